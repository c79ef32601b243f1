#!/usr/bin/env bash
# One call on a 2-GPU machine (no network) that runs several of the project's GPU scripts
# side by side, one track per GPU, from a binary wheel built elsewhere (scripts/build_wheel.sh),
# and packs what they wrote into $OUT (at most a few files come back from such a machine).
#
#   bash scripts/device_session.sh check   # C++ build + tuning harness + ctest (GPU 0) | the wheel's
#                                          # pytest suite + GPU fuzz + OOM/graph tests (GPU 1);
#                                          # first a short AutoEP smoke on both GPUs
#   bash scripts/device_session.sh bench   # bench --peers (GPU 0) | bench --mlp, sanitizers (GPU 1)
#   bash scripts/device_session.sh e2e     # the AutoEP end-to-end runs and their report (both GPUs),
#                                          # then the GPU fuzzer
#   bash scripts/device_session.sh extra   # the fused grouped GEMMs (GPU 0) | the host-cost table alone,
#                                          # then the sanitizers over pytest (GPU 1)
#   bash scripts/device_session.sh fused   # the fused grouped GEMMs with epilogue probes and ncu (GPU 0) |
#                                          # the whole sanitizer sweep, then bench_mlp's unfused rows (GPU 1)
#   bash scripts/device_session.sh fused2  # the fused GEMMs again (GPU 0) | san_diag, then the whole pytest
#                                          # suite from the source tree over the packed library (GPU 1)
#   bash scripts/device_session.sh fused3  # the fused GEMMs again (GPU 0) | san_diag, then the sanitizer
#                                          # sweep under racecheck only (GPU 1)
#   bash scripts/device_session.sh final   # the fused GEMMs' checks and timings (GPU 0) | the whole sanitizer
#                                          # sweep, then the whole pytest suite (GPU 1)
#
# Needs in the tree: dist/expertact-*.whl, .whl/ (deepspeed 0.19.8 and the packages it lacks there),
# .deps/ (dlpack.h, googletest sources). Each part's own script says what it measures.
# Environment: BENCH_ARGS, MLP_ARGS, VARIANTS, E2E_PARTS, *_LIMIT (seconds per track).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CALL=${1:?usage: device_session.sh check|bench|e2e|extra|fused|fused2|fused3|final}
FINAL=${OUT:-$ROOT/_device_out}
# Everything is written under a work folder; $OUT gets the session log and one archive of it.
OUT=/tmp/session-$CALL
rm -rf "$OUT"
mkdir -p "$OUT" "$FINAL"
LOG=$OUT/session.txt
note() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
T0=$SECONDS

# NVLink multicast stays off (NCCL NVLS, torch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda

