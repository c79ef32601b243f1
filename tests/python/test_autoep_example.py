"""examples/autoep_train.py and examples/autoep_report.py on the CPU: the data and call-counting
helpers, the report on made-up runs (in a temp dir), and a 2-rank AutoEP smoke run (gloo, tiny
model, 2 steps) when DeepSpeed >= 0.19.8 and transformers >= 5.15 are installed.
"""
import copy
import dataclasses
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


train = _load("autoep_train")
report = _load("autoep_report")


# ---------------------------------------------------------------------------
# helpers of autoep_train.py
# ---------------------------------------------------------------------------

def test_batches_are_a_function_of_seed_and_step_and_split_by_rank():
    corpus = torch.arange(10_000, dtype=torch.int64) % 251
    full = [train.make_batch(corpus, 3, 7, r, 2, 4, 16) for r in range(2)]
    assert all(b.shape == (4, 16) and b.dtype == torch.int64 for b in full)
    again = train.make_batch(corpus, 3, 7, 1, 2, 4, 16)
    assert torch.equal(again, full[1])
    assert not torch.equal(full[0], full[1])
    assert not torch.equal(train.make_batch(corpus, 4, 7, 0, 2, 4, 16), full[0])
    # Each row is a contiguous window of the corpus.
    for b in full:
        assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(4, 15, dtype=torch.int64).masked_fill(b[:, 1:] == 0, -250))


def test_corpus_is_the_stdlib_sources():
    corpus, info = train.load_corpus()
    assert corpus.dtype == torch.uint8 and corpus.numel() == info["bytes"] > 1_000_000
    assert info["files"] > 100 and len(info["sha256"]) == 64
    assert b"def " in bytes(corpus[:200_000].tolist())


def test_count_calls_counts_and_puts_the_same_entry_back():
    @dataclasses.dataclass(frozen=True)
    class Entry:
        fn: object
        fused_fn: object = None
        packed_fused_fn: object = None

    entry = Entry(fn=lambda g, u, a, l: g * u, packed_fused_fn=lambda gu, a, l: gu)
    reg = {"swiglu_oai": entry}
    counts, restore = train.count_calls(reg, "swiglu_oai")
    assert reg["swiglu_oai"] is not entry and reg["swiglu_oai"].fused_fn is None
    assert reg["swiglu_oai"].fn(2, 3, 1.7, 7.0) == 6
    reg["swiglu_oai"].packed_fused_fn(5, 1.7, 7.0)
    reg["swiglu_oai"].packed_fused_fn(5, 1.7, 7.0)
    assert counts == {"fn": 1, "fused_fn": 0, "packed_fused_fn": 2}
    restore()
    assert reg["swiglu_oai"] is entry
    assert train.expected_calls("eager", "separate", 4) == {"fn": 4, "fused_fn": 0, "packed_fused_fn": 0}
    assert train.expected_calls("eager-fused", "fused", 4) == {"fn": 4, "fused_fn": 0, "packed_fused_fn": 0}
    assert train.expected_calls("expertact", "fused", 4) == {"fn": 0, "fused_fn": 0, "packed_fused_fn": 4}
    assert train.expected_calls("expertact-inplace", "separate", 2) == {"fn": 0, "fused_fn": 2, "packed_fused_fn": 0}


def test_args_presets_and_overrides():
    a = train.parse_args(["--impl", "expertact", "--config", "large", "--micro-batch", "8", "--lr", "3e-4"])
    assert a.sizes["micro_batch"] == 8 and a.sizes["lr"] == 3e-4 and a.sizes["ffn"] == 3072
    assert a.tag == "large-expertact"
    cfg = train.ds_config(a)
    assert cfg["expert_parallel"]["preset_model"] == "minimax_m3" and cfg["expert_parallel"]["comm_backend"] == "comm"
    assert cfg["expert_parallel"]["gate_up_impl"] == "separate"  # AutoEP's default
    assert cfg["bf16"] == {"enabled": True} and cfg["train_micro_batch_size_per_gpu"] == 8
    with pytest.raises(SystemExit):
        train.parse_args(["--impl", "expertact", "--steps", "3", "--warmup", "3"])


