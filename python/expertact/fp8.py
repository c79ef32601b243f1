"""expertact.fp8: rowwise float8 e4m3fn with power-of-two scales, for users composing their own
FP8 GEMMs (``torch._scaled_grouped_mm``), computed as torchao computes its FP8 grouped GEMMs'
operands (docs/spec.md section 10)::

    amax  = max |v| over the row (NaN ignored)
    s     = 2 ** floor(log2(float32(448 / float64(max(amax, 1e-12)))))
    q     = float8_e4m3fn(clamp(v * s, -448, 448))      (nearest even)
    scale = 1 / s                                         (float32: the GEMM's dequantisation scale)

A NaN element stays NaN in q; an infinite one gives s = 0 and scale = inf, so the row's GEMM
output is NaN, never finite garbage.

    q, scale = expertact.fp8.quantize_rowwise(t)                       # t [..., C]
    # also the per expert and column amax, in the same read, for quantize_colwise_grouped
    q, scale, amax = expertact.fp8.quantize_rowwise(x, col_amax_offsets=offsets, ends=ends)
    x_q, x_scale = expertact.fp8.quantize_colwise_grouped(x, offsets, pad_to=16, ends=ends, amax=amax)
    h_q, h_scale = expertact.fp8.glu_rowwise(gate_up, "swiglu_oai", layout="interleaved")
    h_q, h_scale = expertact.fp8.glu_rowwise(gate_up, "swiglu_oai", layout="interleaved",
                                             bias=b13, offsets=offsets)   # per-expert bias [E, 2F]
    # also the per expert and column amax of h as the bf16 forward writes it (h recomputed in
    # bf16 for the weight gradient then takes it: quantize_colwise_grouped(h, ..., amax=amax))
    h_q, h_scale, amax = expertact.fp8.glu_rowwise(gate_up, "swiglu", col_amax_offsets=offsets, ends=ends)
    # the activation's backward, quantised rowwise from float32 (+ the column amax, weights' grad)
    dg_q, dg_scale, dw, amax = expertact.fp8.glu_backward_rowwise(dh, gate_up, "swiglu",
                                   weights=w, weights_grad=True, offsets=offsets, col_amax=True)
    # per expert and column, each expert's rows padded to a multiple of 16 (the weight gradients)
    x_q, x_scale = expertact.fp8.quantize_colwise_grouped(x, offsets, pad_to=16, ends=ends)
    # the activation recomputed from gate_up and quantised so, without writing it; h_amax: its
    # per expert and column amax (quantize_rowwise(h, col_amax_offsets=offsets)[2])
    h_qc, h_cscale = expertact.fp8.glu_colwise_grouped(gate_up, "swiglu", offsets, pad_to=16, ends=ends,
                                                       amax=h_amax)
    offs16 = expertact.fp8.padded_offsets(offsets, 16)                 # on offsets' device

The blockwise operands (DeepSeek-V3's recipe: the same scale per tile of 128 values; 1 x 128 row
tiles, 128 x 1 column tiles over each expert's rows padded to multiples of 128, 128 x 128 weight
blocks)::

    x_q, x_s = expertact.fp8.quantize_row_tiles(x)                     # x_s [T, ceil(C / 128)]
    w_q, w_s = expertact.fp8.quantize_blocks(w13)                       # any strides: [E, R, C]
    h_q, h_s = expertact.fp8.glu_row_tiles(gate_up, "swiglu_oai", layout="interleaved")
    # backward: dy in row tiles and column tiles from one read; h recomputed in column tiles
    dy_cq, dy_cs, dy_q, dy_s = expertact.fp8.quantize_column_tiles_grouped(dy, offsets, ends=ends,
                                                                          row_tiles=True)
    h_cq, h_cs = expertact.fp8.glu_column_tiles_grouped(gate_up, "swiglu", offsets, ends=ends)
    dg_q, dg_s, dg_cq, dg_cs, dw = expertact.fp8.glu_backward_tiles(dh, gate_up, "swiglu", offsets=offsets,
                                                                    ends=ends, column_tiles=True)

CPU and CUDA, the same bytes and scales on both. No autograd: these are operand producers for
a custom FP8 backward.
"""
from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch

from . import _capi, _fp8_buffers, _ops
from ._args import ACTIVATIONS, check_ends, layout_code, preset_coeffs, tensor_arg
from ._capi import rows_view_ok

__all__ = ["quantize_rowwise", "quantize_colwise_grouped", "padded_offsets", "glu_rowwise", "glu_colwise_grouped",
           "glu_backward_rowwise", "DL_FLOAT8_E4M3FN",
           # the blockwise operands
           "TILE", "quantize_row_tiles", "quantize_column_tiles_grouped", "quantize_blocks", "glu_row_tiles",
           "glu_column_tiles_grouped", "glu_backward_tiles"]

#: DLPack 1.1's code of float8_e4m3fn (expertact_c.h: EXPERTACT_DL_FLOAT8_E4M3FN)
DL_FLOAT8_E4M3FN = _capi.DL_FLOAT8_E4M3FN


