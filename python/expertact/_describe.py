"""Describing tensors to the C ABI and calling it: the kernel bodies.

glu_forward_body, glu_backward_body and glu_backward_inplace_body each read their tensors as
row-strided 2-D views ([..., C] with the leading dims collapsing into one row stride), pack
those descriptions into the per-thread buffer of _capi (one struct.pack_into per operand),
and call the library on the current stream of the tensors' own device. The library
validates everything; a failed status becomes the Python exception of _capi.raise_for.
A tensor that cannot be read as rows is copied once (.contiguous()); a 0-dim tensor goes
through the DLTensor entry points, which name the problem.

The same bodies are the CPU/CUDA kernels of the torch operators (_library) and what the
eager path calls directly (_autograd). No torch.library, autograd or dispatch logic here.
"""
from __future__ import annotations

import math
import struct
from ctypes import c_float, c_void_p

import torch

from . import _capi

__all__ = ["glu_forward_body", "glu_backward_body", "glu_backward_inplace_body", "rows_view_ok", "vector_ok",
           "dl", "stream_of"]

# ---------------------------------------------------------------------------
# Describing tensors to the C ABI
# ---------------------------------------------------------------------------

# torch dtype -> DLPack (code, bits). Only the first four are accepted by the library;
# the others are named so that its message says what was passed.
_DL_CODES = {
    torch.float32: (_capi.DL_FLOAT, 32),
    torch.float16: (_capi.DL_FLOAT, 16),
    torch.bfloat16: (_capi.DL_BFLOAT, 16),
    torch.float64: (_capi.DL_FLOAT, 64),
    torch.int8: (_capi.DL_INT, 8),
    torch.int16: (_capi.DL_INT, 16),
    torch.int32: (_capi.DL_INT, 32),
    torch.int64: (_capi.DL_INT, 64),
    torch.uint8: (_capi.DL_UINT, 8),
    torch.bool: (_capi.DL_BOOL, 8),
    torch.complex64: (_capi.DL_COMPLEX, 64),
    torch.complex128: (_capi.DL_COMPLEX, 128),
}
# float8_e4m3fn (DLPack 1.1's code 10): the library takes it for the FP8 outputs only.
if hasattr(torch, "float8_e4m3fn"):
    _DL_CODES[torch.float8_e4m3fn] = (_capi.DL_FLOAT8_E4M3FN, 8)
_UNKNOWN_DTYPE_CODE = 255
_DL_CPU, _DL_CUDA = _capi.DL_CPU, _capi.DL_CUDA
_SEPARATE = _capi.LAYOUT_SEPARATE

try:  # the raw cudaStream_t of a device's current stream, without building a torch.cuda.Stream
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # CPU-only torch builds
    _raw_stream = None

_WS = _capi.WORKSPACE
_raise = _capi.raise_for
_fwd_2d = _capi.forward_2d
_bwd_2d = _capi.backward_2d
_pack_params = struct.Struct("=" + _capi.PARAMS_FMT).pack_into
_pack_matrix = struct.Struct("=" + _capi.MATRIX_FMT).pack_into
_pack_vector = struct.Struct("=" + _capi.VECTOR_FMT).pack_into
_O = _capi._OFFSETS
_OX, _OU, _OW, _OO, _OGU, _OGW, _ODY = (_O[n] for n in ("x", "up", "weights", "out", "grad_up", "grad_weights",
                                                       "grad_out"))

# (dtype, device) -> the packed dtype + device fields: CPU tensors in _CPU_TAILS, CUDA
# tensors in _CUDA_TAILS[device index], filled on first use.
_CPU_TAILS = {dt: _capi.dl_tail(c, b, _DL_CPU, 0) for dt, (c, b) in _DL_CODES.items()}
_CUDA_TAILS = {}


def _tail(t) -> bytes:
    """The dtype and device of t as the 2-D descriptions carry them (12 packed bytes)."""
    if t.is_cpu:
        tail = _CPU_TAILS.get(t.dtype)
        if tail is not None:
            return tail
    elif t.is_cuda:
        tails = _CUDA_TAILS.get(t.get_device())
        tail = None if tails is None else tails.get(t.dtype)
        if tail is not None:
            return tail
    return _new_tail(t)


