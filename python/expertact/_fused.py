"""Experimental: the fused grouped GEMMs of the expert MLP through the C ABI
(expertact_moe_fused_forward / _backward; docs/fused-gemm.md): CUTLASS kernels for Hopper
GPUs that compute the activation in the gate/up GEMM's epilogue and its gradient in the
epilogue of the GEMM that would produce dh. expertact.moe.expert_mlp(..., fused=True)
uses them; the library validates every argument.

They are correct but slower than the unfused path (docs/fused-gemm.md says why that design
cannot reach its targets); why_not, forward and backward may change or go without notice.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _capi
from ._describe import dl_tensor, stream_of

__all__ = ["why_not", "forward", "backward"]

_WS = _capi.WORKSPACE
_LAYOUT_INTERLEAVED = _capi.LAYOUT_INTERLEAVED


def why_not(x: torch.Tensor, D: int, F: int) -> Optional[str]:
    """None when the fused kernels take this problem, else why not (for the fallback's warning).

    They take bfloat16 CUDA tensors on a Hopper (sm_90) GPU, in a build with CUTLASS, with
    D a multiple of 8 and F of 4: the tensor memory accelerator reads x, w13 and gate_up
    (and dy, w2) with row strides that are multiples of 16 bytes."""
    if not _capi.has_fused_gemm():
        return "this expertact build has no fused grouped GEMM (built without CUTLASS or CUDA)"
    if not x.is_cuda:
        return f"x is on {x.device} (the fused GEMMs run on CUDA)"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype} (the fused GEMMs take bfloat16)"
    cap = torch.cuda.get_device_capability(x.device)
    if cap != (9, 0):
        return f"{x.device} is sm_{cap[0]}{cap[1]} (the fused GEMMs are sm_90a code)"
    if D % 8 or F % 4:
        return f"D = {D} and F = {F}: the fused GEMMs need D % 8 == 0 and F % 4 == 0"
    return None


def _params(act, alpha, limit, beta):
    """The per-thread expertact_params struct, filled (a byref for the call)."""
    p = _WS.params
    p.act, p.alpha, p.limit, p.beta = act, alpha, limit, beta
    return _WS.params_ref


def _call(fn, *args):
    status = fn(*args)
    if status:
        _capi.raise_for(status)


def forward(x, w13i, offsets, weights, act, alpha, limit, beta):
    """(gate_up [T, 2F] interleaved, h [T, F]) from x [T, D] and w13i [E, 2F, D] (D contiguous,
    gate and up interleaved along 2F). Rows past offsets[-1] are left unwritten."""
    T = x.shape[0]
    F = w13i.shape[1] // 2
    gate_up = x.new_empty((T, 2 * F))
    h = x.new_empty((T, F))
    s = _WS.slots
    _call(_capi.LIB.expertact_moe_fused_forward, _params(act, alpha, limit, beta), dl_tensor(s[0], x),
          dl_tensor(s[1], w13i), dl_tensor(s[2], offsets), None if weights is None else dl_tensor(s[3], weights),
          dl_tensor(s[4], gate_up), dl_tensor(s[5], h), stream_of(x))
    return gate_up, h


def backward(dy, w2k, offsets, gate_up, weights, weights_grad, inplace, act, alpha, limit, beta):
    """(grad_gate_up, grad_weights or None) from dy [T, D], w2k [E, F, D] (D contiguous) and the
    forward's gate_up; grad_gate_up is gate_up itself when inplace. dh is never stored."""
    dgate_up = gate_up if inplace else torch.empty_like(gate_up)
    dweights = torch.empty(gate_up.shape[0], dtype=torch.float32, device=gate_up.device) \
        if weights_grad else None
    s = _WS.slots
    _call(_capi.LIB.expertact_moe_fused_backward, _params(act, alpha, limit, beta), dl_tensor(s[0], dy),
          dl_tensor(s[1], w2k), dl_tensor(s[2], offsets), dl_tensor(s[3], gate_up),
          None if weights is None else dl_tensor(s[4], weights), dl_tensor(s[5], dgate_up),
          None if dweights is None else dl_tensor(s[6], dweights), stream_of(dy))
    return dgate_up, dweights
