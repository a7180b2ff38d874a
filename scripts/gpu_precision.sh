#!/usr/bin/env bash
# Precision on the GPU machine (issue 32): build ggml-cuda with our precision dispatch, check what
# tf32 and bf16 compute (tests/test_precision.py), that every fp32 cuda golden keeps its bits,
# record the @tf32 and @bf16 goldens and check them again (run-to-run bits), and time gpt2 and
# llama at nano and gpt2-small beside PyTorch at the same precision.
#
#   scripts/gpu_precision.sh OUT_DIR [build] [check] [goldens] [agree600] [bench-fp32] [bench-tf32] [bench-bf16]
#                                    [attention] [goldens-bf16] [goldens-kept] [profile-bf16]
#                                    [goldens-bf16-check] [reuse] [profile-bf16-ours] [profile-bf16-noreuse]
#                                    [frozen] [goldens-frozen-bf16] [bench-lora-bf16] [bench-lora-fp32]
#                                    [profile-lora-bf16] [fused] [recompute] [bench-lora-bf16-recompute]
#                                    [bench-lora-bf16-recompute-keepall] [grouped] [plan-lora-bf16] [kept-all]
#                                    [gelu-bf16] [gelu-bf16-goldens] [gelu-bf16-profile]
#                                    [qkv-bf16] [qkv-bf16-goldens] [qkv-bf16-profile]
#                                    [cudnn] [cudnn-debug] [cudnn-profile] [cudnn-bench]
#                                    [norm] [norm-profile] [gain-profile] [bias-goldens] [bias] [bias-profile]
#                                    [spread600]
#
# norm: a norm computed by its AFFINE (and the residual's sum before it), the norms' rows in
# registers (native/cuda/th-custom.cu): their tests in tests/test_cuda_*.py, each against
# the kernels before it bit for bit, and our RMS_NORM against ggml-cuda's; norm-profile: a
# bf16 gpt2-small step of each of PROFILE_RECIPES (default gpt2 llama) by kernel with the kernels
# before (TOYHARNESS_CUDA_NORM_AFFINE=separate TOYHARNESS_CUDA_NORM_ROWS=memory), then now,
# twice each, interleaved. gain-profile: a bf16 gpt2-small gpt2 step by kernel with LayerNorm's
# gain's gradient summed by a COLUMN_DOT of its own (TOYHARNESS_CUDA_GAIN_SUMS=separate), then by
# LayerNorm's backward (fused), twice each, interleaved (the norm phase runs its tests).
# bias-goldens: every cuda golden checked, then gpt2@bf16 and vit_tiny@bf16 recorded (and checked
# again) into OUT/goldens_bias.tar: at bf16 LayerNorm's backward sums its bias's gradient
# (native/cuda_precision.c, th_layer_norm_bias_sums), which moves their bits; bias: its tests
# (the sums against numpy's in their order, the 16 losses against fp32's); bias-profile: a bf16
# gpt2-small gpt2 step by kernel with the bias's bf16 product (TOYHARNESS_CUDA_BIAS_SUMS=separate),
# then summed by the backward, twice each, interleaved.
#
# cudnn: bf16 attention on cuDNN's fused attention (native/cudnn/th_cudnn.cpp): its test and the
# attention tests of tests/test_precision.py and tests/test_cuda_*.py (cuDNN's against float64,
# grouped heads read in place against ggml's REPEATs); cudnn-debug: a cuDNN
# run under cuda-gdb, its whole output in OUT/cudnn_gdb.txt (the backtrace of a crash); cudnn-profile: a bf16
# gpt2-small step of each of PROFILE_RECIPES (default gpt2 llama) by kernel on our attention kernels
# (TOYHARNESS_CUDNN_ATTENTION=0), then cuDNN's, twice each, interleaved; cudnn-bench: gpt2 and llama at BENCH_SIZES, bf16, beside PyTorch's bf16
# autocast + torch.compile, on cuDNN's attention then ours.
# qkv-bf16: attention's q, k and v products kept in bf16 (native/cuda_precision.c,
# th_attention_inputs_bf16): the bf16 kernels alone with bf16 inputs against fp32 inputs of the same
# values (scripts/attention_bench.sh: the same bits), its tests and the bf16 tests it touches
# (tests/test_precision.py), tests/test_cuda_*.py whole; qkv-bf16-goldens: every cuda golden
# checked (of those, only gpt2@bf16 and vit_tiny@bf16 may move), then those two recorded and checked
# again (OUT/goldens_qkv.tar); qkv-bf16-profile: a bf16 gpt2-small step by kernel with q, k, v f32
# (TOYHARNESS_BF16_ATTENTION_INPUTS=f32), then bf16, ours only, twice each, then the bench beside
# PyTorch's bf16 autocast + torch.compile, each way.
#
# gelu-bf16: a GELU's input product kept in bf16 (native/cuda_precision.c, th_gelu_bf16): its tests
# and the bf16 tests it touches (tests/test_precision.py), tests/test_cuda_*.py whole;
# gelu-bf16-goldens: every cuda golden checked (of those, only gpt2@bf16 and vit_tiny@bf16 may move),
# then those two recorded and checked again (OUT/goldens_gelu.tar); gelu-bf16-profile: a bf16
# gpt2-small step by kernel with GELU's input f32 (TOYHARNESS_BF16_GELU=f32), then bf16, ours only.
#
# grouped: grouped-query heads read in place by the fused attention (iss-32f): the attention tests
# of tests/test_cuda_*.py (the grouped kernels' bits against the repeats' included), the cuda
# goldens of the recipes with grouped heads (each must keep its bits), and recompute's with llama.
# kept-all: every cuda golden checked (bits kept), and the cuda plan's test (tests/test_memory_plan.py).
# plan-lora-bf16: the memory plan (`toyharness run lora --plan`) of bench-lora-bf16's step.
#
# attention: the fused attention's cuda tests (fp32 against ggml's nodes, bf16's tensor-core kernels
# against float64); goldens-bf16: record and check only the @bf16 goldens; goldens-kept: check the
# fp32 and @tf32 cuda goldens (their bits must not move); profile-bf16: a bf16 gpt2-small step's
# kernels beside PyTorch's bf16 autocast + torch.compile (scripts/cuda_kernels.py).
# goldens-bf16-check: check the @bf16 goldens without recording them; reuse: the bf16 operand
# copies' test (tests/test_precision.py, the bits with and without reuse); profile-bf16-noreuse:
# ours alone with TOYHARNESS_BF16_REUSE=0 (every product converts its operands, as before);
# profile-bf16-ours: ours alone, reuse on (the two side by side in one run).
# frozen: the frozen bases' bf16 products (th-frozen.cu) against float64, and lora over a q4_k and
# a q8_0 base at bf16 against fp32 (tests/test_precision.py); goldens-frozen-bf16: record and check
# lora@q4_k@bf16 and lora@q8_0@bf16; bench-lora-P: LoRA over issue 32's Llama-3.2-1B-shaped Q4_K base
# (scripts/lora_bench_base.py; t_seq 1024 x 4, targets q,k,v,o, rank 16) beside transformers at P
# (its base dequantized to bf16 for bf16), eager, each side's GPU memory as the driver counts it.
#
# recompute: recompute_blocks on cuda (tests/test_recompute.py -k cuda: every golden of a recipe that
# checkpoints blocks, fp32, @tf32 and @bf16, keeps its bits with recompute_blocks=true; the cuda plan
# with it is ggml's buffers and smaller); bench-lora-bf16-recompute: bench-lora-bf16 with
# `--set recompute_blocks=true` on our side (PyTorch's side as in bench-lora-bf16: no checkpointing);
# bench-lora-bf16-recompute-keepall: the same with TOYHARNESS_BF16_KEEP_NODES=0 (the bf16 copies kept
# while their bytes are not written, as before the horizon).
#
# fused: the tests of iss-32d's SwiGLU gate-gradient kernel, LoRA scale placement and frozen terms in product sums
# (tests/test_cuda_*.py).
# agree600: 600 steps of the default gpt2 and llama runs in each precision (and fp32 with ggml's
# attention), a run a seed of AGREE_SEEDS (default 1337), eval losses against fp32's. spread600: the
# same runs' bf16 against fp32 seed by seed (AGREE_SEEDS, default 1337 1-9), ours and then PyTorch's
# (its bf16 autocast run against its fp32 run), into OUT/spread600_cuda.json and spread600_torch.json.
# BENCH_SIZES (default "nano gpt2-small") picks the benches' sizes. Offline machines: .device/ggml and .whl/ as for gpu_check.sh. Results in OUT_DIR: precision.log,
# pytest.log, goldens.tar (goldens/cuda-*/*@tf32.yml and @bf16), agree600.json (eval loss after 600 steps
# in each precision), bench_<precision>_<size>.json, bench_lora_<phase's suffix, - as _>.json (e.g.
# bench_lora_bf16_recompute.json), recompute.log.
set -uo pipefail
out=${1:?usage: scripts/gpu_precision.sh OUT_DIR [phases...]}
shift
phases=" ${*:-build check goldens bench-tf32} "
mkdir -p "$out"
log="$out/precision.log"
source "$(dirname "$0")/gpu_env.sh"
status=0
PRECISION_RECIPES=(gpt2 llama lora vit_tiny warm_start)
FROZEN_BF16=(lora@q4_k@bf16 lora@q8_0@bf16)      # LoRA over quantized bases (th-frozen.cu)
# tests_phase LOG FILE K GREP: the tests of FILE selected by -k K, their output in OUT/LOG, the lines
# matching GREP (the last 80) in the phases' log
tests_phase() {
    # shellcheck disable=SC2086  # $2 may be a glob of test files (tests/test_cuda_*.py)
    python3 -m pytest -q -rfEs -s --tb=short -p no:cacheprovider $2 -k "$3" >"$out/$1" 2>&1 || status=1
    grep -E "$4" "$out/$1" | tail -80 | tee -a "$log"
}

