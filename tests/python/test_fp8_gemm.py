"""expertact.fp8.grouped_gemm_blockwise: the blockwise recipe's grouped GEMM (a CUTLASS sm_90a
kernel, FP32-promoted accumulation), M-grouped and K-grouped.

CPU cases (everywhere): the argument errors of the public function and of the library behind it,
and the CPU's refusal. GPU cases (a Hopper GPU and a build with the GEMM; they skip elsewhere)
against a float64 reference of the recipe: the operands dequantised exactly (q * scale, powers of
two) and multiplied in float64, per expert.

Two kinds of operands, two bounds:
- exact: small integer q (|q| <= 4) and power-of-two scales in [2^-2, 2^2]. Every 128-deep partial
  sum is an integer of at most 11 bits, exact in the tensor cores' accumulation (about 14 bits
  kept on Hopper), and every promoted sum is exact in float32; the result is the float64 value
  rounded once to bfloat16, so the test asks for it bit for bit. Any indexing error (a wrong
  expert, row, scale tile, a partial K tile dropped) shows.
- realistic: standard normals quantised by the recipe (tests/python/support/fp8_tiles.py).
  |out - ref| <= ulp_bf16(ref) + 2^-12 * (|a| @ |b|^T): one bf16 ulp for the final rounding (half
  of one, doubled for float32's own sums), and 2^-12 of the sum of the products' magnitudes for
  the tensor cores' in-tile accumulation (about 14 bits kept: an error of at most ~2^-13 of the
  magnitudes added per aligned addition, four 32-deep instructions per 128-deep tile); the
  promotion keeps it from growing with K. A kernel that dropped the promotion would err by
  ~2^-14 of the magnitudes per addition over all of K (thousands), and one with a wrong scale or
  index by O(|ref|).
"""
import math

import pytest
import torch

import expertact
from expertact import fp8
from support import fp8_tiles

_HOPPER = torch.cuda.is_available() and expertact.has_cuda() and torch.cuda.get_device_capability()[0] == 9
requires_gemm = pytest.mark.skipif(not (_HOPPER and fp8.has_grouped_gemm()),
                                   reason="needs a Hopper GPU (sm_90) and a build with the FP8 grouped GEMM")

TILE = 128


# ---------------------------------------------------------------------------
# Operands and the float64 reference
# ---------------------------------------------------------------------------


