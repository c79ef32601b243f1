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

With expert biases (GPT-OSS's gate_up_proj_bias and down_proj_bias: gate_up = x @ w13[e] + b13[e],
y = (h @ w2[e] + b2[e]) * weights), each row above has a "-bias" twin, e.g.:
  eager-bias                   torch._grouped_mm + b13 rows gathered by expert (b13[expert of row]) added +
                               the eager activation + torch._grouped_mm + b2 added, times the routing weights:
                               plain autograd, as transformers' "grouped_mm" computes it
  expertact-op-bias            the same with expertact's activation (expertact.glu)
  expertact-bias               expertact.moe.expert_mlp(..., b13=b13, b2=b2); -inplace-bias, -recompute-bias, ...

--bias is the table of the bias rows: activation swiglu_oai, layout interleaved (GPT-OSS's), routing
weights given, and the rows BIAS_IMPLS: expert_mlp with and without the biases in each memory mode and
the two compositions. Below it, a correctness check at a small shape (CHECK_COUNTS rows per expert,
D = F = 64, the table's dtype): y and every gradient (x, w13, w2, the routing weights, b13, b2) of
each biased row against a float64 per-expert reference, as ||a - ref|| / ||ref||.

Columns: fwd / bwd / fwd+bwd medians (CUDA events after warm-up), extra peak (max allocated
during forward+backward minus before; x, the weights and dy are allocated before), kept (allocated
after forward minus before, minus y), GEMM TFLOP/s (the 6 GEMMs' 18*T*D*F flops / fwd+bwd time),
and y's largest difference from the eager composition's y relative to its largest value.

    python -m expertact.bench --mlp                # CUDA: 4 experts x 261,280 rows, D = F = 3,072, bf16
    python -m expertact.bench --mlp --quick        # 3 timed steps instead of 10
    python -m expertact.bench --mlp --rows 65536 --impls gemms,compile,expertact,expertact-recompute-inplace
    python -m expertact.bench --mlp --device cpu   # a small CPU table (torch._grouped_mm of the CPU build)
    python -m expertact.bench --mlp --bias         # the expert biases: expert_mlp with and without, the compositions

The targets it checks (PASS / FAIL below the table): recompute keeps one [T, F] tensor less
after forward; recompute + in place peaks at or below the in-place composition's measured
extra peak (TARGET_PEAK_GIB); expertact at or below the compiled activation. With bias rows: expert_mlp with biases within 3% of the same mode without
(BIAS_COST); faster than the eager torch composition with biases and with less extra peak;
the small-shape check's errors within twice the eager composition's (or CHECK_FLOOR).
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import types

import torch

import expertact
from expertact import moe

from .common import (
    DTYPES, PRESETS, GiB, OOM, clock_and_memory, eager_form, element_size, fmt_mem, log, measure, mem_unit, method,
    parse_list, preset_kwargs, resolve_device, split, versions, write_outputs,
)

IMPLS = ("gemms", "eager", "compile", "deepspeed", "expertact-op", "expertact", "expertact-inplace",
         "expertact-recompute", "expertact-recompute-inplace")
# The seed's busiest expert-parallel rank: 4 local experts x 261,280 rows (1,045,120 in all).
CUDA_DEFAULT = dict(experts=4, rows=261_280, dim=3072, ffn=3072, dtype="bfloat16")
CPU_DEFAULT = dict(experts=4, rows=256, dim=128, ffn=128, dtype="float32")
_MODES = {
    "expertact": {}, "expertact-inplace": dict(inplace_backward=True), "expertact-recompute": dict(recompute=True),
    "expertact-recompute-inplace": dict(recompute=True, inplace_backward=True),
}
# The extra peak of the unfused in-place composition at the seed size, measured on the H200
# (2026-11-30; bench/results/expert-mlp-h200x2-2026-11-30.md): recompute + in place must not peak above
# it. Recompute runs the forward kernel once more (~4.5 ms at the seed size).
TARGET_PEAK_GIB = 30.11
# The expert biases: every row has a "-bias" twin (the same computation with b13 and b2).
BIAS = "-bias"
ALL_IMPLS = IMPLS + tuple(i + BIAS for i in IMPLS)
# --bias: expert_mlp with and without the biases in each memory mode, and the two compositions.
BIAS_IMPLS = ("expertact", "expertact" + BIAS, "expertact-inplace", "expertact-inplace" + BIAS,
              "expertact-recompute", "expertact-recompute" + BIAS, "expertact-recompute-inplace",
              "expertact-recompute-inplace" + BIAS, "eager" + BIAS, "expertact-op" + BIAS)
# Targets of the bias rows: expert_mlp with biases at most 3% slower than without, in each mode.
BIAS_COST = 1.03
# The correctness check of the bias rows: rows per expert (uneven, none a multiple of 8), D = F.
CHECK_COUNTS = (5, 37, 16, 70)
CHECK_DIM = 64
# Its pass line: each error at most twice the eager composition's in the same dtype, or this floor
# (a few units of the dtype's rounding: the rows differ in summation order and in what they round).
CHECK_FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


class MlpInputs:
    """x [T, D], the weights as DeepSpeed and TorchTitan hold them (w13 [E, 2F, D], w2 [E, D, F],
    read through .transpose(-2, -1)), optional routing weights [T], optional expert biases
    (b13 [E, 2F] in w13's column layout, b2 [E, D]), all leaves requiring grad; dy [T, D];
    offsets int32 [E] and each row's expert (int64 [T], for the compositions' bias gathers).
    Allocated once, before anything is measured. counts: rows per expert (default rows each).

    args: the leaves in call order, names: their keyword names (x, w13, w2[, weights][, b13, b2])."""

    def __init__(self, experts, rows, dim, ffn, dtype, device, weighted, seed=0, biased=False, counts=None):
        gen = torch.Generator(device=device).manual_seed(seed)
        counts = [rows] * experts if counts is None else list(counts)
        T = sum(counts)

        def normal(*shape, std):
            return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

        # gate_up ~ 6 x N(0, 1), as the activation benchmark's inputs: most values past a clamp
        self.x = normal(T, dim, std=1.0).requires_grad_()
        self.w13 = normal(experts, 2 * ffn, dim, std=6.0 / dim ** 0.5).requires_grad_()
        self.w2 = normal(experts, dim, ffn, std=1.0 / ffn ** 0.5).requires_grad_()
        self.weights = None
        if weighted:
            self.weights = torch.rand(T, device=device, generator=gen).requires_grad_()
        self.b13 = self.b2 = None
        if biased:  # N(0, 1): gate_up moves by about a sixth of its spread, y by about its own
            self.b13 = normal(experts, 2 * ffn, std=1.0).requires_grad_()
            self.b2 = normal(experts, dim, std=1.0).requires_grad_()
        self.grad = normal(T, dim, std=1.0)
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        self.offsets = ends.to(device=device, dtype=torch.int32)
        self.expert_of_row = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts)).to(device)
        self.names = ["x", "w13", "w2"] + (["weights"] if weighted else []) + (["b13", "b2"] if biased else [])
        self.args = [getattr(self, n) for n in self.names]

    def clear(self):
        for a in self.args:
            a.grad = None

    def refresh(self):  # nothing is overwritten: in place, expert_mlp writes over its own gate_up
        pass


def make_fn(impl, preset, layout, alpha, limit, offsets, ffn, expert_of_row=None):
    """fn(x, w13, w2, weights=None, b13=None, b2=None) -> y for a row of the table. A "-bias" row
    adds b13 and b2 (its compositions gather them by expert_of_row); the others ignore them."""
    kw = preset_kwargs(preset, alpha, limit)
    biased = impl.endswith(BIAS)
    base = impl[:-len(BIAS)] if biased else impl
    if base in _MODES:
        def mlp(x, w13, w2, weights=None, b13=None, b2=None):
            if not biased:
                b13 = b2 = None
            return moe.expert_mlp(x, w13.transpose(-2, -1), w2.transpose(-2, -1), offsets, preset, layout=layout,
                                  weights=weights, b13=b13, b2=b2, **kw, **_MODES[base])
        return mlp
    if base == "gemms":
        def act(gu, weights):
            return gu[:, :ffn]  # a stand-in for the activation: a strided view, nothing computed
    elif base == "expertact-op":
        fn = getattr(expertact, preset)

        def act(gu, weights):
            return fn(gu, layout=layout, weights=weights, **kw)
    else:
        if base == "deepspeed":
            from deepspeed.moe.ep_experts import apply_packed_expert_activation

            def form(gu):
                return apply_packed_expert_activation(gu, preset, alpha, limit)
        else:
            f, s = eager_form(preset, alpha, limit), split(layout)

            def form(gu):
                return f(*s(gu))
            if base == "compile":
                torch._dynamo.reset()  # a fresh cache: never fall back to eager on a recompile limit
                form = torch.compile(form, dynamic=False)

        def act(gu, weights):
            h = form(gu)
            return h if weights is None else h * weights[:, None].to(h.dtype)

    if not biased:
        def composition(x, w13, w2, weights=None, b13=None, b2=None):
            gu = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(act(gu, weights), w2.transpose(-2, -1), offs=offsets)
        return composition
    if expert_of_row is None:
        raise ValueError(f"{impl}: the biased composition needs each row's expert")

    def biased_composition(x, w13, w2, weights=None, b13=None, b2=None):
        # As transformers' "grouped_mm" adds GPT-OSS's biases: each row's bias gathered by its
        # expert and added out of place, the routing weights multiplying y (after b2).
        gu = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offsets) + b13[expert_of_row]
        y = torch._grouped_mm(act(gu, None), w2.transpose(-2, -1), offs=offsets) + b2[expert_of_row]
        return y if weights is None else y * weights[:, None].to(y.dtype)
    return biased_composition


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
    return out + bias_targets(results, unit)


