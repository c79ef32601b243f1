"""expertact.torchtitan against TorchTitan's own GroupedExperts, FusedGroupedExperts and
GptOssGroupedExperts (TorchTitan 0.3.0) on the same weights and inputs: forward output and every
gradient (x, w1_EFD, w2_EDF, w3_EFD; GPT-OSS: mlp1_weight_EGD, mlp1_bias_EG, mlp2_weight_EDF,
mlp2_bias_ED, with non-zero biases) in each memory mode, with token counts that include empty
experts and padding rows past the last group; GPT-OSS under 2-way tensor parallelism (two gloo
processes on the CPU); the overrides through TorchTitan's own override machinery (apply_overrides
on Qwen3-MoE and GPT-OSS debug configs); whole MoE layers (router, dispatcher, experts, combine)
with the override on and off; state dict keys; enable()/disable(); the refusal of other subclasses.
CPU; skipped where TorchTitan is not importable. TorchTitan's model code needs only a few of its
declared dependencies (not wandb, tensorboard, datasets, torchdata); without changing torch:
    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 \
        typeguard==4.6.1
    python -c "import triton" || pip install --no-deps triton==3.9.0   # imported by its token dispatcher
"""
import os
import pytest
import torch
import torch.distributed.fsdp as _fsdp

# TorchTitan 0.3.0 imports FSDP's DataParallelMeshDims (torch >= 2.12) at import time, in
# modules these tests load but never call into (FSDP wrapping). On an older torch (the GPU
# machine's 2.11) a placeholder of that name lets the model code import; calling it fails.
if not hasattr(_fsdp, "DataParallelMeshDims"):
    class DataParallelMeshDims:  # noqa: D101 - a placeholder, see above
        def __init__(self, *args, **kwargs):
            raise RuntimeError("placeholder for torch >= 2.12's FSDP DataParallelMeshDims")
    _fsdp.DataParallelMeshDims = DataParallelMeshDims

pytest.importorskip("torchtitan.models.common.moe")
pytest.importorskip("torchtitan.config.override")

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

import expertact.torchtitan as et  # noqa: E402
from expertact import moe as ea_moe  # noqa: E402

# TorchTitan's GroupedExperts casts x and the weights to bf16 whatever their dtype. The float32
# comparisons make that cast an identity on both sides (the no_bf16_cast fixture; expertact with
# compute_dtype=None), so that the two compute the same function in float32 and the comparison
# checks the mapping (which weight is gate, up and down, transposes, offsets) at float32
# precision. Largest absolute error of each tensor relative to its largest magnitude: what
# legitimately differs is the order of the sums (torch's grouped-GEMM fallback against
# expert_mlp's per-expert GEMMs) and silu's formula, a few float32 roundings of the unit
# roundoff 6e-8: measured 5.4e-7 or less here, 1.8e-7 or less for GPT-OSS's biased experts (CPU,
# torch 2.13, TorchTitan 0.3.0). A swapped gate and up misses y by 0.6 of its largest magnitude
# (test_a_wrong_mapping_fails); GPT-OSS's mlp1 bias with gate and up swapped by 0.36, its mlp2 bias
# left out by 0.07 (test_gpt_oss_a_wrong_bias_fails). NaN or Inf never passes.
RTOL_F32 = 1e-5
# In bf16, as TorchTitan computes: TorchTitan rounds silu(gate) to bf16 before the product,
# expertact rounds the gated activation once; each side rounds gate, up, h and y to bf16 (unit
# roundoff 3.9e-3), and the gradients' GEMMs once more each. Measured (relative to
# the tensor's largest magnitude, CPU, torch 2.13, TorchTitan 0.3.0): 8.1e-3 or less, 8.3e-3 for
# GPT-OSS (whose biases TorchTitan adds in bf16 after rounding the GEMMs' results); the bound
# allows a few bf16 roundings more.
RTOL_BF16 = 2e-2

MODES = [dict(), dict(recompute=True), dict(inplace_backward=True), dict(recompute=True, inplace_backward=True)]
MODE_IDS = ["default", "recompute", "inplace_backward", "both"]

E, D, F = 6, 32, 16
# Token counts with empty experts (first, middle and last), and padding rows past the last group.
COUNTS = [(0, 5, 0, 9, 3, 0), (7, 1, 4, 0, 2, 11)]
PADDING = [0, 5]


@pytest.fixture
def no_bf16_cast(monkeypatch):
    """Tensor.bfloat16() returns the tensor itself: TorchTitan's GroupedExperts then computes in
    float32, the function it computes in bf16 otherwise."""
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self)


