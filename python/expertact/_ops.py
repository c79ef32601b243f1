"""Every kernel body of the package, in one place: each takes torch tensors (and the
operation's numeric arguments), allocates what it returns, describes its operands in the
per-thread frame of _capi and makes the one C call, on the current stream of the tensors'
own device. No autograd, dispatch or argument policy here: the torch operators (_library),
the autograd nodes (_autograd, moe) and the public functions (functional, fp8) call these.

An operand the library cannot read in place (leading dimensions that do not collapse into
one row stride) is copied once by _capi's description; an in-place output is then written
through its copy and copied back.
"""
from __future__ import annotations

from ctypes import byref, c_size_t, c_void_p

import torch

from . import _capi

__all__ = [
    "glu_forward", "glu_backward", "glu_backward_inplace", "glu_forward_bias", "glu_backward_bias",
    "expert_bias_forward", "expert_bias_backward", "fp8_quantize_rowwise", "fp8_quantize_colwise_grouped",
    "fp8_glu_rowwise", "fp8_glu_colwise_grouped", "fp8_glu_backward_rowwise",
    # FP8 blockwise operands
    "fp8_quantize_row_tiles", "fp8_quantize_column_tiles_grouped", "fp8_quantize_blocks", "fp8_glu_row_tiles",
    "fp8_glu_column_tiles_grouped", "fp8_glu_backward_tiles",
]

_LIB = _capi.LIB
_FRAME = _capi.FRAME
_raise = _capi.raise_for
_check = _capi.check
_put = _capi.put
_vec = _capi.put_vector
_params = _capi.put_params
_pack = _capi.pack_tensor_into
_pack_params = _capi.pack_params
_as_rows = _capi.as_rows
_as_vector = _capi.as_vector
_tail = _capi.tail
_stream = _capi.stream_of
_int32 = _capi.int32
_SEPARATE = _capi.LAYOUT_SEPARATE
_fwd = _LIB.expertact_glu_forward
_bwd = _LIB.expertact_glu_backward
# The activation's slots: x, up, weights, out (grad_x in backward), grad_up, grad_weights, grad_out.
_X, _UP, _W, _OUT, _GU, _GW, _DY = (_capi.SLOT_OFFSET[i] for i in range(7))


def _name(layout, grad=False):
    packed = layout != _SEPARATE
    return ("grad_" if grad else "") + ("gate_up" if packed else "gate")


# ---------------------------------------------------------------------------
# The activation (the bodies of the torch operators expertact::glu, glu_backward, glu_backward_)
# ---------------------------------------------------------------------------


