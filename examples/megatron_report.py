"""The table (markdown) and the loss plot of the Megatron-Core MoE runs that
examples/megatron_moe.py wrote, one JSON per run:

    python3 examples/megatron_report.py --in OUT/megatron --md OUT/megatron.md --png docs/megatron-h200-loss.png

Runs are grouped by config and activation and compared with that group's baseline: Megatron's own
SequentialMLP experts as its trainer runs them by default (the "megatron" run: for SwiGLU its fused
bias-SwiGLU, for GPT-OSS's form the unfused path). The yardsticks for the other runs' differences:
"megatron-repeat", the same run again (the run-to-run nondeterminism), and the same function rounded
in another order ("megatron-unfused": SwiGLU op by op; "megatron-eager": GPT-OSS's quick_gelu
uncompiled). Older result files, which name the fused SwiGLU run "megatron-fused" and the unfused
one "megatron", are read by the fusion they ran with. Each expertact run is held to docs/spec.md
section 10's loss criterion against that baseline, the yardsticks giving the band (the criterion
of examples/autoep_report.py, imported from there: one implementation for both stacks).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # autoep_report.py, beside this file
from autoep_report import criterion as _criterion, verdict  # noqa: E402

IMPL_ORDER = ("megatron", "megatron-fused", "megatron-repeat", "megatron-unfused", "megatron-eager", "expertact",
              "expertact-inplace", "expertact-fp8", "expertact-fp8-bf16-wgrad", "expertact-fp8-promoted-wgrad",
              "expertact-fp8-blockwise")
MEGATRON = ("megatron", "megatron-fused", "megatron-repeat", "megatron-unfused", "megatron-eager")
IMPL_TEXT = {"megatron-eager": "Megatron, quick_gelu uncompiled (yardstick: another rounding)",
             "expertact": "expertact ExpertMLP (bf16)", "expertact-inplace": "expertact, in-place backward",
             "expertact-fp8": "expertact, FP8 rowwise", "expertact-fp8-bf16-wgrad": "expertact, FP8 rowwise-bf16-wgrad",
             "expertact-fp8-promoted-wgrad": "expertact, FP8 rowwise-promoted-wgrad",
             "expertact-fp8-blockwise": "expertact, FP8 blockwise"}
COLORS = {"megatron": "black", "expertact": "tab:blue", "expertact-inplace": "tab:orange", "expertact-fp8": "tab:red",
          "expertact-fp8-bf16-wgrad": "tab:olive", "expertact-fp8-promoted-wgrad": "tab:cyan",
          "expertact-fp8-blockwise": "tab:brown"}
LATE = 50  # the "late" loss differences: steps >= LATE
GIB = 2**30


def load(in_dirs):
    runs = []
    for path in sorted(p for d in in_dirs for p in glob.glob(os.path.join(d, "*.json"))):
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"megatron_report.py: skipping {path}: {e}", file=sys.stderr)
            continue
        if isinstance(run, dict) and "impl" in run and "config" in run:
            run["_path"] = path
            runs.append(run)
    return runs


def ok(run):
    return run is not None and not run.get("error") and bool(run.get("losses"))


def groups_of(runs):
    """{(config, activation): runs in IMPL_ORDER}."""
    out = {}
    for run in sorted(runs, key=lambda r: (r["config"], r.get("activation", "?"), sort_key(r))):
        out.setdefault((run["config"], run.get("activation", "?")), []).append(run)
    return out


def fusion(run):
    """bias_activation_fusion of a run: recorded, or (older files) what its impl name meant then."""
    if "bias_activation_fusion" in run:
        return bool(run["bias_activation_fusion"])
    return run["impl"] == "megatron-fused"


def default_fusion(run):
    """Megatron-LM's trainer's default for the run's form: fused SwiGLU; GPT-OSS's form unfused."""
    return run.get("activation") == "swiglu"


def is_repeat(run):
    return run["impl"] == "megatron-repeat"


def is_baseline(run):
    """Megatron's experts as its trainer runs them by default, not a repeat nor quick_gelu uncompiled."""
    return (run["impl"] in ("megatron", "megatron-fused") and fusion(run) == default_fusion(run))


