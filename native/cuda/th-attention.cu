// Fused causal attention, forward and backward, fp32 (issue 21): the (B*H, T, T) scores and
// probabilities never reach memory in the forward, and the backward writes the scores' gradient
// once (at tf32 and bf16 not at all: dQ's kernel computes its tiles again). th_cuda_rewrite
// (native/cuda_rewrite.c, th_rewrite_attention) hands these kernels the nodes that ggml's
// autograd built for blocks.attention; custom_ops.h fixes the layouts.
//
//   forward  (P's node):   O = softmax(scale Q K^T + mask) V and L = logsumexp per query row,
//                          one pass over the key blocks (online softmax, FlashAttention-2's order)
//   prep     (dP's node):  D = rowsum(dO * O)
//   backward (dS's node):  per key block, over the query blocks it sees: P again from Q, K and L,
//                          dP = dO V^T, dS = scale P (dP - D) (written: what SOFT_MAX_BACK gives;
//                          tf32 and bf16: not written), dV += P^T dO, dK += dS^T Q (both into the
//                          prep node's buffer)
//   dQ       (dq's node):  per query block, dQ = dS K over the key blocks it sees (tf32 and bf16:
//                          dS's tiles computed again from Q, K, V, dO, L and D), written in the
//                          layout its node wants (the projection's (B, T, H, hd) where a CONT
//                          permuted it back: that CONT is the node)
//
// q, k, v^T and dO are read through their strides, and dK, dV and dQ written through them
// (th_opd): where the rewrite folded the CONTs that permuted q, k, v and dO out of the
// projections' layout, the kernels read the projections in place; where CONTs permuted dK, dV
// and dQ back to it, the kernels write those CONTs' nodes directly (dK's and dV's are rooms).
// Every output element is summed by one thread in a fixed order (no atomics): the bits are the
// same run to run. 256 threads a CTA. The forward takes 128 queries against 64 keys at a time,
// 8 query rows a thread (fewer shared-memory reads a product: 6.03 against 6.31 ms a gpt2-small
// step), each row over the same key blocks as with 64 queries, so the same bits; the backward and
// dQ take 64 x 64 tiles, 4 x 4 a thread (dQ with 128 queries was slower: 3.36 against 3.23 ms).
// The forward and the backward fit two CTAs an SM (102.5 KB of shared memory at head size 64).
// At precision bf16 and tf32 the same nodes run on tensor cores instead (the sections "bf16" and
// "tf32" below; th_precision_of(node) picks): bf16 or TF32 tiles, fp32 softmax and sums.
// Packed rows (several examples a row, custom_ops.h's TH_ATTENTION_PACKED): each query sees its own
// example's keys up to itself (th_first_key, th_query_end: the fed bounds), and every kernel walks
// only the key or query blocks of those examples, so a row of short examples costs the sum of
// their squared lengths. A block or tile skipped would have added exactly nothing (its P and dS are
// 0): the bits are those of the walk over every block.
#include "th-custom.cuh"
#include "th-precision.cuh"                 // th_copy_for_writer: dQ's, dK's and dV's bf16 copies
#include "th-cudnn.cuh"                     // cuDNN's fused attention (the section "cuDNN" below)

extern "C" {
#include "custom_ops.h"
}
#include "dropout_mask.h"                   // the stream of P's dropout mask (the section "Dropout" below)

// TOYHARNESS_CUDNN_ATTENTION as toyharness/_ffi.py passed it (custom_ops.h, TH_CUDNN_MODE): ggml-cuda's copy
int th_cuda_cudnn_mode = TH_CUDNN_ON;

extern "C" __attribute__((visibility("default"))) void th_cuda_set_cudnn_attention(int mode) {
    th_cuda_cudnn_mode = mode;
}

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#define TH_AT_B 64        // queries and keys per tile
#define TH_AT_PAD 4       // smem row padding (keeps float4 alignment, spreads banks)
#define TH_AT_LD (TH_AT_B + TH_AT_PAD)
#define TH_AT_THREADS 256
#define TH_AT_QB 128      // queries a forward CTA
#define TH_AT_QLD (TH_AT_QB + TH_AT_PAD)

// a head batch's (t, d) elements, floats: head bh starts at p + (h / H) sb + (h % H) sh, h = bh / g
// (g: query heads a kv head, for k and v^T of grouped-query heads; else 1). bf16: the elements are
// bf16 (q, k and v^T kept in bf16 at precision bf16: native/cuda_precision.c,
// th_attention_inputs_bf16), p their address and the strides in elements; the tensor-core kernels
// read them through their loads' B16 instances (th_stage, th_fill_rows, th_load_rows).
#define TH_ATTENTION_BF16_OPERANDS 1   // th_opd.bf16 exists
struct th_opd {
    float * p;
    int64_t st, sd, sh, sb;
    int H, g;
    int bf16 = 0;
};

static __device__ __forceinline__ float * th_head(const th_opd & o, int bh) {
    if (o.g > 1) bh /= o.g;
    return o.p + (int64_t) (bh / o.H) * o.sb + (int64_t) (bh % o.H) * o.sh;
}

// th_head of an operand whose elements are bf16 (B16) or f32: the head's first element's address
template <bool B16>
static __device__ __forceinline__ float * th_head_as(const th_opd & o, int bh) {
    if constexpr (!B16) {
        return th_head(o, bh);
    } else {
        if (o.g > 1) bh /= o.g;
        return (float *) ((__nv_bfloat16 *) o.p + (int64_t) (bh / o.H) * o.sb + (int64_t) (bh % o.H) * o.sh);
    }
}

// the backward's dK or dV element of a kv head: with grouped heads (group > 1) the sum over its
// group, head by head into memory as REPEAT_BACK summed them (0, then each head's value added in
// fp32, in head order: the same bits); one thread writes and rereads each element
static __device__ __forceinline__ void th_put_grouped(float * p, const float x, const int group, const int r) {
    if (group == 1) {
        *p = x;
    } else {
        *p = __fadd_rn(r == 0 ? 0.0f : *p, x);
    }
}

// A bf16 copy a kernel writes beside its f32 output (th_copy_for_writer), for the products that
// read that output: p (nullptr: none) holds the element that lies at `base + i` at p + i; alone:
// the copy alone, the f32 values not written
struct th_copy16 {
    __nv_bfloat16 * p;
    const float * base;
    int alone;
};

static __device__ __forceinline__ __nv_bfloat16 * th_copy_at(const th_copy16 & c, const float * at) {
    return c.p != nullptr ? c.p + (at - c.base) : nullptr;
}

// the copy of `written` (f32, contiguous), which `writer` (the node computing now) writes
static th_copy16 th_copy16_of(cudaStream_t stream, const ggml_tensor * writer, const ggml_tensor * written) {
    bool alone = false;
    __nv_bfloat16 * p = th_copy_for_writer(stream, writer, &alone, written);
    return {p, (const float *) written->data, alone};
}

struct th_attn_args {
    th_opd q, k, v;       // (t, d) of Q, K and V (the node reads V^T: its strides swapped)
    th_opd dout;          // dO (backward)
    th_opd o;             // O in the forward's node: where the forward writes it, the prep reads it
    th_opd dk, dv, dq;    // where the backward writes dK and dV, the dQ node dQ
    const float * fwd;    // the forward node: per head O (T x hd) then L (T)
    float * scratch;      // the prep node: per head dK (T x hd), dV^T (hd x T), D (T)
    const float * ds;     // the backward node's dS (BH, T, T) (the dQ node at fp32 and tf32)
    float * out;          // the node's own output
    th_copy16 dq16, dk16, dv16;  // at bf16 the copies of dQ, dK and dV that products read, or none
    int T;
    float scale;
    int causal;
    int group;            // query heads a kv head (the backward: one CTA a kv head, its heads in turn)
    const int32_t * drop_key;   // dropout on P: the program's fed key (dropout_mask.h), or none
    th_dropout_params drop;     // and the mask's stream (th_attention_params.dropout)
    const int32_t * bounds;     // packed rows (TH_ATTENTION_PACKED): per batch row the first key
                                // each query sees (T), then the end of the queries each key is seen by
                                // (T); none: every causal query sees keys 0 .. itself
    int row_heads;              // query heads a batch row (head bh's row: bh / row_heads)
};

// Packed rows (custom_ops.h, TH_ATTENTION_PACKED): query i sees keys j with first(i) <= j <= i, and
// key j is seen by queries j <= i < end(j); both nondecreasing along the row (an example's keys are
// contiguous), so a block's bounds are its first and last element's. Without bounds: 0 and T.
// A row or key past T reads its last (those rows and keys are masked or not written anyway).
static __device__ __forceinline__ int th_first_key(const th_attn_args & a, const int bh, const int row) {
    if (a.bounds == nullptr) return 0;
    return __ldg(a.bounds + (int64_t) (bh / a.row_heads) * 2 * a.T + (row < a.T ? row : a.T - 1));
}
static __device__ __forceinline__ int th_query_end(const th_attn_args & a, const int bh, const int key) {
    if (a.bounds == nullptr) return a.T;
    return __ldg(a.bounds + (int64_t) (bh / a.row_heads) * 2 * a.T + a.T + (key < a.T ? key : a.T - 1));
}
// whether query `row` sees `key` (both inside the sequence): causal, and inside the row's example
static __device__ __forceinline__ bool th_sees(const th_attn_args & a, const int bh, const int row, const int key) {
    return key < a.T && row < a.T && !(a.causal && key > row) && key >= th_first_key(a, bh, row);
}

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

// a tile's rows row0 .. row0 + B of a head h (its (t, d) elements through o's strides) into smem,
// as rows (ROWS: rows[r][d], ld ldr) and/or transposed (COLS: cols[d][r], ld TH_AT_LD); rows at or
// past T are zeros. Read along whichever of t and d is adjacent in memory (coalesced).
template <int HD, bool ROWS, bool COLS, int NR = TH_AT_B, int LDC = TH_AT_LD>
static __device__ __forceinline__ void th_load_tile(float * rows, const int ldr, float * cols, const float * h,
                                                    const th_opd & o, const int row0, const int T) {
    const bool d_adjacent = o.sd == 1;
    for (int i = threadIdx.x; i < NR * HD; i += TH_AT_THREADS) {
        const int r = d_adjacent ? i / HD : i % NR, d = d_adjacent ? i % HD : i / NR;
        const float x = row0 + r < T ? h[(int64_t) (row0 + r) * o.st + (int64_t) d * o.sd] : 0.0f;
        if (ROWS) rows[r * ldr + d] = x;
        if (COLS) cols[d * LDC + r] = x;
    }
}

// the forward: one CTA a (head, block of 128 queries), 8 query rows x 4 keys a thread; the last
// query blocks (most key blocks) start first. A warp's 16 query rows see the key blocks up to
// their own: a causal warp skips the one key block past them (its rows then take exactly the
// steps of 64-query blocks, so the bits do not depend on the block size).
template <int HD>
static __global__ void __launch_bounds__(TH_AT_THREADS, 2) th_attn_fwd_kernel(const th_attn_args a) {
    constexpr int DN = HD / 16;                  // O columns per thread
    constexpr int R = TH_AT_QB / 16;             // query rows per thread
    constexpr int LDV = HD + TH_AT_PAD;
    extern __shared__ float sm[];
    float * Qt = sm;                             // [HD][QLD] Q^T
    float * Kt = Qt + HD * TH_AT_QLD;            // [HD][LD]  K^T
    float * V = Kt + HD * TH_AT_LD;              // [B][LDV]  V, key-major
    float * Pt = V + TH_AT_B * LDV;              // [B][QLD]  P^T, key-major
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int bh = blockIdx.x, nqb = gridDim.y, qb = nqb - 1 - blockIdx.y, q0 = qb * TH_AT_QB, T = a.T;
    const int warp_last_row = q0 + 16 * (tid / 32) + 15;
    const float * q = th_head(a.q, bh), * k = th_head(a.k, bh), * v = th_head(a.v, bh);
    th_load_tile<HD, false, true, TH_AT_QB, TH_AT_QLD>(nullptr, 0, Qt, q, a.q, q0, T);
    float m[R], l[R], o[R][DN];
    for (int i = 0; i < R; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int j = 0; j < DN; j++) o[i][j] = 0.0f;
    }
    const int q_end = q0 + TH_AT_QB < T ? q0 + TH_AT_QB : T;
    const int nkb = ((a.causal ? q_end : T) + TH_AT_B - 1) / TH_AT_B;
    // packed rows: the key blocks before the first query's example are skipped by all, and a
    // warp skips those before its first row's
    const int warp_first_key = th_first_key(a, bh, warp_last_row - 15);
    for (int kb = th_first_key(a, bh, q0) / TH_AT_B; kb < nkb; kb++) {
        const int k0 = kb * TH_AT_B;
        const bool sees = (!a.causal || k0 <= warp_last_row) && k0 + TH_AT_B > warp_first_key;   // warp-wide
        __syncthreads();
        th_load_tile<HD, false, true>(nullptr, 0, Kt, k, a.k, k0, T);
        th_load_tile<HD, true, false>(V, LDV, nullptr, v, a.v, k0, T);
        __syncthreads();
        float s[R][4];
        if (sees) {
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) s[i][j] = 0.0f;
#pragma unroll 4
            for (int d = 0; d < HD; d++) {
                const float4 qa = th_ld4(Qt + d * TH_AT_QLD + R * ty), qc = th_ld4(Qt + d * TH_AT_QLD + R * ty + 4);
                const float4 kb4 = th_ld4(Kt + d * TH_AT_LD + 4 * tx);
                const float qv[R] = {qa.x, qa.y, qa.z, qa.w, qc.x, qc.y, qc.z, qc.w};
                const float kv[4] = {kb4.x, kb4.y, kb4.z, kb4.w};
#pragma unroll
                for (int i = 0; i < R; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) s[i][j] += qv[i] * kv[j];
            }
#pragma unroll
            for (int i = 0; i < R; i++) {
                const int row = q0 + R * ty + i, first = th_first_key(a, bh, row);   // packed rows; else 0
                float mx = -INFINITY;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int col = k0 + 4 * tx + j;
                    s[i][j] = col >= T || (a.causal && col > row) || col < first ? -INFINITY : s[i][j] * a.scale;
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
                float * p = Pt + (4 * tx + j) * TH_AT_QLD + R * ty;
                *(float4 *) p = make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
                *(float4 *) (p + 4) = make_float4(s[4][j], s[5][j], s[6][j], s[7][j]);
            }
        }
        __syncthreads();
        if (!sees) continue;
#pragma unroll 4
        for (int c = 0; c < TH_AT_B; c++) {
            const float4 pa = th_ld4(Pt + c * TH_AT_QLD + R * ty), pc = th_ld4(Pt + c * TH_AT_QLD + R * ty + 4);
            const float pv[R] = {pa.x, pa.y, pa.z, pa.w, pc.x, pc.y, pc.z, pc.w};
            float vv[DN];
            th_ld_row<DN>(V + c * LDV + tx * DN, vv);
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < DN; j++) o[i][j] += pv[i] * vv[j];
        }
    }
    float * out = th_head(a.o, bh);
    float * L = a.out + (int64_t) bh * ((int64_t) T * (HD + 1)) + (int64_t) T * HD;
    for (int i = 0; i < R; i++) {
        const int row = q0 + R * ty + i;
        if (row >= T) continue;
        const float inv = 1.0f / l[i];
        for (int j = 0; j < DN; j++) out[(int64_t) row * a.o.st + (int64_t) (tx * DN + j) * a.o.sd] = o[i][j] * inv;
        if (tx == 0) L[row] = m[i] + logf(l[i]);
    }
}

