/* toyharness frozen products: matrix products with a frozen weight kept in its file's type.
 *
 * A LoRA base (or any frozen weight) stays in its GGUF type, mmap'd: f16, bf16, q8_0, q4_0,
 * q4_1, q5_0, q5_1, q4_K, q5_K, q6_K. ggml's cpu MUL_MAT with such a weight converts the f32
 * activations to the weight's dot-product type (q8_0, q8_K, f16...): the activations get
 * quantized, and the losses are no longer those of the dequantized model. Here both products
 * a frozen weight W (N x K, ggml ne = [K, N]) takes part in compute in f32 from W's exact ggml
 * dequantization (the type's own `to_float`, as the QLoRA recipe does):
 *   forward         MUL_MAT(W, x):      y (M x N)  = x (M x K) . W^T
 *   input gradient  OUT_PROD(W, dy^T):  dx (M x K) = dy (M x N) . W
 * A task dequantizes a tile of W into a small per-thread f32 buffer and hands it to the sgemm
 * the f32 products use (th_sgemm, cpu_kernels.c), so these products run at close to sgemm speed
 * and the base is never widened in memory. Tasks are fixed by the shapes alone; the backward
 * sums over N in tiles, in one fixed order, into its output block: every output element comes
 * from the same sequence of calls whatever the thread count, so bits never depend on it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h"
#include "cpu_kernels.h"

#define TH_EXPORT __attribute__((visibility("default")))

/* Tile sizes, fixed by the shapes alone (so bits never follow the thread count). A call's cost
 * beyond its FLOPs is packing its operands: the forward's activation block (TH_FROZEN_M rows) is
 * packed again for each tile of W, the backward's dy block for each column block, so wide
 * products want wide tiles; small ones want enough tasks to keep the threads busy. So: the
 * widest of 512, 256, 128 rows of W a forward tile (columns of dx a backward block) that still
 * makes TH_FROZEN_MIN_TASKS tasks, else 64 with the backward summing over W's rows 128 at a time
 * (the earlier tiles: small products keep their bits), 512 otherwise. Measured on
 * Llama-3.2-1B's attn_q, ffn_up and
 * ffn_down 1.06-1.14x faster at 16 tasks (1.11-1.16x at 8, but SmolLM2-135M's layers 1-5% slower
 * there: 16 keeps them and leaves more tasks for machines of more cores). */
enum { TH_FROZEN_M = 512, TH_FROZEN_MIN_TASKS = 16, TH_FROZEN_NARROW = 64, TH_FROZEN_NARROW_BACK_ROWS = 128,
       TH_FROZEN_WIDE_BACK_ROWS = 512 };

/* the tile width along a dimension of `n` for a product of `m` activation rows */
TH_EXPORT int64_t th_frozen_tile(int64_t n, int64_t m) {
    const int64_t row_blocks = (m + TH_FROZEN_M - 1) / TH_FROZEN_M;
    for (int64_t wide = 512; wide >= 128; wide /= 2) {
        if ((n + wide - 1) / wide * row_blocks >= TH_FROZEN_MIN_TASKS) return wide;
    }
    return TH_FROZEN_NARROW;
}

/* The types a frozen weight may have here (the Python side names the same list). */
TH_EXPORT int th_frozen_type_ok(int type) {
    switch (type) {
        case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
            return ggml_get_type_traits((enum ggml_type) type)->to_float != NULL;
        default:
            return 0;
    }
}

/* A per-thread f32 buffer for dequantized tiles (ggml's threads are OpenMP's, kept for the
 * process: the buffer is made once per thread and grown when a larger tile comes). */
static _Thread_local float * th_tile_buf = NULL;
static _Thread_local size_t th_tile_cap = 0;

static float * th_tile(size_t n) {
    if (n > th_tile_cap) {
        free(th_tile_buf);
        const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
        th_tile_buf = (float *) aligned_alloc(64, bytes);
        th_tile_cap = th_tile_buf != NULL ? n : 0;
    }
    return th_tile_buf;
}

/* rows [r0, r0 + rows) of W, columns [c0, c0 + cols) (c0 and cols multiples of the type's block,
 * or cols reaching the end of the row) into out (rows x cols, row-major); an f32 W is copied */
void th_dequantize(const struct ggml_tensor * w, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                          float * out) {
    if (w->type == GGML_TYPE_F32) {
        for (int64_t r = 0; r < rows; r++) {
            memcpy(out + r * cols, (const char *) w->data + (r0 + r) * w->nb[1] + c0 * sizeof(float), cols * sizeof(float));
        }
        return;
    }
    const struct ggml_type_traits * tr = ggml_get_type_traits(w->type);
    const size_t col_offset = (size_t) (c0 / tr->blck_size) * tr->type_size;
    for (int64_t r = 0; r < rows; r++) {
        const char * row = (const char *) w->data + (r0 + r) * w->nb[1] + col_offset;
        if (!th_fast_dequantize_row(w->type, row, out + r * cols, cols)) tr->to_float(row, out + r * cols, cols);
    }
}

