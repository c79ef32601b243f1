"""The accuracy of each FP8 GEMM of the expert MLP: the six GEMMs (forward gate_up and y; backward
dh, dx, dw2, dw13) computed with each recipe's operands as expertact makes them, against float64
on the same unquantised bf16 inputs and against float64 on the dequantised operands.

    python -m expertact.bench --fp8-accuracy --tensors OUT/h200-eager.capture.pt   # a training run's tensors
    python -m expertact.bench --fp8-accuracy                        # synthetic, the busiest rank's shape
    python -m expertact.bench --fp8-accuracy --scales-from OUT/h200-eager.capture.pt   # ... with its column scales
    python -m expertact.bench --fp8-accuracy --device cpu --experts 3 --rows 200 --dim 128 --ffn 128

Inputs: x, dy, w13 [E, D, 2F], w2 [E, F, D] and the offsets, either captured from a training run
(examples/autoep_train.py --capture-step N) or drawn at the busiest rank's shape (4 experts x
261,280 rows, D = F = 3,072; with --scales-from, each column of x and dy scaled by a column's RMS
of the captured file, drawn at random, and the weights by its weights' RMS). The other GEMM inputs
are the bf16 MLP's: gate_up = x @ w13 (bf16 grouped GEMM), h = act(gate_up), dh = dy @ w2^T,
dgate_up = act'(gate_up) dh, each rounded to bf16. The weight gradients are computed as expert_mlp
computes them for weights held as [E, N, K] (DeepSpeed's, TorchTitan's, transformers' storage):
dw2^T = dy^T h, dw13^T = dgate_up^T x.

Recipes (rows):
  rowwise                    expert_mlp(fp8="rowwise")'s GEMMs: torch._scaled_grouped_mm with
                             use_fast_accum=True on Hopper; on the CPU its emulation (operands
                             dequantised exactly, float32 matmul)
  rowwise-no-fast-accum      the same call with use_fast_accum=False (CUDA; its refusal is recorded)
  rowwise-mm-fast-accum      torch._scaled_mm per expert on the same operands, use_fast_accum=True
  rowwise-mm-no-fast-accum   ... use_fast_accum=False (CUDA)
  rowwise-emulated           the same operands dequantised, float32 matmul on the device (TF32 off):
                             the CPU emulation's arithmetic on the GPU (CUDA; on the CPU = rowwise)
  rowwise-bf16-wgrad         expert_mlp(fp8="rowwise-bf16-wgrad"): dw2 and dw13 as expert_mlp's bf16
                             GEMMs (the other four GEMMs are rowwise's and are not repeated)
  rowwise-promoted-wgrad     expert_mlp(fp8="rowwise-promoted-wgrad"): dw2 and
                             dw13 through the node's GEMM layer with fast accumulation off (on CUDA
                             the call of rowwise-no-fast-accum, whose output it shares when both
                             rows run; on the CPU the emulation, = rowwise); the other four are
                             rowwise's
  blockwise                  DeepSeek-V3's 1x128 / 128x128 operands (expertact.fp8's tile quantisers) and
                             GEMMs as expert_mlp(fp8="blockwise") runs them: expertact's grouped GEMM with
                             FP32-promoted accumulation on Hopper (torch._scaled_mm per expert with the
                             same scales where the build lacks it), its emulation on the CPU; where
                             neither runs, the reason is the row's

Columns per GEMM: err = ||y - ref|| / ||ref||, bias = sum((y - ref) * ref) / sum(ref^2) (signed:
the share of ref the output gains or loses along itself), against ref64 (float64 on the bf16
inputs) and against deq64 (float64 on the dequantised FP8 operands: what is left is the GEMM's own
arithmetic, accumulation and output rounding); vs bf16(deq64): the error against deq64 rounded once
to bf16, the GEMM's arithmetic beyond its output's rounding (an exact accumulation leaves only the
rare rounding flips); quant = ||deq64 - ref64|| / ||ref64||, the operands' quantisation alone.
The four row-split GEMMs are compared on --sample-rows rows per expert (every row's output
depends on that row alone; the GEMM runs on all rows); the weight gradients on their whole
output, reduced over every row in float64.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import expertact
from expertact import fp8 as xfp8
from expertact.moe import _fp8, _gemm

from .common import OOM, device_name, log, parse_list, resolve_device, versions, write_outputs

BUSIEST = dict(experts=4, rows=261_280, dim=3072, ffn=3072)
CPU_DEFAULT = dict(experts=3, rows=256, dim=128, ffn=128)
GEMMS = ("gate_up", "y", "dh", "dx", "dw2", "dw13")
RECIPES = ("rowwise", "rowwise-no-fast-accum", "rowwise-mm-fast-accum", "rowwise-mm-no-fast-accum",
           "rowwise-emulated", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise")
WGRAD_ONLY = ("rowwise-bf16-wgrad", "rowwise-promoted-wgrad")  # their other four GEMMs are rowwise's
CUDA_ONLY = {"rowwise-no-fast-accum", "rowwise-mm-fast-accum", "rowwise-mm-no-fast-accum", "rowwise-emulated"}
WGRADS = ("dw2", "dw13")
TILE = 128
CHUNK = 16384  # rows of a float64 reference block


# ---------------------------------------------------------------------------
# Inputs and the bf16 chain
# ---------------------------------------------------------------------------


class Problem:
    """The expert MLP's inputs (bf16, on the device) and the bf16 chain of the other GEMM inputs.
    Rows past the last offset contribute nothing to any GEMM and are dropped."""

    def __init__(self, x, dy, w13, w2, offsets, activation, alpha, limit, source):
        ends = [int(v) for v in offsets.tolist()]
        end = ends[-1] if ends else 0
        self.x, self.dy = x[:end].contiguous(), dy[:end].contiguous()
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()
        self.offsets = torch.tensor(ends, dtype=torch.int32, device=x.device)
        self.ends, self.starts = ends, [0] + ends[:-1]
        self.act = dict(alpha=alpha, limit=limit) if activation == "swiglu_oai" else (
            dict(limit=limit) if activation == "swiglu_clamped" else {})
        self.activation, self.source = activation, source
        self.E, (self.D, f2) = len(ends), self.w13.shape[1:]
        self.F, self.T = f2 // 2, end

    def chain(self):
        """gate_up, h, dh, dgate_up in bf16 as the bf16 expert MLP makes them."""
        plan = _gemm.Plan(self.ends, _gemm.use_grouped_mm(self.x, self.D, self.F), None, False, False)
        self.gate_up = _gemm.gmm(self.x, self.w13, self.offsets, plan)
        gu = self.gate_up.detach().requires_grad_()
        h = getattr(expertact, self.activation)(gu, layout="halves", **self.act)
        self.h = h.detach()
        self.dh = _gemm.gmm(self.dy, self.w2.transpose(-2, -1), self.offsets, plan)
        h.backward(self.dh)
        self.dg = gu.grad
        self.plan = plan

    def describe(self):
        return dict(source=self.source, experts=self.E, tokens=self.T, dim=self.D, ffn=self.F,
                    rows_per_expert=[b - a for a, b in zip(self.starts, self.ends)], activation=self.activation,
                    **self.act)


def load_capture(path, device):
    """The tensors examples/autoep_train.py --capture-step wrote: a Problem in bf16."""
    c = torch.load(path, map_location="cpu", weights_only=False)
    if c.get("layout", "halves") != "halves" or c.get("weights") is not None:
        raise SystemExit(f"{path}: layout {c.get('layout')!r} with weights {c.get('weights') is not None}: this mode "
                         "reads the halves layout without routing weights")
    bf = dict(dtype=torch.bfloat16, device=device)
    a = c["activation"]
    return Problem(c["x"].to(**bf), c["dy"].to(**bf), c["w13"].to(**bf), c["w2"].to(**bf), c["offsets"].to(device),
                   a["name"], a["alpha"], a["limit"], f"{path} ({c.get('tag')}, step {c.get('step')})")


def column_rms(path):
    """(x's, dy's column RMS, w13's RMS, w2's RMS) of a captured file: the scales of --scales-from."""
    c = torch.load(path, map_location="cpu", weights_only=False)
    rows = int(c["offsets"][-1])
    rms = [c[k][:rows].float().pow(2).mean(0).sqrt() for k in ("x", "dy")]
    return rms + [float(c[k].float().pow(2).mean().sqrt()) for k in ("w13", "w2")]


def synthetic(E, rows, D, F, device, seed, scales_from=None):
    """Normal inputs at this shape: x and dy unit columns, the weights of std 0.02 (transformers'
    initialiser), or each scaled as scales_from's (a column's RMS drawn at random per column)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu = torch.Generator().manual_seed(seed)
    sx = sdy = torch.ones(D)
    s13 = s2 = 0.02
    source = f"synthetic normal, seed {seed}"
    if scales_from:
        rx, rdy, s13, s2 = column_rms(scales_from)
        sx, sdy = rx[torch.randint(0, rx.numel(), (D,), generator=cpu)], rdy[torch.randint(0, rdy.numel(), (D,),
                                                                                           generator=cpu)]
        source += f", column scales of {scales_from}"

    def normal(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(generator=gen)

    T = E * rows
    x = normal(T, D).mul_(sx.to(device, torch.bfloat16))
    dy = normal(T, D).mul_(sdy.to(device, torch.bfloat16))
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * rows
    return Problem(x, dy, normal(E, D, 2 * F).mul_(s13), normal(E, F, D).mul_(s2), offsets, "swiglu_oai", 1.702, 7.0,
                   source)


# ---------------------------------------------------------------------------
# Operands: (bf16 tensor, its FP8 form, how to dequantise it)
# ---------------------------------------------------------------------------
# A row-split GEMM (out[rows of e] = a[rows of e] @ b[e]) takes a token-major A [T, K] and a
# weight B held [E, N, K]; a weight gradient (out[e] = a_e^T b_e, K = the expert's rows) takes two
# token-major operands quantised per expert over their rows, in the rows' padded layout.


def _expand(s, rows, cols):
    """A tile scale [RB, CB] -> [rows, cols] (each value over its 128 x 128 tile)."""
    return s.repeat_interleave(TILE, 0)[:rows].repeat_interleave(TILE, 1)[:, :cols]


class Tokens:
    """A token-major A operand [T, K]: q e4m3 and its scale, rowwise ([T]) or 1 x 128 tiles ([T, KB])."""

    def __init__(self, q, scale):
        self.q, self.scale = q, scale

    def deq(self, idx):
        s = self.scale[idx]
        s = s[:, None] if s.dim() == 1 else s.repeat_interleave(TILE, 1)[:, :self.q.shape[1]]
        return self.q[idx].double() * s.double()


class Weight:
    """A B operand held [E, N, K] (q e4m3) with its scale per expert and column [E, N] or 128 x 128
    blocks [E, NB, KB]; deq(e) -> [K, N] float64."""

    def __init__(self, q, scale):
        self.q, self.scale = q, scale

    def deq(self, e):
        q, s = self.q[e].double(), self.scale[e].double()
        s = s[:, None] if s.dim() == 1 else _expand(s, *q.shape)
        return (q * s).t()


class Columns:
    """A weight gradient's operand: q [Tp, C] (each expert's rows from pstarts[e], padded), its
    scale per expert and column [E, C] (per_expert) or per 128-row tile and column [Tp / 128, C];
    deq(e, r0, r1) -> rows r0..r1 of expert e, [r1 - r0, C] float64."""

    def __init__(self, q, scale, pstarts, per_expert):
        self.q, self.scale, self.pstarts, self.per_expert = q, scale, pstarts, per_expert

    def deq(self, e, r0, r1):
        p0 = self.pstarts[e]
        q = self.q[p0 + r0:p0 + r1].double()
        if self.per_expert:
            return q * self.scale[e].double()
        return q * self.scale[torch.arange(p0 + r0, p0 + r1, device=q.device) // TILE].double()


def rowwise_operands(p: Problem, gemm: str):
    """The rowwise recipe's FP8 operands of one GEMM, made by expertact's kernels as the FP8 node
    makes them: (A, B) for a row-split GEMM, (A, B) Columns for a weight gradient."""
    kw = dict(layout="halves", **p.act)
    if gemm in WGRADS:
        pad = _fp8.ROW_PAD
        pstarts = [0] + xfp8.padded_offsets(p.ends, pad)[:-1]
        if gemm == "dw2":  # dw2^T = dy^T h
            a = xfp8.quantize_colwise_grouped(p.dy, p.offsets, pad_to=pad, ends=p.ends)
            b = xfp8.glu_colwise_grouped(p.gate_up, p.activation, p.offsets, pad_to=pad, ends=p.ends, **kw)
        else:  # dw13^T = dgate_up^T x
            a = xfp8.quantize_colwise_grouped(p.dg, p.offsets, pad_to=pad, ends=p.ends)
            b = xfp8.quantize_colwise_grouped(p.x, p.offsets, pad_to=pad, ends=p.ends)
        return tuple(Columns(q, s, pstarts, True) for q, s in (a, b))
    if gemm == "gate_up":
        a, w = xfp8.quantize_rowwise(p.x), p.w13
    elif gemm == "y":
        a, w = xfp8.glu_rowwise(p.gate_up, p.activation, **kw), p.w2
    elif gemm == "dh":
        a, w = xfp8.quantize_rowwise(p.dy), p.w2.transpose(-2, -1)
    else:
        a = xfp8.glu_backward_rowwise(p.dh, p.gate_up, p.activation, **kw)[:2]
        w = p.w13.transpose(-2, -1)
    # the weight [E, K, N] quantised per expert and output column over K, as _fp8._weight does
    return Tokens(*a), Weight(*xfp8.quantize_rowwise(w.transpose(-2, -1).contiguous()))


def has_blockwise(device) -> str:
    """Why the blockwise recipe's row cannot run here, or '' when it can (the GEMM layer expert_mlp
    uses says which of its GEMMs runs on this device, or why none)."""
    backend, why = _gemm.blockwise_backend(device)
    return "" if backend is not None else f"n/a: {why}"


def blockwise_operands(p: Problem, gemm: str):
    """The blockwise recipe's operands (docs/notes/fp8-recipes.md): 1 x 128 row tiles, 128 x 128
    weight blocks, 128 x 1 column tiles over each expert's rows padded to 128."""
    kw = dict(layout="halves", **p.act)
    if gemm in WGRADS:
        pstarts = [0] + xfp8.padded_offsets(p.ends, TILE)[:-1]
        if gemm == "dw2":
            a = xfp8.quantize_column_tiles_grouped(p.dy, p.offsets, ends=p.ends)
            b = xfp8.glu_column_tiles_grouped(p.gate_up, p.activation, p.offsets, ends=p.ends, **kw)
        else:
            out = xfp8.glu_backward_tiles(p.dh, p.gate_up, p.activation, offsets=p.offsets, ends=p.ends,
                                          column_tiles=True, **kw)
            a, b = out[2:4], xfp8.quantize_column_tiles_grouped(p.x, p.offsets, ends=p.ends)
        return tuple(Columns(q, s, pstarts, False) for q, s in (a, b))
    if gemm == "gate_up":
        a, w = xfp8.quantize_row_tiles(p.x), p.w13
    elif gemm == "y":
        a, w = xfp8.glu_row_tiles(p.gate_up, p.activation, **kw), p.w2
    elif gemm == "dh":
        a, w = xfp8.quantize_row_tiles(p.dy), p.w2.transpose(-2, -1)
    else:
        a, w = xfp8.glu_backward_tiles(p.dh, p.gate_up, p.activation, **kw)[:2], p.w13.transpose(-2, -1)
    return Tokens(*a), Weight(*xfp8.quantize_blocks(w.transpose(-2, -1)))


# ---------------------------------------------------------------------------
# The GEMMs of each recipe
# ---------------------------------------------------------------------------


def _emulated_rows(p, A, B):
    """out[rows of e] = deq(A) @ deq(B[e]) in float32 (TF32 off), rounded once to bf16."""
    out = torch.empty((p.T, B.q.shape[1]), dtype=torch.bfloat16, device=A.q.device)
    for e, (s, t) in enumerate(zip(p.starts, p.ends)):
        for r in range(s, t, CHUNK * 4):
            idx = torch.arange(r, min(t, r + CHUNK * 4), device=A.q.device)
            out[idx] = (A.deq(idx).float() @ B.deq(e).float()).to(torch.bfloat16)
    return out


def _emulated_wgrad(p, A, B):
    out = torch.zeros((p.E, A.q.shape[1], B.q.shape[1]), dtype=torch.float32, device=A.q.device)
    for e, (s, t) in enumerate(zip(p.starts, p.ends)):
        for r in range(0, t - s, CHUNK * 4):
            r1 = min(t - s, r + CHUNK * 4)
            out[e] += A.deq(e, r, r1).float().t() @ B.deq(e, r, r1).float()
    return out.to(torch.bfloat16)


def run_gemm(recipe, p, gemm, A, B):
    """The recipe's output of one GEMM: [T, N] for a row-split GEMM, [E, M, N] for a weight gradient."""
    cuda = p.x.is_cuda
    wgrad = gemm in WGRADS
    if recipe == "rowwise-bf16-wgrad":  # expert_mlp's bf16 weight gradient, held-transposed order
        a, b = (p.dy, p.h) if gemm == "dw2" else (p.dg, p.x)
        return _gemm.gmm_wgrad(a, b, p.offsets, p.plan)
    if recipe == "rowwise-promoted-wgrad":  # the node's call of its weight gradients, on this device
        poffs = xfp8.padded_offsets(p.offsets, _fp8.ROW_PAD)
        return _gemm.scaled_gmm(A.q.t(), B.q, A.scale.reshape(-1), B.scale.reshape(-1), poffs, fast_accum=False)
    if recipe == "blockwise":  # expert_mlp(fp8="blockwise")'s GEMM layer, on this device
        if wgrad:
            pends = xfp8.padded_offsets(p.ends, TILE)
            return _gemm.blockwise_gmm(A.q.t(), A.scale, B.q.t(), B.scale, pends, "k")
        return _gemm.blockwise_gmm(A.q, A.scale, B.q, B.scale, p.ends, "m")
    if not cuda or recipe == "rowwise-emulated":
        if cuda:
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                return _emulated_wgrad(p, A, B) if wgrad else _emulated_rows(p, A, B)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
        if wgrad:  # the node's call on the CPU: the emulation in _gemm.scaled_gmm
            poffs = xfp8.padded_offsets(p.offsets, _fp8.ROW_PAD)
            return _gemm.scaled_gmm(A.q.t(), B.q, A.scale.reshape(-1), B.scale.reshape(-1), poffs)
        return _gemm.scaled_gmm(A.q, B.q.transpose(-2, -1), A.scale, B.scale, p.offsets)
    fast = "no-fast" not in recipe
    if recipe in ("rowwise", "rowwise-no-fast-accum"):
        if wgrad:
            poffs = xfp8.padded_offsets(p.offsets, _fp8.ROW_PAD)
            return torch._scaled_grouped_mm(A.q.t(), B.q, A.scale.reshape(-1), B.scale.reshape(-1), offs=poffs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
        return torch._scaled_grouped_mm(A.q, B.q.transpose(-2, -1), A.scale, B.scale, offs=p.offsets,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
    # torch._scaled_mm per expert, rowwise scales ([M, 1] and [1, N])
    if wgrad:
        out = torch.zeros((p.E, A.q.shape[1], B.q.shape[1]), dtype=torch.bfloat16, device=A.q.device)
        poffs = xfp8.padded_offsets(p.ends, _fp8.ROW_PAD)
        for e, (s, t) in enumerate(zip(A.pstarts, poffs)):
            if t > s:
                out[e] = torch._scaled_mm(A.q[s:t].t(), B.q[s:t], scale_a=A.scale[e][:, None],
                                          scale_b=B.scale[e][None, :], out_dtype=torch.bfloat16, use_fast_accum=fast)
        return out
    out = torch.empty((p.T, B.q.shape[1]), dtype=torch.bfloat16, device=A.q.device)
    for e, (s, t) in enumerate(zip(p.starts, p.ends)):
        if t > s:
            out[s:t] = torch._scaled_mm(A.q[s:t], B.q[e].t(), scale_a=A.scale[s:t, None],
                                        scale_b=B.scale[e][None, :], out_dtype=torch.bfloat16, use_fast_accum=fast)
    return out


# ---------------------------------------------------------------------------
# Errors against float64
# ---------------------------------------------------------------------------


class Sums:
    """sum(ref^2), sum((y - ref)^2), sum((y - ref) * ref), accumulated in float64."""

    def __init__(self):
        self.rr = self.dd = self.dr = 0.0

    def add(self, y, ref):
        d = y - ref
        self.rr += float((ref * ref).sum())
        self.dd += float((d * d).sum())
        self.dr += float((d * ref).sum())

    def result(self):
        if self.rr == 0.0:
            return dict(err=None, bias=None)
        return dict(err=(self.dd / self.rr) ** 0.5, bias=self.dr / self.rr)


def sample_rows(p, n, device):
    """Per expert (each in its place, an empty one too), up to n of its rows evenly spaced (all of
    them when it has n or fewer)."""
    return [torch.linspace(s, t - 1, min(n, t - s), device=device).round().long().unique() for s, t in
            zip(p.starts, p.ends)]


def bf16_inputs(p, gemm):
    """(A, B) of a GEMM as the bf16 MLP has them: row-split A [T, K] with B [E, K, N]; weight
    gradients (a, b) token-major, out[e] = a_e^T b_e."""
    return {"gate_up": (p.x, p.w13), "y": (p.h, p.w2), "dh": (p.dy, p.w2.transpose(-2, -1)),
            "dx": (p.dg, p.w13.transpose(-2, -1)), "dw2": (p.dy, p.h), "dw13": (p.dg, p.x)}[gemm]


def compare(p, gemm, outputs, A, B, sample):
    """Per recipe of `outputs` (name -> output: a weight gradient [E, M, N], or a row-split GEMM's
    sampled rows, torch.cat(sample)'s), its err and bias against ref64 and deq64, and the
    quantisation's own err (deq64 against ref64) of the operands A, B (shared by these recipes)."""
    a16, b16 = bf16_inputs(p, gemm)
    vs64, vsq, vsr = ({n: Sums() for n in outputs} for _ in range(3))
    quant = Sums()

    def add(n, y, ref, deq):
        vs64[n].add(y, ref)
        if deq is not None:
            vsq[n].add(y, deq)
            vsr[n].add(y, deq.to(torch.bfloat16).double())
    if gemm not in WGRADS:
        pos = 0
        for e, idx in enumerate(sample):
            ref = a16[idx].double() @ b16[e].double()
            deq = A.deq(idx) @ B.deq(e) if A is not None else None
            for n, y in outputs.items():
                add(n, y[pos:pos + idx.numel()].double(), ref, deq)
            pos += idx.numel()
            if deq is not None:
                quant.add(deq, ref)
    else:
        for e, (s, t) in enumerate(zip(p.starts, p.ends)):
            if t == s:
                continue
            ref = torch.zeros((a16.shape[1], b16.shape[1]), dtype=torch.float64, device=a16.device)
            deq = torch.zeros_like(ref) if A is not None else None
            for r in range(0, t - s, CHUNK):
                r1 = min(t - s, r + CHUNK)
                ref += a16[s + r:s + r1].double().t() @ b16[s + r:s + r1].double()
                if deq is not None:
                    deq += A.deq(e, r, r1).t() @ B.deq(e, r, r1)
            for n, y in outputs.items():
                add(n, y[e].double(), ref, deq)
            if deq is not None:
                quant.add(deq, ref)
    q = quant.result()["err"]
    return {n: dict(ref64=vs64[n].result(), deq64=vsq[n].result() if A is not None else None,
                    beyond_rounding=vsr[n].result()["err"] if A is not None else None, quant=q) for n in outputs}


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


def measure(p, recipes, sample_n, device):
    """Every (recipe, GEMM) row: its errors, or why it has none."""
    rows = {(r, g): dict(recipe=r, gemm=g) for r in recipes for g in GEMMS}
    blockwise_why = has_blockwise(device) if "blockwise" in recipes else ""
    for r in recipes:
        for g in GEMMS:
            row = rows[(r, g)]
            if r in CUDA_ONLY and device.type != "cuda":
                row["na"] = "= rowwise on the CPU (the emulation)" if r == "rowwise-emulated" else "n/a on CPU"
            elif r in WGRAD_ONLY and g not in WGRADS:
                row["na"] = "as rowwise"
            elif r == "blockwise" and blockwise_why:
                row["na"] = blockwise_why
    sample = sample_rows(p, sample_n, device)
    flat = torch.cat(sample) if sample else torch.zeros(0, dtype=torch.long, device=device)
    for g in GEMMS:
        t0 = time.time()
        for family, make in (("rowwise", rowwise_operands), ("blockwise", blockwise_operands)):
            names = [r for r in recipes if (r == "blockwise") == (family == "blockwise") and "na" not in rows[(r, g)]]
            if not names:
                continue
            try:
                A, B = make(p, g)
            except OOM:
                for n in names:
                    rows[(n, g)]["error"] = "OOM (operands)"
                continue
            outputs = {}
            for n in names:
                if n == "rowwise-promoted-wgrad" and "rowwise-no-fast-accum" in outputs:
                    outputs[n] = outputs["rowwise-no-fast-accum"]  # the same call on the same operands
                    continue
                try:
                    out = run_gemm(n, p, g, A, B)
                    outputs[n] = out if g in WGRADS else out[flat]  # the sampled rows only
                    del out
                except OOM:
                    rows[(n, g)]["error"] = "OOM"
                except Exception as e:  # noqa: BLE001 - one failing row does not end the table
                    # torch's refusal of a form (use_fast_accum=False on sm90, say) is a result
                    key = "refused" if n in CUDA_ONLY else "error"
                    rows[(n, g)][key] = f"{type(e).__name__}: {str(e)[:300]}"
            plain = {n: y for n, y in outputs.items() if n != "rowwise-bf16-wgrad"}
            for n, res in compare(p, g, plain, A, B, sample).items():
                rows[(n, g)].update(res)
            if "rowwise-bf16-wgrad" in outputs:  # its operands are the bf16 inputs themselves
                res = compare(p, g, {"rowwise-bf16-wgrad": outputs["rowwise-bf16-wgrad"]}, None, None, sample)
                rows[("rowwise-bf16-wgrad", g)].update(res["rowwise-bf16-wgrad"])
            del A, B, outputs, plain
            if device.type == "cuda":
                torch.cuda.empty_cache()
        log(f"{g}: {time.time() - t0:.1f} s")
    return [rows[(r, g)] for r in recipes for g in GEMMS]


def _e(v, fmt=".2e"):
    return "" if v is None else format(v, fmt)


def markdown(meta, results):
    pr = meta["problem"]
    lines = [f"## FP8 GEMM accuracy against float64: {meta['device']}", "",
             f"- inputs: {pr['source']}; {pr['experts']} experts, T = {pr['tokens']:,} rows "
             f"(per expert {min(pr['rows_per_expert']):,} to {max(pr['rows_per_expert']):,}), D = {pr['dim']:,}, "
             f"F = {pr['ffn']:,}; {pr['activation']}, bf16",
             f"- row-split GEMMs compared on up to {meta['sample_rows']:,} rows per expert; weight gradients on "
             "their whole output",
             f"- torch {meta['versions']['torch']}, CUDA {meta['versions']['cuda']}, expertact "
             f"{meta['versions']['expertact']}; command: `{meta['command']}`", "",
             "| recipe | GEMM | err vs ref64 | bias vs ref64 | err vs deq64 | bias vs deq64 | vs bf16(deq64) | quant |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        head = f"| {r['recipe']} | {r['gemm']} |"
        why = r.get("na") or r.get("error") or (r.get("refused") and "refused: " + r["refused"])
        if why:
            lines.append(head + f" {why} | | | | | |")
            continue
        d = r.get("deq64") or {}
        lines.append(head + f" {_e(r['ref64']['err'])} | {_e(r['ref64']['bias'], '+.2e')} | {_e(d.get('err'))} | "
                     f"{_e(d.get('bias'), '+.2e')} | {_e(r.get('beyond_rounding'))} | {_e(r.get('quant'))} |")
    lines += ["", "err = ||y - ref|| / ||ref||; bias = sum((y - ref) ref) / sum(ref^2); ref64: float64 on the bf16 "
              "inputs; deq64: float64 on the dequantised FP8 operands (err vs deq64 includes the output's rounding "
              "to bf16); vs bf16(deq64): err against deq64 rounded once to bf16, the GEMM's own arithmetic beyond that "
              "rounding (its accumulation); quant: deq64 against ref64 (the operands' quantisation alone). "
              "rowwise-bf16-wgrad's weight gradients are bf16 GEMMs on the bf16 inputs: no deq64."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m expertact.bench --fp8-accuracy",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--tensors", default=None, metavar="FILE", help="a capture of examples/autoep_train.py")
    p.add_argument("--scales-from", default=None, metavar="FILE",
                   help="synthetic inputs with this capture's column scales")
    for k in ("experts", "rows", "dim", "ffn"):
        p.add_argument("--" + k, type=int, default=None,
                       help=f"synthetic shape (default {BUSIEST[k]:,} on CUDA, {CPU_DEFAULT[k]} on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-rows", type=int, default=None,
                   help="rows per expert the row-split GEMMs are compared on (default 16,384 on CUDA, all on the CPU)")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"default {','.join(RECIPES)}")
    p.add_argument("--json", default="", metavar="PATH")
    p.add_argument("--markdown", default="", metavar="PATH")
    a = p.parse_args(argv)
    if a.tensors and (a.scales_from or any(getattr(a, k) is not None for k in BUSIEST)):
        p.error("--tensors takes the shape and values of its file: no --scales-from, --experts, --rows, --dim, --ffn")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    device = resolve_device(a.device)
    cuda = device.type == "cuda"
    recipes = parse_list(a.recipes, RECIPES, "recipes")
    if a.tensors:
        p = load_capture(a.tensors, device)
    else:
        d = BUSIEST if cuda else CPU_DEFAULT
        E, rows, D, F = (d[k] if getattr(a, k) is None else getattr(a, k) for k in ("experts", "rows", "dim", "ffn"))
        p = synthetic(E, rows, D, F, device, a.seed, a.scales_from)
    why = _fp8.why_not(p.x, p.D, p.F)
    if why is not None:
        raise SystemExit(f"expertact-bench --fp8-accuracy: {why}")
    t0 = time.time()
    p.chain()
    log(f"inputs: {p.describe()}; bf16 chain in {time.time() - t0:.1f} s")
    sample = a.sample_rows if a.sample_rows is not None else (16384 if cuda else max(p.T, 1))
    results = measure(p, recipes, sample, device)
    meta = dict(device=device_name(device), versions=versions(device), problem=p.describe(), sample_rows=sample,
                recipes=recipes, command="python -m expertact.bench --fp8-accuracy " + " ".join(argv))
    md = markdown(meta, results)
    print(md)
    write_outputs(a.json, a.markdown, dict(meta=meta, results=results), md)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
