"""The Megatron-Core experts table: Megatron's own SequentialMLP (megatron.core 0.19,
transformer/moe/experts.py: the experts of a MoE layer built from the local spec, a loop over its
local experts) at a busiest-rank shape, forward + backward through the module's forward call as the
MoE layer makes it (permuted hidden states, tokens per expert, permuted probabilities), one row per
way of running it, in one run. Needs megatron-core (Python >= 3.12).

    python -m expertact.bench --megatron                 # CUDA: both shapes below, bf16
    python -m expertact.bench --megatron --shapes 4x3072 --quick
    python -m expertact.bench --megatron --device cpu    # a small CPU table (the 4-expert form only)

The peer is SequentialMLP as Megatron-LM's trainer configures it by default. For SwiGLU that is
its fused path: the trainer sets bias_activation_fusion from --bias-swiglu-fusion, on unless
--no-bias-swiglu-fusion is given (megatron/training/arguments.py and argument_utils.py in
megatron-core 0.19.2), so its experts run Megatron's weighted bias-SwiGLU (torch.compile'd). For
GPT-OSS's form Megatron has no fused path of the same function: its fused quick-GeGLU clamps
fc1's output before adding fc1's bias, GPT-OSS (and Megatron's unfused path) after, so the peer
there is the unfused path (quick_gelu compiled, the rest op by op). TEGroupedMLP (TransformerEngine's
GroupedLinear, which Megatron's MoE recipes select with --moe-grouped-gemm) was not measured here:
it needs TransformerEngine, and no published TransformerEngine figure at a comparable shape
(one expert-parallel rank's experts, forward + backward) was found; the nearest public numbers are
whole-model TFLOPS (Megatron-Core's MoE report, arXiv 2603.07685, on GB200/GB300) and a
TransformerEngine issue measuring GroupedLinear slower than a loop of F.linear on B300
(NVIDIA/TransformerEngine#2939), neither comparable with this table.

Shapes (--shapes):
  4x3072        4 local experts x 262,144 rows (1,048,576 rows), D = F = 3,072, SwiGLU, no biases
  gpt-oss-20b   GPT-OSS-20B's experts: 32 local experts x 8,192 rows (262,144 rows: 65,536 tokens x
                top-4), D = F = 2,880, Megatron's GPT-OSS config (quick_gelu, glu_linear_offset 1,
                activation_func_clamp_value 7, add_bias_linear: expert biases)

Rows (--impls), each on the same module, inputs and weights (enable() / disable() switch it):
  megatron            Megatron's SequentialMLP as its trainer runs it by default: SwiGLU with
                      bias_activation_fusion=True (its fused weighted SwiGLU); GPT-OSS's form unfused
  megatron-unfused    SwiGLU with bias_activation_fusion=False (the activation op by op in PyTorch);
                      skipped at gpt-oss-20b, whose megatron row is already the unfused path
  expertact           expertact.megatron.enable(module): ExpertMLP, bf16
  expertact-recompute enable(module, recompute=True)
  expertact-inplace   enable(module, inplace_backward=True)
  expertact-fp8       enable(module, fp8="rowwise"); expertact-fp8-bf16-wgrad, expertact-fp8-promoted-wgrad,
                      expertact-fp8-blockwise: the other recipes of expertact.moe.FP8_RECIPES, one row
                      each (bench.common.fp8_rows; skipped where the recipe cannot run)
  stack-copy          the per-call weight stack of the expertact rows alone (forward stack, the
                      stack made again in backward, the gradients split back): its share

Columns: fwd / bwd / fwd+bwd medians (CUDA events), extra peak and kept memory (the weight
gradients are part of both), ||a - ref|| / ||ref|| of y, dx, dprobs, dW1, dW2 against Megatron's
own unfused MLP run in float32 one expert at a time from the same bf16 values (TF32 off).

Targets (PASS / FAIL), against the megatron row (the default): at gpt-oss-20b expertact at least
TARGET_BF16_GPT_OSS x faster; at 4x3072 not slower; expertact-inplace's extra peak at most
TARGET_INPLACE_PEAK x megatron's; expertact-fp8 at least TARGET_FP8 x faster than expertact (bf16)
at 4x3072.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch

from .common import (
    add_step_args, clock_and_memory, errors_against, finish, fp8_rows, log, measure, measured_rows, median_ms,
    method, parse_list, resolve_device, step_counts, timing_error_table, versions,
)

FP8_ROWS = fp8_rows("expertact-")  # "expertact-fp8": "rowwise", "expertact-fp8-bf16-wgrad": ...
IMPLS = ("megatron", "megatron-unfused", "expertact", "expertact-recompute", "expertact-inplace", *FP8_ROWS,
         "stack-copy")
OPTIONS = {"expertact": {}, "expertact-recompute": dict(recompute=True),
           "expertact-inplace": dict(inplace_backward=True),
           **{row: dict(fp8=recipe) for row, recipe in FP8_ROWS.items()}}
SHAPES = {
    "4x3072": dict(experts=4, rows=262_144, dim=3072, ffn=3072, form="swiglu"),
    "gpt-oss-20b": dict(experts=32, rows=8_192, dim=2880, ffn=2880, form="gpt-oss"),
}
CPU_SHAPES = {"4x3072": dict(experts=4, rows=64, dim=64, ffn=64, form="swiglu")}
TARGET_BF16_GPT_OSS = 1.3
TARGET_INPLACE_PEAK = 0.8
TARGET_FP8 = 1.4
WHAT = ("y", "dx", "dprobs", "dW1", "dW2")


def _init_megatron(cuda: bool):
    """One rank and Megatron's model-parallel groups of size 1 (what its experts read), unless the
    caller has them."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def fused_by_default(form) -> bool:
    """Megatron-LM's trainer's bias_activation_fusion for the form: on for SwiGLU (--bias-swiglu-fusion);
    off for GPT-OSS's, whose fused quick-GeGLU computes another function (module docstring)."""
    return form == "swiglu"


