// toyharness's own cuda kernels, dispatched by ggml-cuda for GGML_OP_CUSTOM nodes that
// th_cuda_rewrite (native/cuda_rewrite.c) marked: op_params[0] is TH_CUDA_MAGIC, op_params[1]
// the kernel. The marks and the arithmetic are shared with the cpu kernels
// (native/custom_ops.h, native/cpu_kernels.c), so cuda and cpu compute the same formula.
//
// GELU, tanh form, one node each way (ggml 0.25.3 has no GELU backward; see blocks.gelu_tanh):
//   y  = x s                                    s = sigmoid(x (k1 + k3 x^2))
//   dx = dy (s + x s (1 - s) (k1 + 3 k3 x^2))
// GELU, exact (erf) form, one node each way (blocks.gelu_erf, nanoGPT's nn.GELU()):
//   y  = x Phi(x)                               Phi(x) = 0.5 (1 + erf(x / sqrt 2))
//   dx = dy (Phi(x) + x phi(x))                 phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
// CUDA's own erf, not the cpu kernel's Abramowitz and Stegun (the bits differ from the cpu's, a
// few 1e-7 of Phi): within 1e-6 relative of float64 over the whole range (th_gelu_erf_cdf).
// Elementwise, so every element's bits are the same run to run.
//
// LayerNorm's normalization (blocks.layer_norm), one node each way, a warp a row:
//   t  = (x - mean) r                           r = 1 / sqrt(mean((x - mean)^2) + eps)
//   dx = r (dt - t mean(dt t) - (mean(dt) - mean(dt t) mean(t)))
// the gradient that ggml's RMS_NORM_BACK of the centred rows and the centring's backward give.
// Each lane sums its elements in order and the warp adds the lanes in a fixed tree: the bits
// repeat run to run.
//
// A norm's gain and bias, y = t g + b, one pass (rounded as MUL then ADD: no fused multiply-add;
// without a bias, an RMSNorm's gain in either direction, y = t g),
// and the gain's gradient, per column the sum over rows of t dy: a block sums 32 columns of a
// chunk of rows (each thread its rows in order, then the block's 8 partial sums in order) into
// scratch, then one thread a column sums the chunks in order: the bits repeat run to run.
// LayerNorm's backward, which holds t and dy, takes that first pass where the rewrite hands it
// (th_fuse_gain_sums): a block a chunk, its warps the same rows in the same order (the same bits).
//
// GET_ROWS_BACK, dst (n, V) row v = the sum of the gradient's rows r with ids[r] = v, in the order
// of r from 0, as ggml-cuda's kernel sums (the same bits): a thread an output element, as there,
// but the ids come through shared memory, staged once per block of 256 threads, a warp compares
// 32 of them at once and loads the rows it found many at a time before adding them in order.
//
// A bias added to a product's rows (blocks.linear), one node: cuBLASLt's product of w and x with
// b added in its epilogue (acc + b rounded once, as the ADD after ggml's MUL_MAT rounded it; the
// algorithm cuBLASLt picks for a shape may sum k in another order than cuBLAS's, a few goldens
// moved 1 ulp), y written once. Where cuBLASLt has no algorithm for the shape, or an operand is
// not 16-byte aligned, b is written into every row and cuBLAS's product added to it (beta 1).
//
// RMS_NORM and ROPE (RMSNorm and rotary positions): ggml-cuda's formulas and orders of summing
// (the same bits) with a warp a row and a thread a rotated pair, where ggml's blocks left most
// threads idle at small rows and heads.
//
// CONT of a permuted f32 tensor (attention's head permutes: 8 a layer), a copy: ggml-cuda's
// computes each element's place with 64-bit divisions, about 8x below the memory's speed.
// Here a warp copies a row when the source's rows are contiguous, and a 32 x 32 tile goes
// through shared memory when the permute moves the contiguous axis (a transpose).
#include "th-custom.cuh"
#include "th-precision.cuh"

#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

extern "C" {
#include "custom_ops.h"
#include "dropout_mask.h"
}

#define TH_CUDA_BLOCK 256

static __device__ float th_gelu(const float xi) {
    return xi / (1.0f + expf(-xi * (TH_GELU_K1 + TH_GELU_K3 * xi * xi)));
}

static __device__ float th_gelu_back(const float dyi, const float xi) {
    const float x2 = xi * xi;
    const float s = 1.0f / (1.0f + expf(-xi * (TH_GELU_K1 + TH_GELU_K3 * x2)));
    return dyi * (s + xi * s * (1.0f - s) * (TH_GELU_K1 + 3.0f * TH_GELU_K3 * x2));
}

// Phi(x) by normcdff: 0.5 erfc(-x / sqrt 2) with the rounding of x / sqrt 2 made up for inside
// (5 ulp). 0.5 (1 + erff(x / sqrt 2)) would cancel for x < 0: Phi(-5) = 2.9e-7 from 1 - 0.9999994,
// a tenth of it lost to erff's last bit. (-use_fast_math, ggml-cuda's flag, leaves it alone: it
// maps expf, logf, sinf, cosf, powf and divisions to their approximations.)
static __device__ __forceinline__ float th_gelu_erf_cdf(const float x) { return normcdff(x); }

// phi(x) = exp(-x^2 / 2) / sqrt(2 pi) as exp2f(-(t + t_err)), t + t_err = x^2 log2(e) / 2 carried
// past float's rounding (x^2 and the constant each as a sum of two floats, their errors by fmaf):
// expf(-x^2 / 2) of the rounded argument is off by that rounding, relative to phi, about 4e-6 by
// |x| = 13 (and expf is __expf under -use_fast_math); exp2f is 2 ulp of its argument. |x| clamped
// at 16 (phi underflows from 13.2 on), so that x^2 never overflows.
#define TH_HALF_LOG2E 0.72134752f               /* log2(e) / 2, rounded to float ... */
#define TH_HALF_LOG2E_LO 9.6298150e-9f          /* ... and what that rounding left out */
static __device__ __forceinline__ float th_gelu_erf_density(const float x) {
    const float a = fminf(fabsf(x), 16.0f);
    const float a2 = a * a, a2_err = fmaf(a, a, -a2);                  // a^2 = a2 + a2_err exactly
    const float t = TH_HALF_LOG2E * a2;
    const float t_err = fmaf(TH_HALF_LOG2E, a2, -t) + fmaf(TH_HALF_LOG2E_LO, a2, TH_HALF_LOG2E * a2_err);
    const float e = exp2f(-t);                                          // then exp2(-t_err) = 1 - t_err ln 2
    return fmaf(e, -0.69314718f * t_err, e) * 0.39894228f;             // 1 / sqrt(2 pi)
}

static __device__ float th_gelu_erf(const float xi) { return xi * th_gelu_erf_cdf(xi); }

static __device__ float th_gelu_erf_back(const float dyi, const float xi) {
    return dyi * (th_gelu_erf_cdf(xi) + xi * th_gelu_erf_density(xi));
}

// four floats as bf16 (each rounded to nearest even, as th_to_bf16 rounds) into p, 8-byte aligned
static __device__ __forceinline__ void th_store_bf16x4(__nv_bfloat16 * p, const float4 v) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 packed;
    memcpy(&packed.x, &lo, sizeof(lo));
    memcpy(&packed.y, &hi, sizeof(hi));
    *(uint2 *) p = packed;
}

// A writer's value at i: into y (nullptr: not written, the copy alone) and its bf16 copy y16
// (nullptr: none), rounded to nearest even; th_put4: the float4 at i, the four copies at 4 i
static __device__ __forceinline__ void th_put1(float * y, __nv_bfloat16 * y16, const int64_t i, const float v) {
    if (y != nullptr) y[i] = v;
    if (y16 != nullptr) y16[i] = __float2bfloat16_rn(v);
}
static __device__ __forceinline__ void th_put4(float * y, __nv_bfloat16 * y16, const int64_t i, const float4 v) {
    if (y != nullptr) ((float4 *) y)[i] = v;
    if (y16 != nullptr) th_store_bf16x4(y16 + 4 * i, v);
}

// four values from i * 4 of f32 or bf16 (16- or 8-byte aligned), and one, as floats
static __device__ __forceinline__ float4 th_load4(const float * p, const int64_t i) { return ((const float4 *) p)[i]; }
static __device__ __forceinline__ float4 th_load4(const __nv_bfloat16 * p, const int64_t i) {
    const uint2 r = ((const uint2 *) p)[i];
    __nv_bfloat162 lo, hi;
    memcpy(&lo, &r.x, sizeof(lo));
    memcpy(&hi, &r.y, sizeof(hi));
    const float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
    return make_float4(a.x, a.y, b.x, b.y);
}
static __device__ __forceinline__ float th_load1(const float * p, const int64_t i) { return p[i]; }
static __device__ __forceinline__ float th_load1(const __nv_bfloat16 * p, const int64_t i) { return __bfloat162float(p[i]); }

// y[i] = op(a[i], b[i]) over n floats (b read only by a binary op): GELU (either form), its backward,
// same-shape ADD. A float4 at a time where n is a multiple of 4 and every pointer 16-aligned (vec4), else a
// float; elementwise, so every element's bits are the same run to run. With y16 (copy16) each value
// also as bf16 rounded to nearest even: the copy a bf16 product would otherwise convert
// (th_copy_for_writer), 8 bytes a float4; y nullptr: the copy alone (only products read y).
// a and b f32, or bf16 (TA, TB: a GELU's input kept bf16, th_gelu_bf16), each value widened
// exactly: op computes in fp32 either way.
template <bool vec4, bool copy16, class Op, class TA = float, class TB = float>
static __global__ void th_map_kernel(const Op op, const TA * __restrict__ a, const TB * __restrict__ b,
                                     float * __restrict__ y, __nv_bfloat16 * __restrict__ y16, const int64_t n) {
    const int64_t step = (int64_t) gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < (vec4 ? n / 4 : n); i += step) {
        if (vec4) {
            const float4 u = th_load4(a, i), v = Op::binary ? th_load4(b, i) : u;
            const float4 r = make_float4(op(u.x, v.x), op(u.y, v.y), op(u.z, v.z), op(u.w, v.w));
            th_put4(y, copy16 ? y16 : nullptr, i, r);
        } else {
            th_put1(y, copy16 ? y16 : nullptr, i, op(th_load1(a, i), Op::binary ? th_load1(b, i) : 0.0f));
        }
    }
}

struct th_gelu_op {
    static constexpr bool binary = false;
    __device__ float operator()(const float x, float) const { return th_gelu(x); }
};
struct th_gelu_back_op {
    static constexpr bool binary = true;
    __device__ float operator()(const float dy, const float x) const { return th_gelu_back(dy, x); }
};
struct th_gelu_erf_op {
    static constexpr bool binary = false;
    __device__ float operator()(const float x, float) const { return th_gelu_erf(x); }
};
struct th_gelu_erf_back_op {
    static constexpr bool binary = true;
    __device__ float operator()(const float dy, const float x) const { return th_gelu_erf_back(dy, x); }
};
struct th_add_op {
    static constexpr bool binary = true;
    __device__ float operator()(const float u, const float v) const { return u + v; }
};


// Where a writer of ours puts `dst`'s values: the f32 memory it returns (nullptr: none, the copy
// alone) and *y16, the bf16 copy where products read them at bf16 (th_copy_for_writer), or nullptr.
// `written`: another tensor dst's kernel writes (a room), whose values these are
static float * th_writer_outputs(cudaStream_t stream, const ggml_tensor * dst, __nv_bfloat16 ** y16,
                                 const ggml_tensor * written = nullptr) {
    bool alone = false;
    *y16 = th_copy_for_writer(stream, dst, &alone, written);
    return alone ? nullptr : (float *) (written != nullptr ? written : dst)->data;
}

