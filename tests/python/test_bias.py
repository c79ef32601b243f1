"""Per-expert biases: expert_mlp's b13 / b2, functional's bias= / expert_bias, against a float64
composition of torch operations (docs/spec.md section 7). CPU here; the CUDA cases run where a
GPU is (bf16 and float32 on the kernels of src/cuda/bias_cuda.cu)."""
import pytest
import torch

import expertact
from expertact import functional as Fn
from expertact.moe import expert_mlp
from support.oracle import glu64

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

_ACT_KW = {"swiglu": {}, "swiglu_clamped": {"limit": 2.5}, "swiglu_oai": {"alpha": 1.702, "limit": 2.0},
           "geglu_tanh": {}}


def _experts_of(offsets, T):
    return torch.searchsorted(offsets.cpu().long(), torch.arange(T), right=True)


def _bias_rows(b, eidx):
    return torch.cat((b, b.new_zeros((1, b.shape[1]))))[eidx.to(b.device)]


def _reference(x, w13, w2, offsets, activation, layout, weights, b13, b2, **act_kw):
    """y of the biased expert MLP, float64, GPT-OSS's order: (act(x w13 + b13) w2 + b2) * weights."""
    T = x.shape[0]
    F = w13.shape[-1] // 2
    eidx = _experts_of(offsets, T)
    ends = offsets.tolist()
    start, parts = 0, []
    for e, stop in enumerate(ends):
        parts.append(x[start:stop] @ w13[e])
        start = stop
    gate_up = torch.cat(parts + [x.new_zeros((T - start, w13.shape[-1]))])
    if b13 is not None:
        gate_up = gate_up + _bias_rows(b13, eidx)
    h = glu64(gate_up, layout, activation, **act_kw)
    start, parts = 0, []
    for e, stop in enumerate(ends):
        parts.append(h[start:stop] @ w2[e])
        start = stop
    y = torch.cat(parts + [x.new_zeros((T - start, w2.shape[-1]))])
    if b2 is not None:
        y = y + _bias_rows(b2, eidx) * (eidx < len(ends)).to(y.dtype)[:, None]
    if weights is not None:
        y = y * weights.to(y.dtype)[:, None]
    return y


def _problem(dtype, device, T=37, D=24, F=16, ends=(5, 5, 20, 31), seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    E = len(ends)
    mk = lambda *s, sc=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * sc).to(dtype).to(device)
    x = mk(T, D, sc=scale)
    w13 = mk(E, D, 2 * F, sc=0.3)
    w2 = mk(E, F, D, sc=0.3)
    b13 = mk(E, 2 * F)
    b2 = mk(E, D)
    weights = torch.rand(T, generator=g).to(device)
    offsets = torch.tensor(ends, dtype=torch.int32)
    return x, w13, w2, offsets, weights, b13, b2


def _grads(y, dy, tensors):
    return torch.autograd.grad(y, tensors, dy)


@pytest.mark.parametrize("activation", list(_ACT_KW))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
@pytest.mark.parametrize("mode", ["plain", "recompute", "inplace"])
def test_expert_mlp_biases_float64(activation, layout, mode):
    x, w13, w2, offsets, weights, b13, b2 = _problem(torch.float64, "cpu")
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights, b13, b2)]
    kw = dict(_ACT_KW[activation])
    y = expert_mlp(x, w13, w2, offsets, activation, layout=layout, weights=weights, b13=b13, b2=b2,
                   recompute=mode == "recompute", inplace_backward=mode == "inplace", **kw)
    ref = _reference(x, w13, w2, offsets, activation, layout, weights, b13, b2, **kw)
    # alpha and limit reach the kernels as float32: a few 1e-8 of difference in float64
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6), (y - ref).abs().max()
    assert torch.all(y[31:] == 0)
    dy = torch.randn_like(y)
    got = _grads(y, dy, leaves)
    want = _grads(ref, dy, leaves)
    for name, a, b in zip(("x", "w13", "w2", "weights", "b13", "b2"), got, want):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5), (name, (a.double() - b).abs().max())


