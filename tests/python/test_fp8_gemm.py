"""expertact.moe._gemm.blockwise_gmm: the blockwise recipe's grouped GEMMs (FP32-promoted
accumulation), M-grouped and K-grouped, as expert_mlp(fp8="blockwise") calls them; on a Hopper GPU
torch._scaled_mm per expert with the same scales, on the CPU its emulation.

Every case runs on the CPU (the emulation) and, where torch._scaled_mm passes the layer's probe on
a Hopper GPU, on the GPU (skipped elsewhere), against a float64 reference of the recipe: the
operands dequantised exactly (q * scale, powers of two) and multiplied in float64, per expert.

Two kinds of operands, two bounds:
- exact: small integer q (|q| <= 4) and power-of-two scales in [2^-2, 2^2]. Every 128-deep partial
  sum is an integer of at most 11 bits, exact in the tensor cores' accumulation (about 14 bits
  kept on Hopper) and in float32, and every promoted sum is exact in float32 (at most 2^20 in
  units of 2^-4 here); the result is the float64 value rounded once to bfloat16, so the test asks
  for it bit for bit, on both devices. Any indexing error (a wrong expert, row, scale tile, a
  partial K tile dropped, an expert's last rows not a multiple of 4) shows.
- realistic: standard normals quantised by the recipe (tests/python/support/fp8_tiles.py).
  |out - ref| <= ulp_bf16(ref) + 2^-12 * (|a| @ |b|^T): one bf16 ulp for the final rounding (half
  of one, doubled for float32's own sums), and 2^-12 of the sum of the products' magnitudes for
  the tensor cores' in-tile accumulation (about 14 bits kept: an error of at most ~2^-13 of the
  magnitudes added per aligned addition, four 32-deep instructions per 128-deep tile); the
  promotion keeps it from growing with K. A GEMM that dropped the promotion would err by ~2^-14
  of the magnitudes per addition over all of K (thousands), and one with a wrong scale or index
  by O(|ref|).
"""
import math

import pytest
import torch

import expertact
from expertact.moe import _gemm
from support import fp8_tiles

_HOPPER = torch.cuda.is_available() and expertact.has_cuda() and torch.cuda.get_device_capability()[0] == 9
requires_gpu_gemm = pytest.mark.skipif(
    not (_HOPPER and _gemm.blockwise_backend(torch.device("cuda"))[0] == "scaled_mm"),
    reason="needs a Hopper GPU (sm_90) where torch._scaled_mm passes the blockwise probe")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_gpu_gemm)]

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


def m_call(a, sa, b, sb, ends, device):
    """blockwise_gmm M-grouped, a_scale as the row-tile quantiser gives it: the [T, KB] view of
    [KB, T] storage."""
    sa_t = sa.t().contiguous().to(device).t()
    return _gemm.blockwise_gmm(a.to(device), sa_t, b.to(device), sb.to(device), ends, "m")


def k_call(a_t, sa, b_t, sb, pends, device, out_transposed=False):
    return _gemm.blockwise_gmm(a_t.to(device), sa.to(device), b_t.to(device), sb.to(device), pends, "k", out_transposed)


def poison(shape, device):
    """Memory the output may reuse filled with NaN, so that a GEMM that leaves part of its output
    unwritten (rows past the last offset, an expert without rows) fails."""
    torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def test_reference_is_the_recipe():
    """The float64 reference against a direct sum of q * scale products (so a wrong reference
    cannot pass the tests): M-grouped with a partial K tile, K-grouped with padding."""
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


def test_a_refused_device_raises_naming_why(monkeypatch):
    """Where the layer has no backend, NotImplementedError carries blockwise_backend's reason."""
    monkeypatch.setattr(_gemm, "blockwise_backend", lambda device: (None, "no GEMM for this test"))
    g = torch.Generator().manual_seed(5)
    a, sa, b, sb, ends = m_operands(64, 128, 16, [64], g, exact=True)
    with pytest.raises(NotImplementedError, match="the blockwise FP8 GEMMs cannot run here: no GEMM for this test"):
        m_call(a, sa, b, sb, ends, "cpu")


# ---------------------------------------------------------------------------
# Values, on the CPU (the emulation) and on a Hopper GPU (torch._scaled_mm per expert)
# ---------------------------------------------------------------------------

