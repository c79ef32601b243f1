"""expertact.fp8.glu_colwise_grouped (CPU, and CUDA where a GPU is present): the activation
recomputed from gate_up and quantised per expert and column, bit for bit the bytes and scales
of quantize_colwise_grouped(h, amax=quantize_rowwise(h, col_amax_offsets=)[2]) with h the
library's own forward output on that device (every preset, layout, weights, bias, padding,
dtype, empty experts, rows past the last offset, NaN rows, row tiles, views); the dequantised
values against a float64 oracle; the amax=None fallback; the refusals."""

import pytest
import torch

import expertact
from expertact import fp8, functional
from support.fp8_cases import glu_case, split
from support.oracle import glu64
from test_fp8 import _bits

CUDA = torch.cuda.is_available() and expertact.has_cuda()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
ACTS = ["swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh"]
LAYOUTS = ["halves", "up_first", "interleaved", "separate"]
# Two empty experts (the first one and one in the middle), uneven sizes, and 12 rows past the
# last offset (in no expert: no bias, not quantised).
T, F = 83, 40
ENDS = [0, 17, 17, 50, 71]
# The forward's activation and coefficients of each preset (alpha and limit: the defaults of
# glu_rowwise's forms that read them, unless the test passes its own).
PRESET = {"swiglu": ("silu", 1.0, None, 0.0), "swiglu_clamped": ("silu", 1.0, 7.0, 0.0),
          "swiglu_oai": ("silu", 1.702, 7.0, 1.0), "geglu_tanh": ("gelu_tanh", 1.0, None, 0.0)}


def _case(T, F, dtype, seed, E=len(ENDS), nan_rows=()):
    return glu_case(T, F, dtype, seed, E, [(r, r % (2 * F)) for r in nan_rows])


def _forward(x, up, layout, activation, weights=None, bias=None, offsets=None, alpha=None, limit=None):
    """h as the library's forward writes it (functional.glu; its biased form with bias)."""
    act, a, lim, beta = PRESET[activation]
    a = a if alpha is None else alpha
    lim = lim if limit is None else limit
    return functional.glu(x, up, layout=layout, activation=act, alpha=a, limit=lim, beta=beta, weights=weights,
                          bias=bias, offsets=offsets)


def _reference(h, offsets, pad_to):
    """quantize_colwise_grouped of h with the column amax quantize_rowwise takes of it."""
    amax = fp8.quantize_rowwise(h, col_amax_offsets=offsets)[2]
    q, scale = fp8.quantize_colwise_grouped(h, offsets, pad_to=pad_to, amax=amax)
    return q, scale, amax


