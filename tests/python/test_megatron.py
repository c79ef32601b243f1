"""expertact.megatron.ExpertMLP against Megatron-Core's own SequentialMLP (megatron-core 0.19.2,
Python >= 3.12) on the CPU, float32: the same state dict, the same inputs, the output and every
gradient within float32 rounding. Its FP8 path (fp8="rowwise" or "blockwise", bf16) against
expert_mlp's FP8 node on the same stacked weights, on the CPU emulation of the recipe and on an
H200. Skips without megatron-core."""
import inspect
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from support.fp8_oracle import ScaledGemmLog, rel
from expertact import moe as ea_moe

pytest.importorskip("megatron.core", reason="megatron-core 0.19.2 (Python >= 3.12) is not installed")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mpu():
    """One rank (gloo; NCCL on a GPU machine) and Megatron's model-parallel groups of size 1 (what SequentialMLP reads)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    made = not dist.is_initialized()
    if made:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        if torch.cuda.is_available():  # Megatron's layers run collectives on CUDA tensors there
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield ProcessGroupCollection.use_mpu_process_groups()
    parallel_state.destroy_model_parallel()
    if made:
        dist.destroy_process_group()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(num_layers=1, hidden_size=32, ffn_hidden_size=48, moe_ffn_hidden_size=48, num_attention_heads=4,
                num_moe_experts=4, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                bias_activation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32)
    base.update(kw)
    return TransformerConfig(**base)


def runnable_with_biases(module):
    """Megatron's SequentialMLP with add_bias_linear raises at TP = EP = 1: its MLP adds fc2's bias
    in place to the output of the TP reduce, which returns its input as is at TP 1 (autograd refuses
    the in-place change of a custom Function's view). With expert parallelism fc2 skips that reduce
    (explicit_expert_comm); setting it here takes the same path (the reduce is a no-op at TP 1)."""
    for m in module.modules():
        if hasattr(m, "explicit_expert_comm") and getattr(m, "is_expert", False):
            m.explicit_expert_comm = True
    return module


def _pair(cfg, pg, E=4, **options):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from expertact.megatron import ExpertMLP
    ref = SequentialMLP(E, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=pg)
    runnable_with_biases(ref)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "bias" in name else 4.0 / p.shape[-1] ** 0.5))
    ours = ExpertMLP(E, cfg, pg_collection=pg, **options)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _run(m, x, counts, probs):
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    y, bias = m(x, counts, probs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(y.device, y.dtype))
    grads = {n: p.grad for n, p in m.named_parameters()}
    return y.detach(), bias, x.grad, probs.grad, grads


def _gpt_oss():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    return dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                add_bias_linear=True)


CONFIGS = {"swiglu": {}, "swiglu-clamped": dict(activation_func_clamp_value=7.0),
           "swiglu-bias": dict(add_bias_linear=True), "gpt-oss": None}


MODES = {"default": {}, "recompute": dict(recompute=True), "inplace": dict(inplace_backward=True),
         "recompute-inplace": dict(recompute=True, inplace_backward=True)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", CONFIGS)
def test_matches_sequential_mlp_in_float32(mpu, which, mode):
    ref, ours = _pair(_config(**(CONFIGS[which] if CONFIGS[which] is not None else _gpt_oss())), mpu, **MODES[mode])
    counts = torch.tensor([10, 0, 17, 9])
    x = torch.randn(36, 32, generator=torch.Generator().manual_seed(1))
    probs = torch.rand(36, generator=torch.Generator().manual_seed(2))
    want = _run(ref, x, counts, probs)
    got = _run(ours, x, counts, probs)
    assert got[1] is None and want[1] is None
    for what, g, w in (("y", got[0], want[0]), ("x.grad", got[2], want[2]), ("probs.grad", got[3], want[3])):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5, msg=what)
    assert got[4].keys() == want[4].keys()
    for n in want[4]:
        torch.testing.assert_close(got[4][n], want[4][n], rtol=2e-5, atol=2e-5, msg=n)


def test_state_dict_round_trip(mpu):
    ref, ours = _pair(_config(add_bias_linear=True), mpu)
    sd = ours.state_dict()
    ref2, _ = _pair(_config(add_bias_linear=True), mpu)
    ref2.load_state_dict(sd, strict=False)
    for n, p in ref.state_dict().items():
        if p is not None:
            assert torch.equal(ref2.state_dict()[n], p), n


def test_refused_configs_name_the_field(mpu):
    from expertact.megatron import ExpertMLP, activation_of
    with pytest.raises(ValueError, match="config.gated_linear_unit=False"):
        activation_of(_config(gated_linear_unit=False))
    with pytest.raises(ValueError, match="config.activation_func=gelu"):
        activation_of(_config(activation_func=F.gelu))
    with pytest.raises(ValueError, match="config.glu_linear_offset=1.0 with activation_func silu"):
        activation_of(_config(glu_linear_offset=1.0))
    # Megatron's fused paths compute something else than its unfused path: refused, not guessed
    with pytest.raises(ValueError, match="activation_func_clamp_value=7.0 with bias_activation_fusion=True"):
        activation_of(_config(activation_func_clamp_value=7.0, bias_activation_fusion=True))
    with pytest.raises(ValueError, match="bias_activation_fusion=True with add_bias_linear=True and quick_gelu"):
        activation_of(_config(**_gpt_oss(), bias_activation_fusion=True))
    fused_no_bias = dict(_gpt_oss(), add_bias_linear=False, bias_activation_fusion=True)
    assert activation_of(_config(**fused_no_bias)) == ("swiglu_oai", 1.702, 7.0)  # the same function there
    with pytest.raises(ValueError, match="moe_apply_probs_on_input=True needs moe_router_topk=1"):
        ExpertMLP(4, _config(moe_apply_probs_on_input=True, moe_router_topk=2), pg_collection=mpu)
    with pytest.raises(ValueError, match="expertact.megatron: fp8='e4m3' is not an FP8 recipe"):
        ExpertMLP(4, _config(), pg_collection=mpu, fp8="e4m3")
    with pytest.raises(ValueError, match=r"expertact.megatron: fp8='rowwise_bf16' is not an FP8 recipe: the recipes "
                                         r"are 'rowwise' \(\+0\.076"):
        ExpertMLP(4, _config(), pg_collection=mpu, fp8="rowwise_bf16")
    assert ExpertMLP(4, _config(), pg_collection=mpu, fp8=True).expertact_options["fp8"] == "blockwise"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ea_moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match="expertact.megatron: fp8=True asks for the default FP8 recipe, and none"):
            ExpertMLP(4, _config(), pg_collection=mpu, fp8=True)


def test_probs_on_input_matches_sequential_mlp(mpu):
    """moe_apply_probs_on_input (top-1): the probability scales x, as in Megatron's experts."""
    ref, ours = _pair(_config(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True), mpu)
    counts = torch.tensor([5, 11, 0, 8])
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(3))
    probs = torch.rand(24, generator=torch.Generator().manual_seed(4))
    want, got = _run(ref, x, counts, probs), _run(ours, x, counts, probs)
    for i in (0, 2, 3):
        torch.testing.assert_close(got[i], want[i], rtol=2e-5, atol=2e-5)


