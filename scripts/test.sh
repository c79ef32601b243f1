#!/usr/bin/env bash
# Installs what the tests need, builds the C++ core (and, when nvcc is present, the
# CUDA path for sm_80 and sm_90, so that it keeps compiling), runs the GoogleTest suite,
# installs the Python package and runs pytest. GPU tests skip cleanly on a machine without one.
#   bash scripts/test.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
PY=${PYTHON:-python3}

echo "== installing build and test dependencies"
if command -v apt-get > /dev/null; then
  if ! dpkg -s libdlpack-dev libgtest-dev > /dev/null 2>&1; then
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq libdlpack-dev libgtest-dev > /dev/null
  fi
fi
# torch 2.13.0 (a no-op where it is installed); without a GPU the CPU build is enough.
$PY -m pip install -q "torch==2.13.0" pytest numpy cmake ninja scikit-build-core
# DeepSpeed, an optional test dependency: tests/python/test_deepspeed_registry.py runs expertact inside
# its expert-activation registry and skips without it. Its PyPI release is an sdist whose setup.py
# imports torch (hence --no-build-isolation); DS_BUILD_OPS=0 compiles none of its ops. About a
# minute when not yet installed (download 19 s, build 46 s on a shared 2-core machine).
DS_BUILD_OPS=0 $PY -m pip install -q --no-build-isolation deepspeed==0.19.8
# Hugging Face transformers, an optional test dependency: tests/python/test_transformers.py checks
# expertact.transformers against transformers' own experts and skips without it.
$PY -m pip install -q "transformers==5.17.0"
# TorchTitan, an optional test dependency: tests/python/test_torchtitan.py checks expertact.torchtitan
# against TorchTitan's own experts and skips without it. --no-deps with the few packages its model
# code imports (not its trainer's wandb, tensorboard, datasets), so torch stays as it is; its token
# dispatcher imports triton even on the CPU (a CUDA torch brings its own, left in place).
# About 20 s cold (triton's wheel is 286 MB).
$PY -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
$PY -c "import triton" 2> /dev/null || $PY -m pip install -q --no-deps triton==3.9.0

BUILD=${BUILD_DIR:-build/test}
echo "== configuring (CUDA: ${EXPERTACT_CUDA:-AUTO})"
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA="${EXPERTACT_CUDA:-AUTO}" \
  -DEXPERTACT_BUILD_TESTS=ON -DEXPERTACT_BUILD_BENCH=ON > "$BUILD/configure.log" 2>&1 || {
  cat "$BUILD/configure.log"; exit 1; }
grep "expertact:" "$BUILD/configure.log" || true
echo "== building"
cmake --build "$BUILD" -j "$(nproc)"
# The CUDA tuning harness (bench/kernel_variants.cu, built on request only) reads the library's
# internal launchers: compiled here so that a change to them cannot leave it broken.
if cmake --build "$BUILD" --target help | grep -q expertact_kernel_variants; then
  cmake --build "$BUILD" -j "$(nproc)" --target expertact_kernel_variants
fi
echo "== C++ tests (GoogleTest via ctest)"
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)"

echo "== Python package"
# The C++ build above already compiled (and so checked) the CUDA sources; the
# package is built CPU-only here unless EXPERTACT_PIP_CUDA=AUTO or ON.
CMAKE_ARGS="-DEXPERTACT_CUDA=${EXPERTACT_PIP_CUDA:-OFF}" $PY -m pip install -q --no-build-isolation --no-deps .
echo "== Python tests (pytest)"
(cd /tmp && $PY -m pytest -q -p no:cacheprovider "$OLDPWD/tests/python")
