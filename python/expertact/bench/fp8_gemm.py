"""The six FP8 GEMMs of the expert MLP, each alone: torch's FP8 GEMMs as each of expert_mlp's FP8
recipes calls them (rowwise grouped, with and without promoted accumulation; blockwise 1 x 128 /
128 x 128 scales per expert), on the same shapes, in one run.

    python -m expertact.bench --fp8-gemms                   # H200: 4 experts x 261,280 rows, D = F = 3,072
    python -m expertact.bench --fp8-gemms --rows 32768 --iters 10 --json out.json --markdown out.md

GEMMs (docs/notes/fp8-recipes.md, "The six GEMMs"; T = experts x rows):
  gate_up = x @ w13[e]     M-grouped, K = D,  N = 2F
  y       = h @ w2[e]      M-grouped, K = F,  N = D
  dh      = dy @ w2[e]^T   M-grouped, K = D,  N = F
  dx      = dg @ w13[e]^T  M-grouped, K = 2F, N = D
  dw2[e]  = h_e^T dy_e     K-grouped, M = F,  N = D   (each expert's rows padded to 128)
  dw13[e] = x_e^T dg_e     K-grouped, M = D,  N = 2F

Rows (--impls):
  torch-rowwise    torch._scaled_grouped_mm with rowwise scales and use_fast_accum=True: the rowwise
                   recipe's GEMMs as expert_mlp(fp8="rowwise") and torchao call them (no promotion)
  torch-rowwise-promoted  the same with use_fast_accum=False (FP32-promoted accumulation): the weight
                   gradients of expert_mlp(fp8="rowwise-promoted-wgrad"); the M-grouped four too, for
                   what promotion costs there
  torch-blockwise  torch._scaled_mm per expert (a Python loop) with the blockwise recipe's scales in
                   the form expert_mlp(fp8="blockwise") gives them on Hopper (expertact.moe._gemm:
                   the weights' 128 x 128 blocks as they are where K's block count is a multiple
                   of 4 and that form passed its probe on the GPU, else repeated as 1 x 128 rows,
                   the same values), use_fast_accum=False (cuBLAS's promoted blockwise GEMM)

Columns: the median of --iters calls after --warmup (CUDA events around each call, operands made
beforehand), TFLOP/s (2 x M x N x K of the real rows, not the padding) and its share of the H200's
1,979 TFLOP/s dense FP8, and the scratch: what one call allocates beyond its output
(torch.cuda.max_memory_allocated during it minus what it leaves allocated), the workspace its
kernels take from torch's allocator (where a recipe's extra peak may come from). Totals: each
row's six GEMMs, and each recipe's GEMMs as expert_mlp runs them ("rowwise-promoted-wgrad":
torch-rowwise's four M-grouped GEMMs with torch-rowwise-promoted's two weight gradients;
"blockwise": torch-blockwise's six). The operands are random e4m3 with power-of-two scales: the
time does not depend on the values. A row that cannot run (a torch without the operator or the
scale form) says why.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..moe import _gemm
from .common import OOM, device_name, log, median_ms, parse_list, resolve_device, run_row, versions, write_outputs

IMPLS = ("torch-rowwise", "torch-rowwise-promoted", "torch-blockwise")
# A recipe's GEMMs as rows of this table: (the M-grouped four's row, the K-grouped two's row).
RECIPE_ROWS = {"rowwise": ("torch-rowwise", "torch-rowwise"),
               "rowwise-promoted-wgrad": ("torch-rowwise", "torch-rowwise-promoted"),
               "blockwise": ("torch-blockwise", "torch-blockwise")}
PEAK_TFLOPS = 1979.0  # H200 SXM, dense FP8
TILE = 128


def gemm_shapes(experts: int, rows: int, dim: int, ffn: int):
    """The six GEMMs as (name, grouping "m" or "k", dict of sizes): M-grouped T, K, N; K-grouped
    M, N and the tokens T (padded to Tp per expert)."""
    T = experts * rows
    return [
        ("gate_up = x @ w13", "m", dict(T=T, K=dim, N=2 * ffn)),
        ("y = h @ w2", "m", dict(T=T, K=ffn, N=dim)),
        ("dh = dy @ w2^T", "m", dict(T=T, K=dim, N=ffn)),
        ("dx = dg @ w13^T", "m", dict(T=T, K=2 * ffn, N=dim)),
        ("dw2 = h^T dy", "k", dict(T=T, M=ffn, N=dim)),
        ("dw13 = x^T dg", "k", dict(T=T, M=dim, N=2 * ffn)),
    ]


def flops(grouping: str, s: dict) -> float:
    return 2.0 * s["T"] * s["N"] * (s["K"] if grouping == "m" else s["M"])


def _cdiv(a, b):
    return -(-a // b)


def _fp8(shape, device):
    return torch.randn(shape, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)


def _scales(shape, device):
    return torch.exp2(torch.randint(-3, 4, shape, device=device).float())


def m_operands(s, experts, device):
    """x [T, K], its 1 x 128 scales as the [T, KB] view of [KB, T] storage, w [E, N, K], its
    128 x 128 blocks [E, NB, KB], the offsets."""
    T, K, N = s["T"], s["K"], s["N"]
    a = _fp8((T, K), device)
    sa = _scales((_cdiv(K, TILE), T), device).t()
    b = _fp8((experts, N, K), device)
    sb = _scales((experts, _cdiv(N, TILE), _cdiv(K, TILE)), device)
    rows = T // experts
    offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
    return a, sa, b, sb, offs


def k_operands(s, experts, device):
    """a_t [M, Tp], b_t [N, Tp] (each expert's rows padded to 128), their 128 x 1 scales
    [Tp / 128, M] and [Tp / 128, N], the padded offsets."""
    rows = s["T"] // experts
    prow = _cdiv(rows, TILE) * TILE
    Tp = experts * prow
    a_t = _fp8((s["M"], Tp), device)
    b_t = _fp8((s["N"], Tp), device)
    sa = _scales((Tp // TILE, s["M"]), device)
    sb = _scales((Tp // TILE, s["N"]), device)
    poffs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * prow
    return a_t, sa, b_t, sb, poffs


def make_call(impl: str, grouping: str, ops, experts: int):
    """A no-argument call of impl on the operands (per-expert views and scale copies made here,
    outside the timed calls)."""
    if impl in ("torch-rowwise", "torch-rowwise-promoted"):
        if not hasattr(torch, "_scaled_grouped_mm"):
            raise NotImplementedError(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
        fast = impl == "torch-rowwise"
        if grouping == "m":
            a, _, b, _, offs = ops
            sa = torch.ones(a.shape[0], device=a.device)
            sb = torch.ones(b.shape[0], b.shape[1], device=a.device)
            bt = b.transpose(-2, -1)  # [E, K, N] column-major
            return lambda: torch._scaled_grouped_mm(a, bt, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                                    use_fast_accum=fast)
        a_t, _, b_t, _, poffs = ops
        sa = torch.ones(experts * a_t.shape[0], device=a_t.device)
        sb = torch.ones(experts * b_t.shape[0], device=a_t.device)
        bt = b_t.t()  # [Tp, N] column-major
        return lambda: torch._scaled_grouped_mm(a_t, bt, sa, sb, offs=poffs, out_dtype=torch.bfloat16,
                                                use_fast_accum=fast)
    if impl == "torch-blockwise":
        ends = ops[4].tolist()
        calls = []
        start = 0
        if grouping == "m":
            a, sa, b, sb, _ = ops
            N = b.shape[1]
            _gemm.blockwise_backend(a.device)  # its probe decides B's form on this GPU
            square = _gemm.square_weight_scales(a.device, sb.shape[-1])
            for e, end in enumerate(ends):
                # 1 x 128: [M_e, KB] with strides (1, M_e) (M_e a multiple of 4: the node's tail of 1 to 3
                # rows does not arise here); b[e]'s blocks as they are ([KB, NB], strides (1, KB)) or as
                # 1 x 128 rows ([KB, N] contiguous), as the node sends them
                sae = sa[start:end].t().contiguous().t()
                sbe = sb[e].contiguous().t() if square else sb[e].t().repeat_interleave(TILE, 1)[:, :N].contiguous()
                calls.append((a[start:end], b[e].t(), sae, sbe))
                start = end
        else:
            a_t, sa, b_t, sb, _ = ops
            for end in ends:
                t0, t1 = start // TILE, end // TILE
                calls.append((a_t[:, start:end], b_t[:, start:end].t(), sa[t0:t1].t(), sb[t0:t1]))
                start = end

        def run():
            return [torch._scaled_mm(x, w, scale_a=s1, scale_b=s2, out_dtype=torch.bfloat16, use_fast_accum=False)
                    for x, w, s1, s2 in calls]
        return run
    raise ValueError(impl)


def scratch_bytes(fn, device) -> int:
    """What one call of fn allocates beyond what it returns: the peak allocated during the call
    minus the allocation it leaves (its output), both over what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    kept = torch.cuda.memory_allocated(device) - before
    del out
    return peak - kept


def parse_args(argv):
    p = argparse.ArgumentParser(prog="expertact-bench --fp8-gemms", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto or cuda[:N] (a Hopper GPU)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--rows", type=int, default=261280, help="rows per expert (default 261,280: the busiest rank)")
    p.add_argument("--dim", type=int, default=3072)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--impls", default=",".join(IMPLS), help=f"default {','.join(IMPLS)}")
    p.add_argument("--gemms", default=None, help="which of the six, by index 0-5 (default all)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    return p.parse_args(argv)


def run_gemm(name, grouping, s, impls, a, device):
    """The rows of one GEMM: each impl's median ms, TFLOP/s and share of the peak."""
    ops = (m_operands if grouping == "m" else k_operands)(s, a.experts, device)
    rows = []
    for impl in impls:
        def measure():
            fn = make_call(impl, grouping, ops, a.experts)
            ms = median_ms(fn, a.iters, a.warmup, device)
            tf = flops(grouping, s) / ms / 1e9
            scratch = scratch_bytes(fn, device) / 2**20
            return dict(ms=ms, tflops=tf, peak_pct=100.0 * tf / PEAK_TFLOPS, scratch_mib=scratch)
        rows.append(run_row(dict(gemm=name, grouping=grouping, impl=impl, **s), measure))
        torch.cuda.empty_cache()
    del ops
    torch.cuda.empty_cache()
    return rows


def markdown(data) -> str:
    lines = [f"# FP8 GEMMs: {data['device']}", "",
             f"{data['experts']} experts x {data['rows']:,} rows, D = {data['dim']:,}, F = {data['ffn']:,}; "
             f"median of {data['iters']} after {data['warmup']} warm-up; torch {data['versions']['torch']}, "
             f"CUDA {data['versions']['cuda']}", "",
             "| GEMM | grouping | impl | ms | TFLOP/s | % of 1,979 | scratch MiB |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['gemm']} | {r['grouping']} | {r['impl']} | {r['error']} | | | |")
        else:
            lines.append(f"| {r['gemm']} | {r['grouping']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['peak_pct']:.1f} | {r['scratch_mib']:.1f} |")
    lines += ["", "| impl | six GEMMs ms | TFLOP/s | % of 1,979 |", "|---|---:|---:|---:|"]
    for impl, t in data["totals"].items():
        lines.append(f"| {impl} | {t['ms']:.2f} | {t['tflops']:.0f} | {t['peak_pct']:.1f} |" if t else
                     f"| {impl} | incomplete | | |")
    return "\n".join(lines) + "\n"


def totals(results, impls, shapes):
    """Per impl, the six (or the chosen) GEMMs' summed time and the throughput over it; then per
    recipe of RECIPE_ROWS whose rows ran, the same over its GEMMs (keyed "recipe <name>")."""
    out = {}
    picks = {impl: (impl, impl) for impl in impls}
    picks.update({f"recipe {name}": rows for name, rows in RECIPE_ROWS.items() if set(rows) <= set(impls)})
    for key, (m_impl, k_impl) in picks.items():
        rows = [r for r in results if r["impl"] == (m_impl if r["grouping"] == "m" else k_impl)]
        if len(rows) != len(shapes) or any("error" in r for r in rows):
            out[key] = None
            continue
        ms = sum(r["ms"] for r in rows)
        tf = sum(flops(g, s) for _, g, s in shapes) / ms / 1e9
        out[key] = dict(ms=ms, tflops=tf, peak_pct=100.0 * tf / PEAK_TFLOPS)
    return out


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    impls = parse_list(a.impls, IMPLS, "impls")
    device = resolve_device(a.device)
    if device.type != "cuda":
        raise SystemExit("expertact-bench --fp8-gemms: the FP8 GEMMs run on a CUDA device (Hopper); "
                         f"--device is {device}")
    shapes = gemm_shapes(a.experts, a.rows, a.dim, a.ffn)
    if a.gemms:
        shapes = [shapes[int(i)] for i in a.gemms.split(",")]
    results = []
    for name, grouping, s in shapes:
        log(f"{name} ({grouping}-grouped, {s})")
        try:
            results += run_gemm(name, grouping, s, impls, a, device)
        except OOM:
            results += [dict(gemm=name, grouping=grouping, impl=i, error="OOM (operands)", **s) for i in impls]
    data = dict(device=device_name(device), versions=versions(device), experts=a.experts, rows=a.rows, dim=a.dim,
                ffn=a.ffn, iters=a.iters, warmup=a.warmup, peak_tflops=PEAK_TFLOPS, results=results,
                totals=totals(results, impls, shapes))
    md = markdown(data)
    print(md)
    write_outputs(a.json, a.markdown, data, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
