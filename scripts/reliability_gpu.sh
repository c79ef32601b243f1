#!/usr/bin/env bash
# The reliability run on a GPU machine, one call: the differential fuzzer on CUDA (parallel
# processes, each kernel variant of EXPERTACT_CUDA_KERNEL when the library reads it), the OOM
# and CUDA-graph tests and the other CUDA pytest files alongside; optionally the
# compute-sanitizer sweep (scripts/sanitize.sh, its own call: 243 s wall with the build on an
# H200, 2026-11-30).
# Results in $OUT/reliability ($OUT defaults to out/ in the repository): summary.txt,
# fuzz-*.json, pytest.xml, logs.tgz.
#
#   bash scripts/reliability_gpu.sh                      # build, fuzz (240 s) + CUDA tests: ~5 min + build
#   FUZZ_SECONDS=60 bash scripts/reliability_gpu.sh      # shorter (71 s wall for the fuzzer)
#   FUZZ_PROBLEMS=2000 bash scripts/reliability_gpu.sh   # a fixed number of problems per process
#   STAGES=sanitize bash scripts/reliability_gpu.sh      # = bash scripts/sanitize.sh
#
# Needs what scripts/gpu_check.sh's build stage needs (its header); it
# reuses that stage. The fuzzer is tests/python/support/fuzz.py; the Python package runs from
# the source tree over build/gpu/libexpertact.so (BUILD; FUZZ_LIB names another library).
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
R=$OUT/reliability
L=$R/logs
mkdir -p "$L"
STAGES=${STAGES:-"build fuzz tests"}
FUZZ_SECONDS=${FUZZ_SECONDS:-240}
FUZZ_PROBLEMS=${FUZZ_PROBLEMS:-}  # set: each process stops after this many problems instead
BUILD=${BUILD:-$ROOT/build/gpu}
FUZZ=$ROOT/tests/python/support/fuzz.py
FUZZ_PROCS=${FUZZ_PROCS:-9}  # Python-bound processes on one GPU (16 cores: the tests get the rest)
has() { [[ " $STAGES " == *" $1 "* ]]; }
SUM=$R/summary.txt
T0=$(date +%s)
status=0

if has build; then
  echo "== build (scripts/gpu_check.sh, STAGES=build)"
  OUT="$R/build" BUILD=$BUILD STAGES=build bash scripts/gpu_check.sh > "$L/build.log" 2>&1 ||
    { echo "BUILD FAILED"; tail -40 "$L/build.log"; exit 1; }
  rm -rf "$R/build"
fi
LIB=${FUZZ_LIB:-$BUILD/libexpertact.so}  # FUZZ_LIB: another build of the library (e.g. a wheel's)
[ -f "$LIB" ] || { echo "missing $LIB: run with the build stage (STAGES=\"build ...\")"; exit 1; }
export PYTHONPATH=$ROOT/python:$ROOT/tests/python${PYTHONPATH:+:$PYTHONPATH}
export EXPERTACT_LIBRARY=$LIB

{
  echo "# reliability run: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)" \
       "($(git status --porcelain 2>/dev/null | wc -l) changed files)"
  echo "# GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  python3 -c 'import sys, torch, expertact; print("# python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "| expertact CUDA path:", expertact.has_cuda(), expertact.LIBRARY_PATH)' 2>&1
} > "$SUM"
cat "$SUM"

