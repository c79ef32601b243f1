"""The public functional API: one function per preset and a generic glu(), each taking
(gate, up) or one packed gate_up tensor with a layout, optional per-row weights, and an
opt-in in-place backward. Thin: it picks the operator's arguments; the C library
validates everything and computes everything.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _capi
from ._ops import _plain, eager_ok, glu_eager, glu_op, rows_view_ok, vector_ok

__all__ = ["glu", "swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh", "LAYOUTS", "ACTIVATIONS", "PRESETS"]

Tensor = torch.Tensor

#: Layout names -> the C ABI's layout codes (SPEC section 2). A packed tensor is [..., 2F].
LAYOUTS = {
    "separate": _capi.LAYOUT_SEPARATE,
    "halves": _capi.LAYOUT_HALVES,  # gate_up[..., :F] = gate (DeepSpeed's fused gate+up GEMM)
    "up_first": _capi.LAYOUT_HALVES_UP_FIRST,  # gate_up[..., :F] = up (FlashInfer, TransformerEngine)
    "halves_up_first": _capi.LAYOUT_HALVES_UP_FIRST,
    "interleaved": _capi.LAYOUT_INTERLEAVED,  # gate_up[..., 0::2] = gate (GPT-OSS checkpoints)
}

#: Activation names -> the C ABI's act codes.
ACTIVATIONS = {"silu": _capi.ACT_SILU, "gelu_tanh": _capi.ACT_GELU_TANH}

_INF = math.inf

#: The presets of SPEC section 1: (act, alpha, limit, beta); None = the caller's value.
#: tests/python checks this table against the C library's expertact_preset().
PRESETS = {
    "swiglu": (_capi.ACT_SILU, 1.0, _INF, 0.0),
    "swiglu_clamped": (_capi.ACT_SILU, 1.0, None, 0.0),
    "swiglu_oai": (_capi.ACT_SILU, None, None, 1.0),
    "geglu_tanh": (_capi.ACT_GELU_TANH, 1.0, _INF, 0.0),
}


def _tensor_arg(name: str, t, optional: bool = False):
    if isinstance(t, Tensor) or (optional and t is None):
        return t
    want = "a torch.Tensor or None" if optional else "a torch.Tensor"
    raise TypeError(f"expertact: {name} must be {want} (got {type(t).__name__})")


def _float_arg(name: str, v) -> float:
    if not isinstance(v, (bool, str, bytes, Tensor)):
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"expertact: {name} must be a number (got {type(v).__name__})")


def _layout_code(layout, packed: bool) -> int:
    if layout is None:
        return LAYOUTS["halves"] if packed else LAYOUTS["separate"]
    code = LAYOUTS.get(layout) if isinstance(layout, str) else None
    if code is None:
        raise ValueError(
            f"expertact: layout={layout!r} is not one of 'separate', 'halves', 'up_first', 'interleaved'")
    if packed != (code != _capi.LAYOUT_SEPARATE):
        if packed:
            raise ValueError(f"expertact: layout={layout!r} takes gate and up; up is missing "
                             "(pass one packed tensor with layout='halves', 'up_first' or 'interleaved')")
        raise ValueError(f"expertact: layout={layout!r} takes one packed gate_up tensor, but up was "
                         "given too (pass gate and up with layout='separate' or no layout)")
    return code


def _call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward):
    packed = up is None
    if not isinstance(gate, Tensor):
        _tensor_arg("gate_up" if packed else "gate", gate)
    if not (packed or isinstance(up, Tensor)):
        _tensor_arg("up", up, optional=True)
    if not (weights is None or isinstance(weights, Tensor)):
        _tensor_arg("weights", weights, optional=True)
    code = _layout_code(layout, packed)
    # The library reads row-strided views in place; other strides are copied once,
    # here, so that autograd routes the gradient back through the copy (and an in-place
    # backward overwrites the copy, not the caller's tensor).
    if not (gate.is_contiguous() or rows_view_ok(gate)):
        gate = gate.contiguous()
    if not (packed or up.is_contiguous() or rows_view_ok(up)):
        up = up.contiguous()
    if not (weights is None or weights.is_contiguous() or vector_ok(weights)):
        weights = weights.contiguous()
    inplace_backward = bool(inplace_backward)
    # Plain tensors in eager mode: the kernel bodies without the dispatcher (docs/python.md,
    # "The binding"); otherwise the operator, which torch.compile and modes see.
    if eager_ok() and _plain(gate) and (packed or _plain(up)) and (weights is None or _plain(weights)):
        return glu_eager(gate, up, weights, code, act, alpha, limit, beta, inplace_backward)
    return glu_op(gate, up, weights, code, act, alpha, limit, beta, inplace_backward)


def glu(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
        activation: str = "silu", alpha: float = 1.0, limit: Optional[float] = None, beta: float = 0.0,
        weights: Optional[Tensor] = None, inplace_backward: bool = False) -> Tensor:
    """The general gated activation, per element (SPEC section 1)::

        out = act(min(g, limit)) * (clamp(u, -limit, limit) + beta) * w

    Args:
        gate, up: [..., F] tensors (float32, float16 or bfloat16) of the separate layout; or
            ``gate`` alone, a packed [..., 2F] tensor, with ``up=None``.
        layout: ``"separate"`` (default with two tensors), ``"halves"`` (default with one:
            gate_up[..., :F] is gate), ``"up_first"`` (gate_up[..., :F] is up) or
            ``"interleaved"`` (gate_up[..., 0::2] is gate).
        activation: ``"silu"`` (x * sigmoid(alpha * x)) or ``"gelu_tanh"`` (alpha unused).
        alpha: the sigmoid's scale for silu.
        limit: clamp limit; None or +inf: no clamp at all.
        beta: offset added to the clamped up value.
        weights: optional float32 per-row weights (shape = the leading dims, or [rows]);
            differentiable.
        inplace_backward: write the gradients over gate/up (or gate_up) in backward: extra
            peak memory of one output instead of three tensors. The inputs must be dead after
            this backward (a second backward raises; other saved users of them fail loudly).

    Returns:
        [..., F] tensor of the input's dtype.
    """
    act = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"expertact: activation={activation!r} is not one of 'silu', 'gelu_tanh'")
    lim = _INF if limit is None else _float_arg("limit", limit)
    return _call(gate, up, layout, act, _float_arg("alpha", alpha), lim, _float_arg("beta", beta),
                 weights, inplace_backward)


def swiglu(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
           weights: Optional[Tensor] = None, inplace_backward: bool = False) -> Tensor:
    """silu(gate) * up (Mixtral, Qwen-MoE, DeepSeek-V3, Llama). Arguments as in :func:`glu`."""
    act, alpha, limit, beta = PRESETS["swiglu"]
    return _call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward)


def swiglu_clamped(gate: Tensor, up: Optional[Tensor] = None, *, limit: float = 7.0,
                   layout: Optional[str] = None, weights: Optional[Tensor] = None,
                   inplace_backward: bool = False) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4 uses limit 10).

    Note: DeepSpeed's Triton ``swiglu_clamped(gate, up, alpha, limit, oai=True)`` defaults to
    the GPT-OSS form; that signature is :func:`expertact.deepspeed.swiglu_clamped`.
    """
    act, alpha, _, beta = PRESETS["swiglu_clamped"]
    return _call(gate, up, layout, act, alpha, _float_arg("limit", limit), beta, weights, inplace_backward)


def swiglu_oai(gate: Tensor, up: Optional[Tensor] = None, *, alpha: float = 1.702, limit: float = 7.0,
               layout: Optional[str] = None, weights: Optional[Tensor] = None,
               inplace_backward: bool = False) -> Tensor:
    """GPT-OSS / MiniMax-M3: g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit).

    GPT-OSS checkpoints store gate and up interleaved: ``swiglu_oai(gate_up, layout="interleaved")``.
    """
    act, _, _, beta = PRESETS["swiglu_oai"]
    return _call(gate, up, layout, act, _float_arg("alpha", alpha), _float_arg("limit", limit), beta,
                 weights, inplace_backward)


def geglu_tanh(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
               weights: Optional[Tensor] = None, inplace_backward: bool = False) -> Tensor:
    """gelu(gate, approximate="tanh") * up (GeGLU models). Arguments as in :func:`glu`."""
    act, alpha, limit, beta = PRESETS["geglu_tanh"]
    return _call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward)
