"""The DeepSpeed AutoEP expert table: DeepSpeed's own GroupedExperts module
(deepspeed.moe.ep_experts, the experts of an AutoEP layer) at the busiest rank's shape, forward +
backward through its own forward call, one row per way of running it, in one run.

    python -m expertact.bench --autoep                # CUDA: 4 experts x 261,280 rows, D = F = 3,072, bf16
    python -m expertact.bench --autoep --activations swiglu,swiglu_oai --quick
    python -m expertact.bench --autoep --device cpu   # a small CPU table (DeepSpeed's CPU paths; no FP8)

The peer is GroupedExperts as AutoEP builds it by default: use_grouped_mm=True (torch._grouped_mm;
disable_triton_grouped_mm=True, which changes nothing on sm_90, where DeepSpeed prefers
torch._grouped_mm anyway) and gate_up_impl "separate", AutoEP 0.19.8's default
(deepspeed/module_inject/auto_ep_config.py: gate_up_impl = param_dict.get("gate_up_impl",
"separate")): two grouped GEMMs for gate and up, then its registry's fused_fn (swiglu: its Triton
kernel; the other forms have none and run the eager PyTorch expression).

Rows (--impls), each on the same module, inputs and weights:
  deepspeed                DeepSpeed's default: gate_up_impl "separate"
  deepspeed-fused          gate_up_impl "fused" (one grouped GEMM over w1 and w3 concatenated, then the
                           registry's packed_fused_fn), the other configuration a DeepSpeed user can pick
  deepspeed-compile        torch.compile(module) on DeepSpeed's default, as a user compiles it; compiled
                           before the timed steps (needs bf16: skipped in the float32 CPU table)
  ds+act                   expertact.deepspeed.enable() on DeepSpeed's default: its two GEMMs, expertact's
                           activation (its fused_fn)
  ds+act-inplace           enable(inplace_backward=True): the gradients of gate and up written over them
  mlp                      enable(experts=True): GroupedExperts.forward runs expertact.moe.expert_mlp (one
                           gate_up GEMM over w1 and w3 concatenated, whatever gate_up_impl says)
  mlp-recompute            enable(experts=True, recompute=True)
  mlp-inplace              enable(experts=True, inplace_backward=True)
  mlp-recompute-inplace    both
  mlp-fp8                  enable(experts=True, fp8="rowwise")
  mlp-fp8-bf16-wgrad       enable(experts=True, fp8="rowwise-bf16-wgrad"): the two weight-gradient GEMMs
                           in bf16
  mlp-fp8-promoted-wgrad   enable(experts=True, fp8="rowwise-promoted-wgrad"): the two weight-gradient
                           GEMMs with FP32-promoted accumulation
  mlp-fp8-blockwise        enable(experts=True, fp8="blockwise"): DeepSeek-V3's recipe (1 x 128 / 128 x 128
                           scales, FP32-promoted accumulation)
  (the mlp-fp8 rows: one per recipe of expertact.moe.FP8_RECIPES, bench.common.fp8_rows; skipped
  where the recipe cannot run, as in the float32 CPU table)
  w13-copy                 torch.cat of w1 and w3 and its backward alone (fwd+bwd only): the per-call weight
                           copy that the mlp rows (and deepspeed-fused) make, for its share

Columns: fwd / bwd / fwd+bwd medians (CUDA events), extra peak and kept memory (as --mlp measures
them; the weight gradients are part of both), ||a - ref|| / ||ref|| of y, dx, dw1, dw2, dw3 against
a float32 copy of the module, one expert at a time with DeepSpeed's eager form (TF32 off, the same bf16 values).

Targets (PASS / FAIL below each table), every one against a row on DeepSpeed's default
configuration: mlp-inplace at or below TARGET_INPLACE_PEAK x the extra peak of ds+act-inplace and
at most TARGET_INPLACE_TIME x its time; mlp-fp8 at most TARGET_FP8_TIME x the time of ds+act, extra
peak at or below it; w13-copy under 1% of the mlp row's time.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


from .common import (
    add_mlp_args, clock_and_memory, fp8_rows, log, measure, median_ms, method, mlp_settings, parse_list,
    errors_against, finish, measured_rows, resolve_device, timing_error_table, versions,
)

FP8_ROWS = fp8_rows("mlp-")  # "mlp-fp8": "rowwise", "mlp-fp8-bf16-wgrad": "rowwise-bf16-wgrad", ...
IMPLS = ("deepspeed", "deepspeed-fused", "deepspeed-compile", "ds+act", "ds+act-inplace", "mlp", "mlp-recompute",
         "mlp-inplace", "mlp-recompute-inplace", *FP8_ROWS, "w13-copy")
#: AutoEP 0.19.8's default gate_up_impl (deepspeed/module_inject/auto_ep_config.py): the
#: configuration every row runs on unless ROWS names another.
DEFAULT_GATE_UP = "separate"
# impl -> (gate_up_impl, the arguments of expertact.deepspeed.enable(), None: DeepSpeed's own forward)
ROWS = {
    "deepspeed": (DEFAULT_GATE_UP, None), "deepspeed-fused": ("fused", None),
    "deepspeed-compile": (DEFAULT_GATE_UP, None),
    "ds+act": (DEFAULT_GATE_UP, {}), "ds+act-inplace": (DEFAULT_GATE_UP, dict(inplace_backward=True)),
    "mlp": (DEFAULT_GATE_UP, dict(experts=True)), "mlp-recompute": (DEFAULT_GATE_UP, dict(experts=True, recompute=True)),
    "mlp-inplace": (DEFAULT_GATE_UP, dict(experts=True, inplace_backward=True)),
    "mlp-recompute-inplace": (DEFAULT_GATE_UP, dict(experts=True, recompute=True, inplace_backward=True)),
    **{row: (DEFAULT_GATE_UP, dict(experts=True, fp8=recipe)) for row, recipe in FP8_ROWS.items()},
}
# The seed's busiest expert-parallel rank: 4 local experts x 261,280 rows, D = F = 3,072.
CUDA_DEFAULT = dict(experts=4, rows=261_280, dim=3072, ffn=3072)
CPU_DEFAULT = dict(experts=4, rows=64, dim=64, ffn=64)
ACTIVATIONS = ("swiglu", "swiglu_oai")
TARGET_INPLACE_PEAK = 0.85
TARGET_INPLACE_TIME = 1.01
TARGET_FP8_TIME = 0.72
COPY_SHARE = 0.01
WHAT = ("y", "dx", "dw1", "dw2", "dw3")


class ExpertsInputs:
    """DeepSpeed's GroupedExperts (w1, w3 [E, F, D], w2 [E, D, F] in the table's dtype), x [T, D]
    requiring grad, dy, the rows per expert. measure() calls fn(*args) and backward(grad)."""

    def __init__(self, cls, E, rows, D, F, dtype, device, seed=0):
        self.module = cls(D, F, E, use_grouped_mm=True, disable_triton_grouped_mm=True)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.module.to(device=device, dtype=dtype)
        with torch.no_grad():  # gate/up ~ 6 x N(0, 1), as the activation tables' inputs: most past a clamp
            for w, std in ((self.module.w1, 6.0 / D ** 0.5), (self.module.w3, 6.0 / D ** 0.5),
                           (self.module.w2, 1.0 / F ** 0.5)):
                w.normal_(0.0, std, generator=gen)
        T = E * rows
        self.x = torch.empty(T, D, dtype=dtype, device=device).normal_(generator=gen).requires_grad_()
        self.grad = torch.empty(T, D, dtype=dtype, device=device).normal_(generator=gen)
        self.counts = torch.full((E, ), rows, dtype=torch.int64, device=device)
        self.args = [self.x]

    def clear(self):
        self.x.grad = None
        for p in self.module.parameters():
            p.grad = None

    def grads(self):
        m = self.module
        return [self.x.grad, m.w1.grad, m.w2.grad, m.w3.grad]


def reference32(inp):
    """y and the gradients of x, w1, w2, w3 in float32 from the same bf16 values, one expert at a
    time (the memory of one expert's float32 intermediates), with DeepSpeed's own eager form of the
    activation (its registry's fn), TF32 off."""
    from deepspeed.moe.ep_experts import get_expert_activation

    m = inp.module
    fn = get_expert_activation(m.activation).fn
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x, dy = inp.x.detach(), inp.grad
        y, dx = torch.zeros(x.shape, device=x.device), torch.zeros(x.shape, device=x.device)
        dws = [torch.zeros(getattr(m, n).shape, device=x.device) for n in ("w1", "w2", "w3")]
        start = 0
        for e, n in enumerate(inp.counts.tolist()):
            stop = start + n
            if n:
                xe = x[start:stop].float().requires_grad_()
                w1, w2, w3 = (getattr(m, k).detach()[e].float().requires_grad_() for k in ("w1", "w2", "w3"))
                ye = fn(xe @ w1.t(), xe @ w3.t(), m.activation_alpha, m.activation_limit) @ w2.t()
                ye.backward(dy[start:stop].float())
                y[start:stop], dx[start:stop] = ye.detach(), xe.grad
                for d, w in zip(dws, (w1, w2, w3)):
                    d[e] = w.grad
                del xe, w1, w2, w3, ye
            start = stop
        return [y, dx] + dws
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def errors(fn, inp, ref):
    return errors_against(fn, inp, ref, WHAT)


def copy_ms(inp, iters, warmup, device):
    """The per-call weight copy of the mlp rows alone: w1 and w3 concatenated into w13, and its
    backward (autograd splits w13's gradient into w1.grad and w3.grad). Median ms of both."""
    m = inp.module
    g = torch.ones(m.w1.shape[0], 2 * m.w1.shape[1], m.w1.shape[2], dtype=m.w1.dtype, device=m.w1.device)

    def step():
        torch.cat((m.w1, m.w3), dim=1).backward(g)
        m.w1.grad = m.w3.grad = None
    return dict(ms=median_ms(step, iters, warmup, device), fwd_ms=None, bwd_ms=None, extra_peak_gib=None,
                kept_gib=None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m expertact.bench --autoep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mlp_args(p, CPU_DEFAULT["rows"])
    p.add_argument("--activations", default=None, help=f"default {','.join(ACTIVATIONS)} (one table each)")
    p.add_argument("--impls", default=None, help=f"default {','.join(IMPLS)}")
    return p.parse_args(argv)


def targets(results):
    """(text, passed) of each target whose rows were measured; the rows compared are on DeepSpeed's
    default gate_up_impl, as the texts say."""
    by = {r["impl"]: r for r in results if "error" not in r}
    cfg = f"gate_up_impl {DEFAULT_GATE_UP}, DeepSpeed's default"
    out = []
    m, a = by.get("mlp-inplace"), by.get("ds+act-inplace")
    if m and a and m["extra_peak_gib"] is not None and a["extra_peak_gib"]:
        peak = m["extra_peak_gib"] / a["extra_peak_gib"]
        out.append((f"mlp-inplace extra peak {m['extra_peak_gib']:.2f} GiB = {peak:.3f}x ds+act-inplace's "
                    f"{a['extra_peak_gib']:.2f} ({cfg}; target <= {TARGET_INPLACE_PEAK})", peak <= TARGET_INPLACE_PEAK))
    if m and a:
        t = m["ms"] / a["ms"]
        out.append((f"mlp-inplace {m['ms']:.1f} ms = {t:.3f}x ds+act-inplace's {a['ms']:.1f} ms "
                    f"({cfg}; target <= {TARGET_INPLACE_TIME})", t <= TARGET_INPLACE_TIME))
    f, b = by.get("mlp-fp8"), by.get("ds+act")
    if f and b:
        t = f["ms"] / b["ms"]
        out.append((f"mlp-fp8 {f['ms']:.1f} ms = {t:.3f}x ds+act's {b['ms']:.1f} ms ({cfg}; target <= "
                    f"{TARGET_FP8_TIME})", t <= TARGET_FP8_TIME))
        if f["extra_peak_gib"] is not None and b["extra_peak_gib"] is not None:
            out.append((f"mlp-fp8 extra peak {f['extra_peak_gib']:.2f} GiB vs ds+act's {b['extra_peak_gib']:.2f} GiB "
                        f"({cfg}; target: at or below)", f["extra_peak_gib"] <= b["extra_peak_gib"]))
    c, p = by.get("w13-copy"), by.get("mlp")
    if c and p:
        out.append((f"the w13 copy (cat + its backward) {c['ms']:.3f} ms = {c['ms'] / p['ms']:.2%} of mlp's "
                    f"{p['ms']:.1f} ms (target < {COPY_SHARE:.0%})", c["ms"] < COPY_SHARE * p["ms"]))
    return out


def markdown(meta, tables):
    unit = "GiB"
    lines = [f"## expertact in DeepSpeed AutoEP's GroupedExperts: {meta['device_name']}", "",
             f"- shape: {meta['experts']} experts x {meta['rows']:,} rows (T = {meta['tokens']:,}), D = {meta['dim']:,}, "
             f"F = {meta['ffn']:,}, {meta['dtype']}; DeepSpeed's GroupedExperts (w1, w3 [E, F, D], w2 [E, D, F]) "
             "called as AutoEP calls it: module(x, num_tokens_per_expert)",
             f"- the peer: GroupedExperts as AutoEP builds it by default, use_grouped_mm=True (torch._grouped_mm) and "
             f"gate_up_impl \"{DEFAULT_GATE_UP}\" (AutoEP's default: two grouped GEMMs, then the registry's fused_fn); "
             "every row runs on that configuration except deepspeed-fused (gate_up_impl \"fused\": one GEMM over w1 "
             "and w3 concatenated, the registry's packed_fused_fn); deepspeed-compile is torch.compile(module) of the "
             "default; the mlp rows compute one gate_up GEMM whatever gate_up_impl says",
             f"- timing: {meta['timer']}, median of {meta['iters']} after {meta['warmup']} warm-up; memory: "
             f"{meta['memory_source']}",
             f"- torch {meta['torch']}, DeepSpeed {meta['deepspeed']}, expertact {meta['expertact']}, "
             f"Python {meta['python']}",
             f"- command: `{meta['command']}`"]
    for act, (results, checks) in tables.items():
        lines += timing_error_table(f"### {act}", results, WHAT, checks, unit)
    lines += ["", "err: ||a - ref|| / ||ref|| against float32, one expert at a time with DeepSpeed's eager form of "
              "the activation (TF32 off), from the same bf16 values; extra peak: max allocated during forward+backward minus before "
              "(the weight gradients included); kept: allocated after forward minus before, minus y."]
    return "\n".join(lines) + "\n"


def compiled(module, inp):
    """torch.compile(module) as a DeepSpeed user compiles it, compiled by one forward + backward
    here (so that no timed step includes compilation): the function the deepspeed-compile row
    times. torch 2.13 traces torch._grouped_mm with bf16 operands only (its meta function refuses
    float32), hence NotImplementedError (a skipped row) for another dtype."""
    if inp.x.dtype != torch.bfloat16:
        raise NotImplementedError(f"torch.compile traces torch._grouped_mm with bf16 operands only, this table is "
                                  f"{str(inp.x.dtype)[6:]}")
    cm = torch.compile(module)

    def fn(x):
        return cm(x, inp.counts)
    inp.clear()
    fn(*inp.args).backward(inp.grad)
    inp.clear()
    return fn


def _row(impl, inp, gate_up_impl, enabled, xds, clock, memory, iters, warmup, ref):
    m = inp.module
    if impl == "w13-copy":
        return copy_ms(inp, iters, warmup, inp.x.device)
    m.gate_up_impl = gate_up_impl
    xds.disable()
    if enabled is not None:
        xds.enable(**enabled)
    try:
        if impl == "deepspeed-compile":
            fn = compiled(m, inp)
        else:
            def fn(x):
                return m(x, inp.counts)
        r = measure(fn, inp, clock, memory, iters, warmup, refresh=False)
        if ref is not None:
            r["err"] = errors(fn, inp, ref)
        return r
    finally:
        xds.disable()
        if impl == "deepspeed-compile":
            torch._dynamo.reset()  # the compiled graphs and what they hold go before the next row


def main(argv=None) -> int:
    a = parse_args(argv)
    device = resolve_device(a.device)
    cuda = device.type == "cuda"
    try:
        import deepspeed
        from deepspeed.moe.ep_experts import GroupedExperts
        from .. import deepspeed as xds
    except ImportError as e:
        raise SystemExit(f"expertact-bench --autoep needs DeepSpeed >= 0.19.8 (AutoEP's GroupedExperts): {e}")
    E, rows, D, F, iters, warmup = mlp_settings(a, cuda, CUDA_DEFAULT if cuda else CPU_DEFAULT)
    impls = parse_list(a.impls or ",".join(IMPLS), IMPLS, "impls")
    acts = parse_list(a.activations or ",".join(ACTIVATIONS), xds.EXPERT_ACTIVATIONS, "activations")
    dtype = torch.bfloat16 if cuda else torch.float32
    meta = dict(device_name=torch.cuda.get_device_name(device) if cuda else "CPU", experts=E, rows=rows,
                tokens=E * rows, dim=D, ffn=F, iters=iters, warmup=warmup, dtype=str(dtype)[6:], **method(device),
                **versions(device), deepspeed=deepspeed.__version__,
                command="python -m expertact.bench --autoep " + " ".join(sys.argv[1:] if argv is None else argv))
    log(f"AutoEP experts bench on {meta['device_name']}: {E} x {rows:,} rows, D {D}, F {F}, {acts}")
    clock, memory = clock_and_memory(device)
    tables, data = {}, dict(meta=meta, tables={})
    failed = False
    for act in acts:
        inp = ExpertsInputs(GroupedExperts, E, rows, D, F, dtype, device)
        inp.module.activation = act
        ref = None
        if not a.no_errors:
            t0 = time.time()
            ref = reference32(inp)
            log(f"{act}: float32 reference in {time.time() - t0:.1f} s")
        def row_of(impl):
            gate_up_impl, enabled = ROWS.get(impl, (DEFAULT_GATE_UP, None))
            return _row(impl, inp, gate_up_impl, enabled, xds, clock, memory, iters, warmup, ref)
        results, bad = measured_rows(act, impls, row_of, inp, cuda)
        failed |= bad
        checks = targets(results)
        tables[act] = (results, checks)
        data["tables"][act] = dict(results=results, targets=[dict(text=t, passed=ok) for t, ok in checks])
        inp = ref = None  # freed before the next table
        if cuda:
            torch.cuda.empty_cache()
    return finish(a, data, markdown(meta, tables), failed)


if __name__ == "__main__":
    sys.exit(main())
