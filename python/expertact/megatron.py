"""Megatron-Core: expertact as the experts of a Megatron MoE layer.

``ExpertMLP`` is Megatron's ``SequentialMLP`` (megatron.core 0.19.2, transformer/moe/experts.py)
with its forward computed by :func:`expertact.moe.expert_mlp`: built and called as it is
(``ExpertMLP(num_local_experts, config, submodules=None, pg_collection=None, name=None)``,
``forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs) -> (output, None)``),
a subclass whose constructor builds the same local experts, so its parameters
(``local_experts.{i}.linear_fc1.weight`` [2F, D], gate then up; ``...linear_fc2.weight`` [D, F];
the biases with ``add_bias_linear``), state dict and sharded state dict (the global expert keys of
Megatron's distributed checkpoints) are SequentialMLP's own. Expert tensor parallelism is refused.

Megatron's expert MLP (transformer/mlp.py, the path without TransformerEngine and without
bias_activation_fusion), for the rows of one expert with routing probability p:

    x_glu, x_linear = chunk(x @ W1^T + b1, 2)            (gate first: expertact's "halves")
    x_glu, x_linear = clamp(x_glu, max=c), clamp(x_linear, -c, c)   (activation_func_clamp_value c)
    h = act(x_glu) * (x_linear + glu_linear_offset) * p
    y = h @ W2^T + b2 * p

which is expert_mlp's y = (act(gate_up) @ w2 + b2) * weights with the preset:

    activation_func F.silu, offset 0, no clamp      -> "swiglu"
    activation_func F.silu, offset 0, clamp c       -> "swiglu_clamped", limit c
    activation_func quick_gelu (x * sigmoid(1.702 x)), offset 1, clamp c  -> "swiglu_oai", alpha 1.702, limit c

Anything else is refused at construction with an error naming the config field, and so are the
two fused paths of Megatron that compute another function than its unfused one (docs/megatron.md).
The memory mode and precision are ExpertMLP's keywords (recompute, inplace_backward, fp8: a recipe
of expertact.moe.FP8_RECIPES, resolved by expertact.moe.fp8_recipe).
``swap_experts(spec, **options)`` returns a layer spec with ExpertMLP in place of SequentialMLP (and
how many it replaced); ``gpt_layer_local_spec(..., experts=options)`` is Megatron's
``get_gpt_layer_local_spec(...)`` with that done; ``enable(model, **options)`` switches the
SequentialMLPs of a built model in place (``disable(model)`` switches them back).
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from .moe import expert_mlp, fp8_recipe

__all__ = ["ExpertMLP", "activation_of", "swap_experts", "gpt_layer_local_spec", "enable", "disable"]  # noqa: F822 (module __getattr__)


def _quick_gelus():
    """Megatron's two quick_gelu functions (x * sigmoid(1.702 x)): the fused path's and activations'."""
    try:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        from megatron.core import activations
    except ImportError as e:
        raise ImportError(f"expertact.megatron needs megatron-core (0.19.2; Python >= 3.12): {e}") from e
    return (quick_gelu, getattr(activations, "quick_gelu", quick_gelu))


def activation_of(config):
    """(preset, alpha, limit) of expert_mlp for a Megatron TransformerConfig's expert MLP, or
    ValueError naming the config field expertact cannot take."""
    import torch.nn.functional as F
    quick_gelus = _quick_gelus()
    if not config.gated_linear_unit:
        raise ValueError("expertact.megatron: config.gated_linear_unit=False (a plain MLP): expertact computes "
                         "gated experts only")
    if getattr(config, "use_te_activation_func", False):
        raise ValueError("expertact.megatron: config.use_te_activation_func=True (TransformerEngine's activation)")
    act = config.activation_func
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    clamp = getattr(config, "activation_func_clamp_value", None)
    fused = bool(getattr(config, "bias_activation_fusion", False))
    if act is F.silu:
        if offset != 0.0:
            raise ValueError(f"expertact.megatron: config.glu_linear_offset={offset} with activation_func silu: "
                             "expertact's silu forms have no offset on the linear half")
        if clamp is not None and fused:
            # Megatron's fused weighted SwiGLU takes no clamp: its experts compute an unclamped
            # SwiGLU there and a clamped one without the fusion. Neither is guessed.
            raise ValueError(f"expertact.megatron: config.activation_func_clamp_value={clamp} with "
                             "bias_activation_fusion=True: Megatron's fused SwiGLU ignores the clamp (its unfused "
                             "path applies it); set bias_activation_fusion=False for the clamped SwiGLU, or drop "
                             "the clamp")
        return ("swiglu", None, None) if clamp is None else ("swiglu_clamped", None, float(clamp))
    if any(act is q for q in quick_gelus):
        if offset != 1.0:
            raise ValueError(f"expertact.megatron: config.glu_linear_offset={offset} with activation_func quick_gelu: "
                             "expertact computes GPT-OSS's form, offset 1")
        if clamp is None:
            raise ValueError("expertact.megatron: activation_func quick_gelu without "
                             "config.activation_func_clamp_value: expertact computes GPT-OSS's clamped form")
        if fused and config.add_bias_linear:
            # Megatron's fused quick-GeGLU clamps fc1's output before adding its bias; its unfused
            # path (and GPT-OSS) adds the bias first. expertact computes the latter.
            raise ValueError("expertact.megatron: config.bias_activation_fusion=True with add_bias_linear=True and "
                             "quick_gelu: Megatron's fused quick-GeGLU clamps before adding fc1's bias, its unfused "
                             "path (and GPT-OSS) after; expertact computes the unfused order: set "
                             "bias_activation_fusion=False")
        return "swiglu_oai", 1.702, float(clamp)
    name = getattr(act, "__name__", repr(act))
    raise ValueError(f"expertact.megatron: config.activation_func={name}: expertact takes F.silu or "
                     "megatron's quick_gelu")


