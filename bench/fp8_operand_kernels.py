"""The FP8 node's operand kernels alone, the blockwise recipe's beside the rowwise ones that the
promoted recipe runs for the same operands: per pass its time, the bytes it must move (bf16 read,
e4m3 written; the scales, under 3%, left out) and the rate that makes, beside a plain copy's in
the same process. The passes are those of one forward and backward of the expert MLP
(swiglu_oai, halves layout, no routing weights: the MLP's form), as python/expertact/moe/_fp8.py
calls them, through expertact.fp8:

    x's operand      blockwise: row tiles              rowwise: rows + the column amax
    h's operand      GLU row tiles                     GLU rows + h's column amax
    dy's operands    row and column tiles, one read    rows + amax, then columns (two reads)
    h's columns      GLU column tiles from gate_up     GLU columns from gate_up (amax given)
    dgate_up's       the backward's row and column     the backward's rows + a bf16 dgate_up,
                     tiles                             then its columns (amax given)
    x's columns      column tiles                      columns (amax given)

Medians of 10 calls after 2 (CUDA events; wall time on the CPU, where the kernels are the
reference C++ path and the rates mean nothing).

Then the blockwise recipe's four weight passes (128 x 128 blocks, expertact.fp8.quantize_blocks)
of one forward and backward, the weights stored as transformers' GPT-OSS experts hold them
(gate_up [E, D, 2F], down [E, F, D]): each GEMM quantises its B operand [E, N, K] as a view of
that storage, two of them transposed (the forward's), two not.

    python bench/fp8_operand_kernels.py                              # the busiest rank's shape
    python bench/fp8_operand_kernels.py --shape 8,32768,1024,3072    # one MoE layer of AutoEP's run
    python bench/fp8_operand_kernels.py --bias                       # with GPT-OSS's gate_up bias

--bias: a bias [E, 2F] added to gate and up before the activation in the three passes that read
gate_up (h's operand, h's columns, dgate_up's), each expert's rows its own row of it, as the
GPT-OSS MLP's expert_mlp(..., b13=) does; its bytes (E x 2F, read through the cache) are not
counted.
"""
import argparse
import sys

import torch

import expertact.fp8 as xf
from expertact.bench.common import copy_bandwidth, median_ms, write_outputs

ACT = "swiglu_oai"
LAYOUT = "halves"


def traffic(T: int, D: int, F: int) -> dict:
    """The bytes each pass must move (bf16 read 2 a value, e4m3 written 1), per recipe."""
    x, dy, gu, h = T * D, T * D, T * 2 * F, T * F
    return {
        "x's operand": (2 * x + x, 2 * x + x),
        "h's operand": (2 * gu + h, 2 * gu + h),
        "dy's operands": (2 * dy + 2 * dy, 2 * (2 * dy) + 2 * dy),
        "h's columns": (2 * gu + h, 2 * gu + h),
        # dh and gate_up read; blockwise writes both tile forms, rowwise q, a bf16 dgate_up, then
        # reads it again for its columns
        "dgate_up's operands": (2 * h + 2 * gu + 2 * gu, 2 * h + 2 * gu + gu + 2 * gu + (2 * gu + gu)),
        "x's columns": (2 * x + x, 2 * x + x),
    }