template <class Op, class TA, class TB>
static void th_map_typed(cudaStream_t stream, const Op op, const TA * pa, const TB * pb, float * py,
                         __nv_bfloat16 * y16, const int64_t n, const bool vec4) {
    const int64_t items = vec4 ? n / 4 : n;
    const int64_t wanted = (items + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK;
    const int blocks = (int) (wanted < 65535 ? wanted : 65535);
    if (vec4 && y16 != nullptr) {          // (a copy's memory is 256-byte aligned)
        th_map_kernel<true, true><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(op, pa, pb, py, y16, n);
    } else if (vec4) {
        th_map_kernel<true, false><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(op, pa, pb, py, nullptr, n);
    } else if (y16 != nullptr) {
        th_map_kernel<false, true><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(op, pa, pb, py, y16, n);
    } else {
        th_map_kernel<false, false><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(op, pa, pb, py, nullptr, n);
    }
}

// copies: y's bf16 copy written beside it, or instead of it, where products read it (th_writer_outputs).
// a and b read as their types say: f32, or bf16 (GELU's input and GELU_BACK's x, th_gelu_bf16)
template <class Op>
static void th_map(cudaStream_t stream, const Op op, const ggml_tensor * a, const ggml_tensor * b, ggml_tensor * y,
                   const bool copies = false) {
    const int64_t n = ggml_nelements(y);
    const bool vec4 = n % 4 == 0 && th_aligned16(a->data) && th_aligned16(b->data) && th_aligned16(y->data);
    __nv_bfloat16 * y16 = nullptr;
    float * py = copies ? th_writer_outputs(stream, y, &y16) : (float *) y->data;
    const bool a16 = a->type == GGML_TYPE_BF16, b16 = b->type == GGML_TYPE_BF16;
    if (a16 && b16) {
        th_map_typed(stream, op, (const __nv_bfloat16 *) a->data, (const __nv_bfloat16 *) b->data, py, y16, n, vec4);
    } else if (a16) {
        th_map_typed(stream, op, (const __nv_bfloat16 *) a->data, (const float *) b->data, py, y16, n, vec4);
    } else if (b16) {
        th_map_typed(stream, op, (const float *) a->data, (const __nv_bfloat16 *) b->data, py, y16, n, vec4);
    } else {
        th_map_typed(stream, op, (const float *) a->data, (const float *) b->data, py, y16, n, vec4);
    }
}

// ggml-cuda's op_silu_back (unary.cu), the same expression under the same flags (-use_fast_math):
// SILU_BACK_MUL must give the bits of ggml's SILU_BACK node
static __device__ __forceinline__ float th_silu_back(const float grad, const float x) {
    const float s = 1.0f / (1.0f + expf(-x));
    return grad * s * (1.0f + x * (1.0f - s));
}

// y = silu_back(a * b, x) over n floats: SwiGLU's gate gradient with ggml's MUL(grad, up) inside.
// __fmul_rn rounds the product to f32 as the MUL's node stored it (no FMA contraction into what
// follows). A float4 at a time where every pointer is 16-aligned and n a multiple of 4.
template <bool vec4>
static __global__ void th_silu_back_mul_kernel(const float * __restrict__ a, const float * __restrict__ b,
                                               const float * __restrict__ x, float * __restrict__ y, const int64_t n) {
    const int64_t step = (int64_t) gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < (vec4 ? n / 4 : n); i += step) {
        if (vec4) {
            const float4 u = ((const float4 *) a)[i], v = ((const float4 *) b)[i], w = ((const float4 *) x)[i];
            ((float4 *) y)[i] = make_float4(th_silu_back(__fmul_rn(u.x, v.x), w.x), th_silu_back(__fmul_rn(u.y, v.y), w.y),
                                            th_silu_back(__fmul_rn(u.z, v.z), w.z), th_silu_back(__fmul_rn(u.w, v.w), w.w));
        } else {
            y[i] = th_silu_back(__fmul_rn(a[i], b[i]), x[i]);
        }
    }
}

// ggml-cuda's op_silu (ggml_cuda_op_silu_single, unary.cuh): SWIGLU_BACK's up gradient must be the
// bits of ggml's fused SILU + MUL (unary_gated: op_silu(x) * g)
static __device__ __forceinline__ float th_silu(const float x) { return x / (1.0f + expf(-x)); }

// SwiGLU's forward, y = silu(gate) * up rounded to y's type (ggml-cuda's unary_gated_op_kernel
// with op_silu: the same expression, __float2bfloat16's rounding), 16 bytes of each a thread
// (four f32 values or eight bf16) where every pointer is 16-aligned and n a multiple of the
// vector, else a value a thread
// y16 (f32 only): y's bf16 copy beside it (th_map_kernel's), y nullptr: the copy alone
static __device__ __forceinline__ void th_swiglu_store(float * y, __nv_bfloat16 * y16, const int64_t i, const float4 g,
                                                       const float4 u) {
    const float4 r = make_float4(th_silu(g.x) * u.x, th_silu(g.y) * u.y, th_silu(g.z) * u.z, th_silu(g.w) * u.w);
    th_put4(y, y16, i, r);
}
static __device__ __forceinline__ __nv_bfloat162 th_swiglu_pair(const __nv_bfloat162 g, const __nv_bfloat162 u) {
    const float2 gf = __bfloat1622float2(g), uf = __bfloat1622float2(u);
    return __floats2bfloat162_rn(th_silu(gf.x) * uf.x, th_silu(gf.y) * uf.y);
}
template <bool vec, typename T>
static __global__ void th_swiglu_kernel(const T * __restrict__ gate, const T * __restrict__ up, T * __restrict__ y,
                                        __nv_bfloat16 * __restrict__ y16, const int64_t n) {
    constexpr int width = sizeof(T) == 4 ? 4 : 8;           // values in 16 bytes
    const int64_t step = (int64_t) gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < (vec ? n / width : n); i += step) {
        if constexpr (!vec) {
            const float v = th_silu(th_load1(gate, i)) * th_load1(up, i);
            if constexpr (sizeof(T) == 4) {
                th_put1((float *) y, y16, i, v);
            } else {
                y[i] = __float2bfloat16(v);
            }
        } else if constexpr (sizeof(T) == 4) {
            th_swiglu_store((float *) y, y16, i, ((const float4 *) gate)[i], ((const float4 *) up)[i]);
        } else {
            const uint4 g = ((const uint4 *) gate)[i], u = ((const uint4 *) up)[i];
            __nv_bfloat162 gp[4], up2[4], out[4];
            memcpy(gp, &g, sizeof(g));
            memcpy(up2, &u, sizeof(u));
#pragma unroll
            for (int k = 0; k < 4; k++) out[k] = th_swiglu_pair(gp[k], up2[k]);
            uint4 r;
            memcpy(&r, out, sizeof(r));
            ((uint4 *) y)[i] = r;
        }
    }
}

// (y: where y's values go; y16 (f32 only) their bf16 copy, or nullptr; `at` y's memory, for the
// alignment test when y is nullptr: the copy alone)
template <typename T>
static void th_swiglu_of(cudaStream_t stream, const T * gate, const T * up, T * y, const int64_t n,
                         __nv_bfloat16 * y16 = nullptr, const void * at = nullptr) {
    constexpr int width = sizeof(T) == 4 ? 4 : 8;
    const bool vec = n % width == 0 && th_aligned16(gate) && th_aligned16(up) && th_aligned16(at != nullptr ? at : y);
    const int64_t wanted = ((vec ? n / width : n) + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK;
    const int blocks = (int) (wanted < 65535 ? wanted : 65535);
    if (vec) {
        th_swiglu_kernel<true><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(gate, up, y, y16, n);
    } else {
        th_swiglu_kernel<false><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(gate, up, y, y16, n);
    }
}

// Dropout's mask (dropout_mask.h, the stream the cpu kernel and the numpy reference compute): a
// thread a block of four elements, integer arithmetic only, so every element's bits are the cpu's.
// The key (seed, forward index, enabled) is read from the fed i32[4] in device memory.
static __global__ void th_dropout_mask_kernel(const int32_t * __restrict__ key, float * __restrict__ y,
                                              const int64_t n, const th_dropout_params p) {
    const int32_t k[TH_DROPOUT_KEY_WORDS] = {key[0], key[1], key[2], key[3]};
    const int64_t blocks = (n + 3) / 4, step = (int64_t) gridDim.x * blockDim.x;
    for (int64_t b = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; b < blocks; b += step) {
        float out[4];
        th_dropout_block(out, (uint64_t) b, k, p);
        if (4 * b + 4 <= n) {
            reinterpret_cast<float4 *>(y)[b] = make_float4(out[0], out[1], out[2], out[3]);
        } else {
            for (int64_t j = 0; 4 * b + j < n; j++) y[4 * b + j] = out[j];
        }
    }
}

static void th_dropout_mask(cudaStream_t stream, ggml_tensor * dst) {
    const th_dropout_params p = th_dropout_params_from(dst->op_params + TH_DROPOUT_CUDA_SLOT);
    const int64_t n = ggml_nelements(dst), blocks = (n + 3) / 4;
    const int threads = 256;
    const int64_t grid = std::min<int64_t>((blocks + threads - 1) / threads, 65535);
    if (grid > 0) {
        th_dropout_mask_kernel<<<(unsigned) grid, threads, 0, stream>>>((const int32_t *) dst->src[0]->data,
                                                                       (float *) dst->data, n, p);
    }
}

static void th_swiglu(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * gate = dst->src[0], * up = dst->src[1];
    if (dst->type == GGML_TYPE_BF16) {          // kept in bf16 (th_swiglu_bf16)
        th_swiglu_of(stream, (const __nv_bfloat16 *) gate->data, (const __nv_bfloat16 *) up->data,
                     (__nv_bfloat16 *) dst->data, ggml_nelements(dst));
    } else {                                    // (at bf16 y's copy beside it, or alone: the down product's operand)
        __nv_bfloat16 * y16 = nullptr;
        float * y = th_writer_outputs(stream, dst, &y16);
        th_swiglu_of(stream, (const float *) gate->data, (const float *) up->data, y, ggml_nelements(dst), y16,
                     dst->data);
    }
}

// SwiGLU's backward in one pass over the activation: dg = silu_back(grad * up, gate) (as above) and
// du = silu(gate) * grad, from grad, up and gate read once (5 passes where ggml's nodes make 7,
// SILU_BACK_MUL and ggml's fused SILU + MUL); up and gate f32, or bf16 (th_swiglu_bf16: their
// values, exactly, as floats)
// dg16, du16: their bf16 copies (th_map_kernel's) or nullptr; dg or du nullptr: its copy alone
template <bool vec4, typename T>
static __global__ void th_swiglu_back_kernel(const float * __restrict__ grad, const T * __restrict__ up,
                                             const T * __restrict__ gate, float * __restrict__ dg,
                                             float * __restrict__ du, const int64_t n,
                                             __nv_bfloat16 * __restrict__ dg16, __nv_bfloat16 * __restrict__ du16) {
    const int64_t step = (int64_t) gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < (vec4 ? n / 4 : n); i += step) {
        if (vec4) {
            const float4 d = ((const float4 *) grad)[i], u = th_load4(up, i), x = th_load4(gate, i);
            const float4 g4 = make_float4(th_silu_back(__fmul_rn(d.x, u.x), x.x), th_silu_back(__fmul_rn(d.y, u.y), x.y),
                                          th_silu_back(__fmul_rn(d.z, u.z), x.z), th_silu_back(__fmul_rn(d.w, u.w), x.w));
            const float4 u4 = make_float4(__fmul_rn(th_silu(x.x), d.x), __fmul_rn(th_silu(x.y), d.y),
                                          __fmul_rn(th_silu(x.z), d.z), __fmul_rn(th_silu(x.w), d.w));
            th_put4(dg, dg16, i, g4);
            th_put4(du, du16, i, u4);
        } else {
            const float d = grad[i], x = th_load1(gate, i);
            const float g1 = th_silu_back(__fmul_rn(d, th_load1(up, i)), x), u1 = __fmul_rn(th_silu(x), d);
            th_put1(dg, dg16, i, g1);
            th_put1(du, du16, i, u1);
        }
    }
}