def _check_config(config):
    """activation_of(config), after the refusals of what ExpertMLP cannot take (ValueError
    naming the config field)."""
    form = activation_of(config)
    if getattr(config, "moe_apply_probs_on_input", False) and getattr(config, "moe_router_topk", 1) != 1:
        raise ValueError("expertact.megatron: config.moe_apply_probs_on_input=True needs moe_router_topk=1 "
                         "(as Megatron's own experts)")
    for field in ("fp8", "fp4"):
        if getattr(config, field, None):
            raise ValueError(f"expertact.megatron: config.{field}={getattr(config, field)!r} is TransformerEngine's "
                             "low precision; ExpertMLP's FP8 is its own switch (fp8=True or a recipe's name), with "
                             "config.fp8 unset")
    for field in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"):
        if getattr(config, field, False):
            raise ValueError(f"expertact.megatron: config.{field}=True: ExpertMLP computes its weight gradients "
                             "in its own backward (no deferred backward_dw)")
    return form


def _check_module(module):
    """_check_config of a built experts module (a SequentialMLP), after refusing expert tensor
    parallelism: ExpertMLP computes whole experts."""
    if module.tp_group is not None and module.tp_group.size() > 1:
        raise ValueError(f"expertact.megatron: expert tensor parallelism of {module.tp_group.size()} "
                         "(config.expert_tensor_parallel_size): ExpertMLP computes whole experts; use "
                         "expert parallelism")
    return _check_config(module.config)


def _options(recompute=False, inplace_backward=False, fp8=None):
    """ExpertMLP's memory mode and precision, checked (fp8 resolved to its recipe's name or None)."""
    return {"recompute": bool(recompute), "inplace_backward": bool(inplace_backward),
            "fp8": fp8_recipe(fp8, "expertact.megatron")}


def _sequential_mlp():
    try:
        from megatron.core.transformer.moe.experts import SequentialMLP
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    except ImportError as e:
        raise ImportError(f"expertact.megatron needs megatron-core (0.19.2; Python >= 3.12): {e}") from e
    return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _expert_mlp_class():
    """ExpertMLP is a subclass of Megatron's SequentialMLP, made on first use (Megatron is an
    optional dependency): SequentialMLP's own constructor builds the local experts (Megatron's MLP
    with its linear layers), so the parameters, state_dict, sharded_state_dict (global expert keys)
    and checkpoint loading are Megatron's own; only forward is expertact's."""
    SequentialMLP, local_submodules = _sequential_mlp()

    class ExpertMLP(SequentialMLP):
        __doc__ = __doc__

        def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                     name: Optional[str] = None, *, recompute: bool = False, inplace_backward: bool = False,
                     fp8: Union[str, bool, None] = None):
            options = _options(recompute, inplace_backward, fp8)
            _check_config(config)
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection
                pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            super().__init__(num_local_experts, config, submodules or local_submodules, pg_collection, name)
            self._expertact_configure(options)

        def _expertact_configure(self, options):
            """The checks and settings of __init__, also applied by enable() to a built SequentialMLP."""
            self.preset, self.alpha, self.limit = _check_module(self)
            self.expertact_options = dict(options)

        def _weights(self, dtype):
            """w13 [E, D, 2F] and w2 [E, F, D] in dtype, as transposed views of the stacked
            [E, 2F, D] / [E, D, F] weights of the local experts (one copy each)."""
            w13 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).to(dtype)
            w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).to(dtype)
            return w13.transpose(-2, -1), w2.transpose(-2, -1)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            x, probs = permuted_local_hidden_states, permuted_probs
            if self.config.moe_apply_probs_on_input:
                x = (probs.unsqueeze(-1) * x).to(x.dtype)
                probs = None
            if self.num_local_experts == 1:
                counts = [x.shape[0]]  # one expert takes every row, as Megatron's
            else:
                counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) \
                    else list(tokens_per_expert)
            ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
            w13, w2 = self._weights(x.dtype)
            b13 = b2 = None
            if self.config.add_bias_linear:
                b13 = torch.stack([e.linear_fc1.bias for e in self.local_experts]).to(x.dtype)
                b2 = torch.stack([e.linear_fc2.bias for e in self.local_experts]).to(x.dtype)
            # The stacked weights are made again in backward rather than kept from forward to
            # backward: Megatron's own experts keep no copy of their weights.
            y = expert_mlp(x, w13, w2, ends, self.preset, alpha=self.alpha, limit=self.limit, layout="halves",
                           weights=None if probs is None else probs.to(torch.float32), b13=b13, b2=b2,
                           remake_weights=functools.partial(self._weights, x.dtype), **self.expertact_options)
            return y, None

    ExpertMLP.__module__ = __name__
    ExpertMLP.__qualname__ = "ExpertMLP"
    return ExpertMLP