// D = rowsum(dO * O): a warp a row
template <int HD>
static __global__ void th_attn_prep_kernel(const th_attn_args a, const int64_t rows) {
    const int64_t r = blockIdx.x * (int64_t) (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const int64_t bh = r / a.T, t = r % a.T;
    const float * dout = th_head(a.dout, (int) bh) + t * a.dout.st;
    const float * o = th_head(a.o, (int) bh) + t * a.o.st;
    float sum = 0.0f;
    for (int d = lane; d < HD; d += 32) sum += dout[d * a.dout.sd] * o[d * a.o.sd];
    for (int w = 16; w > 0; w /= 2) sum += __shfl_xor_sync(0xffffffff, sum, w);
    if (lane == 0) a.scratch[bh * ((int64_t) a.T * (2 * HD + 1)) + 2 * (int64_t) a.T * HD + t] = sum;
}

// the backward: one CTA a (head, key block), over the query blocks that see it (the first key
// blocks, seen by most, start first). dS is written for those tiles only. With grouped heads a
// CTA takes a kv head's key block and each query head of its group in turn (K and V loaded once).
template <int HD, bool GROUPED>
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
    const int kvh = blockIdx.x, G = GROUPED ? a.group : 1, kb = blockIdx.y, k0 = kb * TH_AT_B, T = a.T;
    const float * k = th_head(a.k, kvh * G), * v = th_head(a.v, kvh * G);
    th_load_tile<HD, false, true>(nullptr, 0, Kt, k, a.k, k0, T);
    th_load_tile<HD, false, true>(nullptr, 0, Vt, v, a.v, k0, T);
    for (int gr = 0; gr < G; gr++) {
        const int bh = kvh * G + gr;
        const float * q = th_head(a.q, bh), * dout = th_head(a.dout, bh);
        const float * L = a.fwd + bh * ((int64_t) T * (HD + 1)) + (int64_t) T * HD;
        const float * D = a.scratch + bh * ((int64_t) T * (2 * HD + 1)) + 2 * (int64_t) T * HD;
        float * ds_out = a.out + bh * ((int64_t) T * T);
        float dv[4][DN], dk[4][DN];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < DN; j++) dv[i][j] = dk[i][j] = 0.0f;
        // packed rows: the query blocks past the last key's example see none of the block's keys
        const int qb_end = (th_query_end(a, bh, k0 + TH_AT_B - 1) + TH_AT_B - 1) / TH_AT_B;
        for (int qb = a.causal ? kb : 0; qb < qb_end; qb++) {
            const int q0 = qb * TH_AT_B;
            __syncthreads();
            th_load_tile<HD, true, true>(Qn, LDN, Qt, q, a.q, q0, T);
            th_load_tile<HD, true, true>(dOn, LDN, dOt, dout, a.dout, q0, T);
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
                    const bool seen = th_sees(a, bh, qr, key);
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
        // causal: the tiles above the diagonal are never written; the dQ kernel, dS's only reader, skips them
        float * dk_out = th_head(a.dk, kvh), * dv_out = th_head(a.dv, kvh);
        for (int i = 0; i < 4; i++) {
            const int key = k0 + 4 * ty + i;
            if (key >= T) continue;
            for (int j = 0; j < DN; j++) {
                const int64_t d = tx * DN + j;
                th_put_grouped(dk_out + key * a.dk.st + d * a.dk.sd, dk[i][j], G, gr);
                th_put_grouped(dv_out + key * a.dv.st + d * a.dv.sd, dv[i][j], G, gr);
            }
        }
    }
}

// dQ = dS K: one CTA a (head, query block), over the key blocks it sees (causal: the diagonal's
// and those before it, all that the backward wrote), keys in order: the last query blocks (most
// key blocks) start first. dS tiles stay query-major (float4 along keys), K key-major.
template <int HD>
static __global__ void __launch_bounds__(TH_AT_THREADS) th_attn_dq_kernel(const th_attn_args a) {
    constexpr int DN = HD / 16;
    constexpr int LDK = HD + TH_AT_PAD;
    extern __shared__ float sm[];
    float * S = sm;                              // [B][LD]   dS, query-major
    float * Kn = S + TH_AT_B * TH_AT_LD;         // [B][LDK]  K, key-major
    const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    const int bh = blockIdx.x, nqb = gridDim.y, qb = nqb - 1 - blockIdx.y, q0 = qb * TH_AT_B, T = a.T;
    const float * ds = a.ds + (int64_t) bh * T * T;
    const float * k = th_head(a.k, bh);
    float acc[4][DN];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < DN; j++) acc[i][j] = 0.0f;
    const int nkb = a.causal ? qb + 1 : nqb;
    // packed rows: from the first query's example's first key block (the tiles the backward wrote)
    for (int kb = th_first_key(a, bh, q0) / TH_AT_B; kb < nkb; kb++) {
        const int k0 = kb * TH_AT_B;
        __syncthreads();
        if (T % 4 == 0) {             // then a float4 of keys is all in, or all past T
            for (int i = tid; i < TH_AT_B * TH_AT_B / 4; i += TH_AT_THREADS) {
                const int r = i / (TH_AT_B / 4), c = 4 * (i % (TH_AT_B / 4));
                const bool in = q0 + r < T && k0 + c < T;
                *(float4 *) (S + r * TH_AT_LD + c) =
                    in ? th_ld4(ds + (int64_t) (q0 + r) * T + k0 + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        } else {
            for (int i = tid; i < TH_AT_B * TH_AT_B; i += TH_AT_THREADS) {
                const int r = i / TH_AT_B, c = i % TH_AT_B;
                S[r * TH_AT_LD + c] = q0 + r < T && k0 + c < T ? ds[(int64_t) (q0 + r) * T + k0 + c] : 0.0f;
            }
        }
        th_load_tile<HD, true, false>(Kn, LDK, nullptr, k, a.k, k0, T);
        __syncthreads();
#pragma unroll 2
        for (int c = 0; c < TH_AT_B; c += 4) {
            float sv[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 x = th_ld4(S + (4 * ty + i) * TH_AT_LD + c);
                sv[i][0] = x.x, sv[i][1] = x.y, sv[i][2] = x.z, sv[i][3] = x.w;
            }
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
                float kv[DN];
                th_ld_row<DN>(Kn + (c + cc) * LDK + tx * DN, kv);
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < DN; j++) acc[i][j] += sv[i][cc] * kv[j];
            }
        }
    }
    float * dq = th_head(a.dq, bh);
    for (int i = 0; i < 4; i++) {
        const int row = q0 + 4 * ty + i;
        if (row >= T) continue;
        for (int j = 0; j < DN; j++) dq[(int64_t) row * a.dq.st + (int64_t) (tx * DN + j) * a.dq.sd] = acc[i][j];
    }
}

// --- bf16: the same three kernels on tensor cores (issue 32) ------------------------------------
// Under precision = bf16 (the node's stamp) the forward, the backward and dQ multiply bf16 tiles on
// the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulation), FlashAttention-2's tiling: a
// CTA of WARPS warps, each warp 16 rows of the CTA's 16 WARPS (queries in the forward and dQ, keys
// in the backward) against 64-row tiles of the other side. Q, K, V and dO are rounded to
// nearest bf16 as a tile reaches shared memory, P and dS as they enter a product (dS never
// reaches memory: dQ's kernel computes its tiles again); scores, the
// online softmax, L, D, P = exp(S - L) and every sum stay fp32, and the layouts, the nodes and the
// prep kernel are fp32's. A product's order is fixed by the mma's shape and the loops (no atomics,
// no split): the bits repeat, and since a warp's rows see the same 64-row tiles in the same order
// whatever WARPS is, they do not depend on it (8 warps). Every tile is kept row-major ([row][d]);
// where a product needs it as B along its rows (P V, P^T dO, dS^T Q, dS K), ldmatrix's transposing
// load gives the fragments, so no transposed copy (with its bank conflicts) is made.
// The tiles that a CTA walks through (K and V in the forward and dQ, Q, dO, L and D in the
// backward) are copied to fp32 staging in shared memory by cp.async one tile ahead, while the
// warps multiply the tile before (rounded to bf16 from the staging after a barrier): the loads'
// latency was most of these kernels' time with the copies made synchronously. An operand whose d
// is not adjacent or not 16-byte aligned loads synchronously, as before (the same values).
#define TH_MM_B 64                    // rows of the tiles a CTA walks through
#define TH_MM_PAD 8                   // bf16 padding a smem row: 32-bit fragment reads hit 32 banks

static __device__ __forceinline__ void th_mma16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t b0,
                                                   const uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats as a bf16 pair, `lo` in the low half (the lower column of a fragment)
static __device__ __forceinline__ uint32_t th_pack_bf16(const float lo, const float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(const uint32_t *) &h;
}

// x rounded to nearest TF32 (ties away: cvt.rna), as cuBLAS's TF32 products round their inputs
static __device__ __forceinline__ float th_tf32(const float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
}

static __device__ __forceinline__ uint32_t th_ld_pair(const __nv_bfloat16 * p) { return *(const uint32_t *) p; }

// whether head h of o can be staged by 16-byte copies: d adjacent, rows and the head 16-byte aligned
template <bool B16 = false>
static __device__ __forceinline__ bool th_stageable(const th_opd & o, const float * h) {
    return o.sd == 1 && o.st % (B16 ? 8 : 4) == 0 && (uintptr_t) h % 16 == 0;
}

// An operand's elements (B16: a bf16 operand's, else f32), and 16 bytes of them
template <bool B16> using th_elem = std::conditional_t<B16, __nv_bfloat16, float>;
template <bool B16> using th_vec16 = std::conditional_t<B16, uint4, float4>;

// stage NR rows from row0 of head h (st[r][d], HD elements a row, as they are: fp32, or with B16 a
// bf16 operand's in the staging's first half; rows at or past T zeros) by cp.async, 16 bytes a
// copy; completes at th_cp_wait. Only for th_stageable operands.
template <int HD, int NR, int NT, bool B16 = false>
static __device__ __forceinline__ void th_stage(float * st, const float * h, const th_opd & o, const int row0,
                                                const int T) {
    constexpr int PER = 16 / sizeof(th_elem<B16>);
    th_elem<B16> * to = (th_elem<B16> *) st;
    const th_elem<B16> * from = (const th_elem<B16> *) h;
    for (int i = threadIdx.x; i < NR * HD / PER; i += NT) {
        const int r = i / (HD / PER), d = PER * (i % (HD / PER));
        const bool in = row0 + r < T;
        th_cp_async<16>(to + r * HD + d, in ? from + (int64_t) (row0 + r) * o.st + d : from, in);
    }
}

// four floats into a tile of E at p (16-byte aligned for fp32, 8 for bf16): bf16 rounded to nearest
// even, or fp32 rounded to nearest TF32
static __device__ __forceinline__ void th_put4(__nv_bfloat16 * p, const float4 x) {
    *(uint2 *) p = make_uint2(th_pack_bf16(x.x, x.y), th_pack_bf16(x.z, x.w));
}
static __device__ __forceinline__ void th_put4(float * p, const float4 x) {
    *(float4 *) p = make_float4(th_tf32(x.x), th_tf32(x.y), th_tf32(x.z), th_tf32(x.w));
}

// 16 bytes of an operand (th_vec16) into a tile of E at p (8-byte aligned): four floats as th_put4
// rounds them, or eight bf16 as they are into a bf16 tile (a bf16 operand never fills a TF32 one)
static __device__ __forceinline__ void th_put16(__nv_bfloat16 * p, const float4 x) { th_put4(p, x); }
static __device__ __forceinline__ void th_put16(float * p, const float4 x) { th_put4(p, x); }
static __device__ __forceinline__ void th_put16(__nv_bfloat16 * p, const uint4 x) {
    *(uint2 *) p = make_uint2(x.x, x.y);
    *(uint2 *) (p + 4) = make_uint2(x.z, x.w);
}

// NR rows from row0 of head h into smem as rows[r][d] of E (ld ldr): bf16 rounded to nearest even,
// or fp32 rounded to nearest TF32 (th_tf32); rows at or past T zeros. From the staging where the
// operand is stageable (staged before), else loaded now along whichever of t and d is adjacent in
// memory. The same values either way.
// (B16: a bf16 operand, staged as it is and copied, or loaded and widened exactly: the same values
// as an f32 operand of those values gives)
template <typename E, int HD, int NR, int NT, bool B16 = false>
static __device__ __forceinline__ void th_fill_rows(E * rows, const int ldr, const float * st, const bool staged,
                                                    const float * h, const th_opd & o, const int row0, const int T) {
    constexpr bool TF32 = std::is_same<E, float>::value;
    constexpr int PER = 16 / sizeof(th_elem<B16>);
    if (staged) {
        for (int i = threadIdx.x; i < NR * HD / PER; i += NT) {
            const int r = i / (HD / PER), d = PER * (i % (HD / PER));
            th_put16(rows + r * ldr + d, *(const th_vec16<B16> *) ((const th_elem<B16> *) st + r * HD + d));
        }
        return;
    }
    const bool d_adjacent = o.sd == 1;
    for (int i = threadIdx.x; i < NR * HD; i += NT) {
        const int r = d_adjacent ? i / HD : i % NR, d = d_adjacent ? i % HD : i / NR;
        const int64_t at = (int64_t) (row0 + r) * o.st + (int64_t) d * o.sd;
        const float x = row0 + r >= T ? 0.0f : B16 ? __bfloat162float(((const __nv_bfloat16 *) h)[at]) : h[at];
        if constexpr (TF32) {
            rows[r * ldr + d] = th_tf32(x);
        } else {
            rows[r * ldr + d] = __float2bfloat16_rn(x);
        }
    }
}

// th_fill_rows of rows not staged (loaded now): by 16-byte loads where the operand is stageable, 4
// of a thread's issued before any is used (the latency of a CTA's first tiles), else as
// th_fill_rows loads them. The same values either way. (Not inside th_fill_rows: its walks'
// calls would carry this path's registers.)
template <typename E, int HD, int NR, int NT, bool B16 = false>
static __device__ __forceinline__ void th_load_rows(E * rows, const int ldr, const float * h, const th_opd & o,
                                                    const int row0, const int T) {
    if (th_stageable<B16>(o, h)) {               // 16 bytes a load (th_vec16), 4 of a thread's in flight
        constexpr int PER = 16 / sizeof(th_elem<B16>), N = (NR * HD / PER + NT - 1) / NT, NB = N < 4 ? N : 4;
        const th_elem<B16> * from = (const th_elem<B16> *) h;
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += NB) {
            th_vec16<B16> x[NB];
#pragma unroll
            for (int n = 0; n < NB; n++) {
                const int i = threadIdx.x + (n0 + n) * NT, r = i / (HD / PER), d = PER * (i % (HD / PER));
                const bool in = n0 + n < N && i < NR * HD / PER && row0 + r < T;
                x[n] = in ? *(const th_vec16<B16> *) (from + (int64_t) (row0 + r) * o.st + d) : th_vec16<B16>{};
            }
#pragma unroll
            for (int n = 0; n < NB; n++) {
                const int i = threadIdx.x + (n0 + n) * NT, r = i / (HD / PER), d = PER * (i % (HD / PER));
                if (n0 + n >= N || i >= NR * HD / PER) break;
                th_put16(rows + r * ldr + d, x[n]);
            }
        }
        return;
    }
    th_fill_rows<E, HD, NR, NT, B16>(rows, ldr, nullptr, false, h, o, row0, T);
}

// the A fragments (16 rows x HD, HD / 16 steps of k) of rows r0 .. r0 + 15 of a row-major tile
template <int HD>
static __device__ __forceinline__ void th_frag_a(uint32_t (&f)[HD / 16][4], const __nv_bfloat16 * t, const int ld,
                                                 const int r0) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const __nv_bfloat16 * p = t + (r0 + g) * ld + kk * 16 + c;
        f[kk][0] = th_ld_pair(p);
        f[kk][1] = th_ld_pair(p + 8 * ld);
        f[kk][2] = th_ld_pair(p + 8);
        f[kk][3] = th_ld_pair(p + 8 * ld + 8);
    }
}

// four 8 x 8 bf16 matrices by one ldmatrix (TRANS: transposed), lanes 8 m .. 8 m + 7 naming matrix
// m's rows (p: this lane's row, 16-byte aligned), into f[m]
template <bool TRANS>
static __device__ __forceinline__ void th_ldsm_x4(uint32_t (&f)[4], const __nv_bfloat16 * p) {
    const uint32_t addr = (uint32_t) __cvta_generic_to_shared(p);
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                     : "r"(addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                     : "r"(addr));
    }
}

// A fragments (16 rows x 16 of k) of rows r0 .. r0 + 15, columns k0 .. k0 + 15 of a row-major
// tile: lanes 0-15 name the rows at k0, lanes 16-31 at k0 + 8
static __device__ __forceinline__ void th_ldsm_a(uint32_t (&f)[4], const __nv_bfloat16 * t, const int ld,
                                                 const int r0, const int k0) {
    const int lane = threadIdx.x % 32;
    th_ldsm_x4<false>(f, t + (r0 + lane % 16) * ld + k0 + 8 * (lane / 16));
}

// B fragments of two 8-column tiles (n0, n0 + 8) and k0 .. k0 + 15 of a [n][k] row-major tile (B^T
// stored: the scores' products): b[0], b[1] for n0, b[2], b[3] for n0 + 8
static __device__ __forceinline__ void th_ldsm_bt(uint32_t (&b)[4], const __nv_bfloat16 * t, const int ld,
                                                  const int n0, const int k0) {
    const int lane = threadIdx.x % 32;
    th_ldsm_x4<false>(b, t + (n0 + lane % 8 + 8 * (lane / 16)) * ld + k0 + 8 * ((lane / 8) % 2));
}

// B fragments of two 8-column tiles (n0, n0 + 8), rows k0 .. k0 + 15 of a row-major [k][n] tile,
// by ldmatrix's transposing load: b[0], b[1] for n0, b[2], b[3] for n0 + 8
static __device__ __forceinline__ void th_ldsm_b_trans(uint32_t (&b)[4], const __nv_bfloat16 * t, const int ld,
                                                       const int k0, const int n0) {
    const int lane = threadIdx.x % 32;
    th_ldsm_x4<true>(b, t + (k0 + lane % 16) * ld + n0 + 8 * (lane / 16));
}

