"""The FP8 node of expert_mlp (fp8="rowwise"): the grouped expert MLP with its six GEMMs in float8
e4m3fn (docs/spec.md section 10), torch._scaled_grouped_mm on Hopper and its emulation on the CPU
(_gemm.scaled_gmm, the one place where they differ).

Operands, in the formats that operator takes on sm90 (A row-major, B column-major, float32
dequantisation scales):

    forward   gate_up = x_q  @ w13_q   x rowwise [T];  w13 per expert and column [E, 2F]
              y       = h_q  @ w2_q    h rowwise [T] (the activation kernel writes h in e4m3 from
                                       its float32 values); w2 [E, D]
    backward  dh      = dy_q @ w2^T_q  dy rowwise;  w2^T per expert and column [E, F]
              dx      = dg_q @ w13^T_q dgate_up rowwise; w13^T [E, D]
              dw2     = h^T dy         both per expert and column over the expert's rows,
              dw13    = x^T dgate_up   written transposed, each expert's rows padded to 32
                                       (ROW_PAD; the 2-D x 2-D form asserts on the device
                                       for groups that are not multiples of 16)

Scales are torchao's recipe (powers of two from the row's or column's amax, NaN ignored);
docs/spec.md section 10 says which operands are torchao's bit for bit and which are quantised
from float32 values instead. ``fp8_wgrad=False`` keeps the two weight-gradient GEMMs in bf16.
The kernels are _ops' (expertact.fp8 is their checked public form), their outputs allocated by
_fp8_buffers. The node keeps what ``recompute=True`` keeps: h is not kept; backward makes w2's
gradient operand from gate_up with h's column amax taken by the forward's activation (with b13,
from h recomputed in bf16 and a column-wise pass).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _fp8_buffers, _ops
from . import _gemm
from ._bf16 import activation, glu_grad, hooks_active, keep, kept, needs
from ._gemm import gmm_wgrad, held_transposed, zero_empty_groups

__all__ = ["Fp8ExpertMLP", "why_not", "forward", "ALIGN", "ROW_PAD"]

Tensor = torch.Tensor

ALIGN = 16  # rows per group of the weight-gradient GEMMs' reduction dim; K and N multiples of it
# Each expert's rows in the weight-gradient GEMMs' operands start at a multiple of ROW_PAD (a
# multiple of ALIGN; at most ROW_PAD - 1 zero rows an expert, which the GEMMs skip).
ROW_PAD = 32


def why_not(x: Tensor, D: int, F: int) -> Optional[str]:
    """Why the FP8 node cannot run on these operands, or None: Hopper (sm90) GPUs, and the CPU
    (the emulation), with bfloat16 operands and D and F multiples of 16 on both."""
    if x.is_cuda:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
        major, minor = torch.cuda.get_device_capability(x.device)
        if major != 9:
            return (f"{torch.cuda.get_device_name(x.device)} is sm{major}{minor}: the FP8 rowwise grouped GEMMs "
                    "are taken on Hopper (sm90) only")
    elif x.device.type != "cpu":
        return f"x is on {x.device}: FP8 runs on Hopper GPUs (sm90), and on the CPU as an emulation"
    if x.dtype != torch.bfloat16:
        where = "" if x.is_cuda else f"x is on {x.device}, where the recipe runs as an emulation, and "
        return f"{where}x has dtype {x.dtype}: the FP8 path takes bfloat16 operands"
    if D % ALIGN or F % ALIGN:
        return f"D = {D} and F = {F} must be multiples of {ALIGN} (the FP8 GEMMs' K and N)"
    return None


# ---------------------------------------------------------------------------
# Operands and GEMMs
# ---------------------------------------------------------------------------


def _rowwise(t: Tensor, offs: Optional[Tensor] = None, experts: int = 0):
    """(q, scale, amax or None): t [T, C] quantised per row; with offs, also its per expert and
    column amax [E, C] in the same read (for the column-wise operand of a weight gradient)."""
    q, scale = _fp8_buffers.rowwise(t, t.shape[-1])
    amax = None if offs is None else _fp8_buffers.amax(experts, t.shape[-1], t.device)
    _ops.fp8_quantize_rowwise(t, q, scale.view(-1), offs, amax)
    return q, scale, amax


def _weight(w_kn: Tensor):
    """A GEMM's B operand [E, K, N] -> (e4m3 [E, K, N] column-major, scale [E, N]): one scale per
    expert and output column, over K. Weights are small (a few hundred MB): one contiguous copy
    when their storage is not [E, N, K] already, then the rowwise kernel."""
    q, scale, _ = _rowwise(w_kn.transpose(-2, -1).contiguous())
    return q.transpose(-2, -1), scale


def _mm(a, w, offs, end: int) -> Tensor:
    """out[rows of e] = a[rows of e] @ w[e] in FP8: a = (q, scale, _) from _rowwise, w = (q, scale)
    from _weight; rows past the last offset zeroed (the GEMM leaves them unwritten)."""
    out = _gemm.scaled_gmm(a[0], w[0], a[1], w[1], offs)
    if end < out.shape[0]:
        out[end:].zero_()
    return out


def _cols(t: Tensor, offs: Tensor, poffs: Tensor, ends, amax=None):
    """t's column-wise operand of a weight-gradient GEMM: (e4m3 [Tp, C] column-major, scale
    [E, C]), each expert's rows padded to ROW_PAD (poffs: the padded offsets). amax: the per
    expert and column amax when a rowwise pass has taken it already: t is then read once."""
    q_t, scale = _fp8_buffers.colwise(t.shape[0], ends, t.shape[1], ROW_PAD, t.device)
    _ops.fp8_quantize_colwise_grouped(t, offs, poffs, q_t, scale, amax)
    return q_t.t(), scale


def _h_cols(gate_up, weights, offs, poffs, ends, glu, hamax):
    """dw2's column-wise operand of h (_cols' form) made from gate_up in one pass with the
    column amax the forward took: the bytes of h recomputed in bf16 and quantised column-wise,
    without writing h."""
    q_t, scale = _fp8_buffers.colwise(gate_up.shape[0], ends, gate_up.shape[1] // 2, ROW_PAD, gate_up.device)
    _ops.fp8_glu_colwise_grouped(gate_up, None, weights, None, offs, poffs, q_t, scale, hamax, *glu)
    return q_t.t(), scale


def _wgrad(a, b, poffs: Tensor, ends, like: Optional[Tensor]) -> Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e] in FP8: [E, a cols, b cols], from the operands'
    column-wise forms a = (aq, sa), b = (bq, sb) (_cols); laid out as ``like`` (a weight held as
    a transposed view gets its gradient in the weight's storage order)."""
    if held_transposed(like):
        return _wgrad(b, a, poffs, ends, None).transpose(-2, -1)
    (aq, sa), (bq, sb) = a, b
    return zero_empty_groups(_gemm.scaled_gmm(aq.t(), bq, sa.reshape(-1), sb.reshape(-1), poffs), ends)


