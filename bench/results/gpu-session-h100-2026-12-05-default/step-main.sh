#!/usr/bin/env bash
# Second call: the step of blockwise beside the bf16 MLP in place at seeds 1234, 2, 3, with main's kernels.
R=$OUT
OUT=/tmp/w-step BUNDLE=$R/step.tar.gz DEADLINE_S=585 bash scripts/gpu_session.sh build train-autoep-step train-autoep-step-seeds