def bias_ratios(results):
    """Each biased expert_mlp row's fwd+bwd time over the same mode's without biases, as
    "vs_unbiased" in the row (when both rows were measured)."""
    by = {r["impl"]: r for r in results if "error" not in r}
    for name, r in by.items():
        if name.endswith(BIAS) and name[:-len(BIAS)] in _MODES and name[:-len(BIAS)] in by:
            r["vs_unbiased"] = r["ms"] / by[name[:-len(BIAS)]]["ms"]


def bias_targets(results, unit="GiB"):
    """The bias rows' targets: (text, passed) pairs. expert_mlp with biases within BIAS_COST of the
    same mode without; faster than the eager composition with biases and with less extra peak."""
    by = {r["impl"]: r for r in results if "error" not in r}
    out = []
    for mode in _MODES:
        r, r0 = by.get(mode + BIAS), by.get(mode)
        if r and r0:
            ratio = r["ms"] / r0["ms"]
            out.append((f"{mode}{BIAS} {r['ms']:.2f} ms vs {mode} {r0['ms']:.2f} ms without biases "
                        f"({ratio:.3f}x; target <= {BIAS_COST:.2f}x)", ratio <= BIAS_COST))
    comp, comp_op = by.get("eager" + BIAS), by.get("expertact-op" + BIAS)
    for mode in _MODES:
        r = by.get(mode + BIAS)
        # judged against the eager composition; the one with expertact's activation: measured, plain mode
        for c, judged in ((comp, True), (comp_op if mode == "expertact" else None, False)):
            if not r or not c:
                continue
            ok = r["ms"] < c["ms"]
            peak = r["extra_peak_gib"], c["extra_peak_gib"]
            if peak[0] is not None and peak[1] is not None:
                ok = ok and peak[0] < peak[1]
            out.append((f"{mode}{BIAS} {r['ms']:.2f} ms, extra peak {fmt_mem(peak[0], unit)} {unit} vs the "
                        f"composition {c['impl']} {c['ms']:.2f} ms, {fmt_mem(peak[1], unit)} {unit}"
                        + (" (target: faster, less extra peak)" if judged else ""), ok if judged else None))
    return out