// acc[nt] (16 x 64: 8 tiles of 8 columns) = A (16 x HD, fragments) times B^T, B a row-major
// 64 x HD tile (B's row n is output column n): the scores' product. Two tiles' B fragments a
// ldmatrix (th_ldsm_bt: the registers two 32-bit loads a tile gave); each sum in kk's order, the
// eight sums a step at a time (so that a warp is not waiting on one mma's result for the next).
template <int HD>
static __device__ __forceinline__ void th_mm_rows(float (&acc)[8][4], const uint32_t (&a)[HD / 16][4],
                                                  const __nv_bfloat16 * b, const int ld) {
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {     // kk outer: 7 other sums between a sum's two steps
        uint32_t bf[4][4];
#pragma unroll
        for (int np = 0; np < 4; np++) th_ldsm_bt(bf[np], b, ld, 16 * np, 16 * kk);
#pragma unroll
        for (int np = 0; np < 4; np++) {
            th_mma16816(acc[2 * np], a[kk], bf[np][0], bf[np][1]);
            th_mma16816(acc[2 * np + 1], a[kk], bf[np][2], bf[np][3]);
        }
    }
}

// acc[nt] (16 x HD) += X (16 x 64, as the C fragments x[8][4] of a product, rounded to bf16 here)
// times Y (64 x HD), Y a row-major tile y[r][d] (ld ld); two tiles' B fragments a transposing
// ldmatrix (th_ldsm_b_trans)
template <int HD>
static __device__ __forceinline__ void th_mm_acc(float (&acc)[HD / 8][4], const float (&x)[8][4],
                                                 const __nv_bfloat16 * y, const int ld) {
#pragma unroll
    for (int j = 0; j < 4; j++) {              // 16 of the 64 at a time
        const uint32_t a[4] = {th_pack_bf16(x[2 * j][0], x[2 * j][1]), th_pack_bf16(x[2 * j][2], x[2 * j][3]),
                               th_pack_bf16(x[2 * j + 1][0], x[2 * j + 1][1]),
                               th_pack_bf16(x[2 * j + 1][2], x[2 * j + 1][3])};
#pragma unroll
        for (int np = 0; np < HD / 16; np++) {
            uint32_t b[4];
            th_ldsm_b_trans(b, y, ld, j * 16, np * 16);
            th_mma16816(acc[2 * np], a, b[0], b[1]);
            th_mma16816(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// shared memory of the three kernels (bytes): bf16 tiles (row ld HD + pad), fp32 staging
template <int HD, int WARPS>
static constexpr size_t th_fwd_mma_smem() {
    return 2 * (size_t) (16 * WARPS + 2 * TH_MM_B) * (HD + TH_MM_PAD) + 4 * (size_t) 2 * TH_MM_B * HD;
}
template <int HD, int WARPS>
static constexpr size_t th_dq_mma_smem() {          // the forward's: the rows (Q, then dO), K, V, staging
    return th_fwd_mma_smem<HD, WARPS>();
}

// The tensor-core kernels' shared steps (bf16 and tf32).
// a warp's C fragments of 16 x HD, zeroed
// --- Dropout on P, drawn inside the tensor-core kernels ------------------------------------------
// blocks.attention's dropout on the attention weights: O = (P * M) V with M the mask node of
// native/dropout_mask.h's stream, P's element (query row, key col) of head bh multiplied by the
// mask's element col + T (row + T bh), as ggml's nodes would multiply P by the mask node. The
// kernels draw those elements where they use them (the forward's P V, the backward's dV = (P M)^T dO
// and dS = scale P (dP M - D), dQ's dS again), so the (BH, T, T) mask never reaches memory.
// D = rowsum(dO * O) holds as it is: rowsum(P * dP M) = rowsum(dO * (P M) V). Off: no key
// (no dropout), or the key's enabled word 0 (evaluation), where th_dropout_block gives 1.
struct th_drop {
    bool on;
    int32_t key[TH_DROPOUT_KEY_WORDS];
    th_dropout_params p;
};

// a kernel's instance with DROP (launched where a.drop_key is set) draws the mask; without, every
// test of `on` is false at compile time, so those instances are the kernels without dropout
template <bool DROP>
static __device__ __forceinline__ th_drop th_drop_of(const th_attn_args & a) {
    th_drop d = {};
    d.on = DROP;
    if constexpr (DROP) {
#pragma unroll
        for (int j = 0; j < TH_DROPOUT_KEY_WORDS; j++) d.key[j] = a.drop_key[j];
        d.p = a.drop;
    }
    return d;
}

static __device__ __forceinline__ float th_pick4(const float (&m)[4], const unsigned w) {   // m[w], in registers
    return w == 0 ? m[0] : w == 1 ? m[1] : w == 2 ? m[2] : m[3];
}

static __device__ __forceinline__ uint64_t th_drop_index(const int T, const int bh, const int row, const int col) {
    return (uint64_t) col + (uint64_t) T * ((uint64_t) row + (uint64_t) T * (uint64_t) bh);
}

// the mask's elements (row, col) and (row, col + 1): one block of the stream where both are in it
static __device__ __forceinline__ float2 th_drop_pair(const th_drop & d, const int T, const int bh, const int row,
                                                      const int col) {
    const uint64_t i = th_drop_index(T, bh, row, col);
    const unsigned w = (unsigned) (i % 4);
    float m[4];
    th_dropout_block(m, i / 4, d.key, d.p);
    if (w != 3) return make_float2(th_pick4(m, w), th_pick4(m, w + 1));
    const float first = m[3];
    th_dropout_block(m, i / 4 + 1, d.key, d.p);
    return make_float2(first, m[0]);
}

// the mask's element (row, col)
static __device__ __forceinline__ float th_drop_at(const th_drop & d, const int T, const int bh, const int row,
                                                   const int col) {
    const uint64_t i = th_drop_index(T, bh, row, col);
    float m[4];
    th_dropout_block(m, i / 4, d.key, d.p);
    return th_pick4(m, (unsigned) (i % 4));
}

// the forward's P (th_softmax_block's C fragments: rows w0 + g, + 8, keys k0 + 8 nt + c, + 1)
// times the mask, after the softmax's sum took P itself
static __device__ __forceinline__ void th_drop_p(float (&s)[8][4], const th_drop & d, const int T, const int bh,
                                                 const int w0, const int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const float2 m = th_drop_pair(d, T, bh, w0 + g + 8 * r, k0 + nt * 8 + c);
            s[nt][2 * r] *= m.x;
            s[nt][2 * r + 1] *= m.y;
        }
}

template <int HD>
static __device__ __forceinline__ void th_zero(float (&x)[HD / 8][4]) {
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) x[nt][e] = 0.0f;
}

// The online softmax over a 64-key block (keys from k0) of a warp's 16 rows (from w0), their scores
// s (C fragments: rows g and g + 8, columns 2t, 2t + 1 of each 8) turned into P = exp(scale s - m)
// in place; the running maximum m, sum l and the output o rescaled (FlashAttention-2's order).
// WHOLE: a block inside the sequence whose every key every row sees, so no score to mask (the
// tests compile away; a finite score gives the same P either way).
template <int HD, bool WHOLE>
static __device__ __forceinline__ void th_softmax_block(float (&s)[8][4], float (&o)[HD / 8][4], float (&m)[2],
                                                        float (&l)[2], const th_attn_args & a, const int bh,
                                                        const int w0, const int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4), T = a.T;
#pragma unroll
    for (int r = 0; r < 2; r++) {                                   // rows g and g + 8
        const int row = w0 + g + 8 * r, first = WHOLE ? 0 : th_first_key(a, bh, row);
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = k0 + nt * 8 + c + e;
                float & x = s[nt][2 * r + e];
                x = !WHOLE && (col >= T || (a.causal && col > row) || col < first) ? -INFINITY : x * a.scale;
                mx = fmaxf(mx, x);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        const float alpha = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float & x = s[nt][2 * r + e];
                x = !WHOLE && x == -INFINITY ? 0.0f : expf(x - m_new);
                sum += x;
            }
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) o[nt][2 * r] *= alpha, o[nt][2 * r + 1] *= alpha;
    }
}
template <int HD>
static __device__ __forceinline__ void th_softmax_block(float (&s)[8][4], float (&o)[HD / 8][4], float (&m)[2],
                                                        float (&l)[2], const th_attn_args & a, const int bh,
                                                        const int w0, const int k0) {
    if (k0 + TH_MM_B <= a.T && !(a.causal && k0 + TH_MM_B - 1 > w0) && k0 >= th_first_key(a, bh, w0 + 15)) {
        th_softmax_block<HD, true>(s, o, m, l, a, bh, w0, k0);
    } else {
        th_softmax_block<HD, false>(s, o, m, l, a, bh, w0, k0);
    }
}

// the key blocks of TH_MM_B a CTA of `rows` queries from q0 walks through (causal: up to its last
// query's), from th_first_key_block's
static __device__ __forceinline__ int th_key_blocks(const th_attn_args & a, const int q0, const int rows) {
    const int q_end = q0 + rows < a.T ? q0 + rows : a.T;
    return ((a.causal ? q_end : a.T) + TH_MM_B - 1) / TH_MM_B;
}
// packed rows: the first key block a CTA of queries from q0 sees (its first query's example's); else 0
static __device__ __forceinline__ int th_first_key_block(const th_attn_args & a, const int bh, const int q0) {
    return th_first_key(a, bh, q0) / TH_MM_B;
}
// packed rows: the query blocks of TH_MM_B that see keys from k0 to `last` end here (those past the
// last key's example see none); else every block to T
static __device__ __forceinline__ int th_query_blocks_end(const th_attn_args & a, const int bh, const int last) {
    return (th_query_end(a, bh, last) + TH_MM_B - 1) / TH_MM_B;
}

// A walk over key blocks (the forward's, dQ's) takes block kb: the staged K and V (or, unstaged,
// read from memory) into the tiles Ks and Vs of E (th_fill_rows, row ld), and the next block's
// staging started; the barriers around keep the tiles and the staging apart
template <typename E, int HD, int NT, bool B16 = false>
static __device__ __forceinline__ void th_kv_block(const th_attn_args & a, const float * k, const float * v, E * Ks,
                                                   E * Vs, const int ld, float * Kst, float * Vst,
                                                   const bool k_staged, const bool v_staged, const int kb,
                                                   const int nkb) {
    const int k0 = kb * TH_MM_B, T = a.T;
    th_cp_wait();
    __syncthreads();                                                 // the staging holds kb; Ks, Vs free
    th_fill_rows<E, HD, TH_MM_B, NT, B16>(Ks, ld, Kst, k_staged, k, a.k, k0, T);
    th_fill_rows<E, HD, TH_MM_B, NT, B16>(Vs, ld, Vst, v_staged, v, a.v, k0, T);
    __syncthreads();                                                 // Ks, Vs hold kb; the staging free
    if (kb + 1 < nkb) {
        if (k_staged) th_stage<HD, TH_MM_B, NT, B16>(Kst, k, a.k, k0 + TH_MM_B, T);
        if (v_staged) th_stage<HD, TH_MM_B, NT, B16>(Vst, v, a.v, k0 + TH_MM_B, T);
    }
    th_cp_commit();
}

// a warp's 16 rows (from w0; C fragments, 16 x HD) times `scale` (one a row) into out's head h
// h16: the same elements' bf16 copy (each value rounded to nearest even, as th_to_bf16 would),
// the copy's element for h's at h16; f32 false: the copy alone
template <int HD>
static __device__ __forceinline__ void th_put_rows(const float (&x)[HD / 8][4], const float (&scale)[2], float * h,
                                                   const th_opd & out, const int w0, const int T,
                                                   __nv_bfloat16 * h16 = nullptr, const bool f32 = true) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = w0 + g + 8 * r;
        if (row >= T) continue;
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) {
            const float v0 = x[nt][2 * r] * scale[r], v1 = x[nt][2 * r + 1] * scale[r];
            const int64_t at = (int64_t) row * out.st + (int64_t) (nt * 8 + c) * out.sd;
            // (a copy's rows: the pair side by side, 4-byte aligned where every stride is even)
            if (h16 != nullptr && out.sd == 1 && ((out.st | out.sh | out.sb) & 1) == 0) {
                *(__nv_bfloat162 *) (h16 + at) = __floats2bfloat162_rn(v0, v1);
            } else if (h16 != nullptr) {
                h16[at] = __float2bfloat16_rn(v0);
                h16[at + out.sd] = __float2bfloat16_rn(v1);
            }
            if (f32) {
                h[at] = v0;
                h[at + out.sd] = v1;
            }
        }
    }
}

// the forward's end: O = o / l and L = m + log l of the warp's rows into the node
template <int HD>
static __device__ __forceinline__ void th_put_o(const float (&o)[HD / 8][4], const float (&m)[2], const float (&l)[2],
                                                const th_attn_args & a, const int bh, const int w0) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4), T = a.T;
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
    th_put_rows<HD>(o, inv, th_head(a.o, bh), a.o, w0, T);
    float * L = a.out + (int64_t) bh * ((int64_t) T * (HD + 1)) + (int64_t) T * HD;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = w0 + g + 8 * r;
        if (row < T && c == 0) L[row] = m[r] + logf(l[r]);
    }
}

// The tensor-core kernels' P = exp(scale S - L) of a score s the query sees (else 0) and dS = scale
// P (dP - D): one definition for the backward and dQ's kernels, which compute dS each, so that they
// compute the same values
static __device__ __forceinline__ float th_p_of(const float s, const float L, const float scale, const bool seen) {
    return seen ? expf(s * scale - L) : 0.0f;
}
static __device__ __forceinline__ float th_ds_of(const float p, const float dp, const float D, const float scale) {
    return p * (dp - D) * scale;
}

// The backward's chunk of 16 queries (from qc) against a warp's 16 keys (from w0): P from the
// scores s and L, dS = scale P (dP - D) from dP (TF32: dS rounded to TF32, as it enters dK's
// product), neither written: dQ's kernel computes dS again. Lq and Dq: the step's L and D from its
// first query, qc - q0 = 16 j. A chunk with keys all past its queries (causal) is skipped.
template <bool TF32>
static __device__ __forceinline__ void th_chunk_p_ds(float (&s)[2][4], float (&dp)[2][4], const float * Lq,
                                                     const float * Dq, const int j, const th_attn_args & a,
                                                     const int w0, const int qc, const th_drop & drop,
                                                     const int bh) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4), T = a.T;
    float lq[2][2], dq[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        const float2 l2 = *(const float2 *) (Lq + 16 * j + nt * 8 + c);
        const float2 d2 = *(const float2 *) (Dq + 16 * j + nt * 8 + c);
        lq[nt][0] = l2.x, lq[nt][1] = l2.y, dq[nt][0] = d2.x, dq[nt][1] = d2.y;
    }
    // WHOLE: a chunk inside the sequence whose every key every query sees, so no element to mask
    // (its tests compile away)
    auto p_and_ds = [&](auto whole_chunk) {
        constexpr bool WHOLE = decltype(whole_chunk)::value;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = w0 + g + 8 * (e / 2), qr = qc + nt * 8 + c + e % 2;
                const bool seen = WHOLE || th_sees(a, bh, qr, key);
                const float p = th_p_of(s[nt][e], lq[nt][e % 2], a.scale, seen);
                if (drop.on) {                           // P M into dV's product, dP M into dS
                    const float m = th_drop_at(drop, T, bh, qr, key);
                    s[nt][e] = p * m;
                    dp[nt][e] = th_ds_of(p, dp[nt][e] * m, dq[nt][e % 2], a.scale);
                } else {
                    s[nt][e] = p;
                    dp[nt][e] = th_ds_of(p, dp[nt][e], dq[nt][e % 2], a.scale);
                }
                if constexpr (TF32) dp[nt][e] = th_tf32(dp[nt][e]);
            }
    };
    if (w0 + 16 <= T && qc + 16 <= T && !(a.causal && w0 + 15 > qc) && w0 >= th_first_key(a, bh, qc + 15)) {
        p_and_ds(std::true_type{});
    } else {
        p_and_ds(std::false_type{});
    }
}

// dQ's P and dS of a warp's 16 queries (from w0, L lr and D dr of its rows g and g + 8) against 16
// keys (from kc): the C fragments s (scores) and dp (dP) of Q K^T and dO V^T, element (nt, e) at
// query w0 + g + 8 (e / 2), key kc + 8 nt + c + e % 2, turned into dS in dp (th_p_of, th_ds_of:
// the backward's values)
static __device__ __forceinline__ void th_dq_chunk_ds(const float (&s)[2][4], float (&dp)[2][4], const float (&lr)[2],
                                                      const float (&dr)[2], const th_attn_args & a, const int w0,
                                                      const int kc, const th_drop & drop, const int bh) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4), T = a.T;
    float2 m2 = make_float2(1.0f, 1.0f);
    auto p_and_ds = [&](auto whole_chunk) {            // WHOLE: every key seen by every query
        constexpr bool WHOLE = decltype(whole_chunk)::value;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = w0 + g + 8 * (e / 2), key = kc + nt * 8 + c + e % 2;
                const bool seen = WHOLE || th_sees(a, bh, row, key);
                float d = dp[nt][e];
                if (drop.on) {                           // dP M, the mask's pair drawn at the pair's first
                    if (e % 2 == 0) m2 = th_drop_pair(drop, T, bh, row, key);
                    d *= e % 2 == 0 ? m2.x : m2.y;
                }
                dp[nt][e] = th_ds_of(th_p_of(s[nt][e], lr[e / 2], a.scale, seen), d, dr[e / 2], a.scale);
            }
    };
    if (w0 + 16 <= T && kc + 16 <= T && !(a.causal && kc + 15 > w0) && kc >= th_first_key(a, bh, w0 + 15)) {
        p_and_ds(std::true_type{});
    } else {
        p_and_ds(std::false_type{});
    }
}