{
  date -u +%FT%TZ
  echo "commit $(git rev-parse HEAD 2>/dev/null) ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  nvcc --version 2>/dev/null | tail -1
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$LOG"

# DeepSpeed and the packages the machine lacks, then the expertact wheel, both without building.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip-site.log" 2>&1 || { tail "$OUT/pip-site.log"; note "wheels of .whl/ did not install"; }
whl=$(ls dist/expertact-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || { note "no dist/expertact-*.whl"; exit 1; }
rm -rf /tmp/ea-wheel
python3 -m pip install -q --no-index --no-deps --only-binary :all: --target /tmp/ea-wheel "$whl" \
  > "$OUT/pip-wheel.log" 2>&1 || { tail "$OUT/pip-wheel.log"; note "the expertact wheel did not install"; exit 1; }
export PYTHONPATH=/tmp/ea-wheel:/tmp/site
(cd /tmp && python3 -c 'import expertact, deepspeed; print("expertact", expertact.__version__, expertact.LIBRARY_PATH, "cuda", expertact.has_cuda(), "| deepspeed", deepspeed.__version__)') 2>&1 | grep -v "^\[" | tee -a "$LOG"

# track NAME GPU SECONDS CMD...: runs CMD on one GPU (or "0,1") with a time limit, output to $OUT/NAME.log.
track() {
  local name=$1 gpu=$2 limit=$3 t=$SECONDS
  shift 3
  note "start $name on GPU $gpu (limit $limit s): $*"
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
  note "end $name rc=$? after $((SECONDS - t)) s"
}

case $CALL in
  check)
    # The C++ build needs no GPU: it runs while a short AutoEP smoke uses both GPUs.
    (STAGES="build" OUT="$OUT/dev" bash scripts/device_run.sh > "$OUT/build.log" 2>&1; note "C++ build rc=$?") &
    b=$!
    track autoep-smoke 0,1 150 "NOREF=1 SMALL_ARGS='--steps 4 --warmup 1' OUT='$OUT/smoke' bash examples/run_autoep_e2e.sh small"
    wait $b
    track harness-ctest 0 380 "STAGES='variants ctest' VARIANTS='${VARIANTS:-ds}' CTEST_TIMEOUT=330 CTEST_JOBS=12 OUT='$OUT/dev' bash scripts/device_run.sh" &
    a=$!
    track wheel-pytest 1 380 "OUT='$OUT' PYTEST_TIMEOUT=360 bash scripts/wheel_check.sh '$whl'; ${RELIAB_CHECK:-true}" &
    wait $a; wait
    ;;
  bench)
    # Cores split between the tracks, so that the host-cost table and the small sizes of
    # bench --peers (host-bound) do not share cores with the sanitizer processes.
    track peers 0 ${PEERS_LIMIT:-460} "cd /tmp && taskset -c 0-11 python3 -m expertact.bench --peers ${BENCH_ARGS:---repeat 2} --json '$OUT/peers.json' --markdown '$OUT/peers.md' > '$OUT/peers.out'" &
    a=$!
    track mlp-sanitize 1 ${MLP_LIMIT:-460} "taskset -c 12-31 bash -c \"OUT='$OUT' STAGES=bench MLP_ARGS='${MLP_ARGS:-}' bash scripts/moe_device.sh; OUT='$OUT' SAN_TIMEOUT=${SAN_TIMEOUT:-230} bash scripts/sanitize.sh\"" &
    wait $a; wait
    ;;
  e2e)
    track autoep 0,1 ${E2E_LIMIT:-400} "OUT='$OUT' bash examples/run_autoep_e2e.sh ${E2E_PARTS:-small large report}"
    # Then the differential fuzzer on the wheel's library (GPU 0) for what time is left.
    track fuzz 0 ${FUZZ_LIMIT:-90} "OUT='$OUT' FUZZ_LIB=/tmp/ea-wheel/expertact/libexpertact.so STAGES=fuzz FUZZ_SECONDS=${FUZZ_SECONDS:-60} bash scripts/reliability_gpu.sh" &
    wait
    ;;
  extra)
    # The fused grouped GEMMs (a library packed elsewhere: .deps/cutlass-dev) on GPU 0; on GPU 1
    # first the host-cost table alone on a quiet machine, then the sanitizers over pytest.
    track cutlass 0 ${CUTLASS_LIMIT:-300} "taskset -c 0-15 bash -c \"OUT='$OUT' bash scripts/cutlass_device.sh\"" &
    a=$!
    track host-sanitize 1 ${SAN_LIMIT:-300} "taskset -c 16-31 bash -c \"cd /tmp && PYTHONPATH='$ROOT/python:/tmp/site' EXPERTACT_LIBRARY=/tmp/ea-wheel/expertact/libexpertact.so python3 -m expertact.bench --peers --host-only --repeat 3 --json '$OUT/host.json' --markdown '$OUT/host.md' > '$OUT/host.out'; cd '$ROOT' && OUT='$OUT' SAN_PARTS=pytest SAN_TIMEOUT=${SAN_TIMEOUT:-170} bash scripts/sanitize.sh\"" &
    wait $a; wait
    ;;
  fused | fused2 | fused3 | final)
    # GPU 0: the fused grouped GEMMs (the library packed elsewhere: .deps/cutlass-dev), checks,
    # timings with the epilogue probes and (but for final) ncu. GPU 1, by call:
    #   fused   san_diag, the whole sanitizer sweep, then bench_mlp's unfused rows
    #   fused2  san_diag, then the whole pytest suite
    #   fused3  san_diag, then the sanitizer sweep under racecheck only
    #   final   the whole sanitizer sweep, then the whole pytest suite
    # The Python package comes from the source tree, over the packed library.
    PACKED="PYTHONPATH='$ROOT/python:/tmp/site' EXPERTACT_LIBRARY='$ROOT/.deps/cutlass-dev/libexpertact.so'"
    DIAG="OUT='$OUT' LIB='$ROOT/.deps/cutlass-dev/libexpertact.so' bash scripts/san_diag.sh"
    SAN="cd '$ROOT' && OUT='$OUT' SAN_TIMEOUT=${SAN_TIMEOUT:-240} bash scripts/sanitize.sh"
    PYT="cd /tmp && $PACKED timeout ${PYTEST_TIMEOUT:-270} python3 -m pytest '$ROOT/tests/python' -q -p no:cacheprovider -rfE --junitxml='$OUT/pytest-gpu.xml' > '$OUT/pytest-gpu.log' 2>&1; tail -5 '$OUT/pytest-gpu.log'"
    MLP="cd /tmp && $PACKED timeout ${MLP_TIMEOUT:-200} python3 -m expertact.bench_mlp --impls ${MLP_IMPLS:-gemms,eager,compile,deepspeed,expertact-op,expertact,expertact-inplace,expertact-recompute,expertact-recompute-inplace} ${MLP_ARGS:-} --json '$OUT/mlp.json' --markdown '$OUT/mlp.md' > '$OUT/mlp.out' 2> '$OUT/mlp.progress'"
    case $CALL in
      fused) GPU1="$DIAG; $SAN; $MLP" ;;
      fused2) GPU1="$DIAG; $PYT" ;;
      fused3) GPU1="$DIAG; $SAN"; export SAN_TOOLS=racecheck ;;
      final) GPU1="$SAN; $PYT"; export STAGES=${STAGES:-"env gtest pytest kernels mlp"} ;;
    esac
    track cutlass 0 ${CUTLASS_LIMIT:-480} "taskset -c 0-15 bash -c \"OUT='$OUT' bash scripts/cutlass_device.sh\"" &
    a=$!
    track gpu1 1 ${GPU1_LIMIT:-540} "taskset -c 16-31 bash -c \"$GPU1\"" &
    wait $a; wait
    ;;
  *) note "unknown call $CALL (check, bench, e2e, extra, fused, fused2, fused3, final)"; exit 2 ;;
esac

note "$CALL done in $((SECONDS - T0)) s"
# Few files come back from the machine: the session log, and everything in one archive.
cp "$LOG" "$FINAL/session-$CALL.txt"
tar czf "$FINAL/$CALL.tgz" -C "$OUT" . 2>/dev/null
ls -la "$FINAL"
