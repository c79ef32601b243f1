"""The one layer between Python and the C library (include/expertact/expertact_c.h): it loads
the library, declares every entry point's prototype, describes tensors as expertact_tensor
(the ABI's one tensor description) and maps a failed status to its exception. The rest of
the package calls C through the names defined here; the library's information (has_cuda,
cpu_threads, ...) needs no torch, the descriptions of tensors do.

The cost of a call is what matters here (a ctypes call over raw pointers costs under half
of what each tensor costs through a __dlpack__ capsule), so the structs of a call live in
one per-thread buffer, FRAME: the params, then SLOTS tensor descriptions, each filled by one
struct.pack_into, each with its byref() made once. The entry points have no argtypes:
converting an argument through argtypes adds about a tenth of the call's cost; callers pass
byref()s or None for pointers, c_void_p for the stream and Python ints for int32 and int64
values (c_int64 / c_size_t where an int could exceed 32 bits).
"""
from __future__ import annotations

import ctypes
import math
import os
import struct
import sys
import threading
from ctypes import POINTER, byref, c_char_p, c_float, c_int32, c_int64, c_size_t, c_uint8, c_uint16, c_void_p

try:
    import torch
except ImportError:  # the C library alone: no tensor descriptions
    torch = None

ABI_VERSION = 5

# expertact_status values
OK, INVALID_ARGUMENT, UNSUPPORTED, CUDA_ERROR, INTERNAL, INVALID_DTYPE = 0, 1, 2, 3, 4, 5

# DLPack codes (dlpack.h)
DL_CPU, DL_CUDA = 1, 2
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_COMPLEX, DL_BOOL = 0, 1, 2, 4, 5, 6
DL_FLOAT8_E4M3FN = 10  # DLPack 1.1 (expertact_c.h: EXPERTACT_DL_FLOAT8_E4M3FN)

LAYOUT_SEPARATE, LAYOUT_HALVES, LAYOUT_HALVES_UP_FIRST, LAYOUT_INTERLEAVED = 0, 1, 2, 3
ACT_SILU, ACT_GELU_TANH = 0, 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    """dlpack.h's DLTensor: the description of a tensor of any strides, which one entry takes
    (expertact_fp8_quantize_blocks: weights in any orientation)."""

    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", ctypes.c_uint64)]


class Tensor(ctypes.Structure):
    """expertact_tensor: a row-strided [rows, cols] view; a vector is a column [n, 1]."""

    _fields_ = [("data", c_void_p), ("rows", c_int64), ("cols", c_int64), ("row_stride", c_int64),
                ("dtype", DLDataType), ("device", DLDevice)]


class Params(ctypes.Structure):
    """expertact_params: act (0 silu, 1 gelu_tanh), alpha, limit (+inf: no clamp), beta."""

    _fields_ = [("act", c_int32), ("alpha", c_float), ("limit", c_float), ("beta", c_float)]


class ExpertactError(RuntimeError):
    """An internal error of the library (EXPERTACT_INTERNAL): please report it."""


class DTypeError(TypeError, ValueError):
    """A dtype the library does not take, or one that differs from its partner's
    (EXPERTACT_INVALID_DTYPE). Both a TypeError (torch's convention) and a ValueError
    (DeepSpeed's kernels raise ValueError for gate and up of different dtypes)."""


# ---------------------------------------------------------------------------
# The library and its prototypes
# ---------------------------------------------------------------------------

_T = None  # an argument without a declared type (the hot entries below)
# name -> (restype, argtypes); argtypes None: not declared (see the module note).
PROTOTYPES = {
    "expertact_preset": (c_int32, [c_char_p, c_float, c_float, POINTER(Params)]),
    "expertact_tensor_from_dlpack": (c_int32, None),
    "expertact_vector_from_dlpack": (c_int32, None),
    "expertact_glu_forward": (c_int32, None),
    "expertact_glu_backward": (c_int32, None),
    "expertact_glu_bias_workspace_bytes": (c_size_t, [c_int64, c_int64, c_int64]),
    "expertact_expert_bias_workspace_bytes": (c_size_t, [c_int64, c_int64, c_int64]),
    "expertact_glu_forward_bias": (c_int32, None),
    "expertact_glu_backward_bias": (c_int32, None),
    "expertact_expert_bias_forward": (c_int32, None),
    "expertact_expert_bias_backward": (c_int32, None),
    "expertact_fp8_quantize_rowwise": (c_int32, None),
    "expertact_fp8_quantize_colwise_grouped": (c_int32, None),
    "expertact_fp8_glu_rowwise": (c_int32, None),
    "expertact_fp8_glu_rowwise_bias": (c_int32, None),
    "expertact_fp8_glu_colwise_grouped": (c_int32, None),
    "expertact_fp8_glu_backward_rowwise": (c_int32, None),
    # FP8 blockwise operands
    "expertact_fp8_quantize_row_tiles": (c_int32, None),
    "expertact_fp8_quantize_column_tiles_grouped": (c_int32, None),
    "expertact_fp8_quantize_blocks": (c_int32, None),
    "expertact_fp8_glu_row_tiles": (c_int32, None),
    "expertact_fp8_glu_column_tiles_grouped": (c_int32, None),
    "expertact_fp8_glu_backward_tiles": (c_int32, None),
    "expertact_last_error": (c_char_p, []),
    "expertact_has_cuda": (c_int32, []),
    "expertact_abi_version": (c_int32, []),
    "expertact_cpu_threads": (c_int32, []),
    "expertact_set_cpu_threads": (None, [c_int32]),
    "expertact_cpu_kernel_isa": (c_char_p, []),
}


