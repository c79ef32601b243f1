#!/usr/bin/env bash
# Installs what the tests need, builds the C++ library (and, when nvcc is present, its CUDA
# path for sm_80 and sm_90, so that it keeps compiling), installs the Python package from that
# same build, then runs pytest while one job builds the GoogleTest suite and the benchmarks and
# runs ctest. GPU tests skip cleanly on a machine without one.
#   bash scripts/test.sh            (from the repository root)
# On a machine without a GPU no CUDA code runs, so the CUDA sources are compiled with device
# optimisation off (-Xcicc -O0 -Xptxas -O0): every kernel still compiles and assembles for both
# architectures, in a quarter to a third of the time (EXPERTACT_TEST_DEVICE_OPT=1 compiles them as a
# release does; on a machine with a GPU they always are). This package is then for the tests
# only: `pip install .` builds the library as a release.
#
# Optional test dependencies (DeepSpeed, transformers, TorchTitan, and Megatron-Core in a Python
# 3.12 environment) are installed where missing, each step retried once. A user's run goes on
# without one that cannot be had and ends with one line per test suite it skipped, saying why.
# Under CI (CI=true) a missing Python 3.12 or a failed install fails the run, naming it. Every
# step that fails prints its own log (the end of it) and the command.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
PY=${PYTHON:-python3}
NPROC=$(nproc)
BUILD=${BUILD_DIR:-build/test}
LOGS=$BUILD/logs
mkdir -p "$LOGS"
trap 'echo "FAILED: scripts/test.sh line $LINENO: $BASH_COMMAND (exit $?)" >&2' ERR

ci() { [ "${CI:-}" = true ]; }
has_gpu() { command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; }
SKIPS=()  # "suite: why" of each test suite a user's run leaves out, printed at the end

# step LOG CMD...: CMD with its output in LOG, once more after a pause if it fails (downloads); on
# the second failure the end of LOG is printed and the status is 1.
step() {
  local log=$1 attempt
  shift
  for attempt in 1 2; do
    if "$@" > "$log" 2>&1; then return 0; fi
    echo "   failed (attempt $attempt of 2): $*"
    [ $attempt = 2 ] || sleep "${RETRY_PAUSE:-15}"
  done
  echo "---- the end of $log:"
  tail -40 "$log"
  echo "----"
  return 1
}

# optional NAME SUITES CMD...: install an optional test dependency with step; if it cannot be had,
# CI fails naming it, a user's run records SUITES as skipped.
optional() {
  local name=$1 suites=$2
  shift 2
  echo "== installing $name (for $suites)"
  step "$LOGS/install-$name.log" "$@" && return 0
  if ci; then
    echo "FAILED: CI=true and $name did not install ($LOGS/install-$name.log): $suites would not run" >&2
    exit 1
  fi
  SKIPS+=("$suites: skipped, $name did not install ($LOGS/install-$name.log)")
}

echo "== installing build and test dependencies (where missing)"
if command -v apt-get > /dev/null; then
  if ! dpkg -s libdlpack-dev libgtest-dev > /dev/null 2>&1; then
    step "$LOGS/apt.log" bash -c "$SUDO apt-get update -qq && $SUDO apt-get install -y -qq libdlpack-dev libgtest-dev"
  fi
fi
# The pinned versions that are not installed yet (one Python call instead of a pip call each).
missing=$($PY - <<'EOF'
import importlib.metadata as md
want = {"torch": "2.13.0", "pytest": None, "numpy": None, "cmake": None, "ninja": None, "scikit-build-core": None,
        "deepspeed": "0.19.8", "transformers": "5.17.0", "torchtitan": "0.3.0", "spmd_types": "0.2.3",
        "tyro": "1.0.17", "docstring-parser": "0.18.0", "typeguard": "4.6.1", "torchao": "0.18.0"}
out = []
for name, version in want.items():
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        got = None
    if got is None or (version and got.split("+")[0] != version):
        out.append(name)
print(" ".join(out))
EOF
)
wants() { for n in "$@"; do [[ " $missing " == *" $n "* ]] && return 0; done; return 1; }
# torch 2.13.0 (the CPU build); without a GPU it is enough.
if wants torch pytest numpy cmake ninja scikit-build-core; then
  step "$LOGS/install-base.log" $PY -m pip install -q "torch==2.13.0" pytest numpy cmake ninja scikit-build-core
fi
# DeepSpeed, an optional test dependency: tests/python/test_deepspeed*.py run expertact inside its
# expert-activation registry and AutoEP's experts, and skip without it. Its PyPI release is an sdist
# whose setup.py imports torch (hence --no-build-isolation); DS_BUILD_OPS=0 compiles none of its ops.
# About a minute when not yet installed.
if wants deepspeed; then
  optional deepspeed "the DeepSpeed tests (test_deepspeed*.py, test_bench_autoep.py, test_autoep_example.py)" \
    env DS_BUILD_OPS=0 $PY -m pip install -q --no-build-isolation deepspeed==0.19.8
