"""expertact.moe: the grouped expert MLP around the fused activation (docs/spec.md section 7),
y = act(x @ w13[e]) @ w2[e] per expert over rows sorted by expert, as one autograd node
whose memory modes decide what stays alive between forward and backward (bf16, float32 and
float16: _bf16; FP8: _fp8; their grouped GEMMs: _gemm); the FP8 recipes by name (FP8_RECIPES,
fp8_recipe: the one resolver of every ``fp8=`` argument); and GroupedExperts, an nn.Module
holding DeepSpeed's / TorchTitan's expert weights around it.

    from expertact.moe import expert_mlp, GroupedExperts
    y = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=probs,
                   recompute=True, inplace_backward=True)
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Tuple, Union

import torch
from torch import nn

from .. import _capi
from .._args import LAYOUTS, preset_coeffs
from .._capi import DTypeError
from . import _fp8
from ._bf16 import ExpertMLP, mlp_forward
from ._fp8 import Fp8ExpertMLP
from ._gemm import Plan, use_grouped_mm

__all__ = ["expert_mlp", "offsets_from_counts", "GroupedExperts", "PACKED_LAYOUTS", "FP8_RECIPES",
           "DEFAULT_FP8_RECIPE", "fp8_recipe"]

Tensor = torch.Tensor

#: The layouts of gate and up along w13's last dim (and so along gate_up's).
PACKED_LAYOUTS = ("halves", "up_first", "interleaved")

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _err(msg: str) -> str:
    return f"expertact.moe: {msg}"


# ---------------------------------------------------------------------------
# The FP8 recipes
# ---------------------------------------------------------------------------

#: The FP8 recipes, by the name ``fp8=`` takes, each with its measured cost in training loss
#: against bf16 (docs/spec.md section 10): a recipe that changes the training outcome is
#: offered by name only, its cost stated beside it. What each recipe does is _gemm.FP8_FORMS.
FP8_RECIPES = {
    "rowwise": "+0.076 loss over the last 50 steps of the 300-step AutoEP training on one H200 (1.1474 against "
               "DeepSpeed's bf16 default's 1.0718): fast accumulation in the weight-gradient GEMMs; torchao's "
               "rowwise FP8 trains the same",
    "rowwise-bf16-wgrad": "over the last 100 steps at three seeds -0.0138, +0.0169, -0.0034 against bf16 bands of "
                          "0.0094, 0.0077, 0.0056: outside at every seed; 1.04x the bf16 MLP's step",
    "rowwise-promoted-wgrad": "over the last 100 steps at three seeds -0.0099, -0.0075, -0.0007 against bf16 bands "
                              "of 0.0094, 0.0077, 0.0056: below at one seed; 1.06-1.07x the bf16 MLP's step; "
                              "+0.040 in Megatron-Core's GPT-OSS form",
    "blockwise": "over the last 100 steps at three seeds +0.0001, +0.0049, +0.0017 against bf16 bands of 0.0094, "
                 "0.0077, 0.0056: inside at every seed; 1.075x, 1.065x, 1.071x the bf16 MLP's step at those seeds "
                 "on one H100; over 1,000 steps inside the band at seed 2 (last 100 +0.0005, band 0.013), while at "
                 "seed 1234 it left a loss plateau before every bf16 run: up to 0.139 under in steps 500-749, "
                 "outside the band; GPT-OSS fine-tuning through transformers inside the band, at 0.62x bf16's step "
                 "(small experts, D = F = 1,024)",
}

#: The recipe ``fp8=True`` selects: one whose training loss stays inside the bf16 band at every
#: seed and whose step is at least 1.05x the bf16 MLP's at every seed (docs/spec.md section 10).
#: "blockwise" is the one recipe that meets both (docs/BENCHMARKS.md section 8): inside the band
#: at the three seeds of the 300-step AutoEP training on one H200, its step 1.065-1.075x the bf16
#: MLP in place's at the same seeds on one H100; "rowwise-promoted-wgrad", as fast, ended below
#: the band at one seed. None would make True raise, naming the recipes with their cost.
DEFAULT_FP8_RECIPE: Optional[str] = "blockwise"


def fp8_recipe(fp8, where: str = "expertact.moe") -> Optional[str]:
    """The FP8 recipe an ``fp8=`` argument selects, for expert_mlp and every integration that
    offers FP8: None or False -> None (the GEMMs in the model's dtype); a name of
    :data:`FP8_RECIPES` -> that name; True -> :data:`DEFAULT_FP8_RECIPE`. Anything else raises
    ValueError naming the recipes and their measured loss cost; ``where`` prefixes the message."""
    if fp8 is None or fp8 is False:
        return None
    if isinstance(fp8, str) and fp8 in FP8_RECIPES:
        return fp8
    named = "; ".join(f"{name!r} ({cost})" for name, cost in FP8_RECIPES.items())
    if fp8 is True:
        if DEFAULT_FP8_RECIPE is not None:
            return DEFAULT_FP8_RECIPE
        raise ValueError(f"{where}: fp8=True asks for the default FP8 recipe, and none is chosen: the default "
                         "is a recipe whose training loss stays inside the bf16 band at every seed on the GPU, its "
                         "step at least 1.05x bf16's (docs/spec.md section 10). FP8 is offered by name: "
                         f"{named}")
    default = f"; True selects the default, {DEFAULT_FP8_RECIPE!r}" if DEFAULT_FP8_RECIPE is not None else ""
    raise ValueError(f"{where}: fp8={fp8!r} is not an FP8 recipe: the recipes are {named}{default}; None or False "
                     "keeps the GEMMs in the model's dtype")


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def _glu_args(activation, alpha, limit, layout) -> Tuple[int, int, float, float, float]:
    """(layout code, act, alpha, limit, beta) for the glu operators, from a preset name."""
    act, a, lim, beta = preset_coeffs(activation, alpha, limit, "expertact.moe")
    code = LAYOUTS.get(layout) if isinstance(layout, str) else None
    if code is None or code == _capi.LAYOUT_SEPARATE:
        raise ValueError(_err(f"layout={layout!r} is not one of {PACKED_LAYOUTS} (w13 holds gate and up "
                              "packed along its last dim)"))
    return code, act, a, lim, beta


def _tensor(name, t, optional=False):
    if isinstance(t, Tensor) or (optional and t is None):
        return t
    raise TypeError(_err(f"{name} must be a torch.Tensor{' or None' if optional else ''} "
                         f"(got {type(t).__name__})"))


def _shape(t) -> tuple:
    return tuple(t.shape)


def _check(x, w13, w2, offsets, weights):
    """Checks every argument against x; returns (T, D, F, the offsets as host ints)."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("offsets", offsets)):
        _tensor(name, t)
    _tensor("weights", weights, optional=True)
    if x.dim() != 2:
        raise ValueError(_err(f"x must be 2-D [T, D]; got shape {_shape(x)}"))
    if w13.dim() != 3:
        raise ValueError(_err(f"w13 must be 3-D [E, D, 2F]; got shape {_shape(w13)}"))
    if w2.dim() != 3:
        raise ValueError(_err(f"w2 must be 3-D [E, F, D]; got shape {_shape(w2)}"))
    T, D = x.shape
    E, wd, f2 = w13.shape
    ok_dtypes = _FLOAT_DTYPES + ((torch.float64,) if x.device.type == "cpu" else ())
    if x.dtype not in ok_dtypes:
        raise DTypeError(_err(f"x has dtype {x.dtype}; expected one of {', '.join(map(str, ok_dtypes))}"))
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype:
            raise DTypeError(_err(f"{name} has dtype {t.dtype} but x has {x.dtype}: cast the weights "
                                 f"({name}.to(x.dtype))"))
        if t.device != x.device:
            raise ValueError(_err(f"{name} is on {t.device} but x is on {x.device}"))
    if D == 0:
        raise ValueError(_err(f"x has D = 0 columns (shape {_shape(x)})"))
    if wd != D:
        raise ValueError(_err(f"w13 has shape {_shape(w13)}: its D = {wd} does not match x's D = {D} "
                              f"(x shape {_shape(x)})"))
    if f2 == 0 or f2 % 2:
        raise ValueError(_err(f"w13's last dim holds gate and up packed, 2F: it must be even and > 0, "
                              f"got {f2} (shape {_shape(w13)})"))
    F = f2 // 2
    if _shape(w2) != (E, F, D):
        raise ValueError(_err(f"w2 has shape {_shape(w2)}; expected [E, F, D] = {(E, F, D)} from w13 "
                              f"{_shape(w13)} and x {_shape(x)}"))
    if weights is not None:
        if weights.dtype != torch.float32:
            raise DTypeError(_err(f"weights has dtype {weights.dtype}; routing weights are float32"))
        if _shape(weights) != (T,):
            raise ValueError(_err(f"weights has shape {_shape(weights)}; expected [T] = {(T,)}"))
        if weights.device != x.device:
            raise ValueError(_err(f"weights is on {weights.device} but x is on {x.device}"))
    if offsets.dtype != torch.int32:
        raise DTypeError(_err(f"offsets has dtype {offsets.dtype}; it must be int32, as torch._grouped_mm "
                             "takes it (offsets.to(torch.int32))"))
    if _shape(offsets) != (E,):
        raise ValueError(_err(f"offsets has shape {_shape(offsets)}; expected [E] = {(E,)} (one cumulative "
                              "end row per expert)"))
    if offsets.device != x.device and offsets.device.type != "cpu":
        raise ValueError(_err(f"offsets is on {offsets.device} but x is on {x.device} (the CPU is also "
                              "accepted)"))
    # One device-to-host copy of E int32 values when offsets is on the GPU: the checks and
    # the padding rows need the values (a device-side assert would leave a sticky CUDA error).
    ends = offsets.tolist()
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            what = f"offsets[{e}] = {end} is negative" if e == 0 else \
                f"offsets[{e}] = {end} < offsets[{e - 1}] = {prev}"
            raise ValueError(_err(f"offsets must be non-decreasing cumulative end rows; {what} "
                                  f"(offsets = {_short(ends)})"))
        prev = end
    if ends and ends[-1] > T:
        raise ValueError(_err(f"offsets[-1] = {ends[-1]} is past T = {T}, the rows of x "
                              f"(offsets = {_short(ends)})"))
    return T, D, F, ends


def _check_biases(x, w13, b13, b2):
    E, D, f2 = w13.shape
    for name, b, shape in (("b13", b13, (E, f2)), ("b2", b2, (E, D))):
        _tensor(name, b, optional=True)
        if b is None:
            continue
        if _shape(b) != shape:
            raise ValueError(_err(f"{name} has shape {_shape(b)}; expected {list(shape)} from w13 "
                                  f"{_shape(w13)}"))
        if b.dtype != x.dtype:
            raise DTypeError(_err(f"{name} has dtype {b.dtype} but x has {x.dtype}: cast it "
                                  f"({name}.to(x.dtype))"))
        if b.device != x.device:
            raise ValueError(_err(f"{name} is on {b.device} but x is on {x.device}"))


def _short(values, n=8):
    return str(values) if len(values) <= n else f"[{', '.join(map(str, values[:n]))}, ...] ({len(values)} values)"


def offsets_from_counts(num_tokens_per_expert: Tensor, where: str = "expertact.moe") -> Tensor:
    """expert_mlp's ``offsets`` (int32 cumulative end rows) from the rows per expert, a 1-D
    integer tensor (TorchTitan's ``num_tokens_per_expert``); ``where`` names the caller in the
    error for anything else."""
    counts = num_tokens_per_expert
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"{where}: num_tokens_per_expert must be a torch.Tensor (got {type(counts).__name__})")
    if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex:
        raise ValueError(f"{where}: num_tokens_per_expert must be a 1-D integer tensor; got shape "
                         f"{tuple(counts.shape)}, dtype {counts.dtype}")
    return torch.cumsum(counts, 0, dtype=torch.int32)


