// The precision of a node's matrix products inside ggml-cuda (issue 32; Options.precision).
// native/build.py includes this header into ggml-cuda.cu and out-prod.cu with
// TH_PRECISION_WRAP_CUBLAS defined, after their cuBLAS includes: their f32 cuBLAS calls then go
// through the wrappers of th-precision.cu, and ggml-cuda.cu calls th_cuda_precision_before for
// every node before computing it.
//   fp32  the math mode CUBLAS_DEFAULT_MATH (ggml creates its handle in TF32 mode): full fp32
//   tf32  CUBLAS_TF32_TENSOR_OP_MATH, and CUBLAS_COMPUTE_32F_FAST_TF32 for the Ex calls: inputs
//         rounded to TF32 (10 mantissa bits) on tensor cores, fp32 accumulation
//   bf16  every f32 product's operands converted to bf16 (round to nearest even, 8 significant
//         bits) and multiplied on tensor cores with fp32 accumulation and fp32 output
//         (CUDA_R_16BF in, CUBLAS_COMPUTE_32F); CUBLAS_COMPUTE_32F_FAST_16BF on the fp32 operands
//         only allows that, and cuBLAS took TF32 kernels for it
// Each is one cuBLAS algorithm per shape and handle, no atomics: the bits repeat run to run.
#pragma once

#include "ggml.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

// whether `node` may call cuBLAS (a product of ggml's, or a node of ours)
static inline bool th_calls_cublas(const ggml_tensor * node) {
    return node->op == GGML_OP_MUL_MAT || node->op == GGML_OP_OUT_PROD || node->op == GGML_OP_MUL_MAT_ID ||
           node->op == GGML_OP_CUSTOM;
}

// before `node` computes: its precision becomes the current one, and the handle's math mode
// follows it (only for nodes that may call cuBLAS)
void th_cuda_precision_before(cublasHandle_t cublas, const ggml_tensor * node);
// the precision of the node computing now (TH_PRECISION_*)
int th_cuda_precision_now(void);
// a graph's nodes are about to be evaluated (computed, or captured into a CUDA graph) in order on
// one stream, and have been: bf16 products reuse an operand's copy within one such pass
void th_cuda_graph_begin(const ggml_cgraph * graph);
void th_cuda_graph_end(void);

// whether a frozen weight of `type` can enter a bf16 product (th_frozen_gemm_bf16): bf16 itself,
// or a type ggml-cuda dequantizes to bf16 (f16, the quantized ones)
bool th_frozen_type_ok(ggml_type type);
// a frozen weight's n values of `type` as bf16 on `stream` (th-dequant.cu): ggml-cuda's
// dequantizer's bits, by our kernel for Q4_K
void th_dequantize_bf16(ggml_type type, const void * src, __nv_bfloat16 * dst, int64_t n, cudaStream_t stream);
// C (m x n, of type ct: fp32, or bf16 rounded once from the fp32 sums) = op(W) op(B) at bf16, W a
// frozen weight of another type than f32 (ne [K, N], contiguous: column-major K x N, leading
// dimension K) as its bf16 values, B (b_rows x b_cols, leading dimension ldb) f32 as its bf16 copy,
// or bf16 itself (b_bf16); fp32 accumulation, one cuBLAS algorithm for the shape; beta 1 adds the
// product into C (a sum of products, PRODUCT_SUM)
cublasStatus_t th_frozen_gemm_bf16(cublasHandle_t h, const ggml_tensor * w, cublasOperation_t tw, cublasOperation_t tb,
                                   int m, int n, int k, const void * b, bool b_bf16, int b_rows, int b_cols, int ldb,
                                   void * c, cudaDataType ct, int ldc, float beta);

// the bf16 copies of a product's f32 operands a (a_rows x a_cols, leading dimension lda; count of
// them, sa apart) and b, packed (leading dimension their rows), as the bf16 products make them: kept
// within a graph pass where they can be, else converted into the scratch; false when the memory
// cannot be had. The copies serve until the next product's (the scratch is reused). With c, also
// the copy of c's c_n floats (a bias that a product with bf16 output adds in its epilogue) in *c16
// (c16 is written only where c is given).
bool th_bf16_operands(cudaStream_t stream, const float * a, long long sa, int a_rows, int a_cols, int lda,
                      const float * b, long long sb, int b_rows, int b_cols, int ldb, int count, const void ** a16,
                      const void ** b16, const float * c = nullptr, int c_n = 0, const void ** c16 = nullptr);

// where `dst` (the node computing now, f32 and contiguous) is read by bf16 products: memory for its
// bf16 copy (rows ne[0], cols its rows), which its writer fills beside it, each value rounded to
// nearest even; nullptr where none is wanted or none can be had. *alone (a writer that can skip
// its f32 values passes it): true where only products read them, each through the copy: the
// writer then writes the copy alone. `written`: the tensor whose copy it is, where dst's kernel
// writes another tensor (the attention backward's rooms; dst stays the writer)
__nv_bfloat16 * th_copy_for_writer(cudaStream_t stream, const ggml_tensor * dst, bool * alone = nullptr,
                                   const ggml_tensor * written = nullptr);

// device memory of at least `bytes` on the current device for work on its stream that ends within
// one node (the bf16 products' operand copies, the loss's row values): one buffer a device, reused
// node after node, grown (the old kept: a captured CUDA graph may use it); nullptr when none can be had
void * th_scratch_for(size_t bytes);

cublasStatus_t th_cublas_sgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                               const float * alpha, const float * a, int lda, const float * b, int ldb,
                               const float * beta, float * c, int ldc);
cublasStatus_t th_cublas_sgemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                       int k, const float * alpha, const float * const a[], int lda,
                                       const float * const b[], int ldb, const float * beta, float * const c[],
                                       int ldc, int count);
cublasStatus_t th_cublas_sgemm_strided_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                               int n, int k, const float * alpha, const float * a, int lda,
                                               long long sa, const float * b, int ldb, long long sb,
                                               const float * beta, float * c, int ldc, long long sc, int count);
cublasStatus_t th_cublas_gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                 const void * alpha, const void * a, cudaDataType at, int lda, const void * b,
                                 cudaDataType bt, int ldb, const void * beta, void * c, cudaDataType ct, int ldc,
                                 cublasComputeType_t compute, cublasGemmAlgo_t algo);
cublasStatus_t th_cublas_gemm_batched_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const void * alpha, const void * const a[], cudaDataType at, int lda,
                                         const void * const b[], cudaDataType bt, int ldb, const void * beta,
                                         void * const c[], cudaDataType ct, int ldc, int count,
                                         cublasComputeType_t compute, cublasGemmAlgo_t algo);
cublasStatus_t th_cublas_gemm_strided_batched_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                                 int n, int k, const void * alpha, const void * a, cudaDataType at,
                                                 int lda, long long sa, const void * b, cudaDataType bt, int ldb,
                                                 long long sb, const void * beta, void * c, cudaDataType ct, int ldc,
                                                 long long sc, int count, cublasComputeType_t compute,
                                                 cublasGemmAlgo_t algo);

#ifdef TH_PRECISION_WRAP_CUBLAS
#undef cublasSgemm
#define cublasSgemm th_cublas_sgemm
#define cublasSgemmBatched th_cublas_sgemm_batched
#define cublasSgemmStridedBatched th_cublas_sgemm_strided_batched
#define cublasGemmEx th_cublas_gemm_ex
#define cublasGemmBatchedEx th_cublas_gemm_batched_ex
#define cublasGemmStridedBatchedEx th_cublas_gemm_strided_batched_ex
#endif
