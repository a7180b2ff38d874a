#!/usr/bin/env bash
# The bf16 attention kernels alone, this checkout's beside a git revision's (default HEAD), on the
# GPU at hand: builds scripts/attention_bench.cu against each th-attention.cu (about 40 s, no ggml
# build), times both in turn, and says whether their outputs (O, L, dK, dV, D, dQ) are the same bits.
#   scripts/attention_bench.sh [REV] [B T H reps]     (GGML: a ggml source tree, default .device/ggml)
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
shift || true
GGML=${GGML:-.device/ggml}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/rev"
git show "$REV:native/cuda/th-attention.cu" > "$W/rev/th-attention.cu"
git show "$REV:native/cuda/th-custom.cuh" > "$W/rev/th-custom.cuh"     # found beside the .cu first
git show "$REV:native/custom_ops.h" > "$W/rev/custom_ops.h"
build() {      # $1: the folder of th-attention.cu, $2: the binary, then nvcc's options
    local dir=$1 bin=$2
    shift 2
    nvcc "$@" -arch=sm_90 -O3 -std=c++17 --use_fast_math -I "$dir" -I native/cuda -I native -I "$GGML/include" \
        -I "$GGML/src" -I "$GGML/src/ggml-cuda" scripts/attention_bench.cu -o "$bin"
}
build "$W/rev" "$W/rev.bin" &
# VARIANTS: launches of this checkout's kernels the bench times beside the defaults, checking their
# bits, e.g. 'variant("forward, 4 warps", fwd, fwd_n, [&] { th_mma_launch_warps<HD, 4>(s, TH_CUDA_ATTN_FWD, f, BH); });'
# (f, bw, q: the forward's, backward's and dQ's arguments; their outputs fwd, scratch, dq, and
# the outputs' sizes fwd_n, bwd_n, dq_n)
mkdir -p "$W/var"
[ -n "${VARIANTS:-}" ] && printf '%s\n' "$VARIANTS" > "$W/var/attention_bench_variants.h"
build native/cuda "$W/new.bin" -I "$W/var"
wait
for round in 1 2; do
    echo "$REV:   $("$W/rev.bin" "$W/rev.out" "$@")"
    echo "ours:   $("$W/new.bin" "$W/new.out" "$@")"
done
if cmp -s "$W/rev.out" "$W/new.out"; then
    echo "outputs: the same bits"
else
    echo "outputs: DIFFER ($(cmp "$W/rev.out" "$W/new.out" | head -1))"
    exit 1
fi
