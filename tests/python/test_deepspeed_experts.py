"""expertact's whole expert MLP inside DeepSpeed AutoEP: enable(experts=True) replaces
GroupedExperts.forward (deepspeed.moe.ep_experts, DeepSpeed 0.19.8) with expertact.moe.expert_mlp
on the module's own w1/w2/w3. Checked against DeepSpeed's own forward of the same module: every
activation, both gate_up_impls, every path DeepSpeed picks, every memory mode; float32 on the CPU
within rounding, bf16 and FP8 on the GPU against a float32 copy. Skips without deepspeed."""
import math

import pytest
import torch

from expertact import deepspeed as xds
from expertact import moe
from expertact.moe import expert_mlp
from conftest import requires_cuda
from test_deepspeed_registry import EP, FORMS, _OpLog, _grouped_experts, needs_ds

pytestmark = needs_ds

MODES = {"default": {}, "recompute": dict(recompute=True), "inplace": dict(inplace_backward=True),
         "recompute-inplace": dict(recompute=True, inplace_backward=True)}
PATHS = ("grouped_mm-separate", "grouped_mm-fused", "for-loop", "triton")
DS_FORWARD = EP.GroupedExperts.forward if EP is not None else None


@pytest.fixture(autouse=True)
def _restore():
    yield
    xds.disable()
    assert EP.GroupedExperts.forward is DS_FORWARD and not xds.experts_enabled()


def _module(name, path, device="cpu", sizes=(32, 48, 4), dtype=torch.float32):
    """DeepSpeed's GroupedExperts on one of its paths (triton: the flag its constructor sets on sm < 90;
    DeepSpeed's own forward would then call its Triton GEMM, expertact's reads the weights the same way)."""
    grouped = path != "for-loop"
    impl = "fused" if path == "grouped_mm-fused" else "separate"
    m = _grouped_experts(name, "cpu", impl, grouped_mm=grouped, sizes=sizes)
    if path == "triton":
        m.use_triton_grouped_mm = True
    return m.to(device=device, dtype=dtype)


def _fwd_bwd(m, x, counts, forward=None):
    """(y, x.grad, w1.grad, w2.grad, w3.grad) and the operators that ran; forward=None: m's own."""
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype).to(x.device) / 4
    with _OpLog() as log:
        y = m(x, counts) if forward is None else forward(m, x, counts)
        y.backward(dy)
    return [y.detach(), x.grad, m.w1.grad, m.w2.grad, m.w3.grad], log.ops


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# Token groups with an empty expert, and 5 padding rows past the last (AutoEP pads so).
_COUNTS, _PAD = [16, 0, 37, 11], 5
WHAT = ("y", "x.grad", "w1.grad", "w2.grad", "w3.grad")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", FORMS)
def test_matches_deepspeeds_forward_in_float32(name, path, mode):
    """Output and the gradients of x, w1, w2, w3 equal DeepSpeed's own forward within float32
    rounding; the rows past the last expert are zero; the registry's activation is not called,
    expertact's kernels are. The reference is DeepSpeed's for-loop, its path for CPU tensors: its
    grouped paths call its Triton kernel for swiglu wherever Triton is importable, which fails on
    CPU tensors, and its Triton GEMM needs a GPU."""
    m = _module(name, path)
    counts = torch.tensor(_COUNTS)
    rows = sum(_COUNTS)
    x = torch.randn(rows + _PAD, 32, generator=torch.Generator().manual_seed(1))
    want, _ = _fwd_bwd(_module(name, "for-loop"), x, counts)
    xds.enable(experts=True, **MODES[mode])
    got, ops = _fwd_bwd(m, x, counts)
    # recompute: h once more in backward, from the kept gate_up
    assert ops["expertact::glu"] == (2 if "recompute" in mode else 1), ops
    assert ops["expertact::glu_backward" + ("_" if "inplace" in mode else "")] == 1, ops
    assert torch.all(got[0][rows:] == 0) and torch.all(got[1][rows:] == 0)
    for what, g, w in zip(WHAT, got, want):
        w = w if what not in ("y", "x.grad") else w[:rows]
        g = g if what not in ("y", "x.grad") else g[:rows]
        assert torch.isfinite(g).all() and _rel(g, w) <= 2e-6, (what, _rel(g, w))


