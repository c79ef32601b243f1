"""The expert-MLP benchmark runs end to end (a tiny CPU table) and its memory columns show
what the memory modes promise: recompute keeps one [T, F] tensor less, in place peaks two
[T, F] tensors lower."""
import json

import pytest
import torch

from conftest import requires_cuda
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


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_mlp_bias_table(tmp_path):
    """--bias: expert_mlp with and without the expert biases in each memory mode and the two
    compositions with biases, the bias-cost ratios, and the small-shape check of y and every
    gradient (b13's and b2's included) against the float64 reference."""
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    rc = mlp.main(["--bias", "--device", "cpu", "--experts", "2", "--rows", "64", "--dim", "32", "--ffn", "32",
                   "--iters", "1", "--warmup", "0", "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(js.read_text())
    meta = data["meta"]
    assert meta["bias"] and meta["weighted"] and meta["layout"] == "interleaved" and meta["preset"] == "swiglu_oai"
    res = {r["impl"]: r for r in data["results"]}
    assert list(res) == list(mlp.BIAS_IMPLS) and all("error" not in r for r in res.values()), res
    for name, r in res.items():
        # float32: each row against the eager composition of its own kind (with or without biases)
        assert r["y_rel_diff"] < 1e-5, (name, r["y_rel_diff"])
        if name.endswith("-bias") and name[:-5] in ("expertact", "expertact-inplace", "expertact-recompute",
                                                    "expertact-recompute-inplace"):
            assert r["vs_unbiased"] == pytest.approx(r["ms"] / res[name[:-5]]["ms"])
        else:
            assert "vs_unbiased" not in r
    check = {r["impl"]: r for r in data["bias_check"]}
    assert set(check) == {i for i in mlp.BIAS_IMPLS if i.endswith("-bias")}
    for name, r in check.items():
        assert set(r["grad_rel"]) == {"x", "w13", "w2", "weights", "b13", "b2"}, name
        # float32 against float64: a few float32 roundings, far below a dropped bias or a wrong gate
        assert r["y_rel"] < 1e-5 and max(r["grad_rel"].values()) < 1e-5, r
    text = md.read_text()
    assert "| implementation | y | dx | dw13 | dw2 | dweights | db13 | db2 |" in text
    assert "vs unbiased |" in text
    assert "PASS: check expertact-bias:" in text and "target <= 1.03x" in text
    assert "(target: faster, less extra peak)" in text


def test_bench_mlp_bias_check_catches_a_dropped_bias(monkeypatch):
    """The check compares every row with the float64 reference: an expert_mlp that ignored b2
    fails it."""
    import argparse

    from expertact import moe

    real = moe.expert_mlp
    monkeypatch.setattr(moe, "expert_mlp", lambda *args, b2=None, **kw: real(*args, **kw))
    a = argparse.Namespace(preset="swiglu_oai", layout="interleaved", alpha=1.702, limit=7.0)
    s = mlp.settings(mlp.parse_args(["--device", "cpu", "--bias"]), torch.device("cpu"))
    check = mlp.bias_check(["expertact-bias", "eager-bias"], a, s, torch.device("cpu"))
    by = {r["impl"]: r for r in check}
    assert by["eager-bias"]["y_rel"] < 1e-5
    assert by["expertact-bias"]["y_rel"] > 1e-2 and by["expertact-bias"]["grad_rel"]["b2"] is None
    (text, ok), = mlp.check_targets(check, s.dtype)
    assert ok is False and "expertact-bias" in text


def test_bench_mlp_bias_rows_without_routing_weights(tmp_path):
    """A -bias row outside --bias: the biases are allocated, routing weights only with --weights."""
    js = tmp_path / "m.json"
    rc = mlp.main(["--device", "cpu", "--experts", "2", "--rows", "16", "--dim", "16", "--ffn", "16",
                   "--impls", "eager,eager-bias,expertact-bias", "--iters", "1", "--warmup", "0", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert not data["meta"]["weighted"] and data["meta"]["layout"] == "halves"
    res = {r["impl"]: r for r in data["results"]}
    assert all("error" not in r for r in res.values()), res
    assert res["expertact-bias"]["y_rel_diff"] < 1e-5
    assert [r["impl"] for r in data["bias_check"]] == ["eager-bias", "expertact-bias"]


@requires_cuda
def test_bench_mlp_bias_table_on_the_gpu(tmp_path):
    """--bias on the GPU (bf16) at a small shape: every row runs and the small-shape check of each
    biased expert_mlp mode passes (y and every gradient within twice the eager composition's error
    against float64, or the bf16 floor)."""
    js = tmp_path / "b.json"
    rc = mlp.main(["--bias", "--experts", "2", "--rows", "256", "--dim", "128", "--ffn", "128",
                   "--iters", "2", "--warmup", "1", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["meta"]["dtype"] == "bfloat16"
    assert all("error" not in r for r in data["results"] + data["bias_check"]), data
    checks = [t for t in data["targets"] if t["text"].startswith("check ")]
    assert len(checks) == 4 and all(t["passed"] for t in checks), checks


def test_bench_mlp_fp8_table_on_the_cpu(tmp_path):
    """--mlp --fp8 on the CPU: the bf16 rows measured with their errors against float32, the FP8
    rows (and torchao's, whatever its install) reported as skipped, not failed; exit status 0."""
    from expertact.bench import cli
    js = tmp_path / "fp8.json"
    rc = cli.main(["--mlp", "--fp8", "--device", "cpu", "--rows", "32", "--dim", "32", "--ffn", "16",
                   "--iters", "1", "--warmup", "0", "--json", str(js)])
    assert rc == 0
    data = json.loads(js.read_text())
    by = {r["impl"]: r for r in data["results"]}
    assert list(by) == ["expertact", "expertact-recompute", "fp8", "fp8-bf16-wgrad", "fp8-promoted-wgrad",
                        "fp8-blockwise", "torchao", "fp8-gemms"]
    for name in ("expertact", "expertact-recompute"):
        assert "error" not in by[name] and by[name]["ms"] > 0
        assert all(v is not None and v < 1e-5 for v in by[name]["err"].values())  # float32 against float32
        assert all(abs(v) < 1e-5 for v in by[name]["bias"].values())
    for name in ("fp8", "fp8-bf16-wgrad", "fp8-promoted-wgrad", "fp8-blockwise", "fp8-gemms", "torchao"):
        assert by[name].get("skipped") and "x is on cpu" in by[name]["error"]


def test_bench_fp8_rows_are_the_recipes(monkeypatch):
    """One FP8 row per recipe of FP8_RECIPES, each running its recipe; the default recipe's row
    carries the speed target."""
    from expertact import moe
    from expertact.bench import fp8 as bench
    assert bench.FP8_ROWS == {"fp8": "rowwise", "fp8-bf16-wgrad": "rowwise-bf16-wgrad",
                              "fp8-promoted-wgrad": "rowwise-promoted-wgrad", "fp8-blockwise": "blockwise"}
    assert list(bench.FP8_ROWS.values()) == list(moe.FP8_RECIPES) and bench.DEFAULT_ROW == "fp8-blockwise"
    rows = [dict(impl="expertact", ms=300.0, extra_peak_gib=10.0),
            dict(impl="fp8-blockwise", ms=240.0, extra_peak_gib=10.5)]
    (text, ok), (peak, peak_ok) = bench.targets(rows)  # as shipped: blockwise carries the targets
    assert ok and text.startswith("fp8-blockwise (the default recipe) 1.25x faster"), text
    assert not peak_ok and peak.startswith("fp8-blockwise extra peak 10.50 GiB vs bf16 expert_mlp's 10.00 GiB"), peak
    monkeypatch.setattr(bench, "DEFAULT_ROW", None)
    rows[1:] = [dict(impl="fp8-promoted-wgrad", ms=200.0, extra_peak_gib=9.0)]
    [(text, ok)] = bench.targets(rows)  # no default recipe: a FAIL line naming who meets its speed
    assert not ok and text.startswith("no default recipe"), text
    assert text.endswith("is met by rowwise-promoted-wgrad 1.50x (the default's training step and loss rule: "
                         "docs/spec.md section 10)"), text
    [(text, ok)] = bench.targets([rows[0], dict(impl="fp8-blockwise", ms=250.0, extra_peak_gib=9.0)])
    assert not ok and text.endswith("is met by none"), text
    monkeypatch.setattr(bench, "DEFAULT_ROW", "fp8-promoted-wgrad")
    (text, ok), (peak, peak_ok) = bench.targets(rows)
    assert ok and peak_ok and text.startswith("fp8-promoted-wgrad (the default recipe) 1.50x faster"), text


@pytest.mark.parametrize("impl", ["fp8", "fp8-bf16-wgrad", "fp8-promoted-wgrad", "fp8-blockwise"])
def test_bench_fp8_rows_on_the_cpu_emulation(impl):
    """The FP8 rows' code (--mlp --fp8 skips them on the CPU, whose table is float32) on bf16
    inputs, where expert_mlp runs the recipe's emulation: each row's y, dx, dw13, dw2 against the
    float32 reference off by FP8's rounding (measured: err 5.7e-2 to 1.5e-1 on these steep inputs,
    gate_up about 6 x N(0, 1) into swiglu_oai; signed bias -2.6e-3 to -2.2e-2), the bf16 row's
    errors smaller (2.6e-3 to 4.0e-2)."""
    import types
    from expertact.bench import fp8 as bench
    from expertact.bench.mlp import MlpInputs
    a = types.SimpleNamespace(preset="swiglu_oai", alpha=1.702, limit=7.0, layout="halves")
    inp = MlpInputs(3, 40, 32, 48, torch.bfloat16, torch.device("cpu"), False, counts=[40, 0, 77])
    ref = bench.reference32(inp, a)
    err, bias = bench.errors(bench.make_fn(impl, a, inp.offsets, 48), inp, ref)
    base, _ = bench.errors(bench.make_fn("expertact", a, inp.offsets, 48), inp, ref)
    assert err.keys() == bias.keys() == {"y", "dx", "dw13", "dw2"}
    for k in err:
        assert 1e-2 < err[k] < 3e-1 and abs(bias[k]) < err[k] and base[k] < err[k], (k, err[k], bias[k], base[k])


def test_fp8_bench_compare_sums_in_slices():
    """bench --mlp --fp8's comparison sums over slices (the busiest rank's T x D output would need
    three whole-size float64 copies otherwise): the same err and bias as the whole-tensor formulas,
    with slices that do not divide the tensor."""
    from expertact.bench import fp8 as bench
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(37, 11, generator=g)
    a = (ref * 0.97 + 0.05 * torch.randn(37, 11, generator=g)).bfloat16()
    err, bias = bench.compare(a, ref, chunk=50)
    d, r = a.double() - ref.double(), ref.double()
    assert err == pytest.approx(float(d.norm() / r.norm()), rel=1e-12)
    assert bias == pytest.approx(float((d * r).sum() / (r * r).sum()), rel=1e-12)
    assert bias < -0.02  # the 0.97 shows as a loss along ref
    assert bench.compare(a, torch.zeros_like(ref)) == (None, None)
