"""The FP8 node of expert_mlp (fp8= a recipe of expertact.moe.FP8_RECIPES): the grouped expert MLP
with its GEMMs in float8 e4m3fn (docs/spec.md section 10). One autograd node for every recipe:
the flow (what is kept, the order of the backward, what is freed when) is shared; what a recipe
changes is read from its form (_gemm.FP8_FORMS, through plan.form): the operand family, rowwise
or blockwise, each with its own operand step (the kernels that quantise) and GEMM layer
(_gemm.scaled_gmm, _gemm.blockwise_gmm: on Hopper the GPU's GEMMs, on the CPU their emulation);
whether the two weight gradients are FP8 GEMMs or bf16 ones; and, for rowwise FP8 weight
gradients, whether they take Hopper's fast accumulation or the FP32-promoted one.

    forward   gate_up = x_q  @ w13_q       rowwise: x per row, w13 per expert and column
              y       = h_q  @ w2_q        blockwise: x in 1 x 128 row tiles, w13 in 128 x 128
                                           blocks; h from the activation kernel (b13 inside), in
                                           e4m3 from its float32 values, rows or row tiles
    backward  dh      = dy_q @ w2^T_q      dy rows / row tiles; w2's blocks in the other
              dx      = dg_q @ w13^T_q     orientation (a block's scale is orientation-free)
              dw2     = h^T dy             the weight-gradient operands per expert over its rows:
              dw13    = x^T dgate_up       rowwise per column (padded to ROW_PAD rows), blockwise
                                           in 128 x 1 column tiles (padded to 128)

Rowwise: torchao's recipe, torch._scaled_grouped_mm with fast accumulation (in the weight
gradients too with "rowwise", promoted to FP32 there with "rowwise-promoted-wgrad", the weight
gradients in bf16 with "rowwise-bf16-wgrad"); x's and h's per expert and column amax are taken
in the forward's passes, so that backward reads x once and makes h's column operand from
gate_up in one pass. Blockwise: DeepSeek-V3's recipe, each 128-deep K tile promoted to float32;
its column tiles need no amax ahead (a tile's scale is its own), so backward makes h's column
tiles from gate_up (b13 inside), dy's row and column tiles from one read, and dgate_up's row and
column tiles (with the routing weights' gradient) in the activation's backward, with no bf16
dgate_up. Where a bf16 dgate_up is needed (b13's gradient, which the FP8 activation backwards
do not compute; bf16 weight gradients) the bf16 activation backward runs in the node's memory
mode and the operands are quantised from its output. The node keeps what ``recompute=True``
keeps (x, the weights, gate_up; no h) and drops gate_up after the activation's backward, so the
graph runs backward once. The kernels are _ops' (expertact.fp8 is their checked public form),
their outputs allocated by _fp8_buffers.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _fp8_buffers, _ops
from . import _gemm
from ._bf16 import activation, glu_grad, hooks_active, keep, kept, needs
from ._gemm import gmm_wgrad, held_transposed, zero_empty_groups

__all__ = ["Fp8ExpertMLP", "why_not", "forward", "ALIGN", "ROW_PAD", "TILE"]

Tensor = torch.Tensor

ALIGN = 16  # D and F: the FP8 GEMMs' K and N are multiples of it
# Rowwise: each expert's rows in the weight-gradient GEMMs' operands start at a multiple of
# ROW_PAD (a multiple of ALIGN; at most ROW_PAD - 1 zero rows an expert, which the GEMMs skip).
ROW_PAD = 32
TILE = _fp8_buffers.TILE  # blockwise: the tile edge, and each expert's row padding


def why_not(x: Tensor, D: int, F: int, recipe: str = "rowwise") -> Optional[str]:
    """Why the FP8 node of ``recipe`` (a name of _gemm.FP8_FORMS) cannot run on these operands, or
    None: Hopper (sm90) GPUs with the recipe's GEMMs, and the CPU (the emulation), with bfloat16
    operands and D and F multiples of 16 on both."""
    blockwise = _gemm.FP8_FORMS[recipe].blockwise
    if x.is_cuda:
        if blockwise:
            backend, why = _gemm.blockwise_backend(x.device)
            if backend is None:
                return why
        else:
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
        if blockwise:
            return (f"D = {D} and F = {F} must be multiples of {ALIGN}: the blockwise GEMMs' reductions (K = D, F, "
                    "2F) are read in 16-byte rows (TMA) and their outputs' rows (N = D, F, 2F) stored in 16-byte "
                    "units; torch._scaled_mm takes the same multiples of 16 (the 128-wide tiles need none: a "
                    "partial last tile takes what is there)")
        return f"D = {D} and F = {F} must be multiples of {ALIGN} (the FP8 GEMMs' K and N)"
    return None


# ---------------------------------------------------------------------------
# Operands: each recipe's quantisation step
# ---------------------------------------------------------------------------
# A token-major A operand is (q [T, C], scale, amax or None): rowwise scale [T] (amax: the per
# expert and column amax [E, C] of the same read, for the weight gradient's operand), blockwise
# scale [T, ceil(C / 128)] (1 x 128 row tiles, the view of [KB, T] storage). A weight's B
# operand is (q, scale) in its GEMM's form. A weight gradient's operand is (q, scale): rowwise
# q [Tp, C] column-major with scale [E, C]; blockwise q_t [C, Tp] (tokens contiguous) with
# scale [Tp / 128, C].


def _blocks(plan) -> bool:
    return plan.form.blockwise


def _tokens(t: Tensor, plan, offs: Optional[Tensor] = None):
    """t [T, C]'s token-major operand; rowwise with offs, also its per expert and column amax."""
    if _blocks(plan):
        q, store, scale = _fp8_buffers.row_tiles(t, t.shape[-1])
        _ops.fp8_quantize_row_tiles(t, q, store)
        return q, scale, None
    q, scale = _fp8_buffers.rowwise(t, t.shape[-1])
    amax = None if offs is None else _fp8_buffers.amax(len(plan.ends), t.shape[-1], t.device)
    _ops.fp8_quantize_rowwise(t, q, scale.view(-1), offs, amax)
    return q, scale, amax