def _library_path() -> str:
    override = os.environ.get("EXPERTACT_LIBRARY")
    if override:
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    names = {"win32": "expertact.dll", "darwin": "libexpertact.dylib"}
    return os.path.join(here, names.get(sys.platform, "libexpertact.so"))


def _load():
    path = _library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(
            f"expertact: cannot load the C library {path!r} ({e}); build and install the package "
            "with `pip install .` (or point EXPERTACT_LIBRARY at a built libexpertact.so)"
        ) from None
    try:
        got = lib.expertact_abi_version()
    except AttributeError:
        got = None
    if got != ABI_VERSION:
        raise ImportError(f"expertact: {path!r} has C ABI version {got}, this package expects {ABI_VERSION}: "
                          "rebuild it (pip install .)")
    for name, (restype, argtypes) in PROTOTYPES.items():
        f = getattr(lib, name)
        f.restype = restype
        if argtypes is not None:
            f.argtypes = argtypes
    return lib, path


LIB, LIBRARY_PATH = _load()


def last_error() -> str:
    msg = LIB.expertact_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


_STATUS_ERRORS = {INVALID_ARGUMENT: ValueError, INVALID_DTYPE: DTypeError, UNSUPPORTED: NotImplementedError,
                  CUDA_ERROR: RuntimeError}


def raise_for(status: int) -> None:
    """Maps a failed status to the Python exception for it, with the library's message.

    The class follows the status code alone, never the message: INVALID_ARGUMENT ->
    ValueError, INVALID_DTYPE -> DTypeError (a TypeError and a ValueError), UNSUPPORTED ->
    NotImplementedError (a RuntimeError), CUDA_ERROR -> RuntimeError, anything else ->
    ExpertactError (a RuntimeError).
    """
    msg = "expertact: " + (last_error() or f"call failed with status {status}")
    cls = _STATUS_ERRORS.get(status)
    if cls is None:
        raise ExpertactError(msg + " (internal error: please report it)")
    raise cls(msg)


def check(status: int) -> None:
    """Raises for a failed status (raise_for); nothing for EXPERTACT_OK."""
    if status:
        raise_for(status)


def has_cuda() -> bool:
    """Whether this build of the library has the CUDA path."""
    return bool(LIB.expertact_has_cuda())


def abi_version() -> int:
    return int(LIB.expertact_abi_version())


def cpu_threads() -> int:
    """Worker threads of the CPU path."""
    return int(LIB.expertact_cpu_threads())


def set_cpu_threads(n: int) -> None:
    """Sets the CPU path's worker threads (0 restores the default: EXPERTACT_NUM_THREADS, else all cores)."""
    LIB.expertact_set_cpu_threads(int(n))


def cpu_kernel_isa() -> str:
    """The CPU kernels in use: "avx2+fma+f16c" or "baseline"."""
    return LIB.expertact_cpu_kernel_isa().decode()


def preset(name: str, alpha: float = math.nan, limit: float = math.nan) -> tuple:
    """(act, alpha, limit, beta) of a named preset, as the C library defines it (NaN keeps a default)."""
    p = Params()
    check(LIB.expertact_preset(name.encode(), alpha, limit, byref(p)))
    return (p.act, p.alpha, p.limit, p.beta)


def glu_bias_workspace_bytes(rows: int, F: int, num_experts: int) -> int:
    return LIB.expertact_glu_bias_workspace_bytes(rows, F, num_experts)


def expert_bias_workspace_bytes(rows: int, cols: int, num_experts: int) -> int:
    return LIB.expertact_expert_bias_workspace_bytes(rows, cols, num_experts)


# ---------------------------------------------------------------------------
# The per-thread frame of a call: params and SLOTS descriptions in one buffer
# ---------------------------------------------------------------------------