# record_goldens TAR GLOB NAME...: record the named cuda goldens, check them again (a second run must
# give the same bits), and tar the files GLOB matches into OUT/TAR
record_goldens() {
    local tar=$1 glob=$2
    shift 2
    toyharness golden record "$@" --backend cuda 2>&1 | tee -a "$log" || status=1
    toyharness golden check "$@" --backend cuda 2>&1 | tee -a "$log" || status=1
    # shellcheck disable=SC2086  # the glob is meant to expand
    tar cf "$out/$tar" $glob 2>>"$log"
}

# cuda_golden_names: every cuda golden (fp32, @tf32, @bf16, LoRA over quantized bases and other
# architectures) into `names`
cuda_golden_names() {
    names=(gpt2 llama lora lora@q4_k lora@q8_0 vit_tiny warm_start lora@llama3 lora@qwen3 lora@gemma3 lora@phi3)
    for r in "${PRECISION_RECIPES[@]}"; do names+=("$r@tf32" "$r@bf16"); done
    names+=("${FROZEN_BF16[@]}")
}

# moved_bf16_goldens TAR: every cuda golden checked (a change to a path only gpt2@bf16 and
# vit_tiny@bf16 take may move those two), then those two recorded and checked again into OUT/TAR
moved_bf16_goldens() {
    step "every cuda golden checked (only gpt2@bf16 and vit_tiny@bf16 may move), then those two recorded"
    cuda_golden_names
    toyharness golden check "${names[@]}" --backend cuda 2>&1 | tee -a "$log"
    record_goldens "$1" "goldens/cuda-*/gpt2@bf16.yml goldens/cuda-*/vit_tiny@bf16.yml" gpt2@bf16 vit_tiny@bf16
}

