#!/usr/bin/env python3
"""expertact's CPU path against eager PyTorch on the CPU, in one process, on the same tensors.

The eager expression is GPT-OSS's clamped SwiGLU (swiglu_oai):
    g = gate.clamp(max=7); u = up.clamp(-7, 7); out = (u + 1) * (g * torch.sigmoid(1.702 * g))
forward timed alone, backward as out.backward(grad_out) (autograd over the saved
temporaries). expertact is called through its C ABI (ctypes; each tensor's DLTensor made
into the ABI's description by expertact_tensor_from_dlpack; no dependency on the python/
package), forward and backward, same layout (separate,
halves: views of one [rows, 2F] tensor, interleaved: its strided views for torch).
Both use the same number of threads. Medians of --iters runs after --warmup.

It also checks expertact against the expression evaluated in float64 and rounded
once (docs/spec.md section 1): the largest difference in units in the last place of the
dtype, and that NaN and infinity positions match.

    python3 bench/cpu_vs_torch.py [--lib build-bench/libexpertact.so] [--threads 2]
        [--sizes 4096x1408,16384x3072] [--layouts separate,halves,interleaved]
        [--dtype bf16|f32] [--iters 7] [--warmup 2] [--json PATH]
"""
import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time

import torch


# ---------------------------------------------------------------- the C ABI through ctypes

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class Tensor(ctypes.Structure):
    """expertact_tensor, the ABI's one tensor description."""
    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("row_stride", ctypes.c_int64), ("dtype", DLDataType), ("device", DLDevice)]


class Params(ctypes.Structure):
    _fields_ = [("act", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("beta", ctypes.c_float)]


_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16)}
LAYOUTS = {"separate": 0, "halves": 1, "halves_up_first": 2, "interleaved": 3}


def dltensor(t):
    """A DLTensor viewing a CPU tensor (kept alive with its shape/stride arrays)."""
    code, bits = _DTYPES[t.dtype]
    shape = (ctypes.c_int64 * t.dim())(*t.shape)
    strides = (ctypes.c_int64 * t.dim())(*t.stride())
    d = DLTensor(ctypes.c_void_p(t.data_ptr()), DLDevice(1, 0), t.dim(), DLDataType(code, bits, 1),
                 shape, strides, 0)
    d._keep = (shape, strides, t)
    return d


class ExpertAct:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        L = self.lib
        L.expertact_preset.argtypes = [ctypes.c_char_p, ctypes.c_float, ctypes.c_float,
                                       ctypes.POINTER(Params)]
        L.expertact_tensor_from_dlpack.argtypes = [ctypes.POINTER(DLTensor), ctypes.POINTER(Tensor)]
        L.expertact_glu_forward.argtypes = [ctypes.POINTER(Params), ctypes.c_int32] + \
            [ctypes.POINTER(Tensor)] * 4 + [ctypes.c_void_p]
        L.expertact_glu_backward.argtypes = [ctypes.POINTER(Params), ctypes.c_int32] + \
            [ctypes.POINTER(Tensor)] * 7 + [ctypes.c_void_p]
        L.expertact_last_error.restype = ctypes.c_char_p
        L.expertact_set_cpu_threads.argtypes = [ctypes.c_int32]
        try:
            L.expertact_cpu_kernel_isa.restype = ctypes.c_char_p
            self.isa = L.expertact_cpu_kernel_isa().decode()
        except AttributeError:
            self.isa = "unknown"

    def params(self, name, alpha=float("nan"), limit=float("nan")):
        p = Params()
        self._ok(self.lib.expertact_preset(name.encode(), alpha, limit, ctypes.byref(p)))
        return p

    def _ok(self, status):
        if status != 0:
            raise RuntimeError("expertact: " + self.lib.expertact_last_error().decode())

    def describe(self, d):
        """The ABI's description of a DLTensor (None stays None)."""
        if d is None:
            return None
        t = Tensor()
        self._ok(self.lib.expertact_tensor_from_dlpack(ctypes.byref(d), ctypes.byref(t)))
        return ctypes.byref(t)

    def forward(self, p, layout, x, up, out):
        self._ok(self.lib.expertact_glu_forward(ctypes.byref(p), LAYOUTS[layout], self.describe(x),
                                                self.describe(up), None, self.describe(out), None))

    def backward(self, p, layout, dy, x, up, gx, gu):
        self._ok(self.lib.expertact_glu_backward(
            ctypes.byref(p), LAYOUTS[layout], self.describe(dy), self.describe(x), self.describe(up), None,
            self.describe(gx), self.describe(gu), None, None))


