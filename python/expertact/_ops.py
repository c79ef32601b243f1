"""The torch operators: expertact::glu (differentiable), expertact::glu_backward and the
in-place expertact::glu_backward_, registered through torch.library (define/impl,
register_fake, and an Autograd kernel around a torch.autograd.Function: what
register_autograd builds, without its per-call schema walk) so that torch.compile
traces them with no graph break. Each kernel builds DLTensors straight from the tensors and calls the C ABI
on the current stream of the tensors' own device; the library validates everything.

Memory (SPEC section 3): the forward saves only its inputs (and weights) for
backward. With inplace_backward=True the backward writes the gradients over
those inputs and returns them: a second backward through the same graph raises,
and the inputs' version counters are bumped so that any other saved user of them
fails loudly instead of reading gradients.
"""
from __future__ import annotations

import torch

from . import _capi

__all__ = ["glu_op", "glu_backward_op", "glu_backward_inplace_op"]

_LIB = torch.library.Library("expertact", "DEF")
_LIB.define(
    "glu(Tensor x, Tensor? up, Tensor? weights, int layout, int act, float alpha, float limit, "
    "float beta, bool inplace_backward=False) -> Tensor"
)
_LIB.define(
    "glu_backward(Tensor grad_out, Tensor x, Tensor? up, Tensor? weights, bool weights_grad, "
    "int layout, int act, float alpha, float limit, float beta) -> Tensor[]"
)
# Writes the gradients of x (and up) over x (and up); grad_weights, when given, is
# an output buffer. Returns nothing, so torch.compile can functionalize it.
_LIB.define(
    "glu_backward_(Tensor grad_out, Tensor(a!) x, Tensor(b!)? up, Tensor? weights, "
    "Tensor(c!)? grad_weights, int layout, int act, float alpha, float limit, float beta) -> ()"
)

# torch dtype -> DLPack dtype. Only the first three are accepted by the library; the
# others are named so that its message says what was passed.
def _dl_dtype(code, bits):
    d = _capi.DLDataType()
    d.code, d.bits, d.lanes = code, bits, 1
    return d


_DL_DTYPES = {
    dt: _dl_dtype(code, bits) for dt, (code, bits) in {
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
    }.items()
}
_UNKNOWN_DTYPE_CODE = 255
_MAX_DIMS = _capi._MAX_DIMS
_DL_CPU, _DL_CUDA = _capi.DL_CPU, _capi.DL_CUDA

try:  # the raw cudaStream_t of a device's current stream, without building a torch.cuda.Stream
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # CPU-only torch builds
    _raw_stream = None

_WS = _capi.WORKSPACE
_fwd = _capi._forward
_bwd = _capi._backward
_raise = _capi.raise_for


def _dl(slot, t):
    """Fills a reusable DLTensor from a tensor (its data pointer already includes the storage offset)."""
    d = slot.t
    d.data = t.data_ptr()
    dev = slot.dev
    idx = t.get_device()  # -1 for CPU tensors
    if idx < 0:
        dev.device_type = _DL_CPU if t.is_cpu else 0  # 0: not cpu/cuda, which the library names
        dev.device_id = 0
    else:
        dev.device_type = _DL_CUDA if t.is_cuda else 0
        dev.device_id = idx
    dt = _DL_DTYPES.get(t.dtype)
    d.dtype = dt if dt is not None else _dl_dtype(_UNKNOWN_DTYPE_CODE, t.element_size() * 8)
    shape = t.shape
    n = len(shape)
    d.ndim = n
    if n > _MAX_DIMS and len(slot.shape) < n:
        slot.resize(n)
    slot.shape[:n] = shape
    slot.strides[:n] = t.stride()
    return slot.ref


def _stream(t) -> int:
    """The current stream of the tensor's own device (0 for CPU tensors)."""
    if not t.is_cuda:
        return 0
    idx = t.get_device()
    if _raw_stream is not None:
        return _raw_stream(idx)
    return torch.cuda.current_stream(idx).cuda_stream


def _params(act, alpha, limit, beta):
    p = _WS.params
    p.act = act
    p.alpha = alpha
    p.limit = limit
    p.beta = beta
    return _WS.params_ref