def quantize_rowwise(t: torch.Tensor, *, col_amax_offsets: Optional[torch.Tensor] = None, ends=None):
    """(q, scale): t [..., C] (float32, float16 or bfloat16) as float8_e4m3fn [..., C] with one
    float32 dequantisation scale per row ([...]); t ~= q.float() * scale[..., None].

    ``col_amax_offsets`` (int32 [E], the experts' cumulative end rows over t's rows, t taken
    as [T, C]): returns (q, scale, amax), amax float32 [E, C] the max |v| (NaN ignored) of
    each column over each expert's rows (0 for an expert without rows; rows past
    col_amax_offsets[-1] count for none), taken in the same read of t on a GPU. It is the
    amax :func:`quantize_colwise_grouped` starts from: pass it there as ``amax=`` (same
    offsets) to spare that call a read of t. ``ends``: col_amax_offsets' values as host ints
    (see :func:`quantize_colwise_grouped`; without it they are read on the host)."""
    where = "expertact.fp8.quantize_rowwise"
    tensor_arg("t", t)
    if t.dim() < 1:
        raise ValueError(f"{where}: t must have at least one dimension [..., C]")
    if ends is not None and col_amax_offsets is None:
        raise ValueError(f"{where}: ends goes with col_amax_offsets (got ends alone)")
    q, scale = _fp8_buffers.rowwise(t, t.shape[-1])
    if col_amax_offsets is None:
        _ops.fp8_quantize_rowwise(t, q, scale.view(-1))
        return q, scale
    offsets, _ = _grouped_offsets(col_amax_offsets, scale.numel(), t.device, ends, where, "col_amax_offsets")
    amax = _fp8_buffers.amax(offsets.numel(), t.shape[-1], t.device)
    _ops.fp8_quantize_rowwise(t, q, scale.view(-1), offsets, amax)
    return q, scale, amax


def _pad_arg(pad_to, where):
    try:
        P = None if isinstance(pad_to, bool) else operator.index(pad_to)
    except TypeError:
        P = None
    if P is None or not 1 <= P < 2 ** 31:
        raise ValueError(f"{where}: pad_to must be an int from 1 to 2**31 - 1 (got {pad_to!r})")
    return P


def padded_offsets(offsets, pad_to: int):
    """The cumulative end rows of the experts' blocks once each block is padded to a multiple
    of ``pad_to`` rows: ``sum over e' <= e of ceil(n_e' / pad_to) * pad_to`` (n_e: the rows of
    expert e), the ``offs`` of a GEMM over :func:`quantize_colwise_grouped`'s padded q.

    ``offsets``: the experts' cumulative end rows, either a sequence of ints (returns a list
    of ints, computed on the host) or an int32 tensor (returns an int32 tensor on its device,
    computed with torch ops: no host synchronisation on a GPU). The values are not checked
    here (quantize_colwise_grouped checks them)."""
    where = "expertact.fp8.padded_offsets"
    P = _pad_arg(pad_to, where)
    if isinstance(offsets, torch.Tensor):
        if offsets.dtype != torch.int32 or offsets.dim() != 1:
            raise ValueError(f"{where}: offsets must be a 1-D int32 tensor (got {offsets.dtype}, "
                             f"shape {tuple(offsets.shape)})")
    return _fp8_buffers.padded_offsets(offsets, P)


def _grouped_offsets(offsets, rows, device, ends, where, name="offsets"):
    """(offsets on ``device``, contiguous; the end rows as a host list), checked against the
    ``rows`` they index; ``name``: the argument's name in errors."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor (got {type(offsets).__name__})")
    if offsets.dtype != torch.int32:
        raise _capi.DTypeError(f"{where}: {name} has dtype {offsets.dtype}; it must be int32 "
                               f"({name}.to(torch.int32))")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{where}: {name} must be 1-D [E] with E >= 1 (got shape {tuple(offsets.shape)})")
    if ends is None:
        host = offsets.tolist()  # a device-to-host copy on a GPU
        check_ends(host, rows, where, name)
    else:
        try:
            host = [int(v) for v in ends]
        except (TypeError, ValueError):
            raise TypeError(f"{where}: ends must be a sequence of ints (got {type(ends).__name__})") from None
        if len(host) != offsets.numel():
            raise ValueError(f"{where}: ends has {len(host)} values; {name} has {offsets.numel()}")
        check_ends(host, rows, where, "ends")
    if offsets.device != device:
        offsets = offsets.to(device)
    return offsets.contiguous(), host


def _amax_arg(amax, E, C, cname, xname, device, where):
    """Checks a given per expert and column amax: a float32 [E, C] tensor on the input's device."""
    if not isinstance(amax, torch.Tensor):
        raise TypeError(f"{where}: amax must be a torch.Tensor (got {type(amax).__name__})")
    if amax.dtype != torch.float32:
        raise _capi.DTypeError(f"{where}: amax has dtype {amax.dtype}; it must be float32 [E, {cname}]")
    if tuple(amax.shape) != (E, C):
        raise ValueError(f"{where}: amax must be [E, {cname}] = [{E}, {C}] (got shape {tuple(amax.shape)})")
    if amax.device != device:
        raise ValueError(f"{where}: amax is on {amax.device}; {xname} is on {device}")


