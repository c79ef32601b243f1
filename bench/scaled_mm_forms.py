"""Which single-GEMM forms of the blockwise recipe cuBLAS runs through torch._scaled_mm on this
GPU: one table row per case, "ok", "refused" (the error's first line) or "wrong" (the relative
error against the exact product), so that a refusal met in training can be placed.

The cases are those of expertact's per-expert blockwise GEMMs (python/expertact/moe/_gemm.py,
_blockwise_per_expert) at the edges its probe does not reach: an M-grouped expert's rows
starting at a row offset (A's start then lies offset * K bytes into its tensor) with K of one
to three 128-column tiles, and a K-grouped expert's one or two 128-token tiles starting at a
token offset; and an A whose rows lie further apart than K (the row tiles of dgate_up written
over gate_up's storage would be such a view: 2F bytes of each 4F-byte row). With one K tile the 1 x 128 scales have the shapes of rowwise scales ([M, 1] and
[1, N]); such a case also runs widened to two K tiles (the second zero, of scale 1: the form the
node sends, since an H100 refused one with N = 96). Each case also runs on a fresh copy of A (a
256-byte boundary), to tell A's alignment from the shape. Values are small integers and
power-of-two scales: every product is exact in float32, so "ok" means bit-equal to the exact sum
rounded once to bf16.

A second table: the forms of B's 128 x 128 scales at K block counts that are no multiple of 4
(GPT-OSS's K = 2,880 and 5,760: 23 and 45 blocks; a 3-block K; 3,072 as the control), an
expert's 8,192 rows: the block scales repeated on their rows as 1 x 128 (what the node sends
where the 128 x 128 forms are refused), as they are ([KB, NB], strides (1, KB): cuBLAS reads
rows of L4 = KB rounded up to 4, so misaligned), padded ([KB, NB], strides (1, L4): the layout
cuBLAS reads) and padded with the padding in the shape ([L4, NB], the shape
pytorch/pytorch#166752 describes); each "ok" form timed (CUDA events, the median of 20 calls).
torch 2.11 on an H100 refused both padded forms (bench/results/gpu-session-h100-2026-12-05-seed2/).

    python bench/scaled_mm_forms.py [--markdown FILE]     (a CUDA GPU; on the CPU it says so)
"""
import argparse
import sys

import torch

from expertact.bench.common import write_outputs
from expertact.moe import _gemm
from expertact.moe._gemm import TILE, _exact_ints, _exact_scales, _unit_tile, _widened

E4M3 = torch.float8_e4m3fn


def outcome(call, want):
    """'ok', 'wrong (relative error e)' or 'refused: <first line>' for call() against want."""
    try:
        got = call()
        torch.cuda.synchronize()
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if any(k in msg.lower() for k in _gemm._STICKY_CUDA_ERRORS):
            raise  # the context is unusable: no later case could run
        return "refused: " + msg[:110]
    err = ((got.float() - want).abs() / want.abs().clamp_min(1.0)).nan_to_num(1e30).max().item()
    return "ok" if err <= 2.0 ** -8 else f"wrong (relative error {err:.3g})"


def _case(full, part, sa, b, sb, device):
    """torch._scaled_mm of A = full[part] [M, K] (a view into full, starting where the node's
    expert would) and b [N, K] given transposed, both 1 x 128 along K (sa [M, KB], sb [KB, N]):
    runners for A as that view, for a fresh copy of A, and (None unless K is one tile) for both
    operands widened to two K tiles; the exact product rounded once to bf16; A's start past a
    256-byte boundary."""
    a = full[part]
    K = a.shape[1]
    want = (a * sa.repeat_interleave(TILE, 1)[:, :K]) @ (b * sb.t().repeat_interleave(TILE, 1)[:, :K]).t()
    aq, bq, sa, sb = full.to(device, E4M3)[part], b.to(device, E4M3), sa.to(device), sb.to(device)

    def run(a_, b_=bq, sa_=sa, sb_=sb):
        return lambda: torch._scaled_mm(a_, b_.t(), scale_a=sa_, scale_b=sb_, out_dtype=torch.bfloat16,
                                        use_fast_accum=False)
    wide = None
    if K <= TILE:  # as _blockwise_per_expert sends it: A's scales [M, 2] outer-dim-major, B's [2, N]
        wide = run(_widened(aq), _widened(bq), _unit_tile(sa.t()).t(), _unit_tile(sb))
    return run(aq), run(aq.clone()), wide, want.to(torch.bfloat16).float().to(device), aq.data_ptr() % 256