def test_stacked_weights_are_not_kept(mpu):
    """The per-call stack of the experts' weights is made again in backward, not kept from
    forward to backward (Megatron's experts keep no copy of their weights)."""
    _, ours = _pair(_config(), mpu)
    x = torch.randn(36, 32, requires_grad=True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = ours(x, torch.tensor([10, 0, 17, 9]), torch.rand(36))
    assert shapes and (36, 32) in shapes
    assert not [s for s in shapes if len(s) == 3], shapes  # no [E, ., .] tensor kept
    y.sum().backward()
    assert all(p.grad is not None for p in ours.parameters())


def test_enable_switches_a_built_model(mpu):
    """enable(): every SequentialMLP of a built model becomes an ExpertMLP with its own
    parameters; disable() switches back; refusals happen before any module is switched."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from expertact import megatron as em
    ref, _ = _pair(_config(), mpu)
    other, _ = _pair(_config(), mpu)
    model = torch.nn.ModuleDict(dict(a=ref, b=other))
    # the inputs of test_matches_sequential_mlp_in_float32, seeded: drawn from the global generator,
    # an input can give a probs.grad element summed with cancellation, where the two modules'
    # float32 summation orders differ by 1.5e-4 (the precision itself is that test's)
    counts = torch.tensor([10, 0, 17, 9])
    x = torch.randn(36, 32, generator=torch.Generator().manual_seed(1))
    probs = torch.rand(36, generator=torch.Generator().manual_seed(2))
    want = _run(ref, x, counts, probs)
    params = [p for p in model.parameters()]
    assert em.enable(model, inplace_backward=True) == 2
    assert type(ref) is em.ExpertMLP and ref.expertact_options["inplace_backward"] is True
    assert [p for p in model.parameters()] == params  # the same Parameter objects
    got = _run(ref, x, counts, probs)
    for i in (0, 2, 3):
        torch.testing.assert_close(got[i], want[i], rtol=2e-5, atol=2e-5)
    assert em.enable(model, fp8="rowwise") == 2 and ref.expertact_options["fp8"] == "rowwise"
    with ScaledGemmLog() as log:  # the FP8 node runs (the CPU emulation; bf16 activations)
        ref(x.bfloat16().requires_grad_(), counts, probs)[0].float().sum().backward()
    log.check("rowwise")
    with pytest.raises(ValueError, match="fp8='e4m3' is not an FP8 recipe"):
        em.enable(model, fp8="e4m3")
    assert ref.expertact_options["fp8"] == "rowwise"  # refused before any change
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ea_moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match="fp8=True asks for the default FP8 recipe, and none is chosen"):
            em.enable(model, fp8=True)
    assert ref.expertact_options["fp8"] == "rowwise"  # refused before any change
    assert em.enable(model, fp8=True) == 2 and ref.expertact_options["fp8"] == "blockwise"
    assert em.disable(model) == 2 and type(ref) is SequentialMLP and not hasattr(ref, "expertact_options")
    bad, _ = _pair(_config(), mpu)
    bad.config = _config(activation_func=F.gelu)
    with pytest.raises(ValueError, match="activation_func=gelu"):
        em.enable(torch.nn.ModuleList([ref, bad]))
    assert type(ref) is SequentialMLP  # nothing switched

    class TEGroupedMLP(torch.nn.Module):
        pass
    with pytest.raises(ValueError, match="TEGroupedMLP"):
        em.enable(torch.nn.ModuleList([ref, TEGroupedMLP()]))


def _megatron_mlp64(ref, cfg, x, counts, probs):
    """Megatron's MLP forward (transformer/mlp.py, unfused path) per expert in float64, with the
    expert's probability multiplying h and fc2's bias, from SequentialMLP's parameters."""
    act = cfg.activation_func
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        ex = ref.local_experts[e]
        xe, pe = x[start:start + n].double(), probs[start:start + n].double()[:, None]
        h = xe @ ex.linear_fc1.weight.double().t()
        if ex.linear_fc1.bias is not None:
            h = h + ex.linear_fc1.bias.double()
        g, u = torch.chunk(h, 2, dim=-1)
        c = cfg.activation_func_clamp_value
        if c is not None:
            g, u = g.clamp(max=c), u.clamp(-c, c)
        h = act(g) * (u + cfg.glu_linear_offset) * pe
        y = h @ ex.linear_fc2.weight.double().t()
        if ex.linear_fc2.bias is not None:
            y = y + ex.linear_fc2.bias.double() * pe
        ys.append(y)
        start += n
    return torch.cat(ys)


@pytest.mark.parametrize("which", ["swiglu-bias", "gpt-oss"])
def test_biased_configs_match_megatrons_formula(mpu, which):
    """With expert biases, Megatron's MLP formula (transformer/mlp.py, read, not run) in float64 on
    the same parameters: where the probability multiplies, fc2's bias scaled by it."""
    cfg = _config(**(dict(add_bias_linear=True) if which == "swiglu-bias" else _gpt_oss()))
    ref, ours = _pair(cfg, mpu)
    counts = torch.tensor([10, 0, 17, 9])
    x = torch.randn(36, 32, generator=torch.Generator().manual_seed(1))
    probs = torch.rand(36, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _megatron_mlp64(ref, cfg, x, counts, probs)
        got, bias = ours(x, counts, probs)
    assert bias is None
    # float32 against float64: a few units of float32 rounding of the largest value
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def _by_hand(module, x, counts, probs, fp8):
    """expert_mlp on module's experts' weights stacked as ExpertMLP stacks them (in x's dtype),
    with leaves of its own: (y, x's, probs' and each parameter's gradient under its name)."""
    from expertact.megatron import activation_of
    from expertact.moe import expert_mlp
    preset, alpha, limit = activation_of(module.config)
    params = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
    E = module.num_local_experts

    def stack(what):
        return torch.stack([params[f"local_experts.{e}.{what}"] for e in range(E)]).to(x.dtype)
    x, probs = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    biased = module.config.add_bias_linear
    y = expert_mlp(x, stack("linear_fc1.weight").transpose(-2, -1), stack("linear_fc2.weight").transpose(-2, -1),
                   torch.cumsum(counts, 0, dtype=torch.int32), preset, alpha=alpha, limit=limit, layout="halves",
                   weights=probs.float(), b13=stack("linear_fc1.bias") if biased else None,
                   b2=stack("linear_fc2.bias") if biased else None, fp8=fp8)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(y.device, y.dtype))
    return y.detach(), None, x.grad, probs.grad, {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU"))])
@pytest.mark.parametrize("which", ["swiglu", "gpt-oss"])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise"])
def test_fp8_is_expert_mlps_recipe(mpu, which, device, recipe):
    """ExpertMLP(fp8=recipe) with bf16 activations runs expert_mlp's FP8 node on its stacked
    weights (test_fp8_mlp holds that node to the recipe's float64 oracle): the recipe's FP8 GEMMs
    (ScaledGemmLog.check), the output and the gradients of x, the probabilities and every parameter equal to
    expert_mlp(fp8=recipe) on the same stacked weights (the weights stacked again in backward
    are the same values), and differing from ExpertMLP's bf16 ones as FP8 must. On the CPU the
    recipe's emulation, on an H200 the recipe's GPU GEMMs. The layer spec's options build the
    same module."""
    from expertact.megatron import gpt_layer_local_spec
    cfg = _config(**(_gpt_oss() if which == "gpt-oss" else {}))
    _, bf16 = _pair(cfg, mpu)
    experts = gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, experts=dict(fp8=recipe))
    ours = experts.submodules.mlp.keywords["submodules"].experts(4, cfg, pg_collection=mpu)
    ours.load_state_dict(bf16.state_dict())
    ours.to(device), bf16.to(device)
    counts = torch.tensor([10, 0, 22, 16])  # 48 rows, one expert without any
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    probs = torch.rand(48, generator=torch.Generator().manual_seed(2)).to(device)
    with ScaledGemmLog() as log:
        got = _run(ours, x, counts, probs)
    log.check(recipe)
    want = _by_hand(ours, x, counts, probs, recipe)
    plain = _run(bf16, x, counts, probs)
    for i, what in ((0, "y"), (2, "x.grad"), (3, "probs.grad")):
        assert torch.equal(got[i], want[i]), what
        assert rel(got[i], plain[i]) > 2e-2, (what, rel(got[i], plain[i]))
    assert got[4].keys() == want[4].keys()
    for n, g in got[4].items():
        assert torch.equal(g, want[4][n]), n
        if "local_experts.1." not in n and not n.endswith("linear_fc2.bias"):  # expert 1 has no rows
            assert rel(g, plain[4][n]) > 2e-2, (n, rel(g, plain[4][n]))


def test_layer_spec_takes_expert_mlp():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from expertact.megatron import ExpertMLP, gpt_layer_local_spec, swap_experts
    spec = gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    experts = spec.submodules.mlp.keywords["submodules"].experts
    assert experts.func is ExpertMLP and experts.keywords["submodules"] is not None
    assert experts.keywords["inplace_backward"] is False and experts.keywords["fp8"] is None
    again, n = swap_experts(spec, inplace_backward=True)  # an ExpertMLP spec takes new options
    assert n == 1 and again.submodules.mlp.keywords["submodules"].experts.keywords["inplace_backward"] is True
    fp8 = gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, experts=dict(fp8="rowwise"))
    assert fp8.submodules.mlp.keywords["submodules"].experts.keywords["fp8"] == "rowwise"
    with pytest.raises(ValueError, match="fp8='e5m2'"):
        swap_experts(spec, fp8="e5m2")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ea_moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match="fp8=True asks for the default FP8 recipe, and none is chosen"):
            swap_experts(spec, fp8=True)
    blockwise = swap_experts(spec, fp8=True)[0]
    assert blockwise.submodules.mlp.keywords["submodules"].experts.keywords["fp8"] == "blockwise"
    assert swap_experts(spec, fp8=False)[0].submodules.mlp.keywords["submodules"].experts.keywords["fp8"] is None
    theirs = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    swapped, n = swap_experts(theirs)
    assert n == 1 and theirs.submodules.mlp.keywords["submodules"].experts.func is SequentialMLP  # untouched
    with pytest.raises(ValueError, match="no SequentialMLP experts"):
        gpt_layer_local_spec()  # a dense layer