def _colwise_outputs(offsets, host, T, C, P, device, where):
    """(q_t [C, rows] e4m3, scale [E, C] float32, the padded offsets or None) of a column-wise
    quantisation of T rows padded to P per expert."""
    q_t, scale = _fp8_buffers.colwise(T, host, C, P, device, where)
    return q_t, scale, None if P == 1 else _fp8_buffers.padded_offsets(offsets, P)


def quantize_colwise_grouped(t: torch.Tensor, offsets: torch.Tensor, *, pad_to: int = 1,
                             ends=None, amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) per expert and column: t [T, C] (rows sorted by expert; ``offsets`` int32 [E],
    each expert's cumulative end row) quantised with one scale per expert and column, taken over
    that expert's rows (the operands of the weight-gradient GEMMs; for weights [E, K, N], pass
    them as [E * K, N] with offsets (e + 1) * K). scale: float32 [E, C]; t[r, c] ~= q[r', c] *
    scale[e(r), c], r' the output row of r. CPU and CUDA (same bytes).

    ``pad_to`` = 1: q is float8_e4m3fn [T, C] in column-major order (strides (1, T)), as
    torch._scaled_grouped_mm reads the reduction-major operand, r' = r; rows past offsets[-1]
    are 0.

    ``pad_to`` = P > 1: each expert's block of rows starts at a multiple of P: q is [Tp, C]
    column-major (strides (1, Tp)), Tp = sum over e of ceil(n_e / P) * P (n_e: expert e's
    rows; rows past offsets[-1] are left out), expert e's rows start at row
    ``padded_offsets(offsets, P)[e - 1]`` (0 for e = 0), and the rest of its block is 0
    (bytes 0x00). torch._scaled_grouped_mm's 2d x 2d form (the weight gradients) takes groups
    of a multiple of 16 along its reduction dimension on sm90: pad_to=16 with
    ``offs=padded_offsets(offsets, 16)``.

    ``ends``: offsets' values as a host sequence of ints (the caller's copy). Without it the
    offsets are read on the host (a device-to-host copy, which synchronises, on a GPU) for
    their checks and Tp; with it nothing is read from the device (ends must then hold
    offsets' values: if they differ, the output is wrong, never written out of bounds).
    The padded offsets the kernels take are computed from ``offsets`` on its device.

    ``amax`` (float32 [E, C] on t's device, e.g. the third output of
    ``quantize_rowwise(t, col_amax_offsets=offsets)``): the per expert and column amax; the
    scales come from it and t is read once instead of twice. With t's own amax the result is
    the same bytes and scales as without it."""
    where = "expertact.fp8.quantize_colwise_grouped"
    tensor_arg("t", t)
    if t.dim() != 2:
        raise ValueError(f"{where}: t must be 2-D [T, C] (got shape {tuple(t.shape)})")
    P = _pad_arg(pad_to, where)
    T, C = t.shape
    offsets, host = _grouped_offsets(offsets, T, t.device, ends, where)
    E = offsets.numel()
    if amax is not None:
        _amax_arg(amax, E, C, "C", "t", t.device, where)
    q_t, scale, pads = _colwise_outputs(offsets, host, T, C, P, t.device, where)
    _ops.fp8_quantize_colwise_grouped(t, offsets, pads, q_t, scale, amax)
    return q_t.t(), scale


def _glu_tensors(gate_up, up, weights, bias):
    """The activation forms' tensor arguments (TypeError naming one that is not a tensor)."""
    tensor_arg("gate_up" if up is None else "gate", gate_up)
    tensor_arg("up", up, optional=True)
    tensor_arg("weights", weights, optional=True)
    tensor_arg("bias", bias, optional=True)


def _glu_2d(gate_up, up, where):
    """(the input's name, T, F) of a per expert form's 2-D input: gate_up [T, 2F], or gate [T, F]
    with up."""
    xname = "gate_up" if up is None else "gate"
    if gate_up.dim() != 2:
        raise ValueError(f"{where}: {xname} must be 2-D [T, {'2F' if up is None else 'F'}] "
                         f"(got shape {tuple(gate_up.shape)})")
    T = gate_up.shape[0]
    F = gate_up.shape[1] if up is not None else gate_up.shape[1] // 2
    return xname, T, F


def glu_rowwise(gate_up: torch.Tensor, activation: str = "swiglu", *, up: Optional[torch.Tensor] = None,
                alpha: Optional[float] = None, limit: Optional[float] = None, layout: Optional[str] = None,
                weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                offsets: Optional[torch.Tensor] = None, ends=None, col_amax_offsets: Optional[torch.Tensor] = None):
    """(h_q, scale): the gated activation of gate_up [..., 2F] (or gate [..., F] with ``up``,
    the separate layout) times ``weights``, quantised per row from its float32 values (one
    rounding) as :func:`quantize_rowwise` does: h_q float8_e4m3fn [..., F], scale float32 [...].
    ``activation`` is a preset name; ``alpha`` / ``limit`` for the forms that read them
    (default 1.702 and 7.0).

    ``bias`` [E, 2F] (gate_up's dtype, in gate_up's column layout; gate's columns first for the
    separate layout) with ``offsets`` (int32 [E], each expert's cumulative end row over the
    rows of gate_up): bias[e] is added to the rows of expert e before the activation, in
    float32, as functional.glu(..., bias=, offsets=) does; rows past offsets[-1] take none.

    ``col_amax_offsets`` (int32 [E], the experts' cumulative end rows, as
    :func:`quantize_rowwise` takes them): returns (h_q, scale, amax), amax float32 [E, F] the
    max |h| (NaN ignored) of each column over each expert's rows (0 for an expert without
    rows; rows past col_amax_offsets[-1] count for none), h as the activation's forward
    (functional.glu with the same arguments) writes it in gate_up's dtype: bit for bit
    ``quantize_rowwise(h, col_amax_offsets=col_amax_offsets)[2]`` of that output, the amax
    :func:`quantize_colwise_grouped` takes as ``amax=`` for h recomputed in gate_up's dtype,
    computed in the same pass on a GPU. h_q and scale are unchanged by it. With a bias,
    col_amax_offsets must be ``offsets`` itself (the same tensor: the rows' experts are
    offsets'). ``ends``: the offsets' (or col_amax_offsets') values as host ints (see
    :func:`quantize_colwise_grouped`)."""
    where = "expertact.fp8.glu_rowwise"
    _glu_tensors(gate_up, up, weights, bias)
    if (bias is None) != (offsets is None):
        raise ValueError(f"{where}: bias and offsets go together (got only {'bias' if offsets is None else 'offsets'})")
    if ends is not None and offsets is None and col_amax_offsets is None:
        raise ValueError(f"{where}: ends goes with offsets or col_amax_offsets (got ends alone)")
    if col_amax_offsets is not None and offsets is not None and not _same_tensor(col_amax_offsets, offsets):
        raise ValueError(f"{where}: col_amax_offsets must be offsets itself (the same tensor) when a bias is "
                         "given: the rows' experts are offsets'")
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, where)
    code = layout_code(layout, up is None)
    if gate_up.dim() < 1:
        raise ValueError(f"{where}: gate_up must have at least one dimension")
    cols = gate_up.shape[-1] if up is not None else gate_up.shape[-1] // 2
    q, scale = _fp8_buffers.rowwise(gate_up, cols)
    offs = amax = None
    if offsets is not None or col_amax_offsets is not None:
        name = "offsets" if offsets is not None else "col_amax_offsets"
        offs, _ = _grouped_offsets(offsets if offsets is not None else col_amax_offsets, scale.numel(),
                                   gate_up.device, ends, where, name)
        if col_amax_offsets is not None:
            amax = _fp8_buffers.amax(offs.numel(), cols, gate_up.device)
    _ops.fp8_glu_rowwise(gate_up, up, weights, bias, offs, q, scale.view(-1), amax, code, act, a, lim, beta)
    return (q, scale) if amax is None else (q, scale, amax)


