"""Fine-tuning comparison of expert implementations on a GPT-OSS-architecture model.

One command trains the same randomly initialised GPT-OSS model (transformers' GptOssConfig scaled
down, fixed seed, non-zero expert biases, no download) on the same batches of real text for N
steps with each of several experts implementations, and writes a JSON record, a markdown table
and an SVG plot of the loss curves:

    python examples/finetune_gpt_oss.py --out OUT/finetune            # on a GPU: --size h200, bf16
    python examples/finetune_gpt_oss.py --size tiny --steps 20 --out /tmp/ft   # CPU smoke run, float32

Variants (--variants, comma-separated, run in this order; the first is the baseline):

  grouped_mm         transformers' "grouped_mm" experts (torch grouped GEMM): the baseline
  eager              transformers' "eager" experts, the class's own per-expert loop: the same
                     function computed with other kernels (one GEMM per expert instead of one
                     grouped GEMM) and another accumulation (index_add_ of the K contributions in
                     the hidden dtype instead of a float32 sum). Its distance from the baseline is
                     the yardstick: how far two correct bf16 implementations drift apart
  expertact          expertact.transformers' "expertact" (import expertact.transformers)
  expertact_inplace  registered here with expertact.transformers.register("expertact_inplace",
                     inplace_backward=True): gate_up's gradient written over gate_up
  expertact_recompute  register(..., recompute=True): h recomputed in backward (not run by default)
  expertact_repeat   "expertact" again: are two identical runs bit-identical?
  expertact_fp8      register(..., fp8=RECIPE): the expert GEMMs in float8 e4m3 with the recipe
                     --fp8 names (a name of expertact.moe.FP8_RECIPES, or "default", the
                     default, for fp8=True: expertact.moe.DEFAULT_FP8_RECIPE). Hopper, or the
                     recipe's emulation on the CPU (--dtype bf16); not run by default
  grouped_mm_repeat  "grouped_mm" again (not run by default)

A repeat is compared with the run it repeats, from the same command or from an earlier one into
the same --out folder with the same setup (a comparison can be split over several commands).

Data: the Python standard library's own .py files (found through sysconfig's "stdlib" path, not
site-packages), in sorted path order, each file as <bos> + its bytes + <eos> (vocab 256 bytes + 2
special ids: no tokenizer), cut into consecutive windows of seq + 1 tokens; the windows are
visited in one fixed permutation (drawn from --seed), batch after batch, so every variant sees
the same batches.

Determinism (default on; --no-deterministic turns it off): CUBLAS_WORKSPACE_CONFIG=:4096:8 (set
before CUDA starts) and torch.use_deterministic_algorithms(True, warn_only=True): ops with a
deterministic implementation use it (index_put/index_add with accumulation, used by transformers'
gathers' backward, sort-based instead of atomics) and the others warn; the warnings seen in each
variant's first steps are recorded under "determinism_warnings". Attention is transformers'
eager attention (GPT-OSS's sinks have no SDPA path), plain GEMMs and softmax. Uninitialised-memory
filling is left off (torch.utils.deterministic.fill_uninitialized_memory = False): it is not
needed for determinism and would cost every variant extra memory traffic.

Per variant the record holds: steady-state tokens/s (steps after --warmup, each step timed
between two CUDA synchronisations), peak allocated memory (torch.cuda.max_memory_allocated,
reset once the variant's model is on the device: parameters, gradients, AdamW's states and
activations), the loss of every step, the final loss
(mean of the last 10 steps), the largest |loss difference| against the baseline and against the
yardstick over all steps, and for a repeat whether its losses and final parameters are
bit-identical to the run it repeats; with --profile N, where the step goes (N profiled steps after the
warm-up, left out of the timing; OUT/profile-VARIANT.txt). --arch qwen3_moe runs the same comparison
on a Qwen3-MoE model of the same sizes (no expert biases) as a control. See docs/finetune.md.
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
import traceback
import warnings
from pathlib import Path

BOS, EOS = 256, 257
VOCAB = 258

# Model and batch presets. "h200": the experts see 65,536 tokens x top-4 = 262,144 rows per layer
# and step (see docs/finetune.md for the FLOP estimate). "20b-experts": two layers as GPT-OSS-20B
# has them (its config: hidden = expert intermediate = 2,880, 32 experts, top-4, 64 query heads,
# 8 KV heads of 64), 32,768 tokens a step: the expert GEMMs a user fine-tuning that model runs,
# where "h200"'s are too small for FP8 to pay. "tiny": the CPU test, seconds.
SIZES = {
    "h200": dict(hidden=1024, intermediate=1024, experts=32, top_k=4, layers=4, heads=16, kv_heads=4,
                 head_dim=64, seq=256, batch=256, sliding_window=128),
    "20b-experts": dict(hidden=2880, intermediate=2880, experts=32, top_k=4, layers=2, heads=64, kv_heads=8,
                        head_dim=64, seq=256, batch=128, sliding_window=128),
    "tiny": dict(hidden=64, intermediate=64, experts=4, top_k=2, layers=2, heads=4, kv_heads=2,
                 head_dim=16, seq=32, batch=4, sliding_window=16),
}
SIZE_KEYS = tuple(SIZES["h200"])

# name -> (experts_implementation, memory modes for register() or None, the variant it repeats)
VARIANTS = {
    "grouped_mm": ("grouped_mm", None, None),
    "eager": ("eager", None, None),
    "expertact": ("expertact", None, None),
    "expertact_inplace": ("expertact_inplace", dict(inplace_backward=True), None),
    "expertact_recompute": ("expertact_recompute", dict(recompute=True), None),
    "expertact_repeat": ("expertact", None, "expertact"),
    "expertact_fp8": ("expertact_fp8", dict(fp8=True), None),
    "grouped_mm_repeat": ("grouped_mm", None, "grouped_mm"),
}
DEFAULT_VARIANTS = ("grouped_mm", "eager", "expertact", "expertact_inplace", "expertact_repeat")
BASELINE, YARDSTICK = "grouped_mm", "eager"
FINAL_WINDOW = 10


def check_variants(p, names, variants):
    """Refuses (p.error) a variant not in ``variants`` (name -> a tuple whose third item is the
    variant it repeats, or None), none at all, one listed twice, or a repeat listed before the
    run it repeats. Both examples' variant lists."""
    bad = [v for v in names if v not in variants]
    if bad or not names:
        p.error(f"unknown variants {bad}; choose from {', '.join(variants)}")
    if len(set(names)) != len(names):
        p.error("a variant is listed twice")
    for v in names:
        rep = variants[v][2]
        if rep is not None and rep in names and names.index(rep) > names.index(v):
            p.error(f"{v} repeats {rep}: list {rep} before it")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--size", choices=tuple(SIZES), default=None,
                   help="size preset: h200 (default on CUDA), 20b-experts (GPT-OSS-20B's layer dims, two "
                        "layers) or tiny (default on the CPU)")
    for key in SIZE_KEYS:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"override the preset's {key}")
    p.add_argument("--arch", choices=("gpt_oss", "qwen3_moe"), default="gpt_oss",
                   help="gpt_oss (expert biases) or qwen3_moe (no biases; a control)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N steps after the warm-up (torch.profiler; left out of the timing): where each "
                        "variant's step goes, in OUT/profile-VARIANT.txt and the record's \"profile\"")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="bf16 on CUDA, fp32 on the CPU by default")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bias-std", type=float, default=0.02,
                   help="std of the random expert biases set after init (gpt_oss)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--fp8", default="default", metavar="RECIPE",
                   help="expertact_fp8's FP8 recipe: a name of expertact.moe.FP8_RECIPES, or default (fp8=True, "
                        "expertact.moe.DEFAULT_FP8_RECIPE, \"blockwise\"; the default)")
    p.add_argument("--out", default="finetune_out")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    check_variants(p, names, VARIANTS)
    args.variant_names = names
    args.fp8_modes = None
    if "expertact_fp8" in names:
        from expertact.moe import fp8_recipe
        try:  # resolved as every fp8= argument is: an unknown name is refused naming the recipes
            recipe = fp8_recipe(True if args.fp8 == "default" else args.fp8, "finetune_gpt_oss.py --fp8")
        except ValueError as e:
            p.error(str(e))
        args.fp8_modes = dict(fp8=recipe)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.profile < 0 or (args.profile and args.steps <= args.warmup + args.profile):
        p.error(f"--profile {args.profile}: needs --steps ({args.steps}) above --warmup + N, so that timed steps "
                "remain")
    return args


