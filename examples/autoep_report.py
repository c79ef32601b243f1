"""The table (markdown) and the loss / memory plot of the DeepSpeed AutoEP runs that
examples/autoep_train.py wrote, one JSON per run:

    python3 examples/autoep_report.py --in OUT/autoep [MORE_DIRS...] --md docs/autoep-e2e.md --png docs/autoep-e2e-loss.png

Each config's runs are compared with DeepSpeed as a user runs it by default: its own experts on
AutoEP's default gate_up_impl "separate" (--impl eager). Two yardsticks say how large a difference
is: the same run again (eager-repeat, or a tag ending in -repeat: the run-to-run noise) and
DeepSpeed with gate_up_impl "fused" (eager-fused: one grouped GEMM instead of two, the same
function rounded in another order). Runs of older result files (impl eager on gate_up_impl
"fused") are read as the fused yardstick. Every other run of a config with a baseline and a
yardstick is held to the loss criterion of docs/spec.md section 10 (PASS / FAIL per run).

Runs of one config with several seeds (autoep_train.py --seed; folders given together) form one
group per seed, each with its own baseline and yardsticks, and a table across the seeds says, per
run, its criterion in each seed and whether its difference from the baseline keeps its sign; per
FP8 recipe, its step against each seed's fastest bf16 MLP run and whether it meets the default's
rule (the criterion and at least 1.05x in every seed; docs/notes/fp8-recipes.md).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

IMPL_ORDER = ("eager", "eager-repeat", "eager-fused", "expertact", "expertact-inplace", "mlp", "mlp-recompute",
              "mlp-inplace", "mlp-recompute-inplace", "mlp-fp8", "mlp-fp8-bf16-wgrad", "mlp-fp8-promoted-wgrad",
              "mlp-fp8-blockwise", "torchao-fp8")
DEEPSPEED = ("eager", "eager-repeat", "eager-fused")  # DeepSpeed's own experts
DEFAULT_GATE_UP = "separate"  # AutoEP 0.19.8's default gate_up_impl
LATE = 50  # the loss over the last LATE steps (or the last quarter of a shorter run)
CONFIG_ORDER = ("small", "large", "h200", "cpu-diag", "tiny")
WINDOW = 50  # steps per window of the loss criterion (docs/spec.md section 10)
LAST = 100  # the criterion's last steps
IMPL_TEXT = {"expertact": "expertact", "expertact-inplace": "expertact, in-place backward",
             "mlp": "expertact MLP", "mlp-recompute": "expertact MLP, recompute",
             "mlp-inplace": "expertact MLP, in place", "mlp-recompute-inplace": "expertact MLP, recompute + in place",
             "mlp-fp8": "expertact MLP, FP8 rowwise", "mlp-fp8-bf16-wgrad": "expertact MLP, FP8 rowwise-bf16-wgrad",
             "mlp-fp8-promoted-wgrad": "expertact MLP, FP8 rowwise-promoted-wgrad",
             "mlp-fp8-blockwise": "expertact MLP, FP8 blockwise", "torchao-fp8": "torchao FP8 rowwise (AutoEP's experts)"}
COLORS = {"eager": "black", "expertact": "tab:blue", "expertact-inplace": "tab:orange", "mlp": "tab:purple",
          "mlp-inplace": "tab:green", "mlp-fp8": "tab:red", "mlp-fp8-bf16-wgrad": "tab:olive",
          "mlp-fp8-promoted-wgrad": "tab:cyan", "mlp-fp8-blockwise": "tab:brown", "torchao-fp8": "tab:pink"}
SHORT = {"eager": "DeepSpeed", "expertact": "expertact", "expertact-inplace": "in-place", "mlp": "MLP",
         "mlp-inplace": "MLP in place", "mlp-fp8": "FP8 rowwise", "mlp-fp8-bf16-wgrad": "FP8 bf16-wgrad",
         "mlp-fp8-promoted-wgrad": "FP8 promoted-wgrad", "mlp-fp8-blockwise": "FP8 blockwise", "torchao-fp8": "torchao FP8"}
GIB = 2**30


def load(in_dirs):
    runs = []
    for path in sorted(p for d in in_dirs for p in glob.glob(os.path.join(d, "*.json"))):
        with open(path) as f:
            run = json.load(f)
        if "loss" in run and "impl" in run:
            run["_path"] = path
            runs.append(run)
    return runs


def is_deepspeed(run):
    return run["impl"] in DEEPSPEED


def is_repeat(run):
    """The same command again: the run-to-run noise."""
    return run["impl"] == "eager-repeat" or run.get("tag", "").endswith("-repeat")


def is_baseline(run):
    """DeepSpeed's default: its own experts on AutoEP's default gate_up_impl, not a repeat."""
    return is_deepspeed(run) and run.get("gate_up_impl") == DEFAULT_GATE_UP and not is_repeat(run)


def is_reference(run):
    """A yardstick: DeepSpeed's own experts other than the baseline (a repeat, gate_up fused)."""
    return is_deepspeed(run) and not is_baseline(run)


