"""The fused grouped GEMMs alone (docs/fused-gemm.md) beside torch._grouped_mm on the same
GEMM, at the expert-MLP benchmark's shape: what the epilogue costs, in ms and TFLOP/s.

Rows: the forward GEMM gate_up = x @ w13^T (torch._grouped_mm; then the fused kernel, which also
writes h), and the backward GEMM dh = dy @ w2^T (torch._grouped_mm writing dh; then the fused
kernel, which writes dgate_up in place instead of dh). CUDA events, median of --iters after
--warmup. The fused kernels' schedule: EXPERTACT_FUSED_SCHEDULE (cooperative | pingpong | pingpong64, those
the library was built with).

The fused grouped GEMMs are experimental: correct, but slower than the unfused path on the H200
(docs/fused-gemm.md). Needs a CUDA device and a build with them (exit status 2 otherwise).

    python -m expertact.bench.fused                     # 4 x 261,280 rows, D = F = 3,072, bf16
    python -m expertact.bench.fused --rows 4096 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import expertact
from expertact import _fused

from .common import median_ms


def _time(fn, iters, warmup):
    """Median ms of fn over iters CUDA-event-timed calls after warmup calls."""
    return median_ms(fn, iters, warmup)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m expertact.bench.fused", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--rows", type=int, default=261_280, help="rows per expert")
    p.add_argument("--dim", type=int, default=3072)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--preset", default="swiglu_oai", choices=sorted(expertact.PRESETS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("expertact.bench.fused: needs a CUDA device", file=sys.stderr)
        return 2
    E, R, D, F = a.experts, a.rows, a.dim, a.ffn
    T = E * R
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    why = _fused.why_not(x, D, F)
    if why is not None:
        print(f"expertact.bench.fused: {why}", file=sys.stderr)
        return 2
    act, alpha, limit, beta = expertact.PRESETS[a.preset]
    alpha = 1.702 if alpha is None else alpha
    limit = 7.0 if limit is None else limit
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * R
    w13i = (torch.randn(E, 2 * F, D, device="cuda") * 6 / D ** 0.5).bfloat16()
    w2k = (torch.randn(E, F, D, device="cuda") / F ** 0.5).bfloat16()
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    gate_up, _ = _fused.forward(x, w13i, offs, None, act, alpha, limit, beta)
    rows = []

    def row(name, fn, flops):
        ms = _time(fn, a.iters, a.warmup)
        rows.append(dict(name=name, ms=ms, tflops=flops / (ms / 1e3) / 1e12))
        print(f"{name:44s} {ms:8.3f} ms  {rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)

    fwd_flops, bwd_flops = 2 * T * D * 2 * F, 2 * T * D * F
    row("gate_up GEMM, torch._grouped_mm", lambda: torch._grouped_mm(x, w13i.transpose(-2, -1), offs=offs),
        fwd_flops)
    row("gate_up GEMM + h, fused", lambda: _fused.forward(x, w13i, offs, None, act, alpha, limit, beta), fwd_flops)
    row("dh GEMM, torch._grouped_mm", lambda: torch._grouped_mm(dy, w2k.transpose(-2, -1), offs=offs), bwd_flops)
    # In place over the forward's gate_up, step after step: the same work each step (the values
    # change, not the cost).
    row("dh GEMM -> dgate_up (in place), fused",
        lambda: _fused.backward(dy, w2k, offs, gate_up, None, False, True, act, alpha, limit, beta), bwd_flops)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                schedule=os.environ.get("EXPERTACT_FUSED_SCHEDULE") or "the build's default",
                experts=E, rows=R, dim=D, ffn=F, preset=a.preset, iters=a.iters, warmup=a.warmup,
                command="python -m expertact.bench.fused " + " ".join(sys.argv[1:] if argv is None else argv))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
