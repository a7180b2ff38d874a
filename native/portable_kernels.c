/* toyharness portable kernels: the cpu graph of the portable golden mode, computed with the same
 * IEEE-754 float32 operations on every CPU.
 *
 * th_portable_rewrite turns every computing node of a finished graph into a GGML_OP_CUSTOM node
 * (same srcs, same output) whose kernel is here, built on portable_math.c: no OpenBLAS, no ggml
 * arithmetic, no libm; built with -ffp-contract=off and without -ffast-math (CMakeLists.txt).
 * A node that has no kernel here is an error naming its op, never left to ggml. Left to ggml
 * are only the nodes that move data without arithmetic, so their bits are the input's on any
 * CPU (TP_PASS_THROUGH). Every kernel splits its work over outputs (rows of the result), never
 * over a reduction, into tasks fixed by the shapes: the thread count changes no bit. Reductions
 * are portable_math.c's (TP_LANES partial sums in a fixed tree, or one fixed order).
 *
 * The graphs are those that blocks build without the fast path's stand-ins (Program.portable):
 * GELU composed from silu, div and scale, LayerNorm's centring a plain matrix product, a bias
 * added through a K = 1 product. Ops: MUL_MAT, OUT_PROD, ADD, ADD1, SUB, MUL, DIV, SCALE, SQR, SQRT,
 * LOG, EXP, NEG, RELU, STEP (RELU's backward), ABS, SGN (ABS's backward), SOFTPLUS, SIGMOID (SOFTPLUS's
 * backward), SILU, SILU_BACK, SWIGLU (split), SOFT_MAX, SOFT_MAX_BACK, RMS_NORM,
 * RMS_NORM_BACK, ROPE, ROPE_BACK, SUM, SUM_ROWS, REPEAT_BACK, GET_ROWS_BACK, CROSS_ENTROPY_LOSS,
 * CROSS_ENTROPY_LOSS_BACK, ACC (a VIEW's backward), OPT_STEP_ADAMW; and with a frozen weight of
 * another type than f32 (f16, bf16, quantized: a LoRA base), MUL_MAT, OUT_PROD and GET_ROWS through our own
 * dequantization (portable_quant.c).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h" /* struct ggml_custom_op_params */
#include "cpu_kernels.h"
#include "dropout_mask.h"
#include "portable_math.h"
#include "portable_quant.h"

#define TP_EXPORT __attribute__((visibility("default")))

_Static_assert(TP_TYPE_F16 == GGML_TYPE_F16 && TP_TYPE_BF16 == GGML_TYPE_BF16 && TP_TYPE_Q8_0 == GGML_TYPE_Q8_0 &&
               TP_TYPE_Q4_0 == GGML_TYPE_Q4_0 && TP_TYPE_Q4_1 == GGML_TYPE_Q4_1 && TP_TYPE_Q5_0 == GGML_TYPE_Q5_0 &&
               TP_TYPE_Q5_1 == GGML_TYPE_Q5_1 && TP_TYPE_Q4_K == GGML_TYPE_Q4_K && TP_TYPE_Q5_K == GGML_TYPE_Q5_K &&
               TP_TYPE_Q6_K == GGML_TYPE_Q6_K, "portable_quant.h's type values are enum ggml_type's");

/* op_params slots free after struct ggml_custom_op_params (which takes slots 0-5) */
enum { TP_SLOT = 8 };

/* what a node's kernel computes (the custom op's userdata) */
enum tp_kind {
    TP_MUL_MAT = 1, TP_OUT_PROD, TP_ADD, TP_SUB, TP_MUL, TP_DIV, TP_SCALE, TP_SQR, TP_SQRT, TP_LOG, TP_EXP, TP_NEG,
    TP_RELU, TP_SILU, TP_SILU_BACK, TP_SWIGLU, TP_SOFT_MAX, TP_SOFT_MAX_BACK, TP_RMS_NORM, TP_RMS_NORM_BACK, TP_ROPE,
    TP_SUM, TP_SUM_ROWS, TP_REPEAT_BACK, TP_GET_ROWS_BACK, TP_CROSS_ENTROPY, TP_CROSS_ENTROPY_BACK,
    TP_FROZEN_MUL_MAT, TP_FROZEN_OUT_PROD, TP_FROZEN_GET_ROWS, TP_ACC,
    TP_STEP, TP_SGN, TP_ABS, TP_SIGMOID, TP_SOFTPLUS,
};

static inline float tp_param(const struct ggml_tensor * t, int k) {
    float v;
    memcpy(&v, t->op_params + TP_SLOT + k, sizeof(v));
    return v;
}

/* row r of t, rows counted over ne1, ne2, ne3 */
static inline float * tp_row(const struct ggml_tensor * t, int64_t r) {
    const int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
    return (float *) ((char *) t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

static int tp_f32_rows(const struct ggml_tensor * t) { return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float); }

/* ---- elementwise ---------------------------------------------------------------------------
 * One output element from one or two inputs. Rows of dst are the tasks; src1 of a binary op is
 * broadcast (ggml_can_repeat): its index is dst's modulo its shape. dst may share a buffer with
 * src0 (each element read before it is written). */
static inline float tp_unary(int kind, float x, float s, float b) {
    switch (kind) {
        case TP_SCALE: return b == 0.0f ? x * s : x * s + b;
        case TP_SQR: return x * x;
        case TP_SQRT: return sqrtf(x); /* IEEE-754 rounds it correctly */
        case TP_LOG: return tp_logf(x);
        case TP_EXP: return tp_expf(x);
        case TP_NEG: return -x;
        case TP_RELU: return x > 0.0f ? x : 0.0f;
        case TP_STEP: return x > 0.0f ? 1.0f : 0.0f;                          /* RELU's backward */
        case TP_SGN: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);      /* ABS's backward */
        case TP_ABS: return x < 0.0f ? -x : x;
        case TP_SIGMOID: return 1.0f / (1.0f + tp_expf(-x));                   /* SOFTPLUS's backward */
        case TP_SOFTPLUS: return x > 20.0f ? x : tp_logf(1.0f + tp_expf(x));  /* ggml's cutoff */
        default: return tp_silu(x);
    }
}

