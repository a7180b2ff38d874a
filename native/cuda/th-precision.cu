// The precision of a node's matrix products (see th-precision.cuh): ggml-cuda's f32 cuBLAS calls
// (ggml-cuda.cu's MUL_MAT, out-prod.cu's OUT_PROD) and ours (th-custom.cu) come here. The
// precision is the node's stamp (custom_ops.h, th_precision_of), made current by
// th_cuda_precision_before as the node starts; ggml computes a graph's nodes one at a time on
// one host thread.
#include "th-precision.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <mutex>
#include <vector>

extern "C" {
#include "custom_ops.h"
}

static int th_precision_current = TH_PRECISION_FP32;

int th_cuda_precision_now(void) { return th_precision_current; }

void th_cuda_precision_before(cublasHandle_t cublas, const ggml_tensor * node) {
    th_precision_current = th_precision_of(node);
    // ggml creates its handle in TF32 mode: fp32 and bf16 (whose products go through GemmEx with
    // their own compute type) turn it off. A host-side setting of the handle, no launch.
    cublasSetMathMode(cublas, th_precision_current == TH_PRECISION_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                        : CUBLAS_DEFAULT_MATH);
}

// whether a product is an f32 one (all operands CUDA_R_32F, fp32 compute), which a precision changes
static bool th_f32_product(const cudaDataType at, const cudaDataType bt, const cudaDataType ct,
                           const cublasComputeType_t compute) {
    return at == CUDA_R_32F && bt == CUDA_R_32F && ct == CUDA_R_32F && compute == CUBLAS_COMPUTE_32F;
}

// --- bf16: the operands as bf16 copies --------------------------------------------------------
// CUBLAS_COMPUTE_32F_FAST_16BF only allows cuBLAS to round fp32 operands to bf16: on the H100 it
// chose TF32 kernels for it (the same bits as tf32). So a bf16 product converts its operands to
// bf16 (round to nearest even) into scratch memory and multiplies those (CUDA_R_16BF in, fp32
// accumulation and output). The scratch is one buffer a device, reused product after product on
// the stream; a product that needs more gets a larger one, and the old stays allocated: a CUDA
// graph captured before may still use it.
struct th_scratch {
    int device;
    void * ptr;
    size_t bytes;
};
static std::mutex th_scratch_mutex;
static std::vector<th_scratch> th_scratches;        // the newest of a device last

static void * th_scratch_for(const size_t bytes) {
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(th_scratch_mutex);
    for (auto it = th_scratches.rbegin(); it != th_scratches.rend(); ++it) {
        if (it->device == device) {
            if (it->bytes >= bytes) return it->ptr;
            break;
        }
    }
    void * ptr = nullptr;
    const size_t rounded = (bytes + (1 << 20) - 1) & ~(size_t) ((1 << 20) - 1);
    if (cudaMalloc(&ptr, rounded) != cudaSuccess) return nullptr;
    th_scratches.push_back({device, ptr, rounded});
    return ptr;
}

// rows x cols of a column-major fp32 matrix (leading dimension ld), `count` of them, each at
// src + b * stride (or at srcs[b] when srcs is given), into packed bf16 (leading dimension rows).
// Each element rounds to nearest even on its own: how the work is cut does not change a bit.
// The general path: a thread an element, a block row of columns.
static __global__ void th_to_bf16_kernel(const float * __restrict__ src, const float * const * __restrict__ srcs,
                                         const long long stride, const int rows, const int cols, const int ld,
                                         __nv_bfloat16 * __restrict__ dst) {
    const int b = blockIdx.z;
    const float * m = srcs != nullptr ? srcs[b] : src + b * stride;
    __nv_bfloat16 * out = dst + (size_t) b * rows * cols;
    for (int c = blockIdx.y; c < cols; c += gridDim.y) {
        for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
            out[(size_t) c * rows + r] = __float2bfloat16_rn(m[(size_t) c * ld + r]);
        }
    }
}

// The common path: packed matrices (ld == rows, stride == rows * cols or pointer arrays), n floats
// each a multiple of 4 and 16-byte aligned: 8 floats a thread (two float4 loads, one 16-byte
// store), a grid-stride loop over the whole. Before (a thread an element, 2-byte stores): 17.7 ms of
// a bf16 gpt2-small step on the H100 in 632 launches (scripts/cuda_kernels.py).
static __global__ void th_to_bf16_packed_kernel(const float * __restrict__ src, const float * const * __restrict__ srcs,
                                                const long long n, __nv_bfloat16 * __restrict__ dst) {
    const int b = blockIdx.y;
    const float * m = srcs != nullptr ? srcs[b] : src + b * n;
    __nv_bfloat16 * out = dst + b * n;
    const long long n8 = n / 8;
    for (long long i = blockIdx.x * (long long) blockDim.x + threadIdx.x; i < n8; i += (long long) gridDim.x * blockDim.x) {
        const float4 x = ((const float4 *) m)[2 * i], y = ((const float4 *) m)[2 * i + 1];
        __nv_bfloat162 h[4] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w),
                               __floats2bfloat162_rn(y.x, y.y), __floats2bfloat162_rn(y.z, y.w)};
        ((uint4 *) out)[i] = *(const uint4 *) h;
    }
    if (blockIdx.x == 0) {                                  // the last n % 8 (a float4 or none)
        for (long long i = 8 * n8 + threadIdx.x; i < n; i += blockDim.x) out[i] = __float2bfloat16_rn(m[i]);
    }
}

