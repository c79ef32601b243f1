"""expertact.fp8.glu_rowwise(col_amax_offsets=) (CPU, and CUDA where a GPU is present): the
per expert and column amax of h as the activation's forward writes it in the input's dtype,
bit for bit what quantize_rowwise(h, col_amax_offsets=)[2] gives for that forward's output and
what torch's own max over it gives; h_q and scale unchanged by it; NaN rows ignored, rows past
the last offset and empty experts; the layouts, presets, weights and biases; the refusals."""

import pytest
import torch

import expertact
from expertact import fp8
from expertact import functional as Fn
from support.oracle import glu64
from test_fp8 import CUDA, _bits, _torch_col_amax

PRESETS = ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"]
LAYOUTS = ["separate", "halves", "up_first", "interleaved"]
# expert sizes 13, 0, 1, 40, 23 (an empty expert, a one-row expert), then 7 rows past the last offset
ENDS = [13, 13, 14, 54, 77]
T_ROWS = 84

# functional.glu's arguments of each preset (docs/spec.md section 1), alpha 1.9 and limit 6.0
# where read, passed to glu_rowwise as alpha= / limit=
_ALPHA, _LIMIT = 1.9, 6.0


def _preset_kw(preset):
    return {"swiglu_oai": dict(alpha=_ALPHA, limit=_LIMIT), "swiglu_clamped": dict(limit=_LIMIT)}.get(preset, {})


def _functional_kw(preset):
    return {
        "swiglu": dict(activation="silu"),
        "swiglu_clamped": dict(activation="silu", limit=_LIMIT),
        "swiglu_oai": dict(activation="silu", alpha=_ALPHA, limit=_LIMIT, beta=1.0),
        "geglu_tanh": dict(activation="gelu_tanh"),
    }[preset]


def _case(T, F, dtype, seed, E=len(ENDS), nan_rows=True, ends=ENDS):
    """gate_up [T, 2F] with NaN in some rows (a whole row, single elements) and large values
    past the last offset (which no expert may see), the bias [E, 2F] and the weights [T]."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(dtype)
    if nan_rows:
        z[2] = float("nan")                 # a whole row of expert 0
        z[20, 1] = float("nan")             # one element of expert 3
        z[60, 2 * F - 1] = float("nan")     # one element of expert 4
    if ends[-1] < T:
        z[ends[-1]:] = 50.0                 # past the last offset: counts for no expert
    b = (torch.randn(E, 2 * F, generator=g) * 2).to(dtype)
    w = torch.rand(T, generator=g) + 0.5
    return z, b, w


def _split(z, layout):
    """(gate_up or gate, up) as glu_rowwise and functional.glu take them."""
    if layout == "separate":
        F = z.shape[-1] // 2
        return z[..., :F].contiguous(), z[..., F:].contiguous()
    return z, None


def _run(z, preset, layout, w, b, offs, ends=None):
    """(h_q, scale, amax) with the column amax, (h_q, scale) without it, and the forward's h."""
    x, up = _split(z, layout)
    lay = None if layout == "separate" else layout
    kw = dict(up=up, layout=lay, weights=w, **_preset_kw(preset))
    if b is not None:
        kw.update(bias=b, offsets=offs)
    q, s, amax = fp8.glu_rowwise(x, preset, col_amax_offsets=offs, ends=ends, **kw)
    q0, s0 = fp8.glu_rowwise(x, preset, **kw)
    fkw = dict(weights=w, **_functional_kw(preset))
    if b is not None:
        fkw.update(bias=b, offsets=offs)
    h = Fn.glu(x, up, layout=lay, **fkw)
    return (q, s, amax), (q0, s0), h


def _check(res, res0, h, offs, ends):
    (q, s, amax), (q0, s0) = res, res0
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    assert amax.dtype == torch.float32 and amax.shape == (len(ends), h.shape[-1])
    assert amax.device == h.device
    # the forward's h, its amax by quantize_rowwise and by torch: all the same bits
    _, _, ra = fp8.quantize_rowwise(h, col_amax_offsets=offs)
    assert torch.equal(amax, ra)
    assert torch.equal(amax.cpu(), _torch_col_amax(h.cpu(), ends))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_col_amax_is_the_forwards(preset, layout, weighted, biased, dtype):
    z, b, w = _case(T_ROWS, 40, dtype, 31)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    res, res0, h = _run(z, preset, layout, w if weighted else None, b if biased else None, offs)
    _check(res, res0, h, offs, ENDS)
    # NaN ignored: the experts with NaN rows still have finite maxima; the empty expert 0
    amax = res[2]
    assert torch.isfinite(amax).all() and amax[1].eq(0).all()


