"""Which route a call takes to the kernel: the eager path (the bodies called directly, for
plain tensors when _eager.eager_ok() holds) or the torch operators (everything else, and
every call when EXPERTACT_EAGER=0). functional, deepspeed and the explicit backwards call
through here; both routes reach the same kernel body (docs/python.md, "The binding").
"""
from __future__ import annotations

import torch

from ._args import layout_code, tensor_arg
from ._autograd import glu_eager
from ._describe import glu_backward_body, rows_view_ok, vector_ok
from ._eager import eager_ok, plain
from ._library import glu_backward_op, glu_op

__all__ = ["glu_call", "glu_backward_any"]

Tensor = torch.Tensor


def glu_call(gate, up, layout, act, alpha, limit, beta, weights, inplace_backward):
    """The activation of gate (and up, or None for one packed tensor) with numeric parameters:
    the type checks, the layout's code, one copy of an operand the library cannot read in place,
    then the eager path or the operator."""
    packed = up is None
    if not isinstance(gate, Tensor):
        tensor_arg("gate_up" if packed else "gate", gate)
    if not (packed or isinstance(up, Tensor)):
        tensor_arg("up", up, optional=True)
    if not (weights is None or isinstance(weights, Tensor)):
        tensor_arg("weights", weights, optional=True)
    code = layout_code(layout, packed)
    # The library reads row-strided views in place; other strides are copied once,
    # here, so that autograd routes the gradient back through the copy (and an in-place
    # backward overwrites the copy, not the caller's tensor).
    if not (gate.is_contiguous() or rows_view_ok(gate)):
        gate = gate.contiguous()
    if not (packed or up.is_contiguous() or rows_view_ok(up)):
        up = up.contiguous()
    if not (weights is None or weights.is_contiguous() or vector_ok(weights)):
        weights = weights.contiguous()
    inplace_backward = bool(inplace_backward)
    # Plain tensors in eager mode: the kernel bodies without the dispatcher; otherwise the
    # operator, which torch.compile and modes see.
    if eager_ok() and plain(gate) and (packed or plain(up)) and (weights is None or plain(weights)):
        return glu_eager(gate, up, weights, code, act, alpha, limit, beta, inplace_backward)
    return glu_op(gate, up, weights, code, act, alpha, limit, beta, inplace_backward)


def glu_backward_any(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta):
    """expertact::glu_backward, through the body directly when the eager path applies."""
    if eager_ok() and plain(grad_out) and plain(x) and (up is None or plain(up)) and (
            weights is None or plain(weights)):
        return glu_backward_body(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta)
    return glu_backward_op(grad_out, x, up, weights, weights_grad, layout, act, alpha, limit, beta)
