"""expertact.fp8 (CPU): float8 e4m3fn bits against torch's own cast, scales against torchao's
recipe written in torch here (float64 division, power-of-two floor), NaN and Inf rows, the GLU
form against a float64 oracle, and the refusals."""

import pytest
import torch

import expertact
from expertact import fp8
from support.oracle import glu64


def _recipe(t):
    """torchao's rowwise recipe in torch: (q bits, dequantisation scale) of t [..., C]."""
    v = t.float()
    a = torch.where(torch.isnan(v), torch.zeros_like(v), v.abs()).amax(-1)
    a = torch.clamp(a, min=torch.tensor(1e-12, dtype=torch.float32))
    s = (448.0 / a.double()).float()
    s = torch.where(s > 0, torch.exp2(torch.floor(torch.log2(s))), s)
    q = torch.clamp(v * s[..., None], -448.0, 448.0).to(torch.float8_e4m3fn)
    return _bits(q), (1.0 / s)


def _bits(q):
    """q's bytes, NaN written 0x7f: the library does not keep a NaN's sign (fp8.h's quantize)."""
    b = q.view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b)


def test_every_bf16_value_converts_as_torch():
    """Rows holding 448 get s = 1: q is then the plain cast of every bf16 value in range."""
    vals = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = vals[torch.isfinite(vals) & (vals.abs() <= 448)]
    n = vals.numel() // 255 * 255
    rows = torch.cat((vals[:n].reshape(-1, 255), torch.full((n // 255, 1), 448.0)), 1)
    q, scale = fp8.quantize_rowwise(rows)
    assert torch.all(scale == 1.0)
    assert torch.equal(_bits(q), _bits(rows.to(torch.float8_e4m3fn)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_torchao_recipe(dtype):
    g = torch.Generator().manual_seed(0)
    mags = torch.logspace(-9, 4, 64, dtype=torch.float64)
    t = (torch.randn(64, 333, generator=g, dtype=torch.float64) * mags[:, None]).to(dtype)
    t[5] = 0  # all-zero row: amax -> 1e-12
    t[6, :3] = torch.tensor([448.0, -1e-3, 3.0], dtype=torch.float64).to(dtype)
    q, scale = fp8.quantize_rowwise(t)
    rq, rs = _recipe(t)
    assert torch.equal(scale, rs)
    assert torch.equal(_bits(q), rq)
    # powers of two, and t ~= q * scale within e4m3's half step (2^-4 relative) or its subnormal step
    assert torch.all(torch.frexp(scale[scale > 0]).mantissa == 0.5)
    deq = q.float() * scale[:, None]
    err = (deq - t.float()).abs()
    assert torch.all(err <= t.float().abs() * 2 ** -4 + scale[:, None] * 2 ** -10)


def test_leading_dims_and_views():
    t = torch.randn(2, 3, 40)
    q, scale = fp8.quantize_rowwise(t)
    assert q.shape == (2, 3, 40) and scale.shape == (2, 3)
    rq, rs = _recipe(t)
    assert torch.equal(_bits(q), rq) and torch.equal(scale, rs)
    wide = torch.randn(10, 64)
    q2, s2 = fp8.quantize_rowwise(wide[:, 8:40])  # a column slice, read in place
    rq2, rs2 = _recipe(wide[:, 8:40].contiguous())
    assert torch.equal(_bits(q2), rq2) and torch.equal(s2, rs2)
    q0, s0 = fp8.quantize_rowwise(torch.empty(0, 16))
    assert q0.shape == (0, 16) and s0.shape == (0,)


def test_nan_and_inf_surface():
    t = torch.randn(3, 16)
    t[0, 4] = float("nan")
    t[1, 7] = float("inf")
    q, scale = fp8.quantize_rowwise(t)
    f = q.float()
    assert torch.isnan(f[0, 4]) and torch.isfinite(f[0, torch.arange(16) != 4]).all()
    ref = _recipe(torch.cat((t[0, :4], t[0, 5:]))[None])  # the NaN is ignored by the row's amax
    assert torch.equal(scale[0:1], ref[1])
    assert scale[1] == float("inf")  # s = 0: q * scale is NaN along the row, never finite
    assert torch.isnan(f[1, 7])
    assert torch.isnan((f[1] * scale[1]).sum())
    rq, rs = _recipe(t[2:])
    assert torch.equal(_bits(q[2:]), rq) and torch.equal(scale[2:], rs)


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"])
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_rowwise_against_float64(activation, layout, dtype):
    g = torch.Generator().manual_seed(1)
    T, F = 97, 48
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(dtype)
    w = torch.rand(T, generator=g)
    q, scale = fp8.glu_rowwise(z, activation, layout=layout, weights=w)
    kw = {"limit": 7.0} if activation == "swiglu_clamped" else {}
    h = glu64(z.double(), layout, activation, **kw) * w.double()[:, None]
    rq, rs = _recipe(h.float())  # the float32 activation, one rounding, then the recipe
    assert torch.equal(scale, rs)
    # the library's float32 activation may differ from the float64 one rounded by an ulp:
    # at most one e4m3 step, on a tiny share of elements
    diff = (_bits(q).int() - rq.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def test_glu_rowwise_separate_and_alpha_limit():
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(20, 16, generator=g) * 4, torch.randn(20, 16, generator=g) * 4
    q, scale = fp8.glu_rowwise(gate, "swiglu_oai", up=up, alpha=1.5, limit=3.0)
    h = glu64(torch.cat((gate, up), 1).double(), "halves", "swiglu_oai", alpha=1.5, limit=3.0)
    rq, rs = _recipe(h.float())
    assert torch.equal(scale, rs)
    assert (_bits(q).int() - rq.int()).abs().max() <= 1


def test_refusals():
    with pytest.raises(expertact.DTypeError):
        fp8.quantize_rowwise(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(expertact.DTypeError):
        fp8.quantize_rowwise(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        fp8.quantize_rowwise([1.0, 2.0])
    with pytest.raises(ValueError, match="activation"):
        fp8.glu_rowwise(torch.randn(4, 8), "relu")
    with pytest.raises(ValueError, match="no clamp"):
        fp8.glu_rowwise(torch.randn(4, 8), "swiglu", limit=3.0)
    with pytest.raises(ValueError, match="odd"):
        fp8.glu_rowwise(torch.randn(4, 7), "swiglu")


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 3, 333, 3072])
def test_cuda_quantize_matches_cpu(dtype, cols):
    g = torch.Generator().manual_seed(3)
    mags = torch.logspace(-9, 4, 97, dtype=torch.float64)
    t = (torch.randn(97, cols, generator=g, dtype=torch.float64) * mags[:, None]).to(dtype)
    t[3] = 0
    t[4, 0] = float("nan")
    if cols > 1:
        t[5, 1] = float("inf")
    q, scale = fp8.quantize_rowwise(t.cuda())
    rq, rs = fp8.quantize_rowwise(t)
    assert torch.equal(scale.cpu(), rs)
    assert torch.equal(_bits(q).cpu(), _bits(rq))


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "geglu_tanh"])
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_cuda_glu_rowwise_against_float64(activation, layout):
    g = torch.Generator().manual_seed(4)
    T, F = 1000, 3072
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(torch.bfloat16)
    w = torch.rand(T, generator=g)
    q, scale = fp8.glu_rowwise(z.cuda(), activation, layout=layout, weights=w.cuda())
    h = glu64(z.double(), layout, activation) * w.double()[:, None]
    rq, rs = _recipe(h.float())
    assert torch.equal(scale.cpu(), rs)
    diff = (_bits(q).cpu().int() - rq.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def _recipe_grouped(t, ends):
    """torchao's per-group column-wise recipe in torch: (q [T, C] bits, scale [E, C])."""
    v = t.float()
    qs, ss, start = [], [], 0
    for end in ends:
        blk = v[start:end]
        a = torch.where(torch.isnan(blk), torch.zeros_like(blk), blk.abs()).amax(0) if end > start else \
            torch.zeros(v.shape[1])
        a = torch.clamp(a, min=torch.tensor(1e-12, dtype=torch.float32))
        s = (448.0 / a.double()).float()
        s = torch.where(s > 0, torch.exp2(torch.floor(torch.log2(s))), s)
        qs.append(torch.clamp(blk * s, -448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8))
        ss.append(1.0 / s)
        start = end
    qs.append(torch.zeros(v.shape[0] - start, v.shape[1], dtype=torch.uint8))
    return torch.cat(qs), torch.stack(ss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_colwise_grouped_matches_recipe(dtype):
    g = torch.Generator().manual_seed(5)
    ends = [30, 30, 95, 120]  # an empty expert, 5 rows past the end
    t = (torch.randn(125, 40, generator=g, dtype=torch.float64) *
         torch.logspace(-3, 3, 40, dtype=torch.float64)).to(dtype)
    t[40, 3] = float("nan")
    q, scale = fp8.quantize_colwise_grouped(t, torch.tensor(ends, dtype=torch.int32))
    assert q.shape == (125, 40) and q.stride() == (1, 125) and scale.shape == (4, 40)
    rq, rs = _recipe_grouped(t, ends)
    assert torch.equal(scale, rs)
    assert torch.equal(q.contiguous().view(torch.uint8), rq)
    assert torch.isnan(q[40, 3].float())


def test_colwise_grouped_weights_and_refusals():
    w = torch.randn(3, 16, 24)  # [E, K, N]: per expert and column over K
    q, scale = fp8.quantize_colwise_grouped(w.reshape(48, 24), torch.tensor([16, 32, 48], dtype=torch.int32))
    for e in range(3):
        rq, rs = _recipe(w[e].t())
        assert torch.equal(scale[e], rs)
        assert torch.equal(q[16 * e:16 * (e + 1)].t().contiguous().view(torch.uint8), rq)
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8.quantize_colwise_grouped(torch.randn(8, 4), torch.tensor([5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="past the last row"):
        fp8.quantize_colwise_grouped(torch.randn(8, 4), torch.tensor([5, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_colwise_grouped(torch.randn(8), torch.tensor([8], dtype=torch.int32))
