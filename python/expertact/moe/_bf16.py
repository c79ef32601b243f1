"""The bf16 (and float32, float16) node of expert_mlp: one torch.autograd.Function for the whole
MLP, so that the memory modes decide what stays alive between forward and backward; and the
steps both nodes share (the activation with its bias, what a node keeps, the activation's
backward in the node's memory mode, w2's gradient). The FP8 node (_fp8) builds on them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _ops
from .._autograd import CREATE_GRAPH_MSG, SECOND_BACKWARD_MSG
from .._library import glu_backward_inplace_op, glu_backward_op, glu_op
from ._gemm import gmm, gmm_wgrad, mm_operand

__all__ = ["ExpertMLP", "activation", "mlp_forward", "hooks_active", "keep", "kept", "Needs", "needs", "glu_grad",
           "w2_grad", "KEPT"]


def activation(gate_up, weights, glu, b13, offs):
    """h = act(gate_up + b13[e]) * weights: the bias added inside the activation kernel."""
    if b13 is None:
        return glu_op(gate_up, None, weights, *glu, False)
    return _ops.glu_forward_bias(gate_up, None, b13, offs, weights, *glu)


def mlp_forward(x, w13, w2, weights, offs, plan, b13=None, b2=None):
    """(x as the GEMMs read it, gate_up, h, y) of the MLP."""
    if plan.grouped:
        x = mm_operand(x, row_major=True)  # the copy, if any, is what backward reads
    gate_up = gmm(x, w13, offs, plan)
    h = activation(gate_up, weights, plan.glu, b13, offs)
    y = gmm(h, w2, offs, plan)
    if b2 is not None:  # y += weights * b2[e], in place over the GEMM's output
        _ops.expert_bias_forward(y, b2, offs, weights, inplace=True)
    return x, gate_up, h, y


def hooks_active() -> bool:
    """Whether saved tensors go through hooks (torch.autograd.graph.saved_tensors_hooks:
    activation offloading, non-reentrant checkpointing) or a compiler traces the node: then
    everything kept goes through save_for_backward, as those mechanisms expect."""
    if torch.compiler.is_compiling():
        return True
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: the safe choice
    try:
        return top(False) is not None
    except Exception:  # a signature this torch does not have: the safe choice
        return True


KEPT = 8  # x, w13, w2, weights, offs, gate_up, b13, b2


def keep(ctx, plan, tensors, h):
    """What both autograd nodes keep: x, w13, w2, weights, offs, gate_up, b13, b2 (None
    without biases), and h unless recompute (then h is freed when the caller drops it).
    With plan.remake_weights, w13 and w2 are not kept: kept() remakes them.

    h is kept as a plain attribute, not through save_for_backward, so that backward can drop
    it as soon as w2's gradient is computed: a saved tensor lives until its node's backward
    returns, and then h ([T, F], 6 GiB at the seed size) would still be alive when dh and
    dgate_up are, raising the step's peak by one [T, F] tensor (17% more extra memory at the
    seed size, and a 2% slower backward). h is an intermediate the caller never
    sees, so the attribute makes no reference cycle. With saved-tensor hooks active (or under
    a compiler), h goes through save_for_backward as before."""
    hooked = not plan.recompute and hooks_active()
    if plan.remake_weights is not None:  # w13 and w2 are remade in backward: not kept
        tensors = (tensors[0], None, None, *tensors[3:])
    ctx.save_for_backward(*tensors, *((h,) if hooked else ()))
    ctx.h = None if plan.recompute or hooked else h
    ctx.plan = plan
    ctx.spent = False


def kept(ctx):
    """Both nodes' backward guards, then (x, w13, w2, weights, offs, gate_up, b13, b2, h or None).
    An h kept as an attribute is handed over once: the caller drops it after w2's gradient,
    and a second backward (retain_graph=True) finds None and recomputes it (w2_grad)."""
    if torch.is_grad_enabled():
        raise RuntimeError(CREATE_GRAPH_MSG)
    if ctx.spent:
        raise RuntimeError(SECOND_BACKWARD_MSG)
    saved = ctx.saved_tensors
    h = saved[KEPT] if len(saved) > KEPT else ctx.h
    ctx.h = None
    if ctx.plan.remake_weights is not None:
        w13, w2 = ctx.plan.remake_weights()
        saved = (saved[0], w13, w2, *saved[3:KEPT])
    return (*saved[:KEPT], h)


class Needs(NamedTuple):
    """Which of the node's inputs want a gradient."""
    x: bool
    w13: bool
    w2: bool
    weights: bool
    b13: bool
    b2: bool

    @property
    def dh(self) -> bool:
        """Whether dh (and so the activation's backward) is needed."""
        return self.x or self.w13 or self.weights or self.b13


