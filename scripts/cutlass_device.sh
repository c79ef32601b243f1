#!/usr/bin/env bash
# Issue 12 on a Hopper GPU in one command: the fused grouped GEMMs (docs/fused-gemm.md) checked
# first (C++ against float64, pytest against the reference and the unfused kernels), then, only
# if correct, timed at the busiest rank's shape (4 experts x 261,280 rows, D = F = 3,072, bf16).
#
#   here, no GPU needed:  bash scripts/cutlass_device.sh pack
#       builds libexpertact.so (CUDA sm_90 + the CUTLASS kernels, sm_90a) and the C++ test
#       binaries, and copies them to .deps/cutlass-dev/ (git-ignored: carry it). The 8 CUTLASS
#       kernels take 4-5 minutes at -j2 here: the device never compiles.
#   on the GPU machine:   bash scripts/cutlass_device.sh        (carry: .deps/cutlass-dev)
#       stages env gtest pytest kernels mlp (STAGES="..." to pick), for the schedules in
#       $SCHEDULES (default "pingpong cooperative"); results in $OUT/cutlass: summary.txt,
#       kernels.json and mlp.json (keyed by schedule), mlp.md, logs.tgz (gtest.log,
#       pytest.xml, the stages' logs).
#   fallback, if the carried library does not load there: carry .deps/cutlass/include (the
#       CUTLASS headers, 27 MB: cp -r <site-packages>/cutlass_library/source/include) and .deps/include
#       (dlpack) and run STAGES="build env gtest pytest kernels mlp" (builds on the device's cores).
#
# Expected on the GPU: about 4 minutes (env 10 s, gtest 2 x 15 s, pytest 60 s, kernels 2 x 20 s,
# mlp 60 s + 30 s); it stops after the correctness stages if they fail (FORCE_BENCH=1 times
# anyway). Each stage writes its results as it ends: a run cut short keeps what it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PACK=${PACK:-$ROOT/.deps/cutlass-dev}
# What the library is built from: a hash of the sources (the device's copy of the tree may
# have no .git), so that a library packed from another tree is refused, not tested.
sources_hash() { find src include CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16; }

if [ "${1:-}" = "pack" ]; then
  BUILD=${BUILD_DIR:-$ROOT/build/cutlass-pack}
  set -e
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA=ON -DEXPERTACT_CUTLASS=ON \
    -DEXPERTACT_CUTLASS_SCHEDULES="${PACK_SCHEDULES:-cooperative;pingpong64}" -DEXPERTACT_FUSED_PROBES=ON -DEXPERTACT_BUILD_TESTS=ON -DEXPERTACT_BUILD_BENCH=OFF \
    ${PACK_CMAKE_ARGS:-} | grep "expertact:"
  cmake --build "$BUILD" -j "${JOBS:-2}"
  rm -rf "$PACK" && mkdir -p "$PACK"
  cp "$BUILD/libexpertact.so" "$BUILD/tests/cpp/expertact_tests" "$BUILD/tests/cpp/expertact_gemm_layout_tests" "$PACK/"
  # The test binaries use the shared CUDA runtime (the library links it statically): carried too.
  cp -L "$(ldd "$PACK/expertact_tests" | awk '/libcudart/ {print $3}')" "$PACK/"
  { echo "sources $(sources_hash)"; echo "commit $(git rev-parse HEAD)";
    echo "uncommitted files: $(git status --porcelain -- src include CMakeLists.txt | wc -l)";
    echo "built $(date -u +%FT%TZ) on $(hostname) with $(nvcc --version | tail -1)"; } > "$PACK/BUILD_INFO"
  du -sh "$PACK"
  cat "$PACK/BUILD_INFO"
  exit 0
fi