static inline float tp_binary(int kind, float a, float b) {
    switch (kind) {
        case TP_ADD: return a + b;
        case TP_SUB: return a - b;
        case TP_MUL: return a * b;
        case TP_DIV: return a / b;
        case TP_SILU_BACK: return tp_silu_back(b, a); /* a = dy, b = x */
        default: return tp_silu(a) * b;              /* TP_SWIGLU: a = gate, b = up */
    }
}

/* element k of a row whose elements are `stride` bytes apart */
#define TP_AT(row, k, stride) (*(const float *) ((const char *) (row) + (k) * (stride)))

static void tp_elementwise(struct ggml_tensor * dst, int kind, int ith, int nth) {
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1];
    const int unary = b == NULL;
    const float s = unary ? tp_param(dst, 0) : 0.0f, bias = unary ? tp_param(dst, 1) : 0.0f;
    const int64_t n = dst->ne[0];
    const size_t sa = a->nb[0], sb = unary ? 0 : b->nb[0];
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(dst), n, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const int64_t i1 = r % dst->ne[1], i2 = (r / dst->ne[1]) % dst->ne[2], i3 = r / (dst->ne[1] * dst->ne[2]);
            float * y = tp_row(dst, r);
            const float * x = tp_row(a, r);
            if (unary) {
                if (sa == sizeof(float)) {
                    for (int64_t k = 0; k < n; k++) y[k] = tp_unary(kind, x[k], s, bias);
                } else {
                    for (int64_t k = 0; k < n; k++) y[k] = tp_unary(kind, TP_AT(x, k, sa), s, bias);
                }
                continue;
            }
            const float * z = (const float *) ((const char *) b->data + (i1 % b->ne[1]) * b->nb[1] +
                                               (i2 % b->ne[2]) * b->nb[2] + (i3 % b->ne[3]) * b->nb[3]);
            if (b->ne[0] == n && sa == sizeof(float) && sb == sizeof(float)) {
                for (int64_t k = 0; k < n; k++) y[k] = tp_binary(kind, x[k], z[k]);
            } else {
                for (int64_t k = 0; k < n; k++) y[k] = tp_binary(kind, TP_AT(x, k, sa), TP_AT(z, k % b->ne[0], sb));
            }
        }
    }
}

/* ---- MUL_MAT and OUT_PROD: every element one tp_dot over k -----------------------------------
 *   MUL_MAT  dst[m][n] = sum_k a[n][k] b[m][k]    (a: ne0 = K, ne1 = N; b: ne0 = K, ne1 = M)
 *   OUT_PROD dst[m][n] = sum_k a[k][n] b[k][m]    (a: ne0 = N, ne1 = K; b: ne0 = M, ne1 = K)
 * a and b are broadcast over dims 2 and 3 as ggml does. A task is one batch slice times
 * TP_GEMM_ROWS rows of m; strided operands are gathered into contiguous rows first (a copy: no
 * bit changes), f16 and bf16 weights widened to f32 (exact). */
enum { TP_GEMM_ROWS = 16 };

static void tp_gather(const struct ggml_tensor * t, const char * base, size_t stride, int64_t n, float * out) {
    if (t->type == GGML_TYPE_F16) {
        for (int64_t k = 0; k < n; k++) out[k] = ggml_fp16_to_fp32(*(const ggml_fp16_t *) (base + k * stride));
    } else if (t->type == GGML_TYPE_BF16) {
        for (int64_t k = 0; k < n; k++) out[k] = ggml_bf16_to_fp32(*(const ggml_bf16_t *) (base + k * stride));
    } else {
        for (int64_t k = 0; k < n; k++) out[k] = *(const float *) (base + k * stride);
    }
}

static void tp_matmul(struct ggml_tensor * dst, int out_prod, int ith, int nth) {
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t N = dst->ne[0], M = dst->ne[1], K = out_prod ? a->ne[1] : a->ne[0];
    const size_t a_n = out_prod ? a->nb[0] : a->nb[1], a_k = out_prod ? a->nb[1] : a->nb[0];
    const size_t b_m = out_prod ? b->nb[0] : b->nb[1], b_k = out_prod ? b->nb[1] : b->nb[0];
    const int64_t r2 = dst->ne[2] / a->ne[2], r3 = dst->ne[3] / a->ne[3];
    const int64_t blocks = (M + TP_GEMM_ROWS - 1) / TP_GEMM_ROWS, tasks = blocks * dst->ne[2] * dst->ne[3];
    float * buf = NULL;
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) {
        if (buf == NULL && (buf = malloc(sizeof(float) * (size_t) (K * (TP_GEMM_ROWS + 1)))) == NULL) {
            GGML_ABORT("portable kernels: no memory for a %lld-deep product's rows", (long long) K);
        }
        const int64_t blk = task % blocks, i2 = (task / blocks) % dst->ne[2], i3 = task / (blocks * dst->ne[2]);
        const int64_t m0 = blk * TP_GEMM_ROWS, rows = M - m0 < TP_GEMM_ROWS ? M - m0 : TP_GEMM_ROWS;
        const char * pa = (const char *) a->data + (i2 / r2) * a->nb[2] + (i3 / r3) * a->nb[3];
        const char * pb = (const char *) b->data + i2 * b->nb[2] + i3 * b->nb[3];
        float * a_row = buf + K * TP_GEMM_ROWS;
        for (int64_t i = 0; i < rows; i++) tp_gather(b, pb + (m0 + i) * b_m, b_k, K, buf + i * K);
        for (int64_t j = 0; j < N; j++) {
            tp_gather(a, pa + j * a_n, a_k, K, a_row);
            for (int64_t i = 0; i < rows; i++) {
                float * c = (float *) ((char *) dst->data + j * dst->nb[0] + (m0 + i) * dst->nb[1] + i2 * dst->nb[2] +
                                       i3 * dst->nb[3]);
                *c = tp_dot(buf + i * K, a_row, K);
            }
        }
    }
    free(buf);
}

