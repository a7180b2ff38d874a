// Fused causal attention, forward and backward, fp32 (issue 21): the (B*H, T, T) scores and
// probabilities never reach memory in the forward, and the backward writes the scores' gradient
// once. th_cuda_rewrite (native/cuda_rewrite.c, th_rewrite_attention) hands these kernels the
// nodes that ggml's autograd built for blocks.attention; custom_ops.h fixes the layouts.
//
//   forward  (P's node):   O = softmax(scale Q K^T + mask) V and L = logsumexp per query row,
//                          one pass over the key blocks (online softmax, FlashAttention-2's order)
//   prep     (dP's node):  D = rowsum(dO * O)
//   backward (dS's node):  per key block, over the query blocks it sees: P again from Q, K and L,
//                          dP = dO V^T, dS = scale P (dP - D) (written: what SOFT_MAX_BACK gives),
//                          dV += P^T dO, dK += dS^T Q (both into the prep node's buffer)
//   dQ stays ggml's OUT_PROD of K and dS (cuBLAS), and O, dK, dV^T reach their nodes by copies.
//
// Every output element is summed by one thread in a fixed order (no atomics): the bits are the
// same run to run. Tiles are 64 queries x 64 keys, 256 threads, 4 x 4 outputs per thread; the
// backward fits two CTAs an SM (102.5 KB of shared memory at head size 64).
#include "th-custom.cuh"

extern "C" {
#include "custom_ops.h"
}

#include <cmath>
#include <cstdint>
#include <cstring>

#define TH_AT_B 64        // queries and keys per tile
#define TH_AT_PAD 4       // smem row padding (keeps float4 alignment, spreads banks)
#define TH_AT_LD (TH_AT_B + TH_AT_PAD)
#define TH_AT_THREADS 256

struct th_attn_args {
    const float * q;      // (BH, T, hd), row stride hd
    const float * k;      // (BH, T, hd)
    const float * vt;     // (BH, hd, T): V transposed
    const float * dout;   // (BH, T, hd): dO (backward)
    const float * fwd;    // the forward node: per head O (T x hd) then L (T)
    float * scratch;      // the prep node: per head dK (T x hd), dV^T (hd x T), D (T)
    float * out;          // the node's own output
    int64_t q_s, k_s, vt_s, do_s;   // per-head strides, floats
    int T;
    float scale;
    int causal;
};

// a kernel's dynamic shared memory above the 48 KB default, raised once per device (as ggml-cuda does)
#define TH_SET_SMEM_LIMIT(kernel, nbytes)                                                                    \
    do {                                                                                                     \
        static bool raised[64] = {false};                                                                    \
        int device = 0;                                                                                      \
        cudaGetDevice(&device);                                                                              \
        if (device < 64 && !raised[device]) {                                                                \
            if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) (nbytes)) != \
                cudaSuccess) {                                                                               \
                GGML_ABORT("toyharness attention: cannot raise the shared memory limit to %zu", (size_t) (nbytes)); \
            }                                                                                                \
            raised[device] = true;                                                                           \
        }                                                                                                    \
    } while (0)

static __device__ __forceinline__ float4 th_ld4(const float * p) { return *(const float4 *) p; }

// DN consecutive floats from shared memory (16-byte aligned where DN is a multiple of 4)
template <int DN>
static __device__ __forceinline__ void th_ld_row(const float * p, float (&v)[DN]) {
    if constexpr (DN % 4 == 0) {
#pragma unroll
        for (int j = 0; j < DN; j += 4) {
            const float4 x = th_ld4(p + j);
            v[j] = x.x, v[j + 1] = x.y, v[j + 2] = x.z, v[j + 3] = x.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < DN; j++) v[j] = p[j];
    }
}

// a tile's rows row0 .. row0 + B of x (T rows of HD floats), transposed into smem: t[d][r]
// (rows at or past T are zeros). Read along d (coalesced), stored along r.
template <int HD>
static __device__ __forceinline__ void th_load_transposed(float * t, const float * x, const int row0, const int T) {
    for (int i = threadIdx.x; i < TH_AT_B * HD; i += TH_AT_THREADS) {
        const int r = i / HD, d = i % HD;
        t[d * TH_AT_LD + r] = row0 + r < T ? x[(int64_t) (row0 + r) * HD + d] : 0.0f;
    }
}

