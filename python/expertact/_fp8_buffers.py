"""The outputs of the FP8 kernels, allocated in one place for their two callers: the public
expertact.fp8 (which checks its arguments first) and the FP8 expert MLP (expertact.moe._fp8,
whose arguments expert_mlp has checked). The e4m3 bytes and float32 scales of a rowwise or a
per expert and column quantisation, the per expert and column amax tables, and the padded
offsets of the weight-gradient operands. No argument checks here; the kernels are _ops'.
"""
from __future__ import annotations

import torch

__all__ = ["rowwise", "amax", "padded_offsets", "colwise"]

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