/* ---- products with a frozen weight W of another type than f32 (f16, bf16, quantized) ----------
 *   forward         MUL_MAT(W, x):   y[m][n]  = tp_dot(x[m], W[n])     over K
 *   input gradient  OUT_PROD(W, g):  dx[m][k] = tp_dot(dy[m], W[:, k]) over N   (g = dy^T)
 * W (ne = [K, N]) read through portable_quant.c, never widened whole: a forward task is
 * TP_FROZEN_ROWS rows of W (the outputs y[:, n0 .. n0 + rows)), a backward task a block of W's
 * columns as wide as its type's block, at least TP_FROZEN_COLS (the outputs dx[:, k0 .. k0 +
 * cols)); each dequantizes its part of W once. Tasks split the outputs only, and each output is
 * one tp_dot in tp_matmul's order: the bits of tp_matmul over the dequantized W (what
 * tests/test_portable_quant.py checks), whatever the thread count. GET_ROWS (an embedding
 * table) dequantizes the rows its ids name, one row a task. */
enum { TP_FROZEN_ROWS = 16, TP_FROZEN_COLS = 32 };

static float * tp_alloc(size_t n) {
    float * p = malloc(sizeof(float) * (n ? n : 1));
    if (p == NULL) GGML_ABORT("portable kernels: no memory for %zu floats of a frozen product", n);
    return p;
}

static void tp_frozen_mul_mat(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], M = x->ne[1];
    const int64_t tiles = (N + TP_FROZEN_ROWS - 1) / TP_FROZEN_ROWS;
    float * buf = NULL;
    int64_t taken = 0;
    for (int64_t tile; (tile = th_next_task(tiles, ith, nth, &taken)) >= 0;) {
        if (buf == NULL) buf = tp_alloc((size_t) (TP_FROZEN_ROWS * K));
        const int64_t n0 = tile * TP_FROZEN_ROWS, rows = N - n0 < TP_FROZEN_ROWS ? N - n0 : TP_FROZEN_ROWS;
        for (int64_t r = 0; r < rows; r++) tp_dequantize(w->type, (const char *) w->data + (n0 + r) * w->nb[1], buf + r * K, K);
        tp_matmul_nt((const float *) x->data, (int64_t) (x->nb[1] / sizeof(float)), buf, K, (float *) dst->data + n0,
                     (int64_t) (dst->nb[1] / sizeof(float)), M, rows, K);
    }
    free(buf);
}

static void tp_frozen_out_prod(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * w = dst->src[0], * g = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], M = g->ne[0];
    const int64_t block = tp_quant_block(w->type), cb = (TP_FROZEN_COLS + block - 1) / block * block;
    const int64_t col_blocks = (K + cb - 1) / cb;
    /* dy row m (N values) is g's column m: contiguous when g is the transpose of a contiguous dy */
    const int dy_rows = g->nb[1] == sizeof(float);
    float * wt = NULL, * seg = NULL, * dy = NULL;
    int64_t taken = 0;
    for (int64_t blk; (blk = th_next_task(col_blocks, ith, nth, &taken)) >= 0;) {
        if (wt == NULL) {
            wt = tp_alloc((size_t) (cb * N));
            seg = tp_alloc((size_t) cb);
            if (!dy_rows) dy = tp_alloc((size_t) N);
        }
        const int64_t k0 = blk * cb, cols = K - k0 < cb ? K - k0 : cb;
        for (int64_t n = 0; n < N; n++) {      /* W[:, k0 .. k0 + cols) as rows of N: wt[j][n] */
            tp_dequantize(w->type, (const char *) w->data + n * w->nb[1] + (size_t) (k0 / block) * (size_t) tp_quant_block_bytes(w->type),
                          seg, cols);
            for (int64_t j = 0; j < cols; j++) wt[j * N + n] = seg[j];
        }
        for (int64_t m = 0; m < M; m++) {
            const char * col = (const char *) g->data + m * g->nb[0];
            if (!dy_rows) {
                for (int64_t n = 0; n < N; n++) dy[n] = *(const float *) (col + n * g->nb[1]);
            }
            tp_matmul_nt(dy_rows ? (const float *) col : dy, N, wt, N, (float *) ((char *) dst->data + m * dst->nb[1]) + k0,
                         0, 1, cols, N);
        }
    }
    free(wt);
    free(seg);
    free(dy);
}

static void tp_frozen_get_rows(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * w = dst->src[0], * ids = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1];
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(dst), K, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const int32_t id = ((const int32_t *) ids->data)[r];
            if (id < 0 || id >= N) GGML_ABORT("portable kernels: row id %d out of range [0, %lld)", id, (long long) N);
            tp_dequantize(w->type, (const char *) w->data + id * w->nb[1], tp_row(dst, r), K);
        }
    }
}

/* ---- row-wise: softmax, rms_norm, their backward, sums --------------------------------------- */

/* SOFT_MAX: softmax(scale x + mask) per row; mask rows broadcast over dims 2 and 3 */
static void tp_soft_max(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * x = dst->src[0], * mask = dst->src[1];
    const float scale = tp_param(dst, 0);
    const int64_t nc = x->ne[0];
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(x), nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const int64_t i1 = r % x->ne[1], i2 = (r / x->ne[1]) % x->ne[2], i3 = r / (x->ne[1] * x->ne[2]);
            float * y = tp_row(dst, r);
            th_softmax_input(y, tp_row(x, r), mask, i1, i2, i3, nc, scale, 0);
            tp_softmax_row(y, y, nc);
        }
    }
}