def glu_forward(x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    """out [..., F] = glu(x (, up)) * weights, in x's dtype and shape but for the last dim."""
    x, rows, cols, xs = _as_rows(x, _name(layout))
    if up is not None:
        up, urows, ucols, us = _as_rows(up, "up")
    if weights is not None:
        weights, wn, wst = _as_vector(weights)
    shape = x.shape
    f = cols if layout == _SEPARATE else cols // 2
    out = x.new_empty(rows, f) if len(shape) == 2 else x.new_empty((*shape[:-1], f))
    fr = _FRAME
    buf = fr.buf
    _pack_params(buf, act, alpha, limit, beta)
    tail = _tail(x)
    _pack(buf, _X, x.data_ptr(), rows, cols, xs, tail)
    r_up = r_w = None
    if up is not None:
        _pack(buf, _UP, up.data_ptr(), urows, ucols, us, _tail(up))
        r_up = fr.slot[1]
    if weights is not None:
        _pack(buf, _W, weights.data_ptr(), wn, 1, wst, _tail(weights))
        r_w = fr.slot[2]
    _pack(buf, _OUT, out.data_ptr(), rows, f, f, tail)  # out: x's dtype and device
    status = _fwd(fr.params, _int32(layout), fr.slot[0], r_up, r_w, fr.slot[3], _stream(x))
    if status:
        _raise(status)
    return out


def _backward_call(grad_out, x, up, weights, grad_x, grad_up, grad_weights, layout, act, alpha, limit, beta):
    """Describes a backward call and makes it. x, up, grad_out: (t, rows, cols, stride) from
    as_rows; weights: (t, size, stride) from as_vector; grad_x / grad_up: the same tuples, or
    the input's own tuple for in place; grad_weights: (t, size, stride) or None."""
    fr = _FRAME
    buf = fr.buf
    slot = fr.slot
    _pack_params(buf, act, alpha, limit, beta)
    xt = x[0]
    tail = _tail(xt)
    _pack(buf, _X, xt.data_ptr(), x[1], x[2], x[3], tail)
    dy = grad_out[0]
    _pack(buf, _DY, dy.data_ptr(), grad_out[1], grad_out[2], grad_out[3], _tail(dy))
    r_up = r_gu = r_w = r_gw = None
    if up is not None:
        _pack(buf, _UP, up[0].data_ptr(), up[1], up[2], up[3], _tail(up[0]))
        r_up = slot[1]
    if weights is not None:
        _pack(buf, _W, weights[0].data_ptr(), weights[1], 1, weights[2], _tail(weights[0]))
        r_w = slot[2]
    if grad_x is x:  # in place: the input's own description
        r_gx, r_gu = slot[0], r_up
    else:
        _pack(buf, _OUT, grad_x[0].data_ptr(), grad_x[1], grad_x[2], grad_x[3], tail)
        r_gx = slot[3]
        if grad_up is not None:
            _pack(buf, _GU, grad_up[0].data_ptr(), grad_up[1], grad_up[2], grad_up[3], _tail(grad_up[0]))
            r_gu = slot[4]
    if grad_weights is not None:
        _pack(buf, _GW, grad_weights[0].data_ptr(), grad_weights[1], 1, grad_weights[2], _tail(grad_weights[0]))
        r_gw = slot[5]
    status = _bwd(fr.params, _int32(layout), slot[6], slot[0], r_up, r_w, r_gx, r_gu, r_gw, _stream(xt))
    if status:
        _raise(status)


def glu_backward(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta):
    """[grad_x, (grad_up,) (grad_weights)]: new tensors, grad_x and grad_up contiguous."""
    dy, x, up = _as_rows(grad_out, "grad_out"), _as_rows(x, _name(layout)), None if up is None else _as_rows(up, "up")
    w = None if weights is None else _as_vector(weights)
    xt = x[0]
    # Contiguous, as described below: a collapsible x is contiguous or has gaps between
    # rows (not dense), and empty_like gives a dense input's strides, else contiguous ones.
    gx = torch.empty_like(xt)
    gu = None if up is None else torch.empty_like(up[0])
    gw = None
    if weights_grad:
        # With no weights: a 0-element buffer, which the library refuses with its own message.
        gw = torch.empty_like(w[0]) if w is not None else xt.new_empty(0, dtype=torch.float32)
    res = [gx] if gu is None else [gx, gu]
    if gw is not None:
        res.append(gw)
    gxd = (gx, x[1], x[2], x[2])
    gud = None if gu is None else (gu, up[1], up[2], up[2])
    gwd = None if gw is None else (gw, gw.numel(), 1)
    _backward_call(dy, x, up, w, gxd, gud, gwd, layout, act, alpha, limit, beta)
    return res


def glu_backward_inplace(grad_out, x, up, weights, grad_weights, layout, act, alpha, limit, beta):
    """The gradients written over x (and up); grad_weights, when given, an output buffer. The
    library writes in place only over a row-strided view: anything else goes through one
    contiguous copy that is written back."""
    dy = _as_rows(grad_out, "grad_out")
    xd = _as_rows(x, _name(layout))
    ud = None if up is None else _as_rows(up, "up")
    w = None if weights is None else _as_vector(weights)
    gw = None if grad_weights is None else _as_vector(grad_weights)
    _backward_call(dy, xd, ud, w, xd, ud, gw, layout, act, alpha, limit, beta)
    if xd[0] is not x:
        x.copy_(xd[0])
    if ud is not None and ud[0] is not up:
        up.copy_(ud[0])
    if gw is not None and gw[0] is not grad_weights:
        grad_weights.copy_(gw[0])


# ---------------------------------------------------------------------------
# Per-expert biases: rows sorted by expert, offsets int32 [E] on the tensors' device
# ---------------------------------------------------------------------------


def _workspace(like, nbytes: int):
    """(the CUDA bias backwards' workspace through torch's caching allocator, or None; its pointer)."""
    if not like.is_cuda or nbytes == 0:
        return None, None
    ws = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    return ws, ws.data_ptr()


def glu_forward_bias(x, up, bias, offsets, weights, layout, act, alpha, limit, beta):
    """act(x + bias[e]) * weights [..., F] (packed x [.., 2F], or gate x and up [.., F] with the
    separate layout, bias [E, 2F] gate's columns first)."""
    p = _params(act, alpha, limit, beta)
    x, rx = _put(0, x, _name(layout))
    up, ru = (None, None) if up is None else _put(1, up, "up")
    weights, rw = (None, None) if weights is None else _vec(2, weights)
    bias, rb = _put(3, bias, "bias")
    offsets, ro = _vec(4, offsets)
    f = x.shape[-1] if up is not None else x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], f))
    _, rout = _put(5, out, "out")
    _check(_LIB.expertact_glu_forward_bias(p, _int32(layout), rx, ru, rw, rb, ro, rout, _stream(x)))
    return out