def _new_tail(t) -> bytes:
    code, bits = _DL_CODES.get(t.dtype, (_UNKNOWN_DTYPE_CODE, t.element_size() * 8))
    if t.is_cuda:
        idx = t.get_device()
        tail = _capi.dl_tail(code, bits, _DL_CUDA, idx)
        if t.dtype in _DL_CODES:
            _CUDA_TAILS.setdefault(idx, {})[t.dtype] = tail
        return tail
    # 0: neither cpu nor cuda, which the library names
    return _capi.dl_tail(code, bits, _DL_CPU if t.is_cpu else 0, 0)


def stream_of(t):
    """The current stream of the tensor's own device (None, the NULL stream, for CPU tensors)."""
    if not t.is_cuda:
        return None
    idx = t.get_device()
    if _raw_stream is not None:
        return c_void_p(_raw_stream(idx))
    return c_void_p(torch.cuda.current_stream(idx).cuda_stream)


def _row_stride(shape, stride):
    """The one row stride of [..., C] read as rows (the last dimension contiguous, the
    leading ones collapsing into one stride that does not overlap rows), or None."""
    n = len(shape)
    cols = shape[-1]
    if cols > 1 and stride[-1] != 1:
        return None
    if n == 2:  # the usual view: a column slice of a wider matrix (gate_up.chunk(2, -1))
        return cols if shape[0] == 1 else stride[0] if stride[0] >= cols else None
    row_stride = -1
    expect = 0
    for i in range(n - 2, -1, -1):
        s = shape[i]
        if s == 1:
            continue
        if row_stride < 0:
            if stride[i] < cols:
                return None
            row_stride = stride[i]
            expect = row_stride * s
        elif stride[i] != expect:
            return None
        else:
            expect *= s
    return cols if row_stride < 0 else row_stride


def rows_view_ok(t) -> bool:
    """Whether the library reads t in place: [..., C] with the last dim contiguous and the
    leading dims collapsing into one row stride that does not overlap rows. Otherwise the
    caller copies t once (.contiguous())."""
    if t.is_contiguous():
        return True
    shape = t.shape
    if not shape or 0 in shape:
        return True  # nothing to read, or 0-dim: the library names the problem
    return _row_stride(shape, t.stride()) is not None


def _vector_stride(shape, stride):
    """The one stride of a per-row weight tensor's elements, or None."""
    found = None
    expect = 0
    for i in range(len(shape) - 1, -1, -1):
        s = shape[i]
        if s == 1:
            continue
        if found is None:
            found = stride[i]
            expect = found * s
        elif stride[i] != expect:
            return None
        else:
            expect *= s
    return 1 if found is None else found


def vector_ok(t) -> bool:
    """Whether a per-row weight tensor collapses into one stride (else it is copied)."""
    return t.is_contiguous() or _vector_stride(t.shape, t.stride()) is not None


def _as_rows(t):
    """(t, rows, cols, row_stride): t read as a row-strided matrix, or its contiguous copy
    when it cannot be (the leading dims do not collapse). rows is None for a 0-dim tensor,
    which only the DLTensor description can show to the library (which refuses it)."""
    shape = t.shape
    n = len(shape)
    if n == 2:
        rows, cols = shape
        if t.is_contiguous():
            return t, rows, cols, cols
    elif n == 0:
        return t, None, None, None
    else:
        cols = shape[-1]
        rows = math.prod(shape[:-1])
        if t.is_contiguous():
            return t, rows, cols, cols
    if rows == 0 or cols == 0:
        return t, rows, cols, cols
    row_stride = _row_stride(shape, t.stride())
    if row_stride is None:
        return t.contiguous(), rows, cols, cols
    return t, rows, cols, row_stride


def _as_vector(t):
    """(t, size, stride) of per-row weights, t copied when its elements do not collapse."""
    if t.is_contiguous():
        return t, t.numel(), 1
    stride = _vector_stride(t.shape, t.stride())
    if stride is None:
        t = t.contiguous()
        stride = 1
    return t, t.numel(), stride


