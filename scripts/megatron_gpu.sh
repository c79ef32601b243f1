#!/usr/bin/env bash
# expertact as Megatron-Core's experts on a GPU machine, in stages (a machine that allows only
# short commands takes them a few at a time). Needs megatron-core 0.19.2 importable (Python
# >= 3.12): installed, or its wheel in .whl/ (carried, with .deps/ for dlpack.h; installed into
# /tmp/site). Results go to $OUT/megatron/ ($OUT defaults to out/, git-ignored): summary.txt (the
# bench table and each failing log's tail), pytest.txt, bench.json, train.log, train/*.json (one per
# run); the logs to $LOGS (default $OUT/megatron/logs). Each stage writes its results as it ends, so
# a stage cut by a time limit leaves the earlier ones.
#
#   bash scripts/megatron_gpu.sh                       # STAGES="build test bench train report"
#   STAGES="build test" bash scripts/megatron_gpu.sh
#
#   build   the library alone with its CUDA path (ARCHS, default 90), in build/gpu
#   test    tests/python/test_megatron.py on the GPU (fails unless its GPU cases ran)
#   bench   python -m expertact.bench --megatron (BENCH_ARGS adds options): both shapes
#   train   examples/megatron_moe.py on one GPU, two launches of 300 steps at 65,536 tokens a step
#           (TRAIN_ARGS replaces both with one launch of its options; TRAIN_TIMEOUT bounds each):
#           SwiGLU with Megatron's experts, Megatron's fused SwiGLU (the loss yardstick), expertact
#           in place and FP8; GPT-OSS's form with Megatron's, its uncompiled quick_gelu (the
#           yardstick), expertact in place and FP8
#   report  examples/megatron_report.py over the training JSONs: the table and the loss plot
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
R=$OUT/megatron
LOGS=${LOGS:-$R/logs}
mkdir -p "$R" "$LOGS"
STAGES=${STAGES:-"build test bench train report"}
SITE=${SITE:-/tmp/site}
status=0
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
note() { echo "== $*" | tee -a "$R/summary.txt"; }
fail() { echo "FAIL: $*" | tee -a "$R/summary.txt"; status=1; }
failed_log() { fail "$1 ($2)"; tail -25 "$2" >> "$R/summary.txt"; }

if has build; then  # the library alone (its CUDA path for ARCHS), in build/gpu
  t=$SECONDS
  { cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${ARCHS:-90}" -DEXPERTACT_BUILD_TESTS=OFF -DEXPERTACT_BUILD_BENCH=OFF &&
    cmake --build build/gpu -j "$(nproc)" --target expertact; } > "$LOGS/build.log" 2>&1 ||
    failed_log build "$LOGS/build.log"
  note "build: $((SECONDS - t)) s"
fi
if ls .whl/*.whl > /dev/null 2>&1; then  # the carried wheels (megatron-core), out of the machine's way
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl > "$LOGS/pip.log" 2>&1 || failed_log "installing .whl/*.whl into $SITE" "$LOGS/pip.log"
fi
export PYTHONPATH=$ROOT/python:$SITE${PYTHONPATH:+:$PYTHONPATH}
export EXPERTACT_LIBRARY=$ROOT/build/gpu/libexpertact.so
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" >> "$R/summary.txt" 2> /dev/null ||
  fail "megatron-core is not importable (carry its wheel in .whl/)"

if has test; then
  note "test: tests/python/test_megatron.py"
  (cd /tmp && timeout "${TEST_TIMEOUT:-400}" python3 -m pytest "$ROOT/tests/python/test_megatron.py" -q -rs -s -p no:cacheprovider \
    --junitxml="$LOGS/pytest.xml") > "$R/pytest.txt" 2>&1 || fail "pytest (pytest.txt)"
  tail -3 "$R/pytest.txt" | tee -a "$R/summary.txt"
  if grep -q "needs CUDA" "$R/pytest.txt"; then fail "GPU cases skipped (pytest.txt)"; fi
fi

if has bench; then
  note "bench: python -m expertact.bench --megatron ${BENCH_ARGS:-}"
  (cd /tmp && timeout "${BENCH_TIMEOUT:-480}" python3 -m expertact.bench --megatron ${BENCH_ARGS:-} --json "$R/bench.json" \
    --markdown "$LOGS/bench.md") > "$LOGS/bench.log" 2>&1 || failed_log bench "$LOGS/bench.log"
  cat "$LOGS/bench.md" >> "$R/summary.txt" 2> /dev/null
fi

if has train; then
  if [ -n "${TRAIN_ARGS:-}" ]; then LAUNCHES=("$TRAIN_ARGS"); else LAUNCHES=(
    "--impl megatron,megatron-fused,expertact-inplace,expertact-fp8 --steps 300"
    "--activation gpt-oss --impl megatron,megatron-eager,expertact-inplace,expertact-fp8 --steps 300"); fi
  for ARGS in "${LAUNCHES[@]}"; do
    note "train: examples/megatron_moe.py $ARGS"
    timeout "${TRAIN_TIMEOUT:-560}" torchrun --standalone --nproc-per-node 1 examples/megatron_moe.py $ARGS --out "$R/train" \
      >> "$R/train.log" 2>&1 || fail "train (train.log)"
  done
  grep -iE "summary|tokens/s|error" "$R/train.log" | tail -12 | tee -a "$R/summary.txt"
fi

if has report; then
  note "report"
  python3 examples/megatron_report.py --in "$R/train" --md "$R/train.md" --png "$R/megatron-loss.png" \
    > "$LOGS/report.log" 2>&1 || failed_log report "$LOGS/report.log"
fi
exit $status
