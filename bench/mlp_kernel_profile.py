"""Where one expert-MLP step's GPU time goes: one forward+backward at the busiest rank's shape
(4 experts x 261,280 rows, D = F = 3,072, bf16, swiglu_oai, the FP8 table's defaults) under
torch.profiler, after 2 warm-up steps; the step's wall time, its kernels' time and busy time,
the kernels by total time, the GPU's idle gaps inside the step (50 us or more) with the CUDA
runtime calls the host made during them, the host's GEMM calls and launches
(expertact.bench.trace); each GEMM's time in launch order. Then 4 steps timed as the
benchmark's clock times them (CUDA events around forward and backward).

    python bench/mlp_kernel_profile.py            # expert_mlp(fp8="rowwise")
    python bench/mlp_kernel_profile.py expertact  # any row name of python -m expertact.bench --mlp --fp8
    python bench/mlp_kernel_profile.py fp8-blockwise --shape 8,32768,1024,3072
        # experts, rows each, D, F: here one MoE layer of the AutoEP training (docs/BENCHMARKS.md 13)
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from expertact.bench import fp8 as table
from expertact.bench import mlp, trace

argv = sys.argv[1:]
E, ROWS, D, F = 4, 261280, 3072, 3072
if "--shape" in argv:
    i = argv.index("--shape")
    E, ROWS, D, F = (int(v) for v in argv[i + 1].split(","))
    del argv[i:i + 2]
impl = argv[0] if argv else "fp8"
args = table.parse_args([])
inp = mlp.MlpInputs(E, ROWS, D, F, torch.bfloat16, torch.device("cuda"), False)
fn = table.make_fn(impl, args, inp.offsets, F)
print(f"{impl}: {E} experts x {ROWS} rows, D = {D}, F = {F}")


def step():
    fn(*inp.args).backward(inp.grad)
    inp.clear()


for _ in range(2):
    step()
torch.cuda.synchronize()
t0 = time.time()
step()
torch.cuda.synchronize()
print(f"{impl}: one step {1e3 * (time.time() - t0):.1f} ms wall")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
# No wall time: the profiler's own start and stop (over a second) lie inside any clock around it;
# the unprofiled step's is printed above.
print(trace.report(trace.summarise(prof.events(), None, top=24), impl))
kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA")
gemms = [(b - a) / 1e3 for a, b, n in kern if trace.is_gemm(n)]
print(f"{impl}: the GEMMs in launch order, ms: " + ", ".join(f"{g:.2f}" for g in gemms))
ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
steps = []
for _ in range(4):
    inp.clear()
    ev[0].record()
    y = fn(*inp.args)
    ev[1].record()
    y.backward(inp.grad)
    ev[2].record()
    ev[2].synchronize()
    steps.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
    del y
print(f"{impl}: steps timed as the benchmark's clock (fwd, bwd) ms: "
      + ", ".join(f"({a:.1f}, {b:.1f})" for a, b in steps))
