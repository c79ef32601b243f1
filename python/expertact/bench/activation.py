"""The expertact benchmark: the seed's table reproduced side by side in one run.

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
    python -m expertact.bench --peers               # beside DeepSpeed's Triton kernels, several sizes
    python -m expertact.bench --mlp                 # the expert MLP (expertact.moe) and its memory modes
                                                    # (expertact/_peers.py; docs/python.md)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import expertact

GiB = 1024 ** 3
PRESETS = ("swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh")
LAYOUTS = ("separate", "halves", "up_first", "interleaved")
IMPLS = ("eager", "compile", "expertact", "expertact-inplace")
CUDA_DEFAULT = dict(rows=1_045_081, ffn=3072, dtype="bfloat16")  # the seed: MiniMax-M3's busiest EP rank
CPU_DEFAULT = dict(rows=2048, ffn=1024, dtype="float32")
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The peers: the eager expressions (those of the seed's peer baseline)
# ---------------------------------------------------------------------------


def eager_form(preset: str, alpha: float, limit: float):
    if preset == "swiglu":
        return lambda g, u: F.silu(g) * u
    if preset == "swiglu_clamped":
        def clamped(g, u):
            g = g.clamp(max=limit)
            u = u.clamp(min=-limit, max=limit)
            return u * (g * torch.sigmoid(g))
        return clamped
    if preset == "swiglu_oai":
        def oai(g, u):
            g = g.clamp(max=limit)
            u = u.clamp(min=-limit, max=limit)
            return (u + 1) * (g * torch.sigmoid(alpha * g))
        return oai
    if preset == "geglu_tanh":
        return lambda g, u: F.gelu(g, approximate="tanh") * u
    raise ValueError(f"unknown preset {preset!r}")


def split(layout: str):
    """gate_up -> (gate, up) views for a packed layout."""
    if layout == "halves":
        return lambda gu: gu.chunk(2, dim=-1)
    if layout == "up_first":
        return lambda gu: tuple(reversed(gu.chunk(2, dim=-1)))
    if layout == "interleaved":
        return lambda gu: (gu[..., 0::2], gu[..., 1::2])
    raise ValueError(f"unknown layout {layout!r}")


def make_fn(impl: str, preset: str, layout: str, alpha: float, limit: float):
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
# Measurement
# ---------------------------------------------------------------------------


class Inputs:
    """Leaves requiring grad (gate and up, or gate_up) and the upstream gradient,
    all allocated before anything is measured."""

    def __init__(self, layout, rows, ffn, dtype, device, scale, seed=0):
        self.scale = scale
        self.gen = torch.Generator(device=device).manual_seed(seed)
        shapes = [(rows, ffn), (rows, ffn)] if layout == "separate" else [(rows, 2 * ffn)]
        self.args = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        self.refresh()
        for a in self.args:
            a.requires_grad_()
        self.grad = torch.empty(rows, ffn, dtype=dtype, device=device).normal_(generator=self.gen)

    def refresh(self):
        """New 6 x N(0,1) values (an in-place backward overwrote the old ones with gradients)."""
        with torch.no_grad():
            for a in self.args:
                a.normal_(generator=self.gen).mul_(self.scale)

    def clear(self):
        for a in self.args:
            a.grad = None


class CudaClock:
    def __init__(self):
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def step(self, fn, inp):
        s, m, e = self.ev
        s.record()
        out = fn(*inp.args)
        m.record()
        out.backward(inp.grad)
        e.record()
        e.synchronize()
        return s.elapsed_time(m), m.elapsed_time(e)


class CpuClock:
    def step(self, fn, inp):
        t0 = time.perf_counter()
        out = fn(*inp.args)
        t1 = time.perf_counter()
        out.backward(inp.grad)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def cuda_memory(fn, inp):
    """(extra peak, kept) bytes of one forward+backward, as the seed's peer baseline measures them."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inp.args)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.backward(inp.grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak, kept