def _same(q, scale, rq, rscale):
    assert q.shape == rq.shape and q.stride() == rq.stride() and q.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, rscale)
    assert torch.equal(q.t().contiguous().view(torch.uint8), rq.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("pad_to", [1, 16])
def test_matches_forward_then_colwise(device, activation, layout, weighted, biased, pad_to):
    z, b, w = _case(T, F, torch.bfloat16, seed=10 * ACTS.index(activation) + LAYOUTS.index(layout), nan_rows=(3, 40))
    z, b, w = z.to(device), b.to(device), w.to(device)
    offs = torch.tensor(ENDS, dtype=torch.int32, device=device)
    x, up, lay = split(z, layout)
    kw = {"weights": w if weighted else None, "bias": b if biased else None}
    h = _forward(x, up, lay, activation, offsets=offs if biased else None, **kw)
    rq, rs, amax = _reference(h, offs, pad_to)
    q, scale = fp8.glu_colwise_grouped(x, activation, offs, up=up, layout=lay, pad_to=pad_to, ends=ENDS,
                                       amax=amax, **kw)
    _same(q, scale, rq, rs)
    if pad_to == 1:
        assert torch.all(q[ENDS[-1]:].view(torch.uint8) == 0)  # the rows past the last offset


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_dtypes(device, dtype, layout):
    z, b, w = _case(T, F, dtype, seed=7, nan_rows=(20,))
    z, b, w = z.to(device), b.to(device), w.to(device)
    offs = torch.tensor(ENDS, dtype=torch.int32, device=device)
    for bias in (None, b):
        h = _forward(z, None, layout, "swiglu_oai", weights=w, bias=bias, offsets=None if bias is None else offs,
                     alpha=1.5, limit=3.0)
        for pad_to in (1, 16):
            rq, rs, amax = _reference(h, offs, pad_to)
            q, scale = fp8.glu_colwise_grouped(z, "swiglu_oai", offs, alpha=1.5, limit=3.0, layout=layout,
                                               weights=w, bias=bias, pad_to=pad_to, amax=amax)
            _same(q, scale, rq, rs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("biased", [False, True])
def test_row_tiles_and_wide_rows(device, biased):
    """F = 2048 (the forward's column blocks, several row tiles on the CPU at 2 threads), experts
    across the tiles' boundaries, padding."""
    threads = expertact.cpu_threads()
    expertact.set_cpu_threads(2)
    try:
        Tw, Fw, ends = 300, 2048, [5, 127, 129, 256, 290]
        z, b, w = _case(Tw, Fw, torch.bfloat16, seed=11, nan_rows=(128,))
        z, b, w = z.to(device), b.to(device), w.to(device)
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        bias = b if biased else None
        h = _forward(z, None, "interleaved", "swiglu_oai", weights=w, bias=bias, offsets=offs if biased else None)
        for pad_to in (1, 16):
            rq, rs, amax = _reference(h, offs, pad_to)
            q, scale = fp8.glu_colwise_grouped(z, "swiglu_oai", offs, layout="interleaved", weights=w, bias=bias,
                                               pad_to=pad_to, amax=amax)
            _same(q, scale, rq, rs)
    finally:
        expertact.set_cpu_threads(0 if threads is None else threads)


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_amax_strides(device):
    """gate_up a row-strided view, weights a strided vector, amax a row-strided view."""
    z, b, w = _case(T, F + 8, torch.bfloat16, seed=5)
    z, b, w = z.to(device), b.to(device), w.to(device)
    zv = z[:, 4:4 + 2 * F]  # row stride 2F + 16
    wv = torch.stack([w, w], 1)[:, 0]  # stride 2
    offs = torch.tensor(ENDS, dtype=torch.int32, device=device)
    h = _forward(zv, None, "halves", "swiglu", weights=wv)
    rq, rs, amax = _reference(h, offs, 16)
    wide = torch.full((len(ENDS), F + 5), -1.0, device=device)
    wide[:, :F] = amax
    q, scale = fp8.glu_colwise_grouped(zv, "swiglu", offs, weights=wv, pad_to=16, amax=wide[:, :F])
    _same(q, scale, rq, rs)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_and_all_rows_past(device):
    """T = 0; and offsets that end at 0 (every row past the last offset: q all 0)."""
    z = torch.empty(0, 2 * F, dtype=torch.bfloat16, device=device)
    offs = torch.zeros(3, dtype=torch.int32, device=device)
    amax = torch.zeros(3, F, device=device)
    q, scale = fp8.glu_colwise_grouped(z, "swiglu", offs, pad_to=16, amax=amax)
    assert q.shape == (0, F) and torch.equal(scale.cpu(), torch.full((3, F), 2.0 ** -48))
    z, _, _ = _case(9, F, torch.bfloat16, seed=2)
    z = z.to(device)
    for pad_to in (1, 16):
        q, scale = fp8.glu_colwise_grouped(z, "swiglu", offs, pad_to=pad_to, amax=amax)
        assert q.shape == ((9 if pad_to == 1 else 0), F)
        assert torch.all(q.view(torch.uint8) == 0) and torch.equal(scale.cpu(), torch.full((3, F), 2.0 ** -48))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["halves", "interleaved", "separate"])
@pytest.mark.parametrize("biased", [False, True])
def test_fallback_without_amax(device, layout, biased):
    """amax=None: the forward, then quantize_colwise_grouped: the same result as the fused path."""
    z, b, w = _case(T, F, torch.bfloat16, seed=3, nan_rows=(60,))
    z, b, w = z.to(device), b.to(device), w.to(device)
    offs = torch.tensor(ENDS, dtype=torch.int32, device=device)
    x, up, lay = split(z, layout)
    bias = b if biased else None
    for pad_to in (1, 16):
        q0, s0 = fp8.glu_colwise_grouped(x, "geglu_tanh", offs, up=up, layout=lay, weights=w, bias=bias,
                                         pad_to=pad_to)
        h = _forward(x, up, lay, "geglu_tanh", weights=w, bias=bias, offsets=offs if biased else None)
        rq, rs, amax = _reference(h, offs, pad_to)
        _same(q0, s0, rq, rs)
        q1, s1 = fp8.glu_colwise_grouped(x, "geglu_tanh", offs, up=up, layout=lay, weights=w, bias=bias,
                                         pad_to=pad_to, amax=amax)
        _same(q1, s1, q0, s0)


def _bias_rows(b, ends, rows):
    out = torch.zeros(rows, b.shape[1], dtype=torch.float64)
    start = 0
    for e, stop in enumerate(ends):
        out[start:stop] = b[e].double()
        start = stop
    return out


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("pad_to", [1, 16])
def test_dequantised_against_float64(activation, pad_to):
    """q * scale[e] against h in float64: within e4m3's half step (2^-4 relative; below the
    normal range 2^-10 of the scale) plus bfloat16's rounding of h (2^-8 relative), each row at
    its padded position, its expert's scale."""
    z, b, w = _case(T, F, torch.bfloat16, seed=9)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    h = _forward(z, None, "interleaved", activation, weights=w, bias=b, offsets=offs)
    amax = fp8.quantize_rowwise(h, col_amax_offsets=offs)[2]
    q, scale = fp8.glu_colwise_grouped(z, activation, offs, layout="interleaved", weights=w, bias=b, pad_to=pad_to,
                                       amax=amax)
    h64 = glu64(z.double() + _bias_rows(b, ENDS, T), "interleaved", activation) * w.double()[:, None]
    pads = fp8.padded_offsets(ENDS, pad_to) if pad_to > 1 else ENDS
    start = pstart = 0
    deq = q.float().double()
    for e, (end, pend) in enumerate(zip(ENDS, pads)):
        n = end - start
        got = deq[pstart:pstart + n] * scale[e].double()
        want = h64[start:end]
        tol = (2.0 ** -4 + 2.0 ** -7) * want.abs() + scale[e].double() * 2.0 ** -10
        assert torch.all((got - want).abs() <= tol), (activation, e)
        assert torch.all(q[pstart + n:pend].view(torch.uint8) == 0)  # the block's padding
        # the scale is the power of two torchao's recipe takes from the column's amax
        a = h64[start:end].abs().amax(0) if n else torch.zeros(F, dtype=torch.float64)
        assert torch.all(scale[e].double() * 448.0 >= a * (1 - 2.0 ** -7))
        start, pstart = end, pend
    if pad_to == 1:
        assert torch.all(q[ENDS[-1]:].view(torch.uint8) == 0)


def test_refusals():
    z, b, w = _case(T, F, torch.bfloat16, seed=4)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    amax = torch.ones(len(ENDS), F)
    where = "expertact.fp8.glu_colwise_grouped"
    with pytest.raises(ValueError, match=r"amax must be \[E, F\] = \[5, 40\] \(got shape \(5, 80\)\)"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, amax=torch.ones(len(ENDS), 2 * F))
    with pytest.raises(expertact.DTypeError, match="amax has dtype torch.bfloat16; it must be float32"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, amax=amax.bfloat16())
    with pytest.raises(TypeError, match="amax must be a torch.Tensor"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, amax=[1.0])
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'offsets'"):
        fp8.glu_colwise_grouped(z, "swiglu", amax=amax)
    with pytest.raises(TypeError, match=f"{where}: offsets must be a torch.Tensor"):
        fp8.glu_colwise_grouped(z, "swiglu", None, amax=amax)
    with pytest.raises(expertact.DTypeError, match="offsets has dtype torch.int64; it must be int32"):
        fp8.glu_colwise_grouped(z, "swiglu", offs.long(), amax=amax)
    with pytest.raises(ValueError, match="past the last row"):
        fp8.glu_colwise_grouped(z, "swiglu", torch.tensor([5, 90], dtype=torch.int32), amax=amax[:2])
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        fp8.glu_colwise_grouped(z, "swiglu", torch.tensor([5, 4], dtype=torch.int32), amax=amax[:2])
    with pytest.raises(ValueError, match="pad_to"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, pad_to=0, amax=amax)
    with pytest.raises(ValueError, match=r"gate_up must be 2-D \[T, 2F\]"):
        fp8.glu_colwise_grouped(z.view(1, T, 2 * F), "swiglu", offs, amax=amax)
    with pytest.raises(ValueError, match="has no clamp"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, limit=3.0, amax=amax)
    with pytest.raises(ValueError, match="activation='relu' is not one of"):
        fp8.glu_colwise_grouped(z, "relu", offs, amax=amax)
    with pytest.raises(expertact.DTypeError, match="float64"):
        fp8.glu_colwise_grouped(z.double(), "swiglu", offs, amax=amax)
    # the library's own checks, naming the argument
    with pytest.raises(ValueError, match=r"bias"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, bias=b[:, :F], amax=amax)
    with pytest.raises(expertact.DTypeError, match=r"bias"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, bias=b.float(), amax=amax)
    with pytest.raises(ValueError, match=r"weights"):
        fp8.glu_colwise_grouped(z, "swiglu", offs, weights=w[:10], amax=amax)


def _call_c(x, offsets, padded, q_t, scale, amax):
    """expertact_fp8_glu_colwise_grouped: swiglu of x [T, 2F] (halves), no weights or bias."""
    from expertact import _ops
    from expertact._args import preset_coeffs
    _ops.fp8_glu_colwise_grouped(x, None, None, None, offsets, padded, q_t, scale, amax, 1,
                                 *preset_coeffs("swiglu", None, None, "test"))


def test_c_abi_checks():
    """The C entry's own checks: amax required, its shape and dtype, q_t and scale shapes, the
    padded offsets, and an output over an input, each naming the argument."""
    z, _, _ = _case(10, 6, torch.float32, seed=1, E=3)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    h = _forward(z, None, "halves", "swiglu")
    amax = fp8.quantize_rowwise(h, col_amax_offsets=offs)[2]
    q_t = torch.full((6, 16), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.empty(3, 6)
    pads = torch.tensor([4, 6, 13], dtype=torch.int32)
    _call_c(z, offs, pads, q_t, scale, amax)
    rq, rs = fp8.quantize_colwise_grouped(h, offs, amax=amax)
    b = q_t.view(torch.uint8).t()
    rb = rq.view(torch.uint8)
    assert torch.equal(b[0:3], rb[0:3]) and torch.all(b[3:6] == 0)
    assert torch.equal(b[6:13], rb[3:10]) and torch.all(b[13:] == 0)
    assert torch.equal(scale, rs)
    with pytest.raises(ValueError, match="amax is null: it is required"):
        _call_c(z, offs, pads, q_t, scale, None)
    with pytest.raises(ValueError, match=r"amax.*\[3, 6\]"):
        _call_c(z, offs, pads, q_t, scale, torch.ones(3, 12))
    with pytest.raises(expertact.DTypeError, match="amax"):
        _call_c(z, offs, pads, q_t, scale, amax.half())
    with pytest.raises(ValueError, match=r"scale"):
        _call_c(z, offs, pads, q_t, torch.empty(2, 6), amax)
    with pytest.raises(ValueError, match=r"q_t"):  # without padding q_t must be [F, T]
        _call_c(z, offs, None, q_t, scale, amax)
    with pytest.raises(ValueError, match=r"padded_offsets\[2\] = 17 is past q_t's last column"):
        _call_c(z, offs, torch.tensor([4, 6, 17], dtype=torch.int32), q_t, scale, amax)
    with pytest.raises(ValueError, match=r"padded_offsets\[0\] = 2 gives expert 0"):
        _call_c(z, offs, torch.tensor([2, 6, 13], dtype=torch.int32), q_t, scale, amax)
    with pytest.raises(ValueError, match=r"offsets"):
        _call_c(z, torch.tensor([3, 11, 10], dtype=torch.int32), pads, q_t, scale, amax)
    big = torch.zeros(3, 16)  # scale over amax
    with pytest.raises(ValueError, match=r"scale.*amax"):
        _call_c(z, offs, pads, q_t, big[:, :6], big[:, 3:9])
    zz = torch.zeros(10, 12)  # scale over gate_up
    with pytest.raises(ValueError, match=r"scale.*gate_up"):
        _call_c(zz, offs, pads, q_t, zz[:3, :6], amax)
