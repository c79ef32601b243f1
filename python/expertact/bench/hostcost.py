"""Host cost of one call: microseconds per call at a size where device work is negligible,
so that argument handling, autograd, dispatch, the binding and the launch are the whole
cost. host_cost_us() is the measurement; cases() the standard set (expertact's layouts x
weights x in-place, DeepSpeed's Triton SwiGLU when importable, eager PyTorch); the CLI is
bench/host_cost.py, and the --peers mode of python -m expertact.bench prints a host-cost table.

Loading DeepSpeed's kernels leaves the caller's process as it was, beside the modules it
imports: os.environ is restored after the import, and the fallback that loads the kernel file
without DeepSpeed's package __init__ enters nothing in sys.modules.
"""
from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["host_cost_us", "cases", "measure", "iter_measure", "DEFAULT_SIZE", "import_deepspeed_kernels",
           "load_deepspeed_kernel_file"]

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
_DS_TRITON = "deepspeed.ops.triton_ops._triton"


@contextlib.contextmanager
def _deepspeed_import_settings():
    """DS_ACCELERATOR=cuda unless it is set (otherwise DeepSpeed probes for Intel, Ascend,
    Habana, ... accelerators before CUDA) and stdout to stderr (DeepSpeed's logger writes to
    stdout, made at import: the tables stay alone there), for the import only: the caller's
    environment is as it was afterwards. DeepSpeed picks its accelerator once, at that import."""
    saved = os.environ.get("DS_ACCELERATOR")
    if saved is None:
        os.environ["DS_ACCELERATOR"] = "cuda"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)


def import_deepspeed_kernels():
    """(module, how) for DeepSpeed's swiglu_triton: imported as a package module, or, when
    `import deepspeed` fails (typically a dependency of its __init__ that is missing), its
    file loaded alone (load_deepspeed_kernel_file). Raises ImportError saying why neither works."""
    try:
        with _deepspeed_import_settings():
            return importlib.import_module(_DS_MODULE), f"import {_DS_MODULE}"
    except Exception as e:  # noqa: BLE001 - any failure of deepspeed/__init__.py
        first = f"{type(e).__name__}: {e}"
    try:
        mod = load_deepspeed_kernel_file()
    except Exception as e2:  # noqa: BLE001
        raise ImportError(f"{first}; alone: {type(e2).__name__}: {e2}") from e2
    return mod, f"swiglu_triton.py loaded alone (import deepspeed: {first})"


def _deepspeed():
    """DeepSpeed's Triton SwiGLU functions (swiglu, swiglu_packed), or None when not importable."""
    try:
        mod, _ = import_deepspeed_kernels()
    except ImportError:
        return None
    if not getattr(mod, "_TRITON_AVAILABLE", True):
        return None
    return mod.swiglu, mod.swiglu_packed


def _exec_file(path, name, provides=None):
    """The module of one Python file, executed under `name` without registering it in
    sys.modules. provides: absolute module names its `from X import ...` statements get from
    this dict instead of the import system."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    if provides:
        real_import = builtins.__import__

        def _import(target, globals=None, locals=None, fromlist=(), level=0):
            if level == 0 and fromlist and target in provides:
                return provides[target]
            return real_import(target, globals, locals, fromlist, level)

        # The file's own builtins: its functions see this __import__; nothing else does.
        mod.__dict__["__builtins__"] = dict(builtins.__dict__, __import__=_import)
    spec.loader.exec_module(mod)
    return mod


def load_deepspeed_kernel_file():
    """deepspeed/ops/triton_ops/swiglu_triton.py (and the _triton.py it imports) without running
    deepspeed/__init__.py, which imports einops, msgpack, psutil, tqdm, hjson, pydantic and the
    accelerator probes: the kernels themselves need torch and triton only. Both files are
    executed as private modules (expertact.bench.hostcost._ds_*) that are not entered in
    sys.modules, and swiglu_triton.py's import of _triton is answered with the private one: the
    caller's sys.modules holds no deepspeed entry afterwards (torch and triton are imported as
    usual). Raises ImportError (or what the files raise) when they cannot be loaded."""
    spec = importlib.util.find_spec("deepspeed")  # locates the package without importing it
    if spec is None or not spec.origin:
        raise ImportError("deepspeed is not on sys.path")
    folder = os.path.join(os.path.dirname(spec.origin), "ops", "triton_ops")
    triton_mod = _exec_file(os.path.join(folder, "_triton.py"), __name__ + "._ds_triton")
    return _exec_file(os.path.join(folder, "swiglu_triton.py"), __name__ + "._ds_swiglu_triton",
                      provides={_DS_TRITON: triton_mod})


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
