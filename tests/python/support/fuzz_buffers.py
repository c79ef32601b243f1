"""The fuzzer's operands in their buffers: where a [..., cols] view lives (gaps between rows,
offsets, margins, leading dims that do not collapse), bitwise comparisons and guard checks,
and the raw C ABI calls over such views (tests/python/support/fuzz.py)."""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

import expertact
from expertact import _capi
from expertact._capi import rows_view_ok

_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ---------------------------------------------------------------------------
# Geometry: where a [..., cols] operand lives in its buffer
# ---------------------------------------------------------------------------


@dataclass
class Geom:
    """A row-strided view: `pad` elements after each row, the first element `offset` elements
    into the buffer, `tail` elements after the last row; `split3d`: for [a, b, cols] a gap row
    after every b rows, so the leading dims do not collapse (the binding copies such a view)."""
    pad: int = 0
    offset: int = 0
    tail: int = 0
    split3d: bool = False

    def short(self):
        s = f"p{self.pad}o{self.offset}t{self.tail}"
        return s + ("x" if self.split3d else "")


def strided(lead, cols, g: Geom, dtype, device, fill_byte):
    """(buffer, view): a 1-D buffer filled with fill_byte and a lead + (cols,) view of it."""
    stride = cols + g.pad
    shape = tuple(lead) + (cols,)
    strides = [1]
    acc = stride
    for i, d in enumerate(reversed(lead)):
        strides.insert(0, acc)
        # the gap row of split3d: after the innermost leading dim
        acc *= d + (1 if g.split3d and i == 0 and len(lead) > 1 else 0)
    rows = math.prod(lead)
    if rows == 0 or cols == 0:
        n = g.offset + g.tail + 1
    else:
        n = g.offset + sum((d - 1) * s for d, s in zip(shape, strides)) + 1 + g.tail
    buf = torch.empty(n, dtype=dtype, device=device)
    buf.view(torch.uint8).fill_(fill_byte)
    return buf, buf.as_strided(shape, tuple(strides), g.offset)


def view_mask(buf, view):
    """Bool mask over buf's elements: True where view has an element."""
    m = torch.zeros(buf.shape, dtype=torch.bool, device=buf.device)
    if view.numel():
        m.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(True)
    return m


def bits(t):
    return t.view(_INT_OF.get(t.dtype, torch.int32))


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def same_values(a, b):
    """Equal NaN positions and bitwise-equal other values (NaN payloads carry no meaning)."""
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(bits(a)[~na], bits(b)[~nb])


def guard_intact(buf, view, byte):
    """Whether every element of buf outside view still holds the poison byte pattern."""
    pattern = torch.empty(1, dtype=buf.dtype, device=buf.device)
    pattern.view(torch.uint8).fill_(byte)
    outside = ~view_mask(buf, view)
    return bool((bits(buf)[outside] == bits(pattern)).all())


def ulp_diff(a, b):
    """Largest distance in units in the last place between two same-dtype tensors (NaN skipped)."""
    ok = ~(a.isnan() | b.isnan())
    if not ok.any():
        return 0
    ia, ib = bits(a)[ok].long(), bits(b)[ok].long()
    # sign-magnitude -> a monotone integer line
    top = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + top), ia)
    ib = torch.where(ib < 0, -(ib + top), ib)
    return int((ia - ib).abs().max())


class DLTensor(ctypes.Structure):
    """dlpack.h's DLTensor: the fuzzer describes its operands this way and lets the library's
    helpers (expertact_tensor_from_dlpack, expertact_vector_from_dlpack) make the ABI's
    descriptions of them, so the helpers' collapsing of N-D shapes and strides is fuzzed too."""

    _fields_ = [("data", ctypes.c_void_p), ("device", _capi.DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _capi.DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_DTYPE = {torch.float32: (_capi.DL_FLOAT, 32), torch.float16: (_capi.DL_FLOAT, 16),
             torch.bfloat16: (_capi.DL_BFLOAT, 16)}


class Raw:
    """Calls of the C ABI with caller-owned outputs (the Python ops allocate theirs). p: the
    problem (its act, alpha, limit, beta, layout, w_stride and gw_stride are read)."""

    def __init__(self, p):
        self.p = p
        self.params = _capi.Params()
        self.params.act = expertact.ACTIVATIONS[p.act]
        self.params.alpha, self.params.limit, self.params.beta = p.alpha, p.limit, p.beta
        self.layout = expertact.LAYOUTS[p.layout]
        self.descs = [_capi.Tensor() for _ in range(7)]
        self.keep = []

    def _describe(self, i, t, vector, data=None, stride0=None):
        """The library's description of t (a DLTensor of its shape and strides) in descs[i]."""
        n = t.dim()
        shape = (ctypes.c_int64 * max(n, 1))(*t.shape)
        strides = (ctypes.c_int64 * max(n, 1))(*t.stride())
        if stride0 is not None:
            strides[0] = stride0
        code, bits_ = _DL_DTYPE[t.dtype]
        dl = DLTensor(data if data is not None else t.data_ptr(),
                      _capi.DLDevice(_capi.DL_CUDA if t.is_cuda else _capi.DL_CPU, t.get_device() if t.is_cuda else 0),
                      n, _capi.DLDataType(code, bits_, 1), shape, strides, 0)
        helper = _capi.LIB.expertact_vector_from_dlpack if vector else _capi.LIB.expertact_tensor_from_dlpack
        _capi.check(helper(ctypes.byref(dl), ctypes.byref(self.descs[i])))
        return ctypes.byref(self.descs[i])

    def mat(self, i, t):
        if t is None:
            return None
        if not rows_view_ok(t):
            t = t.contiguous()  # what the binding does; the helper refuses such strides
        self.keep.append(t)
        return self._describe(i, t, False)

    def vec(self, i, pos, backwards):
        """A float32 vector given by its positive-stride view; backwards: the logical vector
        walks it from the end (a negative stride, which torch cannot express)."""
        if pos is None:
            return None
        if backwards and pos.numel():
            return self._describe(i, pos, True, data=pos[-1].data_ptr(), stride0=-pos.stride(0))
        return self._describe(i, pos, True)

    @staticmethod
    def stream(t):
        return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0)

    def forward(self, x, up, w, out):
        self.keep = []
        _capi.check(_capi.LIB.expertact_glu_forward(
            ctypes.byref(self.params), self.layout, self.mat(0, x), self.mat(1, up),
            self.vec(2, w, self.p.w_stride < 0), self.mat(3, out), self.stream(x)))

    def backward(self, dy, x, up, w, gx, gu, gw):
        self.keep = []
        _capi.check(_capi.LIB.expertact_glu_backward(
            ctypes.byref(self.params), self.layout, self.mat(0, dy), self.mat(1, x), self.mat(2, up),
            self.vec(3, w, self.p.w_stride < 0), self.mat(4, gx), self.mat(5, gu),
            self.vec(6, gw, self.p.gw_stride < 0), self.stream(x)))