def _close(got, want, rtol, what):
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: expertact gave NaN/Inf"
    assert torch.isfinite(want).all(), f"{what}: TorchTitan gave NaN/Inf"
    got, want = got.double(), want.double()
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert scale > 0, what
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g} > {rtol} * {scale:.3g}"


def _fused_available():
    if getattr(et, "ExpertactFusedGroupedExperts", None) is None:
        pytest.skip("torchtitan.overrides.fused_swiglu is not importable (it needs triton)")


def _pair(dtype=torch.float32, seed=0, fused=False, **modes):
    """TorchTitan's GroupedExperts and expertact's (fused: over TorchTitan's FusedGroupedExperts
    weights, loaded through its own state-dict hook), the same weights."""
    torch.manual_seed(seed)
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    ref = cfg.build()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.25)
    if fused:
        _fused_available()
        ours = et.expertact_fused_grouped_experts(cfg, **modes).build()
    else:
        ours = et.expertact_grouped_experts(cfg, **modes).build()
    ours.load_state_dict(ref.state_dict())
    return ref.to(dtype), ours.to(dtype)


def _grads(module):
    """{w1_EFD, w2_EDF, w3_EFD: gradient}; a fused module's w13 [E, F, 2, D] split into w1's and w3's."""
    g = {n: p.grad for n, p in module.named_parameters()}
    for n in [n for n in g if n.split(".")[-1] == "w13"]:
        w13, prefix = g.pop(n), n[:-len("w13")]
        g[prefix + "w1_EFD"], g[prefix + "w3_EFD"] = w13[:, :, 0], w13[:, :, 1]
    return g


def _run(module, x, counts, dy):
    x = x.detach().clone().requires_grad_(True)
    y = module(x, counts)
    y.backward(dy)
    return y.detach(), x.grad, _grads(module)


W_NAMES = {"w1_EFD", "w2_EDF", "w3_EFD"}
GPT_OSS_NAMES = {"mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"}


def _compare(ref, ours, counts, pad, rtol, x_dtype=torch.float32, names=W_NAMES, y_dtype=None, device="cpu"):
    """y_dtype: the output's dtype (x's unless given; TorchTitan's GPT-OSS experts return their
    compute dtype). device: where both modules and the inputs live."""
    ref, ours = ref.to(device), ours.to(device)
    counts = torch.tensor(counts, device=device)
    end = int(counts.sum())
    torch.manual_seed(1)
    x = torch.randn(end + pad, D, dtype=x_dtype).to(device)
    dy = torch.randn(end + pad, D, dtype=x_dtype).to(device)  # padding rows too: they must not leak in
    y_r, dx_r, g_r = _run(ref, x, counts, dy)
    y_o, dx_o, g_o = _run(ours, x, counts, dy)
    # TorchTitan's torch._grouped_mm leaves the padding rows unwritten (any value): compared
    # over the groups' rows; expertact's are exactly zero.
    _close(y_o[:end], y_r[:end], rtol, "y")
    _close(dx_o[:end], dx_r[:end], rtol, "dx")
    assert y_o.dtype == y_r.dtype == (y_dtype or x.dtype) and dx_o.dtype == x.dtype
    assert not y_o[end:].any() and not dx_o[end:].any(), "padding rows must give 0 output and 0 gradient"
    assert set(g_o) == set(g_r) == names
    for n in g_r:
        assert g_o[n].dtype == g_r[n].dtype, n
        _close(g_o[n], g_r[n], rtol, f"d{n}")


FUSED = [False, True]
FUSED_IDS = ["w1_w3", "fused_w13"]


@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("pad", PADDING)
def test_matches_torchtitan_float32(no_bf16_cast, fused, modes, counts, pad):
    ref, ours = _pair(compute_dtype=None, fused=fused, **modes)
    _compare(ref, ours, counts, pad, RTOL_F32)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_matches_torchtitan_bf16(fused, modes, param_dtype, device):
    """TorchTitan's own numerics (bf16 GEMMs and activation), float32 or bf16 parameters
    (the latter as under FSDP2 mixed precision), float32 activations; on the CPU and on a GPU."""
    ref, ours = _pair(param_dtype, fused=fused, **modes)
    assert ours.compute_dtype is torch.bfloat16
    _compare(ref, ours, COUNTS[1], 3, RTOL_BF16, device=device)


