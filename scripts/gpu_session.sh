#!/usr/bin/env bash
# The measurements behind the documentation's comparisons against each stack's default and the FP8
# recipes' accuracy, speed and training loss, one command each, on one GPU machine: every stage writes
# under $OUT/session/<stage>/ (OUT defaults to out/, git-ignored) its results, its log, and
# command.txt + env.txt (the command, the commit, the device, the versions). Stages run in the order
# given; the build folder is kept between calls, and a stage that needs the library builds it first
# when it is missing (a fresh machine).
#
#   bash scripts/gpu_session.sh                     # the stages and their estimated device time
#   bash scripts/gpu_session.sh --plan              # every measurement in priority order, packed into calls and sessions
#   bash scripts/gpu_session.sh --dry-run STAGE...  # what these stages would run, run nothing
#   bash scripts/gpu_session.sh build bench-autoep  # these stages, in this order
#   bash scripts/gpu_session.sh all                 # every stage
#   BUNDLE=DIR/r.tar.gz bash scripts/gpu_session.sh ...   # also every result (not the captured tensors)
#                                                   # in one archive, for a machine that returns few files
#
# Stages (estimated time on one H200 with 16 cores, from the runs kept in bench/results):
#   preflight              the GPU, the versions, and every package the stages import
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
#                          (fused SwiGLU), the same again, unfused, expertact in place, FP8 rowwise and
#                          rowwise-promoted-wgrad
#   train-megatron-gpt-oss the same for GPT-OSS's form: Megatron's (unfused), the same again, its
#                          quick_gelu uncompiled, expertact in place, FP8 rowwise and rowwise-promoted-wgrad
#   report-megatron        examples/megatron_report.py over both trainings: table and loss plot
#   test-megatron          the GPU cases of test_megatron.py and test_megatron_example.py (Python 3.12)
# The FP8 recipes (docs/notes/fp8-recipes.md), in the order --plan takes them: the diagnosis first,
# then the training runs that decide the default recipe:
#   test-fp8               the GPU cases of the FP8 kernels' and GEMM layer's tests (those of
#                          test_fp8_blocks.py, test_fp8_gemm.py, test_fp8_mlp.py that exist)
#   scaled-mm-forms        bench/scaled_mm_forms.py: which per-expert torch._scaled_mm forms of the blockwise
#                          recipe cuBLAS runs (row and token offsets, one to three K tiles), each also on a
#                          fresh copy of A; and B's 128 x 128 scales at K block counts no multiple of 4
#                          (GPT-OSS's 2,880 and 5,760) as 1 x 128, as they are and padded, each timed
#   fp8-accuracy           the first MoE layer's expert inputs captured at step 150 of the AutoEP h200
#                          training (DeepSpeed's default), then python -m expertact.bench --fp8-accuracy
#                          on them and at the busiest rank's shape with their column scales
#   train-autoep-fp8       beside train-autoep's runs on the same machine (its folder): AutoEP h200, 300
#                          steps, the FP8 recipes train-autoep does not run (rowwise-bf16-wgrad,
#                          rowwise-promoted-wgrad, blockwise; a recipe this expertact lacks is left out
#                          and said so) and torchao's FP8 rowwise MoE training; then one report of every run
#   train-autoep-seedN     the same training with seed N (other weights, other batches): DeepSpeed's
#                          default, its repeat and gate_up fused (the yardsticks), expertact's bf16 MLP in
#                          place and the two rowwise recipes with accurate weight gradients, then their
#                          report, and one over every seed's folder of the session (autoep-seeds.md):
#                          whether a recipe's difference from bf16 keeps its sign across seeds
#   train-autoep-blockwise-seeds  blockwise (DeepSeek-V3's recipe) into both seed folders, beside
#                          their baselines (after train-autoep-seed2 and -seed3 on the same machine), then
#                          the report over every seed's folder again
#   bench-fp8-gemms        python -m expertact.bench --fp8-gemms (where this expertact has it)
#   train-autoep-step      the training step of blockwise beside the bf16 MLP in place (AutoEP h200, 300
#                          steps, default seed, the experts' share): a change to blockwise's speed read where
#                          the default's rule reads it
#   train-autoep-step-seeds  the same at seeds 2 and 3 (the default's rule reads the step at every seed)
#   bench-mlp-fp8          python -m expertact.bench --mlp --fp8: every FP8 row the bench has, beside bf16
#                          and torchao's composition
#   profile-fp8            bench/mlp_kernel_profile.py for rowwise-bf16-wgrad, rowwise-promoted-wgrad and
#                          blockwise: each kernel's time in one step at the busiest rank's shape
#   train-autoep-1000-bf16 1,000 steps on the larger corpus (--corpus stdlib+packages): DeepSpeed's default
#                          and its repeat
#   train-autoep-1000-mlp  ... the bf16 MLP in place (the default's step is read against it)
#   train-autoep-1000-fp8  ... eager-fused and the FP8 recipe LONG_FP8 (default mlp-fp8-blockwise, the
#                          default recipe), then the report
#   train-autoep-1000-seed2, train-autoep-1000-seed2-fp8  the same at seed 2 (other weights, other
#                          batches), without the MLP in place: whether the default's lead at seed 1234
#                          (it left the loss plateau 130 steps before any bf16 run) holds at another seed
#   finetune-fp8-yardsticks  examples/finetune_gpt_oss.py, h200 size, 300 steps: grouped_mm, eager
#   finetune-fp8           ... expertact (bf16, the baseline of the FP8 comparison) and expertact_fp8 with
#                          the recipe FINETUNE_FP8 (default blockwise, the default recipe), into the same report
#   finetune-20b           the same fine-tuning at GPT-OSS-20B's layer dims (--size 20b-experts: hidden = expert
#                          intermediate = 2,880, 32 experts, two layers, 32,768 tokens a step), where the expert
#                          GEMMs are large enough for FP8 to pay: expertact and expertact_fp8 (FINETUNE_FP8),
#                          4 steps profiled
#   finetune-20b-yardsticks  ... eager and grouped_mm into the same report (the criterion's yardsticks)
#   profile-fp8-finetune   where blockwise's step goes in the GPT-OSS fine-tuning (0.62x bf16's step): 30 steps
#                          of its bf16, blockwise and rowwise runs with 4 profiled (--profile: GPU busy and idle
#                          time, kernels, host calls a step), then at its expert shape (32 experts x 8,192
#                          rows, D = F = 1,024) the module bench's bf16, rowwise and blockwise rows and
#                          bench/mlp_kernel_profile.py for bf16 and blockwise
# A/B runs of changes not yet on main (bench/ab/: the patch, the stage's script bench/ab/ab.sh):
#   ab-groups              bench/ab/bwd-groups.patch (blockwise's dh and activation backward by groups of
#                          experts: the extra peak): the module bench's bf16 and blockwise rows at the busiest
#                          rank's and AutoEP's shapes, main / patched / main, and the patch's GPU tests
#   ab-blocks-tr           bench/ab/blocks-tr.patch (the weights' 128 x 128 blocks read along the storage's rows
#                          where the GEMM's view of a weight is transposed, as the forward's are): the operand
#                          passes and the fine-tuning's blockwise run at GPT-OSS-20B's dims (40 steps), main /
#                          patched / main, the library rebuilt with the patch, and the FP8 blocks' GPU tests
#   ab-kpad                bench/ab/kpad.patch (K padded to a multiple of 512 where its block count is not a
#                          multiple of 4, so that B's 128 x 128 scales go to cuBLAS instead of the 1 x 128
#                          form): as ab-blocks-tr, the FP8 GEMM tests patched
#   ab-tail-rows           bench/ab/tail-rows.patch (blockwise's per-expert GEMMs without the padded call for an
#                          expert's last 1 to 3 rows: host work at many experts): the GPT-OSS fine-tuning's
#                          blockwise run, 100 steps, main / patched / main, and the FP8 tests patched
#
# Needs: one NVIDIA GPU, Hopper (sm_90) for the FP8 rows and runs; the CUDA toolkit (nvcc), CMake >=
# 3.24, Ninja and dlpack.h for the build (the system's, or .deps/include/dlpack/dlpack.h); Python
# (PYTHON, default python3) with a CUDA build of torch, deepspeed 0.19.8, transformers >= 5.15,
# torchao 0.18 and matplotlib for the AutoEP and FP8 stages; Python >= 3.12 (PYTHON312, default
# PYTHON) with a CUDA build of torch, megatron-core 0.19.2 and matplotlib for the Megatron stages. No
# network is used: scripts/gpu_wheels.sh, run elsewhere, puts the wheels into WHEELS (default .whl/),
# installed here into SITE (default /tmp/site) and put on PYTHONPATH first, and dlpack.h into
# .deps/include/dlpack/; both folders are copied beside the tree on the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
S=$OUT/session
PY=${PYTHON:-python3}
PY312=${PYTHON312:-$PY}
BUILD=${BUILD:-$ROOT/build/gpu}
SITE=${SITE:-/tmp/site}
LONG_FP8=${LONG_FP8:-mlp-fp8-blockwise}
FINETUNE_FP8=${FINETUNE_FP8:-blockwise}
ORDER=(preflight build bench-autoep train-autoep bench-megatron train-megatron-swiglu train-megatron-gpt-oss
       report-megatron test-megatron test-fp8 fp8-accuracy train-autoep-fp8 bench-fp8-gemms bench-mlp-fp8 profile-fp8
       train-autoep-1000-bf16 train-autoep-1000-mlp train-autoep-1000-fp8 train-autoep-1000-seed2
       train-autoep-1000-seed2-fp8 finetune-fp8-yardsticks finetune-fp8 train-autoep-seed2
       train-autoep-seed3 train-autoep-blockwise-seeds scaled-mm-forms profile-fp8-autoep
       bench-fp8-operands train-autoep-step train-autoep-step-seeds profile-fp8-finetune ab-groups
       ab-tail-rows finetune-20b finetune-20b-yardsticks ab-blocks-tr ab-kpad)
