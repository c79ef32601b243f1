#!/usr/bin/env bash
# One A/B of a change not yet on main, on the GPU: main, then with PATCH applied, then main
# again, each time MODE's measurement, and the patch's own GPU tests (pytest -k TESTS) while it
# is applied; the tree is restored on exit. MODE "bench": the module bench's bf16 and blockwise
# rows at the busiest rank's shape and at AutoEP's; "finetune": examples/finetune_gpt_oss.py's
# blockwise run, 100 steps (its routing skewed as training makes it; bf16 beside it in the first
# main run), 4 of them profiled (--profile; left out of the timing); "finetune-20b": the same
# at --size 20b-experts (GPT-OSS-20B's layer dims), 40 steps, after the operand passes
# (bench/fp8_operand_kernels.py, the weights' blocks among them) at its expert shape. A stage
# of scripts/gpu_session.sh (ab-groups, ab-tail-rows, ab-blocks-tr, ab-kpad), which builds the library
# and sets PYTHONPATH and EXPERTACT_LIBRARY; a patch that touches src/ is built into that
# library when applied and built out again when restored (ninja rebuilds the files it changed).
#
#   bash bench/ab/ab.sh RESULTS_DIR PATCH PYTEST_K [MODE]
set -u
cd "$(dirname "$0")/../.."
R=${1:?results dir} PATCH=${2:?patch} K=${3:?pytest -k expression} MODE=${4:-bench}
PY=${PYTHON:-python3}
mkdir -p "$R"
applied=0
BUILD_DIR=$(dirname "${EXPERTACT_LIBRARY:-build/gpu/libexpertact.so}")
native=0
grep -q '^diff --git a/src/' "$PATCH" && native=1
rebuild() {  # the library again from the tree as it is now, where the patch has C++
  [ $native = 1 ] || return 0
  cmake --build "$BUILD_DIR" --target expertact > "$R/build-$1.log" 2>&1 || { echo "build ($1) failed"; rc=1; }
}
restore() { [ $applied = 1 ] && git apply -R "$PATCH" && applied=0 && echo "restored main" && rebuild main; }
trap restore EXIT
rc=0
bench() {  # bench LABEL: MODE's measurement
  local t0=$SECONDS rows=(--impls expertact,fp8-blockwise --no-errors)
  if [ "$MODE" = finetune ] || [ "$MODE" = finetune-20b ]; then
    local variants=expertact_fp8 size=(--steps 100)
    [ "$1" = main-1 ] && variants=expertact,expertact_fp8
    if [ "$MODE" = finetune-20b ]; then
      size=(--size 20b-experts --steps 40)
      "$PY" bench/fp8_operand_kernels.py --shape "${AB_OPERANDS_SHAPE:-32,4096,2880,2880}" \
        --markdown "$R/operands-$1.md" \
        > "$R/operands-$1.log" 2>&1 || rc=1
    fi
    # (AB_FINETUNE_ARGS: more of its options, e.g. --dtype bf16 to try this script on the CPU)
    "$PY" examples/finetune_gpt_oss.py --variants $variants --fp8 blockwise "${size[@]}" --profile 4 \
      --out "$R/finetune-$1" ${AB_FINETUNE_ARGS:-} > "$R/finetune-$1.log" 2>&1 || rc=1
    echo "finetune $1: $((SECONDS - t0)) s"
    return
  fi
  "$PY" -m expertact.bench --mlp --fp8 "${rows[@]}" --json "$R/busiest-$1.json" --markdown "$R/busiest-$1.md" \
    > "$R/busiest-$1.log" 2>&1 || rc=1
  "$PY" -m expertact.bench --mlp --fp8 "${rows[@]}" --experts 8 --rows 32768 --dim 1024 --ffn 3072 \
    --json "$R/autoep-$1.json" --markdown "$R/autoep-$1.md" > "$R/autoep-$1.log" 2>&1 || rc=1
  echo "bench $1: $((SECONDS - t0)) s"
}
bench main-1
git apply "$PATCH" && applied=1 && echo "applied $PATCH" || { echo "$PATCH does not apply to this tree"; exit 1; }
rebuild patch
bench patch
(cd /tmp && "$PY" -m pytest -q -p no:cacheprovider -rs "$OLDPWD/tests/python" -k "$K") > "$R/pytest.txt" 2>&1 || rc=1
tail -3 "$R/pytest.txt"
restore
bench main-2
if [ "$MODE" = bench ]; then  # per shape and row: fwd+bwd and extra peak, main / patched / main
  "$PY" - "$R" <<'PYEOF' || rc=1
import json, sys
for shape in ("busiest", "autoep"):
    runs = {k: {r["impl"]: r for r in json.load(open(f"{sys.argv[1]}/{shape}-{k}.json"))["results"]}
            for k in ("main-1", "patch", "main-2")}
    for impl in runs["main-1"]:
        nan = float("nan")
        cells = [f"{k} {runs[k][impl].get('ms', nan):.2f} ms, {runs[k][impl].get('extra_peak_gib', nan):.2f} GiB"
                 for k in runs if impl in runs[k]]
        print(f"{shape} {impl}: " + "; ".join(cells))
PYEOF
fi
if [ "$MODE" != bench ]; then  # the same bits per step: the patch changes no value
  "$PY" - "$R" <<'PYEOF' || rc=1
import json, sys
runs = {k: json.load(open(f"{sys.argv[1]}/finetune-{k}/results.json"))["variants"]["expertact_fp8"]
        for k in ("main-1", "patch", "main-2")}
for k, r in runs.items():
    print(f"{k}: step {r['mean_step_time_s'] * 1e3:.1f} ms, final loss {r['final_loss']:.4f}")
same = [runs["patch"]["loss"] == runs[k]["loss"] for k in ("main-1", "main-2")]
print("patch's losses bit-identical to main's:", same)
sys.exit(0 if any(same) else 1)
PYEOF
fi
for f in "$R"/finetune-*/profile-*.txt; do  # where each run's step went (4 profiled steps)
  [ -f "$f" ] && echo "== ${f#$R/}" && head -2 "$f"
done
for f in "$R"/operands-*.md; do  # the weights' passes, main / patched / main
  [ -f "$f" ] && echo "== ${f#$R/}" && grep -E "^\| (all six|all four|gate_up's B|y's B|dh's B|dx's B) " "$f"
done
for f in "$R"/*.md "$R"/finetune-*/results.md; do
  case $f in "$R"/operands-*) continue ;; esac
  [ -f "$f" ] && echo "== ${f#$R/}" && grep -E "^\| (expertact|expertact_fp8|fp8-blockwise) " "$f"
done
exit $rc
