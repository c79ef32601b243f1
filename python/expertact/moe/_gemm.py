"""The grouped GEMMs of the expert MLP, shared by its bf16 and FP8 nodes: torch._grouped_mm on
CUDA where it has a grouped kernel, a per-expert torch.matmul loop elsewhere, and the layout
rules of their operands and weight gradients; and the one layer under the FP8 node's GEMMs:
the rowwise recipes' (scaled_gmm: torch._scaled_grouped_mm on Hopper, its emulation on the CPU)
and the blockwise recipe's (blockwise_gmm: expertact's CUTLASS grouped GEMM on Hopper, else
torch._scaled_mm per expert, its emulation on the CPU); and what each FP8 recipe does
(FP8_FORMS), which the Plan carries by name."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _capi, _ops

__all__ = ["Fp8Form", "FP8_FORMS", "Plan", "use_grouped_mm", "mm_operand", "gmm", "gmm_wgrad", "held_transposed",
           "zero_empty_groups", "scaled_gmm", "blockwise_gmm", "blockwise_backend"]


class Fp8Form(NamedTuple):
    """What the FP8 node does under one recipe."""
    blockwise: bool         # the blockwise operands and GEMMs (blockwise_gmm), else the rowwise ones (scaled_gmm)
    wgrad_fp8: bool         # the two weight-gradient GEMMs in FP8, else in bf16 (gmm_wgrad on the bf16 tensors)
    wgrad_fast_accum: bool  # rowwise FP8 weight gradients with Hopper's fast accumulation, else promoted to FP32


#: Each FP8 recipe's form, by the name ``fp8=`` takes: the one place that says what a recipe
#: does (expertact.moe.FP8_RECIPES names the same recipes with their measured cost). The four
#: M-grouped rowwise GEMMs (K = D, F or 2F) always take fast accumulation; the weight
#: gradients' K is an expert's rows, where it costs accuracy (docs/spec.md section 10).
FP8_FORMS = {
    "rowwise": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=True),
    "rowwise-bf16-wgrad": Fp8Form(blockwise=False, wgrad_fp8=False, wgrad_fast_accum=False),
    "rowwise-promoted-wgrad": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=False),
    "blockwise": Fp8Form(blockwise=True, wgrad_fp8=True, wgrad_fast_accum=False),
}


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
    fp8: Optional[str] = None  # the FP8 recipe (a name of FP8_FORMS), None for the model's dtype

    @property
    def form(self) -> Fp8Form:
        """The FP8 recipe's form (FP8_FORMS); only with fp8 set."""
        return FP8_FORMS[self.fp8]


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


def scaled_gmm(a, b, scale_a, scale_b, offs, fast_accum=True):
    """torch._scaled_grouped_mm as the FP8 node calls it: e4m3 operands in the formats it takes on
    sm90 (A row-major, B column-major), float32 dequantisation scales, int32 offs, bf16 output.
    Two forms: a [T, K] with b [E, K, N], scale_a [T], scale_b [E, N], offs the experts' end rows
    of a -> [T, N], rows past offs[-1] left unwritten; and a [M, Kp] with b [Kp, N], scale_a
    [E * M], scale_b [E * N], offs the experts' end columns of a along Kp -> [E, M, N] (the
    weight gradients over each expert's padded rows).

    On CUDA the operator with ``use_fast_accum=fast_accum``: True as torchao calls it (Hopper's
    FP8 tensor cores accumulate in about 14 bits, never promoted along K), False for the
    accumulation promoted to FP32 (cuBLAS's slower path; the weight gradients of the
    "rowwise-promoted-wgrad" recipe). On the CPU its emulation, for tests and studies of the
    recipe (slow, not a speed path), the same for either ``fast_accum``: q dequantised exactly
    (q * scale, the scales being powers of two) and multiplied in float32 by torch.matmul, each
    expert's block rounded once to bf16. What the operator leaves unwritten (rows past the last
    offset, the block of an expert without rows) the emulation fills with NaN, so that a caller
    that forgets to zero it fails on the CPU too."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast_accum)
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


# ---------------------------------------------------------------------------
# The blockwise recipe's FP8 GEMMs (docs/notes/fp8-recipes.md, "The six GEMMs")
# ---------------------------------------------------------------------------

TILE = 128
_E4M3 = torch.float8_e4m3fn
_SCALED_MM = {}  # device index -> None (torch._scaled_mm takes the blockwise scales there) or why not


def _scaled_mm_refusal(device) -> Optional[str]:
    """Why this torch's torch._scaled_mm does not take 1 x 128 / 128 x 128 scales on this GPU,
    or None: probed once per device with one tiny call of each form the node makes (the
    M-grouped 1 x 128 x 128 x 128 and the K-grouped 1 x 128 x 1 x 128), then cached."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SCALED_MM:
        return _SCALED_MM[index]
    why = None
    if not hasattr(torch, "_scaled_mm"):
        why = f"this torch ({torch.__version__}) has no torch._scaled_mm"
    else:
        dev = torch.device("cuda", index)
        try:
            a = torch.zeros((16, 256), dtype=_E4M3, device=dev)
            b = torch.zeros((16, 256), dtype=_E4M3, device=dev).t()       # [K, N] column-major
            sa = torch.ones((2, 16), device=dev).t()                        # [M, KB], strides (1, M)
            for sb in (torch.ones((1, 2), device=dev).t(),                  # 128 x 128: [KB, NB], strides (1, KB)
                       torch.ones((2, 16), device=dev)):                    # 1 x 128 along K: [KB, N]
                torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=False)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - any refusal is the answer
            why = (f"this torch ({torch.__version__}) does not take 1 x 128 / 128 x 128 scales in "
                   f"torch._scaled_mm on {torch.cuda.get_device_name(dev)} ({type(e).__name__}: "
                   f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})")
    _SCALED_MM[index] = why
    return why