OUT=${OUT:-$ROOT/device-out}
R="$OUT/cutlass"
mkdir -p "$R"
STAGES=${STAGES:-"env gtest pytest kernels ncu mlp"}
# The schedules to test and time (the carried library must have them; the first is its default).
SCHEDULES=${SCHEDULES:-"cooperative pingpong64"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
note() { echo "== $(date +%T) $*" | tee -a "$R/summary.txt"; }
status=0
correct=1

if has build; then
  note "build on this machine (CUTLASS from ${EXPERTACT_CUTLASS_DIR:-$ROOT/.deps/cutlass/include})"
  BUILD=$ROOT/build/cutlass-device
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA=ON -DEXPERTACT_CUTLASS=ON \
      -DEXPERTACT_CUTLASS_DIR="${EXPERTACT_CUTLASS_DIR:-$ROOT/.deps/cutlass/include}" \
      -DEXPERTACT_DLPACK_INCLUDE_DIR="$ROOT/.deps/include" -DCMAKE_CUDA_ARCHITECTURES=90-real \
      -DEXPERTACT_CUTLASS_SCHEDULES="pingpong;cooperative" \
      -DEXPERTACT_BUILD_BENCH=OFF > "$R/build.log" 2>&1 && cmake --build "$BUILD" -j "$(nproc)" >> "$R/build.log" 2>&1; then
    mkdir -p "$PACK"
    cp "$BUILD/libexpertact.so" "$BUILD/tests/cpp/expertact_tests" "$BUILD/tests/cpp/expertact_gemm_layout_tests" "$PACK/" 2>/dev/null
    note "build ok"
  else
    tail -30 "$R/build.log"; note "BUILD FAILED"; exit 1
  fi
fi

export EXPERTACT_LIBRARY="$PACK/libexpertact.so"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$PACK${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f "$EXPERTACT_LIBRARY" ] || { note "no $EXPERTACT_LIBRARY: run 'bash scripts/cutlass_device.sh pack' first and carry .deps/cutlass-dev"; exit 1; }

if has env; then
  note "environment"
  packed=$(awk '/^sources / {print $2}' "$PACK/BUILD_INFO" 2>/dev/null)
  if [ "$packed" != "$(sources_hash)" ] && [ "${FORCE_PACK:-0}" != 1 ]; then
    note "THE CARRIED LIBRARY WAS BUILT FROM OTHER SOURCES (packed $packed, tree $(sources_hash)): run 'bash scripts/cutlass_device.sh pack' on this tree"
    exit 1
  fi
  {
    cat "$PACK/BUILD_INFO" 2>/dev/null
    echo "tree: commit $(git rev-parse HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    (cd /tmp && python3 - <<'EOF'
import torch, expertact
from expertact import _capi
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print("expertact", expertact.__version__, "from", _capi.LIBRARY_PATH, "| CUDA path", _capi.has_cuda(),
      "| fused GEMMs", _capi.has_fused_gemm())
assert _capi.has_fused_gemm(), "the carried library has no fused GEMMs"
assert torch.cuda.get_device_capability() == (9, 0), "not a Hopper GPU"
EOF
    )
  } 2>&1 | tee -a "$R/summary.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { note "ENVIRONMENT NOT USABLE"; exit 1; }
fi

if has gtest; then
  note "C++: layout proofs, refusals, the kernels against float64 (expertact_tests --gtest_filter=*Moe*)"
  "$PACK/expertact_gemm_layout_tests" > "$R/gtest.log" 2>&1 || { note "LAYOUT PROOFS FAILED"; correct=0; }
  for sched in $SCHEDULES; do
    echo "=== EXPERTACT_FUSED_SCHEDULE=$sched" >> "$R/gtest.log"
    EXPERTACT_FUSED_SCHEDULE=$sched timeout 300 "$PACK/expertact_tests" --gtest_filter='*Moe*' >> "$R/gtest.log" 2>&1 ||
      { note "C++ TESTS FAILED ($sched)"; correct=0; }
  done
  grep -E "^=== |^\[  (PASSED|FAILED) |FAILED  \]|Failure" "$R/gtest.log" | head -40 | tee -a "$R/summary.txt"
  # The kernel cases must have run: a skip here means no GPU or no fused GEMM in the library.
  if grep -q "SKIPPED \] All/MoeFused" "$R/gtest.log"; then note "C++ KERNEL CASES SKIPPED"; correct=0; fi
fi

if has pytest; then
  note "pytest tests/python/test_moe_fused.py (the CUDA cases)"
  (cd /tmp && timeout ${TEST_TIMEOUT:-400} python3 -m pytest "$ROOT/tests/python/test_moe_fused.py" -k cuda -q -rs \
      -p no:cacheprovider --junitxml="$R/pytest.xml") > "$R/pytest.log" 2>&1
  rc=$?
  tail -15 "$R/pytest.log" | tee -a "$R/summary.txt"
  python3 - "$R/pytest.xml" <<'EOF' | tee -a "$R/summary.txt"
import sys, xml.etree.ElementTree as ET
cases = [c for c in ET.parse(sys.argv[1]).getroot().iter("testcase") if "cuda" in c.get("name", "")]
ran = [c for c in cases if c.find("skipped") is None]
print(f"CUDA cases: {len(ran)} ran of {len(cases)}")
sys.exit(0 if cases and len(ran) == len(cases) else 1)
EOF
  [ "${PIPESTATUS[0]}" -eq 0 ] || { note "CUDA CASES DID NOT ALL RUN"; correct=0; }
  [ $rc -eq 0 ] || { note "PYTEST FAILED (rc $rc)"; correct=0; }
fi

[ $correct -eq 1 ] || status=1
if [ $correct -eq 0 ] && [ "${FORCE_BENCH:-0}" != 1 ]; then
  note "not timing: the correctness stages failed (FORCE_BENCH=1 to time anyway)"
  STAGES=""
fi

