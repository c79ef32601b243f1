"""The per-expert biases' kernel bodies (docs/spec.md section 7): tensors described to the
C ABI's *_bias_2d entry points, called on the current stream of the tensors' device.

Rows are sorted by expert; ``offsets`` (int32 [E], torch._grouped_mm's offs) holds each
expert's cumulative end row, on the tensors' device. The bias gradients are fixed-order
sums: two identical calls give bit-identical results. The CUDA backwards take a workspace,
allocated here through torch's caching allocator.

The plain calls serve expert_mlp's autograd node; the autograd Functions at the end serve
functional's biased forms (functional.glu(..., bias=, offsets=) and functional.expert_bias).
Those run eagerly: under torch.compile they are a graph break.
"""
from __future__ import annotations

import ctypes
from ctypes import byref, c_int32, c_size_t, c_void_p

import torch

from . import _capi
from ._args import check_ends, tensor_arg
from ._autograd import CREATE_GRAPH_MSG, SECOND_BACKWARD_MSG
from ._describe import _as_rows, _as_vector, _params, _tail, stream_of

__all__ = ["glu_forward", "glu_backward", "row_forward", "row_backward", "check_offsets", "glu_bias_call",
           "expert_bias"]

_LIB = _capi.LIB
_M, _V = _capi.Matrix, _capi.Vector
for _f in ("expertact_glu_forward_bias_2d", "expertact_glu_backward_bias_2d", "expertact_expert_bias_forward_2d",
           "expertact_expert_bias_backward_2d"):
    getattr(_LIB, _f).restype = c_int32
_LIB.expertact_glu_bias_workspace_bytes.restype = c_size_t
_LIB.expertact_glu_bias_workspace_bytes.argtypes = [ctypes.c_int64] * 3
_LIB.expertact_expert_bias_workspace_bytes.restype = c_size_t
_LIB.expertact_expert_bias_workspace_bytes.argtypes = [ctypes.c_int64] * 3


def _matrix(t):
    """(tensor kept alive, expertact_matrix) of t read as rows (copied when it cannot be)."""
    t, rows, cols, stride = _as_rows(t)
    if rows is None:
        raise ValueError("expertact: a 0-dim tensor where [rows, columns] is expected")
    m = _M()
    m.data, m.rows, m.cols, m.row_stride = t.data_ptr(), rows, cols, stride
    tail = _tail(t)
    ctypes.memmove(ctypes.addressof(m) + _M.dtype.offset, tail, len(tail))
    return t, m


def _vector(t):
    """(tensor kept alive, expertact_vector) of a per-row vector (float32 weights, int32 offsets)."""
    t, n, stride = _as_vector(t)
    v = _V()
    v.data, v.size, v.stride = t.data_ptr(), n, stride
    tail = _tail(t)
    ctypes.memmove(ctypes.addressof(v) + _V.dtype.offset, tail, len(tail))
    return t, v


def _ref(x):
    return None if x is None else byref(x[1])


def _params_ref(act, alpha, limit, beta):
    p = _capi.Params()
    buf = (ctypes.c_char * ctypes.sizeof(p)).from_buffer(p)
    _params(buf, act, alpha, limit, beta)
    return byref(p), p


def _check(status):
    if status:
        _capi.raise_for(status)


def check_offsets(offsets, like, where: str = "expertact"):
    """offsets as the kernels read them: int32, 1-D, contiguous, on the device of like, the
    [..., C] tensor whose rows they index (its leading dims collapsed into rows). Their
    values are read once on the host (a device-to-host copy of E values on a GPU) and
    checked, so that offsets out of order raise here, naming them, rather than giving
    wrong sums on the GPU."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{where}: offsets must be a torch.Tensor (got {type(offsets).__name__})")
    if offsets.dtype != torch.int32:
        raise _capi.DTypeError(f"{where}: offsets has dtype {offsets.dtype}; it must be int32 "
                               "(offsets.to(torch.int32))")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{where}: offsets must be 1-D [E] with E >= 1 (got shape {tuple(offsets.shape)})")
    rows = like.numel() // max(like.shape[-1], 1) if like.dim() else 0
    check_ends(offsets.tolist(), rows, where)
    if offsets.device != like.device:
        offsets = offsets.to(like.device)
    return offsets.contiguous()


def _workspace(like, nbytes: int):
    if not like.is_cuda or nbytes == 0:
        return None, 0
    ws = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    return ws, nbytes


def glu_forward(x, up, bias, offsets, weights, layout, act, alpha, limit, beta):
    """act(x + bias[e]) [rows, F] (packed x [.., 2F], or gate x and up [.., F] with the
    separate layout, bias [E, 2F] gate's columns first)."""
    xs = _matrix(x)
    ups = None if up is None else _matrix(up)
    f = xs[1].cols if up is not None else xs[1].cols // 2
    out = x.new_empty((*x.shape[:-1], f))
    outs = _matrix(out)
    bs, offs = _matrix(bias), _vector(offsets)
    ws = None if weights is None else _vector(weights)
    pref, _keep = _params_ref(act, alpha, limit, beta)
    _check(_LIB.expertact_glu_forward_bias_2d(pref, c_int32(layout), _ref(xs), _ref(ups), _ref(ws), _ref(bs),
                                              _ref(offs), _ref(outs), stream_of(x)))
    return out


def glu_backward(grad_out, x, up, bias, offsets, weights, weights_grad, bias_grad, inplace,
                 layout, act, alpha, limit, beta):
    """(grad_x, grad_up or None, grad_weights or None, grad_bias or None); with inplace, the
    gradients are written over x (and up)."""
    xs = _matrix(x)
    ups = None if up is None else _matrix(up)
    dys = _matrix(grad_out)
    if inplace:
        gx, gxs, gu, gus = x, xs, up, ups
    else:
        gx = torch.empty_like(x, memory_format=torch.contiguous_format)
        gxs = _matrix(gx)
        gu = None if up is None else torch.empty_like(up, memory_format=torch.contiguous_format)
        gus = None if gu is None else _matrix(gu)
    gw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device) if weights_grad else None
    gb = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else None
    bs, offs = _matrix(bias), _vector(offsets)
    ws = None if weights is None else _vector(weights)
    gws = None if gw is None else _vector(gw)
    gbs = None if gb is None else _matrix(gb)
    rows, F = dys[1].rows, dys[1].cols
    space, nbytes = _workspace(x, _LIB.expertact_glu_bias_workspace_bytes(rows, F, bias.shape[0]))
    pref, _keep = _params_ref(act, alpha, limit, beta)
    _check(_LIB.expertact_glu_backward_bias_2d(
        pref, c_int32(layout), _ref(dys), _ref(xs), _ref(ups), _ref(ws), _ref(bs), _ref(offs), _ref(gxs), _ref(gus),
        _ref(gws), _ref(gbs), c_void_p(None if space is None else space.data_ptr()), c_size_t(nbytes),
        stream_of(x)))
    return gx, gu, gw, gb