// dQ's L and D of a warp's rows g and g + 8 (from w0; a row past T: 0)
template <int HD>
static __device__ __forceinline__ void th_dq_rows_ld(float (&lr)[2], float (&dr)[2], const th_attn_args & a,
                                                     const int bh, const int w0) {
    const int g = (threadIdx.x % 32) / 4, T = a.T;
    const float * L = a.fwd + bh * ((int64_t) T * (HD + 1)) + (int64_t) T * HD;
    const float * D = a.scratch + bh * ((int64_t) T * (2 * HD + 1)) + 2 * (int64_t) T * HD;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = w0 + g + 8 * r;
        lr[r] = row < T ? L[row] : 0.0f;
        dr[r] = row < T ? D[row] : 0.0f;
    }
}

// the forward: one CTA a (head, 16 WARPS queries), the last query blocks first; a warp's 16 queries
// against the key blocks they see (causal: a warp skips the key blocks past its rows)
template <int HD, int WARPS, bool B16 = false, bool DROP = false>
static __global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) th_attn_fwd_mma_kernel(const th_attn_args a) {
    constexpr int LDR = HD + TH_MM_PAD, QR = 16 * WARPS, NT = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char th_mma_smem[];
    const th_drop drop = th_drop_of<DROP>(a);                   // dropout on P, or off (compiled away)
    __nv_bfloat16 * Qs = (__nv_bfloat16 *) th_mma_smem;           // [q][d]
    __nv_bfloat16 * Ks = Qs + QR * LDR;                            // [key][d]
    __nv_bfloat16 * Vs = Ks + TH_MM_B * LDR;                       // [key][d]
    float * Kst = (float *) (Vs + TH_MM_B * LDR), * Vst = Kst + TH_MM_B * HD;     // staging
    const int warp = threadIdx.x / 32;
    const int bh = blockIdx.x, nqb = gridDim.y, qb = nqb - 1 - blockIdx.y, q0 = qb * QR, T = a.T;
    const int w0 = q0 + 16 * warp;                                   // the warp's first query
    const float * q = th_head_as<B16>(a.q, bh), * k = th_head_as<B16>(a.k, bh), * v = th_head_as<B16>(a.v, bh);
    const bool k_staged = th_stageable<B16>(a.k, k), v_staged = th_stageable<B16>(a.v, v);
    const int nkb = th_key_blocks(a, q0, QR), kb0 = th_first_key_block(a, bh, q0);
    if (k_staged) th_stage<HD, TH_MM_B, NT, B16>(Kst, k, a.k, kb0 * TH_MM_B, T);
    if (v_staged) th_stage<HD, TH_MM_B, NT, B16>(Vst, v, a.v, kb0 * TH_MM_B, T);
    th_cp_commit();
    th_load_rows<__nv_bfloat16, HD, QR, NT, B16>(Qs, LDR, q, a.q, q0, T);
    __syncthreads();
    uint32_t qf[HD / 16][4];
    th_frag_a<HD>(qf, Qs, LDR, 16 * warp);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[HD / 8][4];
    th_zero<HD>(o);
    const int warp_first_key = th_first_key(a, bh, w0);              // packed rows; else 0
    for (int kb = kb0; kb < nkb; kb++) {
        const int k0 = kb * TH_MM_B;
        th_kv_block<__nv_bfloat16, HD, NT, B16>(a, k, v, Ks, Vs, LDR, Kst, Vst, k_staged, v_staged, kb, nkb);
        if ((a.causal && k0 > w0 + 15) || k0 + TH_MM_B <= warp_first_key) continue;   // the same for the whole warp
        float s[8][4];
        th_mm_rows<HD>(s, qf, Ks, LDR);
        th_softmax_block<HD>(s, o, m, l, a, bh, w0, k0);
        if (drop.on) th_drop_p(s, drop, T, bh, w0, k0);
        th_mm_acc<HD>(o, s, Vs, LDR);
    }
    th_put_o<HD>(o, m, l, a, bh, w0);
}

// The two backward kernels' shared steps. Stage a step's Q and dO (head bh, queries q0 ..) into
// the fp32 staging where they can be copied by 16 bytes, and its L and D into ld (64 each).
template <int HD, int NT, bool B16 = false>
static __device__ __forceinline__ void th_bwd_stage(const th_attn_args & a, const int bh, const int q0, float * Qst,
                                                    float * dOst, float * ld) {
    const int T = a.T;
    const float * q = th_head_as<B16>(a.q, bh), * dout = th_head(a.dout, bh);
    if (th_stageable<B16>(a.q, q)) th_stage<HD, TH_MM_B, NT, B16>(Qst, q, a.q, q0, T);
    if (th_stageable(a.dout, dout)) th_stage<HD, TH_MM_B, NT>(dOst, dout, a.dout, q0, T);
    const float * L = a.fwd + bh * ((int64_t) T * (HD + 1)) + (int64_t) T * HD;
    const float * D = a.scratch + bh * ((int64_t) T * (2 * HD + 1)) + 2 * (int64_t) T * HD;
    for (int r = threadIdx.x; r < 2 * TH_MM_B; r += NT) {
        const int qr = q0 + r % TH_MM_B;                             // a padded query's L and D: 0 (its P is 0)
        th_cp_async<4>(ld + r, qr < T ? (r < TH_MM_B ? L : D) + qr : L, qr < T);
    }
}

// a step of the backward starts: its Q and dO (head bh, queries q0 ..) staged (waited for here)
// into the tiles Qs and dOs of E (th_fill_rows), the staging then free (the barriers around)
template <typename E, int HD, int NT, bool B16 = false>
static __device__ __forceinline__ void th_bwd_step_tiles(const th_attn_args & a, const int bh, const int q0, E * Qs,
                                                         E * dOs, const int ld, const float * Qst, const float * dOst) {
    const float * q = th_head_as<B16>(a.q, bh), * dout = th_head(a.dout, bh);
    th_cp_wait();
    __syncthreads();                                                 // the step staged; Qs, dOs free
    th_fill_rows<E, HD, TH_MM_B, NT, B16>(Qs, ld, Qst, th_stageable<B16>(a.q, q), q, a.q, q0, a.T);
    th_fill_rows<E, HD, TH_MM_B, NT>(dOs, ld, dOst, th_stageable(a.dout, dout), dout, a.dout, q0, a.T);
    __syncthreads();                                                 // Qs, dOs hold the step; the staging free
}

// a warp's dK and dV (its 16 keys from w0; C fragments) into kv head kvh's, as query head gr of
// a group of G adds them (th_put_grouped)
template <int HD>
static __device__ __forceinline__ void th_bwd_put(const th_attn_args & a, const int kvh, const int w0, const int G,
                                                  const int gr, const float (&dk)[HD / 8][4],
                                                  const float (&dv)[HD / 8][4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    float * dk_out = th_head(a.dk, kvh), * dv_out = th_head(a.dv, kvh);
    if (a.dk16.p != nullptr || a.dv16.p != nullptr) {   // (bf16 copies: one query head a kv head, G 1)
        const float one[2] = {1.0f, 1.0f};
        th_put_rows<HD>(dk, one, dk_out, a.dk, w0, a.T, th_copy_at(a.dk16, dk_out), !a.dk16.alone);
        th_put_rows<HD>(dv, one, dv_out, a.dv, w0, a.T, th_copy_at(a.dv16, dv_out), !a.dv16.alone);
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int key = w0 + g + 8 * h;
        if (key >= a.T) continue;
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int64_t d = nt * 8 + c + e;
                th_put_grouped(dk_out + key * a.dk.st + d * a.dk.sd, dk[nt][2 * h + e], G, gr);
                th_put_grouped(dv_out + key * a.dv.st + d * a.dv.sd, dv[nt][2 * h + e], G, gr);
            }
    }
}

// the backward: one CTA a (kv head, 16 WARPS keys), a warp 16 keys, over the query blocks that see
// them, each query head of a group in turn: S^T = K Q^T and dP^T = V dO^T, P^T = exp(scale S^T -
// L), dS^T = scale P^T (dP^T - D) (not written: dQ's kernel computes it again), dV += P^T dO,
// dK += dS^T Q, by chunks of 16 queries: a warp holds the scores and dP of 16 queries at a time
// (16 registers, not 64) and reads K's and V's fragments from shared memory, so that two CTAs
// (MINB) fit an SM: twice the warps to hide the latencies of a step that is mostly not mma.
// A chunk whose queries see none of the warp's keys is skipped.
// gpt2-small's bf16 step (H100): 3.95 -> 3.23 ms of backward, 24.97 -> 24.24 ms a step.
template <int HD, int WARPS, bool GROUPED, int MINB, bool B16 = false, bool DROP = false>
static __global__ void __launch_bounds__(32 * WARPS, MINB) th_attn_bwd_chunk_kernel(const th_attn_args a) {
    constexpr int LDR = HD + TH_MM_PAD, KR = 16 * WARPS, NT = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char th_mma_smem[];
    const th_drop drop = th_drop_of<DROP>(a);                   // dropout on P, or off (compiled away)
    __nv_bfloat16 * Ks = (__nv_bfloat16 *) th_mma_smem;           // [key][d], the CTA's keys
    __nv_bfloat16 * Vs = Ks + KR * LDR;                            // [key][d]
    __nv_bfloat16 * Qs = Vs + KR * LDR;                            // [q][d], a step's queries
    __nv_bfloat16 * dOs = Qs + TH_MM_B * LDR;                      // [q][d]
    float * Qst = (float *) (dOs + TH_MM_B * LDR), * dOst = Qst + TH_MM_B * HD;   // staging
    float * LD = dOst + TH_MM_B * HD;                              // [2 steps][L 64, D 64]
    const int warp = threadIdx.x / 32;
    const int kvh = blockIdx.x, G = GROUPED ? a.group : 1, k0 = blockIdx.y * KR, T = a.T;
    // the query blocks that see the CTA's keys (packed rows: to the last key's example's end)
    const int nqb = th_query_blocks_end(a, kvh * G, k0 + KR - 1), qb0 = a.causal ? k0 / TH_MM_B : 0, nq = nqb - qb0;
    const int w0 = k0 + 16 * warp;                                   // the warp's first key
    const int warp_query_end = th_query_end(a, kvh * G, w0 + 15);    // packed rows; else T
    const float * k = th_head_as<B16>(a.k, kvh * G), * v = th_head_as<B16>(a.v, kvh * G);
    auto stage = [&](const int gr, const int qb, const int i) {
        th_bwd_stage<HD, NT, B16>(a, kvh * G + gr, qb * TH_MM_B, Qst, dOst, LD + (i % 2) * 2 * TH_MM_B);
    };
    stage(0, qb0, 0);
    th_cp_commit();
    th_load_rows<__nv_bfloat16, HD, KR, NT, B16>(Ks, LDR, k, a.k, k0, T);
    th_load_rows<__nv_bfloat16, HD, KR, NT, B16>(Vs, LDR, v, a.v, k0, T);
    float dv[HD / 8][4], dk[HD / 8][4];
    int gr = 0, qb = qb0;                                            // step i: head kvh G + gr, query block qb
    for (int i = 0; i < G * nq; i++) {
        const int bh = kvh * G + gr, q0 = qb * TH_MM_B;
        if (qb == qb0) th_zero<HD>(dv), th_zero<HD>(dk);
        th_bwd_step_tiles<__nv_bfloat16, HD, NT, B16>(a, bh, q0, Qs, dOs, LDR, Qst, dOst);
        const int next_gr = qb + 1 < nqb ? gr : gr + 1, next_qb = qb + 1 < nqb ? qb + 1 : qb0;
        if (i + 1 < G * nq) stage(next_gr, next_qb, i + 1);
        th_cp_commit();
        if (!(a.causal && w0 > q0 + TH_MM_B - 1) && q0 < warp_query_end) {
            const float * Lq = LD + (i % 2) * 2 * TH_MM_B, * Dq = Lq + TH_MM_B;
#pragma unroll
            for (int j = 0; j < TH_MM_B / 16; j++) {
                const int qc = q0 + 16 * j;                          // the chunk's first query
                if ((a.causal && w0 > qc + 15) || qc >= warp_query_end) continue;   // no query of the chunk sees the keys
                float s[2][4], dp[2][4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++) {
                    uint32_t af[4], bf[4];
                    th_ldsm_a(af, Ks, LDR, 16 * warp, 16 * kk);
                    th_ldsm_bt(bf, Qs, LDR, 16 * j, 16 * kk);
                    th_mma16816(s[0], af, bf[0], bf[1]);
                    th_mma16816(s[1], af, bf[2], bf[3]);
                    th_ldsm_a(af, Vs, LDR, 16 * warp, 16 * kk);
                    th_ldsm_bt(bf, dOs, LDR, 16 * j, 16 * kk);
                    th_mma16816(dp[0], af, bf[0], bf[1]);
                    th_mma16816(dp[1], af, bf[2], bf[3]);
                }
                th_chunk_p_ds<false>(s, dp, Lq, Dq, j, a, w0, qc, drop, bh);
                // dV += P^T dO and dK += dS^T Q over the chunk's 16 queries (A: the C fragments
                // above, rounded to bf16 as th_mm_acc rounds them)
                const uint32_t pa[4] = {th_pack_bf16(s[0][0], s[0][1]), th_pack_bf16(s[0][2], s[0][3]),
                                        th_pack_bf16(s[1][0], s[1][1]), th_pack_bf16(s[1][2], s[1][3])};
                const uint32_t sa[4] = {th_pack_bf16(dp[0][0], dp[0][1]), th_pack_bf16(dp[0][2], dp[0][3]),
                                        th_pack_bf16(dp[1][0], dp[1][1]), th_pack_bf16(dp[1][2], dp[1][3])};
#pragma unroll
                for (int nt = 0; nt < HD / 8; nt += 2) {
                    uint32_t b[4];
                    th_ldsm_b_trans(b, dOs, LDR, 16 * j, nt * 8);
                    th_mma16816(dv[nt], pa, b[0], b[1]);
                    th_mma16816(dv[nt + 1], pa, b[2], b[3]);
                    th_ldsm_b_trans(b, Qs, LDR, 16 * j, nt * 8);
                    th_mma16816(dk[nt], sa, b[0], b[1]);
                    th_mma16816(dk[nt + 1], sa, b[2], b[3]);
                }
            }
        }
        if (qb == nqb - 1) th_bwd_put<HD>(a, kvh, w0, G, gr, dk, dv);
        gr = next_gr, qb = next_qb;
    }
}

template <int HD, int WARPS>
static constexpr size_t th_bwd_chunk_smem() {
    return 2 * (size_t) (2 * 16 * WARPS + 2 * TH_MM_B) * (HD + TH_MM_PAD) + 4 * ((size_t) 2 * TH_MM_B * HD + 4 * TH_MM_B);
}

