#!/usr/bin/env bash
# One call on a GPU machine: build (CUDA on, sm_90), C++ tests, sanitizers,
# GPU benchmark, Python package tests and benchmark. Logs and results go to
# $OUT (or ./device-out). Stages: STAGES="build ctest sanitize variants bench python"
# (variants: the tuning harness bench/kernel_variants.cu, sections in $VARIANTS;
# it runs right after the build, before ctest, so its numbers come back first).
# ctest also runs the CUDA cases under each EXPERTACT_CUDA_KERNEL choice
# (entries cuda_kernels_rows / _flat / _flat128).
# Without network: .deps/include/dlpack/dlpack.h and .deps/googletest (git-ignored) stand in
# for libdlpack-dev and libgtest-dev.
set -u
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build ctest sanitize bench python"}
JOBS=$(nproc)
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -2
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if has build; then
  log "build googletest"
  if [ -d .deps/googletest ] && [ ! -f /tmp/gtest/lib/cmake/GTest/GTestConfig.cmake ] && [ ! -f /tmp/gtest/lib64/cmake/GTest/GTestConfig.cmake ]; then
    cmake -S .deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF > "$OUT/gtest.log" 2>&1 &&
      ninja -C /tmp/gtest-build -j"$JOBS" install >> "$OUT/gtest.log" 2>&1 || log "googletest build FAILED"
  fi
  log "build expertact"
  cmake -S . -B build-dev -G Ninja -DEXPERTACT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${ARCHS:-90} \
    -DCMAKE_PREFIX_PATH=/tmp/gtest -DEXPERTACT_DLPACK_INCLUDE_DIR=$PWD/.deps/include > "$OUT/build.log" 2>&1 &&
    ninja -C build-dev -j"$JOBS" >> "$OUT/build.log" 2>&1 && log "build ok" || { log "build FAILED"; tail -40 "$OUT/build.log"; exit 1; }
fi

if has variants; then
  log "kernel variants (bench/kernel_variants.cu: ${VARIANTS:-all sections})"
  mkdir -p build-dev && nvcc -O3 -std=c++17 -arch=sm_90 -Iinclude -Isrc -I.deps/include bench/kernel_variants.cu src/core/error.cpp -o build-dev/kernel_variants > "$OUT/variants-build.log" 2>&1 &&
    timeout ${VARIANTS_TIMEOUT:-240} ./build-dev/kernel_variants ${VARIANTS:-} > "$OUT/variants.txt" 2>&1
  rc=$?
  log "variants rc=$rc"
  [ $rc -eq 0 ] || tail -20 "$OUT/variants-build.log"
  cat "$OUT/variants.txt"
fi

if has ctest; then
  log "ctest"
  (cd build-dev && timeout ${CTEST_TIMEOUT:-400} ctest --output-on-failure -j${CTEST_JOBS:-4} > "$OUT/ctest.log" 2>&1)
  log "ctest rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
  grep -E "FAILED|Failed|SKIPPED" "$OUT/ctest.log" | head -40
fi

if has sanitize; then
  for t in memcheck racecheck; do
    log "compute-sanitizer $t"
    for exe in build-dev/tests/cpp/*; do
      [ -x "$exe" ] && [ -f "$exe" ] || continue
      timeout 300 compute-sanitizer --tool $t --error-exitcode 9 "$exe" \
        --gtest_filter="${SANITIZE_FILTER:-All/PresetMatrix.*cuda_swiglu_oai*:All/Views.*cuda*:All/Empty.*cuda*:All/BoundaryValues.*cuda*}" > "$OUT/sanitize-$t-$(basename $exe).log" 2>&1
      log "$t $(basename $exe) rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitize-$t-$(basename $exe).log" | tr '\n' ' ' | cut -c1-200)"
    done
  done
fi

if has bench; then
  log "gpu bench"
  ./build-dev/bench/expertact_gpu_bench ${GPU_BENCH_ARGS:-} --json "$OUT/gpu_bench.json" > "$OUT/gpu_bench.md" 2>&1
  log "gpu bench rc=$?"
  cat "$OUT/gpu_bench.md"
fi

if has python; then
  log "python package: build, pytest, bench (tests/python/run_device.sh)"
  OUT="$OUT" timeout ${PY_TIMEOUT:-420} bash tests/python/run_device.sh ${PY_STAGES:-build test bench} > "$OUT/python.log" 2>&1
  log "python rc=$?"
  tail -60 "$OUT/python.log"
fi
log "done"
# At most 8 files come back from the device: keep results, pack the logs.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz *.log *.txt *.xml *.progress 2>/dev/null; rm -f *.log *.xml *.progress gtest.log; ls)
