"""DeepSpeed, two ways. Drop-in names with DeepSpeed's signatures and defaults: its Triton
SwiGLU module (deepspeed.ops.triton_ops.swiglu_triton: swiglu, swiglu_packed, swiglu_clamped,
swiglu_clamped_packed and the explicit backwards) and its expert-activation registry
(apply_expert_activation, apply_packed_expert_activation). And enable()/disable(), which put
expertact's kernels into DeepSpeed AutoEP's own registry (deepspeed.moe.ep_experts), with
is_enabled() telling whether they are in and enabled_scope() enabling them for a `with` block.
Packed means DeepSpeed's "halves" layout: gate_up[..., :I] is gate, gate_up[..., I:] is up.

    from expertact import deepspeed as ds
    h = ds.apply_packed_expert_activation(gate_up, "swiglu_oai", alpha=1.702, limit=7.0)
    ds.enable()          # DeepSpeed's GroupedExperts now runs expertact (docs/python.md)
    with ds.enabled_scope(inplace_backward=True):
        ...              # enabled for this block, then back to what was in force

These names raise what DeepSpeed's do: ValueError for gate and up of different shapes or
dtypes (expertact.DTypeError, a ValueError and a TypeError, for dtypes) and for a packed
tensor without an even last dimension; RuntimeError for a backward with create_graph=True.

Unlike DeepSpeed, CPU tensors take the same fused kernel (the library's CPU path),
so ``fused`` is accepted for compatibility and changes nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import warnings
from typing import Mapping, Optional, Tuple

import torch

from . import _capi
from ._args import ACTIVATIONS, PRESETS, float_arg, tensor_arg
from ._autograd import glu_backward_any, glu_call
from ._capi import rows_view_ok

__all__ = [
    "EXPERT_ACTIVATIONS", "swiglu", "swiglu_packed", "swiglu_clamped", "swiglu_clamped_packed",
    "swiglu_backward", "swiglu_packed_backward", "apply_expert_activation", "apply_packed_expert_activation",
    "enable", "disable", "enabled_scope", "is_enabled",
]

Tensor = torch.Tensor

#: The activation names DeepSpeed's registry knows, in its order.
EXPERT_ACTIVATIONS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")

_SEP, _HALVES = _capi.LAYOUT_SEPARATE, _capi.LAYOUT_HALVES


def _registry_params(activation, alpha, limit):
    """(act, alpha, limit, beta) of a registry name; alpha/limit only where the form reads them."""
    if not isinstance(activation, str) or activation not in PRESETS:
        raise ValueError(f"expertact: unknown expert activation {activation!r}; expected one of "
                         f"{EXPERT_ACTIVATIONS}")
    act, a, lim, beta = PRESETS[activation]
    if a is None:
        a = float_arg("alpha", alpha)
    if lim is None:
        lim = float_arg("limit", limit)
    return act, a, lim, beta


def _clamped_params(alpha, limit, oai):
    # oai=True: the GPT-OSS form (swiglu_oai); oai=False: silu(clamp(gate)) * clamp(up), alpha unused.
    return _registry_params("swiglu_oai" if oai else "swiglu_clamped", alpha, limit)


def _packed_error(name, gate_up, err):
    """DeepSpeed's packed kernels refuse a 0-dim tensor or an odd last dimension with a
    ValueError saying "expects an even last dimension"; raise that, with the library's message
    after it. Only on the error path: the call itself pays nothing for it. A dtype error stays
    what it is (DTypeError): the dtype, not the width, is then what the caller must fix."""
    if isinstance(err, _capi.DTypeError):
        return
    if isinstance(gate_up, Tensor) and (gate_up.dim() == 0 or gate_up.shape[-1] % 2):
        detail = str(err)
        detail = detail[len("expertact: "):] if detail.startswith("expertact: ") else detail
        raise ValueError(f"expertact: {name} expects an even last dimension, got shape {tuple(gate_up.shape)} "
                         f"({detail})") from None


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Fused ``silu(gate) * up``."""
    tensor_arg("up", up)
    return glu_call(gate, up, "separate", *PRESETS["swiglu"], None, False)


def swiglu_packed(gate_up: Tensor) -> Tensor:
    """Fused ``silu(gate_up[..., :I]) * gate_up[..., I:]``."""
    try:
        return glu_call(gate_up, None, "halves", *PRESETS["swiglu"], None, False)
    except ValueError as e:
        _packed_error("swiglu_packed", gate_up, e)
        raise