# profile_switch VAR TAG WHAT [OFF ON]: a bf16 gpt2-small step by kernel, ours, with VAR=OFF then ON
# (default f32, bf16), twice (interleaved), each into OUT/profile_gpt2_bf16_TAG_VALUE.txt
profile_switch() {
    local var=$1 tag=$2 what=$3 off=${4:-f32} on=${5:-bf16} kept recipe=${PROFILE_RECIPE:-gpt2}
    for kept in "$off" "$on" "$off" "$on"; do
        step "a bf16 $recipe gpt2-small step by kernel, ours, $what $kept"
        env "$var=$kept" python3 scripts/cuda_kernels.py "$recipe" gpt2-small --precision bf16 --rows 40 \
            >"$out/profile_${recipe}_bf16_${tag}_$kept.txt" 2>&1 || status=1
        grep "^==" "$out/profile_${recipe}_bf16_${tag}_$kept.txt" | tee -a "$log"
    done
}

if [[ $phases == *" build "* ]]; then build_cuda; fi

if [[ $phases == *" fused "* ]]; then
    step "iss-32d's fusions on cuda: SwiGLU's gate gradient in one kernel, the LoRA scale on the rank product, frozen terms in product sums"
    tests_phase fused.log 'tests/test_cuda_*.py' "swiglu or silu or lora or frozen or product_sum or products_summed" \
        "^frozen product sum|passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" gelu-bf16 "* ]]; then
    step "a GELU's input kept in bf16: its tests, the bf16 tests it touches, and the cuda kernels' tests"
    tests_phase gelu.log tests/test_precision.py "gelu or first_16 or reuse or trace or alone or writer" \
        "GELU|@bf16|passed|failed|FAILED|ERROR|skipped|SKIPPED"
    tests_phase kernels.log 'tests/test_cuda_*.py' "" "passed|failed|FAILED|ERROR"
