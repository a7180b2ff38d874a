// toyharness's own cuda kernels, dispatched by ggml-cuda for GGML_OP_CUSTOM nodes that
// th_cuda_rewrite (native/cuda_rewrite.c) marked: op_params[0] is TH_CUDA_MAGIC, op_params[1]
// the kernel. The marks and the arithmetic are shared with the cpu kernels
// (native/custom_ops.h, native/cpu_kernels.c), so cuda and cpu compute the same formula.
//
// GELU, tanh form, one node each way (ggml 0.25.3 has no GELU backward; see blocks.gelu_tanh):
//   y  = x s                                    s = sigmoid(x (k1 + k3 x^2))
//   dx = dy (s + x s (1 - s) (k1 + 3 k3 x^2))
// Elementwise, so every element's bits are the same run to run.
//
// CONT of a permuted f32 tensor (attention's head permutes: 8 a layer), a copy: ggml-cuda's
// computes each element's place with 64-bit divisions, about 8x below the memory's speed.
// Here a warp copies a row when the source's rows are contiguous, and a 32 x 32 tile goes
// through shared memory when the permute moves the contiguous axis (a transpose).
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

// rows of ne[0] floats (the source's nb[0] is a float): a warp a row, blockDim (32, 8)
static __global__ void th_cont_rows_kernel(const char * __restrict__ src, float * __restrict__ dst, const int64_t ne0,
                                           const int64_t ne1, const int64_t ne2, const int64_t ne3, const int64_t nb1,
                                           const int64_t nb2, const int64_t nb3) {
    const int64_t rows = ne1 * ne2 * ne3;
    for (int64_t r = blockIdx.x * (int64_t) blockDim.y + threadIdx.y; r < rows; r += (int64_t) gridDim.x * blockDim.y) {
        const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
        const float * s = (const float *) (src + i1 * nb1 + i2 * nb2 + i3 * nb3);
        float * d = dst + r * ne0;
        for (int64_t i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            d[i0] = s[i0];
        }
    }
}

// The source is contiguous along axis c (1..3), the destination along axis 0: 32 x 32 tiles of
// (i0, ic), read along ic and written along i0; the other two axes (d1, d2) are the batch.
struct th_cont_args {
    int64_t ne[4];
    int64_t nb[4];   // the source's strides, bytes
    int c, d1, d2;
};

static __global__ void th_cont_transpose_kernel(const char * __restrict__ src, float * __restrict__ dst,
                                                const th_cont_args a) {
    __shared__ float tile[32][33];
    const int64_t dstride[4] = {1, a.ne[0], a.ne[0] * a.ne[1], a.ne[0] * a.ne[1] * a.ne[2]};
    const int64_t i0_base = blockIdx.x * 32, ic_base = blockIdx.y * (int64_t) 32;
    const int64_t batches = a.ne[a.d1] * a.ne[a.d2];
    for (int64_t z = blockIdx.z; z < batches; z += gridDim.z) {
        const int64_t j1 = z % a.ne[a.d1], j2 = z / a.ne[a.d1];
        const char * s = src + j1 * a.nb[a.d1] + j2 * a.nb[a.d2];
        float * d = dst + j1 * dstride[a.d1] + j2 * dstride[a.d2];
        for (int k = threadIdx.y; k < 32; k += blockDim.y) {
            const int64_t i0 = i0_base + k, ic = ic_base + threadIdx.x;
            if (i0 < a.ne[0] && ic < a.ne[a.c]) {
                tile[k][threadIdx.x] = *(const float *) (s + i0 * a.nb[0] + ic * a.nb[a.c]);
            }
        }
        __syncthreads();
        for (int k = threadIdx.y; k < 32; k += blockDim.y) {
            const int64_t ic = ic_base + k, i0 = i0_base + threadIdx.x;
            if (i0 < a.ne[0] && ic < a.ne[a.c]) {
                d[ic * dstride[a.c] + i0] = tile[threadIdx.x][k];
            }
        }
        __syncthreads();
    }
}

static void th_cont(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * src = dst->src[0];
    const int c = th_cont_axis(src);
    const dim3 block(32, 8);
    if (c == 0) {
        const int64_t rows = src->ne[1] * src->ne[2] * src->ne[3];
        const int grid = (int) ((rows + 7) / 8 < 65535 ? (rows + 7) / 8 : 65535);
        th_cont_rows_kernel<<<grid, block, 0, stream>>>((const char *) src->data, (float *) dst->data, src->ne[0],
                                                        src->ne[1], src->ne[2], src->ne[3], (int64_t) src->nb[1],
                                                        (int64_t) src->nb[2], (int64_t) src->nb[3]);
        return;
    }
    th_cont_args a;
    for (int i = 0; i < 4; i++) {
        a.ne[i] = src->ne[i];
        a.nb[i] = (int64_t) src->nb[i];
    }
    a.c = c;
    a.d1 = c == 1 ? 2 : 1;
    a.d2 = c == 3 ? 2 : 3;
    const int64_t batches = a.ne[a.d1] * a.ne[a.d2];
    const dim3 grid((unsigned) ((a.ne[0] + 31) / 32), (unsigned) ((a.ne[c] + 31) / 32),
                    (unsigned) (batches < 65535 ? batches : 65535));
    th_cont_transpose_kernel<<<grid, block, 0, stream>>>((const char *) src->data, (float *) dst->data, a);
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
        case TH_CUDA_CONT:
            return th_f32_contiguous(op) && op->src[0] != nullptr && op->src[0]->type == GGML_TYPE_F32 &&
                   ggml_are_same_shape(op, op->src[0]) && th_cont_axis(op->src[0]) >= 0 &&
                   (op->src[0]->ne[th_cont_axis(op->src[0])] + 31) / 32 < 65536;
        case TH_CUDA_ATTN_FWD:
        case TH_CUDA_ATTN_PREP:
        case TH_CUDA_ATTN_BWD:
        case TH_CUDA_SLICE:
            return th_attention_supported(op, th_kernel_of(op));
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
        case TH_CUDA_CONT:
            th_cont(stream, dst);
            return true;
        case TH_CUDA_ATTN_FWD:
        case TH_CUDA_ATTN_PREP:
        case TH_CUDA_ATTN_BWD:
        case TH_CUDA_SLICE:
            return th_attention(stream, dst, th_kernel_of(dst));
        default:
            return false;
    }
}

// what toyharness looks for to know that this ggml-cuda has these kernels (its _ffi binding)
extern "C" __attribute__((visibility("default"))) int th_cuda_kernels_version(void) { return TH_CUDA_KERNELS_VERSION; }