def test_gate_up_impl_default_and_the_fused_run_named():
    """AutoEP's default gate_up_impl ("separate", read from the installed DeepSpeed where there is
    one) for every run but eager-fused; a run on another than its name says is tagged so."""
    a = train.parse_args(["--impl", "eager,eager-repeat,eager-fused,mlp-fp8", "--config", "h200"])
    assert a.gate_up_impl == train.DEFAULT_GATE_UP == "separate"
    assert [train.gate_up_of(a, i) for i in a.impls] == ["separate", "separate", "fused", "separate"]
    assert [train.default_tag(a, i) for i in a.impls] == ["h200-eager", "h200-eager-repeat", "h200-eager-fused",
                                                         "h200-mlp-fp8"]
    a.impl = "eager-fused"
    assert train.ds_config(a)["expert_parallel"]["gate_up_impl"] == "fused"
    a = train.parse_args(["--impl", "expertact", "--gate-up-impl", "fused"])
    assert a.tag == "small-expertact-fused" and train.ds_config(a)["expert_parallel"]["gate_up_impl"] == "fused"
    try:
        from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    except ImportError:
        return
    assert parse_autoep_config({"enabled": True}).gate_up_impl == train.DEFAULT_GATE_UP


# ---------------------------------------------------------------------------
# autoep_report.py on made-up runs
# ---------------------------------------------------------------------------

def _fake_run(config, impl, gate_up="separate", steps=200, shift=0.0, peak_gib=(10.0, 11.0), ms=50.0, tag=None):
    """A made-up result in autoep_train.py's format (for the report's test only)."""
    loss = [5.5 * math.exp(-i / 60) + 1.2 + shift * math.sin(i) for i in range(steps)]
    return dict(
        tag=tag or f"{config}-{impl}", impl=impl, config=config,
        sizes=dict(train.CONFIGS["small"], steps=steps), seed=1, zero_stage=1, dtype="bf16", gate_up_impl=gate_up,
        world_size=2, ep_size=2, experts_per_rank=[[0, 1, 2, 3], [4, 5, 6, 7]],
        activation=dict(name="swiglu_oai", alpha=1.702, limit=7.0), expert_gemm="grouped_mm",
        registry_deepspeed=dict(fn="ds._swiglu_oai", fused_fn=None, packed_fused_fn=None),
        registry_in_use=dict(fn="ds._swiglu_oai", fused_fn=None if impl.startswith("eager") else "x.fused",
                             packed_fused_fn=None if impl.startswith("eager") else "x.packed"),
        step0_calls=train.expected_calls(impl, gate_up, 4), optimizer="DeepSpeedZeroOptimizer",
        ds_config=dict(expert_parallel=dict(preset_model="minimax_m3", autoep_size=2, comm_backend="comm")),
        model_config=dict(model_type="minimax_m3_vl_text", vocab_size=256, hidden_size=512, intermediate_size=1024,
                          shared_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64, rotary_dim=32, num_local_experts=8,
                          num_experts_per_tok=2, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0),
        params_before_autoep=1000, params_per_rank_after_autoep=700, tokens_per_rank_per_step=8192,
        corpus=dict(root="/x", files=3, bytes=100, sha256="0" * 64), loss=loss, step_time_s=[ms / 1e3] * steps,
        mean_step_time_s=ms / 1e3, peak_allocated_bytes_per_rank=[int(g * 2**30) for g in peak_gib],
        busiest_rank_rows_per_step=[9000 + i for i in range(steps)], timed_from_step=10,
        versions=dict(python="3.12", torch="2.11", deepspeed="0.19.8", transformers="5.17", expertact="0.1.0",
                      expertact_cuda=True, device="FAKE GPU", cuda="13.0", nccl="2.27", device_count=2,
                      platform="test"),
        command=f"torchrun --nproc_per_node 2 examples/autoep_train.py --impl {impl} --config {config}",
        env={}, date="2000-01-01T00:00:00Z")


def _report_runs():
    return [_fake_run("small", "eager"), _fake_run("small", "expertact", shift=0.01, peak_gib=(8.0, 9.0), ms=45),
            _fake_run("small", "expertact-inplace", shift=0.02, peak_gib=(7.0, 8.25)),
            _fake_run("small", "eager-fused", gate_up="fused", shift=0.015, ms=55),
            _fake_run("small", "eager-repeat", shift=0.001),
            _fake_run("large", "eager", steps=20, peak_gib=(50.0, 60.0), ms=400),
            _fake_run("large", "expertact", steps=20, shift=0.001, peak_gib=(40.0, 45.0), ms=380),
            # an older file: DeepSpeed on gate_up fused under the impl name eager, and its repeat
            _fake_run("large", "eager", gate_up="fused", steps=20, ms=420, tag="large-eager-old"),
            _fake_run("large", "eager", gate_up="fused", steps=20, ms=420, tag="large-eager-old-repeat")]


