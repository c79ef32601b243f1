"""The public functional API: one function per preset and a generic glu(), each taking
(gate, up) or one packed gate_up tensor with a layout, optional per-row weights, and an
opt-in in-place backward. Thin: it picks the operator's arguments; the C library
validates everything and computes everything.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._args import ACTIVATIONS, INF, LAYOUTS, PRESETS, float_arg, layout_code
from ._autograd import expert_bias_call, glu_bias_call, glu_call

__all__ = ["glu", "swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh", "expert_bias", "LAYOUTS", "ACTIVATIONS",
           "PRESETS"]

Tensor = torch.Tensor


def glu(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
        activation: str = "silu", alpha: float = 1.0, limit: Optional[float] = None, beta: float = 0.0,
        weights: Optional[Tensor] = None, inplace_backward: bool = False,
        bias: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
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
        bias, offsets: a per-expert bias added to gate and up before the activation (the
            clamp applies after it; GPT-OSS's gate_up_proj_bias), for rows sorted by expert:
            ``bias`` [E, 2F] of the input's dtype, its columns in the layout's order (the
            separate layout: gate's F columns, then up's); ``offsets`` int32 [E], each
            expert's cumulative end row (torch._grouped_mm's offs). Rows past offsets[-1]
            get no bias. The bias's gradient is each expert's column sums of the input
            gradient, summed in a fixed order (bit-identical from run to run). The offsets
            are read once on the host, to check them. Runs eagerly (a graph break under
            torch.compile).

    Returns:
        [..., F] tensor of the input's dtype.
    """
    act = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if act is None:
        raise ValueError(f"expertact: activation={activation!r} is not one of 'silu', 'gelu_tanh'")
    lim = INF if limit is None else float_arg("limit", limit)
    return _call(gate, up, layout, act, float_arg("alpha", alpha), lim, float_arg("beta", beta),
                 weights, inplace_backward, bias, offsets)


def _call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward, bias, offsets):
    if bias is None and offsets is None:
        return glu_call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward)
    if not isinstance(gate, Tensor):
        raise TypeError(f"expertact: {'gate_up' if up is None else 'gate'} must be a torch.Tensor "
                        f"(got {type(gate).__name__})")
    return glu_bias_call(gate, up, layout_code(layout, up is None), act, alpha, limit, beta, weights,
                         inplace_backward, bias, offsets)


def expert_bias(x: Tensor, bias: Tensor, offsets: Tensor, *, weights: Optional[Tensor] = None) -> Tensor:
    """x + weights[r] * bias[e] for rows sorted by expert (GPT-OSS's down_proj_bias, scaled by
    the routing weight as GPT-OSS scales the whole expert output)::

        out[r] = x[r] + weights[r] * bias[e(r)]     (weights[r] = 1 when None)

    Args:
        x: [rows, C] (or [..., C]) float32, float16 or bfloat16 (float64 on the CPU).
        bias: [E, C] of x's dtype and device.
        offsets: int32 [E], each expert's cumulative end row; rows past offsets[-1] get no bias.
        weights: optional float32 per-row weights; differentiable (their gradient is
            grad_out[r] . bias[e]).

    The bias's gradient sums weights[r] * grad_out[r] over each expert's rows in a fixed
    order: bit-identical from run to run. Runs eagerly (a graph break under torch.compile).
    """
    return expert_bias_call(x, bias, offsets, weights)


def swiglu(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
           weights: Optional[Tensor] = None, inplace_backward: bool = False,
        bias: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
    """silu(gate) * up (Mixtral, Qwen-MoE, DeepSeek-V3, Llama). Arguments as in :func:`glu`."""
    act, alpha, limit, beta = PRESETS["swiglu"]
    return _call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward, bias, offsets)


def swiglu_clamped(gate: Tensor, up: Optional[Tensor] = None, *, limit: float = 7.0,
                   layout: Optional[str] = None, weights: Optional[Tensor] = None,
                   inplace_backward: bool = False,
        bias: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4 uses limit 10).

    Note: DeepSpeed's Triton ``swiglu_clamped(gate, up, alpha, limit, oai=True)`` defaults to
    the GPT-OSS form; that signature is :func:`expertact.deepspeed.swiglu_clamped`.
    """
    act, alpha, _, beta = PRESETS["swiglu_clamped"]
    return _call(gate, up, layout, act, alpha, float_arg("limit", limit), beta, weights, inplace_backward, bias, offsets)


def swiglu_oai(gate: Tensor, up: Optional[Tensor] = None, *, alpha: float = 1.702, limit: float = 7.0,
               layout: Optional[str] = None, weights: Optional[Tensor] = None,
               inplace_backward: bool = False,
        bias: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
    """GPT-OSS / MiniMax-M3: g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit).

    GPT-OSS checkpoints store gate and up interleaved: ``swiglu_oai(gate_up, layout="interleaved")``.
    """
    act, _, _, beta = PRESETS["swiglu_oai"]
    return _call(gate, up, layout, act, float_arg("alpha", alpha), float_arg("limit", limit), beta,
                 weights, inplace_backward, bias, offsets)


def geglu_tanh(gate: Tensor, up: Optional[Tensor] = None, *, layout: Optional[str] = None,
               weights: Optional[Tensor] = None, inplace_backward: bool = False,
        bias: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
    """gelu(gate, approximate="tanh") * up (GeGLU models). Arguments as in :func:`glu`."""
    act, alpha, limit, beta = PRESETS["geglu_tanh"]
    return _call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward, bias, offsets)
