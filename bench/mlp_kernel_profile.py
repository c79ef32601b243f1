"""Where one expert-MLP step's GPU time goes: one forward+backward at the busiest rank's shape
(4 experts x 261,280 rows, D = F = 3,072, bf16, swiglu_oai, the FP8 table's defaults) under
torch.profiler, after 2 warm-up steps; the step's wall time, the sum of its kernel times and
the kernels by total time; the GPU's idle gaps inside the step (between one kernel's end and
the next one's start, 50 us or more) with the CUDA runtime calls the host made during them, the
calls summed over every gap; each GEMM's time in launch order. Then 4 steps timed as the
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
from expertact.bench import mlp

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
rows = {}
for e in prof.events():
    if e.device_type.name == "CUDA":
        r = rows.setdefault(e.name[:110], [0.0, 0])
        r[0] += e.time_range.elapsed_us()
        r[1] += 1
print(f"{impl}: kernel time total {sum(v[0] for v in rows.values()) / 1e3:.2f} ms")
for name, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:24]:
    print(f"{us / 1e3:9.3f} ms {n:3d}x  {name}")
# The GPU's idle time between kernels, and what the host was doing then.
kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA")
gemms = [(b - a) / 1e3 for a, b, n in kern if "gemm" in n.lower() and "prepare" not in n]  # (not torch's setup kernels)
print(f"{impl}: the GEMMs in launch order, ms: " + ", ".join(f"{g:.2f}" for g in gemms))
calls = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
         if e.device_type.name == "CPU" and e.name.startswith("cuda")]
gaps = [(b[0] - a[1], a, b) for a, b in zip(kern, kern[1:]) if b[0] - a[1] >= 50]
print(f"{impl}: first kernel to last kernel {(kern[-1][1] - kern[0][0]) / 1e3:.2f} ms; "
      f"{len(gaps)} gaps of 50 us or more: {sum(g[0] for g in gaps) / 1e3:.2f} ms")
by_call = {}
for i, (g, a, b) in enumerate(sorted(gaps, key=lambda t: -t[0])):
    during = [(min(c[1], b[0]) - max(c[0], a[1]), c[2]) for c in calls if c[0] < b[0] and c[1] > a[1]]
    for us, name in during:
        by_call[name] = by_call.get(name, 0.0) + us
    if i >= 16:
        continue
    top = ", ".join(f"{n} {us / 1e3:.2f}" for us, n in sorted(during, reverse=True)[:3])
    print(f"  gap {g / 1e3:7.3f} ms  after {a[2][:40]!r}  before {b[2][:40]!r}  host: {top}")
print("  runtime calls during the gaps (ms): "
      + ", ".join(f"{n} {us / 1e3:.2f}" for n, us in sorted(by_call.items(), key=lambda kv: -kv[1])[:8]))
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
