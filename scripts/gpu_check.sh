#!/usr/bin/env bash
# Builds, tests and benchmarks expertact on a machine with an NVIDIA GPU, in stages, each of
# which a later call can run alone (the build folder is kept). Results and logs go to
# $OUT/gpu_check/ ($OUT defaults to out/ in the repository, git-ignored; every script of scripts/
# writes its results and logs under the same folder; builds go to build/).
#
#   bash scripts/gpu_check.sh                              # STAGES="build ctest pytest"
#   STAGES="bench mlp fuzz" bash scripts/gpu_check.sh      # then the benchmarks and the fuzzer
#
# Needs: an NVIDIA GPU (sm_80 or newer; sm_90 for the FP8 cases) and its driver; the CUDA toolkit
# (nvcc) with CMake >= 3.24 and Ninja; dlpack.h (libdlpack-dev, or a dlpack/ folder under
# .deps/include) and GoogleTest (libgtest-dev, or its sources in GTEST_SRC, default
# .deps/googletest, built into /tmp/gtest); Python with a CUDA build of torch, pytest and numpy.
# Optional: deepspeed 0.19.8 and triton (the DeepSpeed rows and tests skip without them). No
# network is used.
#
# Stages run in this order, whatever the order given. Times: measured where a date is given
# (H200 = one NVIDIA H200 with 16 cores), else estimated (~):
#   build    the library with its CUDA path (sm_90; ARCHS for others), the C++ tests and
#            benchmarks, in build/gpu (BUILD; incremental when kept from an earlier call). ~1-2
#            minutes on the H200's 16 cores (estimated).
#   ctest    the GoogleTest suite, the kernel-choice entries; fails unless the kernels' CUDA
#            cases ran (CTEST_JOBS, default 4). ~1 minute (46-64 s on a shared 2-core machine,
#            CUDA cases skipped, 2026-12-01).
#   pytest   tests/python, the package from python/ over build/gpu/libexpertact.so; fails
#            unless CUDA cases ran (PYTEST_ARGS adds options). The suite took 202 s on the H200
#            against the wheel (2026-11-30).
#   bench    python -m expertact.bench --peers at the seed size (1,045,081 x 3,072 bf16, every
#            form and layout, beside DeepSpeed's Triton kernels and torch.compile, --repeat 2;
#            BENCH_ARGS replaces these options), then the C++ GPU benchmark (GPU_BENCH_ARGS).
#            ~2-3 minutes: the same at five sizes took 243 s on the H200 (2026-11-30).
#   mlp      python -m expertact.bench --mlp: the expert MLP at the seed's busiest rank
#            (4 experts x 261,280 rows, D = F = 3,072, bf16) (MLP_ARGS adds options). 59 s on the
#            H200 (2026-11-30). Then --mlp --bias (the same with and without GPT-OSS's expert
#            biases, about 110 s on the H200, 2026-12-01) and python -m expertact.bench.bias_kernels
#            (the bias kernels alone, ~20 s).
#   fuzz     the differential fuzzer on CUDA over this build: scripts/reliability_gpu.sh's fuzz
#            stage, FUZZ_SECONDS (default 60) or FUZZ_PROBLEMS per process. 71 s wall for 60 s
#            on the H200 (2026-11-30).
#   sanitize compute-sanitizer over the GPU suites (scripts/sanitize.sh) over this build.
#            243 s wall with the build on the H200 (2026-11-30).
#   wheel    scripts/wheel_check.sh on dist/expertact-*.whl (built elsewhere by
#            scripts/build_wheel.sh): installs it without building, runs pytest against it.
#            209 s on the H200 (2026-11-30).
# scripts/gpu_session.sh runs the measurements the documentation's comparisons rest on.
# Exit status: 0 when every stage run passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
R=$OUT/gpu_check
mkdir -p "$R"
STAGES=${STAGES:-"build ctest pytest"}
BUILD=${BUILD:-$ROOT/build/gpu}
GTEST_SRC=${GTEST_SRC:-$ROOT/.deps/googletest}
JOBS=${JOBS:-$(nproc)}
SEED_SIZE="--rows 1045081 --ffn 3072"
has() { [[ " $STAGES " == *" $1 "* ]]; }
note() { echo "== $(date +%T) $*" | tee -a "$R/summary.txt"; }
status=0
fail() { note "FAILED: $*"; status=1; }
for s in $STAGES; do
  case $s in build | ctest | pytest | bench | mlp | fuzz | sanitize | wheel) ;;
    *) echo "unknown stage '$s' (build ctest pytest bench mlp fuzz sanitize wheel)"; exit 2 ;;
  esac
