"""Host cost of one call: microseconds per call at a size where device work is negligible,
so that argument handling, autograd, dispatch, the binding and the launch are the whole
cost. host_cost_us() is the measurement; cases() the standard set (expertact's layouts x
weights x in-place, DeepSpeed's Triton SwiGLU when importable, eager PyTorch); the CLI is
bench/host_cost.py.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["host_cost_us", "cases", "measure", "iter_measure", "DEFAULT_SIZE"]

#: (rows, F, dtype) per device type: GPU work at 256 x 128 bf16 is a few microseconds of
#: a kernel that overlaps the host's next call; on the CPU the kernel itself runs on the
#: host, so the CPU size is the smallest that still has full rows.
DEFAULT_SIZE = {"cuda": (256, 128, torch.bfloat16), "cpu": (4, 8, torch.float32)}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def host_cost_us(fn: Callable, make_args: Callable[[], tuple], iters: int = 1000, device="cpu", *,
                 repeats: int = 7, warmup: int = 100, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over `repeats` rounds of the time per call of fn(*args), in microseconds.

    Each round builds `iters` argument tuples with make_args() first (outside the clock:
    fresh leaves for each call, so no gradient accumulates and an in-place backward never
    sees overwritten inputs), then times the calls back to back and synchronizes the device
    before stopping the clock: the calls queue their (tiny) kernels without waiting, so the
    host is the bottleneck and what is timed is its cost. The garbage collector is off
    while the clock runs. clock: time.perf_counter (wall time, the default) or
    time.thread_time (this thread's CPU time: steadier on a shared machine, and the same
    as wall time when the host is the bottleneck and nothing else runs).
    """
    args = [make_args() for _ in range(warmup)]
    for a in args:
        fn(*a)
    del args
    _sync(device)
    times = []
    for _ in range(repeats):
        args = [make_args() for _ in range(iters)]
        _sync(device)
        gc_was = gc.isenabled()
        gc.disable()
        try:
            t0 = clock()
            for a in args:
                fn(*a)
            _sync(device)
            t1 = clock()
        finally:
            if gc_was:
                gc.enable()
        times.append((t1 - t0) / iters * 1e6)
        del args
    return statistics.median(times)


_DS_MODULE = "deepspeed.ops.triton_ops.swiglu_triton"


