"""The experts of a Hugging Face transformers MoE layer, forward + backward, under each experts
implementation ("eager", transformers' own "grouped_mm", expertact's "expertact" and its memory
modes), at the experts shapes of real models: time and extra peak memory, with the output and
gradients checked against the eager implementation in the same run.

    python -m expertact.bench --experts                       # GPT-OSS-20B and Qwen3-30B-A3B shapes, 32,768 tokens
    python -m expertact.bench --experts --tokens 8192 --models qwen3_30b_a3b --impls grouped_mm,expertact

What one step is: the experts module called as transformers calls it, ``module(hidden_states
[T, D], top_k_index [T, K], top_k_weights [T, K])``, then ``y.backward(dy)``, with gradients for
the hidden states, the routing weights and every expert weight. The routing is random (each
token's K distinct experts uniform at random, softmax weights in the model dtype), fixed for a
run. GPT-OSS's experts carry biases, which expertact does not compute yet: at its shape the
biases are zero and switched off (``has_bias = False``) for every implementation, so the rows
measure the same function, GPT-OSS's MLP without its biases.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .common import clock_and_memory, log, measure, resolve_device, versions, write_outputs

# name -> (transformers config class, its keyword arguments for the experts, K): the experts
# shapes of the released models (hidden size D, expert width F, experts E, experts per token K).
MODELS = {
    "gpt_oss_20b": dict(config="GptOssConfig", experts="gpt_oss.modeling_gpt_oss.GptOssExperts", kw=dict(hidden_size=2880, intermediate_size=2880,
                                                        num_local_experts=32, num_experts_per_tok=4), K=4),
    "qwen3_30b_a3b": dict(config="Qwen3MoeConfig", experts="qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts", kw=dict(hidden_size=2048, moe_intermediate_size=768,
                                                            num_experts=128, num_experts_per_tok=8), K=8),
}
IMPLS = ("eager", "grouped_mm", "expertact", "expertact_inplace")


def _experts_module(model: str, dtype, device):
    """The model's experts module, transformers' own class built from the model's config, weights
    drawn like its init (normal, std 0.02), on the device in dtype."""
    import importlib

    import transformers

    spec = MODELS[model]
    cfg = getattr(transformers, spec["config"])(**spec["kw"])
    module, cls = spec["experts"].rsplit(".", 1)
    with torch.device(device):
        experts = getattr(importlib.import_module("transformers.models." + module), cls)(cfg)
    experts.to(dtype=dtype)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    if getattr(experts, "has_bias", False):
        experts.has_bias = False  # see the module docstring: the same function in every row
    return experts, spec["K"]


def _routing(T, E, K, dtype, device, gen):
    logits = torch.randn(T, E, device=device, generator=gen)
    weights, index = torch.topk(logits, K, dim=-1)
    return index, torch.softmax(weights, dim=-1).to(dtype)


def _grads(experts, hidden, weights):
    """name -> gradient: the hidden states', the routing weights' and each weight's that got one
    (GPT-OSS's eager forward adds its zero biases, so they get gradients there only)."""
    out = {"hidden_states": hidden.grad, "routing_weights": weights.grad}
    out.update((n, p.grad) for n, p in experts.named_parameters() if p.grad is not None)
    return out


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _Inputs:
    """One step's arguments as common.measure takes them: args (hidden states and routing
    weights as leaves wanting their gradient, the expert ids between them), grad (dy) and
    clear() (every gradient dropped, the experts' too)."""

    def __init__(self, experts, T, K, dtype, device):
        gen = torch.Generator(device=device).manual_seed(1)
        index, w = _routing(T, experts.num_experts, K, dtype, device, gen)
        x = torch.randn(T, hidden_dim(experts), device=device, dtype=dtype, generator=gen)
        self.grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
        self.args = [x.requires_grad_(), index, w.requires_grad_()]
        self.experts = experts

    def clear(self):
        self.experts.zero_grad(set_to_none=True)
        self.args[0].grad = self.args[2].grad = None


def measure_impl(experts, impl, T, K, dtype, device, iters, warmup, ref):
    """(row dict, y, grads) of one implementation: common.measure's medians and memory, and
    relative differences of y and the gradients to ref (None for the reference itself)."""
    from .. import transformers as ea_transformers  # registers "expertact"

    if impl == "expertact_inplace":
        ea_transformers.register(impl, inplace_backward=True)
    experts.config._experts_implementation = impl
    inp = _Inputs(experts, T, K, dtype, device)
    clock, memory = clock_and_memory(device)
    row = dict(impl=impl, **measure(experts, inp, clock, memory, iters, warmup, refresh=False))
    y = experts(*inp.args)  # one more step for the checks
    y.backward(inp.grad)
    grads = _grads(experts, inp.args[0], inp.args[2])
    if ref is not None:
        y_ref, g_ref = ref
        row["y_rel"] = _rel(y, y_ref)
        common = [n for n in grads if n in g_ref]
        row["grad_rel_max"] = max((_rel(grads[n], g_ref[n]) for n in common), default=float("nan"))
        row["finite"] = bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values())
    out = y.detach(), {n: g.detach().clone() for n, g in grads.items()}
    inp.clear()
    return (row,) + out


