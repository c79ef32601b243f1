"""What every benchmark of expertact.bench shares: the reference expressions, the inputs, the
clocks, the memory measurement, the device and the table formatting.

This module sits at the bottom of the subpackage: the benchmark modules import it, and it
imports none of them.

Timing: CUDA events after warm-up on a GPU, time.perf_counter on the CPU. Memory of one
forward+backward: torch.cuda.max_memory_allocated / memory_allocated on a GPU; on the CPU the
allocations and frees torch's CPU allocator reports to the profiler (profile_memory=True),
replayed in time order.
"""
from __future__ import annotations

import contextlib
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
#: The activations and layouts a table covers by default (expertact.PRESETS and expertact.LAYOUTS
#: without the alias halves_up_first).
PRESETS = ("swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh")
LAYOUTS = ("separate", "halves", "up_first", "interleaved")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def log(msg: str) -> None:
    """Progress goes to stderr: stdout holds the tables alone."""
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The reference: the eager PyTorch expressions of each activation
# ---------------------------------------------------------------------------


def preset_kwargs(preset: str, alpha: float, limit: float) -> dict:
    """The keyword arguments a preset takes (expertact.<preset>, expert_mlp): alpha and limit for
    swiglu_oai, limit for swiglu_clamped, none for the others."""
    return {"swiglu_oai": dict(alpha=alpha, limit=limit), "swiglu_clamped": dict(limit=limit)}.get(preset, {})


def eager_form(preset: str, alpha: float, limit: float):
    """(gate, up) -> h as eager PyTorch computes it: the peers' baseline and the reference of
    the correctness checks."""
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


# ---------------------------------------------------------------------------
# Inputs, clocks, memory
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
        """New scale x N(0,1) values (an in-place backward overwrote the old ones with gradients)."""
        with torch.no_grad():
            for a in self.args:
                a.normal_(generator=self.gen).mul_(self.scale)

    def clear(self):
        for a in self.args:
            a.grad = None


class CudaClock:
    """(forward ms, backward ms) of one step, from CUDA events."""

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
    """(forward ms, backward ms) of one step, from time.perf_counter."""

    def step(self, fn, inp):
        t0 = time.perf_counter()
        out = fn(*inp.args)
        t1 = time.perf_counter()
        out.backward(inp.grad)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def cuda_memory(fn, inp):
    """(extra peak, kept) bytes of one forward+backward: the peak allocated during it minus what
    was allocated before, and what forward left allocated besides its output."""
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

    with without_kineto_markers(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
def without_kineto_markers():
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


def clock_and_memory(device):
    """The step clock and the memory measurement for a device."""
    if device.type == "cuda":
        return CudaClock(), cuda_memory
    return CpuClock(), cpu_memory


def method(device) -> dict:
    """How time and memory are measured on a device, as the tables' headers say it."""
    cuda = device.type == "cuda"
    return dict(timer="CUDA events" if cuda else "time.perf_counter",
                memory_source=("torch.cuda.max_memory_allocated / memory_allocated" if cuda else
                               "torch CPU allocator events recorded by torch.profiler (profile_memory=True)"))


def measure(fn, inp, clock, memory, iters, warmup, refresh):
    """warmup steps, one memory measurement, then iters timed steps of forward+backward; the
    medians of forward, backward and their sum per step, and the memory in GiB. refresh: new
    input values before every step (for an in-place backward, which overwrites them)."""
    def fresh():
        inp.clear()
        if refresh:
            inp.refresh()

    for _ in range(warmup):
        fresh()
        clock.step(fn, inp)
    fresh()
    peak, kept = memory(fn, inp)
    fwd, bwd, tot = [], [], []
    for _ in range(iters):
        fresh()
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
# Device and options
# ---------------------------------------------------------------------------


def median_ms(fn, iters, warmup, device=None) -> float:
    """Median ms of fn over iters calls after warmup calls: CUDA events around each call on a
    GPU (the default), wall time on the CPU (device of type cpu)."""
    cuda = device is None or torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def add_mlp_args(p, cpu_rows: int) -> None:
    """The options the expert-MLP tables share (--mlp --fp8, --autoep): the device and shape, the
    step counts, the error columns and the outputs; `cpu_rows` is the rows-per-expert default
    the help names for the CPU. mlp_settings resolves them."""
    p.add_argument("--device", default="auto")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows per expert (default 261,280 on CUDA, {cpu_rows:,} on the CPU)")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    add_step_args(p)


def add_step_args(p) -> None:
    """The step counts, the error columns and the outputs of a table (step_counts resolves the
    counts)."""
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up")
    p.add_argument("--no-errors", action="store_true", help="skip the float32 reference and the error columns")
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")


def step_counts(a, cuda: bool):
    """(timed steps, warm-up steps) from add_step_args' options: 10 timed after 2 warm-up on
    CUDA, 3 after 1 with --quick or on the CPU."""
    iters = a.iters if a.iters is not None else (3 if a.quick else 10 if cuda else 3)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick or not cuda else 2)
    return iters, warmup