def test_weights_cast_to_the_activations_dtype_as_deepspeed_does():
    """float32 parameters with bfloat16 activations (a model whose master weights stay float32): the
    weights are cast to x's dtype, the output is bf16, the gradients land float32 in w1/w2/w3."""
    m = _module("swiglu_oai", "grouped_mm-fused")
    counts = torch.tensor(_COUNTS)
    x = torch.randn(sum(_COUNTS), 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    want, _ = _fwd_bwd(m, x, counts)
    xds.enable(experts=True)
    got, _ = _fwd_bwd(m, x, counts)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[2:])
    for what, g, w in zip(WHAT, got, want):
        assert _rel(g, w) <= 2e-2, (what, _rel(g, w))


def test_enable_disable_and_scopes():
    xds.enable(experts=True, recompute=True)
    assert EP.GroupedExperts.forward is not DS_FORWARD and xds.experts_enabled()
    form = EP.GroupedExperts.forward.expertact_form
    assert form["experts"] and form["recompute"] and form["fp8"] is None and not form["inplace_backward"]
    assert set(form["activations"]) == set(FORMS)
    xds.enable()  # the activation only: DeepSpeed's forward is back
    assert EP.GroupedExperts.forward is DS_FORWARD and not xds.experts_enabled() and xds.is_enabled()
    xds.enable(experts=True)
    with xds.enabled_scope(experts=True, inplace_backward=True):
        assert EP.GroupedExperts.forward.expertact_form["inplace_backward"]
    assert EP.GroupedExperts.forward.expertact_form == dict(form, recompute=False)
    with xds.enabled_scope():
        assert EP.GroupedExperts.forward is DS_FORWARD
    assert xds.experts_enabled()
    xds.disable()
    xds.disable()
    assert EP.GroupedExperts.forward is DS_FORWARD
    with xds.enabled_scope(experts=True):
        assert xds.experts_enabled()
    assert EP.GroupedExperts.forward is DS_FORWARD and not xds.is_enabled()


def test_the_registry_stays_deepspeeds_with_experts():
    """The whole MLP does not go through DeepSpeed's activation registry: enable(experts=True)
    leaves its four entries as shipped (DeepSpeed's own tests check, e.g., that only swiglu has a
    packed kernel), and enable() after it puts expertact's kernels in."""
    shipped = {n: EP.EXPERT_ACTIVATIONS[n] for n in FORMS}
    xds.enable(experts=True, inplace_backward=True)
    assert all(EP.EXPERT_ACTIVATIONS[n] is e for n, e in shipped.items())
    xds.enable()
    assert all(EP.EXPERT_ACTIVATIONS[n] is not e for n, e in shipped.items())
    xds.enable(experts=True)
    assert all(EP.EXPERT_ACTIVATIONS[n] is e for n, e in shipped.items())