def cpu_memory(fn, inp):
    """The same two numbers on the CPU, from the allocator events the profiler records
    (profile_memory=True): every allocation and free of torch's CPU allocator, in time order."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with _without_kineto_markers(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("expertact_bench_forward"):
            out = fn(*inp.args)
        out_bytes = out.numel() * out.element_size()
        out.backward(inp.grad)
        del out
    events = prof.profiler.kineto_results.events()
    fwd_end = max((e.end_ns() for e in events if e.name() == "expertact_bench_forward"), default=None)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    if fwd_end is None or not mem:
        return None, None
    live = peak = 0
    at_fwd_end = None
    for ts, nbytes in mem:
        if at_fwd_end is None and ts > fwd_end:
            at_fwd_end = live
        live += nbytes
        peak = max(peak, live)
    if at_fwd_end is None:
        at_fwd_end = live
    return peak, at_fwd_end - out_bytes


@contextlib.contextmanager
def _without_kineto_markers():
    """Drop the two marker lines torch.profiler's backend prints on every profile.

    Kineto (libkineto, inside libtorch_cpu) logs "USDT:... SyncActivityProfilerHandler.cpp:52]
    profiler_start" and "...profiler_stop" through std::cerr at its USDT level, which is above
    ERROR: KINETO_LOG_LEVEL could only drop them by dropping its errors too. So fd 2 goes to a
    temporary file while the profiler runs and every other line is passed on afterwards."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 to redirect: leave the output as it is
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not (line.startswith("USDT:") and ("profiler_start" in line or "profiler_stop" in line)):
                    sys.stderr.write(line)
            sys.stderr.flush()


def measure(fn, inp, clock, memory, iters, warmup, refresh):
    for _ in range(warmup):
        inp.clear()
        if refresh:
            inp.refresh()
        clock.step(fn, inp)
    inp.clear()
    if refresh:
        inp.refresh()
    peak, kept = memory(fn, inp)
    fwd, bwd, tot = [], [], []
    for _ in range(iters):
        inp.clear()
        if refresh:
            inp.refresh()
        f, b = clock.step(fn, inp)
        fwd.append(f)
        bwd.append(b)
        tot.append(f + b)
    inp.clear()
    return dict(
        extra_peak_gib=None if peak is None else peak / GiB,
        kept_gib=None if kept is None else kept / GiB,
        fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
        ms=statistics.median(tot), ms_min=min(tot),
    )