/* C (m x n, row-major) = A . B + beta C, A (m x k) read transposed when trans_a (stored k x m),
 * B (k x n), or B^T when trans_b (stored n x k). th_sgemm when the binding gave one; else a
 * plain loop (each element summed over k in order: slow, same meaning). */
void th_frozen_gemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, const float * a, int64_t lda,
                           const float * b, int64_t ldb, float beta, float * c, int64_t ldc) {
    if (th_sgemm != NULL) {
        th_sgemm(TH_ROW_MAJOR, trans_a ? TH_TRANS : TH_NO_TRANS, trans_b ? TH_TRANS : TH_NO_TRANS, (int) m, (int) n,
                 (int) k, 1.0f, a, (int) lda, b, (int) ldb, beta, c, (int) ldc);
        return;
    }
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int64_t p = 0; p < k; p++) {
                sum += (trans_a ? a[p * lda + i] : a[i * lda + p]) * (trans_b ? b[j * ldb + p] : b[p * ldb + j]);
            }
            c[i * ldc + j] = beta == 0.0f ? sum : beta * c[i * ldc + j] + sum;
        }
    }
}

/* y = x . W^T. Task (tile, block): W rows [n0, n0 + th_frozen_tile(N, M)) dequantized, times
 * activation rows [m0, m0 + TH_FROZEN_M): one sgemm. A thread's tasks run tile by tile, so
 * a tile dequantized for one block serves the thread's next blocks of the same tile. */
static void th_frozen_mul_mat_op(struct ggml_tensor * dst, const struct ggml_tensor * w, const struct ggml_tensor * x,
                                 int ith, int nth, void * userdata) {
    (void) userdata;
    const int64_t K = w->ne[0], N = w->ne[1], M = x->ne[1];
    const int64_t ldx = (int64_t) (x->nb[1] / sizeof(float)), ldy = (int64_t) (dst->nb[1] / sizeof(float));
    const int64_t tile_rows = th_frozen_tile(N, M);
    const int64_t tiles = (N + tile_rows - 1) / tile_rows, blocks = (M + TH_FROZEN_M - 1) / TH_FROZEN_M;
    float * buf = th_tile((size_t) tile_rows * K);
    int64_t taken = 0, have = -1;
    for (int64_t task; (task = th_next_task(tiles * blocks, ith, nth, &taken)) >= 0;) {
        const int64_t tile = task / blocks, blk = task % blocks;
        const int64_t n0 = tile * tile_rows, rows = N - n0 < tile_rows ? N - n0 : tile_rows;
        const int64_t m0 = blk * TH_FROZEN_M, ms = M - m0 < TH_FROZEN_M ? M - m0 : TH_FROZEN_M;
        if (tile != have) {
            th_dequantize(w, n0, rows, 0, K, buf);
            have = tile;
        }
        th_frozen_gemm(0, 1, ms, rows, K, (const float *) ((const char *) x->data + m0 * x->nb[1]), ldx, buf, K, 0.0f,
                       (float *) ((char *) dst->data + m0 * dst->nb[1]) + n0, ldy);
    }
}

/* dx = dy . W, with OUT_PROD's second operand g = dy^T (g's element (m, n) is dy's (m, n)).
 * Task (column block, row block): output columns [k0, k0 + kb) of rows [m0, m0 + TH_FROZEN_M),
 * kb = th_frozen_tile(K, M) (rounded up to W's block), summed over W's rows in tiles of 128 or
 * 512 (above), in order (beta 0, then 1). */
