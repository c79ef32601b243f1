"""expertact.transformers: expertact's expert MLP as an experts implementation of Hugging Face
transformers (>= 5), selected per model like "eager" or "grouped_mm".

Switch it on::

    import expertact.transformers  # registers "expertact"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="expertact")
    # or, on a loaded model: model.set_experts_implementation("expertact")

Importing this module registers ``"expertact"`` in transformers' experts registry
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``). :func:`register` adds variants with
expert_mlp's memory modes, e.g. ``register("expertact_recompute", recompute=True)``.

What one call does, for an experts module whose class carries transformers'
``@use_experts_implementation`` (hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K]):
the T*K (token, expert) pairs are sorted by expert (a stable sort), the token rows gathered in
that order, and :func:`expertact.moe.expert_mlp` runs the whole MLP as one autograd node over
the module's weights read as stored (``gate_up_proj`` / ``down_proj`` as transposed views, the
expert biases ``gate_up_proj_bias`` / ``down_proj_bias`` as they are: no copy of the weights
per call), with the routing weights (as float32). Each pair's output is
``(act(x @ W13[e] + b13[e]) @ W2[e] + b2[e]) * weight``, the routing weight multiplying the
down projection's output, its bias included, as transformers' eager, batched_mm and
grouped_mm implementations do. The K contributions of each token are summed in float32 in a
fixed order (no atomics: deterministic on the GPU) and cast to the hidden dtype, as
transformers' own implementations do. Expert ids >= E (expert-parallel sentinels) sort past
the last expert's rows and contribute nothing: zero output, zero gradient (biases included);
negative ids raise. The routing weights get their gradient (back to the router), as with
transformers' own implementations; they may come in the model's dtype or in float32. Host
reads per call: the smallest expert id (to refuse negative ids) and expert_mlp's read of the E
offsets, two small device-to-host copies on the GPU.

Supported: the classes whose gate expertact computes exactly (checked against transformers'
eager experts, forward and backward, in tests/python/test_transformers.py with transformers
5.17):

- transformers' default gate, ``act_fn(gate) * up`` over the two halves of gate_up, with
  ``act_fn`` SiLU (``hidden_act`` "silu" or "swish"): "swiglu", layout "halves" (Qwen3-MoE,
  Mixtral, DeepSeek-V3 and the other models using the default gate); with ``act_fn`` torch's
  tanh GELU (``hidden_act`` "gelu_pytorch_tanh"): "geglu_tanh".
- MiniMax-M3 (``MiniMaxM3VLExperts``): "swiglu_oai", halves, with the config's
  ``swiglu_alpha`` and ``swiglu_limit`` (as the module holds them).
- GPT-OSS (``GptOssExperts``): "swiglu_oai", interleaved, with the module's ``alpha`` (1.702)
  and ``limit`` (7.0), and its expert biases (``has_bias=True``): ``gate_up_proj_bias``
  [E, 2F], interleaved like ``gate_up_proj``'s columns, and ``down_proj_bias`` [E, D], passed
  to expert_mlp as ``b13`` and ``b2``; the clamps apply after the bias.

Expert biases (``has_bias=True``) are taken with any supported gate, from the attributes
transformers' own implementations read (``gate_up_proj_bias``, ``down_proj_bias``).

Refused, with an error naming the class and what is missing (never different math): experts
without a gate (``has_gate=False``); any other ``act_fn`` (another GELU variant, ReLU, ...); a
class with its own ``_apply_gate`` not listed above (e.g. ``OpenAIPrivacyFilterExperts``,
which computes in float32 whatever the model's dtype); ``has_bias=True`` without both bias
tensors (NotImplementedError); weights or biases of unexpected shape (ValueError).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Dict, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

try:
    from transformers import activations as _hf_act
    from transformers.integrations import moe as _hf_moe
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "expertact.transformers needs Hugging Face transformers >= 5 (transformers.integrations.moe with "
        f"ExpertsInterface): {_e}") from _e
if not hasattr(_hf_moe, "ALL_EXPERTS_FUNCTIONS"):  # pragma: no cover
    raise ImportError("expertact.transformers: this transformers has no experts registry "
                      "(transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS); it needs transformers >= 5")

from .moe import expert_mlp, fp8_recipe

__all__ = ["register", "experts_forward", "DEFAULT_NAME"]

#: The name ``import expertact.transformers`` registers.
DEFAULT_NAME = "expertact"

_PREFIX = "expertact.transformers"


def _err(msg: str) -> str:
    return f"{_PREFIX}: {msg}"


# ---------------------------------------------------------------------------
# Which function a class computes
# ---------------------------------------------------------------------------


class _Gate(NamedTuple):
    activation: str           # an expert_mlp preset
    layout: str               # gate and up along gate_up's 2F axis
    alpha: Optional[float]
    limit: Optional[float]


def _qualified(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _default_gate(module) -> _Gate:
    """transformers' default gate: act_fn(gate) * up over the halves of gate_up."""
    name = type(module).__name__
    act = getattr(module, "act_fn", None)
    if act is None:
        raise NotImplementedError(_err(f"{name} uses transformers' default gate act_fn(gate) * up but has no "
                                       "act_fn attribute: expertact cannot tell which activation it computes"))
    kind = type(act)
    # Exact types only: a subclass may override forward with other math.
    if kind is nn.SiLU or kind is getattr(_hf_act, "SiLUActivation", None):
        return _Gate("swiglu", "halves", None, None)
    if kind is getattr(_hf_act, "GELUTanh", None):
        f = getattr(act, "act", None)
        # torch's tanh GELU; the Python formula of the same function ("gelu_python_tanh") rounds
        # differently and is refused rather than matched approximately.
        if (isinstance(f, functools.partial) and f.func is nn.functional.gelu and not f.args
                and f.keywords == {"approximate": "tanh"}):
            return _Gate("geglu_tanh", "halves", None, None)
    raise NotImplementedError(_err(
        f"{name}.act_fn is {kind.__module__}.{kind.__qualname__}: expertact implements the gated forms "
        "act(gate) * up with act SiLU (hidden_act 'silu' / 'swish') or torch's tanh GELU "
        "(hidden_act 'gelu_pytorch_tanh') only; use experts_implementation='grouped_mm' for this model"))


