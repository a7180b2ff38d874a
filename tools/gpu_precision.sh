#!/usr/bin/env bash
# The precisions on a GPU machine: build ggml-cuda with our kernels, run the precision and cuda
# kernel tests, check every cuda golden's bits (fp32, @tf32, @bf16, LoRA over quantized bases and
# over each architecture), hold bf16's trained eval loss to fp32's, and time the acceptance benches.
#
#   tools/gpu_precision.sh OUT_DIR [build] [check] [goldens] [record] [spread600]
#                                  [bench-fp32] [bench-tf32] [bench-bf16] [bench-lora-bf16]
#                                                      (default: build check goldens)
#
# check:           tests/test_precision.py and tests/test_cuda_*.py (the products' rounding at
#                  each precision, run-to-run bits, the first 16 losses against fp32's, our kernels
#                  against ggml's nodes and float64), tests/test_recompute.py and the cuda memory plan.
# goldens:         every golden file under goldens/cuda-*/ checked bit for bit (a missing golden or a
#                  mismatch fails the phase).
# record:          the @tf32 and @bf16 goldens recorded, then checked again (a second run must give the
#                  same bits), into OUT_DIR/goldens.tar; only after a change meant to move them.
# spread600:       600 steps of gpt2 and llama at fp32 and bf16 over AGREE_SEEDS (default 1337 1-9):
#                  ours must keep bf16's mean eval loss within 1% of fp32's (tools/eval_spread.py
#                  --check-mean); PyTorch's own bf16 against fp32, the same way, is shown beside it.
# bench-P:         gpt2 and llama at BENCH_SIZES (default "nano gpt2-small") beside PyTorch on cuda at
#                  precision P, into OUT_DIR/bench_P_SIZE.json.
# bench-lora-bf16: LoRA over a Llama-3.2-1B-shaped Q4_K base (tools/lora_bench_base.py; t_seq 1024 x 4,
#                  targets q,k,v,o, rank 16) beside transformers + PEFT at bf16, into
#                  OUT_DIR/bench_lora_bf16.json.
#
# Offline machines: .device/ggml and .whl/ as for tools/gpu_check.sh. The log is OUT_DIR/precision.log.
set -uo pipefail
out=${1:?usage: tools/gpu_precision.sh OUT_DIR [phases...]}
shift
phases=" ${*:-build check goldens} "
mkdir -p "$out"
log="$out/precision.log"
source "$(dirname "$0")/gpu_env.sh"
status=0
PRECISION_RECIPES=(gpt2 llama lora vit_tiny warm_start)

# tests_phase LOG FILE K: the tests of FILE selected by -k K (all where empty), their output in
# OUT/LOG, the summary lines in the phases' log
tests_phase() {
    # shellcheck disable=SC2086  # $2 may be a glob of test files (tests/test_cuda_*.py)
    python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider $2 ${3:+-k "$3"} >"$out/$1" 2>&1 || status=1
    grep -E "passed|failed|FAILED|ERROR|skipped|SKIPPED" "$out/$1" | tail -40 | tee -a "$log"
}

if [[ $phases == *" build "* ]]; then build_cuda; fi

if [[ $phases == *" check "* ]]; then
    step "precision and cuda kernel tests"
    tests_phase precision.log tests/test_precision.py ""
    tests_phase kernels.log tests/test_cuda_*.py ""
    step "recompute_blocks on cuda, and the cuda memory plan"
    tests_phase recompute.log tests/test_recompute.py cuda
    tests_phase plan.log tests/test_memory_plan.py cuda
fi

if [[ $phases == *" goldens "* ]]; then
    step "every cuda golden keeps its bits"
    names=()
    for f in goldens/cuda-*/*.yml; do names+=("$(basename "$f" .yml)"); done
    toyharness golden check "${names[@]}" --backend cuda >"$out/goldens.log" 2>&1 || status=1
    tee -a "$log" <"$out/goldens.log"
    if grep -qE "^(FAIL|SKIP)" "$out/goldens.log"; then status=1; fi
fi

if [[ $phases == *" record "* ]]; then
    names=()
    for r in "${PRECISION_RECIPES[@]}"; do names+=("$r@tf32" "$r@bf16"); done
    step "precision goldens: record, then check (a second run must give the same bits)"
    toyharness golden record "${names[@]}" --backend cuda 2>&1 | tee -a "$log" || status=1
    toyharness golden check "${names[@]}" --backend cuda 2>&1 | tee -a "$log" || status=1
    tar cf "$out/goldens.tar" goldens/cuda-*/*@tf32.yml goldens/cuda-*/*@bf16.yml 2>>"$log"
fi

if [[ $phases == *" spread600 "* ]]; then
    step "600 steps of gpt2 and llama, bf16 against fp32: ours (held to 1%), then PyTorch's"
    # shellcheck disable=SC2206  # a list of seeds
    seeds=(${AGREE_SEEDS:-1337 1 2 3 4 5 6 7 8 9})
    for side in "cuda --check-mean 0.01" torch; do
        # shellcheck disable=SC2086  # the side's words are its arguments
        python3 tools/eval_spread.py "$out/spread600_${side%% *}.json" --backend $side --recipes gpt2 llama \
            --seeds "${seeds[@]}" --precisions fp32 bf16 2>&1 | grep -v Warning | tee -a "$log" || status=1
    done
fi

for precision in fp32 tf32 bf16; do
    [[ $phases == *" bench-$precision "* ]] || continue
    for size in ${BENCH_SIZES:-nano gpt2-small}; do
        step "bench: gpt2 and llama at size $size, precision $precision (PyTorch on cuda, same precision)"
        toyharness bench gpt2 llama --backend cuda --size "$size" --precision "$precision" --steps 10 \
            --out "$out/bench_${precision}_${size}.json" 2>&1 | tee -a "$log" || status=1
    done
done

if [[ $phases == *" bench-lora-bf16 "* ]]; then
    step "bench: lora over the Llama-3.2-1B-shaped Q4_K base at bf16, beside transformers + PEFT (eager)"
    if base=$(python3 tools/lora_bench_base.py --type q4_k 2>>"$log"); then
        toyharness bench lora --backend cuda --precision bf16 --torch-modes eager --steps 10 --warmup 2 \
            --set "base=$base" --set t_seq=1024 --set t_batch=4 --set targets=q,k,v,o --set rank=16 \
            --out "$out/bench_lora_bf16.json" 2>&1 | tee -a "$log" || status=1
    else
        status=1
    fi
fi
step "done, status $status"
exit $status
