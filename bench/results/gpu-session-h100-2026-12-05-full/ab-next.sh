#!/usr/bin/env bash
# Next session's first call (~320 s on a fresh machine): main's GPU tests and operand passes, then
# + tile-wait, then + tile-rows-direct, each in one bundle. Patches: git diff main tile-wait -- src tests
# (and tile-rows-direct); regenerate if main moved.
R=$OUT
set -x
OUT=/tmp/w-main BUNDLE=$R/main.tar.gz DEADLINE_S=220 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
git apply .deps/tile-wait.patch || exit 3
OUT=/tmp/w-wait BUNDLE=$R/wait.tar.gz DEADLINE_S=300 bash scripts/gpu_session.sh build bench-fp8-operands
git apply .deps/tile-rows-direct.patch || exit 4
OUT=/tmp/w-rows BUNDLE=$R/rows.tar.gz DEADLINE_S=380 bash scripts/gpu_session.sh build bench-fp8-operands
git apply -R .deps/tile-rows-direct.patch; git apply -R .deps/tile-wait.patch