def copy_bandwidth(nbytes, device):
    """Device-to-device (or host memcpy) bandwidth in bytes/s, counting bytes read + written."""
    n = max(nbytes // 2, 1)
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        for _ in range(10):
            s.record()
            b.copy_(a)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
    else:
        for _ in range(30):
            t0 = time.perf_counter()
            b.copy_(a)
            ts.append(time.perf_counter() - t0)
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return 2 * n * 2 / statistics.median(ts)
    # On a CPU shared with other work one descheduled thread stretches a copy many times
    # over: the best of 30 is the machine's bandwidth.
    return 2 * n * 2 / min(ts)


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _fmt(v, nd=2):
    return "n/a" if v is None else f"{v:.{nd}f}"


# Memory is shown in GiB on CUDA (the seed's unit) and in MiB at the CPU's small default size.
_UNITS = {"GiB": 1.0, "MiB": 1024.0}


def _bw(tbs):
    return f"{tbs:.3f} TB/s" if tbs >= 0.5 else f"{tbs * 1e3:.1f} GB/s"


def _mem(gib, unit):
    return _fmt(None if gib is None else gib * _UNITS[unit])


def row_line(r, unit):
    if "error" in r:
        return f"{r['preset']:15s} {r['layout']:12s} {r['impl']:18s} ERROR {r['error']}"
    return (f"{r['preset']:15s} {r['layout']:12s} {r['impl']:18s} peak {_mem(r['extra_peak_gib'], unit):>7s} {unit}  "
            f"kept {_mem(r['kept_gib'], unit):>7s} {unit}  fwd {r['fwd_ms']:7.2f}  bwd {r['bwd_ms']:7.2f}  "
            f"fwd+bwd {r['ms']:7.2f} ms  ({r['pct_floor']:5.1f}% of floor)")


def markdown(meta, results):
    unit = meta["mem_unit"]
    lines = [
        f"## expertact benchmark: {meta['device_name']}",
        "",
        f"- size: {meta['rows']:,} x {meta['ffn']:,} {meta['dtype']} (one [rows, F] tensor: "
        f"{_mem(meta['tensor_gib'], unit)} {unit}), inputs {meta['scale']:g} x standard normal, "
        f"alpha {meta['alpha']:g}, limit {meta['limit']:g}",
        f"- copy bandwidth {_bw(meta['copy_tbs'])} (read + written); 8-pass floor "
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
            f"| {r['preset']} | {r['layout']} | {r['impl']} | {_mem(r['extra_peak_gib'], unit)} | "
            f"{_mem(r['kept_gib'], unit)} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['ms']:.2f} | "
            f"{r['pct_floor']:.1f} |")
    lines.append("")
    lines.append("% of floor = floor time / fwd+bwd time: 100% is a forward and backward as fast as copying "
                 "their 8 passes of bytes; extra peak and kept as defined in docs/python.md.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def _csv(value, allowed, what):
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"expertact-bench: unknown {what} {bad}; choose from {','.join(allowed)}")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="expertact-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows (default {CUDA_DEFAULT['rows']:,} on CUDA, {CPU_DEFAULT['rows']:,} on the CPU)")
    p.add_argument("--ffn", type=int, default=None,
                   help=f"F (default {CUDA_DEFAULT['ffn']} on CUDA, {CPU_DEFAULT['ffn']} on the CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--presets", default=None, help=f"default {','.join(PRESETS)}")
    p.add_argument("--layouts", default=None, help=f"default {','.join(LAYOUTS)}")
    p.add_argument("--impls", default=None,
                   help=f"default {','.join(IMPLS)}; with --peers also deepspeed, default without eager")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default 10 on CUDA, 20 with --peers, 5 on the CPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps, the first compiles (default 2 on CUDA, 3 with --peers, 1 on the CPU)")
    p.add_argument("--scale", type=float, default=6.0, help="inputs are scale x standard normal")
    p.add_argument("--alpha", type=float, default=1.702)
    p.add_argument("--limit", type=float, default=7.0)
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    g = p.add_argument_group("--peers mode (expertact/_peers.py)")
    g.add_argument("--peers", action="store_true",
                   help="expertact beside DeepSpeed's Triton kernels, torch.compile (and eager, if in --impls) "
                        "at several sizes, with the winner per cell and a host-cost table")
    g.add_argument("--sizes", default=None, metavar="RxF,...",
                   help="e.g. 65536x1536,16384x1536 (default on CUDA: the five of issue 9; --rows/--ffn: one size)")
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
                   help="the expert-MLP table instead (python -m expertact.bench_mlp; its own options follow)")
    return p.parse_args(argv)