def test_report_table_against_deepspeeds_default():
    """Every difference is against DeepSpeed's default run (eager, gate_up separate); the repeat and
    the fused run are yardsticks, older files' fused eager runs too."""
    runs = _report_runs()
    groups = report.by_config(runs)
    assert [report.label(r) for r in groups["small"]] == [
        "DeepSpeed, gate_up separate (AutoEP's default)", "DeepSpeed, gate_up separate (AutoEP's default), repeat "
        "(yardstick)", "DeepSpeed, gate_up fused (yardstick)", "expertact", "expertact, in-place backward"]
    assert report.baseline_of(groups["large"])["tag"] == "large-eager"
    assert [report.label(r) for r in groups["large"]][1:] == [
        "DeepSpeed, gate_up fused (yardstick)", "DeepSpeed, gate_up fused, repeat (yardstick)", "expertact"]
    rows = {line.split(" | ")[1]: line for line in report.table(groups).splitlines() if line.startswith("| small |")}
    # max |sin| over integer steps < 200 is sin(11) ~ 0.99999: 0.02 * that
    assert "| 0.02000 (11) |" in rows["expertact, in-place backward"]
    assert "| 45.0 | 364,089 | -10.0% | 8.00 / 9.00 | -18.2% |" in rows["expertact"]
    assert "| 55.0 | 297,891 | +10.0% |" in rows["DeepSpeed, gate_up fused (yardstick)"]
    assert "| 7.00 / 8.25 | -25.0% |" in rows["expertact, in-place backward"]
    assert "9,100 / 9,199" in rows["DeepSpeed, gate_up separate (AutoEP's default)"]
    # the mean loss of the last 50 steps and its difference from the default's
    base, ours = runs[0]["loss"][-50:], runs[1]["loss"][-50:]
    want = f"| {sum(ours) / 50:.4f} (last 50) {sum(ours) / 50 - sum(base) / 50:+.4f} |"
    assert want in rows["expertact"]
    large = [line for line in report.table(groups).splitlines() if line.startswith("| large |")]
    assert len(large) == 4 and "| 40.00 / 45.00 | -25.0% |" in large[3] and "(last 5)" in large[0]


def test_report_on_made_up_runs(tmp_path):
    pytest.importorskip("matplotlib")
    for r in _report_runs():
        (tmp_path / f"{r['tag']}.json").write_text(json.dumps(r))
    (tmp_path / "unrelated.json").write_text("{}")
    md, png = tmp_path / "doc" / "e2e.md", tmp_path / "doc" / "e2e.png"
    report.main(["--in", str(tmp_path), "--md", str(md), "--png", str(png)])
    text = md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "![loss curves and peak memory](e2e.png)" in text
    assert report.table(report.by_config(report.load([str(tmp_path)]))) in text


# ---------------------------------------------------------------------------
# the 2-rank CPU smoke run
# ---------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _needs_autoep():
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version
    if Version(transformers.__version__) < Version("5.15"):
        pytest.skip(f"the minimax_m3 AutoEP preset needs transformers >= 5.15 (have {transformers.__version__})")
    try:
        from deepspeed.module_inject.auto_ep_presets.registry import available_preset_names
    except ImportError:
        pytest.skip("this DeepSpeed has no AutoEP (needs >= 0.19.8)")
    if "minimax_m3" not in available_preset_names():
        pytest.skip("this DeepSpeed has no minimax_m3 AutoEP preset")


def _torchrun(tmp_path, *args):
    """examples/autoep_train.py on 2 gloo ranks, tiny model, float32 on the CPU, 3 steps."""
    # A CPU run on any machine: no GPU visible, and DeepSpeed told so (a DS_ACCELERATOR=cuda
    # inherited from a GPU machine's environment would make it look for cuda:0).
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(Path(__file__).parent / "support" / "autoep_launch.py"), str(EXAMPLES / "autoep_train.py"),
           "--config", "tiny", "--steps", "3", "--dtype", "fp32", "--device", "cpu", "--record-grads",
           "--out", str(tmp_path), *args]
    p = subprocess.run(cmd, cwd="/tmp", env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]