fi

if [[ $phases == *" qkv-bf16 "* ]]; then
    step "attention's q, k and v kept in bf16: the kernels alone (bf16 inputs against fp32's), the tests"
    bash scripts/attention_bench.sh HEAD 8 1024 12 20 >"$out/attention_bench.log" 2>&1 || status=1
    tail -8 "$out/attention_bench.log" | tee -a "$log"
    tests_phase qkv.log tests/test_precision.py "attention or gelu or first_16 or reuse or trace or alone or writer" \
        "attention|@bf16|passed|failed|FAILED|ERROR|skipped|SKIPPED"
    tests_phase kernels.log 'tests/test_cuda_*.py' "" "passed|failed|FAILED|ERROR"
fi

if [[ $phases == *" qkv-bf16-goldens "* ]]; then
    step "every cuda golden checked (only gpt2@bf16 and vit_tiny@bf16 may move), then those two recorded"
    cuda_golden_names
    toyharness golden check "${names[@]}" --backend cuda 2>&1 | tee -a "$log"
    record_goldens goldens_qkv.tar "goldens/cuda-*/gpt2@bf16.yml goldens/cuda-*/vit_tiny@bf16.yml" gpt2@bf16 vit_tiny@bf16
    step "the cuda memory plan equals ggml's buffers (the training graph reserved as rewritten)"
    tests_phase plan.log tests/test_memory_plan.py cuda_plan "passed|failed|FAILED|ERROR|skipped|SKIPPED"
    tests_phase recompute.log tests/test_recompute.py "keeps_each_goldens_bits and (gpt2 or vit)" \
        "passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" qkv-bf16-profile "* ]]; then
    profile_switch TOYHARNESS_BF16_ATTENTION_INPUTS qkv "attention's q, k, v"
    for kept in f32 bf16; do
        step "gpt2 at gpt2-small's size, bf16, beside PyTorch: attention's q, k, v $kept"
        TOYHARNESS_BF16_ATTENTION_INPUTS=$kept toyharness bench gpt2 --backend cuda --size gpt2-small \
            --precision bf16 --steps 10 --out "$out/bench_qkv_$kept.json" 2>&1 | tee -a "$log" || status=1
    done
fi

if [[ $phases == *" cudnn "* ]]; then
    step "bf16 attention on cuDNN's fused attention: its test, the attention tests"
    tests_phase cudnn.log tests/test_precision.py "cudnn or attention" \
        "cuDNN|attention|@bf16|passed|failed|FAILED|ERROR|skipped|SKIPPED"
    tests_phase kernels.log 'tests/test_cuda_*.py' "attention or attn or heads" \
        "cuDNN's attention|passed|failed|FAILED|ERROR"
fi

if [[ $phases == *" cudnn-debug "* ]]; then
    step "the cuDNN glue's libraries: what they link and export (OUT/cudnn_libs.txt)"
    for lib in $(find . -name "libtoyharness_cudnn.so*" -o -name "libggml-cuda.so*" | grep -v "^./.device"); do
        { echo "== $lib"; ldd "$lib"; echo "-- dynamic symbols defined"; nm -DC --defined-only "$lib" | grep -v " [ABbDdRr] " | head -40
          echo "-- unique (STB_GNU_UNIQUE)"; nm -DC "$lib" | grep " u " | head -20; } >>"$out/cudnn_libs.txt" 2>&1
    done
    step "gpt2@bf16 at head size 32 on cuDNN's attention, under cuda-gdb: the whole backtrace of a crash"
    TOYHARNESS_CUDNN_ATTENTION=1 timeout 180 cuda-gdb -q -batch -ex "set pagination off" \
        -ex "set cuda break_on_launch none" -ex run -ex bt -ex "info sharedlibrary" --args python3 -X faulthandler -c \
        'from toyharness import goldens; print([x["value"] for x in goldens.compute("gpt2@bf16", "cuda", extra_sets=["d_model=64"])["losses"]])' \
        >"$out/cudnn_gdb.txt" 2>&1 || status=1
    grep -v "^\[New Thread\|^\[Thread" "$out/cudnn_gdb.txt" | grep -B2 -A30 "SIGSEGV\|^\[[0-9]" | head -60 | tee -a "$log"