def row_forward(x, bias, offsets, weights, inplace=False):
    """x + weights[r] * bias[e] per row ([rows, C]); with inplace, written over x."""
    xs = _matrix(x)
    out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    outs = xs if inplace else _matrix(out)
    bs, offs = _matrix(bias), _vector(offsets)
    ws = None if weights is None else _vector(weights)
    _check(_LIB.expertact_expert_bias_forward_2d(_ref(xs), _ref(bs), _ref(offs), _ref(ws), _ref(outs),
                                                 stream_of(x)))
    return out


def row_backward(grad_out, bias, offsets, weights, weights_grad, bias_grad):
    """(grad_bias or None, grad_weights or None) of row_forward."""
    dys = _matrix(grad_out)
    gb = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else None
    gw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device) if weights_grad else None
    if gb is None and gw is None:
        return None, None
    bs, offs = _matrix(bias), _vector(offsets)
    ws = None if weights is None else _vector(weights)
    gbs = None if gb is None else _matrix(gb)
    gws = None if gw is None else _vector(gw)
    rows, C = dys[1].rows, dys[1].cols
    space, nbytes = _workspace(grad_out, _LIB.expertact_expert_bias_workspace_bytes(rows, C, bias.shape[0]))
    _check(_LIB.expertact_expert_bias_backward_2d(
        _ref(dys), _ref(bs), _ref(offs), _ref(ws), _ref(gbs), _ref(gws),
        c_void_p(None if space is None else space.data_ptr()), c_size_t(nbytes), stream_of(grad_out)))
    return gb, gw


# ---------------------------------------------------------------------------
# Autograd: functional's biased forms (functional.glu(..., bias=, offsets=), expert_bias)
# ---------------------------------------------------------------------------


def _pair(bias, offsets):
    if (bias is None) != (offsets is None):
        missing = "offsets" if offsets is None else "bias"
        raise ValueError(f"expertact: a per-expert bias needs both bias and offsets; {missing} is missing")


class _GluBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, up, weights, bias, offsets, args, inplace):
        ctx.save_for_backward(x, up, weights, bias, offsets)
        ctx.args, ctx.inplace, ctx.spent = args, inplace, False
        return glu_forward(x, up, bias, offsets, weights, *args)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            raise RuntimeError(CREATE_GRAPH_MSG)
        if ctx.spent:
            raise RuntimeError(SECOND_BACKWARD_MSG)
        x, up, weights, bias, offsets = ctx.saved_tensors
        ctx.spent = ctx.inplace
        need = ctx.needs_input_grad
        gx, gu, gw, gb = glu_backward(dy, x, up, bias, offsets, weights, weights is not None and need[2], need[3],
                                      ctx.inplace, *ctx.args)
        return gx, gu, gw, gb, None, None, None


def glu_bias_call(gate, up, layout_code, act, alpha, limit, beta, weights, inplace_backward, bias, offsets):
    """functional.glu's biased form: the activation of gate (and up) + bias[e], differentiable
    in every tensor argument (offsets excepted)."""
    _pair(bias, offsets)
    tensor_arg("bias", bias)
    offsets = check_offsets(offsets, gate)
    return _GluBias.apply(gate, up, weights, bias, offsets, (layout_code, act, alpha, limit, beta),
                          bool(inplace_backward))


class _ExpertBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, offsets, weights):
        ctx.save_for_backward(bias, offsets, weights)
        return row_forward(x, bias, offsets, weights)

    @staticmethod
    def backward(ctx, dy):
        bias, offsets, weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        gb, gw = row_backward(dy, bias, offsets, weights, weights is not None and need[3], need[1])
        return (dy if need[0] else None), gb, None, gw


def expert_bias(x, bias, offsets, weights=None):
    """x + weights[r] * bias[e] per row: see functional.expert_bias."""
    tensor_arg("x", x)
    tensor_arg("bias", bias)
    tensor_arg("weights", weights, optional=True)
    offsets = check_offsets(offsets, x)
    return _ExpertBias.apply(x, bias, offsets, weights)