def blockwise_backend(device) -> tuple:
    """(backend, why): which implementation of the blockwise GEMMs runs on ``device``:
    "cutlass" (expertact's grouped GEMM: a build with it, an sm90 GPU), "scaled_mm"
    (torch._scaled_mm per expert with the same scales, where this torch takes them on that GPU),
    "emulation" (the CPU), or None with the reason, naming what is missing."""
    device = torch.device(device)
    if device.type == "cpu":
        return "emulation", None
    if device.type != "cuda":
        return None, (f"the blockwise FP8 GEMMs run on Hopper GPUs (sm90), and on the CPU as an emulation; not on "
                      f"{device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BACKENDS:  # once per device: each of the node's six GEMMs asks
        _BACKENDS[index] = _cuda_backend(torch.device("cuda", index))
    return _BACKENDS[index]


_BACKENDS = {}  # CUDA device index -> blockwise_backend's answer there


def _cuda_backend(device) -> tuple:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return None, (f"{torch.cuda.get_device_name(device)} is sm{major}{minor}: the blockwise FP8 grouped GEMMs are "
                      "taken on Hopper (sm90) only")
    if _capi.has_fp8_grouped_gemm():
        return "cutlass", None
    why = _scaled_mm_refusal(device)
    if why is None:
        return "scaled_mm", None
    return None, ("this expertact build has no FP8 grouped GEMM (its CUDA path is built with the CUTLASS headers: pip "
                  "install nvidia-cutlass==4.2.0.0 before building), and " + why)


def blockwise_gmm(a, scale_a, b, scale_b, offs, ends, grouping="m", out_transposed=False):
    """The blockwise recipe's FP8 grouped GEMM as the node calls it: e4m3 operands with float32
    dequantisation scales (value = q * scale) per tile of 128, every 128-deep K tile accumulated
    and added into float32 (the promotion), the sum rounded once to bf16. ``ends``: offs'
    values as host ints.

    ``grouping="m"`` (forward and input gradients): a [T, K] row-major, scale_a [T, ceil(K / 128)]
    (1 x 128 row tiles; the view of [KB, T] storage, strides (1, T)), b [E, N, K] with K
    contiguous, scale_b [E, ceil(N / 128), ceil(K / 128)] (128 x 128 blocks), offs the experts'
    end rows -> [T, N], rows past the last offset 0.

    ``grouping="k"`` (weight gradients): a [M, Tp] and b [N, Tp] with the tokens contiguous
    (each expert's tokens padded to a multiple of 128), scale_a [Tp / 128, M] and scale_b
    [Tp / 128, N] (128 x 1 column tiles), offs the padded end tokens -> [E, M, N], 0 for an
    expert without tokens; ``out_transposed``: the same values with out[e] column-major (the
    [E, N, M] storage transposed: the gradient of a weight held as its transpose).

    On Hopper expertact's CUTLASS grouped GEMM where the library has it, else torch._scaled_mm
    per expert with the same scales (without fast accumulation: cuBLAS's promoted blockwise
    GEMM). On the CPU its emulation, for tests and studies of the recipe (slow, not a speed
    path): each operand dequantised exactly per its tiles (the scales are powers of two), a
    float32 matmul per expert, rounded once to bf16."""
    backend, why = blockwise_backend(a.device)
    if backend is None:
        raise NotImplementedError(f"expertact.moe: the blockwise FP8 GEMMs cannot run here: {why}")
    if backend == "cutlass":
        m = grouping == "m"
        code = _capi.GEMM_M_GROUPED if m else _capi.GEMM_K_GROUPED
        return _ops.fp8_grouped_gemm_blockwise(a, scale_a.t() if m else scale_a, b, scale_b, offs, code,
                                               out_transposed)
    if backend == "scaled_mm":
        return _blockwise_per_expert(a, scale_a, b, scale_b, ends, grouping, out_transposed)
    return _blockwise_emulated(a, scale_a, b, scale_b, ends, grouping, out_transposed)


def _blockwise_per_expert(a, scale_a, b, scale_b, ends, grouping, out_transposed):
    """blockwise_gmm by torch._scaled_mm per expert (its scale layouts: 1 x 128 outer-dim-major,
    128 x 128 row-major, given for B transposed)."""
    mm = torch._scaled_mm
    kw = dict(out_dtype=torch.bfloat16, use_fast_accum=False)
    start = 0
    if grouping == "m":
        out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
        for e, end in enumerate(ends):
            if end > start:  # an expert's [M_e, KB] scales as their own outer-dim-major block
                sa = scale_a[start:end].t().contiguous().t()
                out[start:end] = mm(a[start:end], b[e].t(), scale_a=sa, scale_b=scale_b[e].t(), **kw)
            start = end
        return out
    if out_transposed:  # out[e]^T = b_e a_e^T: the operands swapped
        return _blockwise_per_expert(b, scale_b, a, scale_a, ends, grouping, False).transpose(-2, -1)
    out = torch.zeros((len(ends), a.shape[0], b.shape[0]), dtype=torch.bfloat16, device=a.device)
    for e, end in enumerate(ends):
        if end > start:
            t0, t1 = start // TILE, end // TILE
            out[e] = mm(a[:, start:end], b[:, start:end].t(), scale_a=scale_a[t0:t1].t(), scale_b=scale_b[t0:t1], **kw)
        start = end
    return out


def _dequantised_rows(q, scale):
    """q [R, C] with one scale per row and 128-column tile ([R, ceil(C / 128)]) -> float32, exactly."""
    return q.float() * scale.float().repeat_interleave(TILE, 1)[:, :q.shape[1]]


def _blockwise_emulated(a, scale_a, b, scale_b, ends, grouping, out_transposed):
    """blockwise_gmm on the CPU: operands dequantised exactly, float32 matmul per expert."""
    start = 0
    if grouping == "m":
        N = b.shape[1]
        out = torch.zeros((a.shape[0], N), dtype=torch.bfloat16, device=a.device)
        for e, end in enumerate(ends):
            if end > start:
                w = _dequantised_rows(b[e], scale_b[e].repeat_interleave(TILE, 0)[:N])
                out[start:end] = torch.matmul(_dequantised_rows(a[start:end], scale_a[start:end]), w.t())
            start = end
        return out
    M, N = a.shape[0], b.shape[0]
    out = torch.zeros((len(ends), N, M) if out_transposed else (len(ends), M, N), dtype=torch.bfloat16,
                      device=a.device)
    for e, end in enumerate(ends):
        if end > start:
            t0, t1 = start // TILE, end // TILE
            ae = _dequantised_rows(a[:, start:end], scale_a[t0:t1].t())
            be = _dequantised_rows(b[:, start:end], scale_b[t0:t1].t())
            out[e] = torch.matmul(be, ae.t()) if out_transposed else torch.matmul(ae, be.t())
        start = end
    return out.transpose(-2, -1) if out_transposed else out