def _gpt_oss_gate(module) -> _Gate:
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit), gate and
    # up interleaved: expertact's swiglu_oai (the biases, added before the clamps: _biases_of).
    return _Gate("swiglu_oai", "interleaved", _number(module, "alpha"), _number(module, "limit"))


def _minimax_m3_gate(module) -> _Gate:
    # The same function as GPT-OSS's with gate and up as halves, alpha and limit from the config.
    return _Gate("swiglu_oai", "halves", _number(module, "swiglu_alpha"), _number(module, "swiglu_limit"))


def _number(module, attr) -> float:
    v = getattr(module, attr, None)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise NotImplementedError(_err(f"{type(module).__name__}.{attr} = {v!r}: expertact needs a finite number "
                                       "there (the clamp or sigmoid scale of its gate)"))
    return float(v)


# Class-specific gates, by the qualified name of the _apply_gate function the class uses: a
# subclass that inherits one computes the same thing; one that overrides it is not listed.
_GATES: Dict[str, Callable] = {
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate": _gpt_oss_gate,
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts._apply_gate": _minimax_m3_gate,
}


def _gate_of(module) -> _Gate:
    """The expert_mlp form computing exactly what the module's class computes, or an error."""
    cls = type(module)
    name = cls.__name__
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    missing = [f for f in flags if not hasattr(module, f)]
    if missing:
        raise NotImplementedError(_err(
            f"{name} has no {', '.join(missing)}: it is not an experts class set up by transformers' "
            "@use_experts_implementation, whose flags say how its weights are stored"))
    if not module.has_gate:
        raise NotImplementedError(_err(
            f"{name} has no gate (has_gate=False: up_proj and act_fn(up) only); expertact computes gated "
            "activations act(gate) * up only"))
    fn = getattr(cls, "_apply_gate", None)
    if fn is None:
        raise NotImplementedError(_err(f"{name} has no _apply_gate: expertact cannot tell which gate it computes"))
    if fn is _hf_moe._default_apply_gate:
        gate = _default_gate(module)
    else:
        mapper = _GATES.get(_qualified(fn))
        if mapper is None:
            raise NotImplementedError(_err(
                f"{name} computes its own gate ({_qualified(fn)}), which expertact has no mapping for; "
                "supported: transformers' default act_fn(gate) * up, GPT-OSS's and MiniMax-M3's"))
        gate = mapper(module)
    concatenated = gate.layout == "halves"
    if bool(module.is_concatenated) != concatenated:
        raise NotImplementedError(_err(
            f"{name} declares is_concatenated={module.is_concatenated} but its gate reads gate and up "
            f"{'as halves' if concatenated else 'interleaved'}: expertact does not guess which is right"))
    return gate