def _same_tensor(a, b) -> bool:
    """Whether a and b are one tensor (or views of the same elements)."""
    if a is b:
        return True
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def glu_colwise_grouped(gate_up: torch.Tensor, activation: str, offsets: torch.Tensor, *,
                        up: Optional[torch.Tensor] = None, alpha: Optional[float] = None,
                        limit: Optional[float] = None, layout: Optional[str] = None,
                        weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                        pad_to: int = 1, ends=None,
                        amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): the activation h = act(gate_up [+ bias[e]]) * weights of gate_up [T, 2F]
    (or gate [T, F] with ``up``, the separate layout), in gate_up's dtype as the activation's
    forward writes it (``functional.glu`` with the preset's parameters, ``bias=``,
    ``offsets=``), quantised per expert and column as :func:`quantize_colwise_grouped` does:
    exactly ``quantize_colwise_grouped(h, offsets, pad_to=pad_to, ends=ends)`` (q float8_e4m3fn
    [T or Tp, F] column-major, scale float32 [E, F]), without writing h. It is the weight
    gradient's operand of the second GEMM in an FP8 backward, recomputed from gate_up in one
    read instead of a bf16 recompute followed by a column-wise pass.

    ``activation``, ``alpha``, ``limit``, ``layout``, ``weights``, ``bias`` as in
    :func:`glu_rowwise` (``bias`` [E, 2F] goes with ``offsets``, int32 [E], the experts'
    cumulative end rows, which also group the quantisation); ``pad_to``, ``ends`` as in
    :func:`quantize_colwise_grouped`.

    ``amax`` (float32 [E, F] on gate_up's device): the max |h| of each column over each expert's
    rows, of h in gate_up's dtype, as ``quantize_rowwise(h, col_amax_offsets=offsets)[2]``
    gives it; a forward that quantises h can keep it. The fused path needs it: its scales must
    be known before h is computed. Without it (None) h is computed here with
    ``functional.glu`` and quantised by :func:`quantize_colwise_grouped` (h written once, read
    twice): the same result. CPU and CUDA write the same bytes for the same h; h itself may
    differ in its last bit between them as the activation's forward does."""
    where = "expertact.fp8.glu_colwise_grouped"
    _glu_tensors(gate_up, up, weights, bias)
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, where)
    code = layout_code(layout, up is None)
    P = _pad_arg(pad_to, where)
    xname, T, F = _glu_2d(gate_up, up, where)
    offsets, host = _grouped_offsets(offsets, T, gate_up.device, ends, where)
    E = offsets.numel()
    if amax is None:
        from . import functional
        name = next(k for k, v in ACTIVATIONS.items() if v == act)
        with torch.no_grad():
            h = functional.glu(gate_up, up, layout=layout, activation=name, alpha=a, limit=lim, beta=beta,
                               weights=weights, bias=bias, offsets=None if bias is None else offsets)
        return quantize_colwise_grouped(h, offsets, pad_to=P, ends=host)
    _amax_arg(amax, E, F, "F", xname, gate_up.device, where)
    q_t, scale, pads = _colwise_outputs(offsets, host, T, F, P, gate_up.device, where)
    _ops.fp8_glu_colwise_grouped(gate_up, up, weights, bias, offsets, pads, q_t, scale, amax, code, act, a, lim, beta)
    return q_t.t(), scale


