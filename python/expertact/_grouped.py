"""Helpers of the grouped weight-gradient GEMMs, shared by moe (bf16) and _fp8_mlp (FP8)."""
from __future__ import annotations

import torch


def held_transposed(w) -> bool:
    """Whether the expert weight w [E, K, N] is a transposed view of [E, N, K] storage (how
    DeepSpeed, TorchTitan and transformers hold them): its gradient is then computed in that
    storage order, so that autograd hands it to the leaf without a transposing copy."""
    return w is not None and w.dim() == 3 and w.stride(-2) == 1 and w.stride(-1) != 1


def zero_empty_groups(out: torch.Tensor, ends) -> torch.Tensor:
    """Zeroes out[e] for each expert e without rows (ends: cumulative end rows, host ints): a
    grouped GEMM may leave an empty group's block unwritten (pytorch/pytorch#172439: non-zero
    on B200; correct on Hopper already). E is small."""
    start = 0
    for e, stop in enumerate(ends):
        if stop == start:
            out[e].zero_()
        start = stop
    return out
