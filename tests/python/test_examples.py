"""The fine-tuning examples (examples/finetune_gpt_oss.py, examples/torchtitan_moe_loop.py) at their
tiny size on the CPU, a few steps each: the outputs exist and parse, the losses are finite and
fall from about ln(vocab), and expertact's variants track the baseline's losses within float32
tolerance, while a deliberately wrong expertact mapping does not (so the comparison can fail).

Each example runs in this process (its run() function), float32, deterministic algorithms on;
the global flags it sets are restored afterwards.
"""
import json
import math
import os
import re
import sys
import xml.dom.minidom
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import finetune_gpt_oss as ft  # noqa: E402

STEPS = 6
# Per-step |loss - baseline loss| allowed between two float32 implementations of the same experts
# over STEPS steps of AdamW: the losses (about 5) differ by the rounding of differently ordered
# float32 sums, which the rest of the model mostly absorbs. Measured 0 for expertact against
# transformers' grouped_mm (Qwen3-MoE) and against TorchTitan's GroupedExperts computing in
# float32 (CPU, torch 2.13, transformers 5.17, TorchTitan 0.3.0). A wrong gate/up mapping misses
# by 3e-4 at the first step and 1e-3 within 8 steps (test_a_wrong_mapping_is_caught).
LOSS_ATOL_F32 = 2e-5
FIRST_LOSS = math.log(ft.VOCAB)


