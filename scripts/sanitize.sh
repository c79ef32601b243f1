#!/usr/bin/env bash
# The GPU test suite under compute-sanitizer, in one call on a GPU machine: every CUDA test
# of the GoogleTest binary under memcheck, racecheck, initcheck and synccheck (sharded, all
# shards at once), and the CUDA part of pytest under each tool. 243 s wall with the build on
# an H200 (2026-11-30; docs/reliability.md), each process under a SAN_TIMEOUT of 450 s. Results in $OUT/sanitize ($OUT defaults to out/ in the
# repository): summary.txt (versions, then one line per tool and shard with its ERROR SUMMARY
# and test counts), logs.tgz.
#
#   bash scripts/sanitize.sh                        # build (scripts/gpu_check.sh's build stage), then all
#   SAN_BUILD=0 bash scripts/sanitize.sh            # over the build already in build/gpu (BUILD)
#   SAN_TOOLS="memcheck initcheck" SAN_PARTS=ctest bash scripts/sanitize.sh
#
# Needs what scripts/gpu_check.sh's build stage needs (its header), and compute-sanitizer (the
# CUDA toolkit's). The
# Python package is used from the source tree (PYTHONPATH=python) over build/gpu/libexpertact.so
# (EXPERTACT_LIBRARY): no second CUDA build.
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
S=$OUT/sanitize
L=$S/logs
mkdir -p "$L"
TOOLS=${SAN_TOOLS:-"memcheck racecheck initcheck synccheck"}
PARTS=${SAN_PARTS:-"ctest pytest"}
LIMIT=${SAN_TIMEOUT:-450}  # seconds for one sanitizer process (a killed one reads TIMEOUT)
BUILD=${BUILD:-$ROOT/build/gpu}
BIN=$BUILD/tests/cpp/expertact_tests
LIB=$BUILD/libexpertact.so
CS=$(command -v compute-sanitizer || true)
for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
  [ -z "$CS" ] && [ -x "$d/compute-sanitizer" ] && CS=$d/compute-sanitizer
done
[ -n "$CS" ] || { echo "compute-sanitizer not found"; exit 1; }
SUM=$S/summary.txt
T0=$(date +%s)

if [ "${SAN_BUILD:-1}" = 1 ]; then
  echo "== build (scripts/gpu_check.sh, STAGES=build)"
  OUT="$S/build" BUILD=$BUILD STAGES=build bash scripts/gpu_check.sh > "$L/build.log" 2>&1 ||
    { echo "BUILD FAILED"; tail -40 "$L/build.log"; exit 1; }
  rm -rf "$S/build"
fi
[ -x "$BIN" ] && [ -f "$LIB" ] || { echo "missing $BIN or $LIB"; exit 1; }

{
  echo "# compute-sanitizer sweep: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)" \
       "($(git status --porcelain 2>/dev/null | wc -l) changed files)"
  echo "# $("$CS" --version | tail -1)"
  echo "# GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "# nvcc: $(nvcc --version 2>/dev/null | tail -1)"
  echo "# $(python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)"
} > "$SUM"

pids=()
names=()
# run NAME CMD...: one sanitizer process in the background, its output in $L/NAME.log
run() {
  local name=$1
  shift
  ( timeout -k 15 "$LIMIT" "$@" > "$L/$name.log" 2>&1; echo $? > "$L/$name.rc" ) &
  pids+=($!)
  names+=("$name")
}

# Kernel choices (EXPERTACT_CUDA_KERNEL, read once per process) where the library reads the
# variable: rows under every tool; flat under memcheck and initcheck (the flat
# kernels use no shared memory and no warp shuffles, which is what racecheck and synccheck
# check). Without the variable in the library: the one build as it is.
KERNELS=${SAN_KERNELS:-"rows flat"}
grep -aq EXPERTACT_CUDA_KERNEL "$LIB" || KERNELS=rows
tools_for() {  # the tools to run under kernel choice $1
  local t out=""
  for t in $TOOLS; do
    if [ "$1" = rows ] || [ "$t" = memcheck ] || [ "$t" = initcheck ]; then out="$out $t"; fi
  done
  echo $out
}

