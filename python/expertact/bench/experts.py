"""The experts of a Hugging Face transformers MoE layer, forward + backward, under each experts
implementation ("eager", transformers' own "grouped_mm", expertact's "expertact" and its memory
modes), at the experts shapes of real models: time and extra peak memory, with the output and
gradients checked against the eager implementation in the same run.

    python -m expertact.bench --experts                       # GPT-OSS-20B and Qwen3-30B-A3B shapes, 32,768 tokens
    python -m expertact.bench --experts --tokens 8192 --models qwen3_30b_a3b --impls grouped_mm,expertact
    python -m expertact.bench --experts --device cpu --tokens 64 --dim 64 --ffn 32 --num-experts 8 --top-k 2

What one step is: the experts module called as transformers calls it, ``module(hidden_states
[T, D], top_k_index [T, K], top_k_weights [T, K])``, then ``y.backward(dy)``, with gradients for
the hidden states, the routing weights and every expert weight. The routing is random (each
token's K distinct experts uniform at random, softmax weights in the model dtype), fixed for a
run. GPT-OSS's experts carry biases (gate_up_proj_bias [E, 2F], down_proj_bias [E, D]): they are
on for every implementation, drawn N(0, BIAS_STD) (the released init zeroes them; non-zero values
make a dropped or misplaced bias show in the differences), and get their gradients like the
weights. An implementation that refuses a model (NotImplementedError, e.g. an expertact without
expert biases on GPT-OSS) gets a "skipped" row with the reason; the others run.

Targets (PASS / FAIL below the table, at the models' own shapes: --dim, --ffn, --num-experts or
--top-k make them measured only): each expertact row at least TARGET_SPEEDUP times faster than
"grouped_mm" (forward + backward) with no more extra peak memory.

On the CPU (time.perf_counter, the profiler's allocator events) it runs the same rows, for tests
at a small shape; transformers' "grouped_mm" then runs torch's CPU grouped GEMM.
"""
from __future__ import annotations

import argparse
import sys

import torch

from .common import OOM, clock_and_memory, device_name, log, measure, method, resolve_device, versions, write_outputs