def _same_training(tmp_path, ref, got, rank):
    """Losses, every gradient at every step and the parameters after the last step of two runs
    (their .pt files) equal within float32 rounding. Measured: losses bit-equal, gradients within
    7e-7 of their largest value, parameters within 3e-8 after 3 AdamW steps."""
    a = torch.load(tmp_path / f"{ref}.rank{rank}.pt")
    b = torch.load(tmp_path / f"{got}.rank{rank}.pt")
    torch.testing.assert_close(torch.tensor(b["loss"]), torch.tensor(a["loss"]), rtol=1e-6, atol=0)
    assert len(a["grads"]) == len(b["grads"]) == 3
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        assert ga.keys() == gb.keys(), (step, sorted(set(ga) ^ set(gb)))
        for name, want in ga.items():
            scale = want.abs().max().item()
            err = (gb[name] - want).abs().max().item()
            assert torch.isfinite(gb[name]).all() and err <= 1e-5 * scale, (got, step, name, err, scale)
    for name, want in a["params"].items():
        torch.testing.assert_close(b["params"][name], want, rtol=0, atol=1e-6)
    return a["grads"][0]


def test_two_rank_autoep_whole_mlp_on_cpu(tmp_path):
    """Tiny MiniMax-M3 model, AutoEP over 2 gloo ranks (ZeRO 1, AdamW, gradient clipping), float32:
    DeepSpeed's own expert path (AutoEP's default gate_up_impl "separate", and "fused"), expertact's
    activation in its registry (in place, on the default path), and expertact's whole expert MLP
    (enable(experts=True)) in every memory mode give the same losses, gradients and parameters.
    torch._grouped_mm runs on the CPU in torch >= 2.9, so DeepSpeed's own runs take its grouped_mm
    path. About 45 s on a shared 2-core machine."""
    _needs_autoep()
    impls = ("eager", "eager-fused", "expertact-inplace", "mlp", "mlp-recompute", "mlp-inplace",
             "mlp-recompute-inplace")
    t = time.perf_counter()
    _torchrun(tmp_path, "--impl", ",".join(impls))
    for impl in impls:
        res = json.loads((tmp_path / f"tiny-{impl}.json").read_text())
        s = res["sizes"]
        assert len(res["loss"]) == 3 and all(4.0 < x < 7.0 for x in res["loss"])  # ln 256 = 5.55 at random init
        assert res["gate_up_impl"] == ("fused" if impl == "eager-fused" else "separate")
        assert res["step0_calls"] == train.expected_calls(impl, res["gate_up_impl"], s["layers"])
        assert res["activation"] == {"name": "swiglu_oai", "alpha": 1.702, "limit": 7.0}
        assert res["expert_gemm"] == "grouped_mm" and res["experts_per_rank"] == [[0, 1], [2, 3]]
        assert res["expertact_enable"] == train.IMPLS[impl]
        whole = impl.startswith("mlp")
        assert res["experts_forward"] == ("expertact.deepspeed.expertact_grouped_experts_forward" if whole
                                          else "deepspeed.moe.ep_experts.GroupedExperts.forward")
        # Every routed row lands on exactly one rank: per layer, the ranks receive all of them.
        routed = res["world_size"] * res["tokens_per_rank_per_step"] * s["top_k"]
        for step_rows in res["rows_received_per_step"]:
            assert [sum(layer) for layer in step_rows] == [routed] * s["layers"]
        assert res["params_per_rank_after_autoep"] < res["params_before_autoep"]  # experts are sharded
    eager = json.loads((tmp_path / "tiny-eager.json").read_text())
    assert eager["step0_calls"] == {"fn": 2, "fused_fn": 0, "packed_fused_fn": 0}
    for rank in (0, 1):
        for impl in impls[1:]:
            grads = _same_training(tmp_path, "tiny-eager", f"tiny-{impl}", rank)
        experts = sorted(n for n in grads if ".experts.w" in n)
        assert len(experts) == 2 * 3 and all(grads[n].abs().max() > 0 for n in experts)
    print(f"2-rank CPU AutoEP, {len(impls)} runs: {time.perf_counter() - t:.1f} s")


def test_two_rank_autoep_whole_mlp_zero2_for_loop_on_cpu(tmp_path):
    """The same check on DeepSpeed's other expert path and ZeRO stage: its for-loop (use_grouped_mm
    false) with gate_up_impl separate, ZeRO stage 2; expertact's whole MLP in place."""
    _needs_autoep()
    _torchrun(tmp_path, "--impl", "eager,mlp-inplace", "--zero-stage", "2", "--expert-gemm", "for-loop",
              "--gate-up-impl", "separate")
    for impl in ("eager", "mlp-inplace"):
        res = json.loads((tmp_path / f"tiny-{impl}.json").read_text())
        assert res["expert_gemm"] == "for-loop" and res["gate_up_impl"] == "separate" and res["zero_stage"] == 2
    for rank in (0, 1):
        _same_training(tmp_path, "tiny-eager", "tiny-mlp-inplace", rank)