def swiglu_clamped(gate: Tensor, up: Tensor, alpha: float = 1.702, limit: float = 7.0, oai: bool = True) -> Tensor:
    """``oai=True``: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, g = clamp(gate, max=limit) (GPT-OSS,
    MiniMax-M3); ``oai=False``: ``silu(g) * clamp(up)`` (DeepSeek-V4). up is clamped to [-limit, limit]."""
    tensor_arg("up", up)
    return glu_call(gate, up, "separate", *_clamped_params(alpha, limit, oai), None, False)


def swiglu_clamped_packed(gate_up: Tensor, alpha: float = 1.702, limit: float = 7.0, oai: bool = True) -> Tensor:
    """:func:`swiglu_clamped` of gate and up packed side by side in ``[..., 2 * I]``."""
    try:
        return glu_call(gate_up, None, "halves", *_clamped_params(alpha, limit, oai), None, False)
    except ValueError as e:
        _packed_error("swiglu_clamped_packed", gate_up, e)
        raise


def _backward(grad, x, up, layout, params):
    tensor_arg("grad", grad)
    tensor_arg("gate" if up is not None else "gate_up", x)
    grad, x = (t if rows_view_ok(t) else t.contiguous() for t in (grad, x))
    if up is not None and not rows_view_ok(up):
        up = up.contiguous()
    with torch.no_grad():
        return glu_backward_any(grad, x, up, None, False, layout, *params)


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """The gradients (grad_gate, grad_up) of :func:`swiglu` given the output's gradient."""
    tensor_arg("up", up)
    gx, gu = _backward(grad, gate, up, _SEP, PRESETS["swiglu"])
    return gx, gu


def swiglu_packed_backward(grad: Tensor, gate_up: Tensor) -> Tensor:
    """The gradient of :func:`swiglu_packed` with respect to gate_up (packed like it)."""
    return _backward(grad, gate_up, None, _HALVES, PRESETS["swiglu"])[0]


def apply_expert_activation(gate: Tensor, up: Tensor, activation: str = "swiglu", alpha: float = 1.702,
                            limit: float = 7.0, fused: bool = True) -> Tensor:
    """Combine the gate and up projections of an expert MLP with the named activation
    (``"swiglu"``, ``"geglu_tanh"``, ``"swiglu_clamped"``, ``"swiglu_oai"``)."""
    tensor_arg("up", up)
    return glu_call(gate, up, "separate", *_registry_params(activation, alpha, limit), None, False)


def apply_packed_expert_activation(gate_up: Tensor, activation: str = "swiglu", alpha: float = 1.702,
                                   limit: float = 7.0, fused: bool = True) -> Tensor:
    """:func:`apply_expert_activation` for gate and up packed side by side in ``[..., 2 * I]``."""
    return glu_call(gate_up, None, "halves", *_registry_params(activation, alpha, limit), None, False)


# ---------------------------------------------------------------------------
# expertact inside DeepSpeed AutoEP: deepspeed.moe.ep_experts.EXPERT_ACTIVATIONS
# ---------------------------------------------------------------------------
# AutoEP and GroupedExperts keep only the activation's name and look its entry up in
# EXPERT_ACTIVATIONS on every call (apply_expert_activation -> get_expert_activation); in
# DeepSpeed 0.19.8 nothing copies an entry or its functions at import or construction
# (auto_ep.py and auto_ep_config.py import the dict itself). So replacing entries takes
# effect at the next forward, before or after deepspeed.initialize.

_DS_MODULE = "deepspeed.moe.ep_experts"
_ENTRY_FIELDS = ("fn", "fused_fn", "uses_alpha", "uses_limit", "packed_fused_fn")
_ACT_NAMES = {code: name for name, code in ACTIVATIONS.items()}

_ORIGINALS = {}  # name -> the entry enable() replaced (DeepSpeed's own, restored by disable())
_INSTALLED = {}  # name -> the entry enable() put in its place
_CONFIG = None  # (inplace_backward, register) of the enable() in force; None when disabled