def test_sharded_state_dict_is_sequential_mlps(mpu):
    """The distributed-checkpoint view: the same keys, global expert keys, shapes, offsets and
    replica ids as Megatron's SequentialMLP (ExpertMLP builds the same local experts)."""
    ref, ours = _pair(_config(add_bias_linear=True), mpu)
    prefix = "decoder.layers.0.mlp.experts."
    a, b = ref.sharded_state_dict(prefix=prefix), ours.sharded_state_dict(prefix=prefix)
    assert a.keys() == b.keys() and len(a) == 24

    def view(v):
        return (type(v).__name__, getattr(v, "key", None), getattr(v, "global_shape", None),
                getattr(v, "global_offset", None), getattr(v, "replica_id", None))
    assert all(view(a[k]) == view(b[k]) for k in a)
    assert any(getattr(v, "key", "").endswith("experts.linear_fc2.weight") for v in b.values())


@pytest.mark.parametrize("singleton", [False, True])
def test_distributed_checkpoint_round_trip(mpu, tmp_path, singleton):
    """A Megatron distributed checkpoint saved from SequentialMLP loads into ExpertMLP, and one
    saved from ExpertMLP loads into SequentialMLP (megatron.core.dist_checkpointing, torch_dist)."""
    from megatron.core import dist_checkpointing
    if not torch.cuda.is_available():
        pytest.skip("Megatron's distributed checkpoint writer calls CUDA (torch.cuda.current_device) on save")
    cfg = _config(add_bias_linear=True)
    ref, ours = _pair(cfg, mpu)
    ref.cuda(), ours.cuda()  # the checkpoint's collectives run over NCCL there
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()  # different from ref's
    meta = dict(singleton_local_shards=singleton)
    (tmp_path / "seq").mkdir()
    (tmp_path / "ours").mkdir()
    dist_checkpointing.save(ref.sharded_state_dict(metadata=meta), str(tmp_path / "seq"))
    ours.load_state_dict(dist_checkpointing.load(ours.sharded_state_dict(metadata=meta), str(tmp_path / "seq")))
    for (n, a), (m, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        assert n == m and (a is None or torch.equal(a, b)), n
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(2)
    dist_checkpointing.save(ours.sharded_state_dict(metadata=meta), str(tmp_path / "ours"))
    ref.load_state_dict(dist_checkpointing.load(ref.sharded_state_dict(metadata=meta), str(tmp_path / "ours")))
    for (n, a), (m, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        assert a is None or torch.equal(a, b), n


# ---------------------------------------------------------------------------
# On the GPU: SequentialMLP with expert biases, bf16, FP8 and whole GPT models
# ---------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_FORMS = {"swiglu": {}, "swiglu-clamped": dict(activation_func_clamp_value=7.0),
             "swiglu-bias": dict(add_bias_linear=True), "gpt-oss": "gpt-oss"}


def _gpu_config(which, **kw):
    extra = _gpt_oss() if GPU_FORMS[which] == "gpt-oss" else GPU_FORMS[which]
    return _config(**extra, hidden_size=128, ffn_hidden_size=192, moe_ffn_hidden_size=192, **kw)


@cuda
@pytest.mark.parametrize("mode", ["default", "inplace"])
@pytest.mark.parametrize("which", GPU_FORMS)
def test_gpu_float32_matches_sequential_mlp(mpu, which, mode):
    """Every form, expert biases included, float32 on the GPU:
    the output and every gradient equal to SequentialMLP's within rounding (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, ours = _pair(_gpu_config(which), mpu, **MODES[mode])
    ref.cuda(), ours.cuda()
    counts = torch.tensor([100, 0, 170, 93])
    x = torch.randn(363, 128, generator=torch.Generator().manual_seed(1)).cuda()
    probs = torch.rand(363, generator=torch.Generator().manual_seed(2)).cuda()
    want, got = _run(ref, x, counts, probs), _run(ours, x, counts, probs)
    for i, what in ((0, "y"), (2, "x.grad"), (3, "probs.grad")):
        torch.testing.assert_close(got[i], want[i].to(got[i].dtype), rtol=1e-4, atol=1e-4 * want[i].abs().max().item(),
                                   msg=what)
    for n in want[4]:
        w = want[4][n]
        torch.testing.assert_close(got[4][n], w, rtol=1e-4, atol=1e-4 * w.abs().max().item(), msg=n)


@cuda
@pytest.mark.parametrize("impl", ["expertact", "expertact-recompute", "expertact-inplace"])
@pytest.mark.parametrize("form", ["swiglu", "gpt-oss"])
def test_gpu_bf16_no_less_accurate_than_megatron(mpu, form, impl):
    """bf16: ExpertMLP's errors against Megatron's MLP in float32 (the same bf16 values) no larger
    than 1.25x SequentialMLP's own bf16 errors plus 2e-3. The bench's inputs and reference
    (expertact.bench.megatron) at a small shape. (FP8: test_fp8_is_expert_mlps_recipe.)"""
    from expertact import megatron as em
    from expertact.bench import megatron as bm
    inp = bm.ExpertsInputs(form, 4, 256, 256, 256, torch.bfloat16, torch.device("cuda"))
    inp.counts = torch.tensor([300, 0, 512, 212])
    ref = bm.reference32(inp)

    def fn(x, probs):
        return inp.module(x, inp.counts, probs)[0]
    theirs = bm.errors(fn, inp, ref)
    em.enable(inp.module, **bm.OPTIONS[impl])
    ours = bm.errors(fn, inp, ref)
    print(f"{form} {impl}: megatron {theirs} expertact {ours}")
    for k in bm.WHAT:
        assert ours[k] == ours[k] and theirs[k] == theirs[k], (k, ours, theirs)  # no NaN
        assert ours[k] <= 1.25 * theirs[k] + 2e-3, (k, ours[k], theirs[k])


def _gpt(spec_fn, dtype, **kw):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    cfg = _config(num_layers=2, hidden_size=128, ffn_hidden_size=256, moe_ffn_hidden_size=192, num_moe_experts=4,
                  moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                  moe_router_load_balancing_type="aux_loss", use_cpu_initialization=False, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    return GPTModel(config=cfg, transformer_layer_spec=spec_fn(num_experts=4, moe_grouped_gemm=False),
                    vocab_size=256, max_sequence_length=64).cuda()


def _gpt_step(model):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (4, 64), generator=gen).cuda()
    labels = torch.randint(0, 256, (4, 64), generator=gen).cuda()
    pos = torch.arange(64).cuda()[None].expand(4, -1)
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).cuda().triu(1)  # True: masked (causal)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@cuda
@pytest.mark.parametrize("which", ["swiglu", "gpt-oss"])
def test_gpu_whole_gpt_model_matches_megatrons(mpu, which):
    """A GPT model with MoE layers from Megatron's local spec (router, alltoall dispatcher, aux
    loss) against the same model from expertact.megatron.gpt_layer_local_spec, float32, the same
    weights: the loss and every parameter's gradient within rounding."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from expertact.megatron import ExpertMLP, gpt_layer_local_spec
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = _gpt_oss() if which == "gpt-oss" else {}
    theirs = runnable_with_biases(_gpt(get_gpt_layer_local_spec, torch.float32, **kw))
    ours = _gpt(gpt_layer_local_spec, torch.float32, **kw)
    assert sum(isinstance(m, ExpertMLP) for m in ours.modules()) == 2
    ours.load_state_dict(theirs.state_dict())
    (lt, gt), (lo, go) = _gpt_step(theirs), _gpt_step(ours)
    torch.testing.assert_close(lo, lt, rtol=1e-5, atol=0)
    assert gt.keys() == go.keys()
    for n in gt:
        if gt[n] is None:
            assert go[n] is None, n
            continue
        torch.testing.assert_close(go[n], gt[n], rtol=1e-4, atol=1e-4 * gt[n].abs().max().item(), msg=n)


