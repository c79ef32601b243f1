"""The transformers-experts benchmark (python -m expertact.bench --experts): it refuses what it
cannot run, and on a GPU its table holds every implementation, checked against eager."""
import json

import pytest

from conftest import requires_cuda

transformers = pytest.importorskip("transformers")
from expertact.bench import experts  # noqa: E402


def test_refuses_a_cpu_device():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        experts.main(["--device", "cpu"])


@requires_cuda  # without a GPU the device check refuses first
def test_refuses_an_unknown_model():
    with pytest.raises(SystemExit, match="unknown model"):
        experts.main(["--models", "no_such_model", "--tokens", "8"])


def test_markdown_ratios_against_grouped_mm():
    meta = dict(device="dev", tokens=64, dtype="bfloat16", iters=2, warmup=1, command="cmd", versions="v")
    rows = [dict(model="m", D=8, F=4, E=2, K=1, impl="grouped_mm", fwd_ms=1.0, bwd_ms=3.0, ms=4.0, extra_peak_gib=1.0),
            dict(model="m", D=8, F=4, E=2, K=1, impl="expertact", fwd_ms=0.5, bwd_ms=1.5, ms=2.0, extra_peak_gib=0.5,
                 y_rel=1e-3, grad_rel_max=2e-3, finite=True)]
    md = experts.markdown(meta, rows)
    assert "| m | 8 | 4 | 2 | 1 | grouped_mm | 1.00 | 3.00 | 4.00 | 1.00x | 1.00 | ref | ref |" in md
    assert "| m | 8 | 4 | 2 | 1 | expertact | 0.50 | 1.50 | 2.00 | 2.00x | 0.50 | 1.0e-03 | 2.0e-03 |" in md


@requires_cuda
def test_small_table_on_the_gpu(tmp_path):
    js = tmp_path / "e.json"
    rc = experts.main(["--tokens", "512", "--models", "qwen3_30b_a3b", "--iters", "2", "--warmup", "1",
                       "--json", str(js)])
    assert rc == 0
    rows = json.loads(js.read_text())["rows"]
    assert [r["impl"] for r in rows] == list(experts.IMPLS)
    for r in rows[1:]:
        assert r["finite"], r
        # bf16 storage; the implementations differ in summation order and in where the routing
        # weight multiplies (h or y): a few bf16 ulps, far below a wrong gate's error
        assert r["y_rel"] < 2e-2 and r["grad_rel_max"] < 5e-2, r