@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
def test_weights_passed_to_expert_mlp(monkeypatch, fused):
    """With bf16 parameters: the fused module's w13 and every w2 reach expert_mlp as views of
    the parameters (no copy); separate w1 and w3 as one packed [E, 2F, D] tensor."""
    ref, ours = _pair(torch.bfloat16, fused=fused)
    seen = {}
    real = et.expert_mlp

    def spy(x, w13, w2, offsets, activation, **kw):
        seen.update(w13=w13, w2=w2, layout=kw["layout"], activation=activation)
        return real(x, w13, w2, offsets, activation, **kw)

    monkeypatch.setattr(et, "expert_mlp", spy)
    ours(torch.randn(5, D), torch.tensor([1, 0, 2, 2, 0, 0]))
    assert seen["activation"] == "swiglu"
    assert seen["w2"].data_ptr() == ours.w2_EDF.data_ptr() and seen["w2"].shape == (E, F, D)
    assert seen["w13"].shape == (E, D, 2 * F)
    if fused:
        assert seen["layout"] == "interleaved" and seen["w13"].data_ptr() == ours.w13.data_ptr()
    else:
        assert seen["layout"] == "halves"
        assert seen["w13"].data_ptr() not in (ours.w1_EFD.data_ptr(), ours.w3_EFD.data_ptr())


def test_a_wrong_mapping_fails(no_bf16_cast):
    """The float32 bound catches a swapped gate and up (w1 and w3 exchanged)."""
    ref, ours = _pair(compute_dtype=None)
    with torch.no_grad():
        ours.w1_EFD.copy_(ref.w3_EFD)
        ours.w3_EFD.copy_(ref.w1_EFD)
    with pytest.raises(AssertionError):
        _compare(ref, ours, COUNTS[1], 0, RTOL_F32)


@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
def test_no_grad_and_all_empty(fused):
    ref, ours = _pair(fused=fused)
    x = torch.randn(4, D)
    with torch.no_grad():
        y = ours(x, torch.zeros(E, dtype=torch.int64))
    assert y.shape == (4, D) and not y.any()


def test_state_dict_and_config():
    ref, ours = _pair(recompute=True)
    sd_r, sd_o = ref.state_dict(), ours.state_dict()
    assert list(sd_o) == list(sd_r) == ["w1_EFD", "w2_EDF", "w3_EFD"]
    for k in sd_r:
        assert sd_o[k].shape == sd_r[k].shape and torch.equal(sd_o[k], sd_r[k])
    ref.load_state_dict(ours.state_dict())  # and back
    assert isinstance(ours, GroupedExperts) and ours.recompute and not ours.inplace_backward
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, param_init={"w1_EFD": torch.nn.init.zeros_})
    new = et.expertact_grouped_experts(cfg, inplace_backward=True, compute_dtype="float32")
    assert type(new) is et.ExpertactGroupedExperts.Config
    assert (new.dim, new.hidden_dim, new.num_experts, new.param_init) == (D, F, E, cfg.param_init)
    assert new.inplace_backward and new.compute_dtype is torch.float32
    with pytest.raises(ValueError, match="compute_dtype"):
        et.expertact_grouped_experts(cfg, compute_dtype="int32")


def test_fused_state_dict_and_config():
    """The fused module's checkpoints keep TorchTitan's keys (its own state-dict hooks)."""
    _fused_available()
    ref, ours = _pair(fused=True, recompute=True)
    assert [n for n, _ in ours.named_parameters()] == ["w2_EDF", "w13"]
    sd_r, sd_o = ref.state_dict(), ours.state_dict()
    assert sorted(sd_o) == sorted(sd_r) == ["w1_EFD", "w2_EDF", "w3_EFD"]
    for k in sd_r:
        assert torch.equal(sd_o[k], sd_r[k]), k
    ref.load_state_dict(sd_o)
    assert ours.recompute and isinstance(ours, et.FusedGroupedExperts)
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E,
                                param_init={"w1_EFD": torch.nn.init.zeros_, "w3_EFD": torch.nn.init.ones_,
                                            "w2_EDF": torch.nn.init.zeros_})
    new = et.expertact_fused_grouped_experts(cfg, compute_dtype=None)
    assert type(new) is et.ExpertactFusedGroupedExperts.Config and new.compute_dtype is None
    assert set(new.param_init) == {"w13", "w2_EDF"}  # TorchTitan's remapping of the initialisers
    m = new.build()
    m.init_states()
    assert not m.w13[:, :, 0].any() and (m.w13[:, :, 1] == 1).all()


def _qwen3_moe_config():
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    cfg = qwen3.qwen3_configs["debugmodel_moe"](attn_backend="flex")
    cfg.layers = cfg.layers[:2]
    return cfg


