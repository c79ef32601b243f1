"""expertact.moe.expert_mlp(..., fused=True): the fused grouped GEMMs (docs/fused-gemm.md).

On the CPU (everywhere, CI too): the fallback (a warning, once per reason, and the unfused
result bit for bit); the reordering of w13 to interleaved and of its gradient back, for every
layout; the fused autograd node's wiring (padding, gradients of x, w13, w2 and the weights,
memory modes) with the two kernels stood in for by their torch definitions.
On a Hopper GPU with a CUTLASS build (skipped elsewhere): against the float64 reference for
every preset x layout, with and without weights, in each memory mode, at odd expert sizes
(empty experts, one row, padding rows) and D, F not multiples of the tile; the kernels'
outputs against the unfused kernels on the same inputs, element by element.
"""
import warnings

import pytest
import torch

from expertact import _capi, _fused, moe
from expertact._library import glu_backward_op, glu_op
from conftest import HAS_CUDA, PRESETS
from test_moe import MODES, assert_close, check_case, make_case, reference_mlp, run

PACKED = ["halves", "up_first", "interleaved"]

HAS_FUSED = (HAS_CUDA and _capi.has_fused_gemm() and torch.cuda.get_device_capability() == (9, 0))
requires_fused = pytest.mark.skipif(
    not HAS_FUSED, reason="needs a Hopper (sm_90) GPU and an expertact build with the fused GEMMs (CUTLASS)")

# Odd expert sizes (an empty expert, a single row) and padding rows; D = 200 is 3 K blocks
# of 64 plus 8, 2F = 360 is one 256-wide N tile plus 104, F = 180 under one tile.
ODD = dict(counts=[37, 0, 129, 1, 200], pad=3, D=200, F=180)


# ---------------------------------------------------------------------------
# CPU: fallback, reordering, and the autograd node with stand-in kernels
# ---------------------------------------------------------------------------