fi
# Hugging Face transformers, an optional test dependency: tests/python/test_transformers.py checks
# expertact.transformers against transformers' own experts and skips without it.
if wants transformers; then
  optional transformers "the transformers tests (test_transformers.py, test_bench_experts.py, test_examples.py)" \
    $PY -m pip install -q "transformers==5.17.0"
fi
# TorchTitan, an optional test dependency: tests/python/test_torchtitan.py checks expertact.torchtitan
# against TorchTitan's own experts and skips without it. --no-deps with the few packages its model
# code imports (not its trainer's wandb, tensorboard, datasets), so torch stays as it is; its token
# dispatcher imports triton even on the CPU (a CUDA torch brings its own, left in place).
if wants torchtitan spmd_types tyro docstring-parser typeguard; then
  optional torchtitan "the TorchTitan tests (test_torchtitan.py, test_examples.py's TorchTitan loop)" \
    $PY -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 \
    typeguard==4.6.1
fi
# torchao, an optional test dependency: test_autoep_example.py checks on the CPU how its FP8 MoE
# training conversion is wired into AutoEP's experts, and skips without it; --no-deps (it imports torch).
if wants torchao; then
  optional torchao "the torchao wiring test (test_autoep_example.py)" $PY -m pip install -q --no-deps "torchao==0.18.0"
fi
if ! $PY -c "import triton" 2> /dev/null; then
  optional triton "the TorchTitan tests (test_torchtitan.py)" $PY -m pip install -q --no-deps triton==3.9.0
fi

CUDA_FLAGS=""
if ! has_gpu && [ "${EXPERTACT_TEST_DEVICE_OPT:-0}" != 1 ]; then
  CUDA_FLAGS="-Xcicc -O0 -Xptxas -O0"
fi
echo "== configuring (CUDA: ${EXPERTACT_CUDA:-AUTO}; device code: ${CUDA_FLAGS:-optimised})"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA="${EXPERTACT_CUDA:-AUTO}" \
  -DCMAKE_CUDA_FLAGS="$CUDA_FLAGS" -DEXPERTACT_BUILD_TESTS=ON -DEXPERTACT_BUILD_BENCH=ON \
  > "$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log"; exit 1; }
grep "expertact:" "$BUILD/configure.log" || true
echo "== building the library"
t=$SECONDS
cmake --build "$BUILD" -j "$NPROC" --target expertact
echo "   built in $((SECONDS - t)) s"

echo "== Python package (a wheel over the same build: the library is not compiled again)"
# scikit-build-core configures the same build folder with the same options and builds only the
# library's target, which is up to date; the wheel (py3-none-<platform>: the binding is ctypes)
# serves this Python and the 3.12 environment below.
rm -rf "$BUILD/wheel"
step "$LOGS/wheel.log" $PY -m pip wheel --no-build-isolation --no-deps -w "$BUILD/wheel" -C build-dir="$BUILD" \
  -C build.targets=expertact -C cmake.define.EXPERTACT_BUILD_TESTS=ON -C cmake.define.EXPERTACT_BUILD_BENCH=ON .
WHEEL=$(ls "$BUILD"/wheel/expertact-*.whl)
step "$LOGS/install-expertact.log" $PY -m pip install -q --no-deps --force-reinstall "$WHEEL"

# Megatron-Core needs Python >= 3.12: its tests run in a 3.12 virtual environment (VENV312, kept)
# whose packages install beside the other tests (about 3.5 minutes of downloads the first time);
# then the package's wheel goes in as a user installs it, with its extra (pip install "...[megatron]").
# Without a GPU the environment takes torch's CPU build (TORCH_CPU_INDEX, about 0.2 GB) rather than
# PyPI's default CUDA build (several GB of CUDA libraries for tests that cannot use them); PyPI's if
# that index cannot be reached.
MEGATRON_SUITES="the Megatron-Core tests (test_megatron.py, test_megatron_example.py)"
if [ -z "${PY312:-}" ]; then  # the first that runs (a pyenv shim on PATH may not)
  for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python python3.12; do
    if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2> /dev/null; then PY312=$c; break; fi
  done
fi
PY312=${PY312:-}
VENV312=${VENV312:-$HOME/.cache/expertact-py312}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ -z "$PY312" ]; then
  if ci; then echo "FAILED: CI=true and no Python 3.12 found (set PY312): $MEGATRON_SUITES would not run" >&2; exit 1; fi
  SKIPS+=("$MEGATRON_SUITES: skipped, no Python 3.12 (set PY312 to one)")
  py312_pid=""