def cdiv(a, b):
    return -(-a // b)


def ends_of(sizes):
    out, acc = [], 0
    for n in sizes:
        acc += n
        out.append(acc)
    return out


def exact_q(shape, gen):
    """float8_e4m3fn integers in [-4, 4] (exact products and sums)."""
    return torch.randint(-4, 5, shape, generator=gen).float().to(torch.float8_e4m3fn)


def exact_scales(shape, gen):
    """Powers of two in [2^-2, 2^2]."""
    return torch.exp2(torch.randint(-2, 3, shape, generator=gen).float())


def m_operands(T, K, N, sizes, gen, exact):
    """(a, a_scale [T, KB], b [E, N, K], b_scale [E, NB, KB], ends): the M-grouped operands."""
    E = len(sizes)
    if exact:
        a, sa = exact_q((T, K), gen), exact_scales((T, cdiv(K, TILE)), gen)
        b, sb = exact_q((E, N, K), gen), exact_scales((E, cdiv(N, TILE), cdiv(K, TILE)), gen)
    else:
        a, sa = fp8_tiles.row_tiles(torch.randn(T, K, generator=gen) * 3)
        b, sb = fp8_tiles.blocks(torch.randn(E, N, K, generator=gen) * 0.05)
    return a, sa, b, sb, ends_of(sizes)


def m_reference(a, sa, b, sb, ends):
    """float64 [T, N]: per expert, dequant(a rows) @ dequant(b[e])^T; rows past the last end 0."""
    T, N = a.shape[0], b.shape[1]
    ad = fp8_tiles.dequantize(a, sa, 1, TILE)
    out = torch.zeros(T, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = ad[start:end] @ fp8_tiles.dequantize(b[e], sb[e], TILE, TILE).t()
        start = end
    return out, ad.abs(), [fp8_tiles.dequantize(b[e], sb[e], TILE, TILE).abs() for e in range(len(ends))]


def m_magnitudes(ad_abs, bd_abs, ends, N):
    """|a| @ |b[e]|^T per expert's rows (the accumulation bound's scale)."""
    out = torch.zeros(ad_abs.shape[0], N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = ad_abs[start:end] @ bd_abs[e].t()
        start = end
    return out


def k_operands(M, N, sizes, gen, exact):
    """(a_t [M, Tp], a_scale [Tp/128, M], b_t [N, Tp], b_scale [Tp/128, N], padded ends): the
    K-grouped operands, each expert's tokens padded to a multiple of 128 with 0x00."""
    ends = ends_of(sizes)
    if exact:
        pends = fp8_tiles.padded_ends(ends)
        Tp = pends[-1] if pends else 0
        a_t, b_t = torch.zeros(M, Tp, dtype=torch.float8_e4m3fn), torch.zeros(N, Tp, dtype=torch.float8_e4m3fn)
        start, pstart = 0, 0
        for end, pend in zip(ends, pends):
            n = end - start
            a_t[:, pstart:pstart + n] = exact_q((M, n), gen)
            b_t[:, pstart:pstart + n] = exact_q((N, n), gen)
            start, pstart = end, pend
        sa, sb = exact_scales((Tp // TILE, M), gen), exact_scales((Tp // TILE, N), gen)
        return a_t, sa, b_t, sb, pends
    T = ends[-1] if ends else 0
    x, g = torch.randn(T, M, generator=gen) * 3, torch.randn(T, N, generator=gen)
    a_t, sa = fp8_tiles.column_tiles(x, ends)
    b_t, sb = fp8_tiles.column_tiles(g, ends)
    return a_t, sa, b_t, sb, fp8_tiles.padded_ends(ends)


def k_reference(a_t, sa, b_t, sb, pends):
    """float64 [E, M, N] and |a| @ |b|^T per expert."""
    ad = fp8_tiles.dequantize(a_t.t(), sa, TILE, 1)  # [Tp, M]
    bd = fp8_tiles.dequantize(b_t.t(), sb, TILE, 1)
    E, M, N = len(pends), a_t.shape[0], b_t.shape[0]
    out, mag = torch.zeros(E, M, N, dtype=torch.float64), torch.zeros(E, M, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(pends):
        out[e] = ad[start:end].t() @ bd[start:end]
        mag[e] = ad[start:end].abs().t() @ bd[start:end].abs()
        start = end
    return out, mag


def bf16_ulp(x):
    """The bfloat16 ulp at |x| (of the smallest normal below it)."""
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -126)))
    return torch.exp2(e - 7)


def assert_exact(got, ref):
    want = ref.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    bad = (got.cpu().view(torch.int16) != want.view(torch.int16))
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {got.numel()} elements are not the float64 result rounded once; "
                             f"first at {i}: got {got.cpu()[tuple(i)].item()!r}, want {want[tuple(i)].item()!r}")


def assert_bounded(got, ref, mag):
    """|got - ref| <= ulp_bf16(ref) + 2^-12 * mag (the module's bound), no NaN."""
    got = got.cpu().double()
    assert not got.isnan().any()
    err = (got - ref).abs()
    tol = bf16_ulp(ref) + 2.0 ** -12 * mag
    bad = err > tol
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} of {got.numel()} elements out of bound; first at {i}: got "
                             f"{got[tuple(i)].item()!r}, want {ref[tuple(i)].item()!r}, "
                             f"bound {tol[tuple(i)].item():.3g}")
    # And on the whole: a few bf16 ulps of the output.
    rel = (err.norm() / ref.norm().clamp(min=1e-300)).item()
    assert rel < 2.0 ** -8, rel


def m_call(a, sa, b, sb, ends, device="cuda"):
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    sa_t = sa.t().contiguous().to(device).t()  # the row-tile quantiser's [T, KB] view, strides (1, T)
    return fp8.grouped_gemm_blockwise(a.to(device), sa_t, b.to(device), sb.to(device), offs, mode="m")


def k_call(a_t, sa, b_t, sb, pends, device="cuda", out_transposed=False):
    offs = torch.tensor(pends, dtype=torch.int32, device=device)
    return fp8.grouped_gemm_blockwise(a_t.to(device), sa.to(device), b_t.to(device), sb.to(device), offs, mode="k",
                                      out_transposed=out_transposed)


# ---------------------------------------------------------------------------
# CPU: the arguments
# ---------------------------------------------------------------------------


def cpu_m_operands():
    g = torch.Generator().manual_seed(0)
    return m_operands(256, 256, 128, [100, 0, 156], g, exact=True)


