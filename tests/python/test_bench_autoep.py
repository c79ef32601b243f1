"""python -m expertact.bench --autoep on the CPU: DeepSpeed's GroupedExperts through its own forward,
with expertact's activation, and as expertact's whole expert MLP; every row measured, every error
column small against the float32 reference, DeepSpeed's forward back afterwards. Skips without
deepspeed."""
import json

import pytest

pytest.importorskip("deepspeed")
from deepspeed.moe import ep_experts  # noqa: E402

from expertact.bench import autoep, cli  # noqa: E402


def test_bench_autoep_cpu_table(tmp_path):
    """geglu_tanh and swiglu_oai: forms DeepSpeed has no Triton kernel for (its swiglu kernel is called
    on CPU tensors too wherever Triton is importable, and fails there)."""
    forward = ep_experts.GroupedExperts.forward
    js, md = tmp_path / "a.json", tmp_path / "a.md"
    rc = cli.main(["--autoep", "--device", "cpu", "--experts", "3", "--rows", "24", "--dim", "32", "--ffn", "48",
                   "--activations", "geglu_tanh,swiglu_oai", "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    assert ep_experts.GroupedExperts.forward is forward
    data = json.loads(js.read_text())
    assert data["meta"]["command"].startswith("python -m expertact.bench --autoep --device cpu")
    for act in ("geglu_tanh", "swiglu_oai"):
        res = {r["impl"]: r for r in data["tables"][act]["results"]}
        assert list(res) == list(autoep.IMPLS)
        assert res["mlp-fp8"].get("skipped") and "cannot run here" in res["mlp-fp8"]["error"]
        for impl, r in res.items():
            if impl == "mlp-fp8":
                continue
            assert "error" not in r and r["ms"] > 0, (impl, r)
            if impl != "w13-copy":  # float32 everywhere on the CPU: rounding-level differences only
                assert all(v is not None and v < 1e-5 for v in r["err"].values()), (impl, r["err"])
    text = md.read_text()
    assert "### swiglu_oai" in text and "| mlp-recompute-inplace |" in text


def test_bench_autoep_rejects_unknown_rows():
    with pytest.raises(SystemExit):
        autoep.main(["--device", "cpu", "--impls", "mlp,bogus"])
