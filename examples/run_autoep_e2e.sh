#!/usr/bin/env bash
# The DeepSpeed AutoEP end-to-end runs behind docs/autoep-e2e.md, then the report: $OUT/autoep/
# gets one JSON and one log per run, autoep-e2e.md and autoep-e2e-loss.png.
#
#   bash examples/run_autoep_e2e.sh                # small + large + report (2 GPUs)
#   bash examples/run_autoep_e2e.sh small          # only some parts, in this order
#   bash examples/run_autoep_e2e.sh large report   # REPORT_IN="DIR..." adds the JSON folders of an earlier
#                                                  # call to the report
#   bash examples/run_autoep_e2e.sh tiny report    # the CPU smoke test (2 ranks, gloo; no GPU needed)
#   bash examples/run_autoep_e2e.sh h200 report    # the whole expert MLP on ONE GPU (autoep_size 1), 300 steps
#   SMALL_ARGS="--steps 300" LARGE_ARGS="--micro-batch 48" bash examples/run_autoep_e2e.sh
#
# Every part compares against DeepSpeed as a user runs it by default (--impl eager: its own experts
# on AutoEP's default gate_up_impl "separate"); the yardsticks of a loss difference are the same run
# again (eager-repeat) and DeepSpeed with gate_up_impl "fused" (eager-fused: the same function rounded
# in another order). NOREF=1 leaves the yardsticks out.
#   small  200 steps, 2 ranks: eager, expertact, expertact-inplace; yardsticks
#   large  20 steps, 2 ranks, a few hundred thousand rows per rank and MoE layer: eager, expertact,
#          expertact-inplace
#   h200   300 steps on one GPU, every expert on it (autoep_size 1): eager, expertact (enable()),
#          mlp-inplace (enable(experts=True, inplace_backward=True)), mlp-fp8 (enable(experts=True,
#          fp8="rowwise"), Hopper only), each with the experts' measured share of the step; yardsticks
#   tiny   the small part's runs on the CPU, tiny model, 3 steps
#   report examples/autoep_report.py over $OUT/autoep (and REPORT_IN)
#
# Needs: 2 CUDA GPUs for small and large, one for h200 (Hopper for mlp-fp8), none for tiny; Python
# with torch (a CUDA build on a GPU machine), deepspeed 0.19.8, transformers >= 5.15 and matplotlib;
# expertact importable with its CUDA path (when it lacks it, the script builds it into the Python
# environment: nvcc, CMake >= 3.24, Ninja, scikit-build-core and dlpack.h needed). No network.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out}  # the one output folder of scripts/ and examples/, git-ignored
RES=$OUT/autoep
mkdir -p "$RES"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(small large report)

# NVLink multicast stays off (NCCL NVLS, torch symmetric memory, NVSHMEM): shared GPU hosts may not allow it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

fail() { echo "run_autoep_e2e.sh: $*" >&2; exit 1; }
T0=$SECONDS
needs_gpu=0
for part in "${PARTS[@]}"; do
  [[ $part == h200 ]] && [ $needs_gpu = 0 ] && needs_gpu=1
  [[ $part == small || $part == large ]] && needs_gpu=2
done

# Preflight: everything the runs import, before any of them starts.
(cd /tmp && $PY - "$needs_gpu" <<'EOF') || fail "preflight failed (see above)"
import sys, torch, deepspeed, transformers, matplotlib
from packaging.version import Version
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
from deepspeed.module_inject.auto_ep_presets.registry import available_preset_names
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPUs), deepspeed "
      f"{deepspeed.__version__}, transformers {transformers.__version__}, matplotlib {matplotlib.__version__}")
assert Version(transformers.__version__) >= Version("5.15"), "the minimax_m3 preset needs transformers >= 5.15"
assert "minimax_m3" in available_preset_names(), "this DeepSpeed has no minimax_m3 AutoEP preset"
if sys.argv[1] != "0":
    assert torch.cuda.device_count() >= int(sys.argv[1]), f"these parts need {sys.argv[1]} GPUs"
