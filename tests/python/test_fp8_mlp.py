"""expert_mlp(fp8="rowwise"): the FP8 grouped expert MLP.

On the CPU the path runs with torch._scaled_grouped_mm replaced by an emulation that checks the
operator's sm90 contract (A row-major, B column-major, scale shapes, 16-row groups in the 2-D x
2-D form) and computes in float32 from the dequantised operands: that tests every operand's
layout, scale indexing, padding and gradient against the float64 MLP. On an H200 the real
operator runs (skipped elsewhere)."""
import math

import pytest
import torch

from expertact.moe import _fp8 as _fp8_mlp
from expertact.moe import expert_mlp

F8 = torch.float8_e4m3fn


def _row_major(t):
    return t.stride(-1) == 1 and t.stride(-2) > 1


def _col_major(t):
    return t.stride(-2) == 1 and t.stride(-1) > 1


def _emulated_sgmm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm's 2-D x 3-D and 2-D x 2-D forms on the CPU, with its sm90
    checks; rows (or groups) the operator leaves unwritten come back NaN."""
    assert a.dtype == F8 and b.dtype == F8
    assert _row_major(a), f"A must be row-major, strides {a.stride()}"
    assert _col_major(b), f"B must be column-major, strides {b.stride()}"
    assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    assert offs.dtype == torch.int32 and offs.dim() == 1
    ends = offs.tolist()
    af, bf = a.float(), b.float()
    if b.dim() == 3:
        assert a.shape[1] == b.shape[1] and a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = torch.full((a.shape[0], b.shape[2]), float("nan"))
        start = 0
        for e, end in enumerate(ends):
            out[start:end] = (af[start:end] * scale_a[start:end, None]) @ (bf[e] * scale_b[e][None, :])
            start = end
        return out.to(torch.bfloat16)
    M, N, E = a.shape[0], b.shape[1], len(ends)
    assert a.shape[1] == b.shape[0]
    assert scale_a.shape == (M * E,) and scale_b.shape == (N * E,)
    out = torch.full((E, M, N), float("nan"))
    start = 0
    for e, end in enumerate(ends):
        assert (end - start) % 16 == 0, f"group {e} has {end - start} rows: the device asserts"
        if end > start:
            out[e] = ((af[:, start:end] * scale_a[e * M:(e + 1) * M, None])
                      @ (bf[start:end] * scale_b[e * N:(e + 1) * N][None, :]))
        start = end
    return out.to(torch.bfloat16)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(_fp8_mlp, "sgmm", _emulated_sgmm)
    monkeypatch.setattr(_fp8_mlp, "why_not", lambda x, D, F: None)


_ACT_KW = {"swiglu": {}, "swiglu_oai": {"alpha": 1.702, "limit": 2.0}, "geglu_tanh": {}}


def _problem(T=70, D=32, F=48, ends=(16, 16, 33, 50, 64), seed=0, biases=False, dtype=torch.bfloat16,
             device="cpu"):
    g = torch.Generator().manual_seed(seed)
    E = len(ends)
    mk = lambda *s, sc=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * sc)
    t = {"x": mk(T, D), "w13": mk(E, D, 2 * F, sc=D ** -0.5), "w2": mk(E, F, D, sc=F ** -0.5),
         "weights": torch.rand(T, generator=g) + 0.5}  # float32, as routing weights are
    if biases:
        t["b13"] = mk(E, 2 * F, sc=0.3)
        t["b2"] = mk(E, D, sc=0.3)
    dy = mk(T, D)
    offsets = torch.tensor(ends, dtype=torch.int32)
    low = {k: (v if k == "weights" else v.to(dtype)).to(device) for k, v in t.items()}
    return t, low, dy, offsets


def _run(t, dy, offsets, activation, layout, **kw):
    """(y, {name: grad}) of expert_mlp over the tensors t (made leaves here)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
    y = expert_mlp(leaves["x"], leaves["w13"], leaves["w2"], offsets.to(leaves["x"].device), activation,
                   layout=layout, weights=leaves["weights"], b13=leaves.get("b13"), b2=leaves.get("b2"),
                   **_ACT_KW[activation], **kw)
    y.backward(dy.to(y.dtype).to(y.device))
    return y.detach(), {k: v.grad for k, v in leaves.items()}


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# FP8 e4m3 keeps 3 mantissa bits (relative rounding error up to 2^-4 per element); a wrong
# layout, scale index or padding gives errors of order 1. Measured here: 2-5 %.
TOL = 0.1


