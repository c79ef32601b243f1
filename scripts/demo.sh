#!/usr/bin/env bash
# The main job: installs expertact and runs its benchmark.
#  - on a machine with a CUDA GPU (and a CUDA build of torch already installed):
#    the seed-size table (1,045,081 x 3,072 bf16) of eager PyTorch, torch.compile,
#    expertact and expertact with in-place backward, plus the C++ GPU benchmark;
#  - on a machine without one: the same table on the CPU path at a reduced size,
#    plus the C++ CPU benchmark against memcpy.
#   bash scripts/demo.sh           (results in $OUT/demo; $OUT defaults to out/ in the repository)
# It installs into the Python environment of $PYTHON (default python3): libdlpack-dev with
# apt-get where missing, torch where missing, scikit-build-core, cmake and ninja, then
# expertact itself. To keep a shared environment as it is, run it from a virtual environment:
#   python3 -m venv --system-site-packages /tmp/ea-venv && PYTHON=/tmp/ea-venv/bin/python bash scripts/demo.sh
# Time: without a GPU, 8.5 minutes on a shared 2-core machine (2026-12-01: the two CPU builds
# of the library, by pip and with the C++ benchmark, about 4; the Python table about 3.5; the
# C++ benchmark about 1). With a GPU: two CUDA builds (a wheel's alone takes 4-10 minutes on
# 2 cores, far less on a GPU machine's), then the seed-size table and the C++ GPU benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
OUT=${OUT:-$PWD/out}
OUTDIR=$OUT/demo
mkdir -p "$OUTDIR"

gpu=0
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then gpu=1; fi

if command -v apt-get > /dev/null && ! dpkg -s libdlpack-dev > /dev/null 2>&1; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libdlpack-dev > /dev/null
fi
if ! $PY -c "import torch" > /dev/null 2>&1; then
  # Without a GPU: torch from the package index (the CPU build where the index has it; PyPI's
  # default Linux wheel is the larger CUDA build, which runs on the CPU too).
  [ $gpu = 1 ] && { echo "a CUDA build of torch is needed on a GPU machine; install it first"; exit 1; }
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q scikit-build-core cmake ninja

# The CUDA path where there is a GPU to run it, else the CPU library alone (no CUDA compile).
CUDA=$([ $gpu = 1 ] && echo ON || echo OFF)
echo "== building and installing expertact (CUDA path: $CUDA)"
$PY -m pip install -q --no-build-isolation --no-deps -C cmake.define.EXPERTACT_CUDA=$CUDA . > "$OUTDIR/pip-install.log" 2>&1 ||
  { tail -30 "$OUTDIR/pip-install.log"; echo "pip install failed (see $OUTDIR/pip-install.log)"; exit 1; }
echo "== building the C++ benchmark (build/demo)"
mkdir -p build/demo
cmake -S . -B build/demo -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_BUILD_TESTS=OFF \
  -DEXPERTACT_CUDA=$CUDA > "$OUTDIR/configure.log"
cmake --build build/demo -j "$(nproc)" > "$OUTDIR/build.log"

echo "== python -m expertact.bench (progress on stderr)"
(cd /tmp && $PY -m expertact.bench --json "$OUTDIR/bench.json" --markdown "$OUTDIR/bench.md")
if [ $gpu = 1 ]; then
  echo "== C++ GPU benchmark"
  ./build/demo/bench/expertact_gpu_bench --json "$OUTDIR/gpu_bench.json" | tee "$OUTDIR/gpu_bench.md"
else
  echo "== C++ CPU benchmark"
  ./build/demo/bench/expertact_cpu_bench --json "$OUTDIR/cpu_bench.json" | tee "$OUTDIR/cpu_bench.md"
fi
echo "== results in $OUTDIR/"
