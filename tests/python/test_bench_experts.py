"""The transformers-experts benchmark (python -m expertact.bench --experts): a small table on the
CPU with every implementation checked against eager (GPT-OSS with its expert biases), the targets
against grouped_mm, and on a GPU the same at a few hundred tokens."""
import json

import pytest
import torch

from conftest import requires_cuda

transformers = pytest.importorskip("transformers")
from expertact.bench import experts  # noqa: E402

# A small shape for the CPU: D, F, E, K.
SMALL = ["--dim", "64", "--ffn", "32", "--num-experts", "8", "--top-k", "2"]


def test_refuses_an_unknown_model():
    with pytest.raises(SystemExit, match="unknown model"):
        experts.main(["--device", "cpu", "--models", "no_such_model", "--tokens", "8"])


def test_model_spec_overrides_the_shape():
    spec = experts.model_spec("qwen3_30b_a3b")
    assert not spec["shape_overridden"] and spec["K"] == 8 and spec["kw"]["moe_intermediate_size"] == 768
    spec = experts.model_spec("gpt_oss_20b", dim=64, top_k=2)
    assert spec["shape_overridden"] and spec["K"] == 2
    assert spec["kw"]["hidden_size"] == 64 and spec["kw"]["intermediate_size"] == 2880
    assert experts.MODELS["gpt_oss_20b"]["kw"]["hidden_size"] == 2880  # the table itself is untouched


def test_gpt_oss_biases_are_on_and_random():
    module, K = experts._experts_module(experts.model_spec("gpt_oss_20b", 16, 8, 4, 2), torch.float32,
                                        torch.device("cpu"))
    assert module.has_bias and K == 2
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        b = getattr(module, name)
        assert b.abs().min() > 0 and 0.3 < b.std().item() < 0.7, name  # N(0, BIAS_STD = 0.5)


def test_markdown_ratios_against_grouped_mm():
    meta = dict(device="dev", tokens=64, dtype="bfloat16", iters=2, warmup=1, command="cmd", versions="v")
    rows = [dict(model="m", D=8, F=4, E=2, K=1, impl="grouped_mm", fwd_ms=1.0, bwd_ms=3.0, ms=4.0, extra_peak_gib=1.0),
            dict(model="m", D=8, F=4, E=2, K=1, impl="expertact", fwd_ms=0.5, bwd_ms=1.5, ms=2.0, extra_peak_gib=0.5,
                 y_rel=1e-3, grad_rel_max=2e-3, finite=True),
            dict(model="m", D=8, F=4, E=2, K=1, impl="expertact_inplace", error="skipped: no biases", skipped=True)]
    md = experts.markdown(meta, rows)
    assert "| m | 8 | 4 | 2 | 1 | grouped_mm | 1.00 | 3.00 | 4.00 | 1.00x | 1.00 | ref | ref |" in md
    assert "| m | 8 | 4 | 2 | 1 | expertact | 0.50 | 1.50 | 2.00 | 2.00x | 0.50 | 1.0e-03 | 2.0e-03 |" in md
    assert "| m | 8 | 4 | 2 | 1 | expertact_inplace | skipped: no biases |" in md


def _row(model, impl, ms, peak):
    return dict(model=model, impl=impl, ms=ms, extra_peak_gib=peak)