def test_fallback_warns_once_and_matches_unfused():
    c = make_case(**dict(counts=[5, 0, 9], pad=2, D=16, F=8), dtype=torch.float32, device="cpu", weighted=True)
    moe._WARNED.clear()
    with pytest.warns(UserWarning, match="fused=True falls back to the unfused path"):
        y, grads = run(c, "swiglu_oai", fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second warning
        run(c, "swiglu_oai", fused=True)
    y0, grads0 = run(c, "swiglu_oai")
    assert torch.equal(y, y0)
    for g, g0 in zip(grads, grads0):
        assert torch.equal(g, g0)


def test_why_not_names_the_reason():
    x = torch.zeros(4, 16)
    reason = _fused.why_not(x, 16, 8)
    assert reason is not None
    if not _capi.has_fused_gemm():
        assert "no fused grouped GEMM" in reason
    else:
        assert "cpu" in reason


def test_binding_reaches_the_library_checks():
    """The ctypes signatures of expertact_moe_fused_forward / _backward: the library's own
    refusals come back naming the argument in the slot it was passed in (on the CPU, where
    the offsets are refused first), in any build."""
    inf = float("inf")
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w13i, w2k = torch.zeros(1, 8, 8, dtype=torch.bfloat16), torch.zeros(1, 4, 8, dtype=torch.bfloat16)
    offs = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets is on DLPack device type 1"):
        _fused.forward(x, w13i, offs, None, 0, 1.0, inf, 0.0)
    with pytest.raises(TypeError, match="offsets must be int32"):
        _fused.forward(x, w13i, offs.long(), None, 0, 1.0, inf, 0.0)
    gate_up = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets is on DLPack device type 1"):
        _fused.backward(x, w2k, offs, gate_up, torch.ones(4), True, False, 0, 1.0, inf, 0.0)


@pytest.mark.parametrize("layout", PACKED)
def test_w13_reordering_round_trips(layout):
    """_w13_interleaved puts expert e's gate column j at row 2j and its up column at 2j + 1 of a
    [E, 2F, D] tensor with D contiguous; _from_interleaved maps the gradient back exactly."""
    E, D, F = 3, 5, 4
    w13 = torch.randn(E, D, 2 * F)
    gate, up = moe._unpack(w13, layout, dim=2)
    wi = moe._w13_interleaved(w13, layout)
    assert wi.shape == (E, 2 * F, D) and wi.stride(-1) == 1
    assert torch.equal(wi[:, 0::2, :], gate.transpose(-2, -1))
    assert torch.equal(wi[:, 1::2, :], up.transpose(-2, -1))
    assert torch.equal(moe._from_interleaved(wi.transpose(-2, -1), layout), w13)


def test_interleaved_w13_stored_k_major_is_not_copied():
    E, D, F = 2, 8, 4
    stored = torch.randn(E, 2 * F, D)  # GPT-OSS's gate_up_proj as [E, 2F, D], or fused_w13 modules
    assert moe._w13_interleaved(stored.transpose(-2, -1), "interleaved").data_ptr() == stored.data_ptr()
    padded = torch.randn(E, 2 * F + 1, D)[:, :2 * F]  # experts not one after another: copied
    assert moe._expert_kmajor(padded).is_contiguous()


def _standin_forward(x, w13i, offsets, weights, act, alpha, limit, beta):
    """The fused forward's definition in torch: gate_up = x @ w13i^T per expert (interleaved),
    h = the activation of gate_up; padding rows left as garbage, as the kernel leaves them."""
    T, F = x.shape[0], w13i.shape[1] // 2
    gate_up = torch.full((T, 2 * F), float("nan"), dtype=x.dtype)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        gate_up[start:end] = x[start:end] @ w13i[e].t()
        start = end
    h = glu_op(gate_up, None, weights, _capi.LAYOUT_INTERLEAVED, act, alpha, limit, beta, False)
    h[start:] = float("nan")
    return gate_up, h


def _standin_backward(dy, w2k, offsets, gate_up, weights, weights_grad, inplace, act, alpha, limit, beta):
    T, F = gate_up.shape[0], w2k.shape[1]
    dh = torch.zeros(T, F, dtype=dy.dtype)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        dh[start:end] = dy[start:end] @ w2k[e].t()
        start = end
    res = glu_backward_op(dh, gate_up, None, weights, weights_grad, _capi.LAYOUT_INTERLEAVED, act, alpha,
                          limit, beta)
    dgate_up = res[0]
    if inplace:
        gate_up.copy_(dgate_up)
        dgate_up = gate_up
    return dgate_up, (res[-1] if weights_grad else None)


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setattr(moe._fused, "why_not", lambda *a: None)
    monkeypatch.setattr(moe._fused, "forward", _standin_forward)
    monkeypatch.setattr(moe._fused, "backward", _standin_backward)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("weighted", [False, True], ids=["noweights", "weights"])
@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize("preset", ["swiglu_oai", "geglu_tanh"])
def test_fused_node_with_standin_kernels(standin, preset, layout, weighted, mode):
    """The autograd node of the fused path (reordering, padding rows, dx through the reordered
    w13, dw13 back in the caller's layout, the weights' gradient, memory modes) against the
    float64 reference, in float32 on the CPU."""
    c = make_case(counts=[5, 0, 9, 3], pad=2, D=11, F=9, dtype=torch.float32, device="cpu",
                  layout=layout, weighted=weighted)
    check_case(c, preset, torch.float32, mode, fused=True)


def test_fused_node_partial_gradients_and_second_backward(standin):
    c = make_case(counts=[5, 0, 9], pad=1, D=8, F=4, dtype=torch.float32, device="cpu", weighted=True)
    ry, rgrads, gw_scale = reference_mlp(c, "swiglu")
    x, w13, w2, w = (c[k].detach() for k in ("x", "w13", "w2", "weights"))
    w.requires_grad_()
    y = moe.expert_mlp(x, w13, w2, c["offsets"], weights=w, inplace_backward=True, fused=True)
    y.backward(c["dy"], retain_graph=True)  # only the weights want a gradient: gate_up kept
    assert_close("dweights", w.grad, rgrads[3], torch.float32, scale=gw_scale)
    y.backward(c["dy"])
    xg = x.clone().requires_grad_()
    y = moe.expert_mlp(xg, w13, w2, c["offsets"], inplace_backward=True, fused=True)
    y.backward(c["dy"], retain_graph=True)
    with pytest.raises(RuntimeError):
        y.backward(c["dy"])
    with torch.no_grad():
        y = moe.expert_mlp(x, w13, w2, c["offsets"], weights=w.detach(), fused=True)
    assert y.grad_fn is None
    assert_close("y", y, ry, torch.float32)


# ---------------------------------------------------------------------------
# GPU: the kernels
# ---------------------------------------------------------------------------


@requires_fused
@pytest.mark.parametrize("mode", ["plain", "recompute+inplace"])
@pytest.mark.parametrize("weighted", [False, True], ids=["noweights", "weights"])
@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_matches_reference(preset, layout, weighted, mode):
    c = make_case(**ODD, dtype=torch.bfloat16, device="cuda", layout=layout, weighted=weighted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y, grads = check_case(c, preset, torch.bfloat16, mode, fused=True)
    fallbacks = [str(w.message) for w in caught if "falls back" in str(w.message)]
    assert not fallbacks, fallbacks  # the fused path must be taken, not the unfused one
    # And beside the unfused path on the same inputs (both within bf16 rounding of the reference).
    y0, grads0 = run(c, preset, mode)
    assert_close("y vs unfused", y, y0, torch.bfloat16)
    for name, g, g0 in zip(("dx", "dw13", "dw2", "dweights"), grads, grads0):
        assert_close(name + " vs unfused", g, g0, torch.bfloat16)


@requires_fused
@pytest.mark.parametrize("counts,pad", [([23], 0), ([0, 0, 0], 5), ([0, 300, 0], 0), ([1, 1], 1),
                                        ([0], 0)],
                         ids=["E1", "all-empty", "empty-ends", "one-row", "T0"])
def test_cuda_edge_shapes(counts, pad):
    c = make_case(counts, pad, D=64, F=256, dtype=torch.bfloat16, device="cuda", layout="interleaved",
                  weighted=True)
    check_case(c, "swiglu_oai", torch.bfloat16, "recompute+inplace", fused=True)
    check_case(c, "swiglu", torch.bfloat16, "plain", fused=True)


@requires_fused
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_kernels_against_unfused_kernels(preset):
    """Element by element on the same inputs: the fused forward's gate_up against
    torch._grouped_mm's, its h against expertact's activation kernel on that gate_up (the same
    math.h, the same one rounding: equal but for a rare last-bit difference from operation
    order); the fused backward's dgate_up against the activation's backward kernel on dh from
    torch._grouped_mm, and the weights' gradient."""
    from expertact.functional import PRESETS as P
    act, alpha, limit, beta = P[preset]
    alpha = 1.702 if alpha is None else alpha
    limit = 7.0 if limit is None else limit
    torch.manual_seed(0)
    counts, D, F = [300, 0, 517, 45], 256, 384
    E, T = len(counts), sum(counts)
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w13i = (torch.randn(E, 2 * F, D, device="cuda") * 4 / D ** 0.5).bfloat16()
    w2k = (torch.randn(E, F, D, device="cuda") / D ** 0.5).bfloat16()
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(T, device="cuda") + 0.5
    gate_up, h = _fused.forward(x, w13i, offs, w, act, alpha, limit, beta)
    ref_gu = torch._grouped_mm(x, w13i.transpose(-2, -1), offs=offs)
    diff = (gate_up.float() - ref_gu.float()).abs()
    assert (diff <= ref_gu.float().abs() * 2.0 ** -7 + 1e-6).all(), "gate_up beyond one bf16 ulp of torch's"
    ref_h = glu_op(gate_up, None, w, _capi.LAYOUT_INTERLEAVED, act, alpha, limit, beta, False)
    exact = (h == ref_h) | (h.isnan() & ref_h.isnan())
    near = (h.float() - ref_h.float()).abs() <= ref_h.float().abs() * 2.0 ** -7 + 1e-30
    assert (exact | near).all(), "h beyond one bf16 ulp of the unfused activation on the same gate_up"
    # The same math.h and rounding: most values are bitwise equal (a last-bit difference comes
    # from the compiler contracting operations differently in the two kernels); another
    # formula would match almost none.
    assert exact.float().mean() > 0.5, f"only {exact.float().mean():.4f} of h bitwise equal to the unfused"

    dgu, dw = _fused.backward(dy, w2k, offs, gate_up, w, True, False, act, alpha, limit, beta)
    dh = torch._grouped_mm(dy, w2k.transpose(-2, -1), offs=offs)
    res = glu_backward_op(dh, gate_up, None, w, True, _capi.LAYOUT_INTERLEAVED, act, alpha, limit, beta)
    ref_dgu, ref_dw = res[0], res[-1]
    close = (dgu.float() - ref_dgu.float()).abs() <= ref_dgu.float().abs() * 2.0 ** -6 + 1e-30
    same = (dgu == ref_dgu).float().mean()
    assert close.float().mean() > 0.999 and same > 0.5, \
        f"dgate_up differs from the unfused activation backward on torch's dh ({same:.4f} bitwise equal)"
    # The rare rest: dh itself rounded the other way (one bf16 ulp of dh, 2^-8 relative).
    assert ((dgu.float() - ref_dgu.float()).abs() <= ref_dgu.float().abs() * 2.0 ** -5 + 1e-30).all()
    # A row sum of F terms: a term whose dh rounded the other way moves it by 2^-8 of that term,
    # so the bound scales with the sum's magnitude, not with the (possibly cancelling) result.
    torch.testing.assert_close(dw, ref_dw, rtol=2e-2, atol=2e-2 * ref_dw.abs().mean().item())
    # In place: the same values over gate_up.
    gu2 = gate_up.clone()
    dgu2, _ = _fused.backward(dy, w2k, offs, gu2, w, False, True, act, alpha, limit, beta)
    assert dgu2.data_ptr() == gu2.data_ptr() and torch.equal(dgu2, dgu)


@requires_fused
def test_cuda_grouped_experts_fused():
    torch.manual_seed(1)
    E, D, F = 3, 128, 96
    counts = torch.tensor([70, 0, 131])
    T = int(counts.sum()) + 4
    ref = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout="interleaved", fused_w13=True,
                             device="cuda", dtype=torch.bfloat16)
    fused = moe.GroupedExperts(D, F, E, activation="swiglu_oai", layout="interleaved", fused_w13=True,
                               fused=True, device="cuda", dtype=torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa, counts.cuda()), fused(xb, counts.cuda())
    ga = torch.autograd.grad(ya, [xa, ref.w13, ref.w2], dy)
    gb = torch.autograd.grad(yb, [xb, fused.w13, fused.w2], dy)
    assert_close("y", yb, ya, torch.bfloat16)
    for name, a, b in zip(("dx", "dw13", "dw2"), ga, gb):
        assert_close(name, b, a, torch.bfloat16)


@requires_fused
def test_cuda_fallback_for_float32():
    c = make_case(**dict(counts=[5, 0, 9], pad=2, D=16, F=8), dtype=torch.float32, device="cuda")
    moe._WARNED.clear()
    with pytest.warns(UserWarning, match="take bfloat16"):
        y, _ = run(c, "swiglu", fused=True)
    y0, _ = run(c, "swiglu")
    assert torch.equal(y, y0)
