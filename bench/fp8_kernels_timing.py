"""The FP8 quantisation kernels alone at the busiest rank's shape (1,045,120 rows, bf16, CUDA):
rowwise plain and with the fused column amax, column-wise with and without a given amax, and the
FP8 activation beside the bf16 one. Medians of 10 CUDA-event-timed calls after 2.

    python bench/fp8_kernels_timing.py
"""
import torch

import expertact.fp8 as xf
import expertact.functional as XF
from expertact.bench.common import median_ms

T, F = 1045120, 3072
gu = torch.randn(T, 2 * F, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
w = torch.rand(T, device="cuda")
offs = torch.arange(1, 5, dtype=torch.int32, device="cuda") * 261280
ends = offs.tolist()
cases = {"colwise [T,3072] pad16": lambda: xf.quantize_colwise_grouped(dy, offs, pad_to=16, ends=ends),
         "colwise [T,6144] pad16": lambda: xf.quantize_colwise_grouped(gu, offs, pad_to=16, ends=ends)}
a3 = xf.quantize_rowwise(dy, col_amax_offsets=offs, ends=ends)[2]
a6 = xf.quantize_rowwise(gu, col_amax_offsets=offs, ends=ends)[2]
cases.update({
    "glu_rowwise (swiglu_oai interleaved, weights)":
        lambda: xf.glu_rowwise(gu, "swiglu_oai", layout="interleaved", weights=w),
    "bf16 glu forward, same": lambda: XF.swiglu_oai(gu, layout="interleaved", weights=w),
    "rowwise [T,3072]": lambda: xf.quantize_rowwise(dy),
    "rowwise + col amax [T,3072]": lambda: xf.quantize_rowwise(dy, col_amax_offsets=offs, ends=ends),
    "colwise [T,3072] pad16, amax given": lambda: xf.quantize_colwise_grouped(dy, offs, pad_to=16, ends=ends,
                                                                               amax=a3),
    "rowwise [T,6144]": lambda: xf.quantize_rowwise(gu),
    "rowwise + col amax [T,6144]": lambda: xf.quantize_rowwise(gu, col_amax_offsets=offs, ends=ends),
    "colwise [T,6144] pad16, amax given": lambda: xf.quantize_colwise_grouped(gu, offs, pad_to=16, ends=ends,
                                                                               amax=a6)})
for n, f in cases.items():
    print(f"{n}: {median_ms(f, 10, 2, 'cuda'):.3f} ms", flush=True)
