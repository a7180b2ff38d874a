#!/usr/bin/env bash
# The memory plan against the GPU's memory: build ggml with cuda from the pinned source
# (as gpu_check.sh does: .device/ggml and .whl/ on an offline machine), then run each recipe at
# several sizes on cuda and write the plan beside the driver's used memory:
#
#   tools/gpu_memory_plan.sh OUT_DIR [build] [measure]       (default: both)
#
# OUT_DIR gets gpu_memory_plan.log, memory_plan_cuda.json (every case: the plan's rows, the used
# memory's growth over a baseline taken after the CUDA context exists, their ratio) and
# memory_plan_cuda.txt (the table); a configuration far too large: its --plan and refusal in the log.
set -uo pipefail
out=${1:?usage: tools/gpu_memory_plan.sh OUT_DIR [build] [measure]}
shift
phases=" ${*:-build measure} "
mkdir -p "$out"
log="$out/gpu_memory_plan.log"
source "$(dirname "$0")/gpu_env.sh"
status=0
if [[ $phases == *" build "* ]]; then build_cuda; fi
if [[ $phases == *" measure "* ]]; then
    step "plan vs the driver's used memory, each recipe at several sizes"
    python3 "$(dirname "$0")/gpu_memory_plan.py" "$out" --backend cuda --tiny 2>&1 | tee -a "$log" || status=1
    step "a configuration far too large: --plan, then the run (refused, exit 2)"
    huge=(--set n_layer=48 --set d_model=2048 --set n_head=16 --set t_seq=4096 --set t_batch=64)
    toyharness run gpt2 --backend cuda "${huge[@]}" --plan 2>&1 | tee -a "$log"
    start=$(date +%s%N)
    toyharness run gpt2 --backend cuda "${huge[@]}" --no-progress 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "exit $rc after $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$log"
    [[ $rc == 2 ]] || status=1
fi
step "done, status $status"
exit $status
