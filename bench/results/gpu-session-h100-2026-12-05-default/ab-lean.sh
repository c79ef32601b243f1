#!/usr/bin/env bash
# Next session's first call (~500 s measured parts, 590 s at most by the deadlines): main's
# GPU FP8 tests (with the full-tile path's bit-for-bit test, never yet run on a GPU) and operand
# passes; then + tile-lean; then + tile-bias (the bias tables are the ones that differ); each in one
# bundle. Patches: git diff main tile-lean -- src tests > .deps/tile-lean.patch and
# git diff tile-lean tile-bias -- src tests > .deps/tile-bias.patch (regenerate if main moved).
# Leaves the tree as main.
R=$OUT
set -x
OUT=/tmp/w-main BUNDLE=$R/main.tar.gz DEADLINE_S=215 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
git apply .deps/tile-lean.patch || exit 3
OUT=/tmp/w-lean BUNDLE=$R/lean.tar.gz DEADLINE_S=215 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
git apply .deps/tile-bias.patch || exit 4
OUT=/tmp/w-bias BUNDLE=$R/bias.tar.gz DEADLINE_S=160 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
git apply -R .deps/tile-bias.patch; git apply -R .deps/tile-lean.patch
set +x
for v in main lean bias; do
  echo "=== $v"
  tail -2 /tmp/w-$v/session/test-fp8/log.txt 2>/dev/null
  for f in autoep busiest autoep-bias; do
    grep -h "all six\|dgate_up" /tmp/w-$v/session/bench-fp8-operands/$f.md 2>/dev/null | sed "s/^/$f /"
  done
done
