"""The six FP8 grouped GEMMs of expert_mlp(fp8="rowwise") one at a time at the busiest rank's
shape (4 experts x 261,280 rows, D = F = 3,072; random e4m3 operands in the sm90 formats, unit
scales), each weight-gradient GEMM in both orientations: out[e] = a^T b as [E, a cols, b cols],
or b^T a as [E, b cols, a cols] (the transpose of the same product). Medians of 10 CUDA-event-
timed calls after 3, ms.

    python bench/fp8_gemm_orient.py
"""
import torch

from expertact import _fp8_mlp
from expertact.bench.common import median_ms

E, Te, D, F = 4, 261280, 3072, 3072
T = E * Te
dev = "cuda"
f8 = torch.float8_e4m3fn
offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * Te
sg = _fp8_mlp._sgmm


def r8(*shape):
    return torch.randn(*shape, device=dev, dtype=torch.bfloat16).to(f8)


def ones(n):
    return torch.ones(n, device=dev)


x8, h8, dy8, dg8 = r8(T, D), r8(T, F), r8(T, D), r8(T, 2 * F)
w13, w2 = r8(E, 2 * F, D).transpose(-2, -1), r8(E, D, F).transpose(-2, -1)  # B: [E, K, N] column-major
w2b, w13b = r8(E, F, D).transpose(-2, -1), r8(E, D, 2 * F).transpose(-2, -1)
# column-wise operands as the MLP makes them: [Tp, C] column-major (storage [C, Tp])
xc, hc, dyc, dgc = r8(D, T).t(), r8(F, T).t(), r8(D, T).t(), r8(2 * F, T).t()
cases = {
    "fwd gate_up = x @ w13": lambda: sg(x8, w13, ones(T), ones((E, 2 * F)), offs),
    "fwd y = h @ w2": lambda: sg(h8, w2, ones(T), ones((E, D)), offs),
    "bwd dh = dy @ w2^T": lambda: sg(dy8, w2b, ones(T), ones((E, F)), offs),
    "bwd dx = dg @ w13^T": lambda: sg(dg8, w13b, ones(T), ones((E, D)), offs),
    "bwd dw13 as x^T dg [E, D, 2F]": lambda: sg(xc.t(), dgc, ones(D * E), ones(2 * F * E), offs),
    "bwd dw13 as dg^T x [E, 2F, D]": lambda: sg(dgc.t(), xc, ones(2 * F * E), ones(D * E), offs),
    "bwd dw2 as h^T dy [E, F, D]": lambda: sg(hc.t(), dyc, ones(F * E), ones(D * E), offs),
    "bwd dw2 as dy^T h [E, D, F]": lambda: sg(dyc.t(), hc, ones(D * E), ones(F * E), offs),
}
for n, f in cases.items():
    print(f"{n}: {median_ms(f, 10, 3, dev):.3f} ms", flush=True)