pids=()
if has fuzz; then
  # Kernel choices: each value of EXPERTACT_CUDA_KERNEL (read once per process) where the
  # library reads that variable, else the one build as it is.
  variants=(default)
  if grep -aq EXPERTACT_CUDA_KERNEL "$LIB"; then
    read -r -a variants <<< "${FUZZ_VARIANTS:-rows flat}"
  fi
  per=$((FUZZ_PROCS / ${#variants[@]}))
  [ "$per" -ge 1 ] || per=1
  if [ -n "$FUZZ_PROBLEMS" ]; then limit=(--problems "$FUZZ_PROBLEMS"); else limit=(--seconds "$FUZZ_SECONDS"); fi
  echo "== fuzz: ${#variants[@]} variant(s) (${variants[*]}) x $per processes x ${limit[*]}"
  vi=0
  for v in "${variants[@]}"; do
    for ((k = 0; k < per; k++)); do
      seed=$((vi * 100000000 + k * 10000000))  # disjoint seed ranges
      prof=()
      [ $k = 0 ] && prof=(--profile-kernels 300)  # which kernels the first problems launch
      envs=()
      [ "$v" != default ] && envs=(EXPERTACT_CUDA_KERNEL=$v)
      ( env "${envs[@]}" python3 "$FUZZ" --device "${FUZZ_DEVICE:-cuda}" --seed $seed "${limit[@]}" \
          "${prof[@]}" --json "$R/fuzz-$v-$k.json" > "$L/fuzz-$v-$k.log" 2>&1
        echo $? > "$L/fuzz-$v-$k.rc" ) &
      pids+=($!)
    done
    vi=$((vi + 1))
  done
fi

if has tests; then
  # The OOM and graph tests, and the rest of the CUDA-only pytest file, alongside the fuzzer.
  echo "== pytest tests/python/test_cuda_reliability.py tests/python/test_cuda.py"
  timeout -k 10 480 python3 -m pytest -q -p no:cacheprovider -rfEs --junitxml="$R/pytest.xml" \
    tests/python/test_cuda_reliability.py tests/python/test_cuda.py > "$L/pytest.log" 2>&1
  rc=$?
  echo "pytest (test_cuda_reliability.py, test_cuda.py): rc=$rc $(tail -1 "$L/pytest.log")" | tee -a "$SUM"
  grep -E "^(FAILED|ERROR)" "$L/pytest.log" | head -20 | tee -a "$SUM"
  [ $rc = 0 ] || status=1
fi

for p in "${pids[@]}"; do wait "$p"; done

if has fuzz; then
  python3 - "$R" "$L" >> "$SUM" <<'EOF' || status=1
import glob, json, os, sys
from collections import Counter
r, logs = sys.argv[1], sys.argv[2]
runs = sorted(glob.glob(os.path.join(r, "fuzz-*.json")))
total = failed = 0
kernels, paths = Counter(), Counter()
for f in runs:
    j = json.load(open(f))
    total += j["problems"]; failed += j["failed"]
    kernels.update(j["kernels"]); paths.update(j["paths"])
    print(f"fuzz {os.path.basename(f)[5:-5]}: {j['problems']} problems, {j['failed']} failed, seeds "
          f"{j['first_seed']}..{j['first_seed'] + j['problems'] - 1}, {j['seconds']} s, EXPERTACT_CUDA_KERNEL="
          f"{j['kernel_env']}, accepted Inf/NaN divergences {j['inf_divergent']}"
          + (f", failed seeds {j['failed_seeds'][:10]}" if j["failed"] else "") + (f", ABORTED {j['aborted']}" if j["aborted"] else ""))
for f in sorted(glob.glob(os.path.join(logs, "fuzz-*.log"))):
    rc = open(f[:-4] + ".rc").read().strip() if os.path.exists(f[:-4] + ".rc") else "?"
    name = os.path.basename(f)[:-4]
    if not os.path.exists(os.path.join(r, name + ".json")):
        print(f"{name}: NO RESULT (rc {rc}); last lines:"); print("".join(open(f).readlines()[-15:]))
        failed += 1
    fails = [l for l in open(f) if l.startswith(("FAIL", "  - ", "  repro"))]
    if fails:
        print(f"{name}: first failures:"); print("".join(fails[:30]), end="")
print(f"FUZZ GPU TOTAL: {total} problems, {failed} failed ({len(runs)} processes)")
print("CUDA paths (mirror of glu_launch.cuh): " + ", ".join(f"{k}: {v}" for k, v in sorted(paths.items())))
print("expertact kernels launched by the profiled problems: " + (", ".join(f"{k}: {v}" for k, v in sorted(kernels.items())) or "(none recorded)"))
sys.exit(1 if failed or not runs else 0)
EOF
fi

if has sanitize; then
  OUT="$OUT" SAN_BUILD=0 BUILD="$BUILD" bash scripts/sanitize.sh > "$L/sanitize.log" 2>&1 || status=1
  tail -40 "$L/sanitize.log"
fi

echo "# $( [ $status = 0 ] && echo OK || echo FAILURES), $(( $(date +%s) - T0 ))s wall" >> "$SUM"
echo "================ summary"
cat "$SUM"
(cd "$R" && tar czf logs.tgz logs && rm -rf logs)
exit $status