# The structs as struct formats (standard sizes, native byte order, explicit padding), so
# that one struct.pack_into fills a whole description (7x faster to fill than a DLTensor set
# field by field); checked against ctypes below.
PARAMS_FMT = "ifff"             # act, alpha, limit, beta
TENSOR_FMT = "Qqqq12s4x"        # data, rows, cols, row_stride, dtype + device (dl_tail), padding
_TAIL = struct.Struct("=BBHii")  # DLDataType (code, bits, lanes) + DLDevice (type, id)
PARAMS_BYTES = ctypes.sizeof(Params)
TENSOR_BYTES = ctypes.sizeof(Tensor)
SLOTS = 14  # the most descriptions one entry takes (expertact_glu_backward_bias: 10)


def _check_layouts():
    head = TENSOR_FMT[:TENSOR_FMT.index("12s")]
    ok = (ctypes.sizeof(c_void_p) == 8 and struct.calcsize("=" + PARAMS_FMT) == PARAMS_BYTES
          and struct.calcsize("=" + TENSOR_FMT) == TENSOR_BYTES and struct.calcsize("=" + head) == Tensor.dtype.offset
          and Tensor.device.offset == Tensor.dtype.offset + 4)
    if not ok:
        raise ImportError("expertact: the packed tensor descriptions assume 64-bit pointers and the x86-64 / "
                          "aarch64 struct layout, which this platform does not have")


_check_layouts()

pack_params_into = struct.Struct("=" + PARAMS_FMT).pack_into
pack_tensor_into = struct.Struct("=" + TENSOR_FMT).pack_into
#: Byte offset of slot i in the frame's buffer.
SLOT_OFFSET = tuple(PARAMS_BYTES + i * TENSOR_BYTES for i in range(SLOTS))


def dl_tail(code: int, bits: int, device_type: int, device_id: int) -> bytes:
    """The dtype and device fields of an expertact_tensor, as packed bytes."""
    return _TAIL.pack(code, bits, 1, device_type, device_id)


class Frame(threading.local):
    """One thread's structs: autograd may run a backward on another thread than its forward.
    buf holds the params at 0 and slot i at SLOT_OFFSET[i]; params and slot[i] are their byref()s."""

    def __init__(self):
        self.buf = (ctypes.c_char * (PARAMS_BYTES + SLOTS * TENSOR_BYTES))()
        self.params = byref(self.buf, 0)
        self.slot = tuple(byref(self.buf, off) for off in SLOT_OFFSET)


FRAME = Frame()

_INT32 = range(-(1 << 31), 1 << 31)


def int32(v: int) -> int:
    """v saturated to int32, so that the library names an out-of-range value as out of range
    (ctypes would truncate 2**32 to 0, a valid code)."""
    return v if v in _INT32 else (_INT32.stop - 1 if v > 0 else _INT32.start)


def pack_params(buf, act, alpha, limit, beta) -> None:
    """expertact_params at the start of buf."""
    try:
        pack_params_into(buf, 0, act, alpha, limit, beta)
    except (struct.error, OverflowError):
        # Out of float32 / int32 range: the values the C struct would hold (a float past
        # float32's range is +-inf, which the library refuses or reads as "no clamp").
        pack_params_into(buf, 0, int32(int(act)), c_float(alpha).value, c_float(limit).value, c_float(beta).value)


# ---------------------------------------------------------------------------
# Describing torch tensors
# ---------------------------------------------------------------------------

if torch is not None:
    # torch dtype -> DLPack (code, bits). The library takes the floating types (and int32
    # offsets, float8_e4m3fn FP8 outputs); the others are named so that its message says
    # what was passed.
    DL_CODES = {
        torch.float32: (DL_FLOAT, 32),
        torch.float16: (DL_FLOAT, 16),
        torch.bfloat16: (DL_BFLOAT, 16),
        torch.float64: (DL_FLOAT, 64),
        torch.int8: (DL_INT, 8),
        torch.int16: (DL_INT, 16),
        torch.int32: (DL_INT, 32),
        torch.int64: (DL_INT, 64),
        torch.uint8: (DL_UINT, 8),
        torch.bool: (DL_BOOL, 8),
        torch.complex64: (DL_COMPLEX, 64),
        torch.complex128: (DL_COMPLEX, 128),
    }
    if hasattr(torch, "float8_e4m3fn"):
        DL_CODES[torch.float8_e4m3fn] = (DL_FLOAT8_E4M3FN, 8)
    try:  # the raw cudaStream_t of a device's current stream, without building a torch.cuda.Stream
        from torch._C import _cuda_getCurrentRawStream as _raw_stream
    except ImportError:  # CPU-only torch builds
        _raw_stream = None