def _weights_of(module, D: int):
    """(w13 [E, D, 2F], w2 [E, F, D]): views of the module's gate_up_proj and down_proj."""
    name = type(module).__name__
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor):
        raise NotImplementedError(_err(f"{name} has no 3-D gate_up_proj and down_proj tensors"))
    if module.is_transposed:  # stored [E, D, 2F] and [E, F, D]: as expert_mlp reads them
        w13, w2, stored = gate_up, down, "[E, D, 2F] and [E, F, D] (is_transposed=True)"
    else:  # nn.Linear's [out, in] per expert: [E, 2F, D] and [E, D, F]
        w13, w2, stored = gate_up.transpose(-2, -1), down.transpose(-2, -1), \
            "[E, 2F, D] and [E, D, F] (is_transposed=False)"
    ok = w13.dim() == 3 and w2.dim() == 3 and w13.shape[1] == D and w13.shape[2] % 2 == 0 and w13.shape[2] > 0
    if ok:
        E, _, f2 = w13.shape
        ok = tuple(w2.shape) == (E, f2 // 2, D)
    if not ok:
        raise ValueError(_err(
            f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not match hidden "
            f"size D = {D} as {stored}"))
    return w13, w2


def _biases_of(module, w13: Tensor):
    """(b13 [E, 2F], b2 [E, D]) of an experts module with has_bias=True, in w13's dtype (a cast
    only if they are held in another dtype), else (None, None). gate_up_proj_bias is in
    gate_up_proj's column layout, which is how expert_mlp reads b13: passed as it is."""
    if not module.has_bias:
        return None, None
    name = type(module).__name__
    b13 = getattr(module, "gate_up_proj_bias", None)
    b2 = getattr(module, "down_proj_bias", None)
    if not isinstance(b13, Tensor) or not isinstance(b2, Tensor):
        raise NotImplementedError(_err(
            f"{name} declares has_bias=True but has no gate_up_proj_bias and down_proj_bias tensors (the "
            "biases transformers' experts implementations read)"))
    E, D, f2 = w13.shape
    if tuple(b13.shape) != (E, f2) or tuple(b2.shape) != (E, D):
        raise ValueError(_err(
            f"{name}: gate_up_proj_bias {tuple(b13.shape)} and down_proj_bias {tuple(b2.shape)} are not [E, 2F] = "
            f"{[E, f2]} and [E, D] = {[E, D]} (from gate_up_proj and the hidden size)"))
    dt = w13.dtype
    return (b13 if b13.dtype == dt else b13.to(dt)), (b2 if b2.dtype == dt else b2.to(dt))


# ---------------------------------------------------------------------------
# Row permutations with deterministic backwards
# ---------------------------------------------------------------------------


class _Gather(torch.autograd.Function):
    """out = src[rows] where each row of src appears `reps` times in rows, and inverse lists, for
    each (row of src, repetition) in order, where it went: src_row * reps + r -> position in out.
    The gradient gathers back with `inverse` and sums the reps copies of each row in float32, in
    a fixed order: no index_add_ (atomics on CUDA, an order that varies from run to run)."""

    @staticmethod
    def forward(ctx, src, rows, inverse, reps):
        ctx.save_for_backward(inverse)
        ctx.reps = reps
        ctx.src_shape = src.shape
        return src.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)
        if ctx.reps > 1:
            g = g.view(ctx.src_shape[0], ctx.reps, *ctx.src_shape[1:]).sum(1, dtype=torch.float32).to(grad.dtype)
        return g, None, None, None


# ---------------------------------------------------------------------------
# The experts forward
# ---------------------------------------------------------------------------


