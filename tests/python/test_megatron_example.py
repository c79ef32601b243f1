"""examples/megatron_moe.py and examples/megatron_report.py, and the baseline rows of
python -m expertact.bench --megatron: Megatron's default (its fused SwiGLU) against its unfused
path, the real-text batches the training takes (examples/byte_corpus.py), the report's choice of
baseline and yardsticks. The report's tests need no megatron-core; the rest skip without it
(Python >= 3.12). Megatron-Core's training step itself needs CUDA (its RoPE, token dispatcher,
schedule and DDP buffers allocate on the current CUDA device): scripts/gpu_session.sh runs it.
"""
import json
import math
import os
import socket
import sys

import pytest
import torch

from support.examples import load

report = load("megatron_report")


# ---------------------------------------------------------------------------
# megatron_report.py on made-up runs
# ---------------------------------------------------------------------------

def _run(impl, act="swiglu", fused=None, shift=0.0, ms=200.0, steps=300, **kw):
    """A made-up result in megatron_moe.py's format (fused None: an older file, without the field)."""
    loss = [5.5 * math.exp(-i / 60) + 1.0 + shift * math.sin(i) for i in range(steps)]
    r = dict(impl=impl, config="h200", activation=act, sizes=dict(layers=2, experts=8, ffn=3072, top_k=4, hidden=1024,
                                                                   heads=16, vocab=256, micro_batch=64, seq=1024,
                                                                   lr=3e-4),
             seed=1234, steps=steps, warmup=10, world_size=1, ep=1, dp=1, tokens_per_step=65536, losses=loss,
             mean_step_ms=ms, tokens_per_s=65536 / ms * 1e3, peak_allocated_bytes=40 * 2**30,
             command=f"torchrun ... --impl {impl}", **kw)
    if fused is not None:
        r["bias_activation_fusion"] = fused
    return r


def test_report_baseline_is_megatrons_default():
    """New files: the fused SwiGLU run named megatron is the baseline, megatron-unfused and the repeat
    yardsticks; GPT-OSS's baseline is its unfused megatron run. Older files (no fusion recorded)
    named the fused run megatron-fused and the unfused one megatron: read by what they ran."""
    new = [_run("megatron", fused=True), _run("megatron-repeat", fused=True, shift=1e-3),
           _run("megatron-unfused", fused=False, shift=2e-3, ms=220.0), _run("expertact-fp8", fused=True, shift=0.05,
                                                                            ms=180.0),
           _run("megatron", act="gpt-oss", fused=False), _run("megatron-eager", act="gpt-oss", fused=False, ms=210.0)]
    groups = report.groups_of(new)
    sw = groups[("h200", "swiglu")]
    assert [report.label(r) for r in sw] == [
        "Megatron SequentialMLP, fused SwiGLU (its trainer's default)",
        "Megatron SequentialMLP, fused SwiGLU, again (yardstick: run-to-run noise)",
        "Megatron SequentialMLP, unfused SwiGLU (yardstick: another rounding)", "expertact, FP8 rowwise"]
    assert report.reference(sw)["impl"] == "megatron" and report.reference(sw)["bias_activation_fusion"]
    assert report.reference(groups[("h200", "gpt-oss")])["impl"] == "megatron"
    rows = {line.split(" | ")[2]: line for line in report.table(groups).splitlines() if "| swiglu |" in line}
    fp8 = rows["expertact, FP8 rowwise"]
    base, ours = sw[0]["losses"][-50:], sw[3]["losses"][-50:]
    assert f"| {sum(ours) / 50:.4f} (last 50) {sum(ours) / 50 - sum(base) / 50:+.4f} | 180.0 |" in fp8
    assert "| 1.11x |" in fp8 and "| 0.91x |" in rows["Megatron SequentialMLP, unfused SwiGLU (yardstick: another "
                                                     "rounding)"]
    old = [_run("megatron"), _run("megatron-fused"), _run("expertact-inplace")]
    sw = report.groups_of(old)[("h200", "swiglu")]
    assert [r["impl"] for r in sw] == ["megatron-fused", "megatron", "expertact-inplace"]
    assert report.label(sw[1]) == "Megatron SequentialMLP, unfused SwiGLU (yardstick: another rounding)"
    assert "MockGPTDataset" in report.data_text(old)
    corpus = dict(files=3, bytes=100, sha256="a" * 64, root="/x", windows_per_step=64, window_bytes=1025, seed=1,
                  batches_sha256="b" * 64)
    assert "sha256 aaaaaaaaaaaaaaaa..." in report.data_text([_run("megatron", fused=True, corpus=corpus)])