# Priority order, what the runs of 2026-12-05 left (bench/results/gpu-session-h200-2026-12-05/, -05b/,
# -05c/, gpu-session-h100-2026-12-05/, -05-tiles/, -05-full/, -05-default/, -05-1000/, -05-finetune/ and
# -05-seed2/): blockwise passed the 1,000 steps at seed 2; the GPT-OSS fine-tuning's step is host-bound
# (0.62x bf16's at the h200 size, where no FP8 recipe can reach 1.05x), and at GPT-OSS-20B's dims a
# 40-step preview gave 0.96x, 13 ms of it the weights' quantisation; so first the GPU tests, the A/Bs
# of the weights' transposed read, of K padded for the 128 x 128 scale form, of the per-expert calls'
# host work and of the extra peak, then the
# fine-tuning at GPT-OSS-20B's dims with its yardsticks (with what the A/Bs keep), the step on an H200,
# the Megatron tests, the module bench, where the step goes at AutoEP's shape, the seeds' steps again,
# the GEMMs' profiles, the bench of AutoEP's rows and the operand kernels (in this order each pair of
# runs read together fits one session).
PLAN=(test-fp8 ab-blocks-tr ab-kpad ab-tail-rows ab-groups finetune-20b finetune-20b-yardsticks train-autoep-step
      test-megatron bench-mlp-fp8 profile-fp8-autoep train-autoep-step-seeds profile-fp8 bench-fp8-gemms bench-autoep
      bench-fp8-operands)