def _weight(w_kn: Tensor, plan):
    """A GEMM's B operand from the weight w_kn [E, K, N]: rowwise (e4m3 [E, K, N] column-major,
    scale [E, N]: one scale per expert and output column, over K; one contiguous copy when the
    storage is not [E, N, K] already); blockwise (e4m3 [E, N, K], 128 x 128 block scales [E, NB,
    KB]), read in place in any strides."""
    w_nk = w_kn.transpose(-2, -1)
    if _blocks(plan):
        E, N, K = w_nk.shape
        q, scale = _fp8_buffers.blocks(E, N, K, w_nk.device)
        _ops.fp8_quantize_blocks(w_nk, q.view(E * N, K), scale.view(E * scale.shape[1], scale.shape[2]))
        return q, scale
    q, scale, _ = _tokens(w_nk.contiguous(), plan)
    return q.transpose(-2, -1), scale


def _mm(a, w, offs, plan) -> Tensor:
    """out[rows of e] = a[rows of e] @ w[e] in FP8 (an M-grouped GEMM): a from _tokens, w from
    _weight; rows past the last offset 0."""
    ends = plan.ends
    if _blocks(plan):
        return _gemm.blockwise_gmm(a[0], a[1], w[0], w[1], ends, "m")
    out = _gemm.scaled_gmm(a[0], w[0], a[1], w[1], offs)
    end = ends[-1] if ends else 0
    if end < out.shape[0]:
        out[end:].zero_()  # the operator leaves them unwritten
    return out


