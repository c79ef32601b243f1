"""The FP8 expert-MLP table: expert_mlp's FP8 recipes (each of expertact.moe.FP8_RECIPES) beside the
bf16 expert_mlp, torchao's FP8 grouped GEMMs and the six FP8 GEMMs alone, forward + backward, in one
run.

    python -m expertact.bench --mlp --fp8            # CUDA (Hopper): 4 experts x 261,280 rows, D = F = 3,072
    python -m expertact.bench --mlp --fp8 --rows 32768 --quick
    python -m expertact.bench --mlp --fp8 --device cpu   # the bf16 row only (the FP8 rows need an H200)

Rows (--impls):
  expertact           expert_mlp in bf16 (torch._grouped_mm), plain mode
  expertact-recompute expert_mlp in bf16 with recompute=True (what the FP8 node keeps)
  fp8                 expert_mlp(fp8="rowwise"): the six GEMMs as torch._scaled_grouped_mm (e4m3, rowwise
                      scales, fast accumulation), h written in e4m3 by the activation kernel
  fp8-bf16-wgrad      expert_mlp(fp8="rowwise-bf16-wgrad"): the two weight-gradient GEMMs in bf16
  fp8-promoted-wgrad  expert_mlp(fp8="rowwise-promoted-wgrad"): the two weight-gradient GEMMs with
                      use_fast_accum=False (FP32-promoted accumulation)
  fp8-blockwise       expert_mlp(fp8="blockwise"): DeepSeek-V3's recipe, 1 x 128 tiles for x, h, dy and
                      dgate_up, 128 x 128 blocks for the weights, 128 x 1 tiles for the weight gradients'
                      operands, written by expertact's kernels; the six GEMMs as torch._scaled_mm per expert
                      with the same scales (FP32-promoted accumulation)
  torchao             torchao's _to_fp8_rowwise_then_scaled_grouped_mm for both GEMMs (its Triton
                      quantisation kernels, the same recipe) around expertact's bf16 activation, under
                      autograd: the composition a torchao user writes today
  fp8-gemms           the six FP8 GEMMs alone on operands quantised beforehand (the floor): forward = the
                      two forward GEMMs, backward = the other four
The fp8 rows are one per recipe (bench.common.fp8_rows); a recipe that cannot run here is a
skipped row naming why.

Columns: fwd / bwd / fwd+bwd medians (CUDA events), the FP8 GEMM floor's share of the time (the
floor: the rowwise recipe's six GEMMs), extra peak and kept memory (as --mlp measures them), and
the per-call accuracy of y, dx, dw13 and dw2 against a float32 reference (torch.mm per expert,
TF32 off, the same bf16 inputs): err = ||a - ref|| / ||ref|| and the signed bias
sum((a - ref) ref) / sum(ref^2) (the share of ref the result gains or loses along itself).

Targets (PASS / FAIL below the table): fp8 fwd+bwd at most TARGET_MS and at least
TARGET_VS_TORCHAO times faster than torchao's composition; its extra peak at or below the bf16
expert_mlp's; each of its errors within ERROR_VS_TORCHAO times torchao's. The default recipe's row
(expertact.moe.DEFAULT_FP8_RECIPE): at least TARGET_VS_BF16 times faster than the bf16 expert_mlp,
its extra peak at or below the bf16 expert_mlp's; with no default recipe chosen, a FAIL line says so.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import expertact
from expertact import moe
from expertact.moe import _fp8, _gemm

from . import mlp
from .fp8_accuracy import Sums
from .common import (
    OOM, add_mlp_args, clock_and_memory, fmt_mem, fp8_rows, log, measure, median_ms, method, mlp_settings,
    parse_list, preset_kwargs, resolve_device, target_lines, write_outputs,
)

FP8_ROWS = fp8_rows("")  # "fp8": "rowwise", "fp8-bf16-wgrad": "rowwise-bf16-wgrad", ...
IMPLS = ("expertact", "expertact-recompute", *FP8_ROWS, "torchao", "fp8-gemms")
# the FP8 recipe each row needs (torchao's: rowwise, on the same GPUs)
RECIPE = {**FP8_ROWS, "fp8-gemms": "rowwise", "torchao": "rowwise"}
# the default recipe's row, or None while fp8=True selects none
DEFAULT_ROW = next((row for row, recipe in FP8_ROWS.items() if recipe == moe.DEFAULT_FP8_RECIPE), None)
TARGET_MS = 200.0
TARGET_VS_BF16 = 1.25
TARGET_VS_TORCHAO = 1.25
ERROR_VS_TORCHAO = 1.25
GRADS = ("x", "w13", "w2")


def _torchao_mm():
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception as e:  # noqa: BLE001 - not installed, or not importable with this torch
        raise ImportError(f"torchao's FP8 grouped GEMM is not importable ({type(e).__name__}: {str(e)[:120]})")
    return _to_fp8_rowwise_then_scaled_grouped_mm


def make_fn(impl, a, offsets, F):
    """fn(x, w13, w2) -> y; the weights are [E, N, K] leaves read through .transpose(-2, -1)."""
    kw = preset_kwargs(a.preset, a.alpha, a.limit)
    modes = {"expertact": {}, "expertact-recompute": dict(recompute=True),
             **{row: dict(fp8=recipe) for row, recipe in FP8_ROWS.items()}}
    if impl in modes:
        def run(x, w13, w2):
            return moe.expert_mlp(x, w13.transpose(-2, -1), w2.transpose(-2, -1), offsets, a.preset,
                                  layout=a.layout, **kw, **modes[impl])
        return run
    if impl == "torchao":
        tao = _torchao_mm()
        act = getattr(expertact, a.preset)

        def run(x, w13, w2):
            gu = tao(x, w13.transpose(-2, -1), offsets, pad_token_groups_for_grouped_mm=False)
            return tao(act(gu, layout=a.layout, **kw), w2.transpose(-2, -1), offsets,
                       pad_token_groups_for_grouped_mm=False)
        return run
    raise ValueError(impl)


def gemm_floor(inp, s, iters, warmup):
    """The six FP8 GEMMs alone at this shape (random e4m3 operands in the sm90 formats, unit scales):
    medians of forward (gate_up, y) and backward (dh, dx, dw13, dw2) in ms."""
    dev, T, D, F, E = inp.x.device, s.T, s.D, s.F, s.E
    offs = inp.offsets
    f8 = torch.float8_e4m3fn

    def r8(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16).to(f8)

    ones = lambda n: torch.ones(n, device=dev)  # noqa: E731
    x8, h8, dy8, dg8 = r8(T, D), r8(T, F), r8(T, D), r8(T, 2 * F)
    w13t, w2t = r8(E, 2 * F, D).transpose(-2, -1), r8(E, D, F).transpose(-2, -1)
    w2b, w13b = r8(E, F, D).transpose(-2, -1), r8(E, D, 2 * F).transpose(-2, -1)
    xt, ht, dgc, dyc = r8(D, T), r8(F, T), r8(2 * F, T).t(), r8(D, T).t()
    sg = _gemm.scaled_gmm

    def fwd():
        sg(x8, w13t, ones(T), ones((E, 2 * F)), offs)
        sg(h8, w2t, ones(T), ones((E, D)), offs)

    def bwd():
        sg(dy8, w2b, ones(T), ones((E, F)), offs)
        sg(dg8, w13b, ones(T), ones((E, D)), offs)
        sg(xt, dgc, ones(D * E), ones(2 * F * E), offs)
        sg(ht, dyc, ones(F * E), ones(D * E), offs)

    return median_ms(fwd, iters, warmup, dev), median_ms(bwd, iters, warmup, dev)  # the caller empties the cache


def reference32(inp, a):
    """y, dx, dw13, dw2 in float32 from the same bf16 inputs, one expert at a time (TF32 off)."""
    kw = preset_kwargs(a.preset, a.alpha, a.limit)
    act = getattr(expertact, a.preset)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        T, D = inp.x.shape
        y = torch.zeros(T, D, device=inp.x.device)
        dx = torch.zeros(T, D, device=inp.x.device)
        dw13 = torch.zeros(inp.w13.shape, device=inp.x.device)
        dw2 = torch.zeros(inp.w2.shape, device=inp.x.device)
        start = 0
        for e, stop in enumerate(inp.offsets.tolist()):
            if stop > start:
                x = inp.x.detach()[start:stop].float().requires_grad_()
                w13 = inp.w13.detach()[e].float().requires_grad_()
                w2 = inp.w2.detach()[e].float().requires_grad_()
                ye = act(x @ w13.t(), layout=a.layout, **kw) @ w2.t()
                ye.backward(inp.grad[start:stop].float())
                y[start:stop], dx[start:stop], dw13[e], dw2[e] = ye.detach(), x.grad, w13.grad, w2.grad
                del x, w13, w2, ye
            start = stop
        return {"y": y, "x": dx, "w13": dw13, "w2": dw2}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def compare(a, ref, chunk=1 << 24):
    """(err, bias) of a against ref: ||a - ref|| / ||ref|| and sum((a - ref) * ref) / sum(ref^2),
    the share of ref that a gains (> 0) or loses (< 0) along ref's own direction. Summed in
    float64 over slices of `chunk` elements, so that the comparison of a T x D output at the
    busiest rank's shape (12.8 GB in float32) needs no whole-size float64 copies beside it."""
    a, ref = a.reshape(-1), ref.reshape(-1)
    sums = Sums()
    for i in range(0, ref.numel(), chunk):
        sums.add(a[i:i + chunk].double(), ref[i:i + chunk].double())
    r = sums.result()
    return r["err"], r["bias"]