TARGET = "expertact.torchtitan.expertact_grouped_experts"
FUSED_TARGET = "expertact.torchtitan.expertact_fused_grouped_experts"


def _target(fused):
    if fused:
        _fused_available()
        return FUSED_TARGET, et.ExpertactFusedGroupedExperts
    return TARGET, et.ExpertactGroupedExperts


@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
def test_override_hook_on_a_model_config(fused):
    """TorchTitan's own --override.imports machinery replaces every inner_experts node."""
    target, cls = _target(fused)
    cfg = _qwen3_moe_config()
    lines = apply_overrides(OverrideConfig(imports=[(target, {"recompute": True, "compute_dtype": None})]), cfg)
    assert len(lines) == 2
    for layer in cfg.layers:
        inner = layer.moe.routed_experts.inner_experts
        assert type(inner) is cls.Config
        assert inner.recompute and inner.compute_dtype is None and inner.param_init is not None


@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_moe_layer_override_on_and_off(request, bf16, fused):
    """A Qwen3-MoE debug layer (router, top-8 dispatch of 32 tokens over 64 experts, experts,
    combine) built from its config with and without the override: output and every gradient."""
    cfg = _qwen3_moe_config().layers[0].moe
    torch.manual_seed(0)
    ref = cfg.build()
    ref.init_states()
    if not bf16:
        request.getfixturevalue("no_bf16_cast")
    target, cls = _target(fused)
    apply_overrides(OverrideConfig(imports=[(target, {"compute_dtype": "bfloat16" if bf16 else None})]), cfg)
    ours = cfg.build()
    assert type(ours.routed_experts.inner_experts) is cls
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    x = torch.randn(2, 16, cfg.routed_experts.inner_experts.dim)
    rtol = RTOL_BF16 if bf16 else RTOL_F32
    outs = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.pow(2).mean().backward()
        outs.append((y.detach(), xi.grad, _grads(m)))
    (y_r, dx_r, g_r), (y_o, dx_o, g_o) = outs
    _close(y_o, y_r, rtol, "y")
    _close(dx_o, dx_r, rtol, "dx")
    assert set(g_o) == set(g_r)
    for n in g_r:
        _close(g_o[n], g_r[n], rtol, f"d{n}")


@pytest.mark.parametrize("fused", FUSED, ids=FUSED_IDS)
def test_enable_disable(no_bf16_cast, fused):
    ref, _ = _pair()
    if fused:
        _fused_available()
        base = et.FusedGroupedExperts
        ref = base(base.Config(dim=D, hidden_dim=F, num_experts=E))
        ref.load_state_dict(_pair()[0].state_dict())
        ours_cls = et.ExpertactFusedGroupedExperts
    else:
        base, ours_cls = GroupedExperts, et.ExpertactGroupedExperts
    model = torch.nn.ModuleDict({"a": ref})
    before = dict(vars(ref))
    counts = torch.tensor(COUNTS[0])
    x = torch.randn(int(counts.sum()), D)
    y_ref = _pair()[0](x, counts).detach()  # TorchTitan's GroupedExperts (FusedGroupedExperts runs on CUDA only)
    if not fused:
        assert torch.equal(ref(x, counts).detach(), y_ref)
    assert et.enable(model, recompute=True, compute_dtype=None) == ["a"]
    assert type(ref) is ours_cls and ref.recompute
    _close(ref(x, counts).detach(), y_ref, RTOL_F32, "y after enable")
    assert et.enable(model, inplace_backward=True, compute_dtype=None) == ["a"]  # new modes
    assert not ref.recompute and ref.inplace_backward
    assert et.disable(model) == ["a"]
    assert type(ref) is base and type(ref).forward is base.forward
    assert vars(ref).keys() == before.keys()
    if not fused:
        assert torch.equal(ref(x, counts).detach(), y_ref)
    assert et.disable(model) == []


# ---------------------------------------------------------------------------
# GPT-OSS: GptOssGroupedExperts, biases and tensor parallelism
# ---------------------------------------------------------------------------


def _gpt_oss_moe():
    return pytest.importorskip("torchtitan.models.gpt_oss.moe")


GPT_OSS_TARGET = "expertact.torchtitan.expertact_gpt_oss_grouped_experts"


def _gpt_oss_pair(dtype=torch.float32, seed=0, limit=7.0, **modes):
    """TorchTitan's GptOssGroupedExperts and expertact's, the same weights and non-zero biases
    (std 0.25: the biases shift gate_up by about a fifth of its spread, and y by as much)."""
    cfg = _gpt_oss_moe().GptOssGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, swiglu_limit=limit)
    torch.manual_seed(seed)
    ref = cfg.build()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.25)
    ours = et.expertact_gpt_oss_grouped_experts(cfg, **modes).build()
    ours.load_state_dict(ref.state_dict())
    return ref.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("limit", [7.0, 1.0])
