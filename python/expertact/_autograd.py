"""The differentiable activation: which route a call takes (glu_call: the eager path, the
kernel bodies of _ops called directly for plain tensors when _eager.eager_ok() holds, or the
torch operators of _library for everything else and for every call with EXPERTACT_EAGER=0);
the Autograd kernel of expertact::glu (a torch.autograd.Function around the operator,
registered here), the eager path's own Function around the kernel body, and the one
backward decision both share (in place or not, operators or bodies); and the autograd
Functions of the biased forms (functional.glu(..., bias=, offsets=), functional.expert_bias),
which run eagerly (a graph break under torch.compile).

Memory (docs/spec.md section 3): the forward saves only its inputs (and weights) for
backward. With inplace_backward=True the backward writes the gradients over those inputs
and returns them: a second backward through the same graph raises, and the inputs' version
counters are bumped so that any other saved user of them fails loudly instead of reading
gradients.
"""
from __future__ import annotations

import torch

from . import _ops
from ._args import check_offsets, layout_code, tensor_arg
from ._capi import rows_view_ok, vector_ok
from ._eager import eager_ok, plain
from ._library import LIB, bump_versions, glu_backward_inplace_op, glu_backward_op, glu_op

__all__ = ["glu_call", "glu_backward_any", "glu_eager", "glu_bias_call", "expert_bias_call", "CREATE_GRAPH_MSG",
           "SECOND_BACKWARD_MSG"]

Tensor = torch.Tensor
glu_forward_body = _ops.glu_forward
glu_backward_body = _ops.glu_backward
glu_backward_inplace_body = _ops.glu_backward_inplace

_grad_enabled = torch.is_grad_enabled
_profiling = torch.autograd._profiler_enabled

CREATE_GRAPH_MSG = (
    "expertact: backward with create_graph=True is not supported: the fused backward has no "
    "derivative of its own (it would silently give a wrong second derivative). Use the eager "
    "PyTorch expression where double backward is needed."
)
SECOND_BACKWARD_MSG = (
    "expertact: this graph's backward already ran with inplace_backward=True, which wrote the "
    "gradients over the saved inputs; a second backward (retain_graph=True) would read "
    "gradients as inputs. Call with inplace_backward=False to backward more than once."
)

_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


def _save(ctx, x, up, weights, args, inplace_backward):
    """What both nodes keep for backward: the inputs themselves, the scalars (layout, act,
    alpha, limit, beta), the in-place flag, and whether an in-place backward already ran."""
    ctx.save_for_backward(x, up, weights)
    ctx.args = args
    ctx.inplace = inplace_backward
    ctx.spent = False


def _glu_grads(ctx, grad, need_x, need_up, need_w, eager):
    """(grad_x, grad_up, grad_weights) of a glu node. eager: the node was made by the
    eager path, whose backward calls the bodies directly unless something now stands in
    between (a mode entered after the forward, a subclass gradient); else the operators."""
    if _grad_enabled():
        raise RuntimeError(CREATE_GRAPH_MSG)
    if ctx.spent:
        raise RuntimeError(SECOND_BACKWARD_MSG)
    x, up, weights = ctx.saved_tensors
    weights_grad = weights is not None and need_w
    eager = eager and eager_ok() and plain(grad)
    # In place only when every tensor it would overwrite wants its gradient: never
    # destroy an input that is not being differentiated.
    if ctx.inplace and need_x and (up is None or need_up):
        ctx.spent = True
        gw = torch.empty_like(weights, dtype=torch.float32) if weights_grad else None
        if eager:
            bump_versions(x, up, gw)
            glu_backward_inplace_body(grad, x, up, weights, gw, *ctx.args)
        else:
            glu_backward_inplace_op(grad, x, up, weights, gw, *ctx.args)
        # Fresh aliases of the overwritten inputs: an AccumulateGrad of a leaf can then
        # take them as .grad without a copy.
        return x.detach(), None if up is None else up.detach(), gw
    if eager:
        res = glu_backward_body(grad, x, up, weights, weights_grad, *ctx.args)
    else:
        res = glu_backward_op(grad, x, up, weights, weights_grad, *ctx.args)
    return res[0], res[1] if up is not None else None, res[-1] if weights_grad else None


class _Glu(torch.autograd.Function):
    """The autograd node of expertact::glu. Registered by hand as the op's Autograd kernel
    rather than through torch.library.register_autograd, whose wrapper re-reads the schema's
    arguments on every call (~O(args^2) Python objects: tens of microseconds a call)."""

    @staticmethod
    def forward(ctx, keyset, x, up, weights, layout, act, alpha, limit, beta, inplace_backward):
        with torch._C._AutoDispatchBelowAutograd():
            out = glu_op.redispatch(keyset & _BELOW_AUTOGRAD, x, up, weights, layout, act, alpha, limit, beta,
                                    inplace_backward)
        _save(ctx, x, up, weights, (layout, act, alpha, limit, beta), inplace_backward)
        return out

    @staticmethod
    def backward(ctx, grad):
        _, need_x, need_up, need_w = ctx.needs_input_grad[:4]
        gx, gu, gw = _glu_grads(ctx, grad, need_x, need_up, need_w, eager=False)
        return None, gx, gu, gw, None, None, None, None, None, None