# PROBES: the epilogue parts left out (a library packed with EXPERTACT_FUSED_PROBES, as
# 'pack' builds it): none (the real kernels), gemm (no epilogue work: the GEMM's own cost),
# nostore (loads and math, no stores). Differences between them place the epilogue's time.
PROBES=${PROBES:-"none gemm nostore"}
if has kernels; then
  for sched in $SCHEDULES; do
    for probe in $PROBES; do
      note "kernels alone ($sched, probe $probe): python -m expertact.bench_fused (fused vs torch._grouped_mm)"
      pe=$probe; [ "$probe" = none ] && pe=""
      (cd /tmp && EXPERTACT_FUSED_PROBE=$pe EXPERTACT_FUSED_SCHEDULE=$sched timeout ${KERNELS_TIMEOUT:-120} \
          python3 -m expertact.bench_fused --json "$R/kernels-$sched-$probe.json") > "$R/kernels-$sched-$probe.log" 2>&1 ||
        { status=1; note "KERNEL BENCH FAILED ($sched, $probe)"; }
      tail -4 "$R/kernels-$sched-$probe.log" | tee -a "$R/summary.txt"
    done
  done
fi

# Nsight Compute on the fused kernels (NCU_KERNELS: a regex over demangled names; "Glu": the
# fused forward twice, then the backward) on a smaller problem (--rows NCU_ROWS): throughput,
# warp stalls, issue slots, the SASS lines stalled most (clocks left alone: --clock-control none).
if has ncu; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for sched in ${NCU_SCHEDULES:-$SCHEDULES}; do
    note "ncu ($sched) on bench_fused --rows ${NCU_ROWS:-32768}"
    (cd /tmp && EXPERTACT_FUSED_SCHEDULE=$sched timeout ${NCU_TIMEOUT:-150} "$NCU" --clock-control none \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats \
        --section MemoryWorkloadAnalysis ${NCU_EXTRA:---section SourceCounters} \
        --kernel-name-base demangled -k regex:"${NCU_KERNELS:-device_kernel.*Glu}" --launch-count "${NCU_COUNT:-3}" \
        python3 -m expertact.bench_fused --rows "${NCU_ROWS:-32768}" --iters 1 --warmup 0) > "$R/ncu-$sched.log" 2>&1 ||
      note "ncu failed ($sched, rc $?)"
    grep -E "device_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Stall|Issued Ipc|No Eligible|Registers Per" \
      "$R/ncu-$sched.log" | cut -c1-150 | head -60 >> "$R/summary.txt"
  done
fi

# The whole MLP: the default schedule with the unfused rows beside it, then the fused rows
# again under each other schedule built.
first=1
for sched in $SCHEDULES; do
  has mlp || break
  if [ $first -eq 1 ]; then
    IMPLS=${IMPLS:-gemms,expertact,expertact-inplace,fused,fused-inplace,fused-recompute-inplace}
  else
    IMPLS=${IMPLS_OTHER:-gemms,fused,fused-inplace}
  fi
  note "($sched) python -m expertact.bench_mlp --layout ${LAYOUT:-interleaved} --impls $IMPLS ${MLP_ARGS:-}"
  # shellcheck disable=SC2086
  (cd /tmp && EXPERTACT_FUSED_SCHEDULE=$sched timeout ${MLP_TIMEOUT:-240} python3 -m expertact.bench_mlp \
      --layout "${LAYOUT:-interleaved}" --impls "$IMPLS" ${MLP_ARGS:-} --json "$R/mlp-$sched.json" \
      --markdown "$R/mlp-$sched.md") > "$R/mlp-$sched.log" 2> "$R/mlp-$sched.progress"
  rc=$?
  grep -E "^(gemms|expertact|fused)|PASS|FAIL|measured" "$R/mlp-$sched.log" | tee -a "$R/summary.txt"
  [ $rc -eq 0 ] || { status=1; note "MLP BENCH FAILED ($sched, rc $rc)"; tail -20 "$R/mlp-$sched.progress"; }
  first=0
  unset IMPLS
done

note "done: status $status"
# At most 8 files come back: one JSON per benchmark (keyed by schedule), one markdown, the
# summary, the rest packed.
(cd "$R" && python3 - <<'EOF'
import glob, json, os
for kind in ("kernels", "mlp"):
    parts = {}
    for path in sorted(glob.glob(f"{kind}-*.json")):
        with open(path) as f:
            parts[path[len(kind) + 1:-5]] = json.load(f)
        os.remove(path)
    if parts:
        with open(f"{kind}.json", "w") as f:
            json.dump(parts, f, indent=1)
EOF
cat mlp-*.md > mlp.md 2>/dev/null && rm -f mlp-*.md; [ -s mlp.md ] || rm -f mlp.md
tar czf logs.tgz --exclude=logs.tgz ./*.log ./*.progress ./pytest.xml 2>/dev/null
rm -f ./*.log ./*.progress ./pytest.xml)
ls "$R"
exit $status