static void th_silu_back_mul(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * a = dst->src[0], * b = dst->src[1], * x = dst->src[2];
    const int64_t n = ggml_nelements(dst);
    const bool vec4 = n % 4 == 0 && th_aligned16(a->data) && th_aligned16(b->data) && th_aligned16(x->data) &&
                      th_aligned16(dst->data);
    const int64_t wanted = ((vec4 ? n / 4 : n) + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK;
    const int blocks = (int) (wanted < 65535 ? wanted : 65535);
    const float * pa = (const float *) a->data, * pb = (const float *) b->data, * px = (const float *) x->data;
    const ggml_tensor * room = dst->src[3];          // SWIGLU_BACK: up's gradient too
    if (room != nullptr) {
        const bool v4 = vec4 && th_aligned16(room->data);
        const int64_t want = ((v4 ? n / 4 : n) + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK;
        const int nb = (int) (want < 65535 ? want : 65535);
        // at bf16 gate's and up's gradients' copies beside them, or alone, where products read
        // them (their weights' and inputs' gradients); up's is the room's, which this node writes
        __nv_bfloat16 * dg16 = nullptr, * du16 = nullptr;
        float * dg = th_writer_outputs(stream, dst, &dg16), * du = th_writer_outputs(stream, dst, &du16, room);
        if (b->type == GGML_TYPE_BF16) {            // up and gate kept in bf16 (th_swiglu_bf16)
            const __nv_bfloat16 * up = (const __nv_bfloat16 *) b->data, * gate = (const __nv_bfloat16 *) x->data;
            if (v4) {
                th_swiglu_back_kernel<true><<<nb, TH_CUDA_BLOCK, 0, stream>>>(pa, up, gate, dg, du, n, dg16, du16);
            } else {
                th_swiglu_back_kernel<false><<<nb, TH_CUDA_BLOCK, 0, stream>>>(pa, up, gate, dg, du, n, dg16, du16);
            }
        } else if (v4) {
            th_swiglu_back_kernel<true><<<nb, TH_CUDA_BLOCK, 0, stream>>>(pa, pb, px, dg, du, n, dg16, du16);
        } else {
            th_swiglu_back_kernel<false><<<nb, TH_CUDA_BLOCK, 0, stream>>>(pa, pb, px, dg, du, n, dg16, du16);
        }
        return;
    }
    if (vec4) {
        th_silu_back_mul_kernel<true><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(pa, pb, px, (float *) dst->data, n);
    } else {
        th_silu_back_mul_kernel<false><<<blocks, TH_CUDA_BLOCK, 0, stream>>>(pa, pb, px, (float *) dst->data, n);
    }
}

// the sum over a warp, in lane 0's order, given to every lane
static __device__ float th_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return __shfl_sync(0xffffffffu, v, 0);
}

// What th_rows_affine_kernel writes in each row: t g + b (AFFINE), t g (AFFINE without a bias: an
// RMSNorm's gain, forward and backward), or b (LINEAR_BIAS's plain path)
enum th_rows_form { TH_ROWS_AFFINE, TH_ROWS_GAIN, TH_ROWS_BIAS };

static __device__ __forceinline__ float th_rows_value(const th_rows_form form, const float ti, const float gi,
                                                      const float bi) {
    // rounded as ggml's MUL then ADD round: no fused multiply-add
    return form == TH_ROWS_AFFINE ? __fadd_rn(__fmul_rn(ti, gi), bi) : form == TH_ROWS_GAIN ? __fmul_rn(ti, gi) : bi;
}

// A norm's output t at i of row r (into tr; nullptr: not written, where nothing reads it), and
// where an AFFINE computes its norm (custom_ops.h) y = t g + b
// (t g without b) by th_rows_value beside it: into y (nullptr: not written, the copy alone) and its
// bf16 copy y16 (nullptr: none). g nullptr: t alone (the norm's own node).
struct th_norm_out {
    const float * g, * b;
    float * y;
    __nv_bfloat16 * y16;
};

static __device__ __forceinline__ void th_norm_put(float * __restrict__ tr, const th_norm_out & o, const int64_t r,
                                                   const int64_t n, const int64_t i, const float ti) {
    if (tr != nullptr) tr[i] = ti;
    if (o.g == nullptr) return;
    const float yi = o.b != nullptr ? th_rows_value(TH_ROWS_AFFINE, ti, o.g[i], o.b[i])
                                    : th_rows_value(TH_ROWS_GAIN, ti, o.g[i], 0.0f);
    th_put1(o.y, o.y16, r * n + i, yi);
}

// A row's sum over its n elements, as LayerNorm's kernels take their means: divided with
// round-to-nearest. ggml-cuda builds with -use_fast_math, where `/` is a reciprocal times the
// numerator that ptxas may fuse with what follows (x - s / n as one FFMA, the mean never rounded)
// in one kernel and not in another: the kernel that keeps a row in registers and the one that reads
// it from memory differed in the last bit at 384 and 768 wide. An exact quotient is the same value
// wherever it is taken (and at power-of-2 widths the reciprocal's, so the goldens keep their bits).
static __device__ __forceinline__ float th_row_mean(const float total, const int64_t n) {
    return __fdiv_rn(total, (float) n);
}

// element i of a row that is x, or x + b (a residual's sum, rounded as th_add_op rounds it) where b
// is given. Each pass forms the sum again rather than reading back what the first wrote: x and b
// are read through the read-only cache, which a kernel's own stores do not reach.
static __device__ __forceinline__ float th_row_at(const float * __restrict__ x, const float * __restrict__ b,
                                                  const int64_t i) {
    return b != nullptr ? x[i] + b[i] : x[i];
}

// a row's mean and 1 / sqrt(variance + eps), read from global memory twice. With b the row is
// x + b (th_row_at), also written into `sum` by the first pass: the moments of that sum.
static __device__ void th_row_moments(const float * __restrict__ x, const int64_t n, const float eps, float * mean,
                                      float * rstd, const float * __restrict__ b = nullptr, float * sum = nullptr) {
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += 32) {
        const float xi = th_row_at(x, b, i);
        if (b != nullptr) sum[i] = xi;
        s += xi;
    }
    const float m = th_row_mean(th_warp_sum(s), n);
    float v = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += 32) {
        const float c = th_row_at(x, b, i) - m;
        v += c * c;
    }
    *mean = m;
    *rstd = rsqrtf(th_row_mean(th_warp_sum(v), n) + eps);
}

// th_row_moments of the row whose lane elements (lane + 32 k) v holds: the same sums in the same order
template <int K>
static __device__ __forceinline__ void th_reg_moments(const float (&v)[K], const int64_t n, const float eps,
                                                      float * mean, float * rstd) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) s += v[k];
    const float m = th_row_mean(th_warp_sum(s), n);
    float var = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const float c = v[k] - m;
        var += c * c;
    }
    *mean = m;
    *rstd = rsqrtf(th_row_mean(th_warp_sum(var), n) + eps);
}

// the elements a lane holds of a row of n floats that the norms' kernels keep in registers (n =
// 32 K), or 0: read from memory on each pass (other widths)
static int th_norm_rows_k(const int64_t n) {
    return n == 384 || n == 512 || n == 768 || n == 1024 ? (int) (n / 32) : 0;
}

// body(i, k) for each element of a row of n that a lane takes: i = lane + 32 k, for k < K where
// the row is held in registers (n = 32 K: unrolled), else (K 0) while i < n
template <int K, class F>
static __device__ __forceinline__ void th_lane_elements(const int64_t n, F && body) {
    if constexpr (K > 0) {
#pragma unroll
        for (int k = 0; k < K; k++) body((int64_t) threadIdx.x + 32 * k, k);
    } else {
        for (int64_t i = threadIdx.x; i < n; i += 32) body(i, 0);
    }
}

// launch(std::integral_constant<int, K>) with K = th_norm_rows_k(n): the norm kernels' instance
// for n (0: the row read from memory on each pass)
template <class F>
static void th_norm_rows_dispatch(const int64_t n, F && launch) {
    switch (th_norm_rows_k(n)) {
        case 12: launch(std::integral_constant<int, 12>()); return;
        case 16: launch(std::integral_constant<int, 16>()); return;
        case 24: launch(std::integral_constant<int, 24>()); return;
        case 32: launch(std::integral_constant<int, 32>()); return;
        default: launch(std::integral_constant<int, 0>()); return;
    }
}

// rows of n floats: a warp a row, blockDim (32, 8). K > 0: n = 32 K, and a lane keeps its K
// elements of the row (x, or x + b) in registers, read once where K 0 reads them three times; the
// same arithmetic in the same order either way. o: an AFFINE's outputs beside t (th_norm_out);
// b: the rows are x + b (th_row_at), also written into `sum`.
template <int K = 0>
static __global__ void __launch_bounds__(256) th_layer_norm_kernel(const float * __restrict__ x, float * __restrict__ t,
                                                                   const int64_t n, const int64_t rows, const float eps,
                                                                   const th_norm_out o, const float * __restrict__ b,
                                                                   float * sum) {
    for (int64_t r = blockIdx.x * (int64_t) blockDim.y + threadIdx.y; r < rows; r += (int64_t) gridDim.x * blockDim.y) {
        const float * xr = x + r * n, * br = b != nullptr ? b + r * n : nullptr;
        float * sr = sum != nullptr ? sum + r * n : nullptr, * tr = t != nullptr ? t + r * n : nullptr;
        float v[K > 0 ? K : 1], mean, rstd;
        if constexpr (K > 0) {
            th_lane_elements<K>(n, [&](const int64_t i, const int k) {
                v[k] = th_row_at(xr, br, i);
                if (br != nullptr) sr[i] = v[k];
            });
            th_reg_moments<K>(v, n, eps, &mean, &rstd);
        } else {
            th_row_moments(xr, n, eps, &mean, &rstd, br, sr);
        }
        th_lane_elements<K>(n, [&](const int64_t i, const int k) {
            float xi;
            if constexpr (K > 0) xi = v[k];
            else xi = th_row_at(xr, br, i);
            th_norm_put(tr, o, r, n, i, (xi - mean) * rstd);
        });
    }
}

// LayerNorm's rows (x + b into `sum` where b is given) into t, and o beside it (th_norm_out)
static void th_layer_norm_rows(cudaStream_t stream, const float * x, float * t, const int64_t n, const int64_t rows,
                               const float eps, const th_norm_out & o, const float * b = nullptr, float * sum = nullptr) {
    const int grid = (int) ((rows + 7) / 8 < 65535 ? (rows + 7) / 8 : 65535);
    th_norm_rows_dispatch(n, [&](auto k) {
        th_layer_norm_kernel<decltype(k)::value><<<grid, dim3(32, 8), 0, stream>>>(x, t, n, rows, eps, o, b, sum);
    });
}

#define TH_COLUMN_ROWS 64   // rows a block of the column sums' first pass sums at least

// partial[chunk][c] = sum over the chunk's rows of a c: blockDim (32, 8), grid (columns / 32, chunks)
static __global__ void th_column_dot_kernel(const float * __restrict__ a, const float * __restrict__ c,
                                            float * __restrict__ partial, const int64_t n, const int64_t m,
                                            const int64_t chunk) {
    __shared__ float sums[8][33];
    const int64_t col = blockIdx.x * 32 + threadIdx.x, r0 = blockIdx.y * chunk;
    const int64_t r1 = r0 + chunk < m ? r0 + chunk : m;
    float s = 0.0f;
    if (col < n) {
        for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) s += __fmul_rn(a[r * n + col], c[r * n + col]);
    }
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
        float total = sums[0][threadIdx.x];
        for (int k = 1; k < 8; k++) total += sums[k][threadIdx.x];
        partial[blockIdx.y * n + col] = total;
    }
}

// out[c] = the sum over chunks of partial[chunk][c], in chunk order; with out2 (n more columns, a
// second sum's partials after the first's: partial + chunks n) out2[c] too, in the same launch
static __global__ void th_column_total_kernel(const float * __restrict__ partial, float * __restrict__ out,
                                              const int64_t n, const int chunks, float * __restrict__ out2 = nullptr) {
    int64_t col = blockIdx.x * (int64_t) blockDim.x + threadIdx.x;
    if (col >= (out2 != nullptr ? 2 * n : n)) return;
    if (col >= n) partial += (int64_t) chunks * n, out = out2, col -= n;
    float total = partial[col];
    for (int k = 1; k < chunks; k++) total += partial[k * n + col];
    out[col] = total;
}

// th_column_dot_kernel's chunks of m rows: enough blocks to fill the device, each at least
// TH_COLUMN_ROWS rows, at most 1024 chunks; returns how many, each of *chunk rows (the last fewer)
static int64_t th_column_chunks(const int64_t m, int64_t * chunk) {
    int64_t chunks = (m + TH_COLUMN_ROWS - 1) / TH_COLUMN_ROWS;
    chunks = chunks < 1024 ? chunks : 1024;
    *chunk = (m + chunks - 1) / chunks;
    return (m + *chunk - 1) / *chunk;
}
static int64_t th_column_chunk_count(const int64_t m) {
    int64_t chunk;
    return th_column_chunks(m, &chunk);
}

