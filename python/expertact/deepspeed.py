"""Drop-in names with DeepSpeed's signatures and defaults: its Triton SwiGLU module
(deepspeed.ops.triton_ops.swiglu_triton: swiglu, swiglu_packed, swiglu_clamped,
swiglu_clamped_packed and the explicit backwards) and its expert-activation registry
(apply_expert_activation, apply_packed_expert_activation). Packed means DeepSpeed's
"halves" layout: gate_up[..., :I] is gate, gate_up[..., I:] is up.

    from expertact import deepspeed as ds
    h = ds.apply_packed_expert_activation(gate_up, "swiglu_oai", alpha=1.702, limit=7.0)

Unlike DeepSpeed, CPU tensors take the same fused kernel (the library's CPU path),
so ``fused`` is accepted for compatibility and changes nothing.
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import _capi
from ._ops import glu_backward_any, rows_view_ok
from .functional import PRESETS, _call, _float_arg, _tensor_arg

__all__ = [
    "EXPERT_ACTIVATIONS", "swiglu", "swiglu_packed", "swiglu_clamped", "swiglu_clamped_packed",
    "swiglu_backward", "swiglu_packed_backward", "apply_expert_activation", "apply_packed_expert_activation",
]

Tensor = torch.Tensor

#: The activation names DeepSpeed's registry knows, in its order.
EXPERT_ACTIVATIONS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")

_SEP, _HALVES = _capi.LAYOUT_SEPARATE, _capi.LAYOUT_HALVES


def _registry_params(activation, alpha, limit):
    """(act, alpha, limit, beta) of a registry name; alpha/limit only where the form reads them."""
    if activation not in PRESETS:
        raise ValueError(f"expertact: unknown expert activation {activation!r}; expected one of "
                         f"{EXPERT_ACTIVATIONS}")
    act, a, lim, beta = PRESETS[activation]
    if a is None:
        a = _float_arg("alpha", alpha)
    if lim is None:
        lim = _float_arg("limit", limit)
    return act, a, lim, beta


def _clamped_params(alpha, limit, oai):
    # oai=True: the GPT-OSS form (swiglu_oai); oai=False: silu(clamp(gate)) * clamp(up), alpha unused.
    return _registry_params("swiglu_oai" if oai else "swiglu_clamped", alpha, limit)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Fused ``silu(gate) * up``."""
    _tensor_arg("up", up)
    return _call(gate, up, "separate", *PRESETS["swiglu"], None, False)


def swiglu_packed(gate_up: Tensor) -> Tensor:
    """Fused ``silu(gate_up[..., :I]) * gate_up[..., I:]``."""
    return _call(gate_up, None, "halves", *PRESETS["swiglu"], None, False)


def swiglu_clamped(gate: Tensor, up: Tensor, alpha: float = 1.702, limit: float = 7.0, oai: bool = True) -> Tensor:
    """``oai=True``: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, g = clamp(gate, max=limit) (GPT-OSS,
    MiniMax-M3); ``oai=False``: ``silu(g) * clamp(up)`` (DeepSeek-V4). up is clamped to [-limit, limit]."""
    _tensor_arg("up", up)
    return _call(gate, up, "separate", *_clamped_params(alpha, limit, oai), None, False)


def swiglu_clamped_packed(gate_up: Tensor, alpha: float = 1.702, limit: float = 7.0, oai: bool = True) -> Tensor:
    """:func:`swiglu_clamped` of gate and up packed side by side in ``[..., 2 * I]``."""
    return _call(gate_up, None, "halves", *_clamped_params(alpha, limit, oai), None, False)


def _backward(grad, x, up, layout, params):
    _tensor_arg("grad", grad)
    _tensor_arg("gate" if up is not None else "gate_up", x)
    grad, x = (t if rows_view_ok(t) else t.contiguous() for t in (grad, x))
    if up is not None and not rows_view_ok(up):
        up = up.contiguous()
    with torch.no_grad():
        return glu_backward_any(grad, x, up, None, False, layout, *params)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """The gradients (grad_gate, grad_up) of :func:`swiglu` given the output's gradient."""
    _tensor_arg("up", up)
    gx, gu = _backward(grad, gate, up, _SEP, PRESETS["swiglu"])
    return gx, gu


def swiglu_packed_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    """The gradient of :func:`swiglu_packed` with respect to gate_up (packed like it)."""
    return _backward(grad, gate_up, None, _HALVES, PRESETS["swiglu"])[0]


def apply_expert_activation(gate: Tensor, up: Tensor, activation: str = "swiglu", alpha: float = 1.702,
                            limit: float = 7.0, fused: bool = True) -> Tensor:
    """Combine the gate and up projections of an expert MLP with the named activation
    (``"swiglu"``, ``"geglu_tanh"``, ``"swiglu_clamped"``, ``"swiglu_oai"``)."""
    _tensor_arg("up", up)
    return _call(gate, up, "separate", *_registry_params(activation, alpha, limit), None, False)


def apply_packed_expert_activation(gate_up: Tensor, activation: str = "swiglu", alpha: float = 1.702,
                                   limit: float = 7.0, fused: bool = True) -> Tensor:
    """:func:`apply_expert_activation` for gate and up packed side by side in ``[..., 2 * I]``."""
    return _call(gate_up, None, "halves", *_registry_params(activation, alpha, limit), None, False)
