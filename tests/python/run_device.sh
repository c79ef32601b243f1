#!/usr/bin/env bash
# On a GPU machine (no network needed; torch with CUDA, nvcc, scikit-build-core, cmake, ninja,
# pytest present): build and install the package with its CUDA path, run the Python
# tests, run the benchmark. Logs, JUnit XML, bench JSON and markdown go to $OUT.
#
#   tests/python/run_device.sh                 # build + test + bench (the full seed-size table)
#   tests/python/run_device.sh build test      # only some stages, in this order
#   BENCH_ARGS="--presets swiglu_oai --iters 5" tests/python/run_device.sh build bench
#   PYTEST_ARGS="-k cuda" tests/python/run_device.sh build test
#
# Every stage re-runs `pip install .`: the CMake build folder (_skbuild/, ignored by
# git) is kept between calls, so after the first build it is an incremental no-op.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/_device_out}
mkdir -p "$OUT"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build test bench)

# dlpack.h travels with the tree in .deps/include (CMake also looks there by itself).
export EXPERTACT_DLPACK_INCLUDE_DIR=${EXPERTACT_DLPACK_INCLUDE_DIR:-$ROOT/.deps/include}
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

status=0
note() { echo "== $*" | tee -a "$OUT/run_device.log"; }

install() {
  note "install: $(nvcc --version 2>/dev/null | tail -1)"
  # EXPERTACT_CUDA=ON: a build that silently lost its CUDA path would be an error here.
  if ! python3 -m pip install --no-index --no-build-isolation --no-deps -v \
      -C cmake.define.EXPERTACT_CUDA=ON . >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    note "BUILD FAILED (see build.log)"
    exit 1
  fi
  (cd /tmp && python3 - <<'EOF'
import torch, expertact
print("expertact", expertact.__version__, "from", expertact.LIBRARY_PATH)
print("CUDA path built:", expertact.has_cuda(), "| torch", torch.__version__, "CUDA", torch.version.cuda,
      "|", torch.cuda.device_count(), "x", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
assert expertact.has_cuda(), "the installed library has no CUDA path"
EOF
  ) 2>&1 | tee -a "$OUT/run_device.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 --version
} | tee "$OUT/env.txt"

install
for stage in "${STAGES[@]}"; do
  case $stage in
    build) ;;  # done above
    test)
      note "pytest tests/python ${PYTEST_ARGS:-}"
      # shellcheck disable=SC2086
      python3 -m pytest tests/python -q -rs -p no:cacheprovider --junitxml="$OUT/pytest.xml" ${PYTEST_ARGS:-} \
        2>&1 | tee "$OUT/pytest.log" | tail -60
      [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; note "TESTS FAILED"; }
      ;;
    bench)
      note "python -m expertact.bench ${BENCH_ARGS:-}"
      # shellcheck disable=SC2086
      (cd /tmp && python3 -m expertact.bench --json "$OUT/bench.json" --markdown "$OUT/BENCHMARKS.md" ${BENCH_ARGS:-}) \
        >"$OUT/bench.log" 2> >(tee "$OUT/bench.progress" >&2)
      rc=$?
      tail -80 "$OUT/bench.log"
      [ $rc -eq 0 ] || { status=1; note "BENCH FAILED"; tail -20 "$OUT/bench.progress"; }
      ;;
    *) note "unknown stage $stage (build, test, bench)"; status=1 ;;
  esac
done
note "done: status $status"
exit $status