/* SOFT_MAX_BACK (src0 dy, src1 y): dx = (dy - dot(y, dy)) y scale */
static void tp_soft_max_back(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * dy_t = dst->src[0], * y_t = dst->src[1];
    const float scale = tp_param(dst, 0);
    const int64_t nc = dst->ne[0];
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(dst), nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const float * dy = tp_row(dy_t, r), * y = tp_row(y_t, r);
            float * dx = tp_row(dst, r);
            const float dot = tp_dot(y, dy, nc);
            for (int64_t k = 0; k < nc; k++) dx[k] = (dy[k] - dot) * y[k] * scale;
        }
    }
}

/* RMS_NORM (src0 x): y = x / sqrt(mean(x^2) + eps); RMS_NORM_BACK (src0 dz, src1 x):
 * dx = (x (-sum(x dz) / (sum(x^2) + eps n)) + dz) / sqrt(mean(x^2) + eps), ggml's formula */
static void tp_rms_norm(struct ggml_tensor * dst, int back, int ith, int nth) {
    const struct ggml_tensor * src = back ? dst->src[1] : dst->src[0], * grad = back ? dst->src[0] : NULL;
    const float eps = tp_param(dst, 0);
    const int64_t n = src->ne[0];
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(src), n, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const float * x = tp_row(src, r);
            float * y = tp_row(dst, r);
            const float sum_xx = tp_dot(x, x, n), rrms = 1.0f / sqrtf(sum_xx / (float) n + eps);
            if (grad == NULL) {
                for (int64_t k = 0; k < n; k++) y[k] = x[k] * rrms;
                continue;
            }
            const float * dz = tp_row(grad, r);
            const float scale_x = -tp_dot(x, dz, n) / (sum_xx + eps * (float) n);
            for (int64_t k = 0; k < n; k++) y[k] = (x[k] * scale_x + dz[k]) * rrms;
        }
    }
}

/* SUM_ROWS: one tp_sum per row; SUM: one tp_sum over the contiguous whole (one task) */
static void tp_sums(struct ggml_tensor * dst, int whole, int ith, int nth) {
    const struct ggml_tensor * x = dst->src[0];
    if (whole) {
        if (ith == 0) *(float *) dst->data = tp_sum((const float *) x->data, ggml_nelements(x));
        return;
    }
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(x), x->ne[0], ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) *tp_row(dst, r) = tp_sum(tp_row(x, r), x->ne[0]);
    }
}

/* REPEAT_BACK: each element of dst sums its copies in src in one fixed order (i3, i2, i1, i0
 * blocks, outermost first), one dst row a task: the sum runs along independent outputs */
static void tp_repeat_back(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * src = dst->src[0];
    const int64_t ne0 = dst->ne[0], ne1 = dst->ne[1], ne2 = dst->ne[2], ne3 = dst->ne[3];
    const int64_t nr0 = src->ne[0] / ne0, nr1 = src->ne[1] / ne1, nr2 = src->ne[2] / ne2, nr3 = src->ne[3] / ne3;
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(dst), ne0, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const int64_t k1 = r % ne1, k2 = (r / ne1) % ne2, k3 = r / (ne1 * ne2);
            float * y = tp_row(dst, r);
            for (int64_t k = 0; k < ne0; k++) y[k] = 0.0f;
            for (int64_t i3 = 0; i3 < nr3; i3++) {
                for (int64_t i2 = 0; i2 < nr2; i2++) {
                    for (int64_t i1 = 0; i1 < nr1; i1++) {
                        const char * row = (const char *) src->data + (i3 * ne3 + k3) * src->nb[3] +
                                           (i2 * ne2 + k2) * src->nb[2] + (i1 * ne1 + k1) * src->nb[1];
                        for (int64_t i0 = 0; i0 < nr0; i0++) {
                            const float * x = (const float *) (row + i0 * ne0 * src->nb[0]);
                            for (int64_t k = 0; k < ne0; k++) y[k] = y[k] + x[k];
                        }
                    }
                }
            }
        }
    }
}

/* GET_ROWS_BACK (src0 the rows' gradient, src1 the ids): dst = 0, then each gradient row added
 * to row ids[i], i in order; one task (a row taken twice sums in id order) */
static void tp_get_rows_back(struct ggml_tensor * dst, int ith) {
    if (ith != 0) return;
    const struct ggml_tensor * grad = dst->src[0], * ids = dst->src[1];
    const int64_t n = dst->ne[0];
    memset(dst->data, 0, ggml_nbytes(dst));
    for (int64_t i = 0; i < ggml_nelements(ids); i++) {
        const int32_t id = ((const int32_t *) ids->data)[i];
        if (id < 0 || id >= ggml_nrows(dst)) GGML_ABORT("portable kernels: GET_ROWS_BACK id %d out of range", id);
        float * y = tp_row(dst, id);
        const float * g = tp_row(grad, i);
        for (int64_t k = 0; k < n; k++) y[k] = y[k] + g[k];
    }
}

/* ---- ROPE and ROPE_BACK: our own angles, sin and cos ------------------------------------------
 * theta_i = p freq_scale theta_scale^i, theta_scale = exp(log(base) (-2 / n_dims)) (tp_expf and
 * tp_logf, not powf), multiplied up in order as ggml does; NORMAL mode rotates pairs (i, i + 1),
 * NEOX (i, i + n_dims / 2); ROPE_BACK rotates by minus the angle; frequency factors divide the
 * angles. One task per position. */
enum { TP_ROPE_MAX_DIM = 1024 };