def is_yardstick(run):
    return run["impl"] in MEGATRON and not is_baseline(run)


def label(run):
    if run["impl"] not in MEGATRON or run["impl"] == "megatron-eager":
        return IMPL_TEXT.get(run["impl"], run["impl"])
    if run.get("activation") == "swiglu":
        text = "Megatron SequentialMLP, " + ("fused SwiGLU" if fusion(run) else "unfused SwiGLU")
    else:
        text = "Megatron SequentialMLP, unfused"
    if is_baseline(run):
        return text + " (its trainer's default)"
    if is_repeat(run):
        return text + ", again (yardstick: run-to-run noise)"
    return text + " (yardstick: another rounding)"


def sort_key(run):
    rank = 0 if is_baseline(run) else 1 if is_repeat(run) else 2 if is_yardstick(run) else 3
    order = IMPL_ORDER.index(run["impl"]) if run["impl"] in IMPL_ORDER else len(IMPL_ORDER)
    return rank, order, run["impl"]


def reference(runs):
    return next((r for r in runs if is_baseline(r) and ok(r)), None)


def diffs(run, ref):
    """loss - ref loss per common step."""
    n = min(len(run["losses"]), len(ref["losses"]))
    return [a - b for a, b in zip(run["losses"][:n], ref["losses"][:n])]


def diff_stats(run, ref):
    """(max |d| (step), max |d| over steps >= LATE, mean |d|) as text."""
    d = [abs(x) for x in diffs(run, ref)]
    if not d:
        return "n/a", "n/a", "n/a"
    at = max(range(len(d)), key=d.__getitem__)
    late = f"{max(d[LATE:]):.2e}" if len(d) > LATE else "n/a"
    return f"{d[at]:.2e} ({at})", late, f"{sum(d) / len(d):.2e}"


def late_mean(run, n):
    return sum(run["losses"][-n:]) / n


