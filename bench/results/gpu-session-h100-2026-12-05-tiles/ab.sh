#!/usr/bin/env bash
# A/B of the tile kernels on one machine: streaming (with tests), streaming with the plain
# source at one block an SM, then the branches without streaming (the baseline).
R=$OUT
set -x
git apply .deps/tile-prefetch.patch && git apply .deps/bwd-stash.patch && git apply .deps/tile-stream.patch || exit 3
OUT=/tmp/w-stream BUNDLE=$R/stream.tar.gz DEADLINE_S=200 bash scripts/gpu_session.sh build test-fp8 bench-fp8-operands
sed -i 's/  static constexpr int kMinBlocks = 2;/  static constexpr int kMinBlocks = 1;/' src/cuda/fp8_tiles.cu
OUT=/tmp/w-min1 BUNDLE=$R/min1.tar.gz DEADLINE_S=80 bash scripts/gpu_session.sh build bench-fp8-operands
sed -i 's/  static constexpr int kMinBlocks = 1;/  static constexpr int kMinBlocks = 2;/' src/cuda/fp8_tiles.cu
git apply -R .deps/tile-stream.patch || exit 4
git diff --stat
OUT=/tmp/w-base BUNDLE=$R/base.tar.gz DEADLINE_S=80 bash scripts/gpu_session.sh build bench-fp8-operands
