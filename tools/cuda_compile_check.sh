#!/usr/bin/env bash
# Our cuda sources compiled on a machine without a GPU, as ggml-cuda compiles them, before a
# device call spends minutes building ggml to find a typo; optionally a kernel's SASS, to see what
# ptxas made of its arithmetic (fast-math contractions change bits).
#
#   tools/cuda_compile_check.sh [--sass NAME_PART]
#
# Compiles each native/cuda/th-*.cu with native/custom_ops.h beside the pinned ggml's ggml-cuda
# sources (python native/build.py --print-src) for sm_90 with ggml-cuda's flags (-use_fast_math,
# C++17), -Xptxas -v: errors, warnings, and each of our kernels' registers and spills. --sass
# prints the SASS of the kernels whose mangled name contains NAME_PART.
#
# Needs nvcc on PATH (the CUDA toolkit, or pip's nvidia-cuda-nvcc). The cuBLAS headers th-custom.cuh
# includes come from the nvidia-cublas wheel, and --sass's cuobjdump and nvdisasm from
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm: fetched with pip by name once into
# $TOYHARNESS_CACHE/cuda-tools (else ~/.cache/toyharness/cuda-tools), outside the clone.
set -euo pipefail
cd "$(dirname "$0")/.."
sass=""
if [ "${1:-}" = "--sass" ]; then
    sass=${2:?"--sass needs part of a kernel's name"}
elif [ -n "${1:-}" ]; then
    echo "cuda_compile_check.sh: unknown argument ${1} (usage: [--sass NAME_PART])" >&2
    exit 2
fi
command -v nvcc >/dev/null || { echo "cuda_compile_check.sh: nvcc not on PATH" >&2; exit 2; }
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
tools=${TOYHARNESS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/toyharness}/cuda-tools
mkdir -p "$tools"

# wheel PACKAGE: the package's wheel unpacked under $tools/PACKAGE (once)
wheel() {
    local dir=$tools/$1
    [ -f "$dir/.unpacked" ] && return 0
    mkdir -p "$dir"
    "$PY" -m pip download -q --no-deps "$1" -d "$dir" >&2
    (cd "$dir" && "$PY" -m zipfile -e ./*.whl . && rm -f ./*.whl && touch .unpacked)
}

wheel nvidia-cublas
cublas_include=$(dirname "$(find "$tools/nvidia-cublas" -name cublasLt.h | head -1)")
ggml=$("$PY" native/build.py --print-src | tail -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$ggml" "$work/ggml"
cp native/cuda/* native/custom_ops.h native/dropout_mask.h "$work/ggml/src/ggml-cuda/"
status=0
for source in native/cuda/th-*.cu; do
    name=$(basename "$source" .cu)
    echo "== $name.cu"
    (cd "$work/ggml/src/ggml-cuda" &&
        nvcc -c -std=c++17 -arch=sm_90 -use_fast_math -extended-lambda -DGGML_USE_CUDA -I../../include -I.. -I. \
            -I "$cublas_include" -Xptxas -v "$name.cu" -o "$work/$name.o") >"$work/$name.log" 2>&1 || status=1
    grep -E "error|warning" "$work/$name.log" | grep -v "^ptxas info" || true
    # registers and spills of each of our kernels (ptxas info lines follow "Compiling entry function")
    awk '/Compiling entry function/ { match($0, /_Z[0-9]+th_[A-Za-z0-9_]+/); name = substr($0, RSTART, RLENGTH) }
         /Function properties for/ { match($0, /for [^ ]+/); props = substr($0, RSTART + 4, RLENGTH - 4) }
         /Used [0-9]+ registers/ && name != "" { match($0, /Used [0-9]+ registers/); print "   " name ": " substr($0, RSTART + 5, RLENGTH - 5); name = "" }
         /spill stores/ && $0 !~ / 0 bytes spill stores/ { sub(/^ +/, ""); print "   spills in " props ": " $0 }' "$work/$name.log" | sort -u
done
if [ -n "$sass" ] && [ $status -eq 0 ]; then
    wheel nvidia-cuda-cuobjdump
    wheel nvidia-cuda-nvdisasm
    bins=$(dirname "$(find "$tools/nvidia-cuda-cuobjdump" -name cuobjdump -type f | head -1)")
    chmod +x "$bins"/* "$(find "$tools/nvidia-cuda-nvdisasm" -name nvdisasm -type f | head -1)"
    export PATH="$bins:$(dirname "$(find "$tools/nvidia-cuda-nvdisasm" -name nvdisasm -type f | head -1)"):$PATH"
    for obj in "$work"/*.o; do
        cuobjdump -sass "$obj" | awk -v part="$sass" '/Function :/ { show = index($0, part) > 0 } show'
    done
fi
[ $status -eq 0 ] && echo "== all compiled" || echo "== a source did not compile (above)"
exit $status