_CLASS = []


def _expert_mlp():
    """The one ExpertMLP class (made once)."""
    if not _CLASS:
        _CLASS.append(_expert_mlp_class())
    return _CLASS[0]


def __getattr__(name):
    # ExpertMLP exists once Megatron is importable; importing this module does not import Megatron.
    if name == "ExpertMLP":
        return _expert_mlp()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def swap_experts(spec, *, recompute: bool = False, inplace_backward: bool = False,
                 fp8: Union[str, bool, None] = None):
    """A Megatron layer spec with ExpertMLP wherever its experts are Megatron's SequentialMLP: in
    ModuleSpec trees and in the functools.partial specs of megatron-core 0.19 (the submodules stay:
    ExpertMLP takes them as SequentialMLP does), with the memory mode and precision given. Returns
    (the new spec, how many experts specs it replaced); the spec given is not modified."""
    import copy
    import dataclasses
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    options = _options(recompute, inplace_backward, fp8)
    ours = _expert_mlp()
    count = 0

    def swap(obj):
        nonlocal count
        if isinstance(obj, functools.partial):
            func, keywords = obj.func, {k: swap(v) for k, v in obj.keywords.items()}
            if func is SequentialMLP or func is ours:
                count += 1
                func, keywords = ours, {**keywords, **options}
            return functools.partial(func, *[swap(a) for a in obj.args], **keywords)
        if isinstance(obj, ModuleSpec):
            new = copy.copy(obj)
            if new.module is SequentialMLP or new.module is ours:
                count += 1
                new.module, new.params = ours, {**(new.params or {}), **options}
            new.submodules = swap(new.submodules)
            return new
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: swap(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                               if f.init})
        if isinstance(obj, (list, tuple)):
            return type(obj)(swap(v) for v in obj)
        if isinstance(obj, dict):
            return {k: swap(v) for k, v in obj.items()}
        return obj

    return swap(spec), count


def gpt_layer_local_spec(*args, experts: Optional[dict] = None, **kwargs):
    """Megatron's ``get_gpt_layer_local_spec(*args, **kwargs)`` (the local spec: no
    TransformerEngine) with expertact's ExpertMLP as the experts, with ``experts`` (a dict of
    ExpertMLP's keywords: recompute, inplace_backward, fp8); needs ``num_experts`` and
    ``moe_grouped_gemm=False`` (Megatron's SequentialMLP), else ValueError."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec, n = swap_experts(get_gpt_layer_local_spec(*args, **kwargs), **(experts or {}))
    if n == 0:
        raise ValueError("expertact.megatron.gpt_layer_local_spec: the spec has no SequentialMLP experts to "
                         "replace (give num_experts, and moe_grouped_gemm=False)")
    return spec


def enable(model, *, recompute: bool = False, inplace_backward: bool = False,
           fp8: Union[str, bool, None] = None) -> int:
    """Switch a built Megatron model (one made from Megatron's own local specs) to expertact: every
    SequentialMLP in it becomes an ExpertMLP in place, with the memory mode and precision given
    (an ExpertMLP already there takes them). The parameters, their values, gradients and optimizer
    state are untouched (ExpertMLP is a SequentialMLP with another forward). Returns how many
    modules it switched; a config ExpertMLP cannot take raises ValueError before any is switched;
    TransformerEngine's TEGroupedMLP (other parameters) is refused."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    options = _options(recompute, inplace_backward, fp8)
    ours = _expert_mlp()
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls is SequentialMLP or cls is ours:
            found.append(module)
        elif cls.__name__ == "TEGroupedMLP":
            raise ValueError(f"expertact.megatron.enable: {name} is TransformerEngine's TEGroupedMLP; build the "
                             "model with Megatron's local spec (moe_grouped_gemm=False: SequentialMLP), or with "
                             "expertact.megatron.gpt_layer_local_spec")
    for module in found:  # every check before any switch
        _check_module(module)
    for module in found:
        module.__class__ = ours
        module._expertact_configure(options)
    return len(found)


def disable(model) -> int:
    """Undo enable(): every ExpertMLP in the model becomes Megatron's SequentialMLP again (its
    parameters untouched). Returns how many."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    ours = _expert_mlp()
    found = [m for m in model.modules() if type(m) is ours]
    for module in found:
        module.__class__ = SequentialMLP
        for attr in ("preset", "alpha", "limit", "expertact_options"):
            module.__dict__.pop(attr, None)
    return len(found)