static void tp_rope(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * x = dst->src[0], * pos = dst->src[1];
    const int n_dims = dst->op_params[TP_SLOT + 0], neox = dst->op_params[TP_SLOT + 1] == GGML_ROPE_TYPE_NEOX;
    const float freq_base = tp_param(dst, 2), freq_scale = tp_param(dst, 3), mscale = tp_param(dst, 4);
    const float sin_sign = tp_param(dst, 5);
    const float theta_scale = tp_expf(tp_logf(freq_base) * (-2.0f / (float) n_dims));
    /* frequency factors (Llama 3's rope_freqs): pair i turns by freq_scale * (theta / ff[i]), as ggml */
    const float * ff = dst->src[2] ? (const float *) dst->src[2]->data : NULL;
    const int64_t ne0 = dst->ne[0], ne1 = dst->ne[1], ne2 = dst->ne[2], ne3 = dst->ne[3];
    float cos_t[TP_ROPE_MAX_DIM / 2], sin_t[TP_ROPE_MAX_DIM / 2];
    int64_t taken = 0;
    for (int64_t i2; (i2 = th_next_task(ne2, ith, nth, &taken)) >= 0;) {
        float theta = (float) ((const int32_t *) pos->data)[i2];
        for (int i = 0; i < n_dims / 2; i++) {
            float s, c;
            tp_sincosf(freq_scale * (ff ? theta / ff[i] : theta), &s, &c);
            cos_t[i] = c * mscale;
            sin_t[i] = s * mscale * sin_sign;
            theta = theta * theta_scale;
        }
        const int64_t n_offset = neox ? n_dims / 2 : 1;
        for (int64_t i3 = 0; i3 < ne3; i3++) {
            for (int64_t i1 = 0; i1 < ne1; i1++) {
                const float * src = (const float *) ((const char *) x->data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3]);
                float * out = (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
                for (int i = 0; i < n_dims / 2; i++) {
                    const int64_t ic = neox ? i : 2 * i;
                    const float x0 = src[ic], x1 = src[ic + n_offset];
                    out[ic] = x0 * cos_t[i] - x1 * sin_t[i];
                    out[ic + n_offset] = x0 * sin_t[i] + x1 * cos_t[i];
                }
                for (int64_t i0 = n_dims; i0 < ne0; i0++) out[i0] = src[i0];
            }
        }
    }
}

/* ---- ACC: a copied, then b added into a strided view of it --------------------------------------
 * The backward of a VIEW (the columns of a fused projection: phi3's q|k|v and gate|up). Each
 * element is one add of one value: no order to fix. One task. */
static void tp_acc(struct ggml_tensor * dst, int ith) {
    if (ith != 0) return;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1];
    const size_t nb1 = (size_t) dst->op_params[TP_SLOT + 0], nb2 = (size_t) dst->op_params[TP_SLOT + 1];
    const size_t nb3 = (size_t) dst->op_params[TP_SLOT + 2], offset = (size_t) dst->op_params[TP_SLOT + 3];
    if (dst->data != a->data) memcpy(dst->data, a->data, ggml_nbytes(dst));
    for (int64_t i3 = 0; i3 < b->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < b->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < b->ne[1]; i1++) {
                const float * src = (const float *) ((const char *) b->data + i1 * b->nb[1] + i2 * b->nb[2] + i3 * b->nb[3]);
                float * d = (float *) ((char *) dst->data + offset + i1 * nb1 + i2 * nb2 + i3 * nb3);
                for (int64_t i0 = 0; i0 < b->ne[0]; i0++) d[i0] += src[i0];
            }
        }
    }
}

/* ---- the loss ----------------------------------------------------------------------------------
 * CROSS_ENTROPY_LOSS (src0 logits, src1 targets): -(1 / rows) sum over rows, in order, of
 * dot(t, log softmax(x)), one task. CROSS_ENTROPY_LOSS_BACK (src0 the loss's gradient, src1
 * logits, src2 targets): (softmax(x) - t) d / rows, one row a task. */
static void tp_cross_entropy(struct ggml_tensor * dst, int ith) {
    if (ith != 0) return;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t nc = a->ne[0], nr = ggml_nrows(a);
    float * logp = malloc(sizeof(float) * (size_t) nc);
    if (logp == NULL) GGML_ABORT("portable kernels: no memory for a %lld-wide row", (long long) nc);
    float total = 0.0f;
    for (int64_t r = 0; r < nr; r++) {
        const float * x = tp_row(a, r);
        const float max = tp_max(x, nc);
        for (int64_t k = 0; k < nc; k++) logp[k] = tp_expf(x[k] - max);
        const float log_sum = tp_logf(tp_sum(logp, nc));
        for (int64_t k = 0; k < nc; k++) logp[k] = (x[k] - max) - log_sum;
        total = total + tp_dot(tp_row(b, r), logp, nc);
    }
    free(logp);
    *(float *) dst->data = total * (-1.0f / (float) nr);
}

static void tp_cross_entropy_back(struct ggml_tensor * dst, int ith, int nth) {
    const struct ggml_tensor * x_t = dst->src[1], * t_t = dst->src[2];
    const int64_t nc = x_t->ne[0], nr = ggml_nrows(x_t);
    const float d_by_nr = *(const float *) dst->src[0]->data / (float) nr;
    int64_t taken = 0, r0, r1;
    while (th_next_rows(nr, nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            float * dx = tp_row(dst, r);
            const float * t = tp_row(t_t, r);
            tp_softmax_row(tp_row(x_t, r), dx, nc);
            for (int64_t k = 0; k < nc; k++) dx[k] = (dx[k] - t[k]) * d_by_nr;
        }
    }
}

