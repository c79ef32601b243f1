"""Which single-GEMM forms of the blockwise recipe cuBLAS runs through torch._scaled_mm on this
GPU: one table row per case, "ok", "refused" (the error's first line) or "wrong" (the relative
error against the exact product), so that a refusal met in training can be placed.

The cases are those of expertact's per-expert blockwise GEMMs (python/expertact/moe/_gemm.py,
_blockwise_per_expert) at the edges its probe does not reach: an M-grouped expert's rows
starting at a row offset (A's start then lies offset * K bytes into its tensor) with K of one
to three 128-column tiles, and a K-grouped expert's one or two 128-token tiles starting at a
token offset. With one K tile the 1 x 128 scales have the shapes of rowwise scales ([M, 1] and
[1, N]). Each case also runs on a fresh copy of A (a 256-byte boundary), to tell A's alignment
from the shape. Values are small integers and power-of-two scales: every product is exact in
float32, so "ok" means bit-equal to the exact sum rounded once to bf16.

    python bench/scaled_mm_forms.py [--markdown FILE]     (a CUDA GPU; on the CPU it says so)
"""
import argparse
import sys

import torch

E4M3 = torch.float8_e4m3fn
TILE = 128


def ints(shape, m, device):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, device=device).view(shape) % m - m // 2).float()


def pow2(shape, m, device):
    """Power-of-two scales [tiles, rows] that differ between consecutive tiles of every row (a
    scale read from the wrong tile changes the product)."""
    tiles, rows = shape
    e = (torch.arange(tiles, device=device)[:, None] * 2 + torch.arange(rows, device=device)) % m - m // 2
    return 2.0 ** e.float()


def outcome(call, want):
    """'ok', 'wrong (relative error e)' or 'refused: <first line>' for call() against want."""
    try:
        got = call()
        torch.cuda.synchronize()
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "illegal memory access" in msg or "launch failure" in msg:
            raise  # the context is unusable: no later case could run
        return "refused: " + msg[:110]
    err = ((got.float() - want).abs() / want.abs().clamp_min(1.0)).nan_to_num(1e30).max().item()
    return "ok" if err <= 2.0 ** -8 else f"wrong (relative error {err:.3g})"


def m_case(K, offset, M, N, device):
    """An expert's M rows at row ``offset`` of a row-major A [offset + M, K], its 1 x 128 scales
    outer-dim-major, B [N, K] given transposed with 1 x 128 scales (the node's non-square form)."""
    KB = -(-K // TILE)
    full = ints((offset + M, K), 7, device)
    a = full.to(E4M3)[offset:]
    sa = pow2((KB, M), 5, device).t()  # [M, KB], strides (1, M)
    b = ints((N, K), 5, device)
    sb = pow2((KB, N), 4, device)  # b^T's scales: [KB, N]
    want = (full[offset:] * sa.repeat_interleave(TILE, 1)[:, :K]) @ (b * sb.t().repeat_interleave(TILE, 1)[:, :K]).t()
    want = want.to(torch.bfloat16).float()
    bq = b.to(E4M3)

    def run(a_):
        return lambda: torch._scaled_mm(a_, bq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=False)
    return run(a), run(a.clone()), want, a.data_ptr() % 256


def k_case(tiles, offset_tiles, M, N, device):
    """A weight gradient's expert: ``tiles`` 128-token tiles starting at tile ``offset_tiles`` of
    token-major operands a [M, Tp] and b [N, Tp], their 128 x 1 column tiles' scales."""
    Tp = (offset_tiles + tiles) * TILE
    af, bf = ints((M, Tp), 7, device), ints((N, Tp), 5, device)
    saf, sbf = pow2((Tp // TILE, M), 5, device), pow2((Tp // TILE, N), 3, device)
    lo, hi = offset_tiles * TILE, Tp
    a, b = af.to(E4M3)[:, lo:hi], bf.to(E4M3)[:, lo:hi]
    sa, sb = saf[offset_tiles:].t(), sbf[offset_tiles:]
    want = ((af[:, lo:hi] * sa.repeat_interleave(TILE, 1)) @ (bf[:, lo:hi] * sb.t().repeat_interleave(TILE, 1)).t())
    want = want.to(torch.bfloat16).float()

    def run(a_):
        return lambda: torch._scaled_mm(a_, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=False)
    return run(a), run(a.clone()), want, a.data_ptr() % 256


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", help="also write the table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/scaled_mm_forms.py needs a CUDA GPU (torch._scaled_mm's blockwise forms are cuBLAS's)")
        return 0
    dev = torch.device("cuda")
    rows = []
    for K in (32, 128, 160, 272):  # one K tile (32, 128), two (160), three (272, the probe's)
        for offset in (0, 5, 8, 10, 20):  # A's start offset * K bytes in: 256-, 128-, 64-, 32-byte aligned
            for M in (8, 20):
                a, a_copy, want, align = m_case(K, offset, M, 128, dev)
                rows.append((f"m-grouped K = {K} ({-(-K // TILE)} tile(s))", f"row {offset}, {M} rows",
                             align, outcome(a, want), outcome(a_copy, want)))
    for tiles in (1, 2):
        for off in (0, 1, 2, 3):
            a, a_copy, want, align = k_case(tiles, off, 32, 48, dev)
            rows.append((f"k-grouped, {tiles} token tile(s)", f"token {off * TILE}", align,
                         outcome(a, want), outcome(a_copy, want)))
    name = torch.cuda.get_device_name(dev)
    lines = [f"## torch._scaled_mm's blockwise forms on {name}", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}; `python bench/scaled_mm_forms.py`", "",
             "| GEMM | where the expert starts | A's start past a 256-byte boundary (bytes) | as the node calls it | "
             "A copied to a fresh tensor |", "|---|---|---:|---|---|"]
    lines += [f"| {g} | {w} | {al} | {o} | {c} |" for g, w, al, o, c in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
