"""The host side of the blockwise recipe's per-expert GEMMs (expertact.moe._gemm's
_blockwise_per_expert, the six of one MoE layer), with no GPU: run on meta tensors, torch._scaled_mm
stubbed, so what is left is the Python and dispatcher work around the GEMM calls. Counts the
torch._scaled_mm calls, the aten ops and those that launch a kernel on a GPU (copies, fills,
allocations excluded), and times the host per layer. Routing: experts' shares drawn skewed (as a
trained router's are; --even for equal shares), so most experts' row counts are no multiple of 4.

    python3 bench/blockwise_host_ops.py                       # the GPT-OSS fine-tuning's shape: 32,8192,1024,1024
    python3 bench/blockwise_host_ops.py --shape 4,261280,3072,3072 --even
"""
from __future__ import annotations

import argparse
import collections
import random
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from expertact import _fp8_buffers
from expertact.moe import _gemm

TILE = _gemm.TILE
E4M3 = torch.float8_e4m3fn
# aten ops that run a kernel on a GPU (views, allocations and metadata do not)
LAUNCHING = ("copy_", "clone", "zero_", "fill_", "zeros", "ones", "cat", "repeat_interleave", "index")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def routing(E, T, even, seed=0):
    rng = random.Random(seed)
    w = [1.0] * E if even else [rng.random() ** 3 for _ in range(E)]
    counts = [int(T * x / sum(w)) for x in w]
    counts[-1] += T - sum(counts)
    ends = [sum(counts[:i + 1]) for i in range(E)]
    return counts, ends, _fp8_buffers.padded_offsets(ends, TILE)  # the weight gradients' padded ends, as the node


def layer(E, T, D, F, ends, pends):
    """The six GEMMs of one layer as the node calls them: gate_up, y, dh, dx (M-grouped), dw2, dw13;
    B's scales 128 x 128 where K's block count is a multiple of 4 (as square_weight_scales on sm90)."""
    def m(K, N):
        a = torch.empty((T, K), dtype=E4M3, device="meta")
        sa = torch.empty((-(-K // TILE), T), device="meta").t()
        b = torch.empty((E, N, K), dtype=E4M3, device="meta")
        return _gemm._blockwise_per_expert(a, sa, b, torch.empty((E, -(-N // TILE), -(-K // TILE)), device="meta"),
                                           ends, "m", False, -(-K // TILE) % 4 == 0)

    def k(M, N):
        Tp = pends[-1]
        a, b = (torch.empty((n, Tp), dtype=E4M3, device="meta") for n in (M, N))
        sa, sb = (torch.empty((Tp // TILE, n), device="meta") for n in (M, N))
        return _gemm._blockwise_per_expert(a, sa, b, sb, pends, "k", True)

    m(D, 2 * F), m(F, D), m(D, F), m(2 * F, D), k(F, D), k(D, 2 * F)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="32,8192,1024,1024", help="E,ROWS,D,F (rows per expert at an even share)")
    p.add_argument("--even", action="store_true", help="equal shares (default: skewed)")
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args(argv)
    E, rows, D, F = (int(v) for v in a.shape.split(","))
    T = E * rows
    counts, ends, pends = routing(E, T, a.even)
    calls = []
    real = torch._scaled_mm

    def stub(x, y, out=None, **kw):
        calls.append(x.shape[0])
        return out if out is not None else torch.empty((x.shape[0], y.shape[1]), dtype=torch.bfloat16, device="meta")

    torch._scaled_mm = stub
    try:
        layer(E, T, D, F, ends, pends)  # warm-up
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            layer(E, T, D, F, ends, pends)
            times.append(time.perf_counter() - t0)
        calls.clear()
        with Count() as c:
            layer(E, T, D, F, ends, pends)
    finally:
        torch._scaled_mm = real
    launching = sum(n for op, n in c.ops.items() if any(f".{w}." in op or op.endswith(f".{w}") for w in LAUNCHING))
    times.sort()
    print(f"shape E={E} T={T:,} D={D} F={F}, {'even' if a.even else 'skewed'} routing: "
          f"{sum(n % 4 != 0 for n in counts)} of {E} experts' rows no multiple of 4, busiest "
          f"{max(counts) / rows:.2f}x an even share")
    print(f"one layer's six GEMMs: {len(calls)} torch._scaled_mm calls, {sum(c.ops.values())} aten ops, "
          f"{launching} of them launching a kernel; host {times[len(times) // 2] * 1e3:.2f} ms (median of "
          f"{a.repeat}, meta tensors, torch {torch.__version__})")


if __name__ == "__main__":
    main()
