"""The activation table: the fused gated activation beside the eager PyTorch expression and
torch.compile of it, every preset x layout, forward and backward, time and memory, in one run.

For each preset x layout: eager PyTorch, torch.compile of the same expression,
expertact, and expertact with in-place backward; columns:

  extra peak  max memory allocated during forward+backward minus what was allocated
              before (inputs and upstream gradient allocated before)
  kept        memory allocated after forward, minus the output (what forward keeps for backward)
  fwd, bwd    median forward and backward times; fwd+bwd the median of their sum per step
  % floor     the bytes floor (8 passes over one [rows, F] tensor at the device-to-device
              copy bandwidth measured in the same run) / fwd+bwd time: 100% = at the floor

On CUDA: CUDA events after warm-up, memory from torch.cuda.max_memory_allocated.
Without a GPU the same table runs on the CPU at a reduced default size: time from
perf_counter, memory from the allocations and frees torch's CPU allocator reports to
the profiler (profile_memory=True), replayed in time order.

    python -m expertact.bench                       # the full table, this machine's default size
    python -m expertact.bench --rows 65536 --ffn 1536 --presets swiglu_oai --impls compile,expertact
    expertact-bench --json out.json --markdown out.md
"""
from __future__ import annotations

import sys
import time

import torch

import expertact

from .common import (
    DTYPES, GiB, LAYOUTS, OOM, PRESETS, Inputs, clock_and_memory, copy_bandwidth, device_name, eager_form,
    element_size, fmt_bandwidth, fmt_mem, log, measure, mem_unit, method, parse_list, resolve_device, split,
    versions, write_outputs,
)

IMPLS = ("eager", "compile", "expertact", "expertact-inplace")
CUDA_DEFAULT = dict(rows=1_045_081, ffn=3072, dtype="bfloat16")  # the seed: MiniMax-M3's busiest EP rank
CPU_DEFAULT = dict(rows=2048, ffn=1024, dtype="float32")


def defaults(device) -> dict:
    """The default size and dtype on this device."""
    return CUDA_DEFAULT if device.type == "cuda" else CPU_DEFAULT


def make_fn(impl: str, preset: str, layout: str, alpha: float, limit: float):
    """The function a table row times: fn(gate, up) for the separate layout, fn(gate_up) otherwise."""
    if impl in ("eager", "compile"):
        f = eager_form(preset, alpha, limit)
        if layout != "separate":
            s = split(layout)
            f = (lambda f, s: (lambda gu: f(*s(gu))))(f, s)
        if impl == "compile":
            torch._dynamo.reset()  # a fresh cache per form: never fall back to eager on a recompile limit
            f = torch.compile(f, dynamic=False)
        return f
    inplace = impl == "expertact-inplace"
    kw = {"inplace_backward": inplace}
    if preset == "swiglu_oai":
        kw.update(alpha=alpha, limit=limit)
    elif preset == "swiglu_clamped":
        kw.update(limit=limit)
    ea = getattr(expertact, preset)
    if layout == "separate":
        return lambda g, u: ea(g, u, **kw)
    return lambda gu: ea(gu, layout=layout, **kw)


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def row_line(r, unit):
    """One row as it is printed while the table runs."""
    if "error" in r:
        return f"{r['preset']:15s} {r['layout']:12s} {r['impl']:18s} ERROR {r['error']}"
    return (f"{r['preset']:15s} {r['layout']:12s} {r['impl']:18s} peak {fmt_mem(r['extra_peak_gib'], unit):>7s} {unit}  "
            f"kept {fmt_mem(r['kept_gib'], unit):>7s} {unit}  fwd {r['fwd_ms']:7.2f}  bwd {r['bwd_ms']:7.2f}  "
            f"fwd+bwd {r['ms']:7.2f} ms  ({r['pct_floor']:5.1f}% of floor)")