# ---------------------------------------------------------------------------
# the FP8 diagnosis's runs, the capture and the larger corpus (examples/autoep_fp8.py)
# ---------------------------------------------------------------------------

def test_corpus_stdlib_and_packages():
    """The larger corpus: the standard library first, then the packages' sources, cut at CAP; the
    same bytes (sha256) on every load; large enough that 1,000 steps of 65,536 tokens read it at
    most twice."""
    small, info_small = train.load_corpus("stdlib")
    big, info = train.load_corpus("stdlib+packages")
    assert info["name"] == "stdlib+packages" and info["cap"] == 128 << 20 and info_small["name"] == "stdlib"
    assert info["bytes"] == big.numel() >= 1000 * 65536 / 2 and info["files"] > info_small["files"]
    assert info["bytes"] <= info["cap"] + (50 << 20)  # cut at the first file past the cap
    assert torch.equal(big[:small.numel()], small)
    _, again = train.load_corpus("stdlib+packages")
    assert again == info
    with pytest.raises(ValueError, match="not one of"):
        train.load_corpus("everything")
    a = train.parse_args(["--impl", "eager", "--corpus", "stdlib+packages"])
    assert a.corpus == "stdlib+packages"


def test_fp8_runs_refused_where_this_expertact_lacks_them():
    """Each FP8 recipe's run is one IMPLS entry; it is refused, naming what is missing, exactly when
    this expertact's enable() lacks an argument it passes or its recipe is not in FP8_RECIPES."""
    import inspect
    import expertact.deepspeed as xds
    from expertact import moe
    diag = train.autoep_fp8
    args = train.parse_args(["--impl", ",".join(diag.FP8_IMPLS), "--config", "h200"])
    takes = set(inspect.signature(xds.enable).parameters)
    for impl, enabled in diag.FP8_IMPLS.items():
        assert train.IMPLS[impl] == enabled and enabled["experts"] is True
        why = diag.unavailable(enabled, impl, torch.device("cpu"), args)
        lacks = sorted(set(enabled) - takes)
        if lacks:
            assert why is not None and all(k in why for k in lacks), why
        elif enabled["fp8"] not in moe.FP8_RECIPES:
            assert why is not None and repr(enabled["fp8"]) in why, why
        else:
            assert why is None
    assert diag.unavailable(None, "eager", torch.device("cpu"), args) is None
    assert diag.unavailable(train.IMPLS["mlp-fp8"], "mlp-fp8", torch.device("cpu"), args) is None


def test_torchao_run_refused_off_hopper(monkeypatch):
    """torchao's run needs torchao 0.18, a Hopper GPU, and DeepSpeed's torch._grouped_mm path with
    gate_up separate (the GEMMs its conversion reaches); each refusal says which."""
    diag = train.autoep_fp8
    cpu = torch.device("cpu")
    args = train.parse_args(["--impl", "torchao-fp8", "--config", "h200"])
    assert train.IMPLS["torchao-fp8"] is None  # DeepSpeed's own experts: enable() is not called
    assert train.expected_calls("torchao-fp8", "separate", 2) == train.expected_calls("eager", "separate", 2)
    try:
        import torchao
    except ImportError:
        assert "not importable" in diag.unavailable(None, "torchao-fp8", cpu, args)
    else:
        if not torchao.__version__.startswith(diag.TORCHAO_VERSION):
            pytest.skip(f"torchao {torchao.__version__} is not {diag.TORCHAO_VERSION}x")
        assert "Hopper" in diag.unavailable(None, "torchao-fp8", cpu, args)
        fused = train.parse_args(["--impl", "torchao-fp8", "--gate-up-impl", "fused"])
        assert "separate" in diag.unavailable(None, "torchao-fp8", cpu, fused)
        loop = train.parse_args(["--impl", "torchao-fp8", "--expert-gemm", "for-loop"])
        assert "grouped_mm" in diag.unavailable(None, "torchao-fp8", cpu, loop)
    monkeypatch.setitem(sys.modules, "torchao", None)
    assert "not importable" in diag.unavailable(None, "torchao-fp8", cpu, args)