done
# NVLink multicast stays off (NCCL NVLS, torch symmetric memory, NVSHMEM): shared GPU hosts may not allow it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

# ---- the environment
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo '(no git)') ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  nvcc --version 2>&1 | tail -1
  cmake --version | head -1
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
"gpus", torch.cuda.device_count())' 2>&1
  python3 - <<'EOF' 2>&1 | grep -v "^\["
import importlib, os
for name in ("triton", "deepspeed"):
    try:
        m = importlib.import_module(name)
    except Exception as e:  # a missing peer: its rows and tests skip
        print(f"{name}: not importable ({type(e).__name__})")
        continue
    print(name, getattr(m, "__version__", ""))
EOF
  echo "cores: $(nproc)"
} > "$R/env.txt"
tee -a "$R/summary.txt" < "$R/env.txt"
# The package from the source tree, over the library of this build.
export EXPERTACT_LIBRARY=$BUILD/libexpertact.so
PKG_PATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}

# ---- build
if has build; then
  # GoogleTest: installed (libgtest-dev), or built once from its sources (GTEST_SRC) into /tmp/gtest.
  GTEST_PREFIX=""
  if [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] && [ ! -f /usr/lib/cmake/GTest/GTestConfig.cmake ] &&
     [ ! -f /usr/local/lib/cmake/GTest/GTestConfig.cmake ] && [ -d "$GTEST_SRC" ]; then
    GTEST_PREFIX=/tmp/gtest
    if [ ! -f /tmp/gtest/lib/cmake/GTest/GTestConfig.cmake ] && [ ! -f /tmp/gtest/lib64/cmake/GTest/GTestConfig.cmake ]; then
      note "build GoogleTest ($GTEST_SRC -> /tmp/gtest)"
      { cmake -S "$GTEST_SRC" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF && ninja -C /tmp/gtest-build -j"$JOBS" install; } \
        > "$R/gtest-build.log" 2>&1 || fail "GoogleTest build (gtest-build.log)"
    fi
  fi
  note "build expertact (CUDA on, architectures ${ARCHS:-90}) in $BUILD"
  t=$SECONDS
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA=ON \
       -DCMAKE_CUDA_ARCHITECTURES="${ARCHS:-90}" -DEXPERTACT_BUILD_TESTS=ON -DEXPERTACT_BUILD_BENCH=ON \
       ${GTEST_PREFIX:+-DCMAKE_PREFIX_PATH=$GTEST_PREFIX} ${CMAKE_EXTRA:-} > "$R/build.log" 2>&1 &&
     cmake --build "$BUILD" -j "$JOBS" >> "$R/build.log" 2>&1; then
    grep "expertact:" "$R/build.log" | sort -u | tee -a "$R/summary.txt"
    note "build ok in $((SECONDS - t)) s"
  else
    tail -40 "$R/build.log"
    fail "build (build.log)"
    note "done: status $status"
    exit $status
  fi
fi
need_build() { [ -f "$EXPERTACT_LIBRARY" ] || { fail "$1: no $EXPERTACT_LIBRARY (run the build stage first)"; return 1; }; }

