"""Why allocation-behaviour tests differ under compute-sanitizer (issue 13): run the in-place
leaf-gradient case and the expert MLP's recompute case, and print which path ran and what
holds the tensors. Run it once plainly and once under a sanitizer tool; compare the lines.

    python3 scripts/san_diag.py
    compute-sanitizer --tool synccheck python3 scripts/san_diag.py
"""
import gc
import os
import sys
import types
import weakref

import torch

import expertact
DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
from expertact import _ops, moe

print("env:", {k: v for k, v in os.environ.items() if k.startswith(("CUDA", "PYTORCH", "TORCH", "LD_PRELOAD", "EXPERTACT"))})
print("eager_ok", _ops.eager_ok(), "| _EAGER", _ops._EAGER, "| profiler", torch.autograd._profiler_enabled(),
      "| dispatch modes", torch._C._len_torch_dispatch_stack(), "| tf modes", torch._C._is_torch_function_mode_enabled(),
      "| trace", sys.gettrace(), "| profile", sys.getprofile())
gu = torch.randn(4, 32, device=DEV).requires_grad_()
print("plain(gu)", _ops._plain(gu), "keys", torch._C._dispatch_keys(gu))
seen = {}


def hook(g):
    seen["refs"] = sys.getrefcount(g)
    seen["ptr"] = g.data_ptr()
    return None


out = expertact.swiglu_oai(gu, layout="interleaved", inplace_backward=True)
print("out.grad_fn", type(out.grad_fn).__name__)
gu.register_hook(hook)
out.sum().backward()
print("leaf grad aliases input:", gu.grad.data_ptr() == gu.data_ptr(), "| hook saw refcount", seen.get("refs"),
      "ptr equal", seen.get("ptr") == gu.data_ptr())

# The expert MLP with recompute: is h freed after forward?
x = torch.randn(64, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
w13 = torch.randn(2, 32, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
w2 = torch.randn(2, 32, 32, device=DEV, dtype=torch.bfloat16, requires_grad=True)
offs = torch.tensor([32, 64], device=DEV, dtype=torch.int32)
refs = []
orig = moe.glu_op


def spy(*a, **k):
    r = orig(*a, **k)
    refs.append(weakref.ref(r))
    return r


moe.glu_op = spy
y = moe.expert_mlp(x, w13, w2, offs, recompute=True)
gc.collect()
h = refs[0]() if refs else None
print("recompute: h alive after forward:", h is not None)
if h is not None:
    # Take the frames first: printing (repr) would run code and make new ones.
    frames = [r for r in gc.get_referrers(h) if isinstance(r, types.FrameType)]
    print("  refcount", sys.getrefcount(h), "| frames holding h:",
          [(f.f_code.co_name, f.f_lineno) for f in frames])

    def name(r):
        if isinstance(r, types.FrameType):
            return f"frame {r.f_code.co_filename}:{r.f_lineno} {r.f_code.co_name}"
        if isinstance(r, types.TracebackType):
            return f"traceback of {r.tb_frame.f_code.co_name}"
        if isinstance(r, BaseException):
            return f"exception {type(r).__name__}"
        if isinstance(r, types.ModuleType):
            return f"module {r.__name__}"
        if isinstance(r, (list, tuple, dict, set)):
            return f"{type(r).__name__} of {len(r)}"
        return type(r).__name__

    def walk(obj, depth, seen):
        # referrers up to 5 levels, not the ones this script made (its frame and lists)
        if depth > 5:
            return
        for r in gc.get_referrers(obj):
            if id(r) in seen or isinstance(r, types.FrameType) and r.f_code.co_filename == __file__:
                continue
            seen.add(id(r))
            print("  " + "  " * depth + "<- " + name(r))
            walk(r, depth + 1, seen)

    def report(frames):
        skip = {id(frames), id(globals()), id(refs)}
        for f in frames:
            print("  frame", f.f_code.co_name, "held by:")
            walk(f, 1, skip | {id(f)})

    report(frames)
moe.glu_op = orig