fi

if [[ $phases == *" cudnn-profile "* ]]; then
    for PROFILE_RECIPE in ${PROFILE_RECIPES:-gpt2 llama}; do
        profile_switch TOYHARNESS_CUDNN_ATTENTION cudnn "cuDNN's attention" 0 1
    done
    unset PROFILE_RECIPE    # (the other phases' profiles: gpt2)
fi

if [[ $phases == *" norm "* ]]; then
    step "norms computed by their AFFINE, the norms' rows in registers: their tests"
    tests_phase norm.log 'tests/test_cuda_*.py' "norm or affine or gain or column or residual" \
        "passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" norm-profile "* ]]; then
    for recipe in ${PROFILE_RECIPES:-gpt2 llama}; do
        for how in before now before now; do
            step "a bf16 $recipe gpt2-small step by kernel, ours, the norms' kernels $how"
            switches=(TOYHARNESS_CUDA_NORM_AFFINE=fused)
            [[ $how == before ]] && switches=(TOYHARNESS_CUDA_NORM_AFFINE=separate TOYHARNESS_CUDA_NORM_ROWS=memory)
            env "${switches[@]}" python3 scripts/cuda_kernels.py "$recipe" gpt2-small --precision bf16 --rows 45 \
                >"$out/profile_${recipe}_bf16_norm_$how.txt" 2>&1 || status=1
            grep "^==" "$out/profile_${recipe}_bf16_norm_$how.txt" | tee -a "$log"
        done
    done
fi

if [[ $phases == *" gain-profile "* ]]; then
    profile_switch TOYHARNESS_CUDA_GAIN_SUMS gain "the gain's gradient" separate fused
fi

if [[ $phases == *" bias-goldens "* ]]; then
    moved_bf16_goldens goldens_bias.tar
fi

if [[ $phases == *" bias "* ]]; then
    step "at bf16 LayerNorm's bias's gradient summed by its backward: its tests"
    tests_phase bias.log 'tests/test_cuda_*.py' "bias_sums or bias_gradient" "passed|failed|FAILED|ERROR|skipped|SKIPPED"
    tests_phase bias_precision.log tests/test_precision.py "bias_gradient or first_16" \
        "bf16|passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" bias-profile "* ]]; then
    profile_switch TOYHARNESS_CUDA_BIAS_SUMS bias "LayerNorm's bias's gradient" separate fused
fi

if [[ $phases == *" cudnn-bench "* ]]; then
    for size in ${BENCH_SIZES:-nano gpt2-small}; do
        for on in 1 0; do
            step "gpt2 and llama at $size, bf16, beside PyTorch: TOYHARNESS_CUDNN_ATTENTION=$on"
            TOYHARNESS_CUDNN_ATTENTION=$on toyharness bench gpt2 llama --backend cuda --size "$size" \
                --precision bf16 --steps 10 --out "$out/bench_cudnn${on}_$size.json" 2>&1 | tee -a "$log" || status=1
        done
    done
fi

if [[ $phases == *" gelu-bf16-goldens "* ]]; then
    moved_bf16_goldens goldens_gelu.tar
fi

if [[ $phases == *" gelu-bf16-profile "* ]]; then
    profile_switch TOYHARNESS_BF16_GELU gelu "GELU's input"
fi