// dQ = dS K without dS in memory: one CTA a (head, 16 WARPS queries), a warp 16 queries, over the
// key blocks they see (causal: up to the diagonal's of the warp's rows), keys in order, the last
// query blocks first; the next key block's K and V staged while this one multiplies (as the
// forward's). For each 16 keys the warp computes again what the backward computed of dS:
// S = Q K^T and dP = dO V^T (each element the backward's S^T or dP^T element, the same 16-term
// mma sums over d in the same order: the same fp32 values), P = exp(scale S - L), dS = scale P
// (dP - D), then dQ += dS K with dS rounded to bf16 as it enters the product (its A fragments
// straight from the C fragments), in the order the kernel that read the backward's dS summed:
// so the same bits, and the (B*H, T, T) dS (192 MiB a gpt2-small layer) is never formed, for two
// more products a tile. Keys past every row of the warp (causal) are skipped: their dS is 0.
template <int HD, int WARPS, bool B16 = false, bool DROP = false>
static __global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) th_attn_dq_mma_kernel(const th_attn_args a) {
    constexpr int LDR = HD + TH_MM_PAD, QR = 16 * WARPS, NT = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char th_mma_smem[];
    const th_drop drop = th_drop_of<DROP>(a);                   // dropout on P, or off (compiled away)
    __nv_bfloat16 * Rs = (__nv_bfloat16 *) th_mma_smem;           // [q][d]: Q's rows, then dO's
    __nv_bfloat16 * Ks = Rs + QR * LDR;                            // [key][d]
    __nv_bfloat16 * Vs = Ks + TH_MM_B * LDR;                       // [key][d]
    float * Kst = (float *) (Vs + TH_MM_B * LDR), * Vst = Kst + TH_MM_B * HD;     // staging
    const int warp = threadIdx.x / 32;
    const int bh = blockIdx.x, nqb = gridDim.y, q0 = (nqb - 1 - blockIdx.y) * QR, T = a.T;
    const int w0 = q0 + 16 * warp;                                   // the warp's first query
    const float * q = th_head_as<B16>(a.q, bh), * k = th_head_as<B16>(a.k, bh), * v = th_head_as<B16>(a.v, bh);
    const float * dout = th_head(a.dout, bh);
    const bool k_staged = th_stageable<B16>(a.k, k), v_staged = th_stageable<B16>(a.v, v);
    const int nkb = th_key_blocks(a, q0, QR), kb0 = th_first_key_block(a, bh, q0);
    if (k_staged) th_stage<HD, TH_MM_B, NT, B16>(Kst, k, a.k, kb0 * TH_MM_B, T);
    if (v_staged) th_stage<HD, TH_MM_B, NT, B16>(Vst, v, a.v, kb0 * TH_MM_B, T);
    th_cp_commit();
    // the warp's Q and dO as A fragments, and L and D of its rows g and g + 8 (a row past T: 0)
    uint32_t qf[HD / 16][4], of[HD / 16][4];
    th_load_rows<__nv_bfloat16, HD, QR, NT, B16>(Rs, LDR, q, a.q, q0, T);
    __syncthreads();
    th_frag_a<HD>(qf, Rs, LDR, 16 * warp);
    __syncthreads();
    th_load_rows<__nv_bfloat16, HD, QR, NT>(Rs, LDR, dout, a.dout, q0, T);
    __syncthreads();
    th_frag_a<HD>(of, Rs, LDR, 16 * warp);
    float lr[2], dr[2];
    th_dq_rows_ld<HD>(lr, dr, a, bh, w0);
    float acc[HD / 8][4];
    th_zero<HD>(acc);
    const int warp_first_key = th_first_key(a, bh, w0);              // packed rows; else 0
    for (int kb = kb0; kb < nkb; kb++) {
        const int k0 = kb * TH_MM_B;
        th_kv_block<__nv_bfloat16, HD, NT, B16>(a, k, v, Ks, Vs, LDR, Kst, Vst, k_staged, v_staged, kb, nkb);
#pragma unroll
        for (int j = 0; j < TH_MM_B / 16; j++) {
            const int kc = k0 + 16 * j;                              // the chunk's first key
            if (a.causal && kc > w0 + 15) break;                     // the same for the whole warp
            if (kc + 16 <= warp_first_key) continue;                 // before every row's example
            float s[2][4], dp[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
            // step kk's fragments loaded while step kk - 1 multiplies (two sets of registers)
            uint32_t bk[2][4], bv[2][4];
            th_ldsm_bt(bk[0], Ks, LDR, 16 * j, 0);
            th_ldsm_bt(bv[0], Vs, LDR, 16 * j, 0);
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const int n = kk % 2;
                if (kk + 1 < HD / 16) {
                    th_ldsm_bt(bk[1 - n], Ks, LDR, 16 * j, 16 * (kk + 1));
                    th_ldsm_bt(bv[1 - n], Vs, LDR, 16 * j, 16 * (kk + 1));
                }
                th_mma16816(s[0], qf[kk], bk[n][0], bk[n][1]);
                th_mma16816(s[1], qf[kk], bk[n][2], bk[n][3]);
                th_mma16816(dp[0], of[kk], bv[n][0], bv[n][1]);
                th_mma16816(dp[1], of[kk], bv[n][2], bv[n][3]);
            }
            th_dq_chunk_ds(s, dp, lr, dr, a, w0, kc, drop, bh);
            const uint32_t sa[4] = {th_pack_bf16(dp[0][0], dp[0][1]), th_pack_bf16(dp[0][2], dp[0][3]),
                                    th_pack_bf16(dp[1][0], dp[1][1]), th_pack_bf16(dp[1][2], dp[1][3])};
            uint32_t b[HD / 16][4];                                  // every step's fragments first
#pragma unroll
            for (int nt = 0; nt < HD / 8; nt += 2) th_ldsm_b_trans(b[nt / 2], Ks, LDR, 16 * j, nt * 8);
#pragma unroll
            for (int nt = 0; nt < HD / 8; nt += 2) {
                th_mma16816(acc[nt], sa, b[nt / 2][0], b[nt / 2][1]);
                th_mma16816(acc[nt + 1], sa, b[nt / 2][2], b[nt / 2][3]);
            }
        }
    }
    const float one[2] = {1.0f, 1.0f};
    float * h = th_head(a.dq, bh);
    th_put_rows<HD>(acc, one, h, a.dq, w0, T, th_copy_at(a.dq16, h), !a.dq16.alone);
}

// --- tf32: the three kernels on tensor cores at precision = tf32 (issue 32) --------------------
// Under precision = tf32 the forward, the backward and dQ multiply on the tensor cores in TF32
// (mma.sync m16n8k8, fp32 accumulation), as the products of a tf32 step do in cuBLAS: each operand
// rounded to nearest TF32 (cvt.rna) as a tile reaches shared memory, P and dS as they enter a
// product; scores, the online softmax, L, D and every sum fp32 (dS not written, as at bf16). The
// tiles and steps are the bf16 kernels' (64-row tiles, a warp 16 rows, the backward by chunks of
// 16 queries), in fp32 rows padded to HD + 4 floats, so that the fragments' 32-bit reads hit 32
// banks. Where a product sums over keys (P V) or queries (P^T dO, dS^T Q) the k index runs in a
// permuted order within each group of 8 (column t of A and row t of B: key 2t; t + 4: key 2t + 1),
// so that a C fragment of the scores is the A fragment of the next product as it stands.
#define TH_TF_PAD 4

// c += A (16 x 8: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)) times B (8 x 8:
// b0 (t, g), b1 (t + 4, g)), TF32 in, fp32 accumulation
static __device__ __forceinline__ void th_mma1688(float (&c)[4], const float a0, const float a1, const float a2,
                                                  const float a3, const float b0, const float b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)), "r"(__float_as_uint(a3)),
          "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// c += X times B, X the C fragments (16 x 8) of an earlier product (its columns the k index, in the
// permuted order: x[0], x[1] at k 2t, 2t + 1 of row g, x[2], x[3] of row g + 8), rounded to TF32
static __device__ __forceinline__ void th_mma1688_c(float (&c)[4], const float (&x)[4], const float b0,
                                                    const float b1) {
    th_mma1688(c, th_tf32(x[0]), th_tf32(x[2]), th_tf32(x[1]), th_tf32(x[3]), b0, b1);
}

// acc[nt] (16 x 64: 8 tiles of 8 columns) = A times B^T, A rows r0 .. r0 + 15 of a row-major
// [row][d] tile, B a row-major [n][d] tile of 64 rows (the scores' products)
template <int HD>
static __device__ __forceinline__ void th_tf_rows(float (&acc)[8][4], const float * a, const int r0, const float * b,
                                                  const int ld) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 8; kk++) {
        const float * pa = a + (r0 + g) * ld + kk * 8 + t;
        const float a0 = pa[0], a1 = pa[8 * ld], a2 = pa[4], a3 = pa[8 * ld + 4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const float * pb = b + (nt * 8 + g) * ld + kk * 8 + t;
            th_mma1688(acc[nt], a0, a1, a2, a3, pb[0], pb[4]);
        }
    }
}

template <int HD, int WARPS>
static constexpr size_t th_fwd_tf_smem() {
    return 4 * ((size_t) (16 * WARPS + 2 * TH_MM_B) * (HD + TH_TF_PAD) + (size_t) 2 * TH_MM_B * HD);
}
template <int HD, int WARPS>
static constexpr size_t th_bwd_tf_smem() {
    return 4 * ((size_t) (2 * 16 * WARPS + 2 * TH_MM_B) * (HD + TH_TF_PAD) + (size_t) 2 * TH_MM_B * HD + 4 * TH_MM_B);
}
template <int HD, int WARPS>
static constexpr size_t th_dq_tf_smem() {           // the forward's: the rows (Q, then dO), K, V, staging
    return th_fwd_tf_smem<HD, WARPS>();
}

// the forward in TF32: th_attn_fwd_mma_kernel's walk (a CTA 16 WARPS queries, a warp 16, key blocks
// of 64 staged one ahead), Q's fragments read from shared memory each block
template <int HD, int WARPS, bool DROP = false>
static __global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) th_attn_fwd_tf_kernel(const th_attn_args a) {
    constexpr int LDF = HD + TH_TF_PAD, QR = 16 * WARPS, NT = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char th_mma_smem[];
    const th_drop drop = th_drop_of<DROP>(a);                   // dropout on P, or off (compiled away)
    float * Qs = (float *) th_mma_smem;                            // [q][d]
    float * Ks = Qs + QR * LDF, * Vs = Ks + TH_MM_B * LDF;         // [key][d]
    float * Kst = Vs + TH_MM_B * LDF, * Vst = Kst + TH_MM_B * HD;  // staging
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, c = 2 * t;
    const int bh = blockIdx.x, nqb = gridDim.y, qb = nqb - 1 - blockIdx.y, q0 = qb * QR, T = a.T;
    const int w0 = q0 + 16 * warp;
    const float * q = th_head(a.q, bh), * k = th_head(a.k, bh), * v = th_head(a.v, bh);
    const bool k_staged = th_stageable(a.k, k), v_staged = th_stageable(a.v, v);
    const int nkb = th_key_blocks(a, q0, QR), kb0 = th_first_key_block(a, bh, q0);
    if (k_staged) th_stage<HD, TH_MM_B, NT>(Kst, k, a.k, kb0 * TH_MM_B, T);
    if (v_staged) th_stage<HD, TH_MM_B, NT>(Vst, v, a.v, kb0 * TH_MM_B, T);
    th_cp_commit();
    th_load_rows<float, HD, QR, NT>(Qs, LDF, q, a.q, q0, T);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[HD / 8][4];
    th_zero<HD>(o);
    const int warp_first_key = th_first_key(a, bh, w0);              // packed rows; else 0
    for (int kb = kb0; kb < nkb; kb++) {
        const int k0 = kb * TH_MM_B;
        th_kv_block<float, HD, NT>(a, k, v, Ks, Vs, LDF, Kst, Vst, k_staged, v_staged, kb, nkb);
        if ((a.causal && k0 > w0 + 15) || k0 + TH_MM_B <= warp_first_key) continue;
        float s[8][4];
        th_tf_rows<HD>(s, Qs, 16 * warp, Ks, LDF);
        th_softmax_block<HD>(s, o, m, l, a, bh, w0, k0);
        if (drop.on) th_drop_p(s, drop, T, bh, w0, k0);
        // O += P V over the block's keys, 8 at a time (keys nt 8 + 2t, + 1: this thread's columns)
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const float * pv = Vs + (nt * 8 + c) * LDF + g;
#pragma unroll
            for (int dn = 0; dn < HD / 8; dn++) th_mma1688_c(o[dn], s[nt], pv[dn * 8], pv[LDF + dn * 8]);
        }
    }
    th_put_o<HD>(o, m, l, a, bh, w0);
}

// the backward in TF32: th_attn_bwd_chunk_kernel's walk (a CTA 16 WARPS keys of a query head, a
// warp 16 keys, a step 64 queries by chunks of 16), K's and V's fragments from shared memory; dS
// not written (dQ's kernel computes it again). One CTA an SM (its tiles are fp32).
template <int HD, int WARPS, bool DROP = false>
static __global__ void __launch_bounds__(32 * WARPS) th_attn_bwd_tf_kernel(const th_attn_args a) {
    constexpr int LDF = HD + TH_TF_PAD, KR = 16 * WARPS, NT = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char th_mma_smem[];
    const th_drop drop = th_drop_of<DROP>(a);                   // dropout on P, or off (compiled away)
    float * Ks = (float *) th_mma_smem, * Vs = Ks + KR * LDF;     // [key][d], the CTA's keys
    float * Qs = Vs + KR * LDF, * dOs = Qs + TH_MM_B * LDF;        // [q][d], a step's queries
    float * Qst = dOs + TH_MM_B * LDF, * dOst = Qst + TH_MM_B * HD;   // staging
    float * LD = dOst + TH_MM_B * HD;                              // [2 steps][L 64, D 64]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, c = 2 * t;
    const int kvh = blockIdx.x, k0 = blockIdx.y * KR, T = a.T;
    const int nqb = th_query_blocks_end(a, kvh, k0 + KR - 1), qb0 = a.causal ? k0 / TH_MM_B : 0;
    const int w0 = k0 + 16 * warp, warp_query_end = th_query_end(a, kvh, w0 + 15);
    const float * k = th_head(a.k, kvh), * v = th_head(a.v, kvh);
    th_bwd_stage<HD, NT>(a, kvh, qb0 * TH_MM_B, Qst, dOst, LD);
    th_cp_commit();
    th_load_rows<float, HD, KR, NT>(Ks, LDF, k, a.k, k0, T);
    th_load_rows<float, HD, KR, NT>(Vs, LDF, v, a.v, k0, T);
    float dv[HD / 8][4], dk[HD / 8][4];
    th_zero<HD>(dv), th_zero<HD>(dk);
    for (int qb = qb0; qb < nqb; qb++) {
        const int i = qb - qb0, q0 = qb * TH_MM_B;
        th_bwd_step_tiles<float, HD, NT>(a, kvh, q0, Qs, dOs, LDF, Qst, dOst);
        if (qb + 1 < nqb) th_bwd_stage<HD, NT>(a, kvh, q0 + TH_MM_B, Qst, dOst, LD + ((i + 1) % 2) * 2 * TH_MM_B);
        th_cp_commit();
        if ((a.causal && w0 > q0 + TH_MM_B - 1) || q0 >= warp_query_end) continue;
        const float * Lq = LD + (i % 2) * 2 * TH_MM_B, * Dq = Lq + TH_MM_B;
#pragma unroll
        for (int j = 0; j < TH_MM_B / 16; j++) {
            const int qc = q0 + 16 * j;
            if ((a.causal && w0 > qc + 15) || qc >= warp_query_end) continue;   // no query of the chunk sees the keys
            float s[2][4], dp[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 8; kk++) {
                const float * pk = Ks + (16 * warp + g) * LDF + kk * 8 + t, * pv = Vs + (16 * warp + g) * LDF + kk * 8 + t;
                const float * pq = Qs + (16 * j + g) * LDF + kk * 8 + t, * po = dOs + (16 * j + g) * LDF + kk * 8 + t;
                const float k0f = pk[0], k1f = pk[8 * LDF], k2f = pk[4], k3f = pk[8 * LDF + 4];
                const float v0f = pv[0], v1f = pv[8 * LDF], v2f = pv[4], v3f = pv[8 * LDF + 4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    th_mma1688(s[nt], k0f, k1f, k2f, k3f, pq[nt * 8 * LDF], pq[nt * 8 * LDF + 4]);
                    th_mma1688(dp[nt], v0f, v1f, v2f, v3f, po[nt * 8 * LDF], po[nt * 8 * LDF + 4]);
                }
            }
            th_chunk_p_ds<true>(s, dp, Lq, Dq, j, a, w0, qc, drop, kvh);
            // dV += P^T dO, dK += dS^T Q over the chunk's queries, 8 at a time (queries 8 nt + 2t, + 1)
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const float * po = dOs + (16 * j + nt * 8 + c) * LDF + g, * pq = Qs + (16 * j + nt * 8 + c) * LDF + g;
#pragma unroll
                for (int dn = 0; dn < HD / 8; dn++) {
                    th_mma1688_c(dv[dn], s[nt], po[dn * 8], po[LDF + dn * 8]);
                    th_mma1688_c(dk[dn], dp[nt], pq[dn * 8], pq[LDF + dn * 8]);
                }
            }
        }
    }
    th_bwd_put<HD>(a, kvh, w0, 1, 0, dk, dv);
}

