"""expertact.fp8's blockwise operands (1 x 128 row tiles, 128 x 1 column tiles per expert,
128 x 128 weight blocks, and the activation's forward and backward forms): bytes and scales bit
for bit against the plain-torch oracle of every tile format (support/fp8_tiles.py) on the CPU
(partial tiles, experts of 0, 1, 127, 128 and 129 rows, rows past the last offset, NaN, +-inf,
all-zero tiles, 448, every dtype, views); the activation forms against the float64 oracle; the
refusals. On a GPU, the CUDA path bit for bit against the CPU's, or against the oracle of its
own float32 values where its fast math differs (those cases skip without one)."""

import pytest
import torch

import expertact
from expertact import fp8, functional
from support import fp8_tiles as ft
from support.fp8_cases import backward_case, glu_case, split
from support.oracle import glu64
from test_fp8_backward import _bias_rows, _oracle, _steps

CUDA = torch.cuda.is_available() and expertact.has_cuda()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Expert sizes 0, 1, 127, 128, 0, 129, 5 and 11 rows past the last offset.
SIZES = [0, 1, 127, 128, 0, 129, 5]
ENDS = [sum(SIZES[:i + 1]) for i in range(len(SIZES))]
T_ROWS = ENDS[-1] + 11
PRESET = {"swiglu": ("silu", 1.0, None, 0.0), "swiglu_oai": ("silu", 1.702, 7.0, 1.0),
          "geglu_tanh": ("gelu_tanh", 1.0, None, 0.0)}


def _values(T, C, dtype, seed=0):
    """[T, C] of dtype: magnitudes over many binades (one per row), an all-zero row and an
    all-zero tile, +-448, NaN, +-inf."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-6, 4, T, dtype=torch.float64)[torch.randperm(T, generator=g)]
    t = torch.randn(T, C, generator=g, dtype=torch.float64) * mags[:, None]
    if dtype == torch.float16:
        t = t.clamp(-6e4, 6e4)
    edits = [(0, slice(None), 0.0), (1, slice(0, 128), 0.0), (2, 0, 448.0), (2, -1, -448.0),
             (3, C // 2, float("nan")), (4, -1, float("inf")), (5, 0, float("-inf"))]
    for r, c, v in edits[:T + 1 if T > 1 else 0]:  # (a single row keeps its values)
        if r < T:
            t[r, c] = v
    return t.to(dtype)


def _same_bytes(q, rq):
    assert q.dtype == torch.float8_e4m3fn and q.shape == rq.shape
    assert torch.equal(ft.bits(q), ft.bits(rq))


def _row_checks(q, scale, t):
    """q and scale are fp8_tiles' row tiles of t [T, C] bit for bit; scale is the [T, KB] view
    with strides (1, T)."""
    rq, rs = ft.row_tiles(t)
    T = t.shape[0]
    assert scale.shape == rs.shape and (T <= 1 or scale.stride() == (1, T))
    _same_bytes(q, rq)
    assert torch.equal(scale, rs)


def _column_checks(q, scale, t, ends):
    """q ([Tp, C], strides (1, Tp)) and scale are fp8_tiles' column tiles of t bit for bit."""
    rq, rs = ft.column_tiles(t, ends)
    Tp = rq.shape[1]
    assert q.shape == (Tp, t.shape[1]) and (Tp == 0 or q.stride() == (1, Tp))
    assert scale.shape == rs.shape
    _same_bytes(q.t(), rq)
    assert torch.equal(scale, rs)


# ---------------------------------------------------------------------------
# Row tiles
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 7, 100, 128, 129, 300, 333])
def test_row_tiles(dtype, C):
    t = _values(37, C, dtype)
    q, scale = fp8.quantize_row_tiles(t)
    _row_checks(q, scale, t)
    if C >= 128:
        assert scale[1, 0] == 2.0 ** -48  # an all-zero tile
    if C > 1:
        assert scale[4, -1] == float("inf") and torch.isnan(q[4, -1].float())