@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("pad", PADDING)
def test_gpt_oss_matches_torchtitan_float32(no_bf16_cast, limit, modes, counts, pad):
    """The config's swiglu_limit is the clamp: 7 (GPT-OSS's) and 1 (most gate and up values
    past it)."""
    ref, ours = _gpt_oss_pair(limit=limit, compute_dtype=None, **modes)
    assert type(ours) is et.ExpertactGptOssGroupedExperts and ours.swiglu_limit == limit
    _compare(ref, ours, counts, pad, RTOL_F32, names=GPT_OSS_NAMES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_matches_torchtitan_bf16(modes, param_dtype, device):
    """TorchTitan's own numerics (bf16 GEMMs, biases and activation; a bf16 result whatever x's
    dtype), float32 or bf16 parameters, float32 activations; on the CPU and on a GPU."""
    ref, ours = _gpt_oss_pair(param_dtype, **modes)
    assert ours.compute_dtype is torch.bfloat16
    _compare(ref, ours, COUNTS[1], 3, RTOL_BF16, names=GPT_OSS_NAMES, y_dtype=torch.bfloat16, device=device)


def test_gpt_oss_weights_passed_to_expert_mlp(monkeypatch):
    """With bf16 parameters the weights and biases reach expert_mlp as the parameters
    themselves (views, no copy): mlp1 as the interleaved [E, D, 2F], its bias as b13."""
    ref, ours = _gpt_oss_pair(torch.bfloat16)
    seen = {}
    real = et.expert_mlp

    def spy(x, w13, w2, offsets, activation, **kw):
        seen.update(kw, w13=w13, w2=w2, activation=activation)
        return real(x, w13, w2, offsets, activation, **kw)

    monkeypatch.setattr(et, "expert_mlp", spy)
    ours(torch.randn(5, D), torch.tensor([1, 0, 2, 2, 0, 0]))
    assert seen["activation"] == "swiglu_oai" and seen["layout"] == "interleaved"
    assert seen["alpha"] == 1.702 and seen["limit"] == 7.0
    for key, param in (("w13", ours.mlp1_weight_EGD), ("w2", ours.mlp2_weight_EDF), ("b13", ours.mlp1_bias_EG),
                       ("b2", ours.mlp2_bias_ED)):
        assert seen[key].data_ptr() == param.data_ptr(), key
    assert seen["w13"].shape == (E, D, 2 * F) and seen["w2"].shape == (E, F, D)


def test_gpt_oss_a_wrong_bias_fails(no_bf16_cast):
    """The float32 bound catches mlp1's bias with its gate and up entries swapped, and a
    down-projection bias left out."""
    ref, ours = _gpt_oss_pair(compute_dtype=None)
    with torch.no_grad():
        ours.mlp1_bias_EG.copy_(ref.mlp1_bias_EG.view(E, F, 2).flip(-1).reshape(E, 2 * F))
    with pytest.raises(AssertionError, match="max"):
        _compare(ref, ours, COUNTS[1], 0, RTOL_F32, names=GPT_OSS_NAMES)
    ref, ours = _gpt_oss_pair(compute_dtype=None)
    with torch.no_grad():
        ours.mlp2_bias_ED.zero_()
    with pytest.raises(AssertionError, match="max"):
        _compare(ref, ours, COUNTS[1], 0, RTOL_F32, names=GPT_OSS_NAMES)


def test_gpt_oss_state_dict_and_config():
    ref, ours = _gpt_oss_pair(recompute=True)
    sd_r, sd_o = ref.state_dict(), ours.state_dict()
    assert list(sd_o) == list(sd_r) == ["mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"]
    for k in sd_r:
        assert torch.equal(sd_o[k], sd_r[k]), k
    ref.load_state_dict(ours.state_dict())
    moe = _gpt_oss_moe()
    assert isinstance(ours, moe.GptOssGroupedExperts) and ours.recompute
    cfg = moe.GptOssGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, swiglu_limit=3.0,
                                          param_init={"mlp1_weight_EGD": torch.nn.init.zeros_,
                                                      "mlp1_bias_EG": torch.nn.init.zeros_,
                                                      "mlp2_weight_EDF": torch.nn.init.zeros_,
                                                      "mlp2_bias_ED": torch.nn.init.ones_})
    # each of the three factories makes the same config of a GPT-OSS node
    for factory in (et.expertact_gpt_oss_grouped_experts, et.expertact_grouped_experts,
                    et.expertact_fused_grouped_experts):
        if factory is None:
            continue
        new = factory(cfg, inplace_backward=True, compute_dtype="float32")
        assert type(new) is et.ExpertactGptOssGroupedExperts.Config
        assert (new.dim, new.hidden_dim, new.num_experts, new.swiglu_limit) == (D, F, E, 3.0)
        assert new.param_init == cfg.param_init and new.inplace_backward and new.compute_dtype is torch.float32
        again = factory(new, recompute=True)  # an expertact config takes new modes
        assert type(again) is type(new) and again.recompute and not again.inplace_backward
    m = new.build()
    m.init_states()
    assert (m.mlp2_bias_ED == 1).all() and not m.mlp1_weight_EGD.any()

    class Custom(moe.GptOssGroupedExperts):
        from dataclasses import dataclass as _dc

        @_dc(kw_only=True, slots=True)
        class Config(moe.GptOssGroupedExperts.Config):
            pass

    for factory in (et.expertact_gpt_oss_grouped_experts, et.expertact_grouped_experts):
        with pytest.raises(NotImplementedError, match="Custom"):
            factory(Custom.Config(dim=D, hidden_dim=F, num_experts=E))