// dQ = dS K in TF32 without dS in memory: th_attn_dq_mma_kernel's walk and steps with TF32's mma
// (m16n8k8): per 16 keys S = Q K^T and dP = dO V^T over d in the backward's fragment order (the
// same fp32 values as its S^T and dP^T), dS with its expressions, rounded to TF32 as it enters
// dQ's product (A straight from the C fragments, keys in the permuted order as the backward's dK
// product takes them), keys summed in the order the kernel that read the backward's dS summed
// them. Q's fragments are held in registers, dO's read from its rows in shared memory: two CTAs
// an SM (some registers spilled), 2.81 ms of a gpt2-small step against 3.37 with dO's fragments
// in registers too (192 registers, one CTA an SM).
template <int HD, int WARPS, bool DROP = false>
static __global__ void __launch_bounds__(32 * WARPS, 16 / WARPS) th_attn_dq_tf_kernel(const th_attn_args a) {
    constexpr int LDF = HD + TH_TF_PAD, QR = 16 * WARPS, NT = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char th_mma_smem[];
    const th_drop drop = th_drop_of<DROP>(a);                   // dropout on P, or off (compiled away)
    float * Rs = (float *) th_mma_smem;                            // [q][d]: Q's rows, then dO's
    float * Ks = Rs + QR * LDF, * Vs = Ks + TH_MM_B * LDF;         // [key][d]
    float * Kst = Vs + TH_MM_B * LDF, * Vst = Kst + TH_MM_B * HD;  // staging
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, c = 2 * t;
    const float * dOs = Rs + (16 * warp + g) * LDF + t;            // the warp's dO rows (a0 of d 0)
    const int bh = blockIdx.x, nqb = gridDim.y, q0 = (nqb - 1 - blockIdx.y) * QR, T = a.T;
    const int w0 = q0 + 16 * warp;
    const float * q = th_head(a.q, bh), * k = th_head(a.k, bh), * v = th_head(a.v, bh);
    const float * dout = th_head(a.dout, bh);
    const bool k_staged = th_stageable(a.k, k), v_staged = th_stageable(a.v, v);
    const int nkb = th_key_blocks(a, q0, QR), kb0 = th_first_key_block(a, bh, q0);
    if (k_staged) th_stage<HD, TH_MM_B, NT>(Kst, k, a.k, kb0 * TH_MM_B, T);
    if (v_staged) th_stage<HD, TH_MM_B, NT>(Vst, v, a.v, kb0 * TH_MM_B, T);
    th_cp_commit();
    // the warp's Q as A fragments (a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) of each 8 of d)
    float qf[HD / 8][4];
    th_load_rows<float, HD, QR, NT>(Rs, LDF, q, a.q, q0, T);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HD / 8; kk++) {
        const float * p = Rs + (16 * warp + g) * LDF + kk * 8 + t;
        qf[kk][0] = p[0], qf[kk][1] = p[8 * LDF], qf[kk][2] = p[4], qf[kk][3] = p[8 * LDF + 4];
    }
    __syncthreads();
    th_load_rows<float, HD, QR, NT>(Rs, LDF, dout, a.dout, q0, T);   // the key loop's barriers order it
    float lr[2], dr[2];
    th_dq_rows_ld<HD>(lr, dr, a, bh, w0);
    float acc[HD / 8][4];
    th_zero<HD>(acc);
    const int warp_first_key = th_first_key(a, bh, w0);              // packed rows; else 0
    for (int kb = kb0; kb < nkb; kb++) {
        const int k0 = kb * TH_MM_B;
        th_kv_block<float, HD, NT>(a, k, v, Ks, Vs, LDF, Kst, Vst, k_staged, v_staged, kb, nkb);
#pragma unroll
        for (int j = 0; j < TH_MM_B / 16; j++) {
            const int kc = k0 + 16 * j;                              // the chunk's first key
            if (a.causal && kc > w0 + 15) break;                     // the same for the whole warp
            if (kc + 16 <= warp_first_key) continue;                 // before every row's example
            float s[2][4], dp[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 8; kk++) {
                const float * po = dOs + kk * 8;
                const float o0 = po[0], o1 = po[8 * LDF], o2 = po[4], o3 = po[8 * LDF + 4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const float * pk = Ks + (16 * j + nt * 8 + g) * LDF + kk * 8 + t;
                    const float * pv = Vs + (16 * j + nt * 8 + g) * LDF + kk * 8 + t;
                    th_mma1688(s[nt], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], pk[0], pk[4]);
                    th_mma1688(dp[nt], o0, o1, o2, o3, pv[0], pv[4]);
                }
            }
            th_dq_chunk_ds(s, dp, lr, dr, a, w0, kc, drop, bh);
            // dQ += dS K over the chunk's keys, 8 at a time (keys 8 nt + 2t, + 1: this thread's columns)
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const float * pk = Ks + (16 * j + nt * 8 + c) * LDF + g;
#pragma unroll
                for (int dn = 0; dn < HD / 8; dn++) th_mma1688_c(acc[dn], dp[nt], pk[dn * 8], pk[LDF + dn * 8]);
            }
        }
    }
    const float one[2] = {1.0f, 1.0f};
    th_put_rows<HD>(acc, one, th_head(a.dq, bh), a.dq, w0, T);
}

// whether a node stamped tf32 takes the TF32 kernels (the backward's stamp decides for dQ, as at bf16)
static bool th_tf32_attention(const ggml_tensor * node) {
    return th_precision_of(node) == TH_PRECISION_TF32 && th_attention_on_tensor_cores(node);
}

// whether the backward node `bwd` writes dS: fp32's kernels do (dQ's kernel reads it), the
// tensor-core kernels do not (custom_ops.h, th_attention_on_tensor_cores: the rule by which
// native/cuda_precision.c shapes the node)
static bool th_attention_forms_ds(const ggml_tensor * bwd) {
    return !th_attention_on_tensor_cores(bwd);
}

// the tf32 kernels of `heads` heads (query heads: the backward takes grouped heads split, each
// query head's dK and dV into the scratch, then summed as at bf16), 8 warps a CTA
template <int HD, bool DROP>
static void th_tf_launch_drop(cudaStream_t stream, const int kernel, const th_attn_args & a, const unsigned heads) {
    constexpr int WARPS = 8;
    const dim3 grid(heads, (unsigned) ((a.T + 16 * WARPS - 1) / (16 * WARPS)));
    if (kernel == TH_CUDA_ATTN_FWD) {
        constexpr size_t smem = th_fwd_tf_smem<HD, WARPS>();
        TH_SET_SMEM_LIMIT((th_attn_fwd_tf_kernel<HD, WARPS, DROP>), smem);
        th_attn_fwd_tf_kernel<HD, WARPS, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
    } else if (kernel == TH_CUDA_ATTN_BWD) {
        constexpr size_t smem = th_bwd_tf_smem<HD, WARPS>();
        TH_SET_SMEM_LIMIT((th_attn_bwd_tf_kernel<HD, WARPS, DROP>), smem);
        th_attn_bwd_tf_kernel<HD, WARPS, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
    } else {
        constexpr size_t smem = th_dq_tf_smem<HD, WARPS>();
        TH_SET_SMEM_LIMIT((th_attn_dq_tf_kernel<HD, WARPS, DROP>), smem);
        th_attn_dq_tf_kernel<HD, WARPS, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
    }
}
template <int HD>
static void th_tf_launch(cudaStream_t stream, const int kernel, const th_attn_args & a, const unsigned heads) {
    if (a.drop_key != nullptr) {
        th_tf_launch_drop<HD, true>(stream, kernel, a, heads);
    } else {
        th_tf_launch_drop<HD, false>(stream, kernel, a, heads);
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

static size_t th_fwd_smem(int hd) {
    return sizeof(float) * (hd * TH_AT_QLD + hd * TH_AT_LD + TH_AT_B * (hd + TH_AT_PAD) + TH_AT_B * TH_AT_QLD);
}
static size_t th_bwd_smem(int hd) {
    const int rows = hd > TH_AT_B ? hd : TH_AT_B;
    return sizeof(float) * (2 * hd * TH_AT_LD + 2 * rows * TH_AT_LD + 2 * TH_AT_B * (hd + TH_AT_PAD) + 2 * TH_AT_B);
}

static size_t th_dq_smem(int hd) { return sizeof(float) * (TH_AT_B * TH_AT_LD + TH_AT_B * (hd + TH_AT_PAD)); }

// an operand's (t, d) elements: a (hd, T, H, B) tensor, or with `t_first` a (T, hd, H, B) one (V^T)
static th_opd th_opd_of(const ggml_tensor * x, const bool t_first) {
    th_opd o;
    const size_t size = x->type == GGML_TYPE_BF16 ? 2 : sizeof(float);     // a bf16 operand's, or f32
    o.p = (float *) x->data;
    o.st = (int64_t) (x->nb[t_first ? 0 : 1] / size);
    o.sd = (int64_t) (x->nb[t_first ? 1 : 0] / size);
    o.sh = (int64_t) (x->nb[2] / size);
    o.sb = (int64_t) (x->nb[3] / size);
    o.H = (int) x->ne[2];
    o.g = 1;
    o.bf16 = x->type == GGML_TYPE_BF16;
    return o;
}

// where a fused node's output goes: head bh's (t, d) at p + (bh / H) sb + (bh % H) sh + t st + d sd
static th_opd th_opd_at(float * p, const int64_t st, const int64_t sd, const int64_t sh, const int64_t heads) {
    th_opd o;
    o.p = p, o.st = st, o.sd = sd, o.sh = sh, o.sb = 0, o.H = (int) heads, o.g = 1;
    return o;
}

// a room's (t, d) elements through its map
static th_opd th_room_opd(const ggml_tensor * room, const th_attention_map m) {
    th_opd o;
    int64_t s[4];
    for (int i = 0; i < 4; i++) s[i] = m.axis[i] >= 0 ? (int64_t) (room->nb[m.axis[i]] / sizeof(float)) : 0;
    o.p = (float *) room->data, o.sd = s[0], o.st = s[1], o.sh = s[2], o.sb = s[3];
    o.H = m.axis[2] >= 0 ? (int) room->ne[m.axis[2]] : 1;
    o.g = 1;
    return o;
}

// a contiguous f32 room holding exactly hd x T x heads elements, its map's axes distinct and sized so
static bool th_room_ok(const ggml_tensor * room, const th_attention_map m, const int64_t hd, const int64_t T,
                       const int64_t heads) {
    if (!th_f32_contiguous(room) || ggml_nelements(room) != hd * T * heads) return false;
    const int64_t want[3] = {hd, T, 0};
    int64_t h = 1, b = 1;
    for (int i = 0; i < 4; i++) {
        const int a = m.axis[i];
        if (a < -1 || a >= GGML_MAX_DIMS) return false;
        for (int j = 0; j < i; j++) {
            if (a >= 0 && m.axis[j] == a) return false;
        }
        const int64_t ne = a >= 0 ? room->ne[a] : 1;
        if (i < 2 && ne != want[i]) return false;
        if (i == 2) h = ne;
        if (i == 3) b = ne;
    }
    return h * b == heads;
}

// an operand of ne0 x ne1 a head, of `type` (f32; bf16: q, k and v^T kept in bf16 at precision bf16)
static bool th_opd_ok(const ggml_tensor * x, const int64_t ne0, const int64_t ne1, const int64_t heads,
                      const ggml_type type = GGML_TYPE_F32) {
    if (x == nullptr || x->type != type || x->ne[0] != ne0 || x->ne[1] != ne1 || x->ne[2] * x->ne[3] != heads) {
        return false;
    }
    for (int i = 0; i < GGML_MAX_DIMS; i++) {
        if (x->nb[i] % (type == GGML_TYPE_BF16 ? 2 : sizeof(float)) != 0) return false;
    }
    return true;
}


// Grouped heads at bf16, split: the backward's CTAs take one query head each (the kernel without
// GROUPED, its k and v read through the group), each head's dK and dV into its own slot of the
// prep node's scratch, then this sums each kv head's group into its destination in head order,
// 0 + the first head's + the next's ..., as th_put_grouped adds them (the same bits). The grouped
// kernel's CTA took a kv head's G query heads in turn: a third or a quarter of the CTAs, each
// G times as long (6.29 ms of a gpt2-small llama step at G 3, 1 CTA an SM).
// `serial`: the destination is the scratch's first heads, which hold partials of lower groups
// until summed, so a thread takes the kv heads of its element in ascending order
static __global__ void th_attn_group_sum_kernel(const th_opd part, const th_opd out, const int T, const int hd,
                                                const int group, const int kv_heads, const bool serial) {
    const int64_t e = blockIdx.x * (int64_t) blockDim.x + threadIdx.x;
    if (e >= (int64_t) T * hd) return;
    const int64_t t = e / hd, d = e % hd;
    const int first = serial ? 0 : (int) blockIdx.y, last = serial ? kv_heads : first + 1;
    for (int kvh = first; kvh < last; kvh++) {
        float sum = 0.0f;
        for (int gr = 0; gr < group; gr++) {
            sum = __fadd_rn(sum, th_head(part, kvh * group + gr)[t * part.st + d * part.sd]);
        }
        th_head(out, kvh)[t * out.st + d * out.sd] = sum;
    }
}

// the bf16 kernels (fwd, bwd, dq) of `heads` heads (kv heads for the backward), WARPS warps a CTA
// (DROP: the instances that draw P's dropout mask, where a.drop_key is set)
template <int HD, int WARPS, bool B16, bool DROP>
static void th_mma_launch_warps(cudaStream_t stream, const int kernel, const th_attn_args & a, const unsigned heads) {
    const dim3 grid(heads, (unsigned) ((a.T + 16 * WARPS - 1) / (16 * WARPS)));
    if (kernel == TH_CUDA_ATTN_FWD) {
        constexpr size_t smem = th_fwd_mma_smem<HD, WARPS>();
        TH_SET_SMEM_LIMIT((th_attn_fwd_mma_kernel<HD, WARPS, B16, DROP>), smem);
        th_attn_fwd_mma_kernel<HD, WARPS, B16, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
    } else if (kernel == TH_CUDA_ATTN_BWD) {
        constexpr size_t smem = th_bwd_chunk_smem<HD, WARPS>();
        constexpr int MINB = WARPS == 8 ? 2 : 4;
        if (a.group > 1) {
            TH_SET_SMEM_LIMIT((th_attn_bwd_chunk_kernel<HD, WARPS, true, MINB, B16, DROP>), smem);
            th_attn_bwd_chunk_kernel<HD, WARPS, true, MINB, B16, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
        } else {
            TH_SET_SMEM_LIMIT((th_attn_bwd_chunk_kernel<HD, WARPS, false, MINB, B16, DROP>), smem);
            th_attn_bwd_chunk_kernel<HD, WARPS, false, MINB, B16, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
        }
    } else {
        constexpr size_t smem = th_dq_mma_smem<HD, WARPS>();
        TH_SET_SMEM_LIMIT((th_attn_dq_mma_kernel<HD, WARPS, B16, DROP>), smem);
        th_attn_dq_mma_kernel<HD, WARPS, B16, DROP><<<grid, 32 * WARPS, smem, stream>>>(a);
    }
}

// 8 warps a CTA (128 rows)
// (q, k and v^T bf16, th_attention_inputs_bf16: the kernels' B16 instances; th_attention_supported
// takes the three of one type)
template <int HD>
static void th_mma_launch(cudaStream_t stream, const int kernel, const th_attn_args & a, const unsigned heads) {
    const bool drop = a.drop_key != nullptr;
    if (a.q.bf16) {
        if (drop) th_mma_launch_warps<HD, 8, true, true>(stream, kernel, a, heads);
        else th_mma_launch_warps<HD, 8, true, false>(stream, kernel, a, heads);
    } else {
        if (drop) th_mma_launch_warps<HD, 8, false, true>(stream, kernel, a, heads);
        else th_mma_launch_warps<HD, 8, false, false>(stream, kernel, a, heads);
    }
}

// ---- cuDNN ----
// An attention that custom_ops.h's th_attention_cudnn gives to cuDNN (bf16 q, k and v^T, as
// PyTorch's compiled step runs it: cuDNN's flash attention on wgmma, its backward deterministic)
// keeps its nodes and their fp32 layouts; these convert between them and cuDNN's bf16 tensors:
//   forward:  cuDNN writes O (bf16, its plan's buffer) and L (its softmax statistics, into the
//             node's L rows); O widened into the node's O rows
//   prep:     O and dO narrowed to bf16 into the node (O's values are bf16's: exact), and L packed
//             (b, h, t) after them: cuDNN before 9.26 reads a backward's statistics packed only
//   backward: cuDNN writes dQ, dK and dV (bf16) into the node; dK and dV widened into their rooms
//             (and their bf16 copies, where products read them)
//   dQ:       the backward's dQ widened into its room (and its bf16 copy)
// So O, dQ, dK and dV are rounded to bf16 once, as autocast's attention returns them.

// The conversions move a tile of TH_CVT_ROWS rows (t) x HD of one head through shared memory, so
// that both sides are read and written in runs: cuDNN's side packed (bh, t, d), ours along
// whichever of d (sd == 1: O, dQ, dK) or t (st == 1: dV^T) is adjacent.
#define TH_CVT_ROWS 32

static __device__ __forceinline__ bool th_rows_adjacent(const th_opd & o) { return o.sd == 1 || o.st != 1; }

// bf16 (bh, t, d), packed, into an fp32 operand's layout, and its bf16 copy where one is read;
// with group > 1 head bh of dst takes the sum of src's heads bh G .. bh G + G - 1, added in head
// order in fp32 (as th_attn_group_sum_kernel adds our kernels' per-head dK and dV)
template <int HD>
static __global__ void __launch_bounds__(256) th_widen_kernel(const __nv_bfloat16 * __restrict__ src, const th_opd dst,
                                                              const th_copy16 copy, const int T, const int group) {
    __shared__ float tile[TH_CVT_ROWS][HD + 1];
    const int bh = blockIdx.y, t0 = blockIdx.x * TH_CVT_ROWS, rows = min(TH_CVT_ROWS, T - t0);
    for (int i = threadIdx.x; i < rows * HD; i += blockDim.x) {
        float sum = 0.0f;
        for (int gr = 0; gr < group; gr++) {
            sum = __fadd_rn(sum, __bfloat162float(src[((int64_t) (bh * group + gr) * T + t0) * HD + i]));
        }
        tile[i / HD][i % HD] = sum;
    }
    __syncthreads();
    float * head = th_head(dst, bh);
    const bool by_rows = th_rows_adjacent(dst);
    for (int i = threadIdx.x; i < TH_CVT_ROWS * HD; i += blockDim.x) {
        const int r = by_rows ? i / HD : i % TH_CVT_ROWS, d = by_rows ? i % HD : i / TH_CVT_ROWS;
        if (r >= rows) continue;
        float * at = head + (int64_t) (t0 + r) * dst.st + (int64_t) d * dst.sd;
        if (!copy.alone) *at = tile[r][d];
        if (copy.p != nullptr) *th_copy_at(copy, at) = __float2bfloat16_rn(tile[r][d]);   // exact: a bf16 value
    }
}

// an operand's (bh, t, d) elements (fp32, rounded to bf16, or bf16: B16), packed; src.g > 1 repeats
// each kv head for its group's query heads
template <int HD, bool B16>
static __global__ void __launch_bounds__(256) th_narrow_kernel(const th_opd src, __nv_bfloat16 * __restrict__ dst,
                                                               const int T) {
    __shared__ float tile[TH_CVT_ROWS][HD + 1];
    const int bh = blockIdx.y, t0 = blockIdx.x * TH_CVT_ROWS, rows = min(TH_CVT_ROWS, T - t0);
    const float * head = th_head_as<B16>(src, bh);
    const bool by_rows = th_rows_adjacent(src);
    for (int i = threadIdx.x; i < TH_CVT_ROWS * HD; i += blockDim.x) {
        const int r = by_rows ? i / HD : i % TH_CVT_ROWS, d = by_rows ? i % HD : i / TH_CVT_ROWS;
        const int64_t at = (int64_t) (t0 + r) * src.st + (int64_t) d * src.sd;
        if (r < rows) tile[r][d] = B16 ? __bfloat162float(((const __nv_bfloat16 *) head)[at]) : head[at];
    }
    __syncthreads();
    __nv_bfloat16 * to = dst + ((int64_t) bh * T + t0) * HD;
    for (int i = threadIdx.x; i < rows * HD; i += blockDim.x) to[i] = __float2bfloat16_rn(tile[i / HD][i % HD]);
}

// the grid of a conversion of `heads` heads of T rows
static dim3 th_cvt_grid(const int64_t heads, const int64_t T) {
    return dim3((unsigned) ((T + TH_CVT_ROWS - 1) / TH_CVT_ROWS), (unsigned) heads);
}

// Where the fp32 side's d is adjacent (O, dQ, dK; not dV^T) a row needs no tile: a thread takes 8
// elements of a row, 16 bytes of bf16 and two float4s, where the addresses allow it
// (th_rows_aligned). The same values as the tiled kernels, the same sums.
template <int HD>
static __global__ void __launch_bounds__(256) th_widen_rows_kernel(const __nv_bfloat16 * __restrict__ src, const th_opd dst,
                                                                   const th_copy16 copy, const int T, const int group) {
    const int bh = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * (HD / 8)) return;
    const int t = i / (HD / 8), d0 = (i % (HD / 8)) * 8;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = 0.0f;
    for (int gr = 0; gr < group; gr++) {
        const uint4 x = *(const uint4 *) (src + ((int64_t) (bh * group + gr) * T + t) * HD + d0);
        const __nv_bfloat16 * b = (const __nv_bfloat16 *) &x;
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = __fadd_rn(v[j], __bfloat162float(b[j]));
    }
    float * at = th_head(dst, bh) + (int64_t) t * dst.st + d0;
    if (!copy.alone) {
        ((float4 *) at)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *) at)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    if (copy.p != nullptr) {
        uint4 c;
        __nv_bfloat16 * b = (__nv_bfloat16 *) &c;
#pragma unroll
        for (int j = 0; j < 8; j++) b[j] = __float2bfloat16_rn(v[j]);     // exact: bf16 values (or their sums' rounding)
        *(uint4 *) th_copy_at(copy, at) = c;
    }
}