def table(groups):
    head = ("| config | activation | run | final loss | mean loss, last steps (vs default) | mean step (ms) | tokens/s "
            "| speed-up vs default | peak GiB | max abs loss diff (step) | max abs diff, steps >= "
            f"{LATE} | mean abs diff |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (config, act), runs in groups.items():
        ref = reference(runs)
        for run in runs:
            name = label(run)
            if not ok(run):
                err = (run.get("error") or "no losses").replace("|", "/")
                lines.append(f"| {config} | {act} | {name} | failed: {err[:120]} |" + " |" * 8)
                continue
            n = min(LATE, max(1, len((ref or run)["losses"]) // 4))
            late = f"{late_mean(run, n):.4f} (last {n})"
            if ref and run is not ref:
                late += f" {late_mean(run, n) - late_mean(ref, n):+.4f}"
            speed = f"{ref['mean_step_ms'] / run['mean_step_ms']:.2f}x" if ref and run is not ref else "—"
            stats = diff_stats(run, ref) if ref and run is not ref else ("—", "—", "—")
            lines.append(f"| {config} | {act} | {name} | {run['losses'][-1]:.4f} | {late} | {run['mean_step_ms']:.1f} | "
                         f"{run['tokens_per_s']:,.0f} | {speed} | {run['peak_allocated_bytes'] / GIB:.2f} | "
                         + " | ".join(stats) + " |")
    return "\n".join(lines)


def criterion(run, ref, yardsticks):
    """docs/spec.md section 10's loss criterion of run against the baseline ref, the yardsticks'
    differences from ref giving the band (examples/autoep_report.py's, on this format's losses)."""
    as_autoep = lambda r: dict(loss=r["losses"])  # noqa: E731
    return _criterion(as_autoep(run), as_autoep(ref), [as_autoep(y) for y in yardsticks])


def criterion_table(groups):
    """Per group with a baseline and at least one yardstick, the criterion of every expertact run
    (markdown), or "" where no group has both."""
    head = ("| config | activation | run | steps | mean loss diff per 50-step window | yardsticks' largest per window "
            "| band per window | last 100: diff / band | criterion |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    fmt = lambda v, sign="+": ", ".join(f"{x:{sign}.4f}" for x in v)  # noqa: E731
    for (config, act), runs in groups.items():
        ref = reference(runs)
        ys = [r for r in runs if is_yardstick(r) and ok(r)]
        if ref is None or not ys:
            continue
        for run in runs:
            if run["impl"] in MEGATRON or not ok(run):
                continue
            c = criterion(run, ref, ys)
            lines.append(f"| {config} | {act} | {label(run)} | {c['steps']} | {fmt(c['windows'])} | "
                         f"{fmt(c['yardstick_windows'], '')} | {fmt(c['bands'], '')} | "
                         f"{c['last']:+.4f} / {c['band_last']:.4f} | {verdict(c)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def data_text(runs):
    """What the runs trained on: the byte corpus (its hashes) or, in older files, Megatron's mock data."""
    corpora = {(r["corpus"]["sha256"], r["corpus"].get("batches_sha256")): r["corpus"] for r in runs if r.get("corpus")}
    if not corpora:
        return "Megatron's MockGPTDataset (runs of consecutive token ids)"
    parts = [f"the Python standard library's .py files as byte tokens (examples/byte_corpus.py: {c['files']} files, "
             f"{c['bytes']:,} bytes, sha256 {c['sha256'][:16]}..., Python's own stdlib at {c['root']}), "
             f"{c.get('windows_per_step')} windows of {c.get('window_bytes')} bytes a step from seed {c.get('seed')} "
             f"(batches sha256 {str(c.get('batches_sha256'))[:16]}...)" for c in corpora.values()]
    return "; ".join(parts)


def setup_text(groups):
    out = []
    for (config, act), runs in groups.items():
        r = next((x for x in runs if ok(x)), runs[0])
        s, v = r["sizes"], r.get("versions", {})
        out.append(
            f"- **{config} / {act}**: Megatron-Core GPTModel (local spec, no TransformerEngine), {s['layers']} layers, "
            f"every one MoE: {s['experts']} experts (ffn {s['ffn']}, top-{s['top_k']}, aux-loss load balancing, "
            f"alltoall dispatcher), hidden {s['hidden']}, {s['heads']} heads, RMSNorm, RoPE, vocab {s['vocab']}; "
            f"{r['world_size']} GPU(s), expert parallelism {r['ep']}, data parallelism {r['dp']}; "
            f"{s['micro_batch']} x {s['seq']} tokens per rank and step ({r['tokens_per_step']:,} a step); bf16, "
            f"Adam lr {s['lr']} ({r.get('lr_warmup')} warm-up steps, then constant), clip 1.0; seed {r['seed']}; "
            f"{r['steps']} steps, times and peak memory over steps {r['warmup']}..{r['steps'] - 1} (slowest rank, "
            f"synchronized; torch.cuda.max_memory_allocated). Loss: {r.get('loss_kind', 'LM loss')}. "
            f"{v.get('device', '?')}, torch {v.get('torch', '?')}, megatron-core {v.get('megatron_core', '?')}, "
            f"expertact {v.get('expertact', '?')}, CUDA {v.get('cuda', '?')}.")
    return "\n".join(out)


def markdown(runs, png_rel, report_cmd):
    groups = groups_of(runs)
    lines = ["# Megatron-Core MoE training: Megatron's experts against expertact's", "",
             "Written by examples/megatron_report.py from the JSON files of examples/megatron_moe.py. Every run of a "
             f"group starts from the same weights and trains on the same batches: {data_text(runs)}.", "",
             f"![loss curves and their difference from Megatron's]({png_rel})" if png_rel else "(no plot)", "",
             table(groups), ""]
    crit = criterion_table(groups)
    if crit:
        lines += ["The loss criterion (docs/spec.md section 10) of each expertact run against Megatron's default: "
                  "every 50-step window's mean within max(2x the largest yardstick difference in that window, 0.01), "
                  "the last 100 steps within max(the largest yardstick difference there, 0.5% of the loss); a miss "
                  "on either side is a miss.", "", crit, ""]
    lines += ["Default: Megatron's SequentialMLP as its trainer runs it by default (SwiGLU: bias_activation_fusion on, "
              "Megatron-LM's --bias-swiglu-fusion; GPT-OSS's form: unfused, Megatron's fused quick-GeGLU computing "
              "another function). Loss differences, speed-ups and the last steps' mean loss are against it, per step. "
              "Yardsticks: the default again (run-to-run nondeterminism) and the same function rounded in another "
              "order (SwiGLU unfused; GPT-OSS's quick_gelu uncompiled). The peer is SequentialMLP (a loop over the "
              "experts); TEGroupedMLP (TransformerEngine's grouped GEMMs) was not measured.", "", "## Setup", "",
              setup_text(groups), "", "## Commands", ""]
    ordered = [r["command"] for rs in groups.values() for r in rs]
    lines += [f"    {c}" for c in dict.fromkeys(ordered)]
    lines += [f"    {report_cmd}", ""]
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(k, rs) for k, rs in groups_of(runs).items() if any(ok(r) for r in rs)]
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 4.2 * len(groups)), squeeze=False)
    for (ax_loss, ax_diff), ((config, act), rs) in zip(axes, groups):
        ref = reference(rs)
        for run in filter(ok, rs):
            yard = is_yardstick(run)
            style = dict(color="0.6" if yard else COLORS.get(run["impl"], "black"), lw=1.0, ls="--" if yard else "-")
            name = label(run)
            ax_loss.plot(range(len(run["losses"])), run["losses"], label=name, **style)
            if ref is not None and run is not ref:
                d = diffs(run, ref)
                ax_diff.plot(range(len(d)), d, label=f"{name} (max abs {max(map(abs, d)):.1e})", **style)
        ax_loss.set(title=f"LM loss, {config} / {act}", xlabel="step", ylabel="loss", yscale="log")
        if ref is None:
            ax_diff.text(0.5, 0.5, "no successful run of Megatron's default to compare with", ha="center", va="center",
                         transform=ax_diff.transAxes)
        ax_diff.axhline(0.0, color="black", lw=0.6)
        ax_diff.set(title="loss minus Megatron's default (same step)", xlabel="step", ylabel="difference")
        for ax in (ax_loss, ax_diff):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    v = next(r for r in runs if ok(r)).get("versions", {})
    fig.suptitle(f"Megatron-Core MoE, {v.get('device', '?')}: torch {v.get('torch', '?')}, megatron-core "
                 f"{v.get('megatron_core', '?')}, expertact {v.get('expertact', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="in_dirs", nargs="+", default=[os.path.join(os.environ.get("OUT", "."), "megatron")],
                   help="folder(s) of megatron_moe.py's JSON files (default $OUT/megatron)")
    p.add_argument("--md", default=None, help="write the markdown here (default: print the table only)")
    p.add_argument("--png", default=None, help="write the plot here")
    args = p.parse_args(argv)
    runs = load(args.in_dirs)
    if not runs:
        sys.exit(f"megatron_report.py: no megatron_moe.py results in {' '.join(args.in_dirs)}")
    seen = {}
    for r in runs:
        key = (r["config"], r.get("activation"), r["impl"])
        if key in seen:
            sys.exit(f"megatron_report.py: {key} found twice: {seen[key]} and {r['_path']}")
        seen[key] = r["_path"]
    for (config, act), rs in groups_of(runs).items():
        if reference(rs) is None:
            print(f"megatron_report.py: no successful run of Megatron's default for {config}/{act}: no comparisons there",
                  file=sys.stderr)
    if args.png and not any(ok(r) for r in runs):
        print("megatron_report.py: no successful run: no plot", file=sys.stderr)
        args.png = None
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        plot(runs, args.png)
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        png_rel = os.path.relpath(os.path.abspath(args.png), os.path.dirname(os.path.abspath(args.md))) \
            if args.png else None
        with open(args.md, "w") as f:
            f.write(markdown(runs, png_rel, " ".join(["python3", "examples/megatron_report.py"] + sys.argv[1:])))
    print(table(groups_of(runs)))
    crit = criterion_table(groups_of(runs))
    if crit:
        print("\n" + crit)
    written = [x for x in (args.md, args.png) if x]
    if written:
        print("wrote " + " and ".join(written))


if __name__ == "__main__":
    main()