def glu_backward_bias(grad_out, x, up, bias, offsets, weights, weights_grad, bias_grad, inplace,
                      layout, act, alpha, limit, beta):
    """(grad_x, grad_up or None, grad_weights or None, grad_bias or None); with inplace, the
    gradients are written over x (and up)."""
    p = _params(act, alpha, limit, beta)
    xt, rx = _put(0, x, _name(layout))
    ut, ru = (None, None) if up is None else _put(1, up, "up")
    weights, rw = (None, None) if weights is None else _vec(2, weights)
    bias, rb = _put(3, bias, "bias")
    offsets, ro = _vec(4, offsets)
    dy, rdy = _put(5, grad_out, "grad_out")
    if inplace:
        gx, rgx, gu, rgu = xt, rx, ut, ru
    else:
        gx = torch.empty_like(x, memory_format=torch.contiguous_format)
        _, rgx = _put(6, gx, _name(layout, True))
        gu = None if up is None else torch.empty_like(up, memory_format=torch.contiguous_format)
        rgu = None if gu is None else _put(7, gu, "grad_up")[1]
    gw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device) if weights_grad else None
    rgw = None if gw is None else _vec(8, gw)[1]
    gb = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else None
    rgb = None if gb is None else _put(9, gb, "grad_bias")[1]
    rows, F = dy.numel() // max(dy.shape[-1], 1), dy.shape[-1]
    space, ptr = _workspace(xt, _capi.glu_bias_workspace_bytes(rows, F, bias.shape[0]))
    _check(_LIB.expertact_glu_backward_bias(p, _int32(layout), rdy, rx, ru, rw, rb, ro, rgx, rgu, rgw, rgb,
                                            c_void_p(ptr), c_size_t(0 if space is None else space.numel()),
                                            _stream(xt)))
    if inplace:  # written through copies of views that do not collapse: back into the caller's tensors
        if xt is not x:
            x.copy_(xt)
        if ut is not None and ut is not up:
            up.copy_(ut)
        gx, gu = x, up
    return gx, gu, gw, gb


def expert_bias_forward(x, bias, offsets, weights, inplace=False):
    """x + weights[r] * bias[e] per row ([rows, C]); with inplace, written over x."""
    xt, rx = _put(0, x, "x")
    bias, rb = _put(1, bias, "bias")
    offsets, ro = _vec(2, offsets)
    weights, rw = (None, None) if weights is None else _vec(3, weights)
    out = xt if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    rout = rx if inplace else _put(4, out, "out")[1]
    _check(_LIB.expertact_expert_bias_forward(rx, rb, ro, rw, rout, _stream(x)))
    if inplace and xt is not x:
        x.copy_(xt)
        out = x
    return out


