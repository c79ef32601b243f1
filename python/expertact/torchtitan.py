"""expertact.torchtitan: expertact's expert MLP as TorchTitan's routed experts (TorchTitan 0.3).

TorchTitan swaps a component by rewriting the model's config tree before anything is built:
an ``@override(target=SomeModule.Config)`` factory, named as ``module.function`` in
``--override.imports``, receives each matching config node and returns its replacement. There is
no whole-module form: list a factory, not just this module. Three are provided::

    --override.imports expertact.torchtitan.expertact_grouped_experts
    --override.imports expertact.torchtitan.expertact_fused_grouped_experts
    --override.imports expertact.torchtitan.expertact_gpt_oss_grouped_experts
    # with expert_mlp's memory modes or an FP8 recipe (one shell token, JSON kwargs):
    --override.imports 'expertact.torchtitan.expertact_grouped_experts={"recompute": true}'
    --override.imports 'expertact.torchtitan.expertact_grouped_experts={"fp8": "rowwise-promoted-wgrad"}'   # FP8

TorchTitan imports this module while resolving the target; importing it only registers the
factories and changes nothing else. The first two replace every ``GroupedExperts.Config`` (the
``inner_experts`` of each ``RoutedExperts``), the third GPT-OSS's only:

- ``expertact_grouped_experts`` -> :class:`ExpertactGroupedExperts`: TorchTitan's
  ``GroupedExperts`` with the same parameters (``w1_EFD``, ``w2_EDF``, ``w3_EFD``: parameter
  names, checkpoint keys, initialisation and sharding plans unchanged), one packed copy of w1 and
  w3 per forward (below).
- ``expertact_fused_grouped_experts`` -> :class:`ExpertactFusedGroupedExperts`: what TorchTitan's
  own ``fused_grouped_experts`` override (torchtitan.overrides.fused_swiglu) makes of the config,
  one ``w13`` [E, F, 2, D] parameter for gate and up (checkpoints still saved and loaded as
  ``w1_EFD`` / ``w3_EFD`` by TorchTitan's state-dict hooks), read by expertact as its
  "interleaved" [E, D, 2F] layout through a view: no per-call copy. List it instead of
  TorchTitan's ``fused_grouped_experts`` (both claim the same nodes).
- ``expertact_gpt_oss_grouped_experts`` -> :class:`ExpertactGptOssGroupedExperts`: TorchTitan's
  ``GptOssGroupedExperts`` (GPT-OSS) with the same parameters (``mlp1_weight_EGD`` [E, 2F, D],
  gate and up interleaved along 2F; ``mlp1_bias_EG`` [E, 2F] in the same order;
  ``mlp2_weight_EDF`` [E, D, F]; ``mlp2_bias_ED`` [E, D]: names, checkpoint keys, initialisation
  and sharding plans unchanged), all read as stored: no per-call copy. The first two factories
  turn a GPT-OSS node into this class too, so any one of the three switches a GPT-OSS model
  (list only one: two factories claiming the same node is an error in TorchTitan).

All forwards go through :func:`expertact.moe.expert_mlp`, one autograd node for the whole MLP
whose memory modes (``recompute``, ``inplace_backward``) decide what is kept for backward, and
whose ``fp8`` (a name of ``expertact.moe.FP8_RECIPES``, or True for the default recipe,
``"blockwise"``; resolved by ``expertact.moe.fp8_recipe``; None, the default, keeps
the GEMMs in the compute dtype) runs its grouped GEMMs in float8 as the recipe says: bf16
compute dtype, on Hopper, or on the CPU as an emulation of the recipe.

For a model built in Python rather than by the trainer, :func:`enable` switches the
``GroupedExperts`` / ``FusedGroupedExperts`` / ``GptOssGroupedExperts`` modules of a built model to expertact's forward and
:func:`disable` switches them back to TorchTitan's own classes (call them before
``fully_shard`` / ``torch.compile``, which wrap the module's class).

What the forward computes: exactly TorchTitan's ``GroupedExperts.forward``, SwiGLU
``y = (silu(x w1^T) * (x w3^T)) w2^T`` per expert over the rows sorted by expert, with the
activations and weights cast to bf16 (as TorchTitan casts them, whatever the parameters' dtype;
``compute_dtype=None`` computes in x's dtype instead) and the result cast back to x's dtype.
Rounding differs slightly: TorchTitan rounds silu(gate) to bf16 before the product, expertact
computes the gated activation in float32 and rounds once. Rows of x past
``sum(num_tokens_per_expert)`` (the capacity padding of TorchTitan's HybridEP dispatcher) give
zero output and zero gradient; TorchTitan's own ``torch._grouped_mm`` leaves them unwritten.
Groups padded to a multiple (TorchAO's dispatcher) are counted in ``num_tokens_per_expert`` and
computed like any row, as TorchTitan does.

GPT-OSS: exactly TorchTitan's ``GptOssGroupedExperts.forward``, per expert
``y = swiglu(x W1^T + b1) W2^T + b2`` with TorchTitan's swiglu (gate and up interleaved, gate
clamped above at ``swiglu_limit``, up to +-``swiglu_limit``, ``(up + 1) * gate *
sigmoid(1.702 * gate)``: expert_mlp's "swiglu_oai", the clamps after the bias), computed in
bf16 (or ``compute_dtype``) and returned in that dtype, as TorchTitan's module returns its bf16
result. Under tensor parallelism (a "tp" dim in mlp1_weight_EGD's DTensor mesh: mlp1 and its
bias sharded along 2F, mlp2 along F, mlp2_bias_ED replicated) each rank's output is a partial
sum, so mlp2_bias_ED is divided by the TP degree in forward and its gradient passed back
unscaled, as TorchTitan's ``ScaleBiasForward`` does. TorchTitan's spmd_types type checking
(its ``spmd_types`` backend) is not applied inside expertact's forward.

Checked against TorchTitan 0.3.0's own modules, forward and backward, in
tests/python/test_torchtitan.py; GPT-OSS also under 2-way tensor parallelism (two gloo processes
on the CPU).

The cost of separate w1 and w3 (``expertact_grouped_experts``): expert_mlp reads gate and up
packed in one tensor, ``w13`` [E, D, 2F], and TorchTitan holds them as two parameters in separate
storages, which no strided view can join. Each forward therefore writes one [E, 2F, D] tensor in
the compute dtype (gate rows then up rows per expert, the "halves" layout), ``2 * E * F * D``
elements, kept for backward as expert_mlp keeps w13; its gradient is split back into w1's and
w3's. With float32 parameters this is the cast TorchTitan's module does anyway (``w1.bfloat16()``
and ``w3.bfloat16()``, the same bytes, also kept for backward): no extra copy. With bf16
parameters (FSDP2 with ``param_dtype=bfloat16``, where TorchTitan's casts are no-ops) it is one
extra copy of ``4 * E * F * D`` bytes per MoE layer and forward, alive until that layer's backward
(or recomputed under activation checkpointing): 805 MB for Qwen3-30B-A3B's 128 experts (F = 768,
D = 2048) on one rank, 101 MB with 8-way expert parallelism (computed from the shapes, not
timed). ``expertact_fused_grouped_experts`` avoids it. w2 is read as stored (a transposed view,
cast only if it is not already bf16, as TorchTitan does).

Refused, with an error naming the class (never different math): any other ``GroupedExperts``
subclass (the MXFP8 converter's quantized experts, a subclass of ``GptOssGroupedExperts``, a
user's own class, ...): it computes something of its own (NotImplementedError).

TorchTitan's model code imports ``spmd_types``, ``tyro`` and (in its token dispatcher) ``triton``,
but not its trainer's wandb, tensorboard, datasets or torchdata; see tests/python/test_torchtitan.py
for a minimal install.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

try:
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.moe import GroupedExperts
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(f"expertact.torchtitan needs TorchTitan >= 0.3 (torchtitan.config.override): {_e}") from _e

try:
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
except ImportError:  # pragma: no cover - a TorchTitan without GPT-OSS
    GptOssGroupedExperts = None

try:  # TorchTitan's own fused gate/up override (it imports triton)
    from torchtitan.overrides.fused_swiglu import FusedGroupedExperts, fused_grouped_experts
except ImportError:  # pragma: no cover - depends on the environment
    FusedGroupedExperts = fused_grouped_experts = None

from .moe import expert_mlp, fp8_recipe, offsets_from_counts

__all__ = ["ExpertactGroupedExperts", "expertact_grouped_experts", "ExpertactFusedGroupedExperts",
           "expertact_fused_grouped_experts", "ExpertactGptOssGroupedExperts", "expertact_gpt_oss_grouped_experts",
           "enable", "disable", "experts_forward"]

_PREFIX = "expertact.torchtitan"

# GptOssGroupedExperts' parameters, and the sigmoid scale of its swiglu (TorchTitan's default
# argument there, not a config field; the clamp limit is the config's swiglu_limit).
_GPT_OSS_PARAMS = ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")
_GPT_OSS_ALPHA = 1.702


def _err(msg: str) -> str:
    return f"{_PREFIX}: {msg}"


def _dtype(value) -> Optional[torch.dtype]:
    """compute_dtype from a torch.dtype, its name ("bfloat16", from JSON kwargs) or None."""
    if value is None or isinstance(value, torch.dtype):
        dt = value
    elif isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        dt = getattr(torch, value)
    else:
        raise ValueError(_err(f"compute_dtype must be a torch dtype, its name or None; got {value!r}"))
    if dt is not None and dt not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(_err(f"compute_dtype {dt} is not a floating dtype expert_mlp computes in"))
    return dt


def _refuse(cls: type, what: str = "module") -> None:
    """Raises NotImplementedError for a GroupedExperts class expertact does not compute."""
    name = cls.__qualname__
    raise NotImplementedError(_err(
        f"{name} is a {what} of its own deriving from TorchTitan's GroupedExperts; expertact computes exactly "
        "TorchTitan's GroupedExperts, FusedGroupedExperts (their SwiGLU) and GptOssGroupedExperts only and does "
        "not guess what another subclass changes"))


# ---------------------------------------------------------------------------
# The forward
# ---------------------------------------------------------------------------


class _PackGateUp(torch.autograd.Function):
    """w1, w3 [E, F, D] -> w13 [E, 2F, D] in dtype, gate rows then up rows per expert: one write of
    the packed tensor, the cast included. Backward splits w13's gradient into w1's and w3's, cast
    to their dtypes (as the backward of TorchTitan's ``.bfloat16()`` casts does)."""

    @staticmethod
    def forward(ctx, w1, w3, dtype):
        E, F, D = w1.shape
        w13 = torch.empty((E, 2 * F, D), dtype=dtype, device=w1.device)
        w13[:, :F].copy_(w1)
        w13[:, F:].copy_(w3)
        ctx.F, ctx.dtypes = F, (w1.dtype, w3.dtype)
        return w13

    @staticmethod
    def backward(ctx, g):
        F = ctx.F
        return g[:, :F].to(ctx.dtypes[0]), g[:, F:].to(ctx.dtypes[1]), None


def _local(t: Tensor) -> Tensor:
    """A DTensor parameter's local shard (TorchTitan's experts run on local tensors), else t."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class _ScaleForward(torch.autograd.Function):
    """bias / tp_degree in forward, its gradient passed back unscaled: what TorchTitan does to
    GPT-OSS's down-projection bias under tensor parallelism (``ScaleBiasForward``), where each
    TP rank's output is a partial sum and the replicated bias must be counted once in the
    sum, while each rank's bias gradient stays the full one."""

    @staticmethod
    def forward(ctx, bias, tp_degree):
        return bias / tp_degree

    @staticmethod
    def backward(ctx, g):
        return g, None


def _tp_degree(param) -> int:
    """The size of the "tp" dim of a DTensor parameter's device mesh (1 for a plain tensor or
    a mesh without one), as TorchTitan's GptOssGroupedExperts reads it from mlp1_weight_EGD."""
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index("tp")) if "tp" in names else 1


