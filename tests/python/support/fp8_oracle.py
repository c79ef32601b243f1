"""A float64 oracle of expert_mlp's FP8 recipes (docs/spec.md section 10), written apart from the
library in plain torch on fp8_tiles' quantisers: the whole expert MLP, forward and backward, with
every GEMM operand quantised as the recipe says and dequantised exactly, the GEMMs in float64,
and the activation and its gradient in float64 (oracle.glu64 and autograd).

It is the recipe's arithmetic with exact accumulation, so it also rounds where the recipe
stores a value: each GEMM writes bf16, the operands the recipe quantises from a bf16 tensor
(x, dy, h for w2's gradient, dgate_up where the bf16 activation backward made it) are that bf16
tensor, and those it quantises from the activation's float32 values (h for the down
projection, dgate_up where the FP8 activation backward made it) are quantised from them. The
FP8 activation backward makes dx's operand unless b13 takes a gradient (rowwise, blockwise) or
the weight gradients are in bf16 (blockwise), and dw13's operand too in the blockwise recipe
(rowwise quantises it from the bf16 dgate_up that kernel writes). The recipes by name differ in
their operands' tiles and in whether the weight gradients are FP8 GEMMs (RECIPES); the
accumulation is exact here, so "rowwise" and "rowwise-promoted-wgrad" have one oracle. A blockwise weight-gradient
scale is per tile of an expert's rows, the tiles starting at its first row: the oracle
quantises each expert's block apart, as the node's 128-padded layout does. An implementation
of the recipe then differs from it only where float32 accumulation moves a value across a
rounding boundary, while
anything else (a bf16 GEMM, another operand or scale, a wrong layout) differs by the FP8
rounding itself, a few percent.
"""
import torch

from .fp8_tiles import TILE, dequantize, quantize_tiles
from .oracle import glu64

# Each operand family's tiles (rows, cols; None: the whole dim), for the three kinds of operand:
#   rows     the token-major A operand of a forward or input-gradient GEMM, [T, K]
#   weights  one expert's B operand [K, N]
#   cols     one expert's operand of a weight-gradient GEMM, [its rows, C], K its rows
TILES = {
    "rowwise": dict(rows=(1, None), weights=(None, 1), cols=(None, 1)),
    "blockwise": dict(rows=(1, TILE), weights=(TILE, TILE), cols=(TILE, 1)),
}
# Each recipe of expertact.moe.FP8_RECIPES, as docs/spec.md section 10 describes it: (its
# operand family, whether its two weight-gradient GEMMs are FP8 GEMMs (else bf16 GEMMs on the
# bf16 tensors), whether those take the GPU's fast accumulation (rowwise; the oracle's
# accumulation is exact either way)).
RECIPES = {
    "rowwise": ("rowwise", True, True),
    "rowwise-bf16-wgrad": ("rowwise", False, False),
    "rowwise-promoted-wgrad": ("rowwise", True, False),
    "blockwise": ("blockwise", True, False),
}


def _q(t, tile):
    """t (any float dtype) quantised in tiles as the recipe says, dequantised exactly, float64.
    The tiles' scales come from t's float32 values, as the kernels take them."""
    q, scale = quantize_tiles(t, *tile)
    return dequantize(q, scale, *tile)


def _bf16(t):
    return t.to(torch.bfloat16).double()


