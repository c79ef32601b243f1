"""The grouped GEMMs of the expert MLP, shared by its bf16 and FP8 nodes: torch._grouped_mm on
CUDA where it has a grouped kernel, a per-expert torch.matmul loop elsewhere, and the layout
rules of their operands and weight gradients; and the one layer under the FP8 node's GEMMs:
the rowwise recipes' (scaled_gmm: torch._scaled_grouped_mm on Hopper, its emulation on the CPU)
and the blockwise recipe's (blockwise_gmm: torch._scaled_mm per expert on Hopper, its
emulation on the CPU); and what each FP8 recipe does
(FP8_FORMS), which the Plan carries by name."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


__all__ = ["Fp8Form", "FP8_FORMS", "Plan", "use_grouped_mm", "mm_operand", "gmm", "gmm_wgrad", "held_transposed",
           "zero_empty_groups", "scaled_gmm", "blockwise_gmm", "blockwise_backend", "square_weight_scales"]


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
_SQUARE = {}  # device index -> None (B's 128 x 128 scales passed the probe there) or why not: square_weight_scales

# torch._scaled_mm's blockwise GEMMs as cuBLAS runs them on sm90, and the forms
# _blockwise_per_expert gives them. An outer-dim-major 1 x 128 scale ([M, KB], strides (1, M))
# needs M % 4 == 0, each of its columns 16-byte aligned (torch 2.11, CUDA 13.0, H200: M = 17 and
# 283 are refused with CUBLAS_STATUS_NOT_SUPPORTED, M = 20, 24, 32, 40, 48, 272, 384 run): an
# expert's last M % 4 rows run as 4 rows, zero-padded. cuBLAS reads a 128 x 128 scale with each
# row of K blocks padded to a multiple of 4, which torch._scaled_mm's check of the scale's
# strides does not ask for in every version (pytorch/pytorch#166752): with a K block count not a
# multiple of 4 such a scale is read misaligned (torch 2.11, H100: wrong values at K = 2,880,
# 5,760 and 272), and a padded one ([KB, NB] with strides (1, L4), or [L4, NB]) is refused
# (bench/scaled_mm_forms.py's second table). So B's 128 x 128 scales go in as they
# are ([KB, NB] with strides (1, KB)) where KB is a multiple of 4 (every K of the MLP at training
# shapes: D or F = 3,072, 2F = 6,144) and the probe of that form passed on the device; otherwise
# as 1 x 128 scales, each block's scale repeated on its 128 rows: the same values, a scale
# [N, KB] whose leading dimension N is a multiple of 16 (torch._scaled_mm's own rule for B), with
# N / 128 times the scale bytes for cuBLAS to read per K tile. With one K block a 1 x 128 scale
# has the shape of a rowwise one ([M, 1], [1, N]) and torch._scaled_mm takes it as such: cuBLAS
# refused that call on an H100 (torch 2.11, CUDA 13.0; M = 20, K = 32, the rows starting 320
# bytes into A) where the blockwise form runs, so a reduction of one tile goes in widened to two
# (_widened: zero columns; _unit_tile: their scale 1).
_SCALE_ROWS = 4
# cuBLAS chooses its kernel for operands aligned to 256 bytes unless told otherwise (the default
# of its CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES preferences), so an expert's rows are written
# in place (torch._scaled_mm's out=) only where they start on such a boundary, as every expert's
# do where N is a multiple of 128; elsewhere into an allocation of their own, then copied.
_OUT_ALIGN = 256


def _index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _scaled_mm_refusal(device) -> Optional[str]:
    """Why this torch's torch._scaled_mm does not take the blockwise GEMMs on this GPU, or None:
    probed once per device (_scaled_mm_probe, each form the node sends), then cached; the probe
    of B's 128 x 128 form decides square_weight_scales there (a refusal of that form alone
    leaves the 1 x 128 form in use)."""
    index = _index(device)
    if index in _SCALED_MM:
        return _SCALED_MM[index]
    square = "not probed: the 1 x 128 form was refused"
    if not hasattr(torch, "_scaled_mm"):
        why = f"this torch ({torch.__version__}) has no torch._scaled_mm"
    else:
        dev = torch.device("cuda", index)
        why = _probe_form(dev, False)
        if why is None:
            square = _probe_form(dev, True)
    _SCALED_MM[index], _SQUARE[index] = why, square
    return why


# CUDA errors after which the process's CUDA context is unusable: the probe re-raises them, since
# no GEMM could run afterwards and an answer "refused" would hide the fault.
_STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert",
                       "misaligned address", "illegal instruction", "uncorrectable ecc")


def _probe_form(device, square: bool) -> Optional[str]:
    """_scaled_mm_probe on ``device`` with its refusals as answers (a fault that leaves the CUDA
    context unusable is raised instead)."""
    try:
        why = _scaled_mm_probe(device, square)
        torch.cuda.synchronize(device)
        return why
    except Exception as e:  # noqa: BLE001 - any refusal is the answer
        msg = str(e).strip()
        if any(k in msg.lower() for k in _STICKY_CUDA_ERRORS):
            raise RuntimeError(f"expertact.moe: torch._scaled_mm faulted in the probe of the blockwise FP8 GEMMs "
                               f"({_form_name(square)} scales) on {torch.cuda.get_device_name(device)}; this "
                               f"process's CUDA context is unusable") from e
        first = msg.splitlines()[0][:200] if msg else ""
        return (f"this torch ({torch.__version__}) does not take {_form_name(square)} scales in torch._scaled_mm on "
                f"{torch.cuda.get_device_name(device)} ({type(e).__name__}: {first})")


def _form_name(square: bool) -> str:
    return "1 x 128 / 128 x 128" if square else "1 x 128"


def square_weight_scales(device, kb: int) -> bool:
    """Whether the M-grouped GEMMs on ``device`` pass B's 128 x 128 scales as they are: K's block
    count kb a multiple of 4 (the notes above _SCALE_ROWS) and that form's probe passed there."""
    key = _index(device) if device.type == "cuda" else device.type
    return kb % 4 == 0 and key in _SQUARE and _SQUARE[key] is None