// the forward: one CTA a (head, query block); the last query blocks (most key blocks) start first
template <int HD>
static __global__ void __launch_bounds__(TH_AT_THREADS) th_attn_fwd_kernel(const th_attn_args a) {
    constexpr int DN = HD / 16;                  // O columns per thread
    constexpr int LDV = HD + TH_AT_PAD;
    extern __shared__ float sm[];
    float * Qt = sm;                             // [HD][LD]  Q^T
    float * Kt = Qt + HD * TH_AT_LD;             // [HD][LD]  K^T
    float * V = Kt + HD * TH_AT_LD;              // [B][LDV]  V, key-major
    float * Pt = V + TH_AT_B * LDV;              // [B][LD]   P^T, key-major
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int bh = blockIdx.x, nqb = gridDim.y, qb = nqb - 1 - blockIdx.y, q0 = qb * TH_AT_B, T = a.T;
    const float * q = a.q + bh * a.q_s;
    const float * k = a.k + bh * a.k_s;
    const float * vt = a.vt + bh * a.vt_s;
    th_load_transposed<HD>(Qt, q, q0, T);
    float m[4], l[4], o[4][DN];
    for (int i = 0; i < 4; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int j = 0; j < DN; j++) o[i][j] = 0.0f;
    }
    const int nkb = a.causal ? qb + 1 : (T + TH_AT_B - 1) / TH_AT_B;
    for (int kb = 0; kb < nkb; kb++) {
        const int k0 = kb * TH_AT_B;
        __syncthreads();
        th_load_transposed<HD>(Kt, k, k0, T);
        for (int i = tid; i < TH_AT_B * HD; i += TH_AT_THREADS) {
            const int d = i / TH_AT_B, c = i % TH_AT_B;
            V[c * LDV + d] = k0 + c < T ? vt[(int64_t) d * T + k0 + c] : 0.0f;
        }
        __syncthreads();
        float s[4][4] = {};
#pragma unroll 8
        for (int d = 0; d < HD; d++) {
            const float4 qa = th_ld4(Qt + d * TH_AT_LD + 4 * ty), kb4 = th_ld4(Kt + d * TH_AT_LD + 4 * tx);
            const float qv[4] = {qa.x, qa.y, qa.z, qa.w}, kv[4] = {kb4.x, kb4.y, kb4.z, kb4.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) s[i][j] += qv[i] * kv[j];
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = q0 + 4 * ty + i;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int col = k0 + 4 * tx + j;
                s[i][j] = col >= T || (a.causal && col > row) ? -INFINITY : s[i][j] * a.scale;
                mx = fmaxf(mx, s[i][j]);
            }
#pragma unroll
            for (int w = 1; w < 16; w *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, w));
            const float m_new = fmaxf(m[i], mx);
            const float alpha = m_new == -INFINITY ? 1.0f : expf(m[i] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                s[i][j] = s[i][j] == -INFINITY ? 0.0f : expf(s[i][j] - m_new);
                sum += s[i][j];
            }
#pragma unroll
            for (int w = 1; w < 16; w *= 2) sum += __shfl_xor_sync(0xffffffff, sum, w);
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
#pragma unroll
            for (int j = 0; j < DN; j++) o[i][j] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            *(float4 *) (Pt + (4 * tx + j) * TH_AT_LD + 4 * ty) = make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
        }
        __syncthreads();
#pragma unroll 8
        for (int c = 0; c < TH_AT_B; c++) {
            const float4 pa = th_ld4(Pt + c * TH_AT_LD + 4 * ty);
            const float pv[4] = {pa.x, pa.y, pa.z, pa.w};
            float vv[DN];
            th_ld_row<DN>(V + c * LDV + tx * DN, vv);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < DN; j++) o[i][j] += pv[i] * vv[j];
        }
    }
    float * out = a.out + (int64_t) bh * ((int64_t) T * (HD + 1));
    for (int i = 0; i < 4; i++) {
        const int row = q0 + 4 * ty + i;
        if (row >= T) continue;
        const float inv = 1.0f / l[i];
        for (int j = 0; j < DN; j++) out[(int64_t) row * HD + tx * DN + j] = o[i][j] * inv;
        if (tx == 0) out[(int64_t) T * HD + row] = m[i] + logf(l[i]);
    }
}

