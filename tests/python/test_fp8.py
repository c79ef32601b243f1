"""expertact.fp8 (CPU): float8 e4m3fn bits against torch's own cast, scales against torchao's
recipe written in plain torch (support/fp8_tiles.py: float64 division, power-of-two floor), NaN
and Inf rows, the GLU form against a float64 oracle, and the refusals."""

import pytest
import torch

import expertact
from expertact import fp8
from support import fp8_tiles
from support.oracle import glu64


def _recipe(t):
    """torchao's rowwise recipe in torch: (q bits, dequantisation scale) of t [..., C]."""
    q, scale = fp8_tiles.rowwise(t)
    return _bits(q), scale


_bits = fp8_tiles.bits


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
# 16-byte packs: 32, 64 or 128 lanes per row, each register instance, rows read twice
# (40,000); 1, 3, 333: the scalar kernel
@pytest.mark.parametrize("cols", [1, 3, 8, 333, 1024, 2048, 3072, 8192, 16384, 40000])
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
def test_cuda_quantize_views():
    """Row strides other than the width: 16-byte aligned (the vector kernels) or not (scalar)."""
    base = torch.randn(50, 3080, dtype=torch.bfloat16) * 5
    base[7, 11] = float("nan")
    for view in (base[:, :3072], base[:, 8:3080], base[:, 1:3073], base[::3, :2048]):
        q, scale = fp8.quantize_rowwise(view.cuda())
        rq, rs = fp8.quantize_rowwise(view)
        assert torch.equal(scale.cpu(), rs) and torch.equal(_bits(q).cpu(), _bits(rq))


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


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
# 32 / 64 / 128 lanes per row, each register instance, rows read twice (20,000 for 16-bit),
# odd F (the scalar kernel)
@pytest.mark.parametrize("F", [4, 64, 1000, 3072, 6144, 20000, 1001])
def test_cuda_glu_rowwise_shapes(dtype, layout, F):
    g = torch.Generator().manual_seed(16)
    T = 37
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(dtype)
    z[3, 5] = float("nan")
    w = torch.rand(T, generator=g)
    q, scale = fp8.glu_rowwise(z.cuda(), "swiglu_oai", layout=layout, weights=w.cuda())
    h = glu64(z.double(), layout, "swiglu_oai") * w.double()[:, None]
    rq, rs = _recipe(h.float())
    assert torch.equal(scale.cpu(), rs)
    diff = (_bits(q).cpu().int() - rq.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def _recipe_grouped(t, ends, pad_to=1):
    """torchao's per-group column-wise recipe in torch: (q bits [T or Tp, C], scale [E, C]).
    pad_to > 1: expert e's rows start at a multiple of pad_to, the rest of its block 0, rows
    past ends[-1] left out."""
    v = t.float()
    qs, ss, start = [], [], 0
    for end in ends:
        blk = v[start:end]
        if end > start:
            q, scale = fp8_tiles.quantize_tiles(blk, None, 1)
            qs.append(_bits(q))
            ss.append(scale[0])
        else:
            ss.append(fp8_tiles.pow2_scale(torch.zeros(v.shape[1]))[1])
        if pad_to > 1:
            n = end - start
            qs.append(torch.zeros(-(-n // pad_to) * pad_to - n, v.shape[1], dtype=torch.uint8))
        start = end
    if pad_to == 1:
        qs.append(torch.zeros(v.shape[0] - start, v.shape[1], dtype=torch.uint8))
    return torch.cat(qs), torch.stack(ss)


def _colwise_bits(q):
    """q [rows, C] column-major -> its bytes [rows, C] (NaN as 0x7f)."""
    return _bits(q.contiguous())


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
    assert torch.equal(_colwise_bits(q), rq)
    assert torch.isnan(q[40, 3].float())


def test_colwise_grouped_weights_and_refusals():
    w = torch.randn(3, 16, 24)  # [E, K, N]: per expert and column over K
    q, scale = fp8.quantize_colwise_grouped(w.reshape(48, 24), torch.tensor([16, 32, 48], dtype=torch.int32))
    for e in range(3):
        rq, rs = _recipe(w[e].t())
        assert torch.equal(scale[e], rs)
        assert torch.equal(_bits(q[16 * e:16 * (e + 1)].t().contiguous()), rq)
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8.quantize_colwise_grouped(torch.randn(8, 4), torch.tensor([5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="past the last row"):
        fp8.quantize_colwise_grouped(torch.randn(8, 4), torch.tensor([5, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_colwise_grouped(torch.randn(8), torch.tensor([8], dtype=torch.int32))


def _grouped_input(T, C, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(T, C, generator=g, dtype=torch.float64) *
         torch.logspace(-4, 4, C, dtype=torch.float64)).to(dtype)
    return t


# expert sizes 0, 1, 17, 33, 16, 0, 5 (ends below), then 4 rows past the last offset
_PAD_ENDS = [0, 1, 18, 51, 67, 67, 72]


def test_padded_offsets_host_and_tensor():
    assert fp8.padded_offsets(_PAD_ENDS, 16) == [0, 16, 48, 96, 112, 112, 128]
    assert fp8.padded_offsets((3, 3, 20), 8) == [8, 8, 32]
    assert fp8.padded_offsets([5, 9], 1) == [5, 9]
    dev = fp8.padded_offsets(torch.tensor(_PAD_ENDS, dtype=torch.int32), 16)
    assert dev.dtype == torch.int32 and dev.tolist() == fp8.padded_offsets(_PAD_ENDS, 16)
    with pytest.raises(ValueError, match="pad_to"):
        fp8.padded_offsets([4], 0)
    with pytest.raises(ValueError, match="int32"):
        fp8.padded_offsets(torch.tensor([4]), 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pad_to", [16, 5])
def test_colwise_grouped_padded_matches_recipe(dtype, pad_to):
    t = _grouped_input(76, 37, dtype, 6)
    t[20, 3] = float("nan")
    t[30, 5] = float("inf")  # expert 3's column 5: s = 0, scale inf, q NaN where v * 0 is
    t[31, 6] = float("-inf")
    offs = torch.tensor(_PAD_ENDS, dtype=torch.int32)
    q, scale = fp8.quantize_colwise_grouped(t, offs, pad_to=pad_to)
    Tp = fp8.padded_offsets(_PAD_ENDS, pad_to)[-1]
    assert q.shape == (Tp, 37) and q.stride() == (1, Tp) and q.dtype == torch.float8_e4m3fn
    assert scale.shape == (7, 37)
    rq, rs = _recipe_grouped(t, _PAD_ENDS, pad_to)
    assert rq.shape == (Tp, 37)
    assert torch.equal(scale, rs)
    assert torch.equal(_colwise_bits(q), rq)
    assert scale[3, 5] == float("inf") and scale[3, 6] == float("inf")
    # the padding rows are bytes 0x00, and each expert's rows start at its padded offset
    starts = [0] + fp8.padded_offsets(_PAD_ENDS, pad_to)[:-1]
    assert torch.equal(_colwise_bits(q[starts[2]:starts[2] + 17]), rq[starts[2]:starts[2] + 17])
    pads = torch.ones(Tp, dtype=torch.bool)
    lo = 0
    for e, end in enumerate(_PAD_ENDS):
        pads[starts[e]:starts[e] + end - lo] = False
        lo = end
    assert torch.all(q.contiguous().view(torch.uint8)[pads] == 0)


def test_colwise_grouped_ends_strides_and_empty():
    t = _grouped_input(80, 48, torch.bfloat16, 7)
    offs = torch.tensor(_PAD_ENDS, dtype=torch.int32)
    q, scale = fp8.quantize_colwise_grouped(t, offs, pad_to=16)
    q2, s2 = fp8.quantize_colwise_grouped(t, offs, pad_to=16, ends=_PAD_ENDS)  # nothing read from offsets
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, s2)
    q3, s3 = fp8.quantize_colwise_grouped(t, offs, ends=tuple(_PAD_ENDS))
    rq, rs = _recipe_grouped(t, _PAD_ENDS)
    assert q3.shape == (80, 48) and torch.equal(_colwise_bits(q3), rq) and torch.equal(s3, rs)
    # a column slice (row stride 48, read in place) at an odd element offset
    v = t[:, 3:40]
    qv, sv = fp8.quantize_colwise_grouped(v, offs, pad_to=16)
    rqv, rsv = _recipe_grouped(v.contiguous(), _PAD_ENDS, 16)
    assert torch.equal(_colwise_bits(qv), rqv) and torch.equal(sv, rsv)
    # no rows at all: every expert empty, Tp = 0, the scales those of amax = 0 (s = 2^48)
    q0, s0 = fp8.quantize_colwise_grouped(torch.empty(0, 24), torch.zeros(3, dtype=torch.int32), pad_to=16)
    assert q0.shape == (0, 24) and torch.equal(s0, torch.full((3, 24), 2.0 ** -48))
    q1, s1 = fp8.quantize_colwise_grouped(torch.empty(0, 24), torch.zeros(3, dtype=torch.int32))
    assert q1.shape == (0, 24) and torch.equal(s1, s0)


def test_colwise_grouped_padding_refusals():
    t = torch.randn(8, 4)
    offs = torch.tensor([5, 8], dtype=torch.int32)
    for bad in (0, -1, True, 1.5, "16"):
        with pytest.raises(ValueError, match="pad_to"):
            fp8.quantize_colwise_grouped(t, offs, pad_to=bad)
    with pytest.raises(ValueError, match="ends has 3 values; offsets has 2"):
        fp8.quantize_colwise_grouped(t, offs, pad_to=16, ends=[1, 2, 8])
    with pytest.raises(ValueError, match="ends must be non-decreasing"):
        fp8.quantize_colwise_grouped(t, offs, pad_to=16, ends=[6, 5])
    with pytest.raises(ValueError, match="past the last row"):
        fp8.quantize_colwise_grouped(t, offs, pad_to=16, ends=[5, 9])
    with pytest.raises(TypeError, match="ends must be a sequence of ints"):
        fp8.quantize_colwise_grouped(t, offs, pad_to=16, ends=5)
    # ends that disagree with offsets: the CPU path reads both and refuses (padded_offsets
    # computed from offsets overrun q, sized from ends)
    with pytest.raises(ValueError, match="padded_offsets"):
        fp8.quantize_colwise_grouped(t, torch.tensor([5, 8], dtype=torch.int32), pad_to=4, ends=[4, 4])


def _call_colwise(x, offsets, padded, q_t, scale):
    from expertact import _ops
    _ops.fp8_quantize_colwise_grouped(x, offsets, padded, q_t, scale)


def test_colwise_grouped_c_abi_padded_offsets():
    """The C ABI takes any padded ends that hold each expert's rows (not only multiples of a
    pad), and checks them on the CPU, naming the argument."""
    x = _grouped_input(10, 6, torch.float32, 8)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    q_t = torch.full((6, 16), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.empty(3, 6)
    _call_colwise(x, offs, torch.tensor([4, 6, 13], dtype=torch.int32), q_t, scale)
    rq, rs = _recipe_grouped(x, [3, 3, 10])
    b = q_t.view(torch.uint8).t()
    assert torch.equal(b[0:3], rq[0:3]) and torch.all(b[3:6] == 0)
    assert torch.equal(b[6:13], rq[3:10]) and torch.all(b[13:] == 0)  # past padded_offsets[-1]: 0
    assert torch.equal(scale, rs)
    cases = [
        (torch.tensor([4, 13], dtype=torch.int32), "padded_offsets has 2 elements; offsets has 3"),
        (torch.tensor([2, 6, 13], dtype=torch.int32), r"padded_offsets\[0\] = 2 gives expert 0 a block of 2 rows"),
        (torch.tensor([4, 3, 13], dtype=torch.int32), r"padded_offsets\[1\] = 3"),
        (torch.tensor([4, 6, 12], dtype=torch.int32), r"padded_offsets\[2\] = 12 gives expert 2"),
        (torch.tensor([4, 6, 17], dtype=torch.int32), r"padded_offsets\[2\] = 17 is past q_t's last column"),
    ]
    for pads, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _call_colwise(x, offs, pads, q_t, scale)
    with pytest.raises(expertact.DTypeError, match="padded_offsets must be int32"):
        _call_colwise(x, offs, torch.tensor([4, 6, 13], dtype=torch.int64), q_t, scale)
    with pytest.raises(ValueError, match="q_t"):  # without padding q_t must be [C, T]
        _call_colwise(x, offs, None, q_t, scale)


def _cuda_vs_cpu(t, ends, **kw):
    offs = torch.tensor(ends, dtype=torch.int32)
    q, scale = fp8.quantize_colwise_grouped(t.cuda(), offs.cuda(), **kw)
    rq, rs = fp8.quantize_colwise_grouped(t, offs, **kw)
    assert q.shape == rq.shape and q.stride() == rq.stride()
    assert torch.equal(scale.cpu(), rs)
    assert torch.equal(_colwise_bits(q).cpu(), _colwise_bits(rq))


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 37, 300, 3072])
@pytest.mark.parametrize("pad_to", [1, 16])
def test_cuda_colwise_grouped_matches_cpu(dtype, cols, pad_to):
    t = _grouped_input(76, cols, dtype, 9)
    t[20, 0] = float("nan")
    t[30, cols - 1] = float("inf")
    _cuda_vs_cpu(t, _PAD_ENDS, pad_to=pad_to)
    rq, _ = _recipe_grouped(t, _PAD_ENDS, pad_to)
    q, _ = fp8.quantize_colwise_grouped(t.cuda(), torch.tensor(_PAD_ENDS, dtype=torch.int32).cuda(), pad_to=pad_to)
    assert torch.equal(_colwise_bits(q).cpu(), rq)


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("pad_to", [1, 16])
def test_cuda_colwise_grouped_large_and_many_experts(pad_to):
    g = torch.Generator().manual_seed(10)
    # several row chunks and tiles per expert, experts ending mid-chunk, rows past the end
    t = _grouped_input(70_001, 200, torch.bfloat16, 11)
    _cuda_vs_cpu(t, [0, 17_001, 17_001, 40_000, 69_990], pad_to=pad_to)
    # 1024 experts, a quarter of them empty, a few rows each
    sizes = torch.randint(0, 12, (1024,), generator=g)
    sizes[torch.randperm(1024, generator=g)[:256]] = 0
    ends = torch.cumsum(sizes, 0).tolist()
    t2 = _grouped_input(ends[-1] + 3, 72, torch.float16, 12)
    _cuda_vs_cpu(t2, ends, pad_to=pad_to)


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_colwise_grouped_runs_across_experts(dtype):
    # Shapes the run form takes (16-bit, columns a multiple of 8, q_t rows a multiple of 16)
    # with experts that change inside a thread's 4 rows and a run's tiles: unpadded ends at
    # odd rows, one-row and empty experts, a partial last column tile, rows past the end, NaN
    # and infinities; and a long run of one expert (tiles that carry the cursor and scales).
    t = _grouped_input(4_096, 136, dtype, 15)  # (unpadded, q_t has a row for each of t's rows)
    t[2, 5] = float("nan")
    t[1_500, 135] = float("-inf")
    t[4_000, 0] = float("inf")
    t[4_095, 0] = float("nan")  # past the last end: never read
    ends = [1, 2, 2, 3, 1_001, 1_002, 2_050, 4_090]
    _cuda_vs_cpu(t, ends)
    _cuda_vs_cpu(t, ends, pad_to=16)
    long = _grouped_input(40_000, 64, dtype, 16)
    _cuda_vs_cpu(long, [37_001, 40_000], pad_to=16)


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_colwise_grouped_strides_ends_and_empty():
    base = _grouped_input(300, 520, torch.bfloat16, 13)
    ends = [0, 33, 250, 251]
    for view in (base[:, 8:392], base[:, 1:386], base[::2, :512]):  # aligned rows, unaligned, gapped
        for pad_to in (1, 16):
            # the gapped view has 150 rows: its last experts end there
            offs = torch.tensor([min(e, view.shape[0] - 1 + (k == 3)) for k, e in enumerate(ends)], dtype=torch.int32)
            q, s = fp8.quantize_colwise_grouped(view.cuda(), offs.cuda(), pad_to=pad_to)
            rq, rs = fp8.quantize_colwise_grouped(view, offs, pad_to=pad_to)
            assert torch.equal(s.cpu(), rs) and torch.equal(_colwise_bits(q).cpu(), _colwise_bits(rq))
    # ends given: the same bytes, nothing read from the device
    t = base[:252].contiguous().cuda()
    offs = torch.tensor(ends, dtype=torch.int32).cuda()
    q1, s1 = fp8.quantize_colwise_grouped(t, offs, pad_to=16)
    q2, s2 = fp8.quantize_colwise_grouped(t, offs, pad_to=16, ends=ends)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    assert fp8.padded_offsets(offs, 16).tolist() == fp8.padded_offsets(ends, 16)
    # no rows
    q0, s0 = fp8.quantize_colwise_grouped(torch.empty(0, 40, device="cuda"), torch.zeros(2, dtype=torch.int32,
                                                                                          device="cuda"), pad_to=16)
    assert q0.shape == (0, 40) and torch.equal(s0.cpu(), torch.full((2, 40), 2.0 ** -48))
    q0, s0 = fp8.quantize_colwise_grouped(torch.empty(0, 40, device="cuda"), torch.zeros(2, dtype=torch.int32,
                                                                                          device="cuda"))
    assert q0.shape == (0, 40) and torch.equal(s0.cpu(), torch.full((2, 40), 2.0 ** -48))
    # an odd padded row count without padding (byte stores at the tile's end)
    _cuda_vs_cpu(_grouped_input(131, 40, torch.float32, 14), [50, 131])


def _conversion_cases():
    """float32 values for the e4m3fn conversion with s = 1: every bf16 value in range, every
    e4m3fn midpoint (ties) and its float32 neighbours, the subnormal range, values near 448,
    float32 subnormals, signed zeros, NaN, and random bit patterns; rows of 255 with 448 added
    (s = 1)."""
    g = torch.Generator().manual_seed(15)
    bf = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf = bf[bf.isnan() | (bf.abs() <= 448)]
    e4 = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = torch.sort(e4[torch.isfinite(e4) & (e4 >= 0)]).values
    mids = (e4[1:] + e4[:-1]) / 2  # exact in float32
    near = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    bits = torch.randint(0x30000000, 0x43e00000, (20000,), generator=g, dtype=torch.int32).view(torch.float32)
    misc = torch.tensor([0.0, 1e-40, 1e-45, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9, 447.9, 448.0,
                         torch.nextafter(torch.tensor(448.0), torch.tensor(0.0)).item(), float("nan")])
    v = torch.cat([bf, mids, near, bits, misc])
    v = torch.cat([v, -v])
    n = -(-v.numel() // 255) * 255
    v = torch.cat([v, torch.zeros(n - v.numel())]).reshape(-1, 255)
    return torch.cat([v, torch.full((v.shape[0], 1), 448.0)], 1)


def test_conversion_cases_on_cpu():
    rows = _conversion_cases()
    q, scale = fp8.quantize_rowwise(rows)
    assert torch.all(scale == 1.0)
    assert torch.equal(_bits(q), _bits(rows.to(torch.float8_e4m3fn)))


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_conversion_matches_cpu():
    """The GPU kernels' conversion (fp8.h from_scaled2: the cvt instruction on sm_89+) against
    the CPU's from_float, byte for byte, through every kernel that quantises."""
    rows = _conversion_cases()
    rq, _ = fp8.quantize_rowwise(rows)
    q, scale = fp8.quantize_rowwise(rows.cuda())
    assert torch.all(scale.cpu() == 1.0)
    assert torch.equal(_bits(q).cpu(), _bits(rq))
    t = rows.t().contiguous()  # every column holds 448
    cq, cs = fp8.quantize_colwise_grouped(t.cuda(), torch.tensor([t.shape[0]], dtype=torch.int32).cuda(),
                                          pad_to=16)
    assert torch.all(cs.cpu() == 1.0)
    assert torch.equal(_colwise_bits(cq).cpu()[:t.shape[0]], _bits(rq).t())


def _bias_rows(bias, ends, T):
    """bias [E, 2F] spread over T rows by expert (0 past the last offset), float64."""
    rows = torch.zeros(T, bias.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        rows[start:end] = bias[e].double()
        start = end
    return rows


def _glu_bias_case(T, F, dtype, seed, ends):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, 2 * F, generator=g) * 3).to(dtype)
    b = (torch.randn(len(ends), 2 * F, generator=g) * 2).to(dtype)
    w = torch.rand(T, generator=g)
    return z, b, w


def _check_glu_bias(q, scale, z, b, w, ends, layout, activation):
    h = glu64(z.double() + _bias_rows(b, ends, z.shape[0]), layout, activation) * w.double()[:, None]
    rq, rs = _recipe(h.float())
    assert torch.equal(scale.cpu(), rs)
    diff = (_bits(q).cpu().int() - rq.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "geglu_tanh"])
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_rowwise_bias_against_float64(activation, layout, dtype):
    ends = [20, 20, 61, 90]  # an empty expert, 7 rows past the last offset (no bias)
    z, b, w = _glu_bias_case(97, 48, dtype, 17, ends)
    offs = torch.tensor(ends, dtype=torch.int32)
    q, scale = fp8.glu_rowwise(z, activation, layout=layout, weights=w, bias=b, offsets=offs)
    _check_glu_bias(q, scale, z, b, w, ends, layout, activation)
    q2, s2 = fp8.glu_rowwise(z, activation, layout=layout, weights=w, bias=b, offsets=offs, ends=ends)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, s2)


def test_glu_rowwise_bias_separate_zero_and_refusals():
    ends = [5, 12]
    z, b, w = _glu_bias_case(12, 16, torch.float32, 18, ends)
    offs = torch.tensor(ends, dtype=torch.int32)
    gate, up = z[:, :16], z[:, 16:]
    q, scale = fp8.glu_rowwise(gate, "swiglu_oai", up=up, bias=b, offsets=offs, weights=w)
    _check_glu_bias(q, scale, z, b, w, ends, "halves", "swiglu_oai")
    # a zero bias: the unbiased bytes exactly
    q0, s0 = fp8.glu_rowwise(z, "swiglu", bias=torch.zeros(2, 32), offsets=offs)
    r0, rs0 = fp8.glu_rowwise(z, "swiglu")
    assert torch.equal(q0.view(torch.uint8), r0.view(torch.uint8)) and torch.equal(s0, rs0)
    # leading dims: offsets index the rows of gate_up [..., 2F] collapsed
    q3, s3 = fp8.glu_rowwise(z.reshape(3, 4, 32), "swiglu", bias=b, offsets=offs)
    r3, rs3 = fp8.glu_rowwise(z, "swiglu", bias=b, offsets=offs)
    assert q3.shape == (3, 4, 16) and torch.equal(q3.reshape(12, 16).view(torch.uint8), r3.view(torch.uint8))
    with pytest.raises(ValueError, match="bias and offsets go together"):
        fp8.glu_rowwise(z, "swiglu", bias=b)
    with pytest.raises(ValueError, match="bias and offsets go together"):
        fp8.glu_rowwise(z, "swiglu", offsets=offs)
    with pytest.raises(ValueError, match="bias"):
        fp8.glu_rowwise(z, "swiglu", bias=torch.zeros(3, 32), offsets=offs)  # E = 2
    with pytest.raises(ValueError, match="bias"):
        fp8.glu_rowwise(z, "swiglu", bias=torch.zeros(2, 30), offsets=offs)
    with pytest.raises(expertact.DTypeError, match="bias"):
        fp8.glu_rowwise(z, "swiglu", bias=torch.zeros(2, 32, dtype=torch.bfloat16), offsets=offs)
    with pytest.raises(ValueError, match="past the last row"):
        fp8.glu_rowwise(z, "swiglu", bias=b, offsets=torch.tensor([5, 13], dtype=torch.int32))
    with pytest.raises(ValueError, match="ends has 1 values"):
        fp8.glu_rowwise(z, "swiglu", bias=b, offsets=offs, ends=[12])


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
# 32 / 64 / 128 lanes per row, each register instance, rows read twice, odd F (the scalar kernel)
@pytest.mark.parametrize("F", [4, 64, 1000, 3072, 6144, 20000, 1001])
def test_cuda_glu_rowwise_bias_against_float64(dtype, layout, F):
    ends = [0, 9, 9, 30, 33]  # empty experts, 4 rows past the last offset
    z, b, w = _glu_bias_case(37, F, dtype, 19, ends)
    z[3, 5] = float("nan")
    offs = torch.tensor(ends, dtype=torch.int32)
    q, scale = fp8.glu_rowwise(z.cuda(), "swiglu_oai", layout=layout, weights=w.cuda(), bias=b.cuda(),
                               offsets=offs.cuda())
    _check_glu_bias(q, scale, z, b, w, ends, layout, "swiglu_oai")
    q2, s2 = fp8.glu_rowwise(z.cuda(), "swiglu_oai", layout=layout, weights=w.cuda(), bias=b.cuda(),
                             offsets=offs.cuda(), ends=ends)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, s2)


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_glu_rowwise_bias_many_experts_and_views():
    g = torch.Generator().manual_seed(20)
    sizes = torch.randint(0, 5, (300,), generator=g)
    ends = torch.cumsum(sizes, 0).tolist()
    T, F = ends[-1] + 2, 512
    z, b, w = _glu_bias_case(T, F, torch.bfloat16, 21, ends)
    offs = torch.tensor(ends, dtype=torch.int32).cuda()
    q, scale = fp8.glu_rowwise(z.cuda(), "swiglu", layout="interleaved", bias=b.cuda(), offsets=offs,
                               weights=w.cuda())
    _check_glu_bias(q, scale, z, b, w, ends, "interleaved", "swiglu")
    # a bias with a row stride of its own (a column slice of a wider buffer): 16-byte aligned
    # rows (the same kernel: the same bytes), and not (the scalar kernel: against the oracle)
    wide = torch.zeros(300, 2 * F + 16, dtype=torch.bfloat16)
    for lo in (8, 1):
        wide[:, lo:lo + 2 * F] = b
        bv = wide.cuda()[:, lo:lo + 2 * F]
        qv, sv = fp8.glu_rowwise(z.cuda(), "swiglu", layout="interleaved", bias=bv, offsets=offs, weights=w.cuda())
        if lo == 8:
            assert torch.equal(qv.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sv, scale)
        else:
            _check_glu_bias(qv, sv, z, b, w, ends, "interleaved", "swiglu")


# ---- the fused column amax: quantize_rowwise(col_amax_offsets=) -> quantize_colwise_grouped(amax=) ----

def _torch_col_amax(t, ends, dtype=torch.float32):
    """Per expert and column max |v| with NaN ignored, by torch ops (exact: a max), in dtype;
    0 for an expert without rows."""
    a = t.reshape(-1, t.shape[-1]).to(dtype).abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    out, start = torch.zeros(len(ends), a.shape[1], dtype=dtype), 0
    for e, end in enumerate(ends):
        if end > start:
            out[e] = a[start:end].amax(0)
        start = end
    return out


def _col_amax_input(T, C, dtype, seed):
    t = _grouped_input(T, C, dtype, seed)
    t[20, 0] = float("nan")
    t[30, C - 1] = float("inf")
    t[31, C // 2] = float("-inf")
    t[T - 1, 0] = float("nan")  # past the last offset below: counts for no expert
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 37, 300])
def test_rowwise_col_amax_matches_torch(dtype, cols):
    t = _col_amax_input(76, cols, dtype, 21)
    offs = torch.tensor(_PAD_ENDS, dtype=torch.int32)
    q, s, amax = fp8.quantize_rowwise(t, col_amax_offsets=offs)
    rq, rs = fp8.quantize_rowwise(t)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)
    assert amax.dtype == torch.float32 and amax.shape == (len(_PAD_ENDS), cols)
    assert torch.equal(amax, _torch_col_amax(t, _PAD_ENDS))
    # ends given: the same, offsets not read on the host
    _, _, a2 = fp8.quantize_rowwise(t, col_amax_offsets=offs, ends=_PAD_ENDS)
    assert torch.equal(a2, amax)
    # no rows: amax 0
    _, _, a0 = fp8.quantize_rowwise(torch.empty(0, cols, dtype=dtype), col_amax_offsets=torch.zeros(2, dtype=torch.int32))
    assert torch.equal(a0, torch.zeros(2, cols))


def test_rowwise_col_amax_leading_dims_and_threads():
    # [2, 600, 130] taken as [1200, 130]: rows split over threads across expert boundaries
    t = _grouped_input(1200, 130, torch.bfloat16, 22).view(2, 600, 130)
    ends = [0, 1, 599, 600, 601, 1100]
    q, s, amax = fp8.quantize_rowwise(t, col_amax_offsets=torch.tensor(ends, dtype=torch.int32))
    assert q.shape == t.shape and s.shape == (2, 600)
    assert torch.equal(amax, _torch_col_amax(t, ends))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad_to", [1, 16, 5])
def test_colwise_with_amax_matches_without(dtype, pad_to):
    t = _col_amax_input(76, 45, dtype, 23)
    offs = torch.tensor(_PAD_ENDS, dtype=torch.int32)
    _, _, amax = fp8.quantize_rowwise(t, col_amax_offsets=offs)
    q1, s1 = fp8.quantize_colwise_grouped(t, offs, pad_to=pad_to)
    q2, s2 = fp8.quantize_colwise_grouped(t, offs, pad_to=pad_to, amax=amax)
    assert torch.equal(s1, s2) and torch.equal(_colwise_bits(q1), _colwise_bits(q2))
    # the scales do come from amax: a larger amax gives other scales
    q3, s3 = fp8.quantize_colwise_grouped(t, offs, pad_to=pad_to, amax=amax * 4 + 1)
    assert not torch.equal(s3, s1)


def test_col_amax_refusals():
    t = _grouped_input(10, 6, torch.float32, 24)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="col_amax_offsets has dtype torch.int64"):
        fp8.quantize_rowwise(t, col_amax_offsets=offs.long())
    with pytest.raises(ValueError, match="col_amax_offsets must be 1-D"):
        fp8.quantize_rowwise(t, col_amax_offsets=offs.view(1, 2))
    with pytest.raises(ValueError, match="col_amax_offsets must be non-decreasing"):
        fp8.quantize_rowwise(t, col_amax_offsets=torch.tensor([5, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"col_amax_offsets\[-1\] = 11 is past the last row"):
        fp8.quantize_rowwise(t, col_amax_offsets=torch.tensor([4, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="ends goes with col_amax_offsets"):
        fp8.quantize_rowwise(t, ends=[4, 10])
    with pytest.raises(TypeError, match="col_amax_offsets must be a torch.Tensor"):
        fp8.quantize_rowwise(t, col_amax_offsets=[4, 10])
    amax = torch.zeros(2, 6)
    with pytest.raises(TypeError, match="amax has dtype torch.float64"):
        fp8.quantize_colwise_grouped(t, offs, amax=amax.double())
    with pytest.raises(ValueError, match=r"amax must be \[E, C\] = \[2, 6\]"):
        fp8.quantize_colwise_grouped(t, offs, amax=torch.zeros(2, 5))
    with pytest.raises(TypeError, match="amax must be a torch.Tensor"):
        fp8.quantize_colwise_grouped(t, offs, amax=[[0.0] * 6] * 2)


def _call_rowwise(x, q, scale, offsets, col_amax):
    from expertact import _ops
    _ops.fp8_quantize_rowwise(x, q, scale, offsets, col_amax)


def test_col_amax_c_abi_refusals():
    """The C ABI's checks of the new arguments, each naming it (the Python layer checks some first)."""
    x = _grouped_input(10, 6, torch.float32, 25)
    q = torch.empty(10, 6, dtype=torch.float8_e4m3fn)
    scale = torch.empty(10)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    amax = torch.full((2, 6), -1.0)
    _call_rowwise(x, q, scale, offs, amax)  # overwritten, no zeroing needed by the caller
    assert torch.equal(amax, _torch_col_amax(x, [4, 10]))
    with pytest.raises(ValueError, match="col_amax_offsets and col_amax go together"):
        _call_rowwise(x, q, scale, offs, None)
    with pytest.raises(ValueError, match="col_amax_offsets and col_amax go together"):
        _call_rowwise(x, q, scale, None, amax)
    with pytest.raises(ValueError, match="col_amax"):
        _call_rowwise(x, q, scale, offs, torch.empty(3, 6))
    with pytest.raises(TypeError, match="col_amax"):
        _call_rowwise(x, q, scale, offs, torch.empty(2, 6, dtype=torch.float16))
    with pytest.raises(TypeError, match="col_amax_offsets"):
        _call_rowwise(x, q, scale, offs.long(), amax)
    q_t = torch.empty(6, 10, dtype=torch.float8_e4m3fn)
    s2 = torch.empty(2, 6)
    from expertact import _ops

    def colwise(a):
        _ops.fp8_quantize_colwise_grouped(x, offs, None, q_t, s2, a)
    with pytest.raises(ValueError, match="amax"):
        colwise(torch.zeros(3, 6))
    with pytest.raises(TypeError, match="amax"):
        colwise(torch.zeros(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="amax"):  # aliasing the output scales
        colwise(s2)


@pytest.mark.skipif(not CUDA, reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 37, 300, 3072, 6144, 20000])
def test_cuda_rowwise_col_amax_matches_cpu(dtype, cols):
    t = _col_amax_input(76, cols, dtype, 26)
    offs = torch.tensor(_PAD_ENDS, dtype=torch.int32)
    q, s, amax = fp8.quantize_rowwise(t.cuda(), col_amax_offsets=offs.cuda(), ends=_PAD_ENDS)
    rq, rs = fp8.quantize_rowwise(t)
    assert torch.equal(_bits(q).cpu(), _bits(rq)) and torch.equal(s.cpu(), rs)
    assert torch.equal(amax.cpu(), _torch_col_amax(t, _PAD_ENDS))
    for pad_to in (1, 16):
        q1, s1 = fp8.quantize_colwise_grouped(t.cuda(), offs.cuda(), pad_to=pad_to, ends=_PAD_ENDS)
        q2, s2 = fp8.quantize_colwise_grouped(t.cuda(), offs.cuda(), pad_to=pad_to, ends=_PAD_ENDS, amax=amax)
        assert torch.equal(s1, s2) and torch.equal(_colwise_bits(q1), _colwise_bits(q2))


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_rowwise_col_amax_large_and_views():
    # many row chunks per expert, experts ending mid-chunk, rows past the end
    t = _grouped_input(70_001, 384, torch.bfloat16, 27)
    ends = [0, 17_001, 17_001, 40_000, 69_990]
    offs = torch.tensor(ends, dtype=torch.int32)
    _, _, amax = fp8.quantize_rowwise(t.cuda(), col_amax_offsets=offs.cuda())
    assert torch.equal(amax.cpu(), _torch_col_amax(t, ends))
    # unaligned and gapped views (the scalar and strided forms)
    base = _grouped_input(300, 520, torch.bfloat16, 28)
    for view in (base[:, 1:386], base[::2, :512], base[:, 8:392]):
        e = [0, 33, 100, 149]
        o = torch.tensor(e, dtype=torch.int32).cuda()
        _, _, a = fp8.quantize_rowwise(view.cuda(), col_amax_offsets=o)
        assert torch.equal(a.cpu(), _torch_col_amax(view, e))
    # no rows: amax 0
    _, _, a0 = fp8.quantize_rowwise(torch.empty(0, 40, device="cuda"),
                                    col_amax_offsets=torch.zeros(2, dtype=torch.int32, device="cuda"))
    assert torch.equal(a0.cpu(), torch.zeros(2, 40))


