# Sourced by the GPU machine scripts (gpu_check.sh, gpu_quant_check.sh) once `log` is set: the
# offline machine's inputs and `step` (offline_env.sh), the cuda build's environment, and
# `build_cuda [EDITABLE...]` (pip install -e . and the folders named, offline, with cuda).
. "$(dirname "${BASH_SOURCE[0]}")/offline_env.sh"
export PYTHONUNBUFFERED=1 TOYHARNESS_BACKENDS=cpu,cuda TOYHARNESS_CUDA_ARCH="${TOYHARNESS_CUDA_ARCH:-90}"
# cuDNN's attention (native/build.py, TOYHARNESS_CUDNN): cuDNN from PyTorch's nvidia-cudnn package;
# its frontend's headers carried as .device/cudnnfe/include (the nvidia-cudnn-frontend wheel's
# include/ folder) where the machine has none installed: a folder there means on, and is searched
# first. TOYHARNESS_CUDNN=off builds without.
if [[ -z "${TOYHARNESS_CUDNN:-}" && -f .device/cudnnfe/include/cudnn_frontend.h ]]; then
    export TOYHARNESS_CUDNN=$PWD/.device/cudnnfe/include
fi
export TOYHARNESS_CUDNN="${TOYHARNESS_CUDNN:-on}"
build_cuda() {
    step "build (cpu+cuda, sm_$TOYHARNESS_CUDA_ARCH)"
    nvidia-smi -L 2>&1 | tee -a "$log"
    local start editable=(-e .)
    start=$(date +%s)
    for folder in "$@"; do editable+=(-e "$folder"); done
    python3 -m pip install --no-deps --no-build-isolation --no-index "${editable[@]}" >>"$log" 2>&1 \
        || { echo "build failed" | tee -a "$log"; tail -40 "$log"; exit 1; }
    echo "build took $(( $(date +%s) - start )) s" | tee -a "$log"
    python3 -c "from toyharness._ffi import available_native_backends as b; print('backends:', b())" | tee -a "$log"
}
