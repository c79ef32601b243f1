"""The FP8 diagnosis on the CPU: examples/autoep_train.py's training run with the CPU emulation of the
rowwise FP8 GEMMs replaced by a MODEL of Hopper's fast FP8 accumulation.

THIS IS A MODEL, NOT THE HARDWARE. The library's CPU emulation of ``fp8="rowwise"``
(expertact.moe._gemm.scaled_gmm) dequantises the e4m3 operands exactly and multiplies them in
float32: its accumulation is exact to float32. The H200's FP8 tensor cores, as
``torch._scaled_grouped_mm(..., use_fast_accum=True)`` drives them, keep a narrower accumulator that
is never promoted to FP32 along K: about 13 explicit mantissa bits, truncated (the PyTorch blog "Some
Matrix Multiplication Engines Are Not As Accurate As We Thought" measured e8m13 on the H100;
SageAttention2 found the same FP22 accumulator of mma f32.f8.f8.f32; DeepSeek-V3's report: about 14
bits, up to 2% error at K = 4,096). Its modelled form here:

- the raw accumulator is the sum over K of q_a * q_b (the e4m3 values, before the scales, which the
  rowwise recipe applies in the epilogue);
- K is taken in chunks of 32 products (the K of one FP8 wgmma); a chunk's sum is exact;
- after each chunk is added, the accumulator keeps `bits` explicit mantissa bits (13 by default),
  truncated toward zero; nothing is promoted;
- then the epilogue: times scale_a[row] * scale_b[col] (powers of two: exact), rounded once to bf16.

The hardware may differ from this in ways that matter (bit-accurate models such as Khattak and
Mikaitis's, arXiv:2512.07004, align each product to the largest exponent inside the instruction and
cut there, which loses more than an exact chunk sum; a kernel may split K across CTAs and add the
splits in FP32): only measurements on the GPU settle it. The model lives here, not in the library.

Run as autoep_train.py is, one rank on the CPU, with this script's arguments first (and ``--``
before autoep_train.py's, optionally):

    torchrun --nproc_per_node 1 tests/python/support/autoep_launch.py examples/fp8_diagnosis.py \\
        --gemms wgrad --bits 13 -- --config cpu-diag --ep-size 1 --device cpu --impl mlp-fp8 --out OUT

--gemms all | wgrad | fwd-dgrad: the model on all six GEMMs, on the two weight-gradient GEMMs only
(K = an expert's rows), or on the other four only (forward and input gradient: K = D, F or 2F).
The result file (default tag <config>-<impl>-fastacc<bits>-<gemms>) is autoep_train.py's with one
more key, ``fp8_accumulation_model``: the model's parameters and how many GEMM calls of each kind it
computed (the run fails if it computed none of a kind it was asked for).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # autoep_train.py, beside this file

WGMMA_K = 32  # FP8 products per wgmma instruction along K on sm90
GEMMS = {"all": ("mm", "wgrad"), "wgrad": ("wgrad",), "fwd-dgrad": ("mm",)}
# The row block of one call of the model: bounds its [chunks, rows, N] float64 partial sums.
_ROW_BLOCK = 1024


def truncate(t: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 t with its significand cut to `bits` explicit bits, toward zero (in place of the
    bit pattern: sign-magnitude, so clearing low bits truncates toward zero for both signs).
    Zeros and infinities stay; a quiet NaN stays NaN for bits >= 1. bits = 52 changes nothing."""
    return (t.contiguous().view(torch.int64) & _keep_mask(bits)).view(torch.float64)


def _keep_mask(bits: int) -> int:
    """The int64 mask of float64's sign, exponent and first `bits` mantissa bits."""
    if not isinstance(bits, int) or not 1 <= bits <= 52:
        raise ValueError(f"bits={bits!r}: the accumulator keeps 1 to 52 explicit mantissa bits")
    return ~((1 << (52 - bits)) - 1)