def rows_view_ok(t) -> bool:
    """Whether the library reads t in place: [..., C] with the last dim contiguous and the
    leading dims collapsing into one row stride that does not overlap rows. Otherwise the
    caller copies t once (.contiguous())."""
    if t.is_contiguous():
        return True
    shape = t.shape
    n = len(shape)
    if n == 0 or t.numel() == 0:
        return True  # nothing to read, or 0-dim: the library names the problem
    stride = t.stride()
    cols = shape[-1]
    if cols > 1 and stride[-1] != 1:
        return False
    expect = -1
    for i in range(n - 2, -1, -1):
        s = shape[i]
        if s == 1:
            continue
        if expect < 0:
            if stride[i] < cols:
                return False
            expect = stride[i] * s
        elif stride[i] != expect:
            return False
        else:
            expect *= s
    return True


def vector_ok(t) -> bool:
    """Whether a per-row weight tensor collapses into one stride (else it is copied)."""
    if t.is_contiguous():
        return True
    expect = None
    for s, st in zip(reversed(t.shape), reversed(t.stride())):
        if s == 1:
            continue
        if expect is None:
            expect = st * s
        elif st != expect:
            return False
        else:
            expect *= s
    return True


def _rows(t):
    return t if t is None or rows_view_ok(t) else t.contiguous()


def _vec(t):
    return t if t is None or vector_ok(t) else t.contiguous()


