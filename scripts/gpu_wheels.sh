#!/usr/bin/env bash
# The Python packages scripts/gpu_session.sh's stages import that a GPU machine without network
# access may lack, fetched as wheels into .whl/ (git-ignored) on a machine that reaches PyPI, for the
# GPU machine's Python (PYVER, default 3.12; x86-64 Linux), and the build's dlpack.h into
# .deps/include/dlpack/ (git-ignored; CMakeLists.txt searches .deps/include): this machine's
# /usr/include/dlpack/dlpack.h, else Debian's libdlpack-dev fetched with apt-get download and
# unpacked. Both folders are then copied beside the tree on the GPU machine, and there, from the
# repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site
#
#   bash scripts/gpu_wheels.sh            # fetch (and build DeepSpeed's), list them with their sizes
#   bash scripts/gpu_wheels.sh --list     # the list only
#
# What for (each pinned; --no-deps, so each needed dependency is named here, and one version of each):
#   deepspeed 0.19.8      the AutoEP stages (its PyPI release is an sdist: built here into a pure-Python
#                         wheel with DS_BUILD_OPS=0, against this machine's torch, as scripts/test.sh
#                         installs it); its dependencies hjson and pydantic (with pydantic-core,
#                         annotated-types, typing-inspection); the rest of what it imports (einops,
#                         msgpack, ninja, psutil, py-cpuinfo, tqdm, nvidia-ml-py) is assumed there
#   torchao 0.18.0        torchao's FP8 MoE training run and the torchao rows of bench --mlp --fp8
#   megatron-core 0.19.2  the Megatron stages (Python 3.12)
# A package the machine already has at another version is replaced by --upgrade inside /tmp/site
# only. Needs: pip, and (for DeepSpeed's wheel) torch installed here.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
W=.whl
BINARY=(hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        torchao==0.18.0 megatron-core==0.19.2)
SDIST=(deepspeed==0.19.8)
DLPACK=.deps/include/dlpack
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${SDIST[@]}" "${BINARY[@]}" "$DLPACK/dlpack.h"
  exit 0
fi
mkdir -p "$W" "$DLPACK"
# .whl/ and .deps/ are in .gitignore; a checkout whose .gitignore lacks one gets it in the local exclude file.
for d in "$W" .deps; do
  git check-ignore -q "$d/x" 2> /dev/null || echo "/$d/" >> "$(git rev-parse --git-path info/exclude)"
done
# dlpack.h: the header only (the library includes dlpack/dlpack.h and links nothing of it).
if [ -f /usr/include/dlpack/dlpack.h ]; then
  cp /usr/include/dlpack/dlpack.h "$DLPACK/"
else
  deb=$(mktemp -d)
  (cd "$deb" && apt-get download libdlpack-dev > /dev/null) && dpkg -x "$deb"/libdlpack-dev_*.deb "$deb/x" \
    && cp "$deb/x/usr/include/dlpack/dlpack.h" "$DLPACK/"
  rm -rf "$deb"
fi
[ -f "$DLPACK/dlpack.h" ] || { echo "gpu_wheels.sh: no dlpack.h (neither /usr/include/dlpack/dlpack.h nor" \
  "apt-get download libdlpack-dev)" >&2; exit 1; }
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$W" "${BINARY[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$W" "${SDIST[@]}"
# One version of each package: a wheel of another version left from an earlier fetch stops the install.
for spec in "${SDIST[@]}" "${BINARY[@]}"; do
  name=${spec%%==*} version=${spec#*==}
  stem=$(echo "$name" | tr - _)
  for f in "$W"/"$stem"-*.whl; do
    [[ $(basename "$f") == "$stem-$version-"* ]] || { echo "removing $f (not $spec)"; rm -f "$f"; }
  done
  ls "$W"/"$stem-$version-"*.whl > /dev/null 2>&1 || { echo "gpu_wheels.sh: no wheel of $spec in $W" >&2; exit 1; }
done
du -ch "$W"/*.whl "$DLPACK/dlpack.h"
echo "copy .whl/ and .deps/ (the wheels and dlpack.h) beside the tree on the GPU machine; there, first: python3 -m pip install -q" \
  "--no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&" \
  "export PYTHONPATH=/tmp/site"