def _float64(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous float64 tensor (e4m3 through float16, which holds every e4m3 value
    exactly: torch's direct e4m3 -> float64 conversion is several times slower)."""
    if t.dtype == torch.float8_e4m3fn:
        t = t.half()
    return t.to(torch.float64, memory_format=torch.contiguous_format)


class Scratch:
    """float64 buffers kept between calls: a fresh allocation of the [chunks, rows, N] partial sums
    on every call costs, in page faults, about as much as the GEMM itself."""

    def __init__(self):
        self.flat = torch.empty(0, dtype=torch.float64)

    def get(self, *shape) -> torch.Tensor:
        n = math.prod(shape)
        if self.flat.numel() < n:
            self.flat = torch.empty(n, dtype=torch.float64)
        return self.flat[:n].view(shape)


def fast_accum_matmul(a: torch.Tensor, b: torch.Tensor, bits, chunk: int = WGMMA_K, scratch=None) -> torch.Tensor:
    """The modelled raw accumulator of a [M, K] x b [K, N] (e4m3 values, or any float dtype holding
    them exactly), float64 [M, N]: the sum over K in chunks of `chunk`, each chunk's sum exact, the
    running sum truncated to `bits` explicit mantissa bits after each chunk (bits None: no
    truncation, the exact sum). The chunk sums are exact in float64: e4m3 products are multiples of
    2^-18 below 2^17.7 in magnitude, so a sum of up to 2^17 of them needs at most 53 bits; so is
    the running sum plus a chunk for K up to 2^17. scratch: a Scratch to reuse between calls."""
    M, K = a.shape
    N = b.shape[1]
    keep = None if bits is None else _keep_mask(bits)
    a, b = _float64(a), _float64(b)
    nc = max(1, math.ceil(K / chunk))
    if nc * chunk != K:  # the last chunk partial: zero products fill it
        a = torch.nn.functional.pad(a, (0, nc * chunk - K))
        b = torch.nn.functional.pad(b, (0, 0, 0, nc * chunk - K))
    bc = b.view(nc, chunk, N)
    scratch = scratch if scratch is not None else Scratch()
    out = torch.empty((M, N), dtype=torch.float64)
    for r in range(0, M, _ROW_BLOCK):
        ar = a[r:r + _ROW_BLOCK]
        parts = torch.bmm(ar.view(-1, nc, chunk).transpose(0, 1), bc,
                          out=scratch.get(nc, ar.shape[0], N))  # [nc, rows, N], each chunk's sum exact
        acc = out[r:r + _ROW_BLOCK]
        if keep is None:
            torch.sum(parts, 0, out=acc)
            continue
        acc.zero_()
        pattern = acc.view(torch.int64)  # acc's bits, truncated in place: temporaries cost 8x the time
        for c in range(nc):
            acc.add_(parts[c])
            pattern.bitwise_and_(keep)
    return out


def _epilogue(acc, sa, sb):
    """The rowwise epilogue: the raw accumulator times its row's and column's scales, one rounding
    to bf16 (acc has at most bits + 1 significant bits and the scales are powers of two, so the
    float32 step is exact for bits <= 23)."""
    return (acc * sa.double()[:, None] * sb.double()[None, :]).float().to(torch.bfloat16)


class FastAccumModel:
    """A drop-in for expertact.moe._gemm.scaled_gmm (same arguments and result forms) that computes
    the GEMM kinds in `kinds` ("mm": the four M-grouped GEMMs, "wgrad": the two weight-gradient
    ones) with the modelled accumulation on CPU tensors where the call asks for fast accumulation,
    and hands every other call to `exact` (the library's emulation). calls counts the modelled
    calls of each kind."""

    def __init__(self, bits, kinds=("mm", "wgrad"), chunk: int = WGMMA_K, exact=None):
        unknown = set(kinds) - {"mm", "wgrad"}
        if unknown or not kinds:
            raise ValueError(f"kinds={kinds!r}: expected a non-empty subset of ('mm', 'wgrad')")
        if bits is not None:
            _keep_mask(bits)  # checks the range
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: at least one product a chunk")
        from expertact.moe import _gemm
        self.bits, self.kinds, self.chunk = bits, tuple(kinds), chunk
        self.exact = exact if exact is not None else _gemm.scaled_gmm
        self.calls = dict.fromkeys(("mm", "wgrad"), 0)
        self.scratch = Scratch()

    def __call__(self, a, b, scale_a, scale_b, offs, fast_accum=True):
        kind = "mm" if b.dim() == 3 else "wgrad"
        if a.is_cuda or kind not in self.kinds or not fast_accum:
            return self.exact(a, b, scale_a, scale_b, offs, fast_accum)
        self.calls[kind] += 1
        ends = offs.tolist()
        start = 0
        # NaN where the operator leaves its output unwritten, as the library's emulation does.
        if kind == "mm":
            out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=torch.bfloat16)
            for e, end in enumerate(ends):
                if end > start:
                    acc = fast_accum_matmul(a[start:end], b[e], self.bits, self.chunk, self.scratch)
                    out[start:end] = _epilogue(acc, scale_a[start:end], scale_b[e])
                start = end
            return out
        M, N = a.shape[0], b.shape[1]
        sa, sb = scale_a.view(-1, M), scale_b.view(-1, N)
        out = torch.full((len(ends), M, N), float("nan"), dtype=torch.bfloat16)
        for e, end in enumerate(ends):
            if end > start:
                out[e] = _epilogue(fast_accum_matmul(a[:, start:end], b[start:end], self.bits, self.chunk, self.scratch),
                                   sa[e], sb[e])
            start = end
        return out

    def describe(self):
        return dict(model="raw accumulator (sum of q_a * q_b before the rowwise scales) in chunks of "
                          f"{self.chunk} products along K, each chunk's sum exact, truncated toward zero to "
                          f"{self.bits} explicit mantissa bits after each chunk, never promoted; then the "
                          "scales and one rounding to bf16 (a model of use_fast_accum=True, not the hardware)",
                    bits=self.bits, chunk=self.chunk, kinds=list(self.kinds), calls=dict(self.calls))


@contextlib.contextmanager
def installed(model: FastAccumModel):
    """The FP8 node's GEMMs through `model` inside the block (the node calls _gemm.scaled_gmm by
    its module attribute), the library's emulation back after it."""
    from expertact.moe import _gemm
    saved = _gemm.scaled_gmm
    _gemm.scaled_gmm = model
    try:
        yield model
    finally:
        _gemm.scaled_gmm = saved


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemms", choices=tuple(GEMMS), default="all",
                   help="which GEMMs the model computes: all six, the weight gradients only, or the other four")
    p.add_argument("--bits", type=int, default=13, help="explicit mantissa bits the accumulator keeps (default 13)")
    p.add_argument("--chunk", type=int, default=WGMMA_K, help=f"products per exact chunk sum (default {WGMMA_K})")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:  # this script's arguments, then autoep_train.py's
        cut = argv.index("--")
        args, rest = p.parse_args(argv[:cut]), argv[cut + 1:]
    else:
        args, rest = p.parse_known_args(argv)
    import autoep_train
    targs = autoep_train.parse_args(rest)  # its own errors first
    if len(targs.impls) != 1:
        p.error(f"one --impl a run (got {targs.impl!r})")
    impl = targs.impls[0]
    form = autoep_train.IMPLS[impl] or {}
    if form.get("fp8") is None:
        p.error(f"--impl {impl} runs no FP8 GEMMs: the model replaces the FP8 emulation (an mlp-fp8 impl)")
    from expertact.moe import _gemm, fp8_recipe
    recipe = _gemm.FP8_FORMS[fp8_recipe(form["fp8"])]
    if recipe.blockwise:
        p.error(f"--impl {impl} runs the blockwise recipe: the model replaces the rowwise GEMMs (scaled_gmm)")
    if "wgrad" in GEMMS[args.gemms] and not (recipe.wgrad_fp8 and recipe.wgrad_fast_accum):
        how = "in bf16" if not recipe.wgrad_fp8 else "without fast accumulation"
        p.error(f"--gemms {args.gemms} models fast accumulation in the weight-gradient GEMMs, which --impl {impl} "
                f"computes {how}")
    if "--tag" not in rest and not any(a.startswith("--tag=") for a in rest):
        rest = rest + ["--tag", f"{targs.tag}-fastacc{args.bits}-{args.gemms}"]
    args.train_args = rest
    return args


def main(argv=None):
    args = parse_args(argv)
    import autoep_train
    model = FastAccumModel(args.bits, GEMMS[args.gemms], args.chunk)
    record = autoep_train.result_record

    def result_record(*a, **k):
        out = record(*a, **k)
        out["fp8_accumulation_model"] = model.describe()
        missing = [kind for kind in model.kinds if model.calls[kind] == 0]
        if missing:
            raise SystemExit(f"fp8_diagnosis.py: the model computed no {missing} GEMM in this run: it did not "
                             "replace the FP8 emulation")
        return out

    autoep_train.result_record = result_record
    with installed(model):
        autoep_train.main(args.train_args)


if __name__ == "__main__":
    main()
