#!/usr/bin/env bash
# The measurements behind the documentation's comparisons against each stack's default, one command
# each, on one GPU machine: every stage writes under $OUT/session/<stage>/ (OUT defaults to out/,
# git-ignored) its results, its log, and command.txt + env.txt (the command, the commit, the
# device, the versions). Stages run in the order given; the build folder is kept between calls.
#
#   bash scripts/gpu_session.sh                     # prints the stages and their estimated device time
#   bash scripts/gpu_session.sh build bench-autoep  # these stages, in this order
#   bash scripts/gpu_session.sh all                 # every stage
#
# Stages (estimated time on one H200 with 16 cores, from the runs kept in bench/results):
#   build                  the library with its CUDA path (ARCHS, default 90) in build/gpu
#   bench-autoep           python -m expertact.bench --autoep: DeepSpeed AutoEP's GroupedExperts at
#                          the busiest rank, deepspeed = AutoEP's default (gate_up_impl separate),
#                          deepspeed-fused, deepspeed-compile and expertact's rows, swiglu and swiglu_oai
#   train-autoep           examples/run_autoep_e2e.sh h200 report: 300 steps on one GPU of DeepSpeed's
#                          default (eager), its yardsticks (eager-repeat, eager-fused), expertact's
#                          activation, its whole MLP in place and in FP8; the report
#   bench-megatron         python -m expertact.bench --megatron: Megatron's default (fused SwiGLU) and
#                          its unfused path beside expertact's rows, both shapes
#   train-megatron-swiglu  examples/megatron_moe.py, 300 steps on the byte corpus: Megatron's default
#                          (fused SwiGLU), the same again, unfused, expertact in place and FP8
#   train-megatron-gpt-oss the same for GPT-OSS's form: Megatron's (unfused), the same again, its
#                          quick_gelu uncompiled, expertact in place and FP8
#   report-megatron        examples/megatron_report.py over both trainings: table and loss plot
# Every stage together is estimated above 30 minutes: a session with less takes them in two parts,
# each starting with build on a fresh machine (build bench-autoep train-autoep; build bench-megatron
# train-megatron-swiglu train-megatron-gpt-oss report-megatron).
#
# Needs: one NVIDIA GPU, Hopper (sm_90) for the FP8 rows and runs; the CUDA toolkit (nvcc), CMake >=
# 3.24, Ninja and dlpack.h for the build; Python (PYTHON, default python3) with a CUDA build of
# torch, deepspeed 0.19.8, transformers >= 5.15 and matplotlib for the AutoEP stages; Python >= 3.12
# (PYTHON312, default PYTHON) with a CUDA build of torch, megatron-core 0.19.2 and matplotlib for the
# Megatron stages. No network is used.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
S=$OUT/session
PY=${PYTHON:-python3}
PY312=${PYTHON312:-$PY}
BUILD=${BUILD:-$ROOT/build/gpu}
ORDER=(build bench-autoep train-autoep bench-megatron train-megatron-swiglu train-megatron-gpt-oss report-megatron)
# Estimated seconds of each stage, from the kept runs: the CUDA build took 71-80 s (bench/results/
# gpu-check-h200-2026-12-03.txt, docs/notes/megatron-notes.md); five 300-step AutoEP runs and the
# report 393 s (docs/autoep-e2e.md), ~78 s a run, here six; the Megatron bench's two tables of six
# rows ~130 s (megatron-notes: build, GPU tests and the bench in 257 s), here seven rows; four
# 300-step Megatron runs 317 s (~79 s a run; the same notes), here five per launch. bench-autoep has
# no recorded duration: two tables of eleven rows at the busiest rank's size (each row about 14
# forward+backward passes of ~0.3-0.4 s) and one torch.compile each, estimated.
declare -A EST=([build]=80 [bench-autoep]=300 [train-autoep]=480 [bench-megatron]=150 [train-megatron-swiglu]=400
                [train-megatron-gpt-oss]=400 [report-megatron]=10)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

