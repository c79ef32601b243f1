"""examples/autoep_train.py and examples/autoep_report.py on the CPU: the data and call-counting
helpers, the report on made-up runs (in a temp dir), and a 2-rank AutoEP smoke run (gloo, tiny
model, 2 steps) when DeepSpeed >= 0.19.8 and transformers >= 5.15 are installed.
"""
import contextlib
import copy
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from support.examples import EXAMPLES, load

train = load("autoep_train")
report = load("autoep_report")


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


def test_a_failed_run_costs_one_rank_launch_only_itself(monkeypatch):
    """One rank: a run that raises is reported, expertact's switch turned off, and the launch's
    later runs still run; the launch then exits non-zero naming it. Several ranks: the error ends
    the launch at once (the other ranks would wait for this one in a collective)."""
    pytest.importorskip("deepspeed.moe.ep_experts")
    import expertact.deepspeed as xds

    ran, disabled = [], []

    def run_one(args, registry, device, rank, world):
        ran.append(args.impl)
        if args.impl == "eager-fused":
            raise RuntimeError("out of memory (made up)")

    monkeypatch.setattr(train, "run_one", run_one)
    monkeypatch.setattr(xds, "disable", lambda: disabled.append(len(ran)))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    argv = ["--impl", "eager,eager-fused,mlp-inplace", "--config", "tiny"]
    monkeypatch.setattr(train, "init_distributed", lambda args: (torch.device("cpu"), 0, 1))
    with pytest.raises(SystemExit, match=r"1 run\(s\) failed: eager-fused"):
        train.main(argv)
    assert ran == ["eager", "eager-fused", "mlp-inplace"] and disabled == [2]

    ran.clear()
    monkeypatch.setattr(train, "init_distributed", lambda args: (torch.device("cpu"), 0, 2))
    with pytest.raises(RuntimeError, match="made up"):
        train.main(argv)
    assert ran == ["eager", "eager-fused"]


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
    # a peak that holds an earlier run's memory says so; a few bytes alive at the start do not count
    runs[1]["tensor_bytes_alive_at_start_per_rank"] = [80, int(2.13 * 2**30)]
    runs[2]["tensor_bytes_alive_at_start_per_rank"] = [80, 80]
    rows = {line.split(" | ")[1]: line for line in report.table(report.by_config(runs)).splitlines()
            if line.startswith("| small |")}
    assert "| 8.00 / 9.00 (incl. 2.13 alive before the run) | -18.2% |" in rows["expertact"]
    assert "| 7.00 / 8.25 | -25.0% |" in rows["expertact, in-place backward"]