// Strided columns (ld > rows), rows a multiple of 8 and ld of 4, 16-byte aligned: 8 rows of a column
// a thread, as the packed kernel does.
static __global__ void th_to_bf16_cols8_kernel(const float * __restrict__ src, const long long stride, const int rows,
                                               const int cols, const int ld, __nv_bfloat16 * __restrict__ dst) {
    const int b = blockIdx.y;
    const float * m = src + b * stride;
    __nv_bfloat16 * out = dst + (size_t) b * rows * cols;
    const int per_col = rows / 8;
    const long long n8 = (long long) per_col * cols;
    for (long long i = blockIdx.x * (long long) blockDim.x + threadIdx.x; i < n8; i += (long long) gridDim.x * blockDim.x) {
        const long long c = i / per_col, r = 8 * (i % per_col);
        const float4 x = *(const float4 *) (m + c * ld + r), y = *(const float4 *) (m + c * ld + r + 4);
        __nv_bfloat162 h[4] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w),
                               __floats2bfloat162_rn(y.x, y.y), __floats2bfloat162_rn(y.z, y.w)};
        *(uint4 *) (out + c * rows + r) = *(const uint4 *) h;
    }
}

static __global__ void th_pointers_kernel(const __nv_bfloat16 * base, const size_t stride, const int count,
                                          const void ** out) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < count) out[b] = base + b * stride;
}

static int th_sm_count(void) {
    static int sms[64] = {0};
    int device = 0;
    cudaGetDevice(&device);
    if (device >= 64) return 132;
    if (sms[device] == 0) {
        int n = 0;
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
        sms[device] = n > 0 ? n : 132;
    }
    return sms[device];
}

static void th_to_bf16(cudaStream_t stream, const float * src, const float * const * srcs, const long long stride,
                       const int rows, const int cols, const int ld, const int count, __nv_bfloat16 * dst) {
    const long long n = (long long) rows * cols;
    // pointer arrays: each pointer's alignment is unknown on the host, so they take the general path
    const bool packed = srcs == nullptr && ld == rows && n % 4 == 0 &&
                        (count == 1 || (stride == n && n % 8 == 0 && count <= 65535)) &&
                        (uintptr_t) src % 16 == 0 && (uintptr_t) dst % 16 == 0;
    if (packed) {
        const long long want = (n / 8 + 255) / 256;
        const int blocks = (int) std::max(1LL, std::min(want, (long long) th_sm_count() * 8));
        th_to_bf16_packed_kernel<<<dim3((unsigned) blocks, (unsigned) count), 256, 0, stream>>>(src, nullptr, n, dst);
        return;
    }
    const bool cols8 = srcs == nullptr && rows % 8 == 0 && ld % 4 == 0 && (count == 1 || stride % 4 == 0) &&
                       (uintptr_t) src % 16 == 0 && (uintptr_t) dst % 16 == 0 && count <= 65535;
    if (cols8) {
        const long long want = (n / 8 + 255) / 256;
        const int blocks = (int) std::max(1LL, std::min(want, (long long) th_sm_count() * 8));
        th_to_bf16_cols8_kernel<<<dim3((unsigned) blocks, (unsigned) count), 256, 0, stream>>>(src, stride, rows, cols,
                                                                                               ld, dst);
        return;
    }
    const dim3 grid((unsigned) std::min((rows + 255) / 256, 64), (unsigned) std::min(cols, 65535), (unsigned) count);
    th_to_bf16_kernel<<<grid, 256, 0, stream>>>(src, srcs, stride, rows, cols, ld, dst);
}