# Estimated seconds of each stage, from the kept runs: the CUDA build took 71-80 s (bench/results/
# gpu-check-h200-2026-12-03.txt, docs/notes/megatron-notes.md) without the CUTLASS GEMMs, which are
# deleted since (109 s with them, below); five 300-step AutoEP runs and
# the report 393 s (docs/autoep-e2e.md), ~78 s a run, here six; the Megatron bench's two tables of six
# rows ~130 s (megatron-notes: build, GPU tests and the bench in 257 s), here seven rows; four 300-step
# Megatron runs 317 s (~79 s a run; the same notes), here six per launch. bench-autoep has no
# recorded duration: two tables of eleven rows at the busiest rank's size (each row about 14
# forward+backward passes of ~0.3-0.4 s) and one torch.compile each, estimated. test-megatron: 50 cases
# took 92 s on 2026-12-03 (bench/results/megatron-h200-2026-12-03/pytest-gpu.txt); 70 now, estimated.
# The FP8 stages, from bench/results/autoep-e2e-h200-2026-12-03 (per 300-step h200 run: 38-60 s of
# steps, 122-182 ms a step, plus ~16 s of model and DeepSpeed setup) and finetune-gpt-oss-fp8-h200-
# 2026-12-02 (300 steps: grouped_mm 202 s, eager 162 s, expertact 52 s, expertact_fp8 53 s), plus ~25 s
# of process start a launch: train-autoep-fp8 three runs ~270 s
# (torchao's step estimated at DeepSpeed's default's); the 1,000-step runs 180 s (bf16) or ~130 s (FP8)
# of steps each; fp8-accuracy: the capture ~75 s (151 steps and the 1.7 GB file), the analysis of it
# ~60 s, the busiest rank's shape ~180 s (its float64 weight-gradient references ~400 TFLOP). test-fp8,
# bench-fp8-gemms and bench-mlp-fp8 have no recorded duration: estimated.
# Measured in the run of 2026-12-05 05:00 UTC (bench/results/gpu-session-h200-2026-12-05b): preflight
# 36 s, build 108 s, test-fp8 52 s, train-autoep 477 s (six runs and the report), train-autoep-fp8 328 s
# (three runs, torchao's 300 steps, the report), bench-mlp-fp8 73 s (its accuracy columns failed: with
# them, estimated 120 s), profile-fp8 53 s, bench-fp8-gemms 41 s; train-autoep-seedN: six runs as
# train-autoep's; train-autoep-blockwise-seeds: two launches of one run each (~85 s a launch, as
# train-autoep-fp8's) and the report.
# Measured in the run of 2026-12-05 02:53 UTC (bench/results/gpu-session-h200-2026-12-05, its
# command.txt files; one H200, 16 cores): preflight 42 s (the wheels' install included), build 109 s
# (with the CUTLASS GEMMs, deleted since), test-fp8 61 s, train-autoep 492 s, fp8-accuracy 111 s,
# train-autoep-fp8 209 s for two runs and torchao's failed start (~85 s a run: four now, torchao's in
# a launch of its own), bench-autoep 145 s and bench-megatron 90 s (now with two more FP8 rows a
# table), bench-fp8-gemms 46 s (now with the promoted row). profile-fp8: three profiled steps
# and their warm-up at the busiest rank's shape, estimated. On one H100 on 2026-12-05 16:21-16:51 UTC
# (bench/results/gpu-session-h100-2026-12-05-full): train-autoep-step 144-152 s (so ~310 s for two
# seeds), profile-fp8-autoep 48-63 s, test-fp8 52-55 s, bench-mlp-fp8 127-140 s, build 82-97 s fresh.
# On one H100 on 2026-12-05 18:46-19:14 UTC (bench/results/gpu-session-h100-2026-12-05-1000): preflight 47 s,
# build 88 s, train-autoep-1000-bf16 448 s, train-autoep-1000-mlp 214 s, train-autoep-1000-fp8 399 s (the
# report included; the seed-2 pair estimated the same), bench-mlp-fp8 117 s, test-fp8 51 s,
# bench-fp8-operands 31 s, scaled-mm-forms 21 s. On one H100 on 2026-12-05 21:28-21:47 UTC
# (bench/results/gpu-session-h100-2026-12-05-seed2): build 53 s, test-fp8 37 s, scaled-mm-forms 17 s
# (its second table included), train-autoep-1000-seed2 427 s, train-autoep-1000-seed2-fp8 383 s,
# profile-fp8-finetune 98 s.
declare -A EST=([preflight]=40 [build]=110 [bench-autoep]=190 [train-autoep]=500 [bench-megatron]=130
                [train-megatron-swiglu]=480 [train-megatron-gpt-oss]=480 [report-megatron]=10
                [test-megatron]=120 [test-fp8]=70 [fp8-accuracy]=120 [train-autoep-fp8]=340 [bench-fp8-gemms]=45
                [bench-mlp-fp8]=120 [profile-fp8]=60 [train-autoep-1000-bf16]=450 [train-autoep-1000-fp8]=400
                [train-autoep-1000-mlp]=215 [train-autoep-1000-seed2]=450 [train-autoep-1000-seed2-fp8]=400
                [finetune-fp8-yardsticks]=400 [finetune-fp8]=140 [train-autoep-seed2]=490
                [train-autoep-seed3]=490 [train-autoep-blockwise-seeds]=190 [scaled-mm-forms]=30
                [profile-fp8-autoep]=45 [bench-fp8-operands]=50
                [train-autoep-step]=170 [train-autoep-step-seeds]=320 [profile-fp8-finetune]=100 [ab-groups]=200
                [ab-tail-rows]=270 [finetune-20b]=240 [finetune-20b-yardsticks]=480 [ab-blocks-tr]=330 [ab-kpad]=290)