def config_of(form, E, D, F, dtype, fused=False):
    import torch.nn.functional as Fn
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_layers=1, hidden_size=D, ffn_hidden_size=F, moe_ffn_hidden_size=F, num_attention_heads=8,
              num_moe_experts=E, gated_linear_unit=True, activation_func=Fn.silu, add_bias_linear=False,
              bias_activation_fusion=fused, use_cpu_initialization=True, perform_initialization=False,
              params_dtype=dtype, bf16=dtype == torch.bfloat16)
    if form == "gpt-oss":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        kw.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                  add_bias_linear=True)
    return TransformerConfig(**kw)


class ExpertsInputs:
    """Megatron's SequentialMLP (E local experts: linear_fc1 [2F, D], linear_fc2 [D, F], biases
    with the GPT-OSS form) in the table's dtype, configured as Megatron's trainer does by default
    (fused_by_default; `fused` overrides it), x [T, D] and probs [T] (float32, as the router gives
    them) requiring grad, dy, the tokens per expert. measure() calls fn(x, probs) and
    backward(grad)."""

    def __init__(self, form, E, rows, D, F, dtype, device, seed=0, fused=None):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        self.fused = fused_by_default(form) if fused is None else fused
        self.form, self.config = form, config_of(form, E, D, F, dtype, self.fused)
        self.submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        self.module = SequentialMLP(E, self.config, self.submodules,
                                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        self.module.to(device=device)
        if self.config.add_bias_linear:
            # SequentialMLP with expert biases raises at TP = EP = 1 (its MLP adds fc2's bias in place
            # to the TP reduce's output, returned as is at TP 1); fc2 takes the path it takes under
            # expert parallelism, where that reduce is skipped (a no-op at TP 1 anyway).
            for e in self.module.local_experts:
                e.linear_fc2.explicit_expert_comm = True
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():  # gate/up ~ 6 x N(0, 1), as the other tables' inputs: most past a clamp
            for e in self.module.local_experts:
                e.linear_fc1.weight.normal_(0.0, 6.0 / D ** 0.5, generator=gen)
                e.linear_fc2.weight.normal_(0.0, 1.0 / F ** 0.5, generator=gen)
                for lin in (e.linear_fc1, e.linear_fc2):
                    if lin.bias is not None:
                        lin.bias.normal_(0.0, 0.5, generator=gen)
        T = E * rows
        self.x = torch.empty(T, D, dtype=dtype, device=device).normal_(generator=gen).requires_grad_()
        self.probs = torch.rand(T, device=device, generator=gen).requires_grad_()
        self.grad = torch.empty(T, D, dtype=dtype, device=device).normal_(generator=gen)
        self.counts = torch.full((E, ), rows, dtype=torch.int64)  # the alltoall dispatcher's: on the host
        self.args = [self.x, self.probs]

    def clear(self):
        for t in self.args:
            t.grad = None
        for p in self.module.parameters():
            p.grad = None

    def grads(self):
        ex = self.module.local_experts
        return [self.x.grad, self.probs.grad, torch.stack([e.linear_fc1.weight.grad for e in ex]),
                torch.stack([e.linear_fc2.weight.grad for e in ex])]


def reference32(inp):
    """y and the gradients of x, probs, W1, W2 in float32 from the same bf16 values: Megatron's own
    MLP of each expert (its unfused path), in a float32 copy, one expert at a time (TF32 off)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP
    cfg = inp.config
    mlp = MLP(config_of(inp.form, cfg.num_moe_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size, torch.float32),
              inp.submodules, ffn_hidden_size=cfg.moe_ffn_hidden_size, is_expert=True,
              tp_group=ProcessGroupCollection.use_mpu_process_groups().expt_tp).to(inp.x.device)
    mlp.linear_fc2.explicit_expert_comm = inp.module.local_experts[0].linear_fc2.explicit_expert_comm
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x, p, dy = inp.x.detach(), inp.probs.detach(), inp.grad
        y, dx, dp = torch.zeros(x.shape, device=x.device), torch.zeros(x.shape, device=x.device), torch.zeros_like(p)
        dw1, dw2 = [], []
        start = 0
        for e, n in enumerate(inp.counts.tolist()):
            mlp.load_state_dict(inp.module.local_experts[e].state_dict())
            mlp.zero_grad(set_to_none=True)
            stop = start + n
            xe, pe = x[start:stop].float().requires_grad_(), p[start:stop].clone().requires_grad_()
            ye, _ = mlp(xe, pe)
            ye.backward(dy[start:stop].float())
            y[start:stop], dx[start:stop], dp[start:stop] = ye.detach(), xe.grad, pe.grad
            dw1.append(mlp.linear_fc1.weight.grad)
            dw2.append(mlp.linear_fc2.weight.grad)
            del xe, pe, ye
            start = stop
        return [y, dx, dp, torch.stack(dw1), torch.stack(dw2)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def errors(fn, inp, ref):
    return errors_against(fn, inp, ref, WHAT)


def stack_ms(inp, iters, warmup, device):
    """The expertact rows' per-call weight copies alone: both stacks in forward, made again in
    backward, and the stacked gradients split back to the experts' parameters. Median ms."""
    ex = inp.module.local_experts
    w1, w2 = [e.linear_fc1.weight for e in ex], [e.linear_fc2.weight for e in ex]
    g1 = torch.ones(len(w1), *w1[0].shape, dtype=w1[0].dtype, device=w1[0].device)
    g2 = torch.ones(len(w2), *w2[0].shape, dtype=w2[0].dtype, device=w2[0].device)

    def step():
        a, b = torch.stack(w1), torch.stack(w2)
        with torch.no_grad():
            torch.stack(w1), torch.stack(w2)
        torch.autograd.backward([a, b], [g1, g2])
        inp.clear()
    return dict(ms=median_ms(step, iters, warmup, device), fwd_ms=None, bwd_ms=None, extra_peak_gib=None,
                kept_gib=None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m expertact.bench --megatron", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--shapes", default=None, help=f"default {','.join(SHAPES)} (one table each)")
    p.add_argument("--impls", default=None, help=f"default {','.join(IMPLS)}")
    p.add_argument("--rows", type=int, default=None, help="rows per expert (default: the shape's)")
    add_step_args(p)
    return p.parse_args(argv)


def targets(shape, results):
    by = {r["impl"]: r for r in results if "error" not in r}
    out = []
    m, x = by.get("megatron"), by.get("expertact")
    if m and x:
        s = m["ms"] / x["ms"]
        if shape == "gpt-oss-20b":
            out.append((f"expertact {x['ms']:.1f} ms: {s:.2f}x faster than megatron's {m['ms']:.1f} ms "
                        f"(target >= {TARGET_BF16_GPT_OSS})", s >= TARGET_BF16_GPT_OSS))
        else:
            out.append((f"expertact {x['ms']:.1f} ms: {s:.2f}x megatron's speed ({m['ms']:.1f} ms; target: "
                        "not slower)", s >= 1.0))
    i = by.get("expertact-inplace")
    if m and i and m["extra_peak_gib"] and i["extra_peak_gib"] is not None:
        r = i["extra_peak_gib"] / m["extra_peak_gib"]
        out.append((f"expertact-inplace extra peak {i['extra_peak_gib']:.2f} GiB = {r:.3f}x megatron's "
                    f"{m['extra_peak_gib']:.2f} (target <= {TARGET_INPLACE_PEAK})", r <= TARGET_INPLACE_PEAK))
    f = by.get("expertact-fp8")
    if shape == "4x3072" and f and x:
        s = x["ms"] / f["ms"]
        out.append((f"expertact-fp8 {f['ms']:.1f} ms: {s:.2f}x faster than expertact bf16's {x['ms']:.1f} ms "
                    f"(target >= {TARGET_FP8})", s >= TARGET_FP8))
    return out


def markdown(meta, tables):
    unit = "GiB"
    lines = [f"## expertact as Megatron-Core's experts (SequentialMLP): {meta['device_name']}", "",
             "- the peer: Megatron's SequentialMLP (a loop over its local experts) as Megatron-LM's trainer configures "
             "it by default: SwiGLU with bias_activation_fusion=True (--bias-swiglu-fusion, on by default; "
             "megatron-unfused: off); GPT-OSS's form unfused (Megatron's fused quick-GeGLU clamps before fc1's bias: "
             "another function). TEGroupedMLP (TransformerEngine's grouped GEMMs) was not measured.",
             f"- timing: {meta['timer']}, median of {meta['iters']} after {meta['warmup']} warm-up; memory: "
             f"{meta['memory_source']}",
             f"- torch {meta['torch']}, megatron-core {meta['megatron_core']}, expertact {meta['expertact']}, "
             f"Python {meta['python']}",
             f"- command: `{meta['command']}`"]
    for shape, (info, results, checks) in tables.items():
        lines += timing_error_table(
            f"### {shape}: {info['experts']} experts x {info['rows']:,} rows (T = {info['tokens']:,}), "
            f"D = {info['dim']:,}, F = {info['ffn']:,}, {info['form']}, {meta['dtype']}", results, WHAT, checks, unit)
    lines += ["", "err: ||a - ref|| / ||ref|| against Megatron's MLP in float32, one expert at a time (TF32 off), "
              "from the same bf16 values; extra peak: max allocated during forward+backward minus before (the weight "
              "gradients included); kept: allocated after forward minus before, minus y."]
    return "\n".join(lines) + "\n"


def _row(impl, inp, xmeg, clock, memory, iters, warmup, ref):
    m = inp.module
    if impl == "stack-copy":
        return stack_ms(inp, iters, warmup, inp.x.device)
    if impl == "megatron-unfused" and not inp.fused:
        raise NotImplementedError(f"the {inp.form} form's megatron row is already Megatron's unfused path (its fused "
                                  "quick-GeGLU clamps before fc1's bias: another function)")
    xmeg.disable(m)
    if impl == "megatron-unfused":
        m.config.bias_activation_fusion = False  # the config every local expert's MLP reads at its forward
    elif impl != "megatron":
        xmeg.enable(m, **OPTIONS[impl])
    try:
        def fn(x, probs):
            return m(x, inp.counts, probs)[0]
        r = measure(fn, inp, clock, memory, iters, warmup, refresh=False)
        if ref is not None:
            r["err"] = errors(fn, inp, ref)
        return r
    finally:
        xmeg.disable(m)
        m.config.bias_activation_fusion = inp.fused


def main(argv=None) -> int:
    a = parse_args(argv)
    device = resolve_device(a.device)
    cuda = device.type == "cuda"
    try:
        import megatron.core
        from .. import megatron as xmeg
    except ImportError as e:
        raise SystemExit(f"expertact-bench --megatron needs megatron-core 0.19 (Python >= 3.12): {e}")
    shapes_known = SHAPES if cuda else CPU_SHAPES
    shapes = parse_list(a.shapes or ",".join(shapes_known), tuple(shapes_known), "shapes")
    impls = parse_list(a.impls or ",".join(IMPLS), IMPLS, "impls")
    iters, warmup = step_counts(a, cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    _init_megatron(cuda)
    meta = dict(device_name=torch.cuda.get_device_name(device) if cuda else "CPU", iters=iters, warmup=warmup,
                dtype=str(dtype)[6:], **method(device), **versions(device),
                megatron_core=getattr(megatron.core, "__version__", "?"),
                command="python -m expertact.bench --megatron " + " ".join(sys.argv[1:] if argv is None else argv))
    clock, memory = clock_and_memory(device)
    tables, data = {}, dict(meta=meta, tables={})
    failed = False
    for shape in shapes:
        info = dict(shapes_known[shape])
        if a.rows is not None:
            info["rows"] = a.rows
        E, rows, D, F = info["experts"], info["rows"], info["dim"], info["ffn"]
        info["tokens"] = E * rows
        log(f"Megatron experts bench on {meta['device_name']}: {shape}, {E} x {rows:,} rows, D {D}, F {F}")
        inp = ExpertsInputs(info["form"], E, rows, D, F, dtype, device)
        ref = None
        if not a.no_errors:
            t0 = time.time()
            ref = reference32(inp)
            log(f"{shape}: float32 reference in {time.time() - t0:.1f} s")
        results, bad = measured_rows(shape, impls, lambda impl: _row(impl, inp, xmeg, clock, memory, iters, warmup,
                                                                     ref), inp, cuda)
        failed |= bad
        checks = targets(shape, results) if cuda else []  # the targets are for the GPU shapes
        tables[shape] = (info, results, checks)
        data["tables"][shape] = dict(shape=info, results=results,
                                     targets=[dict(text=t, passed=ok) for t, ok in checks])
        inp = ref = None  # freed before the next table
        if cuda:
            torch.cuda.empty_cache()
    return finish(a, data, markdown(meta, tables), failed)


if __name__ == "__main__":
    sys.exit(main())
