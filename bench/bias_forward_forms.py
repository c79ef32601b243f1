"""The biased activation forward (b13 added inside) in its two CUDA forms at the busiest rank's
shape (1,045,120 rows, F = 3,072, bf16, swiglu_oai interleaved, routing weights): the chunked
kernel (default) and the row kernels' shape (EXPERTACT_BIAS_FWD=rows); medians of 20 calls, and
whether the two outputs are bit-identical.

    python bench/bias_forward_forms.py
"""
import os

import torch

from expertact import _bias
from expertact._args import PRESETS
from expertact.bench.common import median_ms

T, F, E = 1045120, 3072, 4
g = torch.Generator(device="cuda").manual_seed(0)
gu = torch.randn(T, 2 * F, generator=g, device="cuda", dtype=torch.bfloat16)
b13 = torch.randn(E, 2 * F, generator=g, device="cuda", dtype=torch.bfloat16)
w = torch.rand(T, generator=g, device="cuda")
offs = torch.arange(1, E + 1, dtype=torch.int32, device="cuda") * (T // E)
act, _, _, beta = PRESETS["swiglu_oai"]
args = (3, act, 1.702, 7.0, beta)  # 3: interleaved
out = {}
for form in ("chunks", "rows"):
    os.environ["EXPERTACT_BIAS_FWD"] = form
    out[form] = _bias.glu_forward(gu, None, b13, offs, w, *args)
    ms = median_ms(lambda: _bias.glu_forward(gu, None, b13, offs, w, *args), 20, 3, "cuda")
    print(f"forward + b13 ({form}): {ms:.3f} ms", flush=True)
print("bit-identical:", torch.equal(out["chunks"], out["rows"]))
