"""The expert-MLP benchmark: the whole grouped expert MLP, gate_up = x @ w13[e],
h = act(gate_up), y = h @ w2[e], forward + backward, one row per way of computing it, in one run.

Rows (--impls):
  gemms                        torch._grouped_mm twice and no activation: h = gate_up[:, :F], a view
                               (its backward writes dh into a zero-filled [T, 2F] gradient of gate_up)
  eager                        torch._grouped_mm + the eager PyTorch expression of the activation
  compile                      the same with the activation torch.compile'd (the GEMMs stay eager)
  deepspeed                    torch._grouped_mm + DeepSpeed's registry (apply_packed_expert_activation,
                               its own kernels where it has one; DeepSpeed's packed layout is halves)
  expertact-op                 torch._grouped_mm + expertact.glu: the unfused composition under autograd
  expertact                    expertact.moe.expert_mlp
  expertact-inplace            ... inplace_backward=True
  expertact-recompute          ... recompute=True
  expertact-recompute-inplace  ... both
  fused                        expertact.moe.expert_mlp(..., fused=True): the activation in the grouped GEMMs'
                               epilogues (CUTLASS, Hopper; docs/fused-gemm.md); y, dx and the weight
                               gradients stay torch._grouped_mm
  fused-inplace                ... inplace_backward=True
  fused-recompute-inplace      ... recompute=True, inplace_backward=True

Columns: fwd / bwd / fwd+bwd medians (CUDA events after warm-up), extra peak (max allocated
during forward+backward minus before; x, the weights and dy are allocated before), kept (allocated
after forward minus before, minus y), GEMM TFLOP/s (the 6 GEMMs' 18*T*D*F flops / fwd+bwd time),
and y's largest difference from the eager composition's y relative to its largest value.

    python -m expertact.bench --mlp                # CUDA: 4 experts x 261,280 rows, D = F = 3,072, bf16
    python -m expertact.bench --mlp --quick        # 3 timed steps instead of 10
    python -m expertact.bench --mlp --rows 65536 --impls gemms,compile,expertact,expertact-recompute-inplace
    python -m expertact.bench --mlp --device cpu   # a small CPU table (torch._grouped_mm of the CPU build)

The targets it checks (PASS / FAIL below the table): recompute keeps one [T, F] tensor less
after forward; recompute + in place peaks at or below the in-place composition's measured
extra peak (TARGET_PEAK_GIB); expertact at or below the compiled activation; the experimental
fused path (docs/fused-gemm.md) within 1% of the GEMMs alone and at least 5% faster than the
unfused path.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import types

import torch

import expertact
from expertact import _fused, moe

from .common import (
    DTYPES, PRESETS, GiB, OOM, clock_and_memory, eager_form, element_size, fmt_mem, log, measure, mem_unit, method,
    parse_list, resolve_device, split, versions, write_outputs,
)

IMPLS = ("gemms", "eager", "compile", "deepspeed", "expertact-op", "expertact", "expertact-inplace",
         "expertact-recompute", "expertact-recompute-inplace", "fused", "fused-inplace", "fused-recompute-inplace")
# The seed's busiest expert-parallel rank: 4 local experts x 261,280 rows (1,045,120 in all).
CUDA_DEFAULT = dict(experts=4, rows=261_280, dim=3072, ffn=3072, dtype="bfloat16")
CPU_DEFAULT = dict(experts=4, rows=256, dim=128, ffn=128, dtype="float32")
_MODES = {
    "expertact": {}, "expertact-inplace": dict(inplace_backward=True), "expertact-recompute": dict(recompute=True),
    "expertact-recompute-inplace": dict(recompute=True, inplace_backward=True),
    "fused": dict(fused=True), "fused-inplace": dict(fused=True, inplace_backward=True),
    "fused-recompute-inplace": dict(fused=True, recompute=True, inplace_backward=True),
}
# The extra peak of the unfused in-place composition at the seed size, measured on the H200
# (2026-11-30; bench/results/expert-mlp-h200x2-2026-11-30.md): recompute + in place must not peak above
# it. Recompute runs the forward kernel once more (~4.5 ms at the seed size).
TARGET_PEAK_GIB = 30.11


class MlpInputs:
    """x [T, D], the weights as DeepSpeed and TorchTitan hold them (w13 [E, 2F, D], w2 [E, D, F],
    read through .transpose(-2, -1)), optional routing weights [T], all leaves requiring grad;
    dy [T, D]; offsets int32 [E]. Allocated once, before anything is measured."""

    def __init__(self, experts, rows, dim, ffn, dtype, device, weighted, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        T = experts * rows

        def normal(*shape, std):
            return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

        # gate_up ~ 6 x N(0, 1), as the activation benchmark's inputs: most values past a clamp
        self.x = normal(T, dim, std=1.0).requires_grad_()
        self.w13 = normal(experts, 2 * ffn, dim, std=6.0 / dim ** 0.5).requires_grad_()
        self.w2 = normal(experts, dim, ffn, std=1.0 / ffn ** 0.5).requires_grad_()
        self.weights = None
        if weighted:
            self.weights = torch.rand(T, device=device, generator=gen).requires_grad_()
        self.grad = normal(T, dim, std=1.0)
        self.offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
        self.args = [self.x, self.w13, self.w2] + ([self.weights] if weighted else [])

    def clear(self):
        for a in self.args:
            a.grad = None

    def refresh(self):  # nothing is overwritten: in place, expert_mlp writes over its own gate_up
        pass


def make_fn(impl, preset, layout, alpha, limit, offsets, ffn):
    """fn(x, w13, w2[, weights]) -> y for a row of the table."""
    kw = {"swiglu_oai": dict(alpha=alpha, limit=limit), "swiglu_clamped": dict(limit=limit)}.get(preset, {})
    if impl in _MODES:
        def mlp(x, w13, w2, weights=None):
            return moe.expert_mlp(x, w13.transpose(-2, -1), w2.transpose(-2, -1), offsets, preset, layout=layout,
                                  weights=weights, **kw, **_MODES[impl])
        return mlp
    if impl == "gemms":
        def act(gu, weights):
            return gu[:, :ffn]  # a stand-in for the activation: a strided view, nothing computed
    elif impl == "expertact-op":
        fn = getattr(expertact, preset)

        def act(gu, weights):
            return fn(gu, layout=layout, weights=weights, **kw)
    else:
        if impl == "deepspeed":
            from deepspeed.moe.ep_experts import apply_packed_expert_activation

            def form(gu):
                return apply_packed_expert_activation(gu, preset, alpha, limit)
        else:
            f, s = eager_form(preset, alpha, limit), split(layout)

            def form(gu):
                return f(*s(gu))
            if impl == "compile":
                torch._dynamo.reset()  # a fresh cache: never fall back to eager on a recompile limit
                form = torch.compile(form, dynamic=False)

        def act(gu, weights):
            h = form(gu)
            return h if weights is None else h * weights[:, None].to(h.dtype)

    def composition(x, w13, w2, weights=None):
        gu = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(act(gu, weights), w2.transpose(-2, -1), offs=offsets)
    return composition


def _rel_diff(y, ref):
    if ref is None:
        return None
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _diff_fmt(v):
    return "n/a" if v is None else f"{v:.1e}"


def row_line(r, unit):
    if "error" in r:
        return f"{r['impl']:28s} ERROR {r['error']}"
    return (f"{r['impl']:28s} fwd {r['fwd_ms']:8.2f}  bwd {r['bwd_ms']:8.2f}  fwd+bwd {r['ms']:8.2f} ms  "
            f"peak {fmt_mem(r['extra_peak_gib'], unit):>7s}  kept {fmt_mem(r['kept_gib'], unit):>7s} {unit}  "
            f"{r['tflops']:7.3g} TFLOP/s  y diff {_diff_fmt(r['y_rel_diff'])}")


def targets(results, tensor_gib, unit="GiB"):
    """The targets, checked on this run's numbers: (text, passed) pairs; passed None: measured only."""
    by = {r["impl"]: r for r in results if "error" not in r}
    out = []
    p, rc = by.get("expertact"), by.get("expertact-recompute")
    if p and rc and p["kept_gib"] is not None:
        less = p["kept_gib"] - rc["kept_gib"]
        out.append((f"recompute keeps {fmt_mem(less, unit)} {unit} less than plain after forward (one [T, F] tensor: "
                    f"{fmt_mem(tensor_gib, unit)} {unit})", abs(less - tensor_gib) <= 0.01 * tensor_gib))
    both = by.get("expertact-recompute-inplace")
    if both and both["extra_peak_gib"] is not None and tensor_gib > 1:
        out.append((f"recompute + in-place extra peak {both['extra_peak_gib']:.2f} GiB (target <= {TARGET_PEAK_GIB} "
                    "GiB at the seed size)", both["extra_peak_gib"] <= TARGET_PEAK_GIB))
    comp = by.get("compile")
    for name in ("expertact", "expertact-inplace"):
        if comp and name in by:
            out.append((f"{name} {by[name]['ms']:.1f} ms vs the compiled activation's {comp['ms']:.1f} ms",
                        by[name]["ms"] <= comp["ms"]))
    if p and rc:
        out.append((f"recompute costs {rc['ms'] - p['ms']:+.2f} ms over plain (about one forward kernel)", None))
    # The fused path: within 1% of the GEMMs alone, at least 5% faster than the unfused one.
    g = by.get("gemms")
    for name in ("fused", "fused-inplace", "fused-recompute-inplace"):
        f = by.get(name)
        if f and g:
            out.append((f"{name} {f['ms']:.1f} ms vs GEMMs alone {g['ms']:.1f} ms ({f['ms'] / g['ms'] - 1:+.1%}; "
                        "target <= +1%)", f["ms"] <= 1.01 * g["ms"]))
        if f and p:
            out.append((f"{name} {f['ms']:.1f} ms vs expertact {p['ms']:.1f} ms ({f['ms'] / p['ms'] - 1:+.1%}; "
                        "target <= -5%)", f["ms"] <= 0.95 * p["ms"]))
    return out