/* ---- the one custom op ----------------------------------------------------------------------- */
static void tp_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int kind = (int) (intptr_t) userdata;
    switch (kind) {
        case TP_MUL_MAT: case TP_OUT_PROD: tp_matmul(dst, kind == TP_OUT_PROD, ith, nth); break;
        case TP_FROZEN_MUL_MAT: tp_frozen_mul_mat(dst, ith, nth); break;
        case TP_FROZEN_OUT_PROD: tp_frozen_out_prod(dst, ith, nth); break;
        case TP_FROZEN_GET_ROWS: tp_frozen_get_rows(dst, ith, nth); break;
        case TP_SOFT_MAX: tp_soft_max(dst, ith, nth); break;
        case TP_SOFT_MAX_BACK: tp_soft_max_back(dst, ith, nth); break;
        case TP_RMS_NORM: case TP_RMS_NORM_BACK: tp_rms_norm(dst, kind == TP_RMS_NORM_BACK, ith, nth); break;
        case TP_SUM: case TP_SUM_ROWS: tp_sums(dst, kind == TP_SUM, ith, nth); break;
        case TP_REPEAT_BACK: tp_repeat_back(dst, ith, nth); break;
        case TP_GET_ROWS_BACK: tp_get_rows_back(dst, ith); break;
        case TP_ROPE: tp_rope(dst, ith, nth); break;
        case TP_CROSS_ENTROPY: tp_cross_entropy(dst, ith); break;
        case TP_CROSS_ENTROPY_BACK: tp_cross_entropy_back(dst, ith, nth); break;
        case TP_ACC: tp_acc(dst, ith); break;
        default: tp_elementwise(dst, kind, ith, nth); break;
    }
}

/* ---- which node gets which kernel --------------------------------------------------------------
 * Nodes left to ggml: they move data, computing nothing, so they give the input's bits anywhere
 * (views: no kernel at all; CONT, CPY, DUP and REPEAT of f32 copy floats; GET_ROWS copies rows,
 * widening f16 or bf16 exactly). */
static int tp_pass_through(const struct ggml_tensor * t) {
    switch (t->op) {
        case GGML_OP_NONE: case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
            return 1;
        case GGML_OP_CONT: case GGML_OP_CPY: case GGML_OP_DUP: case GGML_OP_REPEAT:
            return t->type == GGML_TYPE_F32 && t->src[0]->type == GGML_TYPE_F32;
        case GGML_OP_GET_ROWS:
            return t->type == GGML_TYPE_F32 && t->src[1]->type == GGML_TYPE_I32 &&
                   (t->src[0]->type == GGML_TYPE_F32 || t->src[0]->type == GGML_TYPE_F16 ||
                    t->src[0]->type == GGML_TYPE_BF16);
        default:
            return 0;
    }
}

/* dst f32 with contiguous rows, its srcs f32 with any strides (elementwise kernels) */
static int tp_f32_srcs(const struct ggml_tensor * t) {
    if (!tp_f32_rows(t)) return 0;
    for (int k = 0; k < GGML_MAX_SRC && t->src[k] != NULL; k++) {
        if (t->src[k]->type != GGML_TYPE_F32) return 0;
    }
    return 1;
}

static int tp_all_f32_rows(const struct ggml_tensor * t) {
    if (!tp_f32_rows(t)) return 0;
    for (int k = 0; k < GGML_MAX_SRC && t->src[k] != NULL; k++) {
        if (!tp_f32_rows(t->src[k])) return 0;
    }
    return 1;
}

static int tp_weight_type(const struct ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16;
}

/* a 2-D matrix whose rows are contiguous (nb0 = 4) */
static int tp_f32_matrix(const struct ggml_tensor * t) {
    return tp_f32_rows(t) && t->ne[2] == 1 && t->ne[3] == 1 && t->nb[1] % sizeof(float) == 0;
}

/* W of a frozen product or an embedding's table: another type than f32 that portable_quant.c
 * reads, 2-D, rows of whole blocks, contiguous */
static int tp_frozen_weight(const struct ggml_tensor * w) {
    const int block = tp_quant_block(w->type);
    return w->type != GGML_TYPE_F32 && block != 0 && w->ne[0] % block == 0 && w->ne[2] == 1 && w->ne[3] == 1 &&
           ggml_is_contiguous(w);
}

/* the frozen kernels' forms: MUL_MAT(W, x) with x's rows contiguous; OUT_PROD(W, g) with any f32
 * g (its columns, dy's rows, contiguous when g is a transposed dy); GET_ROWS(W, ids) of 1-D ids */
static int tp_frozen_kind(const struct ggml_tensor * t) {
    const struct ggml_tensor * w = t->src[0], * b = t->src[1];
    if (!tp_frozen_weight(w) || !tp_f32_matrix(t)) return 0;
    switch (t->op) {
        case GGML_OP_MUL_MAT: return tp_f32_matrix(b) ? TP_FROZEN_MUL_MAT : 0;
        case GGML_OP_OUT_PROD:
            return b->type == GGML_TYPE_F32 && b->ne[2] == 1 && b->ne[3] == 1 ? TP_FROZEN_OUT_PROD : 0;
        case GGML_OP_GET_ROWS:
            return b->type == GGML_TYPE_I32 && ggml_is_contiguous(b) && b->ne[1] == 1 && b->ne[2] == 1 &&
                   b->ne[3] == 1 && t->ne[1] == b->ne[0] ? TP_FROZEN_GET_ROWS : 0;
        default: return 0;
    }
}

/* The kernel kind for node t, or 0 when none here computes it (the op, or this form of it).
 * Each form is the one the kernel above handles; params are read from t before the rewrite. */