// dt = dy g when `gain` is given (rounded as ggml's MUL of them), else dy; plus r (a residual's
// gradient) when given, rounded as the ADD it stands for. K > 0: n = 32 K, and a lane keeps its K
// elements of x and dy, and of the gain (the same every row), in registers: each read once where
// K 0 reads x 4 times and dy twice; the same arithmetic in the same order either way.
// `sums` (the gain's gradient, th_fuse_gain_sums): block b takes chunk b of `chunk` rows and warp w
// its rows w, w + 8, ... of it in order, each lane adding t dy (__fmul_rn) of its columns to a sum
// from 0 (in registers where K > 0, else in the warp's row of shared memory, 8 n floats); the
// block then adds its 8 warps' sums in order into partial[b]: th_column_dot_kernel's sums of t and
// dy, each in its order, so the same bits (t is formed as the forward formed it).
// `bias` (with sums; the bias's gradient at bf16, th_layer_norm_bias_sums): each lane also adds
// its columns of dy to a second sum in the same order, into partial[chunks + b] (in shared
// memory, where K is 0, warp w's in row 8 + w).
template <bool gain, int K = 0, bool sums = false, bool bias = false>
static __global__ void __launch_bounds__(256) th_layer_norm_back_kernel(
    const float * __restrict__ dy, const float * __restrict__ x, const float * __restrict__ g,
    const float * __restrict__ r_add, float * __restrict__ dx, const int64_t n, const int64_t rows, const float eps,
    __nv_bfloat16 * __restrict__ dx16, float * __restrict__ partial, const int64_t chunk) {
    static_assert(sums || !bias, "the bias's sums go with the gain's");
    extern __shared__ float th_warp_columns[];      // (sums) 8 rows of n: warp w's sums in row w (bias's: 8 + w)
    float * const own = th_warp_columns + threadIdx.y * n;
    float * const own_b = th_warp_columns + (8 + threadIdx.y) * n;
    float gk[gain && K > 0 ? K : 1], acc[sums && K > 0 ? K : 1], acc_b[bias && K > 0 ? K : 1];
    if constexpr (gain && K > 0) th_lane_elements<K>(n, [&](const int64_t i, const int k) { gk[k] = g[i]; });
    if constexpr (sums) {
        th_lane_elements<K>(n, [&](const int64_t i, const int k) {
            if constexpr (K > 0) acc[k] = 0.0f;
            else own[i] = 0.0f;
            if constexpr (bias && K > 0) acc_b[k] = 0.0f;
            else if constexpr (bias) own_b[i] = 0.0f;
        });
    }
    const int64_t first = sums ? blockIdx.x * chunk : blockIdx.x * (int64_t) blockDim.y;
    const int64_t end = sums ? (first + chunk < rows ? first + chunk : rows) : rows;
    const int64_t step = sums ? (int64_t) blockDim.y : (int64_t) gridDim.x * blockDim.y;
    for (int64_t r = first + threadIdx.y; r < end; r += step) {
        const float * xr = x + r * n, * dyr = dy + r * n;
        float xv[K > 0 ? K : 1], dv[K > 0 ? K : 1], mean, rstd;
        if constexpr (K > 0) {
            th_lane_elements<K>(n, [&](const int64_t i, const int k) {
                xv[k] = xr[i];
                dv[k] = dyr[i];
            });
            th_reg_moments<K>(xv, n, eps, &mean, &rstd);
        } else {
            th_row_moments(xr, n, eps, &mean, &rstd);
        }
        // the lane's element i (its k-th): t, dy, and dt
        const auto t_at = [&](const int64_t i, const int k) {
            if constexpr (K > 0) return (xv[k] - mean) * rstd;
            else return (xr[i] - mean) * rstd;
        };
        const auto dy_at = [&](const int64_t i, const int k) {
            if constexpr (K > 0) return dv[k];
            else return dyr[i];
        };
        const auto dt_at = [&](const int64_t i, const int k) {
            if constexpr (K > 0) return gain ? __fmul_rn(dv[k], gk[gain ? k : 0]) : dv[k];
            else return gain ? __fmul_rn(dyr[i], g[i]) : dyr[i];
        };
        float sum_dt = 0.0f, sum_dt_t = 0.0f, sum_t = 0.0f;
        th_lane_elements<K>(n, [&](const int64_t i, const int k) {
            const float ti = t_at(i, k), dti = dt_at(i, k);
            sum_dt += dti;
            sum_dt_t += dti * ti;
            sum_t += ti;
            if constexpr (sums) {
                const float p = __fmul_rn(ti, dy_at(i, k));
                if constexpr (K > 0) acc[k] += p;
                else own[i] += p;
            }
            if constexpr (bias) {
                if constexpr (K > 0) acc_b[k] += dy_at(i, k);
                else own_b[i] += dy_at(i, k);
            }
        });
        const float mean_dt = th_row_mean(th_warp_sum(sum_dt), n), mean_dt_t = th_row_mean(th_warp_sum(sum_dt_t), n);
        const float shift = mean_dt - mean_dt_t * th_row_mean(th_warp_sum(sum_t), n);
        th_lane_elements<K>(n, [&](const int64_t i, const int k) {
            const float ti = t_at(i, k), dti = dt_at(i, k);
            const float dxi = rstd * (dti - ti * mean_dt_t - shift);
            const float out = r_add != nullptr ? __fadd_rn(dxi, r_add[r * n + i]) : dxi;
            if (dx != nullptr) dx[r * n + i] = out;
            if (dx16 != nullptr) dx16[r * n + i] = __float2bfloat16_rn(out);
        });
    }
    if constexpr (sums) {
        // the block's 8 warps' sums, added in warp order; the bias's after the gain's (where K > 0
        // through the same 8 rows of shared memory, once the gain's are read)
        const auto add_warps = [&](const float * rows8, float * out) {
            for (int64_t c = threadIdx.y * 32 + threadIdx.x; c < n; c += 256) {
                float total = rows8[c];
                for (int w = 1; w < 8; w++) total += rows8[w * n + c];
                out[c] = total;
            }
        };
        if constexpr (K > 0) th_lane_elements<K>(n, [&](const int64_t i, const int k) { own[i] = acc[k]; });
        __syncthreads();
        add_warps(th_warp_columns, partial + blockIdx.x * n);
        if constexpr (bias) {
            float * const bias_partial = partial + ((int64_t) gridDim.x + blockIdx.x) * n;
            if constexpr (K > 0) {
                __syncthreads();
                th_lane_elements<K>(n, [&](const int64_t i, const int k) { own[i] = acc_b[k]; });
                __syncthreads();
                add_warps(th_warp_columns, bias_partial);
            } else {
                add_warps(th_warp_columns + 8 * n, bias_partial);
            }
        }
    }
}

// the sums kernel's dynamic shared memory: 8 rows of n floats, 16 where the bias's are kept there
// too (K 0: up to 96 KiB, above the 48 KiB a launch gets by default, so that instance is allowed
// its most first)
template <int K, bool bias>
static size_t th_layer_norm_back_shared(const int64_t n) {
    if constexpr (bias && K == 0) {
        TH_SET_SMEM_LIMIT((th_layer_norm_back_kernel<true, 0, true, true>),
                          16 * (size_t) TH_GAIN_SUMS_MAX_COLUMNS * sizeof(float));
    }
    return (bias && K == 0 ? 16 : 8) * (size_t) n * sizeof(float);
}

// LayerNorm's backward over `rows` rows of n; with `column` (the gain's gradient, n floats) also
// the column sums of t dy, through `partial` (th_column_chunks' chunks x n floats): the first pass
// inside the backward's kernel, then th_column_total_kernel as th_column_dot runs it; with
// `bias_column` also dy's column sums (the bias's gradient), their chunks' partials after those
template <bool gain>
static void th_layer_norm_back_rows(cudaStream_t stream, const float * dy, const float * x, const float * g,
                                    const float * r, float * dx, const int64_t n, const int64_t rows, const float eps,
                                    __nv_bfloat16 * dx16, float * column = nullptr, float * partial = nullptr,
                                    float * bias_column = nullptr) {
    if constexpr (gain) {
        if (column != nullptr) {
            int64_t chunk;
            const int64_t chunks = th_column_chunks(rows, &chunk);
            th_norm_rows_dispatch(n, [&](auto k) {
                constexpr int K = decltype(k)::value;
                if (bias_column != nullptr) {
                    th_layer_norm_back_kernel<gain, K, true, true>
                        <<<(unsigned) chunks, dim3(32, 8), th_layer_norm_back_shared<K, true>(n), stream>>>(
                            dy, x, g, r, dx, n, rows, eps, dx16, partial, chunk);
                } else {
                    th_layer_norm_back_kernel<gain, K, true>
                        <<<(unsigned) chunks, dim3(32, 8), th_layer_norm_back_shared<K, false>(n), stream>>>(
                            dy, x, g, r, dx, n, rows, eps, dx16, partial, chunk);
                }
            });
            const int64_t columns = bias_column != nullptr ? 2 * n : n;
            th_column_total_kernel<<<(unsigned) ((columns + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK), TH_CUDA_BLOCK, 0,
                                     stream>>>(partial, column, n, (int) chunks, bias_column);
            return;
        }
    }
    const int grid = (int) ((rows + 7) / 8 < 65535 ? (rows + 7) / 8 : 65535);
    th_norm_rows_dispatch(n, [&](auto k) {
        th_layer_norm_back_kernel<gain, decltype(k)::value><<<grid, dim3(32, 8), 0, stream>>>(dy, x, g, r, dx, n, rows,
                                                                                            eps, dx16, nullptr, 0);
    });
}

static void th_layer_norm(cudaStream_t stream, ggml_tensor * dst, const bool backward) {
    const float eps = th_params_of<float>(dst);
    const int64_t n = dst->ne[0], rows = ggml_nrows(dst);
    if (backward) {
        const float * dy = (const float *) dst->src[0]->data, * x = (const float *) dst->src[1]->data;
        const float * r = dst->src[3] != nullptr ? (const float *) dst->src[3]->data : nullptr;
        __nv_bfloat16 * dx16 = nullptr;     // (at bf16 dx's copy beside it, or alone, where products read it)
        float * dx = th_writer_outputs(stream, dst, &dx16);
        if (dst->src[2] != nullptr) {     // (and the gain's gradient into src 4, th_fuse_gain_sums;
            float * column = dst->src[4] != nullptr ? (float *) dst->src[4]->data : nullptr;   // the bias's into
            float * partial = dst->src[4] != nullptr ? (float *) dst->src[5]->data : nullptr;  // src 6)
            float * bias_column = dst->src[6] != nullptr ? (float *) dst->src[6]->data : nullptr;
            th_layer_norm_back_rows<true>(stream, dy, x, (const float *) dst->src[2]->data, r, dx, n, rows, eps, dx16,
                                          column, partial, bias_column);
        } else {
            th_layer_norm_back_rows<false>(stream, dy, x, nullptr, r, dx, n, rows, eps, dx16);
        }
    } else {
        th_layer_norm_rows(stream, (const float *) dst->src[0]->data, (float *) dst->data, n, rows, eps, th_norm_out{});
    }
}

// RMS_NORM, y = x / sqrt(mean(x^2) + eps), with ggml-cuda's rms_norm_f32's bits: that kernel
// gives a row a block of B threads (256 where n < 1024, else 1024; thread t sums x[c]^2 over
// c = t, t + B, ... in order, each warp adds its lanes by xor shuffles, then warp 0 adds the B/32
// warps' sums the same way). Here a warp takes a row and lane l plays thread 32 w + l of each of
// ggml's B/32 warps w, so the sums are the same, in the same order: ggml's block of 256 for 384
// floats left most of its threads idle and took 36 us for nano llama's 16384 rows.
// WARPS: ggml's warps a row (B / 32). K > 0: n = 32 K, and a lane keeps its K elements (column
// lane + 32 k: ggml's warp k % WARPS, in the k / WARPS-th stride of its block) in registers, each
// read once; each warp's sum takes the same elements in the same order. o: an AFFINE's outputs
// beside y (th_norm_out); b: the rows are x + b (th_row_at), also written into `sum`.
template <int WARPS, int K = 0>
static __global__ void th_rms_norm_kernel(const float * __restrict__ x, float * __restrict__ y, const int n,
                                          const int64_t rows, const float eps, const th_norm_out o,
                                          const float * __restrict__ b, float * sum) {
    for (int64_t r = blockIdx.x * (int64_t) blockDim.y + threadIdx.y; r < rows; r += (int64_t) gridDim.x * blockDim.y) {
        const float * xr = x + r * n, * br = b != nullptr ? b + r * n : nullptr;
        float part[WARPS], v[K > 0 ? K : 1];
#pragma unroll
        for (int w = 0; w < WARPS; w++) part[w] = 0.0f;
        if constexpr (K > 0) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                v[k] = th_row_at(xr, br, threadIdx.x + 32 * k);
                if (b != nullptr) sum[r * n + threadIdx.x + 32 * k] = v[k];
                part[k % WARPS] += v[k] * v[k];              // as ggml writes it (the same contraction)
            }
        }
        for (int c0 = 0; K == 0 && c0 < n; c0 += 32 * WARPS) {
#pragma unroll
            for (int w = 0; w < WARPS; w++) {
                const int col = c0 + 32 * w + (int) threadIdx.x;
                if (col < n) {
                    const float xi = th_row_at(xr, br, col);
                    if (b != nullptr) sum[r * n + col] = xi;
                    part[w] += xi * xi;                      // as ggml writes it (the same contraction)
                }
            }
        }
        float tmp = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            for (int offset = 16; offset > 0; offset >>= 1) part[w] += __shfl_xor_sync(0xffffffffu, part[w], offset, 32);
            if ((int) threadIdx.x == w) tmp = part[w];       // lane w holds warp w's sum, 0 past the warps
        }
        for (int offset = 16; offset > 0; offset >>= 1) tmp += __shfl_xor_sync(0xffffffffu, tmp, offset, 32);
        const float mean = tmp / n;
        const float scale = rsqrtf(mean + eps);
        float * yr = y + r * n;
        if constexpr (K > 0) {
#pragma unroll
            for (int k = 0; k < K; k++) th_norm_put(yr, o, r, n, threadIdx.x + 32 * k, scale * v[k]);
        } else {
            for (int col = threadIdx.x; col < n; col += 32) th_norm_put(yr, o, r, n, col, scale * th_row_at(xr, br, col));
        }
    }
}