// The product in bf16: the operands (op(A) m x k, op(B) k x n; A stored rows x cols as its op
// says) converted, then one cuBLAS call on the copies. `a`/`b` strided by sa/sb, or pointer
// arrays `as`/`bs` (then c is `cs`); count products.
static cublasStatus_t th_gemm_bf16(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void * alpha, const float * a, const float * const * as, int lda,
                                   long long sa, const float * b, const float * const * bs, int ldb, long long sb,
                                   const void * beta, float * c, void * const * cs, int ldc, long long sc,
                                   int count, bool batched) {
    cudaStream_t stream = nullptr;
    if (cublasGetStream(h, &stream) != CUBLAS_STATUS_SUCCESS) return CUBLAS_STATUS_INTERNAL_ERROR;
    const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
    const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
    const size_t a_size = (size_t) a_rows * a_cols, b_size = (size_t) b_rows * b_cols;
    const size_t pointers = as != nullptr ? 3 * (size_t) count * sizeof(void *) : 0;
    const size_t bytes = (a_size + b_size) * count * sizeof(__nv_bfloat16) + pointers + 512;
    char * scratch = (char *) th_scratch_for(bytes);
    if (scratch == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
    __nv_bfloat16 * a16 = (__nv_bfloat16 *) scratch;             // each copy 256-byte aligned
    __nv_bfloat16 * b16 = (__nv_bfloat16 *) (((uintptr_t) (a16 + a_size * count) + 255) & ~(uintptr_t) 255);
    th_to_bf16(stream, a, as, sa, a_rows, a_cols, lda, count, a16);
    th_to_bf16(stream, b, bs, sb, b_rows, b_cols, ldb, count, b16);
    if (cudaGetLastError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (as != nullptr) {                        // pointer arrays: the copies' pointers, on the device
        const void ** ptrs = (const void **) (((uintptr_t) (b16 + b_size * count) + 255) & ~(uintptr_t) 255);
        th_pointers_kernel<<<(count + 255) / 256, 256, 0, stream>>>(a16, a_size, count, ptrs);
        th_pointers_kernel<<<(count + 255) / 256, 256, 0, stream>>>(b16, b_size, count, ptrs + count);
        return cublasGemmBatchedEx(h, ta, tb, m, n, k, alpha, ptrs, CUDA_R_16BF, a_rows, ptrs + count, CUDA_R_16BF,
                                   b_rows, beta, cs, CUDA_R_32F, ldc, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (batched) {
        return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a16, CUDA_R_16BF, a_rows, (long long) a_size, b16,
                                          CUDA_R_16BF, b_rows, (long long) b_size, beta, c, CUDA_R_32F, ldc, sc, count,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, a16, CUDA_R_16BF, a_rows, b16, CUDA_R_16BF, b_rows, beta, c,
                        CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t th_cublas_sgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                               const float * alpha, const float * a, int lda, const float * b, int ldb,
                               const float * beta, float * c, int ldc) {
    if (th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, a, nullptr, lda, 0, b, nullptr, ldb, 0, beta, c, nullptr, ldc, 0,
                            1, false);
    }
    return cublasSgemm_v2(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);   // tf32: the math mode
}

cublasStatus_t th_cublas_sgemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                       int k, const float * alpha, const float * const a[], int lda,
                                       const float * const b[], int ldb, const float * beta, float * const c[],
                                       int ldc, int count) {
    if (th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, nullptr, a, lda, 0, nullptr, b, ldb, 0, beta, nullptr,
                            (void * const *) c, ldc, 0, count, true);
    }
    return cublasSgemmBatched(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, count);
}

cublasStatus_t th_cublas_sgemm_strided_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                               int n, int k, const float * alpha, const float * a, int lda,
                                               long long sa, const float * b, int ldb, long long sb,
                                               const float * beta, float * c, int ldc, long long sc, int count) {
    if (th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, a, nullptr, lda, sa, b, nullptr, ldb, sb, beta, c, nullptr, ldc,
                            sc, count, true);
    }
    return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, count);
}

cublasStatus_t th_cublas_gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                 const void * alpha, const void * a, cudaDataType at, int lda, const void * b,
                                 cudaDataType bt, int ldb, const void * beta, void * c, cudaDataType ct, int ldc,
                                 cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, (const float *) a, nullptr, lda, 0, (const float *) b, nullptr,
                            ldb, 0, beta, (float *) c, nullptr, ldc, 0, 1, false);
    }
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_TF32) {
        compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, compute, algo);
}

cublasStatus_t th_cublas_gemm_batched_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const void * alpha, const void * const a[], cudaDataType at, int lda,
                                         const void * const b[], cudaDataType bt, int ldb, const void * beta,
                                         void * const c[], cudaDataType ct, int ldc, int count,
                                         cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, nullptr, (const float * const *) a, lda, 0, nullptr,
                            (const float * const *) b, ldb, 0, beta, nullptr, c, ldc, 0, count, true);
    }
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_TF32) {
        compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return cublasGemmBatchedEx(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, count, compute,
                               algo);
}

cublasStatus_t th_cublas_gemm_strided_batched_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                                 int n, int k, const void * alpha, const void * a, cudaDataType at,
                                                 int lda, long long sa, const void * b, cudaDataType bt, int ldb,
                                                 long long sb, const void * beta, void * c, cudaDataType ct, int ldc,
                                                 long long sc, int count, cublasComputeType_t compute,
                                                 cublasGemmAlgo_t algo) {
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, (const float *) a, nullptr, lda, sa, (const float *) b, nullptr,
                            ldb, sb, beta, (float *) c, nullptr, ldc, sc, count, true);
    }
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_TF32) {
        compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc, sc,
                                      count, compute, algo);
}