def _gpt_oss_forward(module, x, offsets, dt, recompute, inplace_backward, fp8):
    """GptOssGroupedExperts' forward through expert_mlp: mlp1 [E, 2F, D] (gate and up
    interleaved along 2F) with its bias [E, 2F] in the same column order, swiglu_oai with
    TorchTitan's alpha 1.702 and the config's swiglu_limit, mlp2 [E, D, F] with its bias [E, D]
    scaled by 1 / the TP degree in forward. Returns the result in the compute dtype, as
    TorchTitan's module returns its bf16 result."""
    name = type(module).__name__
    w1, b1, w2, b2 = (_local(getattr(module, n)) for n in _GPT_OSS_PARAMS)
    ok = w1.dim() == 3 and w1.shape[1] % 2 == 0 and w1.shape[1] > 0
    E, G, D = w1.shape if ok else (0, 0, 0)
    if not ok or tuple(b1.shape) != (E, G) or tuple(w2.shape) != (E, D, G // 2) or tuple(b2.shape) != (E, D):
        raise ValueError(_err(
            f"{name}: mlp1_weight_EGD {tuple(w1.shape)}, mlp1_bias_EG {tuple(b1.shape)}, mlp2_weight_EDF "
            f"{tuple(w2.shape)} and mlp2_bias_ED {tuple(b2.shape)} are not [E, 2F, D], [E, 2F], [E, D, F] and [E, D]"))
    limit = getattr(module, "swiglu_limit", None)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit):
        raise ValueError(_err(f"{name}: swiglu_limit = {limit!r}; expected a finite number"))
    tp = _tp_degree(module.mlp1_weight_EGD)
    if tp > 1:
        b2 = _ScaleForward.apply(b2, tp)
    return expert_mlp(x.to(dt), w1.to(dt).transpose(-2, -1), w2.to(dt).transpose(-2, -1), offsets, "swiglu_oai",
                      alpha=_GPT_OSS_ALPHA, limit=float(limit), layout="interleaved", b13=b1.to(dt), b2=b2.to(dt),
                      recompute=recompute, inplace_backward=inplace_backward, fp8=fp8)