def test_row_tiles_views_and_shapes():
    wide = _values(40, 600, torch.bfloat16, 1)
    view = wide[::2, 3:303]  # rows 2 apart, an odd first column: read in place, element by element
    q, scale = fp8.quantize_row_tiles(view)
    _row_checks(q, scale, view.contiguous())
    t = _values(6, 200, torch.float32, 2).reshape(2, 3, 200)
    q, scale = fp8.quantize_row_tiles(t)
    assert q.shape == (2, 3, 200) and scale.shape == (2, 3, 2)
    rq, rs = ft.row_tiles(t.reshape(6, 200))
    _same_bytes(q.reshape(6, 200), rq)
    assert torch.equal(scale.reshape(6, 2), rs)
    q, scale = fp8.quantize_row_tiles(torch.empty(0, 300))
    assert q.shape == (0, 300) and scale.shape == (0, 3)


def test_row_tiles_dequantise_within_half_a_step():
    t = torch.randn(64, 1000, dtype=torch.float64) * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None]
    q, scale = fp8.quantize_row_tiles(t.float())
    deq = ft.dequantize(q, scale, 1, ft.TILE)
    s = scale.double().repeat_interleave(ft.TILE, 1)[:, :1000]
    assert torch.all((deq - t.float().double()).abs() <= t.float().double().abs() * 2 ** -4 + s * 2 ** -10)