plan() {
  local total=0 st
  echo "stages and their estimated device time (one H200):"
  for st in "$@"; do
    printf "  %-24s ~%3d s\n" "$st" "${EST[$st]}"
    total=$((total + EST[$st]))
  done
  printf "  %-24s ~%3d s (~%d min), plus the machine's start\n" "total" "$total" $(((total + 59) / 60))
}
if [ $# = 0 ]; then
  plan "${ORDER[@]}"
  echo "run: bash scripts/gpu_session.sh STAGE... (or all)"
  exit 0
fi
STAGES=("$@")
[ "$*" = all ] && STAGES=("${ORDER[@]}")
for st in "${STAGES[@]}"; do
  [ -n "${EST[$st]+x}" ] || { echo "unknown stage '$st' (${ORDER[*]}, all)"; exit 2; }
done
plan "${STAGES[@]}"

export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export EXPERTACT_LIBRARY=$BUILD/libexpertact.so

record() {  # record DIR PYTHON COMMAND...: command.txt and env.txt of a stage
  local dir=$1 py=$2
  shift 2
  mkdir -p "$dir"
  echo "$*" > "$dir/command.txt"
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse HEAD 2> /dev/null || echo '(no git)') ($(git status --porcelain 2> /dev/null | wc -l) changed files)"
    { command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } ||
      echo "no nvidia-smi"
    { command -v nvcc > /dev/null && nvcc --version | tail -1; } || echo "no nvcc"
    (cd /tmp && "$py" -W ignore - <<'EOF' 2> /dev/null)
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda,
      "gpus", torch.cuda.device_count())
for name in ("expertact", "deepspeed", "transformers", "megatron.core", "triton"):
    try:
        m = importlib.import_module(name)
    except Exception as e:  # not every stage needs every package
        print(f"{name}: not importable ({type(e).__name__})")
        continue
    extra = f" library {m.LIBRARY_PATH}, CUDA path {m.has_cuda()}" if name == "expertact" else ""
    print(name, getattr(m, "__version__", "?") + extra)
EOF
    echo "cores: $(nproc)"
  } > "$dir/env.txt"
}

status=0
run_stage() {  # run_stage NAME DIR PYTHON COMMAND...: recorded, logged to DIR/log.txt, timed
  local name=$1 dir=$2 py=$3 t=$SECONDS rc
  shift 3
  record "$dir" "$py" "$@"
  echo "== $name (~${EST[$name]} s estimated): $*"
  "$@" > "$dir/log.txt" 2>&1
  rc=$?
  echo "== $name: $((SECONDS - t)) s, exit $rc; results in $dir"
  if [ $rc != 0 ]; then
    status=1
    tail -30 "$dir/log.txt"
  fi
  echo "$((SECONDS - t)) s, exit $rc" >> "$dir/command.txt"
}

for st in "${STAGES[@]}"; do
  D=$S/$st
  case $st in
    build)
      run_stage build "$D" "$PY" bash -c "cmake -S . -B '$BUILD' -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES='${ARCHS:-90}' -DEXPERTACT_BUILD_TESTS=OFF -DEXPERTACT_BUILD_BENCH=OFF &&
        cmake --build '$BUILD' -j '$(nproc)' --target expertact" ;;
    bench-autoep)
      run_stage "$st" "$D" "$PY" "$PY" -m expertact.bench --autoep --json "$D/autoep-bench.json" \
        --markdown "$D/autoep-bench.md" ;;
    train-autoep)
      run_stage "$st" "$D" "$PY" env OUT="$D" PYTHON="$PY" bash examples/run_autoep_e2e.sh h200 report ;;
    bench-megatron)
      run_stage "$st" "$D" "$PY312" "$PY312" -m expertact.bench --megatron --json "$D/megatron-bench.json" \
        --markdown "$D/megatron-bench.md" ;;
    train-megatron-swiglu)
      run_stage "$st" "$D" "$PY312" "$PY312" -m torch.distributed.run --standalone --nproc-per-node 1 \
        examples/megatron_moe.py --impl megatron,megatron-repeat,megatron-unfused,expertact-inplace,expertact-fp8 \
        --steps 300 --out "$S/train-megatron" ;;
    train-megatron-gpt-oss)
      run_stage "$st" "$D" "$PY312" "$PY312" -m torch.distributed.run --standalone --nproc-per-node 1 \
        examples/megatron_moe.py --activation gpt-oss \
        --impl megatron,megatron-repeat,megatron-eager,expertact-inplace,expertact-fp8 --steps 300 \
        --out "$S/train-megatron" ;;
    report-megatron)
      run_stage "$st" "$D" "$PY312" "$PY312" examples/megatron_report.py --in "$S/train-megatron" \
        --md "$D/megatron-train.md" --png "$D/megatron-loss.png" ;;
  esac
done
echo "== done: status $status; results in $S"
exit $status