_INT32 = range(-(1 << 31), 1 << 31)


def _int32(v: int) -> int:
    """v saturated to int32, so that the library names an out-of-range value as out of range
    (ctypes would truncate 2**32 to 0, a valid code)."""
    return v if v in _INT32 else (_INT32.stop - 1 if v > 0 else _INT32.start)


def _params(buf, act, alpha, limit, beta):
    try:
        _pack_params(buf, 0, act, alpha, limit, beta)
    except (struct.error, OverflowError):
        # Out of float32 / int32 range: the values the C structs would hold (a float past
        # float32's range is +-inf, which the library refuses or reads as "no clamp").
        _pack_params(buf, 0, _int32(int(act)), c_float(alpha).value, c_float(limit).value, c_float(beta).value)


def _call_dlpack(entry, layout, act, alpha, limit, beta, operands, stream):
    """The DLTensor description, for what the 2-D one cannot show (a 0-dim tensor, refused
    by the library with its message). operands: tensors or None, in the entry's order;
    the same tensor twice (in place) gets the same DLTensor."""
    ws = _WS
    p = ws.params
    p.act, p.alpha, p.limit, p.beta = _int32(act), alpha, limit, beta
    refs, seen = [], {}
    for t in operands:
        if t is None:
            refs.append(None)
        elif id(t) in seen:
            refs.append(seen[id(t)])
        else:
            seen[id(t)] = ref = dl_tensor(ws.slots[len(seen)], t)
            refs.append(ref)
    status = entry(ws.params_ref, _int32(layout), *refs, stream)
    if status:
        _raise(status)


def dl_tensor(slot, t):
    """Fills a reusable DLTensor from a tensor (its data pointer already includes the storage offset)."""
    d = slot.t
    d.data = t.data_ptr()
    code, bits = _DL_CODES.get(t.dtype, (_UNKNOWN_DTYPE_CODE, t.element_size() * 8))
    d.dtype.code, d.dtype.bits = code, bits
    dev = slot.dev
    dev.device_type = _DL_CUDA if t.is_cuda else _DL_CPU if t.is_cpu else 0
    dev.device_id = max(t.get_device(), 0)
    shape = t.shape
    n = len(shape)
    d.ndim = n
    if len(slot.shape) < n:
        slot.resize(n)
    slot.shape[:n] = shape
    slot.strides[:n] = t.stride()
    return slot.ref


# ---------------------------------------------------------------------------
# Kernel bodies (CPU and CUDA): the operators' kernels and the eager path's calls
# ---------------------------------------------------------------------------