# name -> (transformers config class, its keyword arguments for the experts, K): the experts
# shapes of the released models (hidden size D, expert width F, experts E, experts per token K).
MODELS = {
    "gpt_oss_20b": dict(config="GptOssConfig", experts="gpt_oss.modeling_gpt_oss.GptOssExperts", kw=dict(hidden_size=2880, intermediate_size=2880,
                                                        num_local_experts=32, num_experts_per_tok=4), K=4),
    "qwen3_30b_a3b": dict(config="Qwen3MoeConfig", experts="qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts", kw=dict(hidden_size=2048, moe_intermediate_size=768,
                                                            num_experts=128, num_experts_per_tok=8), K=8),
}
IMPLS = ("eager", "grouped_mm", "expertact", "expertact_inplace")
# The models' own config keys of D, F, E and K (for --dim, --ffn, --num-experts, --top-k).
_SHAPE_KEYS = {"gpt_oss_20b": ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok"),
               "qwen3_30b_a3b": ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok")}
# The expert biases (GPT-OSS): N(0, BIAS_STD), about half the spread of gate_up and of y at the
# inputs drawn here (weights N(0, 0.02), hidden states N(0, 1)).
BIAS_STD = 0.5
# expertact's fwd+bwd speed-up over transformers' "grouped_mm" each model must reach.
TARGET_SPEEDUP = {"gpt_oss_20b": 1.5, "qwen3_30b_a3b": 1.3}


def model_spec(model: str, dim=None, ffn=None, num_experts=None, top_k=None) -> dict:
    """The model's experts config keywords and K, with any of D, F, E, K replaced (a smaller shape
    for tests); "shape_overridden" says whether one was."""
    spec = dict(MODELS[model])
    kw = dict(spec["kw"])
    keys = _SHAPE_KEYS[model]
    new = (dim, ffn, num_experts, top_k)
    for key, v in zip(keys, new):
        if v is not None:
            kw[key] = v
    spec["kw"] = kw
    spec["K"] = kw[keys[3]]
    spec["shape_overridden"] = any(v is not None for v in new)
    return spec


def _experts_module(spec: dict, dtype, device):
    """The model's experts module, transformers' own class built from the model's config, weights
    drawn like its init (normal, std 0.02), biases (where the class has them) N(0, BIAS_STD), on
    the device in dtype."""
    import importlib

    import transformers

    cfg = getattr(transformers, spec["config"])(**spec["kw"])
    module, cls = spec["experts"].rsplit(".", 1)
    with torch.device(device):
        experts = getattr(importlib.import_module("transformers.models." + module), cls)(cfg)
    experts.to(dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.normal_(0.0, BIAS_STD if name.endswith("bias") else 0.02, generator=gen)
    return experts, spec["K"]


def _routing(T, E, K, dtype, device, gen):
    logits = torch.randn(T, E, device=device, generator=gen)
    weights, index = torch.topk(logits, K, dim=-1)
    return index, torch.softmax(weights, dim=-1).to(dtype)


def _grads(experts, hidden, weights):
    """name -> gradient: the hidden states', the routing weights' and each parameter's that got one."""
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
    relative differences of y and the gradients to ref (None for the reference itself). A
    gradient ref has and this implementation lacks makes grad_rel_max inf (named in
    missing_grads)."""
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
        missing = [n for n in g_ref if n not in grads]
        rels = [_rel(grads[n], g_ref[n]) for n in g_ref if n in grads]
        row["grad_rel_max"] = float("inf") if missing else max(rels, default=float("nan"))
        if missing:
            row["missing_grads"] = missing
        row["finite"] = bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(g).all()) for g in grads.values())
    out = y.detach(), {n: g.detach().clone() for n, g in grads.items()}
    inp.clear()
    return (row,) + out


def run_impl(experts, impl, T, K, dtype, device, iters, warmup, ref):
    """measure_impl, or a row saying why not: an implementation that refuses the model
    (NotImplementedError) is skipped; OOM and any other error are reported in the row."""
    try:
        return measure_impl(experts, impl, T, K, dtype, device, iters, warmup, ref)
    except NotImplementedError as e:
        row = dict(impl=impl, error=f"skipped: {str(e)[:300]}", skipped=True)
    except OOM:
        row = dict(impl=impl, error="OOM")
    except Exception as e:  # noqa: BLE001 - one failing row does not end the table
        row = dict(impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
    experts.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, None, None


def targets(rows, overridden=()) -> list:
    """(text, passed) pairs: each expertact row of a model with a TARGET_SPEEDUP at least that much
    faster than grouped_mm, with no more extra peak; passed None (measured only) for a model whose
    shape was overridden."""
    out = []
    for model, need in TARGET_SPEEDUP.items():
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        judged = model not in overridden
        gm = next((r for r in mine if r["impl"] == "grouped_mm"), None)
        for r in mine:
            if not r["impl"].startswith("expertact"):
                continue
            if gm is None or "error" in gm or "error" in r:
                why = r.get("error") if "error" in r else "grouped_mm " + (gm or {}).get("error", "not run")
                out.append((f"{model} {r['impl']}: not measured ({why})", False if judged else None))
                continue
            speed = gm["ms"] / r["ms"]
            peak, gm_peak = r["extra_peak_gib"], gm["extra_peak_gib"]
            ok = speed >= need and (peak is None or gm_peak is None or peak <= gm_peak)
            out.append((f"{model} {r['impl']} {r['ms']:.2f} ms vs grouped_mm {gm['ms']:.2f} ms: {speed:.2f}x "
                        f"(target >= {need}x); extra peak {_gib(peak)} vs {_gib(gm_peak)} GiB (target: no more)",
                        ok if judged else None))
    return out


def _gib(v):
    return "n/a" if v is None else f"{v:.2f}"


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
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--impls", default=",".join(IMPLS), help="the first is the reference of the checks")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--iters", type=int, default=10, help="timed steps (at least 1)")
    p.add_argument("--warmup", type=int, default=3)
    g = p.add_argument_group("another shape than the model's (tests, quick checks; the targets are then measured only)")
    g.add_argument("--dim", type=int, default=None, help="hidden size D")
    g.add_argument("--ffn", type=int, default=None, help="expert width F")
    g.add_argument("--num-experts", type=int, default=None, help="experts E")
    g.add_argument("--top-k", type=int, default=None, help="experts per token K (at most E)")
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    return p.parse_args(argv)


def markdown(meta, rows, checks=()) -> str:
    out = [f"## Hugging Face transformers experts, forward + backward: {meta['device']}", "",
           f"- {meta['tokens']:,} tokens, {meta['dtype']}; command: `{meta['command']}`",
           f"- {meta['versions']}",
           f"- timing: {meta.get('timer', 'CUDA events')} around forward and backward, median of "
           f"{meta['iters']} steps after {meta['warmup']} warm-up; extra peak: "
           f"{meta.get('memory_source', 'torch.cuda.max_memory_allocated')} during one step minus allocated before",
           "- rel diff: ||a - ref|| / ||ref|| against the first implementation, for y and (largest) every gradient",
           "- GPT-OSS's experts with their biases (gate_up_proj_bias, down_proj_bias; N(0, "
           f"{meta.get('bias_std', BIAS_STD)})) for every implementation, their gradients among those compared", "",
           "| model | D | F | E | K | implementation | fwd ms | bwd ms | fwd+bwd ms | vs grouped_mm | extra peak GiB | y rel diff | grad rel diff |",
           "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['model']} | {r['D']:,} | {r['F']:,} | {r['E']} | {r['K']} | {r['impl']} |"
        if "error" in r:
            out.append(head + f" {r['error']} | | | | | | |")
            continue
        gm = next((x["ms"] for x in rows if x["model"] == r["model"] and x["impl"] == "grouped_mm"
                   and "error" not in x), None)
        speed = f"{gm / r['ms']:.2f}x" if gm else "n/a"
        yd = f"{r['y_rel']:.1e}" if "y_rel" in r else "ref"
        gd = f"{r['grad_rel_max']:.1e}" if "grad_rel_max" in r else "ref"
        if r.get("missing_grads"):
            gd += " (none for " + ", ".join(r["missing_grads"]) + ")"
        peak = "n/a" if r["extra_peak_gib"] is None else f"{r['extra_peak_gib']:.2f}"
        out.append(head + f" {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['ms']:.2f} | {speed} | {peak} | {yd} | {gd} |")
    if checks:
        out += ["", "Targets (expertact against transformers' grouped_mm, forward + backward):", ""]
        for text, ok in checks:
            out.append(f"- {'PASS' if ok else 'FAIL' if ok is not None else 'measured'}: {text}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    """The experts table; exit status 1 when a row failed (a skipped row, an implementation that
    refuses the model, is not a failure)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    device = resolve_device(a.device)
    try:
        import transformers
    except ImportError:
        raise SystemExit("expertact-bench --experts: needs transformers (pip install transformers)")
    if a.iters < 1:
        raise SystemExit("expertact-bench --experts: --iters must be at least 1")
    dtype_name = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    impls = [i for i in a.impls.split(",") if i]
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r} (known: {', '.join(MODELS)})")
    rows, overridden = [], []
    for model in models:
        spec = model_spec(model, a.dim, a.ffn, a.num_experts, a.top_k)
        if spec["shape_overridden"]:
            overridden.append(model)
        experts, K = _experts_module(spec, dtype, device)
        ref = None
        for impl in impls:
            row, y, grads = run_impl(experts, impl, a.tokens, K, dtype, device, a.iters, a.warmup, ref)
            if ref is None and y is not None:
                ref = (y, grads)
            row.update(model=model, D=hidden_dim(experts), F=expert_width(experts), E=experts.num_experts, K=K)
            rows.append(row)
            if "error" in row:
                log(f"{model:14s} {impl:18s} {row['error']}")
                continue
            peak = row["extra_peak_gib"]
            log(f"{model:14s} {impl:18s} fwd {row['fwd_ms']:8.2f}  bwd {row['bwd_ms']:8.2f}  fwd+bwd {row['ms']:8.2f} ms  "
                f"peak {'n/a' if peak is None else f'{peak:6.2f}'} GiB  y {row.get('y_rel', 0):.1e}  "
                f"grads {row.get('grad_rel_max', 0):.1e}")
        del experts, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    v = versions(device)
    meta = dict(device=device_name(device), tokens=a.tokens, dtype=dtype_name, iters=a.iters,
                warmup=a.warmup, bias_std=BIAS_STD, command="python -m expertact.bench --experts " + " ".join(argv),
                versions=f"torch {v.get('torch')}, transformers {transformers.__version__}"
                         + (f", CUDA {v['cuda']}" if v.get("cuda") else "") + f", Python {v.get('python')}",
                **method(device))
    checks = targets(rows, overridden)
    md = markdown(meta, rows, checks)
    print(md)
    write_outputs(a.json, a.markdown,
                  dict(meta=meta, rows=rows, targets=[dict(text=t, passed=ok) for t, ok in checks]), md)
    return 1 if any("error" in r and not r.get("skipped") for r in rows) else 0
