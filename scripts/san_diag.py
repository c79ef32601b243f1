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
    for r in gc.get_referrers(h):
        print("  referrer:", type(r).__name__, str(r)[:200].replace("\n", " "))
    print("  refcount", sys.getrefcount(h))
    # Who holds the frames that hold h: referrers up to 4 levels, skipping this script's own
    # bookkeeping (the lists and frames made here).
    mine = set()

    def walk(obj, depth, seen):
        if depth > 4:
            return
        refs = [r for r in gc.get_referrers(obj) if id(r) not in seen and id(r) not in mine]
        for r in refs[:6]:
            seen.add(id(r))
            desc = type(r).__name__
            if isinstance(r, types.FrameType):
                desc += f" {r.f_code.co_filename}:{r.f_lineno} {r.f_code.co_name}"
            elif isinstance(r, types.TracebackType):
                desc += f" tb of {r.tb_frame.f_code.co_name}"
            elif isinstance(r, types.ModuleType):
                desc += f" {r.__name__}"
            else:
                desc += " " + repr(r)[:160].replace("\n", " ")
            print("  " + "  " * depth + "<- " + desc)
            if not isinstance(r, types.ModuleType):
                walk(r, depth + 1, seen)

    frames = [r for r in gc.get_referrers(h) if isinstance(r, types.FrameType)]
    mine.update(id(x) for x in (frames, refs))
    mine.add(id(sys._getframe()))
    for f in frames:
        print("  frame", f.f_code.co_name, "held by:")
        walk(f, 1, {id(f)})
moe.glu_op = orig
