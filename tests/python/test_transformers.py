"""expertact.transformers: the "expertact" experts implementation of Hugging Face transformers
against transformers' own "eager" experts, on tiny random models of each supported family
(Qwen3-MoE with SiLU and with tanh GELU, Mixtral, DeepSeek-V3, MiniMax-M3, and GPT-OSS with
non-zero expert biases, with its clamp limit of 7 and of 1, and with its biases switched off):
loss, logits and every parameter's gradient (the expert biases' included) after one forward
and backward in train mode, in each memory mode; expert-parallel sentinel ids; the registry;
the errors for what is not supported (other activations and gates, biases missing or of the
wrong shape); register(..., fp8="rowwise") against the FP8 recipe's float64 oracle (bf16, the
CPU emulation of the recipe).
CPU, float32; skipped where transformers (>= 5, with its experts registry) is not installed."""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
_hf_moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(_hf_moe, "ALL_EXPERTS_FUNCTIONS"):
    pytest.skip("transformers has no experts registry (needs transformers >= 5)", allow_module_level=True)

import transformers  # noqa: E402

import expertact.transformers as et  # noqa: E402
from expertact import moe as ea_moe  # noqa: E402

# Largest absolute error of each compared tensor (loss, logits, one parameter's gradient),
# relative to that tensor's largest magnitude. Both sides compute in float32 (unit roundoff
# 6e-8); what legitimately differs is the order of the sums: per-expert GEMMs over rows in
# another order, the routing weight applied to h or to the down projection's output (the
# same function without expert biases), the K contributions summed in another order, alpha
# taken as a float32. Measured on these models (CPU, transformers 5.17, torch 2.13): 1.9e-6
# or less (GPT-OSS without biases), 8.7e-7 or less for the others, GPT-OSS with its biases
# included. A wrong gate misses by orders of magnitude: MiniMax-M3's clamp limit 1% too high
# errs by 0.1 on a gradient, 0.1% too high by 4.6e-3 (test_a_wrong_gate_fails shows the first
# failing); GPT-OSS's gate_up bias read as halves, or either bias left out, errs by 0.7 or more
# of the logits (test_a_wrong_bias_fails). NaN or Inf never passes.
RTOL = 1e-5

VOCAB, SEQ, BATCH = 64, 12, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _minimax_m3():
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig
    # A clamp limit of 1 (the checkpoint's is 7) puts many gate and up values past it with
    # these weights: the clamps, alpha and the +1 all shape the result.
    cfg = MiniMaxM3VLTextConfig(**COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                dense_intermediate_size=48, shared_intermediate_size=16, rotary_dim=8,
                                swiglu_alpha=1.5, swiglu_limit=1.0)
    return MiniMaxM3VLForCausalLM(cfg)


def _qwen3_moe(hidden_act="silu"):
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                      hidden_act=hidden_act)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def _deepseek_v3():
    cfg = transformers.DeepseekV3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"}, intermediate_size=48,
                                        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                                        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
                                        qk_nope_head_dim=8)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _gpt_oss():
    cfg = transformers.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
    return transformers.GptOssForCausalLM(cfg)


def _gpt_oss_limit_1():
    """GPT-OSS with the clamp limit 1 instead of 7: many biased gate and up values lie past it,
    so the clamps (after the bias) shape the result."""
    model = _gpt_oss()
    for m in _experts(model):
        m.limit = 1.0
    return model


def _gpt_oss_without_biases():
    """GPT-OSS with its expert biases zeroed and has_bias switched off on each experts module
    (what transformers' grouped_mm computes then too): the interleaved, stored-transposed
    swiglu_oai mapping without the bias arguments. limit 1 exercises the clamps. The zero
    biases are frozen: eager adds them (and would give them a gradient) whatever has_bias says."""
    model = _gpt_oss_limit_1()
    for m in _experts(model):
        with torch.no_grad():
            m.gate_up_proj_bias.zero_()
            m.down_proj_bias.zero_()
        m.gate_up_proj_bias.requires_grad_(False)
        m.down_proj_bias.requires_grad_(False)
        m.has_bias = False
    return model