else:
    DL_CODES = {}
    _raw_stream = None
_UNKNOWN_DTYPE_CODE = 255

# (dtype, device) -> the packed dtype + device fields: CPU tensors in _CPU_TAILS, CUDA
# tensors in _CUDA_TAILS[device index], filled on first use.
_CPU_TAILS = {dt: dl_tail(c, b, DL_CPU, 0) for dt, (c, b) in DL_CODES.items()}
_CUDA_TAILS = {}


def tail(t) -> bytes:
    """The dtype and device of tensor t as a description carries them (12 packed bytes)."""
    if t.is_cpu:
        found = _CPU_TAILS.get(t.dtype)
        if found is not None:
            return found
    elif t.is_cuda:
        tails = _CUDA_TAILS.get(t.get_device())
        found = None if tails is None else tails.get(t.dtype)
        if found is not None:
            return found
    return _new_tail(t)


def _new_tail(t) -> bytes:
    code, bits = DL_CODES.get(t.dtype, (_UNKNOWN_DTYPE_CODE, t.element_size() * 8))
    if t.is_cuda:
        idx = t.get_device()
        found = dl_tail(code, bits, DL_CUDA, idx)
        if t.dtype in DL_CODES:
            _CUDA_TAILS.setdefault(idx, {})[t.dtype] = found
        return found
    # 0: neither cpu nor cuda, which the library names
    return dl_tail(code, bits, DL_CPU if t.is_cpu else 0, 0)


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
        return True  # nothing to read, or 0-dim: refused where it is described
    return _row_stride(shape, t.stride()) is not None


def _vector_stride(shape, stride):
    """The one stride of a per-row vector's elements, or None."""
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
    """Whether a per-row vector collapses into one stride (else it is copied)."""
    return t.is_contiguous() or _vector_stride(t.shape, t.stride()) is not None


def as_rows(t, name: str):
    """(t, rows, cols, row_stride): t read as a row-strided matrix, or its contiguous copy
    when it cannot be (the leading dims do not collapse). A 0-dim tensor has no rows:
    ValueError naming the argument."""
    shape = t.shape
    n = len(shape)
    if n == 2:
        rows, cols = shape
        if t.is_contiguous():
            return t, rows, cols, cols
    elif n == 0:
        raise ValueError(f"expertact: {name} is 0-dimensional; expected [..., features] with at least one "
                         "dimension")
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


def as_vector(t):
    """(t, size, stride) of a per-row vector, t copied when its elements do not collapse."""
    if t.is_contiguous():
        return t, t.numel(), 1
    stride = _vector_stride(t.shape, t.stride())
    if stride is None:
        t = t.contiguous()
        stride = 1
    return t, t.numel(), stride


def put(i: int, t, name: str):
    """Describes tensor t ([..., C], copied when its rows do not collapse) in slot i of this
    thread's frame: (the tensor described, which the caller keeps alive over the call, the
    slot's byref)."""
    t, rows, cols, rs = as_rows(t, name)
    f = FRAME
    pack_tensor_into(f.buf, SLOT_OFFSET[i], t.data_ptr(), rows, cols, rs, tail(t))
    return t, f.slot[i]


def put_vector(i: int, t):
    """Describes a per-row vector (weights, scales, offsets) as the column [n, 1] in slot i:
    (the tensor described, the slot's byref), as put."""
    t, n, stride = as_vector(t)
    f = FRAME
    pack_tensor_into(f.buf, SLOT_OFFSET[i], t.data_ptr(), n, 1, stride, tail(t))
    return t, f.slot[i]


def put_params(act, alpha, limit, beta):
    """expertact_params in this thread's frame: its byref."""
    f = FRAME
    pack_params(f.buf, act, alpha, limit, beta)
    return f.params


def dl_tensor(t):
    """t described as a DLTensor with its own shape and strides (no copy): (the DLTensor, which
    holds its shape and stride arrays; the caller keeps it and t alive over the call)."""
    code, bits = DL_CODES.get(t.dtype, (_UNKNOWN_DTYPE_CODE, t.element_size() * 8))
    n = t.dim()
    d = DLTensor()
    d.data = t.data_ptr()
    d.device = DLDevice(DL_CUDA if t.is_cuda else DL_CPU if t.is_cpu else 0, t.get_device() if t.is_cuda else 0)
    d.ndim = n
    d.dtype = DLDataType(code, bits, 1)
    d._shape = (c_int64 * max(n, 1))(*t.shape)
    d._strides = (c_int64 * max(n, 1))(*t.stride())
    d.shape = ctypes.cast(d._shape, POINTER(c_int64))
    d.strides = ctypes.cast(d._strides, POINTER(c_int64))
    d.byte_offset = 0
    return d