# ---- ctest
if has ctest && need_build ctest; then
  note "ctest -j ${CTEST_JOBS:-4}"
  t=$SECONDS
  (cd "$BUILD" && timeout "${CTEST_TIMEOUT:-400}" ctest --output-on-failure -j "${CTEST_JOBS:-4}") > "$R/ctest.log" 2>&1 ||
    fail "ctest (ctest.log)"
  grep -E "tests passed|tests failed" "$R/ctest.log" | tee -a "$R/summary.txt"
  grep -E "\*\*\*Failed|\*\*\*Timeout|Not Run" "$R/ctest.log" | head -20 | tee -a "$R/summary.txt"
  # The kernels' CUDA cases must have run: they skip where the GPU is not usable.
  n_ran=$(grep -E -c "PresetMatrix\..*/cuda_.* Passed" "$R/ctest.log")
  n_skip=$(grep -E -c "PresetMatrix\..*/cuda_.*Skipped" "$R/ctest.log")
  echo "ctest: PresetMatrix CUDA cases: $n_ran passed, $n_skip skipped;" \
    "all CUDA entries skipped: $(grep -E -c "[Cc]uda.*Skipped" "$R/ctest.log") (OtherDevice needs 2 GPUs)" | tee -a "$R/summary.txt"
  [ "$n_ran" -gt 0 ] && [ "$n_skip" = 0 ] || fail "ctest: the CUDA cases of PresetMatrix did not all run (GPU not usable?)"
  note "ctest: $((SECONDS - t)) s"
fi