def expert_mlp(x, w13, w2, ends, dy, activation="swiglu", *, layout="halves", alpha=1.702, limit=7.0,
               weights=None, b13=None, b2=None, recipe="rowwise", b13_grad=True):
    """y and the gradients of expert_mlp(x, w13, w2, offsets, activation, fp8=recipe) given dy:
    a dict with y, x, w13, w2, and weights, b13, b2 where given, float64 (every tensor the node
    writes in bf16 rounded to bf16; the routing weights' gradient float32's values unrounded).

    x [T, D], w13 [E, D, 2F], w2 [E, F, D], dy [T, D], b13 [E, 2F], b2 [E, D] as the node gets
    them (bf16), weights float32 [T]; ends: the experts' cumulative end rows (host ints); rows
    past ends[-1] give zero. recipe: a name of RECIPES. b13_grad: whether b13 wants its
    gradient (then the recipe quantises dgate_up's operands from the bf16 dgate_up of the biased
    backward, else from the activation backward's float32 values: module docstring)."""
    family, wgrad, _ = RECIPES[recipe]
    tiles = TILES[family]
    # dgate_up's FP8 operands from the bf16 activation backward's output (else from float32)
    bf16_dg = (b13_grad and b13 is not None) or (family == "blockwise" and not wgrad)
    T, D = x.shape
    E, F = w13.shape[0], w2.shape[1]
    X, DY = x.double(), dy.double()
    W = torch.ones(T, dtype=torch.float64) if weights is None else weights.double()
    xq, dyq = _q(x, tiles["rows"]), _q(dy, tiles["rows"])
    out = dict(y=torch.zeros(T, D, dtype=torch.float64), x=torch.zeros(T, D, dtype=torch.float64),
               w13=torch.zeros(w13.shape, dtype=torch.float64), w2=torch.zeros(w2.shape, dtype=torch.float64),
               weights=torch.zeros(T, dtype=torch.float64))
    if b13 is not None:
        out["b13"] = torch.zeros(b13.shape, dtype=torch.float64)
    if b2 is not None:
        out["b2"] = torch.zeros(b2.shape, dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        r = slice(start, end)
        start = end
        if r.start == r.stop:
            continue
        w = W[r, None]
        # forward
        gate_up = _bf16(xq[r] @ _q(w13[e], tiles["weights"]))
        z = (gate_up if b13 is None else gate_up + b13[e].double()).requires_grad_()
        a = glu64(z, layout, activation, alpha, limit)  # act(gate) * (up + beta)
        h = a * w
        y = _bf16(_q(h.detach(), tiles["rows"]) @ _q(w2[e], tiles["weights"]))
        if b2 is not None:
            y = _bf16(y + w * b2[e].double())
        out["y"][r] = y
        # backward
        dh = _bf16(dyq[r] @ _q(w2[e].t(), tiles["weights"]))
        (dz,) = torch.autograd.grad(h, z, dh)
        dgate_up = _bf16(dz)
        out["x"][r] = _bf16(_q(dgate_up if bf16_dg else dz, tiles["rows"]) @ _q(w13[e].t(), tiles["weights"]))
        hb = _bf16(h.detach())  # h as the bf16 forward writes it
        if wgrad:
            dg = dgate_up if bf16_dg or family == "rowwise" else dz
            out["w13"][e] = _bf16(_q(x[r], tiles["cols"]).t() @ _q(dg, tiles["cols"]))
            out["w2"][e] = _bf16(_q(hb, tiles["cols"]).t() @ _q(dy[r], tiles["cols"]))
        else:
            out["w13"][e] = _bf16(X[r].t() @ dgate_up)
            out["w2"][e] = _bf16(hb.t() @ DY[r])
        out["weights"][r] = (dh * a.detach()).sum(-1)
        if b2 is not None:
            out["weights"][r] += (DY[r] * b2[e].double()).sum(-1)
            out["b2"][e] = _bf16((DY[r] * w).sum(0))
        if b13 is not None:
            out["b13"][e] = _bf16(dz.sum(0))
    if weights is None:
        del out["weights"]
    return out


# ---------------------------------------------------------------------------
# Proof that the FP8 GEMMs ran
# ---------------------------------------------------------------------------

F8 = torch.float8_e4m3fn


def check_sm90_contract(a, b, scale_a, scale_b, offs):
    """torch._scaled_grouped_mm's operand contract on sm90, as the FP8 node must meet it on every
    device (the CPU emulation would take more): e4m3 operands, A row-major and B column-major,
    float32 contiguous scales of the form's shapes, int32 offsets, K and N multiples of 16, and
    in the 2-D x 2-D form (the weight gradients) groups of a multiple of 16 along K."""
    assert a.dtype == F8 and b.dtype == F8, (a.dtype, b.dtype)
    assert a.stride(-1) == 1 and a.stride(-2) >= max(1, a.shape[-1]), f"A must be row-major, strides {a.stride()}"
    assert b.stride(-2) == 1 and b.stride(-1) >= max(1, b.shape[-2]), f"B must be column-major, strides {b.stride()}"
    assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    assert offs.dtype == torch.int32 and offs.dim() == 1
    ends = offs.tolist()
    if b.dim() == 3:
        assert a.shape[1] == b.shape[1] and a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0, (a.shape, b.shape)
        assert len(ends) == b.shape[0] and (not ends or ends[-1] <= a.shape[0])
        assert tuple(scale_a.shape) == (a.shape[0],) and tuple(scale_b.shape) == (b.shape[0], b.shape[2])
        return "mm"
    M, N, E = a.shape[0], b.shape[1], len(ends)
    assert a.shape[1] == b.shape[0] and M % 16 == 0 and N % 16 == 0, (a.shape, b.shape)
    assert tuple(scale_a.shape) == (M * E,) and tuple(scale_b.shape) == (N * E,)
    start = 0
    for e, end in enumerate(ends):
        assert (end - start) % 16 == 0, f"group {e} has {end - start} rows: the device asserts"
        start = end
    return "wgrad"


def check_blockwise_contract(a, scale_a, b, scale_b, ends, grouping, out_transposed):
    """The operand contract of the blockwise recipe's grouped GEMM (torch._scaled_mm per expert
    with the same scales on Hopper, the emulation on the CPU), as the FP8 node must meet it on
    every device: e4m3 operands with contiguous rows, float32 scales in the
    tile layouts, the experts' ends as host ints, K and N multiples of 16; the
    M-grouped form with 1 x 128 row tiles ([T, KB], the view of [KB, T] storage) and 128 x 128
    weight blocks, the K-grouped form with 128 x 1 column tiles over 128-padded experts."""
    assert a.dtype == F8 and b.dtype == F8, (a.dtype, b.dtype)
    assert scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    assert all(isinstance(end, int) for end in ends), ends
    kb = lambda n: -(-n // TILE)  # noqa: E731
    if grouping == "m":
        (T, K), (E, N, Kb) = a.shape, b.shape
        assert K == Kb and K % 16 == 0 and N % 16 == 0, (a.shape, b.shape)
        assert a.is_contiguous() and b.stride(-1) == 1 and b.stride(-2) >= K, (a.stride(), b.stride())
        assert tuple(scale_a.shape) == (T, kb(K)) and scale_a.t().is_contiguous(), (scale_a.shape, scale_a.stride())
        assert tuple(scale_b.shape) == (E, kb(N), kb(K)) and scale_b.is_contiguous(), scale_b.shape
        assert len(ends) == E and (not ends or ends[-1] <= T) and not out_transposed
        return "mm"
    assert grouping == "k", grouping
    (M, Tp), (N, Tpb) = a.shape, b.shape
    assert Tp == Tpb and Tp % TILE == 0 and M % 16 == 0 and N % 16 == 0, (a.shape, b.shape)
    assert a.is_contiguous() and b.is_contiguous()
    assert tuple(scale_a.shape) == (Tp // TILE, M) and tuple(scale_b.shape) == (Tp // TILE, N)
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    prev = 0
    for e, end in enumerate(ends):
        assert end % TILE == 0 and end >= prev, f"expert {e}'s tokens end at {end} (after {prev})"
        prev = end
    assert prev == Tp, (ends, Tp)
    return "wgrad"


class ScaledGemmLog:
    """``with ScaledGemmLog() as log: ...``: counts the FP8 GEMMs that run through
    expertact.moe._gemm's scaled_gmm and blockwise_gmm (the one layer under the FP8 node's GEMMs:
    the GPU's GEMMs on Hopper, their emulation on the CPU), checking each call against its
    contract (check_sm90_contract, check_blockwise_contract). log.mm: the M-grouped calls
    (forward and input gradients), log.wgrad: the weight-gradient ones; log.blockwise: how many
    of them were the blockwise recipe's; log.promoted: {"mm": n, "wgrad": n}, the rowwise calls
    (scaled_gmm) of each form made with fast accumulation off (FP32-promoted on Hopper)."""

    def __enter__(self):
        from expertact.moe import _gemm
        self._gemm, self._real, self._real_blockwise = _gemm, _gemm.scaled_gmm, _gemm.blockwise_gmm
        self.mm = self.wgrad = self.blockwise = 0
        self.promoted = {"mm": 0, "wgrad": 0}

        def logged(a, b, scale_a, scale_b, offs, fast_accum=True):
            form = check_sm90_contract(a, b, scale_a, scale_b, offs)
            assert isinstance(fast_accum, bool), fast_accum
            setattr(self, form, getattr(self, form) + 1)
            self.promoted[form] += not fast_accum
            return self._real(a, b, scale_a, scale_b, offs, fast_accum)

        def logged_blockwise(a, scale_a, b, scale_b, ends, grouping="m", out_transposed=False):
            form = check_blockwise_contract(a, scale_a, b, scale_b, ends, grouping, out_transposed)
            setattr(self, form, getattr(self, form) + 1)
            self.blockwise += 1
            return self._real_blockwise(a, scale_a, b, scale_b, ends, grouping, out_transposed)

        _gemm.scaled_gmm, _gemm.blockwise_gmm = logged, logged_blockwise
        return self

    def __exit__(self, *exc):
        self._gemm.scaled_gmm, self._gemm.blockwise_gmm = self._real, self._real_blockwise

    @property
    def calls(self):
        return self.mm + self.wgrad

    def check(self, recipe, mm=4, wgrad=2):
        """The FP8 GEMMs logged are the recipe's (RECIPES): mm M-grouped and wgrad K-grouped calls
        (no K-grouped one where its weight gradients are bf16), all through the recipe's layer,
        its rowwise weight gradients' with fast accumulation off where it says so and every
        other rowwise call with it on."""
        family, fp8_weight_grads, fast = RECIPES[recipe]
        wgrad = wgrad if fp8_weight_grads else 0
        assert (self.mm, self.wgrad) == (mm, wgrad), (recipe, self.mm, self.wgrad)
        assert self.blockwise == (mm + wgrad if family == "blockwise" else 0), (recipe, self.blockwise)
        promoted = wgrad if family == "rowwise" and not fast else 0
        assert self.promoted == {"mm": 0, "wgrad": promoted}, (recipe, self.promoted)


def rel(a, b):
    """||a - b|| / ||b|| in float64 (on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