def glu_forward_body(x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    x, rows, cols, xs = _as_rows(x)
    if up is not None:
        up, urows, ucols, us = _as_rows(up)
    if weights is not None:
        weights, wn, wst = _as_vector(weights)
    shape = x.shape
    if rows is None or (up is not None and urows is None):  # 0-dim
        out = x.new_empty(shape)
        _call_dlpack(_capi._forward, layout, act, alpha, limit, beta, (x, up, weights, out), stream_of(x))
        return out
    f = cols if layout == _SEPARATE else cols // 2
    out = x.new_empty(rows, f) if len(shape) == 2 else x.new_empty((*shape[:-1], f))
    ws = _WS
    buf = ws.buf
    _params(buf, act, alpha, limit, beta)
    tail = _tail(x)
    _pack_matrix(buf, _OX, x.data_ptr(), rows, cols, xs, tail)
    r_up = r_w = None
    if up is not None:
        _pack_matrix(buf, _OU, up.data_ptr(), urows, ucols, us, _tail(up))
        r_up = ws.r_up
    if weights is not None:
        _pack_vector(buf, _OW, weights.data_ptr(), wn, wst, _tail(weights))
        r_w = ws.r_w
    _pack_matrix(buf, _OO, out.data_ptr(), rows, f, f, tail)  # out: x's dtype and device
    status = _fwd_2d(ws.r_params, _int32(layout), ws.r_x, r_up, r_w, ws.r_out, stream_of(x))
    if status:
        _raise(status)
    return out


def _backward_2d(grad_out, x, up, weights, grad_x, grad_up, grad_weights, layout, act, alpha, limit, beta):
    """Describes a backward call in 2-D and makes it. x, up, grad_out: (t, rows, cols, stride)
    from _as_rows; weights: (t, size, stride) from _as_vector; grad_x / grad_up: the same
    tuples, or the input's own tuple for in place; grad_weights: a tensor (any single stride,
    from _as_vector) or None."""
    ws = _WS
    buf = ws.buf
    _params(buf, act, alpha, limit, beta)
    xt = x[0]
    tail = _tail(xt)
    _pack_matrix(buf, _OX, xt.data_ptr(), x[1], x[2], x[3], tail)
    dy = grad_out[0]
    _pack_matrix(buf, _ODY, dy.data_ptr(), grad_out[1], grad_out[2], grad_out[3], _tail(dy))
    r_up = r_gu = r_w = r_gw = None
    if up is not None:
        _pack_matrix(buf, _OU, up[0].data_ptr(), up[1], up[2], up[3], _tail(up[0]))
        r_up = ws.r_up
    if weights is not None:
        _pack_vector(buf, _OW, weights[0].data_ptr(), weights[1], weights[2], _tail(weights[0]))
        r_w = ws.r_w
    if grad_x is x:  # in place: the input's own description
        r_gx, r_gu = ws.r_x, r_up
    else:
        _pack_matrix(buf, _OO, grad_x[0].data_ptr(), grad_x[1], grad_x[2], grad_x[3], tail)
        r_gx = ws.r_out
        if grad_up is not None:
            _pack_matrix(buf, _OGU, grad_up[0].data_ptr(), grad_up[1], grad_up[2], grad_up[3], _tail(grad_up[0]))
            r_gu = ws.r_gu
    if grad_weights is not None:
        _pack_vector(buf, _OGW, grad_weights[0].data_ptr(), grad_weights[1], grad_weights[2],
                     _tail(grad_weights[0]))
        r_gw = ws.r_gw
    status = _bwd_2d(ws.r_params, _int32(layout), ws.r_dy, ws.r_x, r_up, r_w, r_gx, r_gu, r_gw, stream_of(xt))
    if status:
        _raise(status)


def glu_backward_body(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta):
    dy, x, up = _as_rows(grad_out), _as_rows(x), None if up is None else _as_rows(up)
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
    if dy[1] is None or x[1] is None or (up is not None and up[1] is None):  # 0-dim
        _call_dlpack(_capi._backward, layout, act, alpha, limit, beta,
                     (dy[0], xt, None if up is None else up[0], None if w is None else w[0], gx, gu, gw),
                     stream_of(xt))
        return res
    gxd = (gx, x[1], x[2], x[2])
    gud = None if gu is None else (gu, up[1], up[2], up[2])
    gwd = None if gw is None else (gw, gw.numel(), 1)
    _backward_2d(dy, x, up, w, gxd, gud, gwd, layout, act, alpha, limit, beta)
    return res


def glu_backward_inplace_body(grad_out, x, up, weights, grad_weights, layout, act, alpha, limit, beta):
    # The library writes in place only over a row-strided view; anything else goes
    # through one contiguous copy that is written back.
    dy = _as_rows(grad_out)
    xd = _as_rows(x)
    ud = None if up is None else _as_rows(up)
    w = None if weights is None else _as_vector(weights)
    gw = None if grad_weights is None else _as_vector(grad_weights)
    if dy[1] is None or xd[1] is None or (ud is not None and ud[1] is None):  # 0-dim
        _call_dlpack(_capi._backward, layout, act, alpha, limit, beta,
                     (dy[0], xd[0], None if ud is None else ud[0], None if w is None else w[0], xd[0],
                      None if ud is None else ud[0], None if gw is None else gw[0]), stream_of(xd[0]))
    else:
        _backward_2d(dy, xd, ud, w, xd, ud, gw, layout, act, alpha, limit, beta)
    if xd[0] is not x:
        x.copy_(xd[0])
    if ud is not None and ud[0] is not up:
        up.copy_(ud[0])
    if gw is not None and gw[0] is not grad_weights:
        grad_weights.copy_(gw[0])