template <int HD, bool B16>
static __global__ void __launch_bounds__(256) th_narrow_rows_kernel(const th_opd src, __nv_bfloat16 * __restrict__ dst,
                                                                    const int T) {
    const int bh = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * (HD / 8)) return;
    const int t = i / (HD / 8), d0 = (i % (HD / 8)) * 8;
    const int64_t at = (int64_t) t * src.st + d0;
    uint4 c;
    if constexpr (B16) {
        c = *(const uint4 *) ((const __nv_bfloat16 *) th_head_as<true>(src, bh) + at);
    } else {
        const float4 * x = (const float4 *) (th_head(src, bh) + at);
        const float4 lo = x[0], hi = x[1];
        __nv_bfloat16 * b = (__nv_bfloat16 *) &c;
        b[0] = __float2bfloat16_rn(lo.x), b[1] = __float2bfloat16_rn(lo.y), b[2] = __float2bfloat16_rn(lo.z);
        b[3] = __float2bfloat16_rn(lo.w), b[4] = __float2bfloat16_rn(hi.x), b[5] = __float2bfloat16_rn(hi.y);
        b[6] = __float2bfloat16_rn(hi.z), b[7] = __float2bfloat16_rn(hi.w);
    }
    *(uint4 *) (dst + ((int64_t) bh * T + t) * HD + d0) = c;
}

// whether an operand's rows can go 16 bytes at a time: d adjacent, and every row's first element
// (and its bf16 copy's, if any) 16-byte aligned. `elems`: the operand's elements in 16 bytes (4
// f32, 8 bf16).
static bool th_rows_aligned(const th_opd & o, const int elems, const th_copy16 & copy) {
    if (o.sd != 1 || ((uintptr_t) o.p) % 16 != 0 || o.st % elems != 0 || o.sh % elems != 0 || o.sb % elems != 0) {
        return false;
    }
    // the copy mirrors the fp32 layout: its rows start at the same element offsets, 8 of which
    // are 16 bytes of bf16
    return copy.p == nullptr || (((uintptr_t) copy.p) % 16 == 0 && (o.p - copy.base) % 8 == 0 && o.st % 8 == 0 &&
                                 o.sh % 8 == 0 && o.sb % 8 == 0);
}

// bf16 (bh, t, d), packed, heads x group of them summed a head, into `dst` (th_widen_kernel)
template <int HD>
static void th_widen(cudaStream_t stream, const __nv_bfloat16 * src, const th_opd & dst, const th_copy16 & copy,
                     const int64_t T, const int64_t heads, const int group) {
    if (th_rows_aligned(dst, 4, copy)) {
        const dim3 grid((unsigned) ((T * (HD / 8) + 255) / 256), (unsigned) heads);
        th_widen_rows_kernel<HD><<<grid, 256, 0, stream>>>(src, dst, copy, (int) T, group);
    } else {
        th_widen_kernel<HD><<<th_cvt_grid(heads, T), 256, 0, stream>>>(src, dst, copy, (int) T, group);
    }
}

// an operand's heads (fp32 or bf16: B16) into bf16 (bh, t, d), packed (th_narrow_kernel)
template <int HD, bool B16>
static void th_narrow(cudaStream_t stream, const th_opd & src, __nv_bfloat16 * dst, const int64_t T, const int64_t heads) {
    const th_copy16 no_copy = {nullptr, nullptr, 0};
    if (th_rows_aligned(src, B16 ? 8 : 4, no_copy)) {
        const dim3 grid((unsigned) ((T * (HD / 8) + 255) / 256), (unsigned) heads);
        th_narrow_rows_kernel<HD, B16><<<grid, 256, 0, stream>>>(src, dst, (int) T);
    } else {
        th_narrow_kernel<HD, B16><<<th_cvt_grid(heads, T), 256, 0, stream>>>(src, dst, (int) T);
    }
}

// the forward node's L rows (head bh's at (hd + 1) T bh + hd T), packed (bh, t)
template <int HD>
static __global__ void th_pack_stats_kernel(const float * __restrict__ fwd, float * __restrict__ packed, const int T,
                                            const int64_t total) {
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < total; i += (int64_t) gridDim.x * blockDim.x) {
        packed[i] = fwd[(i / T) * (int64_t) (HD + 1) * T + (int64_t) HD * T + i % T];
    }
}

static unsigned th_elementwise_blocks(const int64_t total) {
    const int64_t blocks = (total + 255) / 256;
    return (unsigned) (blocks < (1 << 20) ? blocks : (1 << 20));
}

// cuDNN's view of the attention whose forward node is `fwd`: q (B x H heads), k and v^T (B x Hk
// heads: grouped-query heads share a kv head, query head h kv head h / group) read in place through
// their strides where they are bf16, else narrowed into the plan's buffer (inputs16: packed,
// th_cudnn_inputs); the statistics in the forward node's L rows (head bh's at (hd + 1) T bh + hd T).
// An operand's axis 2 holds its heads of one batch, or of all batches (folded: a REPEAT's output,
// or a view with ne[3] 1); where q, k and v do not fold alike, cuDNN sees one batch of all the heads
// (B 1), every operand narrowed through th_head, which reads either. `repeat`: k and v repeated to
// the H query heads in that buffer (Hk = H)
static th_sdpa_shape th_sdpa_of(const ggml_tensor * fwd, const th_attention_params & ap, const int64_t heads,
                                const bool repeat = false) {
    const th_opd opd[3] = {th_opd_of(fwd->src[0], false), th_opd_of(fwd->src[1], false), th_opd_of(fwd->src[2], true)};
    const bool alike = opd[1].H * ap.group == opd[0].H && opd[2].H * ap.group == opd[0].H && heads % opd[0].H == 0;
    th_sdpa_shape s = {};
    s.H = alike ? opd[0].H : heads, s.B = heads / s.H, s.T = ap.T, s.D = ap.hd;
    s.Hk = repeat ? s.H : s.H / ap.group;
    s.inputs16 = repeat || !alike || !opd[0].bf16;
    int64_t * strides[3] = {s.q, s.k, s.v};
    for (int j = 0; j < 3; j++) {
        const int64_t h = j == 0 ? s.H : s.Hk;
        if (s.inputs16) {
            strides[j][0] = h * s.T * s.D, strides[j][1] = s.T * s.D, strides[j][2] = s.D, strides[j][3] = 1;
        } else {
            strides[j][0] = opd[j].sb, strides[j][1] = opd[j].sh, strides[j][2] = opd[j].st, strides[j][3] = opd[j].sd;
        }
    }
    const int64_t per_head = th_attention_fwd_floats(ap.hd, ap.T);
    s.stats[0] = s.H * per_head, s.stats[1] = per_head, s.stats[2] = 1;
    s.causal = ap.causal, s.scale = ap.scale;
    return s;
}

// cuDNN's view of the attention's backward: grouped heads' k and v repeated for each query head
// (each group's dK and dV summed in fp32 by th_widen_kernel, as our kernels sum them, not by cuDNN,
// which would sum them into bf16), the statistics packed by the prep node
static th_sdpa_shape th_sdpa_backward_of(const ggml_tensor * fwd, const th_attention_params & ap, const int64_t heads) {
    th_sdpa_shape s = th_sdpa_of(fwd, ap, heads, ap.group > 1);
    s.stats[0] = s.H * ap.T, s.stats[1] = ap.T, s.stats[2] = 1;
    return s;
}

// Whether cuDNN takes the attention whose forward node is `fwd` (custom_ops.h's th_attention_cudnn
// offered it): its forward's and its backward's plans both built, at the forward's first
// evaluation (which ggml-cuda does not capture), or found. Else (cuDNN refused a plan: said once
// on stderr) our kernels run all four of the attention's nodes, each of which asks alike; at bf16
// they fit the nodes sized for cuDNN's (the backward's larger room they do not read).
static bool th_cudnn_takes(cudaStream_t stream, const ggml_tensor * fwd, const th_attention_params & ap) {
    char why[768] = "";
    const int64_t heads = fwd->ne[1];
    th_sdpa_shape forward = th_sdpa_of(fwd, ap, heads), backward = th_sdpa_backward_of(fwd, ap, heads);
    forward.refuse = backward.refuse = th_cuda_cudnn_mode == TH_CUDNN_REFUSE;
    return th_sdpa_prepare(stream, &forward, false, why, sizeof why) &&
           th_sdpa_prepare(stream, &backward, true, why, sizeof why);
}

[[noreturn]] static void th_cudnn_failed(const char * why) {
    GGML_ABORT("toyharness attention: %s (TOYHARNESS_CUDNN_ATTENTION=0 runs toyharness's own kernels)", why);
}

// an operand's heads into `dst` (th_narrow_kernel), bf16 or f32, each kv head repeated for the
// s.Hk / x's heads query heads of its group
template <int HD>
static void th_cudnn_narrow(cudaStream_t stream, const ggml_tensor * x, const bool t_first, const int64_t heads,
                            __nv_bfloat16 * dst, const int64_t T) {
    th_opd o = th_opd_of(x, t_first);
    o.g = (int) (heads / (ggml_nelements(x) / (HD * T)));
    if (o.bf16) {
        th_narrow<HD, true>(stream, o, dst, T, heads);
    } else {
        th_narrow<HD, false>(stream, o, dst, T, heads);
    }
}

// q, k and v as cuDNN reads them, for a node whose src[0..2] are the attention's q, k and v^T: in
// place (bf16), or narrowed into the plan's buffer (f32 ones: llama's, after RoPE; or k and v
// repeated to the query heads), packed
template <int HD>
static void th_cudnn_inputs(cudaStream_t stream, const ggml_tensor * node, const th_sdpa_shape & s, const bool backward,
                            const void * (&qkv)[3], char * why, const size_t why_size) {
    if (!s.inputs16) {
        for (int j = 0; j < 3; j++) qkv[j] = node->src[j]->data;
        return;
    }
    __nv_bfloat16 * q16 = (__nv_bfloat16 *) th_sdpa_inputs(stream, &s, backward, why, why_size);
    if (q16 == nullptr) th_cudnn_failed(why);
    __nv_bfloat16 * k16 = q16 + s.B * s.H * s.T * s.D, * v16 = k16 + s.B * s.Hk * s.T * s.D;
    th_cudnn_narrow<HD>(stream, node->src[0], false, s.B * s.H, q16, s.T);
    th_cudnn_narrow<HD>(stream, node->src[1], false, s.B * s.Hk, k16, s.T);
    th_cudnn_narrow<HD>(stream, node->src[2], true, s.B * s.Hk, v16, s.T);
    qkv[0] = q16, qkv[1] = k16, qkv[2] = v16;
}

template <int HD>
static void th_cudnn_launch(cudaStream_t stream, ggml_tensor * dst, const int kernel, const th_attention_params & ap) {
    const int64_t T = ap.T;
    const th_copy16 no_copy = {nullptr, nullptr, 0};
    char why[768] = "";
    if (kernel == TH_CUDA_ATTN_FWD) {
        const int64_t heads = dst->ne[1];
        float * out = (float *) dst->data;
        const th_sdpa_shape shape = th_sdpa_of(dst, ap, heads);
        const void * qkv[3];
        th_cudnn_inputs<HD>(stream, dst, shape, false, qkv, why, sizeof why);
        const void * o16 = th_sdpa_forward(stream, &shape, qkv[0], qkv[1], qkv[2], out + HD * T, why, sizeof why);
        if (o16 == nullptr) th_cudnn_failed(why);
        const th_opd o = th_opd_at(out, HD, 1, th_attention_fwd_floats(HD, T), heads);
        th_widen<HD>(stream, (const __nv_bfloat16 *) o16, o, no_copy, T, heads, 1);
    } else if (kernel == TH_CUDA_ATTN_PREP) {
        const int64_t heads = dst->ne[1], n = heads * T * HD;
        __nv_bfloat16 * o16 = (__nv_bfloat16 *) dst->data;
        const th_opd o = th_opd_at((float *) dst->src[1]->data, HD, 1, th_attention_fwd_floats(HD, T), heads);
        th_narrow<HD, false>(stream, o, o16, T, heads);
        th_narrow<HD, false>(stream, th_opd_of(dst->src[0], false), o16 + n, T, heads);
        th_pack_stats_kernel<HD><<<th_elementwise_blocks(heads * T), 256, 0, stream>>>(
            (const float *) dst->src[1]->data, (float *) (o16 + 2 * n), (int) T, heads * T);
    } else if (kernel == TH_CUDA_ATTN_BWD) {
        const int64_t heads = dst->ne[2], n = heads * T * HD, per_head_floats = th_attention_prep_floats(HD, T);
        const ggml_tensor * fwd = dst->src[4];
        const __nv_bfloat16 * o16 = (const __nv_bfloat16 *) dst->src[5]->data;
        __nv_bfloat16 * dq16 = (__nv_bfloat16 *) dst->data;
        const bool repeat = ap.group > 1;       // (th_sdpa_backward_of)
        const th_sdpa_shape shape = th_sdpa_backward_of(fwd, ap, heads);
        const void * qkv[3];
        th_cudnn_inputs<HD>(stream, dst, shape, true, qkv, why, sizeof why);
        // dK and dV of cuDNN's kv heads (B x Hk: each query head's where k and v were repeated)
        const int64_t n_kv = shape.B * shape.Hk * T * HD, kv_heads = heads / ap.group;
        const int sums = repeat ? ap.group : 1;
        if (!th_sdpa_backward(stream, &shape, qkv[0], qkv[1], qkv[2], o16, o16 + n, (const float *) (o16 + 2 * n),
                              dq16, dq16 + n, dq16 + n + n_kv, why, sizeof why)) {
            th_cudnn_failed(why);
        }
        // dK and dV into their rooms, or the prep node's scratch as the other kernels write them
        // (O's and dO's bf16 there read by now)
        float * scratch = (float *) dst->src[5]->data;
        const th_opd dk = dst->src[6] != nullptr ? th_room_opd(dst->src[6], th_attention_map_of(dst, 0))
                                                 : th_opd_at(scratch, HD, 1, per_head_floats, heads);
        const th_opd dv = dst->src[7] != nullptr ? th_room_opd(dst->src[7], th_attention_map_of(dst, 1))
                                                 : th_opd_at(scratch + T * HD, 1, T, per_head_floats, heads);
        // (grouped heads' rooms have no bf16 copy: as the tensor-core kernels, which sum into them)
        const bool copies = ap.group == 1;
        const th_copy16 dk_copy = copies && dst->src[6] != nullptr ? th_copy16_of(stream, dst, dst->src[6]) : no_copy;
        const th_copy16 dv_copy = copies && dst->src[7] != nullptr ? th_copy16_of(stream, dst, dst->src[7]) : no_copy;
        th_widen<HD>(stream, dq16 + n, dk, dk_copy, T, kv_heads, sums);
        th_widen<HD>(stream, dq16 + n + n_kv, dv, dv_copy, T, kv_heads, sums);
    } else {
        const ggml_tensor * bwd = dst->src[6];
        th_widen<HD>(stream, (const __nv_bfloat16 *) bwd->data, th_room_opd(dst, th_attention_map_of(dst, 0)),
                     th_copy16_of(stream, dst, dst), T, bwd->ne[2], 1);
    }
}