def test_report_loss_criterion():
    """docs/spec.md section 10: per 50-step window within max(2 x the largest yardstick difference,
    0.01), over the last 100 steps within max(the largest yardstick difference, 0.5% of the loss)."""
    base = [1.0] * 300  # 0.5% of the loss: 0.005

    def run(impl, shifts, tag=None):
        r = _fake_run("cpu-diag", impl, steps=300, tag=tag)
        r["loss"] = [b + shifts.get(i // 50, 0.0) for i, b in enumerate(base)]
        return r

    ref, repeat = run("eager", {}), run("eager-repeat", {})
    fused = run("eager-fused", {2: -0.008, 5: 0.001}, tag="cpu-diag-eager-fused")
    fused["gate_up_impl"] = "fused"
    inside = run("mlp", {0: 0.0099, 2: -0.0159, 4: 0.004, 5: 0.004})  # last 100: +0.004 <= 0.005
    late = run("mlp-fp8", {4: 0.008, 5: 0.008}, tag="late")  # windows pass, the last 100 do not
    early = run("mlp-fp8", {1: -0.0101}, tag="early")
    c = report.criterion(inside, ref, [repeat, fused])
    assert c["passed"] and c["bands"] == pytest.approx([0.01, 0.01, 0.016, 0.01, 0.01, 0.01])
    assert c["windows"] == pytest.approx([0.0099, 0, -0.0159, 0, 0.004, 0.004])
    assert c["last"] == pytest.approx(0.004) and c["band_last"] == pytest.approx(0.005)
    c = report.criterion(late, ref, [repeat, fused])
    assert all(c["windows_pass"]) and not c["last_pass"] and not c["passed"]
    c = report.criterion(early, ref, [repeat, fused])
    assert c["windows_pass"] == [True, False, True, True, True, True] and c["last_pass"] and not c["passed"]
    # a yardstick far off widens the last 100 steps' band to its difference
    assert report.criterion(late, ref, [run("eager-repeat", {5: 0.03}, tag="r2")])["passed"]
    rows = report.criterion_table(report.by_config([ref, repeat, fused, inside, late, early])).splitlines()
    assert len(rows) == 5 and rows[2].endswith("| PASS |") and "| +0.0099, +0.0000, -0.0159," in rows[2]
    assert rows[3].endswith("| FAIL (window 2) |") and rows[4].endswith("| FAIL (last 100) |")  # by tag
    assert report.criterion_table(report.by_config([ref, inside])) == ""  # no yardstick, no criterion


def test_report_lead_in_steps():
    """A run whose loss curve is the default's 20 steps sooner reaches each quarter's level 20
    steps sooner (the first quarter's level is the first 50-step mean, which every run has at its
    first); one 20 steps later, 20 later, and never the default's lowest; the yardstick's own."""
    def run(impl, lag, tag=None):
        r = _fake_run("cpu-diag", impl, steps=200, tag=tag)
        r["loss"] = [5.5 * math.exp(-(i - lag) / 60) + 1.2 for i in range(200)]
        return r

    ref, repeat = run("eager", 0), run("eager-repeat", 3)
    sooner, later = run("mlp-fp8", -20, tag="sooner"), run("mlp", 20, tag="later")
    assert [(s0, s) for _, s0, s in report.lead(sooner, ref)] == [(49, 49), (99, 79), (149, 129), (199, 179)]
    assert [s for _, _, s in report.lead(later, ref)] == [69, 119, 169, None]
    rows = report.lead_table(report.by_config([ref, repeat, sooner, later])).splitlines()
    assert rows[0].startswith("| config | run | by 1/4 of the default's steps |") and len(rows) == 5
    cells = {row.split(" | ")[1]: [c.split(": ")[1] for c in row.strip(" |").split(" | ")[2:]] for row in rows[2:]}
    assert cells[report.label(sooner)] == ["+0", "-20", "-20", "-20"]
    assert cells[report.label(later)] == ["+20", "+20", "+20", "never"]
    assert cells[report.label(repeat)] == ["+3", "+3", "+3", "never"]
    assert report.lead_table(report.by_config([sooner, later])) == ""  # no baseline


def test_report_across_seeds(tmp_path):
    """Runs of one config with several seeds: one group per seed, each against its own baseline and
    yardsticks; the table across seeds gives each run's criterion per seed, its windows below and
    above the baseline, and the mean of its last-100 differences; the same tags in two folders of
    different seeds are not duplicates."""
    base = [1.0] * 300

    def run(impl, seed, shift, tag=None):
        r = _fake_run("cpu-diag", impl, steps=300, tag=tag)
        r["seed"], r["loss"] = seed, [b + shift for b in base]
        return r

    runs = []
    for seed, fp8 in ((1, -0.003), (2, +0.002), (3, -0.02)):
        fused = run("eager-fused", seed, 0.004, tag="cpu-diag-eager-fused")
        fused["gate_up_impl"] = "fused"
        mlp = run("mlp-inplace", seed, 0.001)
        mlp["mean_step_time_s"] = 0.100
        promoted = run("mlp-fp8-promoted-wgrad", seed, 0.002)  # inside, 1.05x but 1.04x in seed 2
        promoted["mean_step_time_s"] = 0.100 / (1.04 if seed == 2 else 1.05)
        bf16_wgrad = run("mlp-fp8-bf16-wgrad", seed, -0.001)  # inside and 1.10x in every seed
        bf16_wgrad["mean_step_time_s"] = 0.100 / 1.10
        rowwise = run("mlp-fp8", seed, fp8)
        rowwise["mean_step_time_s"] = 0.080
        runs += [run("eager", seed, 0.0), run("eager-repeat", seed, 0.001), fused, mlp, rowwise, promoted, bf16_wgrad]
    groups = report.by_config(runs)
    assert list(groups) == ["cpu-diag, seed 1", "cpu-diag, seed 2", "cpu-diag, seed 3"]
    assert all(report.baseline_of(g)["seed"] == int(k[-1]) for k, g in groups.items())
    rows = {r.split(" | ")[1]: r for r in report.seed_table(groups).splitlines()[2:]}
    assert len(rows) == 4, rows
    assert rows["expertact MLP, FP8 rowwise"] == (
        "| cpu-diag | expertact MLP, FP8 rowwise | 3 | seed 1: -0.0030 / 0.0050 PASS; seed 2: +0.0020 / 0.0050 PASS; "
        "seed 3: -0.0200 / 0.0050 FAIL | 12 / 6 | -0.0070 | 2 of 3 | 1.25x, 1.25x, 1.25x | not met (seed 3: "
        "criterion) |")
    assert rows["expertact MLP, FP8 rowwise-promoted-wgrad"].endswith(
        "| 3 of 3 | 1.05x, 1.04x, 1.05x | not met (seed 2: 1.040x) |")
    assert rows["expertact MLP, FP8 rowwise-bf16-wgrad"].endswith("| 3 of 3 | 1.10x, 1.10x, 1.10x | met |")
    assert rows["expertact MLP, in place"].endswith("| 3 of 3 | — | — |")  # not FP8: no rule
    assert report.seed_table(report.by_config([r for r in runs if r["seed"] == 1])) == ""  # one seed: no table
    for seed in (1, 2, 3):
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        for r in runs:
            if r["seed"] == seed:
                (d / f"{r['tag']}.json").write_text(json.dumps(r))
    pytest.importorskip("matplotlib")  # main() draws the plot too
    md = tmp_path / "r.md"
    report.main(["--in", *(str(tmp_path / f"seed{s}") for s in (1, 2, 3)), "--md", str(md),
                 "--png", str(tmp_path / "r.png")])
    text = md.read_text()
    assert "Across the seeds" in text and "| 12 / 6 | -0.0070 | 2 of 3 | 1.25x, 1.25x, 1.25x | not met" in text


def test_report_plot_of_cpu_runs_draws_the_windows(tmp_path):
    """Without CUDA memory (CPU runs) the third panel shows the criterion's windows and band."""
    pytest.importorskip("matplotlib")
    runs = [_fake_run("cpu-diag", "eager", steps=120), _fake_run("cpu-diag", "eager-repeat", steps=120, shift=0.002),
            _fake_run("cpu-diag", "mlp-fp8", steps=120, shift=0.01)]
    model = _fake_run("cpu-diag", "mlp-fp8", steps=120, shift=0.02, tag="cpu-diag-mlp-fp8-fastacc13-all")
    model["fp8_accumulation_model"] = dict(bits=13, chunk=32, kinds=["mm", "wgrad"], calls={"mm": 1, "wgrad": 1})
    runs.append(model)
    for r in runs:
        r["peak_allocated_bytes_per_rank"] = [None, None]
    assert report.label(model) == "expertact MLP, FP8 rowwise, fast-accumulation model 13 bits on all GEMMs"
    import matplotlib.pyplot as plt
    drawn = []
    real = plt.Figure.savefig

    def savefig(fig, *a, **k):
        drawn.append([ax.get_title() for ax in fig.axes])
        return real(fig, *a, **k)

    plt.Figure.savefig = savefig
    try:
        report.plot(runs, tmp_path / "cpu.png")
    finally:
        plt.Figure.savefig = real
    assert (tmp_path / "cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn[0][2] == "Mean loss minus the default's, per 50-step window"


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


def _torchrun(tmp_path, *args, script="autoep_train.py", script_args=()):
    """examples/autoep_train.py (or `script` with its `script_args` first) on 2 gloo ranks, tiny
    model, float32 on the CPU (a later --dtype wins), 3 steps."""
    # A CPU run on any machine: no GPU visible, and DeepSpeed told so (a DS_ACCELERATOR=cuda
    # inherited from a GPU machine's environment would make it look for cuda:0).
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(Path(__file__).parent / "support" / "autoep_launch.py"), str(EXAMPLES / script), *script_args,
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
    # Each run starts with what the first started with: no run keeps an earlier run's model and
    # optimizer alive (each would add 1.5 MB here, 2.1 GiB a run at config h200, to the peaks).
    for impl in impls:
        alive = json.loads((tmp_path / f"tiny-{impl}.json").read_text())["tensor_bytes_alive_at_start_per_rank"]
        assert alive == eager["tensor_bytes_alive_at_start_per_rank"], (impl, alive)
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
    DeepSpeed's forward goes through torchao's dispatch (3 per MoE layer and step) on token
    groups of multiples of 16 rows (torchao's FP8 GEMMs refuse others on the GPU), and the run
    trains exactly as DeepSpeed's own: the same losses, gradients and parameters after 3 steps
    (ZeRO's updates reach the weights torchao reads; the padding rows change nothing)."""
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
    assert tao["token_group_rows"] == 16
    for rank in (0, 1):
        got = json.loads(Path(f"{calls}.rank{rank}.json").read_text())
        assert len(got) == 3 * layers * 3 and all(b[0] == E for _, b, _ in got)
        assert all(len(rows) == E and all(n % 16 == 0 for n in rows) for _, _, rows in got)  # the stand-in's check
        assert any(sum(rows) for _, _, rows in got)
        _same_training(tmp_path, "tiny-eager", "tiny-torchao-fp8", rank)


def test_enable_passes_each_runs_recipe_to_the_expert_mlp():
    """Each FP8 run's enable() arguments (mlp-fp8 and autoep_fp8.FP8_IMPLS: one run per recipe of
    FP8_RECIPES) install a forward that hands that recipe to expert_mlp."""
    pytest.importorskip("deepspeed")
    from expertact import deepspeed as xds
    from expertact import moe
    runs = {"mlp-fp8": train.IMPLS["mlp-fp8"], **train.autoep_fp8.FP8_IMPLS}
    assert sorted(r["fp8"] for r in runs.values()) == sorted(moe.FP8_RECIPES)
    try:
        xds.enable(experts=True)
    except RuntimeError as e:  # a DeepSpeed without AutoEP's GroupedExperts
        pytest.skip(str(e))
    try:
        from deepspeed.moe import ep_experts
        for impl, enabled in runs.items():
            xds.enable(**enabled)
            assert ep_experts.GroupedExperts.forward.expertact_form["fp8"] == enabled["fp8"], impl
    finally:
        xds.disable()


def test_two_rank_autoep_fp8_runs_of_the_diagnosis_on_cpu(tmp_path):
    """The FP8 runs of the CPU diagnosis, tiny model in bf16 (the FP8 emulation takes bf16): mlp-fp8,
    mlp-fp8-bf16-wgrad, mlp-fp8-promoted-wgrad, mlp-fp8-blockwise and fp8_diagnosis.py's model of
    fast accumulation (4 bits, so that it shows in 3 steps). Step 0 starts from the same weights
    and batch, so its gradients say which GEMMs each run changed: bf16 weight gradients change
    the experts' gradients and nothing else; the promoted weight gradients nothing on the CPU
    (the emulation accumulates in float32 either way); the model on every GEMM changes the
    others too."""
    _needs_autoep()
    _torchrun(tmp_path, "--impl", "mlp-fp8,mlp-fp8-bf16-wgrad,mlp-fp8-promoted-wgrad,mlp-fp8-blockwise", "--dtype",
              "bf16")
    blockwise = json.loads((tmp_path / "tiny-mlp-fp8-blockwise.json").read_text())
    assert blockwise["expertact_enable"]["fp8"] == "blockwise"
    assert len(blockwise["loss"]) == 3 and all(4.0 < x < 7.0 for x in blockwise["loss"])
    _torchrun(tmp_path, "--impl", "mlp-fp8", "--dtype", "bf16", script="fp8_diagnosis.py",
              script_args=("--bits", "4", "--gemms", "all", "--"))
    runs = {tag: json.loads((tmp_path / f"{tag}.json").read_text())
            for tag in ("tiny-mlp-fp8", "tiny-mlp-fp8-bf16-wgrad", "tiny-mlp-fp8-fastacc4-all")}
    assert runs["tiny-mlp-fp8-bf16-wgrad"]["expertact_enable"] == dict(experts=True, fp8="rowwise-bf16-wgrad")
    promoted = json.loads((tmp_path / "tiny-mlp-fp8-promoted-wgrad.json").read_text())
    assert promoted["expertact_enable"] == dict(experts=True, fp8="rowwise-promoted-wgrad")
    assert promoted["loss"] == runs["tiny-mlp-fp8"]["loss"]
    model = runs["tiny-mlp-fp8-fastacc4-all"]["fp8_accumulation_model"]
    assert model["bits"] == 4 and model["chunk"] == 32 and model["kinds"] == ["mm", "wgrad"]
    # rank 0's calls: 3 steps x 2 layers x (4 M-grouped, 2 weight-gradient GEMMs)
    assert model["calls"] == {"mm": 24, "wgrad": 12}
    assert "fp8_accumulation_model" not in runs["tiny-mlp-fp8"]
    for res in runs.values():
        assert len(res["loss"]) == 3 and all(4.0 < x < 7.0 for x in res["loss"])
    for rank in (0, 1):
        ref, bf16w, fast = (torch.load(tmp_path / f"{tag}.rank{rank}.pt")["grads"][0] for tag in runs)
        promoted = torch.load(tmp_path / f"tiny-mlp-fp8-promoted-wgrad.rank{rank}.pt")["grads"][0]
        experts = {n for n in ref if ".experts.w" in n}
        assert len(experts) == 2 * 3
        for name, g in ref.items():
            assert torch.isfinite(bf16w[name]).all() and torch.isfinite(fast[name]).all()
            assert torch.equal(bf16w[name], g) != (name in experts), name
            assert torch.equal(promoted[name], g), name
        assert any(not torch.equal(fast[n], ref[n]) for n in set(ref) - experts)


# ---------------------------------------------------------------------------
# examples/fp8_diagnosis.py: the model of fast FP8 accumulation
# ---------------------------------------------------------------------------

diag = load("fp8_diagnosis")
E4M3 = torch.float8_e4m3fn


def _trunc_ref(x, bits):
    """x (a Fraction) cut to `bits` explicit mantissa bits toward zero, in exact arithmetic."""
    if x == 0:
        return x
    mag = abs(x)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()  # 2^e <= mag < 2^(e+1) after the fix-up
    if Fraction(2) ** e > mag:
        e -= 1
    ulp = Fraction(2) ** (e - bits)
    return (mag // ulp) * ulp * (1 if x > 0 else -1)


def _fast_accum_ref(a, b, bits, chunk=32):
    """The model on one pair of vectors, in Fractions: exact chunk sums, the running sum cut after
    each (bits None: the exact sum)."""
    acc = Fraction(0)
    for c in range(0, len(a), chunk):
        acc += sum(Fraction(p) * Fraction(q) for p, q in zip(a[c:c + chunk], b[c:c + chunk]))
        if bits is not None:
            acc = _trunc_ref(acc, bits)
    return acc


def _model_dot(a, b, bits):
    return diag.fast_accum_matmul(torch.tensor(a, dtype=E4M3)[None], torch.tensor(b, dtype=E4M3)[:, None],
                                  bits).item()


def test_truncate_cuts_the_significand_toward_zero():
    x = torch.tensor([1 + 2**-13 + 2**-14, -(1 + 2**-13 + 2**-14), 3 * 2**20 + 1, 0.0, -0.0, float("inf"),
                      float("nan")], dtype=torch.float64)
    got = diag.truncate(x, 13)
    assert got[:3].tolist() == [1 + 2**-13, -(1 + 2**-13), 3 * 2**20]
    assert got[3] == 0 and got[5] == float("inf") and math.isnan(got[6])
    assert torch.equal(diag.truncate(x[:3], 52), x[:3])
    assert diag.truncate(x[:1], 14).item() == x[0].item()
    for bad in (0, 53, 13.0):
        with pytest.raises(ValueError, match="bits="):
            diag.truncate(x, bad)


def test_fast_accum_on_hand_made_vectors():
    # 32 products of 2^9 (2^14 in all), then 32 of 2^-5 (1 in all): 2^14 + 1 needs 14 bits.
    a, b = [256.0] * 32 + [0.25] * 32, [2.0] * 32 + [0.125] * 32
    assert _model_dot(a, b, 13) == 2**14  # the second chunk is lost: the accumulation stalls
    assert _model_dot(a, b, 14) == _model_dot(a, b, None) == 2**14 + 1
    assert _model_dot([-v for v in a], b, 13) == -(2**14)  # toward zero for negative sums too
    # One chunk: 2^14 and 31 ones are summed exactly, then cut once (2^14 + 31 -> 2^14 + 30 at
    # 13 bits), not cut product by product (which would keep 2^14).
    a, b = [128.0] + [1.0] * 31, [128.0] + [1.0] * 31
    assert _model_dot(a, b, 13) == 2**14 + 30 and _model_dot(a, b, 15) == 2**14 + 31
    # The chunk size: with chunks of 1 every product is added and cut on its own.
    one = diag.fast_accum_matmul(torch.tensor(a, dtype=E4M3)[None], torch.tensor(b, dtype=E4M3)[:, None], 13, chunk=1)
    assert one.item() == 2**14


@pytest.mark.parametrize("bits", [13, 5, None])
def test_fast_accum_against_the_scalar_reference(bits):
    """Random e4m3 operands over the whole range, K = 200 (a partial last chunk): bit for bit."""
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(3, 200, generator=g) * torch.exp2(torch.randint(-8, 8, (3, 200), generator=g))).to(E4M3)
    b = (torch.randn(200, 2, generator=g) * torch.exp2(torch.randint(-8, 8, (200, 2), generator=g))).to(E4M3)
    got = diag.fast_accum_matmul(a, b, bits)
    for i in range(3):
        for j in range(2):
            want = _fast_accum_ref(a[i].float().tolist(), b[:, j].float().tolist(), bits)
            assert Fraction(got[i, j].item()) == want, (i, j, bits)


def _gmm_operands(small_range):
    """Operands of both scaled_gmm forms (an expert without rows, rows past the last offset), with
    power-of-two scales. small_range: e4m3 values in [1, 16) in magnitude and K = 64, so that every
    sum is exact in float32 (at most 20 significant bits) and the library's emulation is exact."""
    g = torch.Generator().manual_seed(3)

    def q(*shape):
        v = torch.randn(*shape, generator=g)
        if small_range:
            v = v.sign() * (1 + 14 * torch.rand(*shape, generator=g))
        else:
            v = v * 100
        return v.to(E4M3)

    def scales(n):
        return torch.exp2(torch.randint(-6, 6, (n,), generator=g).float())

    T, K, N, E = 40, 64, 24, 3
    mm = (q(T, K), q(E, N, K).transpose(-2, -1), scales(T), scales(E * N).view(E, N),
          torch.tensor([15, 15, 37], dtype=torch.int32))
    M, Kp = 16, 96
    wg = (q(Kp, M).t(), q(Kp, N), scales(E * M), scales(E * N), torch.tensor([32, 32, 96], dtype=torch.int32))
    return mm, wg


def test_fast_accum_model_equals_the_emulation_at_23_bits_and_cuts_below():
    from expertact.moe import _gemm
    for form in _gmm_operands(small_range=True):
        exact = _gemm.scaled_gmm(*form)
        got = diag.FastAccumModel(23)(*form)
        assert got.dtype == torch.bfloat16 and got.shape == exact.shape
        torch.testing.assert_close(got, exact, rtol=0, atol=0, equal_nan=True)  # NaN where unwritten, too
        # 5 bits: every partial sum cut by less than 2^-5 of its size, at most 2 chunks (K <= 64)
        # plus the output's bf16 rounding; sum |q_a q_b| scaled bounds each partial sum.
        cut, exact = diag.FastAccumModel(5)(*form).float(), exact.float()
        bound = _gemm.scaled_gmm(form[0].float().abs().to(E4M3), form[1].float().abs().to(E4M3), *form[2:]).float()
        ok = ~exact.isnan()
        err = (cut[ok] - exact[ok]).abs()
        assert (err <= (2 * 2**-5 + 2**-8) * bound[ok]).all() and (err > 2**-8 * bound[ok]).any()
    for form in _gmm_operands(small_range=False):  # the whole e4m3 range: float32 rounds, 23 bits cut
        exact, got = _gemm.scaled_gmm(*form).float(), diag.FastAccumModel(23)(*form).float()
        ok = ~exact.isnan()
        assert torch.equal(exact.isnan(), got.isnan())
        assert ((got[ok] - exact[ok]).abs() <= exact[ok].abs() * 2**-8).all()  # within one bf16 rounding


def test_fast_accum_model_in_the_fp8_node():
    """Installed, the model computes the GEMM kinds it is given, where the call takes fast
    accumulation, and leaves the others to the emulation: the wgrad-only model leaves y and x's
    gradient bit-equal and changes the weights', and computes nothing of rowwise-promoted-wgrad."""
    from expertact.moe import _gemm, expert_mlp
    g = torch.Generator().manual_seed(5)
    T, D, F, E = 50, 32, 48, 3
    x = torch.randn(T, D, generator=g).bfloat16()
    w13 = (torch.randn(E, D, 2 * F, generator=g) / 6).bfloat16()
    w2 = (torch.randn(E, F, D, generator=g) / 7).bfloat16()
    offsets = torch.tensor([20, 20, 46], dtype=torch.int32)
    dy = torch.randn(T, D, generator=g).bfloat16()

    def run(model=None, recipe="rowwise"):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        with (diag.installed(model) if model is not None else contextlib.nullcontext()):
            y = expert_mlp(*leaves, offsets, "swiglu_oai", fp8=recipe)
            y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    emulation = _gemm.scaled_gmm
    ref = run()
    wgrad = diag.FastAccumModel(4, ("wgrad",))
    got = run(wgrad)
    assert _gemm.scaled_gmm is emulation and wgrad.calls == {"mm": 0, "wgrad": 2}
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert not torch.equal(got[2], ref[2]) and not torch.equal(got[3], ref[3])
    promoted = diag.FastAccumModel(4, ("wgrad",))  # a recipe whose weight gradients take no fast accumulation
    got = run(promoted, "rowwise-promoted-wgrad")
    assert promoted.calls == {"mm": 0, "wgrad": 0} and all(torch.equal(a, b) for a, b in zip(got, ref))
    every = diag.FastAccumModel(13)
    got = run(every)
    assert every.calls == {"mm": 4, "wgrad": 2}
    for a, b in zip(got, ref):  # 13 bits at these K: within a few bf16 roundings of the emulation
        assert torch.isfinite(a).all() and (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()


def test_fp8_diagnosis_args():
    a = diag.parse_args(["--gemms", "wgrad", "--", "--config", "cpu-diag", "--impl", "mlp-fp8", "--ep-size", "1"])
    assert a.gemms == "wgrad" and a.bits == 13 and a.train_args[-2:] == ["--tag", "cpu-diag-mlp-fp8-fastacc13-wgrad"]
    a = diag.parse_args(["--bits", "9", "--config", "cpu-diag", "--impl", "mlp-fp8", "--tag", "x"])
    assert a.train_args == ["--config", "cpu-diag", "--impl", "mlp-fp8", "--tag", "x"]
    for bad in (["--", "--impl", "mlp"], ["--", "--impl", "mlp-fp8,mlp-fp8-bf16-wgrad"],
                ["--gemms", "all", "--", "--impl", "mlp-fp8-bf16-wgrad"],
                ["--gemms", "wgrad", "--", "--impl", "mlp-fp8-promoted-wgrad"],
                ["--gemms", "fwd-dgrad", "--", "--impl", "mlp-fp8-blockwise"]):
        with pytest.raises(SystemExit):
            diag.parse_args(bad)
    for impl in ("mlp-fp8-bf16-wgrad", "mlp-fp8-promoted-wgrad"):
        assert diag.parse_args(["--gemms", "fwd-dgrad", "--", "--impl", impl]).gemms == "fwd-dgrad"
