"""Forward and backward of every preset x layout x dtype against the float64 eager
expression, weights and their gradient, shapes, views and non-contiguous inputs."""
import math

import pytest
import torch

import expertact
from conftest import (DEVICES, DTYPES, LAYOUTS, PRESETS, assert_matches, assert_weight_grad_matches, call,
                      error_scales, make_inputs, preset_params, reference, reference_grads, split,
                      weight_grad_terms)

_check = assert_matches


def _check_all(preset, inputs, layout, grad_out, out, dtype, weights=None):
    """The output and every input's .grad against the float64 eager expression."""
    ref_out, ref_grads = reference_grads(preset, inputs, layout, grad_out, weights=weights)
    s_out, s_grads = error_scales(preset, inputs, layout, grad_out, weights=weights)
    _check(out, ref_out, dtype, s_out)
    for t, g, s in zip(inputs, ref_grads, s_grads):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype
        _check(t.grad, g, dtype, s)
    return ref_grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_backward(preset, layout, dtype, device):
    inputs = [t.requires_grad_() for t in make_inputs(layout, (37, 72), dtype, device)]
    out = call(preset, inputs, layout)
    assert out.shape == (37, 72) and out.dtype == dtype and out.device == inputs[0].device
    grad_out = torch.randn(37, 72, dtype=torch.float64).to(dtype).to(device)
    out.backward(grad_out)
    _check_all(preset, inputs, layout, grad_out, out, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", ["swiglu", "swiglu_oai", "geglu_tanh"])
def test_weights(preset, layout, dtype, device):
    """Per-row float32 weights, differentiable; shape = the leading dims."""
    inputs = [t.requires_grad_() for t in make_inputs(layout, (3, 11, 40), dtype, device, seed=1)]
    w = torch.rand(3, 11, device=device, requires_grad=True)
    out = call(preset, inputs, layout, weights=w)
    grad_out = torch.randn(3, 11, 40, dtype=torch.float64).to(dtype).to(device)
    out.backward(grad_out)
    ref_grads = _check_all(preset, inputs, layout, grad_out, out, dtype, weights=w)
    # grad_w: a float32 sum over the row of grad_out * a * (uc + beta); its error is relative
    # to the sum of the absolute terms.
    gate, up = (inputs[0], inputs[1]) if layout == "separate" else split(inputs[0], layout)
    assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
    assert_weight_grad_matches(w.grad, ref_grads[-1], weight_grad_terms(preset, gate, up, grad_out))


@pytest.mark.parametrize("device", DEVICES)
def test_flat_weights_and_no_weight_grad(device):
    g, u = make_inputs("separate", (2, 5, 16), torch.float32, device)
    w = torch.rand(10, device=device)  # [rows], not requiring grad
    g.requires_grad_()
    out = expertact.swiglu(g, u, weights=w)
    ref = reference(g.double(), u.double(), "silu", 1.0, math.inf, 0.0, w.double().reshape(2, 5))
    _check(out, ref, torch.float32)
    out.sum().backward()
    assert w.grad is None and u.grad is None and g.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, f", [(0, 8), (1, 1), (7, 7), (17, 9), (4, 12), (3, 100), (2, 1408), (1, 0)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sizes(rows, f, layout, device):
    inputs = [t.requires_grad_() for t in make_inputs(layout, (rows, f), torch.float32, device, seed=rows + f)]
    out = call("swiglu_oai", inputs, layout)
    assert out.shape == (rows, f)
    grad_out = torch.randn(rows, f, dtype=torch.float64).float().to(device)
    out.backward(grad_out)
    _check_all("swiglu_oai", inputs, layout, grad_out, out, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_nd_shapes(preset, device):
    g, u = make_inputs("separate", (2, 3, 4, 24), torch.bfloat16, device)
    out = call(preset, [g, u], "separate")
    act, alpha, limit, beta = preset_params(preset)
    assert out.shape == (2, 3, 4, 24)
    _check(out, reference(g.double(), u.double(), act, alpha, limit, beta), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_at_limits_nan_inf(layout, device):
    """Inclusive masks at exactly +-limit, NaN and +-Inf positions as eager PyTorch gives them."""
    L = 7.0
    vals = torch.tensor([L, -L, L + 1, -L - 1, 0.5, -0.5, math.nan, math.inf, -math.inf, 3.0, -3.0, 0.0])
    n = vals.numel()
    gate = vals.repeat(n)
    up = vals.repeat_interleave(n)
    for preset in ("swiglu_oai", "swiglu_clamped", "swiglu"):
        if layout == "separate":
            inputs = [gate.clone().reshape(n, n).to(device).requires_grad_(),
                      up.clone().reshape(n, n).to(device).requires_grad_()]
        else:
            packed = torch.empty(n, 2 * n)
            pg, pu = split(packed, layout)
            pg.copy_(gate.reshape(n, n))
            pu.copy_(up.reshape(n, n))
            inputs = [packed.to(device).requires_grad_()]
        out = call(preset, inputs, layout)
        grad_out = torch.ones(n, n, device=device)
        out.backward(grad_out)
        _check_all(preset, inputs, layout, grad_out, out, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_generic_glu_matches_presets(device):
    g, u = make_inputs("separate", (9, 32), torch.float32, device)
    torch.testing.assert_close(expertact.glu(g, u, activation="silu", alpha=1.702, limit=7.0, beta=1.0),
                               expertact.swiglu_oai(g, u), rtol=0, atol=0)
    torch.testing.assert_close(expertact.glu(g, u), expertact.swiglu(g, u), rtol=0, atol=0)
    torch.testing.assert_close(expertact.glu(g, u, limit=math.inf), expertact.swiglu(g, u), rtol=0, atol=0)
    torch.testing.assert_close(expertact.glu(g, u, activation="gelu_tanh"), expertact.geglu_tanh(g, u),
                               rtol=0, atol=0)
    # A new form needs no new kernel: silu with alpha 1.5, limit 3, beta 0.25.
    out = expertact.glu(g, u, alpha=1.5, limit=3.0, beta=0.25)
    _check(out, reference(g.double(), u.double(), "silu", 1.5, 3.0, 0.25), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_default_layout_is_halves(device):
    (gu,) = make_inputs("halves", (5, 16), torch.float32, device)
    torch.testing.assert_close(expertact.swiglu(gu), expertact.swiglu(*gu.chunk(2, dim=-1)), rtol=0, atol=0)
    torch.testing.assert_close(expertact.swiglu(gu, layout="halves_up_first"),
                               expertact.swiglu(gu, layout="up_first"), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_row_strided_views_and_copies(device):
    """Row-strided views are read in place; other strides go through one copy; gradients
    land in the original tensors either way."""
    base = make_inputs("separate", (8, 64), torch.float32, device)[0]
    cases = {
        "column slices of one buffer": lambda b: (b[:, :32], b[:, 32:]),
        "row slices": lambda b: (b[1:5, :16], b[4:8, 16:32]),
        "last dim strided": lambda b: (b[:, 0::2], b[:, 1::2]),
        "transposed": lambda b: (b[:, :8].t(), b[:, 8:16].t()),
        "3-d permuted": lambda b: (b[:, :32].reshape(8, 4, 8).permute(1, 0, 2), b[:, 32:].reshape(8, 4, 8).permute(1, 0, 2)),
        "misaligned start": lambda b: (b.reshape(-1)[1:129].reshape(4, 32), b.reshape(-1)[131:259].reshape(4, 32)),
    }
    for name, make in cases.items():
        leaf = base.clone().requires_grad_()
        g, u = make(leaf)
        out = expertact.swiglu_oai(g, u)
        grad_out = torch.randn(out.shape, dtype=torch.float64).float().to(device)
        out.backward(grad_out)
        ref_leaf = base.double().clone().requires_grad_()
        rg, ru = make(ref_leaf)
        ref = reference(rg, ru, "silu", 1.702, 7.0, 1.0)
        ref.backward(grad_out.double())
        _check(out, ref.detach(), torch.float32)
        _check(leaf.grad, ref_leaf.grad, torch.float32)
    # The packed layouts on a row slice of a wider buffer: read in place.
    wide = make_inputs("separate", (6, 80), torch.bfloat16, device)[0]
    gu = wide[:, 8:72]
    assert not gu.is_contiguous()
    for layout in ("halves", "up_first", "interleaved"):
        g, u = split(gu, layout)
        _check(expertact.swiglu(gu, layout=layout), reference(g.double(), u.double(), "silu", 1.0, math.inf, 0.0),
               torch.bfloat16)


def test_rows_view_rule():
    from expertact._capi import rows_view_ok
    b = torch.empty(8, 64)
    assert rows_view_ok(b[:, :32]) and rows_view_ok(b[2:6, 8:40]) and rows_view_ok(b.reshape(2, 4, 64)[:, :, 3:9])
    assert not rows_view_ok(b[:, ::2]) and not rows_view_ok(b.t())
    assert not rows_view_ok(torch.empty(1, 16).expand(4, 16))  # rows would overlap
    assert not rows_view_ok(b.reshape(2, 4, 64)[:, :2, :])  # leading dims do not collapse


def test_presets_match_the_c_library():
    from expertact import _capi
    for name, (act, alpha, limit, beta) in expertact.PRESETS.items():
        for a, lim in ((1.702, 7.0), (2.5, 10.0)):
            c_act, c_alpha, c_limit, c_beta = _capi.preset(name, a, lim)
            assert c_act == act and c_beta == beta
            assert c_alpha == pytest.approx(a if alpha is None else alpha)
            assert c_limit == pytest.approx(lim if limit is None else limit)
    assert _capi.preset("swiglu_oai")[1:3] == pytest.approx((1.702, 7.0))
    assert _capi.preset("swiglu_clamped")[2] == 7.0


def test_library_info():
    assert expertact.abi_version() == 5
    assert isinstance(expertact.has_cuda(), bool)
    n = expertact.cpu_threads()
    assert n >= 1
    expertact.set_cpu_threads(1)
    try:
        assert expertact.cpu_threads() == 1
        g, u = make_inputs("separate", (300, 1000), torch.float32, "cpu")
        one = expertact.swiglu(g, u)
    finally:
        expertact.set_cpu_threads(0)
    torch.testing.assert_close(expertact.swiglu(g, u), one, rtol=0, atol=0)