// RMS_NORM of x (x + b into `sum` where b is given) into t (o: an AFFINE's outputs beside it, th_norm_out)
static void th_rms_norm_rows(cudaStream_t stream, const float * x, float * t, const int n, const int64_t rows,
                             const float eps, const th_norm_out & o, const float * b = nullptr, float * sum = nullptr) {
    const dim3 block(32, 8);
    const int grid = (int) ((rows + 7) / 8 < 65535 ? (rows + 7) / 8 : 65535);
    th_norm_rows_dispatch(n, [&](auto k) {
        constexpr int K = decltype(k)::value;
        if constexpr (K > 0) {                      // (ggml's block of 1024 threads from 1024 wide)
            th_rms_norm_kernel<K < 32 ? 8 : 32, K><<<grid, block, 0, stream>>>(x, t, n, rows, eps, o, b, sum);
        } else if (n < 1024) {
            th_rms_norm_kernel<8><<<grid, block, 0, stream>>>(x, t, n, rows, eps, o, b, sum);
        } else {
            th_rms_norm_kernel<32><<<grid, block, 0, stream>>>(x, t, n, rows, eps, o, b, sum);
        }
    });
}

static void th_rms_norm(cudaStream_t stream, ggml_tensor * dst) {
    th_rms_norm_rows(stream, (const float *) dst->src[0]->data, (float *) dst->data, (int) dst->ne[0], ggml_nrows(dst),
                     th_params_of<float>(dst), th_norm_out{});
}

// ROPE and ROPE_BACK (modes normal and neox, no offset): ggml-cuda's rope_norm and rope_neox give
// a row (one head at one position) a block of 256 threads over its pairs, and a head of 64 floats
// has 32: 7/8 of the threads idle (42 us for nano llama's 16384 x 6 heads of q). Here a thread
// takes a pair and a warp 32 adjacent pairs of consecutive rows; each pair is rotated by ggml's
// formula, written as there, so the bits are ggml's. Without YaRN's extrapolation (ext_factor 0,
// the rewrite marks no other): toyharness refuses YaRN files (architectures/spec.py).
// (y16: y's bf16 copy beside it (th_map_kernel's) or nullptr; y nullptr: the copy alone)
static __device__ __forceinline__ void th_put_pair(float * y, __nv_bfloat16 * y16, const int64_t a, const float va,
                                                   const int64_t b, const float vb) {
    if (y != nullptr) {
        y[a] = va;
        y[b] = vb;
    }
    if (y16 != nullptr) {
        y16[a] = __float2bfloat16_rn(va);
        y16[b] = __float2bfloat16_rn(vb);
    }
}

template <bool forward, bool neox>
static __global__ void th_rope_kernel(const float * __restrict__ x, float * __restrict__ y, const int ne00,
                                      const int ne01, const int ne02, const int64_t pairs, const int n_dims,
                                      const int32_t * __restrict__ pos, const float freq_scale,
                                      const float attn_factor, const float theta_scale, const float * __restrict__ ff,
                                      __nv_bfloat16 * __restrict__ y16) {
    const int64_t k = blockIdx.x * (int64_t) blockDim.x + threadIdx.x;
    if (k >= pairs) return;
    const int64_t row = k / (ne00 / 2);
    const int i0 = 2 * (int) (k % (ne00 / 2));
    const float * xr = x + row * ne00;
    if (i0 >= n_dims) {                                  // past the rotated dims: copied
        th_put_pair(y, y16, row * ne00 + i0, xr[i0], row * ne00 + i0 + 1, xr[i0 + 1]);
        return;
    }
    const int i2 = (int) ((row / ne01) % ne02);          // the position
    const float theta_base = pos[i2] * powf(theta_scale, i0 / 2.0f);
    const float theta_extrap = ff != nullptr ? theta_base / ff[i0 / 2] : theta_base;
    const float theta = freq_scale * theta_extrap;
    const float cos_theta = cosf(theta) * attn_factor;
    float sin_theta = sinf(theta) * attn_factor;
    if (!forward) sin_theta *= -1.0f;
    const int a = neox ? i0 / 2 : i0, b = neox ? i0 / 2 + n_dims / 2 : i0 + 1;
    const float x0 = xr[a], x1 = xr[b];
    th_put_pair(y, y16, row * ne00 + a, x0 * cos_theta - x1 * sin_theta, row * ne00 + b, x0 * sin_theta + x1 * cos_theta);
}

static void th_rope(cudaStream_t stream, ggml_tensor * dst) {
    const th_rope_params p = th_params_of<th_rope_params>(dst);
    const ggml_tensor * x = dst->src[0];
    const float theta_scale = powf(p.freq_base, -2.0f / p.n_dims);     // as ggml-cuda's host code
    const int64_t pairs = ggml_nelements(x) / 2;
    const int block = 256;
    const unsigned grid = (unsigned) ((pairs + block - 1) / block);
    const float * ff = dst->src[2] != nullptr ? (const float *) dst->src[2]->data : nullptr;
    const bool neox = p.mode == GGML_ROPE_TYPE_NEOX;
    __nv_bfloat16 * y16 = nullptr;         // (at bf16 the backward's copy, or alone, for q's and k's products)
    float * y = th_writer_outputs(stream, dst, &y16);
#define TH_ROPE_LAUNCH(F, N)                                                                                      \
    th_rope_kernel<F, N><<<grid, block, 0, stream>>>((const float *) x->data, y, (int) x->ne[0], (int) x->ne[1],   \
                                                     (int) x->ne[2], pairs, p.n_dims,                              \
                                                     (const int32_t *) dst->src[1]->data, p.freq_scale,            \
                                                     p.attn_factor, theta_scale, ff, y16)
    if (p.forward && neox) TH_ROPE_LAUNCH(true, true);
    else if (p.forward) TH_ROPE_LAUNCH(true, false);
    else if (neox) TH_ROPE_LAUNCH(false, true);
    else TH_ROPE_LAUNCH(false, false);
#undef TH_ROPE_LAUNCH
}

// y (n, m) by `form` (above): a warp a row, blockDim (32, 8); float4 at a time when `vec4` (n a
// multiple of 4, every pointer given 16-aligned). ggml's broadcasting MUL took 41 us for a gain
// over nano llama's 16384 x 384 rows, this 13 us.
// With y16 (copy16) each value also as bf16 rounded to nearest even (th_map_kernel's copy); y
// nullptr: the copy alone.
template <th_rows_form form, bool vec4, bool copy16 = false>
static __global__ void th_rows_affine_kernel(const float * __restrict__ t, const float * __restrict__ g,
                                             const float * __restrict__ b, float * __restrict__ y, const int64_t n,
                                             const int64_t m, __nv_bfloat16 * __restrict__ y16 = nullptr) {
    for (int64_t r = blockIdx.x * (int64_t) blockDim.y + threadIdx.y; r < m; r += (int64_t) gridDim.x * blockDim.y) {
        if (vec4) {
            const float4 * t4 = (const float4 *) (t + r * n), * g4 = (const float4 *) g, * b4 = (const float4 *) b;
            float4 * y4 = y != nullptr ? (float4 *) (y + r * n) : nullptr;
            for (int64_t i = threadIdx.x; i < n / 4; i += 32) {
                const float4 ti = form != TH_ROWS_BIAS ? t4[i] : float4{}, gi = form != TH_ROWS_BIAS ? g4[i] : float4{};
                const float4 bi = form != TH_ROWS_GAIN ? b4[i] : float4{};
                const float4 yi = make_float4(th_rows_value(form, ti.x, gi.x, bi.x), th_rows_value(form, ti.y, gi.y, bi.y),
                                              th_rows_value(form, ti.z, gi.z, bi.z), th_rows_value(form, ti.w, gi.w, bi.w));
                if (y != nullptr) y4[i] = yi;
                if (copy16) th_store_bf16x4(y16 + r * n + 4 * i, yi);
            }
        } else {
            for (int64_t i = threadIdx.x; i < n; i += 32) {
                const float yi = th_rows_value(form, form != TH_ROWS_BIAS ? t[r * n + i] : 0.0f,
                                               form != TH_ROWS_BIAS ? g[i] : 0.0f, form != TH_ROWS_GAIN ? b[i] : 0.0f);
                if (y != nullptr) y[r * n + i] = yi;
                if (copy16) y16[r * n + i] = __float2bfloat16_rn(yi);
            }
        }
    }
}

#define TH_ROWS_BACK_IDS 512    // ids staged at a time
#define TH_ROWS_BACK_DEPTH 32   // rows a warp has in flight

// a thread an output element (v, col), blockDim (32 columns, 8 rows v): a warp is one row v. The
// block stages the ids in shared memory; a warp compares 32 of them at once (a lane each), lists
// the ids of a staged chunk that are v, in order, then copies up to TH_ROWS_BACK_DEPTH of those
// rows at once (cp.async) and adds them in that order, as ggml's kernel does (the same bits): the
// sum is a chain, its loads are not. Summing each row as it was found took 1.08 ms of a nano llama
// step (ggml's threads each read every id from memory: more before): one byte of text, the space,
// is ~15% of the ids, so its warp waited for ~2,500 loads in a row (ptxas keeps only ~5 plain
// loads of an unrolled loop in flight, hence the copies).
static __global__ void th_get_rows_back_kernel(const float * __restrict__ grad, const int32_t * __restrict__ ids,
                                               float * __restrict__ dst, const int64_t n, const int64_t R,
                                               const int64_t V) {
    __shared__ int32_t staged[TH_ROWS_BACK_IDS];
    __shared__ int16_t found[8][TH_ROWS_BACK_IDS];                   // a warp's list: places in the chunk
    __shared__ float rows[8][TH_ROWS_BACK_DEPTH][32];                // a warp's rows in flight, its 32 columns
    const int64_t col = blockIdx.x * 32 + threadIdx.x, v = (int64_t) blockIdx.y * blockDim.y + threadIdx.y;
    const int thread = threadIdx.y * 32 + threadIdx.x;
    const unsigned below = (1u << threadIdx.x) - 1u;                 // the lanes before this one
    int16_t * list = found[threadIdx.y];
    float (*mine)[32] = rows[threadIdx.y];
    float sum = 0.0f;
    for (int64_t base = 0; base < R; base += TH_ROWS_BACK_IDS) {
        __syncthreads();
        for (int j = thread; j < TH_ROWS_BACK_IDS && base + j < R; j += 32 * 8) staged[j] = ids[base + j];
        __syncthreads();
        const int count = R - base < TH_ROWS_BACK_IDS ? (int) (R - base) : TH_ROWS_BACK_IDS;
        if (v >= V) continue;                                        // the same for the whole warp
        int hits = 0;
        for (int j0 = 0; j0 < count; j0 += 32) {
            const int j = j0 + (int) threadIdx.x;
            const bool hit = j < count && staged[j] == v;
            const unsigned ballot = __ballot_sync(0xffffffffu, hit);
            if (hit) list[hits + __popc(ballot & below)] = (int16_t) j;
            hits += __popc(ballot);
        }
        __syncwarp();
        for (int i = 0; i < hits; i += TH_ROWS_BACK_DEPTH) {
            const int m = hits - i < TH_ROWS_BACK_DEPTH ? hits - i : TH_ROWS_BACK_DEPTH;
            for (int u = 0; u < m; u++) {                            // a lane copies (and later reads) its own column
                th_cp_async<4>(&mine[u][threadIdx.x], grad + (base + list[i + u]) * n + (col < n ? col : 0), col < n);
            }
            th_cp_commit();
            th_cp_wait();
            for (int u = 0; u < m; u++) sum += mine[u][threadIdx.x];
        }
    }
    if (col < n && v < V) dst[v * n + col] = sum;
}