MODELS = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_moe_gelu_tanh": lambda: _qwen3_moe("gelu_pytorch_tanh"),
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "minimax_m3": _minimax_m3,
    "gpt_oss": _gpt_oss,
    "gpt_oss_limit_1": _gpt_oss_limit_1,
    "gpt_oss_without_biases": _gpt_oss_without_biases,
}

MODES = {
    "plain": {},
    "recompute": dict(recompute=True),
    "inplace": dict(inplace_backward=True),
    "recompute+inplace": dict(recompute=True, inplace_backward=True),
}
MODE_NAMES = {"plain": "expertact"} | {m: f"expertact_test_{m.replace('+', '_')}" for m in MODES if m != "plain"}


@pytest.fixture(scope="module", autouse=True)
def _setup():
    """The memory-mode variants registered; one intra-op thread: these tensors are tiny, and
    on a loaded machine idle OpenMP workers made a train step of these models take seconds
    instead of ~10 ms."""
    for mode, kw in MODES.items():
        if mode != "plain":
            et.register(MODE_NAMES[mode], **kw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def _build(name, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name]().float().train()
    # Expert weights large enough that gate_up spreads over several units (RMS-normed inputs,
    # D = 32: std ~1.4), so that SiLU's and GELU's curvature and the clamps matter. Expert
    # biases (GPT-OSS) drawn at random too: the model's initialisation may leave them zero,
    # which would not tell a bias added in the wrong place or column from none.
    with torch.no_grad():
        for m in _experts(model):
            m.gate_up_proj.normal_(0.0, 0.25)
            m.down_proj.normal_(0.0, 0.25)
            if m.has_bias:
                m.gate_up_proj_bias.normal_(0.0, 0.5)
                m.down_proj_bias.normal_(0.0, 0.5)
    return model


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _step(model, impl, ids):
    """Loss, logits and every parameter's gradient (None where there is none) of one train step."""
    model.set_experts_implementation(impl)
    assert model.config._experts_implementation == impl
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def _close(got, want, what, rtol=RTOL):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(want).all(), f"{what}: the eager reference is not finite"
    assert torch.isfinite(got).all(), f"{what}: NaN or Inf"
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * max |eager| {scale:.3g}"
    return err / scale if scale else 0.0


def _compare(got, want):
    loss, logits, grads = got
    rel = {"loss": _close(loss, want[0], "loss"), "logits": _close(logits, want[1], "logits")}
    assert grads.keys() == want[2].keys()
    for n, g in grads.items():
        w = want[2][n]
        assert (g is None) == (w is None), f"{n}: gradient {'missing' if g is None else 'unexpected'}"
        if g is not None:
            rel[n] = _close(g, w, f"gradient of {n}")
    return rel


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_eager(name):
    model = _build(name)
    ids = _inputs()
    eager = _step(model, "eager", ids)
    experts = [n for n, p in model.named_parameters() if ".experts." in n and p.requires_grad]
    assert experts and all(eager[2][n] is not None and eager[2][n].abs().max() > 0 for n in experts)
    biases = [n for n in experts if n.endswith("_proj_bias")]
    assert bool(biases) == (name in ("gpt_oss", "gpt_oss_limit_1"))
    # The routers get the routing weights' gradient from the experts: it must reach them.
    routers = [n for n, g in eager[2].items() if (".gate." in n or ".router." in n) and g is not None]
    assert routers and any(eager[2][n].abs().max() > 0 for n in routers)
    for mode in MODES:
        got = _step(model, MODE_NAMES[mode], ids)
        rel = _compare(got, eager)
        print(f"{name} {mode}: largest relative error {max(rel.values()):.2g}")


def test_deterministic():
    model = _build("mixtral")
    ids = _inputs()
    a, b = _step(model, "expertact", ids), _step(model, "expertact", ids)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][n], b[2][n]) for n in a[2] if a[2][n] is not None)


