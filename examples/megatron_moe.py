"""A Megatron-Core GPT training run with MoE layers: Megatron's own experts (SequentialMLP, a
loop over the local experts) against expertact's (expertact.megatron.ExpertMLP), same seed, same
weights, same batches of real text.

One process per GPU, launched by torchrun; several impls run one after another in one launch:

    torchrun --nproc-per-node 1 examples/megatron_moe.py \\
        --impl megatron,megatron-repeat,megatron-unfused,expertact-inplace,expertact-fp8 --steps 300 --out OUT/megatron

--impl megatron           Megatron's experts as its trainer runs them by default
                          (get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False): SequentialMLP):
                          SwiGLU with bias_activation_fusion=True (Megatron-LM's --bias-swiglu-fusion is on
                          unless --no-bias-swiglu-fusion is given: its fused weighted SwiGLU); GPT-OSS's form
                          unfused (Megatron's fused quick-GeGLU clamps before adding fc1's bias, GPT-OSS
                          after: another function)
--impl megatron-repeat    the same again: its difference from "megatron" is the run-to-run noise
--impl megatron-unfused   SwiGLU with bias_activation_fusion=False (the activation op by op): the same
                          function rounded in another order, the loss yardstick (swiglu only)
--impl megatron-eager     GPT-OSS's form with quick_gelu run op by op in bf16 (Megatron compiles it: one
                          rounding; eager: three), the same function rounded in another order: the loss
                          yardstick of --activation gpt-oss
--impl expertact          expertact.megatron.gpt_layer_local_spec(...): ExpertMLP, bf16
--impl expertact-inplace  ... experts=dict(inplace_backward=True)
--impl expertact-fp8      ... experts=dict(fp8="rowwise") (Hopper only: elsewhere the run is
                          recorded with its error and skipped)
--impl expertact-fp8-bf16-wgrad, expertact-fp8-promoted-wgrad, expertact-fp8-blockwise
                          ... the other recipes of expertact.moe.FP8_RECIPES, named as
                          python -m expertact.bench --megatron names its rows

The peer is SequentialMLP, Megatron's experts without TransformerEngine. TEGroupedMLP
(TransformerEngine's GroupedLinear, which Megatron's MoE recipes select with --moe-grouped-gemm)
was not measured; no comparable published TransformerEngine figure was found (see
expertact.bench.megatron's docstring).

--activation gpt-oss: GPT-OSS's experts (quick_gelu, glu_linear_offset 1, clamp 7, biases). Megatron
0.19.2's own SequentialMLP fails there at TP = EP = 1 in its first forward (transformer/mlp.py adds the
expert bias in place to the output of the TP reduce, a custom autograd Function that returns its input
as is at TP 1: RuntimeError "... is a view and is being modified inplace"); the megatron runs then take
fc2's expert-parallel path (explicit_expert_comm), which skips that reduce.

With N GPUs (--nproc-per-node N) the experts are spread over --ep ranks (default N: expert
parallelism N, data parallelism N for the rest). The model: Megatron's GPTModel from its local
(no TransformerEngine) spec, every layer MoE, RMSNorm, RoPE, no dropout, bf16 (Float16Module),
Megatron's DistributedDataParallel and optimizer (Adam, clip 1.0, 10 linear warm-up steps then a
constant lr), a step through get_forward_backward_func(). The data: the text examples/autoep_train.py
trains on (examples/byte_corpus.py): the Python standard library's .py files as byte tokens
(vocabulary 256), windows of seq + 1 bytes at offsets drawn from (seed, step), the first seq the
tokens and the last seq the labels; every impl of a launch, and every launch with the same seed and
sizes, trains on the same batches (the corpus's and the batches' sha256 are in each JSON). It
replaces Megatron's MockGPTDataset, whose documents (runs of consecutive token ids) were learnt to a
loss of 0.03 by step 50 and under 0.01 by step 100, after which the curves could not tell
implementations apart (bench/results/megatron-h200-2026-12-03);
the AutoEP example's loss on this text was still about 1 after 300 steps (docs/autoep-e2e.md).

Rank 0 writes OUT/<config>-<activation>-<impl>.json per run: the LM loss per step (the token mean
over all ranks, without the router's aux loss), the step time (slowest rank), the peak allocated
memory, versions and the command. examples/megatron_report.py makes the table and the plot.
Megatron-Core's training step is CUDA only (its RoPE, token dispatcher, schedule and DDP buffers
allocate on the current CUDA device).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # byte_corpus.py, beside this file
from byte_corpus import VOCAB, batches_sha256, load_corpus, make_batch  # noqa: E402  (autoep_train.py's text)

# --impl -> the experts: None = Megatron's SequentialMLP, else ExpertMLP's keywords.
IMPLS = {"megatron": None, "megatron-repeat": None, "megatron-unfused": None, "megatron-eager": None, "expertact": {},
         "expertact-inplace": dict(inplace_backward=True), "expertact-fp8": dict(fp8="rowwise"),
         "expertact-fp8-bf16-wgrad": dict(fp8="rowwise-bf16-wgrad"),
         "expertact-fp8-promoted-wgrad": dict(fp8="rowwise-promoted-wgrad"),
         "expertact-fp8-blockwise": dict(fp8="blockwise")}
# The yardsticks of one form only: impl -> the --activation it is for.
ONLY_FOR = {"megatron-unfused": "swiglu", "megatron-eager": "gpt-oss"}
# "h200": 64 x 1024 = 65,536 tokens a step, top-4 of 8 experts: 262,144 routed rows per MoE layer.
CONFIGS = {
    "h200": dict(hidden=1024, heads=16, layers=2, experts=8, ffn=3072, top_k=4, vocab=VOCAB, seq=1024,
                 micro_batch=64, steps=300, warmup=10, lr=3e-4),
    "tiny": dict(hidden=64, heads=4, layers=2, experts=4, ffn=128, top_k=2, vocab=VOCAB, seq=64,
                 micro_batch=4, steps=3, warmup=1, lr=3e-4),
}
ACTIVATIONS = ("swiglu", "gpt-oss")
LR_WARMUP = 10  # steps of linear lr warm-up (from 0), then constant


def parse_args(argv=None):
    head, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", required=True, help=f"one of {', '.join(IMPLS)}, or several, comma-separated")
    p.add_argument("--config", choices=tuple(CONFIGS), default="h200")
    for key in ("steps", "warmup", "micro_batch", "seq"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"override the config's {key}")
    p.add_argument("--lr", type=float, default=None, help="override the config's lr")
    p.add_argument("--activation", choices=ACTIVATIONS, default="swiglu",
                   help="swiglu: F.silu, no biases; gpt-oss: quick_gelu, glu_linear_offset 1, clamp 7, biases")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "megatron"))
    args = p.parse_args(argv)
    args.impls = [i for i in args.impl.split(",") if i]
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown or not args.impls:
        p.error(f"--impl {args.impl!r}: unknown {unknown}; expected one of {', '.join(IMPLS)}")
    for impl, form in ONLY_FOR.items():
        if impl in args.impls and args.activation != form:
            other = next(i for i, f in ONLY_FOR.items() if f == args.activation)
            p.error(f"--impl {impl} is for --activation {form} (the yardstick of {args.activation} is {other}: "
                    "Megatron's fused quick-GeGLU clamps before fc1's bias, another function than GPT-OSS's)")
    if len(set(args.impls)) != len(args.impls):
        p.error(f"--impl {args.impl!r} names a run twice (use megatron-repeat for a second megatron run)")
    s = dict(CONFIGS[args.config])
    for key in ("steps", "warmup", "micro_batch", "seq", "lr"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if min(s["steps"], s["micro_batch"], s["seq"]) < 1 or s["lr"] <= 0:
        p.error("--steps, --micro-batch, --seq and --lr must be positive")
    if not 0 <= s["warmup"] < s["steps"]:
        p.error(f"--warmup ({s['warmup']}) must be in [0, --steps ({s['steps']}))")
    if args.ep is not None and (args.ep < 1 or s["experts"] % args.ep):
        p.error(f"--ep {args.ep}: must divide the {s['experts']} experts")
    args.sizes = s
    return args


def quick_gelu_eager(y):
    """Megatron's quick_gelu without its torch.compile: each op rounded to the input's dtype."""
    import torch
    return y * torch.sigmoid(1.702 * y)


def fused(args, impl):
    """bias_activation_fusion of a run: Megatron-LM's trainer's default for the form (on for SwiGLU,
    --bias-swiglu-fusion; off for GPT-OSS's, whose fused quick-GeGLU computes another function), off
    for megatron-unfused."""
    return args.activation == "swiglu" and impl != "megatron-unfused"


def transformer_config(args, ep, impl):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    s = args.sizes
    act = dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    if args.activation == "gpt-oss":  # GPT-OSS's experts: clamped quick-GeGLU with the +1 offset, biases
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        act = dict(gated_linear_unit=True, activation_func=quick_gelu_eager if impl == "megatron-eager" else quick_gelu,
                   glu_linear_offset=1.0,
                   activation_func_clamp_value=7.0, add_bias_linear=True)
    return TransformerConfig(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"], ffn_hidden_size=s["ffn"],
        num_moe_experts=s["experts"], moe_ffn_hidden_size=s["ffn"], moe_router_topk=s["top_k"],
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=False, expert_model_parallel_size=ep,
        bias_activation_fusion=fused(args, impl),
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, **act)


def layer_spec(impl, num_experts):
    kw = dict(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm")
    if IMPLS[impl] is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        return get_gpt_layer_local_spec(**kw)
    import expertact
    import expertact.megatron as xm
    if not expertact.has_cuda():
        raise RuntimeError(f"the installed expertact has no CUDA path ({expertact.LIBRARY_PATH}): build it with "
                           "nvcc (bash scripts/gpu_check.sh)")
    return xm.gpt_layer_local_spec(experts=IMPLS[impl], **kw)


def corpus_data(args, dp):
    """The byte corpus and its description: the corpus's sha256 and that of every window offset of
    the run (dp x micro_batch windows of seq + 1 bytes a step), with which a rerun checks it trains
    on the same batches."""
    corpus, info = load_corpus()
    s = args.sizes
    count, length = dp * s["micro_batch"], s["seq"] + 1
    info.update(windows_per_step=count, window_bytes=length, seed=args.seed,
                batches_sha256=batches_sha256(corpus.numel(), s["steps"], args.seed, count, length))
    return corpus, info


def batch_of(corpus, seed, step, s, dp, dp_rank, device):
    """This rank's micro batch of step `step`: windows of seq + 1 bytes (the dp_rank-th share of the
    step's global batch), tokens the first seq, labels the last seq, every token in the loss."""
    import torch
    w = make_batch(corpus, step, seed, dp_rank, dp, s["micro_batch"], s["seq"] + 1)
    b = dict(tokens=w[:, :-1], labels=w[:, 1:], loss_mask=torch.ones(w.shape[0], s["seq"]),
             position_ids=torch.arange(s["seq"]).expand(w.shape[0], -1))
    return {k: v.to(device, non_blocking=True) for k, v in b.items()}


def loss_func(loss_mask, losses):
    """Megatron's 3-tuple form: (summed loss, tokens, report); the schedule divides by the tokens."""
    import torch
    mask = loss_mask.reshape(-1).float()
    total = torch.sum(losses.reshape(-1).float() * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach().clone(), mask.sum()])}


