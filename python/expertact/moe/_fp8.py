"""The FP8 node of expert_mlp (fp8="rowwise"): the grouped expert MLP with its six GEMMs as
torch._scaled_grouped_mm in float8 e4m3fn on Hopper (docs/spec.md section 10).

Operands, in the formats that operator takes on sm90 (A row-major, B column-major, float32
dequantisation scales):

    forward   gate_up = x_q  @ w13_q   x rowwise [T];  w13 per expert and column [E, 2F]
              y       = h_q  @ w2_q    h rowwise [T] (expertact.fp8.glu_rowwise: the activation
                                       writes h in e4m3 from its float32 values); w2 [E, D]
    backward  dh      = dy_q @ w2^T_q  dy rowwise;  w2^T per expert and column [E, F]
              dx      = dg_q @ w13^T_q dgate_up rowwise; w13^T [E, D]
              dw2     = h^T dy         both per expert and column over the expert's rows,
              dw13    = x^T dgate_up   written transposed, each expert's rows padded to 32
                                       (ROW_PAD; the 2-D x 2-D form asserts on the device
                                       for groups that are not multiples of 16)

Scales are torchao's recipe (powers of two from the row's or column's amax, NaN ignored);
docs/spec.md section 10 says which operands are torchao's bit for bit and which are quantised
from float32 values instead. ``fp8_wgrad=False`` keeps the two weight-gradient GEMMs in bf16
(torch._grouped_mm). h is not kept: backward makes w2's gradient operand from gate_up with h's
column amax taken by the forward's activation, by its own pass over gate_up before dh's GEMM
(fp8.glu_colwise_grouped), or (with b13) from h recomputed in bf16 and a column-wise pass, so
the node keeps what ``recompute=True`` keeps.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _ops, fp8
from . import _bf16
from ._bf16 import activation, hooks_active, keep, kept
from ._gemm import gmm_wgrad, held_transposed, zero_empty_groups

__all__ = ["Fp8ExpertMLP", "Fp8Plan", "why_not", "sgmm", "ALIGN", "ROW_PAD"]

Tensor = torch.Tensor

ALIGN = 16  # rows per group of the weight-gradient GEMMs' reduction dim; K and N multiples of it
# Each expert's rows in the weight-gradient GEMMs' operands start at a multiple of ROW_PAD (a
# multiple of ALIGN; at most ROW_PAD - 1 zero rows an expert, which the GEMMs skip).
ROW_PAD = 32


class Fp8Plan(NamedTuple):
    activation: str
    alpha: Optional[float]
    limit: Optional[float]
    layout: str
    wgrad: bool  # the weight-gradient GEMMs in FP8 too


def why_not(x: Tensor, D: int, F: int) -> Optional[str]:
    """Why fp8="rowwise" cannot run on these operands, or None."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
    if not x.is_cuda:
        return f"x is on {x.device}: the FP8 grouped GEMMs run on CUDA (Hopper, sm90) only"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major != 9:
        return (f"{torch.cuda.get_device_name(x.device)} is sm{major}{minor}: the FP8 rowwise grouped GEMMs "
                "are taken on Hopper (sm90) only")
    if x.dtype != torch.bfloat16:
        return f"x has dtype {x.dtype}: the FP8 path takes bfloat16 operands"
    if D % ALIGN or F % ALIGN:
        return f"D = {D} and F = {F} must be multiples of {ALIGN} (the FP8 GEMMs' K and N)"
    return None