static void th_get_rows_back(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * grad = dst->src[0];
    const int64_t n = dst->ne[0], V = dst->ne[1], R = grad->ne[1];
    const dim3 block(32, 8);
    const dim3 grid((unsigned) ((n + 31) / 32), (unsigned) ((V + block.y - 1) / block.y));
    th_get_rows_back_kernel<<<grid, block, 0, stream>>>((const float *) grad->data, (const int32_t *) dst->src[1]->data,
                                                        (float *) dst->data, n, R, V);
}

// GET_ROWS_BACK of distinct ids (SCATTER_ROWS): dst zeroed, then a thread an element of grad,
// written to its id's row as 0 + g, the sum ggml's kernel forms for an id found once (__fadd_rn:
// not folded away, so a -0 gradient becomes +0 there too)
static __global__ void th_scatter_rows_kernel(const float * __restrict__ grad, const int32_t * __restrict__ ids,
                                              float * __restrict__ dst, const int64_t n, const int64_t R) {
    for (int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; i < n * R; i += (int64_t) gridDim.x * blockDim.x) {
        const int64_t r = i / n;
        dst[(int64_t) ids[r] * n + (i - r * n)] = __fadd_rn(0.0f, grad[i]);
    }
}

static void th_scatter_rows(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * grad = dst->src[0];
    const int64_t n = dst->ne[0], R = grad->ne[1];
    cudaMemsetAsync(dst->data, 0, ggml_nbytes(dst), stream);
    const int64_t blocks = (n * R + 255) / 256;
    th_scatter_rows_kernel<<<(unsigned) (blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(
        (const float *) grad->data, (const int32_t *) dst->src[1]->data, (float *) dst->data, n, R);
}

template <th_rows_form form>
static void th_rows_affine_launch(cudaStream_t stream, const float * t, const float * g, const float * b, float * y,
                                  const int64_t n, const int64_t m, __nv_bfloat16 * y16) {
    const dim3 block(32, 8);
    const int grid = (int) ((m + 7) / 8 < 65535 ? (m + 7) / 8 : 65535);
    const bool vec4 = n % 4 == 0 && th_aligned16(y) && (form == TH_ROWS_BIAS || (th_aligned16(t) && th_aligned16(g))) &&
                      (form == TH_ROWS_GAIN || th_aligned16(b));
    if (y16 != nullptr && vec4) th_rows_affine_kernel<form, true, true><<<grid, block, 0, stream>>>(t, g, b, y, n, m, y16);
    else if (y16 != nullptr) th_rows_affine_kernel<form, false, true><<<grid, block, 0, stream>>>(t, g, b, y, n, m, y16);
    else if (vec4) th_rows_affine_kernel<form, true><<<grid, block, 0, stream>>>(t, g, b, y, n, m);
    else th_rows_affine_kernel<form, false><<<grid, block, 0, stream>>>(t, g, b, y, n, m);
}

// y = t g + b, t g where no b, b where no t; y16: y's bf16 copy to write beside it, or nullptr
static void th_rows_affine(cudaStream_t stream, const float * t, const float * g, const float * b, float * y,
                           const int64_t n, const int64_t m, __nv_bfloat16 * y16 = nullptr) {
    if (t == nullptr) th_rows_affine_launch<TH_ROWS_BIAS>(stream, t, g, b, y, n, m, nullptr);
    else if (b == nullptr) th_rows_affine_launch<TH_ROWS_GAIN>(stream, t, g, b, y, n, m, y16);
    else th_rows_affine_launch<TH_ROWS_AFFINE>(stream, t, g, b, y, n, m, y16);
}

static void th_affine(cudaStream_t stream, ggml_tensor * dst) {     // (at bf16 a norm's output's copy beside it,
    __nv_bfloat16 * y16 = nullptr;                                   // or alone)
    float * y = th_writer_outputs(stream, dst, &y16);
    if (dst->src[3] != nullptr) {              // the norm too, t into its room (and its input, the sum
        const th_norm_affine_params p = th_params_of<th_norm_affine_params>(dst);     // of srcs 4 and 5)
        float * sum = p.add ? (float *) dst->src[3]->data : nullptr;
        const float * x = (const float *) dst->src[p.add ? 4 : 3]->data;
        const float * b = p.add ? (const float *) dst->src[5]->data : nullptr;
        float * t = p.unread ? nullptr : (float *) dst->src[0]->data;     // (read by nothing else)
        const th_norm_out o = {(const float *) dst->src[1]->data,
                               dst->src[2] != nullptr ? (const float *) dst->src[2]->data : nullptr, y, y16};
        const int64_t n = dst->ne[0], rows = ggml_nrows(dst);
        if (p.norm == TH_CUDA_RMS_NORM) {
            th_rms_norm_rows(stream, x, t, (int) n, rows, p.eps, o, b, sum);
        } else {
            th_layer_norm_rows(stream, x, t, n, rows, p.eps, o, b, sum);
        }
        return;
    }
    th_rows_affine(stream, (const float *) dst->src[0]->data, (const float *) dst->src[1]->data,
                   dst->src[2] != nullptr ? (const float *) dst->src[2]->data : nullptr, y, dst->ne[0],
                   ggml_nrows(dst), y16);
}

static void th_column_dot(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * a = dst->src[0];
    const int64_t n = a->ne[0], m = ggml_nrows(a);
    int64_t chunk;
    const int64_t chunks = th_column_chunks(m, &chunk);
    float * partial = (float *) dst->src[2]->data;      // chunks * n <= m * n floats
    th_column_dot_kernel<<<dim3((unsigned) ((n + 31) / 32), (unsigned) chunks), dim3(32, 8), 0, stream>>>(
        (const float *) a->data, (const float *) dst->src[1]->data, partial, n, m, chunk);
    th_column_total_kernel<<<(unsigned) ((n + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK), TH_CUDA_BLOCK, 0, stream>>>(
        partial, (float *) dst->data, n, (int) chunks);
}

// OUT_PROD(a, b) of 2-D operands (dst's rows, contiguous) added into dst (beta 1) or written
// (beta 0): ggml-cuda's call
static bool th_out_prod_into(cublasHandle_t cublas, const ggml_tensor * a, const ggml_tensor * b, ggml_tensor * dst,
                             const float beta) {
    const bool b_t = ggml_is_transposed(b);
    const float one = 1.0f;
    return th_cublas_sgemm(cublas, CUBLAS_OP_N, b_t ? CUBLAS_OP_N : CUBLAS_OP_T, (int) dst->ne[0], (int) ggml_nrows(dst),
                           (int) a->ne[1], &one, (const float *) a->data, (int) (a->nb[1] / sizeof(float)),
                           (const float *) b->data, (int) ((b_t ? b->nb[0] : b->nb[1]) / sizeof(float)), &beta,
                           (float *) dst->data, (int) dst->ne[0]) == CUBLAS_STATUS_SUCCESS;
}

// each pair (a, b) of sources one product: f32 a (ggml's OUT_PROD) or a frozen weight a at bf16
// (th-frozen.cu), the first written, the others added into the sum so far
static bool th_product_sum(cublasHandle_t cublas, ggml_tensor * dst) {
    for (int k = 0; k + 1 < GGML_MAX_SRC && dst->src[k] != nullptr; k += 2) {
        const ggml_tensor * a = dst->src[k], * b = dst->src[k + 1];
        const float beta = k == 0 ? 0.0f : 1.0f;
        if (!(a->type == GGML_TYPE_F32 ? th_out_prod_into(cublas, a, b, dst, beta)
                                       : th_frozen_out_prod_into(cublas, a, b, dst, beta))) {
            return false;
        }
    }
    return true;
}

static bool th_product_sum_supported(const ggml_tensor * op) {
    if (!th_f32_contiguous(op) || op->src[0] == nullptr || op->ne[0] > INT32_MAX || ggml_nrows(op) > INT32_MAX) {
        return false;
    }
    for (int k = 0; k + 1 < GGML_MAX_SRC && op->src[k] != nullptr; k += 2) {
        const ggml_tensor * a = op->src[k], * b = op->src[k + 1];
        if (b != nullptr && a->type != GGML_TYPE_F32) {      // a frozen weight's term: bf16 only
            ggml_tensor term = *op;          // the product's own 2-D shape (the sum may be 3-D: reshapes)
            term.src[0] = (ggml_tensor *) a, term.src[1] = (ggml_tensor *) b;
            term.ne[1] = ggml_nrows(op), term.ne[2] = term.ne[3] = 1;
            term.nb[2] = term.nb[3] = term.nb[1] * term.ne[1];
            if (!th_frozen_supported(&term, TH_CUDA_FROZEN_OUT_PROD)) return false;
            continue;
        }
        if (b == nullptr || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || a->nb[0] != sizeof(float) ||
            a->ne[2] * a->ne[3] != 1 || b->ne[2] * b->ne[3] != 1 || a->ne[0] != op->ne[0] || b->ne[0] != ggml_nrows(op) ||
            a->ne[1] != b->ne[1] || a->ne[1] > INT32_MAX ||
            (ggml_is_transposed(b) ? b->nb[1] : b->nb[0]) != sizeof(float)) {
            return false;
        }
    }
    return true;
}

// LINEAR_BIAS through cuBLASLt: y = x w^T with b added in the product's epilogue (acc + b rounded
// once, as the ADD after ggml's MUL_MAT rounds it). The descriptors and the algorithm cuBLASLt's
// heuristic picks are kept a (device, shape), found or not (a step asks for the same few shapes
// each time, and the answer depends on nothing else): the same shape takes the same path, so the
// same bits, whatever ran before in the process. Operands are declared 16-byte aligned (ggml-cuda
// places tensors 128 bytes apart; a view that is not takes the plain path), no workspace and no
// reduction scheme: k is never split. ggml's cuBLAS handle is a cuBLASLt handle too (cuBLAS's
// documentation). A plan is also the precision's (th-precision.cuh): its compute type, and at bf16
// its operands' type: the bf16 copies of w and x (packed) that the bf16 products use, fp32 out and
// b fp32, where before bf16 took the plain path (the fill and the beta-1 product: 0.45 + ~0.9 ms
// of a nano gpt2 step). A bf16 dst (a GELU's or attention's input, th_gelu_bf16 and
// th_attention_inputs_bf16): bf16 out, and b's bf16 copy
// (cuBLASLt's bias has the output's type; bf16 autocast casts the bias so too).
struct th_lt_bias_plan {
    int device, precision;
    bool out_bf16;
    int64_t n, m, k, lda, ldb;
    bool found;                                  // cuBLASLt has an algorithm for it
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};

static std::mutex th_lt_mutex;
static std::vector<th_lt_bias_plan *> th_lt_plans;      // kept for the process (a few a model)
static int64_t th_lt_bias_calls[2];                      // LINEAR_BIAS computed by: cuBLASLt, the plain path

extern "C" __attribute__((visibility("default"))) void th_cuda_linear_bias_calls(int64_t * lt, int64_t * plain) {
    std::lock_guard<std::mutex> lock(th_lt_mutex);
    *lt = th_lt_bias_calls[0], *plain = th_lt_bias_calls[1];
}

static th_lt_bias_plan * th_lt_bias_plan_for(cublasLtHandle_t lt, const int64_t n, const int64_t m, const int64_t k,
                                             const int64_t lda, const int64_t ldb, const bool out_bf16) {
    int device = 0;
    cudaGetDevice(&device);
    const int precision = th_cuda_precision_now();
    for (th_lt_bias_plan * p : th_lt_plans) {
        if (p->device == device && p->precision == precision && p->out_bf16 == out_bf16 && p->n == n && p->m == m &&
            p->k == k && p->lda == lda && p->ldb == ldb) {
            return p;
        }
    }
    th_lt_bias_plan * p = new th_lt_bias_plan{device,  precision, out_bf16, n,       m,       k,      lda,
                                              ldb,     false,     nullptr,  nullptr, nullptr, nullptr, {}};
    const cublasComputeType_t compute = precision == TH_PRECISION_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const size_t no_workspace = 0;
    const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE, aligned = 16;
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulHeuristicResult_t found = {};
    int count = 0;
    bool ok = cublasLtMatmulDescCreate(&p->op, compute, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)) ==
                   CUBLAS_STATUS_SUCCESS;
    const cudaDataType operands = precision == TH_PRECISION_BF16 ? CUDA_R_16BF : CUDA_R_32F;     // the copies at bf16
    ok = ok && cublasLtMatrixLayoutCreate(&p->a, operands, (uint64_t) k, (uint64_t) n, lda) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatrixLayoutCreate(&p->b, operands, (uint64_t) k, (uint64_t) m, ldb) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatrixLayoutCreate(&p->c, out_bf16 ? CUDA_R_16BF : CUDA_R_32F, (uint64_t) n, (uint64_t) m, n) ==
                   CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS;
    const cublasLtMatmulPreferenceAttributes_t alignments[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (const cublasLtMatmulPreferenceAttributes_t attr : alignments) {
        ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, attr, &aligned, sizeof(aligned)) == CUBLAS_STATUS_SUCCESS;
    }
    ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace,
                                                    sizeof(no_workspace)) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_reduction,
                                                    sizeof(no_reduction)) == CUBLAS_STATUS_SUCCESS;
    ok = ok && cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &found, &count) ==
                   CUBLAS_STATUS_SUCCESS && count > 0;
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (ok) {
        p->found = true, p->algo = found.algo;
    } else {                                     // remembered as the plain path's
        if (p->op != nullptr) cublasLtMatmulDescDestroy(p->op);
        for (cublasLtMatrixLayout_t l : {p->a, p->b, p->c}) {
            if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
        }
        p->op = nullptr, p->a = p->b = p->c = nullptr;
    }
    th_lt_plans.push_back(p);
    return p;
}