def _dgate_up_out_arg(dgate_up_out, gate_up, where):
    """Checks dgate_up_out (when given): gate_up's shape, with rows it can be written through
    (no copy)."""
    if dgate_up_out is None:
        return
    if dgate_up_out.dim() < 1 or not rows_view_ok(dgate_up_out) or dgate_up_out.shape != gate_up.shape:
        raise ValueError(f"{where}: dgate_up_out must have gate_up's shape {tuple(gate_up.shape)} and rows it can "
                         f"be written through (got shape {tuple(dgate_up_out.shape)}, strides "
                         f"{dgate_up_out.stride()})")


def _backward_args(dh, gate_up, activation, alpha, limit, layout, weights, weights_grad, bias, offsets, ends,
                   dgate_up_out, per_expert, per_expert_wanted, where):
    """The activation backwards' argument checks: (act, alpha, limit, beta, layout code).
    ``per_expert``: the name of the flag whose output needs offsets (its value: per_expert_wanted)."""
    tensor_arg("dh", dh)
    tensor_arg("gate_up", gate_up)
    tensor_arg("weights", weights, optional=True)
    tensor_arg("bias", bias, optional=True)
    tensor_arg("dgate_up_out", dgate_up_out, optional=True)
    if weights_grad and weights is None:
        raise ValueError(f"{where}: weights_grad=True needs weights")
    if bias is not None and offsets is None:
        raise ValueError(f"{where}: bias goes with offsets (got bias alone)")
    if per_expert_wanted and offsets is None:
        raise ValueError(f"{where}: {per_expert}=True needs offsets")
    if ends is not None and offsets is None:
        raise ValueError(f"{where}: ends goes with offsets (got ends alone)")
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, where)
    code = layout_code(layout, True)
    if gate_up.dim() < 1:
        raise ValueError(f"{where}: gate_up must have at least one dimension")
    return act, a, lim, beta, code


