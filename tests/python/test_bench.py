"""The benchmark runs end to end (a tiny CPU table) and its memory columns show what
SPEC section 3 promises: expertact keeps nothing and peaks at 3 tensors, 1 in place."""
import json
import os

import pytest
import torch

from expertact import bench


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_cpu_table(tmp_path, capsys):
    rows, ffn = 256, 64
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    rc = bench.main(["--device", "cpu", "--rows", str(rows), "--ffn", str(ffn), "--presets", "swiglu_oai",
                     "--layouts", "separate,interleaved", "--impls", "eager,compile,expertact,expertact-inplace",
                     "--iters", "2", "--warmup", "1", "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(js.read_text())
    results = data["results"]
    assert len(results) == 2 * 4
    assert all("error" not in r for r in results), [r for r in results if "error" in r]
    tensor_gib = rows * ffn * 4 / 2 ** 30
    for r in results:
        assert r["ms"] > 0 and r["pct_floor"] > 0 and r["fwd_ms"] > 0 and r["bwd_ms"] > 0
        if r["impl"] == "expertact":
            assert r["kept_gib"] == 0 and r["extra_peak_gib"] == pytest.approx(3 * tensor_gib)
        elif r["impl"] == "expertact-inplace":
            assert r["kept_gib"] == 0 and r["extra_peak_gib"] == pytest.approx(tensor_gib)
        elif r["impl"] == "eager" and r["layout"] == "separate" and r["preset"] == "swiglu_oai":
            assert r["kept_gib"] > 2 * tensor_gib and r["extra_peak_gib"] > 5 * tensor_gib
    text = md.read_text()
    assert "| swiglu_oai | interleaved | expertact-inplace |" in text and "% of floor" in text
    assert data["meta"]["floor_ms"] > 0 and data["meta"]["rows"] == rows
    err = capsys.readouterr().err
    assert "[8/8]" in err  # progress while it runs


def test_bench_rejects_unknown_names():
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--presets", "relu"])


def test_kineto_markers_dropped_other_lines_kept(capfd):
    with bench._without_kineto_markers():
        os.write(2, b"USDT:2026-11-30 09:26:16 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                    b"ERROR: a real message\n"
                    b"USDT:2026-11-30 09:26:16 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    err = capfd.readouterr().err
    assert "profiler_st" not in err and "ERROR: a real message" in err
    # The profiler behind the CPU memory columns (kineto prints the markers on every profile).
    inp = bench.Inputs("separate", 8, 16, torch.float32, torch.device("cpu"), 6.0)
    peak, kept = bench.cpu_memory(bench.make_fn("eager", "swiglu", "separate", 1.702, 7.0), inp)
    assert peak > 0 and kept > 0
    assert "USDT" not in capfd.readouterr().err