def resolve_device(name: str) -> torch.device:
    """--device: auto (cuda if available), cuda, cuda:N or cpu; a CUDA device becomes current."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"{expertact.cpu_threads()} expertact threads)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mlp" in argv:  # the expert-MLP table (python/expertact/bench_mlp.py)
        from .bench_mlp import main as mlp_main

        return mlp_main([x for x in argv if x != "--mlp"])
    a = parse_args(argv)
    if a.peers:
        from . import _peers

        return _peers.main(a, argv)
    peers_only = [o for o, v in (("--sizes", a.sizes), ("--quick", a.quick), ("--repeat", a.repeat != 1), ("--host-only", a.host_only)) if v]
    if peers_only:
        raise SystemExit(f"expertact-bench: {', '.join(peers_only)} need --peers")
    device = resolve_device(a.device)
    cuda = device.type == "cuda"
    d = CUDA_DEFAULT if cuda else CPU_DEFAULT
    rows = a.rows if a.rows is not None else d["rows"]
    ffn = a.ffn if a.ffn is not None else d["ffn"]
    dtype_name = a.dtype or d["dtype"]
    dtype = _DTYPES[dtype_name]
    iters = a.iters if a.iters is not None else (10 if cuda else 5)
    warmup = a.warmup if a.warmup is not None else (2 if cuda else 1)
    presets = _csv(a.presets or ",".join(PRESETS), PRESETS, "presets")
    layouts = _csv(a.layouts or ",".join(LAYOUTS), LAYOUTS, "layouts")
    impls = _csv(a.impls or ",".join(IMPLS), IMPLS, "impls")

    esize = torch.empty((), dtype=dtype).element_size()
    tensor_bytes = rows * ffn * esize
    name = device_name(device)
    log(f"expertact-bench on {name}: {rows:,} x {ffn:,} {dtype_name}; torch {torch.__version__}")
    bw = copy_bandwidth(tensor_bytes, device)
    floor_ms = 8 * tensor_bytes / bw * 1e3
    meta = dict(
        device=str(device), device_name=name, rows=rows, ffn=ffn, dtype=dtype_name,
        tensor_gib=tensor_bytes / GiB, mem_unit="GiB" if tensor_bytes >= GiB // 8 else "MiB", scale=a.scale, alpha=a.alpha, limit=a.limit,
        copy_tbs=bw / 1e12, floor_ms=floor_ms, floor_fwd_ms=3 * tensor_bytes / bw * 1e3,
        floor_bwd_ms=5 * tensor_bytes / bw * 1e3, iters=iters, warmup=warmup,
        timer="CUDA events" if cuda else "time.perf_counter",
        memory_source=("torch.cuda.max_memory_allocated / memory_allocated" if cuda else
                       "torch CPU allocator events recorded by torch.profiler (profile_memory=True)"),
        torch=torch.__version__, cuda=torch.version.cuda if cuda else None,
        expertact=expertact.__version__, expertact_cuda=expertact.has_cuda(),
        python=platform.python_version(), command="expertact-bench " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    log(f"copy bandwidth {_bw(bw / 1e12)}; one [rows, F] tensor {tensor_bytes / 2**20:.1f} MiB; "
        f"8-pass floor {floor_ms:.2f} ms")

    clock = CudaClock() if cuda else CpuClock()
    memory = cuda_memory if cuda else cpu_memory
    todo = [(p, l, i) for p in presets for l in layouts for i in impls]
    results = []
    t_start = time.time()
    for k, (preset, layout, impl) in enumerate(todo, 1):
        log(f"[{k}/{len(todo)}] {preset} {layout} {impl} ... ({time.time() - t_start:.0f} s so far)")
        r = dict(preset=preset, layout=layout, impl=impl)
        inp = None
        try:
            inp = Inputs(layout, rows, ffn, dtype, device, a.scale)
            fn = make_fn(impl, preset, layout, a.alpha, a.limit)
            r.update(measure(fn, inp, clock, memory, iters, warmup, refresh=impl == "expertact-inplace"))
            r["pct_floor"] = floor_ms / r["ms"] * 100
        except _OOM:
            r["error"] = "OOM"
        except Exception as e:  # one failing cell does not end the table
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del inp
        if cuda:
            torch.cuda.empty_cache()
        results.append(r)
        print(row_line(r, meta["mem_unit"]), flush=True)
    meta["wall_s"] = time.time() - t_start
    md = markdown(meta, results)
    print()
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        log(f"wrote {a.json}")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
        log(f"wrote {a.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