def m_case(K, offset, M, N, device, row_stride=None):
    """An expert's M rows at row ``offset`` of a row-major A [offset + M, K], its 1 x 128 scales
    outer-dim-major, B [N, K] given transposed with 1 x 128 scales (the node's non-square form);
    with ``row_stride``, A the first K columns of rows that many elements apart (lda > K)."""
    KB = -(-K // TILE)
    sa = _exact_scales((KB, M), 5).t()  # [M, KB], strides (1, M)
    width = row_stride or K
    return _case(_exact_ints((offset + M, width), 7), (slice(offset, None), slice(0, K)), sa,
                 _exact_ints((N, K), 5), _exact_scales((KB, N), 4), device)


def k_case(tiles, offset_tiles, M, N, device):
    """A weight gradient's expert: ``tiles`` 128-token tiles starting at tile ``offset_tiles`` of
    token-major operands a [M, Tp] and b [N, Tp], their 128 x 1 column tiles' scales."""
    Tp = (offset_tiles + tiles) * TILE
    tokens = (slice(None), slice(offset_tiles * TILE, Tp))
    sa = _exact_scales((Tp // TILE, M), 5)[offset_tiles:].t()
    return _case(_exact_ints((M, Tp), 7), tokens, sa, _exact_ints((N, Tp), 5)[tokens],
                 _exact_scales((Tp // TILE, N), 3)[offset_tiles:], device)


def weight_forms(K, N, M, device):
    """(form, runner) for each form of B's 128 x 128 scales (the module docstring), the exact
    product rounded once to bf16."""
    KB, NB = -(-K // TILE), -(-N // TILE)
    L4 = -(-KB // 4) * 4
    a, b = _exact_ints((M, K), 7), _exact_ints((N, K), 5)
    sa, blk = _exact_scales((KB, M), 5).t(), _exact_scales((NB, KB), 4)
    rows = blk.repeat_interleave(TILE, 0)[:N]  # [N, KB]: each block's scale on its rows
    want = (a * sa.repeat_interleave(TILE, 1)[:, :K]) @ (b * rows.repeat_interleave(TILE, 1)[:, :K]).t()
    aq, bq, sa = a.to(device, E4M3), b.to(device, E4M3), sa.to(device)
    padded = torch.ones((NB, L4), device=device)
    padded[:, :KB] = blk.to(device)
    unpadded = torch.ones(NB * L4, device=device)  # room for cuBLAS's reads past [NB, KB]
    unpadded[:NB * KB] = blk.reshape(-1).to(device)
    forms = (("1 x 128 [KB, N]", rows.t().contiguous().to(device)),
             ("128 x 128 [KB, NB], strides (1, KB)", unpadded[:NB * KB].view(NB, KB).t()),
             (f"128 x 128 [KB, NB], strides (1, {L4})", padded[:, :KB].t()),
             (f"128 x 128 [{L4}, NB], strides (1, {L4})", padded.t()))
    return [(name, lambda sb=sb: torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=False))
            for name, sb in forms], want.to(torch.bfloat16).float().to(device)


def ms_per_call(call, reps=20):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * reps)]
    for _ in range(3):
        call()
    for i in range(reps):
        ev[2 * i].record()
        call()
        ev[2 * i + 1].record()
    torch.cuda.synchronize()
    return sorted(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(reps))[reps // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", help="also write the table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/scaled_mm_forms.py needs a CUDA GPU (torch._scaled_mm's blockwise forms are cuBLAS's)")
        return 0
    dev = torch.device("cuda")
    rows = []
    # one K tile (32, 128; N = 96 as in the H100's refusal), two (160), three (272, the probe's)
    for K, N in ((32, 96), (32, 128), (128, 96), (128, 128), (160, 128), (272, 128)):
        for offset in (0, 5, 8, 10, 20):  # A's start offset * K bytes in: 256-, 128-, 64-, 32-byte aligned
            for M in (8, 20):
                a, a_copy, wide, want, align = m_case(K, offset, M, N, dev)
                rows.append((f"m-grouped K = {K} ({-(-K // TILE)} tile(s)), N = {N}", f"row {offset}, {M} rows",
                             align, outcome(a, want), outcome(a_copy, want), wide and outcome(wide, want)))
    for K in (256, 384):  # rows 2K apart, as the row tiles of dgate_up over gate_up's storage would be
        for offset in (0, 5):
            a, a_copy, wide, want, align = m_case(K, offset, 20, 128, dev, row_stride=2 * K)
            rows.append((f"m-grouped K = {K}, rows {2 * K} elements apart (lda > K)", f"row {offset}, 20 rows",
                         align, outcome(a, want), outcome(a_copy, want), wide and outcome(wide, want)))
    for tiles in (1, 2):
        for off in (0, 1, 2, 3):
            a, a_copy, wide, want, align = k_case(tiles, off, 32, 48, dev)
            rows.append((f"k-grouped, {tiles} token tile(s)", f"token {off * TILE}", align,
                         outcome(a, want), outcome(a_copy, want), wide and outcome(wide, want)))
    weights = []
    M = 8192
    for K, N in ((2880, 5760), (2880, 2880), (5760, 2880), (272, 272), (3072, 6144)):
        runners, want = weight_forms(K, N, M, dev)
        for form, call in runners:
            got = outcome(call, want)
            t = ms_per_call(call) if got == "ok" else None
            weights.append((K, N, form, got, t, t and 2 * M * K * N / t / 1e9))
    name = torch.cuda.get_device_name(dev)
    lines = [f"## torch._scaled_mm's blockwise forms on {name}", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}; `python bench/scaled_mm_forms.py`", "",
             "| GEMM | where the expert starts | A's start past a 256-byte boundary (bytes) | A a view at its rows | "
             "A copied to a fresh tensor | widened to two K tiles |", "|---|---|---:|---|---|---|"]
    lines += [f"| {g} | {w} | {al} | {o} | {c} | {wd or '—'} |" for g, w, al, o, c, wd in rows]
    lines += ["", f"### B's 128 x 128 scales at K block counts not a multiple of 4 ({M} rows)", "",
              "| K (blocks) | N | B's scales | outcome | ms per call | TFLOP/s |", "|---|---:|---|---|---:|---:|"]
    lines += [f"| {K} ({-(-K // TILE)}) | {N} | {form} | {got} | {'—' if t is None else f'{t:.3f}'} | "
              f"{'—' if tf is None else f'{tf:.0f}'} |" for K, N, form, got, t, tf in weights]
    text = "\n".join(lines) + "\n"
    print(text)
    write_outputs(None, args.markdown, None, text, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