def _glu_backward(dh, gate_up, weights, b13, offs, plan, need):
    """The fused FP8 activation backward, where dx is wanted and b13 needs no gradient: (dx's
    operand (q, scale, dgate_up's per expert and column amax or None), the weights' gradient or
    None, dgate_up in bf16 or None). dx's operand is quantised from the float32 gradient (one
    rounding; b13 added inside, its gradient not computed); the bf16 dgate_up that dw13's operand
    is quantised from is written over gate_up (its last use), and only when dw13 is wanted, with
    its column amax taken in the same pass when that GEMM runs in FP8."""
    E, C = len(plan.ends), gate_up.shape[-1]
    q, scale = _fp8_buffers.rowwise(gate_up, C)
    dweights = torch.empty(scale.shape, dtype=torch.float32, device=dh.device) if (
        weights is not None and need.weights) else None
    amax = _fp8_buffers.amax(E, C, dh.device) if plan.fp8_wgrad and need.w13 else None
    dgate_up = gate_up if need.w13 else None
    grouped = b13 is not None or amax is not None
    _ops.fp8_glu_backward_rowwise(dh, gate_up, weights, b13, offs if grouped else None, q, scale.view(-1),
                                  None if dweights is None else dweights.view(-1), amax, dgate_up, *plan.glu)
    return (q, scale, amax), dweights, dgate_up


# ---------------------------------------------------------------------------
# The node
# ---------------------------------------------------------------------------


def forward(x, w13, w2, weights, offs, plan, b13=None, b2=None, x_amax=False, h_amax=False):
    """(x as kept, gate_up, y, x's per expert and column amax or None, h's or None). x_amax:
    take that amax in the rowwise pass over x, for dw13's column-wise operand in backward;
    h_amax: h's in the activation's pass, for dw2's (without b13 only: with it backward
    recomputes h)."""
    ends, E = plan.ends, len(plan.ends)
    end = ends[-1] if ends else 0
    x = x.contiguous()
    xq = _rowwise(x, offs if x_amax else None, E)
    gate_up = _mm(xq, _weight(w13), offs, end)
    xamax = xq[2]
    del xq
    # h in e4m3 from the activation's float32 values (one rounding), b13 added inside; with
    # h_amax, h's per expert and column amax of the same pass.
    F = gate_up.shape[1] // 2
    hq, sh = _fp8_buffers.rowwise(gate_up, F)
    hamax = _fp8_buffers.amax(E, F, gate_up.device) if h_amax else None
    grouped = b13 is not None or h_amax
    _ops.fp8_glu_rowwise(gate_up, None, weights, b13, offs if grouped else None, hq, sh.view(-1), hamax, *plan.glu)
    y = _mm((hq, sh), _weight(w2), offs, end)
    if b2 is not None:
        _ops.expert_bias_forward(y, b2, offs, weights, inplace=True)
    return x, gate_up, y, xamax, hamax


