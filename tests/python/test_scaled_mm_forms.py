"""bench/scaled_mm_forms.py on the CPU: each case's expected product is the exact one for the
operands and scales it hands torch._scaled_mm (a stand-in that dequantises them by the 1 x 128
rules gives "ok" everywhere), a torch._scaled_mm that misreads the scales is reported "wrong",
a refusal is reported with its message, and without a GPU the script says so and exits 0; the
forms of B's 128 x 128 scales are exact under cuBLAS's reading of them (rows of K blocks padded
to a multiple of 4) where padded, and misread unpadded at a K block count no multiple of 4."""
import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "scaled_mm_forms.py"
spec = importlib.util.spec_from_file_location("scaled_mm_forms", SCRIPT)
forms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forms)
TILE = 128


def _dequantising_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
    """A [M, K] with scale_a [M, KB]; B given as [K, N] with scale_b [KB, N]: both 1 x 128 along K."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and not use_fast_accum
    K = a.shape[1]
    A = a.float() * scale_a.repeat_interleave(TILE, 1)[:, :K]
    B = b.float() * scale_b.repeat_interleave(TILE, 0)[:K]
    return (A @ B).to(out_dtype)


def _cases():
    for K, N in ((32, 96), (256, 128), (384, 128)):
        for offset, M in ((0, 8), (10, 20)):
            yield forms.m_case(K, offset, M, N, torch.device("cpu"))
    for tiles, off in ((1, 0), (1, 3), (2, 1)):
        yield forms.k_case(tiles, off, 32, 48, torch.device("cpu"))
    yield forms.m_case(256, 5, 20, 128, torch.device("cpu"), row_stride=512)


@pytest.fixture
def no_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def test_every_case_is_exact_under_the_scale_rules(monkeypatch, no_sync):
    monkeypatch.setattr(torch, "_scaled_mm", _dequantising_mm)
    widened = 0
    for run, run_copy, wide, want, _ in _cases():
        assert forms.outcome(run, want) == "ok" and forms.outcome(run_copy, want) == "ok"
        if wide is not None:
            widened += 1
            assert forms.outcome(wide, want) == "ok"
    assert widened == 4  # K = 32 at two offsets, the K-grouped single tiles


def test_rows_further_apart_than_k(monkeypatch, no_sync):
    """row_stride: torch._scaled_mm gets A as a view of the first K columns of wider rows (lda >
    K, as the row tiles of dgate_up over gate_up's storage would be), and its copy contiguous."""
    seen = []

    def record(a, b, scale_a, scale_b, **kw):
        seen.append((tuple(a.shape), a.stride()))
        return _dequantising_mm(a, b, scale_a, scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", record)
    run, run_copy, wide, want, _ = forms.m_case(256, 5, 20, 128, torch.device("cpu"), row_stride=512)
    assert wide is None and forms.outcome(run, want) == "ok" and forms.outcome(run_copy, want) == "ok"
    assert seen == [((20, 256), (512, 1)), ((20, 256), (256, 1))]


def test_a_misread_scale_and_a_refusal_are_named(monkeypatch, no_sync):
    def first_tile_scale(a, b, scale_a, scale_b, **kw):  # every K tile read with the first tile's scales
        return _dequantising_mm(a, b, scale_a[:, :1].expand_as(scale_a), scale_b[:1].expand_as(scale_b), **kw)

    monkeypatch.setattr(torch, "_scaled_mm", first_tile_scale)
    run, _, _, want, _ = forms.m_case(384, 10, 20, 128, torch.device("cpu"))
    assert forms.outcome(run, want).startswith("wrong (relative error")

    def refuse(*a, **k):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    assert forms.outcome(run, want) == "refused: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_a_gpu_it_says_so(capsys):
    assert forms.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def _cublas_reading_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
    """As _dequantising_mm, and B's 128 x 128 scales ([KB, NB]) read as cuBLAS reads them: rows
    of NB's blocks, each of KB values, L4 = KB rounded up to 4 apart from where the view starts."""
    K, N = b.shape
    KB = -(-K // TILE)
    if scale_b.shape[1] < N:
        NB, L4 = scale_b.shape[1], -(-KB // 4) * 4
        read = torch.as_strided(scale_b, (NB, KB), (L4, 1))  # [NB, KB]
        scale_b = read.repeat_interleave(TILE, 0)[:N].t()  # [KB, N]: each block's scale on its columns
    return _dequantising_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum)


def test_the_weight_scale_forms(monkeypatch, no_sync):
    monkeypatch.setattr(torch, "_scaled_mm", _cublas_reading_mm)
    for K, N, misread in ((272, 272, True), (2880, 384, True), (512, 256, False)):
        runners, want = forms.weight_forms(K, N, 8, torch.device("cpu"))
        (rows, r), (unpadded, u), (padded, p), (full, f) = ((name, forms.outcome(call, want)) for name, call in runners)
        L4 = -(-(-(-K // TILE)) // 4) * 4
        assert (rows, unpadded) == ("1 x 128 [KB, N]", "128 x 128 [KB, NB], strides (1, KB)")
        assert (padded, full) == (f"128 x 128 [KB, NB], strides (1, {L4})", f"128 x 128 [{L4}, NB], strides (1, {L4})")
        assert r == p == f == "ok" and u.startswith("wrong") == misread, (K, r, u, p, f)
