"""Training-loop comparison of TorchTitan's routed experts with expertact's, on TorchTitan's own
Qwen3-MoE model classes (TorchTitan 0.3).

    python examples/torchtitan_moe_loop.py --out OUT/torchtitan          # on a GPU: --size h200, bf16
    python examples/torchtitan_moe_loop.py --size tiny --steps 20 --out /tmp/tt   # CPU smoke run, float32

The model is TorchTitan's Qwen3 MoE decoder (torchtitan.models.qwen3: its Qwen3Model, transformer
blocks, router, token dispatcher and GroupedExperts) built from a config of the sizes below, random
init with a fixed seed, causal attention through TorchTitan's ScaledDotProductAttention module
(every window is one plain causal sequence: no per-document masks). Data, batches, optimizer,
timing and outputs are those of examples/finetune_gpt_oss.py (the Python standard library's .py
files, byte-level). Each variant builds the model from its config after TorchTitan's own override
machinery (torchtitan.config.override.apply_overrides, what the trainer's --override.imports
does) has rewritten it, then loads the same initial state dict.

Variants (--variants; the first is the baseline):

  torchtitan         TorchTitan's GroupedExperts (torch grouped GEMMs, SwiGLU in bf16): the baseline
  torchtitan_fused   TorchTitan's own override torchtitan.overrides.fused_swiglu.fused_grouped_experts
                     (one w13 parameter, a Triton silu-and-mul; GPU only): the same function with
                     other kernels and roundings, the yardstick
  expertact          expertact.torchtitan.expertact_grouped_experts
  expertact_fused    expertact.torchtitan.expertact_fused_grouped_experts (w13 read through a view,
                     no per-call packing of w1 and w3)
  expertact_inplace  expertact_grouped_experts with {"inplace_backward": true}
  expertact_repeat   expertact again: are two identical runs bit-identical?

Why not TorchTitan's trainer (torchtitan.train): see docs/finetune.md. In short, its data loader
needs Hugging Face `datasets` and `torchdata` and a dataset on disk or from the hub (the
"c4_test" sample it names lives in TorchTitan's source tree, not in the PyPI package), and its
tokenizer needs tokenizer files; none ship with the package, and this loop needs neither.

Determinism (default on): as finetune_gpt_oss.py, and attention runs on SDPA's math backend
(plain GEMMs and softmax); --no-deterministic uses TorchTitan's default SDPA backends (cuDNN,
flash, math).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import finetune_gpt_oss as common  # noqa: E402  (the data, loop and outputs of the other example)


def _fsdp_name_for_older_torch():
    """TorchTitan 0.3.0 imports FSDP's DataParallelMeshDims (torch >= 2.12) when its model
    packages load, for FSDP wrapping this loop never calls. On an older torch a placeholder of
    that name lets the model classes import (calling it fails); returns whether one was needed,
    which the record notes."""
    import torch.distributed.fsdp as fsdp
    if hasattr(fsdp, "DataParallelMeshDims"):
        return False

    class DataParallelMeshDims:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("placeholder for torch >= 2.12's FSDP DataParallelMeshDims")
    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return True

SIZES = {
    "h200": dict(hidden=1024, intermediate=1024, experts=32, top_k=4, layers=4, heads=16, kv_heads=4,
                 head_dim=64, seq=256, batch=256),
    "tiny": dict(hidden=64, intermediate=64, experts=4, top_k=2, layers=2, heads=4, kv_heads=2,
                 head_dim=16, seq=32, batch=4),
}
SIZE_KEYS = tuple(SIZES["h200"])

_TT_FUSED = "torchtitan.overrides.fused_swiglu.fused_grouped_experts"
_EA = "expertact.torchtitan.expertact_grouped_experts"
_EA_FUSED = "expertact.torchtitan.expertact_fused_grouped_experts"
# name -> (override target or None, expertact modes, the variant it repeats)
VARIANTS = {
    "torchtitan": (None, None, None),
    "torchtitan_fused": (_TT_FUSED, None, None),
    "expertact": (_EA, {}, None),
    "expertact_fused": (_EA_FUSED, {}, None),
    "expertact_inplace": (_EA, dict(inplace_backward=True), None),
    "expertact_recompute": (_EA, dict(recompute=True), None),
    "expertact_repeat": (_EA, {}, "expertact"),
    "torchtitan_repeat": (None, None, "torchtitan"),
}
DEFAULT_VARIANTS = ("torchtitan", "torchtitan_fused", "expertact", "expertact_fused", "expertact_inplace",
                    "expertact_repeat")
GPU_ONLY = {"torchtitan_fused"}
BASELINE, YARDSTICK = "torchtitan", "torchtitan_fused"


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--size", choices=tuple(SIZES), default=None,
                   help="size preset: h200 (default on CUDA) or tiny (default on the CPU)")
    for key in SIZE_KEYS:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"override the preset's {key}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, from {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)}; "
                   "on the CPU without the GPU-only torchtitan_fused)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="bf16 on CUDA, fp32 on the CPU by default")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default="torchtitan_out")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args, p


def model_config(s):
    """TorchTitan's Qwen3-MoE model config at sizes `s` (a fresh config tree each call: overrides
    rewrite it in place)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    layers = _build_qwen3_moe_layers(
        n_layers=s["layers"], dim=s["hidden"], n_heads=s["heads"], n_kv_heads=s["kv_heads"], head_dim=s["head_dim"],
        moe_hidden_dim=s["intermediate"], num_experts=s["experts"], top_k=s["top_k"], attn_backend="flex",
        moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=s["head_dim"], max_seq_len=s["seq"], theta=1e6))
    for layer in layers:
        # Plain causal attention: TorchTitan's language-model backends (flex, varlen) take
        # per-document masks; flex has no CPU backward. Each window here is one causal sequence.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    dim = s["hidden"]
    return Qwen3Model.Config(
        vocab_size=common.VOCAB, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=common.VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=common.VOCAB, param_init=_LINEAR_INIT),
        layers=layers)


