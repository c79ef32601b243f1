#!/usr/bin/env bash
# scripts/san_diag.py plainly and under two compute-sanitizer tools, on the GPU machine:
# $OUT/diag-{none,synccheck,memcheck}.txt (issue 13: allocation tests that differ under the tool).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-13.0/bin/compute-sanitizer 2>/dev/null | head -1)
for t in none synccheck memcheck; do
  w=()
  [ "$t" = none ] || w=("$CS" --tool "$t")
  (cd /tmp && PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" EXPERTACT_LIBRARY="${LIB:-$ROOT/build-dev/libexpertact.so}" \
    timeout 90 "${w[@]}" python3 "$ROOT/scripts/san_diag.py") > "$OUT/diag-$t.txt" 2>&1
  echo "diag $t rc=$?"
done
