"""The grouped GEMMs of the expert MLP, shared by its bf16 and FP8 nodes: torch._grouped_mm on
CUDA where it has a grouped kernel, a per-expert torch.matmul loop elsewhere, and the layout
rules of their operands and weight gradients; and the one layer under the FP8 node's GEMMs,
torch._scaled_grouped_mm on Hopper and its emulation on the CPU (scaled_gmm)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["Plan", "use_grouped_mm", "mm_operand", "gmm", "gmm_wgrad", "held_transposed", "zero_empty_groups",
           "scaled_gmm"]


class Plan(NamedTuple):
    """What the checks of expert_mlp decided, carried by the autograd node."""
    ends: list          # cumulative end row of each expert, host ints
    grouped: bool       # torch._grouped_mm (else the per-expert loop)
    glu: tuple          # (layout, act, alpha, limit, beta) for the activation
    recompute: bool
    inplace: bool
    layout: str = "halves"   # gate and up along w13's last dim
    biased: bool = False     # b13 or b2 given: offs is then on x's device (the bias kernels read it)
    remake_weights: object = None  # () -> (w13, w2) remade in backward instead of kept (expert_mlp's argument)
    fp8: Optional[str] = None  # the FP8 recipe (expertact.moe.FP8_RECIPES), None for the model's dtype
    fp8_wgrad: bool = True     # with fp8: the weight-gradient GEMMs in FP8 too (else bf16)


def use_grouped_mm(x, D, F) -> bool:
    """torch._grouped_mm where it has a grouped kernel: bf16 on sm90 / sm100 (CUTLASS), with
    every leading stride a multiple of 16 bytes (D and F multiples of 8). Elsewhere torch runs
    it as a loop over the groups that reads the offsets to the host on each call (6 times
    per MLP step); this module's own per-expert loop does the same work with the offsets it already
    read: other dtypes, other GPUs, odd D or F."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    return D % 8 == 0 and F % 8 == 0


def mm_operand(t, row_major=False):
    """t as torch._grouped_mm reads it: a 16-byte aligned start and one of the last two dims
    contiguous with the other's stride a multiple of 16 bytes (with row_major, the last dim);
    otherwise a contiguous copy."""
    align = 16 // t.element_size()
    st, n = t.stride(), t.shape
    if t.data_ptr() % 16 == 0:
        if st[-1] == 1 and st[-2] >= max(1, n[-1]) and st[-2] % align == 0:
            return t
        if not row_major and st[-2] == 1 and st[-1] >= max(1, n[-2]) and st[-1] % align == 0:
            return t
    return torch.empty(n, dtype=t.dtype, device=t.device).copy_(t)


# The 2-D operands of torch._grouped_mm are kept row-major ([rows, cols], cols contiguous):
# its CUDA kernel asserts on the device (a sticky error) that a group's size is a multiple of
# 16 bytes along a 2-D operand's dynamic dim when that dim is the contiguous one, and that no
# group is empty in the weight-gradient form unless A is column-major and B row-major
# (prepare_grouped_gemm_data in ATen's GroupMMCommon.cuh). Row-major activations make any
# expert sizes legal, empty experts included; torch's own _grouped_mm backward lays them out so.


def gmm(a, b, offs, plan):
    """out[rows of e] = a[rows of e] @ b[e]: [T, N]. Rows past the last offset are zero
    (torch._grouped_mm leaves them unwritten: whatever the allocator held, NaN included)."""
    T = a.shape[0]
    end = plan.ends[-1] if plan.ends else 0
    if plan.grouped and end > 0:
        out = torch._grouped_mm(mm_operand(a, row_major=True), mm_operand(b), offs=offs)
    else:
        out = a.new_empty((T, b.shape[-1]))
        start = 0
        for e, stop in enumerate(plan.ends):
            if stop > start:
                torch.matmul(a[start:stop], b[e], out=out[start:stop])
            start = stop
    if end < T:
        out[end:].zero_()
    return out


def gmm_wgrad(a, b, offs, plan, like=None):
    """out[e] = a[rows of e]^T @ b[rows of e]: [E, a cols, b cols], zero for an expert with no rows.

    like: the weight this is the gradient of. Expert weights are usually held [E, N, K] and
    read through .transpose(-2, -1) (DeepSpeed, TorchTitan, transformers): then the gradient is
    computed as (b^T a)^T, the same sums laid out as the weight's storage, so that autograd
    hands it to the leaf without a transposing copy (two such copies were about 0.3% of a bf16
    step at the busiest rank: docs/notes/perf-notes.md, "The expert MLP around the
    activation")."""
    if held_transposed(like):
        return gmm_wgrad(b, a, offs, plan).transpose(-2, -1)
    ends = plan.ends
    end = ends[-1] if ends else 0
    if plan.grouped and end > 0:
        # a^T column-major, b row-major: the form with no constraint on the groups' sizes
        out = torch._grouped_mm(mm_operand(a, row_major=True).t(), mm_operand(b, row_major=True), offs=offs)
        return zero_empty_groups(out, ends)
    out = a.new_zeros((len(ends), a.shape[1], b.shape[1]))
    start = 0
    for e, stop in enumerate(ends):
        if stop > start:
            torch.matmul(a[start:stop].t(), b[start:stop], out=out[e])
        start = stop
    return out


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


# ---------------------------------------------------------------------------
# The FP8 GEMMs: the one place where Hopper and the CPU differ
# ---------------------------------------------------------------------------


def scaled_gmm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm as the FP8 node calls it: e4m3 operands in the formats it takes on
    sm90 (A row-major, B column-major), float32 dequantisation scales, int32 offs, bf16 output.
    Two forms: a [T, K] with b [E, K, N], scale_a [T], scale_b [E, N], offs the experts' end rows
    of a -> [T, N], rows past offs[-1] left unwritten; and a [M, Kp] with b [Kp, N], scale_a
    [E * M], scale_b [E * N], offs the experts' end columns of a along Kp -> [E, M, N] (the
    weight gradients over each expert's padded rows).

    On CUDA the operator, with fast accumulation as torchao calls it. On the CPU its emulation,
    for tests and studies of the recipe (slow, not a speed path): q dequantised exactly (q *
    scale, the scales being powers of two) and multiplied in float32 by torch.matmul, each
    expert's block rounded once to bf16. What the operator leaves unwritten (rows past the last
    offset, the block of an expert without rows) the emulation fills with NaN, so that a caller
    that forgets to zero it fails on the CPU too."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    ends = offs.tolist()
    start = 0
    if b.dim() == 3:
        out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=torch.bfloat16)
        for e, end in enumerate(ends):
            if end > start:
                out[start:end] = torch.matmul(a[start:end].float() * scale_a[start:end, None],
                                              b[e].float() * scale_b[e][None, :])
            start = end
        return out
    M, N = a.shape[0], b.shape[1]
    sa, sb = scale_a.view(-1, M), scale_b.view(-1, N)
    out = torch.full((len(ends), M, N), float("nan"), dtype=torch.bfloat16)
    for e, end in enumerate(ends):
        if end > start:
            out[e] = torch.matmul(a[:, start:end].float() * sa[e][:, None], b[start:end].float() * sb[e][None, :])
        start = end
    return out