def test_a_wrong_gate_fails(monkeypatch):
    """The tolerance catches a gate off by little: MiniMax-M3's clamp limit 1% too high."""
    model = _build("minimax_m3")
    ids = _inputs()
    eager = _step(model, "eager", ids)
    right = et._minimax_m3_gate
    monkeypatch.setitem(et._GATES, "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl."
                        "MiniMaxM3VLExperts._apply_gate", lambda m: right(m)._replace(limit=1.01))
    with pytest.raises(AssertionError, match="max error"):
        _compare(_step(model, "expertact", ids), eager)


def test_a_wrong_bias_fails(monkeypatch):
    """The tolerance catches GPT-OSS's biases misused: gate_up_proj_bias read as halves instead
    of interleaved (its gate and up entries swapped over), or down_proj_bias left out."""
    model = _build("gpt_oss")
    ids = _inputs()
    eager = _step(model, "eager", ids)
    right = et._biases_of

    def halves(module, w13):
        b13, b2 = right(module, w13)
        return torch.cat((b13[:, 0::2], b13[:, 1::2]), dim=1), b2

    for wrong in (halves, lambda module, w13: (right(module, w13)[0], None)):
        monkeypatch.setattr(et, "_biases_of", wrong)
        with pytest.raises(AssertionError, match="max error"):
            _compare(_step(model, "expertact", ids), eager)


# ---------------------------------------------------------------------------
# The experts module called directly: sentinels, dtypes, shapes
# ---------------------------------------------------------------------------


def _module_case(name="qwen3_moe", T=20, seed=2):
    model = _build(name)
    experts = _experts(model)[0]
    E, K, D = experts.gate_up_proj.shape[0], 2, model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    return experts, x, ids, w


CALL_OUTPUTS = ("y", "x grad", "weights grad", "gate_up_proj grad", "down_proj grad", "gate_up_proj_bias grad",
                "down_proj_bias grad")


def _call(experts, impl, x, ids, w, weight_mask=None):
    """Output and the gradients of x, the routing weights, gate_up_proj and down_proj (and of
    the expert biases when the module has them)."""
    experts.config._experts_implementation = impl
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    y = experts(x, ids, w if weight_mask is None else w * weight_mask)
    dy = torch.linspace(-1, 1, y.numel()).view_as(y)
    y.backward(dy)
    out = (y.detach(), x.grad, w.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())
    if experts.has_bias:
        out += (experts.gate_up_proj_bias.grad.clone(), experts.down_proj_bias.grad.clone())
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "minimax_m3", "gpt_oss"])
def test_sentinel_ids_contribute_nothing(name):
    """Ids >= E (expert parallelism's sentinels) against eager with those pairs' weights zeroed
    (eager refuses the ids themselves), and against transformers' grouped_mm, which takes them."""
    experts, x, ids, w = _module_case(name)
    E = experts.gate_up_proj.shape[0]
    sentinel = torch.zeros_like(ids, dtype=torch.bool)
    sentinel[::3, 0] = True
    sentinel[5] = True  # a token with no expert at all
    ids_s = torch.where(sentinel, torch.full_like(ids, E) + torch.arange(ids.numel()).view_as(ids) % 3, ids)
    assert (ids_s >= E).sum() == sentinel.sum()
    got = _call(experts, "expertact", x, ids_s, w)
    want = _call(experts, "eager", x, torch.where(sentinel, 0, ids), w, weight_mask=(~sentinel).float())
    grouped = _call(experts, "grouped_mm", x, ids_s, w)
    assert len(got) == len(want) == len(grouped) == (7 if name == "gpt_oss" else 5)
    for what, g, e, gm in zip(CALL_OUTPUTS, got, want, grouped):
        _close(g, e, what)
        _close(g, gm, what + " (against grouped_mm)")
    assert torch.all(got[0][5] == 0) and torch.all(got[1][5] == 0)
    assert torch.all(got[2][sentinel] == 0)