# A device call runs at most 600 s and a session has 1,800 s of device time, the machine's start
# included: 30-150 s on 2026-12-05 02:53 and 05:00 UTC, about 350 s at 10:34 UTC (held 646 s by the
# end of a 289 s first call), after three tries that found no machine (90 s each). --plan fills
# calls up to CALL_S (a 10% margin for the estimates) and sessions up to SESSION_S.
CALL_S=${CALL_S:-540}
SESSION_S=${SESSION_S:-1450}
# Where a command is stopped from outside at a time limit, it returns nothing it did not bundle:
# DEADLINE_S (seconds from this script's start, set a little under that limit; default 0, no
# limit) runs each stage under the time left before it, less BUNDLE_RESERVE_S for the archive, so
# that the results of the stages that ran always come back.
DEADLINE_S=${DEADLINE_S:-0}
BUNDLE_RESERVE_S=${BUNDLE_RESERVE_S:-20}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

plan() {
  local total=0 st
  echo "stages and their estimated device time (one H200):"
  for st in "$@"; do
    printf "  %-24s ~%3d s\n" "$st" "${EST[$st]}"
    total=$((total + EST[$st]))
  done
  printf "  %-24s ~%3d s (~%d min), plus the machine's start\n" "total" "$total" $(((total + 59) / 60))
}

# The stages read together with the next one, run on the same machine: a pair opens a session
# where both do not fit the one under way.
declare -A WITH=([train-autoep-1000-bf16]="train-autoep-1000-mlp train-autoep-1000-fp8"
                 [train-autoep-1000-seed2]=train-autoep-1000-seed2-fp8
                 [finetune-fp8-yardsticks]=finetune-fp8 [finetune-20b]=finetune-20b-yardsticks)