def label(run):
    gate_up = run.get("gate_up_impl")
    if is_deepspeed(run):
        text = f"DeepSpeed, gate_up {gate_up}" + (" (AutoEP's default)" if gate_up == DEFAULT_GATE_UP else "")
    else:
        text = IMPL_TEXT.get(run["impl"], run["impl"])
        whole_mlp = (run.get("expertact_enable") or {}).get("experts")  # one gate_up GEMM whatever gate_up_impl says
        if gate_up != DEFAULT_GATE_UP and not whole_mlp:
            text += f" (gate_up {gate_up})"
    if is_repeat(run):
        text += ", repeat"
    model = run.get("fp8_accumulation_model")  # examples/fp8_diagnosis.py's runs
    if model:
        gemms = {("mm", "wgrad"): "all GEMMs", ("wgrad",): "weight gradients", ("mm",): "forward + input "
                 "gradients"}.get(tuple(model["kinds"]), "+".join(model["kinds"]))
        text += f", fast-accumulation model {model['bits']} bits on {gemms}"
    return text + (" (yardstick)" if is_reference(run) else "")


def sort_key(run):
    c = run["config"]
    rank = 0 if is_baseline(run) else 1 if is_reference(run) else 2
    return (CONFIG_ORDER.index(c) if c in CONFIG_ORDER else len(CONFIG_ORDER), c, run.get("seed", 0), rank,
            IMPL_ORDER.index(run["impl"]) if run["impl"] in IMPL_ORDER else len(IMPL_ORDER), run["tag"])


def by_config(runs):
    """{group: runs}: a group is a config, or a config and seed where that config's runs have
    several seeds (each seed has its own batches, so its own baseline)."""
    seeds = {}
    for run in runs:
        seeds.setdefault(run["config"], set()).add(run.get("seed"))
    out = {}
    for run in sorted(runs, key=sort_key):
        c = run["config"]
        out.setdefault(c if len(seeds[c]) == 1 else f"{c}, seed {run.get('seed')}", []).append(run)
    return out


def baseline_of(runs):
    return next((run for run in runs if is_baseline(run)), None)


def loss_diff(run, ref):
    """(max |loss - ref loss| over the common steps, its step)."""
    n = min(len(run["loss"]), len(ref["loss"]))
    diffs = [abs(a - b) for a, b in zip(run["loss"][:n], ref["loss"][:n])]
    step = max(range(n), key=diffs.__getitem__)
    return diffs[step], step