# ---------------------------------------------------------------------------
# data: the standard library's .py files, byte-level
# ---------------------------------------------------------------------------

def load_tokens():
    """All .py files under the standard library (not site-packages), sorted by path, each as
    <bos> bytes <eos>. Returns (int16 tensor of token ids, description)."""
    import torch
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    parts, digest = [], hashlib.sha256()
    for f in files:
        b = f.read_bytes()
        digest.update(b)
        parts.append(torch.tensor([BOS], dtype=torch.int16))
        parts.append(torch.frombuffer(bytearray(b), dtype=torch.uint8).to(torch.int16) if b else
                     torch.empty(0, dtype=torch.int16))
        parts.append(torch.tensor([EOS], dtype=torch.int16))
    tokens = torch.cat(parts)
    if tokens.numel() < 1 << 20:  # CPython's own sources are ~30 MB; a stripped install ships .pyc only
        raise SystemExit(f"only {tokens.numel()} tokens of .py sources under {root}")
    return tokens, dict(root=str(root), files=len(files), tokens=int(tokens.numel()), sha256=digest.hexdigest())


class Batches:
    """Step s's [batch, seq + 1] window: fixed consecutive windows of the token stream, visited in
    one permutation drawn from the seed (wrapping round after an epoch)."""

    def __init__(self, tokens, seq, batch, seed):
        import torch
        self.windows = tokens[:(tokens.numel() // (seq + 1)) * (seq + 1)].view(-1, seq + 1)
        if self.windows.shape[0] < batch:
            raise SystemExit(f"the corpus has {self.windows.shape[0]} windows of {seq + 1} tokens, fewer than "
                             f"one batch ({batch})")
        self.order = torch.randperm(self.windows.shape[0], generator=torch.Generator().manual_seed(seed))
        self.batch = batch

    def __call__(self, step):
        import torch
        n = self.order.numel()
        idx = self.order[(step * self.batch + torch.arange(self.batch)) % n]
        return self.windows[idx].long()

    @property
    def epoch_steps(self):
        return self.order.numel() // self.batch


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------

def build_model(arch, s, seed, bias_std):
    """A randomly initialised causal LM (float32, CPU), the same for the same arguments."""
    import torch
    common = dict(vocab_size=VOCAB, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                  num_experts_per_tok=s["top_k"], use_cache=False,
                  tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None)
    if arch == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM
        # max_position_embeddings stays GPT-OSS's (131072 = 32 x 4096, its YaRN rope scaling).
        cfg = GptOssConfig(intermediate_size=s["intermediate"], num_local_experts=s["experts"],
                           sliding_window=s["sliding_window"], **common)
        cls = GptOssForCausalLM
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg = Qwen3MoeConfig(intermediate_size=s["intermediate"], moe_intermediate_size=s["intermediate"],
                             max_position_embeddings=s["seq"],
                             num_experts=s["experts"], norm_topk_prob=True, decoder_sparse_step=1, **common)
        cls = Qwen3MoeForCausalLM
    # GPT-OSS's attention sinks have no SDPA path; eager attention (GEMMs and a softmax) for both.
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    if arch == "gpt_oss":
        # transformers initialises the expert biases to zero; non-zero ones exercise the bias path.
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == "GptOssExperts":
                    m.gate_up_proj_bias.copy_(torch.randn(m.gate_up_proj_bias.shape, generator=g) * bias_std)
                    m.down_proj_bias.copy_(torch.randn(m.down_proj_bias.shape, generator=g) * bias_std)
    return model, cfg


def register_variants(names, fp8_modes=None):
    """Imports expertact.transformers (registering "expertact") and registers the memory-mode
    variants that `names` use; expertact_fp8 with fp8_modes (its recipe, from --fp8)."""
    import expertact.transformers as xt
    for n in names:
        impl, modes, _ = VARIANTS[n]
        if n == "expertact_fp8" and fp8_modes is not None:
            modes = fp8_modes
        if modes is not None:
            xt.register(impl, **modes)


def cast_params(model, dtype):
    """Every parameter to `dtype` (pure bf16 training in a bf16 run); buffers such as the rotary
    tables keep their dtype (float32), as when a model is loaded in bf16 rather than cast."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def params_digest(model):
    """sha256 of every parameter's bytes, in named_parameters order: equal digests = bit-identical."""
    import torch
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------
# the training loop (shared with examples/torchtitan_moe_loop.py)
# ---------------------------------------------------------------------------

def setup_determinism(deterministic):
    """Call before CUDA starts. Returns a description of what was set."""
    if not deterministic:
        return dict(deterministic=False)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return dict(deterministic=True, use_deterministic_algorithms="True, warn_only=True",
                CUBLAS_WORKSPACE_CONFIG=os.environ["CUBLAS_WORKSPACE_CONFIG"], fill_uninitialized_memory=False)


def make_optimizer(model, lr, steps):
    """AdamW (betas 0.9/0.95, weight decay 0.1, torch's default foreach implementation) with a
    linear warm-up over the first min(20, steps // 10) steps, then constant."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ramp = max(1, min(20, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / ramp))
    return opt, sched


def train_loop(tag, model, loss_fn, batches, args, device, tokens_per_step, log=print):
    """Trains `model` for args.steps steps; loss_fn(model, ids) returns the scalar loss. Returns
    per-step losses and times, the determinism warnings seen in the first two steps and the peak
    allocated bytes (CUDA) since the caller's reset."""
    import torch
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    opt, sched = make_optimizer(model, args.lr, args.steps)
    model.train()
    losses, times, seen = [], [], []
    routing, probe = {}, _RoutingProbe(model)
    probe_steps = {0, args.steps // 2, args.steps - 1}
    n_prof = getattr(args, "profile", 0)
    profiled, prof, profile_out = range(args.warmup, args.warmup + n_prof), None, {}
    try:
        for step in range(args.steps):
            probe.armed = step in probe_steps
            ids = batches(step).to(device, non_blocking=True)
            sync()
            if n_prof and step == profiled.start:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                prof = profile(activities=acts)
                prof.__enter__()
            with warnings.catch_warnings(record=True) as caught:
                if step < 2:
                    warnings.simplefilter("always")
                t0 = time.perf_counter()
                loss = loss_fn(model, ids)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                sync()
                times.append(time.perf_counter() - t0)
            if prof is not None and step + 1 == profiled.stop:
                prof.__exit__(None, None, None)
                profile_out = _profile_summary(tag, prof, sum(times[profiled.start:]), n_prof, args.out, log)
                prof = None
            for w in caught:
                msg = str(w.message)
                if "determinis" in msg and msg not in seen:
                    seen.append(msg)
            if probe.armed:  # counted after the step's clock stopped
                routing[str(step)] = probe.take()
            losses.append(float(loss.detach().float().item()))
            if not math.isfinite(losses[-1]):
                raise FloatingPointError(f"{tag}: loss {losses[-1]} at step {step}")
            if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
                log(f"[{tag}] step {step + 1:4d}/{args.steps} loss {losses[-1]:.4f} step {times[-1] * 1e3:8.1f} ms "
                    f"{tokens_per_step / times[-1]:10.0f} tok/s peak {peak:.2f} GiB", flush=True)
    finally:  # a step that raised leaves no profiler running into the next variant
        if prof is not None:
            prof.__exit__(None, None, None)
    if seen:
        log(f"[{tag}] determinism warnings in the first steps: " + " | ".join(m.splitlines()[0] for m in seen),
            flush=True)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    probe.remove()
    del opt, sched
    out = dict(loss=losses, step_time_s=times, determinism_warnings=seen, peak_allocated_bytes=peak,
               routing=routing)
    if n_prof:
        out.update(profile=profile_out, profiled_steps=[profiled.start, profiled.stop])
    return out


def _profile_summary(tag, prof, wall_s, steps, out, log):
    """The profiled steps' summary (expertact.bench.trace), written to OUT/profile-TAG.txt and
    returned for the record."""
    from expertact.bench import trace
    s = trace.summarise(prof.events(), wall_s, steps)
    text = trace.report(s, tag)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"profile-{tag}.txt").write_text(text + "\n")
    log(text, flush=True)
    return s


class _RoutingProbe:
    """The rows each expert receives, per MoE layer, at the steps the loop arms it for: a
    forward pre-hook on every experts module (transformers calls them as experts(hidden,
    top_k_index, top_k_weights)) keeps a copy of the routed expert ids, counted on the CPU after
    the step (no sync inside the timed step, and no nondeterministic CUDA op). take() gives,
    per layer, the busiest expert's rows and their ratio to an even share: the skew that a
    computation walking each expert's rows in turn pays for."""

    def __init__(self, model):
        self.armed, self.ids, self.handles = False, [], []
        for module in model.modules():
            if type(module).__name__.endswith("Experts") and hasattr(module, "num_experts"):
                self.handles.append(module.register_forward_pre_hook(self._hook))

    def _hook(self, module, args):
        if self.armed and len(args) > 1 and hasattr(args[1], "dtype") and not args[1].dtype.is_floating_point:
            self.ids.append((module.num_experts, args[1].detach().clone()))

    def take(self):
        import torch
        layers = []
        for n_experts, ids in self.ids:
            counts = torch.bincount(ids.flatten().cpu().long(), minlength=n_experts)
            even = ids.numel() / n_experts
            layers.append(dict(busiest_rows=int(counts.max()), busiest_over_even=round(float(counts.max()) / even, 3)))
        self.ids = []
        return layers

    def remove(self):
        for h in self.handles:
            h.remove()


def summarise(record, warmup, tokens_per_step):
    """Adds tokens/s (steps from `warmup` on, but for profiled ones), mean step time and final
    loss to a variant record."""
    times, losses = record["step_time_s"], record["loss"]
    w = min(warmup, len(times) - 1)
    skip = range(*record.get("profiled_steps", (0, 0)))  # the profiler's steps: slower, not timed
    steady = [t for i, t in enumerate(times) if i >= w and i not in skip]
    record["timed_from_step"] = w
    record["mean_step_time_s"] = sum(steady) / len(steady)
    record["tokens_per_s"] = tokens_per_step * len(steady) / sum(steady)
    tail = losses[-FINAL_WINDOW:]
    record["final_loss"] = sum(tail) / len(tail)
    probes = [layer["busiest_over_even"] for layers in record.get("routing", {}).values() for layer in layers]
    record["busiest_expert_over_even"] = max(probes) if probes else None
    return record


def compare(variants, baseline, yardstick):
    """Fills max |loss difference| against the baseline and the yardstick, and for repeats whether
    losses and parameters are bit-identical to the run they repeat."""
    def maxdiff(a, b):
        if a is None or b is None or "loss" not in a or "loss" not in b:
            return None
        n = min(len(a["loss"]), len(b["loss"]))
        return max(abs(x - y) for x, y in zip(a["loss"][:n], b["loss"][:n]))

    for name, r in variants.items():
        if "loss" not in r:
            continue
        r["max_abs_loss_diff_vs_baseline"] = maxdiff(r, variants.get(baseline))
        r["max_abs_loss_diff_vs_yardstick"] = maxdiff(r, variants.get(yardstick))
        rep = r.get("repeats")
        if rep is not None and "loss" in variants.get(rep, {}):
            o = variants[rep]
            r["bit_identical_losses"] = r["loss"] == o["loss"]
            r["bit_identical_params"] = r.get("params_sha256") == o.get("params_sha256")
            r["steps_with_different_loss"] = sum(x != y for x, y in zip(r["loss"], o["loss"]))


# ---------------------------------------------------------------------------
# outputs: JSON, markdown table, SVG
# ---------------------------------------------------------------------------

def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def markdown_table(result):
    rows = ["| variant | implementation | tokens/s | step (ms) | peak memory (GiB) | final loss | "
            f"max abs loss diff vs {result['baseline']} | max abs loss diff vs {result['yardstick']} | "
            "repeat bit-identical | busiest expert / even share |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, r in result["variants"].items():
        if "error" in r:
            rows.append(f"| {name} | {r['implementation']} | failed: {r['error'].splitlines()[0][:160]} "
                        "| | | | | | | |")
            continue
        peak = None if r.get("peak_allocated_bytes") is None else r["peak_allocated_bytes"] / 2**30
        if "bit_identical_losses" in r:
            same = (f"losses {'yes' if r['bit_identical_losses'] else 'no'}, params "
                    f"{'yes' if r['bit_identical_params'] else 'no'} (vs {r['repeats']})")
        elif r.get("repeats"):
            same = f"no {r['repeats']} run to compare with"
        else:
            same = ""
        rows.append(f"| {name} | {r['implementation']} | {_fmt(r['tokens_per_s'], ',.0f')} | "
                    f"{_fmt(r['mean_step_time_s'] * 1e3, '.1f')} | {_fmt(peak, '.2f')} | {_fmt(r['final_loss'], '.4f')} | "
                    f"{_fmt(r.get('max_abs_loss_diff_vs_baseline'), '.3g')} | "
                    f"{_fmt(r.get('max_abs_loss_diff_vs_yardstick'), '.3g')} | {same} | "
                    f"{_fmt(r.get('busiest_expert_over_even'), '.2f')} |")
    s = result["setup"]
    head = (f"{result['title']}: {s['steps']} steps, {s['tokens_per_step']:,} tokens per step, "
            f"{s['expert_rows_per_layer']:,} expert rows per layer and step, {s['dtype']}, "
            f"{result['versions'].get('device', '?')}, {result['date']}.\n"
            f"Command: `{result['command']}`\n\n"
            f"tokens/s over steps {s['warmup']}..{s['steps'] - 1}{_profiled(s)}; final loss: mean of the last {FINAL_WINDOW} steps; "
            f"loss differences: largest over all steps.\n\n")
    return head + "\n".join(rows) + "\n" + criterion_lines(result)


def _profiled(setup):
    n = setup.get("profile") or 0
    return f" but the {n} profiled ({setup['warmup']}..{setup['warmup'] + n - 1}; OUT/profile-*.txt)" if n else ""


def criterion_lines(result):
    """docs/spec.md section 10's criterion for every FP8 variant against each bf16 baseline there
    is: expertact's bf16 run (the FP8 path's own bf16) and transformers' default (grouped_mm), the
    other bf16 variants the yardsticks. Its loss half is autoep_report.criterion; its speed half
    the FP8 step against the fastest bf16 expertact run's (the whole-MLP runs here), at least
    autoep_report.DEFAULT_SPEEDUP x. "" without an FP8 variant or a yardstick."""
    import autoep_report  # a sibling example: the criterion is written once
    ok = {n: r for n, r in result["variants"].items() if "loss" in r and "error" not in r}
    fp8 = [n for n, r in ok.items() if r["implementation"] == "expertact_fp8"]
    bf16_mlp = [r["mean_step_time_s"] for n, r in ok.items()
                if n not in fp8 and r["implementation"].startswith("expertact") and "mean_step_time_s" in r]
    speed = {}  # the step half, per FP8 variant (the same against either baseline)
    for n in fp8:
        up = min(bf16_mlp) / ok[n]["mean_step_time_s"] if bf16_mlp and "mean_step_time_s" in ok[n] else None
        speed[n] = ("no bf16 expertact run" if up is None else
                    f"{up:.3f}x: {'PASS' if up >= autoep_report.DEFAULT_SPEEDUP else 'FAIL'}")
    lines = []
    for base in ("expertact", BASELINE):
        ys = [n for n in ok if n != base and n not in fp8]
        if base not in ok or not ys:
            continue
        for n in fp8:
            c = autoep_report.criterion(ok[n], ok[base], [ok[y] for y in ys])
            lines.append(f"| {n} ({ok[n].get('fp8', '?')}) | {base} | {', '.join(ys)} | "
                         f"{', '.join(f'{x:+.4f}' for x in c['windows'])} | "
                         f"{', '.join(f'{x:.4f}' for x in c['bands'])} | "
                         f"{c['last']:+.4f} / {c['band_last']:.4f} | {autoep_report.verdict(c)} | {speed[n]} |")
    if not lines:
        return ""
    return ("\nThe criterion (docs/spec.md section 10). Loss: per 50-step window the FP8 run's mean loss minus "
            "the baseline's, within max(2 x the largest yardstick difference, 0.01); over the last 100 steps "
            "within max(the largest yardstick difference, 0.5% of the loss). Step: the fastest bf16 expertact "
            f"run's over the FP8 run's, at least {autoep_report.DEFAULT_SPEEDUP}x.\n\n"
            "| FP8 run (recipe) | baseline | yardsticks | diff per window | band per window | "
            "last 100: diff / band | loss | step vs the fastest bf16 expertact |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(lines) + "\n")


def svg_plot(result, width=900, height=640):
    """Two panels: the loss of each variant per step, and |loss - baseline loss| (log scale)."""
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    runs = [(n, r) for n, r in result["variants"].items() if "loss" in r]
    base = result["variants"].get(result["baseline"], {}).get("loss")
    ml, mr, top, gap = 70, 170, 30, 60
    ph = (height - top - gap - 40) // 2
    pw = width - ml - mr
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" fill="white"/>']

    def panel(y0, series, title, logy):
        pts = [v for _, ys, _ in series for v in ys if v is not None and (not logy or v > 0)]
        out.append(f'<text x="{ml}" y="{y0 - 8}" font-size="13">{title}</text>')
        out.append(f'<rect x="{ml}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
        if not pts:
            out.append(f'<text x="{ml + 10}" y="{y0 + 20}">no data</text>')
            return
        tr = (lambda v: math.log10(v)) if logy else (lambda v: v)
        lo, hi = tr(min(pts)), tr(max(pts))
        if hi - lo < 1e-12:
            lo, hi = lo - 1, hi + 1
        n = max(len(ys) for _, ys, _ in series)

        def xy(i, v):
            return ml + pw * i / max(1, n - 1), y0 + ph * (1 - (tr(v) - lo) / (hi - lo))

        for k in range(5):
            val = lo + (hi - lo) * k / 4
            y = y0 + ph * (1 - k / 4)
            label = f"{10 ** val:.1e}" if logy else f"{val:.3g}"
            out.append(f'<line x1="{ml - 4}" y1="{y:.1f}" x2="{ml}" y2="{y:.1f}" stroke="#444"/>'
                       f'<text x="{ml - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        for i in sorted({round((n - 1) * k / 4) for k in range(5)}):
            x = ml + pw * i / max(1, n - 1)
            out.append(f'<text x="{x:.1f}" y="{y0 + ph + 15}" text-anchor="middle">{i}</text>')
        for j, (name, ys, colour) in enumerate(series):
            seg, segs = [], []
            for i, v in enumerate(ys):
                if v is None or (logy and v <= 0):
                    if seg:
                        segs.append(seg)
                    seg = []
                    continue
                seg.append("%.1f,%.1f" % xy(i, v))
            if seg:
                segs.append(seg)
            dash = ' stroke-dasharray="5,3"' if "repeat" in name else ""
            for sg in segs:
                out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.2"{dash} points="{" ".join(sg)}"/>')
            ly = y0 + 14 + 16 * j
            out.append(f'<line x1="{ml + pw + 10}" y1="{ly - 4}" x2="{ml + pw + 30}" y2="{ly - 4}" stroke="{colour}" '
                       f'stroke-width="2"{dash}/><text x="{ml + pw + 35}" y="{ly}">{name}</text>')

    series = [(n, r["loss"], colours[i % len(colours)]) for i, (n, r) in enumerate(runs)]
    panel(top, series, f"{result['title']}: training loss per step", False)
    diffs = [(n, [abs(a - b) for a, b in zip(r["loss"], base)], colours[i % len(colours)])
             for i, (n, r) in enumerate(runs) if base is not None and n != result["baseline"]]
    panel(top + ph + gap, diffs, f"|loss - {result['baseline']} loss| per step (log scale; zero not drawn)", True)
    out.append(f'<text x="{ml + pw / 2}" y="{height - 8}" text-anchor="middle">step</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_outputs(result, out):
    """results.json, results.md and loss_curves.svg in `out`."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown_table(result))
    with open(os.path.join(out, "loss_curves.svg"), "w") as f:
        f.write(svg_plot(result))


def previous_variants(out, setup_key):
    """Variant records of an earlier run into the same folder with the same setup (so a run can be
    split into several commands, each listing some variants); {} otherwise."""
    try:
        with open(os.path.join(out, "results.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    return old.get("variants", {}) if old.get("setup_key") == setup_key else {}


def start_result(title, setup, device, names, out, argv, baseline, yardstick):
    """The run's record: its setup (and that setup's key, which decides whether an earlier run's
    variants in ``out`` are kept beside this one's), versions, command and date; the variants of
    an earlier run with the same setup, less those in ``names`` (run again here)."""
    keyed = {k: v for k, v in setup.items() if k != "profile"}  # profiled or not, the same losses
    setup_key = hashlib.sha256(json.dumps([keyed, str(device)], sort_keys=True, default=str).encode()).hexdigest()
    result = dict(title=title, baseline=baseline, yardstick=yardstick, setup=setup, setup_key=setup_key,
                  versions=versions(device),
                  command=" ".join([os.path.basename(sys.executable)] + [sys.argv[0]] + list(argv or sys.argv[1:])),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    variants = previous_variants(out, setup_key)
    for name in names:
        variants.pop(name, None)
    result["variants"] = variants
    return result


def train_variants(names, result, new_record, new_model, prepare, loss_fn, batches, args, device, tokens_per_step,
                   log):
    """Trains each variant in turn and records it in result["variants"] (written out after each):
    new_record(name) -> its record; new_model(name) -> the model (or None, to build it in
    prepare); prepare(name, model, record) -> the model ready to train. A variant that fails
    (an implementation that refuses the model, out of memory, ...) is recorded with its error
    and the others still run; the exit status says so."""
    import torch
    variants = result["variants"]
    for name in names:
        record = new_record(name)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        model = new_model(name)
        try:
            model = prepare(name, model, record)
            if device.type == "cuda":  # the training's peak, not the model's setup
                torch.cuda.reset_peak_memory_stats(device)
            record.update(train_loop(name, model, loss_fn, batches, args, device, tokens_per_step, log))
            record["params_sha256"] = params_digest(model)
            summarise(record, args.warmup, tokens_per_step)
        except Exception as e:  # noqa: BLE001  (recorded; the other variants still run)
            record["error"] = f"{type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc()[-6000:]
            log(record["traceback"], flush=True)
            log(f"[{name}] failed: {record['error']}", flush=True)
        del model
        variants[name] = record
        compare(variants, result["baseline"], result["yardstick"])
        write_outputs(result, args.out)
        if "error" not in record:
            peak = record["peak_allocated_bytes"]
            log(f"[{name}] {record['tokens_per_s']:,.0f} tok/s, final loss {record['final_loss']:.4f}, peak "
                f"{_fmt(None if peak is None else peak / 2**30, '.2f')} GiB", flush=True)
    log(markdown_table(result), flush=True)
    log(f"wrote {args.out}/results.json, results.md, loss_curves.svg", flush=True)
    return result


def versions(device):
    import torch
    v = dict(python=platform.python_version(), torch=torch.__version__, platform=platform.platform())
    for mod in ("transformers", "torchtitan"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # not every example imports both
            pass
    try:
        import expertact
        v.update(expertact=getattr(expertact, "__version__", "?"),
                 expertact_library=str(getattr(expertact, "LIBRARY_PATH", "?")), expertact_cuda=expertact.has_cuda())
    except Exception as e:  # pragma: no cover
        v["expertact"] = f"not importable: {e}"
    if device.type == "cuda":
        v.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(device))
    else:
        v["device"] = "cpu"
    return v


def resolve_device(args):
    import torch
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    return torch.device(args.device)


def resolve_sizes(args, device):
    size = args.size or ("h200" if device.type == "cuda" else "tiny")
    s = dict(SIZES[size])
    for key in SIZE_KEYS:
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return size, s, dtype


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def run(argv=None, log=print):
    """Runs the comparison; returns the result dict (also written to --out)."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    det = setup_determinism(args.deterministic)
    import torch

    device = resolve_device(args)
    size, s, dtype_name = resolve_sizes(args, device)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    t0 = time.perf_counter()
    tokens, corpus = load_tokens()
    batches = Batches(tokens, s["seq"], s["batch"], args.seed)
    t1 = time.perf_counter()
    base, cfg = build_model(args.arch, s, args.seed, args.bias_std)
    t2 = time.perf_counter()
    n_params = sum(p.numel() for p in base.parameters())
    tokens_per_step = s["batch"] * s["seq"]
    setup = dict(arch=args.arch, size=size, sizes=s, steps=args.steps, warmup=args.warmup, profile=args.profile,
                 lr=args.lr,
                 seed=args.seed, bias_std=args.bias_std if args.arch == "gpt_oss" else None, dtype=dtype_name,
                 tokens_per_step=tokens_per_step, expert_rows_per_layer=tokens_per_step * s["top_k"],
                 params=n_params, corpus=corpus, epoch_steps=batches.epoch_steps, determinism=det,
                 attention="eager", optimizer="AdamW(betas=(0.9, 0.95), weight_decay=0.1), clip 1.0, "
                 f"linear warm-up {max(1, min(20, args.steps // 10))} steps")
    log(f"{args.arch} ({size}): {n_params / 1e6:.1f}M parameters, {tokens_per_step:,} tokens/step, "
        f"{tokens_per_step * s['top_k']:,} expert rows per layer and step, {dtype_name} on {device}; corpus "
        f"{corpus['files']} files, {corpus['tokens']:,} tokens ({batches.epoch_steps} steps per epoch); setup "
        f"{t1 - t0:.1f} s data, {t2 - t1:.1f} s model", flush=True)
    result = start_result(f"{args.arch} fine-tuning, expert implementations", setup, device, args.variant_names,
                          args.out, argv, BASELINE, YARDSTICK)

    if any(VARIANTS[n][0].startswith("expertact") for n in args.variant_names):
        register_variants(args.variant_names, args.fp8_modes)

    def loss_fn(model, ids):
        return model(input_ids=ids, labels=ids).loss

    def new_record(name):
        impl, _, repeats = VARIANTS[name]
        return dict(implementation=impl, repeats=repeats, **(args.fp8_modes if name == "expertact_fp8" else {}))

    def prepare(name, model, record):
        # An implementation that refuses this model (NotImplementedError) fails here: recorded.
        model.set_experts_implementation(VARIANTS[name][0])
        record["experts_implementation_set"] = model.config._experts_implementation
        return model

    return train_variants(args.variant_names, result, new_record,
                          lambda name: cast_params(copy.deepcopy(base), dtype).to(device), prepare, loss_fn, batches,
                          args, device, tokens_per_step, log)

def main(argv=None):
    result = run(argv)
    return 1 if any("error" in r for r in result["variants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