def _deepspeed():
    """DeepSpeed's Triton SwiGLU functions (swiglu, swiglu_packed), or None when not importable.

    `import deepspeed` runs its package __init__, which needs einops, msgpack, psutil, ...
    and probes accelerators; the kernel file needs torch and triton only. So when the plain
    import fails, the file is loaded under stand-in parent packages (removed afterwards)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to stdout
            mod = importlib.import_module(_DS_MODULE)
    except Exception:
        try:
            mod = load_deepspeed_kernel_file()
        except Exception:
            mod = None
    if mod is None or not getattr(mod, "_TRITON_AVAILABLE", True):
        return None
    return mod.swiglu, mod.swiglu_packed


def load_deepspeed_kernel_file():
    """deepspeed/ops/triton_ops/swiglu_triton.py (and the _triton.py it imports) without running
    deepspeed/__init__.py, which imports einops, msgpack, psutil, tqdm, hjson, pydantic and the
    accelerator probes: the kernels themselves need torch and triton only. The parent packages
    are stand-ins with the real folders as their __path__, removed again once the file is loaded.
    Raises ImportError (or what the file raises) when it cannot be loaded."""
    spec = importlib.util.find_spec("deepspeed")  # locates the package without importing it
    if spec is None or not spec.origin:
        raise ImportError("deepspeed is not on sys.path")
    root = os.path.dirname(spec.origin)
    parents = {"deepspeed": root, "deepspeed.ops": os.path.join(root, "ops"),
               "deepspeed.ops.triton_ops": os.path.join(root, "ops", "triton_ops")}
    saved = {name: sys.modules.get(name) for name in parents}
    try:
        for name, path in parents.items():
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [path]
            sys.modules[name] = stand_in
        return importlib.import_module(_DS_MODULE)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def cases(device="cpu", rows: Optional[int] = None, ffn: Optional[int] = None, dtype=None,
          peers: bool = True) -> List[Tuple[str, Callable, Callable]]:
    """(name, forward, make_inputs) for each implementation x layout x weights x in-place.

    forward(*inputs) returns the output; make_inputs(requires_grad) returns fresh inputs.
    DeepSpeed's kernels are included when importable and the device is CUDA (they are
    Triton kernels); eager PyTorch always, as the reference point.
    """
    import expertact

    d_rows, d_ffn, d_dtype = DEFAULT_SIZE[torch.device(device).type]
    rows, ffn, dtype = rows or d_rows, ffn or d_ffn, dtype or d_dtype
    gen = torch.Generator().manual_seed(0)
    base_sep = [torch.randn(rows, ffn, generator=gen).to(dtype).to(device) for _ in range(2)]
    base_packed = torch.randn(rows, 2 * ffn, generator=gen).to(dtype).to(device)
    base_w = torch.rand(rows, generator=gen).to(device)

    def sep(weights):
        def make(rg):
            xs = tuple(b.detach().clone().requires_grad_(rg) for b in base_sep)
            return xs + ((base_w.detach().clone().requires_grad_(rg),) if weights else ())
        return make

    def packed(weights):
        def make(rg):
            xs = (base_packed.detach().clone().requires_grad_(rg),)
            return xs + ((base_w.detach().clone().requires_grad_(rg),) if weights else ())
        return make

    out = []
    for weights in (False, True):
        for inplace in (False, True):
            tag = ("" if not weights else " +w") + (" inplace" if inplace else "")
            if weights:
                out.append((f"expertact separate{tag}",
                            lambda g, u, w, ip=inplace: expertact.swiglu(g, u, weights=w, inplace_backward=ip),
                            sep(True)))
            else:
                out.append((f"expertact separate{tag}",
                            lambda g, u, ip=inplace: expertact.swiglu(g, u, inplace_backward=ip), sep(False)))
            for layout in ("halves", "up_first", "interleaved"):
                if weights:
                    fn = lambda gu, w, ly=layout, ip=inplace: expertact.swiglu(  # noqa: E731
                        gu, layout=ly, weights=w, inplace_backward=ip)
                else:
                    fn = lambda gu, ly=layout, ip=inplace: expertact.swiglu(  # noqa: E731
                        gu, layout=ly, inplace_backward=ip)
                out.append((f"expertact {layout}{tag}", fn, packed(weights)))
    if peers:
        ds = _deepspeed() if torch.device(device).type == "cuda" else None
        if ds is not None:
            out.append(("deepspeed swiglu (separate)", ds[0], sep(False)))
            out.append(("deepspeed swiglu_packed (halves)", ds[1], packed(False)))
        out.append(("eager F.silu(g) * u (separate)", lambda g, u: F.silu(g) * u, sep(False)))

        def eager_packed(gu):
            g, u = gu.chunk(2, dim=-1)
            return F.silu(g) * u
        out.append(("eager silu * up (halves)", eager_packed, packed(False)))
    return out


def measure(device="cpu", iters: int = 1000, repeats: int = 7, clock=time.perf_counter, names=None,
            **case_kw) -> List[Dict[str, object]]:
    """The rows of iter_measure() as a list."""
    return list(iter_measure(device, iters, repeats, clock, names, **case_kw))


def iter_measure(device="cpu", iters: int = 1000, repeats: int = 7, clock=time.perf_counter, names=None,
                 **case_kw):
    """For each case: forward alone on inputs that do not require grad (no autograd node),
    forward on inputs that do (the node is built, then dropped with the output), and
    forward + backward (out.backward(grad)), in microseconds per call. names: substrings
    of the case names to keep (None: all)."""
    for name, fwd, make in cases(device, **case_kw):
        if names is not None and not any(n in name for n in names):
            continue
        grad = torch.ones_like(fwd(*make(False)))

        def fwdbwd(*a, fwd=fwd, grad=grad):
            fwd(*a).backward(grad)

        kw = dict(iters=iters, device=device, repeats=repeats, clock=clock)
        yield {
            "case": name,
            "fwd_nograd_us": host_cost_us(fwd, lambda make=make: make(False), **kw),
            "fwd_us": host_cost_us(fwd, lambda make=make: make(True), **kw),
            "fwd_bwd_us": host_cost_us(fwdbwd, lambda make=make: make(True), **kw),
        }
