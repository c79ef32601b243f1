"""Where the host microseconds of one call go, layer by layer (docs/perf-notes.md, "Python
host path"): the public call, the eager path's pieces, the kernel body and its parts, the
C call, and the floors they sit on (an autograd.Function that only allocates, eager PyTorch).
Per-thread CPU time, best of 9 rounds (a shared machine only ever slows a round down).

    EXPERTACT_NUM_THREADS=1 python bench/host_breakdown.py            # CPU, 4 x 8 float32
    python bench/host_breakdown.py --device cuda --rows 256 --ffn 128 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import expertact
from expertact import _autograd, _describe, _eager, _library, _route

INF = math.inf


def per_call_ns(fn, n, device, rounds=9):
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(min(n, 2000)):
        fn()
    sync()
    best = math.inf
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.thread_time() - t0) / n)
    return best * 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--n", type=int, default=20000, help="calls per round (fwd+bwd rounds use n / 4)")
    args = ap.parse_args(argv)
    dev, dt, r, f = args.device, getattr(torch, args.dtype), args.rows, args.ffn
    n = args.n

    def show(name, fn, calls=n):
        print(f"{name:58s} {per_call_ns(fn, calls, dev) / 1000:8.2f} us", flush=True)

    print(f"# {r} x {f} {args.dtype} on {dev}, torch {torch.__version__}, per-thread CPU time, best of 9")
    g, u = torch.randn(r, f, dtype=dt, device=dev), torch.randn(r, f, dtype=dt, device=dev)
    gu = torch.randn(r, 2 * f, dtype=dt, device=dev)
    w = torch.rand(r, device=dev)
    dy = torch.ones(r, f, dtype=dt, device=dev)
    args5 = (0, 0, 1.0, INF, 0.0)

    def leaves(*ts):
        return [t.detach().requires_grad_() for t in ts]

    print("## forward, separate, no autograd")
    show("expertact.swiglu(g, u)", lambda: expertact.swiglu(g, u))
    show("  _route.glu_call", lambda: _route.glu_call(g, u, None, 0, 1.0, INF, 0.0, None, False))
    show("  _eager.eager_ok()", _eager.eager_ok)
    show("  _eager.plain(g)", lambda: _eager.plain(g))
    show("  _autograd.glu_eager", lambda: _autograd.glu_eager(g, u, None, *args5, False))
    show("  _describe.glu_forward_body", lambda: _describe.glu_forward_body(g, u, None, *args5))
    show("    _as_rows(g)", lambda: _describe._as_rows(g))
    show("    _tail(g)", lambda: _describe._tail(g))
    show("    stream_of(g)", lambda: _describe.stream_of(g))
    ws = _describe._WS
    show("    _params (pack_into)", lambda: _describe._params(ws.buf, 0, 1.0, INF, 0.0))
    tail = _describe._tail(g)
    show("    _pack_matrix (pack_into)", lambda: _describe._pack_matrix(ws.buf, _describe._OX, 0, r, f, f, tail))
    show("    g.new_empty(rows, F)", lambda: g.new_empty(r, f))
    keep = _describe.glu_forward_body(g, u, None, *args5)  # noqa: F841 - the buffer the C call below writes
    stream = _describe.stream_of(g)
    show("    C call expertact_glu_forward_2d (with the kernel)",
         lambda: _describe._fwd_2d(ws.r_params, 0, ws.r_x, ws.r_up, None, ws.r_out, stream))
    show("  operator: torch.ops.expertact.glu (dispatcher)", lambda: _library.glu_op(g, u, None, *args5, False))
    show("expertact.swiglu(gate_up, layout='halves')", lambda: expertact.swiglu(gu, layout="halves"))
    show("expertact.swiglu(g, u, weights=w)", lambda: expertact.swiglu(g, u, weights=w))

    print("## with autograd (inputs require grad)")
    gr, ur = leaves(g, u)
    show("expertact.swiglu(g, u) forward", lambda: expertact.swiglu(gr, ur))
    show("  _autograd._eager_apply (autograd.Function, C apply)",
         lambda: _autograd._eager_apply(gr, ur, None, args5, False))
    show("expertact.swiglu(g, u).backward(dy)", lambda: expertact.swiglu(*leaves(g, u)).backward(dy), n // 4)
    show("  glu_backward_body alone", lambda: _describe.glu_backward_body(dy, g, u, None, False, *args5))
    show("expertact.swiglu(g, u, inplace_backward=True).backward(dy)",
         lambda: expertact.swiglu(*leaves(g, u), inplace_backward=True).backward(dy), n // 4)
    show("expertact.swiglu(g, u, weights=w).backward(dy)",
         lambda: expertact.swiglu(*leaves(g, u), weights=leaves(w)[0]).backward(dy), n // 4)

    print("## floors")

    class Alloc(torch.autograd.Function):  # allocates what expertact allocates, computes nothing
        @staticmethod
        def forward(ctx, a, b):
            return a.new_empty(r, f)

        @staticmethod
        def backward(ctx, grad):
            return torch.empty_like(grad), torch.empty_like(grad)

    show("leaves(g, u) (included in the rows above)", lambda: leaves(g, u))
    show("autograd.Function, 3 allocations: forward", lambda: Alloc.apply(gr, ur))
    show("autograd.Function, 3 allocations: forward + backward",
         lambda: Alloc.apply(*leaves(g, u)).backward(dy), n // 4)
    show("eager F.silu(g) * u, no autograd", lambda: F.silu(g) * u)
    show("eager F.silu(g) * u, forward + backward", lambda: (F.silu(gr) * ur).backward(dy), n // 4)


if __name__ == "__main__":
    main()
