"""python -m expertact.bench --fp8-accuracy on the CPU: the six FP8 GEMMs of the rowwise recipe (the
emulation: operands made by expertact's kernels, dequantised exactly, float32 accumulation) against
float64, on a capture file with uneven experts (one empty) and on synthetic inputs; the operands'
dequantisation checked against the plain-torch oracle of the recipe; the error and bias sums on
known cases; the rows the CPU cannot make reported as such, never as numbers.
"""
import json
import math

import pytest
import torch

from expertact.bench import cli, fp8_accuracy as acc
from support import fp8_tiles

D, F = 128, 64
COUNTS = (150, 0, 301, 37)  # uneven, one expert without rows, one not a multiple of the padding


def _capture(path, seed=0):
    """A file in examples/autoep_train.py --capture-step's format, with 5 rows past the last offset."""
    g = torch.Generator().manual_seed(seed)
    T, E = sum(COUNTS) + 5, len(COUNTS)
    torch.save(dict(x=torch.randn(T, D, generator=g), dy=torch.randn(T, D, generator=g) * 1e-3,
                    w13=torch.randn(E, D, 2 * F, generator=g) * 0.02, w2=torch.randn(E, F, D, generator=g) * 0.02,
                    offsets=torch.tensor(COUNTS).cumsum(0).to(torch.int32), y=torch.zeros(T, D), weights=None,
                    layout="halves", activation=dict(name="swiglu_oai", alpha=1.702, limit=7.0), step=7, tag="t"),
               path)
    return path


def _rows(results):
    return {(r["recipe"], r["gemm"]): r for r in results}


def test_sums_error_and_signed_bias():
    ref = torch.randn(1000, dtype=torch.float64)
    s = acc.Sums()
    s.add(ref * 1.01, ref)
    r = s.result()
    assert math.isclose(r["err"], 0.01, rel_tol=1e-9) and math.isclose(r["bias"], 0.01, rel_tol=1e-9)
    s = acc.Sums()
    s.add(ref * 0.98, ref)
    assert math.isclose(s.result()["bias"], -0.02, rel_tol=1e-9)
    noise = acc.Sums()  # an error orthogonal to ref has no bias
    other = torch.randn(1000, dtype=torch.float64)
    other -= (other @ ref) / (ref @ ref) * ref
    noise.add(ref + 0.1 * other, ref)
    assert abs(noise.result()["bias"]) < 1e-12 and noise.result()["err"] > 0.01
    assert acc.Sums().result() == dict(err=None, bias=None)


def test_operands_dequantise_as_the_recipe_oracle(tmp_path):
    """The rowwise operands as the bench makes them (expertact's kernels) dequantise to exactly
    what the plain-torch oracle of the recipe gives: x per row, the weights per expert and output
    column over K, the weight gradients' operands per expert and column over the expert's rows."""
    p = acc.load_capture(_capture(tmp_path / "c.pt"), torch.device("cpu"))
    p.chain()
    A, B = acc.rowwise_operands(p, "gate_up")
    idx = torch.arange(p.T)
    q, s = fp8_tiles.rowwise(p.x)
    assert torch.equal(A.deq(idx), q.double() * s.double()[:, None])
    for e in range(p.E):
        qw, sw = fp8_tiles.rowwise(p.w13[e].t())  # [2F, D]: one scale per output column over K = D
        assert torch.equal(B.deq(e), (qw.double() * sw.double()[:, None]).t())
    A, B = acc.rowwise_operands(p, "dw13")  # dw13^T = dgate_up^T x
    for e, (s0, s1) in enumerate(zip(p.starts, p.ends)):
        if s1 == s0:
            continue
        qx, sx = fp8_tiles.quantize_tiles(p.x[s0:s1], None, 1)  # one tile per column over the expert's rows
        assert torch.equal(B.deq(e, 0, s1 - s0), qx.double() * sx.double())