def test_all_sentinels_and_no_tokens():
    experts, x, ids, w = _module_case()
    E = experts.gate_up_proj.shape[0]
    y, dx, dw, dgu, dd = _call(experts, "expertact", x, torch.full_like(ids, E), w)
    for t in (y, dx, dw, dgu, dd):
        assert torch.all(t == 0)
    y, dx, dw, *_ = _call(experts, "expertact", x[:0], ids[:0], w[:0])
    assert y.shape == (0, x.shape[1]) and dx.shape == (0, x.shape[1]) and dw.shape == (0, 2)


def test_negative_id_raises():
    experts, x, ids, w = _module_case()
    ids[3, 1] = -1
    experts.config._experts_implementation = "expertact"
    with pytest.raises(ValueError, match="negative expert id"):
        experts(x, ids, w)


@pytest.mark.parametrize("name,weights_dtype", [("minimax_m3", torch.float32), ("gpt_oss", torch.bfloat16)])
def test_bf16_and_routing_weights_dtype(name, weights_dtype):
    """bf16 weights and hidden states; float32 routing weights (MiniMax's router gives float32)
    or bf16 ones (GPT-OSS's router gives them in the model's dtype): the output is bf16, close
    to eager's within bf16 rounding, the routing weights' gradient in their dtype."""
    experts, x, ids, w = _module_case(name)
    experts.to(torch.bfloat16)
    xb, w = x.to(torch.bfloat16), w.to(weights_dtype)
    got = _call(experts, "expertact", xb, ids, w)
    want = _call(experts, "eager", xb, ids, w)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16 and got[2].dtype == weights_dtype
    assert len(got) == len(want) == (7 if name == "gpt_oss" else 5)
    for what, g, e in zip(CALL_OUTPUTS, got, want):
        _close(g.float(), e.float(), what, rtol=3e-2)


# ---------------------------------------------------------------------------
# FP8: register(..., fp8=a recipe's name or True), on the CPU as the recipe's emulation
# ---------------------------------------------------------------------------

# The experts' forms, written out: (preset, layout, alpha and limit from the module's attributes).
_FP8_FORMS = {"qwen3_moe": ("swiglu", "halves", None, None), "gpt_oss": ("swiglu_oai", "interleaved", "alpha", "limit")}