def errors(fn, inp, ref):
    """({name: err}, {name: signed bias}) of y, dx, dw13 and dw2 against the float32 reference."""
    inp.clear()
    y = fn(*inp.args)
    y.backward(inp.grad)
    out, bias = {}, {}
    out["y"], bias["y"] = compare(y.detach(), ref["y"])
    del y
    for n in GRADS:
        g = getattr(inp, n).grad
        out["d" + n], bias["d" + n] = (None, None) if g is None else compare(g, ref[n])
    inp.clear()
    return out, bias


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m expertact.bench --mlp --fp8", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mlp_args(p, mlp.CPU_DEFAULT["rows"])
    p.add_argument("--preset", default="swiglu_oai", choices=mlp.PRESETS)
    p.add_argument("--layout", default="halves", choices=moe.PACKED_LAYOUTS)
    p.add_argument("--alpha", type=float, default=1.702)
    p.add_argument("--limit", type=float, default=7.0)
    p.add_argument("--impls", default=None, help=f"default {','.join(IMPLS)}")
    return p.parse_args(argv)


def targets(results):
    by = {r["impl"]: r for r in results if "error" not in r}
    out = []
    f, t, b = by.get("fp8"), by.get("torchao"), by.get("expertact")
    if f:
        out.append((f"fp8 fwd+bwd {f['ms']:.1f} ms (target <= {TARGET_MS:.0f} ms at the busiest rank's shape)",
                    f["ms"] <= TARGET_MS))
    if f and t:
        out.append((f"fp8 {t['ms'] / f['ms']:.2f}x faster than torchao's composition ({t['ms']:.1f} ms; target >= "
                    f"{TARGET_VS_TORCHAO}x)", t["ms"] >= TARGET_VS_TORCHAO * f["ms"]))
    if f and b and f["extra_peak_gib"] is not None:
        out.append((f"fp8 extra peak {f['extra_peak_gib']:.2f} GiB vs bf16 expert_mlp's {b['extra_peak_gib']:.2f} GiB "
                    "(target: at or below)", f["extra_peak_gib"] <= b["extra_peak_gib"]))
    if f and t and f.get("err") and t.get("err"):
        worst = max(f["err"][k] / max(t["err"][k], 1e-30) for k in f["err"] if f["err"][k] is not None)
        out.append((f"fp8 errors within {worst:.2f}x of torchao's (y, dx, dw13, dw2; target <= {ERROR_VS_TORCHAO}x)",
                    worst <= ERROR_VS_TORCHAO))
    if DEFAULT_ROW is None and b:
        met = [f"{FP8_ROWS[row]} {b['ms'] / by[row]['ms']:.2f}x" for row in FP8_ROWS
               if row in by and b["ms"] >= TARGET_VS_BF16 * by[row]["ms"]]
        out.append(("no default recipe (expertact.moe.DEFAULT_FP8_RECIPE is None: fp8=True selects none); the "
                    f"default's {TARGET_VS_BF16}x bf16 here is met by "
                    + (", ".join(met) + " (the default's training step and loss rule: docs/spec.md section 10)"
                       if met else "none"), False))
    k = by.get(DEFAULT_ROW)
    if k and b:
        out.append((f"{DEFAULT_ROW} (the default recipe) {b['ms'] / k['ms']:.2f}x faster than the bf16 expert_mlp "
                    f"({b['ms']:.1f} ms; target >= {TARGET_VS_BF16}x)", b["ms"] >= TARGET_VS_BF16 * k["ms"]))
        if k["extra_peak_gib"] is not None:
            out.append((f"{DEFAULT_ROW} extra peak {k['extra_peak_gib']:.2f} GiB vs bf16 expert_mlp's "
                        f"{b['extra_peak_gib']:.2f} GiB (target: at or below)",
                        k["extra_peak_gib"] <= b["extra_peak_gib"]))
    return out


