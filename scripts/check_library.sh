#!/usr/bin/env bash
# Checks a built libexpertact.so: its NEEDED libraries (no libcudart: the CUDA runtime
# is linked in), its exported symbols (the C ABI and the public C++ API only), the
# glibc / libstdc++ symbol versions it needs, and with --cuda its device code (sm_80
# and sm_90 machine code, compute_90 PTX). Prints
# what it found; exits 1 on a violation. Under a second.
#   bash scripts/check_library.sh path/to/libexpertact.so [--cuda] [--list]
# Needs readelf and nm (binutils); --cuda also cuobjdump, which it finds in a CUDA toolkit or
# else installs once from PyPI (nvidia-cuda-cuobjdump, into build/tools; see find_cuobjdump).
# ctest runs it on every build (tests/cpp/CMakeLists.txt); the wheel scripts with --cuda.
set -uo pipefail
lib=${1:?usage: check_library.sh path/to/libexpertact.so [--cuda] [--list]}
want_cuda=0 list=0
for a in "${@:2}"; do
  case $a in
    --cuda) want_cuda=1 ;;
    --list) list=1 ;;  # also print cuobjdump's full --list-elf / --list-ptx
    *) echo "unknown option $a"; exit 2 ;;
  esac
done
READELF=${READELF:-readelf}
NM=${NM:-nm}
bad=0
die() { echo "FAIL: $*"; bad=1; }
[ -f "$lib" ] || { echo "FAIL: no file $lib"; exit 1; }

# 1. NEEDED: the C and C++ runtimes of the system only (what every manylinux policy
#    allows); libcuda is not among them: the CUDA runtime loads it itself at run time.
needed=$("$READELF" -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
echo "NEEDED: $(echo $needed)"
for n in $needed; do
  case $n in
    libstdc++.so.6 | libgcc_s.so.1 | libc.so.6 | libm.so.6 | libpthread.so.0 | libdl.so.2 | librt.so.1 | ld-linux-x86-64.so.2 | ld-linux-aarch64.so.1) ;;
    libcudart*) die "$n is NEEDED: the CUDA runtime must be linked statically" ;;
    *) die "$n is NEEDED: not a system C/C++ runtime library" ;;
  esac
done

# 2. Exports: expertact_* (the C ABI) and the functions of expertact.hpp (src/exports.map).
exports=$("$NM" -D --defined-only -C "$lib" | cut -d' ' -f3-)
extra=$(echo "$exports" | grep -v -E '^expertact_[a-z0-9_]+$|^expertact::(preset_swiglu|preset_swiglu_clamped|preset_swiglu_oai|preset_geglu_tanh|glu_forward|glu_backward|glu_forward_bias|glu_backward_bias|glu_bias_workspace_bytes|expert_bias_forward|expert_bias_backward|expert_bias_workspace_bytes|fp8_quantize_rowwise|fp8_quantize_colwise_grouped|fp8_glu_rowwise|fp8_glu_colwise_grouped|fp8_glu_backward_rowwise|fp8_quantize_row_tiles|fp8_quantize_column_tiles_grouped|fp8_quantize_blocks|fp8_glu_row_tiles|fp8_glu_column_tiles_grouped|fp8_glu_backward_tiles|last_error|has_cuda|cpu_threads|set_cpu_threads)\(')
echo "exported: $(echo "$exports" | grep -c .) symbols ($(echo "$exports" | grep -c '^expertact_') C, $(echo "$exports" | grep -c '^expertact::') C++)"
[ -z "$extra" ] || die "symbols exported beyond the C ABI and C++ API:
$(echo "$extra" | head -20)"
# The C entry points: exactly the functions expertact_c.h declares (EXPERTACT_API), no more, no less.
header=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/include/expertact/expertact_c.h
if [ -f "$header" ]; then
  declared=$(tr '\n' ' ' < "$header" | grep -o 'EXPERTACT_API [^(]*(' | grep -o 'expertact_[a-z0-9_]*(' | tr -d '(' | sort -u)
  c_exports=$(echo "$exports" | grep -E '^expertact_[a-z0-9_]+$' | sort -u)
  missing=$(comm -23 <(echo "$declared") <(echo "$c_exports"))
  undeclared=$(comm -13 <(echo "$declared") <(echo "$c_exports"))
  [ -z "$missing" ] || die "declared in expertact_c.h but not exported: $(echo $missing)"
  [ -z "$undeclared" ] || die "exported C symbols that expertact_c.h does not declare: $(echo $undeclared)"
  echo "C ABI: $(echo "$declared" | grep -c .) entry points of expertact_c.h, all exported"
