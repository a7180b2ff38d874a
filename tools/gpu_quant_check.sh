#!/usr/bin/env bash
# Frozen bases of every type on cuda: build ggml with cuda, check each type's
# products and input gradient and a few LoRA steps (tests/test_quant.py, marker cuda), check
# every cuda golden (lora@q4_k and lora@q8_0 included; `record` rewrites those two), and time
# LoRA over bases of SmolLM2's shape (a seeded llama the harness makes: 30 layers, d 576, 9/3 heads, d_ff 1536, vocabulary
# 49152) in q4_1, q8_0 and f16 beside PyTorch on the GPU (bench config t_seq 256, t_batch 4,
# targets q,v, rank 8).
#
#   tools/gpu_quant_check.sh OUT_DIR [build] [test] [record] [goldens] [bench]
#                                  (default: all but record, which rewrites the two cuda goldens)
#
# Offline machines: as tools/gpu_check.sh (ggml source in .device/ggml, missing wheels in .whl/).
# Results in OUT_DIR: gpu_quant_check.log, bench_<type>.json, goldens_quant.tar.
set -uo pipefail
out=${1:?usage: tools/gpu_quant_check.sh OUT_DIR [build] [test] [record] [goldens] [bench]}
shift
phases=" ${*:-build test goldens bench} "
mkdir -p "$out"
log="$out/gpu_quant_check.log"
source "$(dirname "$0")/gpu_env.sh"
status=0

if [[ $phases == *" build "* ]]; then build_cuda; fi

if [[ $phases == *" test "* ]]; then
    step "every frozen type on cuda: products, input gradient, LoRA steps (run to run, against cpu)"
    python3 -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_quant.py 2>&1 | tail -30 | tee -a "$log" \
        || status=1
fi

if [[ $phases == *" record "* ]]; then
    step "cuda goldens over quantized bases: record (lora@q4_k, lora@q8_0)"
    toyharness golden record lora@q4_k lora@q8_0 --backend cuda 2>&1 | tee -a "$log" || status=1
    tar cf "$out/goldens_quant.tar" goldens/cuda-*/lora@*.yml 2>>"$log"
fi

if [[ $phases == *" goldens "* ]]; then
    step "every cuda golden, the quantized bases' included: a fresh run must give the stored bits"
    toyharness golden check --backend cuda 2>&1 | tee -a "$log" || status=1
fi

if [[ $phases == *" bench "* ]]; then
    step "bases of SmolLM2's shape (seeded llama, quantized by ggml)"
    python3 - >"$out/bases.txt" <<'EOF' || { echo "could not make the bases" | tee -a "$log"; exit 1; }
from toyharness.engine.gguf_io import cached_copy_as
from toyharness.lm import seeded_model_file
base = seeded_model_file("llama", ["n_layer=30", "d_model=576", "n_head=9", "n_kv_head=3", "d_ff=1536"], vocab=49152)
for dtype in ("q4_1", "q8_0", "f16"):
    print(dtype, cached_copy_as(base, dtype))
EOF
    tee -a "$log" <"$out/bases.txt"
    while read -r dtype base; do
        step "bench lora on cuda over the $dtype base ($base)"
        toyharness bench lora --backend cuda --steps 10 --warmup 3 --set "base=$base" --set t_seq=256 --set t_batch=4 \
            --set targets=q,v --set rank=8 --out "$out/bench_$dtype.json" </dev/null 2>&1 | tee -a "$log" || status=1
    done <"$out/bases.txt"
fi
step "done, status $status"
exit $status