def test_targets_speedup_and_peak():
    rows = [_row("gpt_oss_20b", "grouped_mm", 60.0, 8.0), _row("gpt_oss_20b", "expertact", 39.0, 6.0),
            _row("gpt_oss_20b", "expertact_inplace", 41.0, 5.0),
            _row("qwen3_30b_a3b", "grouped_mm", 33.0, 6.0), _row("qwen3_30b_a3b", "expertact", 25.0, 5.0),
            dict(model="qwen3_30b_a3b", impl="expertact_inplace", error="OOM")]
    got = [(t.split(" ")[0] + " " + t.split(" ")[1].rstrip(":"), ok) for t, ok in experts.targets(rows)]
    # 60/39 = 1.54x >= 1.5; 60/41 = 1.46x < 1.5; 33/25 = 1.32x >= 1.3; an errored row fails
    assert got == [("gpt_oss_20b expertact", True), ("gpt_oss_20b expertact_inplace", False),
                   ("qwen3_30b_a3b expertact", True), ("qwen3_30b_a3b expertact_inplace", False)]
    rows[1]["extra_peak_gib"] = 8.5  # faster, but more extra peak than grouped_mm
    assert experts.targets(rows)[0][1] is False
    # at another shape than the model's: measured only
    assert all(ok is None for _, ok in experts.targets(rows, overridden=("gpt_oss_20b", "qwen3_30b_a3b")))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_small_table_on_the_cpu(tmp_path):
    """Both models at a small shape on the CPU (float32): grouped_mm and expertact against eager,
    GPT-OSS with its biases, whose gradients are among those compared."""
    js, md = tmp_path / "e.json", tmp_path / "e.md"
    rc = experts.main(["--device", "cpu", "--tokens", "48", "--iters", "1", "--warmup", "0", *SMALL,
                       "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    data = json.loads(js.read_text())
    rows = {(r["model"], r["impl"]): r for r in data["rows"]}
    assert list(rows) == [(m, i) for m in experts.MODELS for i in experts.IMPLS]
    assert data["meta"]["dtype"] == "float32" and data["meta"]["timer"] == "time.perf_counter"
    for (model, impl), r in rows.items():
        assert (r["D"], r["F"], r["E"], r["K"]) == (64, 32, 8, 2)
        assert "error" not in r, r  # GPT-OSS's expertact rows with their biases too
        if impl != "eager":
            assert r["finite"] and "missing_grads" not in r, r
            # float32, against eager's loop: summation order only
            assert r["y_rel"] < 1e-5 and r["grad_rel_max"] < 1e-5, r
    assert all(t["passed"] is None for t in data["targets"])  # another shape than the models': measured
    assert "GPT-OSS's experts with their biases" in md.read_text()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_grouped_mm_gets_the_bias_gradients():
    """The reference has the biases' gradients: an implementation without them fails the check."""
    spec = experts.model_spec("gpt_oss_20b", 32, 16, 4, 2)
    module, K = experts._experts_module(spec, torch.float32, torch.device("cpu"))
    dev = torch.device("cpu")
    _, y_ref, g_ref = experts.measure_impl(module, "eager", 16, K, torch.float32, dev, 1, 0, None)
    assert {"gate_up_proj_bias", "down_proj_bias"} <= set(g_ref)
    row, _, _ = experts.measure_impl(module, "grouped_mm", 16, K, torch.float32, dev, 1, 0, (y_ref, g_ref))
    assert row["y_rel"] < 1e-5 and row["grad_rel_max"] < 1e-5 and "missing_grads" not in row
    module.down_proj_bias.requires_grad_(False)  # as an implementation that leaves b2 out of the graph
    row, _, _ = experts.measure_impl(module, "grouped_mm", 16, K, torch.float32, dev, 1, 0, (y_ref, g_ref))
    assert row["missing_grads"] == ["down_proj_bias"] and row["grad_rel_max"] == float("inf")


@requires_cuda
def test_small_table_on_the_gpu(tmp_path):
    js = tmp_path / "e.json"
    rc = experts.main(["--tokens", "512", "--iters", "2", "--warmup", "1", "--json", str(js)])
    assert rc == 0
    rows = json.loads(js.read_text())["rows"]
    assert [(r["model"], r["impl"]) for r in rows] == [(m, i) for m in experts.MODELS for i in experts.IMPLS]
    for r in rows:
        if r["impl"] == "eager":
            continue
        assert "error" not in r, r
        assert r["finite"] and "missing_grads" not in r, r
        # bf16 storage; the implementations differ in summation order and in where the routing
        # weight multiplies (h or y): a few bf16 ulps, far below a wrong gate's error
        assert r["y_rel"] < 2e-2 and r["grad_rel_max"] < 5e-2, r