// D = rowsum(dO * O): a warp a row
template <int HD>
static __global__ void th_attn_prep_kernel(const th_attn_args a, const int64_t rows) {
    const int64_t r = blockIdx.x * (int64_t) (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const int64_t bh = r / a.T, t = r % a.T;
    const float * dout = a.dout + bh * a.do_s + t * HD;
    const float * o = a.fwd + bh * ((int64_t) a.T * (HD + 1)) + t * HD;
    float sum = 0.0f;
    for (int d = lane; d < HD; d += 32) sum += dout[d] * o[d];
    for (int w = 16; w > 0; w /= 2) sum += __shfl_xor_sync(0xffffffff, sum, w);
    if (lane == 0) a.scratch[bh * ((int64_t) a.T * (2 * HD + 1)) + 2 * (int64_t) a.T * HD + t] = sum;
}

// the backward: one CTA a (head, key block), over the query blocks that see it (the first key
// blocks, seen by most, start first)
template <int HD>
static __global__ void __launch_bounds__(TH_AT_THREADS, 2) th_attn_bwd_kernel(const th_attn_args a) {
    constexpr int DN = HD / 16;
    constexpr int LDN = HD + TH_AT_PAD;
    constexpr int ROWS = HD > TH_AT_B ? HD : TH_AT_B;   // Qt then P, dOt then dS: room for either
    extern __shared__ float sm[];
    float * Kt = sm;                             // [HD][LD]   K^T
    float * Vt = Kt + HD * TH_AT_LD;             // [HD][LD]   V^T
    float * Qt = Vt + HD * TH_AT_LD;             // [HD][LD]   Q^T, then P   [B][LD] query-major
    float * dOt = Qt + ROWS * TH_AT_LD;          // [HD][LD]   dO^T, then dS [B][LD] query-major
    float * Qn = dOt + ROWS * TH_AT_LD;          // [B][LDN]   Q
    float * dOn = Qn + TH_AT_B * LDN;            // [B][LDN]   dO
    float * Lq = dOn + TH_AT_B * LDN;            // [B]
    float * Dq = Lq + TH_AT_B;                   // [B]
    float * Pq = Qt, * Sq = dOt;
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int bh = blockIdx.x, kb = blockIdx.y, k0 = kb * TH_AT_B, T = a.T;
    const int nqb = (T + TH_AT_B - 1) / TH_AT_B;
    const float * q = a.q + bh * a.q_s;
    const float * k = a.k + bh * a.k_s;
    const float * vt = a.vt + bh * a.vt_s;
    const float * dout = a.dout + bh * a.do_s;
    const float * L = a.fwd + bh * ((int64_t) T * (HD + 1)) + (int64_t) T * HD;
    float * scratch = a.scratch + bh * ((int64_t) T * (2 * HD + 1));
    const float * D = scratch + 2 * (int64_t) T * HD;
    float * ds_out = a.out + bh * ((int64_t) T * T);
    th_load_transposed<HD>(Kt, k, k0, T);
    for (int i = tid; i < TH_AT_B * HD; i += TH_AT_THREADS) {
        const int d = i / TH_AT_B, c = i % TH_AT_B;
        Vt[d * TH_AT_LD + c] = k0 + c < T ? vt[(int64_t) d * T + k0 + c] : 0.0f;
    }
    float dv[4][DN], dk[4][DN];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < DN; j++) dv[i][j] = dk[i][j] = 0.0f;
    for (int qb = a.causal ? kb : 0; qb < nqb; qb++) {
        const int q0 = qb * TH_AT_B;
        __syncthreads();
        for (int i = tid; i < TH_AT_B * HD; i += TH_AT_THREADS) {
            const int r = i / HD, d = i % HD;
            const bool in = q0 + r < T;
            const float qv = in ? q[(int64_t) (q0 + r) * HD + d] : 0.0f;
            const float gv = in ? dout[(int64_t) (q0 + r) * HD + d] : 0.0f;
            Qt[d * TH_AT_LD + r] = qv;
            Qn[r * LDN + d] = qv;
            dOt[d * TH_AT_LD + r] = gv;
            dOn[r * LDN + d] = gv;
        }
        if (tid < TH_AT_B) {
            const bool in = q0 + tid < T;
            Lq[tid] = in ? L[q0 + tid] : INFINITY;      // a padded row's P is exp(-inf) = 0
            Dq[tid] = in ? D[q0 + tid] : 0.0f;
        }
        __syncthreads();
        // S^T and dP^T, keys (rows, 4 ty) x queries (columns, 4 tx)
        float s[4][4] = {}, dp[4][4] = {};
#pragma unroll 4
        for (int d = 0; d < HD; d++) {
            const float4 ka = th_ld4(Kt + d * TH_AT_LD + 4 * ty), va = th_ld4(Vt + d * TH_AT_LD + 4 * ty);
            const float4 qb4 = th_ld4(Qt + d * TH_AT_LD + 4 * tx), gb = th_ld4(dOt + d * TH_AT_LD + 4 * tx);
            const float kv[4] = {ka.x, ka.y, ka.z, ka.w}, vv[4] = {va.x, va.y, va.z, va.w};
            const float qv[4] = {qb4.x, qb4.y, qb4.z, qb4.w}, gv[4] = {gb.x, gb.y, gb.z, gb.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    s[i][j] += kv[i] * qv[j];
                    dp[i][j] += vv[i] * gv[j];
                }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = k0 + 4 * ty + i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int qr = q0 + 4 * tx + j;
                const bool seen = key < T && qr < T && !(a.causal && key > qr);
                const float p = seen ? expf(s[i][j] * a.scale - Lq[4 * tx + j]) : 0.0f;
                s[i][j] = p;
                dp[i][j] = p * (dp[i][j] - Dq[4 * tx + j]) * a.scale;     // dS
            }
        }
        __syncthreads();                            // Qt and dOt read: they take P and dS
#pragma unroll
        for (int j = 0; j < 4; j++) {
            *(float4 *) (Pq + (4 * tx + j) * TH_AT_LD + 4 * ty) = make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
            *(float4 *) (Sq + (4 * tx + j) * TH_AT_LD + 4 * ty) = make_float4(dp[0][j], dp[1][j], dp[2][j], dp[3][j]);
        }
        __syncthreads();
        // dS to the node, a row of keys at a time (coalesced): row q0 + r, keys k0 ..
        const int kw = T - k0 < TH_AT_B ? T - k0 : TH_AT_B;
        if (kw == TH_AT_B && T % 4 == 0) {
            for (int i = tid; i < TH_AT_B * TH_AT_B / 4; i += TH_AT_THREADS) {
                const int r = i / (TH_AT_B / 4), c = 4 * (i % (TH_AT_B / 4));
                if (q0 + r < T) *(float4 *) (ds_out + (int64_t) (q0 + r) * T + k0 + c) = th_ld4(Sq + r * TH_AT_LD + c);
            }
        } else {
            for (int i = tid; i < TH_AT_B * TH_AT_B; i += TH_AT_THREADS) {
                const int r = i / TH_AT_B, c = i % TH_AT_B;
                if (q0 + r < T && c < kw) ds_out[(int64_t) (q0 + r) * T + k0 + c] = Sq[r * TH_AT_LD + c];
            }
        }
#pragma unroll 4
        for (int r = 0; r < TH_AT_B; r++) {         // dV += P^T dO and dK += dS^T Q
            const float4 pa = th_ld4(Pq + r * TH_AT_LD + 4 * ty), sa = th_ld4(Sq + r * TH_AT_LD + 4 * ty);
            const float pv[4] = {pa.x, pa.y, pa.z, pa.w}, sv[4] = {sa.x, sa.y, sa.z, sa.w};
            float gv[DN], qv[DN];
            th_ld_row<DN>(dOn + r * LDN + tx * DN, gv);
            th_ld_row<DN>(Qn + r * LDN + tx * DN, qv);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < DN; j++) {
                    dv[i][j] += pv[i] * gv[j];
                    dk[i][j] += sv[i] * qv[j];
                }
        }
    }
    if (a.causal) {      // the query rows that never see this key block: their dS is 0
        const int kw = T - k0 < TH_AT_B ? T - k0 : TH_AT_B;
        for (int64_t i = tid; i < (int64_t) k0 * kw; i += TH_AT_THREADS) {
            ds_out[(i / kw) * T + k0 + i % kw] = 0.0f;
        }
    }
    for (int i = 0; i < 4; i++) {
        const int key = k0 + 4 * ty + i;
        if (key >= T) continue;
        for (int j = 0; j < DN; j++) {
            const int d = tx * DN + j;
            scratch[(int64_t) key * HD + d] = dk[i][j];
            scratch[(int64_t) T * HD + (int64_t) d * T + key] = dv[i][j];
        }
    }
}