def experts_forward(module: nn.Module, x: Tensor, num_tokens_per_expert: Tensor, *, recompute: bool = False,
                    inplace_backward: bool = False, compute_dtype=torch.bfloat16, fp8=None) -> Tensor:
    """TorchTitan's ``GroupedExperts.forward`` (x [R, D] sorted by expert, num_tokens_per_expert
    [E]) over ``module``'s w1_EFD, w2_EDF, w3_EFD (or a FusedGroupedExperts' w13, w2_EDF; or a
    GptOssGroupedExperts' mlp1_weight_EGD, mlp1_bias_EG, mlp2_weight_EDF, mlp2_bias_ED), through
    :func:`expertact.moe.expert_mlp`. compute_dtype: the dtype of the GEMMs and the activation,
    bf16 as TorchTitan's modules; None computes in x's dtype. recompute / inplace_backward:
    expert_mlp's memory modes; fp8: its FP8 recipe (None: the GEMMs in the compute dtype). Returns [R, D] in x's dtype (GPT-OSS: in the compute dtype, as
    TorchTitan's GptOssGroupedExperts); rows past sum(num_tokens_per_expert) are 0."""
    name = type(module).__name__
    if x.dim() != 2:
        raise ValueError(_err(f"{name}: x must be [R, D] (rows sorted by expert); got shape {tuple(x.shape)}"))
    dt = x.dtype if compute_dtype is None else compute_dtype
    if "mlp1_weight_EGD" in module._parameters:  # GptOssGroupedExperts
        offsets = offsets_from_counts(num_tokens_per_expert, _err(name))
        return _gpt_oss_forward(module, x, offsets, dt, recompute, inplace_backward, fp8)
    fused = "w13" in module._parameters
    if fused:  # TorchTitan's FusedGroupedExperts: w13 [E, F, 2, D], gate and up interleaved along F
        w13_EF2D, w2 = _local(module.w13), _local(module.w2_EDF)
        ok = w13_EF2D.dim() == 4 and w13_EF2D.shape[2] == 2
        E, F, _, D = w13_EF2D.shape if ok else (0, 0, 0, 0)
        shapes = (f"w13 {tuple(w13_EF2D.shape)} and w2_EDF {tuple(w2.shape)} are not [E, F, 2, D] and "
                  "[E, D, F]")
    else:
        w1, w2, w3 = (_local(getattr(module, n)) for n in ("w1_EFD", "w2_EDF", "w3_EFD"))
        ok = w1.dim() == 3 and w1.shape == w3.shape
        E, F, D = w1.shape if ok else (0, 0, 0)
        shapes = (f"w1_EFD {tuple(w1.shape)}, w3_EFD {tuple(w3.shape)} and w2_EDF {tuple(w2.shape)} are not "
                  "[E, F, D], [E, F, D] and [E, D, F]")
    if not ok or tuple(w2.shape) != (E, D, F):
        raise ValueError(_err(f"{name}: {shapes}"))
    offsets = offsets_from_counts(num_tokens_per_expert, _err(name))
    if fused:  # a view when w13 is in dt and contiguous: no copy
        w13, layout = w13_EF2D.to(dt).reshape(E, 2 * F, D).transpose(-2, -1), "interleaved"
    else:  # one packed copy (see the module's docstring)
        w13, layout = _PackGateUp.apply(w1, w3, dt).transpose(-2, -1), "halves"
    w2_fd = w2.to(dt).transpose(-2, -1)  # [E, F, D], a view when w2 is in dt
    y = expert_mlp(x.to(dt), w13, w2_fd, offsets, "swiglu", layout=layout, recompute=recompute,
                   inplace_backward=inplace_backward, fp8=fp8)
    return y.type_as(x)


