"""The --peers mode of expertact.bench: expertact beside DeepSpeed's Triton SwiGLU kernels and
torch.compile (eager PyTorch on request) at several sizes in one run, the winner of each
(form, layout, size) with its margin, the spread over --repeat runs, and a host-cost table.

Every cell is checked against eager float32 before it is timed; a cell that computes another
function fails the run (exit status 1).

    python -m expertact.bench --peers --json peers.json --markdown peers.md
    python -m expertact.bench --peers --quick --repeat 3
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import math
import os
import statistics
import time
import types

import torch

import expertact

from . import activation
from .common import (
    DTYPES, GiB, LAYOUTS, OOM, PRESETS, Inputs, clock_and_memory, copy_bandwidth, device_name, element_size,
    fmt_bandwidth, log, measure, method, parse_list, resolve_device, versions, write_outputs,
)
from .hostcost import host_cost_us, import_deepspeed_kernels

#: The sizes: the seed (MiniMax-M3's busiest expert-parallel rank), a quarter of it, two
#: rank sizes of smaller models, and an odd F (no 16-byte packs in the packed layouts).
PEER_SIZES = ((1_045_081, 3072), (262_144, 3072), (65_536, 1536), (16_384, 1536), (65_536, 2881))
#: --quick: two forms, two layouts, two sizes (8 cells per implementation).
QUICK = dict(presets=("swiglu", "swiglu_oai"), layouts=("separate", "halves"),
             sizes=((1_045_081, 3072), (65_536, 1536)))
IMPLS = ("eager", "compile", "deepspeed", "expertact", "expertact-inplace")
#: eager is 1.7-11x slower than the rest at the seed size (docs/BENCHMARKS.md, "The activation beside eager
#: PyTorch at the seed size"): only on request.
DEFAULT_IMPLS = ("compile", "deepspeed", "expertact", "expertact-inplace")
PEERS = ("eager", "compile", "deepspeed")
OURS = ("expertact", "expertact-inplace")
NAMES = {"eager": "eager", "compile": "torch.compile", "deepspeed": "DeepSpeed",
         "expertact": "expertact", "expertact-inplace": "expertact in place"}
#: Rows of each output and gradient compared with eager float32 before a cell is timed.
CHECK_ROWS = 512
#: Largest accepted error of that check, max |got - want| / (|want| + mean |want|). Measured on
#: 6 x N(0,1) inputs: bf16 eager (every op rounded) 0.022, bf16 expertact 0.0036, float32
#: expertact 1.5e-5; the mistakes it is there for (swiglu_oai with alpha 1 or without its +1,
#: another limit, gate and up swapped) 2.7 to 38.
CHECK_TOL = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.1}


# ---------------------------------------------------------------------------
# DeepSpeed's kernels
# ---------------------------------------------------------------------------


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class DeepSpeedKernels:
    """DeepSpeed's Triton SwiGLU kernels, imported when first needed, or why they cannot run.

    DeepSpeed 0.19.8 fuses one form: swiglu, as swiglu(gate, up) (the separate layout) and
    swiglu_packed(gate_up) (halves). Its expert-activation registry (deepspeed.moe.ep_experts)
    runs the other forms, and every other layout, as eager PyTorch: those cells are "n/a"."""

    def __init__(self, device):
        self.version = _dist_version("deepspeed")
        self.loaded = None  # how the module was loaded
        self.module = None  # DeepSpeed's swiglu_triton module, once loaded
        self.accelerator = None  # DS_ACCELERATOR during that import (hostcost.import_deepspeed_kernels)
        self.reason = None  # why no DeepSpeed cell can run here (None: they can)
        self.kernels = {}
        if self.version is None:
            self.reason = "not installed"
        elif device.type != "cuda":
            self.reason = "needs CUDA/Triton"
        else:
            self._load()

    def _load(self):
        self.accelerator = os.environ.get("DS_ACCELERATOR") or "cuda"
        try:
            mod, self.loaded = import_deepspeed_kernels()
        except ImportError as e:
            self.reason = f"not importable ({e})"
            return
        self.module = mod
        log(f"DeepSpeed {self.version}: {self.loaded}")
        if not getattr(mod, "_TRITON_AVAILABLE", False):
            self.reason = "needs CUDA/Triton (DeepSpeed found no active Triton backend)"
            return
        self.kernels = {("swiglu", "separate"): mod.swiglu, ("swiglu", "halves"): mod.swiglu_packed}

    def fn(self, preset, layout):
        return None if self.reason else self.kernels.get((preset, layout))

    def why_not(self, preset, layout):
        """A table cell's word for a DeepSpeed cell that is not run (None: it is run); the
        details of a failed import are in the markdown's header and the JSON's meta."""
        if self.reason:
            return self.reason.split(" (")[0]
        return "n/a" if (preset, layout) not in self.kernels else None


def make_fn(impl, preset, layout, alpha, limit, ds):
    if impl == "deepspeed":
        return ds.fn(preset, layout)
    return activation.make_fn(impl, preset, layout, alpha, limit)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def check(fn, inp, preset, layout, alpha, limit):
    """The largest error of one forward+backward of fn against eager PyTorch in float32, over the
    first CHECK_ROWS rows of the output and of each gradient (a row depends on its own row only).
    inf when anything is not finite: a NaN never passes."""
    k = min(CHECK_ROWS, inp.args[0].shape[0])
    xs = [a[:k].detach().float().requires_grad_() for a in inp.args]
    want_out = activation.make_fn("eager", preset, layout, alpha, limit)(*xs)
    want_grads = torch.autograd.grad(want_out, xs, inp.grad[:k].float())
    inp.clear()
    out = fn(*inp.args)
    out.backward(inp.grad)
    pairs = [(out[:k], want_out)] + [(a.grad[:k], w) for a, w in zip(inp.args, want_grads)]
    worst = 0.0
    for got, want in pairs:
        got, want = got.detach().float(), want.detach()
        if not bool(torch.isfinite(got).all()):
            worst = math.inf
            break
        worst = max(worst, ((got - want).abs() / (want.abs() + want.abs().mean())).max().item())
    del out, pairs
    inp.clear()
    return worst


def _spread(values):
    return [min(values), max(values)]


def aggregate(cell, floor_ms):
    """The medians over the repeats; the spread is the min and max of the per-repeat medians."""
    reps = cell.pop("reps")
    if not reps:
        return cell
    for key in ("fwd_ms", "bwd_ms", "ms"):
        cell[key] = statistics.median(r[key] for r in reps)
        cell[key + "_spread"] = _spread([r[key] for r in reps])
    cell["ms_per_repeat"] = [r["ms"] for r in reps]
    cell["extra_peak_gib"] = reps[0]["extra_peak_gib"]
    cell["kept_gib"] = reps[0]["kept_gib"]
    cell["pct_floor"] = floor_ms / cell["ms"] * 100
    return cell


def verdict(ours, peer, repeat):
    """The target of one cell: expertact's fwd+bwd at or below the fastest peer's."""
    if ours is None or peer is None:
        return "n/a"
    margin = (ours["ms"] / peer["ms"] - 1) * 100
    if margin <= 0:
        return "met"
    if repeat < 2:
        return f"missed by {margin:.1f}% (--repeat 2+ shows the noise)"
    lo, hi = ours["ms_spread"], peer["ms_spread"]
    if lo[0] <= hi[1]:  # the spreads overlap: the difference is within the run-to-run noise
        return f"within noise (+{margin:.1f}%)"
    return f"missed by {margin:.1f}% (beyond the noise)"


def summarize(cells, sizes, forms, impls, ds, repeat):
    out = []
    for (preset, layout), (rows, ffn) in ((f, z) for f in forms for z in sizes):
        got = {c["impl"]: c for c in cells if (c["preset"], c["layout"], c["rows"], c["ffn"]) ==
               (preset, layout, rows, ffn) and "ms" in c and c.get("check_ok", True)}
        peers = {i: c for i, c in got.items() if i in PEERS}
        best = min(peers, key=lambda i: peers[i]["ms"]) if peers else None
        s = dict(preset=preset, layout=layout, rows=rows, ffn=ffn, fastest_peer=best,
                 winner=min(got, key=lambda i: got[i]["ms"]) if got else None,
                 ms={i: c["ms"] for i, c in got.items()}, ms_spread={i: c["ms_spread"] for i, c in got.items()})
        if "deepspeed" in impls:
            s["deepspeed_status"] = ds.why_not(preset, layout)
        for ours in OURS:
            if ours in got and best:
                s[f"{ours}_vs_peer_pct"] = (got[ours]["ms"] / peers[best]["ms"] - 1) * 100
        s["target"] = verdict(got.get("expertact"), peers.get(best), repeat)
        out.append(s)
    return out


def host_rows(impls):
    """(label, impl, layout, weights) of the host-cost table: the preset is swiglu, the one form
    DeepSpeed has kernels for. eager is always there: at 256 x 128 it costs nothing."""
    rows = [("expertact", "expertact", lay, False) for lay in LAYOUTS]
    rows += [("expertact, weights", "expertact", lay, True) for lay in ("separate", "halves")]
    rows += [("expertact in place", "expertact-inplace", lay, False) for lay in ("separate", "halves")]
    rows += [("DeepSpeed swiglu", "deepspeed", "separate", False),
             ("DeepSpeed swiglu_packed", "deepspeed", "halves", False)]
    rows += [("torch.compile", "compile", lay, False) for lay in ("separate", "halves")]
    rows += [("eager", "eager", lay, False) for lay in ("separate", "halves")]
    return [r for r in rows if r[1] in impls or r[1] == "eager"]


def _host_fn(impl, layout, weights, ds, alpha, limit):
    if impl in OURS:
        kw = dict(inplace_backward=impl == "expertact-inplace")
        if layout != "separate":
            kw["layout"] = layout
        if not weights:
            # The plain separate call is the bare function, as DeepSpeed's rows are.
            return expertact.swiglu if not any(kw.values()) else functools.partial(expertact.swiglu, **kw)
        if layout == "separate":
            return lambda g, u, w: expertact.swiglu(g, u, weights=w, **kw)
        return lambda gu, w: expertact.swiglu(gu, weights=w, **kw)
    return make_fn(impl, "swiglu", layout, alpha, limit, ds)


def host_table(rows, ffn, dtype, device, impls, ds, iters, repeat, alpha, limit):
    """Microseconds per call (hostcost.host_cost_us: fresh leaves for every call, the garbage
    collector off while timing, the median of its rounds) of forward alone and of forward+backward.
    The rows are measured in interleaved rounds (every row once per round, at least 3 rounds), so
    that a slow start of the process or a busy moment of the machine falls on every row alike
    rather than on the first one: the value is the median over the rounds, the spread their range."""
    out, todo = [], []
    for label, impl, layout, weights in host_rows(impls):
        r = dict(label=label, impl=impl, layout=layout, weights=weights)
        out.append(r)
        if impl == "deepspeed" and ds.fn("swiglu", layout) is None:
            r["error"] = ds.why_not("swiglu", layout)
            continue
        try:
            fn = _host_fn(impl, layout, weights, ds, alpha, limit)
        except Exception as e:  # one failing row does not end the table
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        shapes = [(rows, ffn)] * 2 if layout == "separate" else [(rows, 2 * ffn)]
        gen = torch.Generator(device=device).manual_seed(0)
        base = [torch.randn(s, generator=gen, dtype=torch.float32, device=device).mul_(6).to(dtype) for s in shapes]
        wbase = torch.rand(rows, generator=gen, device=device) if weights else None

        def make_args(base=base, wbase=wbase):
            leaves = [b.clone().requires_grad_() for b in base]
            if wbase is not None:
                leaves.append(wbase.clone().requires_grad_())
            return leaves

        grad = torch.randn(rows, ffn, dtype=dtype, device=device)

        def step(*leaves, fn=fn, grad=grad):
            fn(*leaves).backward(grad)

        todo.append((r, fn, step, make_args))
    fwd = {id(r): [] for r, *_ in todo}
    both = {id(r): [] for r, *_ in todo}
    for k in range(max(repeat, 3)):
        for r, fn, step, make_args in todo:
            if "error" in r:
                continue
            log(f"host cost (round {k + 1}): {r['label']} {r['layout']}")
            try:
                fwd[id(r)].append(host_cost_us(fn, make_args, iters, device, repeats=5))
                both[id(r)].append(host_cost_us(step, make_args, iters, device, repeats=5))
            except Exception as e:  # one failing row does not end the table
                r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for r, *_ in todo:
        if "error" not in r:
            f, b = fwd[id(r)], both[id(r)]
            r.update(fwd_us=statistics.median(f), fwd_us_spread=_spread(f),
                     fwd_bwd_us=statistics.median(b), fwd_bwd_us_spread=_spread(b), rounds=len(f))
    return out


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _size(rows, ffn):
    return f"{rows:,} x {ffn:,}"


def _mem(gib, tensor_bytes):
    if gib is None:
        return "n/a"
    if tensor_bytes >= GiB // 8:
        return f"{gib:.2f} GiB"
    return f"{gib * 1024:.1f} MiB"


def _with_spread(v, spread, repeat, nd=2):
    if repeat < 2:
        return f"{v:.{nd}f}"
    return f"{v:.{nd}f} [{spread[0]:.{nd}f}-{spread[1]:.{nd}f}]"


def markdown(meta, sizes, cells, summary, host):
    R = meta["repeat"]
    impls = meta["impls"]
    lines = [
        f"## expertact beside DeepSpeed's Triton kernels and torch.compile: {meta['device_name']}",
        "",
        f"- date: {meta['date']}; command: `{meta['command']}`",
        f"- torch {meta['torch']}, Triton {meta['triton'] or 'not installed'}, DeepSpeed "
        f"{meta['deepspeed'] or 'not installed'}" + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "")
        + (f", driver {meta['driver']}" if meta.get("driver") else "")
        + f", expertact {meta['expertact']} (CUDA path built: {meta['expertact_cuda']}), Python {meta['python']}",
        f"- DeepSpeed's kernels: {meta['deepspeed_status']}",
        f"- {meta['dtype']}, inputs {meta['scale']:g} x standard normal, alpha {meta['alpha']:g}, "
        f"limit {meta['limit']:g}; torch.compile of the eager expression, dynamic=False, one compile "
        "per form, layout and size",
        f"- timing: {meta['timer']} around forward and around backward, median of {meta['iters']} steps after "
        f"{meta['warmup']} warm-up and a correctness check (first {CHECK_ROWS} rows of the output and "
        "gradients against eager float32)"
        + (f"; each cell measured {R} times: the value is the median of the {R} medians, [min-max] their spread"
           if R > 1 else "; one run (--repeat N shows the run-to-run spread)"),
        f"- memory: {meta['memory_source']}; % of floor: the 8-pass bytes floor at the copy bandwidth of the "
        "same run / fwd+bwd time",
        "",
        "| size | one [rows, F] tensor | copy bandwidth | 8-pass floor ms |",
        "|---|---:|---:|---:|",
    ]
    for s in sizes:
        lines.append(f"| {_size(s['rows'], s['ffn'])} | {s['tensor_bytes'] / 2**20:,.1f} MiB | "
                     f"{fmt_bandwidth(s['copy_tbs'])} | {s['floor_ms']:.3f} |")

    peer_cols = [i for i in PEERS if i in impls]
    our_cols = [i for i in OURS if i in impls]
    lines += ["", "### fwd+bwd ms: the winner and expertact's margin to the fastest peer", "",
              "| form | layout | size | " + " | ".join(NAMES[i] for i in peer_cols + our_cols)
              + " | winner | expertact vs fastest peer | target |",
              "|---|---|---|" + "---:|" * len(peer_cols + our_cols) + "---|---:|---|"]
    for s in summary:
        vals = []
        for i in peer_cols + our_cols:
            if i in s["ms"]:
                vals.append(_with_spread(s["ms"][i], s["ms_spread"][i], R))
            elif i == "deepspeed" and s.get("deepspeed_status"):
                vals.append(s["deepspeed_status"])
            else:
                vals.append("error")
        margin = s.get("expertact_vs_peer_pct")
        margin = "n/a" if margin is None else f"{margin:+.1f}% vs {NAMES[s['fastest_peer']]}"
        lines.append(f"| {s['preset']} | {s['layout']} | {_size(s['rows'], s['ffn'])} | " + " | ".join(vals)
                     + f" | {NAMES.get(s['winner'], 'n/a')} | {margin} | {s['target']} |")

    lines += ["", "### every cell", "",
              "| form | layout | size | implementation | fwd ms | bwd ms | fwd+bwd ms | % of floor | extra peak | "
              "kept | check |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        head = f"| {c['preset']} | {c['layout']} | {_size(c['rows'], c['ffn'])} | {NAMES[c['impl']]} |"
        if "ms" not in c:
            lines.append(f"{head} {c.get('error', 'n/a')} | | | | | | |")
            continue
        tb = c["rows"] * c["ffn"] * meta["dtype_bytes"]
        chk = c.get("check_err")
        chk = "n/a" if chk is None else (f"ok ({chk:.1e})" if c["check_ok"] else f"FAILED ({chk:.1e})")
        lines.append(f"{head} {_with_spread(c['fwd_ms'], c['fwd_ms_spread'], R, 3)} | "
                     f"{_with_spread(c['bwd_ms'], c['bwd_ms_spread'], R, 3)} | "
                     f"{_with_spread(c['ms'], c['ms_spread'], R, 3)} | {c['pct_floor']:.1f} | "
                     f"{_mem(c['extra_peak_gib'], tb)} | {_mem(c['kept_gib'], tb)} | {chk} |"
                     + (f" {c['error']}" if "error" in c else ""))

    if host:
        hs = meta["host"]
        lines += ["", f"### host cost per call at {_size(hs['rows'], hs['ffn'])} {meta['dtype']} (swiglu)", "",
                  f"Microseconds per call: {hs['iters']} calls on fresh leaf tensors, back to back, timed with "
                  "time.perf_counter up to one synchronize, the garbage collector off; the median of 5 such blocks; "
                  "the rows measured in interleaved rounds, the value the median over the rounds [min-max]. The "
                  "device work is negligible at this size: this is the calling thread's time.", "",
                  "| call | layout | forward us | forward+backward us |", "|---|---|---:|---:|"]
        for r in host:
            if "error" in r:
                lines.append(f"| {r['label']} | {r['layout']} | {r['error']} | |")
            else:
                n = r.get("rounds", R)
                lines.append(f"| {r['label']} | {r['layout']} | {_with_spread(r['fwd_us'], r['fwd_us_spread'], n, 1)} "
                             f"| {_with_spread(r['fwd_bwd_us'], r['fwd_bwd_us_spread'], n, 1)} |")
    lines += ["", "Peers: eager PyTorch and torch.compile of the same expression (every form and layout), "
              "DeepSpeed's Triton kernels deepspeed.ops.triton_ops.swiglu_triton.swiglu (swiglu, separate) and "
              "swiglu_packed (swiglu, halves); DeepSpeed has no fused kernel for the other forms and layouts (n/a). "
              "target: expertact (not in place) at or below the fastest peer."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def _parse_size(text):
    try:
        rows, ffn = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"expertact-bench: size {text!r} is not ROWSxF (e.g. 65536x1536)") from None
    if rows < 1 or ffn < 1:
        raise SystemExit(f"expertact-bench: size {text!r} must be positive")
    return rows, ffn


def _driver_version():
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


@contextlib.contextmanager
def _compile_settings():
    """torch.compile settings of the run, restored afterwards (the tests run the benchmark in-process).

    - fail_on_recompile_limit_hit: a compiled cell never quietly falls back to eager.
    - compile_threads = 1: inductor compiles in this process. Otherwise the first compile starts
      a pool of compile workers, one per core, each importing torch while
      the cells after it are timed. Each graph here fuses into one or two pointwise kernels:
      there is little for a pool to compile in parallel."""
    import torch._inductor.config as inductor

    saved = []
    for mod, key, value in ((torch._dynamo.config, "fail_on_recompile_limit_hit", True),
                            (inductor, "compile_threads", 1)):
        if hasattr(mod, key):
            saved.append((mod, key, getattr(mod, key)))
            setattr(mod, key, value)
    try:
        yield
    finally:
        for mod, key, value in saved:
            setattr(mod, key, value)


def settings(a, device) -> types.SimpleNamespace:
    """The options resolved against this device's defaults."""
    cuda = device.type == "cuda"
    d = activation.defaults(device)
    if a.sizes:
        sizes = [_parse_size(s) for s in a.sizes.split(",") if s.strip()]
    elif a.rows is not None or a.ffn is not None or not cuda:
        sizes = [(a.rows if a.rows is not None else d["rows"], a.ffn if a.ffn is not None else d["ffn"])]
    else:
        sizes = list(QUICK["sizes"] if a.quick else PEER_SIZES)
    dtype_name = a.dtype or d["dtype"]
    host_rows_, host_ffn = _parse_size(a.host_size)
    return types.SimpleNamespace(
        sizes=sizes,
        presets=parse_list(a.presets or ",".join(QUICK["presets"] if a.quick else PRESETS), PRESETS, "presets"),
        layouts=parse_list(a.layouts or ",".join(QUICK["layouts"] if a.quick else LAYOUTS), LAYOUTS, "layouts"),
        impls=parse_list(a.impls or ",".join(DEFAULT_IMPLS), IMPLS, "impls"),
        dtype_name=dtype_name, dtype=DTYPES[dtype_name], esize=element_size(DTYPES[dtype_name]),
        iters=a.iters if a.iters is not None else (20 if cuda else 5),
        warmup=a.warmup if a.warmup is not None else (3 if cuda else 1),
        repeat=max(a.repeat, 1),
        host_iters=a.host_iters if a.host_iters is not None else (200 if cuda else 50),
        host_rows=host_rows_, host_ffn=host_ffn,
    )