def _fp8_oracle(experts, x, ids, w, dy, name, recipe="rowwise"):
    """The FP8 recipe's float64 oracle (support.fp8_oracle) of an experts call: the (token, k)
    pairs sorted by expert, the oracle's expert MLP over them, each token's K outputs summed and
    rounded to bf16 as transformers' implementations sum them; the gradients of x (its K copies
    summed), the routing weights, and of the experts' parameters in their storage order."""
    from support import fp8_oracle
    preset, layout, alpha, limit = _FP8_FORMS[name]
    E, K, T = experts.gate_up_proj.shape[0], ids.shape[1], x.shape[0]
    order = torch.sort(ids.reshape(-1), stable=True).indices
    tok = order // K
    ends = torch.bincount(ids.reshape(-1), minlength=E).cumsum(0).tolist()
    stored = lambda t: t if experts.is_transposed else t.transpose(-2, -1)  # noqa: E731
    kw = {} if alpha is None else dict(alpha=getattr(experts, alpha), limit=getattr(experts, limit))
    biases = dict(b13=experts.gate_up_proj_bias.detach(), b2=experts.down_proj_bias.detach()) if experts.has_bias else {}
    o = fp8_oracle.expert_mlp(x[tok], stored(experts.gate_up_proj.detach()), stored(experts.down_proj.detach()), ends,
                              dy[tok], preset, layout=layout, weights=w.reshape(-1)[order].float(), recipe=recipe,
                              **biases, **kw)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    y = o["y"][back].view(T, K, -1).sum(1).to(torch.bfloat16)
    out = dict(y=y, x=o["x"][back].view(T, K, -1).sum(1).to(torch.bfloat16), weights=o["weights"][back].view(T, K),
               gate_up_proj=stored(o["w13"]), down_proj=stored(o["w2"]))
    if experts.has_bias:
        out.update(gate_up_proj_bias=o["b13"], down_proj_bias=o["b2"])
    return out


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise"])
@pytest.mark.parametrize("name", list(_FP8_FORMS))
def test_fp8_gives_the_recipes_values(name, recipe):
    """register(name, fp8=recipe) runs the FP8 node (on the CPU its emulation): the recipe's FP8
    GEMMs (ScaledGemmLog.check), the output and the gradients of x, the routing weights and the experts' parameters
    (GPT-OSS's biases included) within test_fp8_mlp's bound of the recipe's float64 oracle, and
    differing from the bf16 implementation's as FP8 must. A bf16 model (FP8 takes bf16).
    Measured (CPU, transformers 5.17): every bf16 tensor equal to the oracle's, the routing
    weights' gradient within 1e-7 (rowwise); the bf16 implementation 5.7e-2 or more away from each."""
    from support.fp8_oracle import ScaledGemmLog, rel
    et.register("expertact_test_fp8", fp8=recipe)
    assert _hf_moe.ALL_EXPERTS_FUNCTIONS["expertact_test_fp8"].fp8 == recipe
    experts, x, ids, w = _module_case(name, T=24)
    experts.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    params = ["gate_up_proj", "down_proj"] + (["gate_up_proj_bias", "down_proj_bias"] if experts.has_bias else [])

    def call(impl):
        experts.config._experts_implementation = impl
        experts.zero_grad(set_to_none=True)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = experts(xr, ids, wr)
        y.backward(dy)
        return dict(y=y.detach(), x=xr.grad, weights=wr.grad, **{n: getattr(experts, n).grad for n in params})

    with ScaledGemmLog() as log:
        got = call("expertact_test_fp8")
    log.check(recipe)
    want = _fp8_oracle(experts, x, ids, w, dy, name, recipe)
    bf16 = call("expertact")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.isfinite(got[k]).all(), k
        assert rel(got[k], want[k]) < 2e-3, (k, rel(got[k], want[k]))  # test_fp8_mlp.TIGHT
        if k != "down_proj_bias":  # its gradient is dy's sum, which FP8 does not touch
            assert rel(got[k], bf16[k]) > 2e-2, (k, rel(got[k], bf16[k]))  # test_fp8_mlp.LOWER


def test_fp8_names(monkeypatch):
    """fp8=True registers the default recipe ("blockwise"), refused while none is chosen; an
    unknown name is refused (nothing registered), naming the recipes and their cost."""
    with monkeypatch.context() as m:
        m.setattr(ea_moe, "DEFAULT_FP8_RECIPE", None)
        with pytest.raises(ValueError, match=r"expertact.transformers.register: fp8=True asks for the default FP8 "
                                             r"recipe, and none is chosen"):
            et.register("expertact_test_fp8_true", fp8=True)
    assert "expertact_test_fp8_true" not in _hf_moe.ALL_EXPERTS_FUNCTIONS
    assert et.register("expertact_test_fp8_true", fp8=True).fp8 == "blockwise"
    with pytest.raises(ValueError, match=r"expertact.transformers.register: fp8='e4m3' is not an FP8 recipe: the "
                                         r"recipes are 'rowwise' \(\+0\.076"):
        et.register("expertact_test_fp8_bad", fp8="e4m3")
    assert "expertact_test_fp8_bad" not in _hf_moe.ALL_EXPERTS_FUNCTIONS
    assert et.register("expertact_test_fp8_off", fp8=False).fp8 is None


# ---------------------------------------------------------------------------
# Registry and loading
# ---------------------------------------------------------------------------


