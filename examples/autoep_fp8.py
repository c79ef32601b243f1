"""The FP8 diagnosis's parts of examples/autoep_train.py, kept beside it: the FP8 recipes' runs
(FP8_IMPLS), torchao's FP8 rowwise MoE training on AutoEP's experts (TORCHAO_IMPLS), and the
capture of the first MoE layer's expert inputs at one step (--capture-step), the tensors that
``python -m expertact.bench --fp8-accuracy --tensors FILE`` measures each FP8 GEMM on.

torchao's conversion (torchao 0.18, torchao.prototype.moe_training): ``quantize_(model,
Float8TrainingOpConfig(), filter_fn)`` swaps each expert weight for a Parameter whose data is a
Float8TrainingWeightWrapperTensor; a ``torch._grouped_mm(A, B, offs=...)`` whose B is such a
tensor then runs torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (its Triton kernels quantise
A and B rowwise with power-of-two scales, torch._scaled_grouped_mm with fast accumulation, and
its own backward). DeepSpeed 0.19.8's GroupedExperts with gate_up_impl "separate" and
use_grouped_mm (AutoEP's defaults; torch._grouped_mm on Hopper) calls
``torch._grouped_mm(x, w.to(x.dtype).transpose(-2, -1), offs=...)`` on w1, w3 and w2: ``to`` of
the same dtype and ``transpose`` keep torchao's tensor, so all three GEMMs of each expert MLP
run in torchao's FP8. Its "fused" gate_up_impl concatenates w1 and w3 first (a plain tensor: that
GEMM would stay bf16) and its for-loop path multiplies per expert (torchao's dense FP8 GEMM):
both are refused. The conversion is applied inside deepspeed.initialize, after AutoEP has built
the experts and DeepSpeed has cast the model to bf16 (a cast makes new Parameters), before
DeepSpeed builds its optimizer, so that ZeRO holds torchao's parameters; DeepSpeed's marks on
each expert parameter (allreduce=False, its group's name, AutoEP's metadata) are copied onto the
new ones, and ZeRO's updates are made to reach the weights torchao reads (follow_zero). Step 0
counts torchao's grouped GEMMs: 3 per MoE layer, or the run stops.

Each expert's token group is padded to a multiple of 16 rows for torchao's GEMMs
(align_token_groups): torch._scaled_grouped_mm's weight-gradient form reads the FP8 operands with
the tokens contiguous, and ATen asserts on the device that a group's byte size along them is a
multiple of 16 (prepare_grouped_gemm_data: 1 byte a value, so 16 rows); AutoEP pads the groups to
multiples of 8 rows (bf16's 16 bytes): a group of an odd multiple of 8 rows stops the run at that
assert in its first backward.
torchao 0.18's own padding (Float8TrainingOpConfig's pad_token_groups_for_grouped_mm) is refused
by its FP8 rowwise GEMM ("not yet supported"); TorchTitan pads its FP8 experts' groups to 16 in
its token dispatcher. AutoEP takes the multiple from deepspeed.moe.ep_kernels'
TOKEN_GROUP_ALIGN_SIZE_M (TorchTitan's setting, ported; its note says 16 for FP8), read at each
MoE layer's forward: this run sets it to 16 around its own MoE layers' forwards only, so that the
other runs of the same process keep DeepSpeed's 8. The padding rows are zero rows, dropped after
the experts: the real rows' values are the same.
"""
from __future__ import annotations

import contextlib
import os

# The FP8 recipes' runs besides mlp-fp8 (fp8="rowwise"): --impl name -> expertact.deepspeed.enable()'s
# arguments (one entry per recipe of expertact.moe.FP8_RECIPES). A recipe or an argument this
# expertact lacks is refused before any run starts.
FP8_IMPLS = {
    "mlp-fp8-bf16-wgrad": dict(experts=True, fp8="rowwise-bf16-wgrad"),
    "mlp-fp8-promoted-wgrad": dict(experts=True, fp8="rowwise-promoted-wgrad"),
    "mlp-fp8-blockwise": dict(experts=True, fp8="blockwise"),
}
# torchao's FP8 rowwise MoE training on DeepSpeed's own experts (enable() not called).
TORCHAO_IMPLS = ("torchao-fp8", )
TORCHAO_VERSION = "0.18."  # the release whose conversion this wiring was written against
GEMMS_PER_LAYER = 3  # gate, up, down: torch._grouped_mm calls of gate_up_impl "separate"
TOKEN_GROUP_ROWS = 16  # torchao's FP8 grouped GEMMs: each expert's rows a multiple of this (16 bytes of e4m3)