def glu_backward_rowwise(dh: torch.Tensor, gate_up: torch.Tensor, activation: str = "swiglu", *,
                         alpha: Optional[float] = None, limit: Optional[float] = None, layout: Optional[str] = None,
                         weights: Optional[torch.Tensor] = None, weights_grad: bool = False,
                         bias: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None, ends=None,
                         col_amax: bool = False, dgate_up_out: Optional[torch.Tensor] = None):
    """(dg_q, dg_scale, dweights or None, amax or None): the gradient of gate_up [..., 2F] of
    h = act(gate_up [+ bias[e]]) * weights, given dh [..., F] (gate_up's dtype), computed in
    float32 (the math of the activation's backward) and quantised per row from those float32
    values (one rounding) as :func:`quantize_rowwise` does, without writing it in gate_up's
    dtype: dg_q float8_e4m3fn [..., 2F] in gate_up's column layout (``layout``: "halves",
    "up_first" or "interleaved"; packed gate_up only), dg_scale float32 [...].

    ``weights_grad`` (needs ``weights``): also the routing weights' gradient, float32 [...]
    (the row's sum of dh * act * (up + beta), in float32). ``col_amax`` (needs ``offsets``):
    also amax float32 [E, 2F], the max |gradient| (NaN ignored) of each column over each
    expert's rows, of the gradient rounded to gate_up's dtype (``dgate_up_out``'s values:
    ``quantize_rowwise(dgate_up_out, col_amax_offsets=)[2]`` bit for bit): pass it to
    :func:`quantize_colwise_grouped` of that tensor as ``amax=``. ``bias`` [E, 2F] with ``offsets`` (int32
    [E], the experts' cumulative end rows): as in :func:`glu_rowwise`; the bias's own gradient
    is not computed here (``functional`` / the biased backward computes it where needed).
    ``ends``: offsets' values as host ints (see :func:`quantize_colwise_grouped`).
    ``dgate_up_out`` (gate_up's shape and dtype, contiguous rows): also receives the gradient
    rounded to gate_up's dtype, as the activation's backward writes it (e.g. for
    :func:`quantize_colwise_grouped`, which needs the values again); it may be ``gate_up``
    itself (in place: gate_up is overwritten), no other output or input may share its bytes. CPU and CUDA quantise
    alike (dg_q and dg_scale are the same function of the float32 gradient); that gradient
    differs in its last bits between them as the activation's backward does (the GPU's exp and
    division are approximate forms), and the weights' gradient by its float32 sum's order."""
    where = "expertact.fp8.glu_backward_rowwise"
    act, a, lim, beta, code = _backward_args(dh, gate_up, activation, alpha, limit, layout, weights, weights_grad,
                                             bias, offsets, ends, dgate_up_out, "col_amax", col_amax, where)
    q, scale = _fp8_buffers.rowwise(gate_up, gate_up.shape[-1])
    dw = None
    if weights_grad:
        dw = torch.empty(scale.shape, dtype=torch.float32, device=gate_up.device)
    amax = None
    if offsets is not None:
        offsets, _ = _grouped_offsets(offsets, scale.numel(), gate_up.device, ends, where)
        if col_amax:
            amax = _fp8_buffers.amax(offsets.numel(), gate_up.shape[-1], gate_up.device)
    _dgate_up_out_arg(dgate_up_out, gate_up, where)
    _ops.fp8_glu_backward_rowwise(dh, gate_up, weights, bias, offsets, q, scale.view(-1),
                                  None if dw is None else dw.view(-1), amax, dgate_up_out, code, act, a, lim, beta)
    return q, scale, dw, amax


# ---------------------------------------------------------------------------
# The blockwise operands (DeepSeek-V3's recipe; docs/notes/fp8-recipes.md, "The blockwise operand
# formats"): the rowwise recipe's power-of-two scale per tile of 128 values. Row tiles (1 x 128,
# the token-major operands of the forward and input-gradient GEMMs): q [T, C] with scale
# [T, ceil(C / 128)], a view of [ceil(C / 128), T] storage (strides (1, T)), the layout
# torch._scaled_mm takes for 1 x 128 scales. Column tiles (128 x 1 over one expert's rows, the
# weight-gradient GEMMs' operands): each expert's rows padded to a multiple of 128, q [Tp, C]
# column-major (strides (1, Tp)) with scale [Tp / 128, C]. Weight blocks (128 x 128): q
# [E, R, C] with scale [E, ceil(R / 128), ceil(C / 128)]. A tile at an edge takes what is
# there; an all-zero tile has scale 2^-48; an infinite value makes its tile's scale inf.
# ---------------------------------------------------------------------------

#: The tile edge of the blockwise operands.
TILE = _fp8_buffers.TILE


def _row_tile_outputs(like, cols):
    """(q [..., cols] e4m3, scale storage [KB, T] float32, scale as the [..., KB] view)."""
    return _fp8_buffers.row_tiles(like, cols)


def _column_tile_outputs(offsets, host, C, device, where):
    """(q_t [C, Tp] e4m3, scale [Tp / 128, C] float32, the 128-padded offsets on the device)."""
    q_t, scale = _fp8_buffers.column_tiles(host, C, device, where)
    return q_t, scale, padded_offsets(offsets, TILE)