if [[ $phases == *" kept-all "* ]]; then
    step "every cuda golden keeps its bits (fp32, @tf32, @bf16, LoRA over quantized bases and other architectures)"
    cuda_golden_names
    toyharness golden check "${names[@]}" --backend cuda 2>&1 | tee -a "$log" || status=1
    step "the cuda memory plan equals ggml's buffers (the training graph reserved as rewritten)"
    tests_phase plan.log tests/test_memory_plan.py cuda_plan "passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" grouped "* ]]; then
    step "grouped-query heads read in place: the attention kernels' tests, grouped against repeated"
    tests_phase grouped.log 'tests/test_cuda_*.py' "grouped or attention" \
        "bf16 attention|passed|failed|FAILED|ERROR|skipped|SKIPPED"
    step "the cuda goldens of recipes with grouped heads keep their bits"
    toyharness golden check llama lora lora@q4_k lora@llama3 lora@qwen3 llama@tf32 lora@tf32 llama@bf16 lora@bf16 \
        warm_start@bf16 lora@q4_k@bf16 lora@q8_0@bf16 --backend cuda 2>&1 | tee -a "$log" || status=1
    tests_phase grouped_recompute.log tests/test_recompute.py "keeps_each_goldens_bits and llama" \
        "passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" check "* ]]; then
    step "precision: the products' rounding, run-to-run bits, agreement with fp32"
    python3 -m pytest -q -rfEs -s --tb=short -p no:cacheprovider tests/test_precision.py tests/test_cuda_*.py \
        >"$out/pytest.log" 2>&1 || status=1
    grep -E "^(tf32|bf16|fp32|gpt2|llama)|largest|passed|failed|FAILED|ERROR" "$out/pytest.log" | tee -a "$log"
    step "every fp32 cuda golden keeps its bits"
    toyharness golden check gpt2 llama lora lora@q4_k lora@q8_0 vit_tiny warm_start --backend cuda 2>&1 \
        | tee -a "$log" || status=1
fi

if [[ $phases == *" attention "* ]]; then
    step "fused attention on cuda: fp32 against ggml's nodes, bf16 (tensor cores) against float64"
    tests_phase attention.log 'tests/test_cuda_*.py' attention "bf16 attention|passed|failed|FAILED|ERROR"
fi

if [[ $phases == *" goldens-bf16 "* ]]; then
    names=()
    for r in "${PRECISION_RECIPES[@]}"; do names+=("$r@bf16"); done
    step "bf16 goldens: record, then check (a second run must give the same bits)"
    record_goldens goldens_bf16.tar "goldens/cuda-*/*@bf16.yml" "${names[@]}"
fi

if [[ $phases == *" goldens-bf16-check "* ]]; then
    names=()
    for r in "${PRECISION_RECIPES[@]}"; do names+=("$r@bf16"); done
    for r in "${FROZEN_BF16[@]}"; do [[ -f goldens/cuda-sm90/$r.yml ]] && names+=("$r"); done
    step "the @bf16 cuda goldens keep their bits (checked, not recorded)"
    toyharness golden check "${names[@]}" --backend cuda 2>&1 | tee -a "$log" || status=1
fi

if [[ $phases == *" frozen "* ]]; then
    step "frozen bases at bf16: their products against float64, lora over q4_k and q8_0 against fp32"
    tests_phase frozen.log tests/test_precision.py "frozen or quantized_base" \
        "^frozen|^lora@|passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" goldens-frozen-bf16 "* ]]; then
    step "bf16 goldens of lora over quantized bases: record, then check (a second run must give the same bits)"
    record_goldens goldens_frozen_bf16.tar "goldens/cuda-*/lora@q*@bf16.yml" "${FROZEN_BF16[@]}"
fi

if [[ $phases == *" recompute "* ]]; then
    step "recompute_blocks on cuda: each golden's bits with it, the plan with it"
    tests_phase recompute.log tests/test_recompute.py cuda "on cuda: activations|passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

for bench in bf16 fp32 bf16-recompute bf16-recompute-keepall; do
    [[ $phases == *" bench-lora-$bench "* ]] || continue
    precision=${bench%%-*}
    extra=()
    keep=${TOYHARNESS_BF16_KEEP_NODES:-}
    [[ $bench == *-recompute* ]] && extra=(--set recompute_blocks=true)
    [[ $bench == *-keepall ]] && keep=0          # no horizon for the bf16 copies (th-precision.cu)
    step "bench: lora over the Llama-3.2-1B-shaped Q4_K base, $bench, beside transformers (eager)"
    base=$(python3 scripts/lora_bench_base.py --type q4_k 2>>"$log") || { status=1; continue; }
    ls -l "$base" | tee -a "$log"
    TOYHARNESS_BF16_KEEP_NODES=$keep toyharness bench lora --backend cuda --precision "$precision" --torch-modes eager \
        --steps 10 --warmup 2 --set "base=$base" --set t_seq=1024 --set t_batch=4 --set targets=q,k,v,o --set rank=16 \
        "${extra[@]}" --out "$out/bench_lora_${bench//-/_}.json" 2>&1 | tee -a "$log" || status=1
