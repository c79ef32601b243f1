"""DeepSpeed, two ways. Drop-in names with DeepSpeed's signatures and defaults: its Triton
SwiGLU module (deepspeed.ops.triton_ops.swiglu_triton: swiglu, swiglu_packed, swiglu_clamped,
swiglu_clamped_packed and the explicit backwards) and its expert-activation registry
(apply_expert_activation, apply_packed_expert_activation). And enable()/disable(), which put
expertact's kernels into DeepSpeed AutoEP's own registry (deepspeed.moe.ep_experts), with
is_enabled() telling whether they are in and enabled_scope() enabling them for a `with` block;
enable(experts=True) also runs AutoEP's whole expert MLP (GroupedExperts.forward) as
expertact.moe.expert_mlp, with its memory modes and FP8 path.
Packed means DeepSpeed's "halves" layout: gate_up[..., :I] is gate, gate_up[..., I:] is up.

    from expertact import deepspeed as ds
    h = ds.apply_packed_expert_activation(gate_up, "swiglu_oai", alpha=1.702, limit=7.0)
    ds.enable()          # DeepSpeed's GroupedExperts now runs expertact's activation (docs/python.md)
    ds.enable(experts=True, fp8="rowwise-promoted-wgrad")   # ... or its whole expert MLP, in FP8
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
from typing import Mapping, Optional, Tuple, Union

import torch

from . import _capi
from ._args import ACTIVATIONS, PRESETS, float_arg, tensor_arg
from ._autograd import glu_backward_any, glu_call
from ._capi import rows_view_ok
from .moe import expert_mlp, fp8_recipe, offsets_from_counts

__all__ = [
    "EXPERT_ACTIVATIONS", "swiglu", "swiglu_packed", "swiglu_clamped", "swiglu_clamped_packed",
    "swiglu_backward", "swiglu_packed_backward", "apply_expert_activation", "apply_packed_expert_activation",
    "enable", "disable", "enabled_scope", "is_enabled", "experts_enabled",
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
_CONFIG = None  # the arguments of the enable() in force; None when disabled


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


# ---------------------------------------------------------------------------
# expertact's whole expert MLP inside DeepSpeed AutoEP: GroupedExperts.forward
# ---------------------------------------------------------------------------
# AutoEP's MoE layer calls self.experts(x, num_tokens_per_expert) on a
# deepspeed.moe.ep_experts.GroupedExperts (auto_ep_layer.py imports the class itself), whose
# forward picks one of four paths (Triton, grouped_mm, fused gate_up, for-loop) on every call.
# enable(experts=True) replaces the class's forward; disable() puts the very function back.
# The parameters stay DeepSpeed's (w1, w3 [E, F, D], w2 [E, D, F]), so ZeRO, the optimizer,
# gradient clipping and is_expert_group see what they always see.

_DS_FORWARD = None  # GroupedExperts.forward as DeepSpeed defined it, while expertact's is in place
_MY_FORWARD = None  # the forward enable(experts=True) put on GroupedExperts; None when not in force

# The registry names whose form expert_mlp computes by the same preset name: DeepSpeed's four.
# A name added with register= (or one it maps to another form) keeps DeepSpeed's forward, which
# then calls the registry's expertact kernel for the activation.
_MLP_FORMS = {name: (PRESETS[name][1] is None, PRESETS[name][2] is None) for name in EXPERT_ACTIVATIONS}


def _ds_grouped_experts():
    mod = importlib.import_module(_DS_MODULE)
    cls = getattr(mod, "GroupedExperts", None)
    if not isinstance(cls, type) or not callable(getattr(cls, "forward", None)):
        raise RuntimeError(f"expertact: {_DS_MODULE} has no GroupedExperts module; enable(experts=True) needs "
                           "DeepSpeed >= 0.19.8")
    return cls


def _experts_forward(ds_forward, fp8, recompute, inplace, mapped):
    """GroupedExperts.forward(x, num_tokens_per_expert) computed by expertact.moe.expert_mlp on
    the module's own parameters. w1 and w3 are concatenated into gate_up's [E, 2F, D] weight,
    as DeepSpeed's gate_up_impl="fused" does (one copy of the gate/up weights a call; its
    gradient is split back into w1.grad and w3.grad by autograd), and cast to x's dtype as
    DeepSpeed casts them; w2 is read as stored (a transposed view)."""
    served = {name: _MLP_FORMS[name] for name in mapped}  # name -> (uses_alpha, uses_limit)

    def forward(self, x, num_tokens_per_expert):
        reads = served.get(self.activation)
        if reads is None:
            return ds_forward(self, x, num_tokens_per_expert)
        uses_alpha, uses_limit = reads
        dt = x.dtype
        w13 = torch.cat((self.w1.to(dt), self.w3.to(dt)), dim=1).transpose(-2, -1)
        w2 = self.w2.to(dt).transpose(-2, -1)
        counts = num_tokens_per_expert
        if isinstance(counts, torch.Tensor) and counts.device != x.device:
            # DeepSpeed's for-loop reads the counts to the host wherever they are; so does this.
            counts = torch.tensor(counts.tolist(), dtype=torch.int64, device=x.device)
        offsets = offsets_from_counts(counts, "expertact.deepspeed")
        return expert_mlp(x, w13, w2, offsets, self.activation,
                          alpha=float(self.activation_alpha) if uses_alpha else None,
                          limit=float(self.activation_limit) if uses_limit else None,
                          layout="halves", recompute=recompute, inplace_backward=inplace, fp8=fp8)

    forward.__qualname__ = forward.__name__ = "expertact_grouped_experts_forward"
    forward.expertact_form = dict(experts=True, fp8=fp8, recompute=recompute, inplace_backward=inplace,
                                  activations=tuple(sorted(mapped)))
    return forward


# GroupedExperts as DeepSpeed builds it: dim 16, hidden 8, 3 experts (one with no rows), the
# for-loop path (no GPU, no torch._grouped_mm needed), float32 on the CPU.
_PROBE_MLP = dict(dim=16, hidden_dim=8, num_experts=3)
_PROBE_COUNTS = (5, 0, 6)


def _probe_experts(cls, ds_forward, forward, names):
    """Refuse to install a forward that computes something else than DeepSpeed's own forward of
    the same module (a DeepSpeed whose GroupedExperts changed its weights' meaning)."""
    gen = torch.Generator().manual_seed(1)
    for name in sorted(names):
        try:
            m = cls(use_grouped_mm=False, activation=name, **_PROBE_MLP)
        except Exception as e:  # a constructor that changed: say so, do not install blind
            raise RuntimeError(f"expertact: DeepSpeed's GroupedExperts(use_grouped_mm=False, activation={name!r}) "
                               f"did not build on the CPU ({e!r}); enable(experts=True) needs DeepSpeed 0.19.8's "
                               "GroupedExperts") from e
        with torch.no_grad():
            for p in (m.w1, m.w2, m.w3):
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
        counts = torch.tensor(_PROBE_COUNTS)
        x = torch.randn(sum(_PROBE_COUNTS) + 2, _PROBE_MLP["dim"], generator=gen)  # 2 padding rows
        with torch.no_grad():
            want = ds_forward(m, x, counts)
            got = forward(m, x, counts)
        rows = sum(_PROBE_COUNTS)
        if got.shape != want.shape or not torch.allclose(got[:rows], want[:rows], rtol=1e-4, atol=1e-4):
            err = (got[:rows] - want[:rows]).abs().max().item() if got.shape == want.shape else got.shape
            raise ValueError(f"expertact: expertact's expert MLP differs from DeepSpeed's GroupedExperts.forward "
                             f"for activation {name!r} by {err} (CPU float32 probe); enable(experts=True) refuses "
                             "to replace it")


def _install_experts(forward, ds_forward=None):
    """Put `forward` (expertact's, checked) on GroupedExperts, keeping DeepSpeed's `ds_forward` to
    restore; with forward None, put DeepSpeed's back."""
    global _DS_FORWARD, _MY_FORWARD
    cls = _ds_grouped_experts()
    if forward is None:
        if _MY_FORWARD is not None and cls.__dict__.get("forward") is _MY_FORWARD:
            cls.forward = _DS_FORWARD  # one that someone else put there since is theirs and stays
        _DS_FORWARD = _MY_FORWARD = None
        return
    _DS_FORWARD = ds_forward
    cls.forward = _MY_FORWARD = forward


def _bool_arg(name, v):
    if not isinstance(v, bool):
        raise TypeError(f"expertact: {name} must be a bool (got {type(v).__name__})")
    return v


def enable(inplace_backward: bool = False, register: Optional[Mapping[str, object]] = None, *,
           experts: bool = False, fp8: Union[str, bool, None] = None, recompute: bool = False) -> None:
    """Put expertact's kernels into DeepSpeed AutoEP (``deepspeed.moe.ep_experts``).

    ``enable()``: expertact's activation kernels become the ``fused_fn`` and ``packed_fused_fn``
    of ``swiglu``, ``geglu_tanh``, ``swiglu_clamped`` and ``swiglu_oai`` in DeepSpeed's
    expert-activation registry (``EXPERT_ACTIVATIONS``). Each entry is replaced by a copy
    (``dataclasses.replace``); ``fn``, ``uses_alpha``, ``uses_limit`` and ``gate_fn`` stay
    DeepSpeed's. DeepSpeed's ``apply_expert_activation`` / ``apply_packed_expert_activation`` with
    ``fused=True`` (GroupedExperts' grouped-GEMM paths) then run expertact; ``fused=False`` (its
    for-loop path) still runs DeepSpeed's eager ``fn``.

    ``enable(experts=True)``: the whole expert MLP instead. ``GroupedExperts.forward`` runs
    :func:`expertact.moe.expert_mlp` on the module's own ``w1``, ``w3`` [E, F, D] and ``w2``
    [E, D, F] on every path DeepSpeed would pick (grouped_mm, Triton, for-loop) and for both
    ``gate_up_impl``; the gradients land in w1/w2/w3. The registry entries of the four names
    stay DeepSpeed's (the forward no longer calls them). Names given in ``register=`` (or one
    of the four mapped there to another form) keep DeepSpeed's forward, with expertact's kernel
    in their registry entry.

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
        experts: run GroupedExperts' whole forward as expertact's expert MLP (above).
        fp8: with ``experts=True``, the FP8 recipe of the grouped GEMMs, expert_mlp's ``fp8``
            (resolved by :func:`expertact.moe.fp8_recipe`): a name of
            :data:`expertact.moe.FP8_RECIPES` (``"rowwise"``, ``"rowwise-bf16-wgrad"``,
            ``"rowwise-promoted-wgrad"``, ``"blockwise"``), or True for the default,
            :data:`expertact.moe.DEFAULT_FP8_RECIPE` (``"blockwise"``, the recipe that trained
            inside the bf16 band at every seed, its step 1.05x bf16's or more). FP8 runs on
            Hopper (bf16, D and F multiples of 16; on the CPU the emulation of the recipe;
            elsewhere the forward raises NotImplementedError naming what is missing). None or False: the GEMMs in the
            model's dtype.
        recompute: with ``experts=True``, keep one [T, F] tensor less between forward and
            backward (h recomputed in backward; expert_mlp's ``recompute``).

    Each call configures the whole hookup afresh (names of an earlier enable() that are not
    given again go back to DeepSpeed's, and so does GroupedExperts.forward without
    ``experts=True``); DeepSpeed's originals are kept across calls. Before changing anything,
    each kernel is checked against DeepSpeed's own ``fn``, and with ``experts=True`` the expert
    MLP against DeepSpeed's own forward, on small CPU probes: a form that does not match raises
    ValueError. Raises ImportError without DeepSpeed, RuntimeError when DeepSpeed lacks what is
    replaced (DeepSpeed < 0.19.8). Works before or after ``deepspeed.initialize``: DeepSpeed looks
    the registry entry and the forward up on every call.
    """
    global _CONFIG
    _bool_arg("inplace_backward", inplace_backward)
    _bool_arg("experts", experts)
    _bool_arg("recompute", recompute)
    fp8 = fp8_recipe(fp8, "expertact.deepspeed.enable")
    if not experts and (fp8 is not None or recompute):
        given = ", ".join(f"{k}={v!r}" for k, v in (("fp8", fp8), ("recompute", recompute)) if v)
        raise ValueError(f"expertact: {given} applies to the whole expert MLP: pass experts=True as well "
                         "(enable() alone replaces the activation only)")
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
    # The expert MLP serves the names whose form is expert_mlp's preset of that name; with
    # experts=True their registry entries stay DeepSpeed's (GroupedExperts no longer calls them),
    # and only the names it does not serve get expertact's kernels there.
    mapped = frozenset(n for n in _MLP_FORMS if wanted.get(n) == n)
    if experts:
        wanted = {name: spec for name, spec in wanted.items() if name not in mapped}
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
    forward = ds_forward = None
    if experts:
        cls = _ds_grouped_experts()
        ds_forward = _DS_FORWARD if _DS_FORWARD is not None else cls.forward
        forward = _experts_forward(ds_forward, fp8, recompute, inplace_backward, mapped)
        # The probe checks what the weights mean, in float32 on the CPU (where FP8 does not run).
        _probe_experts(cls, ds_forward, _experts_forward(ds_forward, None, False, False, mapped), mapped)
    # Everything is checked: only now change DeepSpeed.
    _restore(reg)
    for name, (base, entry) in new.items():
        _ORIGINALS[name] = base
        _INSTALLED[name] = entry
        reg[name] = entry
    _install_experts(forward, ds_forward)
    _CONFIG = dict(inplace_backward=inplace_backward, register=dict(register) if register else None,
                   experts=experts, fp8=fp8, recompute=recompute)


def disable() -> None:
    """Restore DeepSpeed's own registry entries and GroupedExperts.forward (the very objects
    enable() replaced). Idempotent. Raises ImportError without DeepSpeed."""
    global _CONFIG
    _restore(_ds_registry())
    _install_experts(None)
    _CONFIG = None


def is_enabled() -> bool:
    """Whether an :func:`enable` is in force (not undone by :func:`disable`)."""
    return _CONFIG is not None


def experts_enabled() -> bool:
    """Whether AutoEP's GroupedExperts runs expertact's whole expert MLP (``enable(experts=True)``)."""
    return _MY_FORWARD is not None


@contextlib.contextmanager
def enabled_scope(inplace_backward: bool = False, register: Optional[Mapping[str, object]] = None, *,
                  experts: bool = False, fp8: Union[str, bool, None] = None, recompute: bool = False):
    """``with expertact.deepspeed.enabled_scope(): ...``: :func:`enable` for the block, then back to
    what was in force before it (DeepSpeed's entries, or an outer enable()'s)."""
    before = _CONFIG
    enable(inplace_backward, register, experts=experts, fp8=fp8, recompute=recompute)
    try:
        yield
    finally:
        if before is None:
            disable()
        else:
            enable(**before)


def enabled(inplace_backward: bool = False, register: Optional[Mapping[str, object]] = None):
    """Deprecated: the earlier name of :func:`enabled_scope` (``with enabled(): ...``), kept for
    one release. It warns and returns ``enabled_scope(inplace_backward, register)``."""
    warnings.warn("expertact.deepspeed.enabled() is renamed enabled_scope() (is_enabled() is the predicate); "
                  "the old name goes in the next release", FutureWarning, stacklevel=2)
    return enabled_scope(inplace_backward, register)
