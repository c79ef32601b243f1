"""An end-to-end MoE language-model training run with DeepSpeed AutoEP (experts sharded over the
ranks, token all-to-all over torch.distributed), with DeepSpeed's eager expert activation or expertact's.

One process per rank, launched by torchrun:

    torchrun --nproc_per_node 2 examples/autoep_train.py --impl eager --config small --out OUT/autoep

--impl eager                     DeepSpeed as a user runs it by default: AutoEP's default gate_up_impl
                                 "separate" (two grouped GEMMs) and its registry as shipped (swiglu_oai has
                                 no fused kernel, so its fused path falls back to the eager fn; checked at
                                 step 0, below)
--impl eager-repeat              the same again: its difference from eager is the run-to-run noise
--impl eager-fused               DeepSpeed with gate_up_impl "fused" (one grouped GEMM over w1 and w3
                                 concatenated): the same function rounded in another order, the loss
                                 yardstick
--impl expertact                 expertact.deepspeed.enable(): expertact's kernels in the registry
--impl expertact-inplace         expertact.deepspeed.enable(inplace_backward=True)
--impl mlp                       enable(experts=True): AutoEP's GroupedExperts runs expertact's whole
                                 expert MLP (expertact.moe.expert_mlp)
--impl mlp-recompute, mlp-inplace, mlp-recompute-inplace, mlp-fp8
                                 ... with recompute=True, inplace_backward=True, both, fp8="rowwise"
--impl mlp-fp8-bf16-wgrad, mlp-fp8-promoted-wgrad, mlp-fp8-blockwise
                                 ... fp8="rowwise-bf16-wgrad" (the weight gradients in bf16),
                                 "rowwise-promoted-wgrad" (the weight gradients without fast
                                 accumulation), "blockwise"
                                 (examples/autoep_fp8.py: one entry per recipe)
--impl torchao-fp8               DeepSpeed's own experts with their weights converted by torchao 0.18's
                                 FP8 rowwise MoE training (examples/autoep_fp8.py says how; Hopper)

--impl takes a comma-separated list too: the runs then follow one another in the same processes
(the CPU test runs every memory mode so, with --record-grads). A run whose recipe or library this
machine lacks is refused before any run starts (--skip-unavailable: left out, and said so). On one
rank a run that fails is reported and the list goes on (the launch then exits non-zero, naming it);
on several, the first failure ends the launch. Every
run but eager-fused takes --gate-up-impl (default "separate", AutoEP's default); a run on another
gate_up_impl than its impl names gets "-<gate_up_impl>" at the end of its default tag, so that a
result file says which.

The model is a randomly initialised MiniMax-M3 text backbone (transformers' minimax_m3_vl_text, built
from a config, no download), so AutoEP's minimax_m3 preset converts it and its experts compute
swiglu_oai (alpha 1.702, limit 7). The data are the bytes of the Python standard library's own .py
files (vocab 256; examples/byte_corpus.py, shared with megatron_moe.py), sampled with a fixed seed:
every run of a config sees the same batches. --corpus stdlib+packages adds the installed
packages' .py sources (128 MiB: the 1,000-step run reads it about 0.5 times).

--capture-step N saves, at step N, the first MoE layer's expert inputs as expert_mlp takes them
(x sorted by expert, offsets, w13, w2) and the gradient of their output, dy, to
OUT/<tag>.capture.pt (examples/autoep_fp8.py), for python -m expertact.bench --fp8-accuracy (about
1.7 GB at config h200; that step's peak memory includes the copies).

Rank 0 writes OUT/<config>-<impl>.json: per step the global mean loss, the step time (slowest rank),
each rank's peak allocated memory and the rows each rank's experts received in each MoE layer;
plus the configuration, the versions and the command. examples/autoep_report.py turns the files
into a table and a plot.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # byte_corpus.py, beside this file
from byte_corpus import CORPORA, load_corpus, make_batch  # noqa: E402  (the same text as megatron_moe.py's)
import autoep_fp8  # noqa: E402  (the FP8 diagnosis's runs and the capture)

# --impl -> the arguments of expertact.deepspeed.enable() (None: DeepSpeed's own experts).
IMPLS = {
    "eager": None,
    "eager-repeat": None,
    "eager-fused": None,
    "expertact": dict(inplace_backward=False),
    "expertact-inplace": dict(inplace_backward=True),
    "mlp": dict(experts=True),
    "mlp-recompute": dict(experts=True, recompute=True),
    "mlp-inplace": dict(experts=True, inplace_backward=True),
    "mlp-recompute-inplace": dict(experts=True, recompute=True, inplace_backward=True),
    "mlp-fp8": dict(experts=True, fp8="rowwise"),
}
# The FP8 diagnosis's runs (each recipe, torchao's): examples/autoep_fp8.py, the one place naming them.
for _impl, _enabled in {**autoep_fp8.FP8_IMPLS, **dict.fromkeys(autoep_fp8.TORCHAO_IMPLS)}.items():
    assert _impl not in IMPLS, _impl
    IMPLS[_impl] = _enabled
# The runs whose gate_up_impl is their name's; every other one takes --gate-up-impl.
FIXED_GATE_UP = {"eager-fused": "fused"}
# AutoEP 0.19.8's default (deepspeed/module_inject/auto_ep_config.py: gate_up_impl =
# param_dict.get("gate_up_impl", "separate")).
DEFAULT_GATE_UP = "separate"
ACTIVATION = "swiglu_oai"  # what the minimax_m3 preset asks of DeepSpeed's registry
PRESET = "minimax_m3"

# Model and batch sizes. "small": the 200-step loss-curve run (about 8K tokens and 16K routed rows
# per rank and step). "large": the memory run, sized so that each rank's experts receive a few
# hundred thousand rows per step and layer (131K tokens x top-2 per rank; expert ffn 3072 is
# MiniMax-M3's own intermediate_size), a few x 10 GiB per rank. "h200": the one-GPU run of the whole
# expert MLP (--ep-size 1: every expert on the one rank), sized so that the experts take most of the
# step (hidden 1024, expert ffn 3072, top-4 of 8 experts, 64K tokens a step: 262K rows per MoE layer).
# "cpu-diag": the FP8 diagnosis on the CPU (examples/fp8_diagnosis.py; one rank, --ep-size 1): h200's
# routing (each token to half the experts, here top-2 of 4) at a size two CPU cores train for 300
# steps in minutes, with a weight gradient's K (an expert's rows a step) of 2,048 on average.
# "tiny": the CPU smoke and gradient tests.
CONFIGS = {
    "small": dict(hidden=512, ffn=1024, shared_ffn=512, layers=4, experts=8, top_k=2, heads=8, kv_heads=2,
                  seq=512, micro_batch=16, steps=200, warmup=10, lr=1e-3),
    "large": dict(hidden=1024, ffn=3072, shared_ffn=1024, layers=2, experts=8, top_k=2, heads=8, kv_heads=2,
                  seq=2048, micro_batch=64, steps=20, warmup=5, lr=1e-3),
    "h200": dict(hidden=1024, ffn=3072, shared_ffn=1024, layers=2, experts=8, top_k=4, heads=8, kv_heads=2,
                 seq=2048, micro_batch=32, steps=300, warmup=10, lr=1e-3),
    "cpu-diag": dict(hidden=128, ffn=256, shared_ffn=128, layers=2, experts=4, top_k=2, heads=4, kv_heads=2,
                     seq=256, micro_batch=16, steps=300, warmup=10, lr=1e-3),
    "tiny": dict(hidden=64, ffn=64, shared_ffn=32, layers=2, experts=4, top_k=2, heads=4, kv_heads=2,
                 seq=64, micro_batch=2, steps=3, warmup=1, lr=1e-3),
}
SIZE_KEYS = tuple(CONFIGS["small"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", required=True, help=f"one of {', '.join(IMPLS)}, or several, comma-separated")
    p.add_argument("--config", choices=tuple(CONFIGS), default="small", help="size preset (default small)")
    for key in SIZE_KEYS:
        typ = float if key == "lr" else int
        p.add_argument("--" + key.replace("_", "-"), type=typ, default=None, help=f"override the preset's {key}")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--gate-up-impl", choices=("separate", "fused"), default=DEFAULT_GATE_UP,
                   help="AutoEP's gate_up_impl for every run but eager-fused (default separate, AutoEP's default: "
                   "two grouped GEMMs and the registry's fused_fn; fused: one grouped GEMM into a packed gate_up "
                   "tensor and its packed_fused_fn)")
    p.add_argument("--expert-gemm", choices=("grouped_mm", "for-loop"), default="grouped_mm",
                   help="AutoEP's use_grouped_mm: grouped_mm (true; DeepSpeed picks its Triton GEMM on sm < 90) or "
                   "for-loop (false: DeepSpeed's per-expert loop)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--ep-size", type=int, default=2, help="AutoEP's autoep_size (default 2: experts over 2 ranks; "
                   "1: every rank holds every expert, the one-GPU run)")
    p.add_argument("--record-grads", action="store_true", help="save each rank's gradients of every parameter "
                   "at every step (as autograd hands them to DeepSpeed) and the parameters after the last step "
                   "to OUT/<tag>.rank<r>.pt, for the CPU gradient test")
    p.add_argument("--expert-share", action="store_true", help="after the steps, time the first MoE layer's "
                   "experts alone (forward + backward at the last step's rows, CUDA) and report their share "
                   "of the step")
    p.add_argument("--corpus", choices=CORPORA, default="stdlib", help="the training text (examples/byte_corpus.py)")
    p.add_argument("--capture-step", type=int, default=None, metavar="N", help="save the first MoE layer's expert "
                   "inputs and output gradient at step N to OUT/<tag>.capture.pt (examples/autoep_fp8.py)")
    p.add_argument("--skip-unavailable", action="store_true", help="leave out the runs this machine cannot make "
                   "(a recipe this expertact lacks, torchao missing, no Hopper GPU) instead of refusing them all")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "autoep"))
    p.add_argument("--tag", default=None, help="file name of the result (default <config>-<impl>)")
    args = p.parse_args(argv)
    sizes = dict(CONFIGS[args.config])
    for key in SIZE_KEYS:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    args.sizes = sizes
    args.impls = [i for i in args.impl.split(",") if i]
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown or not args.impls:
        p.error(f"--impl {args.impl!r}: unknown {unknown}; expected one of {', '.join(IMPLS)}")
    if args.tag is not None and len(args.impls) > 1:
        p.error("--tag names one run; with several --impl each run is named <config>-<impl>")
    args.tag = args.tag or default_tag(args, args.impls[0])
    if sizes["warmup"] >= sizes["steps"]:
        p.error(f"--warmup ({sizes['warmup']}) must be below --steps ({sizes['steps']})")
    if args.capture_step is not None and not 0 <= args.capture_step < sizes["steps"]:
        p.error(f"--capture-step {args.capture_step} is not one of the steps 0..{sizes['steps'] - 1}")
    return args


def gate_up_of(args, impl):
    """The gate_up_impl run `impl` takes: its name's (eager-fused), else --gate-up-impl."""
    return FIXED_GATE_UP.get(impl, args.gate_up_impl)