def test_counts_on_another_device_are_read_to_the_host():
    """DeepSpeed's for-loop takes the token counts on any device (it reads them with .tolist());
    so does expertact's forward. Here a CPU tensor that says it is on cuda:0, as DeepSpeed's own
    unit test of its asynchronous split plan passes them."""
    class ElsewhereCounts(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    m = _module("swiglu_oai", "for-loop")
    counts = torch.tensor(_COUNTS)
    x = torch.randn(sum(_COUNTS), 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = DS_FORWARD(m, x, counts)
        xds.enable(experts=True)
        got = m(x, counts.as_subclass(ElsewhereCounts))
    assert type(got) is torch.Tensor and _rel(got, want) <= 2e-6


def test_what_deepspeed_refuses_stays_refused():
    """The switch replaces the forward only: DeepSpeed's constructor still refuses what it refuses,
    with its own errors."""
    xds.enable(experts=True)
    with pytest.raises(ValueError, match="unknown expert activation 'relu2'"):
        EP.GroupedExperts(16, 8, 2, use_grouped_mm=False, activation="relu2")
    with pytest.raises(ValueError, match='gate_up_impl="fused" runs the gate and up projections as one'):
        EP.GroupedExperts(16, 8, 2, use_grouped_mm=False, gate_up_impl="fused")
    with pytest.raises(ValueError, match='gate_up_impl must be "separate" or "fused"'):
        EP.GroupedExperts(16, 8, 2, use_grouped_mm=False, gate_up_impl="packed")


def test_disable_leaves_a_forward_someone_else_put_there():
    xds.enable(experts=True)

    def theirs(self, x, counts):
        return DS_FORWARD(self, x, counts)

    EP.GroupedExperts.forward = theirs
    try:
        xds.disable()
        assert EP.GroupedExperts.forward is theirs
    finally:
        EP.GroupedExperts.forward = DS_FORWARD


def test_refusals(monkeypatch):
    with pytest.raises(ValueError, match="fp8='rowwise' applies to the whole expert MLP: pass experts=True"):
        xds.enable(fp8="rowwise")
    with pytest.raises(ValueError, match="recompute=True applies to the whole expert MLP"):
        xds.enable(recompute=True)
    with pytest.raises(ValueError, match="fp8='e5m2'"):
        xds.enable(experts=True, fp8="e5m2")
    with pytest.raises(TypeError, match="experts must be a bool"):
        xds.enable(experts=1)
    with pytest.raises(TypeError, match="recompute must be a bool"):
        xds.enable(experts=True, recompute="yes")
    assert EP.GroupedExperts.forward is DS_FORWARD and not xds.is_enabled()
    with monkeypatch.context() as mp:
        mp.delattr(EP, "GroupedExperts")
        with pytest.raises(RuntimeError, match="has no GroupedExperts module; .*>= 0.19.8"):
            xds.enable(experts=True)
    assert not xds.is_enabled()


def test_probe_refuses_a_grouped_experts_that_means_something_else(monkeypatch):
    """A DeepSpeed whose GroupedExperts read w1 as up and w3 as gate: expertact's forward would
    train another model, so enable(experts=True) refuses and changes nothing."""
    def swapped(self, x, counts):
        self.w1, self.w3 = self.w3, self.w1
        try:
            return DS_FORWARD(self, x, counts)
        finally:
            self.w1, self.w3 = self.w3, self.w1

    monkeypatch.setattr(EP.GroupedExperts, "forward", swapped)
    with pytest.raises(ValueError, match="differs from DeepSpeed's GroupedExperts.forward for activation 'geglu_tanh'"):
        xds.enable(experts=True)
    assert EP.GroupedExperts.forward is swapped and not xds.is_enabled()


def test_a_registered_form_keeps_deepspeeds_forward(monkeypatch):
    """A name added to DeepSpeed's registry and served with register=: the expert MLP does not
    know its form by name, so GroupedExperts keeps DeepSpeed's forward (which calls the registry's
    expertact kernel); DeepSpeed's four names run the whole MLP."""
    monkeypatch.setitem(EP.EXPERT_ACTIVATIONS, "my_swiglu", EP.EXPERT_ACTIVATIONS["swiglu"])
    xds.enable(experts=True, register={"my_swiglu": "swiglu"})
    m = _grouped_experts("my_swiglu", "cpu", "fused")
    counts = torch.tensor([16, 16, 0, 16])
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    got, ops = _fwd_bwd(m, x, counts)
    assert ops["aten::_grouped_mm"] >= 2 and ops["expertact::glu"] == 1, ops  # DeepSpeed's GEMMs, our kernel
    want, _ = _fwd_bwd(m, x, counts, forward=DS_FORWARD)
    assert all(_rel(g, w) <= 2e-6 for g, w in zip(got, want))
    assert "my_swiglu" not in EP.GroupedExperts.forward.expertact_form["activations"]
    xds.disable()


def test_fp8_where_it_cannot_run_says_why():
    """float32 on the CPU (the emulation takes bf16, as the GPU path does)."""
    xds.enable(experts=True, fp8="rowwise")
    m = _module("swiglu", "grouped_mm-fused")
    with pytest.raises(NotImplementedError, match="fp8='rowwise' cannot run here: x is on cpu, .*float32"):
        m(torch.randn(16, 32), torch.tensor([16, 0, 0, 0]))


def test_fp8_names(monkeypatch):
    """fp8 resolves through expertact.moe.fp8_recipe: False is bf16, True the default recipe
    ("blockwise"; refused while none is chosen, nothing changed then), a name that recipe (in
    enable() and in enabled_scope()); an unknown name is refused naming the recipes and their
    loss cost, and nothing changes then."""
    xds.enable(experts=True, fp8=True)
    assert EP.GroupedExperts.forward.expertact_form["fp8"] == "blockwise"
    xds.enable(experts=True, fp8=False)
    assert EP.GroupedExperts.forward.expertact_form["fp8"] is None
    monkeypatch.setattr(moe, "DEFAULT_FP8_RECIPE", None)
    with pytest.raises(ValueError, match=r"expertact.deepspeed.enable: fp8=True asks for the default FP8 recipe, "
                                         r"and none is chosen"):
        xds.enable(experts=True, fp8=True)
    assert EP.GroupedExperts.forward.expertact_form["fp8"] is None
    monkeypatch.setattr(moe, "DEFAULT_FP8_RECIPE", "rowwise-promoted-wgrad")
    xds.enable(experts=True, fp8=True)
    assert EP.GroupedExperts.forward.expertact_form["fp8"] == "rowwise-promoted-wgrad"
    with xds.enabled_scope(experts=True, fp8="rowwise-bf16-wgrad"):
        assert EP.GroupedExperts.forward.expertact_form["fp8"] == "rowwise-bf16-wgrad"
    assert EP.GroupedExperts.forward.expertact_form["fp8"] == "rowwise-promoted-wgrad"
    xds.disable()
    with pytest.raises(ValueError, match=r"expertact.deepspeed.enable: fp8='rowwise-fast' is not an FP8 recipe: "
                                         r"the recipes are 'rowwise' \(\+0\.076.*'rowwise-bf16-wgrad' \(over the last 100 "):
        xds.enable(experts=True, fp8="rowwise-fast")
    assert EP.GroupedExperts.forward is DS_FORWARD and not xds.is_enabled()


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise"])
@pytest.mark.parametrize("path", ["grouped_mm-separate", "for-loop"])
@pytest.mark.parametrize("name", ["swiglu", "swiglu_oai"])
def test_fp8_reaches_expert_mlp_on_the_cpu(name, path, recipe):
    """enable(experts=True, fp8=recipe) on a bf16 module on the CPU runs the FP8 node (its
    emulation there): the recipe's FP8 GEMMs (ScaledGemmLog.check), the output and the gradients
    of x, w1, w2, w3 those of expert_mlp(fp8=recipe) on the module's weights bit for bit
    (test_fp8_mlp holds that node to the recipe's oracle), and differing from
    enable(experts=True)'s bf16 ones as FP8 must."""
    from support.fp8_oracle import ScaledGemmLog
    m = _module(name, path, dtype=torch.bfloat16)
    counts = torch.tensor(_COUNTS)
    x = torch.randn(sum(_COUNTS) + _PAD, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
    xds.enable(experts=True)
    bf16, _ = _fwd_bwd(m, x, counts)
    xds.enable(experts=True, fp8=recipe)
    assert EP.GroupedExperts.forward.expertact_form["fp8"] == recipe
    with ScaledGemmLog() as log:
        got, _ = _fwd_bwd(m, x, counts)
    log.check(recipe)

    def by_hand(module, x, counts):
        w13 = torch.cat((module.w1, module.w3), dim=1).transpose(-2, -1)
        kw = dict(alpha=module.activation_alpha, limit=module.activation_limit) if name == "swiglu_oai" else {}
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return expert_mlp(x, w13, module.w2.transpose(-2, -1), offsets, name, fp8=recipe, **kw)

    xds.disable()
    want, _ = _fwd_bwd(m, x, counts, forward=by_hand)
    for what, g, w, b in zip(WHAT, got, want, bf16):
        assert torch.equal(g, w), what
        assert _rel(g, b) > 2e-2, (what, _rel(g, b))


# ---------------------------------------------------------------------------
# On the GPU: bf16 and FP8 against a float32 copy of DeepSpeed's module
# ---------------------------------------------------------------------------

_H100 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# 16-row groups (AutoEP pads so), one empty; D = 256, F = 384: the FP8 GEMMs' multiples of 16.
_GPU_COUNTS = [256, 0, 384, 208, 256, 0, 512, 432]
_GPU_SIZES = (256, 384, 8)
# Relative error floor of the bf16 comparison: expertact's error against the float32 copy must be
# within 1.25x DeepSpeed's own bf16 error plus this; a wrong form errs by ~1e-1.
_BF16_FLOOR = 2e-3
# FP8 e4m3 rowwise: expertact's errors against the float32 copy within this factor of those of the
# same recipe composed from torchao's FP8 grouped GEMM (bench/fp8.py's ERROR_VS_TORCHAO), plus a floor.
_FP8_VS_TORCHAO, _FP8_FLOOR = 1.25, 1e-3
# Without torchao: a wrong layout, scale or padding errs by order 1, the recipe by 2-11 % here.
_FP8_TOL = 0.2

def _gpu_problem(name, path):
    m32 = _module(name, path, device="cuda", sizes=_GPU_SIZES)
    counts = torch.tensor(_GPU_COUNTS, device="cuda")
    x = torch.randn(sum(_GPU_COUNTS) + 16, _GPU_SIZES[0], generator=torch.Generator().manual_seed(4)).cuda()
    ref, _ = _fwd_bwd(_module(name, "for-loop", device="cuda", sizes=_GPU_SIZES), x, counts)  # float32
    m16 = _module(name, path, device="cuda", sizes=_GPU_SIZES, dtype=torch.bfloat16)
    return m32, m16, counts, x, ref


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", FORMS)
@requires_cuda
def test_cuda_bf16_no_less_accurate_than_deepspeed(name, path, mode):
    if path == "triton":
        pytest.importorskip("triton", reason="DeepSpeed's Triton grouped GEMM needs triton")
    _, m16, counts, x, ref = _gpu_problem(name, path)
    rows = sum(_GPU_COUNTS)
    ds, _ = _fwd_bwd(m16, x.bfloat16(), counts)  # DeepSpeed's own path, bf16
    xds.enable(experts=True, **MODES[mode])
    got, ops = _fwd_bwd(m16, x.bfloat16(), counts)
    assert ops["expertact::glu"] >= 1, ops
    assert torch.all(got[0][rows:] == 0) and torch.all(got[1][rows:] == 0)
    for what, r, d, g in zip(WHAT, ref, ds, got):
        if what in ("y", "x.grad"):
            r, d, g = r[:rows], d[:rows], g[:rows]
        assert math.isfinite(_rel(g, r)) and _rel(g, r) <= 1.25 * _rel(d, r) + _BF16_FLOOR, \
            (what, _rel(g, r), _rel(d, r))


def _torchao_forward(m, x, counts):
    """The rowwise FP8 recipe composed from torchao's FP8 grouped GEMM around DeepSpeed's own packed
    activation: the error a user of that recipe gets."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as tao
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate_up = tao(x, torch.cat((m.w1, m.w3), dim=1).transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)
    h = EP.apply_packed_expert_activation(gate_up, m.activation, m.activation_alpha, m.activation_limit)
    return tao(h, m.w2.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False)


@requires_cuda
@pytest.mark.skipif(not _H100, reason="the FP8 grouped GEMMs need a Hopper GPU")
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("path", ["grouped_mm-separate", "grouped_mm-fused"])
@pytest.mark.parametrize("name", FORMS)
def test_cuda_fp8_within_the_rowwise_recipes_error(name, path, inplace):
    _, m16, counts, x, ref = _gpu_problem(name, path)
    rows = sum(_GPU_COUNTS)
    try:
        tao, _ = _fwd_bwd(m16, x.bfloat16(), counts, forward=_torchao_forward)
    except ImportError:
        tao = None
    xds.enable(experts=True, fp8="rowwise", inplace_backward=inplace)
    got, ops = _fwd_bwd(m16, x.bfloat16(), counts)
    assert ops["aten::_scaled_grouped_mm"] == 6, ops
    assert torch.all(got[0][rows:] == 0) and torch.all(got[1][rows:] == 0)
    for i, (what, r, g) in enumerate(zip(WHAT, ref, got)):
        if what in ("y", "x.grad"):
            r, g = r[:rows], g[:rows]
        assert torch.isfinite(g).all() and _rel(g, r) < _FP8_TOL, (what, _rel(g, r))
        if tao is not None:
            t = tao[i][:rows] if what in ("y", "x.grad") else tao[i]
            assert _rel(g, r) <= _FP8_VS_TORCHAO * _rel(t, r) + _FP8_FLOOR, (what, _rel(g, r), _rel(t, r))
