"""The contract of DeepSpeed's Triton SwiGLU module (deepspeed.ops.triton_ops.swiglu_triton:
swiglu and swiglu_packed), checked against the drop-in names of expertact.deepspeed: values
and gradients against the eager expression silu(gate) * up, empty and non-contiguous inputs,
the packed form equal to the separate one bit for bit, and the errors DeepSpeed's functions
raise (ValueError for mismatched shapes or dtypes and for an odd packed width; RuntimeError
naming the second derivative for create_graph=True). The cases follow DeepSpeed 0.19.8's own
unit test of that module (tests/unit/v1/ops/triton_ops/test_swiglu_triton.py), with its
shapes and tolerances; they run on the CPU here, and on CUDA where there is a GPU."""
import pytest
import torch
import torch.nn.functional as F

import expertact
from expertact import deepspeed as ds
from conftest import DEVICES, requires_2_gpus

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype):
    # DeepSpeed's test tolerances for its fused kernel against the eager expression.
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}[dtype]


def _eager(gate, up):
    return F.silu(gate) * up


def _randn(shape, dtype, device, gen, requires_grad=False):
    t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
    return t.requires_grad_(requires_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(32, 16), (1, 1), (128, 512), (7, 13), (4, 2048), (2, 3000)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_silu_gate_times_up(dtype, shape, device):
    gen = torch.Generator().manual_seed(11)
    gate, up = _randn(shape, dtype, device, gen), _randn(shape, dtype, device, gen)
    out = ds.swiglu(gate, up)
    want = _eager(gate, up)
    assert out.shape == want.shape and out.dtype == dtype and out.device == gate.device
    torch.testing.assert_close(out, want, **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(32, 16), (128, 512), (7, 13), (4, 2048), (2, 3000)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_are_eager_gradients(dtype, shape, device):
    gen = torch.Generator().manual_seed(12)
    gate, up = _randn(shape, dtype, device, gen, True), _randn(shape, dtype, device, gen, True)
    gate_eager, up_eager = (t.detach().clone().requires_grad_() for t in (gate, up))
    dy = _randn(shape, dtype, device, gen)
    ds.swiglu(gate, up).backward(dy)
    _eager(gate_eager, up_eager).backward(dy)
    torch.testing.assert_close(gate.grad, gate_eager.grad, **_tol(dtype))
    torch.testing.assert_close(up.grad, up_eager.grad, **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device):
    gate, up = (torch.empty(0, 16, device=device, requires_grad=True) for _ in range(2))
    out = ds.swiglu(gate, up)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert gate.grad.shape == gate.shape and up.grad.shape == up.shape


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_inputs(device):
    gen = torch.Generator().manual_seed(13)
    gate = _randn((64, 32), torch.float32, device, gen).t()
    up = _randn((64, 32), torch.float32, device, gen).t()
    assert not gate.is_contiguous()
    torch.testing.assert_close(ds.swiglu(gate, up), _eager(gate, up), **_tol(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_and_up_of_different_shapes_raise_value_error(device):
    with pytest.raises(ValueError):
        ds.swiglu(torch.randn(8, 16, device=device), torch.randn(8, 32, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(32, 16), (1, 1), (7, 13), (4, 768), (3, 5, 384), (0, 16)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_is_the_separate_form_bit_for_bit(dtype, shape, device):
    """One [..., 2I] tensor holding gate then up gives exactly the separate form's output, and
    its gradient is exactly the separate gradients side by side."""
    gen = torch.Generator().manual_seed(14)
    gate, up = _randn(shape, dtype, device, gen, True), _randn(shape, dtype, device, gen, True)
    gate_up = torch.cat([gate, up], dim=-1).detach().requires_grad_()
    dy = _randn(shape, dtype, device, gen)
    packed, separate = ds.swiglu_packed(gate_up), ds.swiglu(gate, up)
    assert packed.shape == separate.shape and packed.dtype == dtype
    torch.testing.assert_close(packed, separate, rtol=0, atol=0)
    torch.testing.assert_close(packed, _eager(gate, up), **_tol(dtype))
    packed.backward(dy)
    separate.backward(dy)
    torch.testing.assert_close(gate_up.grad, torch.cat([gate.grad, up.grad], dim=-1), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_transposed_input_and_gradient(dtype, device):
    gen = torch.Generator().manual_seed(15)
    gate_up = _randn((32, 64), dtype, device, gen).t().requires_grad_()  # [64, 32], column-major
    twin = gate_up.detach().clone().requires_grad_()
    gate, up = twin.chunk(2, dim=-1)
    dy = _randn((16, 64), dtype, device, gen).t()
    assert not gate_up.is_contiguous() and not dy.is_contiguous()
    packed, separate = ds.swiglu_packed(gate_up), ds.swiglu(gate, up)
    torch.testing.assert_close(packed, _eager(gate, up), **_tol(dtype))
    torch.testing.assert_close(packed, separate, rtol=0, atol=0)
    packed.backward(dy)
    separate.backward(dy)
    torch.testing.assert_close(gate_up.grad, twin.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_create_graph_raises(dtype, device):
    gate_up = torch.ones(4, 32, device=device, dtype=dtype, requires_grad=True)
    loss = ds.swiglu_packed(gate_up).float().sum()
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(loss, gate_up, create_graph=True)


@requires_2_gpus
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_packed_runs_on_the_input_device_and_stream(dtype):
    """Inputs on GPU 1 under a side stream of GPU 1, called while GPU 0 is current: the result
    is right, and the caller's current device and stream are unchanged."""
    with torch.cuda.device(0):
        caller_stream = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=1)
        with torch.cuda.stream(side):
            gate_up = torch.ones(7, 26, device="cuda:1", dtype=dtype, requires_grad=True)
            twin = gate_up.detach().clone().requires_grad_()
        with torch.cuda.stream(side), torch.cuda.device(0):
            out = ds.swiglu_packed(gate_up)
            assert torch.cuda.current_device() == 0
            want = _eager(*twin.chunk(2, dim=-1))
            out.float().sum().backward()
            want.float().sum().backward()
            assert torch.cuda.current_device() == 0
        side.synchronize()
        assert torch.cuda.current_stream() == caller_stream
        torch.testing.assert_close(out, want, **_tol(dtype))
        torch.testing.assert_close(gate_up.grad, twin.grad, **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_packed_odd_width_raises_value_error(device):
    for fn in (ds.swiglu_packed, ds.swiglu_clamped_packed):
        with pytest.raises(ValueError, match="even last dimension"):
            fn(torch.randn(4, 7, device=device))
        with pytest.raises(ValueError, match="even last dimension"):
            fn(torch.tensor(1.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_and_up_of_different_dtypes_raise_value_error(device):
    """DeepSpeed raises ValueError; expertact's DTypeError is that and a TypeError (torch's
    convention for a wrong dtype), so code written for either contract catches it."""
    gate = torch.randn(8, 16, device=device, dtype=torch.float16)
    up = torch.randn(8, 16, device=device, dtype=torch.float32)
    for exc in (ValueError, TypeError, expertact.DTypeError):
        with pytest.raises(exc):
            ds.swiglu(gate, up)
    with pytest.raises(ValueError):
        ds.swiglu_backward(torch.randn(8, 16, device=device, dtype=torch.float16), gate, up)