@pytest.mark.parametrize("preset", ["swiglu", "swiglu_oai"])
@pytest.mark.parametrize("biased", [False, True])
def test_col_amax_float16(preset, biased):
    # float16 rounds h to float16 (its overflow included: 255 * 300 > 65504 -> inf)
    z, b, w = _case(T_ROWS, 24, torch.float16, 32)
    z[30, :24] = 255.0
    z[30, 24:] = 300.0
    w[30] = 1.0
    offs = torch.tensor(ENDS, dtype=torch.int32)
    res, res0, h = _run(z, preset, "halves", w, b if biased else None, offs)
    _check(res, res0, h, offs, ENDS)
    if preset == "swiglu" and not biased:
        assert torch.isinf(res[2][3]).any()


def test_col_amax_against_float64():
    """The amax against the float64 activation (within the input dtype's rounding): the
    forward and this amax are not merely equal, they are right."""
    z, b, w = _case(T_ROWS, 40, torch.bfloat16, 33, nan_rows=False)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    for preset in PRESETS:
        _, _, amax = fp8.glu_rowwise(z, preset, layout="interleaved", weights=w, col_amax_offsets=offs,
                                     **_preset_kw(preset))
        h64 = glu64(z.double(), "interleaved", preset, alpha=_ALPHA, limit=_LIMIT) * w.double()[:, None]
        ref = _torch_col_amax(h64, ENDS).double()
        torch.testing.assert_close(amax.double(), ref, rtol=2 ** -8 + 1e-6, atol=1e-30)


def test_col_amax_leading_dims_threads_and_ends():
    # [2, 700, 2F] taken as [1400, 2F]: rows split over the threads across expert boundaries
    F = 72
    ends = [0, 1, 699, 700, 701, 1300, 1390]
    z, b, w = _case(1400, F, torch.bfloat16, 34, E=len(ends), ends=ends)
    offs = torch.tensor(ends, dtype=torch.int32)
    for biased in (False, True):
        kw = dict(bias=b, offsets=offs) if biased else {}
        q, s, amax = fp8.glu_rowwise(z.view(2, 700, 2 * F), "swiglu_oai", layout="interleaved",
                                     weights=w.view(2, 700), col_amax_offsets=offs, **kw)
        assert q.shape == (2, 700, F) and s.shape == (2, 700)
        h = Fn.glu(z, layout="interleaved", activation="silu", alpha=1.702, limit=7.0, beta=1.0, weights=w,
                   **kw)
        assert torch.equal(amax, _torch_col_amax(h, ends))
        # ends given: the same, the offsets not read on the host
        _, _, a2 = fp8.glu_rowwise(z, "swiglu_oai", layout="interleaved", weights=w, col_amax_offsets=offs,
                                   ends=ends, **kw)
        assert torch.equal(a2, amax)


def test_col_amax_no_rows_and_zero_experts_rows():
    offs = torch.zeros(3, dtype=torch.int32)
    for biased in (False, True):
        kw = dict(bias=torch.ones(3, 32, dtype=torch.bfloat16), offsets=offs) if biased else {}
        q, s, amax = fp8.glu_rowwise(torch.empty(0, 32, dtype=torch.bfloat16), "swiglu", col_amax_offsets=offs, **kw)
        assert q.shape == (0, 16) and torch.equal(amax, torch.zeros(3, 16))
    # rows, but every expert empty (all rows past the last offset): 0
    z, _, _ = _case(10, 16, torch.bfloat16, 35, nan_rows=False, ends=[0])
    q, s, amax = fp8.glu_rowwise(z, "swiglu", col_amax_offsets=offs)
    assert torch.equal(amax, torch.zeros(3, 16))
    # the output is overwritten, whatever it held: a fresh call gives the same
    _, _, a1 = fp8.glu_rowwise(z, "swiglu", col_amax_offsets=torch.tensor([4, 10], dtype=torch.int32))
    assert torch.equal(a1, _torch_col_amax(Fn.glu(z), [4, 10]))


