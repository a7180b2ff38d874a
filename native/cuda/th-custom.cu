// toyharness's own cuda kernels, dispatched by ggml-cuda for GGML_OP_CUSTOM nodes that
// th_cuda_rewrite (native/cuda_rewrite.c) marked: op_params[0] is TH_CUDA_MAGIC, op_params[1]
// the kernel. The marks and the arithmetic are shared with the cpu kernels
// (native/custom_ops.h, native/cpu_kernels.c), so cuda and cpu compute the same formula.
//
// GELU, tanh form, one node each way (ggml 0.25.3 has no GELU backward; see blocks.gelu_tanh):
//   y  = x s                                    s = sigmoid(x (k1 + k3 x^2))
//   dx = dy (s + x s (1 - s) (k1 + 3 k3 x^2))
// Elementwise, so every element's bits are the same run to run.
#include "th-custom.cuh"

extern "C" {
#include "custom_ops.h"
}

#define TH_CUDA_BLOCK 256

static __global__ void th_gelu_kernel(const float * __restrict__ x, float * __restrict__ y, const int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        const float xi = x[i];
        y[i] = xi / (1.0f + expf(-xi * (TH_GELU_K1 + TH_GELU_K3 * xi * xi)));
    }
}

static __global__ void th_gelu_back_kernel(const float * __restrict__ dy, const float * __restrict__ x,
                                           float * __restrict__ dx, const int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        const float xi = x[i], x2 = xi * xi;
        const float s = 1.0f / (1.0f + expf(-xi * (TH_GELU_K1 + TH_GELU_K3 * x2)));
        dx[i] = dy[i] * (s + xi * s * (1.0f - s) * (TH_GELU_K1 + 3.0f * TH_GELU_K3 * x2));
    }
}

static int th_kernel_of(const ggml_tensor * t) {
    if (t->op != GGML_OP_CUSTOM) return 0;
    const int32_t * p = (const int32_t *) t->op_params;
    return p[0] == TH_CUDA_MAGIC ? p[1] : 0;
}

static bool th_f32_contiguous(const ggml_tensor * t) {
    return t != nullptr && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
}

bool th_cuda_custom_supported(const ggml_tensor * op) {
    switch (th_kernel_of(op)) {
        case TH_CUDA_GELU:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && ggml_are_same_shape(op, op->src[0]);
        case TH_CUDA_GELU_BACK:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && th_f32_contiguous(op->src[1]) &&
                   ggml_are_same_shape(op, op->src[0]) && ggml_are_same_shape(op, op->src[1]);
        default:
            return false;
    }
}

bool th_cuda_custom(cudaStream_t stream, ggml_tensor * dst) {
    const int64_t n = ggml_nelements(dst);
    const int blocks = (int) ((n + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK < 65535 ? (n + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK
                                                                              : 65535);
    switch (th_kernel_of(dst)) {
        case TH_CUDA_GELU:
            th_gelu_kernel<<<blocks, TH_CUDA_BLOCK, 0, stream>>>((const float *) dst->src[0]->data,
                                                                 (float *) dst->data, n);
            return true;
        case TH_CUDA_GELU_BACK:
            th_gelu_back_kernel<<<blocks, TH_CUDA_BLOCK, 0, stream>>>(
                (const float *) dst->src[0]->data, (const float *) dst->src[1]->data, (float *) dst->data, n);
            return true;
        default:
            return false;
    }
}

// what toyharness looks for to know that this ggml-cuda has these kernels (its _ffi binding)
extern "C" __attribute__((visibility("default"))) int th_cuda_kernels_version(void) { return TH_CUDA_KERNELS_VERSION; }
