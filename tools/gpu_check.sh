#!/usr/bin/env bash
# The cuda backend on a GPU machine: build ggml with cuda from the pinned source,
# record and re-check the cuda goldens (run-to-run bits), hold cuda against the cpu goldens,
# and time every recipe on cuda, on the cpu with all cores, and in PyTorch eager on both.
#
#   tools/gpu_check.sh OUT_DIR [build] [check] [bench] [sizes]      (default: the first three)
#
# sizes: gpt2 and llama at `bench --size nano` and `--size gpt2-small`, each op's
# time (bench --profile, in OUT_DIR/profile_<size>.log) and ms/step beside PyTorch
# (OUT_DIR/bench_<size>.json).
#
# Offline machines: put the ggml source in .device/ggml (TOYHARNESS_GGML_SRC) and wheels of
# missing Python packages in .whl/; both are used when present. Results land in OUT_DIR:
# gpu_check.log, bench_cuda.json, bench_cpu.json and goldens.tar (goldens/cuda-*/ and the
# example plugin's).
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [build] [check] [bench]}
shift
phases=" ${*:-build check bench} "
mkdir -p "$out"
log="$out/gpu_check.log"
source "$(dirname "$0")/gpu_env.sh"
status=0

if [[ $phases == *" build "* ]]; then build_cuda plugins/example_bigram; fi

if [[ $phases == *" check "* ]]; then
    step "every op and block on cuda: forward vs float64 numpy, backward vs finite differences"
    TOYHARNESS_TEST_BACKEND=cuda python3 -m pytest -q -p no:cacheprovider tests/test_engine_ops.py 2>&1 | tail -25 \
        | tee -a "$log" || status=1
    step "our kernels inside ggml-cuda (native/cuda): GELU forward and backward against float64"
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_*.py 2>&1 | tail -15 | tee -a "$log" || status=1
    step "packed rows on cuda: the packed step's loss and gradients against the unpacked step's (1e-6)"
    python3 -m pytest -q -m cuda -rs -p no:cacheprovider tests/test_packing.py 2>&1 | tail -15 | tee -a "$log" || status=1
    step "cuda goldens: record, then check (a second run must give the same bits)"
    toyharness golden record gpt2 llama lora lora@q4_k lora@q8_0 vit_tiny warm_start --backend cuda 2>&1 \
        | tee -a "$log" || status=1
    toyharness golden record bigram --backend cuda --dir plugins/example_bigram/goldens 2>&1 | tee -a "$log" || status=1
    toyharness golden check --backend cuda 2>&1 | tee -a "$log" || status=1
    toyharness golden check bigram --backend cuda --dir plugins/example_bigram/goldens 2>&1 | tee -a "$log" || status=1
    step "tests-cuda: agreement with the cpu goldens, run-to-run bits"
    python3 -m pytest -q -m cuda -rs -s -p no:cacheprovider tests/test_backends.py 2>&1 | tee -a "$log" || status=1
    tar cf "$out/goldens.tar" goldens/cuda-* plugins/example_bigram/goldens/cuda-* 2>>"$log"
fi

if [[ $phases == *" bench "* ]]; then
    step "bench: cuda (PyTorch on cuda)"
    toyharness bench --backend cuda --out "$out/bench_cuda.json" 2>&1 | tee -a "$log" || status=1
    step "bench: cpu, all cores (PyTorch on cpu)"
    toyharness bench --backend cpu --out "$out/bench_cpu.json" 2>&1 | tee -a "$log" || status=1
fi
if [[ $phases == *" sizes "* ]]; then
    for size in nano gpt2-small; do
        step "profile: gpt2 and llama at size $size, each node timed alone"
        toyharness bench --profile gpt2 llama --backend cuda --size "$size" 2>&1 | tee "$out/profile_$size.log" \
            || status=1
        step "bench: gpt2 and llama at size $size (PyTorch on cuda)"
        toyharness bench gpt2 llama --backend cuda --size "$size" --steps 10 --out "$out/bench_$size.json" 2>&1 \
            | tee -a "$log" || status=1
    done
fi
step "done, status $status"
exit $status