def test_col_amax_refusals():
    z, b, _ = _case(12, 8, torch.float32, 36, E=2, nan_rows=False, ends=[5, 12])
    offs = torch.tensor([5, 12], dtype=torch.int32)
    with pytest.raises(expertact.DTypeError, match="col_amax_offsets has dtype torch.int64"):
        fp8.glu_rowwise(z, "swiglu", col_amax_offsets=offs.long())
    with pytest.raises(ValueError, match="col_amax_offsets must be 1-D"):
        fp8.glu_rowwise(z, "swiglu", col_amax_offsets=offs.view(1, 2))
    with pytest.raises(ValueError, match="col_amax_offsets must be non-decreasing"):
        fp8.glu_rowwise(z, "swiglu", col_amax_offsets=torch.tensor([6, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"col_amax_offsets\[-1\] = 13 is past the last row"):
        fp8.glu_rowwise(z, "swiglu", col_amax_offsets=torch.tensor([5, 13], dtype=torch.int32))
    with pytest.raises(TypeError, match="col_amax_offsets must be a torch.Tensor"):
        fp8.glu_rowwise(z, "swiglu", col_amax_offsets=[5, 12])
    with pytest.raises(ValueError, match="ends goes with offsets or col_amax_offsets"):
        fp8.glu_rowwise(z, "swiglu", ends=[5, 12])
    with pytest.raises(ValueError, match="ends has 1 values"):
        fp8.glu_rowwise(z, "swiglu", col_amax_offsets=offs, ends=[12])
    # with a bias: col_amax_offsets must be offsets itself (a view of it is that tensor too)
    with pytest.raises(ValueError, match="col_amax_offsets must be offsets itself"):
        fp8.glu_rowwise(z, "swiglu", bias=b, offsets=offs, col_amax_offsets=offs.clone())
    _, _, a = fp8.glu_rowwise(z, "swiglu", bias=b, offsets=offs, col_amax_offsets=offs[:])
    h = Fn.glu(z, bias=b, offsets=offs)
    assert torch.equal(a, _torch_col_amax(h, [5, 12]))


def _c_glu(x, q, scale, offsets, col_amax, bias=None, bias_offsets=None):
    """The C ABI's glu_rowwise entries directly (swiglu, halves): the checks the Python layer
    does not make first."""
    from expertact import _ops
    from expertact._args import layout_code, preset_coeffs
    coeffs = preset_coeffs("swiglu", None, None, "test")
    code = layout_code("halves", True)
    if bias is None:
        _ops.fp8_glu_rowwise(x, None, None, None, offsets, q, scale, col_amax, code, *coeffs)
    else:
        _ops.fp8_glu_rowwise(x, None, None, bias, bias_offsets, q, scale, col_amax, code, *coeffs)


def test_col_amax_c_abi():
    """The C ABI's checks of the new arguments, each naming it."""
    z, b, _ = _case(10, 6, torch.float32, 37, E=2, nan_rows=False, ends=[4, 10])
    q = torch.empty(10, 6, dtype=torch.float8_e4m3fn)
    scale = torch.empty(10)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    amax = torch.full((2, 6), -1.0)
    _c_glu(z, q, scale, offs, amax)  # overwritten, no zeroing needed by the caller
    assert torch.equal(amax, _torch_col_amax(Fn.glu(z), [4, 10]))
    amax_b = torch.full((2, 6), -1.0)
    _c_glu(z, q, scale, None, amax_b, bias=b, bias_offsets=offs)  # the biased entry: over offsets
    assert torch.equal(amax_b, _torch_col_amax(Fn.glu(z, bias=b, offsets=offs), [4, 10]))
    _c_glu(z, q, scale, None, None, bias=b, bias_offsets=offs)  # and without it
    with pytest.raises(ValueError, match="col_amax_offsets and col_amax go together"):
        _c_glu(z, q, scale, offs, None)
    with pytest.raises(ValueError, match="col_amax_offsets and col_amax go together"):
        _c_glu(z, q, scale, None, amax)
    with pytest.raises(ValueError, match="col_amax"):
        _c_glu(z, q, scale, offs, torch.empty(3, 6))
    with pytest.raises(ValueError, match="col_amax"):
        _c_glu(z, q, scale, offs, torch.empty(2, 5))
    with pytest.raises(ValueError, match="col_amax"):
        _c_glu(z, q, scale, None, torch.empty(3, 6), bias=b, bias_offsets=offs)
    with pytest.raises(TypeError, match="col_amax"):
        _c_glu(z, q, scale, offs, torch.empty(2, 6, dtype=torch.float16))
    with pytest.raises(TypeError, match="col_amax_offsets"):
        _c_glu(z, q, scale, offs.long(), amax)
    with pytest.raises(ValueError, match="col_amax_offsets"):
        _c_glu(z, q, scale, torch.tensor([4, 11], dtype=torch.int32), amax)
    with pytest.raises(ValueError, match="col_amax"):  # aliasing the input
        _c_glu(z, q, scale, offs, z[:2, :6])
    buf = torch.empty(22)
    with pytest.raises(ValueError, match="col_amax"):  # aliasing the output scales
        _c_glu(z, q, buf[:10], offs, buf[6:18].view(2, 6))


# ---- CUDA: the forward's amax on the GPU, and against the CPU ----

def _cuda_case(T, F, dtype, layout, preset, biased, seed, ends):
    z, b, w = _case(T, F, dtype, seed, E=len(ends), ends=ends)
    offs = torch.tensor(ends, dtype=torch.int32)
    res, res0, h = _run(z.cuda(), preset, layout, w.cuda(), b.cuda() if biased else None, offs.cuda(), ends=ends)
    _check(res, res0, h, offs.cuda(), ends)
    # against the CPU: h differs in its last bits between them (the GPU's exp and division are
    # approximate forms), so each amax by at most the largest difference of |h| over that
    # expert's rows of the column (|max a - max b| <= max |a - b|, exact); each device's h is
    # checked against float64 by the activation's own tests
    cres, _, ch = _run(z, preset, layout, w, b if biased else None, offs)
    a, ca = res[2].cpu().double(), cres[2].double()
    fin = torch.isfinite(ca)
    assert torch.equal(torch.isfinite(a), fin)
    d = (h.cpu().double().abs() - ch.double().abs()).abs()
    bound = _torch_col_amax(d, ends, d.dtype)
    assert ((a - ca).abs()[fin] <= bound[fin]).all()


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved", "separate"])
@pytest.mark.parametrize("biased", [False, True])
# 32 / 64 / 128 lanes a row, each fused instance (up to 32 and 64 values a lane), the
# separate pass (16-bit rows of 65-128 values a lane, rows read twice, odd F: the scalar kernel)
@pytest.mark.parametrize("F", [4, 64, 1000, 3072, 6144, 12288, 20000, 1001])
def test_cuda_col_amax_is_the_forwards(dtype, layout, biased, F):
    _cuda_case(T_ROWS, F, dtype, layout, "swiglu_oai", biased, 38, ENDS)


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_cuda_col_amax_presets(preset, layout):
    _cuda_case(T_ROWS, 3072, torch.bfloat16, layout, preset, False, 39, ENDS)
    _cuda_case(T_ROWS, 3072, torch.bfloat16, layout, preset, True, 40, ENDS)


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("biased", [False, True])
def test_cuda_col_amax_many_rows_and_experts(biased):
    # many blocks per expert, experts ending mid-block, rows past the end; 4 rows a step (F = 384)
    _cuda_case(70_001, 384, torch.bfloat16, "halves", "swiglu", biased, 41, [0, 17_001, 17_001, 40_000, 69_990])
    # 300 experts of 0-9 rows (many expert changes in each block's run), F = 3072 interleaved
    g = torch.Generator().manual_seed(42)
    ends = torch.cumsum(torch.randint(0, 10, (300,), generator=g), 0).tolist()
    _cuda_case(ends[-1] + 3, 3072, torch.bfloat16, "interleaved", "swiglu_oai", biased, 43, ends)


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_col_amax_views_and_empty():
    # a row stride of its own: 16-byte aligned rows (the fused kernels) and not (the separate pass)
    ends = [10, 10, 40]
    base, b, w = _case(44, 3072 + 8, torch.bfloat16, 44, E=3, ends=ends, nan_rows=False)
    offs = torch.tensor(ends, dtype=torch.int32).cuda()
    for lo in (8, 1):
        z = base.cuda()[:, lo:lo + 2 * 3072]
        q, s, a = fp8.glu_rowwise(z, "swiglu", layout="interleaved", weights=w.cuda(), col_amax_offsets=offs)
        h = Fn.glu(z, layout="interleaved", weights=w.cuda())
        assert torch.equal(a.cpu(), _torch_col_amax(h.cpu(), ends))
    q, s, a = fp8.glu_rowwise(torch.empty(0, 64, dtype=torch.bfloat16, device="cuda"), "swiglu",
                              col_amax_offsets=torch.zeros(2, dtype=torch.int32, device="cuda"))
    assert torch.equal(a.cpu(), torch.zeros(2, 32))
