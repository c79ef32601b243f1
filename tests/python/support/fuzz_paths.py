"""Which CUDA path a call takes, for the fuzzer's counts (tests/python/support/fuzz.py)."""
from __future__ import annotations

import torch

from expertact._capi import rows_view_ok

# ---------------------------------------------------------------------------
# Which CUDA path a call takes: a mirror of the host-side choice in src/cuda/glu_launch.cuh as
# of main a4e5da5 (pick_pack, rows_mergeable / merge_if_better, the flat kernels under
# EXPERTACT_CUDA_KERNEL=flat, use_realign, shape_for), used only to count how often
# the fuzzer reaches each path. It decides no check; if the launcher changes, the counts go
# stale, not the verdicts (a GPU run also lists the kernels it launched).
# ---------------------------------------------------------------------------


def _aligned(op, V, es, rows):
    ptr, stride, mult = op
    b = min(16, mult * V * es)
    return ptr % b == 0 and (rows <= 1 or (stride * es) % b == 0)


def _pick_pack(ops, F, rows, es, step):
    for V in (16 // es // step, 4 // es, 1):
        if V >= 1 and F % V == 0 and all(_aligned(o, V, es, rows) for o in ops):
            return V
    return 1


def _unroll(pack_bytes, fwd):
    if fwd:
        return 2 if pack_bytes >= 16 else 4 if pack_bytes >= 8 else 8 if pack_bytes >= 4 else 16
    return 2 if pack_bytes >= 32 else 4 if pack_bytes >= 16 else 8 if pack_bytes >= 8 else 16


def _grid(rows, packs, U, row_sum, sms, max_lanes):
    """'rows' (a block holds whole rows: rows fill the GPU, or a row sum), 'tile' (a block per
    row, one tile of it) or 'split' (a row's tiles over several blocks)."""
    def lanes(cap):
        G = 1
        while G < cap and G * 2 * U <= packs:
            G *= 2
        return G
    G = lanes(32)
    row_blocks = -(-rows // (128 // G))
    if row_sum or row_blocks >= sms * 32:
        return "rows"
    G = lanes(min(128, max_lanes))
    row_blocks = -(-rows // (128 // G))
    tiles = -(-packs // (G * U))
    return "split" if min(tiles, 0x7FFFFFFF // row_blocks) > 1 else "tile"


def _flat_fits(rows, packs, kernel):
    """glu_launch.cuh's flat_shape: a grid under 2^31 blocks, and for several rows pack numbers
    within the 32-bit division (kFlatDiv32Max)."""
    total = rows * packs
    blocks = -(-total // 256)
    return blocks <= 0x7FFFFFFF and (rows == 1 or total <= (1 << 31) - 4096)


def predict_path(fwd, es, step, F, rows, ops, planar, inputs, weighted, row_sum, sms, kernel="rows"):
    """A label for the kernel and launch shape that glu_launch.cuh picks, or None (no launch).
    kernel: the kernel choice of the call (rows, flat; auto resolved by Context.choice)."""
    if rows == 0 or F == 0:
        return None
    wide = 16 // es // step
    V = _pick_pack(ops, F, rows, es, step)
    merged = False
    if not weighted and rows > 1 and all(s == F for s in planar) and all(s == step * F for s in inputs):
        Vm = _pick_pack(ops, rows * F, 1, es, step)
        if Vm > V or F // V < 64 or (kernel != "rows" and Vm == wide):
            F, rows, V, merged = rows * F, 1, Vm, True
    m = " merged" if merged else ""
    if kernel != "rows" and not row_sum and V == wide and _flat_fits(rows, F // V, kernel):
        return f"{'fwd' if fwd else 'bwd'} {kernel}{m}"
    if step == 1 and V != 16 // es:
        kern, grid = "realign", _grid(rows, -(-F // (16 // es)), 1, row_sum, sms, 32)
    else:
        kern = f"pack{V * es * step}B"
        grid = _grid(rows, F // V, _unroll(es * V * step, fwd), row_sum, sms, 128)
    return f"{'fwd' if fwd else 'bwd'} {kern}{m} {grid}"


def operand(t):
    """(data pointer, row stride in elements) of a matrix as the library sees it."""
    if not rows_view_ok(t):
        return 0, t.shape[-1]  # the binding's contiguous copy: a fresh, aligned allocation
    # the innermost leading dim with more than one row sets the row stride
    inner = [s for d, s in zip(t.shape[:-1], t.stride()[:-1]) if d > 1]
    return t.data_ptr(), (inner[-1] if inner else t.shape[-1])


def gate_up_ptrs(p, x, up):
    es = torch.tensor([], dtype=p.dtype).element_size()
    bx, sx = operand(x)
    if p.layout == "separate":
        bu, su = operand(up)
        return (bx, sx), (bu, su), 1
    off = {"halves": (0, p.F), "up_first": (p.F, 0), "interleaved": (0, 1)}[p.layout]
    return (bx + off[0] * es, sx), (bx + off[1] * es, sx), 2 if p.layout == "interleaved" else 1
