"""CUDA specifics: the current stream of the tensor's own device, CUDA graph capture,
a device other than the current one, torch.compile on CUDA, a tensor over 2^31 elements
(opt-in: EXPERTACT_TEST_LARGE=1). Skipped without a GPU."""
import os

import pytest
import torch

import expertact
from conftest import TOL, make_inputs, reference, reference_grads, requires_2_gpus, requires_cuda, split

pytestmark = requires_cuda


def _check(got, want, dtype):
    torch.testing.assert_close(got.double(), want.to(dtype).double(), equal_nan=True, **TOL[dtype])


def _oai_ref(g, u):
    return reference(g.double(), u.double(), "silu", 1.702, 7.0, 1.0)


def test_runs_on_the_current_stream():
    """Forward and backward are queued on the current (non-default) stream: behind a long
    kernel on that stream that writes their inputs. On any other stream they would read
    the inputs before the writes land."""
    rows, f = 4096, 1024
    src_g, src_u = make_inputs("separate", (rows, f), torch.bfloat16, "cuda")
    g = torch.zeros_like(src_g).requires_grad_()
    u = torch.zeros_like(src_u).requires_grad_()
    grad = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the inputs are written
        with torch.no_grad():
            g.copy_(src_g)
            u.copy_(src_u)
        out = expertact.swiglu_oai(g, u)
        out.backward(grad)
    s.synchronize()
    ref_out, (rg, ru) = reference_grads("swiglu_oai", [src_g, src_u], "separate", grad)
    _check(out, ref_out, torch.bfloat16)
    _check(g.grad, rg, torch.bfloat16)
    _check(u.grad, ru, torch.bfloat16)


def test_cuda_graph_capture():
    rows, f = 1000, 384
    (gu,) = make_inputs("interleaved", (rows, f), torch.bfloat16, "cuda")
    gu.requires_grad_()
    w = torch.rand(rows, device="cuda", requires_grad=True)
    grad = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)

    def step():
        out = expertact.swiglu_oai(gu, layout="interleaved", weights=w)
        dgu, dw = torch.autograd.grad(out, (gu, w), grad)
        return out, dgu, dw

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dgu, dw = step()
    (new,) = make_inputs("interleaved", (rows, f), torch.bfloat16, "cuda", seed=5)
    with torch.no_grad():
        gu.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, (rgu, rw) = reference_grads("swiglu_oai", [new], "interleaved", grad, weights=w)
    _check(out, ref_out, torch.bfloat16)
    _check(dgu, rgu, torch.bfloat16)
    torch.testing.assert_close(dw.double(), rw, rtol=1e-3, atol=1e-2)


def test_cuda_graph_capture_inplace_backward():
    rows, f = 512, 256
    (base,) = make_inputs("halves", (rows, f), torch.bfloat16, "cuda")
    x = base.clone()
    grad = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)

    def step():
        xr = x.detach().requires_grad_()
        out = expertact.swiglu(xr, inplace_backward=True)
        (dx,) = torch.autograd.grad(out, (xr,), grad)
        return out, dx

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.copy_(base)
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dx = step()
    x.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, (rx,) = reference_grads("swiglu", [base], "halves", grad)
    _check(out, ref_out, torch.bfloat16)
    _check(dx, rx, torch.bfloat16)
    assert dx.data_ptr() == x.data_ptr()  # written over the input


@requires_2_gpus
def test_device_other_than_current():
    """Tensors on cuda:1 while cuda:0 is current: the kernel runs on cuda:1, on cuda:1's
    current stream, and the caller's current device is left as it was."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    src_g, src_u = make_inputs("separate", (2048, 512), torch.bfloat16, dev)
    g = torch.zeros_like(src_g).requires_grad_()
    u = torch.zeros_like(src_u).requires_grad_()
    grad = torch.randn(2048, 512, device=dev, dtype=torch.bfloat16)
    s1 = torch.cuda.Stream(device=dev)
    s1.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s1):  # makes s1 current on cuda:1 (and cuda:1 the current device)
        torch.cuda._sleep(200_000_000)  # on s1: the inputs are written ~0.1 s from now
        with torch.no_grad():
            g.copy_(src_g)
            u.copy_(src_u)
        torch.cuda.set_device(0)  # cuda:0 current again; s1 stays cuda:1's current stream
        assert torch.cuda.current_stream(dev) == s1
        out = expertact.swiglu_oai(g, u)
        out.backward(grad)
        assert torch.cuda.current_device() == 0
    s1.synchronize()
    torch.cuda.synchronize(0)
    assert out.device == dev and g.grad.device == dev
    ref_out, (rg, ru) = reference_grads("swiglu_oai", [src_g, src_u], "separate", grad)
    _check(out, ref_out, torch.bfloat16)
    _check(g.grad, rg, torch.bfloat16)
    _check(u.grad, ru, torch.bfloat16)


def test_misaligned_and_odd_sizes():
    for f in (1, 7, 9, 100, 1408, 3072, 11008 + 1):
        buf = torch.randn(17 * (2 * f + 3) + 5, device="cuda", dtype=torch.bfloat16) * 4
        gu = buf[1:1 + 17 * (2 * f + 1)].reshape(17, 2 * f + 1)[:, :2 * f]  # odd offset, odd row stride
        for layout in ("halves", "up_first", "interleaved"):
            g, u = split(gu, layout)
            _check(expertact.swiglu_oai(gu, layout=layout), _oai_ref(g, u), torch.bfloat16)


def test_torch_compile_cuda():
    torch._dynamo.reset()
    (gu,) = make_inputs("interleaved", (256, 128), torch.bfloat16, "cuda")
    gu.requires_grad_()

    def f(x):
        return expertact.swiglu_oai(x * 1, layout="interleaved", inplace_backward=True).float().square().sum()

    cf = torch.compile(f, fullgraph=True)
    cf(gu).backward()
    got = gu.grad.clone()
    gu.grad = None
    f(gu).backward()
    torch.testing.assert_close(got, gu.grad, **TOL[torch.bfloat16])


@pytest.mark.skipif(os.environ.get("EXPERTACT_TEST_LARGE") != "1", reason="opt-in: EXPERTACT_TEST_LARGE=1 (~30 GiB)")
def test_over_2_31_elements():
    rows, f = (1 << 31) // 3072 + 7, 3072  # rows * F > 2^31
    gu = torch.empty(rows, 2 * f, device="cuda", dtype=torch.bfloat16).normal_().mul_(4).requires_grad_()
    out = expertact.swiglu_oai(gu, layout="interleaved")
    out.backward(torch.ones_like(out))
    for sl in (slice(0, 3), slice(rows - 3, rows), slice(rows // 2, rows // 2 + 2)):
        g, u = gu.detach()[sl, 0::2], gu.detach()[sl, 1::2]
        _check(out[sl], _oai_ref(g, u), torch.bfloat16)
        ref_out, (rg,) = reference_grads("swiglu_oai", [gu.detach()[sl]], "interleaved",
                                         torch.ones(out[sl].shape, device="cuda", dtype=torch.bfloat16))
        _check(gu.grad[sl], rg, torch.bfloat16)