def unavailable(enabled, impl, device, args):
    """Why this expertact, DeepSpeed setup or device cannot run `impl` (None when it can): an
    enable() argument or FP8 recipe this expertact lacks; for torchao's run, torchao 0.18 not
    importable, a setup whose GEMMs its conversion does not reach, or no Hopper GPU."""
    import inspect
    import expertact.deepspeed as xds
    if impl in TORCHAO_IMPLS:
        return torchao_unavailable(device, args)
    if not enabled:
        return None
    missing = sorted(set(enabled) - set(inspect.signature(xds.enable).parameters))
    if missing:
        return f"this expertact's expertact.deepspeed.enable() takes no {', '.join(missing)}"
    fp8 = enabled.get("fp8")
    if fp8 is not None:
        from expertact import moe
        if fp8 not in getattr(moe, "FP8_RECIPES", {}):
            return f"this expertact has no FP8 recipe {fp8!r} (it has {sorted(getattr(moe, 'FP8_RECIPES', {}))})"
    return None


def torchao_unavailable(device, args):
    try:
        import torchao
    except ImportError as e:
        return f"torchao is not importable ({e}); pip install 'torchao=={TORCHAO_VERSION}*'"
    if not torchao.__version__.startswith(TORCHAO_VERSION):
        return f"torchao {torchao.__version__}: this run is written for torchao {TORCHAO_VERSION}x"
    if args.expert_gemm != "grouped_mm" or args.gate_up_impl != "separate":
        return ("torchao's conversion reaches DeepSpeed's torch._grouped_mm calls on the expert weights: --expert-gemm "
                f"grouped_mm with --gate-up-impl separate (got {args.expert_gemm}, {args.gate_up_impl})")
    import torch
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return (f"torchao's FP8 grouped GEMMs (Triton quantisation, torch._scaled_grouped_mm) run on Hopper GPUs; "
                f"this run is on {device}")
    return None


def _experts_class():
    from deepspeed.moe.ep_experts import GroupedExperts
    return GroupedExperts