def size_table(sizes, esize, device):
    """Per size: one [rows, F] tensor's bytes, the copy bandwidth measured at that size and the
    8-pass bytes floor."""
    out = []
    for rows, ffn in sizes:
        tb = rows * ffn * esize
        bw = copy_bandwidth(tb, device)
        out.append(dict(rows=rows, ffn=ffn, tensor_bytes=tb, copy_tbs=bw / 1e12, floor_ms=8 * tb / bw * 1e3))
        log(f"{_size(rows, ffn)}: copy bandwidth {fmt_bandwidth(bw / 1e12)}, 8-pass floor {8 * tb / bw * 1e3:.3f} ms")
    return out


def run_meta(a, argv, s, device, name, ds) -> dict:
    """The header of the tables and the JSON's meta: versions, settings, command."""
    cuda = device.type == "cuda"
    v = versions(device)
    return dict(
        mode="peers", date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["expertact-bench"] + list(argv)),
        device=str(device), device_name=name, driver=_driver_version() if cuda else None,
        torch=v["torch"], triton=_dist_version("triton"), cuda=v["cuda"],
        deepspeed=_dist_version("deepspeed"),
        deepspeed_status=("not measured (not in --impls)" if ds is None else
                          ds.reason or f"{ds.loaded}; swiglu separate and halves, n/a elsewhere"),
        ds_accelerator=getattr(ds, "accelerator", None) or os.environ.get("DS_ACCELERATOR"),
        expertact=v["expertact"], expertact_cuda=v["expertact_cuda"], python=v["python"],
        dtype=s.dtype_name, dtype_bytes=s.esize, scale=a.scale, alpha=a.alpha, limit=a.limit, impls=s.impls,
        presets=s.presets, layouts=s.layouts, iters=s.iters, warmup=s.warmup, repeat=s.repeat, **method(device),
    )