def _gpt_oss_model_config():
    gpt_oss = pytest.importorskip("torchtitan.models.gpt_oss")
    cfg = gpt_oss.gptoss_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    cfg.layers = cfg.layers[:2]
    return cfg


@pytest.mark.parametrize("target", [GPT_OSS_TARGET, TARGET])
def test_gpt_oss_override_hook_on_a_model_config(target):
    cfg = _gpt_oss_model_config()
    lines = apply_overrides(OverrideConfig(imports=[(target, {"recompute": True})]), cfg)
    assert len(lines) == 2
    for layer in cfg.layers:
        inner = layer.moe.routed_experts.inner_experts
        assert type(inner) is et.ExpertactGptOssGroupedExperts.Config
        assert inner.recompute and inner.param_init is not None and inner.swiglu_limit == 7.0


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_gpt_oss_moe_layer_override_on_and_off(request, bf16):
    """A GPT-OSS debug layer (router with bias, top-4 dispatch of 32 tokens over 8 experts,
    biased experts, combine) built from its config with and without the override. In bf16 the
    layer's parameters and activations are bf16, as under FSDP mixed precision: TorchTitan's
    GPT-OSS experts return bf16, which its combine cannot add into float32 activations."""
    cfg = _gpt_oss_model_config().layers[0].moe
    torch.manual_seed(0)
    ref = cfg.build()
    ref.init_states()
    dtype = torch.bfloat16 if bf16 else torch.float32
    if not bf16:
        request.getfixturevalue("no_bf16_cast")
    apply_overrides(OverrideConfig(imports=[(GPT_OSS_TARGET, {"compute_dtype": "bfloat16" if bf16 else None})]), cfg)
    ours = cfg.build()
    assert type(ours.routed_experts.inner_experts) is et.ExpertactGptOssGroupedExperts
    ours.load_state_dict(ref.state_dict())
    assert ref.routed_experts.inner_experts.mlp2_bias_ED.abs().min() > 0  # the biases are not zero
    ref, ours = ref.to(dtype), ours.to(dtype)
    torch.manual_seed(1)
    x = torch.randn(2, 16, cfg.routed_experts.inner_experts.dim, dtype=dtype)
    rtol = RTOL_BF16 if bf16 else RTOL_F32
    # The router's gradient reaches it through the routing weights' gradient, a sum over D of
    # bf16 products on each side: measured 8e-3 of its largest magnitude with torch 2.13, 2.01e-2
    # with torch 2.11 (CPU); a swapped gate and up or a dropped bias misses by 0.07 or more.
    rtol_router = 3e-2 if bf16 else RTOL_F32
    outs = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.float().pow(2).mean().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y_r, dx_r, g_r), (y_o, dx_o, g_o) = outs
    assert y_o.dtype == y_r.dtype
    _close(y_o, y_r, rtol, "y")
    _close(dx_o, dx_r, rtol, "dx")
    assert set(g_o) == set(g_r) and {n.split(".")[-1] for n in g_r} >= GPT_OSS_NAMES
    for n in g_r:
        _close(g_o[n], g_r[n], rtol_router if n.startswith("router.") else rtol, f"d{n}")


