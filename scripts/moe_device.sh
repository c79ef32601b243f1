#!/usr/bin/env bash
# GPU run for expertact.moe (issue 11), one command from the repository root:
# build and install the package with its CUDA path (tests/python/run_device.sh's build
# stage), run the moe tests on the GPU, then the expert-MLP benchmark at the seed's busiest
# rank (4 experts x 261,280 rows, D = F = 3,072, bf16). Results go to $OUT/moe (or
# ./device-out/moe): pytest.xml, mlp.json, mlp.md, logs.tgz.
#
#   bash scripts/moe_device.sh                 # build + tests + benchmark
#   MLP_ARGS="--quick" bash scripts/moe_device.sh
#   STAGES="test bench" bash scripts/moe_device.sh   # package already installed
#
# Expected: build as run_device.sh (incremental if _skbuild/ is carried), tests ~1-2 min,
# benchmark ~2 min (9 rows x ~13 steps of ~0.3 s, torch.compile's compile ~30-60 s).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
R="$OUT/moe"
mkdir -p "$R"
STAGES=${STAGES:-"build test bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
note() { echo "== $(date +%T) $*" | tee -a "$R/summary.txt"; }
status=0

if has build; then
  note "build + install (tests/python/run_device.sh build)"
  OUT="$R" bash tests/python/run_device.sh build > "$R/build-stage.log" 2>&1 || {
    tail -40 "$R/build-stage.log"; note "BUILD FAILED"; exit 1; }
  tail -3 "$R/build-stage.log"
fi

if has test; then
  note "pytest test_moe.py test_bench_mlp.py (GPU cases included)"
  (cd /tmp && timeout ${TEST_TIMEOUT:-600} python3 -m pytest "$ROOT/tests/python/test_moe.py" \
      "$ROOT/tests/python/test_bench_mlp.py" -q -rs -p no:cacheprovider --junitxml="$R/pytest.xml") \
      > "$R/pytest.log" 2>&1
  rc=$?
  tail -15 "$R/pytest.log"
  # The GPU cases must have run, not skipped: a CPU-only install would skip them all.
  python3 - "$R/pytest.xml" <<'EOF' | tee -a "$R/summary.txt"
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
cuda = [c for c in cases if "cuda" in c.get("name", "")]
ran = [c for c in cuda if c.find("skipped") is None]
print(f"CUDA cases: {len(ran)} ran of {len(cuda)}")
sys.exit(0 if ran else 1)
EOF
  [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; note "NO CUDA CASE RAN"; }
  [ $rc -eq 0 ] || { status=1; note "TESTS FAILED (rc $rc)"; }
fi

if has bench; then
  note "python -m expertact.bench_mlp ${MLP_ARGS:-}"
  # shellcheck disable=SC2086
  (cd /tmp && timeout ${BENCH_TIMEOUT:-480} python3 -m expertact.bench_mlp ${MLP_ARGS:-} \
      --json "$R/mlp.json" --markdown "$R/mlp.md") > "$R/bench.log" 2> "$R/bench.progress"
  rc=$?
  tail -32 "$R/bench.log"
  [ $rc -eq 0 ] || { status=1; note "BENCH FAILED (rc $rc)"; tail -20 "$R/bench.progress"; }
fi

note "done: status $status"
(cd "$R" && tar czf logs.tgz --exclude=logs.tgz ./*.log ./*.progress ./*.txt 2>/dev/null; rm -f ./*.log ./*.progress)
exit $status
