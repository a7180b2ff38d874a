#!/usr/bin/env bash
# The vulkan backend on a GPU machine's own Vulkan driver: ggml built with cuda and
# vulkan from the pinned source, then on vulkan every op and block against float64 numpy, every
# golden config against the cpu goldens (run-to-run bits), the graphs lowered for metal, the
# device's vulkan goldens recorded, and `bench` at the default and nano sizes beside PyTorch on
# cuda and our cuda backend.
#
#   [VULKAN_CHECK_BACKENDS=cpu,vulkan] tools/vulkan_gpu_check.sh OUT_DIR DEBS_DIR [GL_DEBS_DIR]
#
# DEBS_DIR holds Debian 12's packages for the build and the loader (apt-get download libvulkan1
# libvulkan-dev glslc libshaderc1 spirv-headers); they are unpacked into /opt/vk, not into /.
# GL_DEBS_DIR: the GL dispatch libraries NVIDIA's Vulkan driver loads (apt-get download libglvnd0
# libegl1 libgl1 libglx0 libopengl0 libgles2), unpacked into / as the device notes say.
# VULKAN_CHECK_BACKENDS=cpu,vulkan skips the cuda build and bench; VULKAN_CHECK_BENCH=0 every bench.
# Offline machines: the ggml source in .device/ggml and wheels in .whl/, as gpu_check.sh.
set -uo pipefail
out=${1:?usage: tools/vulkan_gpu_check.sh OUT_DIR DEBS_DIR}
debs=${2:?usage: tools/vulkan_gpu_check.sh OUT_DIR DEBS_DIR}
mkdir -p "$out"
log="$out/vulkan_gpu_check.log"
source "$(dirname "$0")/gpu_env.sh"
export TOYHARNESS_BACKENDS=${VULKAN_CHECK_BACKENDS:-cpu,cuda,vulkan}
status=0
if [ -n "${3:-}" ]; then
    for f in "$3"/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi

step "unpack the Vulkan loader, headers, SPIR-V headers and glslc into /opt/vk"
for f in "$debs"/*.deb; do dpkg -x "$f" /opt/vk; done
ln -sf x86_64-linux-gnu/libvulkan.so /opt/vk/usr/lib/libvulkan.so
export VULKAN_SDK=/opt/vk/usr PATH=/opt/vk/usr/bin:$PATH LD_LIBRARY_PATH=/opt/vk/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CMAKE_PREFIX_PATH=/opt/vk/usr
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
build_cuda
ls /usr/local/nvidia/share/vulkan/icd.d /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>&1 | tee -a "$log"
ls "$(python3 -c 'import toyharness, os; print(os.path.dirname(toyharness.__file__))')/_native" | tee -a "$log"
TOYHARNESS_GGML_LOG=2 python3 -c "
from toyharness._ffi import ffi, lib
print([ffi.string(lib.ggml_backend_dev_description(lib.ggml_backend_dev_get(i))).decode() for i in range(lib.ggml_backend_dev_count())])
from toyharness.engine import get_engine
e = get_engine('vulkan'); print('vulkan device:', e.device_description(), '->', e.fingerprint())" 2>&1 | tee -a "$log"

step "every op and block on vulkan: forward vs float64 numpy, backward vs finite differences"
TOYHARNESS_TEST_BACKEND=vulkan python3 -m pytest -q -p no:cacheprovider tests/test_engine_ops.py 2>&1 | tail -8 \
    | tee -a "$log" || status=1
step "vulkan against the cpu goldens (1e-5 relative), run-to-run bits"
python3 -m pytest -q -m vulkan -rs -s -p no:cacheprovider -k agrees tests/test_backends.py 2>&1 | tee -a "$log" || status=1
step "graphs lowered for metal, on vulkan"
toyharness golden record gpt2 llama lora lora@q4_k lora@q8_0 lora@llama3 lora@qwen3 lora@gemma3 lora@phi3 vit_tiny \
    warm_start --backend vulkan 2>&1 | tee -a "$log" || status=1
tar cf "$out/goldens.tar" goldens/vulkan-* 2>>"$log"
TOYHARNESS_TEST_BACKEND=vulkan python3 -m pytest -q -s -p no:cacheprovider -k "train_as_the_normal" \
    tests/test_metal_lowering.py 2>&1 | grep -E "lowered for|passed|failed" | tee -a "$log" || status=1

step "frozen products of every frozen type, and lora over each quantized type, on vulkan"
python3 -m pytest -q -m vulkan -rs -p no:cacheprovider tests/test_quant.py 2>&1 | tail -5 | tee -a "$log" || status=1

[ "${VULKAN_CHECK_BENCH:-1}" = 0 ] || for size in default nano; do
    step "bench at size $size: vulkan (PyTorch on cuda)"
    toyharness bench gpt2 llama --backend vulkan --torch-device cuda --size "$size" --steps 10 \
        --out "$out/bench_vulkan_$size.json" 2>&1 | tee -a "$log" || status=1
    if [[ $TOYHARNESS_BACKENDS == *cuda* ]]; then
        step "bench at size $size: cuda (PyTorch on cuda)"
        toyharness bench gpt2 llama --backend cuda --size "$size" --steps 10 --out "$out/bench_cuda_$size.json" \
            2>&1 | tee -a "$log" || status=1
    fi
done
step "done, status $status"
exit $status
