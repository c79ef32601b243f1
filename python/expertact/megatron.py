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

Anything else is refused at construction with an error naming the config field.
``swap_experts(spec)`` returns a layer spec with ExpertMLP in place of SequentialMLP (and how many
it replaced); ``gpt_layer_local_spec(...)`` is Megatron's ``get_gpt_layer_local_spec(...)`` with
that done.

Not yet: the GPU tests, FP8 on the GPU, the training example and the benchmark (they need a GPU).
"""
from __future__ import annotations

from typing import Optional

import torch

from .moe import expert_mlp

__all__ = ["ExpertMLP", "activation_of", "swap_experts", "gpt_layer_local_spec"]  # noqa: F822 (module __getattr__)


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
    if act is F.silu:
        if offset != 0.0:
            raise ValueError(f"expertact.megatron: config.glu_linear_offset={offset} with activation_func silu: "
                             "expertact's silu forms have no offset on the linear half")
        return ("swiglu", None, None) if clamp is None else ("swiglu_clamped", None, float(clamp))
    if any(act is q for q in quick_gelus):
        if offset != 1.0:
            raise ValueError(f"expertact.megatron: config.glu_linear_offset={offset} with activation_func quick_gelu: "
                             "expertact computes GPT-OSS's form, offset 1")
        if clamp is None:
            raise ValueError("expertact.megatron: activation_func quick_gelu without "
                             "config.activation_func_clamp_value: expertact computes GPT-OSS's clamped form")
        return "swiglu_oai", 1.702, float(clamp)
    name = getattr(act, "__name__", repr(act))
    raise ValueError(f"expertact.megatron: config.activation_func={name}: expertact takes F.silu or "
                     "megatron's quick_gelu")


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
                     fp8: Optional[str] = None):
            form = activation_of(config)
            if getattr(config, "moe_apply_probs_on_input", False) and getattr(config, "moe_router_topk", 1) != 1:
                raise ValueError("expertact.megatron: config.moe_apply_probs_on_input=True needs moe_router_topk=1 "
                                 "(as Megatron's own experts)")
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection
                pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            super().__init__(num_local_experts, config, submodules or local_submodules, pg_collection, name)
            if self.tp_group is not None and self.tp_group.size() > 1:
                raise ValueError(f"expertact.megatron: expert tensor parallelism of {self.tp_group.size()} "
                                 "(config.expert_tensor_parallel_size): ExpertMLP computes whole experts; use "
                                 "expert parallelism")
            self.preset, self.alpha, self.limit = form
            self.expertact_recompute, self.expertact_inplace = bool(recompute), bool(inplace_backward)
            self.expertact_fp8 = fp8

        def _stacked(self, dtype):
            fc1 = [e.linear_fc1 for e in self.local_experts]
            fc2 = [e.linear_fc2 for e in self.local_experts]
            w13 = torch.stack([m.weight for m in fc1]).to(dtype)  # [E, 2F, D], gate then up
            w2 = torch.stack([m.weight for m in fc2]).to(dtype)   # [E, D, F]
            b13 = b2 = None
            if self.config.add_bias_linear:
                b13 = torch.stack([m.bias for m in fc1]).to(dtype)
                b2 = torch.stack([m.bias for m in fc2]).to(dtype)
            return w13, w2, b13, b2

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
            w13, w2, b13, b2 = self._stacked(x.dtype)
            y = expert_mlp(x, w13.transpose(-2, -1), w2.transpose(-2, -1), ends, self.preset, alpha=self.alpha,
                           limit=self.limit, layout="halves",
                           weights=None if probs is None else probs.to(torch.float32),
                           recompute=self.expertact_recompute, inplace_backward=self.expertact_inplace,
                           b13=b13, b2=b2, fp8=self.expertact_fp8)
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


def swap_experts(spec):
    """A Megatron layer spec with ExpertMLP wherever its experts are Megatron's SequentialMLP: in
    ModuleSpec trees and in the functools.partial specs of megatron-core 0.19 (the submodules stay:
    ExpertMLP takes and ignores them). Returns (the new spec, how many experts specs it replaced);
    the spec given is not modified."""
    import copy
    import dataclasses
    import functools
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    count = 0

    def swap(obj):
        nonlocal count
        if isinstance(obj, functools.partial):
            func = obj.func
            if func is SequentialMLP:
                count += 1
                func = _expert_mlp()
            args = [swap(a) for a in obj.args]
            keywords = {k: swap(v) for k, v in obj.keywords.items()}
            return functools.partial(func, *args, **keywords)
        if isinstance(obj, ModuleSpec):
            new = copy.copy(obj)
            if new.module is SequentialMLP:
                count += 1
                new.module = _expert_mlp()
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


def gpt_layer_local_spec(*args, **kwargs):
    """Megatron's ``get_gpt_layer_local_spec(*args, **kwargs)`` (the local spec: no
    TransformerEngine) with expertact's ExpertMLP as the experts; with ``num_experts`` and
    ``moe_grouped_gemm=False`` (Megatron's SequentialMLP), else ValueError."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec, n = swap_experts(get_gpt_layer_local_spec(*args, **kwargs))
    if n == 0:
        raise ValueError("expertact.megatron.gpt_layer_local_spec: the spec has no SequentialMLP experts to "
                         "replace (give num_experts, and moe_grouped_gemm=False)")
    return spec
