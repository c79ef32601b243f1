#!/usr/bin/env bash
# Third call: main with the weights' gradient's adds unfused (the misaligned-view test's failures),
# its GPU FP8 tests and operand passes; then + tile-lean, the same.
R=$OUT
OUT=/tmp/w-fix BUNDLE=$R/fix.tar.gz DEADLINE_S=260 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
git apply .deps/tile-lean.patch || exit 3
OUT=/tmp/w-lean2 BUNDLE=$R/lean2.tar.gz DEADLINE_S=215 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
git apply -R .deps/tile-lean.patch
for v in fix lean2; do
  echo "=== $v"; tail -1 /tmp/w-$v/session/test-fp8/log.txt
  grep -h "FAILED" /tmp/w-$v/session/test-fp8/log.txt | head -5
  for f in autoep busiest autoep-bias; do
    grep -h "all six\|dgate_up" /tmp/w-$v/session/bench-fp8-operands/$f.md 2>/dev/null | sed "s/^/$f /"
  done
done