def _ds_registry():
    """DeepSpeed's EXPERT_ACTIVATIONS dict, once it is known to hold what enable() replaces."""
    try:
        mod = importlib.import_module(_DS_MODULE)
    except ImportError as e:
        raise ImportError(
            f"expertact.deepspeed.enable()/disable() need DeepSpeed's expert-activation registry "
            f"({_DS_MODULE}, DeepSpeed >= 0.19.8), and importing it failed: {e}. "
            "Install DeepSpeed (DS_BUILD_OPS=0 pip install deepspeed) or use expertact's own functions.") from e
    version = getattr(importlib.import_module("deepspeed"), "__version__", "unknown")
    where = f"{_DS_MODULE} (deepspeed {version})"
    reg = getattr(mod, "EXPERT_ACTIVATIONS", None)
    if not isinstance(reg, dict):
        raise RuntimeError(f"expertact: {where} has no EXPERT_ACTIVATIONS dict; expertact.deepspeed.enable() "
                           "needs DeepSpeed >= 0.19.8")
    cls = getattr(mod, "ExpertActivation", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise RuntimeError(f"expertact: {where} has no ExpertActivation dataclass; expertact.deepspeed.enable() "
                           "needs DeepSpeed >= 0.19.8")
    have = {f.name for f in dataclasses.fields(cls)}
    missing = [f for f in _ENTRY_FIELDS if f not in have]
    if missing:
        raise RuntimeError(f"expertact: {where}: ExpertActivation has no field {', '.join(missing)}; "
                           "expertact.deepspeed.enable() needs DeepSpeed >= 0.19.8")
    return reg


def _form(name, spec, entry):
    """(act, alpha, limit, beta) of expertact's kernel behind registry name `name`; alpha or
    limit None means DeepSpeed's value passed in each call, which must be exactly what the
    entry's uses_alpha / uses_limit say the form reads."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"expertact: register[{name!r}]={spec!r} is not a preset; expected one of "
                             f"{tuple(PRESETS)} or dict(activation=, alpha=, limit=, beta=)")
        act, alpha, limit, beta = PRESETS[spec]
    elif isinstance(spec, Mapping):
        unknown = sorted(set(spec) - {"activation", "alpha", "limit", "beta"})
        if unknown:
            raise ValueError(f"expertact: register[{name!r}] has unknown keys {unknown}; expected "
                             "activation, alpha, limit, beta")
        activation = spec.get("activation", "silu")
        act = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
        if act is None:
            raise ValueError(f"expertact: register[{name!r}]: activation={activation!r} is not one of "
                             f"{tuple(ACTIVATIONS)}")
        alpha = spec.get("alpha", None if entry.uses_alpha else 1.0)
        limit = spec.get("limit", None if entry.uses_limit else math.inf)
        alpha = None if alpha is None else float_arg("alpha", alpha)
        limit = None if limit is None else float_arg("limit", limit)
        beta = float_arg("beta", spec.get("beta", 0.0))
    else:
        raise TypeError(f"expertact: register[{name!r}] must be a preset name or a dict(activation=, alpha=, "
                        f"limit=, beta=) (got {type(spec).__name__})")
    for arg, value, uses in (("alpha", alpha, entry.uses_alpha), ("limit", limit, entry.uses_limit)):
        if uses and value is not None:
            raise ValueError(f"expertact: DeepSpeed's {name!r} reads {arg} from each call (uses_{arg}=True), "
                             f"but its expertact form fixes {arg}={value}; leave {arg} out (or None) for {name!r}")
        if not uses and value is None:
            raise ValueError(f"expertact: DeepSpeed's {name!r} does not read {arg} (uses_{arg}=False), but its "
                             f"expertact form takes {arg} from the call; give {name!r} a fixed {arg}")
    return act, alpha, limit, beta


def _fused_fns(name, act, alpha, limit, beta, inplace):
    """The registry's fused_fn(gate, up, alpha, limit) and packed_fused_fn(gate_up, alpha, limit).
    DeepSpeed passes alpha and limit to every form; where the form fixes them (alpha/limit not
    None here) the call's values are ignored, as DeepSpeed's own fn ignores them."""
    call_alpha, call_limit = alpha is None, limit is None
    fixed_alpha, fixed_limit = alpha, limit

    # DeepSpeed passes Python floats: `type(x) is float` lets them through without float_arg's
    # checks (two type tests take about a sixth of the time of two float_arg calls); anything
    # else gets the checks.
    def params(alpha, limit):
        if call_alpha:
            alpha = alpha if type(alpha) is float else float_arg("alpha", alpha)
        else:
            alpha = fixed_alpha
        if call_limit:
            limit = limit if type(limit) is float else float_arg("limit", limit)
        else:
            limit = fixed_limit
        return alpha, limit

    def fused_fn(gate, up, alpha, limit):
        if up is None:
            tensor_arg("up", up)  # raises, naming up
        alpha, limit = params(alpha, limit)
        return glu_call(gate, up, "separate", act, alpha, limit, beta, None, inplace)

    def packed_fused_fn(gate_up, alpha, limit):
        alpha, limit = params(alpha, limit)
        return glu_call(gate_up, None, "halves", act, alpha, limit, beta, None, inplace)

    # What the function computes, for tests and for a user asking the registry what runs (None:
    # the call's value).
    form = dict(name=name, activation=_ACT_NAMES[act], alpha=alpha, limit=limit, beta=beta,
                inplace_backward=inplace)
    for f in (fused_fn, packed_fused_fn):
        f.__qualname__ = f.__name__ = f"expertact_{f.__name__}[{name}]"
        f.expertact_form = form
    return fused_fn, packed_fused_fn


# The probe crosses both limits (+-3, +-7) on gate and up. float32 kernel and float32 eager agree to
# ~1e-6 relative; a different form (alpha 1 for 1.702, no +1, gelu for silu, a missing clamp)
# differs by >= 1e-2 somewhere on it.
_PROBE = torch.linspace(-9.5, 9.5, 20)
_PROBE_PARAMS = ((1.702, 7.0), (1.25, 3.0))


def _probe(name, entry, fused_fn, packed_fused_fn):
    """Refuse a kernel that computes something else than DeepSpeed's own fn of the form
    (a register= mapping that does not fit, or a DeepSpeed whose form changed)."""
    n = _PROBE.numel()
    gate = _PROBE.repeat(n).reshape(n, n)
    up = _PROBE.repeat_interleave(n).reshape(n, n)
    gate_up = torch.cat([gate, up], -1)
    with torch.no_grad():
        for a, lim in _PROBE_PARAMS:
            try:
                want = entry.fn(gate, up, a, lim)
            except Exception as e:  # e.g. a user's form written for CUDA tensors only
                warnings.warn(f"expertact: DeepSpeed's fn of {name!r} did not run on a CPU probe ({e!r}); "
                              "its expertact kernel is not checked against it", stacklevel=3)
                return
            for kind, got in (("fused_fn", fused_fn(gate, up, a, lim)),
                              ("packed_fused_fn", packed_fused_fn(gate_up, a, lim))):
                if not torch.allclose(got, want.to(got.dtype), rtol=1e-4, atol=1e-4, equal_nan=True):
                    err = (got - want).abs().max().item()
                    raise ValueError(
                        f"expertact: the kernel put behind {name!r} ({kind}: {fused_fn.expertact_form}) differs "
                        f"from DeepSpeed's own fn of {name!r} by up to {err:.3g} at alpha={a}, limit={lim} "
                        "(CPU float32 probe over [-9.5, 9.5]); map the name to the form it computes with "
                        "register={name: dict(activation=, alpha=, limit=, beta=)}")


def _restore(reg):
    """Put DeepSpeed's entries back where enable() replaced them. An entry that someone else
    replaced since is theirs and stays."""
    for name, mine in _INSTALLED.items():
        if reg.get(name) is mine:
            reg[name] = _ORIGINALS[name]
    _INSTALLED.clear()
    _ORIGINALS.clear()


def enable(inplace_backward: bool = False, register: Optional[Mapping[str, object]] = None) -> None:
    """Put expertact's kernels into DeepSpeed AutoEP's expert-activation registry
    (``deepspeed.moe.ep_experts.EXPERT_ACTIVATIONS``) as the ``fused_fn`` and ``packed_fused_fn``
    of ``swiglu``, ``geglu_tanh``, ``swiglu_clamped`` and ``swiglu_oai``. Each entry is replaced by
    a copy (``dataclasses.replace``); ``fn``, ``uses_alpha``, ``uses_limit`` and ``gate_fn`` stay
    DeepSpeed's. DeepSpeed's ``apply_expert_activation`` / ``apply_packed_expert_activation`` with
    ``fused=True`` (GroupedExperts' grouped-GEMM paths) then run expertact; ``fused=False`` (its
    for-loop path) still runs DeepSpeed's eager ``fn``.

    Args:
        inplace_backward: write the gradient of gate/up (or gate_up) over them in backward. Safe
            in GroupedExperts: the grouped GEMMs that produce them save their inputs, not their
            outputs (docs/python.md). Not for tensors the caller still reads after backward.
        register: more registry names to serve, for forms DeepSpeed adds later (they must be
            registered in DeepSpeed first): ``{name: preset}`` with a preset of
            :data:`expertact.PRESETS`, or ``{name: dict(activation="silu" | "gelu_tanh",
            alpha=, limit=, beta=)}``. alpha/limit left out (or None) come from each call, which
            must match the entry's uses_alpha/uses_limit; otherwise they default to 1 and no clamp.
            A name of the four may be given too, to map it differently.

    Each call configures the whole hookup afresh (names of an earlier enable() that are not
    given again go back to DeepSpeed's); DeepSpeed's originals are kept across calls. Before
    changing anything, each kernel is checked against DeepSpeed's own ``fn`` on a small CPU
    probe: a form that does not match raises ValueError. Raises ImportError without DeepSpeed,
    RuntimeError when its registry lacks what is replaced (DeepSpeed < 0.19.8).
    """
    global _CONFIG
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"expertact: inplace_backward must be a bool (got {type(inplace_backward).__name__})")
    if register is not None and not isinstance(register, Mapping):
        raise TypeError(f"expertact: register must be a dict of registry name -> preset name or "
                        f"dict(activation=, alpha=, limit=, beta=) (got {type(register).__name__})")
    reg = _ds_registry()
    wanted = {name: name for name in EXPERT_ACTIVATIONS}
    wanted.update(register or {})
    missing = [name for name in wanted if name not in reg]
    if missing:
        raise RuntimeError(
            f"expertact: DeepSpeed's EXPERT_ACTIVATIONS has no {', '.join(map(repr, missing))} (it has "
            f"{tuple(reg)}); a name given in register= must first be registered in DeepSpeed with "
            "deepspeed.moe.ep_experts.register_expert_activation(name, fn, uses_alpha=, uses_limit=)")
    new = {}
    for name, spec in wanted.items():
        base = reg[name]
        if name in _INSTALLED and base is _INSTALLED[name]:
            base = _ORIGINALS[name]  # enabled before: build on DeepSpeed's entry, not on ours
        if not dataclasses.is_dataclass(base) or isinstance(base, type):
            raise RuntimeError(f"expertact: DeepSpeed's EXPERT_ACTIVATIONS[{name!r}] is a {type(base).__name__}, "
                               "not an ExpertActivation")
        fused_fn, packed_fused_fn = _fused_fns(name, *_form(name, spec, base), inplace_backward)
        _probe(name, base, fused_fn, packed_fused_fn)
        new[name] = (base, dataclasses.replace(base, fused_fn=fused_fn, packed_fused_fn=packed_fused_fn))
    # Everything is checked: only now change the registry.
    _restore(reg)
    for name, (base, entry) in new.items():
        _ORIGINALS[name] = base
        _INSTALLED[name] = entry
        reg[name] = entry
    _CONFIG = (inplace_backward, dict(register) if register else None)


def disable() -> None:
    """Restore DeepSpeed's own registry entries (the very objects enable() replaced).
    Idempotent. Raises ImportError without DeepSpeed."""
    global _CONFIG
    _restore(_ds_registry())
    _CONFIG = None


def is_enabled() -> bool:
    """Whether an :func:`enable` is in force (not undone by :func:`disable`)."""
    return _CONFIG is not None


@contextlib.contextmanager
def enabled_scope(inplace_backward: bool = False, register: Optional[Mapping[str, object]] = None):
    """``with expertact.deepspeed.enabled_scope(): ...``: :func:`enable` for the block, then back to
    what was in force before it (DeepSpeed's entries, or an outer enable()'s)."""
    before = _CONFIG
    enable(inplace_backward, register)
    try:
        yield
    finally:
        if before is None:
            disable()
        else:
            enable(*before)


def enabled(inplace_backward: bool = False, register: Optional[Mapping[str, object]] = None):
    """Deprecated: the earlier name of :func:`enabled_scope` (``with enabled(): ...``), kept for
    one release. It warns and returns ``enabled_scope(inplace_backward, register)``."""
    warnings.warn("expertact.deepspeed.enabled() is renamed enabled_scope() (is_enabled() is the predicate); "
                  "the old name goes in the next release", FutureWarning, stacklevel=2)
    return enabled_scope(inplace_backward, register)
