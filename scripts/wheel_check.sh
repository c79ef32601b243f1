#!/usr/bin/env bash
# On a GPU machine: installs a binary wheel built elsewhere (scripts/build_wheel.sh) into
# a fresh folder without building anything, shows that the installed library is the
# wheel's, and runs the Python test suite (GPU tests included) against that install.
#   bash scripts/wheel_check.sh [dist/expertact-*.whl]
# Results in $OUT/wheel/ ($OUT defaults to out/ in the repository). About 3.5 minutes on an
# H200 (209 s, 2026-11-30: install 7 s, pytest 202 s).
# Needs python3 with torch (a CUDA build) and pytest; cuobjdump (the CUDA toolkit's, or see
# scripts/check_library.sh); no nvcc, cmake or network. DeepSpeed's tests run where
# deepspeed imports (installed, or on PYTHONPATH).
# WHEEL_CHECK_ALLOW_NO_GPU=1 lets it run without a GPU (CUDA tests then skip).
set -uo pipefail
whl_arg=${1:+$(realpath "$1")}
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
RES=$OUT/wheel
TARGET=${WHEEL_TARGET:-/tmp/ea-wheel}
mkdir -p "$RES"
: > "$RES/summary.txt"
note() { echo "== $*" | tee -a "$RES/summary.txt"; }
failed=0
fail() { note "FAIL: $*"; failed=1; }
t0=$(date +%s)

whl=${whl_arg:-$(ls dist/expertact-*.whl 2> /dev/null)}
[ -n "$whl" ] && [ "$(echo "$whl" | wc -l)" = 1 ] && [ -f "$whl" ] ||
  { note "FAIL: expected one wheel (argument or dist/expertact-*.whl), found: '$whl'"; exit 1; }
note "wheel $(basename "$whl"), $(stat -c %s "$whl") bytes, sha256 $(sha256sum "$whl" | cut -d' ' -f1)"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1
  # Whether this machine's pip would also take the manylinux retag (MANYLINUX=1 of build_wheel.sh).
  echo "$(python3 -c 'import platform; print(*platform.libc_ver())'), pip accepts manylinux_2_35_x86_64:" \
    "$(python3 -m pip debug --verbose 2> /dev/null | grep 'manylinux_2_35_x86_64' > /dev/null && echo yes || echo no)"
} | tee -a "$RES/summary.txt"

# 1. Install without building: only binary wheels, no index, and cmake / nvcc / ninja /
#    compilers on PATH replaced by traps that record any call.
rm -rf "$TARGET"
traps=$(mktemp -d)
for t in cmake nvcc ninja make cc c++ gcc g++; do
  printf '#!/bin/sh\necho "%s $*" >> %s/called\nexit 97\n' "$t" "$traps" > "$traps/$t"
  chmod +x "$traps/$t"
done
unset EXPERTACT_LIBRARY  # it would make the package load another library
if ! PATH=$traps:$PATH python3 -m pip install --no-index --no-deps --only-binary :all: \
    --target "$TARGET" "$whl" > "$RES/install.log" 2>&1; then
  cat "$RES/install.log"
  fail "pip install of the wheel failed"
fi
[ -e "$traps/called" ] && fail "the install called build tools: $(cat "$traps/called")"
grep -i -E "building wheel|running cmake|build backend" "$RES/install.log" && fail "pip built something"
rm -rf "$traps"
lib=$TARGET/expertact/libexpertact.so
python3 - "$whl" "$lib" << 'EOF' 2>&1 | tee -a "$RES/summary.txt"
import hashlib, sys, zipfile
whl, lib = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    in_wheel = hashlib.sha256(z.read("expertact/libexpertact.so")).hexdigest()
installed = hashlib.sha256(open(lib, "rb").read()).hexdigest()
print("libexpertact.so sha256: wheel", in_wheel, "installed", installed)
sys.exit(0 if in_wheel == installed else "the installed library is not the wheel's")
EOF
[ "${PIPESTATUS[0]}" = 0 ] || fail "library hash mismatch"
note "install: $(($(date +%s) - t0)) s, no build"

# 2. The installed library: NEEDED (no libcudart), exports, device code.
readelf -d "$lib" | grep NEEDED | tee -a "$RES/summary.txt"
bash scripts/check_library.sh "$lib" --cuda 2>&1 | tee -a "$RES/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || fail "check_library"

# 3. The test suite against the install, from /tmp so that the source tree is not on the
#    path; the runner imports expertact first and refuses any copy but the installed one.
note "pytest tests/python against $TARGET ${PYTEST_ARGS:-}"
t1=$(date +%s)
(cd /tmp && PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} timeout "${PYTEST_TIMEOUT:-540}" python3 - \
  "$ROOT/tests/python" "$TARGET" "$RES/pytest.xml" ${PYTEST_ARGS:-} << 'EOF'
import os, sys
tests, target, xml, *extra = sys.argv[1:]
import expertact, torch
here = os.path.dirname(expertact.__file__)
assert here == os.path.join(target, "expertact"), f"expertact imported from {here}, not from {target}"
assert expertact.LIBRARY_PATH == os.path.join(here, "libexpertact.so"), expertact.LIBRARY_PATH
assert expertact.has_cuda(), "the wheel's library has no CUDA path"
gpu = torch.cuda.is_available()
print(f"expertact {expertact.__version__} from {here}; has_cuda {expertact.has_cuda()}; "
      f"torch {torch.__version__}, GPU: {torch.cuda.get_device_name() if gpu else 'none'}", flush=True)
if not gpu and os.environ.get("WHEEL_CHECK_ALLOW_NO_GPU") != "1":
    sys.exit("no CUDA device visible to torch: the GPU tests would all skip")
import pytest
rc = pytest.main([tests, "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra])
assert sys.modules["expertact"].__file__.startswith(target), "the tests imported another expertact"
sys.exit(int(rc))
EOF
) > "$RES/pytest.log" 2>&1
rc=$?
head -1 "$RES/pytest.log" | tee -a "$RES/summary.txt"
tail -15 "$RES/pytest.log"
grep -E "^[0-9]+ (passed|failed)|passed|failed|error" "$RES/pytest.log" | tail -1 | tee -a "$RES/summary.txt"
[ $rc = 0 ] || fail "pytest rc=$rc (see pytest.log)"
note "pytest: $(($(date +%s) - t1)) s"

if [ $failed = 0 ]; then note "wheel check PASSED in $(($(date +%s) - t0)) s"; else note "wheel check FAILED"; fi
exit $failed
