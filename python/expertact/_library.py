"""The torch operators, registered through torch.library: expertact::glu (differentiable),
expertact::glu_backward and the in-place expertact::glu_backward_.

What is registered here: the schemas, the CPU and CUDA kernels (the bodies of _ops),
the fake (meta) kernels that give torch.compile and meta tensors their shapes and dtypes,
and an ADInplaceOrView kernel for glu_backward_ that bumps the version counters of what it
overwrites. glu's Autograd kernel is registered by _autograd, which holds the autograd
Functions (it needs these operators, so it cannot be imported from here).

The operators are what torch.compile traces (no graph break) and what runs whenever
anything but autograd stands between the caller and the kernel: a TorchDispatchMode,
FakeTensors, tensor subclasses, functorch transforms, jit tracing, other devices.
"""
from __future__ import annotations

import torch

from . import _capi
from ._ops import glu_backward, glu_backward_inplace, glu_forward

__all__ = ["LIB", "glu_op", "glu_backward_op", "glu_backward_inplace_op", "bump_versions"]

_SEPARATE = _capi.LAYOUT_SEPARATE

LIB = torch.library.Library("expertact", "DEF")
LIB.define(
    "glu(Tensor x, Tensor? up, Tensor? weights, int layout, int act, float alpha, float limit, "
    "float beta, bool inplace_backward=False) -> Tensor"
)
LIB.define(
    "glu_backward(Tensor grad_out, Tensor x, Tensor? up, Tensor? weights, bool weights_grad, "
    "int layout, int act, float alpha, float limit, float beta) -> Tensor[]"
)
# Writes the gradients of x (and up) over x (and up); grad_weights, when given, is
# an output buffer. Returns nothing, so torch.compile can functionalize it.
LIB.define(
    "glu_backward_(Tensor grad_out, Tensor(a!) x, Tensor(b!)? up, Tensor? weights, "
    "Tensor(c!)? grad_weights, int layout, int act, float alpha, float limit, float beta) -> ()"
)

for _key in ("CPU", "CUDA"):
    LIB.impl("glu", glu_forward, _key)
    LIB.impl("glu_backward", glu_backward, _key)
    LIB.impl("glu_backward_", glu_backward_inplace, _key)


def bump_versions(x, up, grad_weights):
    # Bump the version counters of what the in-place backward writes, as built-in in-place
    # ops do: any autograd node that saved x or up (or a view of them) then fails loudly.
    for t in (x, up, grad_weights):
        if t is not None:  # one at a time: older torch takes a single tensor
            torch.autograd.graph.increment_version(t)


def _glu_backward_inplace_adinplaceorview(keyset, grad_out, x, up, weights, grad_weights, *args):
    bump_versions(x, up, grad_weights)
    return glu_backward_inplace_op.redispatch(
        keyset & torch._C._after_ADInplaceOrView_keyset, grad_out, x, up, weights, grad_weights, *args)


LIB.impl("glu_backward_", _glu_backward_inplace_adinplaceorview, "ADInplaceOrView", with_keyset=True)

glu_op = torch.ops.expertact.glu.default
glu_backward_op = torch.ops.expertact.glu_backward.default
glu_backward_inplace_op = torch.ops.expertact.glu_backward_.default


# ---------------------------------------------------------------------------
# Fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors
# ---------------------------------------------------------------------------


def _out_cols(x, layout):
    shape = x.shape
    if not shape:
        return shape  # 0-dim: the library refuses it with a message naming it
    c = shape[-1]
    return shape[:-1] + (c if layout == _SEPARATE else c // 2,)


@torch.library.register_fake("expertact::glu", lib=LIB)
def _glu_fake(x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    return x.new_empty(_out_cols(x, layout))


@torch.library.register_fake("expertact::glu_backward", lib=LIB)
def _glu_backward_fake(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta):
    res = [x.new_empty(x.shape)]
    if up is not None:
        res.append(up.new_empty(up.shape))
    if weights_grad:
        res.append(x.new_empty(weights.shape if weights is not None else (0,), dtype=torch.float32))
    return res


@torch.library.register_fake("expertact::glu_backward_", lib=LIB)
def _glu_backward_inplace_fake(grad_out, x, up, weights, grad_weights, layout, act, alpha, limit, beta):
    return None