def _h(gate_up: Tensor, weights, b13, offs, plan, col_amax: bool):
    """h's token-major operand from the activation's float32 values (one rounding), b13 added
    inside; rowwise with col_amax, also h's per expert and column amax of the same pass."""
    F = gate_up.shape[1] // 2
    if _blocks(plan):
        q, store, scale = _fp8_buffers.row_tiles(gate_up, F)
        _ops.fp8_glu_row_tiles(gate_up, None, weights, b13, None if b13 is None else offs, q, store, *plan.glu)
        return q, scale, None
    q, scale = _fp8_buffers.rowwise(gate_up, F)
    amax = _fp8_buffers.amax(len(plan.ends), F, gate_up.device) if col_amax else None
    grouped = b13 is not None or col_amax
    _ops.fp8_glu_rowwise(gate_up, None, weights, b13, offs if grouped else None, q, scale.view(-1), amax, *plan.glu)
    return q, scale, amax


def _pads(offs, plan):
    """(the padded end rows on the device, as host ints) of the weight-gradient operands."""
    pad = TILE if _blocks(plan) else ROW_PAD
    return _fp8_buffers.padded_offsets(offs, pad), _fp8_buffers.padded_offsets(plan.ends, pad)


def _tiles(t: Tensor, offs, pads, plan, rows: bool):
    """Blockwise: (t's row tiles, dx's or dh's A operand, when ``rows``, else None; its column
    tiles, a weight gradient's operand), both from one read of t."""
    q_t, scale = _fp8_buffers.column_tiles(plan.ends, t.shape[1], t.device)
    if not rows:
        _ops.fp8_quantize_column_tiles_grouped(t, offs, pads[0], q_t, scale)
        return None, (q_t, scale)
    q, store, row_scale = _fp8_buffers.row_tiles(t, t.shape[1])
    _ops.fp8_quantize_column_tiles_grouped(t, offs, pads[0], q_t, scale, q, store)
    return (q, row_scale, None), (q_t, scale)


def _cols(t: Tensor, offs, pads, plan, amax=None):
    """t [T, C]'s operand of a weight-gradient GEMM (rows sorted by expert, each expert padded).
    Rowwise amax: t's per expert and column amax when a rowwise pass took it (t read once)."""
    if _blocks(plan):
        return _tiles(t, offs, pads, plan, False)[1]
    q_t, scale = _fp8_buffers.colwise(t.shape[0], plan.ends, t.shape[1], ROW_PAD, t.device)
    _ops.fp8_quantize_colwise_grouped(t, offs, pads[0], q_t, scale, amax)
    return q_t.t(), scale


def _dy(dy: Tensor, offs, pads, plan, need):
    """(dh's A operand or None, dw2's column operand or None) of dy, from one read of dy."""
    wgrad = plan.form.wgrad_fp8 and need.w2
    if _blocks(plan):
        if not wgrad:
            return (_tokens(dy, plan) if need.dh else None), None
        return _tiles(dy, offs, pads, plan, need.dh)
    dya = _tokens(dy, plan, offs if wgrad else None) if need.dh else None
    return dya, (_cols(dy, offs, pads, plan, dya[2] if need.dh else None) if wgrad else None)


def _h_cols(gate_up: Tensor, weights, b13, offs, pads, plan, hamax):
    """dw2's operand of h, made from gate_up in backward without writing h in bf16 (rowwise:
    from the amax the forward took; with b13, h recomputed in bf16 and then its column pass)."""
    F = gate_up.shape[1] // 2
    if _blocks(plan):
        q_t, scale = _fp8_buffers.column_tiles(plan.ends, F, gate_up.device)
        _ops.fp8_glu_column_tiles_grouped(gate_up, None, weights, b13, offs, pads[0], q_t, scale, *plan.glu)
        return q_t, scale
    if hamax is None:
        return _cols(activation(gate_up, weights, plan.glu, b13, offs), offs, pads, plan)
    q_t, scale = _fp8_buffers.colwise(gate_up.shape[0], plan.ends, F, ROW_PAD, gate_up.device)
    _ops.fp8_glu_colwise_grouped(gate_up, None, weights, None, offs, pads[0], q_t, scale, hamax, *plan.glu)
    return q_t.t(), scale


