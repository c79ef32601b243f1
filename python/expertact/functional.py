"""The public functional API: one function per preset and a generic glu(), each taking
(gate, up) or one packed gate_up tensor with a layout, optional per-row weights, and an
opt-in in-place backward. Thin: it picks the operator's arguments; the C library
validates everything and computes everything.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._args import ACTIVATIONS, INF, LAYOUTS, PRESETS, float_arg
from ._route import glu_call

__all__ = ["glu", "swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh", "LAYOUTS", "ACTIVATIONS", "PRESETS"]

Tensor = torch.Tensor


def glu(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
        activation: str = "silu", alpha: float = 1.0, limit: Optional[float] = None, beta: float = 0.0,
        weights: Optional[Tensor] = None, inplace_backward: bool = False) -> Tensor:
    """The general gated activation, per element (docs/spec.md section 1)::

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
    lim = INF if limit is None else float_arg("limit", limit)
    return glu_call(gate, up, layout, act, float_arg("alpha", alpha), lim, float_arg("beta", beta),
                 weights, inplace_backward)


def swiglu(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
           weights: Optional[Tensor] = None, inplace_backward: bool = False) -> Tensor:
    """silu(gate) * up (Mixtral, Qwen-MoE, DeepSeek-V3, Llama). Arguments as in :func:`glu`."""
    act, alpha, limit, beta = PRESETS["swiglu"]
    return glu_call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward)


def swiglu_clamped(gate: Tensor, up: Optional[Tensor] = None, *, limit: float = 7.0,
                   layout: Optional[str] = None, weights: Optional[Tensor] = None,
                   inplace_backward: bool = False) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4 uses limit 10).

    Note: DeepSpeed's Triton ``swiglu_clamped(gate, up, alpha, limit, oai=True)`` defaults to
    the GPT-OSS form; that signature is :func:`expertact.deepspeed.swiglu_clamped`.
    """
    act, alpha, _, beta = PRESETS["swiglu_clamped"]
    return glu_call(gate, up, layout, act, alpha, float_arg("limit", limit), beta, weights, inplace_backward)


def swiglu_oai(gate: Tensor, up: Optional[Tensor] = None, *, alpha: float = 1.702, limit: float = 7.0,
               layout: Optional[str] = None, weights: Optional[Tensor] = None,
               inplace_backward: bool = False) -> Tensor:
    """GPT-OSS / MiniMax-M3: g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit).

    GPT-OSS checkpoints store gate and up interleaved: ``swiglu_oai(gate_up, layout="interleaved")``.
    """
    act, _, _, beta = PRESETS["swiglu_oai"]
    return glu_call(gate, up, layout, act, float_arg("alpha", alpha), float_arg("limit", limit), beta,
                 weights, inplace_backward)


def geglu_tanh(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
               weights: Optional[Tensor] = None, inplace_backward: bool = False) -> Tensor:
    """gelu(gate, approximate="tanh") * up (GeGLU models). Arguments as in :func:`glu`."""
    act, alpha, limit, beta = PRESETS["geglu_tanh"]
    return glu_call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward)