// dst (contiguous, n floats a head) = the head's n floats from `offset` in src (a head every `stride`)
static __global__ void th_slice_kernel(const float * __restrict__ src, float * __restrict__ dst, const int64_t n,
                                       const int64_t heads, const int64_t stride, const int64_t offset) {
    const int64_t total = n * heads;
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < total; i += (int64_t) gridDim.x * blockDim.x) {
        dst[i] = src[(i / n) * stride + offset + i % n];
    }
}

static size_t th_fwd_smem(int hd) { return sizeof(float) * (2 * hd * TH_AT_LD + TH_AT_B * (hd + TH_AT_PAD) + TH_AT_B * TH_AT_LD); }
static size_t th_bwd_smem(int hd) {
    const int rows = hd > TH_AT_B ? hd : TH_AT_B;
    return sizeof(float) * (2 * hd * TH_AT_LD + 2 * rows * TH_AT_LD + 2 * TH_AT_B * (hd + TH_AT_PAD) + 2 * TH_AT_B);
}

static th_attention_params th_params_of(const ggml_tensor * t) {
    th_attention_params ap;
    memcpy(&ap, t->op_params + 2, sizeof(ap));
    return ap;
}

static int64_t th_head_stride(const ggml_tensor * t) { return (int64_t) (t->nb[2] / sizeof(float)); }

