#!/usr/bin/env bash
# The DeepSpeed AutoEP end-to-end runs behind docs/autoep-e2e.md, on one machine with 2 GPUs, then
# the report: $OUT/autoep/ gets one JSON and one log per run, autoep-e2e.md and autoep-e2e-loss.png.
#
#   bash examples/run_autoep_e2e.sh                # small (4 runs) + large (3 runs) + report
#   bash examples/run_autoep_e2e.sh small          # only some parts, in this order
#   bash examples/run_autoep_e2e.sh large report   # split across two calls: REPORT_IN="DIR..." adds the
#                                                  # JSON folders of an earlier call to the report
#   bash examples/run_autoep_e2e.sh tiny report    # the CPU smoke test (2 ranks, gloo; no GPU needed)
#   bash examples/run_autoep_e2e.sh h200 report    # the whole expert MLP on ONE GPU (autoep_size 1), 300 steps
#   SMALL_ARGS="--steps 300" LARGE_ARGS="--micro-batch 48" bash examples/run_autoep_e2e.sh
#
# Parts: small = 200 steps x 3 impls (eager, expertact, expertact-inplace) plus the bf16-noise
# yardstick (eager with gate_up_impl separate; NOREF=1 skips it); large = 20 steps x 3 impls with a
# few hundred thousand rows per rank and MoE layer; h200 = one GPU, every expert on it (autoep_size 1),
# 300 steps of DeepSpeed's own path, its gate_up_impl "separate" twin (the yardstick), expertact's
# activation (enable()), expertact's whole expert MLP in place (enable(experts=True,
# inplace_backward=True)) and in FP8 (enable(experts=True, fp8="rowwise")), each with the experts'
# measured share of the step; report = examples/autoep_report.py.
# Needs: torch with CUDA, transformers >= 5.15, matplotlib, deepspeed 0.19.8 importable (e.g.
# PYTHONPATH=/tmp/site), expertact with expertact.deepspeed.enable() (installed with its CUDA path
# here when the installed one lacks it). No network.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out}  # the one output folder of scripts/ and examples/, git-ignored
RES=$OUT/autoep
mkdir -p "$RES"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(small large report)

# NVLink multicast stays off on the GPU machine: NCCL NVLS, torch symmetric memory, NVSHMEM.
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
  export EXPERTACT_DLPACK_INCLUDE_DIR=${EXPERTACT_DLPACK_INCLUDE_DIR:-$ROOT/.deps/include}
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

for part in "${PARTS[@]}"; do
  case $part in
    small|large|tiny)
      eval "extra=(\${${part^^}_ARGS:-})"
      for impl in eager expertact expertact-inplace; do
        rm -f "$RES/$part-$impl.json"
        run "$part-$impl" --config "$part" --impl "$impl" "${extra[@]}"
      done
      if [ "${NOREF:-0}" != 1 ] && [ "$part" != large ]; then
        rm -f "$RES/$part-eager-separate.json"
        run "$part-eager-separate" --config "$part" --impl eager --gate-up-impl separate "${extra[@]}"
      fi
      ;;
    h200)
      NPROC=1
      eval "extra=(\${H200_ARGS:-})"
      for impl in eager expertact mlp-inplace mlp-fp8; do
        rm -f "$RES/h200-$impl.json"
        run "h200-$impl" --config h200 --ep-size 1 --expert-share --impl "$impl" "${extra[@]}"
      done
      if [ "${NOREF:-0}" != 1 ]; then
        rm -f "$RES/h200-eager-separate.json"
        run "h200-eager-separate" --config h200 --ep-size 1 --expert-share --impl eager --gate-up-impl separate \
          "${extra[@]}"
      fi
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