def test_blockwise_operands_dequantise_as_the_recipe_oracle(tmp_path):
    """The blockwise operands (1 x 128 row tiles, 128 x 128 weight blocks, 128 x 1 column tiles over
    each expert's rows) dequantise to exactly the oracle's, at sizes that are not multiples of 128."""
    assert acc.has_blockwise(torch.device("cpu")) == ""
    g = torch.Generator().manual_seed(3)
    T, d, f = 301, 160, 96
    p = acc.Problem(torch.randn(T, d, generator=g).bfloat16(), torch.randn(T, d, generator=g).bfloat16(),
                    (torch.randn(3, d, 2 * f, generator=g) * 0.05).bfloat16(),
                    (torch.randn(3, f, d, generator=g) * 0.05).bfloat16(), torch.tensor([100, 100, 301]).int(),
                    "swiglu_oai", 1.702, 7.0, "test")
    p.chain()
    A, B = acc.blockwise_operands(p, "gate_up")
    q, s = fp8_tiles.row_tiles(p.x)
    assert torch.equal(A.deq(torch.arange(T)), q.double() * s.double().repeat_interleave(128, 1)[:, :d])
    qb, sb = fp8_tiles.blocks(p.w13.transpose(-2, -1))  # [E, 2F, D] blocks
    for e in range(3):
        full = sb[e].double().repeat_interleave(128, 0)[:2 * f].repeat_interleave(128, 1)[:, :d]
        assert torch.equal(B.deq(e), (qb[e].double() * full).t())
    A, B = acc.blockwise_operands(p, "dw13")
    qt, st = fp8_tiles.column_tiles(p.x, p.ends)  # [D, Tp], [Tp / 128, D]
    deq = qt.double().t() * st.double().repeat_interleave(128, 0)
    for e, (s0, s1) in enumerate(zip(p.starts, p.ends)):
        if s1 > s0:
            p0 = B.pstarts[e]
            assert torch.equal(B.deq(e, 0, s1 - s0), deq[p0:p0 + s1 - s0])