def _out_cols(x, layout):
    shape = x.shape
    if not shape:
        return shape  # 0-dim: the library refuses it with a message naming it
    c = shape[-1]
    return shape[:-1] + (c if layout == _capi.LAYOUT_SEPARATE else c // 2,)


# ---------------------------------------------------------------------------
# Kernels (CPU and CUDA)
# ---------------------------------------------------------------------------


def _glu_kernel(x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    x, up, weights = _rows(x), _rows(up), _vec(weights)
    out = x.new_empty(_out_cols(x, layout))
    s = _WS.slots
    status = _fwd(
        _params(act, alpha, limit, beta), layout, _dl(s[0], x),
        None if up is None else _dl(s[1], up),
        None if weights is None else _dl(s[2], weights),
        _dl(s[3], out), _stream(x))
    if status:
        _raise(status)
    return out


def _glu_backward_kernel(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta):
    grad_out, x, up, weights = _rows(grad_out), _rows(x), _rows(up), _vec(weights)
    gx = x.new_empty(x.shape)
    gu = None if up is None else up.new_empty(up.shape)
    gw = None
    if weights_grad:
        # With no weights: a 0-element buffer, which the library refuses with its own message.
        gw = torch.empty(weights.shape if weights is not None else (0,), dtype=torch.float32,
                         device=(weights if weights is not None else x).device)
    s = _WS.slots
    status = _bwd(
        _params(act, alpha, limit, beta), layout, _dl(s[0], grad_out), _dl(s[1], x),
        None if up is None else _dl(s[2], up),
        None if weights is None else _dl(s[3], weights),
        _dl(s[4], gx),
        None if gu is None else _dl(s[5], gu),
        None if gw is None else _dl(s[6], gw), _stream(x))
    if status:
        _raise(status)
    res = [gx]
    if gu is not None:
        res.append(gu)
    if gw is not None:
        res.append(gw)
    return res


def _glu_backward_inplace_kernel(grad_out, x, up, weights, grad_weights, layout, act, alpha, limit, beta):
    grad_out, weights = _rows(grad_out), _vec(weights)
    # The library writes in place only over a row-strided view; anything else goes
    # through one contiguous copy that is written back.
    xs = _rows(x)
    us = _rows(up)
    gws = _vec(grad_weights)
    s = _WS.slots
    xr = _dl(s[1], xs)
    ur = None if us is None else _dl(s[2], us)
    status = _bwd(
        _params(act, alpha, limit, beta), layout, _dl(s[0], grad_out), xr, ur,
        None if weights is None else _dl(s[3], weights),
        xr, ur, None if gws is None else _dl(s[6], gws), _stream(x))
    if status:
        _raise(status)
    if xs is not x:
        x.copy_(xs)
    if us is not up:
        up.copy_(us)
    if gws is not grad_weights:
        grad_weights.copy_(gws)


for _key in ("CPU", "CUDA"):
    _LIB.impl("glu", _glu_kernel, _key)
    _LIB.impl("glu_backward", _glu_backward_kernel, _key)
    _LIB.impl("glu_backward_", _glu_backward_inplace_kernel, _key)


def _glu_backward_inplace_adinplaceorview(keyset, grad_out, x, up, weights, grad_weights, *args):
    # Bump the version counters of what the op writes, as built-in in-place ops do:
    # any autograd node that saved x or up (or a view of them) then fails loudly.
    tensors = [x]
    if up is not None:
        tensors.append(up)
    if grad_weights is not None:
        tensors.append(grad_weights)
    for t in tensors:  # one at a time: older torch takes a single tensor
        torch.autograd.graph.increment_version(t)
    return glu_backward_inplace_op.redispatch(
        keyset & torch._C._after_ADInplaceOrView_keyset, grad_out, x, up, weights, grad_weights, *args)


_LIB.impl("glu_backward_", _glu_backward_inplace_adinplaceorview, "ADInplaceOrView", with_keyset=True)

glu_op = torch.ops.expertact.glu.default
glu_backward_op = torch.ops.expertact.glu_backward.default
glu_backward_inplace_op = torch.ops.expertact.glu_backward_.default


# ---------------------------------------------------------------------------
# Fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors
# ---------------------------------------------------------------------------


@torch.library.register_fake("expertact::glu", lib=_LIB)
def _glu_fake(x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    return x.new_empty(_out_cols(x, layout))


@torch.library.register_fake("expertact::glu_backward", lib=_LIB)
def _glu_backward_fake(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta):
    res = [x.new_empty(x.shape)]
    if up is not None:
        res.append(up.new_empty(up.shape))
    if weights_grad:
        res.append(x.new_empty(weights.shape if weights is not None else (0,), dtype=torch.float32))
    return res


@torch.library.register_fake("expertact::glu_backward_", lib=_LIB)
def _glu_backward_inplace_fake(grad_out, x, up, weights, grad_weights, layout, act, alpha, limit, beta):
    return None


# ---------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------

_CREATE_GRAPH_MSG = (
    "expertact: backward with create_graph=True is not supported: the fused backward has no "
    "derivative of its own (it would silently give a wrong second derivative). Use the eager "
    "PyTorch expression where double backward is needed."
)
_SECOND_BACKWARD_MSG = (
    "expertact: this graph's backward already ran with inplace_backward=True, which wrote the "
    "gradients over the saved inputs; a second backward (retain_graph=True) would read "
    "gradients as inputs. Call with inplace_backward=False to backward more than once."
)


_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


class _Glu(torch.autograd.Function):
    """The autograd node of expertact::glu. Registered by hand as the op's Autograd kernel
    rather than through torch.library.register_autograd, whose wrapper re-reads the schema's
    arguments on every call (~O(args^2) Python objects: tens of microseconds a call)."""

    @staticmethod
    def forward(ctx, keyset, x, up, weights, layout, act, alpha, limit, beta, inplace_backward):
        with torch._C._AutoDispatchBelowAutograd():
            out = glu_op.redispatch(keyset & _BELOW_AUTOGRAD, x, up, weights, layout, act, alpha, limit, beta,
                                    inplace_backward)
        ctx.save_for_backward(x, up, weights)
        ctx.args = (layout, act, alpha, limit, beta)
        ctx.inplace = inplace_backward
        ctx.spent = False
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError(_CREATE_GRAPH_MSG)
        if ctx.spent:
            raise RuntimeError(_SECOND_BACKWARD_MSG)
        _, need_x, need_up, need_w = ctx.needs_input_grad[:4]
        x, up, weights = ctx.saved_tensors
        grad = _rows(grad)
        weights_grad = weights is not None and need_w
        # In place only when every tensor it would overwrite wants its gradient: never
        # destroy an input that is not being differentiated.
        if ctx.inplace and need_x and (up is None or need_up):
            ctx.spent = True
            gw = None
            if weights_grad:
                gw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
            glu_backward_inplace_op(grad, x, up, weights, gw, *ctx.args)
            # Fresh aliases of the overwritten inputs: an AccumulateGrad of a leaf can then
            # take them as .grad without a copy.
            gx = x.detach()
            gu = None if up is None else up.detach()
            return None, gx, gu, gw, None, None, None, None, None, None
        res = glu_backward_op(grad, x, up, weights, weights_grad, *ctx.args)
        gx = res[0]
        gu = res[1] if up is not None else None
        gw = res[-1] if weights_grad else None
        return None, gx, gu, gw, None, None, None, None, None, None


def _glu_autograd(keyset, x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    if torch.is_grad_enabled() and (x.requires_grad or (up is not None and up.requires_grad)
                                    or (weights is not None and weights.requires_grad)):
        return _Glu.apply(keyset, x, up, weights, layout, act, alpha, limit, beta, inplace_backward)
    with torch._C._AutoDispatchBelowAutograd():
        return glu_op.redispatch(keyset & _BELOW_AUTOGRAD, x, up, weights, layout, act, alpha, limit, beta,
                                 inplace_backward)


_LIB.impl("glu", _glu_autograd, "Autograd", with_keyset=True)