else
  echo "$exports" | grep -q '^expertact_glu_forward$' || die "expertact_glu_forward is not exported"
fi

# 3. The newest glibc / libstdc++ symbol versions it asks for (the oldest system it loads on).
vers=$("$READELF" --dyn-syms -W "$lib" | grep -o '@GLIBC[A-Z]*_[0-9.]*' | sort -u -V)
echo "needs: $(echo "$vers" | grep '@GLIBC_' | tail -1 | tr -d @) $(echo "$vers" | grep '@GLIBCXX_' | tail -1 | tr -d @) $(echo "$vers" | grep '@CXXABI_' | tail -1 | tr -d @)"

# cuobjdump (for --cuda): $CUOBJDUMP; on PATH; in the toolkit of nvcc (which may be a wrapper
# script, so nvcc itself says where its toolkit is); /usr/local/cuda*/bin; the PyPI package
# nvidia-cuda-cuobjdump (binary at site-packages/nvidia/cu13/bin/cuobjdump, or
# nvidia/cuda_cuobjdump/bin/ in CUDA 12 releases) in the Python environment or in this
# repository's build/tools. Not found: pip installs that package into build/tools (the
# release of nvcc's major version; the Python environment is left as it is).
pip_cuobjdump() {  # the first nvidia/*/bin/cuobjdump under the folders given
  local d f
  for d in "$@"; do
    for f in "$d"/nvidia/*/bin/cuobjdump; do [ -x "$f" ] && { echo "$f"; return 0; }; done
  done
  return 1
}
find_cuobjdump() {
  local c root tools py=${PYTHON:-python3}
  tools=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/tools
  for c in "${CUOBJDUMP:-}" "$(command -v cuobjdump)"; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return; }
  done
  if command -v nvcc > /dev/null; then
    root=$(nvcc -dryrun -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
    [ -n "$root" ] && [ -x "$root/cuobjdump" ] && { echo "$root/cuobjdump"; return; }
  fi
  for c in /usr/local/cuda/bin/cuobjdump /usr/local/cuda-*/bin/cuobjdump; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  # shellcheck disable=SC2046
  pip_cuobjdump "$tools" $($py -c 'import sys; print(*[p for p in sys.path if p])' 2> /dev/null) && return
  local major
  major=$(nvcc --version 2> /dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  echo "cuobjdump not found: pip install nvidia-cuda-cuobjdump${major:+ (CUDA $major)} --target $tools" >&2
  PIP_ROOT_USER_ACTION=ignore $py -m pip install -q --disable-pip-version-check --no-deps --target "$tools" \
    "nvidia-cuda-cuobjdump${major:+>=$major.0,<$((major + 1))}" >&2 || return 0
  pip_cuobjdump "$tools"
}

# 4. Device code: machine code for sm_80 and sm_90, PTX for compute_90 (newer GPUs JIT it).
if [ $want_cuda = 1 ]; then
  CUOBJDUMP=$(find_cuobjdump)
  if [ -z "$CUOBJDUMP" ]; then
    die "cuobjdump not found and not installable (needed for --cuda): set CUOBJDUMP, or install the CUDA toolkit or the PyPI package nvidia-cuda-cuobjdump"
  else
    echo "cuobjdump: $CUOBJDUMP"
    elf=$("$CUOBJDUMP" --list-elf "$lib" 2>&1)
    ptx=$("$CUOBJDUMP" --list-ptx "$lib" 2>&1)
    arches=$(echo "$elf" | grep -o 'sm_[0-9]*[a-z]*' | sort | uniq -c | awk '{printf "%s x%s ", $2, $1}')
    ptxs=$(echo "$ptx" | grep -o 'sm_[0-9]*[a-z]*' | sort | uniq -c | awk '{printf "%s x%s ", $2, $1}')
    echo "ELF (machine code): $arches"
    echo "PTX: $ptxs"
    [ $list = 1 ] && printf '%s\n%s\n' "$elf" "$ptx"
    for a in sm_80 sm_90; do echo "$elf" | grep -q "\.$a\.cubin" || die "no $a machine code"; done
    echo "$ptx" | grep -q '\.sm_90\.ptx' || die "no compute_90 PTX"
    extra_arch=$(echo "$elf" | grep -o 'sm_[0-9]*[a-z]*' | sort -u | grep -v -x -E 'sm_80|sm_90')
    [ -z "$extra_arch" ] || die "unexpected machine code: $extra_arch"
  fi
fi
[ $bad = 0 ] && echo "check_library: ok ($lib)"
exit $bad