def markdown(meta, results, checks):
    unit = meta["mem_unit"]
    lines = [
        f"## expertact expert-MLP benchmark: {meta['device_name']}",
        "",
        f"- shape: {meta['experts']} experts x {meta['rows']:,} rows (T = {meta['tokens']:,}), D = {meta['dim']:,}, "
        f"F = {meta['ffn']:,}, {meta['dtype']}; activation {meta['preset']}, layout {meta['layout']}"
        + (", routing weights" if meta["weighted"] else "") + f"; one [T, F] tensor {fmt_mem(meta['tensor_gib'], unit)} {unit}",
        f"- GEMMs: torch._grouped_mm, weights held [E, N, K] (DeepSpeed's and TorchTitan's layout) and read "
        f"through .transpose(-2, -1); {meta['gemm_tflop']:.4g} TFLOP per fwd+bwd (18 T D F)",
        f"- timing: {meta['timer']}, median of {meta['iters']} after {meta['warmup']} warm-up; memory: "
        f"{meta['memory_source']}",
        f"- torch {meta['torch']}" + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "")
        + (f", deepspeed {meta['deepspeed']}" if meta.get("deepspeed") else "")
        + f", expertact {meta['expertact']} (CUDA path built: {meta['expertact_cuda']}), Python {meta['python']}",
        f"- command: `{meta['command']}`",
        "",
        f"| implementation | fwd ms | bwd ms | fwd+bwd ms | extra peak {unit} | kept {unit} | GEMM TFLOP/s | y diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['ms']:.2f} | "
                     f"{fmt_mem(r['extra_peak_gib'], unit)} | {fmt_mem(r['kept_gib'], unit)} | {r['tflops']:.4g} | "
                     f"{_diff_fmt(r['y_rel_diff'])} |")
    lines += ["", "extra peak: max allocated during forward+backward minus before (x, weights, dy allocated "
              "before); kept: allocated after forward minus before, minus y; y diff: max |y - y_eager| / "
              "max |y_eager| against the eager composition (gemms computes another function)."]
    if checks:
        lines += ["", "Targets (memory modes: docs/python.md; the fused rows: docs/fused-gemm.md):", ""]
        for text, ok in checks:
            lines.append(f"- {'PASS' if ok else 'FAIL' if ok is not None else 'measured'}: {text}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m expertact.bench --mlp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--experts", type=int, default=None, help="local experts E (default 4)")
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows per expert (default {CUDA_DEFAULT['rows']:,} on CUDA, {CPU_DEFAULT['rows']} on the CPU)")
    p.add_argument("--dim", type=int, default=None, help="D (default 3072 on CUDA, 128 on the CPU)")
    p.add_argument("--ffn", type=int, default=None, help="F (default 3072 on CUDA, 128 on the CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--preset", default="swiglu_oai", choices=PRESETS)
    p.add_argument("--layout", default="halves", choices=moe.PACKED_LAYOUTS)
    p.add_argument("--alpha", type=float, default=1.702)
    p.add_argument("--limit", type=float, default=7.0)
    p.add_argument("--weights", action="store_true", help="routing weights [T] applied to h")
    p.add_argument("--impls", default=",".join(IMPLS), help="the table's rows, comma-separated")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 10 on CUDA, 5 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2 on CUDA, 1 on the CPU)")
    p.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up")
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    return p.parse_args(argv)