def _reference64(inp, preset, layout, alpha, limit):
    """y of the biased MLP in float64, one expert at a time (torch.mm): the check's reference."""
    f, sp = eager_form(preset, alpha, limit), split(layout)
    d = {n: a.detach().double().requires_grad_() for n, a in zip(inp.names, inp.args)}
    ys, start = [], 0
    for e, stop in enumerate(inp.offsets.tolist()):
        gu = d["x"][start:stop] @ d["w13"][e].T + d["b13"][e]
        ys.append(f(*sp(gu)) @ d["w2"][e].T + d["b2"][e])
        start = stop
    y = torch.cat(ys)
    if "weights" in d:
        y = y * d["weights"][:, None]
    y.backward(inp.grad.double())
    return y.detach(), {n: a.grad for n, a in d.items()}


def _rel_norm(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def bias_check(impls, a, s, device):
    """The correctness check of the bias rows at a small shape (CHECK_COUNTS rows per expert,
    D = F = CHECK_DIM, the table's dtype, routing weights given): for each biased row that computes
    the MLP, ||a - ref|| / ||ref|| of y and of every gradient against _reference64."""
    rows = [i for i in impls if i.endswith(BIAS) and i[:-len(BIAS)] not in ("gemms", "deepspeed")]
    if not rows:
        return []
    inp = MlpInputs(len(CHECK_COUNTS), 0, CHECK_DIM, CHECK_DIM, s.dtype, device, True, seed=1, biased=True,
                    counts=CHECK_COUNTS)
    y_ref, g_ref = _reference64(inp, a.preset, a.layout, a.alpha, a.limit)
    out = []
    for impl in rows:
        r = dict(impl=impl)
        try:
            fn = make_fn(impl, a.preset, a.layout, a.alpha, a.limit, inp.offsets, CHECK_DIM, inp.expert_of_row)
            inp.clear()
            y = fn(**dict(zip(inp.names, inp.args)))
            y.backward(inp.grad)
            r["y_rel"] = _rel_norm(y, y_ref)
            r["grad_rel"] = {n: (None if t.grad is None else _rel_norm(t.grad, g_ref[n]))
                             for n, t in zip(inp.names, inp.args)}
        except ImportError as e:
            r["error"], r["skipped"] = f"skipped: {e}", True
        except Exception as e:  # noqa: BLE001 - reported in the check's table
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        inp.clear()
        out.append(r)
    return out


def _check_max(r):
    """The largest error of a check row (inf when a gradient is missing)."""
    vals = [r["y_rel"]] + [float("inf") if v is None else v for v in r["grad_rel"].values()]
    return max(vals)


def check_targets(check, dtype):
    """Each biased expert_mlp row's largest error at most twice the eager composition's, or CHECK_FLOOR."""
    by = {r["impl"]: r for r in check if "error" not in r}
    comp = by.get("eager" + BIAS)
    floor = CHECK_FLOOR.get(dtype, 1e-5)
    out = []
    for r in check:
        if r["impl"][:-len(BIAS)] not in _MODES or r.get("skipped"):
            continue
        if "error" in r:
            out.append((f"check {r['impl']}: {r['error']}", False))
            continue
        bound = max(2 * _check_max(comp), floor) if comp else floor
        out.append((f"check {r['impl']}: largest relative error {_check_max(r):.1e} (y and every gradient, "
                    f"b13's and b2's included; bound {bound:.1e})", _check_max(r) <= bound))
    return out


def check_markdown(check, meta):
    names = ["x", "w13", "w2", "weights", "b13", "b2"]
    counts = ", ".join(str(c) for c in CHECK_COUNTS)
    lines = [f"Correctness at a small shape: {len(CHECK_COUNTS)} experts x ({counts}) rows, D = F = {CHECK_DIM}, "
             f"{meta['dtype']}, routing weights; ||a - ref|| / ||ref|| against a float64 per-expert reference "
             "(torch.mm, the biases added, the eager activation):", "",
             "| implementation | y | " + " | ".join(f"d{n}" for n in names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for r in check:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} |" + " |" * len(names))
            continue
        g = r["grad_rel"]
        cells = ["n/a" if g.get(n) is None else f"{g[n]:.1e}" for n in names]
        lines.append(f"| {r['impl']} | {r['y_rel']:.1e} | " + " | ".join(cells) + " |")
    return lines


def markdown(meta, results, checks, check=()):
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
    ]
    biased = any(r["impl"].endswith(BIAS) for r in results)
    if biased:
        lines.insert(-1, "- bias rows (-bias): b13 [E, 2F] and b2 [E, D] (GPT-OSS's gate_up_proj_bias and "
                         "down_proj_bias), N(0, 1); y = (h @ w2[e] + b2[e]) * weights; the compositions gather "
                         "each row's bias by its expert and add it out of place")
    ratio_head, ratio_rule = (" vs unbiased |", "---:|") if biased else ("", "")
    lines += [
        "",
        f"| implementation | fwd ms | bwd ms | fwd+bwd ms | extra peak {unit} | kept {unit} | GEMM TFLOP/s | y diff |"
        + ratio_head,
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ratio_rule,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} | | | | | | |" + (" |" if biased else ""))
            continue
        ratio = ""
        if biased:
            ratio = f" {r['vs_unbiased']:.3f}x |" if "vs_unbiased" in r else " |"
        lines.append(f"| {r['impl']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['ms']:.2f} | "
                     f"{fmt_mem(r['extra_peak_gib'], unit)} | {fmt_mem(r['kept_gib'], unit)} | {r['tflops']:.4g} | "
                     f"{_diff_fmt(r['y_rel_diff'])} |" + ratio)
    lines += ["", "extra peak: max allocated during forward+backward minus before (x, weights, dy allocated "
              "before); kept: allocated after forward minus before, minus y; y diff: max |y - y_eager| / "
              "max |y_eager| against the eager composition (gemms computes another function)"
              + (", a -bias row against the eager composition with biases; vs unbiased: fwd+bwd time over "
                 "the same expert_mlp mode's without biases." if biased else ".")]
    if check:
        lines += [""] + check_markdown(check, meta)
    if checks:
        lines += ["", "Targets (memory modes: docs/python.md"
                  + ('; the bias rows: docs/BENCHMARKS.md, "Expert biases (GPT-OSS) in the expert MLP"'
                     if biased else "") + "):", ""]
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
    p.add_argument("--layout", default=None, choices=moe.PACKED_LAYOUTS,
                   help="default halves; interleaved (GPT-OSS's) with --bias")
    p.add_argument("--alpha", type=float, default=1.702)
    p.add_argument("--limit", type=float, default=7.0)
    p.add_argument("--weights", action="store_true",
                   help="routing weights [T] applied to h (to y, after b2, in the -bias rows); always with --bias")
    p.add_argument("--bias", action="store_true",
                   help="the expert-bias table: expert_mlp with and without b13 and b2 in each memory mode and "
                        f"the compositions with biases ({','.join(BIAS_IMPLS)}), routing weights, layout "
                        "interleaved, and a correctness check at a small shape")
    p.add_argument("--impls", default=None,
                   help=f"the table's rows, comma-separated (default {','.join(IMPLS)}; with --bias "
                        f"{','.join(BIAS_IMPLS)}); any row + '-bias' adds the expert biases")
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
        impls=parse_list(a.impls or ",".join(BIAS_IMPLS if a.bias else IMPLS), ALL_IMPLS, "impls"),
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
        bias=a.bias,
        tensor_gib=s.tensor_gib, mem_unit=mem_unit(s.tensor_gib * GiB), gemm_tflop=s.flops / 1e12, iters=s.iters,
        warmup=s.warmup, **method(device), torch=v["torch"], cuda=v["cuda"], deepspeed=_deepspeed_version(),
        expertact=v["expertact"], expertact_cuda=v["expertact_cuda"], python=v["python"],
        command="python -m expertact.bench --mlp " + " ".join(sys.argv[1:] if argv is None else argv),
    )