# ---------------------------------------------------------------------------
# The module and its config
# ---------------------------------------------------------------------------


_MODE_ATTRS = ("recompute", "inplace_backward", "compute_dtype", "fp8")


def _fp8(value):
    """An override's or enable()'s fp8 as its recipe's name or None (expertact.moe.fp8_recipe)."""
    return fp8_recipe(value, _PREFIX)


class _Modes:
    """The memory modes, compute dtype and FP8 recipe of the expertact classes, set from a config or
    by enable()."""

    def __init__(self, config):
        super().__init__(config)
        self._set_modes(config.recompute, config.inplace_backward, config.compute_dtype, config.fp8)

    def _set_modes(self, recompute, inplace_backward, compute_dtype, fp8):
        self.recompute, self.inplace_backward = bool(recompute), bool(inplace_backward)
        self.compute_dtype = _dtype(compute_dtype)
        self.fp8 = _fp8(fp8)

    def forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        return experts_forward(self, x_RD, num_tokens_per_expert_E, recompute=self.recompute,
                               inplace_backward=self.inplace_backward, compute_dtype=self.compute_dtype, fp8=self.fp8)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, recompute={self.recompute}, "
                f"inplace_backward={self.inplace_backward}, compute_dtype={self.compute_dtype}, fp8={self.fp8!r}")