template <int HD>
static void th_attention_launch(cudaStream_t stream, ggml_tensor * dst, const int kernel, const th_attention_params & ap) {
    th_attn_args a = {};
    a.T = ap.T, a.scale = ap.scale, a.causal = ap.causal, a.out = (float *) dst->data;
    const int nb = (a.T + TH_AT_B - 1) / TH_AT_B;
    if (kernel == TH_CUDA_ATTN_FWD) {
        const ggml_tensor * q = dst->src[0], * k = dst->src[1], * vt = dst->src[2];
        a.q = (const float *) q->data, a.k = (const float *) k->data, a.vt = (const float *) vt->data;
        a.q_s = th_head_stride(q), a.k_s = th_head_stride(k), a.vt_s = th_head_stride(vt);
        const size_t smem = th_fwd_smem(HD);
        TH_SET_SMEM_LIMIT(th_attn_fwd_kernel<HD>, smem);
        th_attn_fwd_kernel<HD><<<dim3((unsigned) q->ne[2], (unsigned) nb), TH_AT_THREADS, smem, stream>>>(a);
    } else if (kernel == TH_CUDA_ATTN_PREP) {
        const ggml_tensor * dout = dst->src[0], * fwd = dst->src[1];
        a.dout = (const float *) dout->data, a.do_s = th_head_stride(dout), a.fwd = (const float *) fwd->data;
        a.scratch = (float *) dst->data;
        const int64_t rows = dout->ne[2] * (int64_t) a.T;
        th_attn_prep_kernel<HD><<<(unsigned) ((rows + 7) / 8), 256, 0, stream>>>(a, rows);
    } else {
        const ggml_tensor * q = dst->src[0], * k = dst->src[1], * vt = dst->src[2], * dout = dst->src[3];
        a.q = (const float *) q->data, a.k = (const float *) k->data, a.vt = (const float *) vt->data;
        a.dout = (const float *) dout->data;
        a.fwd = (const float *) dst->src[4]->data;
        a.scratch = (float *) dst->src[5]->data;
        a.q_s = th_head_stride(q), a.k_s = th_head_stride(k), a.vt_s = th_head_stride(vt), a.do_s = th_head_stride(dout);
        const size_t smem = th_bwd_smem(HD);
        TH_SET_SMEM_LIMIT(th_attn_bwd_kernel<HD>, smem);
        th_attn_bwd_kernel<HD><<<dim3((unsigned) q->ne[2], (unsigned) nb), TH_AT_THREADS, smem, stream>>>(a);
    }
}

bool th_attention_supported(const ggml_tensor * op, const int kernel) {
    if (op->type != GGML_TYPE_F32 || !ggml_is_contiguous(op)) return false;
    for (int i = 0; i < GGML_MAX_SRC && op->src[i] != nullptr; i++) {
        if (op->src[i]->type != GGML_TYPE_F32 || op->src[i]->nb[0] != sizeof(float)) return false;
    }
    if (kernel == TH_CUDA_SLICE) return op->src[0] != nullptr && ggml_is_contiguous(op->src[0]);
    const th_attention_params ap = th_params_of(op);
    return th_attention_head_dim_ok(ap.hd) && ap.T > 0;
}

bool th_attention(cudaStream_t stream, ggml_tensor * dst, const int kernel) {
    if (kernel == TH_CUDA_SLICE) {
        th_slice_params sp;
        memcpy(&sp, dst->op_params + 2, sizeof(sp));
        const int64_t n = dst->ne[0] * dst->ne[1], heads = ggml_nelements(dst) / n;
        const int64_t total = n * heads;
        const int blocks = (int) ((total + 255) / 256 < 65535 ? (total + 255) / 256 : 65535);
        th_slice_kernel<<<blocks, 256, 0, stream>>>((const float *) dst->src[0]->data, (float *) dst->data, n, heads,
                                                    sp.stride, sp.offset);
        return true;
    }
    const th_attention_params ap = th_params_of(dst);
    switch (ap.hd) {
        case 16: th_attention_launch<16>(stream, dst, kernel, ap); return true;
        case 32: th_attention_launch<32>(stream, dst, kernel, ap); return true;
        case 64: th_attention_launch<64>(stream, dst, kernel, ap); return true;
        default: return false;
    }
}