def run(a, argv) -> int:
    """The --peers tables for the parsed options a (argv: the command line, for the header);
    exit status 1 when a cell failed its correctness check."""
    device = resolve_device(a.device)
    s = settings(a, device)
    name = device_name(device)
    ds = DeepSpeedKernels(device) if "deepspeed" in s.impls else None
    forms = [(p, lay) for p in s.presets for lay in s.layouts]
    n_compiles = len(forms) * len(s.sizes) if "compile" in s.impls else 0
    log(f"expertact-bench --peers on {name}: {len(forms)} forms x layouts, sizes "
        f"{', '.join(_size(*z) for z in s.sizes)}, {s.dtype_name}, impls {','.join(s.impls)}, x{s.repeat}; "
        f"{n_compiles} torch.compile compilations")
    size_info = size_table(s.sizes, s.esize, device)
    meta = run_meta(a, argv, s, device, name, ds)

    t_start = time.time()
    with _compile_settings():
        # The host-cost table first: a run cut short by a time limit still has it.
        host = []
        if s.host_iters > 0:
            host = host_table(s.host_rows, s.host_ffn, s.dtype, device, s.impls, ds, s.host_iters, s.repeat,
                              a.alpha, a.limit)
            meta["host_s"] = time.time() - t_start
        meta["host"] = dict(rows=s.host_rows, ffn=s.host_ffn, iters=s.host_iters)
        cells, rc = {}, 0
        if a.host_only:  # the host-cost table alone
            meta["wall_s"], meta["complete"] = time.time() - t_start, True
            return report(a, meta, size_info, cells, host, [], s.sizes, s.impls, ds, final=True)
        for n, (preset, layout) in enumerate(forms):
            cells.update(measure_form(preset, layout, s, ds, device, a))
            done = forms[:n + 1]
            left = (time.time() - t_start - meta.get("host_s", 0)) / len(done) * (len(forms) - len(done))
            log(f"== {len(done)}/{len(forms)} forms x layouts done, {time.time() - t_start:.0f} s so far, "
                f"about {left:.0f} s left")
            meta["wall_s"] = time.time() - t_start
            meta["complete"] = len(done) == len(forms)
            # Rewritten after each form: a run stopped by a time limit keeps what it measured.
            rc = report(a, meta, size_info, cells, host, done, s.sizes, s.impls, ds, final=meta["complete"])
    return rc