class Fp8ExpertMLP(torch.autograd.Function):
    """expert_mlp(fp8="rowwise"): keeps what recompute=True keeps (x, the weights, gate_up in
    bf16, and two small amax tables); w2's gradient operand is made from gate_up in backward,
    and gate_up is freed after the activation's backward (its storage holds dgate_up where the
    weight gradient reads it), so the graph runs backward once."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, offs, plan, b13=None, b2=None):
        need = needs(ctx)
        x, gate_up, y, xamax, hamax = forward(x, w13, w2, weights, offs, plan, b13, b2,
                                              x_amax=need.w13 and plan.fp8_wgrad,
                                              h_amax=need.w2 and plan.fp8_wgrad and b13 is None)
        # gate_up as an attribute, as keep() holds h: backward drops it after the activation's
        # backward, before the dx and dw13 operands exist (one [T, 2F] tensor less at the peak).
        hooked = hooks_active()
        keep(ctx, plan, (x, w13, w2, weights, offs, gate_up if hooked else None, b13, b2), None)
        ctx.gate_up = None if hooked else gate_up
        ctx.xamax = xamax  # x's per expert and column amax [E, D] (float32, small), or None
        ctx.hamax = hamax  # h's [E, F], or None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, weights, offs, gate_up, b13, b2, _ = kept(ctx)
        if gate_up is None:
            gate_up, ctx.gate_up = ctx.gate_up, None
        if gate_up is None:  # taken by an earlier backward (retain_graph=True)
            raise RuntimeError("expertact.moe: expert_mlp(fp8=...) frees gate_up during its backward, so its graph "
                               "runs backward once (a second backward, retain_graph=True, is not supported)")
        plan, need = ctx.plan, needs(ctx)
        ends, E, wgrad = plan.ends, len(plan.ends), plan.fp8_wgrad
        end = ends[-1] if ends else 0
        dy = dy.contiguous()
        dx = dw13 = dw2 = dweights = db13 = db2 = dweights_b2 = None
        if b2 is not None:  # one pass over dy: b2's gradient and its term of the weights' gradient
            db2, dweights_b2 = _ops.expert_bias_backward(dy, b2, offs, weights, weights is not None and need.weights,
                                                         need.b2)
        poffs = _fp8_buffers.padded_offsets(offs, ROW_PAD) if wgrad and (need.w2 or need.w13) else None
        if need.dh:  # dy's rowwise operand, and in the same read its column amax for dw2's operand
            dyq = _rowwise(dy, offs if wgrad and need.w2 else None, E)
        # w2's gradient first, so that h's operand is freed before dh exists.
        if need.w2 and not wgrad:
            dw2 = gmm_wgrad(activation(gate_up, weights, plan.glu, b13, offs), dy, offs, plan, like=w2)
        elif need.w2:
            if ctx.hamax is not None:  # from gate_up in one pass, with the amax the forward took
                hc = _h_cols(gate_up, weights, offs, poffs, ends, plan.glu, ctx.hamax)
            else:  # with b13: h recomputed in bf16, then its column-wise pass
                hc = _cols(activation(gate_up, weights, plan.glu, b13, offs), offs, poffs, ends)
            dw2 = _wgrad(hc, _cols(dy, offs, poffs, ends, dyq[2] if need.dh else None), poffs, ends, w2)
            del hc
        if need.dh:
            dh = _mm(dyq, _weight(w2.transpose(-2, -1)), offs, end)
            del dyq
            dg = None
            if need.x and not (b13 is not None and need.b13):
                dg, dweights, dgate_up = _glu_backward(dh, gate_up, weights, b13, offs, plan, need)
            else:  # the bf16 activation's backward in the node's memory mode (b13's gradient fused)
                dgate_up, dweights, db13 = glu_grad(ctx, need, dh, gate_up, weights, b13, offs)
            del dh, gate_up  # gate_up's last use: freed here unless its storage holds dgate_up
            if need.x and dg is None:  # dx's operand quantised from the bf16 backward's output
                dg = _rowwise(dgate_up, offs if wgrad and need.w13 else None, E)
            if need.x:
                dx = _mm(dg, _weight(w13.transpose(-2, -1)), offs, end)
            dgamax = None if dg is None else dg[2]
            del dg
            if need.w13 and wgrad:
                dgc = _cols(dgate_up, offs, poffs, ends, dgamax)
                del dgate_up  # (its storage freed before the GEMM: gate_up's, when written in place)
                dw13 = _wgrad(_cols(x, offs, poffs, ends, ctx.xamax), dgc, poffs, ends, w13)
            elif need.w13:
                dw13 = gmm_wgrad(x, dgate_up, offs, plan, like=w13)
        if dweights_b2 is not None:
            dweights = dweights_b2 if dweights is None else dweights.add_(dweights_b2)
        return dx, dw13, dw2, dweights, None, None, db13, db2