# ---------------------------------------------------------------------------
# Column tiles (and row tiles from the same read)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 100, 128, 200, 257])
def test_column_tiles(dtype, C):
    t = _values(T_ROWS, C, dtype, 3)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    q, scale = fp8.quantize_column_tiles_grouped(t, offs)
    _column_checks(q, scale, t, ENDS)
    assert scale.shape[0] == sum(-(-n // 128) for n in SIZES)
    q2, scale2, rq, rscale = fp8.quantize_column_tiles_grouped(t, offs, ends=ENDS, row_tiles=True)
    assert torch.equal(ft.bits(q2), ft.bits(q)) and torch.equal(scale2, scale)
    _row_checks(rq, rscale, t)  # every row, those past the last offset included


def test_column_tiles_edges():
    # one expert, no rows: nothing to write
    t = torch.randn(5, 40)
    q, scale = fp8.quantize_column_tiles_grouped(t, torch.tensor([0], dtype=torch.int32))
    assert q.shape == (0, 40) and scale.shape == (0, 40)
    # a column slice of a wider tensor; an expert whose 128 rows hold NaN, inf and an all-zero column
    wide = _values(300, 333, torch.bfloat16, 4)
    wide[130:258, 7] = 0
    ends = [130, 258, 290]
    view = wide[:, 5:205]
    q, scale, rq, rscale = fp8.quantize_column_tiles_grouped(view, torch.tensor(ends, dtype=torch.int32),
                                                             row_tiles=True)
    _column_checks(q, scale, view.contiguous(), ends)
    _row_checks(rq, rscale, view.contiguous())
    assert scale[2, 2] == 2.0 ** -48  # expert 1's tile (its one), column 7 of wide: all zero


# ---------------------------------------------------------------------------
# Weight blocks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 100, 300), (3, 128, 128), (2, 129, 257)])
def test_blocks(dtype, shape):
    E, R, C = shape
    w = _values(E * R, C, dtype, 5).reshape(E, R, C)
    for view in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):  # contiguous, then as a transposed view
        q, scale = fp8.quantize_blocks(view)
        rq, rs = ft.blocks(view)
        assert q.shape == (E, R, C) and q.is_contiguous() and scale.shape == rs.shape
        _same_bytes(q, rq)
        assert torch.equal(scale, rs)


@pytest.mark.parametrize("shape", [(1, 1, 0), (2, 0, 300), (0, 3, 5), (2, 0, 0), (0, 0, 0)])
def test_blocks_empty(shape):
    """An empty w (no columns, no rows or no experts; 3-D and 2-D, and a view whose columns are
    sliced away) gives empty q and scale of the documented shapes, and is still checked."""
    E, R, C = shape
    want_scale = (E, -(-R // ft.TILE), -(-C // ft.TILE))
    for w in (torch.zeros(shape), torch.ones(E, R, C + 1, dtype=torch.bfloat16)[:, :, 1:]):  # and a view
        q, scale = fp8.quantize_blocks(w)
        assert q.shape == shape and q.dtype == torch.float8_e4m3fn and scale.shape == want_scale
        if E:
            q2, scale2 = fp8.quantize_blocks(w[0])
            assert q2.shape == shape[1:] and scale2.shape == want_scale[1:]
    with pytest.raises(TypeError, match="w.dtype"):
        fp8.quantize_blocks(torch.zeros(shape, dtype=torch.float64))


def test_blocks_any_strides_and_2d():
    base = _values(3 * 260, 300, torch.bfloat16, 6).reshape(3, 260, 300)
    view = base[:, ::2, 1:]  # row stride 600, an odd first column
    q, scale = fp8.quantize_blocks(view)
    rq, rs = ft.blocks(view)
    _same_bytes(q, rq)
    assert torch.equal(scale, rs)
    q2, s2 = fp8.quantize_blocks(base[1].t())  # 2-D, transposed
    rq2, rs2 = ft.blocks(base[1].t()[None])
    _same_bytes(q2, rq2[0])
    assert torch.equal(s2, rs2[0])
    # the transposed q with the transposed scale is the transposed weight's quantisation
    qt, st = fp8.quantize_blocks(base.transpose(1, 2))
    assert torch.equal(ft.bits(qt), ft.bits(q_of(base).transpose(1, 2)))
    assert torch.equal(st, fp8.quantize_blocks(base)[1].transpose(1, 2))


def q_of(w):
    return fp8.quantize_blocks(w)[0]


# ---------------------------------------------------------------------------
# The activation: row tiles of h (forward) and column tiles of h recomputed (backward)
# ---------------------------------------------------------------------------


def _glu_case(T, F, dtype, seed, E=len(ENDS)):
    return glu_case(T, F, dtype, seed, E, nan_at=[(9, 3)])


def _h64(z, layout, activation, w, b, ends):
    """The float64 activation of gate_up z (the separate layout as halves), weights and bias."""
    x = z.double() if b is None else z.double() + _bias_rows(b, ends, z.shape[0])
    return glu64(x, "halves" if layout == "separate" else layout, activation) * w.double()[:, None]


def _close_bytes(q, rq, share=1e-3):
    """e4m3 bytes at most one step apart, on at most `share` of them (the library's float32
    values may round to the other side of a step than the float64 oracle's)."""
    diff = (_steps(ft.bits(q)) - _steps(ft.bits(rq))).abs()
    assert diff.max() <= 1
    assert (diff > 0).float().mean() <= share, (diff > 0).float().mean()


def _padded_t(t, ends):
    """t [T, C] float64 as the column tiles lay it out: [C, Tp], each expert's rows from its
    128-padded offset, zeros between."""
    pends = ft.padded_ends(ends)
    out = torch.zeros(t.shape[1], pends[-1] if pends else 0, dtype=torch.float64)
    start = pstart = 0
    for end, pend in zip(ends, pends):
        out[:, pstart:pstart + end - start] = t[start:end].double().t()
        start, pstart = end, pend
    return out


def _close_to(q, scale, tile_rows, tile_cols, ref):
    """q * scale (tiles of tile_rows x tile_cols) against the float64 values ref wherever both are
    finite: within half an e4m3 step (2^-4 relative, 2^-10 scale among the subnormals) plus the
    float32 arithmetic's error (1e-5 of the largest value: tiles whose values are all far below
    it, e.g. gelu's cancellation at large negative inputs in a one-row column tile, are judged by
    the bit-for-bit tests against the library's own float32 values)."""
    deq = ft.dequantize(q, scale, tile_rows, tile_cols)
    s = scale.double().repeat_interleave(tile_rows or q.shape[0], 0).repeat_interleave(tile_cols or q.shape[1], 1)
    s = s[:q.shape[0], :q.shape[1]]
    ok = torch.isfinite(ref) & torch.isfinite(s)
    assert ok.float().mean() > 0.9
    tol = ref.abs() * 2 ** -4 + s * 2 ** -10 + 1e-5 * ref[ok].abs().max()
    assert torch.all((deq - ref).abs()[ok] <= tol[ok])


@pytest.mark.parametrize("activation", list(PRESET))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biased", [False, True])
def test_glu_row_tiles_against_float64(activation, layout, dtype, biased):
    T, F = T_ROWS, 200
    z, b, w = _glu_case(T, F, dtype, 7)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    x, up, lay = split(z, layout)
    kw = {"bias": b, "offsets": offs} if biased else {}
    q, scale = fp8.glu_row_tiles(x, activation, up=up, layout=lay, weights=w, **kw)
    rq, rs = ft.row_tiles(_h64(z, layout, activation, w, b if biased else None, ENDS).float())
    assert scale.shape == rs.shape and scale.stride() == (1, T)
    assert torch.equal(scale, rs)
    _close_bytes(q, rq)


@pytest.mark.parametrize("layout", ["halves", "interleaved", "separate"])
def test_glu_row_tiles_are_the_rowwise_h(layout):
    """The same float32 h as glu_rowwise's: where a row's amax equals its first tile's, its
    first tile's bytes and scale are glu_rowwise's."""
    z, b, w = _glu_case(64, 100, torch.bfloat16, 8)
    x, up, lay = split(z, layout)
    q, scale = fp8.glu_row_tiles(x, "swiglu_oai", up=up, layout=lay, weights=w)
    rq, rs = fp8.glu_rowwise(x, "swiglu_oai", up=up, layout=lay, weights=w)
    _same_bytes(q, rq)  # F = 100: one tile a row
    assert torch.equal(scale[:, 0], rs)


@pytest.mark.parametrize("activation", list(PRESET))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved", "separate"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("biased", [False, True])
def test_glu_column_tiles_are_the_forward_h(activation, layout, dtype, biased):
    """Bit for bit quantize_column_tiles_grouped of the activation's forward output (h rounded
    to the input's dtype), and that h within rounding of the float64 one."""
    T, F = T_ROWS, 130
    z, b, w = _glu_case(T, F, dtype, 9)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    x, up, lay = split(z, layout)
    act, a, lim, beta = PRESET[activation]
    kw = {"bias": b} if biased else {}
    h = functional.glu(x, up, layout=lay, activation=act, alpha=a, limit=lim, beta=beta, weights=w,
                       offsets=offs if biased else None, **kw)
    q, scale = fp8.glu_column_tiles_grouped(x, activation, offs, up=up, layout=lay, weights=w, **kw)
    _column_checks(q, scale, h, ENDS)
    # the dequantised tiles against float64's h (the forward's rounding to the dtype: within a
    # dtype ulp, far inside half an e4m3 step)
    h64 = _h64(z, layout, activation, w, b if biased else None, ENDS)
    _close_to(q.t(), scale.t(), 1, ft.TILE, _padded_t(h64.to(dtype).double(), ENDS))


# ---------------------------------------------------------------------------
# The activation's backward: row tiles of dgate_up, its column tiles from the same pass
# ---------------------------------------------------------------------------


def _bwd_case(T, F, dtype, seed, E=len(ENDS)):
    return backward_case(T, F, dtype, seed, E)


@pytest.mark.parametrize("activation", list(PRESET))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
@pytest.mark.parametrize("F", [48, 100, 200])
def test_backward_float32_bit_for_bit(activation, layout, F):
    """A float32 call's dgate_up_out holds the float32 gradient itself: the row and column tiles
    are fp8_tiles' of it byte for byte; it and the weights' gradient are float64's within
    float32's error."""
    z, dh, b, w = _bwd_case(T_ROWS, F, torch.float32, 10)
    z[9, 3] = float("nan")
    dh[12, 1] = float("inf")
    offs = torch.tensor(ENDS, dtype=torch.int32)
    d32 = torch.full_like(z, 12345.0)
    q, scale, cq, cscale, dw = fp8.glu_backward_tiles(dh, z, activation, layout=layout, weights=w, weights_grad=True,
                                                      bias=b, offsets=offs, column_tiles=True, dgate_up_out=d32)
    _row_checks(q, scale, d32)
    _column_checks(cq, cscale, d32, ENDS)
    d64, dw64 = _oracle(z, dh, activation, layout, w, b, ENDS)
    fin = torch.isfinite(d64)
    assert torch.equal(torch.isfinite(d32), fin)
    torch.testing.assert_close(d32.double()[fin], d64[fin], rtol=1e-5, atol=1e-6 * d64[fin].abs().max().item())
    finw = torch.isfinite(dw64)
    torch.testing.assert_close(dw.double()[finw], dw64[finw], rtol=1e-5, atol=1e-5 * dw64[finw].abs().max().item())


@pytest.mark.parametrize("activation", list(PRESET))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("biased", [False, True])
def test_backward_against_float64(activation, layout, dtype, biased):
    F = 100
    z, dh, b, w = _bwd_case(T_ROWS, F, dtype, 11)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    kw = {"bias": b} if biased else {}
    q, scale, cq, cscale, dw = fp8.glu_backward_tiles(dh, z, activation, layout=layout, weights=w, weights_grad=True,
                                                      offsets=offs, ends=ENDS, column_tiles=True, **kw)
    d64, dw64 = _oracle(z, dh, activation, layout, w, b if biased else None, ENDS)
    _close_to(q, scale, 1, ft.TILE, d64)
    assert (scale != ft.row_tiles(d64.float())[1]).float().mean() < 0.02  # a tile's amax on a boundary
    _close_to(cq.t(), cscale.t(), 1, ft.TILE, _padded_t(d64, ENDS))
    assert (cscale != ft.column_tiles(d64.float(), ENDS)[1]).float().mean() < 0.05
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-5, atol=1e-5 * dw64.abs().max().item())


@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_backward_forms_agree(layout):
    """Without column tiles the row tiles are the same (a bias's experts then found per row); the
    weights' gradient is the same bits twice and glu_backward_rowwise's (both sum a row in
    column order on the CPU); the bf16 copy is the activation's backward's."""
    z, dh, b, w = _bwd_case(T_ROWS, 96, torch.bfloat16, 12)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    full = fp8.glu_backward_tiles(dh, z, "swiglu_oai", layout=layout, weights=w, weights_grad=True, bias=b,
                                  offsets=offs, column_tiles=True)
    rows_only = fp8.glu_backward_tiles(dh, z, "swiglu_oai", layout=layout, weights=w, weights_grad=True, bias=b,
                                       offsets=offs)
    assert rows_only[2] is None and rows_only[3] is None
    assert torch.equal(ft.bits(full[0]), ft.bits(rows_only[0])) and torch.equal(full[1], rows_only[1])
    assert torch.equal(full[4], rows_only[4])
    _, _, dw_rowwise, _ = fp8.glu_backward_rowwise(dh, z, "swiglu_oai", layout=layout, weights=w, weights_grad=True,
                                                   bias=b, offsets=offs)
    assert torch.equal(full[4], dw_rowwise)
    out = torch.empty_like(z)
    fp8.glu_backward_tiles(dh, z, "swiglu_oai", layout=layout, weights=w, bias=b, offsets=offs, dgate_up_out=out)
    ref = torch.empty_like(z)
    fp8.glu_backward_rowwise(dh, z, "swiglu_oai", layout=layout, weights=w, bias=b, offsets=offs, dgate_up_out=ref)
    assert torch.equal(out, ref)


def test_backward_empty():
    z = torch.randn(0, 20)
    q, scale, cq, cscale, dw = fp8.glu_backward_tiles(torch.randn(0, 10), z, weights=torch.rand(0), weights_grad=True,
                                                      offsets=torch.tensor([0], dtype=torch.int32),
                                                      column_tiles=True)
    assert q.shape == (0, 20) and scale.shape == (0, 1) and cq.shape == (0, 20) and dw.shape == (0,)


# ---------------------------------------------------------------------------
# Refusals: the library names the argument and its value
# ---------------------------------------------------------------------------


def test_refusals():
    with pytest.raises(expertact.DTypeError, match="float64"):
        fp8.quantize_row_tiles(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="w must be"):
        fp8.quantize_blocks(torch.randn(8))
    with pytest.raises(expertact.DTypeError, match="w.dtype"):
        fp8.quantize_blocks(torch.randn(2, 4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="offsets"):
        fp8.quantize_column_tiles_grouped(torch.randn(10, 8), torch.tensor([6, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="past the last row"):
        fp8.quantize_column_tiles_grouped(torch.randn(10, 8), torch.tensor([4, 12], dtype=torch.int32), ends=[4, 12])
    with pytest.raises(ValueError, match="column_tiles=True needs offsets"):
        fp8.glu_backward_tiles(torch.randn(4, 8), torch.randn(4, 16), column_tiles=True)
    with pytest.raises(ValueError, match="separate"):
        fp8.glu_backward_tiles(torch.randn(4, 8), torch.randn(4, 16), layout="separate")
    z = torch.randn(4, 16)
    with pytest.raises(ValueError, match="grad_gate_up overlaps gate_up"):
        fp8.glu_backward_tiles(torch.randn(4, 8), z, dgate_up_out=z)
    with pytest.raises(ValueError, match="bias and offsets go together"):
        fp8.glu_row_tiles(z, bias=torch.randn(2, 16))


# ---------------------------------------------------------------------------
# CUDA: the same bytes as the CPU (a GPU session runs these as they are)
# ---------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [1, 7, 100, 128, 129, 300, 3072])
def test_cuda_row_and_column_tiles_match_cpu(dtype, C):
    t = _values(T_ROWS, C, dtype, 13)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    for view in (t, torch.cat((t, t), 1)[:, 1:C + 1]):  # 16-byte rows, then an odd first column
        q, scale = fp8.quantize_row_tiles(view.cuda())
        rq, rs = fp8.quantize_row_tiles(view)
        _same_bytes(q.cpu(), rq)
        assert torch.equal(scale.cpu(), rs)
        got = fp8.quantize_column_tiles_grouped(view.cuda(), offs.cuda(), ends=ENDS, row_tiles=True)
        want = fp8.quantize_column_tiles_grouped(view, offs, row_tiles=True)
        for g, r in zip(got, want):
            assert g.shape == r.shape and g.stride() == r.stride()
            if r.dtype == torch.float8_e4m3fn:
                assert torch.equal(ft.bits(g.cpu()), ft.bits(r))
            else:
                assert torch.equal(g.cpu(), r)


@needs_cuda
def test_cuda_column_tiles_many_rows_past_the_last_offset():
    """More row tiles past the last offset than the kernel has blocks for them: they loop."""
    t = _values(80000, 8, torch.bfloat16, 14)
    offs = torch.tensor([300, 1000], dtype=torch.int32)
    got = fp8.quantize_column_tiles_grouped(t.cuda(), offs.cuda(), row_tiles=True)
    want = fp8.quantize_column_tiles_grouped(t, offs, row_tiles=True)
    for g, r in zip(got, want):
        assert torch.equal(g.cpu().view(torch.uint8) if r.dtype == torch.float8_e4m3fn else g.cpu(),
                           r.view(torch.uint8) if r.dtype == torch.float8_e4m3fn else r)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 100, 300), (3, 128, 128), (2, 129, 257), (2, 512, 768)])
def test_cuda_blocks_match_cpu(dtype, shape):
    E, R, C = shape
    w = _values(E * R, C, dtype, 15).reshape(E, R, C)
    for view in (w, w.transpose(1, 2).contiguous().transpose(1, 2), w[:, :, 1:]):
        q, scale = fp8.quantize_blocks(view.cuda())
        rq, rs = fp8.quantize_blocks(view)
        _same_bytes(q.cpu(), rq)
        assert torch.equal(scale.cpu(), rs)


@needs_cuda
@pytest.mark.parametrize("activation", list(PRESET))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved", "separate"])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("F", [100, 3072])
def test_cuda_glu_tiles(activation, layout, biased, F):
    """float32: the row tiles are fp8_tiles' of the GPU forward's own float32 h bit for bit;
    bfloat16: the column tiles are fp8_tiles' of the GPU forward's output, the row tiles within
    a step of the float64 oracle's."""
    offs = torch.tensor(ENDS, dtype=torch.int32).cuda()
    act, a, lim, beta = PRESET[activation]
    for dtype in (torch.float32, torch.bfloat16):
        z, b, w = (v.cuda() for v in _glu_case(T_ROWS, F, dtype, 16))
        x, up, lay = split(z, layout)
        kw = {"bias": b} if biased else {}
        h = functional.glu(x, up, layout=lay, activation=act, alpha=a, limit=lim, beta=beta, weights=w,
                           offsets=offs if biased else None, **kw)
        q, scale = fp8.glu_row_tiles(x, activation, up=up, layout=lay, weights=w,
                                     offsets=offs if biased else None, **kw)
        if dtype == torch.float32:
            _row_checks(q.cpu(), scale.cpu(), h.cpu())
        else:
            h64 = _h64(z.cpu(), layout, activation, w.cpu(), b.cpu() if biased else None, ENDS)
            _close_bytes(q.cpu(), ft.row_tiles(h64.float())[0], share=5e-3)
        cq, cscale = fp8.glu_column_tiles_grouped(x, activation, offs, up=up, layout=lay, weights=w, ends=ENDS, **kw)
        _column_checks(cq.cpu(), cscale.cpu(), h.cpu(), ENDS)


@needs_cuda
@pytest.mark.parametrize("activation", list(PRESET))
@pytest.mark.parametrize("layout", ["halves", "up_first", "interleaved"])
@pytest.mark.parametrize("F", [48, 100, 3072])
@pytest.mark.parametrize("biased", [False, True])
def test_cuda_backward_tiles(activation, layout, F, biased):
    """float32 with dgate_up_out (the GPU's own float32 gradient): the row and column tiles are
    fp8_tiles' of it byte for byte; the weights' gradient NaN where float64's is (the NaN gate_up
    value's row), elsewhere within float32's error of it, and the same bits when the call is made
    again (the kernel's promise: a fixed order); without column tiles (another schedule of the
    same rows) the same row tiles (a bias's experts per row) and the weights' gradient within
    float32's error of the first form's."""
    z, dh, b, w = _bwd_case(T_ROWS, F, torch.float32, 17)
    z[9, 3] = float("nan")
    offs = torch.tensor(ENDS, dtype=torch.int32)
    kw = {"bias": b.cuda()} if biased else {}
    args = (dh.cuda(), z.cuda(), activation)

    def call(d32=None, column_tiles=True):
        return fp8.glu_backward_tiles(*args, layout=layout, weights=w.cuda(), weights_grad=True, offsets=offs.cuda(),
                                      ends=ENDS, column_tiles=column_tiles, dgate_up_out=d32, **kw)

    d32 = torch.full_like(z, 12345.0).cuda()
    q, scale, cq, cscale, dw = call(d32)
    d32 = d32.cpu()
    _row_checks(q.cpu(), scale.cpu(), d32)
    _column_checks(cq.cpu(), cscale.cpu(), d32, ENDS)
    d64, dw64 = _oracle(z, dh, activation, layout, w, b if biased else None, ENDS)
    fin = torch.isfinite(dw64)
    assert fin[:9].all() and not fin[9]  # the NaN value's row, and only it
    assert torch.equal(torch.isnan(dw.cpu()), ~fin)
    atol = 1e-5 * dw64[fin].abs().max().item()
    torch.testing.assert_close(dw.cpu().double()[fin], dw64[fin], rtol=1e-5, atol=atol)
    same = call(torch.full_like(z, 12345.0).cuda())
    assert _same_float_bits(same[4], dw)
    assert torch.equal(ft.bits(same[0]), ft.bits(q)) and torch.equal(same[1], scale)
    rows_only = call(column_tiles=False)
    assert rows_only[2] is None and rows_only[3] is None
    assert torch.equal(ft.bits(rows_only[0]), ft.bits(q)) and torch.equal(rows_only[1], scale)
    assert torch.equal(torch.isnan(rows_only[4]), torch.isnan(dw))
    torch.testing.assert_close(rows_only[4].double()[fin.cuda()], dw.double()[fin.cuda()], rtol=1e-5, atol=atol)



def _inset(t):
    """t [T, C] as a view of a wider tensor: one element in, rows C + 3 elements apart (neither
    a multiple of 4 elements: the CUDA kernels' 4-value loads refused, fp8_tiles_plan.h)."""
    wide = torch.full((t.shape[0], t.shape[1] + 3), 7.0, dtype=t.dtype, device=t.device)
    wide[:, 1:t.shape[1] + 1] = t
    view = wide[:, 1:t.shape[1] + 1]
    assert view.storage_offset() == 1 and view.stride(0) == t.shape[1] + 3
    return view


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("layout", ["halves", "up_first", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F, biased", [(100, True), (256, False), (256, True)])
def test_tiles_of_misaligned_views(device, layout, dtype, F, biased):
    """gate_up (gate and up), dh as views whose rows start off every 4-element boundary give the
    bytes, scales and weights' gradient of the same values contiguous, where F lets the CUDA
    sources load 4 values at a time: the one-at-a-time path the views take and the vector path
    agree bit for bit (the activation's row and column tiles, the backward's both forms). F = 256
    without a bias: on a GPU the contiguous call takes the tile engine's full-tile path on the
    experts' whole 128-row tiles (bf16: streamed, the backward's pairs through its stash), the
    checked path on the rest (fp8_tiles.cuh)."""
    z, dh, b, w = (t.to(device) for t in _bwd_case(T_ROWS, F, dtype, 19))
    b = b if biased else None
    z[9, 3] = float("nan")
    offs = torch.tensor(ENDS, dtype=torch.int32, device=device)
    act = "swiglu_oai"

    def forward(inset):
        x, up, lay = split(z, layout)
        if inset:
            x, up = _inset(x), None if up is None else _inset(up)
        kw = dict(up=up, layout=lay, weights=w, bias=b)
        return (fp8.glu_row_tiles(x, act, offsets=offs if biased else None, **kw)
                + fp8.glu_column_tiles_grouped(x, act, offs, ends=ENDS, **kw))

    got, want = forward(True), forward(False)
    for g, r in zip(got, want):
        assert torch.equal(ft.bits(g), ft.bits(r)) if r.dtype == torch.float8_e4m3fn else torch.equal(g, r)
    if layout == "separate":
        return  # the backward takes packed layouts only
    got, want = (fp8.glu_backward_tiles(d, x, act, layout=layout, weights=w, weights_grad=True, bias=b, offsets=offs,
                                        ends=ENDS, column_tiles=True)
                 for d, x in ((_inset(dh), _inset(z)), (dh, z)))
    for g, r in zip(got[:4], want[:4]):
        assert torch.equal(ft.bits(g), ft.bits(r)) if r.dtype == torch.float8_e4m3fn else torch.equal(g, r)
    assert _same_float_bits(got[4], want[4])

def _same_float_bits(a, b):
    """a and b hold the same float32 bits (every NaN counted as one value: torch.equal finds a
    NaN unequal to itself)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.masked_fill(nan, 0).view(torch.int32),
                                                            b.masked_fill(nan, 0).view(torch.int32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_column_tiles_into_strided_views(device):
    """q_t given as a view into wider rows, as the library's C ABI takes it: first byte and row
    stride such that each 16-byte run of a column tile can be stored 16, 8 or 4 bytes at a time,
    or only byte by byte. Every form writes the contiguous call's bytes inside the view and none
    outside it (on a GPU: each store width of the kernels' staged column tiles)."""
    from expertact import _ops
    ends = [0, 1, 128, 256, 256, 385]
    T, C = 394, 257
    t = _values(T, C, torch.bfloat16, 21).to(device)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    pads = fp8.padded_offsets(offs, 128)
    want_q, want_s = fp8.quantize_column_tiles_grouped(t, offs, ends=ends)
    want = ft.bits(want_q.t().contiguous().cpu())  # [C, Tp]
    Tp = want.shape[1]
    for first, stride in [(0, Tp + 16), (8, Tp + 24), (0, Tp + 8), (4, Tp + 12), (0, Tp + 4), (1, Tp + 3),
                          (3, Tp + 16)]:
        width = first + (C - 1) * stride + Tp
        buf = torch.full((width,), 0x5A, dtype=torch.uint8, device=device)
        q_t = buf.view(torch.float8_e4m3fn).as_strided((C, Tp), (stride, 1), first)
        scale = torch.full_like(want_s, float("nan"))
        _ops.fp8_quantize_column_tiles_grouped(t, offs, pads, q_t, scale)
        got = buf.cpu()
        inside = torch.zeros(width, dtype=torch.bool)
        inside[first:].view(-1)[: (C - 1) * stride + Tp].as_strided((C, Tp), (stride, 1)).fill_(True)
        where = f"first byte {first}, row stride {stride}"
        assert torch.equal(got.as_strided((C, Tp), (stride, 1), first), want), where
        assert bool((got[~inside] == 0x5A).all()), f"{where}: bytes written outside the view"
        assert torch.equal(scale, want_s), where