def default_tag(args, impl):
    """<config>-<impl>, with -<gate_up_impl> when the run takes another than its name says
    (AutoEP's default, or eager-fused's own)."""
    named = FIXED_GATE_UP.get(impl, DEFAULT_GATE_UP)
    gate_up = gate_up_of(args, impl)
    return f"{args.config}-{impl}" + ("" if gate_up == named else f"-{gate_up}")


# ---------------------------------------------------------------------------
# model: a randomly initialised MiniMax-M3 text backbone
# ---------------------------------------------------------------------------

def build_model(s, seed):
    import torch
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM
    head_dim = s["hidden"] // s["heads"]
    cfg = MiniMaxM3VLTextConfig(
        vocab_size=256, hidden_size=s["hidden"], intermediate_size=s["ffn"],
        shared_intermediate_size=s["shared_ffn"], dense_intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=head_dim, rotary_dim=head_dim // 2,  # MiniMax-M3 rotates half of each head (64 of 128)
        num_local_experts=s["experts"], num_experts_per_tok=s["top_k"],
        max_position_embeddings=s["seq"], mlp_layer_types=["sparse"] * s["layers"],
        layer_types=["full_attention"] * s["layers"],  # the sparse (lightning indexer) attention is not the point
        bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False, tie_word_embeddings=False,
        # swiglu_alpha / swiglu_limit stay the defaults 1.702 / 7: AutoEP reads them from this config.
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(cfg)  # random init (post_init), identical on every rank
    return model, cfg


def ds_config(args):
    s = args.sizes
    cfg = {
        "train_micro_batch_size_per_gpu": s["micro_batch"],
        "gradient_accumulation_steps": 1,
        # torch_adam: torch.optim.AdamW, so that nothing needs DeepSpeed's JIT-built FusedAdam op.
        "optimizer": {"type": "AdamW", "params": {"lr": s["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": s["lr"],
                                                      "warmup_num_steps": max(1, min(20, s["steps"] // 10)),
                                                      "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": args.ep_size,  # 2: experts sharded over 2 ranks (num_experts / 2 each)
            "preset_model": PRESET,
            "comm_backend": "comm",  # torch.distributed all_to_all_single (NCCL on GPUs); no DeepEP
            "use_grouped_mm": args.expert_gemm == "grouped_mm",
            "gate_up_impl": gate_up_of(args, args.impl),
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


# ---------------------------------------------------------------------------
# the activation: which functions DeepSpeed's registry holds, and which ones ran
# ---------------------------------------------------------------------------

ENTRY_FNS = ("fn", "fused_fn", "packed_fused_fn")


def describe_entry(entry):
    def name(f):
        return None if f is None else f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"

    return {k: name(getattr(entry, k)) for k in ENTRY_FNS}


def count_calls(registry, name):
    """Put a copy of registry[name] whose fn / fused_fn / packed_fused_fn count their calls; returns
    (counts, restore). Used for step 0 only, then the very entry object is put back."""
    entry = registry[name]
    counts = dict.fromkeys(ENTRY_FNS, 0)

    def counting(key, f):
        if f is None:
            return None

        def wrapped(*a, **k):
            counts[key] += 1
            return f(*a, **k)

        return wrapped

    registry[name] = dataclasses.replace(entry, **{k: counting(k, getattr(entry, k)) for k in ENTRY_FNS})
    return counts, lambda: registry.__setitem__(name, entry)


def expected_calls(impl, gate_up_impl, n_layers, loop_experts=None):
    """What one forward must call: DeepSpeed's fused=True path of GroupedExperts takes
    packed_fused_fn (gate_up_impl fused) or fused_fn (separate) when the entry has one, else fn;
    its for-loop path (loop_experts: the experts of a rank) calls fn once per expert; expertact's
    whole expert MLP calls none of them."""
    if IMPLS[impl] is not None and IMPLS[impl].get("experts"):
        return {"fn": 0, "fused_fn": 0, "packed_fused_fn": 0}
    if loop_experts is not None:
        return {"fn": n_layers * loop_experts, "fused_fn": 0, "packed_fused_fn": 0}
    if IMPLS[impl] is None:  # DeepSpeed's registry: swiglu_oai has no fused kernel, its fn runs
        return {"fn": n_layers, "fused_fn": 0, "packed_fused_fn": 0}
    key = "packed_fused_fn" if gate_up_impl == "fused" else "fused_fn"
    return {"fn": 0, "fused_fn": 0, "packed_fused_fn": 0, key: n_layers}


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------

def _nccl_version(torch):
    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int (2.27.5 -> 22705) in old ones
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def versions(device):
    import torch
    import deepspeed
    import transformers
    import expertact
    v = dict(python=platform.python_version(), torch=torch.__version__, deepspeed=deepspeed.__version__,
             transformers=transformers.__version__, expertact=getattr(expertact, "__version__", "?"),
             expertact_library=str(getattr(expertact, "LIBRARY_PATH", "?")), expertact_cuda=expertact.has_cuda(),
             platform=platform.platform())
    if device.type == "cuda":
        v.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(device),
                 nccl=_nccl_version(torch), device_count=torch.cuda.device_count())
    else:
        v.update(device="cpu")
    return v


def init_distributed(args):
    """(device, rank, world): this rank's device, and the process group (NCCL on GPUs, gloo on
    the CPU) over exactly 2 ranks."""
    import torch
    import deepspeed
    import deepspeed.comm as dist

    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if want_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.ep_size:
        raise SystemExit(f"autoep_train.py: the world size {world} is not a multiple of --ep-size {args.ep_size}")
    return device, rank, world


def rank0_logger(rank, tag):
    def log(*a):
        if rank == 0:
            print(f"[{tag}]", *a, flush=True)
    return log


def select_activation(args, registry, device):
    """expertact.deepspeed.enable(...) as --impl asks (disable() for eager); returns (DeepSpeed's
    entry, the entry in use, the enable() arguments or None), entries described."""
    import expertact
    import expertact.deepspeed as xds

    enabled = IMPLS[args.impl]
    if device.type == "cuda" and enabled is not None and not expertact.has_cuda():
        raise SystemExit("autoep_train.py: the installed expertact has no CUDA path "
                         f"({expertact.LIBRARY_PATH}); build it with nvcc (bash scripts/gpu_check.sh)")
    xds.disable()
    ds_entry = describe_entry(registry[ACTIVATION])
    if enabled is not None:
        if enabled.get("experts") and "experts" not in inspect.signature(xds.enable).parameters:
            raise SystemExit("autoep_train.py: this expertact's enable() has no experts= (an older expertact)")
        xds.enable(**enabled)
    return ds_entry, describe_entry(registry[ACTIVATION]), enabled


def build_engine(args):
    """The corpus, the model and DeepSpeed's engine (AutoEP converts the model's MoE layers).
    Returns (engine, setup) with setup: the corpus, its description, the model config, the
    parameter count before AutoEP, the DeepSpeed config and the seconds each part took."""
    import deepspeed

    t = [time.perf_counter()]
    corpus, corpus_info = load_corpus(args.corpus)
    t.append(time.perf_counter())
    model, model_cfg = build_model(args.sizes, args.seed)
    n_params_before = sum(p.numel() for p in model.parameters())
    t.append(time.perf_counter())
    config = ds_config(args)
    torchao = {} if args.impl in autoep_fp8.TORCHAO_IMPLS else None
    with autoep_fp8.torchao_during_initialize(torchao) if torchao is not None else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if torchao is not None:
        autoep_fp8.follow_zero(engine.optimizer)
    t.append(time.perf_counter())
    setup = dict(corpus=corpus, corpus_info=corpus_info, model_cfg=model_cfg, n_params_before=n_params_before,
                 config=config, seconds=dict(corpus=t[1] - t[0], model=t[2] - t[1], deepspeed_initialize=t[3] - t[2]),
                 torchao=torchao)
    return engine, setup


class AutoEPLayout(typing.NamedTuple):
    moe_layers: list  # the AutoEPMoELayer modules, in model order
    first: object  # moe_layers[0]
    act: tuple  # (activation name, alpha, limit) of its experts
    ep_size: int
    owned: list  # owned[r]: the experts of rank r
    grouped: str  # the expert GEMMs: triton, grouped_mm or for-loop


def autoep_layout(engine, s):
    """What AutoEP made of the model, checked: the MoE layers, the first one, its activation
    (name, alpha, limit), the expert-parallel size, the experts each rank owns and the expert
    GEMM implementation."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    moe_layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    if len(moe_layers) != s["layers"]:
        raise SystemExit(f"autoep_train.py: AutoEP replaced {len(moe_layers)} MoE layers, expected {s['layers']}")
    first = moe_layers[0]
    act = (first.experts.activation, first.experts.activation_alpha, first.experts.activation_limit)
    if act[0] != ACTIVATION:
        raise SystemExit(f"autoep_train.py: AutoEP's experts compute {act}, expected {ACTIVATION}")
    ep_size = first.ep_size
    owned = [list(autoep_experts_for_rank(first.expert_placement_descriptor, r)) for r in range(ep_size)]
    grouped = "triton" if first.experts.use_triton_grouped_mm else ("grouped_mm" if first.experts.use_grouped_mm
                                                                     else "for-loop")
    return AutoEPLayout(moe_layers, first, act, ep_size, owned, grouped)


def train(args, engine, corpus, layout, registry, device, rank, world, log):
    """The training steps: per step the global mean loss, this rank's step time and peak
    allocated memory, and the rows each rank's experts received per MoE layer; plus the calls
    step 0 made into registry[ACTIVATION], checked against expected_calls."""
    import torch
    import deepspeed.comm as dist

    s = args.sizes
    moe_layers, owned, ep_size = layout.moe_layers, layout.owned, layout.ep_size

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def rows_this_step():
        """[layers, ep ranks]: rows each rank's experts received in each MoE layer in this step
        (from the per-expert counts AutoEP accumulates in tokens_per_expert, summed over ranks)."""
        counts = torch.stack([m.tokens_per_expert for m in moe_layers]).double()
        for m in moe_layers:
            m.tokens_per_expert.zero_()
        dist.all_reduce(counts)
        return [[int(counts[l, owned[r]].sum().item()) for r in range(ep_size)] for l in range(len(moe_layers))]

    for m in moe_layers:
        m.tokens_per_expert.zero_()
    losses, times, peaks, rows = [], [], [], []
    calls, captured = None, {}
    grads, hooks = [], []
    if args.record_grads:  # each parameter's gradient as autograd hands it over, before DeepSpeed's hooks
        for name, param in engine.module.named_parameters():
            if param.requires_grad:
                hooks.append(param.register_hook(
                    lambda g, name=name: grads[-1].__setitem__(name, g.detach().float().clone())))
    for step in range(s["steps"]):
        ids = make_batch(corpus, step, args.seed, rank, world, s["micro_batch"], s["seq"]).to(device)
        if step == 0:
            calls, restore = count_calls(registry, ACTIVATION)
            if args.impl in autoep_fp8.TORCHAO_IMPLS:
                tao_calls, tao_restore = autoep_fp8.count_torchao_gemms()
        capture = autoep_fp8.Capture(layout.first.experts) if step == args.capture_step else None
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        if args.record_grads:
            grads.append({})
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
        if step == 0:
            restore()
            loop = len(owned[rank % ep_size]) if layout.grouped == "for-loop" else None
            want = expected_calls(args.impl, layout.first.experts.gate_up_impl, len(moe_layers), loop)
            if calls != want:
                raise SystemExit(f"autoep_train.py: step 0 called {calls} of registry[{ACTIVATION!r}], "
                                 f"expected {want} for --impl {args.impl}")
            if args.impl in autoep_fp8.TORCHAO_IMPLS:
                tao_restore()
                if tao_calls["grouped_mm"] != autoep_fp8.GEMMS_PER_LAYER * len(moe_layers):
                    raise SystemExit(f"autoep_train.py: step 0 ran {tao_calls['grouped_mm']} of torchao's FP8 grouped "
                                     f"GEMMs, expected {autoep_fp8.GEMMS_PER_LAYER} per MoE layer")
                captured["torchao_step0_gemms"] = tao_calls["grouped_mm"]
        if capture is not None:
            name = args.tag + (".capture.pt" if rank == 0 else f".capture.rank{rank}.pt")
            path = os.path.join(args.out, name)
            size = capture.save(path, step=step, tag=args.tag, impl=args.impl, config=args.config, rank=rank,
                                seed=args.seed, loss=out.loss.detach().float().item())
            captured["capture"] = dict(path=path, step=step, bytes=size)
            log(f"captured the first MoE layer's expert inputs at step {step}: {path} ({size / 2**20:.1f} MiB)")
        loss = out.loss.detach().float().reshape(1)
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        rows.append(rows_this_step())
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"autoep_train.py: loss {losses[-1]} at step {step}")
        if step % max(1, s["steps"] // 10) == 0 or step == s["steps"] - 1:
            busiest = max(max(r) for r in rows[-1])
            log(f"step {step:4d} loss {losses[-1]:.4f} time {times[-1] * 1e3:8.1f} ms "
                f"peak {peaks[-1] / 2**30 if peaks[-1] is not None else float('nan'):.2f} GiB "
                f"busiest rank rows {busiest}")
    for h in hooks:
        h.remove()
    return dict(losses=losses, times=times, peaks=peaks, rows=rows, calls=calls, grads=grads, **captured)


def expert_share(layout, run, device, reps=5):
    """(ms, rows): forward + backward of the first MoE layer's experts alone, at the rows this
    rank's experts received in the first layer in the last step (split evenly among them), the
    median of `reps` timed calls after one warm-up. Times the number of MoE layers, over the step
    time, it is the experts' share of the step."""
    import torch
    ds_experts = layout.first.experts
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rows = run["rows"][-1][0][rank % layout.ep_size]
    E, F, D = ds_experts.w1.shape
    # A copy of the module with the same weights, so that DeepSpeed's gradient hooks on the
    # engine's parameters see nothing of these calls.
    experts = type(ds_experts)(D, F, E, use_grouped_mm=ds_experts.use_grouped_mm, activation=ds_experts.activation,
                               activation_alpha=ds_experts.activation_alpha,
                               activation_limit=ds_experts.activation_limit, gate_up_impl=ds_experts.gate_up_impl)
    experts.use_triton_grouped_mm = ds_experts.use_triton_grouped_mm
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(experts, name).data = getattr(ds_experts, name).detach().clone()
    counts = torch.full((E, ), rows // E, dtype=torch.int64, device=device)
    counts[: rows - int(counts.sum())] += 1
    x = torch.randn(rows, D, device=device, dtype=ds_experts.w1.dtype, requires_grad=True)
    dy = torch.randn_like(x)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        experts(x, counts).backward(dy)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        x.grad = None
        for param in experts.parameters():
            param.grad = None
    return sorted(times[1:])[reps // 2] * 1e3, rows


def _share_record(gathered, layers, mean_step_s):
    """The experts' share of the step on the busiest rank (None without --expert-share)."""
    shares = [g["share"] for g in gathered if g.get("share") is not None]
    if not shares:
        return None
    ms, rows = max(shares, key=lambda t: t[1])
    step_ms = mean_step_s * 1e3
    return dict(experts_fwd_bwd_ms=ms, rows=rows, moe_layers=layers, mean_step_ms=step_ms,
                share_of_step=ms * layers / step_ms)


def result_record(args, engine, setup, layout, run, gathered, activation, device, world):
    """Rank 0's JSON record of the run (the format examples/autoep_report.py reads)."""
    s, w = args.sizes, args.sizes["warmup"]
    ds_entry, run_entry, enabled = activation
    step_time = [max(g["times"][i] for g in gathered) for i in range(s["steps"])]
    mean_step = sum(step_time[w:]) / len(step_time[w:])
    peak_per_rank = [max(g["peaks"][w:]) if device.type == "cuda" else None for g in gathered]
    busiest = [max(max(r) for r in step_rows) for step_rows in run["rows"]]
    model_cfg, act = setup["model_cfg"], layout.act
    return dict(
        tag=args.tag, impl=args.impl, config=args.config, sizes=s, seed=args.seed, zero_stage=args.zero_stage,
        dtype=args.dtype, gate_up_impl=layout.first.experts.gate_up_impl, world_size=world, ep_size=layout.ep_size,
        experts_per_rank=layout.owned, activation=dict(name=ACTIVATION, alpha=act[1], limit=act[2]),
        expert_gemm=layout.grouped, registry_deepspeed=ds_entry, registry_in_use=run_entry, expertact_enable=enabled,
        experts_forward=run["experts_forward"],
        step0_calls=run["calls"], optimizer=type(engine.optimizer).__name__, ds_config=setup["config"],
        model_config={k: getattr(model_cfg, k) for k in (
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "shared_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rotary_dim",
            "num_local_experts", "num_experts_per_tok", "routed_scaling_factor", "swiglu_alpha",
            "swiglu_limit")},
        params_before_autoep=setup["n_params_before"],
        params_per_rank_after_autoep=sum(p.numel() for p in engine.module.parameters()),
        tokens_per_rank_per_step=s["micro_batch"] * s["seq"], corpus=setup["corpus_info"],
        corpus_reads=s["steps"] * world * s["micro_batch"] * s["seq"] / setup["corpus_info"]["bytes"],
        torchao=None if setup["torchao"] is None else autoep_fp8.torchao_record(
            dict(setup["torchao"], step0_gemms=run.get("torchao_step0_gemms"))),
        capture=run.get("capture"),
        loss=run["losses"], step_time_s=step_time, step_time_s_per_rank=[g["times"] for g in gathered],
        peak_allocated_bytes_per_step_per_rank=[g["peaks"] for g in gathered],
        peak_allocated_bytes_per_rank=peak_per_rank,
        tensor_bytes_alive_at_start_per_rank=[g["alive"] for g in gathered],
        mean_step_time_s=mean_step,
        rows_received_per_step=run["rows"], busiest_rank_rows_per_step=busiest,
        experts_share=_share_record(gathered, s["layers"], mean_step),
        timed_from_step=w, setup_s=setup["seconds"], versions=versions(device),
        command=" ".join((["torchrun", "--nproc_per_node", str(world)] if "TORCHELASTIC_RUN_ID" in os.environ
                          else [os.path.basename(sys.executable)]) + sys.argv),
        env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                            "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")},
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def run_one(args, registry, device, rank, world):
    """One training run of args.impl: enable() as it asks, DeepSpeed's engine, the steps, rank
    0's JSON (and with --record-grads every rank's gradients), disable()."""
    import torch
    import torch.distributed as tdist
    import deepspeed.comm as dist
    import expertact.deepspeed as xds

    log = rank0_logger(rank, args.tag)
    activation = select_activation(args, registry, device)
    ds_entry, run_entry, enabled = activation
    log("registry", ACTIVATION, "DeepSpeed:", ds_entry, "in use:", run_entry, "enable():", enabled)

    alive = alive_tensor_bytes(device)
    engine, setup = build_engine(args)
    try:
        layout = autoep_layout(engine, args.sizes)
        experts = layout.first.experts
        log(f"AutoEP: {len(layout.moe_layers)} layers, ep_size {layout.ep_size}, experts per rank {layout.owned}, "
            f"activation {layout.act}, expert GEMMs {layout.grouped}, gate_up_impl {experts.gate_up_impl}; "
            f"experts' forward {type(experts).forward.__qualname__}; "
            f"optimizer {type(engine.optimizer).__name__}; "
            "setup s: " + ", ".join(f"{k} {v:.1f}" for k, v in setup["seconds"].items()))
        engine.train()
        run = train(args, engine, setup["corpus"], layout, registry, device, rank, world, log)
        fwd = type(experts).forward
        run["experts_forward"] = f"{fwd.__module__}.{fwd.__qualname__}"
        share = None
        if args.expert_share and device.type == "cuda":
            if args.impl in autoep_fp8.TORCHAO_IMPLS:
                # The share's copy of the experts is a plain module given torchao's converted weights;
                # on the H200 an illegal memory access surfaced at the copy's first synchronize, after
                # the 300 steps had run, and ended the process before the run's JSON was written.
                log("experts' share not measured: torchao's converted weights do not carry into the copy it times")
            else:
                share = expert_share(layout, run, device)

        if args.record_grads:
            os.makedirs(args.out, exist_ok=True)
            params = {n: autoep_fp8.plain(p).float().clone() for n, p in engine.module.named_parameters()}
            torch.save(dict(loss=run["losses"], grads=run["grads"], params=params),
                       os.path.join(args.out, f"{args.tag}.rank{rank}.pt"))
        xds.disable()
        if describe_entry(registry[ACTIVATION]) != ds_entry or xds.experts_enabled():
            raise SystemExit("autoep_train.py: expertact.deepspeed.disable() did not restore DeepSpeed's entry")

        # Every rank's times and peaks go to rank 0.
        gathered = [None] * world
        tdist.all_gather_object(gathered, dict(rank=rank, times=run["times"], peaks=run["peaks"], share=share,
                                               alive=alive))
        if rank == 0:
            result = result_record(args, engine, setup, layout, run, gathered, activation, device, world)
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, args.tag + ".json")
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            peaks_txt = ", ".join("n/a" if p is None else f"{p / 2**30:.2f}"
                                  for p in result["peak_allocated_bytes_per_rank"])
            share_txt = ""
            if result["experts_share"] is not None:
                share_txt = f", experts {result['experts_share']['share_of_step']:.0%} of the step"
            log(f"done: final loss {run['losses'][-1]:.4f}, mean step {result['mean_step_time_s'] * 1e3:.1f} ms "
                f"(steps {args.sizes['warmup']}..{args.sizes['steps'] - 1}), "
                f"peak GiB per rank [{peaks_txt}]{share_txt}, "
                f"busiest rank rows/step/layer max {max(result['busiest_rank_rows_per_step'])} -> {path}")
    finally:
        release_engine(engine)
    dist.barrier()


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch.distributed as tdist
    from deepspeed.moe import ep_experts

    device, rank, world = init_distributed(args)
    registry = ep_experts.EXPERT_ACTIVATIONS
    why = {impl: autoep_fp8.unavailable(IMPLS[impl], impl, device, args) for impl in args.impls}
    for impl, reason in why.items():
        if reason is not None and not args.skip_unavailable:
            raise SystemExit(f"autoep_train.py: --impl {impl}: {reason} (--skip-unavailable leaves such runs out)")
        if reason is not None and rank == 0:
            print(f"[{default_tag(args, impl)}] left out: {reason}", flush=True)
    failed = []
    for impl in [i for i in args.impls if why[i] is None]:
        one = copy.copy(args)
        one.impl = impl
        one.tag = args.tag if len(args.impls) == 1 else default_tag(args, impl)
        try:
            run_one(one, registry, device, rank, world)
        except Exception:
            # On one rank a run that fails (out of memory, say) need not cost the launch's later
            # runs: it is reported, DeepSpeed's own forward put back, and the next run starts. With
            # several ranks the others would wait in a collective for this one: the launch ends.
            if world > 1:
                raise
            failed.append(impl)
            traceback.print_exc()
            switch_off()
        collect(device)  # out of the except clause, whose traceback holds the failed run's frames
    tdist.destroy_process_group()
    if failed:
        raise SystemExit(f"autoep_train.py: {len(failed)} run(s) failed: {', '.join(failed)} (the traceback of "
                         "each above); the launch's other runs completed and wrote their JSONs")


def alive_tensor_bytes(device) -> int:
    """Bytes of the storages of every tensor alive on ``device``, after a garbage collection: at a
    run's start, what earlier runs of the launch left behind (it adds to every peak of the run)."""
    import gc
    import torch

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device == device and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def release_engine(engine):
    """DeepSpeed's destroy() of the run's engine: it removes the ZeRO optimizer's gradient hooks,
    which the autograd engine holds on the parameters' gradient accumulators and which hold the
    optimizer. Without it every run left its parameters, master weights and Adam states alive
    (2.1 GiB a run at config h200, seen on the GPU) and each later run of a launch peaked that much
    higher. The memory itself goes when run_one's frame does (main's collect())."""
    destroy = getattr(engine, "destroy", None)
    if destroy is not None:
        destroy()


def collect(device):
    """A finished run's memory returned: its objects collected, the allocator's cache emptied."""
    import gc
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def switch_off():
    """After a run that raised: expertact's switch off (DeepSpeed's forward and activations as
    shipped), so that the next run starts as a fresh one (its memory: main's collect())."""
    import expertact.deepspeed as xds

    xds.disable()


if __name__ == "__main__":
    main()
