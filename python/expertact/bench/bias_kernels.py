"""The per-expert bias kernels beside the unbiased activation, one kernel call each:

    python -m expertact.bench.bias_kernels                 # CUDA: 4 experts x 261,280 rows, F = 3,072, bf16
    python -m expertact.bench.bias_kernels --rows 4096 --ffn 256 --device cpu

Rows: the activation's forward and backward without bias (the fused activation kernels) and
with b13 (glu_forward_bias / glu_backward_bias, b13's gradient included), and expert_bias's
forward (in place) and backward (b2's and the weights' gradients); swiglu_oai, interleaved
gate_up, routing weights. Medians of CUDA-event times (wall time on the CPU), and the bytes
each kernel must move over that time. Then: two backward calls' bias gradients compared bit
for bit.
"""
from __future__ import annotations

import argparse
import json

import torch

from .. import _ops
from .._args import PRESETS
from .common import median_ms


def run(rows_per_expert, ffn, experts, device, dtype, iters, warmup):
    T, F, E = rows_per_expert * experts, ffn, experts
    g = torch.Generator(device=device).manual_seed(0)  # on the device: the CPU took over a minute at this size
    mk = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    gu, dy, y = mk(T, 2 * F), mk(T, F), mk(T, F)
    b13, b2 = mk(E, 2 * F), mk(E, F)
    w = torch.rand(T, generator=g, device=device)
    offs = torch.arange(1, E + 1, dtype=torch.int32).mul_(rows_per_expert).to(device)
    act, _, _, beta = PRESETS["swiglu_oai"]
    args = (3, act, 1.702, 7.0, beta)  # interleaved
    es = gu.element_size()
    cases = {
        "forward": (lambda: _ops.glu_forward(gu, None, w, *args), 3 * F),
        "forward + b13": (lambda: _ops.glu_forward_bias(gu, None, b13, offs, w, *args), 3 * F),
        "backward": (lambda: _ops.glu_backward(dy, gu, None, w, True, *args), 5 * F),
        "backward + b13 (its gradient too)": (
            lambda: _ops.glu_backward_bias(dy, gu, None, b13, offs, w, True, True, False, *args), 5 * F),
        "expert_bias forward (in place)": (lambda: _ops.expert_bias_forward(y, b2, offs, w, inplace=True), 2 * F),
        "expert_bias backward (b2, weights)": (lambda: _ops.expert_bias_backward(dy, b2, offs, w, True, True), F),
    }
    rows = []
    for name, (fn, elems) in cases.items():
        ms = median_ms(fn, iters, warmup, device)
        rows.append({"kernel": name, "ms": ms, "GB": T * elems * es / 1e9, "TB/s": T * elems * es / ms / 1e9})
    r1 = _ops.glu_backward_bias(dy, gu, None, b13, offs, w, True, True, False, *args)
    r2 = _ops.glu_backward_bias(dy, gu, None, b13, offs, w, True, True, False, *args)
    s1 = _ops.expert_bias_backward(dy, b2, offs, w, True, True)
    s2 = _ops.expert_bias_backward(dy, b2, offs, w, True, True)
    same = all(torch.equal(a, b) for a, b in ((r1[3], r2[3]), (r1[2], r2[2]), (s1[0], s2[0]), (s1[1], s2[1])))
    return rows, same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m expertact.bench.bias_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--rows", type=int, default=None, help="rows per expert (default 261,280 on CUDA, 1,024 on the CPU)")
    p.add_argument("--ffn", type=int, default=None, help="F (default 3,072 on CUDA, 256 on the CPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    cuda = dev.type == "cuda"
    rows = a.rows or (261280 if cuda else 1024)
    ffn = a.ffn or (3072 if cuda else 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    table, same = run(rows, ffn, a.experts, dev, dtype, a.iters, a.warmup)
    where = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"{where}: {a.experts} experts x {rows:,} rows, F = {ffn:,}, {str(dtype).replace('torch.', '')}, "
          f"swiglu_oai interleaved, routing weights; medians of {a.iters}")
    print("| kernel | ms | GB moved | TB/s |\n|---|---:|---:|---:|")
    for r in table:
        print(f"| {r['kernel']} | {r['ms']:.3f} | {r['GB']:.2f} | {r['TB/s']:.2f} |")
    print(f"bias gradients of two identical calls bit-identical: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": where, "rows_per_expert": rows, "ffn": ffn, "experts": a.experts,
                       "dtype": str(dtype), "rows": table, "bit_identical": same}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