def sgmm(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm with bf16 output and fast accumulation, as torchao calls it."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def _quant_b(w_kn: Tensor):
    """A GEMM's B operand [E, K, N] -> (e4m3 [E, K, N] column-major, scale [E, N]): one scale per
    expert and output column, over K. Weights are small (a few hundred MB): one contiguous copy
    when their storage is not [E, N, K] already, then expertact's rowwise kernel."""
    wt = w_kn.transpose(-2, -1).contiguous()
    q, s = fp8.quantize_rowwise(wt)
    return q.transpose(-2, -1), s


def _zero_tail(t: Tensor, end: int) -> Tensor:
    if end < t.shape[0]:
        t[end:].zero_()  # rows past the last offset: the grouped GEMM leaves them unwritten
    return t


def _cols(t: Tensor, offs: Tensor, ends, amax=None):
    """t's column-wise operand of a weight-gradient GEMM: (e4m3 [Tp, C] column-major, scale
    [E, C]), each expert's rows padded to ROW_PAD. amax: the per expert and column amax when a
    rowwise pass has already taken it (quantize_rowwise(col_amax_offsets=)): t is read once."""
    return fp8.quantize_colwise_grouped(t, offs, pad_to=ROW_PAD, ends=ends, amax=amax)


def _wgrad(a, b, poffs: Tensor, ends, like: Optional[Tensor]):
    """out[e] = a[rows of e]^T @ b[rows of e] in FP8: [E, a cols, b cols], from the operands'
    column-wise forms a = (aq, sa), b = (bq, sb) (_cols); laid out as ``like`` (a weight held as
    a transposed view gets its gradient in the weight's storage order)."""
    if held_transposed(like):
        return _wgrad(b, a, poffs, ends, None).transpose(-2, -1)
    (aq, sa), (bq, sb) = a, b
    return zero_empty_groups(sgmm(aq.t(), bq, sa.reshape(-1), sb.reshape(-1), poffs), ends)


def _h_fp8(gate_up, weights, fplan, b13, offs, ends, h_amax=False):
    """(h in e4m3, its rowwise scales, h's per expert and column amax or None), h from the
    activation kernel's float32 values (one rounding), b13 added inside when given. h_amax: the
    same kernel also takes h's column amax, which lets backward make dw2's operand from gate_up
    in one pass (h_cols)."""
    bias = {} if b13 is None else dict(bias=b13, offsets=offs, ends=ends)
    if h_amax:
        return fp8.glu_rowwise(gate_up, fplan.activation, alpha=fplan.alpha, limit=fplan.limit,
                               layout=fplan.layout, weights=weights, col_amax_offsets=offs, ends=ends, **bias)
    return (*fp8.glu_rowwise(gate_up, fplan.activation, alpha=fplan.alpha, limit=fplan.limit,
                             layout=fplan.layout, weights=weights, **bias), None)


def h_cols(gate_up, weights, offs, ends, fplan, hamax):
    """dw2's column-wise operand of h (_cols' form), made from gate_up in one pass with the
    column amax the forward took (fp8.glu_colwise_grouped: the bytes of h recomputed in bf16
    and quantised column-wise, without writing h)."""
    return fp8.glu_colwise_grouped(gate_up, fplan.activation, offs, alpha=fplan.alpha, limit=fplan.limit,
                                   layout=fplan.layout, weights=weights, pad_to=ROW_PAD, ends=ends, amax=hamax)


def forward(x, w13, w2, weights, offs, plan, fplan, b13=None, b2=None, x_amax=False, h_amax=False):
    """(x as kept, gate_up, y, x's per expert and column amax or None, h's or None). x_amax:
    take that amax in the rowwise pass over x, for dw13's column-wise operand in backward;
    h_amax: h's in the activation's pass, for dw2's (without b13 only: with it backward
    recomputes h)."""
    end = plan.ends[-1] if plan.ends else 0
    x = x.contiguous()
    xamax = None
    if x_amax and fplan.wgrad:
        xq, sx, xamax = fp8.quantize_rowwise(x, col_amax_offsets=offs, ends=plan.ends)
    else:
        xq, sx = fp8.quantize_rowwise(x)
    w13q, s13 = _quant_b(w13)
    gate_up = _zero_tail(sgmm(xq, w13q, sx, s13, offs), end)
    del xq, sx, w13q, s13
    hq, sh, hamax = _h_fp8(gate_up, weights, fplan, b13, offs, plan.ends,
                           h_amax and fplan.wgrad and b13 is None)
    w2q, s2 = _quant_b(w2)
    y = _zero_tail(sgmm(hq, w2q, sh, s2, offs), end)
    if b2 is not None:
        _ops.expert_bias_forward(y, b2, offs, weights, inplace=True)
    return x, gate_up, y, xamax, hamax


def glu_grad_fp8(dh, gate_up, weights, weights_grad, b13, offs, ends, fplan, col_amax, keep_bf16):
    """(dg_q, dg_scale, dweights or None, dgate_up's column amax or None, dgate_up in bf16 or
    None): the activation's backward quantised rowwise from its float32 values in one pass
    (expertact.fp8.glu_backward_rowwise; b13 added inside, its gradient not computed), the
    column amax for dw13's column-wise operand when ``col_amax``, and the bf16 gradient that
    operand is quantised from when ``keep_bf16``, written in place over gate_up (its last use:
    the node holds no second [T, 2F] tensor at the peak)."""
    out = gate_up if keep_bf16 else None
    grouped = b13 is not None or col_amax
    dgq, sdg, dweights, amax = fp8.glu_backward_rowwise(
        dh, gate_up, fplan.activation, alpha=fplan.alpha, limit=fplan.limit, layout=fplan.layout, weights=weights,
        weights_grad=weights_grad, bias=b13, offsets=offs if grouped else None, ends=ends if grouped else None,
        col_amax=col_amax, dgate_up_out=out)
    return dgq, sdg, dweights, amax, out


def backward(ctx_needs, x, w13, w2, weights, offs, b2, dy, plan, fplan, glu_grad, h_of, gmm_wgrad, xamax=None,
             glu_fp8=None, h_cols_of=None):
    """The gradients (dx, dw13, dw2, dweights, db13, db2) of forward's y.

    glu_grad(dh) -> (dgate_up, dweights, db13): the activation's backward (moe's, with its
    memory modes); h_of() -> h in bf16 recomputed from gate_up; h_cols_of() -> dw2's operand of h
    made from gate_up (h_cols), or None where the forward took no amax of h; gmm_wgrad: moe's bf16
    weight-gradient GEMM (fp8_wgrad=False). glu_fp8(dh, col_amax, keep_bf16) -> glu_grad_fp8's
    result, or None where it does not apply (b13's gradient wanted): when dx is wanted, dx's
    operand comes straight from the fused FP8 backward (dgate_up not written in bf16 and read
    back for the rowwise pass; written, over gate_up, only when dw13 needs it)."""
    need_x, need_w13, need_w2, need_w, need_b13, need_b2 = ctx_needs
    ends = plan.ends
    end = ends[-1] if ends else 0
    dy = dy.contiguous()
    dx = dw13 = dw2 = dweights = db13 = db2 = dweights_b2 = None
    if b2 is not None:
        db2, dweights_b2 = _ops.expert_bias_backward(dy, b2, offs, weights, weights is not None and need_w,
                                                     need_b2)
    poffs = fp8.padded_offsets(offs, ROW_PAD) if fplan.wgrad and (need_w2 or need_w13) else None
    need_dh = need_x or need_w13 or need_w or need_b13
    dyq = sdy = dyamax = None
    if need_dh:  # dy's rowwise operand, and in the same read its column amax for dw2's operand
        if fplan.wgrad and need_w2:
            dyq, sdy, dyamax = fp8.quantize_rowwise(dy, col_amax_offsets=offs, ends=ends)
        else:
            dyq, sdy = fp8.quantize_rowwise(dy)
    if need_w2:  # first, so that h is freed before dh exists
        hc = h_cols_of() if fplan.wgrad and h_cols_of is not None else None
        h = h_of() if hc is None else None
        if hc is not None:
            dw2 = _wgrad(hc, _cols(dy, offs, ends, dyamax), poffs, ends, w2)
            del hc
        elif fplan.wgrad:
            hc = _cols(h, offs, ends)
            del h
            dw2 = _wgrad(hc, _cols(dy, offs, ends, dyamax), poffs, ends, w2)
            del hc
        else:
            dw2 = gmm_wgrad(h, dy, offs, plan, like=w2)
            del h
    if need_dh:
        w2tq, s2t = _quant_b(w2.transpose(-2, -1))
        dh = _zero_tail(sgmm(dyq, w2tq, sdy, s2t, offs), end)
        del dyq, sdy, w2tq, s2t
        fused = glu_fp8(dh, fplan.wgrad and need_w13, need_w13) if glu_fp8 is not None and need_x else None
        dgamax = None
        if fused is not None:  # dx's operand (and dw13's amax) from the fused FP8 backward
            dgq, sdg, dweights, dgamax, dgate_up = fused
            del dh, fused
        else:
            dgate_up, dweights, db13 = glu_grad(dh)
            del dh
            if need_x:
                if fplan.wgrad and need_w13:
                    dgq, sdg, dgamax = fp8.quantize_rowwise(dgate_up, col_amax_offsets=offs, ends=ends)
                else:
                    dgq, sdg = fp8.quantize_rowwise(dgate_up)
        if need_x:
            w13tq, s13t = _quant_b(w13.transpose(-2, -1))
            dx = _zero_tail(sgmm(dgq, w13tq, sdg, s13t, offs), end)
            del dgq, sdg, w13tq, s13t
        if need_w13:
            if fplan.wgrad:
                dgc = _cols(dgate_up, offs, ends, dgamax)
                del dgate_up  # (its storage freed before the GEMM: gate_up's, when written in place)
                dw13 = _wgrad(_cols(x, offs, ends, xamax), dgc, poffs, ends, w13)
            else:
                dw13 = gmm_wgrad(x, dgate_up, offs, plan, like=w13)
    if dweights_b2 is not None:
        dweights = dweights_b2 if dweights is None else dweights.add_(dweights_b2)
    return dx, dw13, dw2, dweights, db13, db2


class Fp8ExpertMLP(torch.autograd.Function):
    """expert_mlp(fp8="rowwise"): keeps what recompute=True keeps (x, the weights,
    gate_up in bf16, and two small amax tables); w2's gradient operand is made from gate_up in
    backward."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, offs, plan, fplan, b13=None, b2=None):
        x, gate_up, y, xamax, hamax = forward(x, w13, w2, weights, offs, plan, fplan, b13, b2,
                                                       x_amax=ctx.needs_input_grad[1],
                                                       h_amax=ctx.needs_input_grad[2])
        # gate_up as an attribute, as keep() holds h: backward drops it after the activation's
        # backward, before the dx and dw13 operands exist (one [T, 2F] tensor less at the peak).
        hooked = hooks_active()
        keep(ctx, plan, (x, w13, w2, weights, offs, gate_up if hooked else None, b13, b2), None)
        ctx.gate_up = None if hooked else gate_up
        ctx.xamax = xamax  # x's per expert and column amax [E, D] (float32, small), or None
        ctx.hamax = hamax  # h's [E, F], or None
        ctx.fplan = fplan
        ctx.b13_index = 7
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, weights, offs, gate_up, b13, b2, _ = kept(ctx)
        held = {"gate_up": gate_up if gate_up is not None else ctx.gate_up}
        ctx.gate_up = gate_up = None
        if held["gate_up"] is None:  # taken by an earlier backward (retain_graph=True)
            raise RuntimeError("expertact.moe: expert_mlp(fp8='rowwise') frees gate_up during its backward, so its "
                               "graph runs backward once (a second backward, retain_graph=True, is not supported)")
        plan = ctx.plan
        n = ctx.needs_input_grad
        needs = (n[0], n[1], n[2], n[3], n[7], n[8])

        def glu_grad(dh):
            out = _bf16.glu_grad(ctx, dh, held["gate_up"], weights, b13, offs)
            held.clear()  # gate_up's last use (in place, dgate_up is its storage and lives on)
            return out

        def glu_fp8(dh, col_amax, keep_bf16):
            # The fused FP8 activation backward (in place over gate_up), where b13 needs no
            # gradient (the biased bf16 backward computes it).
            if b13 is not None and n[7]:
                return None
            out = glu_grad_fp8(dh, held["gate_up"], weights, weights is not None and n[3], b13, offs, plan.ends,
                               ctx.fplan, col_amax, keep_bf16)
            held.clear()
            return out

        grads = backward(
            needs, x, w13, w2, weights, offs, b2, dy, plan, ctx.fplan, glu_grad=glu_grad,
            h_of=lambda: activation(held["gate_up"], weights, plan.glu, b13, offs), gmm_wgrad=gmm_wgrad,
            xamax=ctx.xamax, glu_fp8=glu_fp8,
            h_cols_of=None if ctx.hamax is None else lambda: h_cols(
                held["gate_up"], weights, offs, plan.ends, ctx.fplan, ctx.hamax))
        dx, dw13, dw2, dweights, db13, db2 = grads
        return dx, dw13, dw2, dweights, None, None, None, db13, db2