def _glu_autograd(keyset, x, up, weights, layout, act, alpha, limit, beta, inplace_backward=False):
    if torch.is_grad_enabled() and (x.requires_grad or (up is not None and up.requires_grad)
                                    or (weights is not None and weights.requires_grad)):
        return _Glu.apply(keyset, x, up, weights, layout, act, alpha, limit, beta, inplace_backward)
    with torch._C._AutoDispatchBelowAutograd():
        return glu_op.redispatch(keyset & _BELOW_AUTOGRAD, x, up, weights, layout, act, alpha, limit, beta,
                                 inplace_backward)


LIB.impl("glu", _glu_autograd, "Autograd", with_keyset=True)


class _GluEager(torch.autograd.Function):
    """The eager path's autograd node: the forward body called directly, no dispatcher. The
    five scalars travel as one tuple: each input of an autograd.Function costs a little in
    apply and again in backward (a toy Function with 9 inputs was slower per forward+backward
    than one with 2)."""

    @staticmethod
    def forward(ctx, x, up, weights, args, inplace_backward):
        out = glu_forward_body(x, up, weights, *args)
        _save(ctx, x, up, weights, args, inplace_backward)
        return out

    @staticmethod
    def backward(ctx, grad):
        need_x, need_up, need_w = ctx.needs_input_grad[:3]
        gx, gu, gw = _glu_grads(ctx, grad, need_x, need_up, need_w, eager=True)
        return gx, gu, gw, None, None


# autograd.Function.apply's Python wrapper only binds defaults for setup_context forms,
# routes functorch transforms (excluded by eager_ok) and unwraps dead functorch wrappers
# (excluded by plain); the C apply underneath saves about a seventh of the host time of an
# eager forward with autograd on the CPU (docs/notes/perf-notes.md, "Python host path").
_eager_apply = super(torch.autograd.Function, _GluEager).apply


def glu_eager(x, up, weights, layout, act, alpha, limit, beta, inplace_backward, _named=False):
    """expertact::glu without the dispatcher: for plain tensors when eager_ok() holds."""
    if not _named and _profiling():  # a profiler trace names the call as it would the operator
        with torch.autograd.profiler.record_function("expertact::glu"):
            return glu_eager(x, up, weights, layout, act, alpha, limit, beta, inplace_backward, True)
    if _grad_enabled() and (x.requires_grad or (up is not None and up.requires_grad)
                            or (weights is not None and weights.requires_grad)):
        return _eager_apply(x, up, weights, (layout, act, alpha, limit, beta), inplace_backward)
    return glu_forward_body(x, up, weights, layout, act, alpha, limit, beta)



# ---------------------------------------------------------------------------
# The route of a call: the eager path or the operator
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# The biased forms (rows sorted by expert; offsets int32 [E])
# ---------------------------------------------------------------------------


def _pair(bias, offsets):
    if (bias is None) != (offsets is None):
        missing = "offsets" if offsets is None else "bias"
        raise ValueError(f"expertact: a per-expert bias needs both bias and offsets; {missing} is missing")


class _GluBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, up, weights, bias, offsets, args, inplace):
        ctx.save_for_backward(x, up, weights, bias, offsets)
        ctx.args, ctx.inplace, ctx.spent = args, inplace, False
        return _ops.glu_forward_bias(x, up, bias, offsets, weights, *args)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            raise RuntimeError(CREATE_GRAPH_MSG)
        if ctx.spent:
            raise RuntimeError(SECOND_BACKWARD_MSG)
        x, up, weights, bias, offsets = ctx.saved_tensors
        ctx.spent = ctx.inplace
        need = ctx.needs_input_grad
        gx, gu, gw, gb = _ops.glu_backward_bias(dy, x, up, bias, offsets, weights, weights is not None and need[2],
                                                need[3], ctx.inplace, *ctx.args)
        return gx, gu, gw, gb, None, None, None


def glu_bias_call(gate, up, layout_code, act, alpha, limit, beta, weights, inplace_backward, bias, offsets):
    """functional.glu's biased form: the activation of gate (and up) + bias[e], differentiable
    in every tensor argument (offsets excepted)."""
    _pair(bias, offsets)
    tensor_arg("bias", bias)
    offsets = check_offsets(offsets, gate)
    return _GluBias.apply(gate, up, weights, bias, offsets, (layout_code, act, alpha, limit, beta),
                          bool(inplace_backward))


class _ExpertBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, offsets, weights):
        ctx.save_for_backward(bias, offsets, weights)
        return _ops.expert_bias_forward(x, bias, offsets, weights)

    @staticmethod
    def backward(ctx, dy):
        bias, offsets, weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        gb, gw = _ops.expert_bias_backward(dy, bias, offsets, weights, weights is not None and need[3], need[1])
        return (dy if need[0] else None), gb, None, gw


def expert_bias_call(x, bias, offsets, weights=None):
    """x + weights[r] * bias[e] per row: see functional.expert_bias."""
    tensor_arg("x", x)
    tensor_arg("bias", bias)
    tensor_arg("weights", weights, optional=True)
    offsets = check_offsets(offsets, x)
    return _ExpertBias.apply(x, bias, offsets, weights)
