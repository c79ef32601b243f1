"""CUDA reliability: out of memory inside an expertact call (torch.OutOfMemoryError, no sticky
error, the next calls work), CUDA graph capture and replay (torch.cuda.graph and
make_graphed_callables, plain and in-place backward, with weights), and no host
synchronisation in the ops. Skipped without a GPU."""
import contextlib
import gc

import pytest
import torch

import expertact
from conftest import assert_matches, error_scales, make_inputs, reference_grads, requires_cuda

pytestmark = requires_cuda

DT = torch.bfloat16
MiB = 1 << 20


# ---------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------


def _unit_bytes():
    """The size of one [rows, F] bf16 operand: 1/64 of the device (2 GiB on an 80-141 GB GPU),
    at least 64 MiB, so that a cap well under the device's memory decides the OOM."""
    total = torch.cuda.get_device_properties(0).total_memory
    return max(64 * MiB, min(2048 * MiB, total // 64))


@contextlib.contextmanager
def allocator_cap(headroom):
    """Caps the caching allocator at what this process holds now plus `headroom` bytes (a
    fraction of the device's total memory, set_per_process_memory_fraction's unit), and
    restores the default (1.0) after."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + headroom) / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _inputs(layout, rows, f, seed=0):
    """Leaf inputs made on the GPU (the OOM tests' are gigabytes: no float64 host copy)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    shapes = [(rows, f)] * 2 if layout == "separate" else [(rows, 2 * f)]
    return [(torch.randn(s, device="cuda", dtype=DT, generator=gen) * 4).requires_grad_() for s in shapes]


def _shape(unit):
    """(rows, F) of a [rows, F] bf16 tensor of `unit` bytes."""
    f = 2048
    return unit // (2 * f), f


def _still_works():
    """After an OOM: no sticky CUDA error; a torch op and an expertact call give correct results."""
    torch.cuda.synchronize()
    a = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert (a * 2).sum().item() == 999 * 1000
    (gu,) = _inputs("interleaved", 300, 257, seed=9)
    out = expertact.swiglu_oai(gu, layout="interleaved")
    dy = torch.randn(out.shape, device="cuda", dtype=DT)
    out.backward(dy)
    ref_out, (ref_g,) = reference_grads("swiglu_oai", [gu], "interleaved", dy)
    s_out, (s_g,) = error_scales("swiglu_oai", [gu], "interleaved", dy)
    assert_matches(out, ref_out, DT, s_out)
    assert_matches(gu.grad, ref_g, DT, s_g)


def test_oom_in_forward_output():
    """The forward's output buffer does not fit: torch.OutOfMemoryError, nothing leaked."""
    rows, f = _shape(_unit_bytes())
    (gu,) = _inputs("halves", rows, f)  # 2 units; the output needs 1
    before = torch.cuda.memory_allocated()
    with allocator_cap(_unit_bytes() // 2):
        with pytest.raises(torch.OutOfMemoryError):
            expertact.swiglu(gu, layout="halves")
    gc.collect()  # frames of the traceback may hold buffers until their cycle is collected
    assert torch.cuda.memory_allocated() == before
    del gu
    _still_works()


@pytest.mark.parametrize("which", ["first", "second"])
def test_oom_in_backward_gradients(which):
    """Separate layout: the first (grad_gate) or the second (grad_up) gradient buffer does not
    fit: torch.OutOfMemoryError out of backward(), the first buffer freed again."""
    unit = _unit_bytes()
    rows, f = _shape(unit)
    g, u = _inputs("separate", rows, f)
    w = torch.rand(rows, device="cuda", requires_grad=True)
    out = expertact.swiglu_oai(g, u, weights=w)
    dy = torch.randn(out.shape, device="cuda", dtype=DT)
    before = torch.cuda.memory_allocated()
    with allocator_cap(unit // 2 if which == "first" else unit + unit // 2):
        with pytest.raises(torch.OutOfMemoryError):
            out.backward(dy)
    assert g.grad is None and u.grad is None
    gc.collect()  # the first gradient buffer, held by the traceback's frames until collected
    assert torch.cuda.memory_allocated() <= before
    del g, u, w, out, dy
    _still_works()


def test_oom_inplace_backward_fits_where_out_of_place_does_not():
    """Under a cap that leaves no room for a gradient buffer, the out-of-place backward fails
    with OutOfMemoryError and the in-place backward (docs/spec.md section 3: no gradient buffers)
    runs, with correct gradients."""
    unit = _unit_bytes()
    rows, f = _shape(unit)
    for inplace in (False, True):
        g, u = _inputs("separate", rows, f, seed=3)
        probe = slice(rows - 5, rows)
        g0, u0 = g.detach()[probe].clone(), u.detach()[probe].clone()
        out = expertact.swiglu(g, u, inplace_backward=inplace)
        dy = torch.randn(out.shape, device="cuda", dtype=DT)
        with allocator_cap(unit // 4):  # far less than one gradient buffer
            if inplace:
                out.backward(dy)
            else:
                with pytest.raises(torch.OutOfMemoryError):
                    out.backward(dy)
        if inplace:
            assert g.grad.data_ptr() == g.data_ptr()
            _, (rg, ru) = reference_grads("swiglu", [g0, u0], "separate", dy[probe])
            _, (sg, su) = error_scales("swiglu", [g0, u0], "separate", dy[probe])
            assert_matches(g.grad[probe], rg, DT, sg)
            assert_matches(u.grad[probe], ru, DT, su)
        del g, u, out, dy
    _still_works()


# ---------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------


def _fresh(layout, rows, f, seed):
    xs = make_inputs(layout, (rows, f), DT, "cuda", seed=seed)
    w = torch.rand(rows, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    dy = torch.randn(rows, f, device="cuda", dtype=DT, generator=torch.Generator("cuda").manual_seed(seed + 1))
    return xs, w, dy


def _eager(layout, xs, w, dy, inplace):
    """Output and gradients of an eager call on copies of the values."""
    xs = [x.clone().requires_grad_() for x in xs]
    w = w.clone().requires_grad_()
    out = (expertact.swiglu_oai(*xs, weights=w, inplace_backward=inplace) if layout == "separate" else
           expertact.swiglu_oai(xs[0], layout=layout, weights=w, inplace_backward=inplace))
    grads = torch.autograd.grad(out, xs + [w], dy)
    return [out.detach()] + [g.detach() for g in grads]


def _check_against(got, layout, xs, w, dy, inplace):
    """got (out, input grads..., weight grad) equals the eager call bit for bit (same kernels,
    same geometry) and matches the float64 oracle."""
    want = _eager(layout, xs, w, dy, inplace)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ref_out, ref_grads = reference_grads("swiglu_oai", xs, layout, dy, weights=w)
    s_out, s_grads = error_scales("swiglu_oai", xs, layout, dy, weights=w)
    assert_matches(got[0], ref_out, DT, s_out)
    for g, r, s in zip(got[1:-1], ref_grads[:-1], s_grads):
        assert_matches(g, r, DT, s)


@pytest.mark.parametrize("inplace", [False, True], ids=["plain", "inplace"])
@pytest.mark.parametrize("layout", ["separate", "interleaved"])
def test_graph_capture_replay(layout, inplace):
    """Forward and backward (with weights and their gradient) captured in one graph; each replay
    after new values are copied into the static inputs gives what an eager call gives."""
    rows, f = 777, 1000  # odd rows; F not a multiple of 128
    xs, w, dy = _fresh(layout, rows, f, seed=1)
    static_x = [x.clone() for x in xs]
    static_w, static_dy = w.clone(), dy.clone()

    def step():
        ins = [x.detach().requires_grad_() for x in static_x]  # in place: the gradients land in static_x
        ww = static_w.detach().requires_grad_()
        out = (expertact.swiglu_oai(*ins, weights=ww, inplace_backward=inplace) if layout == "separate" else
               expertact.swiglu_oai(ins[0], layout=layout, weights=ww, inplace_backward=inplace))
        return [out] + list(torch.autograd.grad(out, ins + [ww], static_dy))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode="global": an unsafe CUDA call anywhere fails it
        static_res = step()
    for seed in (11, 12):
        xs, w, dy = _fresh(layout, rows, f, seed=seed)
        for sx, x in zip(static_x, xs):
            sx.copy_(x)
        static_w.copy_(w)
        static_dy.copy_(dy)
        graph.replay()
        torch.cuda.synchronize()
        _check_against([r.detach().clone() for r in static_res], layout, xs, w, dy, inplace)
        if inplace:
            assert static_res[1].data_ptr() == static_x[0].data_ptr()


@pytest.mark.parametrize("inplace", [False, True], ids=["plain", "inplace"])
def test_make_graphed_callables(inplace):
    """torch.cuda.make_graphed_callables around an expertact call: its forward and backward
    graphs, called on new tensors, give what an eager call gives."""
    rows, f, layout = 513, 384, "interleaved"

    def fn(gate_up, weights):
        return expertact.swiglu_oai(gate_up, layout=layout, weights=weights, inplace_backward=inplace)

    xs, w, _ = _fresh(layout, rows, f, seed=2)
    graphed = torch.cuda.make_graphed_callables(fn, (xs[0].clone().requires_grad_(), w.clone().requires_grad_()))
    for seed in (21, 22):
        xs, w, dy = _fresh(layout, rows, f, seed=seed)
        gu, ww = xs[0].clone().requires_grad_(), w.clone().requires_grad_()
        out = graphed(gu, ww)
        out.backward(dy)
        torch.cuda.synchronize()
        _check_against([out.detach().clone(), gu.grad.clone(), ww.grad.clone()], layout, xs, w, dy, inplace)


@pytest.mark.parametrize("inplace", [False, True], ids=["plain", "inplace"])
def test_no_host_sync(inplace):
    """torch's sync debug mode "error" raises on any synchronising torch call (.item(), a
    device-to-host copy, ...) made by the Python layer in forward or backward."""
    xs, w, dy = _fresh("halves", 256, 640, seed=4)
    gu, ww = xs[0].clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = expertact.swiglu_clamped(gu, layout="halves", weights=ww, limit=10.0, inplace_backward=inplace)
        out.backward(dy)
        out2 = expertact.glu(gu.detach()[:, :640], gu.detach()[:, 640:], activation="gelu_tanh", beta=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == (256, 640) and gu.grad is not None and ww.grad is not None and out2.shape == (256, 640)
