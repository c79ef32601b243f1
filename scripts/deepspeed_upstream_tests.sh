#!/usr/bin/env bash
# Runs DeepSpeed's own AutoEP unit tests (a copy kept outside the repository, see
# tests/deepspeed_upstream/README.md) four times: as shipped, then with expertact switched in by the
# pytest plugin tests/deepspeed_upstream/expertact_switch.py: enable(experts=True), with
# recompute=True, with inplace_backward=True. Writes each run's JUnit XML, log and switch tally to
# $OUT/deepspeed_upstream/ and compares the outcome of every test across the runs.
#   bash scripts/deepspeed_upstream_tests.sh [DS_TESTS_DIR [TEST_FILE...]]
# DS_TESTS_DIR: the folder holding DeepSpeed's tests/ contents (conftest.py, unit/), default
# .deps/deepspeed-tests. TEST_FILEs, relative to it, default to the AutoEP files that exercise
# GroupedExperts (below; DS_UPSTREAM_FILES overrides them too).
# Exit status: 0 when every test has the same outcome in all runs; 1 when a test that passed as
# shipped fails (or errors) with the switch; 3 when outcomes differ otherwise (e.g. a skip turned
# pass); 2 on a usage or setup error.
# Environment:
#   OUT              results folder (default ./out)
#   EXPERTACT_SRC    installed | tree | auto (default auto): which expertact the switched runs import.
#                    tree = this checkout's python/ (with EXPERTACT_LIBRARY, else the installed
#                    package's libexpertact.so, else one under build/); auto = the installed package
#                    if its enable() takes experts=, else tree.
#   LOCAL_SIZE       devices DeepSpeed's CPU accelerator reports (default 8): its DistributedTest
#                    launches world_size processes only when that many "devices" exist, and on the
#                    CPU it counts NUMA nodes otherwise (1 here), skipping every distributed test.
#   DS_UPSTREAM_RUNS the runs, as name=JSON pairs separated by spaces; "-" for the run without the
#                    plugin (default: baseline=- experts={} recompute={"recompute":true}
#                    inplace={"inplace_backward":true}). The first run is the reference.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
DS_TESTS=${1:-.deps/deepspeed-tests}
[ $# -gt 0 ] && shift
DS_TESTS=$(cd "$DS_TESTS" 2>/dev/null && pwd) || { echo "no DeepSpeed tests folder ${1:-.deps/deepspeed-tests}" \
  "(see tests/deepspeed_upstream/README.md for how to assemble it)" >&2; exit 2; }
if [ $# -gt 0 ]; then FILES=("$@"); else
  read -r -a FILES <<< "${DS_UPSTREAM_FILES:-unit/v1/moe/test_autoep_expert_activation.py unit/v1/moe/test_autoep_unit.py unit/v1/moe/test_autoep_grad_parity.py}"
fi
for f in "${FILES[@]}"; do [ -f "$DS_TESTS/$f" ] || { echo "missing $DS_TESTS/$f" >&2; exit 2; }; done
[ -f "$DS_TESTS/conftest.py" ] && [ -f "$DS_TESTS/unit/common.py" ] || {
  echo "$DS_TESTS lacks conftest.py or unit/common.py (DeepSpeed's test harness)" >&2; exit 2; }
OUT=${OUT:-$REPO/out}
RES="$OUT/deepspeed_upstream"
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
DEFAULT_RUNS='baseline=- experts={} recompute={"recompute":true} inplace={"inplace_backward":true}'
read -r -a RUNS <<< "${DS_UPSTREAM_RUNS:-$DEFAULT_RUNS}"

# Which expertact the switched runs import.
SRC=${EXPERTACT_SRC:-auto}
has_experts() { "$PY" -c 'import inspect, sys, expertact.deepspeed as d; sys.exit("experts" not in inspect.signature(d.enable).parameters)' 2>/dev/null; }
if [ "$SRC" = auto ]; then if has_experts; then SRC=installed; else SRC=tree; fi; fi
EXTRA_PYTHONPATH=""
case "$SRC" in
  installed) ;;
  tree)
    EXTRA_PYTHONPATH="$REPO/python"
    if [ -z "${EXPERTACT_LIBRARY:-}" ]; then
      lib=$("$PY" -c 'import importlib.util, os
s = importlib.util.find_spec("expertact")
p = s and s.submodule_search_locations and os.path.join(list(s.submodule_search_locations)[0], "libexpertact.so")
print(p if p and os.path.exists(p) and not p.startswith(os.path.abspath("python")) else "")' 2>/dev/null || true)
      [ -n "$lib" ] || lib=$(ls -t build/*/libexpertact.so 2>/dev/null | head -1 || true)
      [ -n "$lib" ] || { echo "EXPERTACT_SRC=tree: no libexpertact.so found; set EXPERTACT_LIBRARY" >&2; exit 2; }
      export EXPERTACT_LIBRARY=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")
    fi ;;
  *) echo "EXPERTACT_SRC must be installed, tree or auto (got $SRC)" >&2; exit 2 ;;
esac
sig=$(PYTHONPATH="$EXTRA_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import inspect, expertact.deepspeed as d
print(d.__file__, inspect.signature(d.enable))' 2>&1 | tail -1)
echo "== DeepSpeed tests: $DS_TESTS"
echo "   files: ${FILES[*]}"
echo "   deepspeed $("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))'), expertact for the switched runs ($SRC): $sig"
[ -n "${EXPERTACT_LIBRARY:-}" ] && echo "   EXPERTACT_LIBRARY=$EXPERTACT_LIBRARY"

export DS_ACCELERATOR=cpu LOCAL_SIZE=${LOCAL_SIZE:-8} PYTHONDONTWRITEBYTECODE=1
names=()
for spec in "${RUNS[@]}"; do
  name=${spec%%=*}; switch=${spec#*=}; names+=("$name")
  xml="$RES/$name.xml"; log="$RES/$name.log"; rep="$RES/$name.switch.json"
  rm -f "$xml" "$log" "$rep"
  args=(-p no:cacheprovider --color=no -q -rfEs --junitxml="$xml")
  if [ "$switch" = - ]; then
    echo "== run $name: as shipped"
    envs=()
  else
    echo "== run $name: EXPERTACT_DS_SWITCH='$switch'"
    args=(-p expertact_switch "${args[@]}")
    envs=(EXPERTACT_DS_SWITCH="$switch" EXPERTACT_DS_SWITCH_REPORT="$rep" EXPERTACT_DS_SWITCH_LOG="$RES/$name.switch.d"
          PYTHONPATH="$REPO/tests/deepspeed_upstream${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}")
  fi
  t0=$(date +%s)
  set +e
  (cd "$DS_TESTS" && env "${envs[@]}" "$PY" -m pytest "${args[@]}" "${FILES[@]}") > "$log" 2>&1
  rc=$?
  set -e
  t1=$(date +%s)
    # DeepSpeed's conftest forces colour on: strip the escapes for the summary line.
  last=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^=+ .*(passed|failed|skipped|error).* in ' | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
  echo "   pytest exit $rc in $((t1 - t0)) s: $last"
  echo "$((t1 - t0))" > "$RES/$name.seconds"
  [ -f "$xml" ] || { echo "   no JUnit XML from run $name; see $log" >&2; exit 2; }
done

echo "== per-test outcomes"
"$PY" - "$RES" "${names[@]}" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

res, names = sys.argv[1], sys.argv[2:]


def outcomes(path):
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        out[tid] = ("error" if "error" in tags else "failed" if "failed" in tags or "failure" in tags else
                    "skipped" if "skipped" in tags else "passed")
    return out


runs = {n: outcomes(os.path.join(res, f"{n}.xml")) for n in names}
ref = names[0]
kinds = ("passed", "failed", "error", "skipped")
w = max(len(n) for n in names)
print(f"{'run':<{w}}  " + "  ".join(f"{k:>7}" for k in kinds) + "   seconds  switch: processes (workers), GroupedExperts calls checked (in workers), not expertact")
for n in names:
    counts = [sum(1 for o in runs[n].values() if o == k) for k in kinds]
    secs = open(os.path.join(res, f"{n}.seconds")).read().strip()
    rep = os.path.join(res, f"{n}.switch.json")
    sw = "-"
    if os.path.exists(rep):
        s = json.load(open(rep))
        sw = (f"{s['processes']} ({s['worker_processes']}), {s['grouped_experts_calls']} "
              f"({s['grouped_experts_calls_in_workers']}), {s['calls_not_expertact']}"
              + (f", enable errors: {len(s['enable_errors'])}" if s["enable_errors"] else ""))
    elif n != ref:
        sw = "no switch report"
    print(f"{n:<{w}}  " + "  ".join(f"{c:>7}" for c in counts) + f"   {secs:>7}  {sw}")

tests = sorted(set().union(*runs.values()))
rows = [t for t in tests if len({runs[n].get(t, "absent") for n in names}) > 1]
regressions = [t for t in rows if runs[ref].get(t) == "passed" and any(runs[n].get(t) in ("failed", "error", "absent")
                                                                        for n in names[1:])]
not_passing = [t for t in tests if runs[ref].get(t) in ("failed", "error")]
if not_passing:
    print(f"\nnot passing as shipped ({ref}), so not evidence either way:")
    for t in not_passing:
        print(f"  {runs[ref][t]:<7} {t}")
if rows:
    print(f"\ntests whose outcome differs between runs ({len(rows)}):")
    tw = max(len(t) for t in rows)
    print(f"  {'test':<{tw}}  " + "  ".join(f"{n:>{max(len(n), 7)}}" for n in names))
    for t in rows:
        print(f"  {t:<{tw}}  " + "  ".join(f"{runs[n].get(t, 'absent'):>{max(len(n), 7)}}" for n in names))
else:
    print(f"\nall {len(tests)} tests have the same outcome in every run")
with open(os.path.join(res, "summary.json"), "w") as f:
    json.dump(dict(runs=names, differing=rows, regressions=regressions, outcomes=runs), f, indent=1)
if regressions:
    print(f"\nFAIL: {len(regressions)} test(s) pass as shipped and fail with the switch")
    sys.exit(1)
sys.exit(3 if rows else 0)
EOF