class ExpertactGroupedExperts(_Modes, GroupedExperts):
    """TorchTitan's ``GroupedExperts`` (same parameters, same state dict keys) whose forward is
    :func:`experts_forward`. Config fields beyond GroupedExperts.Config: ``recompute`` and
    ``inplace_backward`` (expert_mlp's memory modes), ``compute_dtype`` (bf16 as TorchTitan's
    module; None computes in the activations' dtype), ``fp8`` (expert_mlp's FP8 recipe by name,
    e.g. "rowwise-promoted-wgrad"; None: none)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        recompute: bool = False
        inplace_backward: bool = False
        compute_dtype: Optional[torch.dtype] = torch.bfloat16
        fp8: Optional[str] = None


def _modes(recompute, inplace_backward, compute_dtype, fp8) -> dict:
    """The override factories' keyword arguments as config fields."""
    return dict(recompute=bool(recompute), inplace_backward=bool(inplace_backward),
                compute_dtype=_dtype(compute_dtype), fp8=_fp8(fp8))


@override(target=GroupedExperts.Config,
          description="expertact: routed experts' SwiGLU MLP as one fused autograd node (expertact.moe.expert_mlp)")
def expertact_grouped_experts(cfg: GroupedExperts.Config, *, recompute: bool = False, inplace_backward: bool = False,
                              compute_dtype="bfloat16", fp8=None) -> ExpertactGroupedExperts.Config:
    """TorchTitan override factory: ``GroupedExperts.Config`` -> ``ExpertactGroupedExperts.Config``
    (every other field copied). Keyword arguments come from the ``--override.imports`` entry's
    JSON: ``recompute``, ``inplace_backward`` (bools), ``compute_dtype`` ("bfloat16", "float32",
    or null for the activations' dtype), ``fp8`` (a recipe's name, true for the default FP8
    recipe, "blockwise", or null). A ``GptOssGroupedExperts.Config``
    becomes ``ExpertactGptOssGroupedExperts.Config``; other subclasses raise NotImplementedError."""
    modes = _modes(recompute, inplace_backward, compute_dtype, fp8)
    if _is_gpt_oss(cfg):
        return _gpt_oss_config(cfg, modes)
    if type(cfg) is not GroupedExperts.Config and not isinstance(cfg, ExpertactGroupedExperts.Config):
        _refuse(getattr(type(cfg), "_owner", None) or type(cfg), "config")
    return derive(cfg, ExpertactGroupedExperts.Config, **modes)