def test_has_grouped_gemm_is_the_builds():
    assert fp8.has_grouped_gemm() in (True, False)
    assert fp8.has_grouped_gemm() == bool(expertact._capi.LIB.expertact_has_fp8_grouped_gemm())


def test_cpu_tensors_are_refused_naming_cuda():
    a, sa, b, sb, ends = cpu_m_operands()
    with pytest.raises(NotImplementedError, match="CUDA tensors"):
        m_call(a, sa, b, sb, ends, device="cpu")
    g = torch.Generator().manual_seed(1)
    a_t, sa_k, b_t, sb_k, pends = k_operands(64, 32, [130, 0, 7], g, exact=True)
    with pytest.raises(NotImplementedError, match="CUDA tensors"):
        k_call(a_t, sa_k, b_t, sb_k, pends, device="cpu")


def test_argument_errors():
    a, sa, b, sb, ends = cpu_m_operands()
    offs = torch.tensor(ends, dtype=torch.int32)
    f = fp8.grouped_gemm_blockwise
    with pytest.raises(ValueError, match="mode must be 'm'"):
        f(a, sa, b, sb, offs, mode="n")
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        f(a, sa, None, sb, offs)
    with pytest.raises(ValueError, match="b must be 3-D in mode 'm'"):
        f(a, sa, b[0], sb, offs)
    with pytest.raises(ValueError, match="b has 2 experts"):
        f(a, sa, b[:2], sb, offs)
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        f(a, sa, b, sb, offs[None])
    with pytest.raises(ValueError, match="at least one expert"):
        f(a, sa, b[:0], sb[:0], offs[:0])
    with pytest.raises(ValueError, match="out_transposed is for mode 'k'"):
        f(a, sa, b, sb, offs, out_transposed=True)
    # The library's own checks, named.
    with pytest.raises(expertact.DTypeError, match="a.dtype is bfloat16"):
        f(a.to(torch.bfloat16), sa, b, sb, offs)
    with pytest.raises(expertact.DTypeError, match="b_scale.dtype is float64"):
        f(a, sa, b, sb.double(), offs)
    with pytest.raises(ValueError, match="K = 248"):
        f(a[:, :248], sa, b[:, :, :248], sb, offs)
    with pytest.raises(ValueError, match="a_scale has shape"):
        f(a, sa[:, :1], b, sb, offs)
    with pytest.raises(ValueError, match="offsets"):
        f(a, sa, b, sb, torch.tensor([100, 50, 256], dtype=torch.int32))
    with pytest.raises(expertact.DTypeError, match="offsets must be int32"):
        f(a, sa, b, sb, offs.long())
    g = torch.Generator().manual_seed(2)
    a_t, sa_k, b_t, sb_k, pends = k_operands(64, 32, [130, 7], g, exact=True)
    po = torch.tensor(pends, dtype=torch.int32)
    with pytest.raises(ValueError, match="b must be 2-D in mode 'k'"):
        f(a_t, sa_k, b_t[None], sb_k, po, mode="k")
    with pytest.raises(ValueError, match="Tp = 320"):
        f(a_t[:, :320], sa_k, b_t[:, :320], sb_k, torch.tensor([256, 320], dtype=torch.int32), mode="k")
    with pytest.raises(ValueError, match="b_scale has shape"):
        f(a_t, sa_k, b_t, sb_k[:1], po, mode="k")


