"""expertact-bench: the activation table, --peers (beside DeepSpeed's Triton kernels at several
sizes), --mlp (the expert MLP and its memory modes) or --experts (transformers' experts
implementations), chosen by the command line.

    python -m expertact.bench                       # the activation table, this machine's default size
    python -m expertact.bench --rows 65536 --ffn 1536 --presets swiglu_oai --impls compile,expertact
    expertact-bench --json out.json --markdown out.md
    python -m expertact.bench --peers               # beside DeepSpeed's Triton kernels, several sizes
    python -m expertact.bench --mlp                 # the expert MLP (expertact.moe) and its memory modes
                                                    # (docs/python.md)
    python -m expertact.bench --mlp --fp8           # the FP8 expert MLP beside bf16, torchao and the FP8 GEMM floor
    python -m expertact.bench --mlp --bias          # the same with and without GPT-OSS's expert biases, beside
                                                    # the torch compositions with biases
    python -m expertact.bench --experts             # Hugging Face transformers' experts: eager, grouped_mm,
                                                    # expertact (expertact/bench/experts.py)
    python -m expertact.bench --autoep              # DeepSpeed AutoEP's GroupedExperts: DeepSpeed's own forward,
                                                    # with expertact's activation, expertact's whole MLP (bf16, FP8)
    python -m expertact.bench --megatron            # Megatron-Core's SequentialMLP experts beside expertact's
                                                    # ExpertMLP (bf16, memory modes, FP8); Python >= 3.12
    python -m expertact.bench --fp8-gemms           # the six FP8 GEMMs alone, as each FP8 recipe calls torch's
                                                    # (expertact/bench/fp8_gemm.py)
    python -m expertact.bench --fp8-accuracy        # each FP8 GEMM of the expert MLP against float64, per recipe
"""
from __future__ import annotations

import argparse
import sys

from . import activation
from .common import DTYPES, LAYOUTS, PRESETS


def parse_args(argv=None):
    """The options of the activation table and of --peers (--mlp has its own: expertact.bench.mlp)."""
    cuda_d, cpu_d = activation.CUDA_DEFAULT, activation.CPU_DEFAULT
    p = argparse.ArgumentParser(prog="expertact-bench", description=activation.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows (default {cuda_d['rows']:,} on CUDA, {cpu_d['rows']:,} on the CPU)")
    p.add_argument("--ffn", type=int, default=None,
                   help=f"F (default {cuda_d['ffn']} on CUDA, {cpu_d['ffn']} on the CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--presets", default=None, help=f"default {','.join(PRESETS)}")
    p.add_argument("--layouts", default=None, help=f"default {','.join(LAYOUTS)}")
    p.add_argument("--impls", default=None,
                   help=f"default {','.join(activation.IMPLS)}; with --peers also deepspeed, default without eager")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default 10 on CUDA, 20 with --peers, 5 on the CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps, the first compiles (default 2 on CUDA, 3 with --peers, 1 on the CPU)")
    p.add_argument("--scale", type=float, default=6.0, help="inputs are scale x standard normal")
    p.add_argument("--alpha", type=float, default=1.702)
    p.add_argument("--limit", type=float, default=7.0)
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    g = p.add_argument_group("--peers mode (expertact/bench/peers.py)")
    g.add_argument("--peers", action="store_true",
                   help="expertact beside DeepSpeed's Triton kernels, torch.compile (and eager, if in --impls) "
                        "at several sizes, with the winner per cell and a host-cost table")
    g.add_argument("--sizes", default=None, metavar="RxF,...",
                   help="e.g. 65536x1536,16384x1536 (default on CUDA: the five of expertact.bench.peers.PEER_SIZES; "
                        "--rows/--ffn: one size)")
    g.add_argument("--quick", action="store_true",
                   help="swiglu and swiglu_oai, separate and halves, 1,045,081 x 3,072 and 65,536 x 1,536")
    g.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="repeat each measurement N times; the table shows the spread (min-max) of the N medians")
    g.add_argument("--host-size", default="256x128", metavar="RxF", help="size of the host-cost table")
    g.add_argument("--host-only", action="store_true", help="the host-cost table alone (no sizes)")
    g.add_argument("--host-iters", type=int, default=None,
                   help="calls per timed block of the host-cost table (default 200 on CUDA, 50 on the CPU); "
                        "0: no host-cost table")
    p.add_argument("--mlp", action="store_true",
                   help="the expert-MLP table instead (expertact.bench.mlp; its own options follow, e.g. --bias: "
                        "with and without the expert biases)")
    p.add_argument("--autoep", action="store_true",
                   help="DeepSpeed AutoEP's GroupedExperts instead (expertact.bench.autoep; its own options follow)")
    p.add_argument("--megatron", action="store_true",
                   help="Megatron-Core's experts instead (expertact.bench.megatron; its own options follow)")
    p.add_argument("--experts", action="store_true",
                   help="Hugging Face transformers' experts implementations instead (expertact.bench.experts; "
                        "its own options follow)")
    p.add_argument("--fp8-gemms", action="store_true",
                   help="the six FP8 GEMMs alone, as each FP8 recipe calls torch's "
                        "(expertact.bench.fp8_gemm; its own options follow)")
    p.add_argument("--fp8-accuracy", action="store_true",
                   help="each FP8 GEMM of the expert MLP against float64, per recipe "
                        "(expertact.bench.fp8_accuracy; its own options follow)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mlp" in argv and "--fp8" in argv:  # the FP8 expert-MLP table, with its own options
        from . import fp8

        return fp8.main([x for x in argv if x not in ("--mlp", "--fp8")])
    if "--mlp" in argv:  # the expert-MLP table, with its own options
        from . import mlp

        return mlp.main([x for x in argv if x != "--mlp"])
    if "--autoep" in argv:  # DeepSpeed AutoEP's GroupedExperts, with its own options
        from . import autoep

        return autoep.main([x for x in argv if x != "--autoep"])
    if "--megatron" in argv:  # Megatron-Core's experts, with their own options
        from . import megatron

        return megatron.main([x for x in argv if x != "--megatron"])
    if "--fp8-gemms" in argv:  # the six FP8 GEMMs alone, with their own options
        from . import fp8_gemm

        return fp8_gemm.main([x for x in argv if x != "--fp8-gemms"])
    if "--fp8-accuracy" in argv:  # each FP8 GEMM against float64, with its own options
        from . import fp8_accuracy

        return fp8_accuracy.main([x for x in argv if x != "--fp8-accuracy"])
    if "--experts" in argv:  # transformers' experts implementations, with their own options
        from . import experts

        return experts.main([x for x in argv if x != "--experts"])
    a = parse_args(argv)
    if a.peers:
        from . import peers

        return peers.run(a, argv)
    peers_only = [o for o, v in (("--sizes", a.sizes), ("--quick", a.quick), ("--repeat", a.repeat != 1),
                                 ("--host-only", a.host_only)) if v]
    if peers_only:
        raise SystemExit(f"expertact-bench: {', '.join(peers_only)} need --peers")
    return activation.run(a, argv)