def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *,
                    recompute: bool = False, inplace_backward: bool = False,
                    fp8: Union[str, bool, None] = None) -> Tensor:
    """The experts of a transformers MoE block (the class's ``forward`` arguments) through
    :func:`expertact.moe.expert_mlp`: hidden_states [T, D], top_k_index [T, K] (expert ids;
    ids >= E contribute nothing), top_k_weights [T, K] -> [T, D] in hidden_states' dtype.
    With expert biases (has_bias=True), each pair gives (act(x W13 + b13) W2 + b2) * weight.
    recompute / inplace_backward: expert_mlp's memory modes; fp8: its FP8 recipe (a name of
    expertact.moe.FP8_RECIPES, or True for the default, "blockwise": bf16
    on Hopper; on the CPU the emulation of the recipe)."""
    gate = _gate_of(module)
    name = type(module).__name__
    if hidden_states.dim() != 2:
        raise ValueError(_err(f"{name}: hidden_states must be [T, D]; got shape {tuple(hidden_states.shape)}"))
    T, D = hidden_states.shape
    w13, w2 = _weights_of(module, D)
    b13, b2 = _biases_of(module, w13)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(_err(
            f"{name}: top_k_index and top_k_weights must both be [T, K] with T = {T}; got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"))
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise TypeError(_err(f"{name}: top_k_index must hold integer expert ids; got dtype {top_k_index.dtype}"))
    K = top_k_index.shape[1]
    E = w13.shape[0]
    device = hidden_states.device

    ids = top_k_index.reshape(-1)
    # Stable: the pairs of one expert keep token order, so equal inputs give equal row orders.
    sorted_ids, perm = torch.sort(ids, stable=True)
    if sorted_ids.numel() and bool(sorted_ids[0] < 0):
        raise ValueError(_err(f"{name}: top_k_index holds a negative expert id ({int(sorted_ids[0])}); ids are "
                              f"0 .. {E - 1}, or >= {E} for pairs that contribute nothing"))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    # offsets[e] = the number of pairs with id <= e: the end row of expert e; ids >= E lie past offsets[-1].
    offsets = torch.searchsorted(sorted_ids, torch.arange(E, device=sorted_ids.device, dtype=sorted_ids.dtype),
                                 right=True, out_int32=True)

    # As transformers' grouped_mm does: the activations in the weights' dtype (autocast
    # can hand float32 hidden states to bf16 weights).
    x = hidden_states if hidden_states.dtype == w13.dtype else hidden_states.to(w13.dtype)
    xs = _Gather.apply(x, perm // K, inverse, K)
    flat_w = top_k_weights.reshape(-1)
    ws = _Gather.apply(flat_w, perm, inverse, 1).to(torch.float32)
    ys = expert_mlp(xs, w13, w2, offsets, gate.activation, alpha=gate.alpha, limit=gate.limit, layout=gate.layout,
                    weights=ws, recompute=recompute, inplace_backward=inplace_backward, b13=b13, b2=b2,
                    fp8=fp8)
    # Back to (token, k) order, then the K contributions of each token summed in float32.
    y = _Gather.apply(ys, inverse, perm, 1).view(T, K, D).sum(1, dtype=torch.float32)
    return y.to(hidden_states.dtype)


_REGISTERED: Dict[str, Callable] = {}


def register(name: str = DEFAULT_NAME, recompute: bool = False, inplace_backward: bool = False,
             fp8: Union[str, bool, None] = None) -> Callable:
    """Registers expertact under ``name`` in transformers' experts registry, with expert_mlp's
    memory modes (recompute: h is recomputed in backward; inplace_backward: gate_up's gradient
    is written over gate_up, so the graph runs backward once only), and its FP8 GEMMs (fp8: a
    recipe of expertact.moe.FP8_RECIPES, e.g. "rowwise-promoted-wgrad" or "blockwise", or True for
    the default recipe, "blockwise"; resolved here by
    expertact.moe.fp8_recipe: bf16 models on Hopper, and on
    the CPU as an emulation of the recipe). Returns the registered function.
    Re-registering a name this module registered replaces it; transformers' own names ("eager",
    "grouped_mm", ...) are refused."""
    if not isinstance(name, str) or not name:
        raise ValueError(_err(f"name must be a non-empty string; got {name!r}"))
    fp8 = fp8_recipe(fp8, _PREFIX + ".register")
    taken = {"eager"} | set(_hf_moe.ALL_EXPERTS_FUNCTIONS.keys())
    fp8_names = getattr(_fp8_registry(), "keys", None)
    if fp8_names is not None:
        taken |= set(fp8_names())
    if name in taken and name not in _REGISTERED:
        raise ValueError(_err(f"{name!r} is already an experts implementation of transformers; pick another name"))
    recompute, inplace_backward = bool(recompute), bool(inplace_backward)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, recompute=recompute,
                               inplace_backward=inplace_backward, fp8=fp8)

    forward.__name__ = forward.__qualname__ = "expertact_experts_forward"
    forward.__doc__ = (f"expertact's experts implementation {name!r} (recompute={recompute}, "
                       f"inplace_backward={inplace_backward}, fp8={fp8!r}): see "
                       "expertact.transformers.experts_forward.")
    forward.recompute, forward.inplace_backward, forward.fp8 = recompute, inplace_backward, fp8
    _hf_moe.ALL_EXPERTS_FUNCTIONS.register(name, forward)
    _REGISTERED[name] = forward
    return forward


def _fp8_registry():
    """transformers' FP8 experts registry, whose names from_pretrained also accepts (None if absent)."""
    try:
        from transformers.integrations import finegrained_fp8
    except Exception:  # pragma: no cover - optional in transformers
        return None
    return getattr(finegrained_fp8, "ALL_FP8_EXPERTS_FUNCTIONS", None)


register()