def test_report_holds_expertact_runs_to_the_loss_criterion():
    """Each expertact run against Megatron's default with the yardsticks' band (docs/spec.md section 10,
    autoep_report's criterion): a run that drifts beyond the band fails in the windows and the last
    100 steps it leaves, on either side; one inside passes; Megatron's own runs are not judged; no
    yardstick, no table."""
    runs = [_run("megatron", fused=True), _run("megatron-repeat", fused=True, shift=2e-3),
            _run("megatron-unfused", fused=False, shift=4e-3), _run("expertact-inplace", fused=True, shift=3e-3),
            _run("expertact-fp8", fused=True), _run("expertact-fp8-promoted-wgrad", fused=True)]
    base = runs[0]["losses"]
    runs[4]["losses"] = [x + 0.05 for x in base]  # above the band everywhere
    runs[5]["losses"] = [x - (0.03 if i >= 250 else 0.0) for i, x in enumerate(base)]  # below it at the end
    groups = report.groups_of(runs)
    crit = report.criterion_table(groups)
    rows = {line.split(" | ")[2]: line for line in crit.splitlines()[2:]}
    assert sorted(rows) == ["expertact, FP8 rowwise", "expertact, FP8 rowwise-promoted-wgrad",
                            "expertact, in-place backward"]
    assert rows["expertact, in-place backward"].endswith("| PASS |")
    every = ", ".join(f"window {i}" for i in range(1, 7))
    assert f"FAIL ({every}, last 100)" in rows["expertact, FP8 rowwise"]
    assert "+0.0500, +0.0500" in rows["expertact, FP8 rowwise"]
    promoted = rows["expertact, FP8 rowwise-promoted-wgrad"]
    # below the band is a miss too
    assert "FAIL (window 6, last 100)" in promoted and ", -0.0300 | " in promoted and "| -0.0150 / " in promoted
    ref, ys = report.reference(groups[("h200", "swiglu")]), [runs[1], runs[2]]
    c = report.criterion(runs[3], ref, ys)
    assert c["passed"] and max(c["yardstick_windows"]) > 0 and c["bands"] == [0.01] * 6
    md = report.markdown(runs, None, "python3 examples/megatron_report.py")
    assert crit in md and "a miss on either side is a miss" in md
    assert report.criterion_table(report.groups_of([runs[0], runs[3]])) == ""  # no yardstick: no verdict
    assert [report.label(r) for r in groups[("h200", "swiglu")]][-3:] == [
        "expertact, in-place backward", "expertact, FP8 rowwise", "expertact, FP8 rowwise-promoted-wgrad"]


# ---------------------------------------------------------------------------
# megatron_moe.py (its options, configs and data; no CUDA step)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example():
    pytest.importorskip("megatron.core", reason="megatron-core 0.19.2 (Python >= 3.12) is not installed")
    return load("megatron_moe")


def test_impls_and_fusion(example):
    """megatron is Megatron-LM's default (fused SwiGLU; GPT-OSS's form unfused), megatron-unfused and
    megatron-eager the yardstick of one form each."""
    a = example.parse_args(["--impl", "megatron,megatron-repeat,megatron-unfused,expertact-inplace", "--config", "tiny"])
    assert [example.fused(a, i) for i in a.impls] == [True, True, False, True]
    cfgs = [example.transformer_config(a, 1, i) for i in a.impls]
    assert [c.bias_activation_fusion for c in cfgs] == [True, True, False, True]
    g = example.parse_args(["--impl", "megatron,megatron-repeat,megatron-eager", "--activation", "gpt-oss"])
    assert [example.fused(g, i) for i in g.impls] == [False, False, False]
    assert not example.transformer_config(g, 1, "megatron").bias_activation_fusion
    for bad in (["--impl", "megatron-unfused", "--activation", "gpt-oss"], ["--impl", "megatron-eager"],
                ["--impl", "megatron-fused"]):
        with pytest.raises(SystemExit):
            example.parse_args(bad)
    assert all(c["vocab"] == 256 for c in example.CONFIGS.values())  # byte tokens


def test_fp8_impls_are_every_recipe_named_as_the_bench_names_them(example):
    """One training run per FP8 recipe, named as python -m expertact.bench --megatron names its rows:
    a recipe added to expertact.moe.FP8_RECIPES without a run here fails."""
    from expertact.bench.common import fp8_rows
    fp8 = {impl: opts["fp8"] for impl, opts in example.IMPLS.items() if opts and "fp8" in opts}
    assert fp8 == fp8_rows("expertact-")
    a = example.parse_args(["--impl", ",".join(fp8), "--config", "tiny"])
    assert a.impls == list(fp8) and all(example.fused(a, i) for i in a.impls)


def test_megatron_lm_trainer_fuses_swiglu_by_default():
    """What the megatron row stands for: Megatron-LM's trainer (megatron.training, shipped in the
    megatron-core wheel) turns bias_activation_fusion on for --swiglu unless told not to."""
    pytest.importorskip("megatron.core", reason="megatron-core 0.19.2 (Python >= 3.12) is not installed")
    try:
        from megatron.training import arguments
    except Exception as e:  # its import pulls in optional packages
        pytest.skip(f"megatron.training is not importable here: {e!r}")
    import argparse
    p = argparse.ArgumentParser()
    arguments._add_training_args(p)
    assert p.parse_args([]).bias_swiglu_fusion is True
    assert p.parse_args(["--no-bias-swiglu-fusion"]).bias_swiglu_fusion is False