def needs(ctx) -> Needs:
    """Needs of a node's backward: both nodes take (x, w13, w2, weights, offs, plan, b13, b2)."""
    n = ctx.needs_input_grad
    return Needs(n[0], n[1], n[2], n[3], n[6], n[7])


def glu_grad(ctx, need, dh, gate_up, weights, b13, offs):
    """(dgate_up, the weights' gradient or None, db13 or None) from dh: the activation's
    backward in the node's memory mode (in place over gate_up with inplace_backward, which
    spends the node), b13's gradient fused when b13 is given. need: the node's Needs."""
    plan = ctx.plan
    weights_grad = weights is not None and need.weights
    inplace = plan.inplace and (need.x or need.w13 or need.b13)
    if inplace:
        ctx.spent = True
    if b13 is not None:
        dgate_up, _, dweights, db13 = _ops.glu_backward_bias(dh, gate_up, None, b13, offs, weights, weights_grad,
                                                           need.b13, inplace, *plan.glu)
        return dgate_up, dweights, db13
    if inplace:
        gw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device) if weights_grad else None
        glu_backward_inplace_op(dh, gate_up, None, weights, gw, *plan.glu)
        return gate_up, gw, None
    res = glu_backward_op(dh, gate_up, None, weights, weights_grad, *plan.glu)
    return res[0], (res[-1] if weights_grad else None), None


class ExpertMLP(torch.autograd.Function):
    """Keeps x, w13, w2, weights, gate_up and (unless recompute) h: what torch's autograd
    keeps for the unfused composition (torch._grouped_mm saves its inputs, the activation
    its input). recompute drops h and recomputes it in backward for w2's gradient."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, offs, plan, b13=None, b2=None):
        x, gate_up, h, y = mlp_forward(x, w13, w2, weights, offs, plan, b13, b2)
        keep(ctx, plan, (x, w13, w2, weights, offs, gate_up, b13, b2), h)
        del h  # with recompute, freed here: one [T, F] tensor less kept for backward
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, weights, offs, gate_up, b13, b2, h = kept(ctx)
        plan, need = ctx.plan, needs(ctx)
        if plan.grouped:
            dy = mm_operand(dy, row_major=True)  # once, here, rather than in each of the two GEMMs
        dx = dw13 = dw2 = dweights = db13 = db2 = None
        dweights_b2 = None
        if b2 is not None:  # one pass over dy: b2's gradient and its term of the weights' gradient
            db2, dweights_b2 = _ops.expert_bias_backward(dy, b2, offs, weights, weights is not None and need.weights,
                                                         need.b2)
        # Order for the smallest peak: w2's gradient first, so that h (kept or recomputed) is freed
        # before dh exists; then dh, the activation's backward (over gate_up if in place),
        # dh freed, then x's gradient.
        if need.w2:
            dw2 = w2_grad(h, gate_up, weights, plan.glu, dy, offs, plan, w2, b13)
        h = None  # freed now (kept as an attribute, or recomputed): dh and dgate_up never meet it
        if need.dh:
            dh = gmm(dy, w2.transpose(-2, -1), offs, plan)
            dgate_up, dweights, db13 = glu_grad(ctx, need, dh, gate_up, weights, b13, offs)
            del dh
            if need.x:
                dx = gmm(dgate_up, w13.transpose(-2, -1), offs, plan)
            if need.w13:
                dw13 = gmm_wgrad(x, dgate_up, offs, plan, like=w13)
        if dweights_b2 is not None:
            dweights = dweights_b2 if dweights is None else dweights.add_(dweights_b2)
        return dx, dw13, dw2, dweights, None, None, db13, db2


def w2_grad(h, gate_up, weights, glu, dy, offs, plan, w2=None, b13=None):
    """w2's gradient h^T dy per expert, h recomputed by the fused forward kernel from gate_up
    (glu: layout, act, alpha, limit, beta; b13 added inside) when the forward did not keep it
    (recompute=True); laid out as w2 is, when given."""
    if h is None:
        h = activation(gate_up, weights, glu, b13, offs)
    return gmm_wgrad(h, dy, offs, plan, like=w2)
