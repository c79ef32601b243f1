"""The FP8 quantisation kernels alone at the busiest rank's shape (1,045,120 rows, bf16, CUDA):
rowwise plain and with the fused column amax, column-wise with and without a given amax, the
FP8 activation beside the bf16 one, and the fused FP8 activation backward beside the bf16
backward + rowwise pass it replaces. Medians of 10 CUDA-event-timed calls after 2.

    python bench/fp8_kernels_timing.py                 # every section
    python bench/fp8_kernels_timing.py colwise glu     # sections: colwise rowwise glu glucol bwd
"""
import sys

import torch

import expertact
import expertact.fp8 as xf
import expertact.functional as XF
from expertact.bench.common import median_ms

# The bf16 activation backward alone: the registered operator torch.ops.expertact.glu_backward
# (public as expertact.ops), with the layout and activation codes of expertact.LAYOUTS / PRESETS.
glu_backward_op = expertact.ops.glu_backward.default

SECTIONS = ("colwise", "rowwise", "glu", "glucol", "bwd")
want = [a for a in sys.argv[1:] if a in SECTIONS] or list(SECTIONS)
T, F = 1045120, 3072
gu = torch.randn(T, 2 * F, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
w = torch.rand(T, device="cuda")
offs = torch.arange(1, 5, dtype=torch.int32, device="cuda") * 261280
ends = offs.tolist()
cases = {}
if "colwise" in want:
    a3 = xf.quantize_rowwise(dy, col_amax_offsets=offs, ends=ends)[2]
    a6 = xf.quantize_rowwise(gu, col_amax_offsets=offs, ends=ends)[2]
    cases.update({
        "colwise [T,3072] pad16": lambda: xf.quantize_colwise_grouped(dy, offs, pad_to=16, ends=ends),
        "colwise [T,6144] pad16": lambda: xf.quantize_colwise_grouped(gu, offs, pad_to=16, ends=ends),
        "colwise [T,3072] pad16, amax given": lambda: xf.quantize_colwise_grouped(dy, offs, pad_to=16, ends=ends,
                                                                                   amax=a3),
        "colwise [T,6144] pad16, amax given": lambda: xf.quantize_colwise_grouped(gu, offs, pad_to=16, ends=ends,
                                                                                   amax=a6)})
if "rowwise" in want:
    cases.update({
        "rowwise [T,3072]": lambda: xf.quantize_rowwise(dy),
        "rowwise + col amax [T,3072]": lambda: xf.quantize_rowwise(dy, col_amax_offsets=offs, ends=ends),
        "rowwise [T,6144]": lambda: xf.quantize_rowwise(gu),
        "rowwise + col amax [T,6144]": lambda: xf.quantize_rowwise(gu, col_amax_offsets=offs, ends=ends)})
if "glu" in want:
    cases.update({
        "glu_rowwise (swiglu_oai interleaved, weights)":
            lambda: xf.glu_rowwise(gu, "swiglu_oai", layout="interleaved", weights=w),
        "bf16 glu forward, same": lambda: XF.swiglu_oai(gu, layout="interleaved", weights=w),
        "glu_rowwise + col amax": lambda: xf.glu_rowwise(gu, "swiglu_oai", layout="interleaved", weights=w,
                                                         col_amax_offsets=offs, ends=ends),
        "glu_rowwise halves, no weights (the MLP's)": lambda: xf.glu_rowwise(gu, "swiglu_oai", layout="halves"),
        "glu_rowwise halves, no weights + col amax (the MLP's)": lambda: xf.glu_rowwise(
            gu, "swiglu_oai", layout="halves", col_amax_offsets=offs, ends=ends)})
if "glucol" in want:
    ha = xf.glu_rowwise(gu, "swiglu_oai", layout="interleaved", weights=w, col_amax_offsets=offs, ends=ends)[2]

    def bf16_then_colwise():
        h = XF.swiglu_oai(gu, layout="interleaved", weights=w)
        return xf.quantize_colwise_grouped(h, offs, pad_to=16, ends=ends)

    cases.update({
        "glu_colwise_grouped pad16, amax given": lambda: xf.glu_colwise_grouped(
            gu, "swiglu_oai", offs, layout="interleaved", weights=w, pad_to=16, ends=ends, amax=ha),
        "bf16 glu forward + colwise pad16": bf16_then_colwise})
    hh = xf.glu_rowwise(gu, "swiglu_oai", layout="halves", col_amax_offsets=offs, ends=ends)[2]
    cases["glu_colwise_grouped halves, no weights, amax given (the MLP's)"] = lambda: xf.glu_colwise_grouped(
        gu, "swiglu_oai", offs, layout="halves", pad_to=16, ends=ends, amax=hh)
if "bwd" in want:
    act, _, _, beta = expertact.PRESETS["swiglu_oai"]
    glu = (expertact.LAYOUTS["interleaved"], act, 1.702, 7.0, beta)
    keep = torch.empty_like(gu)

    def bf16_then_rowwise():
        dg = glu_backward_op(dy, gu, None, w, True, *glu)[0]
        return xf.quantize_rowwise(dg, col_amax_offsets=offs, ends=ends)

    cases.update({
        "bf16 glu backward (weights' grad)": lambda: glu_backward_op(dy, gu, None, w, True, *glu),
        "bf16 glu backward + rowwise + col amax": bf16_then_rowwise,
        "fp8 glu_backward_rowwise + col amax": lambda: xf.glu_backward_rowwise(
            dy, gu, "swiglu_oai", layout="interleaved", weights=w, weights_grad=True, offsets=offs, ends=ends,
            col_amax=True),
        "fp8 glu_backward_rowwise + col amax + bf16 copy": lambda: xf.glu_backward_rowwise(
            dy, gu, "swiglu_oai", layout="interleaved", weights=w, weights_grad=True, offsets=offs, ends=ends,
            col_amax=True, dgate_up_out=keep),
        "fp8 glu_backward_rowwise halves + weights + col amax + bf16 copy": lambda: xf.glu_backward_rowwise(
            dy, gu, "swiglu_oai", layout="halves", weights=w, weights_grad=True, offsets=offs, ends=ends,
            col_amax=True, dgate_up_out=keep),
        "fp8 glu_backward_rowwise halves + col amax + bf16 copy (the MLP's: no weights)":
            lambda: xf.glu_backward_rowwise(dy, gu, "swiglu_oai", layout="halves", offsets=offs, ends=ends,
                                            col_amax=True, dgate_up_out=keep)})
for n, f in cases.items():
    print(f"{n}: {median_ms(f, 10, 2, 'cuda'):.3f} ms", flush=True)
