"""Where a profiled span's time went, from torch.profiler's events: the GPU's kernels (busy time as
the union of their intervals, so overlapping streams count once; the largest by total time), the
GPU's idle gaps and the CUDA runtime calls the host made during them, and the host's counts of the
calls that decide whether a step is bound by the host (GEMM calls, kernel launches, waits for the
device). Used by bench/mlp_kernel_profile.py and examples/finetune_gpt_oss.py --profile; torch is
imported by the caller, not here.

The figures are the profiler's: its own overhead lengthens the host's side (each op's record),
so a profiled step's wall time is an upper bound of an unprofiled one; kernel times are not
affected."""
from __future__ import annotations

import bisect

# The host calls counted per step: name -> its label. aten ops are counted with their nested
# work (inclusive time); runtime calls are leaves.
HOST_CALLS = {
    "aten::_scaled_mm": "torch._scaled_mm",
    "aten::_scaled_grouped_mm": "torch._scaled_grouped_mm",
    "aten::_grouped_mm": "torch._grouped_mm",
    "aten::mm": "torch.mm",
    "aten::_local_scalar_dense": "a device value read on the host (.item(), .tolist())",
    "cudaLaunchKernel": "kernel launches (cudaLaunchKernel)",
    "cudaLaunchKernelExC": "kernel launches (cudaLaunchKernelExC)",
    "cuLaunchKernel": "kernel launches (cuLaunchKernel)",
    "cuLaunchKernelEx": "kernel launches (cuLaunchKernelEx)",
    "cudaMemcpyAsync": "cudaMemcpyAsync",
    "cudaStreamSynchronize": "cudaStreamSynchronize",
    "cudaDeviceSynchronize": "cudaDeviceSynchronize",
    "cudaMemsetAsync": "cudaMemsetAsync",
}
GAP_US = 50.0  # an idle stretch of the GPU counted as a gap


def is_gemm(name: str) -> bool:
    """A GEMM kernel by its name (cuBLAS's, CUTLASS's), not torch's setup kernels around one."""
    n = name.lower()
    return any(k in n for k in ("gemm", "xmma", "cutlass", "nvjet", "wgmma")) and "prepare" not in n


def summarise(events, wall_s: float = None, steps: int = 1, top: int = 20) -> dict:
    """The summary of a profiled span of ``steps`` steps (``wall_s``: its wall time, if measured).
    Every time in the result is in ms per step. Keys: wall_ms, kernel_ms (sum of kernel times),
    busy_ms (their union), idle_ms (wall - busy; None without wall_s), gemm_ms, kernels (name,
    ms, count per step; the ``top`` largest), gaps (count and ms of idle stretches of GAP_US or
    more between the first and last kernel, and the five largest: ms, the kernels before and
    after), gap_calls (runtime call -> ms inside those gaps),
    host (label -> [count, inclusive ms] per step), steps."""
    steps = max(1, int(steps))
    kern, cpu = [], []
    for e in events:
        kind = e.device_type.name
        if kind == "CUDA" and not getattr(e, "is_user_annotation", False):  # a range such as
            # the optimizer's "Optimizer.step#AdamW.step" on the GPU's timeline is not a kernel
            kern.append((e.time_range.start, e.time_range.end, e.name))
        elif kind == "CPU":
            cpu.append((e.time_range.start, e.time_range.end, e.name))
    kern.sort()
    by_name = {}
    for a, b, n in kern:
        r = by_name.setdefault(n, [0.0, 0])
        r[0] += b - a
        r[1] += 1
    busy, gaps, end, last = 0.0, [], None, None
    for a, b, n in kern:
        if end is None or a >= end:
            if end is not None and a - end >= GAP_US:
                gaps.append((end, a, last, n))
            busy += b - a
            end, last = b, n
        elif b > end:
            busy += b - end
            end, last = b, n
    gap_calls = {}
    runtime = sorted(c for c in cpu if c[2].startswith("cu"))
    starts = [c[0] for c in runtime]
    longest = max((c[1] - c[0] for c in runtime), default=0.0)
    for g0, g1, _, _ in gaps:  # the calls that overlap [g0, g1): those starting from g0 - longest on
        for c0, c1, n in runtime[bisect.bisect_left(starts, g0 - longest):bisect.bisect_left(starts, g1)]:
            if c1 > g0:
                gap_calls[n] = gap_calls.get(n, 0.0) + min(c1, g1) - max(c0, g0)
    host = {}
    for c0, c1, n in cpu:
        label = HOST_CALLS.get(n)
        if label is not None:
            r = host.setdefault(label, [0, 0.0])
            r[0] += 1
            r[1] += c1 - c0
    per = 1e3 * steps  # us in the span -> ms per step
    wall_ms = None if wall_s is None else 1e3 * wall_s / steps
    return dict(
        steps=steps,
        wall_ms=wall_ms,
        kernel_ms=sum(v[0] for v in by_name.values()) / per,
        busy_ms=busy / per,
        idle_ms=None if wall_ms is None else wall_ms - busy / per,
        gemm_ms=sum(v[0] for n, v in by_name.items() if is_gemm(n)) / per,
        kernels=[(n, v[0] / per, v[1] / steps) for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        gaps=dict(count=len(gaps) / steps, ms=sum(g[1] - g[0] for g in gaps) / per,
                  largest=[((b - a) / 1e3, before, after) for a, b, before, after in
                           sorted(gaps, key=lambda g: g[0] - g[1])[:5]]),
        gap_calls={n: us / per for n, us in sorted(gap_calls.items(), key=lambda kv: -kv[1])[:8]},
        host={k: [v[0] / steps, v[1] / per] for k, v in sorted(host.items(), key=lambda kv: -kv[1][1])},
    )


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def report(s: dict, tag: str = "") -> str:
    """``summarise``'s result as text, one figure per line, times in ms per step."""
    p = f"{tag}: " if tag else ""
    lines = [f"{p}per step over {s['steps']} profiled step(s): wall {_ms(s['wall_ms'])} ms, GPU busy "
             f"{_ms(s['busy_ms'])} ms (kernels {_ms(s['kernel_ms'])}, of them GEMMs {_ms(s['gemm_ms'])}), "
             f"GPU idle {_ms(s['idle_ms'])} ms"]
    if not s["kernels"]:
        lines.append(f"{p}no GPU kernels recorded (a CPU run)")
    else:
        lines.append(f"{p}idle gaps of {GAP_US:.0f} us or more between kernels: {s['gaps']['count']:.1f} a step, "
                     f"{_ms(s['gaps']['ms'])} ms; runtime calls inside them (ms): "
                     + (", ".join(f"{n} {v:.2f}" for n, v in s["gap_calls"].items()) or "none"))
        lines += [f"  gap {ms:8.3f} ms after {a[:50]!r} before {b[:50]!r}" for ms, a, b in s["gaps"]["largest"]]
        lines.append(f"{p}kernels by time per step (ms, calls):")
        lines += [f"  {ms:9.3f} {n_:7.1f}x  {name[:110]}" for name, ms, n_ in s["kernels"]]
    lines.append(f"{p}host calls per step (count, inclusive ms):")
    lines += [f"  {c:9.1f} {ms:9.2f}  {label}" for label, (c, ms) in s["host"].items()] or ["  none"]
    return "\n".join(lines)
