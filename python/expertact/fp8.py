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
    h_q, h_scale = expertact.fp8.glu_rowwise(gate_up, "swiglu_oai", layout="interleaved")

CPU and CUDA (a warp per row, two passes). No autograd: these are operand producers for a
custom FP8 backward.
"""
from __future__ import annotations

from ctypes import byref, c_int32
from typing import Optional, Tuple

import torch

from . import _capi
from ._args import layout_code, preset_coeffs, tensor_arg
from ._bias import _check, _matrix, _params_ref, _vector, check_offsets
from ._describe import stream_of

__all__ = ["quantize_rowwise", "quantize_colwise_grouped", "glu_rowwise", "DL_FLOAT8_E4M3FN"]

#: DLPack 1.1's code of float8_e4m3fn (expertact_c.h: EXPERTACT_DL_FLOAT8_E4M3FN)
DL_FLOAT8_E4M3FN = _capi.DL_FLOAT8_E4M3FN

_LIB = _capi.LIB
_LIB.expertact_fp8_quantize_rowwise_2d.restype = c_int32
_LIB.expertact_fp8_glu_rowwise_2d.restype = c_int32
_LIB.expertact_fp8_quantize_colwise_grouped_2d.restype = c_int32


def _outputs(like, cols):
    shape = (*like.shape[:-1], cols)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=like.device)
    scale = torch.empty(shape[:-1], dtype=torch.float32, device=like.device)
    return q, scale


def quantize_rowwise(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): t [..., C] (float32, float16 or bfloat16) as float8_e4m3fn [..., C] with one
    float32 dequantisation scale per row ([...]); t ~= q.float() * scale[..., None]."""
    tensor_arg("t", t)
    if t.dim() < 1:
        raise ValueError("expertact.fp8.quantize_rowwise: t must have at least one dimension [..., C]")
    q, scale = _outputs(t, t.shape[-1])
    xs, qs, ss = _matrix(t), _matrix(q), _vector(scale.view(-1))
    _check(_LIB.expertact_fp8_quantize_rowwise_2d(byref(xs[1]), byref(qs[1]), byref(ss[1]), stream_of(t)))
    return q, scale


def quantize_colwise_grouped(t: torch.Tensor, offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) per expert and column: t [T, C] (rows sorted by expert; ``offsets`` int32 [E],
    each expert's cumulative end row) quantised with one scale per expert and column, taken over
    that expert's rows (the operands of the weight-gradient GEMMs; for weights [E, K, N], pass
    them as [E * K, N] with offsets (e + 1) * K). q: float8_e4m3fn [T, C] in column-major order
    (strides (1, T)), as torch._scaled_grouped_mm reads the reduction-major operand; scale:
    float32 [E, C]; t[r, c] ~= q[r, c] * scale[e(r), c]. Rows past offsets[-1] are 0 in q."""
    tensor_arg("t", t)
    if t.dim() != 2:
        raise ValueError(f"expertact.fp8.quantize_colwise_grouped: t must be 2-D [T, C] (got shape {tuple(t.shape)})")
    T, C = t.shape
    offsets = check_offsets(offsets, t, "expertact.fp8.quantize_colwise_grouped")
    E = offsets.numel()
    q_t = torch.empty((C, T), dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.empty((E, C), dtype=torch.float32, device=t.device)
    xs, qs, ss, offs = _matrix(t), _matrix(q_t), _matrix(scale), _vector(offsets)
    _check(_LIB.expertact_fp8_quantize_colwise_grouped_2d(byref(xs[1]), byref(offs[1]), byref(qs[1]), byref(ss[1]),
                                                          None))
    return q_t.t(), scale


def glu_rowwise(gate_up: torch.Tensor, activation: str = "swiglu", *, up: Optional[torch.Tensor] = None,
                alpha: Optional[float] = None, limit: Optional[float] = None, layout: Optional[str] = None,
                weights: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(h_q, scale): the gated activation of gate_up [..., 2F] (or gate [..., F] with ``up``,
    the separate layout) times ``weights``, quantised per row from its float32 values (one
    rounding) as :func:`quantize_rowwise` does: h_q float8_e4m3fn [..., F], scale float32 [...].
    ``activation`` is a preset name; ``alpha`` / ``limit`` for the forms that read them
    (default 1.702 and 7.0)."""
    tensor_arg("gate_up" if up is None else "gate", gate_up)
    tensor_arg("up", up, optional=True)
    tensor_arg("weights", weights, optional=True)
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, "expertact.fp8.glu_rowwise")
    code = layout_code(layout, up is None)
    if gate_up.dim() < 1:
        raise ValueError("expertact.fp8.glu_rowwise: gate_up must have at least one dimension")
    cols = gate_up.shape[-1] if up is not None else gate_up.shape[-1] // 2
    q, scale = _outputs(gate_up, cols)
    xs, qs, ss = _matrix(gate_up), _matrix(q), _vector(scale.view(-1))
    us = None if up is None else _matrix(up)
    ws = None if weights is None else _vector(weights)
    pref, _keep = _params_ref(act, a, lim, beta)
    _check(_LIB.expertact_fp8_glu_rowwise_2d(pref, c_int32(code), byref(xs[1]), None if us is None else byref(us[1]),
                                             None if ws is None else byref(ws[1]), byref(qs[1]), byref(ss[1]),
                                             stream_of(gate_up)))
    return q, scale