static void th_frozen_out_prod_op(struct ggml_tensor * dst, const struct ggml_tensor * w, const struct ggml_tensor * g,
                                  int ith, int nth, void * userdata) {
    (void) userdata;
    const int64_t K = w->ne[0], N = w->ne[1], M = g->ne[0];
    const int64_t blck = ggml_blck_size(w->type);
    const int64_t tile = th_frozen_tile(K, M), kb = (tile + blck - 1) / blck * blck;
    /* by the tile asked for, not kb: a K-quant's 256-value blocks round 64 up to 256 */
    const int64_t back_rows = tile > TH_FROZEN_NARROW ? TH_FROZEN_WIDE_BACK_ROWS : TH_FROZEN_NARROW_BACK_ROWS;
    /* dy as a row-major M x N matrix: g's rows contiguous (dy stored N x M, read transposed) or not */
    const int trans_dy = g->nb[0] == sizeof(float);
    const int64_t ld_dy = (int64_t) ((trans_dy ? g->nb[1] : g->nb[0]) / sizeof(float));
    const int64_t ldx = (int64_t) (dst->nb[1] / sizeof(float));
    const int64_t col_blocks = (K + kb - 1) / kb, row_blocks = (M + TH_FROZEN_M - 1) / TH_FROZEN_M;
    float * buf = th_tile((size_t) back_rows * kb);
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(col_blocks * row_blocks, ith, nth, &taken)) >= 0;) {
        const int64_t cb = task / row_blocks, rb = task % row_blocks;
        const int64_t k0 = cb * kb, cols = K - k0 < kb ? K - k0 : kb;
        const int64_t m0 = rb * TH_FROZEN_M, ms = M - m0 < TH_FROZEN_M ? M - m0 : TH_FROZEN_M;
        float * out = (float *) ((char *) dst->data + m0 * dst->nb[1]) + k0;
        for (int64_t n0 = 0; n0 < N; n0 += back_rows) {
            const int64_t rows = N - n0 < back_rows ? N - n0 : back_rows;
            th_dequantize(w, n0, rows, k0, cols, buf);
            const float * a = (const float *) g->data + (trans_dy ? n0 * ld_dy + m0 : m0 * ld_dy + n0);
            th_frozen_gemm(trans_dy, 0, ms, cols, rows, a, ld_dy, buf, cols, n0 == 0 ? 0.0f : 1.0f, out, ldx);
        }
    }
}

/* a 2-D f32 operand whose rows are contiguous (nb0 = 4), or, with `either`, whose columns are */
static int th_f32_matrix(const struct ggml_tensor * t, int either) {
    if (t->type != GGML_TYPE_F32 || t->ne[2] != 1 || t->ne[3] != 1) return 0;
    if (t->nb[0] == sizeof(float) && t->nb[1] % sizeof(float) == 0 && t->nb[1] >= t->ne[0] * sizeof(float)) return 1;
    return either && t->nb[1] == sizeof(float) && t->nb[0] % sizeof(float) == 0 &&
           t->nb[0] >= t->ne[1] * sizeof(float);
}

/* t is a product with a non-f32 weight: 1 if a frozen kernel here computes it, else 0 */
static int th_frozen_ok(const struct ggml_tensor * t) {
    const struct ggml_tensor * w = t->src[0];
    if (!th_frozen_type_ok(w->type) || w->ne[2] != 1 || w->ne[3] != 1 || !ggml_is_contiguous(w)) return 0;
    if (t->ne[0] > INT32_MAX || t->ne[1] > INT32_MAX || w->ne[0] > INT32_MAX || w->ne[1] > INT32_MAX) return 0;
    if (!th_f32_matrix(t, 0)) return 0;
    return t->op == GGML_OP_MUL_MAT ? th_f32_matrix(t->src[1], 0) : th_f32_matrix(t->src[1], 1);
}

/* Every MUL_MAT and OUT_PROD whose first operand is not f32 becomes a frozen kernel. Returns how
 * many, or -1 when one cannot be (its type or layout is not one of these kernels'): ggml would
 * compute it with quantized activations, so the caller must not compute the graph. */
int th_rewrite_frozen(struct ggml_cgraph * graph) {
    int changed = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if ((t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD) || t->src[0]->type == GGML_TYPE_F32) continue;
        if (!th_frozen_ok(t)) return -1;
        th_set_custom2(t, t->op == GGML_OP_MUL_MAT ? th_frozen_mul_mat_op : th_frozen_out_prod_op, NULL,
                       GGML_N_TASKS_MAX);
        changed++;
    }
    return changed;
}

/* For `bench --profile` and the FLOP count: "frozen_matmul" / "frozen_out_prod" and the
 * product's FLOPs when t is one of these kernels; NULL and 0 otherwise. */
const char * th_frozen_kernel_name(const struct ggml_tensor * t, double * flops) {
    if (t->op != GGML_OP_MAP_CUSTOM2) return NULL;
    struct ggml_map_custom2_op_params p;
    memcpy(&p, t->op_params, sizeof(p));
    if (p.fun != th_frozen_mul_mat_op && p.fun != th_frozen_out_prod_op) return NULL;
    /* y (M x N) over K, or dx (M x K) over N: 2 FLOPs per multiply-add either way */
    *flops = 2.0 * (double) ggml_nelements(t) * (double) (p.fun == th_frozen_mul_mat_op ? t->src[0]->ne[0]
                                                                                          : t->src[0]->ne[1]);
    return p.fun == th_frozen_mul_mat_op ? "frozen_matmul" : "frozen_out_prod";
}