def mlp_settings(a, cuda: bool, default: dict):
    """(E, rows per expert, D, F, timed steps, warm-up steps) from add_mlp_args' options, each
    left out taken from `default` (experts, rows, dim, ffn); the step counts as step_counts."""
    E, rows = a.experts or default["experts"], a.rows if a.rows is not None else default["rows"]
    D, F = a.dim or default["dim"], a.ffn or default["ffn"]
    return (E, rows, D, F, *step_counts(a, cuda))


def rel_error(a, ref) -> float:
    """||a - ref|| / ||ref||, a compared in float32 with a float32 reference."""
    return float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))


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


def parse_list(value, allowed, what):
    """A comma-separated option, each item one of allowed (SystemExit otherwise)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"expertact-bench: unknown {what} {bad}; choose from {','.join(allowed)}")
    return items


def element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------
# Table output
# ---------------------------------------------------------------------------

#: Memory is shown in GiB at GPU sizes and in MiB at the CPU's small default sizes.
UNITS = {"GiB": 1.0, "MiB": 1024.0}


def mem_unit(tensor_bytes) -> str:
    """The unit of a table whose one [rows, F] tensor has this many bytes."""
    return "GiB" if tensor_bytes >= GiB // 8 else "MiB"


def fmt(v, nd=2):
    return "n/a" if v is None else f"{v:.{nd}f}"


def fmt_bandwidth(tbs):
    return f"{tbs:.3f} TB/s" if tbs >= 0.5 else f"{tbs * 1e3:.1f} GB/s"


def fmt_mem(gib, unit):
    return fmt(None if gib is None else gib * UNITS[unit])


def versions(device) -> dict:
    """The versions every table's header names."""
    cuda = device.type == "cuda"
    return dict(torch=torch.__version__, cuda=torch.version.cuda if cuda else None,
                expertact=expertact.__version__, expertact_cuda=expertact.has_cuda(),
                python=platform.python_version())


def write_outputs(json_path, md_path, data, md, *, quiet=False):
    """--json and --markdown, when given."""
    import json

    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
        if not quiet:
            log(f"wrote {json_path}")
    if md_path:
        with open(md_path, "w") as f:
            f.write(md)
        if not quiet:
            log(f"wrote {md_path}")


def fp8_rows(prefix: str) -> dict:
    """{row name: FP8 recipe}, one row for each recipe of expertact.moe.FP8_RECIPES, as the FP8
    tables name them: prefix + "fp8" for "rowwise" (the name that row always had), prefix +
    "fp8-" + the name less its "rowwise-" for the others ("mlp-fp8-bf16-wgrad",
    "mlp-fp8-promoted-wgrad", "mlp-fp8-blockwise"). A recipe that cannot run on a table's device
    makes a skipped row (expert_mlp's NotImplementedError, naming what is missing)."""
    from expertact.moe import FP8_RECIPES
    return {prefix + ("fp8" if name == "rowwise" else "fp8-" + name.removeprefix("rowwise-")): name
            for name in FP8_RECIPES}