template <int HD>
static void th_attention_launch(cudaStream_t stream, ggml_tensor * dst, const int kernel, const th_attention_params & ap) {
    const ggml_tensor * fwd = kernel == TH_CUDA_ATTN_FWD ? dst : kernel == TH_CUDA_ATTN_PREP ? dst->src[1] : dst->src[4];
    if (th_attention_cudnn(fwd) && th_cudnn_takes(stream, fwd, ap)) {
        th_cudnn_launch<HD>(stream, dst, kernel, ap);
        return;
    }
    th_attn_args a = {};
    a.T = ap.T, a.scale = ap.scale, a.causal = ap.causal, a.out = (float *) dst->data, a.group = ap.group;
    if (th_attention_has_dropout(&ap) && kernel != TH_CUDA_ATTN_PREP) {     // the forward's fed key
        a.drop_key = (const int32_t *) fwd->src[3]->data;
        a.drop = th_dropout_params_from(ap.dropout);
    }
    if (ap.causal == TH_ATTENTION_PACKED) {      // the fed bounds (T, 2, B) of the forward's src 6
        const ggml_tensor * bounds = fwd->src[TH_ATTENTION_BOUNDS_SRC];
        a.bounds = (const int32_t *) bounds->data;
        a.row_heads = (int) (fwd->ne[1] / bounds->ne[2]);
    }
    const int nb = (a.T + TH_AT_B - 1) / TH_AT_B;
    const int64_t T = ap.T;
    const bool bf16 = th_precision_of(dst) == TH_PRECISION_BF16;      // tensor cores (TH_MM_B == TH_AT_B)
    const bool tf32 = th_tf32_attention(dst);
    if (kernel == TH_CUDA_ATTN_FWD) {
        a.q = th_opd_of(dst->src[0], false), a.k = th_opd_of(dst->src[1], false), a.v = th_opd_of(dst->src[2], true);
        a.k.g = a.v.g = ap.group;
        a.o = th_opd_at((float *) dst->data, HD, 1, (HD + 1) * T, dst->ne[1]);
        if (bf16) {
            th_mma_launch<HD>(stream, kernel, a, (unsigned) dst->ne[1]);
            return;
        }
        if (tf32) {
            th_tf_launch<HD>(stream, kernel, a, (unsigned) dst->ne[1]);
            return;
        }
        const size_t smem = th_fwd_smem(HD);
        TH_SET_SMEM_LIMIT(th_attn_fwd_kernel<HD>, smem);
        const int nqb = (a.T + TH_AT_QB - 1) / TH_AT_QB;
        th_attn_fwd_kernel<HD><<<dim3((unsigned) dst->ne[1], (unsigned) nqb), TH_AT_THREADS, smem, stream>>>(a);
    } else if (kernel == TH_CUDA_ATTN_PREP) {
        a.dout = th_opd_of(dst->src[0], false), a.fwd = (const float *) dst->src[1]->data;
        a.o = th_opd_at((float *) dst->src[1]->data, HD, 1, (HD + 1) * T, dst->ne[1]);
        a.scratch = (float *) dst->data;
        const int64_t rows = dst->ne[1] * (int64_t) a.T;
        th_attn_prep_kernel<HD><<<(unsigned) ((rows + 7) / 8), 256, 0, stream>>>(a, rows);
    } else if (kernel == TH_CUDA_ATTN_BWD) {
        a.q = th_opd_of(dst->src[0], false), a.k = th_opd_of(dst->src[1], false), a.v = th_opd_of(dst->src[2], true);
        a.k.g = a.v.g = ap.group;
        a.dout = th_opd_of(dst->src[3], false);
        a.fwd = (const float *) dst->src[4]->data;
        a.scratch = (float *) dst->src[5]->data;
        // dK and dV of the kv heads (heads / group): into rooms, or the first heads of the scratch
        // (grouped only where no SLICE reads it: th_check_group_rooms)
        const int64_t heads = dst->ne[2], per_head_floats = (2 * HD + 1) * T;
        const unsigned ctas = (unsigned) (heads / ap.group);
        a.dk = dst->src[6] != nullptr ? th_room_opd(dst->src[6], th_attention_map_of(dst, 0))
                                      : th_opd_at(a.scratch, HD, 1, per_head_floats, heads);
        a.dv = dst->src[7] != nullptr ? th_room_opd(dst->src[7], th_attention_map_of(dst, 1))
                                      : th_opd_at(a.scratch + T * HD, 1, T, per_head_floats, heads);
        // without grouped heads the kernels' loop over a group's heads compiles away (the same code as before)
        if ((bf16 || tf32) && ap.group > 1) {
            th_attn_args per_head = a;                  // each query head's dK, dV into its scratch slot
            per_head.group = 1;
            per_head.dk = th_opd_at(a.scratch, HD, 1, per_head_floats, heads);
            per_head.dv = th_opd_at(a.scratch + T * HD, 1, T, per_head_floats, heads);
            if (tf32) {
                th_tf_launch<HD>(stream, kernel, per_head, (unsigned) heads);
            } else {
                th_mma_launch<HD>(stream, kernel, per_head, (unsigned) heads);
            }
            const bool serial = dst->src[6] == nullptr || dst->src[7] == nullptr;      // into the scratch itself
            const dim3 grid((unsigned) ((T * HD + 255) / 256), serial ? 1u : ctas);
            th_attn_group_sum_kernel<<<grid, 256, 0, stream>>>(per_head.dk, a.dk, (int) T, HD, ap.group, (int) ctas,
                                                               serial);
            th_attn_group_sum_kernel<<<grid, 256, 0, stream>>>(per_head.dv, a.dv, (int) T, HD, ap.group, (int) ctas,
                                                               serial);
            return;
        }
        if (bf16) {
            // dK's and dV's bf16 copies beside them, or alone, where products read them (k's and
            // v's weight, bias and input gradients): into their rooms, written by this node
            // (grouped heads sum into their rooms head by head: no copy there)
            if (dst->src[6] != nullptr && ap.group == 1) a.dk16 = th_copy16_of(stream, dst, dst->src[6]);
            if (dst->src[7] != nullptr && ap.group == 1) a.dv16 = th_copy16_of(stream, dst, dst->src[7]);
            th_mma_launch<HD>(stream, kernel, a, ctas);
            return;
        }
        if (tf32) {
            th_tf_launch<HD>(stream, kernel, a, ctas);
            return;
        }
        const size_t smem = th_bwd_smem(HD);
        if (ap.group > 1) {
            TH_SET_SMEM_LIMIT((th_attn_bwd_kernel<HD, true>), smem);
            th_attn_bwd_kernel<HD, true><<<dim3(ctas, (unsigned) nb), TH_AT_THREADS, smem, stream>>>(a);
        } else {
            TH_SET_SMEM_LIMIT((th_attn_bwd_kernel<HD, false>), smem);
            th_attn_bwd_kernel<HD, false><<<dim3(ctas, (unsigned) nb), TH_AT_THREADS, smem, stream>>>(a);
        }
    } else {
        const ggml_tensor * bwd = dst->src[6];
        a.k = th_opd_of(dst->src[1], false);
        a.k.g = ap.group;
        a.dq = th_room_opd(dst, th_attention_map_of(dst, 0));
        const unsigned heads = (unsigned) bwd->ne[2];
        // the backward's stamp, not this node's, says whether dS was written (a graph's nodes are
        // stamped alike, so the two agree; this reads what was written): by fp32's kernels only;
        // the tensor-core kernels compute it again from the backward's sources
        if (!th_attention_forms_ds(bwd)) {
            a.q = th_opd_of(dst->src[0], false), a.v = th_opd_of(dst->src[2], true), a.dout = th_opd_of(dst->src[3], false);
            a.v.g = ap.group;
            a.fwd = (const float *) dst->src[4]->data, a.scratch = (float *) dst->src[5]->data;
            if (bf16) {
                // dQ's bf16 copy beside it, or alone, where products read it (q's weight, bias
                // and input gradients): the conversion each would otherwise make
                a.dq16 = th_copy16_of(stream, dst, dst);
                th_mma_launch<HD>(stream, kernel, a, heads);
            } else {
                th_tf_launch<HD>(stream, kernel, a, heads);
            }
            return;
        }
        a.ds = (const float *) bwd->data;
        const size_t smem = th_dq_smem(HD);
        TH_SET_SMEM_LIMIT(th_attn_dq_kernel<HD>, smem);
        th_attn_dq_kernel<HD><<<dim3(heads, (unsigned) nb), TH_AT_THREADS, smem, stream>>>(a);
    }
}

// the backward node's shape: dS (T, T, BH), or where the tensor-core kernels take it no dS (1, 1,
// BH: native/cuda_precision.c, th_attention_drop_ds)
// (cuDNN's: dQ, dK and dV in bf16, (3 hd T / 2, 1, BH) floats: native/cuda_precision.c, th_attention_cudnn_room)
static bool th_attention_ds_shape_ok(const ggml_tensor * bwd, const int64_t hd, const int64_t T) {
    if (th_attention_cudnn(bwd->src[4])) return bwd->ne[0] == 3 * hd * T / 2 && bwd->ne[1] == 1;
    return th_attention_forms_ds(bwd) ? bwd->ne[0] == T && bwd->ne[1] == T : bwd->ne[0] == 1 && bwd->ne[1] == 1;
}

bool th_attention_supported(const ggml_tensor * op, const int kernel) {
    if (op->type != GGML_TYPE_F32 || !ggml_is_contiguous(op)) return false;
    if (kernel == TH_CUDA_SLICE) {
        return op->src[0] != nullptr && op->src[0]->type == GGML_TYPE_F32 && ggml_is_contiguous(op->src[0]);
    }
    const th_attention_params ap = th_params_of<th_attention_params>(op);
    if (!th_attention_head_dim_ok(ap.hd) || ap.T <= 0 || ap.group < 1) return false;
    if (ap.causal == TH_ATTENTION_PACKED && kernel != TH_CUDA_ATTN_PREP) {
        // the forward's bounds: i32 (T, 2, B), B dividing the heads (each batch row's H of them)
        const ggml_tensor * fwd = kernel == TH_CUDA_ATTN_FWD ? op : op->src[4];
        const ggml_tensor * bounds = fwd != nullptr ? fwd->src[TH_ATTENTION_BOUNDS_SRC] : nullptr;
        if (bounds == nullptr || bounds->type != GGML_TYPE_I32 || !ggml_is_contiguous(bounds) ||
            bounds->ne[0] != ap.T || bounds->ne[1] != 2 || bounds->ne[3] != 1 || fwd->ne[1] % bounds->ne[2] != 0) {
            return false;
        }
    }
    if (th_attention_has_dropout(&ap) && kernel != TH_CUDA_ATTN_PREP) {
        // the tensor-core kernels draw P's mask (fp32's do not), from the forward's fed key
        const ggml_tensor * fwd = kernel == TH_CUDA_ATTN_FWD ? op : op->src[4];
        const ggml_tensor * key = fwd != nullptr ? fwd->src[3] : nullptr;
        if (!th_attention_on_tensor_cores(op) || key == nullptr || key->type != GGML_TYPE_I32 ||
            ggml_nelements(key) != TH_DROPOUT_KEY_WORDS || !ggml_is_contiguous(key)) {
            return false;
        }
    }
    const int64_t hd = ap.hd, T = ap.T, G = ap.group;     // k, vt and the rooms: heads / G kv heads
    const ggml_tensor * const * s = op->src;
    // q, k and v^T: all f32, or all bf16 where the tensor-core kernels read them (th_attention_inputs_bf16)
    const ggml_type b = kernel != TH_CUDA_ATTN_PREP && s[0] != nullptr && s[0]->type == GGML_TYPE_BF16 &&
                        th_precision_of(op) == TH_PRECISION_BF16 ? GGML_TYPE_BF16 : GGML_TYPE_F32;
    switch (kernel) {
        case TH_CUDA_ATTN_FWD:
            return op->ne[0] == th_attention_fwd_floats(hd, T) && th_opd_ok(s[0], hd, T, op->ne[1], b) &&
                   op->ne[1] % G == 0 && th_opd_ok(s[1], hd, T, op->ne[1] / G, b) &&
                   th_opd_ok(s[2], T, hd, op->ne[1] / G, b);
        case TH_CUDA_ATTN_PREP:
            return op->ne[0] == th_attention_prep_floats(hd, T) && th_opd_ok(s[0], hd, T, op->ne[1]) &&
                   th_f32_contiguous(s[1]) && ggml_nelements(s[1]) == th_attention_fwd_floats(hd, T) * op->ne[1];
        case TH_CUDA_ATTN_BWD:                 // dS (T, T, BH), or none (1, 1, BH): th_attention_ds_shape_ok
            return th_attention_ds_shape_ok(op, hd, T) && th_opd_ok(s[0], hd, T, op->ne[2], b) && op->ne[2] % G == 0 &&
                   th_opd_ok(s[1], hd, T, op->ne[2] / G, b) && th_opd_ok(s[2], T, hd, op->ne[2] / G, b) &&
                   th_opd_ok(s[3], hd, T, op->ne[2]) && th_f32_contiguous(s[4]) && th_f32_contiguous(s[5]) &&
                   ggml_nelements(s[4]) == th_attention_fwd_floats(hd, T) * op->ne[2] &&
                   ggml_nelements(s[5]) == th_attention_prep_floats(hd, T) * op->ne[2] &&
                   (s[6] == nullptr || th_room_ok(s[6], th_attention_map_of(op, 0), hd, T, op->ne[2] / G)) &&
                   (s[7] == nullptr || th_room_ok(s[7], th_attention_map_of(op, 1), hd, T, op->ne[2] / G));
        case TH_CUDA_ATTN_DQ: {                // the backward's sources, then the backward (dS)
            const ggml_tensor * bwd = s[6];
            if (bwd == nullptr || th_kernel_of(bwd) != TH_CUDA_ATTN_BWD || !th_f32_contiguous(bwd) ||
                !th_attention_ds_shape_ok(bwd, hd, T) || th_precision_of(bwd) != th_precision_of(op)) {
                return false;
            }
            const int64_t heads = bwd->ne[2];
            return heads % G == 0 && th_opd_ok(s[0], hd, T, heads, b) && th_opd_ok(s[1], hd, T, heads / G, b) &&
                   th_opd_ok(s[2], T, hd, heads / G, b) && th_opd_ok(s[3], hd, T, heads) && th_f32_contiguous(s[4]) &&
                   th_f32_contiguous(s[5]) && ggml_nelements(s[4]) == th_attention_fwd_floats(hd, T) * heads &&
                   ggml_nelements(s[5]) == th_attention_prep_floats(hd, T) * heads &&
                   th_room_ok(op, th_attention_map_of(op, 0), hd, T, heads);
        }
        default:
            return false;
    }
}

bool th_attention(cudaStream_t stream, ggml_tensor * dst, const int kernel) {
    if (kernel == TH_CUDA_SLICE) {
        const th_slice_params sp = th_params_of<th_slice_params>(dst);
        const int64_t n = dst->ne[0] * dst->ne[1], heads = ggml_nelements(dst) / n;
        const int64_t total = n * heads;
        const int blocks = (int) ((total + 255) / 256 < 65535 ? (total + 255) / 256 : 65535);
        th_slice_kernel<<<blocks, 256, 0, stream>>>((const float *) dst->src[0]->data, (float *) dst->data, n, heads,
                                                    sp.stride, sp.offset);
        return true;
    }
    const th_attention_params ap = th_params_of<th_attention_params>(dst);
    switch (ap.hd) {
        case 16: th_attention_launch<16>(stream, dst, kernel, ap); return true;
        case 32: th_attention_launch<32>(stream, dst, kernel, ap); return true;
        case 64: th_attention_launch<64>(stream, dst, kernel, ap); return true;
        default: return false;
    }
}