def _keywords(fn, names):
    """fn called with the inputs' leaves by name (x, w13, w2[, weights][, b13, b2])."""
    def call(*args):
        return fn(**dict(zip(names, args)))
    return call


def measure_row(impl, a, s, inp, y_ref, device, clock, memory):
    """One row of the table: its measurements, or why it was skipped or failed."""
    r = dict(impl=impl)
    base = impl[:-len(BIAS)] if impl.endswith(BIAS) else impl
    try:
        fn = _keywords(make_fn(impl, a.preset, "halves" if base == "deepspeed" else a.layout, a.alpha, a.limit,
                               inp.offsets, s.F, inp.expert_of_row), inp.names)
        r.update(measure(fn, inp, clock, memory, s.iters, s.warmup, refresh=False))
        r["tflops"] = s.flops / (r["ms"] / 1e3) / 1e12
        with torch.no_grad():
            r["y_rel_diff"] = None if base == "gemms" else _rel_diff(fn(*inp.args), y_ref)
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
    if a.layout is None:
        a.layout = "interleaved" if a.bias else "halves"
    a.weights = a.weights or a.bias
    device = resolve_device(a.device)
    s = settings(a, device)
    meta = run_meta(a, argv, s, device)
    log(f"expertact expert-MLP bench on {meta['device_name']}: {s.E} x {s.rows:,} rows, D {s.D}, F {s.F}, "
        f"{s.dtype_name}, {a.preset} {a.layout}; one [T, F] tensor {s.tensor_gib:.2f} GiB; torch {torch.__version__}")
    t_start = time.time()
    biased = any(i.endswith(BIAS) for i in s.impls)
    check = []
    if biased:  # first, so that a wrong result shows before the long table
        log(f"correctness of the bias rows at {len(CHECK_COUNTS)} x {CHECK_COUNTS} rows, D = F = {CHECK_DIM} ...")
        check = bias_check(s.impls, a, s, device)
        for r in check:
            log(f"  {r['impl']:34s} " + (r["error"] if "error" in r else f"largest relative error {_check_max(r):.1e}"))
    inp = MlpInputs(s.E, s.rows, s.D, s.F, s.dtype, device, a.weights, biased=biased)
    # The eager compositions' y (with and without biases), for the y diff column (no graph: only y is kept).
    y_refs = {}
    for bias, ref in (("", "eager"), (BIAS, "eager" + BIAS)):
        if any(i.endswith(BIAS) == bool(bias) and not i.startswith("gemms") for i in s.impls):
            with torch.no_grad():
                fn = make_fn(ref, a.preset, a.layout, a.alpha, a.limit, inp.offsets, s.F, inp.expert_of_row)
                y_refs[bias] = _keywords(fn, inp.names)(*inp.args)
    clock, memory = clock_and_memory(device)
    results = []
    for k, impl in enumerate(s.impls, 1):
        log(f"[{k}/{len(s.impls)}] {impl} ... ({time.time() - t_start:.0f} s so far)")
        y_ref = y_refs.get(BIAS if impl.endswith(BIAS) else "")
        r = measure_row(impl, a, s, inp, y_ref, device, clock, memory)
        results.append(r)
        print(row_line(r, meta["mem_unit"]), flush=True)
    meta["wall_s"] = time.time() - t_start
    bias_ratios(results)
    checks = targets(results, s.tensor_gib, meta["mem_unit"]) + check_targets(check, s.dtype)
    md = markdown(meta, results, checks, check)
    print()
    print(md)
    data = dict(meta=meta, results=results, targets=[dict(text=t, passed=ok) for t, ok in checks])
    if biased:
        data["bias_check"] = check
    write_outputs(a.json, a.markdown, data, md)
    failed = any("error" in r and not r.get("skipped") for r in results + check)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