def expert_bias_backward(grad_out, bias, offsets, weights, weights_grad, bias_grad):
    """(grad_bias or None, grad_weights or None) of expert_bias_forward (x's gradient is grad_out)."""
    gb = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else None
    gw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device) if weights_grad else None
    if gb is None and gw is None:
        return None, None
    dy, rdy = _put(0, grad_out, "grad_out")
    bias, rb = _put(1, bias, "bias")
    offsets, ro = _vec(2, offsets)
    weights, rw = (None, None) if weights is None else _vec(3, weights)
    rgb = None if gb is None else _put(4, gb, "grad_bias")[1]
    rgw = None if gw is None else _vec(5, gw)[1]
    rows, C = dy.numel() // max(dy.shape[-1], 1), dy.shape[-1]
    space, ptr = _workspace(dy, _capi.expert_bias_workspace_bytes(rows, C, bias.shape[0]))
    _check(_LIB.expertact_expert_bias_backward(rdy, rb, ro, rw, rgb, rgw, c_void_p(ptr),
                                               c_size_t(0 if space is None else space.numel()),
                                               _stream(grad_out)))
    return gb, gw


# ---------------------------------------------------------------------------
# FP8 (float8 e4m3fn, torchao's rowwise recipe): the outputs are given, allocated by fp8.py
# ---------------------------------------------------------------------------


def _glu_inputs(x, up, weights, bias, layout):
    """The activation's inputs in slots 0 (x), 1 (up), 2 (weights) and 3 (bias), all but x
    optional: (the tensors described, which the caller keeps alive over the call; the slots'
    byrefs, None for an absent one)."""
    x, rx = _put(0, x, _name(layout))
    up, ru = (None, None) if up is None else _put(1, up, "up")
    weights, rw = (None, None) if weights is None else _vec(2, weights)
    bias, rb = (None, None) if bias is None else _put(3, bias, "bias")
    return (x, up, weights, bias), (rx, ru, rw, rb)


def fp8_quantize_rowwise(t, q, scale, col_amax_offsets=None, col_amax=None):
    """q [..., C] and scale [...] of t; with col_amax_offsets, also col_amax [E, C]."""
    t, rx = _put(0, t, "t")
    _, rq = _put(1, q, "q")
    _, rs = _vec(2, scale)
    ro = None if col_amax_offsets is None else _vec(3, col_amax_offsets)[1]
    ra = None if col_amax is None else _put(4, col_amax, "col_amax")[1]
    _check(_LIB.expertact_fp8_quantize_rowwise(rx, rq, rs, ro, ra, _stream(t)))


def fp8_quantize_colwise_grouped(t, offsets, padded_offsets, q_t, scale, amax=None):
    """q_t [C, T or Tp] and scale [E, C] of t [T, C], per expert and column."""
    t, rx = _put(0, t, "t")
    offsets, ro = _vec(1, offsets)
    rp = None if padded_offsets is None else _vec(2, padded_offsets)[1]
    _, rq = _put(3, q_t, "q_t")
    _, rs = _put(4, scale, "scale")
    ra = None if amax is None else _put(5, amax, "amax")[1]
    _check(_LIB.expertact_fp8_quantize_colwise_grouped(rx, ro, rp, rq, rs, ra, _stream(t)))