# ---- GoogleTest: the CUDA instances (names with cuda/Cuda; OtherDevice needs 2 GPUs and
# skips on one). Shards by GTEST_TOTAL_SHARDS/GTEST_SHARD_INDEX, all at once.
GT_FILTER='*cuda*:*Cuda*:OtherDevice.*'
if [[ " $PARTS " == *" ctest "* ]]; then
  for k in $KERNELS; do
    for tool in $(tools_for "$k"); do
      filter=$GT_FILTER
      # LargeOffsets maps a 8.6 / 17 GB cudaMalloc to touch a few pages of it (row offsets past
      # 2^31 elements); initcheck tracks the initialization of every byte of an allocation, so
      # the test measures the tool there. It runs under memcheck, racecheck and synccheck.
      [ "$tool" = initcheck ] && filter="$filter-*LargeOffsets*"
      n=2
      [ "$k" = rows ] || n=1
      for ((i = 0; i < n; i++)); do
        # EXPERTACT_NUM_THREADS=1: the tests' CPU peer runs in each of ~20 processes at once.
        run "gtest-$k-$tool-$i" env GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i EXPERTACT_NUM_THREADS=1 \
          EXPERTACT_CUDA_KERNEL=$k "$CS" --tool "$tool" --error-exitcode 9 --print-limit 100 "$BIN" \
          --gtest_filter="$filter" --gtest_brief=1
      done
    done
  done
fi

# ---- pytest, CUDA part. memcheck, racecheck and synccheck instrument expertact's kernels only
# (--kernel-name kns=expertact: every kernel of the library is in namespace expertact); initcheck
# instruments all kernels, since a filter would leave torch's writes untracked and report
# expertact's reads of them as uninitialized. PYTORCH_NO_CUDA_MEMORY_CACHING=1 (memcheck,
# initcheck) gives every tensor its own cudaMalloc, so an access past a tensor (the fuzzer's
# buffers end where its views end) is out of bounds for memcheck and never-written bytes are
# fresh for initcheck; graph capture and the OOM tests need the caching allocator: a memcheck
# job of their own. racecheck and synccheck track no global memory: one job each, caching on.
# Under flat: the fuzzer under memcheck (test_fuzz_cuda). Files: those that run the
# activation (ACT), and with the kernel filter also expertact's DeepSpeed names and the expert
# MLP (its GEMMs are torch's, uninstrumented); not the benchmarks, nor DeepSpeed's own Triton
# kernels (test_deepspeed_registry), nor under initcheck the GEMM libraries' kernels.
if [[ " $PARTS " == *" pytest "* ]]; then
  export PYTHONPATH=$ROOT/python:$ROOT/tests/python${PYTHONPATH:+:$PYTHONPATH}
  export EXPERTACT_LIBRARY=$LIB
  ACT=()
  for f in functional autograd cuda cuda_reliability errors fuzz; do ACT+=(tests/python/test_$f.py); done
  MORE=("${ACT[@]}")
  for f in deepspeed moe; do [ -f tests/python/test_$f.py ] && MORE+=(tests/python/test_$f.py); done
  PY=(python3 -m pytest -q -p no:cacheprovider -rfE)
  # Left out under every tool: tests of allocation behaviour rather than of results, which
  # fail under compute-sanitizer and pass without it (docs/reliability.md): the
  # in-place gradient of a leaf aliasing its input (AccumulateGrad copied it under the tool;
  # cause not found), the OOM case whose in-place backward must fit under a memory cap (under
  # the tool it asked for 2 GiB more: the same copy of the gradient, it seems), and the
  # kept-memory counts of the expert MLP (memory_allocated).
  NOT_ALLOC="not leaf_gradient_needs_no_copy and not oom_inplace_backward_fits and not kept_memory"
  K_NOCACHE="cuda and not compile and not graph and not oom and not sync and not reach and not memory and $NOT_ALLOC"
  K_ALL="cuda and not compile and not reach and $NOT_ALLOC"
  # racecheck and initcheck: the fuzzer's activation problems only. Its expert-MLP problems run
  # torch._grouped_mm (CUTLASS, TMA): racecheck failed on it with "failed to handle a hardware
  # exception" and initcheck reported uninitialized reads inside it; both are torch's kernel.
  GLU_ONLY=(EXPERTACT_FUZZ_KINDS=glu)
  CSP=("$CS" --error-exitcode 9 --print-limit 100 --target-processes all)
  NOCACHE=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 EXPERTACT_FUZZ_CUDA_SECONDS=${SAN_FUZZ_SECONDS:-60})
  for k in $KERNELS; do
    for tool in $(tools_for "$k"); do
      filt=(--kernel-name kns=expertact)
      [ "$tool" = initcheck ] && filt=()
      if [ "$k" != rows ]; then
        [ "$tool" = memcheck ] && run "pytest-$k-memcheck-fuzz" "${NOCACHE[@]}" EXPERTACT_CUDA_KERNEL=$k \
          "${CSP[@]}" --tool memcheck "${filt[@]}" "${PY[@]}" tests/python/test_fuzz.py -k fuzz_cuda
        continue
      fi
      case $tool in
        memcheck)
          run "pytest-memcheck" "${NOCACHE[@]}" EXPERTACT_CUDA_KERNEL=rows "${CSP[@]}" --tool memcheck "${filt[@]}" \
            "${PY[@]}" "${MORE[@]}" -k "$K_NOCACHE"
          run "pytest-memcheck-graphs-oom" env EXPERTACT_CUDA_KERNEL=rows "${CSP[@]}" --tool memcheck "${filt[@]}" \
            "${PY[@]}" tests/python/test_cuda.py tests/python/test_cuda_reliability.py -k "(graph or oom or sync) and $NOT_ALLOC" ;;
        initcheck)
          run "pytest-initcheck" "${NOCACHE[@]}" "${GLU_ONLY[@]}" EXPERTACT_CUDA_KERNEL=rows EXPERTACT_FUZZ_CUDA_SECONDS=30 \
            "${CSP[@]}" --tool initcheck "${PY[@]}" "${ACT[@]}" -k "$K_NOCACHE" ;;
        *)
          if [ "$tool" = racecheck ]; then files=("${ACT[@]}"); kinds=("${GLU_ONLY[@]}"); else files=("${MORE[@]}"); kinds=(); fi
          run "pytest-$tool" env "${kinds[@]}" EXPERTACT_CUDA_KERNEL=rows EXPERTACT_FUZZ_CUDA_SECONDS=30 "${CSP[@]}" --tool "$tool" \
            "${filt[@]}" "${PY[@]}" "${files[@]}" -k "$K_ALL" ;;
      esac
    done
  done