def test_rowwise_emulation_against_float64(tmp_path):
    """Each of the six GEMMs: a few percent from float64 on the bf16 inputs (the quantisation; a
    silent bf16 fallback would be 100x closer), its bias small; against float64 on the dequantised
    operands only the output's bf16 rounding (exact float32 accumulation: within 1e-4 of that value
    rounded once); the bf16 weight gradients of rowwise-bf16-wgrad at bf16 precision; those of
    rowwise-promoted-wgrad the emulation's, rowwise's values on the CPU."""
    out = tmp_path / "acc.json"
    assert cli.main(["--fp8-accuracy", "--device", "cpu", "--tensors", str(_capture(tmp_path / "c.pt")),
                     "--json", str(out), "--markdown", str(tmp_path / "acc.md")]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["problem"]["rows_per_expert"] == list(COUNTS)
    rows = _rows(data["results"])
    assert set(rows) == {(r, g) for r in acc.RECIPES for g in acc.GEMMS}
    for g in acc.GEMMS:
        r = rows[("rowwise", g)]
        assert 0.01 < r["ref64"]["err"] < 0.08 and abs(r["ref64"]["bias"]) < 0.01, (g, r)
        assert 5e-4 < r["deq64"]["err"] < 3e-3 and abs(r["deq64"]["bias"]) < 1e-3, (g, r)
        assert r["beyond_rounding"] < 1e-4, (g, r)
        assert math.isclose(r["quant"], r["ref64"]["err"], rel_tol=0.1), (g, r)
        for cuda_only in acc.CUDA_ONLY:
            assert "n/a on CPU" in rows[(cuda_only, g)]["na"] or "= rowwise" in rows[(cuda_only, g)]["na"]
        bf = rows[("rowwise-bf16-wgrad", g)]
        promoted = rows[("rowwise-promoted-wgrad", g)]
        if g in acc.WGRADS:
            assert bf["ref64"]["err"] < 3e-3 and bf["deq64"] is None, (g, bf)
            assert {k: promoted[k] for k in r if k != "recipe"} == {k: r[k] for k in r if k != "recipe"}, (g, promoted)
        else:
            assert bf["na"] == promoted["na"] == "as rowwise"
        blk = rows[("blockwise", g)]  # expert_mlp's emulation of the recipe's GEMMs
        assert 0.005 < blk["ref64"]["err"] < 0.08 and blk["beyond_rounding"] < 1e-4, (g, blk)
    md = (tmp_path / "acc.md").read_text()
    assert "| rowwise | dw13 |" in md and "n/a on CPU" in md and "step 7" in md


def test_synthetic_inputs_and_scales_from(tmp_path, capsys):
    """Without a file: normal inputs at the given shape; --scales-from: each column of x and dy
    scaled as one of the file's columns (the errors, relative, stay those of the recipe)."""
    cap = _capture(tmp_path / "c.pt")
    p = acc.synthetic(2, 64, 32, 32, torch.device("cpu"), 0, scales_from=str(cap))
    rx, rdy, s13, _ = acc.column_rms(str(cap))
    assert p.x.shape == (128, 32) and p.w13.shape == (2, 32, 64) and p.offsets.tolist() == [64, 128]
    assert 0.5e-3 < float(p.dy.float().pow(2).mean().sqrt()) < 2e-3  # dy's columns were ~1e-3
    assert math.isclose(float(p.w13.float().pow(2).mean().sqrt()), s13, rel_tol=0.1)
    assert cli.main(["--fp8-accuracy", "--device", "cpu", "--experts", "2", "--rows", "96", "--dim", "64",
                     "--ffn", "32", "--recipes", "rowwise"]) == 0
    text = capsys.readouterr().out
    assert "synthetic normal" in text and text.count("| rowwise |") == 6
    with pytest.raises(SystemExit):
        acc.parse_args(["--tensors", str(cap), "--dim", "64"])
    with pytest.raises(SystemExit, match="multiples of 16"):
        acc.main(["--device", "cpu", "--dim", "40", "--ffn", "32", "--experts", "1", "--rows", "8"])


def test_promoted_rows_share_the_no_fast_accum_output(tmp_path, monkeypatch):
    """rowwise-promoted-wgrad's weight gradients are the call rowwise-no-fast-accum makes: where
    both rows run, the GEMM runs once and both rows get its numbers; alone, it makes the call
    itself. (rowwise-no-fast-accum is CUDA's; let through on the CPU here, where both are the
    emulation.)"""
    monkeypatch.setattr(acc, "CUDA_ONLY", set())
    calls = []
    real = acc.run_gemm
    monkeypatch.setattr(acc, "run_gemm", lambda recipe, p, gemm, A, B: calls.append((recipe, gemm)) or
                        real(recipe, p, gemm, A, B))
    p = acc.load_capture(_capture(tmp_path / "c.pt"), torch.device("cpu"))
    p.chain()
    both = _rows(acc.measure(p, ["rowwise-no-fast-accum", "rowwise-promoted-wgrad"], 1000, torch.device("cpu")))
    assert sorted(calls) == sorted([("rowwise-no-fast-accum", g) for g in acc.GEMMS])
    for g in acc.WGRADS:
        a, b = both[("rowwise-no-fast-accum", g)], both[("rowwise-promoted-wgrad", g)]
        assert a["ref64"]["err"] is not None
        assert {k: a[k] for k in a if k != "recipe"} == {k: b[k] for k in b if k != "recipe"}
    calls.clear()
    alone = _rows(acc.measure(p, ["rowwise-promoted-wgrad"], 1000, torch.device("cpu")))
    assert sorted(calls) == sorted([("rowwise-promoted-wgrad", g) for g in acc.WGRADS])
    for g in acc.WGRADS:
        assert alone[("rowwise-promoted-wgrad", g)]["ref64"] == both[("rowwise-promoted-wgrad", g)]["ref64"]