def fp8_glu_rowwise(x, up, weights, bias, offsets, q, scale, col_amax, layout, act, alpha, limit, beta):
    """q [..., F] and scale [...] of the activation (bias[e] added when given, with offsets);
    col_amax [E, F] (with offsets) when given."""
    p = _params(act, alpha, limit, beta)
    x, rx = _put(0, x, _name(layout))
    up, ru = (None, None) if up is None else _put(1, up, "up")
    weights, rw = (None, None) if weights is None else _vec(2, weights)
    _, rq = _put(3, q, "q")
    _, rs = _vec(4, scale)
    ro = None if offsets is None else _vec(5, offsets)[1]
    ra = None if col_amax is None else _put(6, col_amax, "col_amax")[1]
    if bias is None:
        _check(_LIB.expertact_fp8_glu_rowwise(p, _int32(layout), rx, ru, rw, rq, rs, ro, ra, _stream(x)))
    else:
        bias, rb = _put(7, bias, "bias")
        _check(_LIB.expertact_fp8_glu_rowwise_bias(p, _int32(layout), rx, ru, rw, rb, ro, rq, rs, ra, _stream(x)))


def fp8_glu_colwise_grouped(x, up, weights, bias, offsets, padded_offsets, q_t, scale, amax, layout, act, alpha,
                            limit, beta):
    """q_t [F, T or Tp] and scale [E, F] of the activation, per expert and column, from its amax."""
    p = _params(act, alpha, limit, beta)
    kept, (rx, ru, rw, rb) = _glu_inputs(x, up, weights, bias, layout)
    offsets, ro = _vec(4, offsets)
    rp = None if padded_offsets is None else _vec(5, padded_offsets)[1]
    _, rq = _put(6, q_t, "q_t")
    _, rs = _put(7, scale, "scale")
    ra = None if amax is None else _put(8, amax, "amax")[1]  # required: the library names it when missing
    _check(_LIB.expertact_fp8_glu_colwise_grouped(p, _int32(layout), rx, ru, rw, rb, ro, rp, rq, rs, ra, _stream(x)))


def fp8_glu_backward_rowwise(dh, gate_up, weights, bias, offsets, q, scale, grad_weights, col_amax, grad_gate_up,
                             layout, act, alpha, limit, beta):
    """q [..., 2F] and scale [...] of the activation's gradient; grad_weights [...], col_amax
    [E, 2F] and grad_gate_up (gate_up's shape, written through: it may be gate_up itself)
    when given."""
    p = _params(act, alpha, limit, beta)
    dh, rd = _put(0, dh, "dh")
    gate_up, rx = _put(1, gate_up, "gate_up")
    weights, rw = (None, None) if weights is None else _vec(2, weights)
    bias, rb = (None, None) if bias is None else _put(3, bias, "bias")
    ro = None if offsets is None else _vec(4, offsets)[1]
    _, rq = _put(5, q, "q")
    _, rs = _vec(6, scale)
    rgw = None if grad_weights is None else _vec(7, grad_weights)[1]
    ra = None if col_amax is None else _put(8, col_amax, "col_amax")[1]
    rg = None if grad_gate_up is None else _put(9, grad_gate_up, "dgate_up_out")[1]
    _check(_LIB.expertact_fp8_glu_backward_rowwise(p, _int32(layout), rd, rx, rw, rb, ro, rq, rs, rgw, ra, rg,
                                                   _stream(gate_up)))


# ---------------------------------------------------------------------------
# FP8 blockwise operands (1 x 128 row tiles, 128 x 1 column tiles, 128 x 128 weight blocks): the
# outputs are given, allocated by fp8.py; scales as the library writes them (row tiles [KB, T],
# column tiles [Tp / 128, C], blocks [E * RB, CB])
# ---------------------------------------------------------------------------


def fp8_quantize_row_tiles(t, q, scale):
    """q [..., C] and scale [KB, T] of t [..., C] (T: its rows)."""
    t, rx = _put(0, t, "t")
    _, rq = _put(1, q, "q")
    _, rs = _put(2, scale, "scale")
    _check(_LIB.expertact_fp8_quantize_row_tiles(rx, rq, rs, _stream(t)))