@pytest.fixture
def restore_flags():
    """The examples switch torch's deterministic mode on for the whole process; put it back."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3], saved[4]
    if saved[5] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def _quiet(*a, **k):
    pass


def _args(out, variants, *extra):
    return ["--device", "cpu", "--size", "tiny", "--steps", str(STEPS), "--warmup", "2", "--log-every", "100",
            "--out", str(out), "--variants", ",".join(variants), *extra]


def _check_outputs(out, result, ran):
    """results.json equals the returned record; results.md has a row per variant; the SVG parses
    and draws one loss line per variant that ran."""
    with open(out / "results.json") as f:
        assert json.load(f) == json.loads(json.dumps(result))
    md = (out / "results.md").read_text()
    assert "| variant | implementation | tokens/s |" in md
    for name in result["variants"]:
        assert f"| {name} |" in md
    svg = xml.dom.minidom.parse(str(out / "loss_curves.svg"))
    labels = [t.firstChild.data for t in svg.getElementsByTagName("text") if t.firstChild is not None]
    for name in ran:
        assert name in labels


def _check_training(r):
    loss = r["loss"]
    assert len(loss) == STEPS and all(math.isfinite(v) for v in loss)
    assert abs(loss[0] - FIRST_LOSS) < 0.3, loss[0]  # a random init predicts about uniformly
    assert sum(loss[-3:]) / 3 < loss[0] - 0.2, loss  # and learns the byte statistics quickly
    assert r["tokens_per_s"] > 0 and r["mean_step_time_s"] > 0 and len(r["step_time_s"]) == STEPS
    assert r["final_loss"] == pytest.approx(sum(loss) / len(loss))  # fewer steps than the window of 10
    assert r["peak_allocated_bytes"] is None  # CPU


def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def _check_repeat(variants, name, of):
    r = variants[name]
    assert r["repeats"] == of
    assert r["bit_identical_losses"] == (r["loss"] == variants[of]["loss"])
    assert r["bit_identical_params"] == (r["params_sha256"] == variants[of]["params_sha256"])


def test_finetune_gpt_oss(tmp_path, restore_flags):
    variants = ["grouped_mm", "eager", "expertact", "expertact_inplace", "expertact_repeat"]
    result = ft.run(_args(tmp_path, variants), log=_quiet)
    v = result["variants"]
    assert list(v) == variants
    assert result["setup"]["arch"] == "gpt_oss" and result["setup"]["bias_std"] > 0
    for name in ("grouped_mm", "eager"):
        _check_training(v[name])
        assert v[name]["experts_implementation_set"] == name
    assert _max_diff(v["eager"]["loss"], v["grouped_mm"]["loss"]) <= LOSS_ATOL_F32
    assert v["eager"]["max_abs_loss_diff_vs_baseline"] == _max_diff(v["eager"]["loss"], v["grouped_mm"]["loss"])
    for name in ("expertact", "expertact_inplace", "expertact_repeat"):  # with GPT-OSS's expert biases
        assert "error" not in v[name], v[name].get("error")
        _check_training(v[name])
        assert v[name]["max_abs_loss_diff_vs_baseline"] <= LOSS_ATOL_F32, name
    _check_repeat(v, "expertact_repeat", "expertact")
    _check_outputs(tmp_path, result, variants)


def test_finetune_qwen3_moe_control(tmp_path, restore_flags):
    """The same example on Qwen3-MoE (no expert biases)."""
    variants = ["grouped_mm", "expertact", "expertact_inplace", "expertact_repeat"]
    result = ft.run(_args(tmp_path, variants, "--arch", "qwen3_moe"), log=_quiet)
    v = result["variants"]
    for name in variants:
        assert "error" not in v[name], v[name].get("error")
        _check_training(v[name])
    for name in variants[1:]:
        assert v[name]["max_abs_loss_diff_vs_baseline"] == _max_diff(v[name]["loss"], v["grouped_mm"]["loss"])
        assert v[name]["max_abs_loss_diff_vs_baseline"] <= LOSS_ATOL_F32, name
    _check_repeat(v, "expertact_repeat", "expertact")
    _check_outputs(tmp_path, result, variants)


def test_a_wrong_mapping_is_caught(tmp_path, restore_flags, monkeypatch):
    """expertact with gate and up swapped (a mapping bug) misses the baseline by more than the
    tolerance: the comparison above can fail."""
    import expertact.transformers as xt
    right = xt._gate_of
    monkeypatch.setattr(xt, "_gate_of", lambda m: right(m)._replace(layout="up_first"))
    result = ft.run(_args(tmp_path, ["grouped_mm", "expertact"], "--arch", "qwen3_moe"), log=_quiet)
    assert result["variants"]["expertact"]["max_abs_loss_diff_vs_baseline"] > 5 * LOSS_ATOL_F32


def test_variant_lists_are_checked(capsys):
    """check_variants (both examples' --variants): an unknown name, an empty list, a name given
    twice and a repeat before the run it repeats are refused, each saying why."""
    import argparse
    repeat_first = "grouped_mm_repeat repeats grouped_mm: list grouped_mm before it"
    for names, why in ((["grouped_mm", "nonsense"], r"unknown variants \['nonsense'\]"), ([], "unknown variants"),
                       (["eager", "eager"], "listed twice"), (["grouped_mm_repeat", "grouped_mm"], repeat_first)):
        with pytest.raises(SystemExit):
            ft.check_variants(argparse.ArgumentParser(), names, ft.VARIANTS)
        assert re.search(why, capsys.readouterr().err), (names, why)
    ft.check_variants(argparse.ArgumentParser(), ["grouped_mm", "grouped_mm_repeat"], ft.VARIANTS)


def test_runs_merge_into_one_report(tmp_path, restore_flags):
    """A comparison split over two commands into one --out folder gives one report, a repeat
    compared with its run from the first command; main()'s exit status says whether a variant
    failed."""
    with pytest.raises(SystemExit):  # a repeat listed before the run it repeats
        ft.parse_args(["--variants", "grouped_mm_repeat,grouped_mm"])
    assert ft.main(_args(tmp_path, ["grouped_mm"], "--steps", "3")) == 0
    result = ft.run(_args(tmp_path, ["eager", "grouped_mm_repeat"], "--steps", "3"), log=_quiet)
    v = result["variants"]
    assert list(v) == ["grouped_mm", "eager", "grouped_mm_repeat"]
    assert v["eager"]["max_abs_loss_diff_vs_baseline"] == _max_diff(v["eager"]["loss"], v["grouped_mm"]["loss"])
    assert v["grouped_mm_repeat"]["bit_identical_losses"] == (v["grouped_mm_repeat"]["loss"] == v["grouped_mm"]["loss"])
    # Another setup (here: another seed) starts a fresh report; the repeat then has nothing to
    # compare with and says so.
    result = ft.run(_args(tmp_path, ["grouped_mm_repeat"], "--steps", "3", "--seed", "1"), log=_quiet)
    assert list(result["variants"]) == ["grouped_mm_repeat"]
    assert "bit_identical_losses" not in result["variants"]["grouped_mm_repeat"]
    assert "no grouped_mm run to compare with" in (tmp_path / "results.md").read_text()


def test_finetune_fp8_recipe_by_name(tmp_path, restore_flags, monkeypatch):
    """--fp8 names expertact_fp8's recipe, resolved by expertact.moe.fp8_recipe (an unknown name is
    refused naming the recipes; "default", the default, is fp8=True's recipe, "blockwise", and is
    refused while none is chosen); on the CPU, in bf16, "rowwise" and the default (the run the
    GPU session's fine-tuning stage makes) train through the recipe's emulation (every expert
    GEMM through its FP8 layer, counted: no silent bf16) near the bf16 baseline, and the record
    says which recipe ran."""
    from expertact import moe
    from expertact.moe import FP8_RECIPES, _gemm
    for bad in ("nonsense", "tensorwise"):
        with pytest.raises(SystemExit):
            ft.parse_args(["--variants", "expertact_fp8", "--fp8", bad])
    assert ft.parse_args(["--variants", "grouped_mm", "--fp8", "nonsense"]).fp8_modes is None  # not asked for
    with pytest.raises(SystemExit):  # folded into the recipe names
        ft.parse_args(["--variants", "expertact_fp8", "--fp8", "rowwise", "--fp8-bf16-wgrad"])
    for given in ([], ["--fp8", "default"]):  # fp8=True's recipe
        assert ft.parse_args(["--variants", "expertact_fp8", *given]).fp8_modes == dict(fp8="blockwise")
    with monkeypatch.context() as m:
        m.setattr(moe, "DEFAULT_FP8_RECIPE", None)
        for given in ([], ["--fp8", "default"]):
            with pytest.raises(SystemExit):
                ft.parse_args(["--variants", "expertact_fp8", *given])
    for name in FP8_RECIPES:
        assert ft.parse_args(["--variants", "expertact_fp8", "--fp8", name]).fp8_modes == dict(fp8=name)
    for recipe, gemm in (("rowwise", "scaled_gmm"), (moe.DEFAULT_FP8_RECIPE, "blockwise_gmm")):
        calls = []
        real = getattr(_gemm, gemm)
        monkeypatch.setattr(_gemm, gemm, lambda *x, real=real, **k: calls.append(1) or real(*x, **k))
        result = ft.run(_args(tmp_path / recipe, ["grouped_mm", "expertact", "expertact_fp8"], "--dtype", "bf16",
                              "--fp8", recipe, "--steps", "3"), log=_quiet)
        v = result["variants"]
        assert "error" not in v["expertact_fp8"], v["expertact_fp8"].get("error")
        assert v["expertact_fp8"]["fp8"] == recipe
        layers = result["setup"]["sizes"]["layers"]
        assert len(calls) == 6 * layers * 3, (recipe, len(calls))  # six FP8 GEMMs per MoE layer and step
        fp8, bf16 = v["expertact_fp8"]["loss"], v["expertact"]["loss"]
        assert all(math.isfinite(x) for x in fp8) and fp8 != bf16 and _max_diff(fp8, bf16) < 0.05


def test_finetune_fp8_criterion():
    """results.md applies the criterion to each FP8 variant against expertact's bf16 run and
    against transformers' default, the other bf16 runs the yardsticks: a run inside the band
    passes the loss half, one shifted past it in one window fails naming that window; the step
    half passes at 1.05x the fastest bf16 expertact run's and fails below; a failed variant and a
    missing baseline are left out."""
    import random
    rng = random.Random(0)
    base = [2.0 - s / 300 + 0.01 * rng.random() for s in range(300)]
    shifted = lambda d, lo=0, hi=300: [x + (d if lo <= s < hi else 0.0) for s, x in enumerate(base)]  # noqa: E731
    run = lambda loss, impl, t, **k: dict(implementation=impl, loss=loss, mean_step_time_s=t, **k)  # noqa: E731
    variants = dict(grouped_mm=run(shifted(0.004), "grouped_mm", 0.7), eager=run(shifted(-0.003), "eager", 0.45),
                    expertact=run(base, "expertact", 0.2), expertact_inplace=run(base, "expertact_inplace", 0.21),
                    expertact_fp8=run(shifted(0.005), "expertact_fp8", 0.19, fp8="blockwise"))
    result = dict(variants=variants)
    text = ft.criterion_lines(result)
    rows = [ln for ln in text.splitlines() if ln.startswith("| expertact_fp8")]
    assert [r.split(" | ")[1] for r in rows] == ["expertact", "grouped_mm"]
    assert all(r.endswith("| PASS | 1.053x: PASS |") and "(blockwise)" in r for r in rows), rows
    assert "| grouped_mm, eager, expertact_inplace |" in rows[0] and "| eager, expertact, expertact_inplace |" in rows[1]
    variants["expertact_fp8"] = run(shifted(0.05, 100, 150), "expertact_fp8", 0.3, fp8="rowwise")
    rows = [ln for ln in ft.criterion_lines(result).splitlines() if ln.startswith("| expertact_fp8")]
    assert all(r.endswith("| FAIL (window 3) | 0.667x: FAIL |") for r in rows), rows
    variants["expertact_fp8"]["mean_step_time_s"] = 0.1999  # 1.0005x: the step half fails
    rows = [ln for ln in ft.criterion_lines(result).splitlines() if ln.startswith("| expertact_fp8")]
    assert all(r.endswith("| 1.001x: FAIL |") for r in rows), rows
    del variants["expertact_inplace"]
    variants["grouped_mm"] = dict(implementation="grouped_mm", error="OutOfMemoryError")
    rows = [ln for ln in ft.criterion_lines(result).splitlines() if ln.startswith("| expertact_fp8")]
    assert len(rows) == 1 and "| expertact | eager |" in rows[0]
    del variants["eager"]
    assert ft.criterion_lines(result) == ""  # no yardstick left
    assert ft.criterion_lines(dict(variants=dict(expertact=run(base, "expertact", 0.2)))) == ""


def test_torchtitan_loop(tmp_path, restore_flags, monkeypatch):
    pytest.importorskip("torchtitan.models.qwen3")
    pytest.importorskip("torchtitan.config.override")
    import torchtitan_moe_loop as tt
    # TorchTitan's GroupedExperts casts to bf16 whatever the parameters' dtype; with .bfloat16()
    # an identity it computes in float32, as expertact does in a float32 run, so that the two
    # compute the same function at float32 precision (as tests/python/test_torchtitan.py does).
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self)
    variants = ["torchtitan", "expertact", "expertact_fused", "expertact_inplace", "expertact_repeat"]
    result = tt.run(_args(tmp_path, variants), log=_quiet)
    v = result["variants"]
    assert list(v) == variants
    assert v["torchtitan"]["experts_class"] == ["GroupedExperts"]
    assert v["expertact"]["experts_class"] == ["ExpertactGroupedExperts"]
    assert v["expertact_fused"]["experts_class"] == ["ExpertactFusedGroupedExperts"]
    for name in variants:
        assert "error" not in v[name], v[name].get("error")
        _check_training(v[name])
    for name in variants[1:]:
        assert v[name]["max_abs_loss_diff_vs_baseline"] <= LOSS_ATOL_F32, name
    _check_repeat(v, "expertact_repeat", "expertact")
    _check_outputs(tmp_path, result, variants)


def test_gpu_session_plan_and_dry_run():
    """scripts/gpu_session.sh --plan packs every stage, in priority order, into device calls of at
    most CALL_S and sessions of at most SESSION_S, each session opening with preflight and build;
    --dry-run prints each stage's command and runs nothing; the runs those commands name exist in
    the examples they launch (autoep_train.py's impls, finetune_gpt_oss.py's variants)."""
    import re
    import subprocess
    import autoep_train

    script = EXAMPLES.parent / "scripts" / "gpu_session.sh"
    env = dict(os.environ, OUT="/nonexistent/out")
    plan = subprocess.run(["bash", str(script), "--plan"], capture_output=True, text=True, env=env, check=True).stdout
    calls = re.findall(r"call: bash scripts/gpu_session.sh (.+?)\s+~\s*(\d+) s", plan)
    totals = [int(t) for t in re.findall(r"session \d+ total ~(\d+) s", plan)]
    cap = int(re.search(r"calls \(<= (\d+) s\)", plan).group(1))
    session_cap = int(re.search(r"sessions \(<= (\d+) s", plan).group(1))
    stages = [s for c, _ in calls for s in c.split()]
    fp8 = [s for s in stages if s not in ("preflight", "build")]
    assert fp8[:4] == ["test-fp8", "ab-blocks-tr", "ab-kpad", "ab-tail-rows"]
    assert len(fp8) == len(set(fp8)) == 16
    # the runs a comparison reads together share a session (one machine): the 1,000-step runs of a
    # seed
    session_of = {}
    for n, block in enumerate(re.split(r"session \d+ \(a fresh machine\)", plan)[1:]):
        for c in re.findall(r"call: bash scripts/gpu_session.sh (.+?)\s+~", block):
            session_of.update(dict.fromkeys(c.split(), n))
    assert session_of["finetune-20b"] == session_of["finetune-20b-yardsticks"]
    assert all(int(t) <= cap for _, t in calls) and totals and all(t <= session_cap for t in totals)
    assert stages.count("build") == len(totals) and all(c.startswith("preflight build") for c, _ in calls
                                                       if "build" in c.split())
    off_plan = ["train-autoep-seed2", "train-autoep-seed3", "train-autoep-blockwise-seeds", "train-autoep-1000-bf16",
                "train-autoep-1000-mlp", "train-autoep-1000-fp8", "finetune-fp8-yardsticks", "finetune-fp8",
                "train-autoep-1000-seed2", "train-autoep-1000-seed2-fp8", "profile-fp8-finetune", "scaled-mm-forms"]
    dry = subprocess.run(["bash", str(script), "--dry-run", *fp8, *off_plan, "fp8-accuracy", "train-autoep",
                          "train-autoep-fp8"], capture_output=True, text=True, env=env, check=True).stdout
    assert not os.path.exists("/nonexistent/out")
    for st in fp8 + off_plan:
        assert re.search(rf"^{st}: ", dry, re.M), st
    assert re.search(r"^train-autoep-seed3: .*\n.*autoep_train.py .*--seed 3 ", dry, re.M)
    assert re.search(r"^train-autoep-step: .*autoep_train.py .*--impl mlp-inplace,mlp-fp8-blockwise", dry, re.M)
    for seed in (2, 3):  # the step at the other two seeds, each beside its own bf16 MLP in place
        assert re.search(rf"^train-autoep-step-seeds: (.*\n)*.*autoep_train.py .*--seed \$seed .*--expert-share "
                         r".*--impl mlp-inplace,mlp-fp8-blockwise", dry, re.M) and "for seed in 2 3" in dry
    assert re.search(r"^profile-fp8-autoep: .*\n.*mlp_kernel_profile.py .*--shape 8,32768,1024,3072", dry, re.M)
    assert re.search(r"^profile-fp8-finetune: .*finetune_gpt_oss.py --variants expertact,expertact_fp8\s+--fp8 "
                     r"blockwise --steps 30 --profile 4 .*\n.*--variants expertact_fp8 --fp8 rowwise --steps 30 "
                     r"--profile 4\s+--out .*\n.*--impls expertact,fp8,fp8-blockwise\s+--no-errors --experts 32 "
                     r"--rows 8192 --dim 1024 --ffn 1024 .*\n.*mlp_kernel_profile.py \$impl --shape 32,8192,1024,1024",
                     dry, re.M)
    for st, variants in (("finetune-20b", "expertact,expertact_fp8"), ("finetune-20b-yardsticks", "eager,grouped_mm")):
        assert re.search(rf"^{st}: .*finetune_gpt_oss.py --size 20b-experts\s+--variants {variants} .*--out "
                         r"\S*/session/finetune-20b$", dry, re.M), st
    assert re.search(r"^ab-groups: bash bench/ab/ab.sh \S+ bench/ab/bwd-groups.patch groups$", dry, re.M)
    assert re.search(r"^ab-blocks-tr: bash bench/ab/ab.sh \S+ bench/ab/blocks-tr.patch blocks finetune-20b$", dry,
                     re.M)
    assert re.search(r"^ab-kpad: bash bench/ab/ab.sh \S+ bench/ab/kpad.patch test_fp8_gemm or test_fp8_mlp "
                     r"finetune-20b$", dry, re.M)
    assert re.search(r"^ab-tail-rows: bash bench/ab/ab.sh \S+ bench/ab/tail-rows.patch test_fp8_gemm or "
                     r"test_fp8_mlp finetune$", dry, re.M)
    assert re.search(r"^bench-fp8-operands: .*fp8_operand_kernels.py .*\n.*--shape 8,32768,1024,3072", dry, re.M)
    for impls in re.findall(r"autoep_train.py .*--impl ([\w,-]+)", dry):
        assert all(i in autoep_train.IMPLS for i in impls.split(",")), impls
    # megatron_moe.py imports megatron-core (Python >= 3.12): its IMPLS read from its source
    import ast
    tree = ast.parse((EXAMPLES / "megatron_moe.py").read_text())
    megatron_impls = next({k.value for k in n.value.keys} for n in tree.body
                          if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "IMPLS")
    assert "megatron-unfused" in megatron_impls
    for impls in re.findall(r"megatron_moe.py .*--impl ([\w,-]+)", dry):
        assert set(impls.split(",")) <= megatron_impls, impls
    for variants in re.findall(r"--variants ([\w,]+)", dry):
        assert all(v in ft.VARIANTS for v in variants.split(",")), variants
    # the 1,000-step runs: the baseline and its yardsticks, the bf16 MLP in place (the step's reference)
    # and the default recipe, into one folder
    assert re.search(r"^train-autoep-1000-mlp: .*--steps 1000 .*--out \S*/train-autoep-1000 --impl mlp-inplace$",
                     dry, re.M)
    for st, seed, folder in [("train-autoep-1000-bf16", 1234, "train-autoep-1000"),
                             ("train-autoep-1000-seed2", 2, "train-autoep-1000-seed2")]:
        assert re.search(rf"^{st}: .*--seed {seed} --steps 1000 .*--out \S*/{folder} --impl eager,eager-repeat$",
                         dry, re.M), st
        fp8_stage = st.replace("-bf16", "") + "-fp8"
        assert re.search(rf"^{fp8_stage}: .*--seed {seed} --steps 1000 .*--out '\S*/{folder}' "
                         rf"--impl eager-fused,mlp-fp8-\w+ .*--in '\S*/{folder}' .*--md '\S*/{folder[6:]}.md'",
                         dry, re.M), fp8_stage
    from expertact.moe import DEFAULT_FP8_RECIPE  # the longer runs train the default recipe
    assert re.search(rf"--impl eager-fused,mlp-fp8-{DEFAULT_FP8_RECIPE} ", dry)
    assert re.search(rf"--variants expertact,expertact_fp8 .*--fp8 {DEFAULT_FP8_RECIPE} ", dry)
    assert "--capture-step 150" in dry and "--fp8-accuracy --tensors" in dry and "--corpus stdlib+packages" in dry
    bad = subprocess.run(["bash", str(script), "--dry-run", "no-such-stage"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown stage" in bad.stdout


def test_ab_patches_apply():
    """Each change waiting for its GPU A/B (bench/ab/*.patch, a stage of scripts/gpu_session.sh)
    still applies to this tree, touches Python, tests or the library's sources (ab.sh rebuilds
    the library for a patch to src/), and the stage that runs it names its patch; a patch that
    no longer applies is rebased or dropped, never left to fail on the GPU machine."""
    import shutil
    import subprocess
    root = EXAMPLES.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs git and a git checkout")
    session = (root / "scripts" / "gpu_session.sh").read_text()
    patches = sorted((root / "bench" / "ab").glob("*.patch"))
    assert patches
    for p in patches:
        check = subprocess.run(["git", "apply", "--check", str(p)], cwd=root, capture_output=True, text=True)
        assert check.returncode == 0, (p.name, check.stderr)
        files = re.findall(r"^diff --git a/(\S+)", p.read_text(), re.M)
        assert files and all(f.startswith(("python/", "tests/", "src/")) for f in files), (p.name, files)
        assert f"bench/ab/{p.name}" in session, p.name


def test_finetune_profile(tmp_path, restore_flags, monkeypatch):
    """--profile N: N steps after the warm-up run under torch.profiler, left out of the timing; each
    variant's summary (expertact.bench.trace) is in OUT/profile-VARIANT.txt and its record, and
    counts the host's GEMM calls (on the CPU: the experts' and attention's torch.mm); a
    profile that leaves no timed step is refused; a variant that fails inside its profiled
    steps leaves no profiler running. The losses are the unprofiled run's."""
    with pytest.raises(SystemExit):
        ft.parse_args(["--steps", "6", "--warmup", "2", "--profile", "4"])
    plain = ft.run(_args(tmp_path / "plain", ["expertact"]), log=_quiet)["variants"]["expertact"]
    result = ft.run(_args(tmp_path / "prof", ["expertact"], "--profile", "2"), log=_quiet)
    r = result["variants"]["expertact"]
    assert r["loss"] == plain["loss"]
    assert r["profiled_steps"] == [2, 4]
    timed = [t for i, t in enumerate(r["step_time_s"]) if i >= 2 and i not in (2, 3)]
    assert r["mean_step_time_s"] == pytest.approx(sum(timed) / len(timed))
    p = r["profile"]
    assert p["steps"] == 2 and p["wall_ms"] == pytest.approx(1e3 * sum(r["step_time_s"][2:4]) / 2)
    assert p["host"]["torch.mm"][0] > 0 and p["kernels"] == []
    text = (tmp_path / "prof" / "profile-expertact.txt").read_text()
    assert "torch.mm" in text and "no GPU kernels recorded" in text
    assert "but the 2 profiled (2..3" in (tmp_path / "prof" / "results.md").read_text()
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def fails_once_profiling(*a, **k):  # the second variant's step 3, inside its profiled steps 2..3
        calls.append(1)
        if len(calls) == STEPS + 4:
            raise RuntimeError("a step that fails")
        return clip(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", fails_once_profiling)
    v = ft.run(_args(tmp_path / "fail", ["expertact_inplace", "expertact"], "--profile", "2"), log=_quiet)["variants"]
    assert "error" not in v["expertact_inplace"] and v["expertact_inplace"]["profile"]["host"]["torch.mm"][0] > 0
    assert "a step that fails" in v["expertact"]["error"]
    assert not torch.autograd.profiler._is_profiler_enabled


def test_finetune_20b_experts_preset(tmp_path, restore_flags):
    """The "20b-experts" preset has GPT-OSS's layer dims (transformers' GptOssConfig defaults:
    hidden 2,880 = expert intermediate, top-4, 64 query heads and 8 KV heads of 64, the
    128-token sliding window) with GPT-OSS-20B's 32 experts; at those dims (fewer experts, one
    layer, a few tokens) the bf16 and FP8 (blockwise, emulated) variants train on the CPU beside
    transformers' grouped_mm."""
    from transformers import GptOssConfig
    s, c = ft.SIZES["20b-experts"], GptOssConfig()
    assert (s["hidden"], s["intermediate"], s["top_k"], s["heads"], s["kv_heads"], s["head_dim"], s["sliding_window"]) \
        == (c.hidden_size, c.intermediate_size, c.num_experts_per_tok, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.sliding_window)
    assert s["experts"] == 32 and s["seq"] * s["batch"] == 32768
    result = ft.run(["--device", "cpu", "--size", "20b-experts", "--layers", "1", "--experts", "4", "--seq", "16",
                     "--batch", "2", "--steps", "3", "--warmup", "1", "--dtype", "bf16", "--lr", "1e-4", "--log-every", "100",
                     "--out", str(tmp_path), "--variants", "grouped_mm,expertact,expertact_fp8"], log=_quiet)
    v = result["variants"]
    assert result["setup"]["sizes"]["hidden"] == 2880 and result["setup"]["expert_rows_per_layer"] == 128
    for name in v:
        assert "error" not in v[name], v[name].get("error")
        assert all(math.isfinite(x) for x in v[name]["loss"])
    assert _max_diff(v["expertact"]["loss"], v["grouped_mm"]["loss"]) < 0.01  # bf16, the same function (measured 2e-3)
    assert v["expertact_fp8"]["fp8"] == "blockwise" and v["expertact_fp8"]["loss"] != v["expertact"]["loss"]
    assert _max_diff(v["expertact_fp8"]["loss"], v["expertact"]["loss"]) < 0.05  # measured 0.018
