#!/usr/bin/env bash
# The tile engine's full-tile path (uncommitted in this tree) against main (HEAD) on one machine:
# main's operand passes, then the tree's GPU FP8 tests and operand passes, then (tests passing)
# AutoEP's training step with blockwise against bf16 MLP in place, then the kernel profile.
R=$OUT
set -x
git worktree add -f /tmp/base HEAD > /dev/null 2>&1 || exit 3
(cd /tmp/base && OUT=/tmp/w-base BUNDLE=$R/base.tar.gz DEADLINE_S=150 BUILD=/tmp/base/build/gpu \
  bash scripts/gpu_session.sh build bench-fp8-operands)
OUT=/tmp/w-full BUNDLE=$R/full.tar.gz DEADLINE_S=220 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
L=$(tail -1 /tmp/w-full/session/test-fp8/log.txt)
echo "$L" | grep -q " passed" && ! echo "$L" | grep -qE "failed|error" || { echo "tests did not pass"; exit 4; }
OUT=/tmp/w-step BUNDLE=$R/step.tar.gz DEADLINE_S=280 bash scripts/gpu_session.sh train-autoep-step profile-fp8-autoep
