"""The outputs of the FP8 kernels, allocated in one place for their two callers: the public
expertact.fp8 (which checks its arguments first) and the FP8 expert MLP (expertact.moe._fp8,
whose arguments expert_mlp has checked). The e4m3 bytes and float32 scales of a rowwise or a
per expert and column quantisation, the per expert and column amax tables, the padded
offsets of the weight-gradient operands, and the blockwise recipe's row tiles, column tiles
and weight blocks. No argument checks here; the kernels are _ops'.
"""
from __future__ import annotations

import math

import torch

__all__ = ["rowwise", "amax", "padded_offsets", "colwise", "TILE", "tiles", "row_tiles", "column_tiles", "blocks"]

E4M3 = torch.float8_e4m3fn


def rowwise(like: torch.Tensor, cols: int):
    """(q e4m3 [..., cols], scale float32 [...]) for a rowwise quantisation of rows shaped as
    like's leading dims."""
    shape = (*like.shape[:-1], cols)
    q = torch.empty(shape, dtype=E4M3, device=like.device)
    scale = torch.empty(shape[:-1], dtype=torch.float32, device=like.device)
    return q, scale


def amax(experts: int, cols: int, device) -> torch.Tensor:
    """A per expert and column amax table, float32 [E, cols] (the kernels write every value)."""
    return torch.empty((experts, cols), dtype=torch.float32, device=device)


def padded_offsets(offsets, pad_to: int):
    """The cumulative end rows once each expert's block of rows is padded to a multiple of
    pad_to: sum over e' <= e of ceil(n_e' / pad_to) * pad_to. offsets: a sequence of host ints
    (returns a list) or an int32 tensor (returns an int32 tensor on its device, computed there:
    no host synchronisation on a GPU)."""
    P = pad_to
    if isinstance(offsets, torch.Tensor):
        n = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return torch.cumsum((n + (P - 1)) // P * P, 0, dtype=torch.int32)
    out, prev, acc = [], 0, 0
    for end in offsets:
        end = int(end)
        acc += -(-(end - prev) // P) * P
        prev = end
        out.append(acc)
    return out


def colwise(rows: int, ends, cols: int, pad_to: int, device, where: str = "expertact"):
    """(q_t e4m3 [cols, R], scale float32 [E, cols]) of a per expert and column quantisation of
    ``rows`` rows sorted by expert (ends: the experts' cumulative end rows, host ints): R = rows
    with pad_to = 1, else the padded row count (padded_offsets(ends, pad_to)[-1]), which must
    fit the kernels' int32 offsets (ValueError naming ``where`` otherwise)."""
    if pad_to != 1:
        padded = padded_offsets(ends, pad_to)
        rows = padded[-1] if padded else 0
        if rows >= 2 ** 31:
            raise ValueError(f"{where}: the padded row count {rows} does not fit the int32 offsets")
    q_t = torch.empty((cols, rows), dtype=E4M3, device=device)
    scale = torch.empty((len(ends), cols), dtype=torch.float32, device=device)
    return q_t, scale


# ---------------------------------------------------------------------------
# The blockwise operands (docs/notes/fp8-recipes.md, "The blockwise operand formats")
# ---------------------------------------------------------------------------

TILE = 128  # the tile edge of the blockwise operands


def tiles(n: int) -> int:
    """The tiles of TILE along n values, the last one partial."""
    return -(-n // TILE)


def row_tiles(like: torch.Tensor, cols: int):
    """(q e4m3 [..., cols], scale storage float32 [KB, T], scale as the [..., KB] view) of a
    1 x 128 row-tile quantisation of rows shaped as like's leading dims (T of them)."""
    lead = like.shape[:-1]
    T, KB = math.prod(lead), tiles(cols)
    q = torch.empty((*lead, cols), dtype=E4M3, device=like.device)
    store = torch.empty((KB, T), dtype=torch.float32, device=like.device)
    return q, store, store.view(KB, *lead).movedim(0, -1)


def column_tiles(ends, cols: int, device, where: str = "expertact"):
    """(q_t e4m3 [cols, Tp], scale float32 [Tp / 128, cols]) of a 128 x 1 column-tile
    quantisation over experts' rows (ends: their cumulative end rows, host ints), each expert's
    rows padded to a multiple of 128: Tp = padded_offsets(ends, 128)[-1], which must fit the
    kernels' int32 offsets (ValueError naming ``where`` otherwise)."""
    padded = padded_offsets(ends, TILE)
    Tp = padded[-1] if padded else 0
    if Tp >= 2 ** 31:
        raise ValueError(f"{where}: the padded row count {Tp} does not fit the int32 offsets")
    q_t = torch.empty((cols, Tp), dtype=E4M3, device=device)
    scale = torch.empty((Tp // TILE, cols), dtype=torch.float32, device=device)
    return q_t, scale


def blocks(experts: int, rows: int, cols: int, device):
    """(q e4m3 [E, rows, cols], scale float32 [E, ceil(rows / 128), ceil(cols / 128)]) of a
    128 x 128 block quantisation of E matrices."""
    q = torch.empty((experts, rows, cols), dtype=E4M3, device=device)
    scale = torch.empty((experts, tiles(rows), tiles(cols)), dtype=torch.float32, device=device)
    return q, scale