def test_gpt_oss_enable_disable(no_bf16_cast):
    ref, _ = _gpt_oss_pair()
    base = _gpt_oss_moe().GptOssGroupedExperts
    module = base(base.Config(dim=D, hidden_dim=F, num_experts=E))
    module.load_state_dict(ref.state_dict())
    plain, _ = _pair()
    model = torch.nn.ModuleDict({"oss": module, "plain": plain})
    before = dict(vars(module))
    counts = torch.tensor(COUNTS[1])
    x = torch.randn(int(counts.sum()), D)
    y_ref = ref(x, counts).detach()
    assert et.enable(model, recompute=True, compute_dtype=None) == ["oss", "plain"]
    assert type(module) is et.ExpertactGptOssGroupedExperts and module.recompute
    assert type(plain) is et.ExpertactGroupedExperts
    _close(module(x, counts).detach(), y_ref, RTOL_F32, "y after enable")
    assert et.disable(model) == ["oss", "plain"]
    assert type(module) is base and type(module).forward is base.forward and vars(module).keys() == before.keys()
    assert torch.equal(module(x, counts).detach(), y_ref)


def _tp_worker(rank, world, init_file, queue):
    """One rank of test_gpt_oss_tensor_parallel: TorchTitan's GPT-OSS experts and expertact's,
    both with their parameters as DTensors over a 1-D "tp" mesh in TorchTitan's tensor-parallel
    layout (mlp1 and its bias sharded along 2F, mlp2 along F, mlp2's bias replicated), and a
    plain unsharded TorchTitan module; float32. Puts the largest relative errors on the queue."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.Tensor.bfloat16 = lambda self, *a, **k: self  # float32 on both sides, as no_bf16_cast
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        full, ours = _gpt_oss_pair(limit=1.0, compute_dtype=None)
        ref, _ = _gpt_oss_pair(limit=1.0)
        layout = {"mlp1_weight_EGD": Shard(1), "mlp1_bias_EG": Shard(1), "mlp2_weight_EDF": Shard(2),
                  "mlp2_bias_ED": Replicate()}
        for m in (ref, ours):
            for n, p in list(m.named_parameters()):
                setattr(m, n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [layout[n]])))
        assert et._tp_degree(ours.mlp1_weight_EGD) == world
        counts = torch.tensor(COUNTS[1])
        torch.manual_seed(1)  # the same x and dy on every rank (replicated activations)
        x = torch.randn(int(counts.sum()), D)
        dy = torch.randn_like(x)
        outs = []
        for m in (ref, ours, full):
            xi = x.clone().requires_grad_(True)
            y = m(xi, counts)
            y.backward(dy)
            grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in m.named_parameters()}
            outs.append((y.detach(), xi.grad, grads))
        (y_r, dx_r, g_r), (y_o, dx_o, g_o), (y_f, _, g_f) = outs

        def rel(a, b):
            return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

        errs = {"y": rel(y_o, y_r), "dx": rel(dx_o, dx_r)}
        errs.update({f"d{n}": rel(g_o[n], g_r[n]) for n in g_r})
        total = y_o.clone()
        dist.all_reduce(total)  # the partial sums of the ranks: the unsharded module's output
        errs["sum of y over ranks"] = rel(total, y_f)
        errs["dmlp2_bias_ED against the unsharded"] = rel(g_o["mlp2_bias_ED"], g_f["mlp2_bias_ED"])
        queue.put((rank, errs))
        dist.barrier()  # no rank tears gloo down while its peer is still in a collective
    finally:
        dist.destroy_process_group()
    # destroy_process_group drops only the registry's reference: the DTensors' mesh keeps the gloo
    # group alive until interpreter finalization, where tearing down its worker threads can abort
    # the process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291
    # describes the race). The result is already in the pipe (SimpleQueue.put writes it before
    # returning), so this rank leaves without finalization.
    os._exit(0)


def test_gpt_oss_tensor_parallel(tmp_path):
    """2-way tensor parallelism on the CPU (gloo): each rank's output (a partial sum, with
    mlp2's bias divided by the TP degree) and gradients equal TorchTitan's on that rank; the
    ranks' outputs sum to the unsharded module's; mlp2's bias gradient is the full one on each
    rank."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_tp_worker, args=(2, str(tmp_path / "init"), queue), nprocs=2, start_method="spawn")
    results = dict(queue.get() for _ in range(2))
    for rank, errs in sorted(results.items()):
        for what, err in errs.items():
            assert err <= RTOL_F32, f"rank {rank}: {what}: max error {err:.3g} relative > {RTOL_F32}"