def late_steps(run):
    """The steps of the late mean loss: the last LATE, or the last quarter of a shorter run."""
    return min(LATE, max(1, len(run["loss"]) // 4))


def late_loss(run, n):
    return sum(run["loss"][-n:]) / n


# Tensor bytes alive at a run's start (autoep_train.py records them) from which the table says that
# the run's peak is not its own: a launch's earlier run left that much held (a DeepSpeed engine that
# is not destroyed keeps its parameters and optimizer states: 2.13 GiB at config h200).
LEFT_ALIVE = 64 * 2**20


def peak(run):
    """Per-rank peak allocated bytes (after the warm-up steps), or None off CUDA."""
    p = run.get("peak_allocated_bytes_per_rank") or []
    return None if not p or any(v is None for v in p) else p


def pct(a, b):
    return f"{100.0 * (a - b) / b:+.1f}%"


def tokens_per_s(run):
    """Tokens of all ranks per second of the mean (slowest-rank) step."""
    return run["tokens_per_rank_per_step"] * run["world_size"] / run["mean_step_time_s"]


def table(groups):
    head = ("| config | run | steps | final loss | mean loss, last steps (vs default) | max abs loss diff vs default "
            "(step) | mean step time (ms) | tokens/s | vs default | peak allocated GiB per rank | vs default (busiest "
            "rank) | busiest rank's rows per MoE layer and step (mean / max) | experts' share of the step |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for config, runs in groups.items():
        ref = baseline_of(runs)
        for run in runs:
            steps = len(run["loss"])
            n = late_steps(ref if ref is not None else run)
            late = f"{late_loss(run, n):.4f} (last {n})"
            if ref is not None and run is not ref:
                d, at = loss_diff(run, ref)
                diff = f"{d:.5f} ({at})"
                t_vs = pct(run["mean_step_time_s"], ref["mean_step_time_s"])
                late += f" {late_loss(run, n) - late_loss(ref, n):+.4f}"
            else:
                diff, t_vs = "—", "—"
            p, pref = peak(run), peak(ref) if ref is not None else None
            mem = " / ".join(f"{v / GIB:.2f}" for v in p) if p else "n/a"
            left = max(run.get("tensor_bytes_alive_at_start_per_rank") or [0])
            if p and left >= LEFT_ALIVE:  # not the run's own peak: an earlier run's memory was still held
                mem += f" (incl. {left / GIB:.2f} alive before the run)"
            m_vs = pct(max(p), max(pref)) if p and pref and run is not ref else "—"
            rows = run["busiest_rank_rows_per_step"]
            rows_txt = f"{sum(rows) / len(rows):,.0f} / {max(rows):,}"
            sh = run.get("experts_share")
            share = "n/a" if not sh else f"{sh['share_of_step']:.0%} ({sh['moe_layers']} x {sh['experts_fwd_bwd_ms']:.1f} ms)"
            lines.append(f"| {config} | {label(run)} | {steps} | {run['loss'][-1]:.4f} | {late} | {diff} | "
                         f"{run['mean_step_time_s'] * 1e3:.1f} | {tokens_per_s(run):,.0f} | {t_vs} | {mem} | {m_vs} | "
                         f"{rows_txt} | {share} |")
    return "\n".join(lines)


def window_means(run, ref, size=WINDOW):
    """Per window of `size` steps (the last one may be shorter), the run's mean loss minus ref's."""
    n = min(len(run["loss"]), len(ref["loss"]))
    return [(sum(run["loss"][i:min(i + size, n)]) - sum(ref["loss"][i:min(i + size, n)])) / (min(i + size, n) - i)
            for i in range(0, n, size)]


def criterion(run, ref, yardsticks):
    """docs/spec.md section 10's loss criterion of `run` against the baseline `ref`, the bf16
    yardsticks' differences from ref giving the band: in every 50-step window the mean loss within
    max(2 x the largest yardstick difference in that window, 0.01) of ref's, and over the last 100
    steps within max(the largest yardstick difference there, 0.5% of ref's loss). Differences
    are signed, bands and the test on their magnitude. Returns a dict (pass: bool)."""
    n = min([len(run["loss"]), len(ref["loss"])] + [len(y["loss"]) for y in yardsticks])
    run, ref = dict(run, loss=run["loss"][:n]), dict(ref, loss=ref["loss"][:n])
    ys = [dict(y, loss=y["loss"][:n]) for y in yardsticks]
    diffs = window_means(run, ref)
    yw = [max([abs(d) for d in col], default=0.0) for col in zip(*(window_means(y, ref) for y in ys))] if ys else [
        0.0] * len(diffs)
    bands = [max(2 * y, 0.01) for y in yw]
    last = min(LAST, n)
    ref_last = sum(ref["loss"][-last:]) / last
    d_last = sum(run["loss"][-last:]) / last - ref_last
    y_last = max([abs(sum(y["loss"][-last:]) / last - ref_last) for y in ys], default=0.0)
    band_last = max(y_last, 0.005 * ref_last)
    ok_w = [abs(d) <= b for d, b in zip(diffs, bands)]
    ok_last = abs(d_last) <= band_last
    return dict(steps=n, windows=diffs, yardstick_windows=yw, bands=bands, windows_pass=ok_w, last_steps=last,
                last=d_last, yardstick_last=y_last, band_last=band_last, last_pass=ok_last,
                passed=all(ok_w) and ok_last)


def verdict(c):
    """A criterion's result as the tables print it: PASS, or FAIL and what missed."""
    misses = [f"window {i + 1}" for i, ok in enumerate(c["windows_pass"]) if not ok]
    misses += [] if c["last_pass"] else [f"last {c['last_steps']}"]
    return "PASS" if c["passed"] else f"FAIL ({', '.join(misses)})"


def criteria(groups):
    """(group, run, criterion) of every run that is not DeepSpeed's own, in each group with a
    baseline and at least one yardstick."""
    for group, runs in groups.items():
        ref = baseline_of(runs)
        ys = [r for r in runs if is_reference(r)]
        if ref is not None and ys:
            for run in runs:
                if not is_deepspeed(run):
                    yield group, run, criterion(run, ref, ys)


def criterion_table(groups):
    """Per config with a baseline and at least one yardstick, the criterion of every run that is
    not DeepSpeed's own (markdown), or "" when no config has both."""
    head = ("| config | run | steps | mean step (s) | mean loss diff per 50-step window | yardsticks' largest per "
            "window | band per window | last 100: diff / band | criterion |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    fmt = lambda v: ", ".join(f"{x:+.4f}" for x in v)  # noqa: E731
    for config, run, c in criteria(groups):
        lines.append(f"| {config} | {label(run)} | {c['steps']} | {run['mean_step_time_s']:.2f} | {fmt(c['windows'])} "
                     f"| {', '.join(f'{x:.4f}' for x in c['yardstick_windows'])} | "
                     f"{', '.join(f'{x:.4f}' for x in c['bands'])} | {c['last']:+.4f} / {c['band_last']:.4f} | "
                     f"{verdict(c)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def trailing_means(loss, size=WINDOW):
    """The mean of each `size` steps ending at step s, for s = size - 1 .. len(loss) - 1 (each
    summed on its own: equal losses give equal means)."""
    return [sum(loss[s - size + 1:s + 1]) / size for s in range(size - 1, len(loss))]


def lead(run, ref, quarters=4):
    """How many steps sooner (negative) or later `run` reaches the losses `ref` reached by each
    quarter of its steps: level k is the lowest trailing 50-step mean of ref up to step k n / 4
    (k = 1 .. 4), and the result [(level, ref's first step at it, run's first step at it or None
    when it never gets there)]. Not the criterion: a shift along the steps, where the criterion
    compares the same steps (a run that leaves a plateau first fails windows it leads in)."""
    m, mr = trailing_means(run["loss"]), trailing_means(ref["loss"])
    n = min(len(m), len(mr))
    out = []
    for k in range(1, quarters + 1):
        q = (len(ref["loss"]) * k) // quarters - WINDOW  # index of step k n / 4 in the trailing means
        if q < 0 or n == 0:
            continue
        level = min(mr[:min(q, n - 1) + 1])
        first = lambda xs: next((i + WINDOW - 1 for i, v in enumerate(xs) if v <= level), None)  # noqa: E731
        out.append((level, first(mr), first(m[:n])))
    return out


def lead_table(groups):
    """Per config with a baseline, every other run's lead() as a markdown table, or ""."""
    rows = []
    for config, runs in groups.items():
        ref = baseline_of(runs)
        for run in runs if ref is not None else []:
            cells = [f"{lv:.3f}: {'never' if s is None else f'{s - s0:+d}'}" for lv, s0, s in lead(run, ref)]
            if run is not ref and cells:
                rows.append(f"| {config} | {label(run)} | {' | '.join(cells)} |")
    if not rows:
        return ""
    k = max(row.count(" | ") - 1 for row in rows)
    head = "| config | run | " + " | ".join(f"by {q}/4 of the default's steps" for q in range(1, k + 1)) + " |"
    return "\n".join([head, "|" + "---|" * (k + 2)] + rows)


DEFAULT_SPEEDUP = 1.05  # docs/spec.md section 10: the default FP8 recipe's step against the fastest bf16 MLP


def is_fp8(run):
    return run["impl"].startswith("mlp-fp8")


def bf16_mlp_speedup(run, runs):
    """The fastest bf16 whole-MLP run's (``mlp*``) mean step over ``run``'s, in the same group, or None."""
    times = [r["mean_step_time_s"] for r in runs if r["impl"].startswith("mlp") and not is_fp8(r)]
    return min(times) / run["mean_step_time_s"] if times else None


def default_rule(by_seed):
    """The default FP8 recipe's rule over the seeds (docs/notes/fp8-recipes.md, "The default's
    decision over the seeds"): in every seed the criterion passed and the step at least
    DEFAULT_SPEEDUP x the fastest bf16 MLP run's. ``by_seed``: {seed: (criterion, speedup)}.
    Returns "met" or what missed it."""
    misses = []
    for seed, (c, x) in sorted(by_seed.items()):
        why = [] if c["passed"] else ["criterion"]
        if x is None:
            why.append("no bf16 MLP run")
        elif x < DEFAULT_SPEEDUP:
            why.append(f"{x:.3f}x")  # three digits: 1.0496x is a miss that two would print as 1.05x
        if why:
            misses.append(f"seed {seed}: " + " and ".join(why))
    return "met" if not misses else "not met (" + "; ".join(misses) + ")"


def seed_table(groups):
    """Per config trained with several seeds, every run that is not DeepSpeed's own and ran in at
    least two of them: the criterion in each seed (the last 100 steps' difference from that seed's
    baseline, its band, the verdict), how many 50-step windows over all seeds lie below and above
    the baseline, the mean of the last-100 differences and, for an FP8 recipe, its step against
    each seed's fastest bf16 MLP run and the default's rule (default_rule) (markdown), or "" when
    no config has two seeds with a baseline and a yardstick each."""
    per = {}  # (config, label, is FP8) -> {seed: (criterion, speed-up over the bf16 MLP)}
    for group, run, c in criteria(groups):
        speedup = bf16_mlp_speedup(run, groups[group]) if is_fp8(run) else None
        per.setdefault((run["config"], label(run), is_fp8(run)), {})[run.get("seed")] = (c, speedup)
    head = ("| config | run | seeds | per seed: last 100 diff / band, criterion | windows below / above the "
            "default | mean last-100 diff | passed | step vs bf16 MLP per seed | the default's rule |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for (config, name, fp8), by_seed in per.items():
        if len(by_seed) < 2:
            continue
        seeds = sorted(by_seed)
        cs = [by_seed[s][0] for s in seeds]
        cells = "; ".join(f"seed {s}: {c['last']:+.4f} / {c['band_last']:.4f} {'PASS' if c['passed'] else 'FAIL'}"
                          for s, c in zip(seeds, cs))
        windows = [w for c in cs for w in c["windows"]]
        below, above = sum(w < 0 for w in windows), sum(w > 0 for w in windows)
        speed = ", ".join("n/a" if by_seed[s][1] is None else f"{by_seed[s][1]:.2f}x" for s in seeds) if fp8 else "—"
        rule = default_rule(by_seed) if fp8 else "—"
        lines.append(f"| {config} | {name} | {len(cs)} | {cells} | {below} / {above} | "
                     f"{sum(c['last'] for c in cs) / len(cs):+.4f} | {sum(c['passed'] for c in cs)} of {len(cs)} | "
                     f"{speed} | {rule} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def setup_text(groups):
    out = []
    for config, runs in groups.items():
        r = runs[0]
        m, s = r["model_config"], r["sizes"]
        ep = r["ds_config"]["expert_parallel"]
        out.append(
            f"- **{config}**: {m['model_type']} (random init, seed {r['seed']}), hidden {m['hidden_size']}, "
            f"{m['num_hidden_layers']} MoE layers of {m['num_local_experts']} experts (ffn "
            f"{m['intermediate_size']}, top-{m['num_experts_per_tok']}, sigmoid router, routed scaling "
            f"{m['routed_scaling_factor']}) plus a shared expert (ffn {m['shared_intermediate_size']}), "
            f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads of {m['head_dim']}, vocab "
            f"{m['vocab_size']} (bytes); {r['params_before_autoep']:,} parameters, "
            f"{r['params_per_rank_after_autoep']:,} per rank after AutoEP. Per rank and step "
            f"{s['micro_batch']} x {s['seq']} = {r['tokens_per_rank_per_step']:,} tokens. {r['dtype']}, ZeRO "
            f"stage {r['zero_stage']} ({r['optimizer']}, AdamW lr {s['lr']}, linear warm-up), "
            f"{r['world_size']} ranks, AutoEP preset `{ep['preset_model']}`, autoep_size {ep['autoep_size']} "
            f"(experts per rank {r['experts_per_rank']}), comm_backend `{ep['comm_backend']}`, expert GEMMs "
            f"{r['expert_gemm']}. Step time: the slowest rank's, synchronized, mean of steps "
            f"{r['timed_from_step']}..{len(r['loss']) - 1}; peak memory: torch.cuda.max_memory_allocated over "
            "those steps.")
    return "\n".join(out)


def _kwargs(d):
    return ", ".join(f"{k}={v!r}" for k, v in d.items())


def activation_text(runs):
    out = []
    seen = set()
    for run in sorted(runs, key=sort_key):
        key = (run["impl"], run.get("gate_up_impl"))
        if key in seen:
            continue
        seen.add(key)
        if run.get("expertact_enable") and run["expertact_enable"].get("experts"):
            ran = ", ".join(f"{k} x{v}" for k, v in run["step0_calls"].items() if v) or "none"
            out.append(f"- {label(run)}: `expertact.deepspeed.enable({_kwargs(run['expertact_enable'])})`: "
                       f"GroupedExperts.forward = `{run.get('experts_forward')}`; registry calls counted in step 0: "
                       f"{ran}")
            continue
        key = "packed_fused_fn" if run.get("gate_up_impl") == "fused" else "fused_fn"
        ran = ", ".join(f"{k} x{v}" for k, v in run["step0_calls"].items() if v)
        out.append(f"- {label(run)}: registry['{run['activation']['name']}'] {key} = `{run['registry_in_use'][key]}` "
                   f"(DeepSpeed's own: `{run['registry_deepspeed'][key]}`); calls counted in step 0: {ran} (alpha "
                   f"{run['activation']['alpha']}, limit {run['activation']['limit']})")
    return "\n".join(out)


def markdown(runs, png_name, report_cmd):
    groups = by_config(runs)
    v = runs[0]["versions"]
    dev = v.get("device", "?")
    if v.get("device_count"):
        dev = f"{runs[0]['world_size']} x {dev} (of {v['device_count']} visible)"
    corpus = runs[0]["corpus"]
    env = {k: val for k, val in runs[0].get("env", {}).items() if val is not None and k != "PYTHONPATH"}
    lines = [
        "# DeepSpeed AutoEP end to end: DeepSpeed's own experts against expertact",
        "",
        "A randomly initialised MiniMax-M3 text model trained with DeepSpeed AutoEP, several ways with the same "
        "seed and batches: DeepSpeed's own expert path as AutoEP runs it by default (`gate_up_impl` \"separate\": two "
        "grouped GEMMs; its registry has no fused kernel for swiglu_oai, so GroupedExperts runs the eager PyTorch "
        "form), expertact's activation in DeepSpeed's registry "
        "(`expertact.deepspeed.enable()`, optionally in place), and expertact's whole expert MLP "
        "(`enable(experts=True, ...)`: GroupedExperts.forward runs expertact.moe.expert_mlp, in bf16 or FP8). "
        "Written by examples/autoep_report.py from the JSON files of examples/autoep_train.py.",
        "",
        f"![loss curves and peak memory]({png_name})",
        "",
        table(groups),
        "",
    ]
    crit = criterion_table(groups)
    if crit:
        lines += [
            "The loss criterion of docs/spec.md section 10 for every run that is not DeepSpeed's own: per 50-step "
            "window the mean loss minus the default's, within max(2 x the largest yardstick difference in that "
            "window, 0.01); over the last 100 steps within max(the largest yardstick difference, 0.5% of the "
            "default's loss). Yardsticks: DeepSpeed's runs other than the default (its repeat, gate_up fused).",
            "",
            crit,
            "",
        ]
    leads = lead_table(groups)
    if leads:
        lines += [
            "Steps sooner or later than the default to the same loss (not the criterion, which compares the same "
            "steps): for each quarter of the default's run, the lowest mean of 50 steps it had reached by then "
            "(the level), and how many steps before (-) or after (+) the default each run's 50-step mean first got "
            "there (never: not within its run). The yardsticks' shifts are what bf16's rounding alone moves.",
            "",
            leads,
            "",
        ]
    seeds = seed_table(groups)
    if seeds:
        lines += [
            "Across the seeds: each seed's criterion against its own baseline and yardsticks, and whether a run's "
            "difference from the baseline keeps its sign from seed to seed. For an FP8 recipe, its step against the "
            f"fastest bf16 MLP run of each seed, and the default's rule: the criterion passed and at least "
            f"{DEFAULT_SPEEDUP}x in every seed.",
            "",
            seeds,
            "",
        ]
    lines += [
        "Default: DeepSpeed's own experts on AutoEP's default `gate_up_impl` \"separate\", the same config; every "
        "\"vs default\" and the max abs loss diff (over all steps) are against it. The loss is the global mean over "
        "the ranks' tokens; the mean loss is over the last steps named (and its difference from the default's). "
        "Yardsticks (where present): the default run again (run-to-run noise) and DeepSpeed with `gate_up_impl` "
        "\"fused\" (one grouped GEMM over w1 and w3: the same function rounded in another order); a difference "
        "within theirs is bf16 rounding carried through training. Rows: routed (token, expert) rows that the "
        "experts of the busiest rank received in one MoE layer, per step.",
        "",
        "## Setup",
        "",
        setup_text(groups),
        f"- Data: the Python standard library's own .py files ({corpus['files']} files, {corpus['bytes']:,} "
        f"bytes, sha256 {corpus['sha256'][:16]}...), byte-level tokens, windows at offsets drawn from "
        "(seed, step): every run of a config trains on the same batches.",
        "",
        "## What ran",
        "",
        activation_text(runs),
        "",
        "## Versions and command",
        "",
        f"- Device: {dev}; CUDA {v.get('cuda', '-')}, NCCL {v.get('nccl', '-')}; {v.get('platform', '')}",
        f"- Python {v['python']}, torch {v['torch']}, DeepSpeed {v['deepspeed']}, transformers "
        f"{v['transformers']}, expertact {v['expertact']} (CUDA path: {v['expertact_cuda']})",
        f"- Environment: {', '.join(f'{k}={val}' for k, val in env.items()) or '-'}",
        f"- Date: {min(r['date'] for r in runs)} .. {max(r['date'] for r in runs)}",
        "- Commands, as each result file records them (`bash examples/run_autoep_e2e.sh` runs the GPU set):",
        "",
    ]
    lines += [f"      {r['command']}" for r in sorted(runs, key=sort_key)]
    lines += ["", f"      {report_cmd}", ""]
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_config(runs)
    # The loss panels show the config with the most steps (the loss-curve run).
    main_config = max(groups, key=lambda c: (len(groups[c][0]["loss"]), -sort_key(groups[c][0])[0]))
    main_runs = groups[main_config]
    ref = baseline_of(main_runs)

    fig, (ax_loss, ax_diff, ax_mem) = plt.subplots(1, 3, figsize=(17, 4.8),
                                                   gridspec_kw=dict(width_ratios=[1.2, 1.2, 1.0]))

    def mem_label(run):
        p = peak(run)
        return "" if not p else f", peak {max(p) / GIB:.2f} GiB"

    # examples/fp8_diagnosis.py's runs share an impl: colours of their own, apart from COLORS'
    models = [r["tag"] for r in main_runs if r.get("fp8_accumulation_model")]
    colors = {tag: matplotlib.colormaps["tab20b"]((4 * i + i // 5) % 20) for i, tag in enumerate(models)}
    for run in main_runs:
        steps = range(len(run["loss"]))
        color = colors.get(run["tag"], COLORS.get(run["impl"]))
        style = dict(color="0.6", lw=1.0, ls="--") if is_reference(run) else dict(
            color=color, lw=1.3 if is_baseline(run) else 1.0)
        ax_loss.plot(steps, run["loss"], label=label(run) + mem_label(run), **style)
        if ref is not None and run is not ref:
            n = min(len(run["loss"]), len(ref["loss"]))
            d = [a - b for a, b in zip(run["loss"][:n], ref["loss"][:n])]
            dmax, _ = loss_diff(run, ref)
            ax_diff.plot(range(n), d, label=f"{label(run)} (max abs {dmax:.5f})", **style)
    ax_loss.set(title=f"Training loss, config '{main_config}' (global mean)", xlabel="step", ylabel="loss")
    ax_loss.legend(fontsize=8 if len(main_runs) < 8 else 6)
    ax_loss.grid(alpha=0.3)
    ax_diff.axhline(0.0, color="black", lw=0.8)
    ax_diff.set(title="Loss minus DeepSpeed's default, same step", xlabel="step", ylabel="loss difference")
    if ax_diff.lines[1:]:
        ax_diff.legend(fontsize=8 if len(main_runs) < 8 else 6)
    ax_diff.grid(alpha=0.3)

    # Peak memory: per config, one bar per impl (the busiest rank), each rank's value as a dot.
    bars = [(c, r) for c, rs in groups.items() for r in rs if peak(r) and not is_reference(r)]
    if bars:
        x, labels, prev = 0.0, [], None
        for config, run in bars:
            if prev is not None and config != prev:
                x += 0.6
            p = [v / GIB for v in peak(run)]
            ax_mem.bar(x, max(p), color=COLORS.get(run["impl"], "0.5"), width=0.8)
            ax_mem.plot([x] * len(p), p, "o", color="white", mec="black", ms=4)
            ax_mem.text(x, max(p), f"{max(p):.1f}", ha="center", va="bottom", fontsize=8)
            labels.append((x, f"{SHORT.get(run['impl'], run['impl'])}\n{config}"))
            prev, x = config, x + 1.0
        ax_mem.set_xticks([t for t, _ in labels], [s for _, s in labels], fontsize=7)
        ax_mem.set(title="Peak allocated memory per rank", ylabel="GiB (bar: busiest rank, dots: each rank)")
        ax_mem.grid(alpha=0.3, axis="y")
    else:
        yardsticks = [r for r in main_runs if is_reference(r)]
        if ref is not None and yardsticks:  # no memory on the CPU: the criterion's windows instead
            windows(ax_mem, main_runs, ref, yardsticks, colors)
        else:
            ax_mem.text(0.5, 0.5, "no CUDA memory recorded\n(CPU run)", ha="center", va="center",
                        transform=ax_mem.transAxes)
            ax_mem.set_axis_off()
    v = runs[0]["versions"]
    fig.suptitle(f"DeepSpeed AutoEP, MiniMax-M3-style model, swiglu_oai experts: {runs[0]['world_size']} rank{'s' if runs[0]['world_size'] > 1 else ''} on "
                 f"{v.get('device', '?')}; torch {v['torch']}, DeepSpeed {v['deepspeed']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def windows(ax, runs, ref, yardsticks, colors):
    """Each run's mean loss minus ref's per 50-step window, inside the criterion's band (grey)."""
    band = criterion(ref, ref, yardsticks)["bands"]
    mid = [i * WINDOW + WINDOW / 2 for i in range(len(band))]
    ax.fill_between(mid, [-b for b in band], band, color="0.85", label="band: max(2 x yardstick, 0.01)")
    for run in runs:
        if is_deepspeed(run):
            continue
        color = colors.get(run["tag"], COLORS.get(run["impl"]))
        ax.plot(mid, criterion(run, ref, yardsticks)["windows"], "o-", ms=3, lw=1.0, color=color)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set(title="Mean loss minus the default's, per 50-step window", xlabel="step (window centre)",
           ylabel="loss difference")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="in_dirs", nargs="+", default=[os.path.join(os.environ.get("OUT", "."), "autoep")],
                   help="folder(s) of autoep_train.py's JSON files (default $OUT/autoep)")
    p.add_argument("--md", default="docs/autoep-e2e.md")
    p.add_argument("--png", default="docs/autoep-e2e-loss.png")
    args = p.parse_args(argv)
    runs = load(args.in_dirs)
    if not runs:
        sys.exit(f"autoep_report.py: no autoep_train.py results in {' '.join(args.in_dirs)}")
    tags = [(r["tag"], r.get("seed")) for r in runs]
    dup = sorted({t for t, s in tags if tags.count((t, s)) > 1})
    if dup:
        sys.exit(f"autoep_report.py: runs {dup} found more than once in {' '.join(args.in_dirs)}")
    missing = [c for c, rs in by_config(runs).items() if baseline_of(rs) is None]
    if missing:
        print(f"autoep_report.py: no run of DeepSpeed's default (--impl eager, gate_up_impl {DEFAULT_GATE_UP}) for "
              f"config(s) {missing}: no differences for them", file=sys.stderr)
    for path in (args.md, args.png):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    png_rel = os.path.relpath(os.path.abspath(args.png), os.path.dirname(os.path.abspath(args.md)))
    text = markdown(runs, png_rel, " ".join(["python3", "examples/autoep_report.py"] + sys.argv[1:]))
    with open(args.md, "w") as f:
        f.write(text)
    plot(runs, args.png)
    print(table(by_config(runs)))
    crit = criterion_table(by_config(runs))
    if crit:
        print(crit)
    seeds = seed_table(by_config(runs))
    if seeds:
        print(seeds)
    print(f"wrote {args.md} and {args.png}")


if __name__ == "__main__":
    main()
