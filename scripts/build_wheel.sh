#!/usr/bin/env bash
# Builds the binary wheel dist/expertact-<version>-py3-none-<platform>.whl (CUDA path
# required: sm_80 + sm_90 machine code, compute_90 PTX, CUDA runtime linked statically)
# and checks the library inside it: NEEDED entries, exports, glibc needs, device code.
#   bash scripts/build_wheel.sh               (from anywhere in the repository)
#   MANYLINUX=1 bash scripts/build_wheel.sh   also retag it manylinux with auditwheel
# Needs nvcc (the CUDA toolkit) and python3; installs scikit-build-core, cmake and ninja with
# pip where they are missing, and the check's cuobjdump where no CUDA toolkit has it (the PyPI
# package nvidia-cuda-cuobjdump, into build/tools: scripts/check_library.sh).
# Output: the wheel in dist/ (DIST), the build log in out/wheel/build.log (OUT).
# The wheel needs no CUDA toolkit and no torch build where it is installed, only an
# NVIDIA driver >= 580 (docs/python.md, "Installing"). Build time on 2 cores: docs/BENCHMARKS.md
# section 11.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIST=${DIST:-dist}
OUT=${OUT:-$PWD/out}
LOG=$OUT/wheel/build.log
command -v nvcc > /dev/null || { echo "nvcc not found: a binary wheel needs the CUDA path (install the CUDA toolkit)"; exit 1; }
# The build backend and tools (pip wheel --no-build-isolation uses what is installed).
missing=()
$PY -c "import scikit_build_core" 2> /dev/null || missing+=(scikit-build-core)
command -v cmake > /dev/null || missing+=(cmake)
command -v ninja > /dev/null || missing+=(ninja)
[ "${MANYLINUX:-0}" = 1 ] && { $PY -c "import auditwheel" 2> /dev/null || missing+=(auditwheel); }
[ "${MANYLINUX:-0}" = 1 ] && { $PY -c "import wheel" 2> /dev/null || missing+=(wheel); }
if [ ${#missing[@]} -gt 0 ]; then
  echo "== pip install ${missing[*]}"
  $PY -m pip install -q "${missing[@]}"
fi
unset CMAKE_ARGS  # a -DEXPERTACT_CUDA=OFF from the caller's shell must not reach this build

mkdir -p "$DIST" "$(dirname "$LOG")"
rm -f "$DIST"/expertact-*.whl
echo "== pip wheel . ($(nvcc --version | tail -1)); log: $LOG"
t0=$(date +%s)
# Its own build folder, so that it never reconfigures the CPU-only one of scripts/test.sh.
if ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    $PY -m pip wheel . --no-deps --no-build-isolation -w "$DIST" -v \
    -C build-dir=_skbuild/wheel -C cmake.define.EXPERTACT_CUDA=ON > "$LOG" 2>&1; then
  tail -40 "$LOG"
  echo "WHEEL BUILD FAILED (see $LOG)"
  exit 1
fi
echo "built in $(($(date +%s) - t0)) s"
grep "expertact:" "$LOG" || true
whl=$(ls "$DIST"/expertact-*.whl)
[ "$(echo "$whl" | wc -l)" = 1 ] || { echo "expected one wheel in $DIST, found: $whl"; exit 1; }

if [ "${MANYLINUX:-0}" = 1 ]; then
  # auditwheel (optional: pip install auditwheel) names the oldest (widest) manylinux policy whose
  # symbol versions the library fits (here: manylinux_2_35, from GLIBCXX_3.4.30 of GCC 12);
  # there is nothing to graft (every NEEDED is a system library), so the wheel is only
  # retagged, its files byte for byte the same.
  plat=$($PY -m auditwheel show "$whl" 2>&1 | tr -s ' \n' ' ' | grep -o 'consistent with the following platform tag: "manylinux_[0-9]*_[0-9]*_x86_64"' | grep -o 'manylinux_[0-9_]*x86_64' || true)
  [ -n "$plat" ] || { $PY -m auditwheel show "$whl"; echo "auditwheel found no manylinux policy"; exit 1; }
  whl=$DIST/$($PY -m wheel tags --remove --platform-tag "$plat" "$whl")
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY - "$whl" "$tmp" << 'EOF'
import hashlib, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = z.namelist()
    tag = [l for l in z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode().splitlines()
           if l.startswith("Tag:")]
    lib = [n for n in names if n.endswith("libexpertact.so")]
    assert lib == ["expertact/libexpertact.so"], f"expected expertact/libexpertact.so in the wheel, found {lib}"
    z.extract(lib[0], out)
    print("contents:", ", ".join(f"{n} ({z.getinfo(n).file_size:,} B)" for n in names if not n.endswith(".py")))
    print("python files:", sum(n.endswith(".py") for n in names))
print("WHEEL", *tag)
print("libexpertact.so sha256", hashlib.sha256(open(f"{out}/{lib[0]}", "rb").read()).hexdigest())
EOF
so=$tmp/expertact/libexpertact.so
echo "== readelf -d (NEEDED)"
readelf -d "$so" | grep NEEDED
echo "== device code (cuobjdump --list-elf / --list-ptx)"
bash scripts/check_library.sh "$so" --cuda --list | tee "$tmp/check.txt" || true
grep -q "check_library: ok" "$tmp/check.txt" || { echo "WHEEL CHECK FAILED"; exit 1; }
echo "== wheel"
echo "$whl"
echo "size: $(stat -c %s "$whl") bytes ($(du -h "$whl" | cut -f1)); library unpacked: $(stat -c %s "$so") bytes"
echo "sha256: $(sha256sum "$whl" | cut -d' ' -f1)"