def markdown(meta, results):
    unit = meta["mem_unit"]
    lines = [
        f"## expertact benchmark: {meta['device_name']}",
        "",
        f"- size: {meta['rows']:,} x {meta['ffn']:,} {meta['dtype']} (one [rows, F] tensor: "
        f"{fmt_mem(meta['tensor_gib'], unit)} {unit}), inputs {meta['scale']:g} x standard normal, "
        f"alpha {meta['alpha']:g}, limit {meta['limit']:g}",
        f"- copy bandwidth {fmt_bandwidth(meta['copy_tbs'])} (read + written); 8-pass floor "
        f"{meta['floor_ms']:.2f} ms (forward 3 passes {meta['floor_fwd_ms']:.2f} ms, backward 5 passes "
        f"{meta['floor_bwd_ms']:.2f} ms)",
        f"- timing: {meta['timer']}, median of {meta['iters']} after {meta['warmup']} warm-up; memory: "
        f"{meta['memory_source']}",
        f"- torch {meta['torch']}" + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "")
        + f", expertact {meta['expertact']} (CUDA path built: {meta['expertact_cuda']}), "
        f"Python {meta['python']}",
        f"- command: `{meta['command']}`",
        "",
        f"| preset | layout | implementation | extra peak {unit} | kept {unit} | fwd ms | bwd ms | fwd+bwd ms | % of floor |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['layout']} | {r['impl']} | {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['preset']} | {r['layout']} | {r['impl']} | {fmt_mem(r['extra_peak_gib'], unit)} | "
            f"{fmt_mem(r['kept_gib'], unit)} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['ms']:.2f} | "
            f"{r['pct_floor']:.1f} |")
    lines.append("")
    lines.append("% of floor = floor time / fwd+bwd time: 100% is a forward and backward as fast as copying "
                 "their 8 passes of bytes; extra peak and kept as defined in docs/python.md.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def settings(a, device) -> dict:
    """The options resolved against this device's defaults."""
    cuda = device.type == "cuda"
    d = defaults(device)
    dtype_name = a.dtype or d["dtype"]
    return dict(
        rows=a.rows if a.rows is not None else d["rows"],
        ffn=a.ffn if a.ffn is not None else d["ffn"],
        dtype_name=dtype_name, dtype=DTYPES[dtype_name],
        iters=a.iters if a.iters is not None else (10 if cuda else 5),
        warmup=a.warmup if a.warmup is not None else (2 if cuda else 1),
        presets=parse_list(a.presets or ",".join(PRESETS), PRESETS, "presets"),
        layouts=parse_list(a.layouts or ",".join(LAYOUTS), LAYOUTS, "layouts"),
        impls=parse_list(a.impls or ",".join(IMPLS), IMPLS, "impls"),
    )


def measure_cell(preset, layout, impl, s, device, a, clock, memory, floor_ms):
    """One row of the table: its measurements, or the error that stopped it."""
    r = dict(preset=preset, layout=layout, impl=impl)
    inp = None
    try:
        inp = Inputs(layout, s["rows"], s["ffn"], s["dtype"], device, a.scale)
        fn = make_fn(impl, preset, layout, a.alpha, a.limit)
        r.update(measure(fn, inp, clock, memory, s["iters"], s["warmup"], refresh=impl == "expertact-inplace"))
        r["pct_floor"] = floor_ms / r["ms"] * 100
    except OOM:
        r["error"] = "OOM"
    except Exception as e:  # one failing cell does not end the table
        r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del inp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def run(a, argv) -> int:
    """The table for the parsed options a (argv: the command line, for the header)."""
    device = resolve_device(a.device)
    s = settings(a, device)
    rows, ffn = s["rows"], s["ffn"]
    tensor_bytes = rows * ffn * element_size(s["dtype"])
    name = device_name(device)
    log(f"expertact-bench on {name}: {rows:,} x {ffn:,} {s['dtype_name']}; torch {torch.__version__}")
    bw = copy_bandwidth(tensor_bytes, device)
    floor_ms = 8 * tensor_bytes / bw * 1e3
    meta = dict(
        device=str(device), device_name=name, rows=rows, ffn=ffn, dtype=s["dtype_name"],
        tensor_gib=tensor_bytes / GiB, mem_unit=mem_unit(tensor_bytes), scale=a.scale, alpha=a.alpha,
        limit=a.limit, copy_tbs=bw / 1e12, floor_ms=floor_ms, floor_fwd_ms=3 * tensor_bytes / bw * 1e3,
        floor_bwd_ms=5 * tensor_bytes / bw * 1e3, iters=s["iters"], warmup=s["warmup"], **method(device),
        **versions(device), command="expertact-bench " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    log(f"copy bandwidth {fmt_bandwidth(bw / 1e12)}; one [rows, F] tensor {tensor_bytes / 2**20:.1f} MiB; "
        f"8-pass floor {floor_ms:.2f} ms")

    clock, memory = clock_and_memory(device)
    todo = [(p, l, i) for p in s["presets"] for l in s["layouts"] for i in s["impls"]]
    results = []
    t_start = time.time()
    for k, (preset, layout, impl) in enumerate(todo, 1):
        log(f"[{k}/{len(todo)}] {preset} {layout} {impl} ... ({time.time() - t_start:.0f} s so far)")
        r = measure_cell(preset, layout, impl, s, device, a, clock, memory, floor_ms)
        results.append(r)
        print(row_line(r, meta["mem_unit"]), flush=True)
    meta["wall_s"] = time.time() - t_start
    md = markdown(meta, results)
    print()
    print(md)
    write_outputs(a.json, a.markdown, dict(meta=meta, results=results), md)
    return 0