def build_variant(s, name, device, dtype, compute_dtype, state, deterministic):
    """The model of variant `name` on `device` in `dtype`, with the initial `state` loaded;
    returns (model, override log lines, experts class name)."""
    import torch
    from torch.nn.attention import SDPBackend
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.attention import ScaledDotProductAttention

    target, modes, _ = VARIANTS[name]
    cfg = model_config(s)
    lines = []
    if target is not None:
        entry = target if modes is None else (target, dict(modes, compute_dtype=compute_dtype))
        lines = apply_overrides(OverrideConfig(imports=[entry]), cfg)
    with torch.device(device):
        model = cfg.build()
        model.init_states(buffer_device=device)
    common.cast_params(model, dtype)
    model.load_state_dict(state)
    for m in model.modules():
        if isinstance(m, ScaledDotProductAttention) and deterministic:
            m.sdpa_backends = [SDPBackend.MATH]
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("inner_experts")})
    return model, lines, experts


def run(argv=None, log=print):
    args, p = parse_args(argv)
    det = common.setup_determinism(args.deterministic)
    import torch
    import torch.nn.functional as F

    device = common.resolve_device(args)
    size = args.size or ("h200" if device.type == "cuda" else "tiny")
    s = dict(SIZES[size])
    for key in SIZE_KEYS:
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    # expertact computes in bf16 as TorchTitan's GroupedExperts does; in an fp32 run in the
    # parameters' dtype (TorchTitan's module still casts to bf16 there: see docs/finetune.md).
    compute_dtype = "bfloat16" if dtype_name == "bf16" else None
    if args.variants is None:
        names = [v for v in DEFAULT_VARIANTS if device.type == "cuda" or v not in GPU_ONLY]
    else:
        names = [v for v in args.variants.split(",") if v]
    common.check_variants(p, names, VARIANTS)
    fsdp_placeholder = _fsdp_name_for_older_torch()

    t0 = time.perf_counter()
    tokens, corpus = common.load_tokens()
    batches = common.Batches(tokens, s["seq"], s["batch"], args.seed)
    t1 = time.perf_counter()
    torch.manual_seed(args.seed)
    base = model_config(s).build()
    base.init_states()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    n_params = sum(v.numel() for v in base.parameters())
    del base
    t2 = time.perf_counter()
    tokens_per_step = s["batch"] * s["seq"]
    setup = dict(model="torchtitan qwen3 MoE (Qwen3Model)", size=size, sizes=s, steps=args.steps, warmup=args.warmup,
                 lr=args.lr, seed=args.seed, dtype=dtype_name, expertact_compute_dtype=compute_dtype,
                 tokens_per_step=tokens_per_step, expert_rows_per_layer=tokens_per_step * s["top_k"], params=n_params,
                 corpus=corpus, epoch_steps=batches.epoch_steps, determinism=det,
                 fsdp_placeholder=fsdp_placeholder,
                 attention="SDPA math backend" if args.deterministic else "SDPA (cuDNN, flash, math)",
                 optimizer="AdamW(betas=(0.9, 0.95), weight_decay=0.1), clip 1.0, "
                 f"linear warm-up {max(1, min(20, args.steps // 10))} steps")
    log(f"torchtitan qwen3 MoE ({size}): {n_params / 1e6:.1f}M parameters, {tokens_per_step:,} tokens/step, "
        f"{tokens_per_step * s['top_k']:,} expert rows per layer and step, {dtype_name} on {device}; setup "
        f"{t1 - t0:.1f} s data, {t2 - t1:.1f} s model", flush=True)
    result = common.start_result("TorchTitan Qwen3-MoE training loop, routed experts", setup, device, names, args.out,
                                 argv, BASELINE, YARDSTICK)

    def loss_fn(model, ids):
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    def new_record(name):
        target, modes, repeats = VARIANTS[name]
        impl = "GroupedExperts" if target is None else target.rsplit(".", 1)[1]
        if modes:
            impl += " " + json.dumps(modes)
        return dict(implementation=impl, override=target, repeats=repeats, expertact_modes=modes)

    def prepare(name, model, record):
        model, lines, experts = build_variant(s, name, device, dtype, compute_dtype, state, args.deterministic)
        record.update(override_log=lines, experts_class=experts)
        return model

    return common.train_variants(names, result, new_record, lambda name: None, prepare, loss_fn, batches, args,
                                 device, tokens_per_step, log)

def main(argv=None):
    result = run(argv)
    return 1 if any("error" in r for r in result["variants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
