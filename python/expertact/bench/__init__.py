"""expertact's benchmarks: tooling beside the library, not part of its API.

    python -m expertact.bench               # the activation table (activation.py)
    python -m expertact.bench --peers       # beside DeepSpeed's Triton kernels and torch.compile (peers.py)
    python -m expertact.bench --mlp         # the expert MLP and its memory modes (mlp.py)
    python bench/host_cost.py               # host cost per call (hostcost.py)

The command expertact-bench is python -m expertact.bench (cli.py). common.py, at the bottom,
holds what they share (reference expressions, inputs, clocks, memory, table output); it imports
none of the others, and none of them imports this package's namespace.
"""

# The memory measurement, for tests that check a memory contract with it.
from .common import cpu_memory, cuda_memory  # noqa: E402,F401