done

if [[ $phases == *" plan-lora-bf16 "* ]]; then
    step "the memory plan of the bf16 LoRA step over the Llama-3.2-1B-shaped Q4_K base (TOYHARNESS_CUDA_ATTENTION=${TOYHARNESS_CUDA_ATTENTION:-fused})"
    base=$(python3 scripts/lora_bench_base.py --type q4_k 2>>"$log") || status=1
    toyharness run lora --plan --backend cuda --set precision=bf16 --set "base=$base" --set t_seq=1024 --set t_batch=4 \
        --set targets=q,k,v,o --set rank=16 2>&1 | tee -a "$log" || status=1
fi

if [[ $phases == *" profile-lora-bf16 "* ]]; then
    step "a bf16 LoRA step over the Llama-3.2-1B-shaped Q4_K base by kernel, ours only"
    base=$(python3 scripts/lora_bench_base.py --type q4_k 2>>"$log") || status=1
    python3 scripts/cuda_kernels.py lora default --precision bf16 --rows 45 --set "base=$base" --set t_seq=1024 \
        --set t_batch=4 --set targets=q,k,v,o --set rank=16 >"$out/profile_lora_bf16.txt" 2>&1 || status=1
    grep "^==" "$out/profile_lora_bf16.txt" | tee -a "$log"
fi

if [[ $phases == *" reuse "* ]]; then
    step "bf16 operand copies reused within a graph: the losses' bits with and without reuse"
    tests_phase reuse.log tests/test_precision.py "reuse or edits" "@bf16: operands|passed|failed|FAILED|ERROR|skipped|SKIPPED"
fi

if [[ $phases == *" profile-bf16-ours "* ]]; then
    step "a bf16 gpt2-small step by kernel, ours only (the operand copies reused)"
    python3 scripts/cuda_kernels.py gpt2 gpt2-small --precision bf16 --rows 40 \
        >"$out/profile_gpt2_bf16_ours.txt" 2>&1 || status=1
    grep "^==" "$out/profile_gpt2_bf16_ours.txt" | tee -a "$log"
fi

if [[ $phases == *" profile-bf16-noreuse "* ]]; then
    step "a bf16 gpt2-small step by kernel, ours only, every product converting its operands (no reuse)"
    TOYHARNESS_BF16_REUSE=0 python3 scripts/cuda_kernels.py gpt2 gpt2-small --precision bf16 --rows 40 \
        >"$out/profile_gpt2_bf16_noreuse.txt" 2>&1 || status=1
    grep "^==" "$out/profile_gpt2_bf16_noreuse.txt" | tee -a "$log"
fi

if [[ $phases == *" goldens-kept "* ]]; then
    names=()
    for r in "${PRECISION_RECIPES[@]}"; do names+=("$r@tf32"); done
    step "the fp32 and @tf32 cuda goldens keep their bits"
    toyharness golden check gpt2 llama lora lora@q4_k lora@q8_0 vit_tiny warm_start "${names[@]}" --backend cuda \
        2>&1 | tee -a "$log" || status=1
fi

if [[ $phases == *" profile-bf16 "* ]]; then
    step "a bf16 gpt2-small step by kernel, ours and PyTorch bf16 autocast + torch.compile"
    python3 scripts/cuda_kernels.py gpt2 gpt2-small --torch --torch-compile --precision bf16 --rows 40 \
        >"$out/profile_gpt2_bf16.txt" 2>&1 || status=1
    grep "^==" "$out/profile_gpt2_bf16.txt" | tee -a "$log"
fi