def measure_form(preset, layout, s, ds, device, a):
    """Every size and implementation of one (form, layout), --repeat times; returns the cells."""
    cuda = device.type == "cuda"
    clock, memory = clock_and_memory(device)
    cells = {(preset, layout, rows, ffn, impl): dict(preset=preset, layout=layout, rows=rows, ffn=ffn, impl=impl,
                                                      reps=[])
             for rows, ffn in s.sizes for impl in s.impls}
    fns = {}
    for impl in s.impls:
        if impl == "deepspeed" and ds.fn(preset, layout) is None:
            for rows, ffn in s.sizes:
                cells[(preset, layout, rows, ffn, impl)]["skipped"] = ds.why_not(preset, layout)
            continue
        # compile: a fresh dynamo cache per form and layout (5 sizes, 5 entries: under the
        # recompile limit of 8), kept across the repeats.
        fns[impl] = make_fn(impl, preset, layout, a.alpha, a.limit, ds)
    for rep in range(s.repeat):
        for rows, ffn in s.sizes:
            log(f"{preset} {layout} {_size(rows, ffn)}, repeat {rep + 1}/{s.repeat}")
            try:
                inp = Inputs(layout, rows, ffn, s.dtype, device, a.scale)
            except OOM:
                for impl in fns:
                    cells[(preset, layout, rows, ffn, impl)].setdefault("error", "OOM (inputs)")
                continue
            for impl, fn in fns.items():
                c = cells[(preset, layout, rows, ffn, impl)]
                if "error" in c:
                    continue
                try:
                    inp.refresh()  # an in-place backward left gradients in the inputs
                    if rep == 0:
                        c["check_err"] = check(fn, inp, preset, layout, a.alpha, a.limit)
                        c["check_ok"] = c["check_err"] <= CHECK_TOL[s.dtype]
                        inp.refresh()
                    r = measure(fn, inp, clock, memory, s.iters, s.warmup, refresh=impl == "expertact-inplace")
                    c["reps"].append(r)
                    log(f"    {NAMES[impl]:18s} fwd+bwd {r['ms']:8.3f} ms  (fwd {r['fwd_ms']:.3f}, bwd "
                        f"{r['bwd_ms']:.3f})" + ("" if c["check_ok"] else f"  CHECK FAILED {c['check_err']:.2e}"))
                except OOM:
                    c["error"] = "OOM"
                except Exception as e:  # one failing cell does not end the table
                    c["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    log(f"    {NAMES[impl]:18s} ERROR {c['error']}")
            del inp
            if cuda:
                torch.cuda.empty_cache()
    return cells


def report(a, meta, size_info, cells, host, forms, sizes, impls, ds, final):
    """Tables of the forms measured so far: markdown on stdout (when final), --json, --markdown."""
    floor = {(s["rows"], s["ffn"]): s["floor_ms"] for s in size_info}
    # DeepSpeed's cells without a kernel (or without DeepSpeed) are one column of the summary.
    done = [aggregate(dict(c), floor[(c["rows"], c["ffn"])]) for c in cells.values() if "skipped" not in c]
    summary = summarize(done, sizes, forms, impls, ds, meta["repeat"])
    md = markdown(meta, size_info, done, summary, host)
    if final:
        print(md)
        log(f"done in {meta['wall_s']:.0f} s" + (f" (host-cost table {meta['host_s']:.0f} s)" if "host_s" in meta
                                                  else ""))
    write_outputs(a.json, a.markdown, dict(meta=meta, sizes=size_info, cells=done, summary=summary, host=host), md,
                  quiet=True)
    if final and (a.json or a.markdown):
        log(f"wrote {' and '.join(p for p in (a.json, a.markdown) if p)}")
    failed = [c for c in done if c.get("check_ok") is False]
    if final and failed:
        log(f"{len(failed)} cells FAILED the correctness check: "
            + ", ".join(f"{c['preset']} {c['layout']} {c['impl']}" for c in failed[:8]))
    return 1 if failed else 0