def calls(x, gu, dy, dh, offs, ends, bias=None):
    """Per pass, (the blockwise call, the rowwise calls), each a function of no arguments; bias
    [E, 2F] or None: gate_up's bias where a pass reads gate_up."""
    b = {} if bias is None else {"bias": bias, "offsets": offs}  # the GLU calls' bias (and its rows)
    bc = {} if bias is None else {"bias": bias}  # the same where offsets are the call's own argument
    xa = xf.quantize_rowwise(x, col_amax_offsets=offs, ends=ends)[2]
    ha = xf.glu_rowwise(gu, ACT, layout=LAYOUT, col_amax_offsets=offs, ends=ends, **b)[2]
    keep = torch.empty_like(gu)
    ga = xf.glu_backward_rowwise(dh, gu, ACT, layout=LAYOUT, offsets=offs, ends=ends, col_amax=True,
                                 dgate_up_out=keep, **bc)[3]

    def dy_rowwise():
        amax = xf.quantize_rowwise(dy, col_amax_offsets=offs, ends=ends)[2]
        return xf.quantize_colwise_grouped(dy, offs, pad_to=32, ends=ends, amax=amax)

    def dgate_up_rowwise():
        xf.glu_backward_rowwise(dh, gu, ACT, layout=LAYOUT, offsets=offs, ends=ends, col_amax=True,
                                dgate_up_out=keep, **bc)
        return xf.quantize_colwise_grouped(keep, offs, pad_to=32, ends=ends, amax=ga)

    return {
        "x's operand": (lambda: xf.quantize_row_tiles(x),
                        lambda: xf.quantize_rowwise(x, col_amax_offsets=offs, ends=ends)),
        "h's operand": (lambda: xf.glu_row_tiles(gu, ACT, layout=LAYOUT, **b),
                        lambda: xf.glu_rowwise(gu, ACT, layout=LAYOUT, col_amax_offsets=offs, ends=ends, **b)),
        "dy's operands": (lambda: xf.quantize_column_tiles_grouped(dy, offs, ends=ends, row_tiles=True), dy_rowwise),
        "h's columns": (lambda: xf.glu_column_tiles_grouped(gu, ACT, offs, layout=LAYOUT, ends=ends, **bc),
                        lambda: xf.glu_colwise_grouped(gu, ACT, offs, layout=LAYOUT, pad_to=32, ends=ends, amax=ha,
                                                       **bc)),
        "dgate_up's operands": (lambda: xf.glu_backward_tiles(dh, gu, ACT, layout=LAYOUT, offsets=offs, ends=ends,
                                                              column_tiles=True, **bc), dgate_up_rowwise),
        "x's columns": (lambda: xf.quantize_column_tiles_grouped(x, offs, ends=ends),
                        lambda: xf.quantize_colwise_grouped(x, offs, pad_to=32, ends=ends, amax=xa)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4,261280,3072,3072", help="experts,rows each,D,F (default the busiest rank's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--markdown", help="also write the table here")
    p.add_argument("--bias", action="store_true", help="gate_up with a bias [E, 2F] (GPT-OSS's experts)")
    args = p.parse_args(argv)
    E, rows, D, F = (int(v) for v in args.shape.split(","))
    dev = torch.device(args.device)
    T = E * rows
    gen = torch.Generator(device=dev).manual_seed(0)

    def normal(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, 1.0, generator=gen)

    x, gu, dy, dh = normal(T, D), normal(T, 2 * F), normal(T, D), normal(T, F)
    bias = normal(E, 2 * F) if args.bias else None
    offs = torch.arange(1, E + 1, dtype=torch.int32, device=dev) * rows
    ends = offs.tolist()
    copy_rate = copy_bandwidth(2 * gu.numel(), dev) / 1e12  # TB/s, read + written, a copy as large as gate_up
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (reference path: rates mean nothing)"
    lines = [f"## The FP8 node's operand kernels: {name}", "",
             f"{E} experts x {rows:,} rows, D = {D:,}, F = {F:,}, bf16, {ACT} {LAYOUT}"
             f"{', gate_up with a bias' if args.bias else ''}; torch {torch.__version__}; "
             f"`python bench/fp8_operand_kernels.py --shape {args.shape}{' --bias' if args.bias else ''}`; "
             "a copy of gate_up's size: "
             f"{copy_rate:.2f} TB/s", "",
             "| pass | blockwise ms | GB | TB/s | % of the copy's | rowwise ms | GB | TB/s | % of the copy's |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    sums = [0.0, 0.0, 0, 0]
    need = traffic(T, D, F)
    for pass_, (block, row) in calls(x, gu, dy, dh, offs, ends, bias).items():
        cells = []
        for k, fn in enumerate((block, row)):
            ms, nbytes = median_ms(fn, 10, 2, dev), need[pass_][k]
            rate = nbytes / ms / 1e9
            sums[k] += ms
            sums[2 + k] += nbytes
            cells += [f"{ms:.3f}", f"{nbytes / 1e9:.2f}", f"{rate:.2f}", f"{100 * rate / copy_rate:.0f}%"]
        lines.append(f"| {pass_} | " + " | ".join(cells) + " |")
    total = []
    for k in (0, 1):
        rate = sums[2 + k] / sums[k] / 1e9
        total += [f"{sums[k]:.3f}", f"{sums[2 + k] / 1e9:.2f}", f"{rate:.2f}", f"{100 * rate / copy_rate:.0f}%"]
    lines.append("| all six | " + " | ".join(total) + " |")
    w13, w2 = normal(E, D, 2 * F), normal(E, F, D)
    lines += ["", "| the weights' blocks | view | ms | GB | TB/s | % of the copy's |", "|---|---|---:|---:|---:|---:|"]
    wsum = [0.0, 0]
    for name, view in (("gate_up's B (forward)", w13.transpose(1, 2)), ("y's B (forward)", w2.transpose(1, 2)),
                       ("dh's B (backward)", w2), ("dx's B (backward)", w13)):
        ms, nbytes = median_ms(lambda v=view: xf.quantize_blocks(v), 10, 2, dev), 3 * view.numel()
        wsum[0] += ms
        wsum[1] += nbytes
        kind = "transposed" if view.stride(-1) != 1 else "rows contiguous"
        lines.append(f"| {name} | {kind} | {ms:.3f} | {nbytes / 1e9:.2f} | {nbytes / ms / 1e9:.2f} | "
                     f"{100 * nbytes / ms / 1e9 / copy_rate:.0f}% |")
    lines.append(f"| all four | | {wsum[0]:.3f} | {wsum[1] / 1e9:.2f} | {wsum[1] / wsum[0] / 1e9:.2f} | "
                 f"{100 * wsum[1] / wsum[0] / 1e9 / copy_rate:.0f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_outputs(None, args.markdown, None, text, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
