#!/usr/bin/env bash
# Nsight Compute on main's backward and GLU tile kernels at AutoEP's shape.
R=$OUT; set -x
OUT=/tmp/w-n BUNDLE=$R/build.tar.gz DEADLINE_S=150 bash scripts/gpu_session.sh build || exit 2
export PYTHONPATH=$PWD/python EXPERTACT_LIBRARY=$PWD/build/gpu/libexpertact.so
S="--shape 8,32768,1024,3072"
ncu --kernel-name-base demangled -k regex:BwdTileSrc --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
  --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
  python3 bench/fp8_operand_kernels.py $S > $R/bwd-sections.txt 2>&1
ncu --kernel-name-base demangled -k regex:BwdTileSrc --launch-count 1 --section SourceCounters --section WarpStateStats \
  --page source --print-source sass --csv python3 bench/fp8_operand_kernels.py $S > /tmp/bwd-src.csv 2>&1
python3 .deps/sass_summary.py /tmp/bwd-src.csv > $R/bwd-sass.txt 2>&1
ncu --kernel-name-base demangled -k regex:GluTileSrc --launch-count 1 --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats python3 bench/fp8_operand_kernels.py $S > $R/glu-sections.txt 2>&1
ls -la $R