def test_registered():
    fns = _hf_moe.ALL_EXPERTS_FUNCTIONS
    assert et.DEFAULT_NAME == "expertact" and "expertact" in fns
    assert fns["expertact"].recompute is False and fns["expertact"].inplace_backward is False
    fn = et.register("expertact_test_both", recompute=True, inplace_backward=True)
    assert _hf_moe.ExpertsInterface()["expertact_test_both"] is fn  # a new interface instance sees it too
    assert fn.recompute and fn.inplace_backward
    for taken in ("eager", "grouped_mm", "batched_mm"):
        with pytest.raises(ValueError, match="already an experts implementation"):
            et.register(taken)
    with pytest.raises(ValueError, match="non-empty string"):
        et.register("")


def test_from_pretrained(tmp_path):
    model = _build("qwen3_moe")
    model.save_pretrained(tmp_path)
    ids = _inputs()
    want = _step(model, "eager", ids)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="expertact",
                                                               dtype=torch.float32).train()
    assert loaded.config._experts_implementation == "expertact"
    model.load_state_dict(loaded.state_dict())  # the same weights, whatever loading did
    _compare(_step(loaded, "expertact", ids), want)


# ---------------------------------------------------------------------------
# What is refused
# ---------------------------------------------------------------------------


def test_bias_refusals():
    experts, x, ids, w = _module_case()
    m = copy.deepcopy(experts)
    m.has_bias = True  # a class declaring biases it does not hold
    with pytest.raises(NotImplementedError, match=r"Qwen3MoeExperts declares has_bias=True but has no gate_up_proj_bias"):
        et.experts_forward(m, x, ids, w)
    experts, x, ids, w = _module_case("gpt_oss")
    m = copy.deepcopy(experts)
    m.down_proj_bias = nn.Parameter(m.down_proj_bias.detach()[:, :-1])
    with pytest.raises(ValueError, match=r"GptOssExperts: gate_up_proj_bias \(8, 32\) and down_proj_bias \(8, 31\)"):
        et.experts_forward(m, x, ids, w)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_python_tanh", "relu"])
def test_other_activation_refused(hidden_act):
    torch.manual_seed(0)
    model = _qwen3_moe(hidden_act)
    model.set_experts_implementation("expertact")
    with pytest.raises(NotImplementedError, match=r"Qwen3MoeExperts\.act_fn is .*grouped_mm"):
        model(input_ids=_inputs())


def test_refusals_name_the_class():
    experts, x, ids, w = _module_case()
    experts.config._experts_implementation = "expertact"

    def fails(module, match):
        with pytest.raises(NotImplementedError, match=match):
            et.experts_forward(module, x, ids, w)

    m = copy.deepcopy(experts)
    m.has_gate = False
    fails(m, r"Qwen3MoeExperts has no gate \(has_gate=False")
    m = copy.deepcopy(experts)
    m.is_concatenated = False
    fails(m, r"Qwen3MoeExperts declares is_concatenated=False")
    m = copy.deepcopy(experts)
    del m.act_fn
    fails(m, "Qwen3MoeExperts uses transformers' default gate .* no act_fn")

    class ScaledExperts(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return 2 * self.act_fn(gate) * up

    m = copy.deepcopy(experts)
    m.__class__ = ScaledExperts
    fails(m, r"ScaledExperts computes its own gate \(.*ScaledExperts\._apply_gate\)")

    class SiLUSubclass(nn.SiLU):
        pass

    m = copy.deepcopy(experts)
    m.act_fn = SiLUSubclass()
    fails(m, r"Qwen3MoeExperts\.act_fn is .*SiLUSubclass")

    class Bare(nn.Module):
        pass

    fails(Bare(), r"Bare has no has_gate, has_bias, is_transposed, is_concatenated")

    m = copy.deepcopy(experts)
    m.gate_up_proj = nn.Parameter(m.gate_up_proj.detach()[:, :, :-1])
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts: gate_up_proj .* do not match hidden size D = 32"):
        et.experts_forward(m, x, ids, w)
