"""Differential fuzzer of expertact against the float64 eager oracle of conftest.py.

Random problems, each checked through the public API and through the raw C ABI with poisoned
outputs, guard regions and an in-place run.

    python tests/python/support/fuzz.py --device cpu --problems 200        # a fixed number of problems
    python tests/python/support/fuzz.py --device cuda --seconds 240        # the GPU run: a time budget
    python tests/python/support/fuzz.py --device cuda --seed 1234 --problems 1 -v   # one problem: a repro

Problem i of a run is drawn from seed (--seed + i) alone, so a failure's seed is its repro.
Problem kinds live in KINDS (name -> Kind(draw, check)); docs/reliability.md says how to add one.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import struct
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# tests/python, for conftest (the oracle) and test_moe (the expert MLP's cases), and this
# folder, for the fuzzer's other modules (fuzz.py also runs as a script)
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
for _p in (TESTS, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import expertact  # noqa: E402
from expertact._capi import rows_view_ok  # noqa: E402
from fuzz_buffers import Geom, Raw, bits, guard_intact, same_bits, same_values, strided, ulp_diff, view_mask  # noqa: E402
from fuzz_paths import gate_up_ptrs, operand, predict_path  # noqa: E402

from conftest import (assert_matches, assert_weight_grad_matches, error_scales, reference_grads,  # noqa: E402
                      split, weight_grad_terms)

PRESET_NAMES = ("swiglu", "swiglu_clamped", "swiglu_oai", "geglu_tanh")
LAYOUT_NAMES = ("separate", "halves", "up_first", "interleaved")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POISONS = (0xFF, 0x7B)  # every byte: NaN in every dtype; large finite (f32 1.3e36, f16 61280, bf16 1.3e36)
INPUT_PAD_BYTE = 0xFF  # row gaps and margins of the inputs hold NaN: a read of them shows in a result
EDGE_ROWS = (1, 7, 4097)
PRIMES = (2, 3, 5, 13, 31, 127, 509, 1021, 2039, 3067)
FIXED_F = (1, 2, 3, 7, 8, 9, 12, 15, 16, 17, 63, 64, 65, 100, 128, 384, 1408, 3072)


def f32(x: float) -> float:
    """x rounded to float32 (the C ABI's params are float32: a limit must be exact there)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# ---------------------------------------------------------------------------
# The glu problem: draw
# ---------------------------------------------------------------------------


@dataclass
class GluProblem:
    seed: int
    form: str  # a preset name, or "glu" (the general form)
    act: str
    alpha: float
    limit: float
    beta: float
    limit_as_none: bool  # general form, no clamp: passed as limit=None instead of math.inf
    layout: str
    dtype: torch.dtype
    lead: tuple
    F: int
    x_geom: Geom  # gate (separate) or gate_up
    up_geom: Geom
    shared: bool  # separate: gate and up are column ranges of one buffer
    weights: Optional[str]  # None, "flat" [rows], "lead" (the leading dims), "strided" [rows] view
    w_stride: int  # strided weights (raw C ABI calls: negative = the buffer walked backwards)
    w_grad: bool
    up_grad: bool  # separate: up requires grad (else the backward is not in place)
    inplace: bool  # the API call's inplace_backward
    specials: float  # fraction of gate/up elements replaced by special values
    w_specials: bool  # weights with exact zeros and a NaN
    scale: float
    dy_geom: Geom
    out_geom: Geom  # raw C ABI output views
    grad_geom: Geom
    gw_stride: int
    threads: int  # CPU worker threads for the call (0: the default)

    @property
    def rows(self):
        return math.prod(self.lead)

    @property
    def params(self):
        return (self.act, self.alpha, self.limit, self.beta)

    def describe(self):
        p = self.form if self.form != "glu" else f"glu({self.act},a={self.alpha:g},L={self.limit:g},b={self.beta:g})"
        if self.form in ("swiglu_oai", "swiglu_clamped"):
            p += f"(a={self.alpha:g},L={self.limit:g})"
        w = "-" if self.weights is None else f"{self.weights}{self.w_stride if self.weights == 'strided' else ''}" \
            + ("+grad" if self.w_grad else "")
        return (f"{p} {self.layout} {str(self.dtype)[6:]} lead={list(self.lead)} F={self.F} "
                f"x={self.x_geom.short()} up={self.up_geom.short()}{' shared' if self.shared else ''} "
                f"w={w} inplace={int(self.inplace)} up_grad={int(self.up_grad)} specials={self.specials:g}"
                f"{' w_specials' if self.w_specials else ''} scale={self.scale:g} dy={self.dy_geom.short()} "
                f"out={self.out_geom.short()} "
                f"grad={self.grad_geom.short()} gw={self.gw_stride} threads={self.threads}")


def _draw_limit(rng):
    r = rng.random()
    if r < 0.5:
        return rng.choice((7.0, 10.0, 1.0, 3.0, 0.5))
    return f32(rng.uniform(0.05, 12.0))  # usually not exact in a 16-bit dtype


def _draw_geom(rng, offset_p=0.4, allow_split=False):
    g = Geom()
    r = rng.random()
    if r < 0.55:
        g.pad = 0
    elif r < 0.85:
        g.pad = rng.randint(1, 9)
    else:
        g.pad = rng.choice((16, 24, 64, 129))
    if rng.random() < offset_p:
        g.offset = rng.randint(1, 7)
    if rng.random() < 0.5:
        g.tail = rng.randint(1, 16)
    g.split3d = allow_split and rng.random() < 0.15
    return g


def _draw_size(rng, cap, big):
    """(rows, F) with rows * F <= cap."""
    r = rng.random()
    if big:
        # Enough rows that rows alone fill the GPU (no column split: glu_launch.cuh's shape_for):
        # ceil(rows * G / 128) >= 132 SMs * 32 blocks, G the lanes of a row (1..32, from F).
        G = rng.choice((1, 4, 32))
        F = {1: (1, 2, 3, 7, 8), 4: (64, 72, 96, 100), 32: (1024, 1032, 2048, 2056)}[G]
        return rng.randint(540_672 // G + 1, 600_000 // G), rng.choice(F)
    if r < 0.25:
        rows = rng.choice(EDGE_ROWS)
    elif r < 0.30:
        rows = 0
    elif r < 0.65:
        rows = rng.randint(1, 64)
    else:
        rows = rng.randint(65, 3000)
    r = rng.random()
    if r < 0.01:
        F = 0
    elif r < 0.35:
        F = rng.choice(FIXED_F)
    elif r < 0.55:
        F = rng.choice(PRIMES)
    elif r < 0.75:
        F = rng.randint(1, 128)
    else:
        F = rng.randint(129, 3200)
    if rows * F > cap:
        if rows in EDGE_ROWS:
            F = max(1, cap // rows)
        else:
            rows = max(1, cap // max(F, 1))
    return rows, F


def _draw_lead(rng, rows):
    if rows > 1 and rng.random() < 0.3:
        divs = [d for d in range(2, min(rows, 64) + 1) if rows % d == 0]
        if divs:
            a = rng.choice(divs)
            return (a, rows // a)
    if rng.random() < 0.05:
        return (1, rows)
    return (rows,)


def draw_glu(seed: int, ctx: "Context") -> GluProblem:
    rng = random.Random(seed)
    if rng.random() < 0.35:
        form = "glu"
        act = rng.choice(("silu", "silu", "gelu_tanh"))
        alpha = 1.0 if act == "gelu_tanh" else rng.choice((1.0, 1.702, 0.5, f32(rng.uniform(0.25, 3.0))))
        limit = math.inf if rng.random() < 0.3 else _draw_limit(rng)
        beta = rng.choice((0.0, 1.0, -0.25, f32(rng.uniform(-1.0, 2.0))))
    else:
        form = rng.choice(PRESET_NAMES)
        act = "gelu_tanh" if form == "geglu_tanh" else "silu"
        alpha, limit, beta = 1.0, math.inf, 0.0
        if form == "swiglu_oai":
            alpha = 1.702 if rng.random() < 0.6 else f32(rng.uniform(0.5, 2.5))
            limit = 7.0 if rng.random() < 0.6 else _draw_limit(rng)
            beta = 1.0
        elif form == "swiglu_clamped":
            limit = rng.choice((7.0, 10.0)) if rng.random() < 0.6 else _draw_limit(rng)
    if form == "swiglu_oai" and alpha == 1.702:
        alpha = f32(1.702)  # what the library computes with; the oracle takes the same float
    layout = rng.choice(LAYOUT_NAMES)
    dtype = rng.choice(DTYPES)
    big = rng.random() < ctx.big_fraction
    rows, F = _draw_size(rng, ctx.cap, big)
    lead = _draw_lead(rng, rows)
    sep = layout == "separate"
    w_r = rng.random()
    weights = None if w_r < 0.4 else "flat" if w_r < 0.6 else "strided" if w_r < 0.85 else "lead"
    if weights == "lead" and len(lead) == 1:
        weights = "flat"
    w_stride = rng.choice((2, 3, 5, -1, -2)) if weights == "strided" else 1
    return GluProblem(
        seed=seed, form=form, act=act, alpha=alpha, limit=limit, beta=beta,
        limit_as_none=form == "glu" and math.isinf(limit) and rng.random() < 0.5,
        layout=layout, dtype=dtype, lead=lead, F=F,
        x_geom=_draw_geom(rng, allow_split=len(lead) > 1), up_geom=_draw_geom(rng),
        shared=sep and rng.random() < 0.25,
        weights=weights, w_stride=w_stride, w_grad=weights is not None and rng.random() < 0.8,
        up_grad=not sep or rng.random() < 0.9,
        inplace=rng.random() < 0.5,
        specials=0.0 if rng.random() < 0.35 else rng.choice((0.002, 0.01, 0.05, 0.2)),
        w_specials=weights is not None and rng.random() < 0.1,
        scale=rng.choice((1.0, 4.0, 6.0, 8.0)),
        dy_geom=_draw_geom(rng, offset_p=0.3),
        out_geom=_draw_geom(rng), grad_geom=_draw_geom(rng),
        gw_stride=rng.choice((1, 1, 2, -1, -3)),
        threads=rng.choice((0, 0, 1, 2, 3, 5)) if ctx.device == "cpu" else 0,
    )


# ---------------------------------------------------------------------------
# The glu problem: inputs
# ---------------------------------------------------------------------------


def _neighbours(value, dtype):
    """(largest dtype value <= value, smallest >= value) for a positive finite float."""
    t = torch.tensor([value], dtype=torch.float64).to(dtype)
    b = bits(t)
    up, down = (b + 1).view(dtype), (b - 1).view(dtype)
    v = t.double().item()
    if v == value:
        return down.double().item(), up.double().item(), True
    if v > value:
        return down.double().item(), v, False
    return v, up.double().item(), False


def special_values(p: GluProblem):
    """NaN, +-Inf, +-0 and, with a finite limit, +-limit and the dtype's neighbours of it:
    exactly at the clamp (the masks are inclusive), one ulp inside and one outside."""
    vals = [math.nan, math.inf, -math.inf, 0.0, -0.0]
    if not math.isinf(p.limit):
        lo, hi, exact = _neighbours(p.limit, p.dtype)
        side = [lo, hi] + ([p.limit] if exact else [])
        if exact:  # one more ulp outside
            side.append(_neighbours(hi * (1 + 1e-7), p.dtype)[1])
        vals += side + [-v for v in side]
    return vals


def _values(gen, shape, p: GluProblem, device):
    """float64 values exact in p.dtype: scale * N(0, 1) with specials sprinkled in."""
    v = (torch.randn(shape, generator=gen, dtype=torch.float64, device=device) * p.scale).to(p.dtype).double()
    if p.specials > 0 and v.numel():
        sp = torch.tensor(special_values(p), dtype=torch.float64, device=device)
        hit = torch.rand(shape, generator=gen, dtype=torch.float64, device=device) < p.specials
        pick = torch.randint(0, sp.numel(), shape, generator=gen, device=device)
        v = torch.where(hit, sp[pick], v)
    return v


@dataclass
class GluData:
    """The logical float64 values of one problem and pristine buffers holding them."""
    x: torch.Tensor  # gate (separate) or gate_up, float64, lead + (cols,)
    up: Optional[torch.Tensor]
    w: Optional[torch.Tensor]  # float64 [rows] (logical order)
    dy: torch.Tensor  # float64 lead + (F,)
    bufs: dict = field(default_factory=dict)  # name -> (buffer, view) holding the dtype values


def make_data(p: GluProblem, device) -> GluData:
    gen = torch.Generator(device=device).manual_seed(p.seed)
    sep = p.layout == "separate"
    cols = p.F if sep else 2 * p.F
    shape = p.lead + (cols,)
    if sep:
        x, up = _values(gen, shape, p, device), _values(gen, shape, p, device)
    else:
        x, up = _values(gen, shape, p, device), None
    w = None
    if p.weights is not None:
        w = torch.rand(p.rows, generator=gen, dtype=torch.float64, device=device) * 3 - 1
        w = w.float().double()
        if p.w_specials and p.rows:
            w[torch.randint(0, p.rows, (max(1, p.rows // 8),), generator=gen, device=device)] = 0.0
            w[torch.randint(0, p.rows, (1,), generator=gen, device=device)] = math.nan
    dy = torch.randn(p.lead + (p.F,), generator=gen, dtype=torch.float64, device=device).to(p.dtype).double()
    d = GluData(x=x, up=up, w=w, dy=dy, bufs=make_buffers(p, device))
    d.bufs["x"][1].copy_(x)
    if sep:
        d.bufs["up"][1].copy_(up)
    d.bufs["dy"][1].copy_(dy)
    if w is not None:
        d.bufs["w"] = weight_view(p, w, device)
    return d


def make_buffers(p: GluProblem, device) -> dict:
    """name -> (buffer, view) for the inputs x, up (separate) and dy, NaN everywhere: the
    values go into the views, the rest (row gaps, margins) stays NaN."""
    sep = p.layout == "separate"
    bufs = {}
    if sep and p.shared:  # a row: gate, a gap of up_geom.pad, up, then x_geom.pad
        buf, both = strided(p.lead, 2 * p.F + p.up_geom.pad, p.x_geom, p.dtype, device, INPUT_PAD_BYTE)
        bufs["x"] = (buf, both[..., :p.F])
        bufs["up"] = (buf, both[..., p.F + p.up_geom.pad:])
    else:
        bufs["x"] = strided(p.lead, p.F if sep else 2 * p.F, p.x_geom, p.dtype, device, INPUT_PAD_BYTE)
        if sep:
            bufs["up"] = strided(p.lead, p.F, p.up_geom, p.dtype, device, INPUT_PAD_BYTE)
    bufs["dy"] = strided(p.lead, p.F, p.dy_geom, p.dtype, device, INPUT_PAD_BYTE)
    return bufs


def weight_view(p: GluProblem, w, device, fill=None):
    """(buffer, positive-stride view, logical view) of the weights: for a negative stride the
    logical order walks the positive view backwards (the raw C ABI call passes it that way)."""
    n = p.rows
    s = abs(p.w_stride) if p.weights == "strided" else 1
    off = 3 if p.weights == "strided" else 0
    buf = torch.empty(off + max(n - 1, 0) * s + 1 + 2, dtype=torch.float32, device=device)
    buf.view(torch.uint8).fill_(INPUT_PAD_BYTE if fill is None else fill)
    pos = buf.as_strided((n,), (s,), off)
    if w is not None:
        (pos.copy_(w.flip(0)) if p.w_stride < 0 else pos.copy_(w))
    return buf, pos


def _clone_view(buf, view):
    b = buf.clone()
    return b, b.as_strided(view.shape, view.stride(), view.storage_offset())


# ---------------------------------------------------------------------------
# The glu problem: calls
# ---------------------------------------------------------------------------


def api_call(p: GluProblem, x, up, w):
    kw = dict(layout=p.layout, weights=w, inplace_backward=p.inplace)
    args = (x, up) if p.layout == "separate" else (x,)
    if p.form == "glu":
        lim = None if p.limit_as_none else p.limit
        return expertact.glu(*args, activation=p.act, alpha=p.alpha, limit=lim, beta=p.beta, **kw)
    extra = {"swiglu_oai": dict(alpha=p.alpha, limit=p.limit), "swiglu_clamped": dict(limit=p.limit)}
    return getattr(expertact, p.form)(*args, **extra.get(p.form, {}), **kw)


def gw_view(p: GluProblem, dev, byte):
    """A poisoned float32 weight-gradient buffer and its view of stride |gw_stride|."""
    s = abs(p.gw_stride)
    buf = torch.empty(2 + max(p.rows - 1, 0) * s + 1 + 2, dtype=torch.float32, device=dev)
    buf.view(torch.uint8).fill_(byte)
    return buf, buf.as_strided((p.rows,), (s,), 2)


# ---------------------------------------------------------------------------
# The glu problem: the checks
# ---------------------------------------------------------------------------


class Failures(list):
    def check(self, what, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except AssertionError as e:
            self.append(f"{what}: {str(e).splitlines()[0] if str(e) else 'assertion failed'}")

    def expect(self, what, ok, detail=None):
        """detail: a callable giving more words, called only on failure."""
        if not ok:
            self.append(f"{what}{': ' + detail() if detail else ''}")


def inf_meets_rounding(p: GluProblem, up64):
    """Elements where the clamp is off (limit = +inf) and up is +-Inf, or None.

    There an Inf meets the activation's value or derivative, and eager PyTorch's expression
    (float64 and float32 alike) gives NaN where the library's float32 formula gives +-Inf:
    gelu_tanh's 0.5 x (1 + tanh(y)) rounds to 0 for x << 0 (the library computes x sigmoid(2y),
    with no cancellation), and autograd's product rule for g * sigmoid(alpha g) adds +Inf and
    -Inf (the library's derivative s (1 + alpha g (1 - s)) is one finite factor). Both are
    infinite in exact arithmetic: the C++ oracle (tests/cpp/support/oracle.cpp) takes the Inf as
    the value and lets NaN pass. The other way round, a factor that float32 flushes to 0 (the
    sigmoid of alpha g < -103) gives NaN where float64 gives +-Inf. So relax() takes, at these
    elements: +-Inf or NaN where eager float64 gives NaN; where it gives +-Inf, that Inf, or
    NaN if the eager expression in float32 gives NaN too. It counts the elements that differ
    from eager float64."""
    if not math.isinf(p.limit) or up64 is None:
        return None
    m = up64.isinf()
    return m if m.any() else None


def relax(what, got, want, mask, fails, ctx, want32):
    """(got, want) as float64 with the masked elements checked as inf_meets_rounding says, then
    set equal so that the comparison that follows judges the others. want32(): the same
    result of the eager expression evaluated in float32 (asked for only when needed)."""
    g, w = got.detach().double().clone(), want.detach().double().clone()
    gm, wm = g[mask], w[mask]
    nan_for_inf = wm.isinf() & gm.isnan()
    bad = gm.isfinite() | (wm.isinf() & ~gm.isnan() & (gm != wm))
    if nan_for_inf.any():
        bad |= nan_for_inf & ~want32().detach().reshape(w.shape)[mask].isnan()
    if bad.any():
        i = bad.nonzero()[0].item()
        fails.append(f"{what}: {int(bad.sum())} elements with an unclamped Inf input are wrong; "
                     f"first: got {gm[i].item()!r}, eager float64 {wm[i].item()!r}")
    ctx.inf_divergent += int((gm.isnan() != wm.isnan()).sum())
    g[mask] = 0.0
    w[mask] = 0.0
    return g, w


def _gate_up(x, up, layout):
    return (x, up) if layout == "separate" else split(x, layout)


def check_glu(p: GluProblem, ctx: "Context") -> list:
    if p.threads:
        expertact.set_cpu_threads(p.threads)
    try:
        return _check_glu(p, ctx)
    finally:
        if p.threads:
            expertact.set_cpu_threads(0)


def _check_glu(p: GluProblem, ctx: "Context") -> list:
    dev = ctx.device
    fails = Failures()
    d = make_data(p, dev)
    sep = p.layout == "separate"
    # --- the oracle (float64 eager PyTorch, conftest.reference_grads) on the logical values
    w_lead = None if d.w is None else d.w.reshape(p.lead)
    ins64 = [d.x, d.up] if sep else [d.x]
    ref_out, ref_grads = reference_grads(p.params, ins64, p.layout, d.dy, weights=w_lead)
    s_out, s_grads = error_scales(p.params, ins64, p.layout, d.dy, weights=w_lead)
    g64, u64 = _gate_up(d.x, d.up, p.layout)
    terms = weight_grad_terms(p.params, g64, u64, d.dy) if d.w is not None else None
    ref_gw = ref_grads[-1].reshape(-1) if d.w is not None else None

    # Unclamped Inf: see inf_meets_rounding. The output's, the gate's gradient's and the weight
    # gradient's elements that it touches; not the up gradient's (dy * w * act(g): no Inf in it).
    m_out = inf_meets_rounding(p, u64)
    m_gx = m_out
    if m_out is not None and not sep:
        m_gx = torch.zeros(d.x.shape, dtype=torch.bool, device=dev)
        split(m_gx, p.layout)[0].copy_(m_out)
    m_w = None if m_out is None else m_out.reshape(p.rows, p.F).any(-1)

    eager32 = []

    def want32(i):
        """Result i (0 out, 1.. the gradients as reference_grads orders them) in float32."""
        if not eager32:
            o, gs = reference_grads(p.params, ins64, p.layout, d.dy, weights=w_lead, dtype=torch.float32)
            eager32.extend([o] + gs)
        return lambda: eager32[i]

    def cmp(what, got, want, scale, mask, i):
        got = got.detach()
        if mask is not None:
            got, want = relax(what, got, want, mask, fails, ctx, want32(i))
        fails.check(what, assert_matches, got, want, p.dtype, scale)

    def check_grads(tag, gx, gu, gw):
        cmp(f"{tag} grad {'gate' if sep else 'gate_up'}", gx, ref_grads[0], s_grads[0], m_gx, 1)
        if sep and gu is not None:
            cmp(f"{tag} grad up", gu, ref_grads[1], s_grads[1], None, 2)
        if gw is not None:
            gw, want, t = gw.detach().reshape(-1), ref_gw, terms.reshape(-1)
            if m_w is not None:
                gw, want = relax(f"{tag} grad weights", gw, want, m_w, fails, ctx, want32(len(ref_grads)))
                t = t.masked_fill(m_w, 0.0)
            fails.check(f"{tag} grad weights", assert_weight_grad_matches, gw.float(), want, t)

    # --- 1. the public API: views of NaN-padded buffers as leaves, autograd backward
    bx, x = _clone_view(*d.bufs["x"])
    bu, up = _clone_view(*d.bufs["up"]) if sep else (None, None)
    if sep and p.shared:
        bu, up = bx, bx.as_strided(up.shape, up.stride(), up.storage_offset())
    w = None
    if d.w is not None:
        wbuf, wpos = _clone_view(*d.bufs["w"][:2])
        w = wpos if p.weights == "strided" and p.w_stride > 0 else d.w.float()
        if p.weights == "lead":
            w = w.reshape(p.lead)
        w.requires_grad_(p.w_grad)
    x.requires_grad_()
    if up is not None:
        up.requires_grad_(p.up_grad)
    out = api_call(p, x, up, w)
    fails.expect("api out shape/dtype", out.shape == p.lead + (p.F,) and out.dtype == p.dtype,
                 lambda: f"{tuple(out.shape)} {out.dtype}")
    cmp("api out", out, ref_out, s_out, m_out, 0)
    _, dy = _clone_view(*d.bufs["dy"])
    out.backward(dy)
    api_gx = x.grad
    api_gu = up.grad if up is not None else None
    fails.expect("api grad present", api_gx is not None and (up is None or (api_gu is not None) == p.up_grad))
    if api_gx is not None:
        check_grads("api", api_gx, api_gu, w.grad if w is not None and p.w_grad else None)
    if sep and not p.up_grad:
        fails.expect("api: up (no grad wanted) unchanged", same_bits(up.detach(), d.bufs["up"][1]))
    api_inplace = p.inplace and (not sep or p.up_grad)
    # gaps of the input buffers: never written, in place or not
    for name, buf in (("x", bx), ("up", bu)):
        if buf is None:
            continue
        views = [d.bufs["x"][1], d.bufs["up"][1]] if sep and p.shared else [d.bufs[name][1]]
        mask = torch.zeros(buf.shape, dtype=torch.bool, device=buf.device)
        for v in views:
            mask |= view_mask(buf, v)
        fails.expect(f"api: gaps of the {name} buffer unchanged", same_bits(buf[~mask], d.bufs[name][0][~mask]))

    # --- 2. the raw C ABI: poisoned outputs (two poisons), guards, unchanged inputs
    raw = Raw(p)
    xr, ur = d.bufs["x"][1], d.bufs["up"][1] if sep else None
    wr = d.bufs["w"][1] if d.w is not None else None
    dyr = d.bufs["dy"][1]
    snap = {k: v[0].clone() for k, v in d.bufs.items()}
    outs = []
    for byte in POISONS:
        ob, ov = strided(p.lead, p.F, p.out_geom, p.dtype, dev, byte)
        raw.forward(xr, ur, wr, ov)
        fails.expect(f"raw forward: nothing written outside out (poison {byte:#x})", guard_intact(ob, ov, byte))
        outs.append(ov)
    fails.expect("raw forward: every element written (two poisons give the same bits)", same_bits(*outs),
                 lambda: f"{int((bits(outs[0]) != bits(outs[1])).sum())} elements differ")
    cmp("raw out", outs[0], ref_out, s_out, m_out, 0)
    fails.expect("raw out equals the API's out", same_values(outs[0], out.detach()),
                 lambda: f"max {ulp_diff(outs[0], out.detach())} ulp")

    cols = p.F if sep else 2 * p.F
    grads = []
    for byte in POISONS:
        gxb, gxv = strided(p.lead, cols, p.grad_geom, p.dtype, dev, byte)
        gub, guv = strided(p.lead, p.F, p.grad_geom, p.dtype, dev, byte) if sep else (None, None)
        gwb = gwv = None
        if d.w is not None and p.w_grad:
            gwb, gwv = gw_view(p, dev, byte)
        raw.backward(dyr, xr, ur, wr, gxv, guv, gwv)
        fails.expect(f"raw backward: nothing written outside the gradients (poison {byte:#x})",
                     guard_intact(gxb, gxv, byte) and (gub is None or guard_intact(gub, guv, byte))
                     and (gwb is None or guard_intact(gwb, gwv, byte)))
        grads.append((gxv, guv, None if gwv is None else (gwv.flip(0) if p.gw_stride < 0 else gwv)))
    (ax, au, aw), (bx2, bu2, bw2) = grads
    fails.expect("raw backward: every element written (two poisons give the same bits)",
                 same_bits(ax, bx2) and (au is None or same_bits(au, bu2)) and (aw is None or same_bits(aw, bw2)))
    check_grads("raw", ax, au, aw)
    for k, v in d.bufs.items():
        fails.expect(f"raw calls left input {k} unchanged", same_bits(v[0], snap[k]))

    # --- 3. in place against out of place: the same values
    if api_inplace:
        ip_gx, ip_gu, what = api_gx, api_gu, "API in-place"
    else:
        ibx, ix = _clone_view(*d.bufs["x"])
        iu = None
        if sep:
            if p.shared:
                iu = ibx.as_strided(d.bufs["up"][1].shape, d.bufs["up"][1].stride(),
                                    d.bufs["up"][1].storage_offset())
            else:
                _, iu = _clone_view(*d.bufs["up"])
        ip_gx, ip_gu, what = ix, iu, "raw in-place"
        if rows_view_ok(ix):  # else the library refuses it; in place, the binding copies such views
            raw.backward(dyr, ix, iu, wr, ix, iu, None)
        else:
            ip_gx = None
    if ip_gx is not None:
        fails.expect(f"{what} grad equals out-of-place", same_values(ip_gx.detach(), ax),
                     lambda: f"max {ulp_diff(ip_gx.detach(), ax)} ulp")
        if sep and ip_gu is not None:
            fails.expect(f"{what} grad up equals out-of-place", same_values(ip_gu.detach(), au),
                         lambda: f"max {ulp_diff(ip_gu.detach(), au)} ulp")
    tally_glu(p, ctx, d)
    return list(fails)


def tally_glu(p: GluProblem, ctx: "Context", d: Optional[GluData] = None) -> list:
    """Counts the CUDA paths of the problem's raw calls (forward, backward, in-place backward)
    in ctx.paths; as a Kind's check (tests) it draws the geometry only and checks nothing."""
    bufs = d.bufs if d is not None else make_buffers(p, ctx.device)
    sep = p.layout == "separate"
    x, up, dy = bufs["x"][1], bufs["up"][1] if sep else None, bufs["dy"][1]
    out = strided(p.lead, p.F, p.out_geom, p.dtype, ctx.device, 0)[1]
    gx = strided(p.lead, p.F if sep else 2 * p.F, p.grad_geom, p.dtype, ctx.device, 0)[1]
    gu = strided(p.lead, p.F, p.grad_geom, p.dtype, ctx.device, 0)[1] if sep else None
    ctx.tally_forward(p, x, up, out)
    ctx.tally_backward(p, dy, x, up, gx, gu, p.weights is not None and p.w_grad)
    if rows_view_ok(x):
        ctx.tally_backward(p, dy, x, up, x, up, False)
    return []




@dataclass
class Context:
    device: str
    cap: int  # elements of one [rows, F] operand at most (big draws aside)
    big_fraction: float  # share of problems with enough rows to fill a GPU without column splits
    sms: int = 132
    kernel: str = field(default_factory=lambda: os.environ.get("EXPERTACT_CUDA_KERNEL") or "auto")
    paths: Counter = field(default_factory=Counter)
    inf_divergent: int = 0  # elements where relax() accepted +-Inf against eager's NaN (or back)

    def tally_forward(self, p, x, up, out):
        es = out.element_size()
        (g, gs), (u, us), step = gate_up_ptrs(p, x, up)
        o, os_ = operand(out)
        ops = [(o, os_, 1), (g, gs, step), (u, us, 1)][:3 if step == 1 else 2]
        self.paths[predict_path(True, es, step, p.F, p.rows, ops, [os_], [gs, us], p.weights is not None,
                                False, self.sms, self.choice(p, step, True))] += 1

    def tally_backward(self, p, dy, x, up, gx, gu, row_sum):
        es = dy.element_size()
        (g, gs), (u, us), step = gate_up_ptrs(p, x, up)
        (dg, dgs), (du, dus), _ = gate_up_ptrs(p, gx, gu)
        d, ds = operand(dy)
        ops = [(d, ds, 1), (g, gs, step), (dg, dgs, step), (u, us, 1), (du, dus, 1)][:5 if step == 1 else 3]
        self.paths[predict_path(False, es, step, p.F, p.rows, ops, [ds], [gs, us, dgs, dus],
                                p.weights is not None, row_sum, self.sms, self.choice(p, step, False))] += 1

    def choice(self, p, step, fwd):
        """The kernel choice a call takes: the variable's, or what src/cuda/entry.h's
        resolve_auto picks for this call (flat, but rows for a large interleaved forward
        and for a large problem with a limit)."""
        if self.kernel != "auto":
            return self.kernel
        n = p.rows * p.F
        if fwd and step == 2 and n > 1 << 25:
            return "rows"
        if not math.isinf(p.limit) and n > 1 << 28:
            return "rows"
        return "flat"


# ---------------------------------------------------------------------------
# Problem kinds and the run
# ---------------------------------------------------------------------------


@dataclass
class Kind:
    """draw(seed, ctx) -> a problem with .describe(); check(problem, ctx) -> failure messages."""
    draw: Callable
    check: Callable
    weight: float = 1.0


KINDS = {"glu": Kind(draw_glu, check_glu)}


# ---------------------------------------------------------------------------
# The expert MLP (expertact.moe.expert_mlp), where the package has it: random expert counts
# (empty experts, padding rows), D and F (odd, or multiples of 8 for torch._grouped_mm), forms,
# layouts, routing weights and memory modes, built and checked by tests/python/test_moe.py
# (make_case, check_case: the float64 per-expert reference and its per-row tolerances).
# ---------------------------------------------------------------------------


@dataclass
class MlpProblem:
    seed: int
    counts: list
    pad: int
    D: int
    F: int
    dtype: torch.dtype
    layout: str
    preset: str
    weighted: bool
    mode: str

    def describe(self):
        return (f"expert_mlp {self.preset} {self.layout} {str(self.dtype)[6:]} counts={self.counts} "
                f"pad={self.pad} D={self.D} F={self.F} weights={int(self.weighted)} mode={self.mode}")


def draw_expert_mlp(seed: int, ctx: "Context") -> MlpProblem:
    import test_moe
    rng = random.Random(seed)
    E = rng.choice((1, 2, 3, 4, 8))
    counts = [rng.choice((0, 1, 3, 16, 32, rng.randint(0, 64 if ctx.device == "cpu" else 300))) for _ in range(E)]
    aligned = rng.random() < 0.5  # multiples of 8: the torch._grouped_mm path on CUDA (bf16)
    # D and F >= 8: test_moe's per-row tolerance (a norm relative to the row's norm) is sized on
    # rows of 9 or more terms; rows of 1-3 terms cancel (a row's norm far below its terms') and
    # a gelu_tanh row can be exactly 0 in eager float64 but not in the library (the Inf/NaN
    # note of inf_meets_rounding, without the Inf): 21 failures in 495 such problems, all of
    # that kind (docs/reliability.md).
    D = rng.choice((8, 16, 64, 128)) if aligned else rng.choice((9, 11, 17, 31, 65))
    F = rng.choice((8, 24, 48, 128)) if aligned else rng.choice((9, 13, 33, 127))
    dtypes = (torch.float32, torch.float16, torch.bfloat16) + ((torch.float64,) if ctx.device == "cpu" else ())
    return MlpProblem(seed=seed, counts=counts, pad=rng.choice((0, 0, 1, 7)), D=D, F=F,
                      dtype=torch.bfloat16 if aligned and rng.random() < 0.5 else rng.choice(dtypes),
                      layout=rng.choice(test_moe.PACKED), preset=rng.choice(PRESET_NAMES),
                      weighted=rng.random() < 0.6, mode=rng.choice(sorted(test_moe.MODES)))


def check_expert_mlp(p: MlpProblem, ctx: "Context") -> list:
    import test_moe
    fails = Failures()
    c = test_moe.make_case(p.counts, p.pad, p.D, p.F, p.dtype, ctx.device, p.layout, p.weighted, p.seed)
    fails.check("expert_mlp against the float64 reference", test_moe.check_case, c, p.preset, p.dtype, p.mode)
    return list(fails)


def _has_expert_mlp():
    try:
        import test_moe  # noqa: F401  (tests/python/test_moe.py: the case builder and the reference)
        from expertact import moe  # noqa: F401
    except ImportError:
        return False
    return True


if _has_expert_mlp():
    KINDS["expert_mlp"] = Kind(draw_expert_mlp, check_expert_mlp, weight=0.25)


@dataclass
class Stats:
    device: str
    first_seed: int
    problems: int = 0
    failed: int = 0
    seconds: float = 0.0
    by_kind: Counter = field(default_factory=Counter)
    failed_seeds: list = field(default_factory=list)
    paths: Counter = field(default_factory=Counter)
    inf_divergent: int = 0
    kernels: Counter = field(default_factory=Counter)
    aborted: str = ""

    def summary(self):
        lines = [f"fuzz: {self.problems} problems ({dict(self.by_kind)}), {self.failed} failed, "
                 f"seeds {self.first_seed}..{self.first_seed + self.problems - 1}, device {self.device}, "
                 f"{self.seconds:.0f} s" + (f"; ABORTED: {self.aborted}" if self.aborted else "")]
        if self.inf_divergent:
            lines.append(f"accepted: {self.inf_divergent} elements where an unclamped Inf input gives +-Inf "
                         "here and NaN in eager PyTorch, or back (fuzz.inf_meets_rounding)")
        if self.failed_seeds:
            lines.append(f"failed seeds: {self.failed_seeds[:50]}")
        if self.paths:
            lines.append("CUDA paths these problems take (mirror of glu_launch.cuh): " + ", ".join(
                f"{k}: {v}" for k, v in sorted(self.paths.items(), key=lambda kv: str(kv[0])) if k))
        if self.kernels:
            lines.append("expertact kernels launched (profiled problems): " + ", ".join(
                f"{k}: {v}" for k, v in sorted(self.kernels.items())))
        return "\n".join(lines)


def repro_command(seed, ctx, kind):
    env = os.environ.get("EXPERTACT_CUDA_KERNEL")
    pre = f"EXPERTACT_CUDA_KERNEL={env} " if env else ""
    return (f"{pre}python tests/python/support/fuzz.py --device {ctx.device} --seed {seed} --problems 1 --kinds {kind} "
            f"--cap {ctx.cap} --big-fraction {ctx.big_fraction:g} -v")


def _pick_kind(seed, names):
    if len(names) == 1:
        return names[0]
    rng = random.Random(seed * 7919 + 1)
    return rng.choices(names, weights=[KINDS[n].weight for n in names])[0]


def _kernel_name(n):
    """A demangled kernel name without its parameter list (the last parenthesized group; the
    template arguments may hold casts in parentheses) and without "void expertact::..::"."""
    n = n.strip()
    if n.endswith(")"):
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                n = n[:i]
                break
    n = n.removeprefix("void ")
    for ns in ("expertact::cuda::", "expertact::detail::", "(anonymous namespace)::", "expertact::"):
        n = n.replace(ns, "")
    return n[:160]


def _kernel_names(prof):
    names = Counter()
    for e in prof.key_averages():
        if "glu_" in e.key or "expertact" in e.key or "fill_zero" in e.key:
            names[_kernel_name(e.key)] += e.count
    return names


def run(device="cpu", seed=0, count=None, seconds=None, kinds=None, verbose=False, log=print,
        cap=None, big_fraction=None, profile_kernels=0) -> Stats:
    """Draws and checks problems seed, seed + 1, ... until count problems or seconds have passed."""
    names = [k for k in (kinds or KINDS) if k in KINDS]
    if not names:
        raise ValueError(f"no problem kind among {kinds} (registered: {list(KINDS)})")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    ctx = Context(device=device, cap=cap or (1 << 22 if device == "cuda" else 1 << 17),
                  big_fraction=(0.01 if device == "cuda" else 0.0) if big_fraction is None else big_fraction,
                  sms=sms)
    st = Stats(device=device, first_seed=seed)
    # One torch thread for the oracle and the checks: on a shared 2-core machine torch's
    # intra-op threads made them 20x slower (40 problems: 42.7 s against 2.1 s). The library's
    # own CPU threads are drawn per problem.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run_loop(st, ctx, names, seed, count, seconds, verbose, log, profile_kernels)
    finally:
        torch.set_num_threads(torch_threads)
    st.paths = ctx.paths
    st.inf_divergent = ctx.inf_divergent
    return st


def _run_loop(st, ctx, names, seed, count, seconds, verbose, log, profile_kernels):
    device = ctx.device
    t0 = time.time()
    last_note = t0
    i = 0
    while (count is None or i < count) and (seconds is None or time.time() - t0 < seconds):
        s = seed + i
        i += 1
        kind = _pick_kind(s, names)
        prob = None
        prof = None
        if device == "cuda" and st.problems < profile_kernels:
            try:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            except Exception as e:  # noqa: BLE001 - the profiler is an extra, not a check
                log(f"(kernel profiling off: {type(e).__name__}: {e})")
                prof, profile_kernels = None, 0
        try:
            prob = KINDS[kind].draw(s, ctx)
            if verbose:
                log(f"seed {s} [{kind}] {prob.describe()}")
            msgs = KINDS[kind].check(prob, ctx)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - any exception is a finding, reported with its seed
            msgs = [f"exception {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
            if verbose:
                log(traceback.format_exc())
            if device == "cuda" and ("CUDA error" in str(e) or "cudaError" in str(e)):
                st.aborted = f"CUDA error at seed {s}: the context may be unusable"
        finally:
            if prof is not None:
                try:
                    prof.__exit__(None, None, None)
                    st.kernels.update(_kernel_names(prof))
                except Exception as e:  # noqa: BLE001 - the profiler is an extra, not a check
                    log(f"(kernel profiling off: {type(e).__name__}: {e})")
                    profile_kernels = 0
        st.problems += 1
        st.by_kind[kind] += 1
        if msgs:
            st.failed += 1
            st.failed_seeds.append(s)
            log(f"FAIL seed {s} [{kind}] {prob.describe() if prob is not None else ''}")
            for m in msgs[:8]:
                log(f"  - {m}")
            if len(msgs) > 8:
                log(f"  - ... {len(msgs) - 8} more")
            log(f"  repro: {repro_command(s, ctx, kind)}")
        if st.aborted:
            break
        now = time.time()
        if not verbose and now - last_note > 30:
            last_note = now
            log(f"... {st.problems} problems, {st.failed} failed, {now - t0:.0f} s")
    st.seconds = time.time() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--seed", type=int, default=0, help="first seed (problem i uses seed + i)")
    ap.add_argument("--problems", "--count", dest="count", type=int, default=None,
                    help="stop after this many problems (the same problems on any machine: what CI runs)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="stop after this many seconds (a time budget: the GPU runs)")
    ap.add_argument("--kinds", default=None, help=f"comma-separated problem kinds (registered: {','.join(KINDS)})")
    ap.add_argument("--cap", type=int, default=None, help="max elements of one [rows, F] operand "
                    "(default 2^17 on the CPU, 2^22 on CUDA)")
    ap.add_argument("--big-fraction", type=float, default=None,
                    help="share of problems with enough rows to fill the GPU without column splits "
                    "(default 0.01 on CUDA, 0 on the CPU)")
    ap.add_argument("--profile-kernels", type=int, default=0,
                    help="CUDA: list the kernels the first N problems launch (torch.profiler)")
    ap.add_argument("--json", default=None, help="write the summary here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every problem")
    a = ap.parse_args(argv)
    if a.count is None and a.seconds is None:
        a.count = 200
    if a.device == "cuda" and not (torch.cuda.is_available() and expertact.has_cuda()):
        print("fuzz: --device cuda needs a CUDA device and a CUDA build of expertact", file=sys.stderr)
        return 2
    print(f"fuzz: torch {torch.__version__}, expertact {expertact.LIBRARY_PATH}, device {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else "")
          + f", EXPERTACT_CUDA_KERNEL={os.environ.get('EXPERTACT_CUDA_KERNEL', '(unset)')}", flush=True)
    st = run(device=a.device, seed=a.seed, count=a.count, seconds=a.seconds,
             kinds=a.kinds.split(",") if a.kinds else None, verbose=a.verbose,
             log=lambda m: print(m, flush=True), cap=a.cap, big_fraction=a.big_fraction,
             profile_kernels=a.profile_kernels)
    print(st.summary(), flush=True)
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump({"device": st.device, "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
                       "torch": torch.__version__, "kernel_env": os.environ.get("EXPERTACT_CUDA_KERNEL"),
                       "first_seed": st.first_seed, "problems": st.problems, "failed": st.failed,
                       "failed_seeds": st.failed_seeds, "seconds": round(st.seconds, 1),
                       "by_kind": dict(st.by_kind), "paths": {str(k): v for k, v in st.paths.items() if k},
                       "kernels": dict(st.kernels), "aborted": st.aborted,
                       "inf_divergent": st.inf_divergent}, f, indent=1)
    return 1 if st.failed or st.aborted else 0


if __name__ == "__main__":
    sys.exit(main())
