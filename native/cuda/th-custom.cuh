// toyharness's own cuda kernels inside ggml-cuda (see th-custom.cu). native/build.py copies this
// folder into the staged ggml-cuda source of a cuda build and has ggml-cuda.cu dispatch
// GGML_OP_CUSTOM nodes marked by th_cuda_rewrite (native/cuda_rewrite.c) to th_cuda_custom.
#pragma once

#include "ggml.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

static inline bool th_aligned16(const void * p) { return ((uintptr_t) p & 15) == 0; }

// a kernel's dynamic shared memory above the 48 KB default, raised once per device (as ggml-cuda does)
#define TH_SET_SMEM_LIMIT(kernel, nbytes)                                                                    \
    do {                                                                                                     \
        static bool raised[64] = {false};                                                                    \
        int device = 0;                                                                                      \
        cudaGetDevice(&device);                                                                              \
        if (device < 64 && !raised[device]) {                                                                \
            if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) (nbytes)) != \
                cudaSuccess) {                                                                               \
                GGML_ABORT("toyharness: cannot raise a kernel's shared memory limit to %zu", (size_t) (nbytes)); \
            }                                                                                                \
            raised[device] = true;                                                                           \
        }                                                                                                    \
    } while (0)

// cp.async of `bytes` (4 or 16) from global to shared memory, zero-filled where `in` is false
// (src then only has to be a valid address); completes at th_cp_wait
template <int BYTES>
static __device__ __forceinline__ void th_cp_async(void * smem, const void * src, const bool in) {
    const uint32_t s = (uint32_t) __cvta_generic_to_shared(smem);
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(in ? 16 : 0));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(in ? 4 : 0));
    }
}
static __device__ __forceinline__ void th_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
static __device__ __forceinline__ void th_cp_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// wait until at most N of this thread's newest commit groups are still in flight
template <int N>
static __device__ __forceinline__ void th_cp_wait_groups() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// a node of ours' parameters: what th_cuda_rewrite set after its two marks (op_params[2..])
template <typename P>
static inline P th_params_of(const ggml_tensor * t) {
    P p;
    memcpy(&p, (const int32_t *) t->op_params + 2, sizeof(p));
    return p;
}

static inline bool th_f32_contiguous(const ggml_tensor * t) {
    return t != nullptr && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
}
// contiguous f32, or contiguous bf16 (a node kept in bf16 at precision bf16: native/cuda_precision.c)
static inline bool th_f32_or_bf16_contiguous(const ggml_tensor * t) {
    return t != nullptr && (t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_BF16) && ggml_is_contiguous(t);
}

// whether `op` is a node of ours that these kernels can compute
bool th_cuda_custom_supported(const ggml_tensor * op);
// compute `dst` on `stream` (products with `cublas`, ggml's handle); false when it is not a node of ours
bool th_cuda_custom(cudaStream_t stream, cublasHandle_t cublas, ggml_tensor * dst);

// the fused attention's nodes (th-attention.cu): ATTN_FWD, ATTN_PREP, ATTN_BWD, ATTN_DQ and SLICE
bool th_attention_supported(const ggml_tensor * op, int kernel);
bool th_attention(cudaStream_t stream, ggml_tensor * dst, int kernel);

// AdamW over a run of parameters (th-adamw.cu): the run's last node computes it, the others nothing
bool th_adamw_supported(const ggml_tensor * op);
void th_adamw(cudaStream_t stream, ggml_tensor * dst);

// th-loss.cu: CROSS_ENTROPY (false when its scratch or cub's call failed), CROSS_ENTROPY_BACK and
// SOFT_MAX_BACK (false when its scratch failed)
bool th_cross_entropy(cudaStream_t stream, ggml_tensor * dst);
void th_cross_entropy_back(cudaStream_t stream, ggml_tensor * dst);
bool th_soft_max_back(cudaStream_t stream, ggml_tensor * dst);

// a frozen weight's products at bf16 (th-frozen.cu): FROZEN_MUL_MAT and FROZEN_OUT_PROD
bool th_frozen_supported(const ggml_tensor * op, int kernel);
bool th_frozen(cublasHandle_t cublas, ggml_tensor * dst, int kernel);
// dst = dy W + beta dst of a frozen W (OUT_PROD(W, dy^T), at bf16): a PRODUCT_SUM's frozen terms
bool th_frozen_out_prod_into(cublasHandle_t cublas, const ggml_tensor * w, const ggml_tensor * x, ggml_tensor * dst,
                             float beta);