def _wgrad(a, b, pads, plan, like: Optional[Tensor]) -> Tensor:
    """out[e] = a[rows of e]^T @ b[rows of e] in FP8 (a K-grouped GEMM): [E, a cols, b cols],
    from the operands' column forms (_cols); laid out as ``like`` (a weight held as a transposed
    view gets its gradient in the weight's storage order); 0 for an expert without rows."""
    if _blocks(plan):
        return _gemm.blockwise_gmm(a[0], a[1], b[0], b[1], pads[1], "k", held_transposed(like))
    if held_transposed(like):
        return _wgrad(b, a, pads, plan, None).transpose(-2, -1)
    (aq, sa), (bq, sb) = a, b
    out = _gemm.scaled_gmm(aq.t(), bq, sa.reshape(-1), sb.reshape(-1), pads[0], fast_accum=plan.form.wgrad_fast_accum)
    return zero_empty_groups(out, plan.ends)


def _fused_backward(plan, need, b13) -> bool:
    """Whether dgate_up's operands come from the FP8 activation backward (from its float32
    values, no bf16 dgate_up in between): not where b13 wants its gradient (those kernels do
    not compute it); rowwise where dx is wanted (its kernel writes the bf16 dgate_up the
    column operand is quantised from, over gate_up); blockwise where the weight gradients are
    in FP8 (its kernel writes the column tiles too, and cannot write over gate_up)."""
    if b13 is not None and need.b13:
        return False
    return plan.form.wgrad_fp8 if _blocks(plan) else need.x


def _glu_backward(dh, gate_up, weights, b13, offs, pads, plan, need):
    """The fused FP8 activation backward (b13 added inside, its gradient not computed):
    (dx's operand, dw13's operand or None, the weights' gradient or None, a bf16 dgate_up or
    None). Rowwise: dx's operand with dgate_up's per expert and column amax, and the bf16
    dgate_up that dw13's operand is quantised from written over gate_up (its last use), when
    dw13 is wanted. Blockwise: the row tiles and, when dw13 is wanted, the column tiles."""
    E, C = len(plan.ends), gate_up.shape[-1]
    grad_w = weights is not None and need.weights
    if _blocks(plan):
        q, store, scale = _fp8_buffers.row_tiles(gate_up, C)
        dweights = torch.empty(gate_up.shape[:-1], dtype=torch.float32, device=dh.device) if grad_w else None
        q_t = col_scale = None
        if need.w13:
            q_t, col_scale = _fp8_buffers.column_tiles(plan.ends, C, dh.device)
        grouped = b13 is not None or q_t is not None
        _ops.fp8_glu_backward_tiles(dh, gate_up, weights, b13, offs if grouped else None,
                                    pads[0] if q_t is not None else None, q, store, q_t, col_scale, dweights, None,
                                    *plan.glu)
        return (q, scale, None), (None if q_t is None else (q_t, col_scale)), dweights, None
    q, scale = _fp8_buffers.rowwise(gate_up, C)
    dweights = torch.empty(scale.shape, dtype=torch.float32, device=dh.device) if grad_w else None
    amax = _fp8_buffers.amax(E, C, dh.device) if plan.form.wgrad_fp8 and need.w13 else None
    dgate_up = gate_up if need.w13 else None
    grouped = b13 is not None or amax is not None
    _ops.fp8_glu_backward_rowwise(dh, gate_up, weights, b13, offs if grouped else None, q, scale.view(-1),
                                  None if dweights is None else dweights.view(-1), amax, dgate_up, *plan.glu)
    return (q, scale, amax), None, dweights, dgate_up


def _dg(dgate_up: Tensor, offs, pads, plan, need):
    """(dx's operand or None, dw13's column operand or None) from the bf16 activation backward's
    dgate_up. Rowwise makes dw13's later, from dgate_up and the amax of dx's operand."""
    wgrad = plan.form.wgrad_fp8 and need.w13
    if _blocks(plan) and wgrad:
        return _tiles(dgate_up, offs, pads, plan, need.x)
    if not need.x:
        return None, None
    return _tokens(dgate_up, plan, offs if wgrad else None), None


# ---------------------------------------------------------------------------
# The node
# ---------------------------------------------------------------------------


