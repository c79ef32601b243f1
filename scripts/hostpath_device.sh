#!/usr/bin/env bash
# The host-path work (issue 9, item 1) on the GPU machine, one command from the repo root:
#
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash scripts/hostpath_device.sh            # about 5 minutes on one H200
#
# Builds the library with its CUDA path (sm_90 only) and the C++ tests; runs ctest (the C
# ABI's 2-D entry points on CUDA, host memory refused in every operand position), the
# Python tests against that build (the eager path against the operators on CUDA, graph
# capture, streams), and bench/host_cost.py --device cuda: us per call at 256 x 128 bf16
# for every layout x weights x in place, beside DeepSpeed's Triton swiglu / swiglu_packed
# (when `import deepspeed.ops.triton_ops.swiglu_triton` works) and eager PyTorch.
# Needs .deps/include/dlpack/dlpack.h and .deps/googletest (git-ignored: carry them).
# Results in $OUT/hostpath: summary.txt, host_cost.txt, host_cost.json, logs.tgz.
# Exit status: 0 when every stage passed. DEVICE=cpu: the same stages on a machine without a
# GPU (a dry run: the CUDA build compiles, its GPU tests skip, the benchmark runs on the CPU).
set -u
DEVICE=${DEVICE:-cuda}
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}/hostpath
mkdir -p "$OUT"
JOBS=$(nproc)
status=0
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
bad() { log "FAILED: $*"; status=1; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import deepspeed, triton; print("deepspeed", deepspeed.__version__, "triton", triton.__version__)' 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$OUT/summary.txt"

log "build googletest + expertact (CUDA, sm_90)"
if [ ! -f /tmp/gtest/lib/cmake/GTest/GTestConfig.cmake ] && [ ! -f /tmp/gtest/lib64/cmake/GTest/GTestConfig.cmake ]; then
  cmake -S .deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF > "$OUT/gtest.log" 2>&1 &&
    ninja -C /tmp/gtest-build -j"$JOBS" install >> "$OUT/gtest.log" 2>&1 || bad "googletest build"
fi
if ! { cmake -S . -B build-hp -G Ninja -DEXPERTACT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DEXPERTACT_BUILD_BENCH=OFF \
         -DCMAKE_PREFIX_PATH=/tmp/gtest -DEXPERTACT_DLPACK_INCLUDE_DIR="$ROOT/.deps/include" > "$OUT/build.log" 2>&1 &&
       ninja -C build-hp -j"$JOBS" >> "$OUT/build.log" 2>&1; }; then
  tail -40 "$OUT/build.log"
  bad "build (build.log)"
  exit 1
fi
log "build ok"

log "ctest"
(cd build-hp && timeout 400 ctest -j4 --output-on-failure > "$OUT/ctest.log" 2>&1) || bad "ctest (ctest.log)"
log "$(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
# The CUDA cases of the new tests must have run, not been skipped.
[ "$DEVICE" = cuda ] && for t in "CudaBuild.HostMemoryInAnyOperandIsRefused" "CAbiErrors.TwoDimensionalDescriptions/cuda" \
         "CAbiRun.StridedSlicesAndByteOffset/cuda_halves_bf16"; do
  grep -E "$t .*Passed" "$OUT/ctest.log" > /dev/null || bad "$t did not pass (skipped?)"
done

export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export EXPERTACT_LIBRARY="$ROOT/build-hp/libexpertact.so"
log "pytest tests/python (the package from python/, the library from build-hp)"
python3 -c "import expertact, torch; assert expertact.has_cuda(); assert torch.cuda.is_available() or '$DEVICE' == 'cpu'
print(expertact.LIBRARY_PATH)" >> "$OUT/summary.txt" 2>&1 || bad "the CUDA build is not the one imported"
timeout 900 python3 -m pytest tests/python -q -rs -p no:cacheprovider > "$OUT/pytest.log" 2>&1 || bad "pytest (pytest.log)"
log "$(tail -1 "$OUT/pytest.log")"
if [ "$DEVICE" = cuda ]; then  # the eager path's CUDA cases ran, none skipped
  python3 -m pytest tests/python/test_eager_path.py -q -rs -p no:cacheprovider -k cuda > "$OUT/pytest_cuda.log" 2>&1 ||
    bad "test_eager_path.py -k cuda (pytest_cuda.log)"
  log "test_eager_path.py -k cuda: $(tail -1 "$OUT/pytest_cuda.log")"
  ! grep -q SKIPPED "$OUT/pytest_cuda.log" || bad "CUDA cases of test_eager_path.py were skipped"
fi

log "host cost (bench/host_cost.py --device $DEVICE)"
timeout 600 python3 bench/host_cost.py --device "$DEVICE" --json "$OUT/host_cost.json" > "$OUT/host_cost.txt" 2> "$OUT/host_cost.log" ||
  bad "host_cost.py (host_cost.log)"
cat "$OUT/host_cost.txt" | tee -a "$OUT/summary.txt"
grep -q "deepspeed swiglu" "$OUT/host_cost.txt" || log "note: DeepSpeed's Triton kernels were not importable (no peer rows)"

log "done: status $status"
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz ./*.log 2>/dev/null && rm -f ./*.log)
exit $status