# pack STAGE...: the stages in this order, in calls of at most CALL_S and sessions of at most
# SESSION_S (a stage and its WITH in one), each session opening with a call of preflight and build (a
# fresh machine).
pack() {
  local first=$((EST[preflight] + EST[build])) session=0 used=0 call=() call_s=0 st
  flush() {
    [ ${#call[@]} = 0 ] && return
    printf "    call: %-58s ~%3d s\n" "bash scripts/gpu_session.sh ${call[*]}" "$call_s"
    used=$((used + call_s))
    call=()
    call_s=0
  }
  open() {
    [ $session -gt 0 ] && { flush; printf "  session %d total ~%d s of device time\n" $session $used; }
    session=$((session + 1))
    used=0
    printf "  session %d (a fresh machine):\n" $session
    call=(preflight build)
    call_s=$first
  }
  open
  local need w
  for st in "$@"; do
    need=${EST[$st]}
    for w in ${WITH[$st]-}; do need=$((need + EST[$w])); done
    if [ $((used + call_s + need)) -gt "$SESSION_S" ]; then
      open
    fi
    if [ $((call_s + EST[$st])) -gt "$CALL_S" ]; then
      flush
    fi
    call+=("$st")
    call_s=$((call_s + EST[$st]))
  done
  flush
  printf "  session %d total ~%d s of device time\n" $session $used
  echo "  each call as one command on the GPU machine (where it has no network, with scripts/gpu_wheels.sh's .whl/"
  echo "  and .deps/ copied beside the tree), its results in one file:"
  echo "    R=\$OUT; OUT=/tmp/work BUNDLE=\$R/results.tar.gz DEADLINE_S=$((CALL_S + 40)) bash scripts/gpu_session.sh STAGE..."
  echo "  the calls of a session back to back (the build and /tmp/work stay while the machine is held; a lent"
  echo "  machine may go back seconds after a call ends: issue the next call at once, read the results after)"
}

DRY=0
case "${1:-}" in
  "")
    plan "${ORDER[@]}"
    echo "run: bash scripts/gpu_session.sh STAGE... (or all); --plan: every stage packed into sessions"
    exit 0 ;;
  --plan)
    shift
    [ $# = 0 ] && set -- "${PLAN[@]}"
    echo "the stages packed into device calls (<= $CALL_S s) and sessions (<= $SESSION_S s besides the start):"
    pack "$@"
    exit 0 ;;
  --dry-run)
    DRY=1
    shift ;;
esac
STAGES=("$@")
[ "$*" = all ] && STAGES=("${ORDER[@]}")
for st in "${STAGES[@]}"; do
  [ -n "${EST[$st]+x}" ] || { echo "unknown stage '$st' (${ORDER[*]}, all)"; exit 2; }
done
plan "${STAGES[@]}"

# Wheels carried to a machine without network (WHEELS, default .whl; empty: none): installed once
# into SITE, first on PYTHONPATH.
WHEELS=${WHEELS-.whl}
if [ $DRY = 0 ] && [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  if [ ! -f "$SITE/.installed" ] || [ "$(ls "$WHEELS")" != "$(cat "$SITE/.installed")" ]; then
    echo "== installing $WHEELS/ into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl && ls "$WHEELS" > "$SITE/.installed" || { echo "the wheels of $WHEELS/ did not install"; exit 1; }
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
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
for name in ("expertact", "deepspeed", "transformers", "torchao", "megatron.core", "triton"):
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
  if [ $DRY = 1 ]; then
    echo "$name: $*"
    return
  fi
  record "$dir" "$py" "$@"
  local limit=()
  if [ "$DEADLINE_S" -gt 0 ]; then
    local left=$((DEADLINE_S - BUNDLE_RESERVE_S - SECONDS))
    if [ $left -lt 10 ]; then
      echo "== $name: not run, no time left before the call's deadline (DEADLINE_S=$DEADLINE_S)"
      echo "not run: no time left before the call's deadline (DEADLINE_S=$DEADLINE_S)" >> "$dir/command.txt"
      status=1
      return
    fi
    limit=(timeout --kill-after=5 "$left")
  fi
  echo "== $name (~${EST[$name]} s estimated): $*"
  ${limit[@]+"${limit[@]}"} "$@" > "$dir/log.txt" 2>&1
  rc=$?
  [ $rc = 124 ] && echo "stopped at the call's deadline (DEADLINE_S=$DEADLINE_S)" >> "$dir/log.txt"
  echo "== $name: $((SECONDS - t)) s, exit $rc; results in $dir"
  if [ $rc != 0 ]; then
    status=1
    tail -30 "$dir/log.txt"
  fi
  echo "$((SECONDS - t)) s, exit $rc" >> "$dir/command.txt"
}