fi

echo "== ${#pids[@]} sanitizer processes, up to ${LIMIT}s each: ${names[*]}"
for p in "${pids[@]}"; do wait "$p"; done

# ---- summary: one line per process
bad=0
for name in "${names[@]}"; do
  log=$L/$name.log
  rc=$(cat "$L/$name.rc" 2>/dev/null || echo "?")
  errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$log" | tail -1)
  tests=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]|^[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s' "$log" |
    tail -3 | tr '\n' ' ')
  state=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then state=TIMEOUT; fi
  if [ "$rc" != 0 ] && [ $state = ok ]; then state="rc=$rc"; fi
  # racecheck prints "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)" instead
  # (pytest's process: one per target process; every one must say 0 errors)
  if [ -z "$errs" ] && grep -q 'RACECHECK SUMMARY' "$log"; then
    if grep -E 'RACECHECK SUMMARY' "$log" | grep -vq '(0 errors, 0 warnings)'; then
      errs="RACECHECK: hazards reported"
    else
      errs="RACECHECK SUMMARY: 0 errors"
    fi
  fi
  [ -z "$errs" ] && errs="ERROR SUMMARY: (none printed)"
  [ "$state" != ok ] || [[ "$errs" != *" 0 errors"* ]] && bad=$((bad + 1))
  printf '%-26s %-8s %-28s %s\n' "$name" "$state" "$errs" "$tests" >> "$SUM"
  if [[ "$errs" != *" 0 errors"* ]]; then
    # what was reported (headlines: "Invalid __global__ read ...", "Program hit ... on CUDA API
    # call to ...") and where (the kernels after "at"), most frequent first
    # (a report can start on a line that pytest's progress dots began: not anchored at the start)
    grep -Eo '========= [^ ].*|=========     at .*' "$log" |
      grep -Ev 'COMPUTE-SANITIZER|ERROR SUMMARY|Target application|Saved host backtrace|Host Frame' |
      sed -e 's/^=========  *//' -e 's/0x[0-9a-f]*/0x../g' | cut -c1-170 | sort | uniq -c | sort -rn |
      head -8 | sed "s/^/    $name: /" >> "$SUM"
  fi
done
echo "# $( [ $bad = 0 ] && echo "ALL CLEAN: every process 0 errors, exit 0" || echo "$bad PROCESSES WITH ERRORS, FAILURES OR TIMEOUTS")," \
     "$(( $(date +%s) - T0 ))s wall" >> "$SUM"
cat "$SUM"
(cd "$S" && tar czf logs.tgz -C "$S" logs && rm -rf logs)
[ $bad = 0 ]
