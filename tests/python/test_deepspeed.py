"""DeepSpeed-compatible names: DeepSpeed's signatures, defaults and values."""
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import expertact
from expertact import deepspeed as ds
from conftest import DEVICES, TOL, make_inputs


# DeepSpeed's own eager expressions (deepspeed/ops/triton_ops/swiglu_triton.py and the
# expert-activation registry), the reference for the drop-in names.
def _ds_swiglu(gate, up, alpha, limit):
    return F.silu(gate) * up


def _ds_geglu_tanh(gate, up, alpha, limit):
    return F.gelu(gate, approximate="tanh") * up


def _ds_swiglu_clamped(gate, up, alpha, limit):
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _ds_swiglu_oai(gate, up, alpha, limit):
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


DS_FORMS = {"swiglu": _ds_swiglu, "geglu_tanh": _ds_geglu_tanh, "swiglu_clamped": _ds_swiglu_clamped,
            "swiglu_oai": _ds_swiglu_oai}


def test_signatures_and_defaults():
    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    e = inspect.Parameter.empty
    assert params(ds.swiglu) == [("gate", e), ("up", e)]
    assert params(ds.swiglu_packed) == [("gate_up", e)]
    assert params(ds.swiglu_clamped) == [("gate", e), ("up", e), ("alpha", 1.702), ("limit", 7.0), ("oai", True)]
    assert params(ds.swiglu_clamped_packed) == [("gate_up", e), ("alpha", 1.702), ("limit", 7.0), ("oai", True)]
    assert params(ds.apply_expert_activation) == [("gate", e), ("up", e), ("activation", "swiglu"), ("alpha", 1.702),
                                                  ("limit", 7.0), ("fused", True)]
    assert params(ds.apply_packed_expert_activation) == [("gate_up", e), ("activation", "swiglu"),
                                                         ("alpha", 1.702), ("limit", 7.0), ("fused", True)]
    assert params(ds.swiglu_backward) == [("grad", e), ("gate", e), ("up", e)]
    assert params(ds.swiglu_packed_backward) == [("grad", e), ("gate_up", e)]
    assert ds.EXPERT_ACTIVATIONS == ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")
    # DeepSpeed's names live in expertact.deepspeed only: at the top level, swiglu_clamped is the
    # silu form (expertact.swiglu_clamped), not DeepSpeed's (GPT-OSS by default).
    # The three top-level names of 0.1.0 resolve there for one more release, with a warning.
    for name in ("swiglu_packed", "apply_expert_activation", "apply_packed_expert_activation"):
        assert name not in expertact.__all__
        with pytest.warns(FutureWarning, match=f"expertact.deepspeed.{name}"):
            assert getattr(expertact, name) is getattr(ds, name)
    with pytest.raises(AttributeError, match="swiglu_unknown"):
        expertact.swiglu_unknown
    # enabled(), the context manager of 0.1.0, is enabled_scope(): the old name warns, one release.
    with pytest.warns(FutureWarning, match="enabled_scope"):
        scope = ds.enabled(inplace_backward=True)
    assert hasattr(scope, "__enter__") and hasattr(scope, "__exit__")
    assert expertact.swiglu_clamped is not ds.swiglu_clamped


def _check(got, want, dtype):
    torch.testing.assert_close(got.double(), want.to(dtype).double(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", list(DS_FORMS))
def test_apply_expert_activation(activation, dtype, device):
    g, u = make_inputs("separate", (33, 40), dtype, device, scale=5.0)
    for alpha, limit in ((1.702, 7.0), (1.5, 10.0)):
        want = DS_FORMS[activation](g.double(), u.double(), alpha, limit)
        _check(ds.apply_expert_activation(g, u, activation, alpha, limit), want, dtype)
        _check(ds.apply_expert_activation(g, u, activation, alpha=alpha, limit=limit, fused=False), want, dtype)
        _check(ds.apply_packed_expert_activation(torch.cat([g, u], -1), activation, alpha, limit), want, dtype)
    _check(ds.apply_expert_activation(g, u), _ds_swiglu(g.double(), u.double(), 0, 0), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_module_names(device):
    g, u = make_inputs("separate", (17, 24), torch.float32, device, scale=5.0)
    gu = torch.cat([g, u], -1)
    gd, ud = g.double(), u.double()
    _check(ds.swiglu(g, u), _ds_swiglu(gd, ud, 0, 0), torch.float32)
    _check(ds.swiglu_packed(gu), _ds_swiglu(gd, ud, 0, 0), torch.float32)
    # swiglu_clamped defaults to the GPT-OSS form (oai=True, alpha 1.702, limit 7)
    _check(ds.swiglu_clamped(g, u), _ds_swiglu_oai(gd, ud, 1.702, 7.0), torch.float32)
    _check(ds.swiglu_clamped_packed(gu), _ds_swiglu_oai(gd, ud, 1.702, 7.0), torch.float32)
    _check(ds.swiglu_clamped(g, u, 1.5, 3.0), _ds_swiglu_oai(gd, ud, 1.5, 3.0), torch.float32)
    # oai=False: silu(clamp(gate)) * clamp(up); alpha is not read
    _check(ds.swiglu_clamped(g, u, alpha=1.5, limit=3.0, oai=False), _ds_swiglu_clamped(gd, ud, 0, 3.0),
           torch.float32)
    _check(ds.swiglu_clamped_packed(gu, 2.0, 10.0, False), _ds_swiglu_clamped(gd, ud, 0, 10.0), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_backwards(device):
    g, u = make_inputs("separate", (9, 16), torch.float32, device)
    grad = torch.randn(9, 16, device=device)
    gr, ur = g.double().requires_grad_(), u.double().requires_grad_()
    want = torch.autograd.grad(_ds_swiglu(gr, ur, 0, 0), (gr, ur), grad.double())
    got = ds.swiglu_backward(grad, g, u)
    assert isinstance(got, tuple) and len(got) == 2
    for a, b in zip(got, want):
        _check(a, b, torch.float32)
    packed = ds.swiglu_packed_backward(grad, torch.cat([g, u], -1))
    _check(packed, torch.cat(want, -1), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_differentiable(device):
    g, u = (t.requires_grad_() for t in make_inputs("separate", (5, 8), torch.float32, device))
    ds.swiglu_clamped(g, u).sum().backward()
    gr, ur = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    _ds_swiglu_oai(gr, ur, 1.702, 7.0).sum().backward()
    _check(g.grad, gr.grad, torch.float32)
    _check(u.grad, ur.grad, torch.float32)


def test_errors():
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown expert activation 'relu'"):
        ds.apply_expert_activation(g, g, "relu")
    with pytest.raises(ValueError, match="unknown expert activation"):
        ds.apply_packed_expert_activation(g, "swish")
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        ds.swiglu(g, None)
    with pytest.raises(ValueError, match="odd"):
        ds.swiglu_packed(torch.randn(4, 7))
    with pytest.raises(TypeError, match="limit must be a number"):
        ds.swiglu_clamped(g, g, limit="7")
    assert math.isfinite(ds.swiglu_clamped(g, g, limit=10).sum().item())