def settings(a, device) -> types.SimpleNamespace:
    """The options resolved against this device's defaults."""
    cuda = device.type == "cuda"
    d = CUDA_DEFAULT if cuda else CPU_DEFAULT
    E = a.experts or d["experts"]
    rows = a.rows if a.rows is not None else d["rows"]
    D, F = a.dim or d["dim"], a.ffn or d["ffn"]
    dtype_name = a.dtype or d["dtype"]
    dtype = DTYPES[dtype_name]
    T = E * rows
    return types.SimpleNamespace(
        E=E, rows=rows, D=D, F=F, T=T, dtype_name=dtype_name, dtype=dtype,
        iters=a.iters if a.iters is not None else (3 if a.quick else 10 if cuda else 5),
        warmup=a.warmup if a.warmup is not None else (1 if a.quick or not cuda else 2),
        impls=parse_list(a.impls, IMPLS, "impls"),
        tensor_gib=T * F * element_size(dtype) / GiB,  # one [T, F] tensor
        flops=18 * T * D * F,  # the 6 GEMMs of forward + backward
    )


def _deepspeed_version():
    try:
        import deepspeed
        return deepspeed.__version__
    except Exception:  # noqa: BLE001 - the deepspeed row reports its own import error
        return None


def run_meta(a, argv, s, device) -> dict:
    """The header of the table and the JSON's meta: shape, versions, command."""
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()}, " \
        f"{torch.get_num_threads()} torch threads)"
    v = versions(device)
    return dict(
        device=str(device), device_name=name, experts=s.E, rows=s.rows, tokens=s.T, dim=s.D, ffn=s.F,
        dtype=s.dtype_name, preset=a.preset, layout=a.layout, alpha=a.alpha, limit=a.limit, weighted=a.weights,
        tensor_gib=s.tensor_gib, mem_unit=mem_unit(s.tensor_gib * GiB), gemm_tflop=s.flops / 1e12, iters=s.iters,
        warmup=s.warmup, **method(device), torch=v["torch"], cuda=v["cuda"], deepspeed=_deepspeed_version(),
        expertact=v["expertact"], expertact_cuda=v["expertact_cuda"], python=v["python"],
        command="python -m expertact.bench --mlp " + " ".join(sys.argv[1:] if argv is None else argv),
    )