def forward_step(data_iterator, model):
    b = next(data_iterator)
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # per-token LM losses [b, s]
    return losses, functools.partial(loss_func, b["loss_mask"])


def versions():
    import torch
    import megatron.core
    v = dict(python=platform.python_version(), torch=torch.__version__, megatron_core=megatron.core.__version__,
             cuda=torch.version.cuda, device=torch.cuda.get_device_name(),
             capability=torch.cuda.get_device_capability(), platform=platform.platform())
    try:
        import expertact
        v.update(expertact=expertact.__version__, expertact_library=str(expertact.LIBRARY_PATH),
                 expertact_cuda=expertact.has_cuda())
    except Exception as e:  # the megatron runs need no expertact
        v.update(expertact=f"not importable: {e}")
    return v


def train_one(args, impl, corpus, env, log):
    """One run: a fresh model from the seed, Megatron's DDP and optimizer, the steps."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    s = args.sizes
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # same initial weights for every impl
    config = transformer_config(args, env["ep"], impl)
    gpt = GPTModel(config, layer_spec(impl, s["experts"]), vocab_size=s["vocab"], max_sequence_length=s["seq"],
                   position_embedding_type="rope")
    experts = type(gpt.decoder.layers[0].mlp.experts)
    if IMPLS[impl] is None and config.add_bias_linear and env["ep"] == 1:
        # Megatron 0.19.2's SequentialMLP with expert biases raises at TP = EP = 1 (its MLP adds fc2's
        # bias in place to the TP reduce's output, which that reduce returns as is at TP 1); fc2 takes
        # the path it takes under expert parallelism, where the reduce (a no-op at TP 1) is skipped.
        for m in gpt.modules():
            if getattr(m, "is_expert", False) and hasattr(m, "explicit_expert_comm"):
                m.explicit_expert_comm = True
    gpt.cuda(env["device"])
    with torch.no_grad():  # equal for every impl of a launch: the same initial weights
        checksum = float(sum(p.double().sum() for p in gpt.parameters()))
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
        module=Float16Module(config, gpt))
    try:
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=s["lr"], min_lr=s["lr"], weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
            clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16), [model])
        lr_warmup = min(LR_WARMUP, s["steps"] - 1)
        scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=s["lr"], min_lr=s["lr"],
                                            lr_warmup_steps=lr_warmup, lr_decay_steps=max(s["steps"], lr_warmup + 1),
                                            lr_decay_style="constant", start_wd=0.01, end_wd=0.01,
                                            wd_incr_steps=s["steps"], wd_incr_style="constant")
        config.finalize_model_grads_func = finalize_model_grads  # the DP all-reduce of grads, as Megatron's training
        config.grad_scale_func = optimizer.scale_loss
        name = f"{experts.__module__}.{experts.__qualname__}"
        log(f"{impl}: experts {name}, {sum(p.numel() for p in gpt.parameters()):,} parameters on this rank "
            f"(sum {checksum:.6f}), optimizer {type(optimizer).__name__}")
        return steps(s, args.seed, impl, model, optimizer, scheduler, corpus, env, log) | dict(
            init_param_sum=checksum, experts_class=name)
    finally:
        release(model, config)


def release(model, config):
    """Free the run's model, grad buffers and master weights. Without this (megatron-core 0.19.2, torch
    2.11, seen on the H200) Megatron's DDP outlived its run, held through references that Python's gc
    does not see (autograd's C++ objects, tensors held from C++), and each run left 2-4 GiB more in use."""
    model.grad_accs.clear()
    for p in model.parameters():
        p.grad = None
        p.__dict__.clear()  # main_grad (a view of the grad buffer), main_param (the fp32 master weight), ...
    for buffer in model.buffers + model.expert_parallel_buffers:
        buffer.__dict__.clear()
    config.finalize_model_grads_func = config.grad_scale_func = None
    model.__dict__.clear()


def steps(s, seed, impl, model, optimizer, scheduler, corpus, env, log):
    """The training steps: per step the LM loss, grad norm, step time and peak allocated memory."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    dev, fwd_bwd = env["device"], get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group()
    losses, grad_norms, times, peaks = [], [], [], []
    model.train()
    for step in range(s["steps"]):
        batch = batch_of(corpus, seed, step, s, env["dp"], env["dp_rank"], dev)  # before the clock
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = fwd_bwd(forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
                          num_microbatches=1, seq_length=s["seq"], micro_batch_size=s["micro_batch"],
                          forward_only=False)
        scheduler.step(1)  # step i runs at lr * min(1, (i + 1) / lr_warmup)
        ok, grad_norm, _ = optimizer.step()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated(dev))
        clear_aux_losses_tracker()
        total = reports[0]["lm loss"].float()
        torch.distributed.all_reduce(total, group=dp_group)
        losses.append((total[0] / total[1]).item())
        grad_norms.append(None if grad_norm is None else float(grad_norm))
        if not ok or not math.isfinite(losses[-1]):
            raise RuntimeError(f"step {step}: optimizer update {'skipped' if not ok else 'done'}, loss {losses[-1]}")
        if step % 50 == 0 or step == s["steps"] - 1:
            log(f"{impl}: step {step:4d} loss {losses[-1]:.4f} grad norm {grad_norms[-1] or float('nan'):.3f} "
                f"time {times[-1] * 1e3:8.1f} ms peak {peaks[-1] / 2**30:.2f} GiB")
    return dict(losses=losses, grad_norms=grad_norms, times=times, peaks=peaks)


def record(args, impl, run, env, error):
    """Rank 0's JSON record (what examples/megatron_report.py reads)."""
    s, w = args.sizes, args.sizes["warmup"]
    out = dict(impl=impl, config=args.config, sizes=s, activation=args.activation, seed=args.seed,
               bias_activation_fusion=fused(args, impl), corpus=env["corpus"], experts_options=IMPLS[impl], steps=s["steps"], warmup=w, lr_warmup=min(LR_WARMUP, s["steps"] - 1),
               world_size=env["world"], ep=env["ep"], dp=env["dp"],
               tokens_per_step=s["micro_batch"] * s["seq"] * env["dp"], loss_kind="LM loss (token mean over all "
               "ranks), without the router's aux loss", error=error, versions=env["versions"],
               command=" ".join(["torchrun", "--nproc-per-node", str(env["world"])] + sys.argv),
               env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")},
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if run is not None:
        times = [max(r["times"][i] for r in run["ranks"]) for i in range(s["steps"])]  # the slowest rank
        mean = sum(times[w:]) / len(times[w:])
        out.update(experts_class=run["experts_class"], init_param_sum_rank0=run["init_param_sum"],
                   losses=run["losses"], grad_norms=run["grad_norms"],
                   step_times_s=times, mean_step_ms=mean * 1e3, tokens_per_s=out["tokens_per_step"] / mean,
                   peak_allocated_bytes=max(max(r["peaks"][w:]) for r in run["ranks"]),
                   peak_allocated_bytes_per_step=[max(r["peaks"][i] for r in run["ranks"]) for i in range(s["steps"])],
                   peak_allocated_bytes_per_rank=[max(r["peaks"][w:]) for r in run["ranks"]])
    return out


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    import torch
    import torch.distributed as dist
    if not torch.cuda.is_available():
        sys.exit("megatron_moe.py: needs a CUDA GPU (Megatron's MoE router and token dispatcher run on CUDA)")
    if "LOCAL_RANK" not in os.environ:
        sys.exit("megatron_moe.py: launch it with torchrun (torchrun --nproc-per-node N examples/megatron_moe.py ...)")
    from megatron.core import parallel_state

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep or world
    if world % ep:
        sys.exit(f"megatron_moe.py: the world size {world} is not a multiple of --ep {ep}")
    if args.sizes["experts"] % ep:
        sys.exit(f"megatron_moe.py: the expert-parallel size {ep} does not divide the {args.sizes['experts']} experts")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=ep)
    env = dict(device=torch.device("cuda", local_rank), world=world, ep=ep,
               dp=parallel_state.get_data_parallel_world_size(), dp_rank=parallel_state.get_data_parallel_rank(),
               versions=versions())

    def log(*a):
        if rank == 0:
            print(f"[megatron_moe {args.config}/{args.activation}]", *a, flush=True)

    log(f"world {world}, ep {ep}, dp {env['dp']}, sizes {args.sizes}, impls {args.impls}; {env['versions']['device']}")
    corpus, env["corpus"] = corpus_data(args, env["dp"])
    log(f"corpus: {env['corpus']['files']} files, {env['corpus']['bytes']:,} bytes, sha256 "
        f"{env['corpus']['sha256'][:16]}...; batches sha256 {env['corpus']['batches_sha256'][:16]}...")
    failed = []
    for impl in args.impls:
        run, error = None, None
        try:
            run = train_one(args, impl, corpus, env, log)
        except Exception as e:  # e.g. NotImplementedError for FP8 off Hopper: recorded, the next impl runs
            # (an error raised on some ranks only would leave the others waiting in a collective)
            error = f"{type(e).__name__}: {e}"
            print(f"[rank {rank}] {impl} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            failed.append(impl)
        gc.collect()  # the model, its DDP buffers and optimizer go before the next run
        torch.cuda.empty_cache()
        log(f"{impl}: {torch.cuda.memory_allocated(env['device']) / 2**20:.0f} MiB still allocated after the run")
        if run is not None:
            ranks = [None] * world
            dist.all_gather_object(ranks, dict(times=run["times"], peaks=run["peaks"]))
            run["ranks"] = ranks
        if rank == 0:
            result = record(args, impl, run, env, error)
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"{args.config}-{args.activation}-{impl}.json")
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            if error:
                log(f"{impl}: FAILED ({error}) -> {path}")
            else:
                log(f"{impl}: done: final loss {result['losses'][-1]:.4f}, mean step {result['mean_step_ms']:.1f} ms "
                    f"(steps {result['warmup']}..{result['steps'] - 1}), {result['tokens_per_s']:,.0f} tokens/s, "
                    f"peak {result['peak_allocated_bytes'] / 2**30:.2f} GiB -> {path}")
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if failed:
        sys.exit(f"megatron_moe.py: failed runs: {', '.join(failed)} (recorded with their error)")


if __name__ == "__main__":
    main()
