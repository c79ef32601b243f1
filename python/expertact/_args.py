"""The names the Python API accepts and the checks of its arguments, shared by functional,
moe and deepspeed: the layout, activation and preset tables (public as expertact.LAYOUTS,
expertact.ACTIVATIONS and expertact.PRESETS) and the type checks of tensors, numbers and
layouts. Value checks (shapes, dtypes, devices, strides) are the C library's.
"""
from __future__ import annotations

import math

import torch

from . import _capi

__all__ = ["LAYOUTS", "ACTIVATIONS", "PRESETS", "INF", "DEFAULT_ALPHA", "DEFAULT_LIMIT", "preset_coeffs", "tensor_arg",
           "float_arg", "layout_code", "check_ends", "check_offsets"]

Tensor = torch.Tensor

#: Layout names -> the C ABI's layout codes (docs/spec.md section 2). A packed tensor is [..., 2F].
LAYOUTS = {
    "separate": _capi.LAYOUT_SEPARATE,
    "halves": _capi.LAYOUT_HALVES,  # gate_up[..., :F] = gate (DeepSpeed's fused gate+up GEMM)
    "up_first": _capi.LAYOUT_HALVES_UP_FIRST,  # gate_up[..., :F] = up (FlashInfer, TransformerEngine)
    "halves_up_first": _capi.LAYOUT_HALVES_UP_FIRST,
    "interleaved": _capi.LAYOUT_INTERLEAVED,  # gate_up[..., 0::2] = gate (GPT-OSS checkpoints)
}

#: Activation names -> the C ABI's act codes.
ACTIVATIONS = {"silu": _capi.ACT_SILU, "gelu_tanh": _capi.ACT_GELU_TANH}

INF = math.inf

#: The presets of docs/spec.md section 1: (act, alpha, limit, beta); None = the caller's value.
#: tests/python checks this table against the C library's expertact_preset().
PRESETS = {
    "swiglu": (_capi.ACT_SILU, 1.0, INF, 0.0),
    "swiglu_clamped": (_capi.ACT_SILU, 1.0, None, 0.0),
    "swiglu_oai": (_capi.ACT_SILU, None, None, 1.0),
    "geglu_tanh": (_capi.ACT_GELU_TANH, 1.0, INF, 0.0),
}


# The defaults of the forms that read alpha / limit: DeepSpeed's registry defaults (alpha
# 1.702, limit 7.0), which are also GPT-OSS's.
DEFAULT_ALPHA = 1.702
DEFAULT_LIMIT = 7.0


def preset_coeffs(activation, alpha, limit, where: str):
    """(act, alpha, limit, beta) of a preset by name, alpha and limit defaulted for the forms
    that read them. A form that does not read alpha or limit refuses them: silently dropping
    limit=10 from "swiglu" would train an unclamped model that was meant to be clamped.
    ``where`` prefixes the messages."""
    params = PRESETS.get(activation) if isinstance(activation, str) else None
    if params is None:
        raise ValueError(f"{where}: activation={activation!r} is not one of {tuple(PRESETS)}")
    act, a, lim, beta = params
    if a is None:
        a = DEFAULT_ALPHA if alpha is None else float_arg("alpha", alpha)
    elif alpha is not None:
        raise ValueError(f"{where}: activation={activation!r} has no alpha (got alpha={alpha!r}); "
                         "'swiglu_oai' is the form with a sigmoid scale")
    if lim is None:
        lim = DEFAULT_LIMIT if limit is None else float_arg("limit", limit)
    elif limit is not None:
        raise ValueError(f"{where}: activation={activation!r} has no clamp (got limit={limit!r}); "
                         "'swiglu_clamped' and 'swiglu_oai' are the clamped forms")
    return act, a, lim, beta


def tensor_arg(name: str, t, optional: bool = False):
    """t when it is a tensor (or None with optional); else TypeError naming the argument."""
    if isinstance(t, Tensor) or (optional and t is None):
        return t
    want = "a torch.Tensor or None" if optional else "a torch.Tensor"
    raise TypeError(f"expertact: {name} must be {want} (got {type(t).__name__})")


def float_arg(name: str, v) -> float:
    """v as a float (any number but bool; not a tensor or a string); else TypeError naming it."""
    if not isinstance(v, (bool, str, bytes, Tensor)):
        try:
            return float(v)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"expertact: {name} must be a number (got {type(v).__name__})")


def layout_code(layout, packed: bool) -> int:
    """The C ABI's code of a layout name; None: 'halves' for one packed tensor, else 'separate'."""
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


def check_ends(ends, rows, where, name="offsets"):
    """Cumulative end rows (host ints) are non-decreasing, from 0, and within ``rows``; the
    errors name the argument ``name`` and the caller ``where``."""
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            what = f"{name}[0] = {end} is negative" if e == 0 else f"{name}[{e}] = {end} < {name}[{e - 1}] = {prev}"
            raise ValueError(f"{where}: {name} must be non-decreasing cumulative end rows; {what}")
        prev = end
    if prev > rows:
        raise ValueError(f"{where}: {name}[-1] = {prev} is past the last row ({rows} rows)")


def check_offsets(offsets, like, where: str = "expertact"):
    """offsets as the kernels read them: int32, 1-D, contiguous, on the device of like, the
    [..., C] tensor whose rows they index (its leading dims collapsed into rows). Their
    values are read once on the host (a device-to-host copy of E values on a GPU) and
    checked, so that offsets out of order raise here, naming them, rather than giving
    wrong sums on the GPU."""
    if not isinstance(offsets, Tensor):
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