def forward(x, w13, w2, weights, offs, plan, b13=None, b2=None, x_amax=False, h_amax=False):
    """(x as kept, gate_up, y, x's per expert and column amax or None, h's or None). Rowwise
    x_amax: take that amax in the pass over x, for dw13's operand in backward; h_amax: h's in
    the activation's pass, for dw2's (without b13 only: with it backward recomputes h)."""
    x = x.contiguous()
    xa = _tokens(x, plan, offs if x_amax else None)
    gate_up = _mm(xa, _weight(w13, plan), offs, plan)
    xamax = xa[2]
    del xa
    ha = _h(gate_up, weights, b13, offs, plan, h_amax)
    y = _mm(ha, _weight(w2, plan), offs, plan)
    if b2 is not None:
        _ops.expert_bias_forward(y, b2, offs, weights, inplace=True)
    return x, gate_up, y, xamax, ha[2]


class Fp8ExpertMLP(torch.autograd.Function):
    """expert_mlp(fp8=...): keeps what recompute=True keeps (x, the weights, gate_up in bf16; the
    rowwise recipe two small amax tables); w2's gradient operand is made from gate_up in
    backward, and gate_up is freed after the activation's backward, so the graph runs backward
    once."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, offs, plan, b13=None, b2=None):
        need = needs(ctx)
        amax = plan.form.wgrad_fp8 and not _blocks(plan)  # the rowwise column operands start from them
        x, gate_up, y, xamax, hamax = forward(x, w13, w2, weights, offs, plan, b13, b2,
                                              x_amax=need.w13 and amax, h_amax=need.w2 and amax and b13 is None)
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
        wgrad = plan.form.wgrad_fp8
        dy = dy.contiguous()
        dx = dw13 = dw2 = dweights = db13 = db2 = dweights_b2 = None
        if b2 is not None:  # one pass over dy: b2's gradient and its term of the weights' gradient
            db2, dweights_b2 = _ops.expert_bias_backward(dy, b2, offs, weights, weights is not None and need.weights,
                                                         need.b2)
        pads = _pads(offs, plan) if wgrad and (need.w2 or need.w13) else None
        dya, dyc = _dy(dy, offs, pads, plan, need)
        # w2's gradient first, so that h's operand is freed before dh exists.
        if need.w2 and not wgrad:
            dw2 = gmm_wgrad(activation(gate_up, weights, plan.glu, b13, offs), dy, offs, plan, like=w2)
        elif need.w2:
            dw2 = _wgrad(_h_cols(gate_up, weights, b13, offs, pads, plan, ctx.hamax), dyc, pads, plan, w2)
        del dyc
        if need.dh:
            dh = _mm(dya, _weight(w2.transpose(-2, -1), plan), offs, plan)
            del dya
            if _fused_backward(plan, need, b13):
                dga, dgc, dweights, dgate_up = _glu_backward(dh, gate_up, weights, b13, offs, pads, plan, need)
                del dh, gate_up  # gate_up's last use: freed here unless its storage holds dgate_up
            else:  # the bf16 activation's backward in the node's memory mode (b13's gradient fused)
                dgate_up, dweights, db13 = glu_grad(ctx, need, dh, gate_up, weights, b13, offs)
                del dh, gate_up
                dga, dgc = _dg(dgate_up, offs, pads, plan, need)
            if need.x:
                dx = _mm(dga, _weight(w13.transpose(-2, -1), plan), offs, plan)
            dgamax = None if dga is None else dga[2]
            del dga
            if need.w13 and wgrad:
                if dgc is None:  # rowwise: from the bf16 dgate_up, with the amax of dx's operand
                    dgc = _cols(dgate_up, offs, pads, plan, dgamax)
                del dgate_up  # (its storage freed before the GEMM: gate_up's, when written in place)
                dw13 = _wgrad(_cols(x, offs, pads, plan, ctx.xamax), dgc, pads, plan, w13)
            elif need.w13:
                dw13 = gmm_wgrad(x, dgate_up, offs, plan, like=w13)
        if dweights_b2 is not None:
            dweights = dweights_b2 if dweights is None else dweights.add_(dweights_b2)
        return dx, dw13, dw2, dweights, None, None, db13, db2