else
  ( set -e
    trap - ERR
    echo "== the Python 3.12 environment $VENV312 ($PY312)"
    [ -x "$VENV312/bin/python" ] || step "$LOGS/py312-venv.log" "$PY312" -m venv "$VENV312"
    if ! "$VENV312/bin/python" -c "import torch" 2> /dev/null; then
      if has_gpu; then
        step "$LOGS/py312-torch.log" "$VENV312/bin/python" -m pip install -q "torch==2.13.0"
      else
        step "$LOGS/py312-torch.log" "$VENV312/bin/python" -m pip install -q --index-url "$TORCH_CPU_INDEX" \
          "torch==2.13.0" ||
          { echo "   $TORCH_CPU_INDEX failed: PyPI's torch"
            step "$LOGS/py312-torch.log" "$VENV312/bin/python" -m pip install -q "torch==2.13.0"; }
      fi
    fi
    "$VENV312/bin/python" -c "import pytest, megatron.core" 2> /dev/null ||
      step "$LOGS/py312-megatron.log" "$VENV312/bin/python" -m pip install -q "megatron-core==0.19.2" pytest numpy
  ) > "$LOGS/py312.log" 2>&1 &
  py312_pid=$!
fi

echo "== pytest; beside it, one job builds the C++ tests and benchmarks and runs ctest"
t=$SECONDS
# The CUDA tuning harness (bench/kernel_variants.cu, built on request only) reads the library's
# internal launchers: compiled here so that a change to them cannot leave it broken.
( cmake --build "$BUILD" -j 1 &&
  { ! cmake --build "$BUILD" --target help | grep -q expertact_kernel_variants ||
    cmake --build "$BUILD" -j 1 --target expertact_kernel_variants; } &&
  ctest --test-dir "$BUILD" --output-on-failure -j 1 ) > "$BUILD/ctest.log" 2>&1 &
ctest_pid=$!
py_rc=0
(cd /tmp && $PY -m pytest -q -p no:cacheprovider "$OLDPWD/tests/python") || py_rc=$?
ct_rc=0
wait $ctest_pid || ct_rc=$?

echo "== $MEGATRON_SUITES in Python 3.12"
mc_rc=0
if [ -n "$py312_pid" ]; then
  wait "$py312_pid" || mc_rc=$?
  if [ $mc_rc = 0 ]; then  # the same wheel, with the extra a user names
    { "$VENV312/bin/python" -m pip uninstall -q -y expertact 2> /dev/null || true
      step "$LOGS/py312-expertact.log" "$VENV312/bin/python" -m pip install -q "$WHEEL[megatron]"; } >> "$LOGS/py312.log" 2>&1 ||
      mc_rc=$?
  fi
  if [ $mc_rc = 0 ]; then
    (cd /tmp && "$VENV312/bin/python" -m pytest -q -p no:cacheprovider "$OLDPWD/tests/python/test_megatron.py" \
      "$OLDPWD/tests/python/test_megatron_example.py") || mc_rc=$?
  else
    echo "   the Python 3.12 environment could not be made: its steps ($LOGS/py312.log):"
    cat "$LOGS/py312.log"
    if ! ci; then SKIPS+=("$MEGATRON_SUITES: skipped, the Python 3.12 environment could not be made ($LOGS/py312.log)"); mc_rc=0; fi
  fi
fi

echo "== the C++ build and ctest ($((SECONDS - t)) s for both sides)"
grep -E "tests passed|tests failed|FAILED|error:" "$BUILD/ctest.log" | head -20 || true
n_skipped=$(grep -c "(Skipped)" "$BUILD/ctest.log" || true)
echo "   ctest: $n_skipped skipped (cases that cannot run here: no GPU, or not this build)"
# Without a GPU every CUDA case (a gtest instance .../cuda..., the cuda_kernels_* entries) must
# report skipped: one counted as passed checks nothing here, and would make CI's count a lie.
if ! has_gpu; then
  gpu_passed=$(grep -E "Test +#[0-9]+: ([^ ]*/cuda[^ ]*|cuda_kernels_[^ ]*) \.+ +Passed" "$BUILD/ctest.log" || true)
  if [ -n "$gpu_passed" ]; then
    echo "FAILED: ctest counted CUDA cases as passed on a machine without a GPU (they cannot run here: they must"
    echo "   report skipped; tests/cpp/CMakeLists.txt, tests/cpp/support/backend.h):"
    echo "$gpu_passed" | head -20
    [ $ct_rc != 0 ] || ct_rc=1
  fi
fi
if [ $ct_rc != 0 ]; then  # (a failed build has none of these lines: its log's end below says why)
  grep -E -A 40 "The following tests FAILED|\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout" "$BUILD/ctest.log" | head -200 || true
  tail -30 "$BUILD/ctest.log"
fi
for line in "${SKIPS[@]+"${SKIPS[@]}"}"; do echo "SKIPPED: $line"; done
[ $py_rc = 0 ] && [ $ct_rc = 0 ] && [ $mc_rc = 0 ] ||
  { echo "FAILED: pytest status $py_rc, C++ build and ctest status $ct_rc, Megatron-Core tests $mc_rc"; exit 1; }
echo "== all tests passed${SKIPS[*]:+ (but for the suites skipped above)}"
