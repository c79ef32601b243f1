"""ctypes binding of the C ABI (include/expertact/expertact_c.h): the library, the DLPack
and 2-D description structs, and the status -> Python exception mapping. No torch here.

Per-call cost is what matters (about 1 us for ctypes over raw pointers against 2.4 us per
tensor through __dlpack__ capsules), so the structs of a call are allocated once per
thread: the 2-D descriptions in one buffer that struct.pack_into fills (the common path),
the DLTensor structs and their shape/stride arrays refilled field by field (for 0-dim
tensors only).
"""
from __future__ import annotations

import ctypes
import math
import os
import struct
import sys
import threading
from ctypes import POINTER, byref, c_char_p, c_float, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p

ABI_VERSION = 3

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
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class Matrix(ctypes.Structure):
    """expertact_matrix: a row-strided [rows, cols] view (the *_2d entry points)."""

    _fields_ = [("data", c_void_p), ("rows", c_int64), ("cols", c_int64), ("row_stride", c_int64),
                ("dtype", DLDataType), ("device", DLDevice)]


class Vector(ctypes.Structure):
    """expertact_vector: per-row float32 weights with one stride (the *_2d entry points)."""

    _fields_ = [("data", c_void_p), ("size", c_int64), ("stride", c_int64), ("dtype", DLDataType),
                ("device", DLDevice)]


class Params(ctypes.Structure):
    """expertact_params: act (0 silu, 1 gelu_tanh), alpha, limit (+inf: no clamp), beta."""

    _fields_ = [("act", c_int32), ("alpha", c_float), ("limit", c_float), ("beta", c_float)]


class ExpertactError(RuntimeError):
    """An internal error of the library (EXPERTACT_INTERNAL): please report it."""


class DTypeError(TypeError, ValueError):
    """A dtype the library does not take, or one that differs from its partner's
    (EXPERTACT_INVALID_DTYPE). Both a TypeError (torch's convention) and a ValueError
    (DeepSpeed's kernels raise ValueError for gate and up of different dtypes)."""


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
    P = POINTER(DLTensor)
    lib.expertact_preset.argtypes = [c_char_p, c_float, c_float, POINTER(Params)]
    lib.expertact_glu_forward.argtypes = [POINTER(Params), c_int32, P, P, P, P, c_void_p]
    lib.expertact_glu_backward.argtypes = [POINTER(Params), c_int32, P, P, P, P, P, P, P, c_void_p]
    try:
        fwd_2d, bwd_2d = lib.expertact_glu_forward_2d, lib.expertact_glu_backward_2d
    except AttributeError:
        raise ImportError(f"expertact: {path!r} lacks expertact_glu_forward_2d: it is older than this "
                          "package; rebuild it (pip install .)") from None
    # No argtypes on the 2-D entry points: converting each argument through argtypes costs
    # ~0.1 us (measured: 1.2 us against 0.4 us for a forward call). Every caller passes
    # byref() objects or None for pointers, c_void_p for the stream and int32 ints.
    for f in (lib.expertact_preset, lib.expertact_glu_forward, lib.expertact_glu_backward, fwd_2d, bwd_2d,
              lib.expertact_has_cuda, lib.expertact_abi_version, lib.expertact_cpu_threads):
        f.restype = c_int32
    lib.expertact_last_error.argtypes = []
    lib.expertact_last_error.restype = c_char_p
    lib.expertact_set_cpu_threads.argtypes = [c_int32]
    lib.expertact_set_cpu_threads.restype = None
    got = lib.expertact_abi_version()
    if got != ABI_VERSION:
        raise ImportError(f"expertact: {path!r} has C ABI version {got}, this package expects {ABI_VERSION}")
    return lib, path


LIB, LIBRARY_PATH = _load()
_forward = LIB.expertact_glu_forward
_backward = LIB.expertact_glu_backward
forward_2d = LIB.expertact_glu_forward_2d
backward_2d = LIB.expertact_glu_backward_2d


def last_error() -> str:
    msg = LIB.expertact_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


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


_STATUS_ERRORS = {INVALID_ARGUMENT: ValueError, INVALID_DTYPE: DTypeError, UNSUPPORTED: NotImplementedError,
                  CUDA_ERROR: RuntimeError}


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


def preset(name: str, alpha: float = math.nan, limit: float = math.nan) -> tuple:
    """(act, alpha, limit, beta) of a named preset, as the C library defines it (NaN keeps a default)."""
    p = Params()
    status = LIB.expertact_preset(name.encode(), alpha, limit, byref(p))
    if status:
        raise_for(status)
    return (p.act, p.alpha, p.limit, p.beta)


