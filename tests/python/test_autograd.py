"""Autograd integration: gradcheck, torch.library.opcheck of every operator,
create_graph, the in-place backward and its guards, torch.compile(fullgraph=True)."""
import math

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

import expertact
from conftest import DEVICES, LAYOUTS, PRESETS, call, make_inputs, preset_params, reference, split

ops = torch.ops.expertact
LAYOUT_CODE = {"separate": 0, "halves": 1, "up_first": 2, "interleaved": 3}


def _float64_supported():
    try:
        expertact.swiglu(torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
        return True
    except TypeError:
        return False


def _away_from_kinks(t, limit, margin=0.05):
    """Moves values off +-limit so that finite differences never straddle a clamp's kink."""
    near = (t.abs() - limit).abs() < margin
    return torch.where(near, t + 3 * margin * torch.sign(t), t)


def _gradcheck_case(preset, layout, dtype):
    act, alpha, limit, beta = preset_params(preset, alpha=1.702, limit=2.0)
    gen = torch.Generator().manual_seed(3)
    shape = (5, 6) if layout == "separate" else (5, 12)
    xs = [_away_from_kinks(torch.randn(shape, generator=gen, dtype=torch.float64) * 2, 2.0).to(dtype)
          .requires_grad_() for _ in range(2 if layout == "separate" else 1)]
    w = (torch.rand(5, generator=gen, dtype=torch.float64) + 0.5).float().requires_grad_()
    kw = dict(activation=act, alpha=alpha, limit=limit, beta=beta, weights=w)
    if layout == "separate":
        def fn(g, u, w):
            return expertact.glu(g, u, **{**kw, "weights": w})
    else:
        def fn(gu, w):
            return expertact.glu(gu, layout=layout, **{**kw, "weights": w})
    return fn, (*xs, w)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_gradcheck_float32(preset, layout):
    """The library computes in float32 (float64 tensors are refused), so gradcheck runs on float32
    inputs with a finite-difference step and tolerances sized for float32."""
    fn, args = _gradcheck_case(preset, layout, torch.float32)
    assert torch.autograd.gradcheck(fn, args, eps=1e-2, atol=2e-3, rtol=2e-3, nondet_tol=0.0,
                                    check_undefined_grad=True)


@pytest.mark.skipif(not _float64_supported(), reason="the C library has no float64 path yet (docs/spec.md section 1: float32/16/bf16)")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_gradcheck_float64(preset, layout):
    """float64 runs on the CPU in float64 arithmetic. The weights stay float32 (as docs/spec.md
    defines them), so they enter as a constant here; their gradient is checked by the
    float32 gradcheck above."""
    fn, args = _gradcheck_case(preset, layout, torch.float64)
    xs = tuple(a.detach().double().requires_grad_() for a in args[:-1])
    w = args[-1].detach()
    assert torch.autograd.gradcheck(lambda *x: fn(*x, w), xs)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_catches_a_wrong_gradient(layout):
    """The float32 gradcheck tolerances are tight enough to fail a wrong derivative."""
    fn, args = _gradcheck_case("swiglu_oai", layout, torch.float32)

    def wrong(*a):  # alpha 1.702 forward, but the gradient of alpha 1.75
        out = fn(*a)
        bumped = expertact.glu(*a[:-1], layout=None if layout == "separate" else layout, alpha=1.75, limit=2.0,
                               beta=1.0, weights=a[-1])
        return out.detach() + bumped - bumped.detach()

    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(wrong, args, eps=1e-2, atol=2e-3, rtol=2e-3)


def _opcheck_samples(device):
    gen = torch.Generator().manual_seed(0)

    def t(*shape, dtype=torch.float32):
        return (torch.randn(shape, generator=gen) * 4).to(dtype).to(device)

    w = (torch.rand(3, 5, generator=gen) + 0.5).to(device)
    yield "glu separate weights", ops.glu.default, (
        t(3, 5, 8).requires_grad_(), t(3, 5, 8).requires_grad_(), w.clone().requires_grad_(), 0, 0, 1.702, 7.0, 1.0, False)
    yield "glu separate inf limit", ops.glu.default, (t(4, 8, dtype=torch.bfloat16).requires_grad_(),
                                                     t(4, 8, dtype=torch.bfloat16), None, 0, 1, 1.0, math.inf, 0.0,
                                                     False)
    for layout in (1, 2, 3):
        yield f"glu packed {layout}", ops.glu.default, (t(15, 16).requires_grad_(), None, w.reshape(15), layout, 0,
                                                        1.0, 7.0, 0.0, False)
        yield f"glu packed {layout} inplace", ops.glu.default, (
            t(15, 16, dtype=torch.float16).requires_grad_(), None, None, layout, 0, 1.702, 7.0, 1.0, True)
    yield "glu_backward separate", ops.glu_backward.default, (
        t(15, 8), t(15, 8), t(15, 8), w.reshape(15), True, 0, 0, 1.702, 7.0, 1.0)
    yield "glu_backward packed", ops.glu_backward.default, (t(15, 8), t(15, 16), None, None, False, 3, 1, 1.0,
                                                           math.inf, 0.0)
    yield "glu_backward_ separate", ops.glu_backward_.default, (
        # grad_weights is an output buffer, but opcheck copies every argument before the call: an
        # initialised one, so that copy reads defined memory (compute-sanitizer's initcheck
        # reported the copy of a torch.empty buffer here). That the kernels write every element
        # is the fuzzer's poisoned-output check.
        t(15, 8), t(15, 8), t(15, 8), w.reshape(15), torch.zeros(15, device=device), 0, 0, 1.702, 7.0, 1.0)
    yield "glu_backward_ packed", ops.glu_backward_.default, (
        t(15, 8), t(15, 16), None, None, None, 1, 0, 1.0, 7.0, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for name, op, args in _opcheck_samples(device):
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (name, result)


def test_schemas():
    assert "Tensor(a!) x" in str(ops.glu_backward_.default._schema)
    assert ops.glu.default._schema.is_mutable is False
    assert ops.glu_backward.default._schema.is_mutable is False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_create_graph_is_rejected(device, inplace):
    g, u = (t.requires_grad_() for t in make_inputs("separate", (4, 8), torch.float32, device))
    out = expertact.swiglu_oai(g, u, inplace_backward=inplace)
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(out.sum(), (g, u), create_graph=True)


# ---------------------------------------------------------------------------
# In-place backward (docs/spec.md section 3)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_inplace_backward_matches_default(preset, layout, device):
    base = make_inputs(layout, (6, 5, 24), torch.bfloat16, device, seed=7)
    w = torch.rand(6, 5, device=device)
    grads = []
    for inplace in (False, True):
        leaves = [b.clone().requires_grad_() for b in base]
        wl = w.clone().requires_grad_()
        xs = [l * 1 for l in leaves]  # non-leaf inputs, as a GEMM's output would be
        out = call(preset, xs, layout, weights=wl, inplace_backward=inplace)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out).to(device)
        versions = [x._version for x in xs]
        out.backward(grad_out)
        if inplace:
            assert all(x._version > v for x, v in zip(xs, versions)), "version counters not bumped"
            for x, leaf in zip(xs, leaves):  # the gradient was written over the input itself
                torch.testing.assert_close(x.detach(), leaf.grad, rtol=0, atol=0)
        grads.append([l.grad for l in leaves] + [wl.grad])
    *gx0, gw0 = grads[0]
    *gx1, gw1 = grads[1]
    for a, b in zip(gx0, gx1):  # the same arithmetic, written elsewhere
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(gw0, gw1, rtol=1e-6, atol=1e-6)  # a float32 row sum, maybe in another order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["separate", "interleaved"])
def test_inplace_second_backward_raises(layout, device):
    xs = [t.requires_grad_() * 1 for t in make_inputs(layout, (4, 8), torch.float32, device)]
    out = call("swiglu_oai", xs, layout, inplace_backward=True)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran with inplace_backward=True"):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_other_saved_user_fails_loudly(device):
    (gu,) = make_inputs("halves", (4, 16), torch.float32, device)
    gu.requires_grad_()
    x = gu * 1
    other = (x * x).sum()  # saves x for its own backward, which runs after ours
    out = expertact.swiglu(x, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + other).backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_only_overwrites_what_wants_a_gradient(device):
    g, u = make_inputs("separate", (4, 8), torch.float32, device)
    g.requires_grad_()
    u_before = u.clone()
    out = expertact.swiglu(g, u, inplace_backward=True)  # up needs no gradient: it is left intact
    out.sum().backward()
    torch.testing.assert_close(u, u_before, rtol=0, atol=0)
    ref_g = g.detach().clone().requires_grad_()
    expertact.swiglu(ref_g, u).sum().backward()
    torch.testing.assert_close(g.grad, ref_g.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_on_a_copied_input_leaves_the_original(device):
    """A non-row-strided input is copied once before the op; the in-place backward then
    overwrites the copy, and the gradient reaches the original through the copy."""
    (buf,) = make_inputs("halves", (8, 32), torch.float32, device)
    leaf = buf.clone().requires_grad_()
    gate, up = leaf[:, 0::2], leaf[:, 1::2]  # last-dim stride 2: copied
    out = expertact.swiglu_oai(gate, up, inplace_backward=True)
    out.sum().backward()
    torch.testing.assert_close(leaf.detach(), buf, rtol=0, atol=0)
    ref = buf.clone().requires_grad_()
    expertact.swiglu_oai(ref, layout="interleaved").sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_on_views_of_one_buffer(device):
    """gate and up as column views of one GEMM output (separate layout): both are written
    in place, the buffer's version counter moves, and its gradient is right."""
    (buf,) = make_inputs("halves", (8, 32), torch.bfloat16, device)
    grads = []
    for inplace in (False, True):
        leaf = buf.clone().requires_grad_()
        gate_up = leaf * 1
        gate, up = gate_up.chunk(2, dim=-1)
        v = gate_up._version
        expertact.swiglu_oai(gate, up, inplace_backward=inplace).float().square().sum().backward()
        assert (gate_up._version > v) == inplace
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_leaf_gradient_needs_no_copy(device):
    """For a leaf input the gradient aliases the input's memory (no extra tensor), and it is
    the gradient: the same values as the default backward's into a fresh leaf."""
    (base,) = make_inputs("interleaved", (4, 16), torch.float32, device)
    gu = base.clone().requires_grad_()
    expertact.swiglu_oai(gu, layout="interleaved", inplace_backward=True).sum().backward()
    assert gu.grad is not None and gu.grad.data_ptr() == gu.data_ptr()
    ref = base.clone().requires_grad_()
    expertact.swiglu_oai(ref, layout="interleaved").sum().backward()
    torch.testing.assert_close(gu.grad, ref.grad, rtol=0, atol=0)


def test_inplace_op_bumps_versions_directly():
    dy = torch.randn(4, 8)
    gu = torch.randn(4, 16)
    w = torch.rand(4)
    gw = torch.empty(4)
    v0, v1 = gu._version, gw._version
    ops.glu_backward_(dy, gu, None, w, gw, 1, 0, 1.0, 7.0, 0.0)
    assert gu._version > v0 and gw._version > v1


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def _expert_mlp(x, w13, w2, probs, layout, inplace):
    gate_up = x @ w13
    if layout == "separate":
        gate, up = gate_up.chunk(2, dim=-1)
        h = expertact.swiglu_oai(gate, up, weights=probs, inplace_backward=inplace)
    else:
        h = expertact.swiglu_oai(gate_up, layout=layout, weights=probs, inplace_backward=inplace)
    return h @ w2


@pytest.mark.parametrize("layout, inplace", [("separate", False), ("interleaved", True)])
def test_torch_compile_fullgraph(layout, inplace):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=gen)
    w13 = (torch.randn(16, 64, generator=gen) * 0.5).requires_grad_()
    w2 = (torch.randn(32, 16, generator=gen) * 0.2).requires_grad_()
    probs = torch.rand(32, generator=gen).requires_grad_()
    params = (w13, w2, probs)

    def run(fn):
        for p in params:
            p.grad = None
        out = fn(x, w13, w2, probs, layout, inplace)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in params]

    ref_out, ref_grads = run(_expert_mlp)
    out, grads = run(torch.compile(_expert_mlp, fullgraph=True))  # fullgraph: a graph break is an error
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