def quantize_row_tiles(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): t [..., C] (float32, float16 or bfloat16) in 1 x 128 row tiles: q
    float8_e4m3fn [..., C], scale float32 [..., ceil(C / 128)] (for t [T, C]: [T, KB] with
    strides (1, T)), scale[r, k] the dequantisation scale of t[r, 128 k : 128 k + 128] (the last
    tile partial when C is not a multiple of 128): t ~= q.float() * scale repeated 128 times along
    the columns. CPU and CUDA (same bytes)."""
    tensor_arg("t", t)
    if t.dim() < 1:
        raise ValueError("expertact.fp8.quantize_row_tiles: t must have at least one dimension [..., C]")
    q, store, scale = _row_tile_outputs(t, t.shape[-1])
    _ops.fp8_quantize_row_tiles(t, q, store)
    return q, scale


def quantize_column_tiles_grouped(t: torch.Tensor, offsets: torch.Tensor, *, ends=None, row_tiles: bool = False):
    """(q, scale): t [T, C] (rows sorted by expert; ``offsets`` int32 [E], each expert's
    cumulative end row) in 128 x 1 column tiles over each expert's rows, each expert's rows padded
    to a multiple of 128 (the operands of the weight-gradient GEMMs, whose reduction runs over an
    expert's rows): q float8_e4m3fn [Tp, C] column-major (strides (1, Tp)), Tp = sum over e of
    ceil(n_e / 128) * 128 (n_e: expert e's rows), expert e's rows from row
    ``padded_offsets(offsets, 128)[e - 1]`` (0 for e = 0) on, then 0x00 to its block's end; rows
    past offsets[-1] are left out. scale float32 [Tp / 128, C]: row j the scales of q's rows
    128 j .. 128 j + 127 per column.

    ``row_tiles=True``: returns (q, scale, row_q, row_scale), also t's row tiles as
    :func:`quantize_row_tiles` gives them (every row), from the same read of t (x in backward, dy:
    both operands at once). ``ends``: offsets' values as host ints (see
    :func:`quantize_colwise_grouped`)."""
    where = "expertact.fp8.quantize_column_tiles_grouped"
    tensor_arg("t", t)
    if t.dim() != 2:
        raise ValueError(f"{where}: t must be 2-D [T, C] (got shape {tuple(t.shape)})")
    T, C = t.shape
    offsets, host = _grouped_offsets(offsets, T, t.device, ends, where)
    q_t, scale, pads = _column_tile_outputs(offsets, host, C, t.device, where)
    if not row_tiles:
        _ops.fp8_quantize_column_tiles_grouped(t, offsets, pads, q_t, scale)
        return q_t.t(), scale
    q, store, row_scale = _row_tile_outputs(t, C)
    _ops.fp8_quantize_column_tiles_grouped(t, offsets, pads, q_t, scale, q, store)
    return q_t.t(), scale, q, row_scale


def quantize_blocks(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): weights w [E, R, C] (or [R, C]; float32, float16 or bfloat16, any strides:
    e.g. the transposed view of an [E, C, R] parameter, read in place) in 128 x 128 blocks: q
    float8_e4m3fn [E, R, C] contiguous, scale float32 [E, ceil(R / 128), ceil(C / 128)] (without
    E for a 2-D w). A block's scale is the same in both orientations: ``q.transpose(-1, -2)``
    with ``scale.transpose(-1, -2)`` is the transposed weight's quantisation."""
    where = "expertact.fp8.quantize_blocks"
    tensor_arg("w", w)
    if w.dim() not in (2, 3):
        raise ValueError(f"{where}: w must be [E, R, C] or [R, C] (got shape {tuple(w.shape)})")
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    E, R, C = w3.shape
    q, scale = _fp8_buffers.blocks(E, R, C, w.device)
    # The 2-D views by their sizes, never -1: with C = 0 both are empty and -1 is ambiguous.
    # The library checks an empty w like any other and launches nothing for it.
    _ops.fp8_quantize_blocks(w3, q.view(E * R, C), scale.view(E * scale.shape[1], scale.shape[2]))
    return (q, scale) if w.dim() == 3 else (q[0], scale[0])


def glu_row_tiles(gate_up: torch.Tensor, activation: str = "swiglu", *, up: Optional[torch.Tensor] = None,
                  alpha: Optional[float] = None, limit: Optional[float] = None, layout: Optional[str] = None,
                  weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  offsets: Optional[torch.Tensor] = None, ends=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h_q, scale): the gated activation of gate_up [..., 2F] (or gate [..., F] with ``up``)
    times ``weights``, quantised in 1 x 128 row tiles from its float32 values (one rounding), as
    :func:`quantize_row_tiles` quantises a tensor: h_q float8_e4m3fn [..., F], scale float32
    [..., ceil(F / 128)] (strides (1, T) for 2-D gate_up). The arguments as in
    :func:`glu_rowwise` (``bias`` [E, 2F] with ``offsets``)."""
    where = "expertact.fp8.glu_row_tiles"
    _glu_tensors(gate_up, up, weights, bias)
    if (bias is None) != (offsets is None):
        raise ValueError(f"{where}: bias and offsets go together (got only {'bias' if offsets is None else 'offsets'})")
    if ends is not None and offsets is None:
        raise ValueError(f"{where}: ends goes with offsets (got ends alone)")
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, where)
    code = layout_code(layout, up is None)
    if gate_up.dim() < 1:
        raise ValueError(f"{where}: gate_up must have at least one dimension")
    cols = gate_up.shape[-1] if up is not None else gate_up.shape[-1] // 2
    q, store, scale = _row_tile_outputs(gate_up, cols)
    if offsets is not None:
        offsets, _ = _grouped_offsets(offsets, store.shape[1], gate_up.device, ends, where)
    _ops.fp8_glu_row_tiles(gate_up, up, weights, bias, offsets, q, store, code, act, a, lim, beta)
    return q, scale


def glu_column_tiles_grouped(gate_up: torch.Tensor, activation: str, offsets: torch.Tensor, *,
                             up: Optional[torch.Tensor] = None, alpha: Optional[float] = None,
                             limit: Optional[float] = None, layout: Optional[str] = None,
                             weights: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                             ends=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): the activation h = act(gate_up [+ bias[e]]) * weights of gate_up [T, 2F] (or
    gate [T, F] with ``up``), in gate_up's dtype as the activation's forward writes it
    (``functional.glu`` with the preset's parameters, ``bias=``, ``offsets=``), in 128 x 1 column
    tiles: exactly ``quantize_column_tiles_grouped(h, offsets, ends=ends)`` (q float8_e4m3fn
    [Tp, F] column-major, scale float32 [Tp / 128, F]), without writing h (gate_up read once): the
    second weight gradient's operand, recomputed in backward. ``offsets`` group the rows and are
    the bias's. CPU and CUDA write the same bytes for the same h; h itself may differ in its last
    bit between them as the activation's forward does."""
    where = "expertact.fp8.glu_column_tiles_grouped"
    _glu_tensors(gate_up, up, weights, bias)
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, where)
    code = layout_code(layout, up is None)
    _, T, F = _glu_2d(gate_up, up, where)
    offsets, host = _grouped_offsets(offsets, T, gate_up.device, ends, where)
    q_t, scale, pads = _column_tile_outputs(offsets, host, F, gate_up.device, where)
    _ops.fp8_glu_column_tiles_grouped(gate_up, up, weights, bias, offsets, pads, q_t, scale, code, act, a, lim, beta)
    return q_t.t(), scale


