"""expertact.megatron.ExpertMLP against Megatron-Core's own SequentialMLP (megatron-core 0.19.2,
Python >= 3.12) on the CPU, float32: the same state dict, the same inputs, the output and every
gradient within float32 rounding. Skips without megatron-core."""
import os
import socket

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core 0.19.2 (Python >= 3.12) is not installed")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mpu():
    """One gloo rank and Megatron's model-parallel groups of size 1 (what SequentialMLP reads)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    made = not dist.is_initialized()
    if made:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
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


def _pair(cfg, pg, E=4, **options):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from expertact.megatron import ExpertMLP
    ref = SequentialMLP(E, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=pg)
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
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)))
    grads = {n: p.grad for n, p in m.named_parameters()}
    return y.detach(), bias, x.grad, probs.grad, grads


def _gpt_oss():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    return dict(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                add_bias_linear=True)


# SequentialMLP itself runs on the CPU without expert biases only: with add_bias_linear=True its
# MLP adds fc2's bias in place on a view (transformer/mlp.py) and autograd refuses it.
CONFIGS = {"swiglu": {}, "swiglu-clamped": dict(activation_func_clamp_value=7.0)}


MODES = {"default": {}, "recompute": dict(recompute=True), "inplace": dict(inplace_backward=True),
         "recompute-inplace": dict(recompute=True, inplace_backward=True)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", CONFIGS)
def test_matches_sequential_mlp_in_float32(mpu, which, mode):
    ref, ours = _pair(_config(**CONFIGS[which]), mpu, **MODES[mode])
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
    with pytest.raises(ValueError, match="fp8='e4m3'"):
        ExpertMLP(4, _config(), pg_collection=mpu, fp8="e4m3")


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
    counts, x, probs = torch.tensor([10, 0, 17, 9]), torch.randn(36, 32), torch.rand(36)
    want = _run(ref, x, counts, probs)
    params = [p for p in model.parameters()]
    assert em.enable(model, inplace_backward=True) == 2
    assert type(ref) is em.ExpertMLP and ref.expertact_options["inplace_backward"] is True
    assert [p for p in model.parameters()] == params  # the same Parameter objects
    got = _run(ref, x, counts, probs)
    for i in (0, 2, 3):
        torch.testing.assert_close(got[i], want[i], rtol=2e-5, atol=2e-5)
    assert em.enable(model, fp8="rowwise") == 2 and ref.expertact_options["fp8"] == "rowwise"
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
    """With expert biases (SequentialMLP fails on the CPU there): Megatron's MLP formula in float64
    on the same parameters; SequentialMLP itself is the reference on a GPU."""
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