@pytest.mark.parametrize("activation", list(_ACT_KW))
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("wgrad", [True, False])
def test_emulated_fp8_against_float64(emulated, activation, layout, biases, wgrad):
    t64, low, dy, offsets = _problem(biases=biases)
    y64, g64 = _run(t64, dy, offsets, activation, layout)
    y, g = _run(low, dy, offsets, activation, layout, fp8="rowwise", fp8_wgrad=wgrad)
    end = offsets[-1].item()
    assert torch.all(y[end:] == 0) and torch.all(g["x"][end:] == 0)  # padding rows
    assert _rel(y, y64) < TOL
    for k in g64:
        assert torch.isfinite(g[k]).all(), k
        assert _rel(g[k], g64[k]) < TOL, (k, _rel(g[k], g64[k]))


def test_emulated_fp8_memory_modes_agree(emulated):
    """inplace_backward gives the same gradients (the activation's backward is the same math);
    recompute is what the FP8 node always does."""
    _, low, dy, offsets = _problem(biases=True)
    y0, g0 = _run(low, dy, offsets, "swiglu_oai", "interleaved", fp8="rowwise")
    for kw in ({"inplace_backward": True}, {"recompute": True}):
        y1, g1 = _run(low, dy, offsets, "swiglu_oai", "interleaved", fp8="rowwise", **kw)
        assert torch.equal(y0, y1)
        for k in g0:
            assert torch.equal(g0[k], g1[k]), (kw, k)


@pytest.mark.parametrize("case", ["plain", "b13_frozen", "b13_grad", "inplace", "no_dx"])
def test_emulated_fp8_fused_activation_backward(emulated, monkeypatch, case):
    """The fused FP8 activation backward (fp8.glu_backward_rowwise) gives dx's operand where
    b13 needs no gradient and dx is wanted, in every memory mode (its bf16 copy of dgate_up for
    dw13 is written over gate_up); the gradients stay within the FP8 tolerance of float64
    either way."""
    from expertact import fp8
    calls = []

    def counting(real):
        def f(*a, **kw):
            calls.append(dict(kw, gate_up=a[1]))
            return real(*a, **kw)
        return f

    monkeypatch.setattr(fp8, "glu_backward_rowwise", counting(fp8.glu_backward_rowwise))
    t64, low, dy, offsets = _problem(biases=case.startswith("b13"))
    frozen = {"b13"} if case == "b13_frozen" else set()
    if case == "no_dx":
        frozen.add("x")
    kw = {"inplace_backward": True} if case == "inplace" else {}

    def run(t, **more):
        leaves = {k: v.detach().clone().requires_grad_(k not in frozen) for k, v in t.items()}
        y = expert_mlp(leaves["x"], leaves["w13"], leaves["w2"], offsets, "swiglu_oai", layout="interleaved",
                       weights=leaves["weights"], b13=leaves.get("b13"), b2=leaves.get("b2"),
                       **_ACT_KW["swiglu_oai"], **more)
        y.backward(dy.to(y.dtype))
        return {k: v.grad for k, v in leaves.items() if k not in frozen}

    g64 = run(t64)
    g = run(low, fp8="rowwise", **kw)
    assert len(calls) == (1 if case in ("plain", "b13_frozen", "inplace") else 0)
    if calls:
        assert calls[0]["col_amax"] and calls[0]["dgate_up_out"] is not None and calls[0]["weights_grad"]
        assert calls[0]["dgate_up_out"] is calls[0]["gate_up"]  # in place
    for k in g64:
        assert torch.isfinite(g[k]).all(), k
        assert _rel(g[k], g64[k]) < TOL, (k, _rel(g[k], g64[k]))


def test_emulated_fp8_transposed_weights(emulated):
    """Weights held [E, N, K] and passed as transposed views (DeepSpeed, TorchTitan, transformers)
    get their gradients laid out as their storage, with the same values."""
    t64, low, dy, offsets = _problem()
    y0, g0 = _run(low, dy, offsets, "swiglu", "halves", fp8="rowwise")
    leaves = {k: v.detach().clone() for k, v in low.items()}
    w13s = leaves["w13"].transpose(-2, -1).contiguous().requires_grad_()
    w2s = leaves["w2"].transpose(-2, -1).contiguous().requires_grad_()
    x = leaves["x"].requires_grad_()
    y = expert_mlp(x, w13s.transpose(-2, -1), w2s.transpose(-2, -1), offsets, "swiglu",
                   weights=leaves["weights"], fp8="rowwise")
    y.backward(dy.to(y.dtype))
    assert torch.equal(y, y0)
    assert torch.equal(w13s.grad.transpose(-2, -1), g0["w13"]) and torch.equal(w2s.grad.transpose(-2, -1), g0["w2"])
    assert torch.equal(x.grad, g0["x"])