def test_batches_are_real_text_the_same_for_every_impl(example):
    """Each rank's batch: windows of seq + 1 bytes of the standard library's sources, labels the
    tokens shifted by one, the data-parallel ranks' shares of one global batch; the batches a function
    of (seed, step) alone, and their hash recorded beside the corpus's."""
    a = example.parse_args(["--impl", "megatron", "--config", "tiny", "--steps", "4"])
    corpus, info = example.corpus_data(a, 2)
    assert info["bytes"] == corpus.numel() > 1_000_000 and len(info["sha256"]) == 64
    assert info["windows_per_step"] == 2 * a.sizes["micro_batch"] and info["window_bytes"] == a.sizes["seq"] + 1
    s, dev = a.sizes, torch.device("cpu")
    b0, b1 = (example.batch_of(corpus, a.seed, 2, s, 2, r, dev) for r in (0, 1))
    for b in (b0, b1):
        assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == (s["micro_batch"], s["seq"])
        assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1]) and b["loss_mask"].min() == 1
        assert b["tokens"].dtype == torch.int64 and int(b["tokens"].max()) < 256
        assert torch.equal(b["position_ids"][0], torch.arange(s["seq"]))
    assert not torch.equal(b0["tokens"], b1["tokens"])
    text = bytes(torch.cat([b0["tokens"][0], b0["labels"][0, -1:]]).tolist())
    assert text in bytes(corpus.numpy()) and b"def " in bytes(corpus[:200_000].tolist())
    assert torch.equal(example.batch_of(corpus, a.seed, 2, s, 2, 1, dev)["tokens"], b1["tokens"])
    assert example.corpus_data(a, 2)[1]["batches_sha256"] == info["batches_sha256"]
    other = example.parse_args(["--impl", "megatron", "--config", "tiny", "--steps", "4", "--seed", "7"])
    assert example.corpus_data(other, 2)[1]["batches_sha256"] != info["batches_sha256"]


def test_record_names_the_data_and_the_fusion(example):
    a = example.parse_args(["--impl", "megatron-unfused", "--config", "tiny"])
    env = dict(world=1, ep=1, dp=1, versions={}, corpus=dict(sha256="c" * 64, batches_sha256="d" * 64))
    rec = example.record(a, "megatron-unfused", None, env, "RuntimeError: x")
    assert rec["bias_activation_fusion"] is False and rec["corpus"]["batches_sha256"] == "d" * 64
    json.dumps(rec)
    assert report.label(dict(rec, losses=[1.0])) == "Megatron SequentialMLP, unfused SwiGLU (yardstick: another rounding)"


# ---------------------------------------------------------------------------
# python -m expertact.bench --megatron: which path each Megatron row runs
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mpu():
    pytest.importorskip("megatron.core", reason="megatron-core 0.19.2 (Python >= 3.12) is not installed")
    import torch.distributed as dist
    from megatron.core import parallel_state
    made = not dist.is_initialized()
    if made:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if made:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_rows_run_megatrons_fused_and_unfused_paths(mpu, monkeypatch):
    """The megatron row of the SwiGLU table calls Megatron's fused weighted SwiGLU once per expert
    and step, megatron-unfused never (and leaves the module fused again); at GPT-OSS's form
    megatron-unfused is skipped, saying why."""
    from megatron.core.transformer import mlp
    from expertact import megatron as xmeg
    from expertact.bench import megatron as bm
    from expertact.bench.common import clock_and_memory, run_row
    calls = []
    real = mlp.weighted_bias_swiglu_impl
    monkeypatch.setattr(mlp, "weighted_bias_swiglu_impl", lambda *a, **k: calls.append(1) or real(*a, **k))
    dev = torch.device("cpu")
    clock, memory = clock_and_memory(dev)
    inp = bm.ExpertsInputs("swiglu", 3, 16, 32, 48, torch.float32, dev)
    assert inp.fused and inp.config.bias_activation_fusion
    ref = bm.reference32(inp)
    r = bm._row("megatron", inp, xmeg, clock, memory, 1, 0, ref)
    assert len(calls) >= 3 and max(r["err"].values()) < 1e-5
    calls.clear()
    r = bm._row("megatron-unfused", inp, xmeg, clock, memory, 1, 0, ref)
    assert not calls and max(r["err"].values()) < 1e-6 and inp.module.config.bias_activation_fusion
    gpt = bm.ExpertsInputs("gpt-oss", 2, 8, 32, 32, torch.float32, dev)
    assert not gpt.fused
    row = run_row(dict(impl="megatron-unfused"), lambda: bm._row("megatron-unfused", gpt, xmeg, clock, memory, 1, 0,
                                                                  None))
    assert row.get("skipped") and "already Megatron's unfused path" in row["error"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