def expert_mlp(x: Tensor, w13: Tensor, w2: Tensor, offsets: Tensor, activation: str = "swiglu", *,
               alpha: Optional[float] = None, limit: Optional[float] = None, layout: str = "halves",
               weights: Optional[Tensor] = None, recompute: bool = False,
               inplace_backward: bool = False, fused: bool = False, b13: Optional[Tensor] = None,
               b2: Optional[Tensor] = None, fp8: Union[str, bool, None] = None,
               remake_weights: Optional[Callable[[], Tuple[Tensor, Tensor]]] = None) -> Tensor:
    """The grouped expert MLP over rows sorted by expert (docs/spec.md section 7)::

        gate_up = x[rows of e] @ w13[e]        (grouped GEMM)
        h       = act(gate_up) * weights       (expertact's fused activation, any packed layout)
        y       = h[rows of e] @ w2[e]         (grouped GEMM)

    Args:
        x: [T, D] float32, float16 or bfloat16 (float64 on the CPU, for gradcheck).
        w13: [E, D, 2F], gate and up along the last dim in ``layout``; x's dtype and device.
            Any strides (a ``.transpose(-2, -1)`` view of DeepSpeed's [E, 2F, D] is read as is).
        w2: [E, F, D].
        offsets: int32 [E], the cumulative end row of each expert (``torch._grouped_mm``'s
            ``offs``); on x's device or on the CPU. Rows past ``offsets[-1]`` are padding: y
            and x's gradient are 0 there.
        activation: ``"swiglu"``, ``"swiglu_clamped"``, ``"swiglu_oai"`` or ``"geglu_tanh"``.
        alpha, limit: for the forms that read them (default 1.702 and 7.0); others refuse them.
        layout: ``"halves"`` (gate first), ``"up_first"`` or ``"interleaved"`` (GPT-OSS).
        weights: optional float32 [T] routing weights multiplying h; differentiable.
        b13: optional [E, 2F] expert biases of gate_up, in w13's column layout (GPT-OSS's
            ``gate_up_proj_bias``): gate_up = x @ w13[e] + b13[e], the clamp after the bias.
        b2: optional [E, D] expert biases of the output (GPT-OSS's ``down_proj_bias``):
            y = (h @ w2[e] + b2[e]) * weights. Both take x's dtype and device; differentiable.
        recompute: keep x, the weights and gate_up only; h is recomputed in backward (one
            fused forward kernel) for w2's gradient: one [T, F] tensor less kept.
        inplace_backward: write gate_up's gradient over gate_up (the activation's in-place
            backward): two [T, F] tensors less at the backward's peak. The graph can then be
            run backward once only.
        fused: deprecated, ignored: the experimental fused grouped GEMMs were removed (they
            were slower than this path; docs/fused-gemm.md). ``fused=True`` warns and
            runs this path; the argument goes in the next release.
        fp8: the FP8 recipe of the grouped GEMMs, resolved by :func:`fp8_recipe`: None or
            False for the GEMMs in x's dtype; True for the default recipe,
            :data:`DEFAULT_FP8_RECIPE` (``"blockwise"``); or a name of
            :data:`FP8_RECIPES` (each with its measured training-loss cost there), float8
            e4m3fn operands with float32 power-of-two scales:

            - ``"rowwise"``: torchao's rowwise recipe (one scale per row for the token-major
              operands, per expert and column for the weights and the weight-gradient
              operands), the six GEMMs ``torch._scaled_grouped_mm`` with fast accumulation on
              Hopper;
            - ``"rowwise-bf16-wgrad"``: the same for the forward and input-gradient GEMMs, the
              two weight gradients (K = an expert's rows) bf16 GEMMs on the bf16 tensors;
            - ``"rowwise-promoted-wgrad"``: as ``"rowwise"``, the two weight-gradient GEMMs
              with ``use_fast_accum=False`` (the accumulation promoted to float32);
            - ``"blockwise"``: DeepSeek-V3's recipe (1 x 128 tiles along K for x, h, dy and
              dgate_up, 128 x 128 blocks for the weights, 128 x 1 tiles along the tokens for
              the weight gradients' operands), the GEMMs ``torch._scaled_mm`` per expert with
              the same scales and the accumulation promoted to float32 every 128 of K, on
              Hopper where this torch gives exact values with those scales (probed once per
              device; elsewhere NotImplementedError says why).

            The activation kernel writes h in e4m3 from its float32 values. bf16, D and F
            multiples of 16. On the CPU the same node runs with the GEMMs emulated (the
            operands made by the same kernels, dequantised exactly and multiplied in float32,
            so ``"rowwise"`` and ``"rowwise-promoted-wgrad"`` give the same values there): an
            emulation for tests and studies of the recipe, not a speed path. The node keeps
            what ``recompute=True`` keeps (h is recomputed in backward) and runs backward once.
            Other GPUs and dtypes raise NotImplementedError naming what is missing.
        remake_weights: for weights made on each call from separate parameters (expertact.megatron
            stacks its experts' weights per call): a callable returning (w13, w2) as given here,
            called in backward instead of keeping them from forward, so that the made copies
            are not held between forward and backward. The parameters they are made from must
            not change between forward and backward (as in any training step).

    Returns:
        y [T, D], differentiable in x, w13, w2, weights, b13 and b2.

    The offsets are read on the host once per call (one device-to-host copy of E values
    when they are on the GPU), to check them and to zero the padding rows.
    """
    if fused:
        _fused_removed()
    recipe = fp8_recipe(fp8)
    glu = _glu_args(activation, alpha, limit, layout)
    T, D, F, ends = _check(x, w13, w2, offsets, weights)
    _check_biases(x, w13, b13, b2)
    grouped = use_grouped_mm(x, D, F)
    offs = offsets
    biased = b13 is not None or b2 is not None
    # torch._grouped_mm, the bias kernels and the FP8 kernels read the offsets on x's device
    if offs.device != x.device and (grouped or biased or recipe is not None):
        offs = offs.to(x.device)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w13, w2, weights, b13, b2))
    if recipe is not None:
        reason = _fp8.why_not(x, D, F, recipe)
        if reason is not None:
            raise NotImplementedError(_err(f"fp8={recipe!r} cannot run here: {reason}"))
        plan = Plan(ends, grouped, glu, True, bool(inplace_backward), layout, biased, remake_weights, recipe)
        if needs_grad:
            return Fp8ExpertMLP.apply(x, w13, w2, weights, offs.contiguous(), plan, b13, b2)
        return _fp8.forward(x, w13, w2, weights, offs.contiguous(), plan, b13, b2)[2]
    plan = Plan(ends, grouped, glu, bool(recompute), bool(inplace_backward), layout, biased, remake_weights)
    if needs_grad:
        return ExpertMLP.apply(x, w13, w2, weights, offs, plan, b13, b2)
    return mlp_forward(x, w13, w2, weights, offs, plan, b13, b2)[3]