if FusedGroupedExperts is not None:

    class ExpertactFusedGroupedExperts(_Modes, FusedGroupedExperts):
        """TorchTitan's ``FusedGroupedExperts`` (its fused override's module: parameters ``w13``
        [E, F, 2, D] and ``w2_EDF``; checkpoints saved and loaded as ``w1_EFD`` / ``w2_EDF`` /
        ``w3_EFD`` by TorchTitan's own state-dict hooks) whose forward is :func:`experts_forward`:
        w13 is read as expert_mlp's interleaved [E, D, 2F] through a view, with no per-call copy
        when the parameters are already in the compute dtype. Computes what ``GroupedExperts``
        computes (the same SwiGLU); config fields as :class:`ExpertactGroupedExperts`."""

        @dataclass(kw_only=True, slots=True)
        class Config(FusedGroupedExperts.Config):
            recompute: bool = False
            inplace_backward: bool = False
            compute_dtype: Optional[torch.dtype] = torch.bfloat16
            fp8: Optional[str] = None

    @override(target=GroupedExperts.Config,
              description="expertact: fused gate/up weight (TorchTitan's FusedGroupedExperts) read without a copy")
    def expertact_fused_grouped_experts(cfg: GroupedExperts.Config, *, recompute: bool = False,
                                        inplace_backward: bool = False, compute_dtype="bfloat16", fp8=None):
        """TorchTitan override factory: what TorchTitan's own ``fused_grouped_experts`` override
        does to a ``GroupedExperts.Config`` (w1_EFD and w3_EFD become one ``w13`` parameter, its
        initialisation and sharding remapped by TorchTitan), building
        :class:`ExpertactFusedGroupedExperts`. List this one instead of TorchTitan's (both claim
        the same nodes). Keyword arguments as :func:`expertact_grouped_experts`. A
        ``GptOssGroupedExperts.Config`` (whose gate and up are one parameter already) becomes
        ``ExpertactGptOssGroupedExperts.Config``, as with :func:`expertact_grouped_experts`."""
        modes = _modes(recompute, inplace_backward, compute_dtype, fp8)
        if _is_gpt_oss(cfg):
            return _gpt_oss_config(cfg, modes)
        if isinstance(cfg, ExpertactFusedGroupedExperts.Config):
            return derive(cfg, ExpertactFusedGroupedExperts.Config, **modes)
        if type(cfg) is not GroupedExperts.Config:
            _refuse(getattr(type(cfg), "_owner", None) or type(cfg), "config")
        return derive(fused_grouped_experts(cfg), ExpertactFusedGroupedExperts.Config, **modes)

else:  # pragma: no cover - a TorchTitan without its fused override
    ExpertactFusedGroupedExperts = expertact_fused_grouped_experts = None