# (T, K, N, rows per expert): uneven and empty experts, experts whose rows are not a multiple of 4
# (torch._scaled_mm's 1 x 128 scales take 4-row blocks: the last 1 to 3 rows go in padded), a
# single expert, rows past the last offset (T beyond the ends), K = 2,880 (a partial last K tile)
# and 3,072, N = 272 and 2,880 (a partial last N block), K = N = 16 (one partial tile each).
M_CASES = [
    pytest.param(1100, 2880, 384, [300, 0, 397, 1, 0, 255], id="uneven-empty-past-K2880"),
    pytest.param(640, 3072, 272, [640], id="one-expert-K3072-N272"),
    pytest.param(700, 3072, 2880, [129, 127, 0, 300], id="N2880-past"),
    pytest.param(513, 16, 16, [200, 313], id="K16-N16"),
    pytest.param(300, 256, 128, [0, 0, 0], id="all-empty"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,K,N,sizes", M_CASES)
def test_m_grouped_exact(T, K, N, sizes, device):
    g = torch.Generator().manual_seed(T + K + N)
    a, sa, b, sb, ends = m_operands(T, K, N, sizes, g, exact=True)
    ref, _, _ = m_reference(a, sa, b, sb, ends)
    poison((T, N), device)
    assert_exact(m_call(a, sa, b, sb, ends, device), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,K,N,sizes", M_CASES[:3])
def test_m_grouped_realistic(T, K, N, sizes, device):
    g = torch.Generator().manual_seed(7 * T + K)
    a, sa, b, sb, ends = m_operands(T, K, N, sizes, g, exact=False)
    ref, ad_abs, bd_abs = m_reference(a, sa, b, sb, ends)
    assert_bounded(m_call(a, sa, b, sb, ends, device), ref, m_magnitudes(ad_abs, bd_abs, ends, N))


@pytest.mark.parametrize("device", DEVICES)
def test_m_grouped_weight_stack_as_a_view(device):
    """b as a slice of a wider stack (an expert stride that is not N * K): the same values."""
    g = torch.Generator().manual_seed(11)
    a, sa, b, sb, ends = m_operands(400, 512, 256, [150, 250], g, exact=True)
    ref, _, _ = m_reference(a, sa, b, sb, ends)
    wide = torch.zeros(2, 384, 512, dtype=torch.float8_e4m3fn)
    wide[:, 64:320] = b
    assert_exact(m_call(a, sa, wide.to(device)[:, 64:320], sb, ends, device), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_m_grouped_nan_reaches_its_row(device):
    """A NaN in one row of a (in an expert's body of 4-row blocks, and in its last rows) makes
    that output row NaN and no other."""
    g = torch.Generator().manual_seed(12)
    a, sa, b, sb, ends = m_operands(258, 256, 128, [258], g, exact=True)
    for r in (17, 257):
        a.view(torch.uint8)[r, 5] = 0x7F  # NaN
    out = m_call(a, sa, b, sb, ends, device).cpu()
    nan_rows = torch.isin(torch.arange(258), torch.tensor([17, 257]))
    assert out[nan_rows].isnan().all()
    assert not out[~nan_rows].isnan().any()


K_CASES = [
    pytest.param(256, 384, [300, 0, 1, 128, 1000], id="uneven-empty"),
    pytest.param(3072, 272, [900], id="one-expert-N272"),
    pytest.param(320, 2880, [129, 0, 0], id="N2880-trailing-empty"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N,sizes", K_CASES)
def test_k_grouped_exact(M, N, sizes, device):
    g = torch.Generator().manual_seed(M + N)
    a_t, sa, b_t, sb, pends = k_operands(M, N, sizes, g, exact=True)
    ref, _ = k_reference(a_t, sa, b_t, sb, pends)
    poison((len(sizes), M, N), device)
    assert_exact(k_call(a_t, sa, b_t, sb, pends, device), ref)  # experts without tokens: 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,N,sizes", K_CASES[:2])
def test_k_grouped_realistic(M, N, sizes, device):
    g = torch.Generator().manual_seed(3 * M + N)
    a_t, sa, b_t, sb, pends = k_operands(M, N, sizes, g, exact=False)
    ref, mag = k_reference(a_t, sa, b_t, sb, pends)
    assert_bounded(k_call(a_t, sa, b_t, sb, pends, device), ref, mag)


@pytest.mark.parametrize("device", DEVICES)
def test_k_grouped_transposed_output(device):
    g = torch.Generator().manual_seed(13)
    a_t, sa, b_t, sb, pends = k_operands(256, 144, [200, 0, 60], g, exact=True)
    ref, _ = k_reference(a_t, sa, b_t, sb, pends)
    out = k_call(a_t, sa, b_t, sb, pends, device, out_transposed=True)
    assert out.shape == (3, 256, 144) and out.stride(1) == 1  # d[e] column-major
    assert_exact(out, ref)


@requires_gpu_gemm
def test_the_weight_scales_form_taken_on_this_gpu():
    """B's 128 x 128 scales pass their probe on this GPU, so the M-grouped GEMMs at K = 3,072 and
    6,144 take them as they are (a refusal would leave the slower 1 x 128 form: named here)."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert _gemm.blockwise_backend(device)[0] == "scaled_mm"
    assert _gemm.square_weight_scales(device, 24), _gemm._SQUARE.get(device.index)
    assert not _gemm.square_weight_scales(device, 23)


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
    """The totals: each row's GEMMs, and each recipe's GEMMs as expert_mlp runs them (the promoted
    recipe: torch-rowwise's M-grouped GEMMs, torch-rowwise-promoted's weight gradients; blockwise:
    torch-blockwise's six); a row with an error has no total, nor has its recipe."""
    from expertact.bench import fp8_gemm as bench

    assert bench.IMPLS == ("torch-rowwise", "torch-rowwise-promoted", "torch-blockwise")
    shapes = bench.gemm_shapes(2, 256, 128, 128)
    ms = {"torch-rowwise": 1.0, "torch-rowwise-promoted": 3.0, "torch-blockwise": 5.0}
    results = [dict(impl=impl, grouping=g, ms=ms[impl]) for impl in ms for _, g, _ in shapes]
    got = bench.totals(results, list(ms), shapes)
    assert got["torch-rowwise"]["ms"] == 6.0 and got["torch-rowwise-promoted"]["ms"] == 18.0
    assert got["recipe rowwise"]["ms"] == 6.0 and got["recipe rowwise-promoted-wgrad"]["ms"] == 4 * 1.0 + 2 * 3.0
    assert got["recipe blockwise"]["ms"] == got["torch-blockwise"]["ms"] == 30.0
    results[-1] = dict(results[-1], error="OOM")  # torch-blockwise's last GEMM
    got = bench.totals(results, list(ms), shapes)
    assert got["torch-blockwise"] is None and got["recipe blockwise"] is None and got["recipe rowwise"]["ms"] == 6.0
    assert "recipe rowwise" not in bench.totals(results, ["torch-blockwise"], shapes)


def test_bench_cli_needs_a_gpu():
    from expertact.bench import cli

    with pytest.raises(SystemExit, match="--fp8-gemms: the FP8 GEMMs run on a CUDA device"):
        cli.main(["--fp8-gemms", "--device", "cpu"])


@requires_gpu_gemm
def test_bench_runs_small(tmp_path):
    import json

    from expertact.bench import cli

    out = tmp_path / "gemms.json"
    assert cli.main(["--fp8-gemms", "--rows", "1000", "--dim", "512", "--ffn", "256", "--iters", "2", "--warmup", "1",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = [r for r in data["results"] if r["impl"] == "torch-blockwise"]
    assert len(rows) == 6 and all("error" not in r and r["ms"] > 0 for r in rows), rows
    assert data["totals"]["recipe blockwise"]["ms"] == sum(r["ms"] for r in rows)
    assert all(r["scratch_mib"] >= 0 for r in data["results"] if "error" not in r)


def test_bench_markdown_names_each_gemms_scratch():
    """The table gives each GEMM's scratch (what a call allocates beyond its output) beside its time;
    a row that failed leaves every column after the error empty."""
    from expertact.bench import fp8_gemm as bench

    r = dict(gemm="dw2 = h^T dy", grouping="k", ms=2.0, tflops=500.0, peak_pct=25.3, scratch_mib=96.0)
    data = dict(device="H200", experts=4, rows=1000, dim=512, ffn=256, iters=2, warmup=1,
                versions=dict(torch="2.11", cuda="13.0"), totals={"torch-rowwise": None},
                results=[dict(r, impl="torch-rowwise"), dict(gemm=r["gemm"], grouping="k", impl="torch-blockwise",
                                                             error="OOM")])
    md = bench.markdown(data).splitlines()
    assert "| scratch MiB |" in md[4]
    assert "| dw2 = h^T dy | k | torch-rowwise | 2.000 | 500 | 25.3 | 96.0 |" in md
    assert "| dw2 = h^T dy | k | torch-blockwise | OOM | | | |" in md