static bool th_linear_bias(cudaStream_t stream, cublasHandle_t cublas, ggml_tensor * dst) {
    const ggml_tensor * w = dst->src[0], * x = dst->src[1], * b = dst->src[2];
    const int64_t n = dst->ne[0], m = ggml_nrows(dst), k = w->ne[0];
    const int64_t lda = (int64_t) (w->nb[1] / sizeof(float)), ldb = (int64_t) (x->nb[1] / sizeof(float));
    const float one = 1.0f, zero = 0.0f;
    const bool out_bf16 = dst->type == GGML_TYPE_BF16;      // kept bf16 (th_gelu_bf16, th_attention_inputs_bf16)
    {
        std::lock_guard<std::mutex> lock(th_lt_mutex);      // the plans, and the bias pointer set on one
        const bool bf16 = th_cuda_precision_now() == TH_PRECISION_BF16;     // operands: their bf16 copies
        // (a bf16 dst adds b's bf16 copy, 256-byte aligned as every copy, so b's own place does not matter)
        if ((out_bf16 || th_aligned16(b->data)) && th_aligned16(dst->data) &&
            (bf16 || (th_aligned16(w->data) && th_aligned16(x->data)))) {
            const cublasLtHandle_t lt = (cublasLtHandle_t) cublas;
            th_lt_bias_plan * p = th_lt_bias_plan_for(lt, n, m, k, bf16 ? k : lda, bf16 ? k : ldb, out_bf16);
            const void * bias = b->data, * wa = w->data, * xa = x->data;
            if (p->found && (!bf16 || th_bf16_operands(stream, (const float *) w->data, 0, (int) k, (int) n, (int) lda,
                                                       (const float *) x->data, 0, (int) k, (int) m, (int) ldb, 1, &wa,
                                                       &xa, out_bf16 ? (const float *) b->data : nullptr, (int) n,
                                                       out_bf16 ? &bias : nullptr)) &&
                cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)) ==
                    CUBLAS_STATUS_SUCCESS &&
                cublasLtMatmul(lt, p->op, &one, wa, p->a, xa, p->b, &zero, dst->data, p->c, dst->data, p->c,
                               &p->algo, nullptr, 0, stream) == CUBLAS_STATUS_SUCCESS) {
                th_lt_bias_calls[0]++;
                return true;
            }
        }
        th_lt_bias_calls[1]++;
    }
    // bf16 out has no plain path: cuBLASLt had no algorithm for the shape (none such met on sm_90),
    // so the node is not computed and ggml-cuda stops, naming it
    if (out_bf16) return false;
    // the plain path: b in every row, then cuBLAS adds the product to it (beta 1: the call ggml's
    // MUL_MAT makes), y written, read and written again
    th_rows_affine(stream, nullptr, nullptr, (const float *) b->data, (float *) dst->data, n, m);
    return th_cublas_sgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int) n, (int) m, (int) k, &one,
                           (const float *) w->data, (int) lda, (const float *) x->data, (int) ldb, &one,
                           (float *) dst->data, (int) n) == CUBLAS_STATUS_SUCCESS;
}

// rows of ne[0] floats (the source's nb[0] is a float): a warp a row, blockDim (32, 8); with y16
// each value also as bf16 rounded to nearest even (th_map_kernel's copy), dst nullptr: the copy
// alone
static __global__ void th_cont_rows_kernel(const char * __restrict__ src, float * __restrict__ dst,
                                           __nv_bfloat16 * __restrict__ y16, const int64_t ne0, const int64_t ne1,
                                           const int64_t ne2, const int64_t ne3, const int64_t nb1, const int64_t nb2,
                                           const int64_t nb3) {
    const int64_t rows = ne1 * ne2 * ne3;
    for (int64_t r = blockIdx.x * (int64_t) blockDim.y + threadIdx.y; r < rows; r += (int64_t) gridDim.x * blockDim.y) {
        const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
        const float * s = (const float *) (src + i1 * nb1 + i2 * nb2 + i3 * nb3);
        for (int64_t i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            th_put1(dst, y16, r * ne0 + i0, s[i0]);
        }
    }
}