# The probe's problems, each run through _blockwise_per_expert as the node calls it. M-grouped,
# (T, K, N, ends): experts of 3 rows (run padded to 4) and 21 (20 of them into a slice of the
# output at a row offset, the last padded), one empty, rows past the last end; B's scales 1 x 128
# with three K tiles, the last partial, or 128 x 128 with four (the multiple of 4 that form
# needs, the last partial) and three N blocks, the last partial. K-grouped, (M, N, padded ends):
# two experts with tokens, one without.
_PROBE_M = {False: (28, 272, 32, [3, 24, 24]), True: (28, 496, 272, [3, 24, 24])}
_PROBE_K = (16, 32, [128, 128, 384])


def _exact_ints(shape, m):
    """Small integers (-(m // 2) up to m - 1 - m // 2) as float32: exact in e4m3, and their
    products' sums exact in float32."""
    return (torch.arange(math.prod(shape)).view(shape) % m - m // 2).float()


def _exact_scales(shape, m, tile_dim=0):
    """Power-of-two scales (exponents -(m // 2) up to m - 1 - m // 2, m >= 3) whose exponent
    differs by 2 (mod m) between neighbouring tiles along ``tile_dim`` at every other index: a
    scale read from the wrong tile changes the product."""
    idx = torch.arange(math.prod(shape)).view(shape)
    tile = torch.arange(shape[tile_dim]).view([-1 if d == tile_dim % len(shape) else 1 for d in range(len(shape))])
    return 2.0 ** ((2 * tile + idx - tile * idx.stride(tile_dim)) % m - m // 2).float()


def _scaled_mm_probe(device, square: bool = False) -> Optional[str]:
    """Each form _blockwise_per_expert sends torch._scaled_mm (B's scales 128 x 128 with
    ``square``, else 1 x 128; the weight-gradient form with the 1 x 128 one), on ``device``, on
    values whose products are exact in float32 (small integers, power-of-two scales that differ
    per tile): None if every result is the CPU emulation's (the exact sum rounded once to bf16)
    within bf16's rounding, else what differs (a scale read from the wrong place is off by a
    power of two, a row left unwritten is whatever the allocator held). Raises what
    torch._scaled_mm raises."""
    T, K, N, ends = _PROBE_M[square]
    KB, NB = -(-K // TILE), -(-N // TILE)
    def q(shape, m):
        return _exact_ints(shape, m).to(_E4M3)

    E = len(ends)
    m_args = (q((T, K), 7), _exact_scales((KB, T), 5).t(), q((E, N, K), 5), _exact_scales((E, NB, KB), 4, 2))
    M, Nk, pends = _PROBE_K
    Tp = pends[-1]
    k_args = (q((M, Tp), 7), _exact_scales((Tp // TILE, M), 5), q((Nk, Tp), 5), _exact_scales((Tp // TILE, Nk), 3))
    problems = [("m", m_args, ends, (T, K, N))]
    if not square:  # the weight-gradient form has no 128 x 128 scales
        problems.append(("k", k_args, pends, (M, Tp, Nk)))
    for grouping, args, e, shape in problems:
        want = _blockwise_emulated(*args, e, grouping, False)
        got = _blockwise_per_expert(*(t.to(device) for t in args), e, grouping, False, square and grouping == "m")
        err = ((got.cpu().float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).nan_to_num(1e30).max()
        if not err <= 2.0 ** -8:  # bf16's rounding (the sums are exact); a NaN or a stale value fails
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
            return (f"this torch ({torch.__version__}) gives wrong values in torch._scaled_mm with "
                    f"{_form_name(square)} scales on {name} ({grouping}-grouped, (M, K, N) = {shape}: relative error "
                    f"{err.item():.3g})")
    return None


def blockwise_backend(device) -> tuple:
    """(backend, why): which implementation of the blockwise GEMMs runs on ``device``:
    "scaled_mm" (torch._scaled_mm per expert with the same scales, on an sm90 GPU where this
    torch gives exact values with them: a probe, run once per device), "emulation" (the CPU),
    or None with the reason, naming what is missing (the node raises NotImplementedError with
    it)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "emulation", None
    if device.type != "cuda":
        return None, (f"the blockwise FP8 GEMMs run on Hopper GPUs (sm90), and on the CPU as an emulation; not on "
                      f"{device}")
    index = _index(device)
    if index not in _BACKENDS:  # once per device: each of the node's six GEMMs asks
        _BACKENDS[index] = _cuda_backend(torch.device("cuda", index))
    return _BACKENDS[index]


_BACKENDS = {}  # CUDA device index -> blockwise_backend's answer there


def _cuda_backend(device) -> tuple:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return None, (f"{torch.cuda.get_device_name(device)} is sm{major}{minor}: the blockwise FP8 grouped GEMMs are "
                      "taken on Hopper (sm90) only")
    why = _scaled_mm_refusal(device)
    return ("scaled_mm", None) if why is None else (None, why)


def blockwise_gmm(a, scale_a, b, scale_b, ends, grouping="m", out_transposed=False):
    """The blockwise recipe's FP8 grouped GEMM as the node calls it: e4m3 operands with float32
    dequantisation scales (value = q * scale) per tile of 128, every 128-deep K tile accumulated
    and added into float32 (the promotion), the sum rounded once to bf16. ``ends``: host ints, the
    experts' end rows (or end tokens) below; its GEMMs are per expert, so no device copy is
    taken.

    ``grouping="m"`` (forward and input gradients): a [T, K] row-major, scale_a [T, ceil(K / 128)]
    (1 x 128 row tiles; the view of [KB, T] storage, strides (1, T)), b [E, N, K] with K
    contiguous, scale_b [E, ceil(N / 128), ceil(K / 128)] (128 x 128 blocks), ends the experts'
    end rows -> [T, N], rows past the last end 0.

    ``grouping="k"`` (weight gradients): a [M, Tp] and b [N, Tp] with the tokens contiguous
    (each expert's tokens padded to a multiple of 128), scale_a [Tp / 128, M] and scale_b
    [Tp / 128, N] (128 x 1 column tiles), ends the padded end tokens -> [E, M, N], 0 for an
    expert without tokens; ``out_transposed``: the same values with out[e] column-major (the
    [E, N, M] storage transposed: the gradient of a weight held as its transpose).

    On Hopper torch._scaled_mm per expert with the same scales (without fast accumulation:
    cuBLAS's promoted blockwise GEMM), each expert's product written in place into the output.
    On the CPU its emulation, for tests and studies of the recipe (slow, not a speed path): each
    operand dequantised exactly per its tiles (the scales are powers of two), a float32 matmul per
    expert, rounded once to bf16."""
    backend, why = blockwise_backend(a.device)
    if backend is None:
        raise NotImplementedError(f"expertact.moe: the blockwise FP8 GEMMs cannot run here: {why}")
    if backend == "scaled_mm":
        square = grouping == "m" and square_weight_scales(a.device, scale_b.shape[-1])
        return _blockwise_per_expert(a, scale_a, b, scale_b, ends, grouping, out_transposed, square)
    return _blockwise_emulated(a, scale_a, b, scale_b, ends, grouping, out_transposed)


def _widened(q):
    """An e4m3 operand whose reduction (its last dim, at most 128 long) is one tile, as two:
    [..., C] -> [..., 2 * TILE], zero past C, so the second tile adds an exact 0 (why: the notes
    above _SCALE_ROWS)."""
    wide = torch.zeros((*q.shape[:-1], 2 * TILE), dtype=torch.uint8, device=q.device).view(_E4M3)
    wide[..., :q.shape[-1]] = q
    return wide


def _unit_tile(scale, dim=0):
    """The scales of a _widened operand: ``scale``, one tile along ``dim``, with a second tile of
    scale 1 (the zero tile's); contiguous."""
    return torch.cat([scale, torch.ones_like(scale)], dim)


def _mm_into(dst, a, b, **scales):
    """torch._scaled_mm's promoted bf16 product of a and b written to ``dst`` (contiguous): in
    place where dst starts on a _OUT_ALIGN boundary, else through an allocation of its own."""
    kw = dict(out_dtype=torch.bfloat16, use_fast_accum=False, **scales)
    if dst.data_ptr() % _OUT_ALIGN == 0:
        torch._scaled_mm(a, b, out=dst, **kw)
    else:
        dst.copy_(torch._scaled_mm(a, b, **kw))


def _blockwise_per_expert(a, scale_a, b, scale_b, ends, grouping, out_transposed, square=False):
    """blockwise_gmm by torch._scaled_mm per expert, in the forms its probe checks (the notes
    above _SCALE_ROWS): A's scales 1 x 128 along K, outer-dim-major ([rows, KB] with strides
    (1, rows), rows a multiple of 4); B given transposed (column-major) with its scales 128 x 128
    (``square``: KB a multiple of 4) or 1 x 128. Each expert's product goes into its rows (or its
    block) of one output allocated uninitialised, in place where they start on a 256-byte
    boundary (_mm_into): every element is written, by a GEMM or as a zero (rows past the last
    end, an expert without tokens). Each ``out=`` is a
    whole range of rows (or a whole block) of a contiguous output, so itself contiguous:
    torch._scaled_mm runs cuBLAS on a contiguous copy of an ``out`` that is not dense and never
    copies it back (ATen's cublasCommonArgs and _scaled_gemm), which would leave it unwritten."""
    mm = torch._scaled_mm
    kw = dict(out_dtype=torch.bfloat16, use_fast_accum=False)
    start = 0
    if grouping == "m":
        (T, K), N = a.shape, b.shape[1]
        if K <= TILE:  # one K tile: both operands widened to two (_widened), once for every expert
            return _blockwise_per_expert(_widened(a), _unit_tile(scale_a.t()).t(), _widened(b),
                                         _unit_tile(scale_b, -1), ends, grouping, False, False)
        out = torch.empty((T, N), dtype=torch.bfloat16, device=a.device)
        last = ends[-1] if ends else 0
        if last < T:
            out[last:].zero_()
        for e, end in enumerate(ends):
            n = end - start
            if n > 0:
                if square:  # [KB, NB] with strides (1, KB): b[e]^T's 128 x 128 scales
                    sb = scale_b[e].contiguous().t()
                else:  # [KB, N]: b[e]'s rows' 1 x 128
                    sb = scale_b[e].t().repeat_interleave(TILE, 1)[:, :N].contiguous()
                body, tail = n - n % _SCALE_ROWS, n % _SCALE_ROWS
                if body:  # an expert's [body, KB] scales as their own outer-dim-major block
                    rows = slice(start, start + body)
                    sa = scale_a[rows].t().contiguous().t()
                    _mm_into(out[rows], a[rows], b[e].t(), scale_a=sa, scale_b=sb)
                if tail:  # its last 1 to 3 rows as 4: zero rows of scale 1, their products dropped
                    rows = slice(start + body, end)
                    pa = torch.zeros((_SCALE_ROWS, K), dtype=torch.uint8, device=a.device).view(_E4M3)
                    pa[:tail] = a[rows]
                    sa = torch.ones((scale_a.shape[1], _SCALE_ROWS), dtype=torch.float32, device=a.device)
                    sa[:, :tail] = scale_a[rows].t()
                    out[rows] = mm(pa, b[e].t(), scale_a=sa.t(), scale_b=sb, **kw)[:tail]
            start = end
        return out
    if out_transposed:  # out[e]^T = b_e a_e^T: the operands swapped
        return _blockwise_per_expert(b, scale_b, a, scale_a, ends, grouping, False).transpose(-2, -1)
    M, N = a.shape[0], b.shape[0]
    if M % _SCALE_ROWS or N % _SCALE_ROWS:  # the weight's dims: expert_mlp takes multiples of 16
        raise ValueError(f"expertact.moe: torch._scaled_mm's weight-gradient GEMM takes 1 x 128 scales whose leading "
                         f"dimensions, the weight's dims (here {M} and {N}), are multiples of {_SCALE_ROWS}")
    out = torch.empty((len(ends), M, N), dtype=torch.bfloat16, device=a.device)
    for e, end in enumerate(ends):
        if end > start:
            t0, t1 = start // TILE, end // TILE
            ae, be, sa, sb = a[:, start:end], b[:, start:end], scale_a[t0:t1], scale_b[t0:t1]
            if t1 - t0 == 1:  # an expert of one token tile: both operands widened to two (_widened)
                ae, be, sa, sb = _widened(ae), _widened(be), _unit_tile(sa), _unit_tile(sb)
            _mm_into(out[e], ae, be.t(), scale_a=sa.t(), scale_b=sb)
        else:
            out[e].zero_()
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