def _fused_removed():
    warnings.warn("expertact.moe: fused=True is deprecated and ignored: the experimental fused grouped GEMMs "
                  "were removed (slower than the unfused path); the argument goes in the next release",
                  FutureWarning, stacklevel=3)


# ---------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------


def _pack(gate, up, layout, dim):
    """gate and up [.., F, ..] -> one [.., 2F, ..] tensor along dim, in layout."""
    if layout == "interleaved":
        return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)
    first, second = (up, gate) if layout in ("up_first", "halves_up_first") else (gate, up)
    return torch.cat((first, second), dim=dim)


def _unpack(packed, layout, dim):
    """The inverse of _pack: (gate, up) views."""
    if layout == "interleaved":
        idx = [slice(None)] * packed.dim()
        idx[dim] = slice(0, None, 2)
        gate = packed[tuple(idx)]
        idx[dim] = slice(1, None, 2)
        return gate, packed[tuple(idx)]
    first, second = packed.chunk(2, dim=dim)
    return (second, first) if layout in ("up_first", "halves_up_first") else (first, second)


class GroupedExperts(nn.Module):
    """E expert MLPs over rows sorted by expert, computed by :func:`expert_mlp`.

    The weights are held as DeepSpeed's and TorchTitan's ``GroupedExperts`` hold them
    (nn.Linear's [out, in] per expert):

    - ``fused_w13=False`` (default): ``w1`` [E, F, D] (gate), ``w2`` [E, D, F] (down),
      ``w3`` [E, F, D] (up). The state dict is DeepSpeed's, key for key. Each forward packs
      w1 and w3 into one [E, 2F, D] tensor (a copy of the weights, as DeepSpeed's
      ``gate_up_impl="fused"`` does).
    - ``fused_w13=True``: ``w13`` [E, 2F, D], gate and up along dim 1 in ``layout``, and
      ``w2`` [E, D, F]: no per-call copy.

    ``fp8``: the FP8 recipe of expert_mlp's GEMMs (a name of :data:`FP8_RECIPES`; True: the
    default, :data:`DEFAULT_FP8_RECIPE` (``"blockwise"``); None or False: the
    model's dtype; resolved by :func:`fp8_recipe` at construction), for bf16 activations.

    ``bias=True`` adds expert biases (GPT-OSS's): ``b13`` [E, 2F], gate and up biases in
    ``layout`` (the column order of w13's gate/up axis), and ``b2`` [E, D], zero at
    initialisation; each expert computes ``(act(x W13^T + b13) W2^T + b2) * weights``
    (expert_mlp's ``b13`` / ``b2``; the clamps of the clamped forms apply after the bias).

    ``load_state_dict`` also takes the other form's state dict, a DeepSpeed ``GroupedExperts``
    one (``w1``, ``w2``, ``w3``) and a GPT-OSS (HF transformers) experts one: ``gate_up_proj``
    [E, D, 2F] with gate and up interleaved, ``down_proj`` [E, F, D], ``gate_up_proj_bias``
    [E, 2F] interleaved and ``down_proj_bias`` [E, D]. With ``bias=True`` the biases load into
    ``b13`` (reordered to ``layout``) and ``b2``; with ``bias=False`` all-zero biases are
    accepted and dropped, and any other value raises ValueError (construct the module with
    ``bias=True``).

    forward(x [T, D], num_tokens_per_expert [E], weights=None [T]) -> [T, D]; rows past
    sum(num_tokens_per_expert) are padding and give 0. The weights (and biases) are cast to
    x's dtype (as DeepSpeed does), so float32 master weights work with bf16 activations.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, activation: str = "swiglu",
                 alpha: Optional[float] = None, limit: Optional[float] = None, layout: str = "halves",
                 fused_w13: bool = False, recompute: bool = False, inplace_backward: bool = False,
                 fused: bool = False, init_std: float = 0.02, bias: bool = False, fp8: Union[str, bool, None] = None,
                 device=None, dtype=None):
        super().__init__()
        _glu_args(activation, alpha, limit, layout)  # an unknown form or layout fails here, not at forward
        self.fp8 = fp8_recipe(fp8, "expertact.moe.GroupedExperts")
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.activation, self.alpha, self.limit, self.layout = activation, alpha, limit, layout
        self.fused_w13 = bool(fused_w13)
        self.recompute, self.inplace_backward = bool(recompute), bool(inplace_backward)
        if fused:
            _fused_removed()
        self.init_std = init_std
        # has_bias, not bias: initialisation code often reads a module's .bias as a tensor or None
        self.has_bias = bool(bias)
        kw = dict(device=device, dtype=dtype)
        if self.fused_w13:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim, **kw))
        else:
            self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
            self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        if self.has_bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, **kw))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim, **kw))
        self.reset_parameters()

    def reset_parameters(self):
        """The weights drawn from N(0, init_std^2), the biases zero."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name in ("b13", "b2"):
                    p.zero_()
                else:
                    p.normal_(0.0, self.init_std)

    def _w13(self):
        """[E, 2F, D] in self.layout."""
        return self.w13 if self.fused_w13 else _pack(self.w1, self.w3, self.layout, dim=1)

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        offsets = offsets_from_counts(num_tokens_per_expert)
        dt = x.dtype
        w13 = self._w13().to(dt).transpose(-2, -1)
        w2 = self.w2.to(dt).transpose(-2, -1)
        b13, b2 = (self.b13.to(dt), self.b2.to(dt)) if self.has_bias else (None, None)
        return expert_mlp(x, w13, w2, offsets, self.activation, alpha=self.alpha, limit=self.limit,
                          layout=self.layout, weights=weights, recompute=self.recompute,
                          inplace_backward=self.inplace_backward, b13=b13, b2=b2, fp8=self.fp8)

    def extra_repr(self) -> str:
        s = (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
             f"activation={self.activation!r}, layout={self.layout!r}, fused_w13={self.fused_w13}")
        for name in ("alpha", "limit"):
            if getattr(self, name) is not None:
                s += f", {name}={getattr(self, name)}"
        if self.recompute:
            s += ", recompute=True"
        if self.inplace_backward:
            s += ", inplace_backward=True"
        if self.has_bias:
            s += ", bias=True"
        if self.fp8 is not None:
            s += f", fp8={self.fp8!r}"
        return s

    # State dicts of the other forms -----------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._convert_state(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _convert_state(self, sd, prefix):
        """Rewrites, in the (copied) state dict load_state_dict passes down, a DeepSpeed,
        fused or GPT-OSS form of this module's weights (and biases) into this module's own form."""
        k = {name: prefix + name for name in (
            "w1", "w2", "w3", "w13", "b13", "b2", "gate_up_proj", "down_proj", "gate_up_proj_bias",
            "down_proj_bias")}
        gate = up = None
        if k["gate_up_proj"] in sd:  # GPT-OSS: [E, D, 2F] interleaved, down [E, F, D], biases
            for b in ("gate_up_proj_bias", "down_proj_bias"):
                if k[b] in sd and not self.has_bias:
                    if torch.count_nonzero(sd[k[b]]).item():
                        raise ValueError(_err(
                            f"{k[b]} has non-zero values but this GroupedExperts has no biases: construct it "
                            "with bias=True to load GPT-OSS's expert biases (all-zero biases load into a "
                            "module without biases and are dropped)"))
                    del sd[k[b]]
            if k["gate_up_proj_bias"] in sd:  # interleaved, as gate_up_proj's columns
                bgate, bup = _unpack(sd.pop(k["gate_up_proj_bias"]), "interleaved", dim=1)
                sd[k["b13"]] = _pack(bgate, bup, self.layout, dim=1).contiguous()
            if k["down_proj_bias"] in sd:
                sd[k["b2"]] = sd.pop(k["down_proj_bias"])
            gate, up = _unpack(sd.pop(k["gate_up_proj"]).transpose(-2, -1), "interleaved", dim=1)
            if k["down_proj"] in sd:
                sd[k["w2"]] = sd.pop(k["down_proj"]).transpose(-2, -1)
        elif self.fused_w13 and k["w1"] in sd and k["w3"] in sd:  # DeepSpeed's form into a fused module
            gate, up = sd.pop(k["w1"]), sd.pop(k["w3"])
        elif not self.fused_w13 and k["w13"] in sd:  # a fused state dict (in this module's layout)
            gate, up = _unpack(sd.pop(k["w13"]), self.layout, dim=1)
        if gate is None:
            return
        if self.fused_w13:
            sd[k["w13"]] = _pack(gate, up, self.layout, dim=1).contiguous()
        else:
            sd[k["w1"]], sd[k["w3"]] = gate.contiguous(), up.contiguous()
        if k["w2"] in sd:
            sd[k["w2"]] = sd[k["w2"]].contiguous()