def run_row(row: dict, thunk, skip=(NotImplementedError, )) -> dict:
    """row updated with thunk()'s measurements, or with what ended them: "OOM"; "skipped: ..."
    (row["skipped"]) for the exceptions in skip, what cannot run on this machine; else the
    exception. One failing row does not end the table."""
    try:
        row.update(thunk())
    except OOM:
        row["error"] = "OOM"
    except skip as e:
        row["error"], row["skipped"] = f"skipped: {str(e)[:160]}", True
    except Exception as e:  # noqa: BLE001 - one failing row does not end the table
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def timing_error_rows(results, what, unit="GiB") -> list:
    """The markdown rows of a forward/backward table with memory and error columns: row, fwd ms,
    bwd ms, fwd+bwd ms, extra peak, kept, then one ||a - ref|| / ||ref|| cell per name in what."""
    lines = []
    for r in results:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} |" + " |" * (4 + len(what)))
            continue
        e = r.get("err") or {}
        cells = [("n/a" if e.get(k) is None else f"{e[k]:.2e}") for k in what]
        f, b = (("n/a" if r.get(k) is None else f"{r[k]:.2f}") for k in ("fwd_ms", "bwd_ms"))
        lines.append(f"| {r['impl']} | {f} | {b} | {r['ms']:.3f} | "
                     f"{fmt_mem(r.get('extra_peak_gib'), unit)} | {fmt_mem(r.get('kept_gib'), unit)} | "
                     + " | ".join(cells) + " |")
    return lines


def target_lines(checks) -> list:
    """The markdown of a table's (text, passed) targets: a "Targets:" list, or nothing."""
    if not checks:
        return []
    return ["", "Targets:", ""] + [f"- {'PASS' if ok else 'FAIL'}: {t}" for t, ok in checks]


def timing_error_table(heading, results, what, checks, unit="GiB") -> list:
    """One titled forward/backward table of timing_error_rows (its header made from `what`), then
    its targets."""
    head = (f"| row | fwd ms | bwd ms | fwd+bwd ms | extra peak {unit} | kept {unit} | "
            + " | ".join(f"{k} err" for k in what) + " |")
    return (["", heading, "", head, "|---|" + "---:|" * (5 + len(what))] + timing_error_rows(results, what, unit)
            + target_lines(checks))


def measured_rows(label, impls, row_of, inp, cuda):
    """One guarded row (run_row) per impl: row_of(impl) measures it; inp.clear() and the CUDA
    cache emptied after each; each row logged. Returns (rows, whether a row failed other than
    by being skipped)."""
    results, failed = [], False
    for impl in impls:
        r = run_row(dict(impl=impl), lambda: row_of(impl))
        inp.clear()
        if cuda:
            torch.cuda.empty_cache()
        results.append(r)
        failed |= "error" in r and not r.get("skipped")
        log(f"{label} {impl}: " + (r["error"] if "error" in r else
                                   f"{r['ms']:.3f} ms, extra peak {r.get('extra_peak_gib')}, err {r.get('err')}"))
    return results, failed


def finish(a, data, md, failed) -> int:
    """Print a table's markdown, write its --json / --markdown outputs; the exit status."""
    print()
    print(md)
    write_outputs(a.json, a.markdown, data, md)
    return 1 if failed else 0


def errors_against(fn, inp, ref, what) -> dict:
    """One forward + backward of fn(*inp.args) with inp.grad: ||a - ref|| / ||ref|| of the output
    and of inp.grads() against ref, keyed by the names in what (None where a gradient is None)."""
    inp.clear()
    y = fn(*inp.args)
    y.backward(inp.grad)
    got = [y.detach()] + inp.grads()
    out = {k: (None if g is None else rel_error(g, r)) for k, g, r in zip(what, got, ref)}
    del y, got
    inp.clear()
    return out