def test_capture_of_the_first_moe_layer_on_cpu(tmp_path):
    """--capture-step 1: each rank's file holds its first MoE layer's expert inputs in expert_mlp's
    form, and expert_mlp on them gives the experts' captured output; dy is the gradient of that
    output (finite, not all zero); the record points to the file."""
    _needs_autoep()
    from expertact.moe import expert_mlp
    _torchrun(tmp_path, "--impl", "eager", "--capture-step", "1")
    res = json.loads((tmp_path / "tiny-eager.json").read_text())
    s = res["sizes"]
    D, F = s["hidden"], s["ffn"]
    E = len(res["experts_per_rank"][0])
    assert res["capture"]["step"] == 1 and res["capture"]["path"] == str(tmp_path / "tiny-eager.capture.pt")
    for rank, name in ((0, "tiny-eager.capture.pt"), (1, "tiny-eager.capture.rank1.pt")):
        c = torch.load(tmp_path / name)
        assert (c["step"], c["rank"], c["impl"], c["layout"], c["weights"]) == (1, rank, "eager", "halves", None)
        assert c["activation"] == {"name": "swiglu_oai", "alpha": 1.702, "limit": 7.0}
        T = c["x"].shape[0]
        assert c["x"].shape == c["y"].shape == c["dy"].shape == (T, D)
        assert c["w13"].shape == (E, D, 2 * F) and c["w2"].shape == (E, F, D)
        assert c["offsets"].dtype == torch.int32 and c["offsets"].shape == (E,)
        end = int(c["offsets"][-1])
        # the rows this rank's experts received in the first layer at step 1, each expert's padded by
        # AutoEP to a multiple of 8 (deepspeed.moe.ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M) with zero rows
        got = res["rows_received_per_step"][1][0][rank]
        assert got <= end < got + 8 * E and end <= T
        counts = torch.diff(c["offsets"], prepend=c["offsets"].new_zeros(1))
        assert (counts % 8 == 0).all()
        y = expert_mlp(c["x"], c["w13"], c["w2"], c["offsets"], "swiglu_oai", alpha=1.702, limit=7.0,
                       layout="halves")
        scale = c["y"][:end].abs().max()
        assert scale > 0 and (y[:end] - c["y"][:end]).abs().max() <= 1e-5 * scale
        assert torch.isfinite(c["dy"]).all() and c["dy"][:end].abs().max() > 0


def test_torchao_wiring_on_cpu(tmp_path):
    """torchao's conversion of AutoEP's expert weights, with its FP8 grouped GEMM replaced by the
    same torch._grouped_mm (tests/python/support/autoep_launch_torchao.py): every expert GEMM of
    DeepSpeed's forward goes through torchao's dispatch (3 per MoE layer and step), and the run
    trains exactly as DeepSpeed's own: the same losses, gradients and parameters after 3 steps
    (ZeRO's updates reach the weights torchao reads)."""
    _needs_autoep()
    pytest.importorskip("torchao")
    calls = tmp_path / "calls"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
               TORCHAO_CALLS=str(calls))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(Path(__file__).parent / "support" / "autoep_launch_torchao.py"), str(EXAMPLES / "autoep_train.py"),
           "--config", "tiny", "--steps", "3", "--dtype", "fp32", "--device", "cpu", "--record-grads",
           "--out", str(tmp_path), "--impl", "eager,torchao-fp8"]
    p = subprocess.run(cmd, cwd="/tmp", env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((tmp_path / "tiny-torchao-fp8.json").read_text())
    layers, E = res["sizes"]["layers"], len(res["experts_per_rank"][0])
    tao = res["torchao"]
    assert tao["version"].startswith(train.autoep_fp8.TORCHAO_VERSION) and "Float8TrainingOpConfig" in tao["config"]
    assert tao["converted"] == [f"model.layers.{i}.mlp.experts.{w}" for i in range(layers) for w in ("w1", "w2", "w3")]
    assert tao["step0_gemms"] == 3 * layers and res["step0_calls"] == train.expected_calls("eager", "separate", layers)
    for rank in (0, 1):
        got = json.loads(Path(f"{calls}.rank{rank}.json").read_text())
        assert len(got) == 3 * layers * 3 and all(b[0] == E for _, b in got)
        _same_training(tmp_path, "tiny-eager", "tiny-torchao-fp8", rank)