# The library's sources by content (not by time: a tree copied again between calls has new times),
# recorded when the build stage succeeds: a later call whose sources differ (a branch merged or
# reverted in between) builds again instead of running the new Python over the old library.
SOURCE_HASH="find src include CMakeLists.txt -type f -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40"
source_hash() { bash -c "$SOURCE_HASH"; }
# long_folder SEED: where the 1,000-step runs of a seed go, each seed's runs read together
long_folder() { if [ "$1" = 1234 ]; then echo train-autoep-1000; else echo "train-autoep-1000-seed$1"; fi; }
TRAIN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1 examples/autoep_train.py --config h200
       --ep-size 1)
AUTOEP_REPORT=("$PY" examples/autoep_report.py)
stage() {  # stage NAME: run_stage with the stage's command
  local st=$1 D=$S/$1
  case $st in
    preflight)
      run_stage "$st" "$D" "$PY" bash -c "nvidia-smi; cd /tmp && '$PY' -c \"
import torch, deepspeed, transformers, torchao, matplotlib
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0),
      torch.cuda.get_device_capability(0), 'deepspeed', deepspeed.__version__, 'transformers',
      transformers.__version__, 'torchao', torchao.__version__)
from torchao.prototype.moe_training.config import Float8TrainingOpConfig
\"" ;;
    build)
      run_stage build "$D" "$PY" bash -c "cmake -S . -B '$BUILD' -G Ninja -DCMAKE_BUILD_TYPE=Release -DEXPERTACT_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES='${ARCHS:-90}' -DEXPERTACT_BUILD_TESTS=OFF -DEXPERTACT_BUILD_BENCH=OFF &&
        cmake --build '$BUILD' -j '$(nproc)' --target expertact && { $SOURCE_HASH; } > '$BUILD/source-hash'" ;;
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
        examples/megatron_moe.py \
        --impl megatron,megatron-repeat,megatron-unfused,expertact-inplace,expertact-fp8,expertact-fp8-promoted-wgrad \
        --steps 300 --out "$S/train-megatron" ;;
    train-megatron-gpt-oss)
      run_stage "$st" "$D" "$PY312" "$PY312" -m torch.distributed.run --standalone --nproc-per-node 1 \
        examples/megatron_moe.py --activation gpt-oss \
        --impl megatron,megatron-repeat,megatron-eager,expertact-inplace,expertact-fp8,expertact-fp8-promoted-wgrad \
        --steps 300 --out "$S/train-megatron" ;;
    report-megatron)
      run_stage "$st" "$D" "$PY312" "$PY312" examples/megatron_report.py --in "$S/train-megatron" \
        --md "$D/megatron-train.md" --png "$D/megatron-loss.png" ;;
    test-megatron)
      run_stage "$st" "$D" "$PY312" bash -c "cd /tmp && '$PY312' -m pytest -q -p no:cacheprovider -rs \
        '$ROOT/tests/python/test_megatron.py' '$ROOT/tests/python/test_megatron_example.py'" ;;
    test-fp8)
      local tests=() t
      for t in test_fp8_blocks test_fp8_gemm test_fp8_mlp; do
        [ -f "tests/python/$t.py" ] && tests+=("$ROOT/tests/python/$t.py")
      done
      run_stage "$st" "$D" "$PY" bash -c "cd /tmp && '$PY' -m pytest -q -p no:cacheprovider -rs ${tests[*]}" ;;
    fp8-accuracy)
      run_stage "$st" "$D" "$PY" bash -c "set -e
        ${TRAIN[*]} --impl eager --steps 151 --capture-step 150 --out '$D' --tag h200-eager-step150
        '$PY' -m expertact.bench --fp8-accuracy --tensors '$D/h200-eager-step150.capture.pt' \
          --json '$D/fp8-accuracy-capture.json' --markdown '$D/fp8-accuracy-capture.md'
        '$PY' -m expertact.bench --fp8-accuracy --scales-from '$D/h200-eager-step150.capture.pt' \
          --json '$D/fp8-accuracy-busiest.json' --markdown '$D/fp8-accuracy-busiest.md'" ;;
    train-autoep-fp8)  # beside train-autoep's runs (same machine, same folder), then one report of all;
      # torchao's run in a launch of its own, so that a failure of the peer (a device assert ends the
      # process) costs neither expertact's runs nor the report
      run_stage "$st" "$D" "$PY" bash -c "rc=0
          ${TRAIN[*]} --expert-share --skip-unavailable --out '$S/train-autoep/autoep' \
            --impl mlp-fp8-bf16-wgrad,mlp-fp8-promoted-wgrad,mlp-fp8-blockwise || rc=1
          ${TRAIN[*]} --expert-share --skip-unavailable --out '$S/train-autoep/autoep' --impl torchao-fp8 || rc=1
          ${AUTOEP_REPORT[*]} --in '$S/train-autoep/autoep' --md '$D/autoep-fp8.md' --png '$D/autoep-fp8-loss.png' || rc=1
          exit \$rc" ;;
    scaled-mm-forms)
      run_stage "$st" "$D" "$PY" "$PY" bench/scaled_mm_forms.py --markdown "$D/scaled-mm-forms.md" ;;
    bench-fp8-gemms)
      run_stage "$st" "$D" "$PY" bash -c "if '$PY' -c 'import expertact.bench.fp8_gemm' 2> /dev/null; then
          '$PY' -m expertact.bench --fp8-gemms --json '$D/fp8-gemms.json' --markdown '$D/fp8-gemms.md'
        else echo 'skipped: this expertact has no python -m expertact.bench --fp8-gemms'; fi" ;;
    bench-mlp-fp8)
      run_stage "$st" "$D" "$PY" "$PY" -m expertact.bench --mlp --fp8 --json "$D/mlp-fp8.json" \
        --markdown "$D/mlp-fp8.md" ;;
    profile-fp8)
      run_stage "$st" "$D" "$PY" bash -c "for impl in fp8-bf16-wgrad fp8-promoted-wgrad fp8-blockwise; do
          '$PY' bench/mlp_kernel_profile.py \$impl || exit 1; done" ;;
    profile-fp8-autoep)  # one MoE layer of the AutoEP training: where blockwise's step loses to bf16's
      run_stage "$st" "$D" "$PY" bash -c "for impl in expertact fp8-promoted-wgrad fp8-blockwise; do
          '$PY' bench/mlp_kernel_profile.py \$impl --shape 8,32768,1024,3072 || exit 1; done" ;;
    bench-fp8-operands)  # each operand kernel's rate, blockwise beside rowwise, at both shapes (AutoEP's also
      # with GPT-OSS's gate_up bias)
      run_stage "$st" "$D" "$PY" bash -c "'$PY' bench/fp8_operand_kernels.py --markdown '$D/busiest.md' &&
          '$PY' bench/fp8_operand_kernels.py --shape 8,32768,1024,3072 --markdown '$D/autoep.md' &&
          '$PY' bench/fp8_operand_kernels.py --shape 8,32768,1024,3072 --bias --markdown '$D/autoep-bias.md'" ;;
    train-autoep-seed*)
      local seed=${st#train-autoep-seed}
      # (a run that fails leaves the launch's others and the reports to run; the stage fails)
      run_stage "$st" "$D" "$PY" bash -c "rc=0
          ${TRAIN[*]} --seed $seed --out '$S/$st/autoep' \
            --impl eager,eager-repeat,eager-fused,mlp-inplace,mlp-fp8-bf16-wgrad,mlp-fp8-promoted-wgrad || rc=1
          ${AUTOEP_REPORT[*]} --in '$S/$st/autoep' --md '$D/autoep-seed$seed.md' --png '$D/autoep-seed$seed-loss.png' || rc=1
          ${AUTOEP_REPORT[*]} --in '$S'/train-autoep-seed*/autoep --md '$D/autoep-seeds.md' --png '$D/autoep-seeds-loss.png' || rc=1
          exit \$rc" ;;
    train-autoep-blockwise-seeds)
      run_stage "$st" "$D" "$PY" bash -c "rc=0
          for seed in 2 3; do ${TRAIN[*]} --seed \$seed --out '$S'/train-autoep-seed\$seed/autoep \
            --impl mlp-fp8-blockwise || rc=1; done
          ${AUTOEP_REPORT[*]} --in '$S'/train-autoep-seed*/autoep --md '$D/autoep-seeds.md' --png '$D/autoep-seeds-loss.png' || rc=1
          exit \$rc" ;;
    train-autoep-step)  # beside the bf16 MLP in place: the seed runs' only bf16 MLP, the one the default's
      # rule compared blockwise's step against
      run_stage "$st" "$D" "$PY" "${TRAIN[@]}" --expert-share --out "$S/$st/autoep" \
        --impl mlp-inplace,mlp-fp8-blockwise ;;
    train-autoep-step-seeds)
      run_stage "$st" "$D" "$PY" bash -c "rc=0
          for seed in 2 3; do ${TRAIN[*]} --seed \$seed --expert-share --out '$S/$st'/seed\$seed/autoep \
            --impl mlp-inplace,mlp-fp8-blockwise || rc=1; done
          exit \$rc" ;;
    train-autoep-1000-bf16 | train-autoep-1000-seed2)
      local seed=1234
      [ "$st" = train-autoep-1000-seed2 ] && seed=2
      run_stage "$st" "$D" "$PY" "${TRAIN[@]}" --seed $seed --steps 1000 --corpus stdlib+packages \
        --out "$S/$(long_folder $seed)" --impl eager,eager-repeat ;;
    train-autoep-1000-mlp)
      run_stage "$st" "$D" "$PY" "${TRAIN[@]}" --steps 1000 --corpus stdlib+packages --out "$S/train-autoep-1000" \
        --impl mlp-inplace ;;
    train-autoep-1000-fp8 | train-autoep-1000-seed2-fp8)
      local seed=1234
      [ "$st" = train-autoep-1000-seed2-fp8 ] && seed=2
      local f; f=$(long_folder $seed)
      run_stage "$st" "$D" "$PY" bash -c "${TRAIN[*]} --seed $seed --steps 1000 --corpus stdlib+packages \
          --out '$S/$f' --impl eager-fused,$LONG_FP8 && ${AUTOEP_REPORT[*]} \
          --in '$S/$f' --md '$D/${f#train-}.md' --png '$D/${f#train-}-loss.png'" ;;
    profile-fp8-finetune)
      run_stage "$st" "$D" "$PY" bash -c "'$PY' examples/finetune_gpt_oss.py --variants expertact,expertact_fp8 \
          --fp8 blockwise --steps 30 --profile 4 --out '$D/finetune-profile' &&
          '$PY' examples/finetune_gpt_oss.py --variants expertact_fp8 --fp8 rowwise --steps 30 --profile 4 \
          --out '$D/finetune-profile-rowwise' &&
          '$PY' -m expertact.bench --mlp --fp8 --impls expertact,fp8,fp8-blockwise \
          --no-errors --experts 32 --rows 8192 --dim 1024 --ffn 1024 --json '$D/mlp-fp8.json' \
          --markdown '$D/mlp-fp8.md' &&
          for impl in expertact fp8-blockwise; do '$PY' bench/mlp_kernel_profile.py \$impl --shape 32,8192,1024,1024 \
          || exit 1; done" ;;
    ab-groups)
      run_stage "$st" "$D" "$PY" bash bench/ab/ab.sh "$D" bench/ab/bwd-groups.patch groups ;;
    ab-blocks-tr)
      run_stage "$st" "$D" "$PY" bash bench/ab/ab.sh "$D" bench/ab/blocks-tr.patch "blocks" finetune-20b ;;
    ab-kpad)
      run_stage "$st" "$D" "$PY" bash bench/ab/ab.sh "$D" bench/ab/kpad.patch "test_fp8_gemm or test_fp8_mlp" \
        finetune-20b ;;
    ab-tail-rows)
      run_stage "$st" "$D" "$PY" bash bench/ab/ab.sh "$D" bench/ab/tail-rows.patch "test_fp8_gemm or test_fp8_mlp" \
        finetune ;;
    finetune-20b)
      run_stage "$st" "$D" "$PY" "$PY" examples/finetune_gpt_oss.py --size 20b-experts \
        --variants expertact,expertact_fp8 --fp8 "$FINETUNE_FP8" --profile 4 --out "$S/finetune-20b" ;;
    finetune-20b-yardsticks)
      run_stage "$st" "$D" "$PY" "$PY" examples/finetune_gpt_oss.py --size 20b-experts --variants eager,grouped_mm \
        --out "$S/finetune-20b" ;;
    finetune-fp8-yardsticks)
      run_stage "$st" "$D" "$PY" "$PY" examples/finetune_gpt_oss.py --variants grouped_mm,eager \
        --out "$S/finetune-fp8" ;;
    finetune-fp8)
      run_stage "$st" "$D" "$PY" "$PY" examples/finetune_gpt_oss.py --variants expertact,expertact_fp8 \
        --fp8 "$FINETUNE_FP8" --out "$S/finetune-fp8" ;;
  esac
}

for st in "${STAGES[@]}"; do
  if [ $DRY = 0 ] && [ "$st" != build ] && [ "$st" != preflight ]; then
    if [ ! -f "$BUILD/libexpertact.so" ]; then
      echo "== $st needs the library, which this machine has not built: build first"
      stage build
    elif [ "$(cat "$BUILD/source-hash" 2> /dev/null)" != "$(source_hash)" ]; then
      echo "== the library's sources changed since this machine built it: build again first"
      stage build
    fi
  fi
  stage "$st"
done
if [ $DRY = 0 ] && [ -n "${BUNDLE:-}" ]; then  # every result but the captured tensors, in one archive
  mkdir -p "$(dirname "$BUNDLE")"
  tar czf "$BUNDLE" -C "$OUT" --exclude='*.pt' session && echo "== bundled into $BUNDLE ($(du -h "$BUNDLE" | cut -f1))"
fi
echo "== done: status $status; results in $S"
exit $status
