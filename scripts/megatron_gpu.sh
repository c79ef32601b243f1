#!/usr/bin/env bash
# expertact as Megatron-Core's experts on a GPU machine, in stages (each of which a later call can
# run alone; the build folder is kept). Results go to $OUT/megatron/ ($OUT defaults to out/,
# git-ignored): summary.txt (the bench table and each failing log's tail), pytest.txt, bench.json,
# train.log, train/*.json (one per run), train.md and megatron-loss.png; the logs to $LOGS (default
# $OUT/megatron/logs). Each stage writes its results as it ends, so a stage cut by a time limit
# leaves the earlier ones.
#
#   bash scripts/megatron_gpu.sh                       # STAGES="build test bench train report"
#   STAGES="build test" bash scripts/megatron_gpu.sh
#
# Needs: an NVIDIA GPU (Hopper for the FP8 rows and runs) and the CUDA toolkit (nvcc, CMake >= 3.24,
# Ninja, dlpack.h) for the build stage; Python >= 3.12 (PYTHON, default python3) with a CUDA build
# of torch, megatron-core 0.19.2 and pytest; matplotlib for the report's plot. No network is used.
#
#   build   the library alone with its CUDA path (ARCHS, default 90), in build/gpu
#   test    tests/python/test_megatron.py and test_megatron_example.py on the GPU (fails unless the
#           GPU cases ran)
#   bench   python -m expertact.bench --megatron (BENCH_ARGS adds options): both shapes, Megatron's
#           default (fused SwiGLU) and its unfused path beside expertact's rows
#   train   examples/megatron_moe.py on one GPU, 300 steps on the byte corpus at 65,536 tokens a
#           step, two launches, each with its yardsticks in the same launch (TRAIN_ARGS replaces both
#           with one launch of its options; TRAIN_TIMEOUT bounds each): SwiGLU with Megatron's
#           default (fused), the same again, Megatron unfused (another rounding), expertact in place
#           and FP8; GPT-OSS's form with Megatron's, the same again, its quick_gelu uncompiled
#           (another rounding), expertact in place and FP8
#   report  examples/megatron_report.py over the training JSONs: the table and the loss plot
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
R=$OUT/megatron
LOGS=${LOGS:-$R/logs}
mkdir -p "$R" "$LOGS"
STAGES=${STAGES:-"build test bench train report"}
PY=${PYTHON:-python3}
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
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export EXPERTACT_LIBRARY=$ROOT/build/gpu/libexpertact.so
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
$PY -c "import sys, megatron.core as m; print('Python', sys.version.split()[0], 'megatron-core', m.__version__)" \
  >> "$R/summary.txt" 2> /dev/null || fail "megatron-core is not importable by $PY (pip install megatron-core==0.19.2, Python >= 3.12)"

if has test; then
  note "test: tests/python/test_megatron.py, test_megatron_example.py"
  (cd /tmp && timeout "${TEST_TIMEOUT:-400}" $PY -m pytest "$ROOT/tests/python/test_megatron.py" \
    "$ROOT/tests/python/test_megatron_example.py" -q -rs -s -p no:cacheprovider \
    --junitxml="$LOGS/pytest.xml") > "$R/pytest.txt" 2>&1 || fail "pytest (pytest.txt)"
  tail -3 "$R/pytest.txt" | tee -a "$R/summary.txt"
  if grep -q "needs CUDA" "$R/pytest.txt"; then fail "GPU cases skipped (pytest.txt)"; fi
fi

if has bench; then
  note "bench: python -m expertact.bench --megatron ${BENCH_ARGS:-}"
  (cd /tmp && timeout "${BENCH_TIMEOUT:-480}" $PY -m expertact.bench --megatron ${BENCH_ARGS:-} --json "$R/bench.json" \
    --markdown "$LOGS/bench.md") > "$LOGS/bench.log" 2>&1 || failed_log bench "$LOGS/bench.log"
  cat "$LOGS/bench.md" >> "$R/summary.txt" 2> /dev/null
fi

if has train; then
  OURS=expertact-inplace,expertact-fp8,expertact-fp8-promoted-wgrad  # bf16 in place, FP8 rowwise and the candidate
  if [ -n "${TRAIN_ARGS:-}" ]; then LAUNCHES=("$TRAIN_ARGS"); else LAUNCHES=(
    "--impl megatron,megatron-repeat,megatron-unfused,$OURS --steps 300"
    "--activation gpt-oss --impl megatron,megatron-repeat,megatron-eager,$OURS --steps 300")
  fi
  for ARGS in "${LAUNCHES[@]}"; do
    note "train: examples/megatron_moe.py $ARGS"
    timeout "${TRAIN_TIMEOUT:-590}" $PY -m torch.distributed.run --standalone --nproc-per-node 1 examples/megatron_moe.py \
      $ARGS --out "$R/train" \
      >> "$R/train.log" 2>&1 || fail "train (train.log)"
  done
  grep -iE "summary|tokens/s|error" "$R/train.log" | tail -12 | tee -a "$R/summary.txt"
fi

if has report; then
  note "report"
  $PY examples/megatron_report.py --in "$R/train" --md "$R/train.md" --png "$R/megatron-loss.png" \
    > "$LOGS/report.log" 2>&1 || failed_log report "$LOGS/report.log"
fi
exit $status