_MAX_DIMS = 8


class Slot:
    """One reusable DLTensor with room for _MAX_DIMS dims, plus views of its nested
    structs (each ctypes attribute access of a nested struct builds a new object)."""

    __slots__ = ("t", "dev", "shape", "strides", "ref")

    def __init__(self):
        self.t = DLTensor()
        self.dev = self.t.device
        self.t.dtype.lanes = 1
        self.ref = byref(self.t)
        self.resize(_MAX_DIMS)

    def resize(self, n: int) -> None:
        """Shape and stride arrays for n dims (kept alive here while the DLTensor points at them)."""
        self.shape = (c_int64 * n)()
        self.strides = (c_int64 * n)()
        self.t.shape = ctypes.cast(self.shape, POINTER(c_int64))
        self.t.strides = ctypes.cast(self.strides, POINTER(c_int64))


# The 2-D descriptions as struct formats, so that one struct.pack_into fills a whole
# operand (measured 0.15 us against 1.1 us for a DLTensor set field by field).
# Standard sizes, native byte order, explicit padding: checked against ctypes below.
PARAMS_FMT = "ifff"                 # act, alpha, limit, beta
MATRIX_FMT = "Qqqq12s4x"            # data, rows, cols, row_stride, dtype + device (dl_tail), padding
VECTOR_FMT = "Qqq12s4x"             # data, size, stride, dtype + device (dl_tail), padding
_TAIL = struct.Struct("=BBHii")     # DLDataType (code, bits, lanes) + DLDevice (type, id)


def _check_layouts():
    ok = ctypes.sizeof(c_void_p) == 8 and struct.calcsize("=" + PARAMS_FMT) == ctypes.sizeof(Params)
    for fmt, ct in ((MATRIX_FMT, Matrix), (VECTOR_FMT, Vector)):
        head = fmt[:fmt.index("12s")]
        ok = (ok and struct.calcsize("=" + fmt) == ctypes.sizeof(ct)
              and struct.calcsize("=" + head) == ct.dtype.offset and ct.device.offset == ct.dtype.offset + 4)
    if not ok:
        raise ImportError("expertact: the packed 2-D descriptions assume 64-bit pointers and the x86-64 / "
                          "aarch64 struct layout, which this platform does not have")


_check_layouts()


def dl_tail(code: int, bits: int, device_type: int, device_id: int) -> bytes:
    """The dtype and device fields of an expertact_matrix / expertact_vector, as packed bytes."""
    return _TAIL.pack(code, bits, 1, device_type, device_id)


# Offsets of the structs of one call in the per-thread buffer. The forward uses a
# prefix (params, x, up, weights, out), the backward all of it; the out slot is grad_x.
_OFFSETS = {}
_off = 0
for _name, _ct in (("params", Params), ("x", Matrix), ("up", Matrix), ("weights", Vector), ("out", Matrix),
                   ("grad_up", Matrix), ("grad_weights", Vector), ("grad_out", Matrix)):
    _OFFSETS[_name] = _off
    _off += ctypes.sizeof(_ct)
_BUFFER_BYTES = _off


class Workspace(threading.local):
    """Per-thread structs: autograd may run a backward on another thread than its forward."""

    def __init__(self):
        self.params = Params()
        self.params_ref = byref(self.params)
        self.slots = [Slot() for _ in range(7)]
        # The 2-D call: one buffer, and a byref() of each struct in it (made once: ~0.1 us each).
        self.buf = (ctypes.c_char * _BUFFER_BYTES)()
        refs = {name: byref(self.buf, off) for name, off in _OFFSETS.items()}
        (self.r_params, self.r_x, self.r_up, self.r_w, self.r_out, self.r_gu, self.r_gw,
         self.r_dy) = (refs[n] for n in ("params", "x", "up", "weights", "out", "grad_up", "grad_weights",
                                         "grad_out"))


WORKSPACE = Workspace()


def glu_forward(params_ref, layout: int, x, up, weights, out, stream: int) -> None:
    """Raw call: x, up, weights, out are byref(DLTensor) or None; raises on failure."""
    status = _forward(params_ref, layout, x, up, weights, out, stream)
    if status:
        raise_for(status)


def glu_backward(params_ref, layout: int, grad_out, x, up, weights, grad_x, grad_up, grad_weights,
                 stream: int) -> None:
    status = _backward(params_ref, layout, grad_out, x, up, weights, grad_x, grad_up, grad_weights, stream)
    if status:
        raise_for(status)