def fp8_quantize_column_tiles_grouped(t, offsets, padded_offsets, q_t, scale, q=None, row_scale=None):
    """q_t [C, Tp] and scale [Tp / 128, C] of t [T, C]; with q and row_scale also its row tiles."""
    t, rx = _put(0, t, "t")
    offsets, ro = _vec(1, offsets)
    padded_offsets, rp = _vec(2, padded_offsets)
    _, rqt = _put(3, q_t, "q_t")
    _, rs = _put(4, scale, "scale")
    rq = None if q is None else _put(5, q, "q")[1]
    rrs = None if row_scale is None else _put(6, row_scale, "row_scale")[1]
    _check(_LIB.expertact_fp8_quantize_column_tiles_grouped(rx, ro, rp, rqt, rs, rq, rrs, _stream(t)))


def fp8_quantize_blocks(w, q, scale):
    """q [E * R, C] and scale [E * RB, CB] of w [E, R, C] (any strides)."""
    dw = _capi.dl_tensor(w)
    _, rq = _put(0, q, "q")
    _, rs = _put(1, scale, "scale")
    _check(_LIB.expertact_fp8_quantize_blocks(byref(dw), rq, rs, _stream(w)))


def fp8_glu_row_tiles(x, up, weights, bias, offsets, q, scale, layout, act, alpha, limit, beta):
    """q [..., F] and scale [KB, T] of the activation (bias[e] added when given, with offsets)."""
    p = _params(act, alpha, limit, beta)
    kept, (rx, ru, rw, rb) = _glu_inputs(x, up, weights, bias, layout)
    offsets, ro = (None, None) if offsets is None else _vec(4, offsets)
    _, rq = _put(5, q, "q")
    _, rs = _put(6, scale, "scale")
    _check(_LIB.expertact_fp8_glu_row_tiles(p, _int32(layout), rx, ru, rw, rb, ro, rq, rs, _stream(x)))


def fp8_glu_column_tiles_grouped(x, up, weights, bias, offsets, padded_offsets, q_t, scale, layout, act, alpha,
                                 limit, beta):
    """q_t [F, Tp] and scale [Tp / 128, F] of the activation rounded to x's dtype."""
    p = _params(act, alpha, limit, beta)
    kept, (rx, ru, rw, rb) = _glu_inputs(x, up, weights, bias, layout)
    offsets, ro = _vec(4, offsets)
    padded_offsets, rp = _vec(5, padded_offsets)
    _, rqt = _put(6, q_t, "q_t")
    _, rs = _put(7, scale, "scale")
    _check(_LIB.expertact_fp8_glu_column_tiles_grouped(p, _int32(layout), rx, ru, rw, rb, ro, rp, rqt, rs,
                                                       _stream(x)))


def fp8_glu_backward_tiles(dh, gate_up, weights, bias, offsets, padded_offsets, q, scale, q_t, col_scale,
                           grad_weights, grad_gate_up, layout, act, alpha, limit, beta):
    """q [..., 2F] and scale [KB, T] of the activation's gradient; q_t [2F, Tp] and col_scale
    [Tp / 128, 2F], grad_weights [...] and grad_gate_up (gate_up's shape, written through) when
    given."""
    p = _params(act, alpha, limit, beta)
    dh, rd = _put(0, dh, "dh")
    gate_up, rx = _put(1, gate_up, "gate_up")
    weights, rw = (None, None) if weights is None else _vec(2, weights)
    bias, rb = (None, None) if bias is None else _put(3, bias, "bias")
    offsets, ro = (None, None) if offsets is None else _vec(4, offsets)
    padded_offsets, rp = (None, None) if padded_offsets is None else _vec(5, padded_offsets)
    _, rq = _put(6, q, "q")
    _, rs = _put(7, scale, "scale")
    rqt = None if q_t is None else _put(8, q_t, "q_t")[1]
    rcs = None if col_scale is None else _put(9, col_scale, "col_scale")[1]
    rgw = None if grad_weights is None else _vec(10, grad_weights)[1]
    rg = None if grad_gate_up is None else _put(11, grad_gate_up, "dgate_up_out")[1]
    _check(_LIB.expertact_fp8_glu_backward_tiles(p, _int32(layout), rd, rx, rw, rb, ro, rp, rq, rs, rqt, rcs, rgw, rg,
                                                 _stream(gate_up)))