if GptOssGroupedExperts is not None:

    class ExpertactGptOssGroupedExperts(_Modes, GptOssGroupedExperts):
        """TorchTitan's ``GptOssGroupedExperts`` (same parameters ``mlp1_weight_EGD`` [E, 2F, D],
        ``mlp1_bias_EG`` [E, 2F], ``mlp2_weight_EDF`` [E, D, F], ``mlp2_bias_ED`` [E, D]: same
        state dict keys, initialisation and sharding plans) whose forward is :func:`experts_forward`:
        expert_mlp's "swiglu_oai" over gate and up interleaved, alpha 1.702 and the config's
        ``swiglu_limit``, the two biases passed as b13 and b2 as they are stored (no copy; casts
        to the compute dtype only). Under tensor parallelism mlp2_bias_ED is divided by the TP
        degree in forward, its gradient unscaled, as TorchTitan does. Config fields as
        :class:`ExpertactGroupedExperts`."""

        @dataclass(kw_only=True, slots=True)
        class Config(GptOssGroupedExperts.Config):
            recompute: bool = False
            inplace_backward: bool = False
            compute_dtype: Optional[torch.dtype] = torch.bfloat16
            fp8: Optional[str] = None

    def _gpt_oss_config(cfg, modes):
        """A GptOssGroupedExperts.Config (or an expertact one, given new modes) -> expertact's."""
        if type(cfg) is not GptOssGroupedExperts.Config and not isinstance(cfg, ExpertactGptOssGroupedExperts.Config):
            _refuse(getattr(type(cfg), "_owner", None) or type(cfg), "config")
        return derive(cfg, ExpertactGptOssGroupedExperts.Config, **modes)

    @override(target=GptOssGroupedExperts.Config,
              description="expertact: GPT-OSS routed experts (biased clamped SwiGLU) as one autograd node")
    def expertact_gpt_oss_grouped_experts(cfg: GptOssGroupedExperts.Config, *, recompute: bool = False,
                                          inplace_backward: bool = False, compute_dtype="bfloat16", fp8=None):
        """TorchTitan override factory: ``GptOssGroupedExperts.Config`` ->
        ``ExpertactGptOssGroupedExperts.Config`` (every other field copied: dims, swiglu_limit,
        initialisation, sharding). Claims GPT-OSS's experts only; ``expertact_grouped_experts``
        and ``expertact_fused_grouped_experts`` convert them too (list one of the three).
        Keyword arguments as :func:`expertact_grouped_experts`."""
        return _gpt_oss_config(cfg, _modes(recompute, inplace_backward, compute_dtype, fp8))

else:  # pragma: no cover - a TorchTitan without GPT-OSS
    ExpertactGptOssGroupedExperts = expertact_gpt_oss_grouped_experts = None


def _is_gpt_oss(cfg) -> bool:
    return GptOssGroupedExperts is not None and isinstance(cfg, GptOssGroupedExperts.Config)


# ---------------------------------------------------------------------------
# enable / disable on a built model
# ---------------------------------------------------------------------------


def _swaps():
    """{TorchTitan's class: expertact's}, for the classes expertact computes."""
    pairs = {GroupedExperts: ExpertactGroupedExperts}
    if FusedGroupedExperts is not None:
        pairs[FusedGroupedExperts] = ExpertactFusedGroupedExperts
    if GptOssGroupedExperts is not None:
        pairs[GptOssGroupedExperts] = ExpertactGptOssGroupedExperts
    return pairs


def enable(model: nn.Module, *, recompute: bool = False, inplace_backward: bool = False,
           compute_dtype=torch.bfloat16, fp8=None) -> List[str]:
    """Switches every TorchTitan ``GroupedExperts`` (``FusedGroupedExperts``,
    ``GptOssGroupedExperts``) module of a built ``model`` to expertact's forward: its class
    becomes :class:`ExpertactGroupedExperts` (:class:`ExpertactFusedGroupedExperts`,
    :class:`ExpertactGptOssGroupedExperts`); parameters, buffers and hooks are the same objects.
    Modules already switched take the new modes. ``fp8``: expert_mlp's FP8 recipe (a name of
    expertact.moe.FP8_RECIPES, True for the default, "blockwise"; None keeps
    the GEMMs in the compute dtype). Nothing changes when a module is refused
    (other subclasses: NotImplementedError). Returns the qualified names of the modules
    switched or updated."""
    dt, recipe = _dtype(compute_dtype), _fp8(fp8)
    swaps = _swaps()
    ours = set(swaps.values())
    found = []
    for fqn, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            if type(m) not in swaps and type(m) not in ours:
                _refuse(type(m))
            found.append((fqn, m))
    for fqn, m in found:
        m.__class__ = swaps.get(type(m), type(m))
        m._set_modes(recompute, inplace_backward, dt, recipe)
    return [fqn for fqn, _ in found]


def disable(model: nn.Module) -> List[str]:
    """Switches every expertact experts module of ``model`` back to TorchTitan's class
    (``GroupedExperts``, ``FusedGroupedExperts`` or ``GptOssGroupedExperts``: its class and forward exactly; the
    memory-mode attributes removed). Returns the qualified names of the modules switched back."""
    back = {v: k for k, v in _swaps().items()}
    done = []
    for fqn, m in model.named_modules():
        if type(m) in back:
            m.__class__ = back[type(m)]
            for a in _MODE_ATTRS:
                m.__dict__.pop(a, None)
            done.append(fqn)
    return done