// The same, a float4 a thread (ne0 a multiple of 4, the source's rows and both pointers 16-byte
// aligned), a grid-stride loop over the whole: a warp a row of 64 floats (a head) moved 2 scalar
// floats a thread, 26 us for gpt2-small's attention output on the H200 (1.9 TB/s)
static __global__ void th_cont_rows4_kernel(const char * __restrict__ src, float * __restrict__ dst,
                                            __nv_bfloat16 * __restrict__ y16, const int64_t ne0, const int64_t ne1,
                                            const int64_t ne2, const int64_t ne3, const int64_t nb1, const int64_t nb2,
                                            const int64_t nb3) {
    const int64_t per_row = ne0 / 4, n = per_row * ne1 * ne2 * ne3, step = (int64_t) gridDim.x * blockDim.x;
    for (int64_t e = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; e < n; e += step) {
        const int64_t r = e / per_row, i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
        const float4 v = ((const float4 *) (src + i1 * nb1 + i2 * nb2 + i3 * nb3))[e % per_row];
        th_put4(dst, y16, e, v);
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

// dst = a copy of the f32 elements `src` (ne, nb, data) describes, in dst's order. Rows along
// axis 0 (an attention's output, heads into rows) also write dst's bf16 copy at bf16 where
// products read it (th_writer_outputs: beside dst, or alone)
static void th_cont_of(cudaStream_t stream, const ggml_tensor * src, ggml_tensor * dst) {
    const int c = th_cont_axis(src);
    const dim3 block(32, 8);
    if (c == 0) {
        __nv_bfloat16 * y16 = nullptr;
        float * y = th_writer_outputs(stream, dst, &y16);
        const char * from = (const char *) src->data;
        const int64_t ne0 = src->ne[0], ne1 = src->ne[1], ne2 = src->ne[2], ne3 = src->ne[3];
        const int64_t nb1 = (int64_t) src->nb[1], nb2 = (int64_t) src->nb[2], nb3 = (int64_t) src->nb[3];
        if (ne0 % 4 == 0 && nb1 % 16 == 0 && nb2 % 16 == 0 && nb3 % 16 == 0 && th_aligned16(from) &&
            th_aligned16(dst->data)) {
            const int64_t wanted = (ggml_nelements(dst) / 4 + TH_CUDA_BLOCK - 1) / TH_CUDA_BLOCK;
            const int grid = (int) (wanted < 65535 ? wanted : 65535);
            th_cont_rows4_kernel<<<grid, TH_CUDA_BLOCK, 0, stream>>>(from, y, y16, ne0, ne1, ne2, ne3, nb1, nb2, nb3);
            return;
        }
        const int64_t rows = ne1 * ne2 * ne3;
        const int grid = (int) ((rows + 7) / 8 < 65535 ? (rows + 7) / 8 : 65535);
        th_cont_rows_kernel<<<grid, block, 0, stream>>>(from, y, y16, ne0, ne1, ne2, ne3, nb1, nb2, nb3);
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

// CONT of a view of a SLICE, from the sliced node (custom_ops.h, TH_CUDA_SLICE_CONT): the view
// as it lies there, described to the copy by its strides and start
static ggml_tensor th_slice_cont_source(const ggml_tensor * dst) {
    const th_slice_cont_params p = th_params_of<th_slice_cont_params>(dst);
    ggml_tensor view = *dst->src[0];
    view.data = (float *) dst->src[0]->data + p.offset;
    for (int i = 0; i < 4; i++) {
        view.ne[i] = dst->ne[i];
        view.nb[i] = (size_t) p.nb[i];
    }
    return view;
}

// an AFFINE that computes its norm (src 3 its input), and that input as the sum of srcs 4 and 5
// where `add` (custom_ops.h)
static bool th_norm_affine_supported(const ggml_tensor * op) {
    const th_norm_affine_params p = th_params_of<th_norm_affine_params>(op);
    const ggml_tensor * x = op->src[3];
    bool ok = th_f32_contiguous(x) && ggml_nelements(x) == ggml_nelements(op) && x->ne[0] == op->ne[0] &&
              op->ne[0] <= INT32_MAX && (p.norm == TH_CUDA_LAYER_NORM || p.norm == TH_CUDA_RMS_NORM);
    for (int j = 4; j < 6; j++) {
        ok = ok && (p.add ? op->src[j] != nullptr && th_f32_contiguous(op->src[j]) &&
                                ggml_nelements(op->src[j]) == ggml_nelements(op)
                          : op->src[j] == nullptr);
    }
    return ok;
}

bool th_cuda_custom_supported(const ggml_tensor * op) {
    switch (th_kernel_of(op)) {
        case TH_CUDA_GELU:              // (the input f32, or bf16: th_gelu_bf16)
        case TH_CUDA_GELU_ERF:
            return th_f32_contiguous(op) && th_f32_or_bf16_contiguous(op->src[0]) && ggml_are_same_shape(op, op->src[0]);
        case TH_CUDA_GELU_BACK:
        case TH_CUDA_GELU_ERF_BACK:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && th_f32_or_bf16_contiguous(op->src[1]) &&
                   ggml_are_same_shape(op, op->src[0]) && ggml_are_same_shape(op, op->src[1]);
        case TH_CUDA_CONT:
            return th_f32_contiguous(op) && op->src[0] != nullptr && op->src[0]->type == GGML_TYPE_F32 &&
                   ggml_are_same_shape(op, op->src[0]) && th_cont_axis(op->src[0]) >= 0 &&
                   (op->src[0]->ne[th_cont_axis(op->src[0])] + 31) / 32 < 65536;
        case TH_CUDA_LAYER_NORM:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && ggml_are_same_shape(op, op->src[0]);
        case TH_CUDA_LINEAR_BIAS: {
            const ggml_tensor * w = op->src[0], * x = op->src[1], * b = op->src[2];
            return th_f32_or_bf16_contiguous(op) && th_f32_contiguous(w) && th_f32_contiguous(x) && th_f32_contiguous(b) &&
                   ggml_nrows(w) == op->ne[0] && w->ne[0] == x->ne[0] && ggml_nrows(x) == ggml_nrows(op) &&
                   ggml_nelements(b) == op->ne[0] && ggml_nrows(op) <= INT32_MAX && w->ne[0] <= INT32_MAX;
        }
        case TH_CUDA_FOLDED:
        case TH_CUDA_ROOM:
            return true;
        case TH_CUDA_SLICE_CONT: {
            if (!th_f32_contiguous(op) || op->src[0] == nullptr || op->src[0]->type != GGML_TYPE_F32) return false;
            const ggml_tensor view = th_slice_cont_source(op);
            return th_cont_axis(&view) >= 0 && (view.ne[th_cont_axis(&view)] + 31) / 32 < 65536;
        }
        case TH_CUDA_ROPE: {
            const ggml_tensor * x = op->src[0], * pos = op->src[1], * ff = op->src[2];
            const th_rope_params p = th_params_of<th_rope_params>(op);
            return th_f32_contiguous(op) && th_f32_contiguous(x) && ggml_are_same_shape(op, x) && pos != nullptr &&
                   pos->type == GGML_TYPE_I32 && ggml_nelements(pos) == x->ne[2] &&
                   (ff == nullptr || (th_f32_contiguous(ff) && ggml_nelements(ff) >= p.n_dims / 2)) &&
                   (p.mode == 0 || p.mode == GGML_ROPE_TYPE_NEOX) && p.ext_factor == 0.0f && p.n_dims > 0 &&
                   p.n_dims % 2 == 0 &&
                   p.n_dims <= x->ne[0] && x->ne[0] % 2 == 0;
        }
        case TH_CUDA_RMS_NORM:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && ggml_are_same_shape(op, op->src[0]) &&
                   op->ne[0] <= INT32_MAX;
        case TH_CUDA_CROSS_ENTROPY_BACK:
            return th_f32_contiguous(op) && op->src[0] != nullptr && op->src[0]->type == GGML_TYPE_F32 &&
                   ggml_is_scalar(op->src[0]) && th_f32_contiguous(op->src[1]) && th_f32_contiguous(op->src[2]) &&
                   ggml_are_same_shape(op, op->src[1]) && ggml_are_same_shape(op, op->src[2]) &&
                   op->ne[0] <= INT32_MAX && ggml_nrows(op) <= INT32_MAX;
        case TH_CUDA_CROSS_ENTROPY: {
            const ggml_tensor * logits = op->src[0], * labels = op->src[1];
            return op->type == GGML_TYPE_F32 && ggml_is_scalar(op) && th_f32_contiguous(logits) &&
                   th_f32_contiguous(labels) && ggml_are_same_shape(logits, labels) && logits->ne[0] <= INT32_MAX &&
                   ggml_nrows(logits) <= INT32_MAX;
        }
        case TH_CUDA_SWIGLU: {
            const ggml_tensor * gate = op->src[0], * up = op->src[1];
            return (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_BF16) && ggml_is_contiguous(op) &&
                   gate != nullptr && up != nullptr && gate->type == op->type && up->type == op->type &&
                   ggml_is_contiguous(gate) && ggml_is_contiguous(up) && ggml_nelements(gate) == ggml_nelements(op) &&
                   ggml_nelements(up) == ggml_nelements(op);
        }
        case TH_CUDA_DROPOUT_MASK:
            return th_f32_contiguous(op) && op->src[0] != nullptr && op->src[0]->type == GGML_TYPE_I32 &&
                   ggml_nelements(op->src[0]) == TH_DROPOUT_KEY_WORDS && ggml_is_contiguous(op->src[0]);
        case TH_CUDA_SOFT_MAX_BACK:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && th_f32_contiguous(op->src[1]) &&
                   ggml_are_same_shape(op, op->src[0]) && ggml_are_same_shape(op, op->src[1]) &&
                   op->ne[0] < INT32_MAX / 2;
        case TH_CUDA_SCATTER_ROWS:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && op->src[1] != nullptr &&
                   th_ids_distinct(op->src[1]) && ggml_is_contiguous(op->src[1]) &&
                   op->src[0]->ne[0] == op->ne[0] && ggml_nrows(op->src[0]) == op->src[0]->ne[1] &&
                   ggml_nelements(op->src[1]) == op->src[0]->ne[1] && op->ne[2] * op->ne[3] == 1;
        case TH_CUDA_GET_ROWS_BACK:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && op->src[1] != nullptr &&
                   op->src[1]->type == GGML_TYPE_I32 && ggml_is_contiguous(op->src[1]) &&
                   op->src[0]->ne[0] == op->ne[0] && ggml_nrows(op->src[0]) == op->src[0]->ne[1] &&
                   ggml_nelements(op->src[1]) == op->src[0]->ne[1] && op->ne[2] * op->ne[3] == 1 &&
                   (op->ne[1] + 7) / 8 < 65536;
        case TH_CUDA_ADD:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && th_f32_contiguous(op->src[1]) &&
                   ggml_are_same_shape(op, op->src[0]) && ggml_are_same_shape(op, op->src[1]);
        case TH_CUDA_SILU_BACK_MUL:
        case TH_CUDA_SWIGLU_BACK:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) &&
                   ((th_f32_contiguous(op->src[1]) && th_f32_contiguous(op->src[2])) ||
                    (th_kernel_of(op) == TH_CUDA_SWIGLU_BACK && op->src[1]->type == GGML_TYPE_BF16 &&
                     op->src[2]->type == GGML_TYPE_BF16 && ggml_is_contiguous(op->src[1]) &&
                     ggml_is_contiguous(op->src[2]))) && ggml_nelements(op->src[0]) == ggml_nelements(op) &&
                   ggml_nelements(op->src[1]) == ggml_nelements(op) && ggml_nelements(op->src[2]) == ggml_nelements(op) &&
                   ((th_kernel_of(op) == TH_CUDA_SILU_BACK_MUL && op->src[3] == nullptr) ||
                    (th_kernel_of(op) == TH_CUDA_SWIGLU_BACK && op->src[3] != nullptr &&
                     th_f32_contiguous(op->src[3]) && ggml_nelements(op->src[3]) == ggml_nelements(op)));
        case TH_CUDA_LAYER_NORM_BACK:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && th_f32_contiguous(op->src[1]) &&
                   ggml_nelements(op) == ggml_nelements(op->src[0]) && ggml_nelements(op) == ggml_nelements(op->src[1]) &&
                   op->ne[0] == op->src[1]->ne[0] &&
                   (op->src[2] == nullptr ||
                    (th_f32_contiguous(op->src[2]) && ggml_nelements(op->src[2]) == op->ne[0])) &&
                   (op->src[3] == nullptr ||
                    (th_f32_contiguous(op->src[3]) && ggml_nelements(op->src[3]) == ggml_nelements(op))) &&
                   (op->src[4] == nullptr ||          // the gain's gradient, and the scratch of its partial sums
                    (op->src[2] != nullptr && th_f32_contiguous(op->src[4]) && ggml_nelements(op->src[4]) == op->ne[0] &&
                     op->ne[0] <= TH_GAIN_SUMS_MAX_COLUMNS && op->src[5] != nullptr &&
                     op->src[5]->type == GGML_TYPE_F32 && ggml_nelements(op->src[5]) >= ggml_nelements(op))) &&
                   (op->src[6] == nullptr ||          // the bias's gradient, its partials after the gain's
                    (op->src[4] != nullptr && th_f32_contiguous(op->src[6]) && ggml_nelements(op->src[6]) == op->ne[0] &&
                     ggml_nelements(op->src[5]) >= 2 * th_column_chunk_count(ggml_nrows(op)) * op->ne[0]));
        case TH_CUDA_PRODUCT_SUM:
            return th_product_sum_supported(op);
        case TH_CUDA_AFFINE:
            return th_f32_contiguous(op) && th_f32_contiguous(op->src[0]) && ggml_nelements(op->src[0]) == ggml_nelements(op) &&
                   op->src[0]->ne[0] == op->ne[0] && th_f32_contiguous(op->src[1]) &&
                   ggml_nelements(op->src[1]) == op->ne[0] &&
                   (op->src[2] == nullptr || (th_f32_contiguous(op->src[2]) && ggml_nelements(op->src[2]) == op->ne[0])) &&
                   (op->src[3] == nullptr || th_norm_affine_supported(op));
        case TH_CUDA_COLUMN_DOT: {
            const ggml_tensor * a = op->src[0], * c = op->src[1], * scratch = op->src[2];
            return th_f32_contiguous(op) && th_f32_contiguous(a) && th_f32_contiguous(c) && ggml_are_same_shape(a, c) &&
                   ggml_nelements(op) == a->ne[0] && scratch != nullptr && scratch->type == GGML_TYPE_F32 &&
                   ggml_nelements(scratch) >= ggml_nelements(a);
        }
        case TH_CUDA_ADAMW:
            return th_adamw_supported(op);
        case TH_CUDA_FROZEN_MUL_MAT:
        case TH_CUDA_FROZEN_OUT_PROD:
            return th_frozen_supported(op, th_kernel_of(op));
        case TH_CUDA_ATTN_FWD:
        case TH_CUDA_ATTN_PREP:
        case TH_CUDA_ATTN_BWD:
        case TH_CUDA_ATTN_DQ:
        case TH_CUDA_SLICE:
            return th_attention_supported(op, th_kernel_of(op));
        default:
            return false;
    }
}

bool th_cuda_custom(cudaStream_t stream, cublasHandle_t cublas, ggml_tensor * dst) {
    switch (th_kernel_of(dst)) {
        case TH_CUDA_GELU:              // (at bf16 its output's copy beside it, or alone: the next products' operand)
            th_map(stream, th_gelu_op(), dst->src[0], dst->src[0], dst, true);
            return true;
        case TH_CUDA_GELU_BACK:
            th_map(stream, th_gelu_back_op(), dst->src[0], dst->src[1], dst, true);
            return true;
        case TH_CUDA_GELU_ERF:          // (as GELU and GELU_BACK)
            th_map(stream, th_gelu_erf_op(), dst->src[0], dst->src[0], dst, true);
            return true;
        case TH_CUDA_GELU_ERF_BACK:
            th_map(stream, th_gelu_erf_back_op(), dst->src[0], dst->src[1], dst, true);
            return true;
        case TH_CUDA_CONT:
            th_cont_of(stream, dst->src[0], dst);
            return true;
        case TH_CUDA_SLICE_CONT: {
            const ggml_tensor view = th_slice_cont_source(dst);
            th_cont_of(stream, &view, dst);
            return true;
        }
        case TH_CUDA_LAYER_NORM:
        case TH_CUDA_LAYER_NORM_BACK:
            th_layer_norm(stream, dst, th_kernel_of(dst) == TH_CUDA_LAYER_NORM_BACK);
            return true;
        case TH_CUDA_LINEAR_BIAS:
            return th_linear_bias(stream, cublas, dst);
        case TH_CUDA_PRODUCT_SUM:
            return th_product_sum(cublas, dst);
        case TH_CUDA_AFFINE:
            th_affine(stream, dst);
            return true;
        case TH_CUDA_COLUMN_DOT:
            th_column_dot(stream, dst);
            return true;
        case TH_CUDA_GET_ROWS_BACK:
            th_get_rows_back(stream, dst);
            return true;
        case TH_CUDA_SCATTER_ROWS:
            th_scatter_rows(stream, dst);
            return true;
        case TH_CUDA_SOFT_MAX_BACK:
            return th_soft_max_back(stream, dst);
        case TH_CUDA_RMS_NORM:
            th_rms_norm(stream, dst);
            return true;
        case TH_CUDA_ROPE:
            th_rope(stream, dst);
            return true;
        case TH_CUDA_CROSS_ENTROPY_BACK:
            th_cross_entropy_back(stream, dst);
            return true;
        case TH_CUDA_CROSS_ENTROPY:
            return th_cross_entropy(stream, dst);
        case TH_CUDA_SWIGLU:
            th_swiglu(stream, dst);
            return true;
        case TH_CUDA_DROPOUT_MASK:
            th_dropout_mask(stream, dst);
            return true;
        case TH_CUDA_ADD:               // (at bf16 a copy beside the sum, or alone, where products read it)
            th_map(stream, th_add_op(), dst->src[0], dst->src[1], dst, true);
            return true;
        case TH_CUDA_SILU_BACK_MUL:
        case TH_CUDA_SWIGLU_BACK:
            th_silu_back_mul(stream, dst);
            return true;
        case TH_CUDA_FOLDED:
        case TH_CUDA_ROOM:
            return true;
        case TH_CUDA_ADAMW:
            th_adamw(stream, dst);
            return true;
        case TH_CUDA_FROZEN_MUL_MAT:
        case TH_CUDA_FROZEN_OUT_PROD:
            return th_frozen(cublas, dst, th_kernel_of(dst));
        case TH_CUDA_ATTN_FWD:
        case TH_CUDA_ATTN_PREP:
        case TH_CUDA_ATTN_BWD:
        case TH_CUDA_ATTN_DQ:
        case TH_CUDA_SLICE:
            return th_attention(stream, dst, th_kernel_of(dst));
        default:
            return false;
    }
}

// what toyharness looks for to know that this ggml-cuda has these kernels (its _ffi binding)
extern "C" __attribute__((visibility("default"))) int th_cuda_kernels_version(void) { return TH_CUDA_KERNELS_VERSION; }