# ---------------------------------------------------------------------------
# FP8: the factories' and enable()'s fp8, on the CPU as the recipe's emulation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise"])
@pytest.mark.parametrize("kind", ["w1_w3", "fused_w13", "gpt_oss"])
def test_fp8_reaches_expert_mlp(monkeypatch, kind, recipe):
    """A factory's fp8=recipe reaches expert_mlp and runs its FP8 node (test_fp8_mlp holds it to
    the recipe's oracle): the recipe's FP8 GEMMs (ScaledGemmLog.check), the output and the
    gradients differing from the same module's bf16 ones as FP8 must; enable(model, fp8=...)
    switches it on a built model, fp8=True to the default recipe; an unknown name is refused
    before any change."""
    from support.fp8_oracle import ScaledGemmLog, rel
    if kind == "gpt_oss":
        _, bf16 = _gpt_oss_pair()
        _, ours = _gpt_oss_pair(fp8=recipe)
    else:
        _, bf16 = _pair(fused=kind == "fused_w13")
        _, ours = _pair(fused=kind == "fused_w13", fp8=recipe)
    assert ours.fp8 == recipe and bf16.fp8 is None and f"fp8='{recipe}'" in repr(ours)
    seen = []
    real = et.expert_mlp

    def spy(*a, **kw):
        seen.append(kw["fp8"])
        return real(*a, **kw)

    monkeypatch.setattr(et, "expert_mlp", spy)
    counts = torch.tensor(COUNTS[1])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(int(counts.sum()) + 3, D, generator=gen)
    dy = torch.randn(x.shape, generator=gen)
    with ScaledGemmLog() as log:
        got = _run(ours, x, counts, dy)
    log.check(recipe)
    assert seen == [recipe]
    want = _run(bf16, x, counts, dy)
    assert rel(got[0], want[0]) > 2e-2 and rel(got[1], want[1]) > 2e-2
    for n, g in got[2].items():
        if n != "mlp2_bias_ED":  # its gradient is dy's sum, which FP8 does not touch
            assert rel(g, want[2][n]) > 2e-2, n
    model = torch.nn.ModuleDict({"a": bf16})
    assert et.enable(model, fp8=recipe) == ["a"] and bf16.fp8 == recipe
    with ScaledGemmLog() as log:
        again = _run(bf16, x, counts, dy)
    log.check(recipe)
    assert torch.equal(again[0], got[0])
    with pytest.raises(ValueError, match=r"expertact.torchtitan: fp8='e4m3' is not an FP8 recipe: the recipes are "
                                         r"'rowwise' \(\+0\.076"):
        et.enable(model, fp8="e4m3")
    assert bf16.fp8 == recipe  # refused before any change
    with monkeypatch.context() as m:
        m.setattr(ea_moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match="expertact.torchtitan: fp8=True asks for the default FP8 recipe"):
            et.enable(model, fp8=True)
    assert bf16.fp8 == recipe
    assert et.enable(model, fp8=True) == ["a"] and bf16.fp8 == "blockwise"


def test_fp8_config_field():
    cfg = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)
    assert et.expertact_grouped_experts(cfg).fp8 is None
    assert et.expertact_grouped_experts(cfg, fp8="rowwise").fp8 == "rowwise"
    assert et.expertact_grouped_experts(cfg, fp8=False).fp8 is None
    assert et.expertact_grouped_experts(cfg, fp8=True).fp8 == "blockwise"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ea_moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match="fp8=True asks for the default FP8 recipe, and none is chosen"):
            et.expertact_grouped_experts(cfg, fp8=True)
    with pytest.raises(ValueError, match="fp8='e4m3' is not an FP8 recipe"):
        et.expertact_grouped_experts(cfg, fp8="e4m3")
    gpt = _gpt_oss_moe().GptOssGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, swiglu_limit=7.0)
    assert et.expertact_gpt_oss_grouped_experts(gpt, fp8="rowwise").fp8 == "rowwise"
    assert et.expertact_grouped_experts(cfg, fp8="blockwise").fp8 == "blockwise"
    assert et.expertact_grouped_experts(cfg, fp8="rowwise-promoted-wgrad").fp8 == "rowwise-promoted-wgrad"


def test_other_subclasses_refused():
    class Custom(GroupedExperts):
        from dataclasses import dataclass as _dc

        @_dc(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

    cfg = Custom.Config(dim=D, hidden_dim=F, num_experts=E)
    with pytest.raises(NotImplementedError, match="Custom"):
        et.expertact_grouped_experts(cfg)
    with pytest.raises(NotImplementedError, match="Custom"):
        et.enable(torch.nn.ModuleDict({"c": cfg.build()}))