def glu_backward_tiles(dh: torch.Tensor, gate_up: torch.Tensor, activation: str = "swiglu", *,
                       alpha: Optional[float] = None, limit: Optional[float] = None, layout: Optional[str] = None,
                       weights: Optional[torch.Tensor] = None, weights_grad: bool = False,
                       bias: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None, ends=None,
                       column_tiles: bool = False, dgate_up_out: Optional[torch.Tensor] = None):
    """(q, scale, col_q, col_scale, dweights): the gradient of gate_up [..., 2F] of h =
    act(gate_up [+ bias[e]]) * weights, given dh [..., F] (gate_up's dtype), computed in float32
    and quantised from those values (one rounding each) without writing it in gate_up's dtype:
    q float8_e4m3fn [..., 2F] in 1 x 128 row tiles along the packed columns (gate_up's column
    layout; packed layouts only) with scale float32 [..., ceil(2F / 128)] as
    :func:`quantize_row_tiles` gives them, for the input gradient's GEMM.

    ``column_tiles=True`` (needs ``offsets``; 2-D gate_up): also col_q [Tp, 2F] and col_scale
    [Tp / 128, 2F], the gradient's 128 x 1 column tiles over each expert's rows as
    :func:`quantize_column_tiles_grouped` gives them, for the weight gradient's GEMM, from the same
    pass (else None, None). ``weights_grad`` (needs ``weights``): also the routing weights'
    gradient, float32 [...] (the row's float32 sum of dh * act * (up + beta) in a fixed order:
    the same bits from run to run; else None). ``bias`` [E, 2F] with ``offsets``: as in
    :func:`glu_rowwise` (its own gradient is not computed here). ``ends``: offsets' values as host
    ints. ``dgate_up_out`` (gate_up's shape and dtype, rows it can be written through, apart from
    gate_up): also receives the gradient rounded to gate_up's dtype. CPU and CUDA quantise alike;
    the float32 gradient differs in its last bits between them as the activation's backward
    does, and the weights' gradient by its sum's order."""
    where = "expertact.fp8.glu_backward_tiles"
    act, a, lim, beta, code = _backward_args(dh, gate_up, activation, alpha, limit, layout, weights, weights_grad,
                                             bias, offsets, ends, dgate_up_out, "column_tiles", column_tiles, where)
    C = gate_up.shape[-1]
    q, store, scale = _row_tile_outputs(gate_up, C)
    T = store.shape[1]
    dw = torch.empty(gate_up.shape[:-1], dtype=torch.float32, device=gate_up.device) if weights_grad else None
    q_t = col_scale = pads = None
    if offsets is not None:
        offsets, host = _grouped_offsets(offsets, T, gate_up.device, ends, where)
        if column_tiles:
            if gate_up.dim() != 2:
                raise ValueError(f"{where}: column_tiles=True takes a 2-D gate_up [T, 2F] (got shape "
                                 f"{tuple(gate_up.shape)})")
            q_t, col_scale, pads = _column_tile_outputs(offsets, host, C, gate_up.device, where)
    _dgate_up_out_arg(dgate_up_out, gate_up, where)
    _ops.fp8_glu_backward_tiles(dh, gate_up, weights, bias, offsets, pads, q, store, q_t, col_scale,
                                None if dw is None else dw.view(-1), dgate_up_out, code, act, a, lim, beta)
    return q, scale, None if q_t is None else q_t.t(), col_scale, dw