def test_reference_is_the_recipe():
    """The float64 reference against a direct sum of q * scale products (so a wrong reference
    cannot pass the GPU tests): M-grouped with a partial K tile, K-grouped with padding."""
    g = torch.Generator().manual_seed(3)
    a, sa, b, sb, ends = m_operands(12, 144, 8, [5, 0, 4], g, exact=False)
    ref, _, _ = m_reference(a, sa, b, sb, ends)
    for r, e in ((0, 0), (4, 0), (5, 2), (8, 2)):
        for n in (0, 7):
            s = sum(float(a[r, k].float()) * float(sa[r, k // 128]) * float(b[e, n, k].float()) *
                    float(sb[e, n // 128, k // 128]) for k in range(144))
            assert math.isclose(ref[r, n].item(), s, rel_tol=1e-12, abs_tol=1e-12)
    assert ref[9:].abs().sum() == 0  # rows past the last end
    a_t, sa_k, b_t, sb_k, pends = k_operands(4, 3, [130, 0, 5], g, exact=False)
    assert pends == [256, 256, 384]
    ref_k, _ = k_reference(a_t, sa_k, b_t, sb_k, pends)
    assert ref_k[1].abs().sum() == 0
    s = sum(float(a_t[2, t].float()) * float(sa_k[t // 128, 2]) * float(b_t[1, t].float()) * float(sb_k[t // 128, 1])
            for t in range(256, 384))
    assert math.isclose(ref_k[2, 2, 1].item(), s, rel_tol=1e-12, abs_tol=1e-12)


# ---------------------------------------------------------------------------
# GPU: values
# ---------------------------------------------------------------------------

# (T, K, N, rows per expert): uneven and empty experts, a single expert, rows past the last
# offset (T beyond the ends), K = 2,880 (a partial last K tile) and 3,072, N not a multiple of 128.
M_CASES = [
    pytest.param(1100, 2880, 384, [300, 0, 397, 1, 0, 255], id="uneven-empty-past-K2880"),
    pytest.param(640, 3072, 264, [640], id="one-expert-K3072-N264"),
    pytest.param(700, 3072, 2880, [129, 127, 0, 300], id="N2880-past"),
    pytest.param(513, 16, 8, [200, 313], id="K16-N8"),
    pytest.param(300, 256, 128, [0, 0, 0], id="all-empty"),
]


@requires_gemm
@pytest.mark.parametrize("T,K,N,sizes", M_CASES)
def test_m_grouped_exact(T, K, N, sizes):
    g = torch.Generator().manual_seed(T + K + N)
    a, sa, b, sb, ends = m_operands(T, K, N, sizes, g, exact=True)
    ref, _, _ = m_reference(a, sa, b, sb, ends)
    # Rows past the last offset must be written as 0: poison the memory the output will reuse.
    torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert_exact(m_call(a, sa, b, sb, ends), ref)


@requires_gemm
@pytest.mark.parametrize("T,K,N,sizes", M_CASES[:3])
def test_m_grouped_realistic(T, K, N, sizes):
    g = torch.Generator().manual_seed(7 * T + K)
    a, sa, b, sb, ends = m_operands(T, K, N, sizes, g, exact=False)
    ref, ad_abs, bd_abs = m_reference(a, sa, b, sb, ends)
    assert_bounded(m_call(a, sa, b, sb, ends), ref, m_magnitudes(ad_abs, bd_abs, ends, N))


@requires_gemm
def test_m_grouped_views_and_expert_stride():
    """b as a slice of a wider stack (an expert stride that is not N * K), a_scale given as a
    contiguous [T, KB] (copied), d's values unchanged."""
    g = torch.Generator().manual_seed(11)
    a, sa, b, sb, ends = m_operands(400, 512, 256, [150, 250], g, exact=True)
    ref, _, _ = m_reference(a, sa, b, sb, ends)
    wide = torch.zeros(2, 384, 512, dtype=torch.float8_e4m3fn)
    wide[:, 64:320] = b
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    out = fp8.grouped_gemm_blockwise(a.cuda(), sa.cuda(), wide.cuda()[:, 64:320], sb.cuda(), offs, mode="m")
    assert_exact(out, ref)


@requires_gemm
def test_m_grouped_nan_reaches_its_row():
    g = torch.Generator().manual_seed(12)
    a, sa, b, sb, ends = m_operands(256, 256, 128, [256], g, exact=True)
    a.view(torch.uint8)[17, 5] = 0x7F  # NaN
    out = m_call(a, sa, b, sb, ends).cpu()
    assert out[17].isnan().all()
    assert not out[torch.arange(256) != 17].isnan().any()


K_CASES = [
    pytest.param(256, 384, [300, 0, 1, 128, 1000], id="uneven-empty"),
    pytest.param(3072, 264, [900], id="one-expert-N264"),
    pytest.param(320, 2880, [129, 0, 0], id="N2880-trailing-empty"),
]


@requires_gemm
@pytest.mark.parametrize("M,N,sizes", K_CASES)
def test_k_grouped_exact(M, N, sizes):
    g = torch.Generator().manual_seed(M + N)
    a_t, sa, b_t, sb, pends = k_operands(M, N, sizes, g, exact=True)
    ref, _ = k_reference(a_t, sa, b_t, sb, pends)
    torch.full((len(sizes), M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert_exact(k_call(a_t, sa, b_t, sb, pends), ref)  # experts without tokens: 0


@requires_gemm
@pytest.mark.parametrize("M,N,sizes", K_CASES[:2])
def test_k_grouped_realistic(M, N, sizes):
    g = torch.Generator().manual_seed(3 * M + N)
    a_t, sa, b_t, sb, pends = k_operands(M, N, sizes, g, exact=False)
    ref, mag = k_reference(a_t, sa, b_t, sb, pends)
    assert_bounded(k_call(a_t, sa, b_t, sb, pends), ref, mag)


@requires_gemm
def test_k_grouped_transposed_output():
    g = torch.Generator().manual_seed(13)
    a_t, sa, b_t, sb, pends = k_operands(256, 136, [200, 0, 60], g, exact=True)
    ref, _ = k_reference(a_t, sa, b_t, sb, pends)
    out = k_call(a_t, sa, b_t, sb, pends, out_transposed=True)
    assert out.shape == (3, 256, 136) and out.stride(1) == 1  # d[e] column-major
    assert_exact(out, ref)


@requires_gemm
def test_stream_and_device_of_the_operands():
    """The call runs on the current stream of the operands' device (another stream here), and
    its result is ready after that stream's work."""
    g = torch.Generator().manual_seed(14)
    a, sa, b, sb, ends = m_operands(256, 256, 128, [100, 156], g, exact=True)
    ref, _, _ = m_reference(a, sa, b, sb, ends)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = m_call(a, sa, b, sb, ends)
    s.synchronize()
    assert_exact(out, ref)


# ---------------------------------------------------------------------------
# The timing script (python -m expertact.bench --fp8-gemms): its shapes on the CPU, its run on a GPU
# ---------------------------------------------------------------------------


def test_bench_shapes_are_the_six_gemms():
    from expertact.bench import fp8_gemm as bench

    shapes = bench.gemm_shapes(4, 261280, 3072, 3072)
    T = 4 * 261280
    assert [(g, s) for _, g, s in shapes] == [
        ("m", dict(T=T, K=3072, N=6144)), ("m", dict(T=T, K=3072, N=3072)), ("m", dict(T=T, K=3072, N=3072)),
        ("m", dict(T=T, K=6144, N=3072)), ("k", dict(T=T, M=3072, N=3072)), ("k", dict(T=T, M=3072, N=6144))]
    # In units of 2 T D F (D = F): 2 + 1 + 1 + 2 for the M-grouped four, 1 + 2 for the weight gradients.
    assert sum(bench.flops(g, s) for _, g, s in shapes) == 2 * T * 3072 * 3072 * (2 + 1 + 1 + 2 + 1 + 2)


def test_bench_totals_per_row_and_per_recipe():
    """The totals: each row's GEMMs, and each rowwise recipe's GEMMs as expert_mlp runs them (the
    promoted recipe: torch-rowwise's M-grouped GEMMs, torch-rowwise-promoted's weight gradients);
    a row with an error has no total."""
    from expertact.bench import fp8_gemm as bench

    shapes = bench.gemm_shapes(2, 256, 128, 128)
    ms = {"torch-rowwise": 1.0, "torch-rowwise-promoted": 3.0}
    results = [dict(impl=impl, grouping=g, ms=ms[impl]) for impl in ms for _, g, _ in shapes]
    results.append(dict(impl="expertact", grouping="m", error="OOM"))
    got = bench.totals(results, ["expertact", *ms], shapes)
    assert got["expertact"] is None and got["torch-rowwise"]["ms"] == 6.0 and got["torch-rowwise-promoted"]["ms"] == 18.0
    assert got["recipe rowwise"]["ms"] == 6.0 and got["recipe rowwise-promoted-wgrad"]["ms"] == 4 * 1.0 + 2 * 3.0
    assert "recipe rowwise" not in bench.totals(results, ["expertact"], shapes)


def test_bench_cli_needs_a_gpu():
    from expertact.bench import cli

    with pytest.raises(SystemExit, match="--fp8-gemms: the FP8 GEMMs run on a CUDA device"):
        cli.main(["--fp8-gemms", "--device", "cpu"])


@requires_gemm
def test_bench_runs_small(tmp_path):
    import json

    from expertact.bench import cli

    out = tmp_path / "gemms.json"
    assert cli.main(["--fp8-gemms", "--rows", "1000", "--dim", "512", "--ffn", "256", "--iters", "2", "--warmup", "1",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = [r for r in data["results"] if r["impl"] == "expertact"]
    assert len(rows) == 6 and all("error" not in r and r["ms"] > 0 for r in rows), rows