def measure_row(impl, a, s, inp, y_ref, fused_why, device, clock, memory):
    """One row of the table: its measurements, or why it was skipped or failed."""
    r = dict(impl=impl)
    try:
        if _MODES.get(impl, {}).get("fused") and fused_why is not None:
            raise ImportError(fused_why)  # it would time the unfused fallback: skipped instead
        fn = make_fn(impl, a.preset, "halves" if impl == "deepspeed" else a.layout, a.alpha, a.limit,
                     inp.offsets, s.F)
        r.update(measure(fn, inp, clock, memory, s.iters, s.warmup, refresh=False))
        r["tflops"] = s.flops / (r["ms"] / 1e3) / 1e12
        with torch.no_grad():
            r["y_rel_diff"] = None if impl == "gemms" else _rel_diff(fn(*inp.args), y_ref)
    except OOM:
        r["error"] = "OOM"
    except ImportError as e:  # an optional peer that is not installed: reported, not a failure
        r["error"] = f"skipped: {e}"
        r["skipped"] = True
    except Exception as e:  # one failing row does not end the table
        r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    inp.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def main(argv=None) -> int:
    """The expert-MLP table; exit status 1 when a row failed (a skipped row is not a failure)."""
    a = parse_args(argv)
    device = resolve_device(a.device)
    s = settings(a, device)
    meta = run_meta(a, argv, s, device)
    log(f"expertact expert-MLP bench on {meta['device_name']}: {s.E} x {s.rows:,} rows, D {s.D}, F {s.F}, "
        f"{s.dtype_name}, {a.preset} {a.layout}; one [T, F] tensor {s.tensor_gib:.2f} GiB; torch {torch.__version__}")
    t_start = time.time()
    inp = MlpInputs(s.E, s.rows, s.D, s.F, s.dtype, device, a.weights)
    # The eager composition's y, for the y diff column (no graph: only y is kept).
    y_ref = None
    if any(i != "gemms" for i in s.impls):
        with torch.no_grad():
            y_ref = make_fn("eager", a.preset, a.layout, a.alpha, a.limit, inp.offsets, s.F)(*inp.args)
    fused_why = _fused.why_not(inp.x, s.D, s.F)
    clock, memory = clock_and_memory(device)
    results = []
    for k, impl in enumerate(s.impls, 1):
        log(f"[{k}/{len(s.impls)}] {impl} ... ({time.time() - t_start:.0f} s so far)")
        r = measure_row(impl, a, s, inp, y_ref, fused_why, device, clock, memory)
        results.append(r)
        print(row_line(r, meta["mem_unit"]), flush=True)
    meta["wall_s"] = time.time() - t_start
    checks = targets(results, s.tensor_gib, meta["mem_unit"])
    md = markdown(meta, results, checks)
    print()
    print(md)
    write_outputs(a.json, a.markdown,
                  dict(meta=meta, results=results, targets=[dict(text=t, passed=ok) for t, ok in checks]), md)
    return 1 if any("error" in r and not r.get("skipped") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
