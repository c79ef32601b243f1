"""Host cost per call of expertact (every layout, weights, in place) beside DeepSpeed's Triton
SwiGLU (when importable) and eager PyTorch, at a tiny size where the host is the bottleneck.
A thin CLI over expertact.bench.hostcost (the measurement lives in the package).

    python bench/host_cost.py --device cuda            # 256 x 128 bf16
    python bench/host_cost.py --device cpu --clock thread
    python bench/host_cost.py --device cuda --json "$OUT/host_cost.json"
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

import expertact
from expertact.bench.hostcost import DEFAULT_SIZE, iter_measure

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, help="default: 256 on CUDA, 4 on the CPU")
    ap.add_argument("--ffn", type=int, help="F, the output width (default: 128 on CUDA, 8 on the CPU)")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--iters", type=int, default=1000, help="calls per timed round")
    ap.add_argument("--repeats", type=int, default=7, help="rounds; the median is reported")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall: perf_counter; thread: this thread's CPU time (steadier on a shared machine)")
    ap.add_argument("--only", help="comma-separated substrings of the case names to run")
    ap.add_argument("--json", help="also write the rows and the environment here")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda" and not (torch.cuda.is_available() and expertact.has_cuda()):
        print("host_cost: --device cuda needs a GPU and a CUDA build of expertact", file=sys.stderr)
        return 2
    rows, ffn, dtype = DEFAULT_SIZE[dev.type]
    rows, ffn = args.rows or rows, args.ffn or ffn
    dtype = _DTYPES[args.dtype] if args.dtype else dtype
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    env = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(), "expertact": expertact.__version__,
        "size": [rows, ffn, str(dtype).replace("torch.", "")], "iters": args.iters, "repeats": args.repeats,
        "clock": args.clock, "EXPERTACT_NUM_THREADS": os.environ.get("EXPERTACT_NUM_THREADS"),
    }
    try:  # the version without importing it (its import logs to stdout)
        from importlib.metadata import version
        env["deepspeed"] = version("deepspeed")
    except Exception:
        env["deepspeed"] = None
    names = args.only.split(",") if args.only else None
    print(f"# host cost, us per call (median of {args.repeats} rounds of {args.iters}), {rows} x {ffn} "
          f"{env['size'][2]} on {env['device']}, torch {env['torch']}, deepspeed {env['deepspeed']}, "
          f"clock {args.clock}", flush=True)
    print(f"{'case':40s} {'fwd no-grad':>12s} {'fwd':>8s} {'fwd+bwd':>8s}", flush=True)
    results = []
    for row in iter_measure(dev, iters=args.iters, repeats=args.repeats, clock=clock, names=names,
                       rows=rows, ffn=ffn, dtype=dtype):
        results.append(row)
        print(f"{row['case']:40s} {row['fwd_nograd_us']:12.1f} {row['fwd_us']:8.1f} {row['fwd_bwd_us']:8.1f}",
              flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
