"""python -m expertact.bench --autoep on the CPU: DeepSpeed's GroupedExperts through its own forward
(its default gate_up_impl "separate", its fused one, compiled), with expertact's activation, and as
expertact's whole expert MLP; every row measured, every error column small against the float32
reference, DeepSpeed's forward back afterwards. Skips without deepspeed."""
import json

import pytest
import torch

pytest.importorskip("deepspeed")
from deepspeed.moe import ep_experts  # noqa: E402

from expertact.bench import autoep, cli  # noqa: E402
from expertact.bench.common import clock_and_memory  # noqa: E402


def test_rows_run_on_deepspeeds_default_configuration():
    """AutoEP's default gate_up_impl, read from the installed DeepSpeed: every row but deepspeed-fused
    runs on it."""
    from deepspeed.module_inject import auto_ep_config
    default = auto_ep_config.parse_autoep_config({"enabled": True}).gate_up_impl
    assert default == autoep.DEFAULT_GATE_UP == "separate"
    assert {impl for impl, (gu, _) in autoep.ROWS.items() if gu != default} == {"deepspeed-fused"}
    assert autoep.ROWS["deepspeed"] == (default, None) and autoep.ROWS["deepspeed-compile"] == (default, None)


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
    skipped = {"mlp-fp8": "cannot run here", "mlp-fp8-bf16-wgrad": "cannot run here",
               "mlp-fp8-promoted-wgrad": "cannot run here", "mlp-fp8-blockwise": "cannot run here",
               "deepspeed-compile": "bf16 operands only"}
    for act in ("geglu_tanh", "swiglu_oai"):
        res = {r["impl"]: r for r in data["tables"][act]["results"]}
        assert list(res) == list(autoep.IMPLS)
        for impl, r in res.items():
            if impl in skipped:
                assert r.get("skipped") and skipped[impl] in r["error"], (impl, r)
                continue
            assert "error" not in r and r["ms"] > 0, (impl, r)
            if impl != "w13-copy":  # float32 everywhere on the CPU: rounding-level differences only
                assert all(v is not None and v < 1e-5 for v in r["err"].values()), (impl, r["err"])
    text = md.read_text()
    assert "### swiglu_oai" in text and "| mlp-recompute-inplace |" in text
    assert 'gate_up_impl "separate" (AutoEP\'s default' in text


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compile_row_in_bf16_on_the_cpu():
    """The deepspeed-compile row at the dtype it runs in on a GPU (bf16), on the CPU: it times a
    compiled module (dynamo compiled a frame before the timed steps, none during them), on
    DeepSpeed's default path, and its errors are bf16 rounding against the float32 reference, as
    DeepSpeed's own row's are."""
    from torch._dynamo.utils import counters
    import expertact.deepspeed as xds
    dev = torch.device("cpu")
    inp = autoep.ExpertsInputs(ep_experts.GroupedExperts, 3, 16, 32, 48, torch.bfloat16, dev)
    inp.module.activation = "swiglu_oai"
    ref = autoep.reference32(inp)
    clock, memory = clock_and_memory(dev)
    torch._dynamo.reset()
    counters.clear()
    ds = autoep._row("deepspeed", inp, "separate", None, xds, clock, memory, 1, 0, ref)
    assert not counters["stats"]["unique_graphs"]
    r = autoep._row("deepspeed-compile", inp, "separate", None, xds, clock, memory, 2, 0, ref)
    assert counters["stats"]["unique_graphs"] >= 1 and inp.module.gate_up_impl == "separate"
    for k in autoep.WHAT:
        assert r["err"][k] < max(3 * ds["err"][k], 2e-2), (k, r["err"], ds["err"])


def test_one_fp8_row_per_recipe():
    from expertact import moe
    assert [autoep.ROWS[row][1] for row in autoep.FP8_ROWS] == [dict(experts=True, fp8=r) for r in moe.FP8_RECIPES]
    assert list(autoep.FP8_ROWS) == ["mlp-fp8", "mlp-fp8-bf16-wgrad", "mlp-fp8-promoted-wgrad", "mlp-fp8-blockwise"]


@pytest.mark.parametrize("impl", ["mlp-fp8", "mlp-fp8-bf16-wgrad", "mlp-fp8-promoted-wgrad", "mlp-fp8-blockwise"])
def test_fp8_rows_in_bf16_on_the_cpu(impl):
    """The FP8 rows (skipped in the float32 CPU table) in bf16 on the CPU, where expert_mlp runs the
    recipe's emulation: each error against the float32 copy is FP8's rounding (measured 7.0e-2 to
    2.3e-1 on these steep swiglu_oai inputs), above the bf16 mlp row's (2.5e-3 to 5.8e-2)."""
    import expertact.deepspeed as xds
    dev = torch.device("cpu")
    inp = autoep.ExpertsInputs(ep_experts.GroupedExperts, 3, 16, 32, 48, torch.bfloat16, dev)
    inp.module.activation = "swiglu_oai"
    ref = autoep.reference32(inp)
    clock, memory = clock_and_memory(dev)
    rows = {i: autoep._row(i, inp, *autoep.ROWS[i], xds, clock, memory, 1, 0, ref) for i in ("mlp", impl)}
    for k in autoep.WHAT:
        assert rows["mlp"]["err"][k] < rows[impl]["err"][k] < 0.5, (k, rows[impl]["err"], rows["mlp"]["err"])
        assert rows[impl]["err"][k] > 2e-2, (k, rows[impl]["err"])


def test_bench_autoep_rejects_unknown_rows():
    with pytest.raises(SystemExit):
        autoep.main(["--device", "cpu", "--impls", "mlp,bogus"])