# ---- pytest
if has pytest && need_build pytest; then
  note "pytest tests/python ${PYTEST_ARGS:-}"
  t=$SECONDS
  # shellcheck disable=SC2086
  (cd /tmp && PYTHONPATH=$PKG_PATH timeout "${PYTEST_TIMEOUT:-540}" python3 -m pytest "$ROOT/tests/python" -q -rs \
      -p no:cacheprovider --junitxml="$R/pytest.xml" ${PYTEST_ARGS:-}) > "$R/pytest.log" 2>&1 || fail "pytest (pytest.log)"
  tail -1 "$R/pytest.log" | tee -a "$R/summary.txt"
  grep -E "^(FAILED|ERROR)" "$R/pytest.log" | head -20 | tee -a "$R/summary.txt"
  # The library imported must be this build's, with its CUDA path, and CUDA cases must have run.
  python3 - "$R/pytest.xml" "$EXPERTACT_LIBRARY" <<'EOF' 2>&1 | tee -a "$R/summary.txt"
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
cuda = [c for c in cases if "cuda" in (c.get("name", "") + c.get("classname", "")).lower()]
ran = [c for c in cuda if c.find("skipped") is None]
print(f"pytest: {len(cases)} cases; CUDA cases: {len(ran)} ran of {len(cuda)}")
sys.exit(0 if ran else "no CUDA case ran")
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || fail "pytest: no CUDA case ran"
  (cd /tmp && PYTHONPATH=$PKG_PATH python3 -c "import expertact
assert expertact.LIBRARY_PATH == '$EXPERTACT_LIBRARY', expertact.LIBRARY_PATH
assert expertact.has_cuda(), 'no CUDA path'
print('library', expertact.LIBRARY_PATH, '| CUDA path', expertact.has_cuda())") \
    2>&1 | grep -v "^\[" | tee -a "$R/summary.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || fail "pytest: the library imported is not $EXPERTACT_LIBRARY with its CUDA path"
  note "pytest: $((SECONDS - t)) s"
fi

# ---- bench: the activation beside its peers at the seed size, then the C++ GPU benchmark
if has bench && need_build bench; then
  args=${BENCH_ARGS:-"--peers $SEED_SIZE --repeat 2"}
  note "python -m expertact.bench $args"
  t=$SECONDS
  # shellcheck disable=SC2086
  (cd /tmp && PYTHONPATH=$PKG_PATH timeout "${BENCH_TIMEOUT:-480}" python3 -m expertact.bench $args \
      --json "$R/bench.json" --markdown "$R/bench.md") > "$R/bench.log" 2> "$R/bench.progress" ||
    { fail "python -m expertact.bench (bench.progress)"; tail -20 "$R/bench.progress"; }
  cat "$R/bench.log"
  note "python -m expertact.bench: $((SECONDS - t)) s"
  if [ -x "$BUILD/bench/expertact_gpu_bench" ]; then
    note "C++ GPU benchmark (build/gpu/bench/expertact_gpu_bench ${GPU_BENCH_ARGS:-})"
    t=$SECONDS
    # shellcheck disable=SC2086
    timeout "${GPU_BENCH_TIMEOUT:-240}" "$BUILD/bench/expertact_gpu_bench" ${GPU_BENCH_ARGS:-} --json "$R/gpu_bench.json" \
      > "$R/gpu_bench.md" 2>&1 || fail "expertact_gpu_bench (gpu_bench.md)"
    cat "$R/gpu_bench.md"
    note "C++ GPU benchmark: $((SECONDS - t)) s"
  fi
fi

# ---- mlp: the expert MLP at the seed's busiest rank
if has mlp && need_build mlp; then
  note "python -m expertact.bench --mlp ${MLP_ARGS:-}"
  t=$SECONDS
  # shellcheck disable=SC2086
  (cd /tmp && PYTHONPATH=$PKG_PATH timeout "${MLP_TIMEOUT:-300}" python3 -m expertact.bench --mlp ${MLP_ARGS:-} \
      --json "$R/mlp.json" --markdown "$R/mlp.md") > "$R/mlp.log" 2> "$R/mlp.progress" ||
    { fail "python -m expertact.bench --mlp (mlp.progress)"; tail -20 "$R/mlp.progress"; }
  cat "$R/mlp.log"
  note "python -m expertact.bench --mlp: $((SECONDS - t)) s"
  # The expert biases: the MLP with and without them, then their kernels alone (docs/BENCHMARKS.md,
  # "Expert biases (GPT-OSS) in the expert MLP")
  t=$SECONDS
  (cd /tmp && PYTHONPATH=$PKG_PATH timeout "${MLP_TIMEOUT:-300}" python3 -m expertact.bench --mlp --bias \
      --json "$R/mlp-bias.json" --markdown "$R/mlp-bias.md" &&
    PYTHONPATH=$PKG_PATH python3 -m expertact.bench.bias_kernels --json "$R/bias-kernels.json") \
    > "$R/mlp-bias.log" 2> "$R/mlp-bias.progress" ||
    { fail "python -m expertact.bench --mlp --bias / bench.bias_kernels (mlp-bias.progress)"; tail -20 "$R/mlp-bias.progress"; }
  cat "$R/mlp-bias.log"
  note "the expert biases' benchmarks: $((SECONDS - t)) s"
fi

# ---- fuzz, sanitize, wheel: their own scripts, over this build
if has fuzz && need_build fuzz; then
  note "fuzzer: STAGES=fuzz FUZZ_SECONDS=${FUZZ_SECONDS:-60} bash scripts/reliability_gpu.sh"
  OUT=$OUT STAGES=fuzz FUZZ_SECONDS=${FUZZ_SECONDS:-60} FUZZ_LIB=$EXPERTACT_LIBRARY bash scripts/reliability_gpu.sh \
    > "$R/fuzz.log" 2>&1 || fail "fuzzer ($OUT/reliability/summary.txt)"
  grep -E "FUZZ GPU TOTAL|^# " "$OUT/reliability/summary.txt" 2>/dev/null | tee -a "$R/summary.txt"
fi
if has sanitize && need_build sanitize; then
  note "compute-sanitizer: bash scripts/sanitize.sh"
  OUT=$OUT SAN_BUILD=0 BUILD=$BUILD bash scripts/sanitize.sh > "$R/sanitize.log" 2>&1 ||
    fail "sanitizers ($OUT/sanitize/summary.txt)"
  tail -1 "$OUT/sanitize/summary.txt" 2>/dev/null | tee -a "$R/summary.txt"
fi
if has wheel; then
  note "wheel: bash scripts/wheel_check.sh"
  OUT=$OUT bash scripts/wheel_check.sh > "$R/wheel.log" 2>&1 || fail "wheel check ($OUT/wheel/summary.txt)"
  tail -1 "$OUT/wheel/summary.txt" 2>/dev/null | tee -a "$R/summary.txt"
fi

note "done: status $status"
exit $status