@cuda
def test_gpu_enable_on_a_bf16_gpt_model_fp8(mpu):
    """enable(model, fp8=...) on a bf16 GPT model built from Megatron's own spec (router, alltoall
    dispatcher, Float16Module): in one training step each MoE layer's experts compute, on the
    inputs the model gave them, expert_mlp(fp8="rowwise")'s output on their stacked weights
    (within test_fp8_mlp's bound of 2e-3: the same recipe), and Megatron's own SequentialMLP's
    output on those inputs within FP8's error (e4m3 rounds each operand by up to 2^-4: about 6%
    relative on the CPU emulation at these sizes; a wrong expert, weight or activation errs by
    order 1); every expert weight gets a finite gradient."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 path runs on sm90")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from expertact import megatron as em
    from expertact.moe import expert_mlp
    from megatron.core.transformer.module import Float16Module
    gpt = _gpt(get_gpt_layer_local_spec, torch.bfloat16)
    model = Float16Module(gpt.config, gpt)  # as a bf16 training wraps it (its norms too)
    assert em.enable(model, fp8="rowwise") == 2
    calls = []

    def hook(module, args, kwargs, out):
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments.values()
        calls.append((module, tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in bound),
                      out[0].detach().clone()))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules() if isinstance(m, em.ExpertMLP)]
    with ScaledGemmLog() as log:
        loss, grads = _gpt_step(model)
    for h in handles:
        h.remove()
    assert len(calls) == 2 and log.calls == 12 and torch.isfinite(loss)
    for module, (x, tokens_per_expert, probs), y in calls:
        counts = torch.as_tensor(tokens_per_expert).cpu()
        with torch.no_grad():
            w13 = torch.stack([e.linear_fc1.weight for e in module.local_experts]).to(x.dtype).transpose(-2, -1)
            w2 = torch.stack([e.linear_fc2.weight for e in module.local_experts]).to(x.dtype).transpose(-2, -1)
            recipe = expert_mlp(x, w13, w2, torch.cumsum(counts, 0, dtype=torch.int32), module.preset, alpha=module.alpha,
                                limit=module.limit, weights=probs.float(), fp8="rowwise")
            theirs = SequentialMLP.forward(module, x, tokens_per_expert, probs)[0]
        assert rel(y, recipe) < 2e-3, rel(y, recipe)
        assert rel(y, theirs) < 0.15, rel(y, theirs)
    experts = [g for n, g in grads.items() if ".experts." in n]
    assert experts and all(g is not None and torch.isfinite(g).all() for g in experts)


def test_bench_table_on_the_cpu(mpu, tmp_path):
    """python -m expertact.bench --megatron on the CPU: every row, errors at float32 rounding, FP8
    skipped with its reason."""
    import json
    from expertact import moe
    from expertact.bench import megatron as bm
    assert bm.main(["--device", "cpu", "--quick", "--json", str(tmp_path / "m.json")]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "m.json").read_text())["tables"]["4x3072"]["results"]}
    assert set(rows) == set(bm.IMPLS)
    assert [bm.OPTIONS[row]["fp8"] for row in bm.FP8_ROWS] == list(moe.FP8_RECIPES)
    for row in ("expertact-fp8", "expertact-fp8-bf16-wgrad", "expertact-fp8-promoted-wgrad", "expertact-fp8-blockwise"):
        assert rows[row].get("skipped") and "cpu" in rows[row]["error"], rows[row]
    for impl in ("megatron", "expertact", "expertact-recompute", "expertact-inplace"):
        assert max(rows[impl]["err"].values()) < 1e-5, rows[impl]


def test_training_example_arguments():
    """examples/megatron_moe.py's options (the run itself needs CUDA: Megatron's router)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "megatron_moe.py"
    spec = importlib.util.spec_from_file_location("megatron_moe_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = mod.parse_args(["--impl", "megatron,expertact-fp8", "--config", "tiny", "--steps", "5"])
    assert a.impls == ["megatron", "expertact-fp8"] and a.sizes["steps"] == 5
    a = mod.parse_args(["--impl", "megatron,megatron-eager", "--activation", "gpt-oss"])
    assert a.impls == ["megatron", "megatron-eager"]
    for bad in (["--impl", "megatron,nope"], ["--impl", "megatron,megatron"], ["--impl", "x", "--steps", "0"],
                ["--impl", "megatron-eager"], ["--impl", "megatron-fused", "--activation", "gpt-oss"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


def test_bench_gpt_oss_rows_on_the_cpu(mpu):
    """The benchmark's GPT-OSS form (expert biases; Megatron's reference on fc2's expert-parallel
    path) on the CPU: Megatron's and expertact's errors against the float32 reference at rounding."""
    from expertact import megatron as em
    from expertact.bench import megatron as bm
    inp = bm.ExpertsInputs("gpt-oss", 4, 32, 64, 64, torch.float32, torch.device("cpu"))
    ref = bm.reference32(inp)

    def fn(x, probs):
        return inp.module(x, inp.counts, probs)[0]
    theirs = bm.errors(fn, inp, ref)
    em.enable(inp.module)
    ours = bm.errors(fn, inp, ref)
    assert max(theirs.values()) < 1e-6 and max(ours.values()) < 1e-5, (theirs, ours)


def test_a_rank_with_no_rows(mpu):
    """No token routed to this rank's experts: an empty output, zero weight gradients, as
    SequentialMLP gives."""
    ref, ours = _pair(_config(), mpu)
    counts, x, probs = torch.tensor([0, 0, 0, 0]), torch.zeros(0, 32), torch.zeros(0)
    want, got = _run(ref, x, counts, probs), _run(ours, x, counts, probs)
    assert got[0].shape == want[0].shape == (0, 32)
    for n, g in got[4].items():
        w = want[4][n]
        assert (g is None or not g.any()) and (w is None or not w.any()), n