static int tp_kind_of(const struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    switch (t->op) {
        case GGML_OP_MUL_MAT: case GGML_OP_OUT_PROD:
            if (tp_frozen_kind(t) != 0) return tp_frozen_kind(t);
            return t->type == GGML_TYPE_F32 && tp_weight_type(a) && tp_weight_type(b) &&
                   t->ne[2] % a->ne[2] == 0 && t->ne[3] % a->ne[3] == 0 && t->ne[2] == b->ne[2] &&
                   t->ne[3] == b->ne[3] ? (t->op == GGML_OP_MUL_MAT ? TP_MUL_MAT : TP_OUT_PROD) : 0;
        case GGML_OP_ADD1:   /* a + b[0] (SUM's backward into a gradient already begun): ADD of b repeated */
            return tp_f32_srcs(t) && ggml_are_same_shape(t, a) && ggml_nelements(b) == 1 ? TP_ADD : 0;
        case GGML_OP_ADD: case GGML_OP_SUB: case GGML_OP_MUL: case GGML_OP_DIV:
            if (!tp_f32_srcs(t) || !ggml_are_same_shape(t, a) || !ggml_can_repeat(b, a)) return 0;
            return t->op == GGML_OP_ADD ? TP_ADD : t->op == GGML_OP_SUB ? TP_SUB : t->op == GGML_OP_MUL ? TP_MUL : TP_DIV;
        case GGML_OP_SCALE: case GGML_OP_SQR: case GGML_OP_SQRT: case GGML_OP_LOG:
            if (!tp_f32_srcs(t) || !ggml_are_same_shape(t, a)) return 0;
            return t->op == GGML_OP_SCALE ? TP_SCALE : t->op == GGML_OP_SQR ? TP_SQR : t->op == GGML_OP_SQRT ? TP_SQRT : TP_LOG;
        case GGML_OP_UNARY:
            if (!tp_f32_srcs(t) || !ggml_are_same_shape(t, a)) return 0;
            switch (ggml_get_unary_op(t)) {
                case GGML_UNARY_OP_SILU: return TP_SILU;
                case GGML_UNARY_OP_NEG: return TP_NEG;
                case GGML_UNARY_OP_EXP: return TP_EXP;
                case GGML_UNARY_OP_RELU: return TP_RELU;
                case GGML_UNARY_OP_STEP: return TP_STEP;
                case GGML_UNARY_OP_SGN: return TP_SGN;
                case GGML_UNARY_OP_ABS: return TP_ABS;
                case GGML_UNARY_OP_SIGMOID: return TP_SIGMOID;
                case GGML_UNARY_OP_SOFTPLUS: return TP_SOFTPLUS;
                default: return 0;
            }
        case GGML_OP_SILU_BACK:
            return tp_f32_srcs(t) && ggml_are_same_shape(t, a) && ggml_are_same_shape(t, b) ? TP_SILU_BACK : 0;
        case GGML_OP_GLU:  /* split swiglu, not swapped: silu(a) * b */
            return ggml_get_glu_op(t) == GGML_GLU_OP_SWIGLU && b != NULL && t->op_params[1] == 0 &&
                   tp_f32_srcs(t) && ggml_are_same_shape(t, a) && ggml_are_same_shape(t, b) ? TP_SWIGLU : 0;
        case GGML_OP_SOFT_MAX: {
            float max_bias;
            memcpy(&max_bias, (const float *) t->op_params + 1, sizeof(float));
            if (max_bias != 0.0f || t->src[2] != NULL || !tp_all_f32_rows(t) || !ggml_are_same_shape(t, a)) return 0;
            return b == NULL || (b->ne[0] == a->ne[0] && b->ne[1] >= a->ne[1] && a->ne[2] % b->ne[2] == 0 &&
                                 a->ne[3] % b->ne[3] == 0) ? TP_SOFT_MAX : 0;
        }
        case GGML_OP_SOFT_MAX_BACK: {
            float max_bias;
            memcpy(&max_bias, (const float *) t->op_params + 1, sizeof(float));
            return max_bias == 0.0f && tp_all_f32_rows(t) && ggml_are_same_shape(t, a) && ggml_are_same_shape(t, b)
                       ? TP_SOFT_MAX_BACK : 0;
        }
        case GGML_OP_RMS_NORM:
            return tp_all_f32_rows(t) && ggml_are_same_shape(t, a) ? TP_RMS_NORM : 0;
        case GGML_OP_RMS_NORM_BACK:
            return tp_all_f32_rows(t) && ggml_are_same_shape(t, a) && ggml_are_same_shape(t, b) ? TP_RMS_NORM_BACK : 0;
        case GGML_OP_SUM:
            return t->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 && ggml_is_contiguous(a) ? TP_SUM : 0;
        case GGML_OP_SUM_ROWS:
            return tp_all_f32_rows(t) && ggml_nrows(t) == ggml_nrows(a) && t->ne[0] == 1 ? TP_SUM_ROWS : 0;
        case GGML_OP_REPEAT_BACK:
            return t->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 && ggml_can_repeat(t, a) && tp_f32_rows(t)
                       ? TP_REPEAT_BACK : 0;
        case GGML_OP_GET_ROWS_BACK:
            return tp_f32_rows(t) && tp_f32_rows(a) && b->type == GGML_TYPE_I32 && ggml_is_contiguous(b) &&
                   ggml_is_contiguous(t) && a->ne[0] == t->ne[0] && ggml_nrows(a) == ggml_nelements(b) ? TP_GET_ROWS_BACK : 0;
        case GGML_OP_ROPE: case GGML_OP_ROPE_BACK: {
            const int32_t * p = t->op_params;
            float ext_factor;
            memcpy(&ext_factor, p + 7, sizeof(float));
            const struct ggml_tensor * ff = t->src[2];
            return tp_f32_rows(t) && tp_f32_rows(a) && b->type == GGML_TYPE_I32 &&
                   (ff == NULL || (ff->type == GGML_TYPE_F32 && ggml_is_contiguous(ff) && ff->ne[0] >= p[1] / 2)) &&
                   (p[2] == GGML_ROPE_TYPE_NORMAL || p[2] == GGML_ROPE_TYPE_NEOX) && ext_factor == 0.0f &&
                   p[15] == 0 && p[1] > 0 && p[1] % 2 == 0 && p[1] <= t->ne[0] && t->ne[0] <= TP_ROPE_MAX_DIM &&
                   ggml_are_same_shape(t, a) && b->ne[0] == t->ne[2] && ggml_is_contiguous(b) ? TP_ROPE : 0;
        }
        case GGML_OP_ACC:
            return t->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 &&
                   ggml_is_contiguous(t) && ggml_is_contiguous(a) && ggml_are_same_shape(t, a) &&
                   b->nb[0] == sizeof(float) ? TP_ACC : 0;
        case GGML_OP_CROSS_ENTROPY_LOSS:
            return tp_all_f32_rows(t) && ggml_are_same_shape(a, b) && a->ne[0] > 0 ? TP_CROSS_ENTROPY : 0;
        case GGML_OP_CROSS_ENTROPY_LOSS_BACK:
            return tp_all_f32_rows(t) && ggml_are_same_shape(t, b) && ggml_are_same_shape(t, t->src[2])
                       ? TP_CROSS_ENTROPY_BACK : 0;
        case GGML_OP_GET_ROWS:     /* of a quantized table (f32, f16, bf16 ones move data: tp_pass_through) */
            return tp_frozen_kind(t);
        default:
            return 0;
    }
}