def convert_experts_torchao(model):
    """torchao's FP8 rowwise MoE training conversion of every GroupedExperts' weights, with
    DeepSpeed's attributes of each parameter kept; returns the converted parameters' names."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_
    cls = _experts_class()
    experts = [m for m in model.modules() if isinstance(m, cls)]
    marks = {(id(m), n): dict(p.__dict__) for m in experts for n, p in m.named_parameters(recurse=False)}
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, cls))
    for m in experts:
        for n, p in m.named_parameters(recurse=False):
            p.__dict__.update(marks[(id(m), n)])
    names = [n for n, p in model.named_parameters() if type(p.data).__name__ == "Float8TrainingWeightWrapperTensor"]
    if len(names) != 3 * len(experts) or not names:
        raise SystemExit(f"autoep_fp8.py: torchao converted {names}, expected w1, w2, w3 of {len(experts)} "
                         "GroupedExperts")
    return names


def align_token_groups(model, rows=TOKEN_GROUP_ROWS):
    """Pads each expert's token group to a multiple of ``rows`` (the module docstring says why)
    in the MoE layers of ``model`` (those holding a GroupedExperts as .experts): AutoEP's
    alignment, deepspeed.moe.ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M, made a multiple of ``rows``
    while each such layer's forward runs (AutoEP reads it there to permute the tokens; the
    backward replays the permutation it saved). Returns the number of layers."""
    import math
    from deepspeed.moe import ep_kernels
    if not isinstance(getattr(ep_kernels, "TOKEN_GROUP_ALIGN_SIZE_M", None), int):
        raise SystemExit("autoep_fp8.py: this DeepSpeed has no deepspeed.moe.ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M, "
                         "the padding of AutoEP's token groups that torchao's FP8 grouped GEMMs need")
    cls = _experts_class()
    layers = [m for m in model.modules() if isinstance(getattr(m, "experts", None), cls)]

    def aligned(forward):
        def run(*args, **kwargs):
            saved = ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M
            ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M = math.lcm(saved, rows)
            try:
                return forward(*args, **kwargs)
            finally:
                ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M = saved
        return run

    for layer in layers:
        layer.forward = aligned(layer.forward)
    return len(layers)


def follow_zero(optimizer):
    """ZeRO 1 and 2 point each parameter's .data at its slice of their flat buffer, at the start
    and after every step (_update_model_bit16_weights); a torchao weight reads its values from its
    own _data, which that assignment does not reach (the experts would stay at their initial
    values): point _data at the same slice, each time."""
    if not hasattr(optimizer, "_update_model_bit16_weights"):
        raise SystemExit(f"autoep_fp8.py: torchao's run takes ZeRO stage 1 or 2 (DeepSpeed's optimizer is "
                         f"{type(optimizer).__name__})")
    original = optimizer._update_model_bit16_weights

    def update(group):
        original(group)
        flat, rr = optimizer.bit16_groups_flat[group], optimizer.round_robin_bit16_groups[group]
        meta, offsets = optimizer.round_robin_bit16_meta[group], optimizer.round_robin_bit16_offsets[group]
        for i, p in enumerate(optimizer.bit16_groups[group]):
            j = optimizer.round_robin_bit16_indices[group][i]
            if hasattr(p.data, "_data") or hasattr(rr[j].data, "_data"):
                view = flat.narrow(0, offsets[j], meta[j].numel()).view(meta[j].shape)
                for t in {id(p): p, id(rr[j]): rr[j]}.values():
                    t._data = view

    optimizer._update_model_bit16_weights = update
    for group in range(len(optimizer.bit16_groups)):
        update(group)


@contextlib.contextmanager
def torchao_during_initialize(record):
    """Inside deepspeed.initialize: torchao's conversion right after DeepSpeed's
    _configure_distributed_model (AutoEP's experts built, the model cast and placed), before the
    optimizer is built, and the token groups' padding (align_token_groups). record["converted"]
    gets the converted parameters' names, record["token_group_rows"] the groups' multiple."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine._configure_distributed_model

    def configure(self, model, *a, **k):
        out = original(self, model, *a, **k)
        record["converted"] = convert_experts_torchao(model)
        if not align_token_groups(model):
            raise SystemExit("autoep_fp8.py: no MoE layer holds the GroupedExperts torchao converted")
        record["token_group_rows"] = TOKEN_GROUP_ROWS
        return out

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original


def count_torchao_gemms():
    """(counts, restore): torchao's grouped GEMMs that its converted weights dispatch to,
    counted (torchao.prototype.moe_training.tensor's _quantize_then_scaled_grouped_mm)."""
    from torchao.prototype.moe_training import tensor as tao_tensor
    original = tao_tensor._quantize_then_scaled_grouped_mm
    counts = {"grouped_mm": 0}

    def counting(*a, **k):
        counts["grouped_mm"] += 1
        return original(*a, **k)

    tao_tensor._quantize_then_scaled_grouped_mm = counting
    return counts, lambda: setattr(tao_tensor, "_quantize_then_scaled_grouped_mm", original)


def plain(t):
    """t detached, as a plain tensor: a weight torchao converted gives its data."""
    t = t.detach()
    return getattr(t, "_data", t)


def torchao_record(record):
    import torchao
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    return dict(version=torchao.__version__, config=repr(Float8TrainingOpConfig()), **record)


# ---------------------------------------------------------------------------
# the capture of the first MoE layer's expert inputs
# ---------------------------------------------------------------------------


class Capture:
    """At one step, what the first MoE layer's experts (DeepSpeed's GroupedExperts module, or
    expertact's forward on it) receive and give back, in expert_mlp's terms: x [T, D] (rows
    sorted by expert, as the experts see them: AutoEP pads each expert's rows with zero rows to a
    multiple of 8, and may leave rows past the last), offsets int32 [E] (cumulative end rows), w13
    [E, D, 2F] (w1 and w3 concatenated, gate first: layout "halves") and w2 [E, F, D] in x's
    dtype as the GEMMs read them, the experts' output y [T, D], and dy [T, D], its gradient, taken
    in backward. The routing weights: AutoEP's minimax_m3 preset applies the router's scores after
    the experts (score_apply "post"), so the experts see none (weights None; "pre" would have
    scaled x already)."""

    def __init__(self, experts):
        self.experts, self.data, self.handles = experts, {}, []
        self.handles.append(experts.register_forward_pre_hook(self._inputs))
        self.handles.append(experts.register_forward_hook(self._output))

    def _inputs(self, module, args):
        import torch
        x, counts = args[0], args[1]
        counts = torch.as_tensor(counts).to("cpu", torch.int64)
        dt = x.dtype

        def weight(p):
            return plain(p).to(dt)

        w13 = torch.cat((weight(module.w1), weight(module.w3)), dim=1).transpose(-2, -1).contiguous()
        self.data.update(x=x.detach().clone(), offsets=torch.cumsum(counts, 0).to(torch.int32), w13=w13,
                         w2=weight(module.w2).transpose(-2, -1).contiguous())

    def _output(self, module, args, out):
        self.data["y"] = out.detach().clone()
        if out.requires_grad:
            out.register_hook(lambda g: self.data.__setitem__("dy", g.detach().clone()))

    def save(self, path, **meta):
        """Writes the tensors (and `meta`) to path; returns its size in bytes."""
        import torch
        for h in self.handles:
            h.remove()
        e = self.experts
        missing = [k for k in ("x", "offsets", "w13", "w2", "y", "dy") if k not in self.data]
        if missing:
            raise SystemExit(f"autoep_fp8.py: the capture missed {missing} (was step {meta.get('step')} run?)")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(dict(self.data, weights=None, layout="halves",
                        activation=dict(name=e.activation, alpha=float(e.activation_alpha),
                                        limit=float(e.activation_limit)), **meta), path)
        return os.path.getsize(path)