if [[ $phases == *" goldens "* ]]; then
    names=()
    for r in "${PRECISION_RECIPES[@]}"; do names+=("$r@tf32" "$r@bf16"); done
    step "precision goldens: record, then check (a second run must give the same bits)"
    record_goldens goldens.tar "goldens/cuda-*/*@tf32.yml goldens/cuda-*/*@bf16.yml" "${names[@]}"
fi

if [[ $phases == *" agree600 "* ]]; then
    # AGREE_SEEDS (default 1337, the recipes' seed): a run per seed of each precision, and fp32 again
    # with ggml's attention nodes (TOYHARNESS_CUDA_ATTENTION=ggml: the same maths summed in another
    # order), which says how far two fp32 runs that differ only in rounding end apart. A run whose
    # folder holds its summary already (an earlier call on the same machine) is not run again.
    step "600 steps of the default gpt2 and llama runs in each precision: eval loss against fp32's"
    seeds=(${AGREE_SEEDS:-1337})
    for recipe in gpt2 llama; do
        for seed in "${seeds[@]}"; do
            for precision in fp32 tf32 bf16; do
                [[ -f /tmp/agree/$recipe-$precision-$seed/summary.json ]] && continue
                toyharness run "$recipe" --backend cuda --steps 600 --set precision="$precision" --set seed="$seed" \
                    --out "/tmp/agree/$recipe-$precision-$seed" --no-progress >>"$log" 2>&1 || status=1
            done
            [[ -f /tmp/agree/$recipe-fp32ggml-$seed/summary.json ]] && continue
            TOYHARNESS_CUDA_ATTENTION=ggml toyharness run "$recipe" --backend cuda --steps 600 --set seed="$seed" \
                --out "/tmp/agree/$recipe-fp32ggml-$seed" --no-progress >>"$log" 2>&1 || status=1
        done
    done
    python3 - "$out/agree600.json" "${seeds[@]}" <<'PY' 2>&1 | tee -a "$log" || status=1
import json, statistics, sys
seeds, out, ok = sys.argv[2:], {}, True
kinds = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp32ggml": "fp32, ggml's attention"}
for recipe in ("gpt2", "llama"):
    means, loaded = {}, {kind: [json.load(open(f"/tmp/agree/{recipe}-{kind}-{seed}/summary.json")) for seed in seeds]
                         for kind in kinds}
    refs = [r["eval_loss"] for r in loaded["fp32"]]
    for kind, label in kinds.items():
        runs = loaded[kind]
        rel = [abs(r["eval_loss"] - ref) / ref for r, ref in zip(runs, refs)]
        means[kind] = statistics.fmean(r["eval_loss"] for r in runs)
        out[f"{recipe}@{kind}"] = {"seeds": seeds, "eval_loss": [r["eval_loss"] for r in runs],
                                   "rel_to_fp32": rel, "mean_eval_loss": means[kind],
                                   "mean_rel_to_fp32": abs(means[kind] - means["fp32"]) / means["fp32"]}
        if kind in ("tf32", "bf16"):
            ok = ok and max(rel) < 0.01
        print(f"{recipe} {label}: eval loss after 600 steps " + ", ".join(f"{r['eval_loss']:.5f}" for r in runs) +
              " (" + ", ".join(f"{100 * x:.2f}%" for x in rel) + " from fp32's, seed by seed); mean "
              f"{means[kind]:.5f} ({100 * out[f'{recipe}@{kind}']['mean_rel_to_fp32']:.2f}% from fp32's mean)")
json.dump(out, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if ok else 1)
PY
fi

if [[ $phases == *" spread600 "* ]]; then
    # Ours beside PyTorch's own: each side's bf16 run against its fp32 run, seed by seed (AGREE_SEEDS,
    # default 1337 1-9), 600 steps, on the default 4 eval batches and on 64 (scripts/eval_spread.py;
    # --backend torch is toyharness/reference.py's model trained the same way, bf16 as autocast).
    step "600 steps of gpt2 and llama, bf16 against fp32: ours, then PyTorch's"
    seeds=(${AGREE_SEEDS:-1337 1 2 3 4 5 6 7 8 9})
    # ours must keep bf16's mean over the seeds within 1% of fp32's (--check-mean); PyTorch's is shown
    for side in "cuda --check-mean 0.01" torch; do
        python3 scripts/eval_spread.py "$out/spread600_${side%% *}.json" --backend $side --recipes gpt2 llama \
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
step "done, status $status"
exit $status