@pytest.mark.parametrize("which", ["b13", "b2", "both"])
def test_expert_mlp_one_bias(which):
    x, w13, w2, offsets, weights, b13, b2 = _problem(torch.float64, "cpu", seed=3)
    b13 = b13 if which in ("b13", "both") else None
    b2 = b2 if which in ("b2", "both") else None
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights) + tuple(t for t in (b13, b2) if t is not None)]
    y = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights, b13=b13, b2=b2)
    ref = _reference_defaults(x, w13, w2, offsets, weights, b13, b2)
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(y)
    for a, b in zip(_grads(y, dy, leaves), _grads(ref, dy, leaves)):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def _reference_defaults(x, w13, w2, offsets, weights, b13, b2):
    """The reference of expert_mlp's swiglu_oai defaults (alpha 1.702, limit 7), interleaved."""
    return _reference(x, w13, w2, offsets, "swiglu_oai", "interleaved", weights, b13, b2, alpha=1.702, limit=7.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_mlp_biases_against_float64(device, dtype):
    """float32 / bf16 storage against the float64 oracle: errors of the storage's rounding."""
    x, w13, w2, offsets, weights, b13, b2 = _problem(dtype, device, T=300, D=64, F=48, ends=(40, 40, 170, 260),
                                                     seed=5)
    leaves = [t.requires_grad_() for t in (x, w13, w2, weights, b13, b2)]
    y = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights, b13=b13, b2=b2)
    leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref = _reference_defaults(leaves64[0], leaves64[1], leaves64[2], offsets, leaves64[3], leaves64[4], leaves64[5])
    dy = torch.randn(y.shape, dtype=torch.float64)
    got = _grads(y, dy.to(dtype).to(device), leaves)
    want = _grads(ref, dy, leaves64)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for name, a, b in zip(("y",) + ("x", "w13", "w2", "weights", "b13", "b2"), (y,) + tuple(got), (ref,) + tuple(want)):
        a = a.detach().double().cpu()
        assert not torch.isnan(a).any(), name
        err = ((a - b).norm() / b.norm()).item()
        assert err < tol, (name, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_bias_gradients_bit_identical(device, inplace):
    """Two identical runs give bit-identical gradients (no float atomics in the bias sums)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    outs = []
    for _ in range(2):
        x, w13, w2, offsets, weights, b13, b2 = _problem(dtype, device, T=5000, D=64, F=64,
                                                         ends=(1000, 1000, 3100, 4990), seed=7)
        leaves = [t.requires_grad_() for t in (x, w13, w2, weights, b13, b2)]
        y = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights, b13=b13, b2=b2,
                       inplace_backward=inplace)
        outs.append(_grads(y, torch.ones_like(y), leaves))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_bias_thread_count_independent():
    x, w13, w2, offsets, weights, b13, b2 = _problem(torch.float32, "cpu", T=5000, D=32, F=32,
                                                     ends=(1000, 1000, 3100, 4990), seed=8)
    results = []
    before = expertact.cpu_threads()
    try:
        for n in (1, 2, 3):
            expertact.set_cpu_threads(n)
            leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, weights, b13, b2)]
            y = expert_mlp(*leaves[:3], offsets, "swiglu_oai", layout="interleaved", weights=leaves[3],
                           b13=leaves[4], b2=leaves[5])
            results.append(_grads(y, torch.ones_like(y), leaves)[3:])
    finally:
        expertact.set_cpu_threads(before)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


def test_bias_errors():
    x, w13, w2, offsets, weights, b13, b2 = _problem(torch.float32, "cpu")
    with pytest.raises(ValueError, match="b13 has shape"):
        expert_mlp(x, w13, w2, offsets, b13=b13[:, :-2])
    with pytest.raises(ValueError, match="b2 has shape"):
        expert_mlp(x, w13, w2, offsets, b2=b2.t())
    with pytest.raises(TypeError, match="b13 has dtype"):
        expert_mlp(x, w13, w2, offsets, b13=b13.double())
    with pytest.raises(TypeError, match="b2 must be a torch.Tensor"):
        expert_mlp(x, w13, w2, offsets, b2=[1.0])
    if CUDA:
        with pytest.raises(ValueError, match="b2 is on"):
            expert_mlp(x, w13, w2, offsets, b2=b2.cuda())


def test_fused_is_deprecated_and_ignored():
    """fused=True (the removed experimental GEMMs) warns and computes the same as without it."""
    x, w13, w2, offsets, weights, b13, b2 = _problem(torch.float32, "cpu", seed=2)
    with pytest.warns(FutureWarning, match="fused=True is deprecated"):
        y = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights, b13=b13, b2=b2,
                       fused=True)
    ref = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights, b13=b13, b2=b2)
    assert torch.equal(y, ref)


def test_zero_biases_equal_no_biases():
    x, w13, w2, offsets, weights, b13, b2 = _problem(torch.float32, "cpu", seed=4)
    y0 = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights)
    y1 = expert_mlp(x, w13, w2, offsets, "swiglu_oai", layout="interleaved", weights=weights,
                    b13=torch.zeros_like(b13), b2=torch.zeros_like(b2))
    # the same function; the biased kernel may round differently from the unbiased one
    assert torch.allclose(y0, y1, rtol=1e-6, atol=1e-6)


# --- the activation API ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["separate", "halves", "up_first", "interleaved"])
@pytest.mark.parametrize("inplace", [False, True])
def test_glu_bias(device, dtype, layout, inplace):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU-only")
    T, F, E = 301, 40, 5
    g = torch.Generator().manual_seed(11)
    offsets = torch.tensor([50, 50, 120, 250, 290], dtype=torch.int32, device=device)
    # the oracle reads the values as stored (rounded to dtype): the clamps' masks then agree
    z = (torch.randn(T, 2 * F, generator=g, dtype=torch.float64) * 3).to(dtype).double()
    b = torch.randn(E, 2 * F, generator=g, dtype=torch.float64).to(dtype).double()
    w = torch.rand(T, generator=g, dtype=torch.float64)
    dy = torch.randn(T, F, generator=g, dtype=torch.float64)
    kw = dict(activation="silu", alpha=1.702, limit=3.0, beta=1.0)
    # the oracle: (gate, up) of z + bias in the layout's column order
    z64, b64, w64 = (t.clone().requires_grad_() for t in (z, b, w))
    eidx = _experts_of(offsets, T)
    zb = z64 + _bias_rows(b64, eidx)
    gcols = {"interleaved": slice(0, None, 2), "up_first": slice(F, None)}.get(layout, slice(0, F))
    ucols = {"interleaved": slice(1, None, 2), "up_first": slice(0, F)}.get(layout, slice(F, None))
    gg, uu = zb[:, gcols].clamp(max=3.0), zb[:, ucols].clamp(-3.0, 3.0)
    ref = gg * torch.sigmoid(1.702 * gg) * (uu + 1) * w64.float().double()[:, None]
    ref.backward(dy)
    zt = z.to(dtype).to(device)
    bt = b.to(dtype).to(device).requires_grad_()
    wt = w.float().to(device).requires_grad_()
    if layout == "separate":
        gate = zt[:, :F].clone().requires_grad_()
        up = zt[:, F:].clone().requires_grad_()
        out = Fn.glu(gate, up, bias=bt, offsets=offsets, weights=wt, inplace_backward=inplace, **kw)
        ins = (gate, up)
    else:
        zin = zt.clone().requires_grad_()
        out = Fn.glu(zin * 1 if inplace else zin, layout=layout, bias=bt, offsets=offsets, weights=wt,
                     inplace_backward=inplace, **kw)
        ins = (zin,)
    out.backward(dy.to(dtype).to(device))
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    rel = lambda a, r: ((a.detach().double().cpu() - r).norm() / r.norm()).item()
    assert rel(out, ref.detach()) < tol
    if layout == "separate":
        gz = torch.cat((ins[0].grad, ins[1].grad), 1)
        assert rel(gz, z64.grad) < tol
    else:
        assert rel(ins[0].grad, z64.grad) < tol
    assert rel(bt.grad, b64.grad) < tol
    assert rel(wt.grad, w64.grad) < max(tol, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_expert_bias(device, dtype):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU-only")
    T, C, E = 413, 72, 6
    g = torch.Generator().manual_seed(12)
    offsets = torch.tensor([0, 100, 100, 250, 300, 400], dtype=torch.int32)
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    b = torch.randn(E, C, generator=g, dtype=torch.float64)
    w = torch.rand(T, generator=g, dtype=torch.float64).float().double()
    dy = torch.randn(T, C, generator=g, dtype=torch.float64)
    x64, b64, w64 = (t.clone().requires_grad_() for t in (x, b, w))
    eidx = _experts_of(offsets, T)
    ref = x64 + _bias_rows(b64, eidx) * w64[:, None]
    ref.backward(dy)
    xt = x.to(dtype).to(device).requires_grad_()
    bt = b.to(dtype).to(device).requires_grad_()
    wt = w.float().to(device).requires_grad_()
    out = Fn.expert_bias(xt, bt, offsets.to(device), weights=wt)
    out.backward(dy.to(dtype).to(device))
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    rel = lambda a, r: ((a.detach().double().cpu() - r).norm() / r.norm()).item()
    assert rel(out, ref.detach()) < tol
    assert rel(xt.grad, x64.grad) < tol
    assert rel(bt.grad, b64.grad) < tol
    assert rel(wt.grad, w64.grad) < max(tol, 1e-6)
    assert torch.equal(out[400:].cpu(), xt[400:].detach().cpu())  # past the last offset: no bias


def test_glu_bias_errors():
    z = torch.randn(10, 8)
    b = torch.randn(2, 8)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets"):
        Fn.swiglu(z, layout="halves", bias=b)
    with pytest.raises(ValueError, match="bias"):
        Fn.swiglu(z, layout="halves", offsets=offs)
    with pytest.raises(ValueError, match="non-decreasing"):
        Fn.swiglu(z, layout="halves", bias=b, offsets=torch.tensor([6, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="past the last row"):
        Fn.swiglu(z, layout="halves", bias=b, offsets=torch.tensor([4, 11], dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        Fn.swiglu(z, layout="halves", bias=b, offsets=offs.long())
    with pytest.raises(ValueError, match="bias"):
        Fn.swiglu(z, layout="halves", bias=torch.randn(2, 6), offsets=offs)
    with pytest.raises(ValueError, match="bias"):
        Fn.swiglu(z, layout="halves", bias=torch.randn(3, 8), offsets=offs)
    with pytest.raises(TypeError, match="bias"):
        Fn.swiglu(z, layout="halves", bias=b.double(), offsets=offs)
    with pytest.raises(ValueError, match="bias"):
        Fn.expert_bias(z, torch.randn(2, 7), offs)


def test_c_abi_bias_workspace_and_checks():
    """The C entry points name what is wrong (the Python layer's checks stand aside here)."""
    import ctypes
    from expertact import _capi, _ops
    lib = _capi.LIB
    assert lib.expertact_glu_bias_workspace_bytes(0, 8, 2) == 0
    assert lib.expertact_glu_bias_workspace_bytes(1000, 8, 2) >= (125 + 2) * 16 * 4
    z = torch.randn(10, 8)
    b = torch.randn(2, 8)
    # offsets out of order on the CPU: the library itself refuses them
    with pytest.raises(ValueError, match="non-decreasing"):
        _ops.glu_forward_bias(z, None, b, torch.tensor([6, 4], dtype=torch.int32), None, 1, 0, 1.0, float("inf"), 0.0)
    with pytest.raises(ValueError, match="past the last row"):
        _ops.expert_bias_forward(z, b, torch.tensor([4, 12], dtype=torch.int32), None)


def test_bias_kernels_bench_runs_on_cpu(tmp_path, capsys):
    from expertact.bench import bias_kernels
    out = tmp_path / "k.json"
    assert bias_kernels.main(["--device", "cpu", "--rows", "64", "--ffn", "32", "--iters", "1", "--warmup", "0",
                              "--json", str(out)]) == 0
    assert "bit-identical: True" in capsys.readouterr().out
    assert out.exists()