def markdown(meta, results, checks):
    unit = "GiB"
    floor = meta.get("floor_ms")
    lines = [f"## expertact FP8 expert-MLP benchmark: {meta['device_name']}", "",
             f"- shape: {meta['experts']} experts x {meta['rows']:,} rows (T = {meta['tokens']:,}), D = {meta['dim']:,}, "
             f"F = {meta['ffn']:,}, {meta['dtype']} inputs; activation {meta['preset']}, layout {meta['layout']}; "
             "weights held [E, N, K] and read through .transpose(-2, -1)",
             f"- timing: {meta['timer']}, median of {meta['iters']} after {meta['warmup']} warm-up; memory: "
             f"{meta['memory_source']}",
             f"- torch {meta['torch']}, torchao {meta['torchao']}, expertact {expertact.__version__}, "
             f"Python {meta['python']}",
             f"- command: `{meta['command']}`", "",
             "| implementation | fwd ms | bwd ms | fwd+bwd ms | FP8 GEMM floor / time | extra peak GiB | kept GiB | "
             "y err | y bias | dx err | dx bias | dw13 err | dw13 bias | dw2 err | dw2 bias |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} |" + " |" * 13)
            continue
        share = f"{floor / r['ms']:.0%}" if floor else "n/a"
        e, sb = r.get("err") or {}, r.get("bias") or {}
        cells = [c for k in ("y", "dx", "dw13", "dw2") for c in (
            "n/a" if e.get(k) is None else f"{e[k]:.2e}", "n/a" if sb.get(k) is None else f"{sb[k]:+.2e}")]
        lines.append(f"| {r['impl']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['ms']:.2f} | {share} | "
                     f"{fmt_mem(r.get('extra_peak_gib'), unit)} | {fmt_mem(r.get('kept_gib'), unit)} | "
                     + " | ".join(cells) + " |")
    lines += ["", "err: ||a - ref|| / ||ref|| against float32 (torch.mm per expert, TF32 off) from the same bf16 "
              "inputs; bias: sum((a - ref) ref) / sum(ref^2); extra peak: max allocated during forward+backward "
              "minus before; kept: allocated after "
              "forward minus before, minus y. fp8-gemms: random e4m3 operands, no quantisation, no activation."]
    lines += target_lines(checks)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    device = resolve_device(a.device)
    cuda = device.type == "cuda"
    E, rows, D, F, iters, warmup = mlp_settings(a, cuda, mlp.CUDA_DEFAULT if cuda else mlp.CPU_DEFAULT)
    impls = parse_list(a.impls or ",".join(IMPLS), IMPLS, "impls")
    try:
        import torchao
        tao_v = torchao.__version__
    except Exception:  # noqa: BLE001
        tao_v = "not importable"
    meta = dict(device_name=torch.cuda.get_device_name(device) if cuda else "CPU", experts=E, rows=rows,
                tokens=E * rows, dim=D, ffn=F, preset=a.preset, layout=a.layout, iters=iters, warmup=warmup,
                dtype="bfloat16" if cuda else "float32", **method(device),
                torch=torch.__version__, torchao=tao_v, python=sys.version.split()[0],
                command="python -m expertact.bench --mlp --fp8 " + " ".join(sys.argv[1:] if argv is None else argv))
    log(f"FP8 expert-MLP bench on {meta['device_name']}: {E} x {rows:,} rows, D {D}, F {F}")
    inp = mlp.MlpInputs(E, rows, D, F, torch.bfloat16 if cuda else torch.float32, device, False)
    s = mlp.types.SimpleNamespace(E=E, T=E * rows, D=D, F=F)
    ref = None
    if not a.no_errors:
        t0 = time.time()
        ref = reference32(inp, a)
        log(f"float32 reference in {time.time() - t0:.1f} s")
    clock, memory = clock_and_memory(device)
    results = []
    why = {recipe: _fp8.why_not(inp.x, D, F, recipe) for recipe in moe.FP8_RECIPES}
    for impl in impls:
        r = dict(impl=impl)
        try:
            if impl in RECIPE and why[RECIPE[impl]] is not None:
                raise ImportError(why[RECIPE[impl]])  # torchao's FP8 grouped GEMM needs the same GPU
            if impl == "fp8-gemms":
                f, b = gemm_floor(inp, s, iters, warmup)
                r.update(fwd_ms=f, bwd_ms=b, ms=f + b, extra_peak_gib=None, kept_gib=None)
                meta["floor_ms"] = f + b
            else:
                fn = make_fn(impl, a, inp.offsets, F)
                r.update(measure(fn, inp, clock, memory, iters, warmup, refresh=False))
                if ref is not None:
                    r["err"], r["bias"] = errors(fn, inp, ref)
        except OOM:
            r["error"] = "OOM"
        except ImportError as e:
            r["error"], r["skipped"] = f"skipped: {e}", True
        except Exception as e:  # noqa: BLE001 - one failing row does not end the table
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        inp.clear()
        if cuda:
            torch.cuda.empty_cache()
        results.append(r)
        log(f"{impl}: " + (r["error"] if "error" in r else f"{r['ms']:.2f} ms, err {r.get('err')}"))
    checks = targets(results)
    md = markdown(meta, results, checks)
    print()
    print(md)
    write_outputs(a.json, a.markdown, dict(meta=meta, results=results,
                                           targets=[dict(text=t, passed=ok) for t, ok in checks]), md)
    return 1 if any("error" in r and not r.get("skipped") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