static int tp_is_ours(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_CUSTOM) return 0;
    struct ggml_custom_op_params p;
    memcpy(&p, t->op_params, sizeof(p));
    /* dropout's mask (dropout_mask.c): integer arithmetic, the same bits on every CPU */
    return p.fun == tp_op || p.fun == th_adamw_op || p.fun == th_dropout_mask_op;
}

static void tp_set_custom(struct ggml_tensor * t, ggml_custom_op_t fun, int kind, int n_tasks) {
    int32_t old[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    memcpy(old, t->op_params, sizeof(old));
    struct ggml_custom_op_params p = {fun, n_tasks, (void *) (intptr_t) kind};
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, &p, sizeof(p));
    /* the op's own parameters, into the free slots */
    switch (kind) {
        case TP_SCALE: t->op_params[TP_SLOT] = old[0]; t->op_params[TP_SLOT + 1] = old[1]; break;  /* s, b */
        case TP_SOFT_MAX: case TP_SOFT_MAX_BACK: case TP_RMS_NORM: case TP_RMS_NORM_BACK:
            t->op_params[TP_SLOT] = old[0];  /* scale, eps */
            break;
        case TP_ACC: memcpy(t->op_params + TP_SLOT, old, 4 * sizeof(int32_t)); break;  /* nb1, nb2, nb3, offset */
        case TP_ROPE: {
            const float sin_sign = t->op == GGML_OP_ROPE ? 1.0f : -1.0f;
            t->op_params[TP_SLOT + 0] = old[1];  /* n_dims */
            t->op_params[TP_SLOT + 1] = old[2];  /* mode */
            t->op_params[TP_SLOT + 2] = old[5];  /* freq_base */
            t->op_params[TP_SLOT + 3] = old[6];  /* freq_scale */
            t->op_params[TP_SLOT + 4] = old[8];  /* attn_factor */
            memcpy(t->op_params + TP_SLOT + 5, &sin_sign, sizeof(float));
            break;
        }
        default: break;
    }
    t->op = GGML_OP_CUSTOM;
}

/* Every computing node of the graph to its portable kernel. Returns how many nodes were swapped,
 * or -1 (graph unchanged) when a node has no portable kernel: `why` then names it. Nodes a
 * previous call swapped (graphs share nodes) are left as they are. */
TP_EXPORT int th_portable_rewrite(struct ggml_cgraph * graph, char * why, size_t why_len) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (tp_is_ours(t) || tp_pass_through(t) || tp_kind_of(t) != 0 || th_adamw_ok(t)) continue;
        snprintf(why, why_len, "op %s of node '%s' (%s)", ggml_op_desc(t), t->name,
                 t->op == GGML_OP_CUSTOM || t->op == GGML_OP_MAP_CUSTOM1 || t->op == GGML_OP_MAP_CUSTOM2
                     ? "a custom op of another kernel set" : "no portable kernel takes this op or this form of it");
        return -1;
    }
    int changed = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (tp_is_ours(t) || tp_pass_through(t)) continue;
        /* AdamW: cpu_adamw.c's kernel is already portable: ggml's multiply-adds are explicit
         * fmaf (correctly rounded everywhere, with or without an FMA unit), its square root and
         * division IEEE-754's, and nothing else in it is a multiply followed by an add. */
        if (th_adamw_ok(t)) {
            tp_set_custom(t, th_adamw_op, 0, GGML_N_TASKS_MAX);
        } else {
            const int kind = tp_kind_of(t);
            const int one_task = kind == TP_CROSS_ENTROPY || kind == TP_GET_ROWS_BACK || kind == TP_SUM ||
                                 kind == TP_ACC;
            tp_set_custom(t, tp_op, kind, one_task ? 1 : GGML_N_TASKS_MAX);
        }
        changed++;
    }
    return changed;
}

/* The index of the first node of the graph that no portable kernel computes (th_portable_rewrite
 * would refuse it), or -1: the check a run makes when its graphs are built, before any compute. */
TP_EXPORT int th_portable_first_unsupported(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!(tp_is_ours(t) || tp_pass_through(t) || tp_kind_of(t) != 0 || th_adamw_ok(t))) return i;
    }
    return -1;
}

/* "portable" for a node computed by a kernel here (`bench --profile`), else NULL */
TP_EXPORT const char * th_portable_kernel_name(const struct ggml_tensor * t) {
    return tp_is_ours(t) ? "portable" : NULL;
}