def hidden_dim(experts) -> int:
    for attr in ("hidden_dim", "hidden_size"):
        if hasattr(experts, attr):
            return int(getattr(experts, attr))
    raise AttributeError(f"{type(experts).__name__} has no hidden size attribute")


def expert_width(experts) -> int:
    """F: down_proj is [E, F, D] when transformers' flags say the weights are stored transposed,
    else [E, D, F]."""
    return int(experts.down_proj.shape[-2] if experts.is_transposed else experts.down_proj.shape[-1])


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="expertact-bench --experts", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--impls", default=",".join(IMPLS), help="the first is the reference of the checks")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=10, help="timed steps (at least 1)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    return p.parse_args(argv)


def markdown(meta, rows) -> str:
    out = [f"## Hugging Face transformers experts, forward + backward: {meta['device']}", "",
           f"- {meta['tokens']:,} tokens, {meta['dtype']}; command: `{meta['command']}`",
           f"- {meta['versions']}",
           "- timing: CUDA events around forward and backward, median of "
           f"{meta['iters']} steps after {meta['warmup']} warm-up; extra peak: torch.cuda.max_memory_allocated "
           "during one step minus allocated before",
           "- rel diff: ||a - ref|| / ||ref|| against the first implementation, for y and (largest) every gradient",
           "- GPT-OSS's experts carry biases, which expertact does not compute yet: at that shape they are zero and "
           "switched off for every implementation (the MLP without its biases)", "",
           "| model | D | F | E | K | implementation | fwd ms | bwd ms | fwd+bwd ms | vs grouped_mm | extra peak GiB | y rel diff | grad rel diff |",
           "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gm = next((x["ms"] for x in rows if x["model"] == r["model"] and x["impl"] == "grouped_mm"), None)
        speed = f"{gm / r['ms']:.2f}x" if gm else "n/a"
        yd = f"{r['y_rel']:.1e}" if "y_rel" in r else "ref"
        gd = f"{r['grad_rel_max']:.1e}" if "grad_rel_max" in r else "ref"
        out.append(f"| {r['model']} | {r['D']:,} | {r['F']:,} | {r['E']} | {r['K']} | {r['impl']} | {r['fwd_ms']:.2f} | "
                   f"{r['bwd_ms']:.2f} | {r['ms']:.2f} | {speed} | {r['extra_peak_gib']:.2f} | {yd} | {gd} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    device = resolve_device(a.device)
    if device.type != "cuda":
        raise SystemExit("expertact-bench --experts: needs a CUDA device (transformers' grouped_mm experts are CUDA kernels)")
    try:
        import transformers
    except ImportError:
        raise SystemExit("expertact-bench --experts: needs transformers (pip install transformers)")
    if a.iters < 1:
        raise SystemExit("expertact-bench --experts: --iters must be at least 1")
    dtype = getattr(torch, a.dtype)
    impls = [i for i in a.impls.split(",") if i]
    models = [m for m in a.models.split(",") if m]
    rows = []
    for model in models:
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r} (known: {', '.join(MODELS)})")
        experts, K = _experts_module(model, dtype, device)
        ref = None
        for impl in impls:
            row, y, grads = measure_impl(experts, impl, a.tokens, K, dtype, device, a.iters, a.warmup, ref)
            if ref is None:
                ref = (y, grads)
            row.update(model=model, D=hidden_dim(experts), F=expert_width(experts), E=experts.num_experts, K=K)
            rows.append(row)
            log(f"{model:14s} {impl:18s} fwd {row['fwd_ms']:8.2f}  bwd {row['bwd_ms']:8.2f}  fwd+bwd {row['ms']:8.2f} ms  "
                f"peak {row['extra_peak_gib']:6.2f} GiB  y {row.get('y_rel', 0):.1e}  grads {row.get('grad_rel_max', 0):.1e}")
        del experts, ref
        torch.cuda.empty_cache()
    v = versions(device)
    meta = dict(device=torch.cuda.get_device_name(device), tokens=a.tokens, dtype=a.dtype, iters=a.iters,
                warmup=a.warmup, command="python -m expertact.bench --experts " + " ".join(argv),
                versions=f"torch {v.get('torch')}, transformers {transformers.__version__}, CUDA {v.get('cuda')}, "
                         f"Python {v.get('python')}")
    md = markdown(meta, rows)
    print(md)
    write_outputs(a.json, a.markdown, dict(meta=meta, rows=rows), md)
    return 0