EOF
expertact_ok() {
  (cd /tmp && $PY -c "
import sys, torch, expertact, expertact.deepspeed as x
print('expertact', expertact.__version__, 'from', expertact.LIBRARY_PATH, '| CUDA path:', expertact.has_cuda())
assert hasattr(x, 'enable') and hasattr(x, 'disable'), 'expertact.deepspeed has no enable()/disable() (an older expertact)'
assert expertact.has_cuda() or sys.argv[1] == '0', 'no CUDA path'
" "$needs_gpu")
}
if ! expertact_ok; then
  [ "$needs_gpu" != 0 ] || fail "expertact is not usable (see above)"
  echo "== installing expertact with its CUDA path (a few minutes)"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  $PY -m pip install --no-index --no-build-isolation --no-deps -C cmake.define.EXPERTACT_CUDA=ON . \
    >"$RES/build.log" 2>&1 || { tail -30 "$RES/build.log"; fail "expertact build failed ($RES/build.log)"; }
  expertact_ok || fail "expertact still not usable after the build"
fi

status=0
NPROC=2
run() {  # run TAG ARGS...: one training run on NPROC ranks; its full log goes to $RES/TAG.log
  local tag=$1 t=$SECONDS
  shift
  echo "== $tag: torchrun --nproc_per_node $NPROC examples/autoep_train.py $*"
  $PY -m torch.distributed.run --standalone --nproc_per_node $NPROC examples/autoep_train.py --out "$RES" --tag "$tag" \
    "$@" >"$RES/$tag.log" 2>&1
  local rc=$?
  grep -E "^\[$tag\]" "$RES/$tag.log"
  if [ $rc -ne 0 ] || [ ! -s "$RES/$tag.json" ]; then
    status=1
    echo "== $tag FAILED (rc $rc); its errors, then the end of $RES/$tag.log:"
    grep -E "Error|error:|autoep_train.py:" "$RES/$tag.log" | grep -v "torch.distributed.elastic" | sort -u | head -20
    tail -25 "$RES/$tag.log"
  fi
  echo "== $tag: $((SECONDS - t)) s"
}

runs() {  # runs PART IMPL... -- ARGS...: one run per impl, tagged PART-IMPL, each with ARGS
  local part=$1 impl
  shift
  local impls=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do impls+=("$1"); shift; done
  shift
  for impl in "${impls[@]}"; do
    rm -f "$RES/$part-$impl.json"
    run "$part-$impl" --config "$part" --impl "$impl" "$@"
  done
}
yardsticks() { [ "${NOREF:-0}" != 1 ] && echo eager-repeat eager-fused; }

for part in "${PARTS[@]}"; do
  case $part in
    small|tiny)
      eval "extra=(\${${part^^}_ARGS:-})"
      # shellcheck disable=SC2046
      runs "$part" eager expertact expertact-inplace $(yardsticks) -- "${extra[@]}"
      ;;
    large)
      eval "extra=(\${LARGE_ARGS:-})"
      runs large eager expertact expertact-inplace -- "${extra[@]}"
      ;;
    h200)
      NPROC=1
      eval "extra=(\${H200_ARGS:-})"
      # shellcheck disable=SC2046
      runs h200 eager expertact mlp-inplace mlp-fp8 $(yardsticks) -- --ep-size 1 --expert-share "${extra[@]}"
      NPROC=2
      ;;
    report)
      echo "== report"
      # shellcheck disable=SC2086
      $PY examples/autoep_report.py --in "$RES" ${REPORT_IN:-} --md "$RES/autoep-e2e.md" --png "$RES/autoep-e2e-loss.png" \
        || { status=1; echo "== report FAILED"; }
      ;;
    *) echo "unknown part $part (small, large, h200, tiny, report)"; status=1 ;;
  esac
done
echo "== done in $((SECONDS - T0)) s, status $status; results in $RES"
exit $status
