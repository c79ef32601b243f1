"""The expert-MLP benchmark runs end to end (a tiny CPU table) and its memory columns show
what the memory modes promise: recompute keeps one [T, F] tensor less, in place peaks two
[T, F] tensors lower."""
import json

import pytest

from expertact.bench import mlp


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_mlp_cpu_table(tmp_path, capsys):
    E, rows, D, F = 2, 128, 32, 32
    js, md = tmp_path / "m.json", tmp_path / "m.md"
    impls = "gemms,eager,expertact-op,expertact,expertact-inplace,expertact-recompute,expertact-recompute-inplace"
    rc = mlp.main(["--device", "cpu", "--experts", str(E), "--rows", str(rows), "--dim", str(D), "--ffn", str(F),
                         "--layout", "interleaved", "--impls", impls, "--iters", "2", "--warmup", "1",
                         "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(js.read_text())
    res = {r["impl"]: r for r in data["results"]}
    assert list(res) == impls.split(",") and all("error" not in r for r in res.values()), res
    tf = E * rows * F * 4 / 2 ** 30  # one [T, F] float32 tensor, GiB
    assert res["expertact"]["kept_gib"] == pytest.approx(3 * tf)  # gate_up and h
    assert res["expertact-recompute"]["kept_gib"] == pytest.approx(2 * tf)  # gate_up
    assert res["expertact"]["extra_peak_gib"] - res["expertact-inplace"]["extra_peak_gib"] == pytest.approx(2 * tf)
    # h is dropped right after w2's gradient whether kept or recomputed: the peaks match
    assert res["expertact-recompute-inplace"]["extra_peak_gib"] == pytest.approx(res["expertact-inplace"]["extra_peak_gib"])
    assert res["expertact-recompute"]["extra_peak_gib"] == pytest.approx(res["expertact"]["extra_peak_gib"])
    for name, r in res.items():
        assert r["ms"] > 0 and r["tflops"] > 0
        if name != "gemms":
            assert r["y_rel_diff"] < 1e-5, (name, r["y_rel_diff"])  # the same function as the eager composition
    text = md.read_text()
    assert "| expertact-recompute-inplace |" in text and "Targets (memory modes" in text
    assert "PASS: recompute keeps" in text
    assert "[7/7]" in capsys.readouterr().err


def test_bench_mlp_rejects_unknown_rows():
    with pytest.raises(SystemExit):
        mlp.main(["--device", "cpu", "--impls", "expertact,fused-bogus"])


def test_bench_mlp_fused_rows_skip_where_the_fused_path_cannot_run(tmp_path):
    """On the CPU (or a build without CUTLASS) a fused row would time the unfused fallback:
    it is reported as skipped, with the reason, and the table still succeeds."""
    js = tmp_path / "m.json"
    rc = mlp.main(["--device", "cpu", "--experts", "2", "--rows", "16", "--dim", "16", "--ffn", "16",
                         "--impls", "gemms,fused,fused-recompute-inplace", "--iters", "1", "--warmup", "0",
                         "--json", str(js)])
    assert rc == 0
    res = {r["impl"]: r for r in json.loads(js.read_text())["results"]}
    for name in ("fused", "fused-recompute-inplace"):
        assert res[name]["error"].startswith("skipped: ") and res[name]["skipped"], res[name]


def test_bench_mlp_through_expertact_bench(tmp_path):
    """python -m expertact.bench --mlp (and expertact-bench --mlp) runs this table."""
    from expertact.bench import cli

    js = tmp_path / "m.json"
    rc = cli.main(["--mlp", "--device", "cpu", "--experts", "2", "--rows", "16", "--dim", "16", "--ffn", "16",
                   "--impls", "gemms,expertact", "--iters", "1", "--warmup", "0", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert [r["impl"] for r in data["results"]] == ["gemms", "expertact"]
    assert data["meta"]["command"].startswith("python -m expertact.bench --mlp --device cpu")