def test_emulated_fp8_nan_surfaces(emulated):
    _, low, dy, offsets = _problem()
    low["x"][3, 5] = float("nan")
    low["x"][20, 0] = float("inf")
    y, g = _run(low, dy, offsets, "swiglu", "halves", fp8="rowwise")
    assert torch.isnan(y[3]).all() and torch.isnan(y[20]).all()  # the row's scale is NaN / inf
    others = [r for r in range(16) if r != 3]
    assert torch.isfinite(y[others]).all()
    assert torch.isnan(g["w13"][0]).any() and torch.isnan(g["w2"][0]).any()


def test_emulated_fp8_no_grad_forward(emulated):
    _, low, dy, offsets = _problem()
    y0, _ = _run(low, dy, offsets, "swiglu", "halves", fp8="rowwise")
    with torch.no_grad():
        y = expert_mlp(low["x"], low["w13"], low["w2"], offsets, "swiglu", weights=low["weights"], fp8="rowwise")
    assert torch.equal(y, y0)


def test_emulated_fp8_second_backward_refused(emulated):
    _, low, dy, offsets = _problem()
    x = low["x"].clone().requires_grad_()
    y = expert_mlp(x, low["w13"], low["w2"], offsets, "swiglu", fp8="rowwise")
    y.backward(dy.to(y.dtype), retain_graph=True)
    with pytest.raises(RuntimeError, match="runs backward once"):
        y.backward(dy.to(y.dtype))


def test_fp8_errors():
    _, low, dy, offsets = _problem()
    args = (low["x"], low["w13"], low["w2"], offsets, "swiglu")
    with pytest.raises(NotImplementedError, match="fp8='rowwise' cannot run here: x is on cpu"):
        expert_mlp(*args, fp8="rowwise")
    with pytest.raises(ValueError, match="'rowwise'"):
        expert_mlp(*args, fp8="tensorwise")


def test_fp8_refuses_what_the_gemms_cannot_take(monkeypatch):
    x = torch.randn(8, 24, dtype=torch.bfloat16)
    reason = _fp8_mlp.why_not(x, 24, 16)
    assert reason is not None
    if hasattr(torch, "_scaled_grouped_mm"):
        assert "x is on cpu" in reason


_H200 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _H200, reason="needs a Hopper GPU")
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
@pytest.mark.parametrize("biases", [False, True])
def test_cuda_fp8_against_float64(layout, biases):
    t64, low, dy, offsets = _problem(T=1100, D=256, F=384, ends=(0, 17, 300, 301, 700, 1085), biases=biases,
                                     device="cuda")
    y64, g64 = _run(t64, dy, offsets, "swiglu_oai", layout)
    y, g = _run(low, dy, offsets, "swiglu_oai", layout, fp8="rowwise")
    end = offsets[-1].item()
    assert torch.all(y[end:] == 0) and torch.all(g["x"][end:] == 0)
    assert _rel(y, y64) < TOL
    for k in g64:
        assert _rel(g[k], g64[k]) < TOL, (k, _rel(g[k], g64[k]))
    # the same problem through the emulation gives the same operands: close to the device's result
    # (the device accumulates in its own order, with fast accumulation)
    assert math.isfinite(_rel(y, y64))


@pytest.mark.skipif(not _H200, reason="needs a Hopper GPU")
def test_cuda_fp8_matches_emulation(monkeypatch):
    """The device's GEMMs against the emulation on the same quantised operands."""
    _, low, dy, offsets = _problem(T=600, D=128, F=256, ends=(100, 100, 333, 590), device="cuda")
    y, g = _run(low, dy, offsets, "swiglu", "halves", fp8="rowwise")
    cpu = {k: v.cpu() for k, v in low.items()}
    monkeypatch.setattr(_fp8_mlp, "sgmm", _emulated_sgmm)
    monkeypatch.setattr(_fp8_mlp, "why_not", lambda x, D, F: None)
    ye, ge = _run(cpu, dy, offsets, "swiglu", "halves", fp8="rowwise")
    assert _rel(y, ye) < 0.02
    for k in g:
        assert _rel(g[k], ge[k]) < 0.03, k