# ---------------------------------------------------------------- timing

def warm(fn, warmup, min_s=0.3):
    """At least `warmup` calls and min_s seconds: eager PyTorch's first calls are slow
    (its first backward took ~700 ms on a 512 x 1408 tensor, the next ones ~9 ms)."""
    t_end = time.perf_counter() + min_s
    n = 0
    while n < warmup or time.perf_counter() < t_end:
        fn()
        n += 1


def median_ms(fn, iters, warmup):
    warm(fn, warmup)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def eager(gate, up, alpha=1.702, limit=7.0):
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def views(layout, x, F):
    if layout == "separate":
        return x[0], x[1]
    if layout == "halves":
        return x[:, :F], x[:, F:]
    if layout == "interleaved":
        return x[:, 0::2], x[:, 1::2]
    raise ValueError(layout)


def ulp_diff(a, b):
    """Largest |a - b| in units in the last place of b's dtype at b (finite positions; a
    gradient near a zero of silu' shows many units of its tiny value in float32), the
    largest |a - b| relative to the largest |b|, and whether NaN and infinity positions match."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[b.dtype]
    a = a.double()
    b = b.double()
    nan_ok = bool(torch.equal(torch.isnan(a), torch.isnan(b)))
    fin = torch.isfinite(b) & torch.isfinite(a)
    inf_ok = bool(torch.equal(a[~fin & ~torch.isnan(b)], b[~fin & ~torch.isnan(b)]))
    mag = b[fin].abs().clamp(min=2.0 ** -126)
    ulp = torch.pow(2.0, torch.floor(torch.log2(mag)) - mant)
    worst = float(((a[fin] - b[fin]).abs() / ulp).max()) if fin.any() else 0.0
    normwise = float((a[fin] - b[fin]).abs().max() / b[fin].abs().max()) if fin.any() else 0.0
    return worst, normwise, nan_ok and inf_ok


def run(args):
    ea = ExpertAct(args.lib)
    torch.set_num_threads(args.threads)
    ea.lib.expertact_set_cpu_threads(args.threads)
    p = ea.params("swiglu_oai")
    torch.manual_seed(0)
    dt = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[args.dtype]
    rows_out = []
    for size in args.sizes.split(","):
        R, F = (int(v) for v in size.split("x"))
        for layout in args.layouts.split(","):
            if layout == "separate":
                x = (6 * torch.randn(2, R, F)).to(dt)
                xg, xu = x[0], x[1]
                gx = torch.empty_like(x)
                gxg, gxu = gx[0], gx[1]
            else:
                x = (6 * torch.randn(R, 2 * F)).to(dt)
                gx = torch.empty_like(x)
            dy = torch.randn(R, F).to(dt)
            out = torch.empty(R, F, dtype=dt)

            # eager PyTorch: forward builds the graph (and its saved temporaries), backward walks it.
            def t_fwd():
                xl = x.detach().requires_grad_(True)
                g, u = views(layout, xl, F)
                return xl, eager(g, u)

            def t_bwd_once():
                xl, y = t_fwd()
                t0 = time.perf_counter()
                y.backward(dy)
                return (time.perf_counter() - t0) * 1e3, xl.grad

            torch_fwd = median_ms(lambda: t_fwd(), args.iters, args.warmup)
            warm(t_bwd_once, args.warmup)
            torch_bwd = statistics.median(t_bwd_once()[0] for _ in range(args.iters))

            # expertact through the C ABI
            if layout == "separate":
                dx, du_, dgx, dgu = dltensor(xg), dltensor(xu), dltensor(gxg), dltensor(gxu)
            else:
                dx, du_, dgx, dgu = dltensor(x), None, dltensor(gx), None
            dout, ddy = dltensor(out), dltensor(dy)
            ea_fwd = median_ms(lambda: ea.forward(p, layout, dx, du_, dout), args.iters, args.warmup)
            ea_bwd = median_ms(lambda: ea.backward(p, layout, ddy, dx, du_, dgx, dgu), args.iters,
                               args.warmup)

            # Correctness: against the expression in float64, rounded once to the dtype.
            xf = x.double().detach().requires_grad_(True)
            g64, u64 = views(layout, xf, F)
            y64 = eager(g64, u64)
            y64.backward(dy.double())
            d_out, n_out, nan_out = ulp_diff(out, y64.detach().to(dt))
            d_grad, n_grad, nan_grad = ulp_diff(gx, xf.grad.to(dt))
            _, torch_grad = t_bwd_once()
            d_torch, n_torch, _ = ulp_diff(torch_grad, xf.grad.to(dt))

            r = dict(rows=R, F=F, layout=layout, dtype=args.dtype, preset="swiglu_oai",
                     torch_fwd_ms=torch_fwd, torch_bwd_ms=torch_bwd,
                     expertact_fwd_ms=ea_fwd, expertact_bwd_ms=ea_bwd,
                     speedup_fwd=torch_fwd / ea_fwd, speedup_bwd=torch_bwd / ea_bwd,
                     speedup_total=(torch_fwd + torch_bwd) / (ea_fwd + ea_bwd),
                     expertact_max_ulp_out=d_out, expertact_max_ulp_grad=d_grad,
                     eager_max_ulp_grad=d_torch, expertact_normwise_err_out=n_out,
                     expertact_normwise_err_grad=n_grad, eager_normwise_err_grad=n_torch,
                     nan_inf_positions_match=nan_out and nan_grad)
            rows_out.append(r)
            print("| %d x %d | %s | %s | %.2f | %.2f | %.2f | %.2f | %.1fx | %.1fx | %.1fx | %.1f / %.1f (%.0f) | %.1e / %.1e (%.1e) | %s |"
                  % (R, F, args.dtype, layout, torch_fwd, torch_bwd, ea_fwd, ea_bwd, r["speedup_fwd"],
                     r["speedup_bwd"], r["speedup_total"], d_out, d_grad, d_torch, n_out, n_grad,
                     n_torch, "yes" if r["nan_inf_positions_match"] else "NO"), flush=True)
            del x, gx, dy, out, xf, y64
    return ea, rows_out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--lib", default=os.path.join(here, "..", "build-bench", "libexpertact.so"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--sizes", default="4096x1408,16384x3072")
    ap.add_argument("--layouts", default="separate,halves,interleaved")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print("expertact CPU path vs eager PyTorch %s, swiglu_oai %s, %d threads, cpu: %s, load average: %s"
          % (torch.__version__, args.dtype, args.threads, cpu, " ".join("%.2f" % v for v in os.getloadavg())))
    print("torch: eager forward; backward = out.backward(grad_out). expertact: C ABI forward; backward. "
          "Medians (ms) of %d after %d warm-up.\n" % (args.iters, args.warmup))
    print("(errors: expertact against the expression in float64 rounded once to the dtype; "
          "eager: PyTorch's own bf16/f32 result against the same)\n")
    print("| rows x F | dtype | layout | torch fwd | torch bwd | expertact fwd | expertact bwd | fwd speedup | "
          "bwd speedup | fwd+bwd speedup | max ulp: out / grad (eager grad) | max err / max ref: out / grad "
          "(eager grad) | NaN/inf match |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    ea, rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(benchmark="cpu_vs_torch", command=" ".join(sys.argv), torch=torch.__version__,
                           python=platform.python_version(), cpu=cpu, threads=args.threads,
                           expertact_kernels=ea.isa, date=time.strftime("%Y-%m-%d"),
                           load_average=os.getloadavg(), results=rows), f, indent=1)
        print("\nwrote " + args.json)


if __name__ == "__main__":
    main()
