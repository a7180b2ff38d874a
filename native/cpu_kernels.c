/* toyharness cpu kernels: faster stand-ins for the hot nodes of a finished cpu graph.
 *
 * For our tiny models ggml 0.25.3's cpu backend is slow in these places (measured with
 * `toyharness bench --profile`):
 *   - f32 MUL_MAT and OUT_PROD (OUT_PROD is a plain loop): OpenBLAS sgemm instead;
 *   - CONT of a permuted tensor (one element at a time): a tiled copy, same bits;
 *   - SILU_BACK (a scalar expf and a division per element): a vectorisable exp;
 *   - SOFT_MAX and CROSS_ENTROPY_LOSS (per-row overhead; scalar expf, logf): the same exp;
 *   - RMS_NORM and RMS_NORM_BACK (row sums in double, one element at a time): vectorised sums;
 *   - products with LayerNorm's centring constant I - 1/d (blocks.layer_norm), a d-deep dot
 *     product per element: one pass of row centring instead;
 *   - GELU, composed from 17 nodes forward and backward (ggml has no GELU backward): one node
 *     each way, through a stand-in node that blocks.gelu_tanh names for this rewrite;
 *   - a bias added as y + ones @ b (blocks.add_bias): y + b, the product not computed;
 *   - ROPE and ROPE_BACK (cos and sin of every position's angles once per batch row): the
 *     table once per position;
 *   - OPT_STEP_ADAMW (a scalar loop): the same arithmetic, vectorised;
 *   - an ADD of a product, and a norm gain's MULs in the backward (th_cpu_fold, at the Trainer):
 *     computed by the node that reads them, one pass less each.
 * th_cpu_rewrite swaps each such node for a custom op with the same inputs and output. It runs
 * after the backward graph is built: ggml has no backward for custom ops. Every kernel cuts its
 * work into tasks fixed by the shapes alone, never by the thread count, so the bits do not
 * depend on the number of threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#endif

#include "ggml.h"
#include "ggml-impl.h" /* struct ggml_map_custom{1,2}_op_params */
#include "cpu_kernels.h"
#include "custom_ops.h"
#include "dropout_mask.h"

#define TH_EXPORT __attribute__((visibility("default")))

/* row r of t (rows counted over ne1, ne2, ne3) */
static inline char * th_row(const struct ggml_tensor * t, int64_t r) {
    const int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
    return (char *) t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

/* the op_params slot where a rewritten node keeps its own parameter (scale, eps); slots 0-5 hold
 * the custom op's */
enum { TH_PARAM_SLOT = 8 };

/* ---- matrix products through an external sgemm ---------------------------------------------
 * The binding hands us a CBLAS sgemm (OpenBLAS from the scipy-openblas32 wheel). The work is
 * cut into fixed tasks (a batch slice times a tile of output rows and columns), each one sgemm
 * call on one thread, so every output element comes from the same call whatever the thread
 * count.
 *
 * The tiles (th_gemm_cut): each call packs its whole second operand again, and calls of 64 rows
 * ran at 69-94 GFLOP/s a core against 95-100 for 192 rows or more (OpenBLAS SkylakeX and Haswell
 * at training shapes). So 64-row blocks are merged where a slice has rows to spare (at least
 * TH_GEMM_MIN_CALLS calls left for the threads, at most TH_GEMM_MAX_ROWS rows a call), and a
 * product of few rows (a weight's gradient: its rows are the weight's; 3 to 7 blocks) is cut
 * into two or more calls of merged rows and, to keep TH_GEMM_MIN_CALLS tasks, into column tiles
 * of at least TH_GEMM_MIN_COLS. Two blocks or fewer stay as they were. The cut depends on the
 * shape alone. (Letting each thread merge its own blocks would be faster still at 2 threads, but
 * OpenBLAS's rows are not the same bits for every cut, e.g. its small-matrix paths: the bits
 * would follow the thread count.) */
enum { TH_GEMM_ROWS = 64, TH_GEMM_MIN_CALLS = 8, TH_GEMM_MAX_ROWS = 256, TH_GEMM_MIN_COLS = 192 };
th_sgemm_fn th_sgemm = NULL;

TH_EXPORT void th_set_sgemm(void * fn) { th_sgemm = (th_sgemm_fn) fn; }

/* rows and columns of one call, for a product with M x N output a slice (exported for the tests) */
TH_EXPORT void th_gemm_cut(int64_t M, int64_t N, int64_t * rows, int64_t * cols) {
    *rows = TH_GEMM_ROWS, *cols = N;
    const int64_t blocks = (M + TH_GEMM_ROWS - 1) / TH_GEMM_ROWS;
    int64_t merged = blocks / TH_GEMM_MIN_CALLS;
    if (merged < 1) merged = blocks / 2 > 1 ? blocks / 2 : 1;
    if (merged > TH_GEMM_MAX_ROWS / TH_GEMM_ROWS) merged = TH_GEMM_MAX_ROWS / TH_GEMM_ROWS;
    if (merged == 1) return;    /* 2 blocks or fewer: as they were (narrower tiles were slower there) */
    *rows = merged * TH_GEMM_ROWS;
    const int64_t row_calls = (M + *rows - 1) / *rows;
    int64_t col_calls = (TH_GEMM_MIN_CALLS + row_calls - 1) / row_calls;
    if (col_calls > N / TH_GEMM_MIN_COLS) col_calls = N / TH_GEMM_MIN_COLS;
    if (col_calls > 1) *cols = ((N + col_calls - 1) / col_calls + 15) / 16 * 16;
}

/* ---- causal attention's products ------------------------------------------------------------
 * P = softmax(S + causal mask) is zero above the diagonal (query i sees keys j <= i), and so is
 * its gradient dS = SOFT_MAX_BACK(dP, P); S and dP are read on and below it only. Seen as
 * C (M x N) = A (M x K) . B (K x N), a product that makes S or dP (TH_CAUSAL_OUT) computes in each
 * block of rows the columns those rows see and writes 0 to the rest (the softmax and its backward
 * read whole rows); one that reads P or dS, either way round, contracts only over the terms that
 * are not exactly zero: A = X (X lower triangular) gives rows [m0, m1) the terms k < m1, A = X^T
 * the terms k >= m0, B = X columns [n0, n1) the terms k >= n0, B = X^T the terms k < n1. What is
 * left out is a sum of exact zeros (0 x a finite value): every element sums the same nonzero terms
 * in the same order (OpenBLAS may still round a smaller call otherwise: which kernel it takes
 * follows the call's size). PyTorch's scaled_dot_product_attention (is_causal) skips the
 * same blocks; about half of attention's FLOPs at long sequences. The blocks: TH_CAUSAL_BLOCK
 * rows (or columns, for the B forms) a call where the product has more. */
enum th_causal { TH_CAUSAL_NONE, TH_CAUSAL_OUT, TH_CAUSAL_A_LOWER, TH_CAUSAL_A_UPPER, TH_CAUSAL_B_LOWER,
                 TH_CAUSAL_B_UPPER };
enum { TH_CAUSAL_BLOCK = 64 };

/* the contraction's terms [*k0, *k1) and the output columns computed (the rest of the tile is
 * written 0) of the tile of rows [m0, m0 + rows) and columns [n0, n0 + cols) */
static void th_causal_range(int causal, int64_t K, int64_t m0, int64_t rows, int64_t n0, int64_t cols,
                            int64_t * k0, int64_t * k1, int64_t * computed) {
    *k0 = 0, *k1 = K, *computed = cols;
    switch (causal) {
    case TH_CAUSAL_OUT:     *computed = m0 + rows - n0 < 0 ? 0 : (m0 + rows - n0 < cols ? m0 + rows - n0 : cols); break;
    case TH_CAUSAL_A_LOWER: *k1 = m0 + rows < K ? m0 + rows : K; break;
    case TH_CAUSAL_A_UPPER: *k0 = m0 < K ? m0 : K; break;
    case TH_CAUSAL_B_LOWER: *k0 = n0 < K ? n0 : K; break;
    case TH_CAUSAL_B_UPPER: *k1 = n0 + cols < K ? n0 + cols : K; break;
    default: break;
    }
}

/* Packed rows (toyharness/engine/packed.py): the softmax's mask, fed per step as (T, T, 1, B), is
 * block-diagonal within the causal triangle, so X (P or dS) of batch row b is zero outside each
 * example's block too. Row i of X is nonzero in columns [start(i), i] only, column j in rows
 * [j, end(j)); starts and ends grow with i and j. A product of a packed attention (th_gemm_packed_op)
 * narrows the causal form's terms (or, making S or dP, its columns) further to a tile's block range,
 * read from the mask per tile: what is left out is again a sum of exact zeros. */
static const float TH_MASK_SEEN = -1e20f;       /* packed masks hold 0 (seen) or -1e30 (hidden) */

static const float * th_mask_row(const struct ggml_tensor * m, int64_t b, int64_t i) {
    return (const float *) ((const char *) m->data + i * m->nb[1] + (b % m->ne[3]) * m->nb[3]);
}

static int64_t th_segment_start(const struct ggml_tensor * m, int64_t b, int64_t i) {
    const float * row = th_mask_row(m, b, i);
    int64_t k = 0;
    while (k < i && row[k] < TH_MASK_SEEN) k++;
    return k;
}

static int64_t th_segment_end(const struct ggml_tensor * m, int64_t b, int64_t j) {
    int64_t k = j + 1;
    while (k < m->ne[1] && th_mask_row(m, b, k)[j] >= TH_MASK_SEEN) k++;
    return k;
}

/* a tile's terms [*k0, *k1) (already the causal form's) and, for TH_CAUSAL_OUT, its first computed
 * column *first, narrowed to the blocks of batch row b */
static void th_packed_range(const struct ggml_tensor * m, int causal, int64_t b, int64_t m0, int64_t rows, int64_t n0,
                            int64_t cols, int64_t * k0, int64_t * k1, int64_t * first) {
    int64_t s;
    *first = 0;
    switch (causal) {
    case TH_CAUSAL_OUT:     s = th_segment_start(m, b, m0) - n0; *first = s < 0 ? 0 : (s < cols ? s : cols); break;
    case TH_CAUSAL_A_LOWER: s = th_segment_start(m, b, m0); if (s > *k0) *k0 = s; break;
    case TH_CAUSAL_A_UPPER: s = th_segment_end(m, b, m0 + rows - 1); if (s < *k1) *k1 = s; break;
    case TH_CAUSAL_B_LOWER: s = th_segment_end(m, b, n0 + cols - 1); if (s < *k1) *k1 = s; break;
    case TH_CAUSAL_B_UPPER: s = th_segment_start(m, b, n0); if (s > *k0) *k0 = s; break;
    default: break;
    }
}

/* A 2-D slice of t seen as a row-major (ne1 x ne0) matrix `view`: stored either row-major
 * (nb0 = 4) or as the transpose of a row-major matrix (nb1 = 4). Say which operand of sgemm
 * is wanted (view or view^T) and get its trans flag and leading dimension. */
static int th_operand(const struct ggml_tensor * t, int want_transposed, int * trans, int * ld) {
    const size_t es = sizeof(float);
    if (t->nb[0] == es && t->nb[1] % es == 0) {
        int64_t l = t->ne[1] > 1 ? (int64_t) (t->nb[1] / es) : t->ne[0];
        if (l < t->ne[0]) return 0;
        *trans = want_transposed ? TH_TRANS : TH_NO_TRANS;
        *ld = (int) (l > 0 ? l : 1);
        return 1;
    }
    if (t->nb[1] == es && t->nb[0] % es == 0) {
        int64_t l = t->ne[0] > 1 ? (int64_t) (t->nb[0] / es) : t->ne[1];
        if (l < t->ne[1]) return 0;
        *trans = want_transposed ? TH_NO_TRANS : TH_TRANS;
        *ld = (int) (l > 0 ? l : 1);
        return 1;
    }
    return 0;
}

/* One output column (N = 1) of an OUT_PROD: c[i] = sum_k b[k][i] a[k], b's rows contiguous (a bias
 * gradient: ones^T dY, a column sum of dY). sgemm took such a product as a strided matrix-vector
 * product: 16-29 us for dY of 1024 x 128, 0.37-0.62 ms of the default gpt2 step's 15.6 on the AVX2
 * build (bench --profile); this pass down b's rows, each row one vector operation into the partial
 * sums, takes 0.13 ms. Each element's sum runs over k in one fixed order whatever the tile or thread
 * (blocks of TH_COLUMN_BLOCK terms, each block's sum added to the total), so the bits follow the
 * shape alone; the blocks keep the rounding error near a pairwise sum's, not a K-term running sum's. */
enum { TH_COLUMN_BLOCK = 128, TH_COLUMN_STRIPE = 64 };

static void th_column_product(float * c, int64_t ldc, const char * b, size_t kb, const char * a, size_t ka,
                              int64_t rows, int64_t K) {
    for (int64_t i0 = 0; i0 < rows; i0 += TH_COLUMN_STRIPE) {
        const int64_t w = rows - i0 < TH_COLUMN_STRIPE ? rows - i0 : TH_COLUMN_STRIPE;
        float total[TH_COLUMN_STRIPE], part[TH_COLUMN_STRIPE];
        for (int64_t j = 0; j < w; j++) total[j] = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += TH_COLUMN_BLOCK) {
            const int64_t k1 = k0 + TH_COLUMN_BLOCK < K ? k0 + TH_COLUMN_BLOCK : K;
            for (int64_t j = 0; j < w; j++) part[j] = 0.0f;
            for (int64_t k = k0; k < k1; k++) {
                const float ak = *(const float *) (a + k * ka);
                const float * restrict bk = (const float *) (b + k * kb) + i0;
                for (int64_t j = 0; j < w; j++) part[j] += bk[j] * ak;
            }
            for (int64_t j = 0; j < w; j++) total[j] += part[j];
        }
        for (int64_t j = 0; j < w; j++) c[(i0 + j) * ldc] = total[j];
    }
}

/* dst(m, n) as a row-major M x N matrix, M = dst->ne[1], N = dst->ne[0]:
 *   MUL_MAT  dst = b_view   . a_view^T   (a: N x K, b: M x K)
 *   OUT_PROD dst = b_view^T . a_view     (a: K x N, b: K x M)
 * With K = 1 (our bias broadcast: ones(rows, 1) @ b) it is an outer product, written directly:
 * the same bits as sgemm's 0 + 1 * (x * y), without its zeroing pass and call overhead.
 * `addend` (th_gemm_add_op, NULL otherwise): added to each block of output rows as soon as the
 * block is made, while it is in cache: a contiguous tensor of dst's size (element for element),
 * or with `bias` one row of N added to every row. The same one rounding per element as the ADD
 * it replaces (float addition commutes). */
static void th_gemm_run(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                        int out_prod, int causal, const struct ggml_tensor * addend, int bias, int ith, int nth,
                        const struct ggml_tensor * packed) {
    int ta, lda, tb, ldb;
    th_operand(b, out_prod, &tb, &ldb);
    th_operand(a, !out_prod, &ta, &lda);
    const int64_t M = dst->ne[1], N = dst->ne[0];
    const int64_t K = out_prod ? a->ne[1] : a->ne[0];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    int64_t call_rows, call_cols;
    th_gemm_cut(M, N, &call_rows, &call_cols);
    /* causal blocks: a remainder joins the last block (no call of a few rows) */
    int64_t row_blocks = (M + call_rows - 1) / call_rows, col_blocks = (N + call_cols - 1) / call_cols;
    if (causal == TH_CAUSAL_B_LOWER || causal == TH_CAUSAL_B_UPPER) {
        if (N >= 2 * TH_CAUSAL_BLOCK) {
            call_rows = M, call_cols = TH_CAUSAL_BLOCK, row_blocks = 1, col_blocks = N / TH_CAUSAL_BLOCK;
        }
    } else if (causal != TH_CAUSAL_NONE && M >= 2 * TH_CAUSAL_BLOCK) {
        call_rows = TH_CAUSAL_BLOCK, call_cols = N, row_blocks = M / TH_CAUSAL_BLOCK, col_blocks = 1;
    }
    /* the contraction's stride in each operand: along b's ne0 (MUL_MAT) or ne1 (OUT_PROD), the same in a */
    const size_t kb = out_prod ? b->nb[1] : b->nb[0], ka = out_prod ? a->nb[1] : a->nb[0];
    const int64_t tiles = row_blocks * col_blocks, tasks = tiles * dst->ne[2] * dst->ne[3];
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) {
        const int64_t tile = task % tiles, i2 = (task / tiles) % dst->ne[2], i3 = task / (tiles * dst->ne[2]);
        const int64_t m0 = tile / col_blocks * call_rows, n0 = tile % col_blocks * call_cols;
        const int64_t rows = tile / col_blocks == row_blocks - 1 ? M - m0 : call_rows;
        const int64_t cols = tile % col_blocks == col_blocks - 1 ? N - n0 : call_cols;
        const char * pa = (const char *) a->data + (i2 / r2) * a->nb[2] + (i3 / r3) * a->nb[3];
        const char * pb = (const char *) b->data + i2 * b->nb[2] + i3 * b->nb[3];
        /* the first operand's rows m0.. : along b's ne1 for MUL_MAT, along b's ne0 for OUT_PROD;
         * the second's columns n0.. : along a's ne1 for MUL_MAT, along a's ne0 for OUT_PROD */
        pb += m0 * (out_prod ? b->nb[0] : b->nb[1]);
        pa += n0 * (out_prod ? a->nb[0] : a->nb[1]);
        float * pc = (float *) ((char *) dst->data + m0 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]) + n0;
        const int ldc = (int) (dst->nb[1] / sizeof(float));
        if (out_prod && N == 1 && K > 1 && causal == TH_CAUSAL_NONE && b->nb[0] == sizeof(float)) {
            th_column_product(pc, ldc, pb, kb, pa, ka, rows, K);
        } else if (K == 1) {
            /* element i of the first operand's column, element j of the second's row */
            const size_t sb = out_prod ? b->nb[0] : b->nb[1], sa = out_prod ? a->nb[0] : a->nb[1];
            for (int64_t i = 0; i < rows; i++) {
                const float x = *(const float *) ((const char *) pb + i * sb);
                float * c = pc + i * ldc;
                for (int64_t j = 0; j < cols; j++) c[j] = x * *(const float *) (pa + j * sa);
            }
        } else {
            int64_t k0, k1, computed, first = 0;
            th_causal_range(causal, K, m0, rows, n0, cols, &k0, &k1, &computed);
            if (packed != NULL) {
                /* the batch row of this slice: dst's slices are its (batch, head) pairs, batch-major */
                th_packed_range(packed, causal, i2 / (dst->ne[2] / packed->ne[3]), m0, rows, n0, cols, &k0, &k1, &first);
                if (first > computed) first = computed;
            }
            if (k1 <= k0) computed = first = 0;
            if (computed > first) {
                const size_t step = out_prod ? a->nb[0] : a->nb[1];     /* one column of the second operand */
                th_sgemm(TH_ROW_MAJOR, tb, ta, (int) rows, (int) (computed - first), (int) (k1 - k0), 1.0f,
                         (const float *) (pb + k0 * kb), ldb, (const float *) (pa + first * step + k0 * ka), lda, 0.0f,
                         pc + first, ldc);
            }
            for (int64_t i = 0; first > 0 && i < rows; i++) memset(pc + i * ldc, 0, (size_t) first * sizeof(float));
            for (int64_t i = 0; computed < cols && i < rows; i++) {
                memset(pc + i * ldc + computed, 0, (size_t) (cols - computed) * sizeof(float));
            }
        }
        if (addend == NULL) continue;
        for (int64_t i = 0; i < rows; i++) {
            float * restrict c = pc + i * ldc;
            const float * restrict e = (const float *) addend->data + (bias ? n0 : (c - (float *) dst->data));
            for (int64_t j = 0; j < cols; j++) c[j] += e[j];
        }
    }
}

/* userdata: bit 0 OUT_PROD, bits 1.. the causal form (enum th_causal; th_mark_causal) */
static void th_gemm_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                       int ith, int nth, void * userdata) {
    const intptr_t flags = (intptr_t) userdata;
    th_gemm_run(dst, a, b, (int) (flags & 1), (int) (flags >> 1), NULL, 0, ith, nth, NULL);
}

/* A product of packed attention (th_packed_range): srcs a, b as th_gemm_op's, then the mask;
 * userdata as th_gemm_op's */
static void th_gemm_packed_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const intptr_t flags = (intptr_t) userdata;
    th_gemm_run(dst, dst->src[0], dst->src[1], (int) (flags & 1), (int) (flags >> 1), NULL, 0, ith, nth, dst->src[2]);
}

/* A 2-D product with an addend (th_fold_gemm_adds): srcs a, b as th_gemm_op's, then the addend;
 * userdata's bit 0: OUT_PROD, bit 1: the addend is a bias row. dst is the ADD's node, of the
 * product's size (any shape); the product's rows are its ne0-wide rows. */
static void th_gemm_add_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const intptr_t flags = (intptr_t) userdata;
    struct ggml_tensor rows = *dst;
    rows.ne[1] = ggml_nelements(dst) / dst->ne[0], rows.ne[2] = rows.ne[3] = 1;
    rows.nb[1] = dst->ne[0] * sizeof(float), rows.nb[2] = rows.nb[3] = rows.nb[1] * rows.ne[1];
    th_gemm_run(&rows, dst->src[0], dst->src[1], (int) (flags & 1), TH_CAUSAL_NONE, dst->src[2], (int) ((flags >> 1) & 1), ith, nth, NULL);
}

static int th_gemm_ok(const struct ggml_tensor * t) {
    if (th_sgemm == NULL || (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD)) return 0;
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    if (t->type != GGML_TYPE_F32 || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32) return 0;
    if (!ggml_is_contiguous(t) || a->ne[2] == 0 || a->ne[3] == 0) return 0;
    if (b->ne[2] % a->ne[2] || b->ne[3] % a->ne[3] || t->ne[2] != b->ne[2] || t->ne[3] != b->ne[3]) return 0;
    if (t->ne[0] > INT32_MAX || t->ne[1] > INT32_MAX || a->ne[0] > INT32_MAX || a->ne[1] > INT32_MAX) return 0;
    int tr, ld;
    const int out_prod = t->op == GGML_OP_OUT_PROD;
    return th_operand(b, out_prod, &tr, &ld) && th_operand(a, !out_prod, &tr, &ld);
}

/* ---- CONT: a tiled strided copy -------------------------------------------------------------
 * dst is contiguous with src's shape. When src's rows are contiguous, a row copy; otherwise
 * TH_COPY_TILE x TH_COPY_TILE tiles, so that both the strided reads and the contiguous writes
 * stay in cache when src is a transpose. */
enum { TH_COPY_TILE = 32 };

static void th_cont_tiled(struct ggml_tensor * dst_in, const struct ggml_tensor * src_in, int k, int ith, int nth);

static void th_cont_op(struct ggml_tensor * dst, const struct ggml_tensor * src, int ith, int nth, void * userdata) {
    (void) userdata;
    const int64_t ne0 = dst->ne[0], ne1 = dst->ne[1], ne2 = dst->ne[2], ne3 = dst->ne[3];
    const size_t s0 = src->nb[0];
    if (s0 == sizeof(float)) {
        /* rows are contiguous (a permute of the outer axes): tasks of whole rows over i1, i2, i3;
         * rows are often short (a 16-float attention head), so an inline loop, not a memcpy */
        int64_t taken = 0, r0, r1;
        while (th_next_rows(ne1 * ne2 * ne3, ne0, ith, nth, &taken, &r0, &r1)) {
            for (int64_t r = r0; r < r1; r++) {
                const float * src_row = (const float *) th_row(src, r);
                float * dst_row = (float *) dst->data + r * ne0;
                for (int64_t i0 = 0; i0 < ne0; i0++) dst_row[i0] = src_row[i0];
            }
        }
        return;
    }
    /* tiles over axis 0 and the axis along which src is contiguous (axis 1 where none is) */
    int k = 1;
    for (int j = 3; j >= 1; j--) {
        if (src->nb[j] == sizeof(float) && src->ne[j] > 1) k = j;
    }
    th_cont_tiled(dst, src, k, ith, nth);
}

/* the tiled copy of th_cont_op, its tiles over axis 0 and axis `k` (1, 2 or 3): the axis along which
 * src is contiguous where that is not axis 1 (dV's heads: a copy over hd and H alone read each
 * cache line of src once per float) */
static void th_cont_tiled(struct ggml_tensor * dst_in, const struct ggml_tensor * src_in, int k, int ith, int nth) {
    /* axes 1 and k swapped in both: the loops below tile axes 0 and 1 */
    struct ggml_tensor dst = *dst_in, src = *src_in;
    dst.ne[1] = dst_in->ne[k], dst.nb[1] = dst_in->nb[k], dst.ne[k] = dst_in->ne[1], dst.nb[k] = dst_in->nb[1];
    src.ne[1] = src_in->ne[k], src.nb[1] = src_in->nb[k], src.ne[k] = src_in->ne[1], src.nb[k] = src_in->nb[1];
    const int64_t ne0 = dst.ne[0], ne1 = dst.ne[1], ne2 = dst.ne[2], ne3 = dst.ne[3];
    const size_t s0 = src.nb[0], s1 = src.nb[1], d1 = dst.nb[1];
    /* a task: one block of TH_COPY_TILE rows of i1 in each of `spt` consecutive (i2, i3) slices,
     * as many slices as make about TH_EW_CHUNK elements (small heads: many slices a task) */
    const int64_t blocks = (ne1 + TH_COPY_TILE - 1) / TH_COPY_TILE, n23 = ne2 * ne3;
    const int64_t block_elems = (ne1 < TH_COPY_TILE ? ne1 : TH_COPY_TILE) * ne0;
    const int64_t spt = block_elems >= TH_EW_CHUNK ? 1 : TH_EW_CHUNK / (block_elems > 0 ? block_elems : 1);
    const int64_t groups = (n23 + spt - 1) / spt, tasks = blocks * groups;
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) {
        const int64_t blk = task % blocks, g0 = (task / blocks) * spt, g1 = g0 + spt < n23 ? g0 + spt : n23;
        const int64_t r0 = blk * TH_COPY_TILE, r1 = r0 + TH_COPY_TILE < ne1 ? r0 + TH_COPY_TILE : ne1;
        for (int64_t g = g0; g < g1; g++) {
            const int64_t i2 = g % ne2, i3 = g / ne2;
            const char * ps = (const char *) src.data + i2 * src.nb[2] + i3 * src.nb[3];
            char * pd = (char *) dst.data + i2 * dst.nb[2] + i3 * dst.nb[3];
            for (int64_t c0 = 0; c0 < ne0; c0 += TH_COPY_TILE) {
                const int64_t c1 = c0 + TH_COPY_TILE < ne0 ? c0 + TH_COPY_TILE : ne0;
                for (int64_t i0 = c0; i0 < c1; i0++) {
                    const char * col = ps + i0 * s0;
                    float * out = (float *) pd + i0;
                    for (int64_t i1 = r0; i1 < r1; i1++) *(float *) ((char *) out + i1 * d1) = *(const float *) (col + i1 * s1);
                }
            }
        }
    }
}

static int th_cont_ok(const struct ggml_tensor * t) {
    const struct ggml_tensor * s = t->src[0];
    return t->op == GGML_OP_CONT && t->type == GGML_TYPE_F32 && s->type == GGML_TYPE_F32 &&
           ggml_are_same_shape(t, s) && ggml_is_contiguous(t) && s->nb[0] % sizeof(float) == 0 &&
           s->nb[1] % sizeof(float) == 0;
}

/* ---- SILU_BACK: dx = dy * s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)) ------------------------
 * ggml calls glibc's scalar expf per element; th_expf (cpu_kernels.h) is branch-free so the
 * loop vectorises. */

/* max of a row (exact in any order, so the compiler may vectorise it: -fopenmp-simd) */
static float th_row_max(const float * x, int64_t n) {
    float max = -INFINITY;
#pragma omp simd reduction(max : max)
    for (int64_t k = 0; k < n; k++) max = x[k] > max ? x[k] : max;
    return max;
}

/* sum of exp(x[k] - shift) over a row: TH_LANES partial sums combined in a fixed order */
static float th_lane_sum_exp(const float * x, int64_t n, float shift) {
    float lane[TH_LANES] = {0};
    int64_t k = 0;
    for (; k + TH_LANES <= n; k += TH_LANES) {
        for (int j = 0; j < TH_LANES; j++) lane[j] += th_expf(x[k + j] - shift);
    }
    float sum = 0.0f;
    for (int j = 0; j < TH_LANES; j++) sum += lane[j];
    for (; k < n; k++) sum += th_expf(x[k] - shift);
    return sum;
}

/* a = dy, b = x. dst may be dy's buffer (ggml plans SILU_BACK in place): each element is read
 * before it is written, hence ivdep rather than restrict. */
static void th_silu_back_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                            int ith, int nth, void * userdata) {
    (void) userdata;
    const float * dy = (const float *) a->data, * x = (const float *) b->data;
    float * dx = (float *) dst->data;
    int64_t taken = 0, i0, i1;
    while (th_next_chunk(ggml_nelements(dst), ith, nth, &taken, &i0, &i1)) {
#pragma GCC ivdep
        for (int64_t i = i0; i < i1; i++) {
            const float s = 1.0f / (1.0f + th_expf(-x[i]));
            dx[i] = dy[i] * s * (1.0f + x[i] * (1.0f - s));
        }
    }
}

static int th_silu_back_ok(const struct ggml_tensor * t) {
    return t->op == GGML_OP_SILU_BACK && t->type == GGML_TYPE_F32 && t->src[0]->type == GGML_TYPE_F32 &&
           t->src[1]->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && ggml_is_contiguous(t->src[0]) &&
           ggml_is_contiguous(t->src[1]) && ggml_are_same_shape(t, t->src[0]) && ggml_are_same_shape(t, t->src[1]);
}

/* ---- GELU, tanh form: one node forward, one backward ------------------------------------------
 * ggml 0.25.3 has no GELU backward, so blocks.gelu_tanh composes it from ops that have one: 5
 * nodes forward and 12 backward over the whole activation. On cpu with these kernels it builds
 * a stand-in instead, a SILU node named TH_GELU_NAME, whose backward ggml writes as
 * SILU_BACK(grad, x); the rewrite turns that pair into these two kernels. With
 * s = sigmoid(2u), 2u = x (k1 + k3 x^2), k1 = 2 sqrt(2/pi), k3 = 0.044715 k1:
 *   y  = x s                                  (= 0.5 x (1 + tanh u))
 *   dx = dy (s + x s (1 - s) (k1 + 3 k3 x^2))  (the slope; kept from the forward: th_keep_gelu_slopes)
 * Both elementwise: dst may share a buffer with x or dy. Both ways take s from th_gelu_sigmoid
 * (one division; y = x s), so the slope the forward keeps and the one the backward would take
 * again are the same bits. */
static const char TH_GELU_NAME[] = "th.gelu_tanh";
/* TH_GELU_K1, TH_GELU_K3: custom_ops.h (the cuda kernels use the same) */

/* s = 1 / (1 + exp(-2u)), with 2u rounded as x (k1 + (k3 x) x); y = x s, and the slope at x */
static inline float th_gelu_sigmoid(float xi) {
    return 1.0f / (1.0f + th_expf(-xi * (TH_GELU_K1 + TH_GELU_K3 * xi * xi)));
}

static inline float th_gelu_slope(float xi, float s) {
    return s + xi * s * (1.0f - s) * (TH_GELU_K1 + 3.0f * TH_GELU_K3 * (xi * xi));
}

/* userdata: NULL, or the backward node it keeps the slope for (th_keep_gelu_slopes): then the
 * slope overwrites x in place once y is written, and the backward reads it instead of taking the
 * exp again. Not where y is x's buffer (a forward-only graph may compute it in place: no
 * backward reads x there). */
static void th_gelu_op(struct ggml_tensor * dst, const struct ggml_tensor * src, int ith, int nth, void * userdata) {
    float * x = (float *) src->data;
    float * y = (float *) dst->data;
    const int keep = userdata != NULL && dst->data != src->data;
    int64_t taken = 0, i0, i1;
    while (th_next_chunk(ggml_nelements(dst), ith, nth, &taken, &i0, &i1)) {
        if (keep) {
#pragma GCC ivdep
            for (int64_t i = i0; i < i1; i++) {
                const float xi = x[i], si = th_gelu_sigmoid(xi);
                y[i] = xi * si;
                x[i] = th_gelu_slope(xi, si);
            }
        } else {
#pragma GCC ivdep
            for (int64_t i = i0; i < i1; i++) y[i] = x[i] * th_gelu_sigmoid(x[i]);
        }
    }
}

/* userdata: NULL, or the forward node that keeps the slope in its input (th_keep_gelu_slopes):
 * while b is still that input it holds the slope. A backward pointed at a recomputed copy of x
 * (engine/recompute.py) reads x itself and takes the slope again, with the same bits. */
static void th_gelu_back_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                            int ith, int nth, void * userdata) {
    const struct ggml_tensor * forward = (const struct ggml_tensor *) userdata;
    const int kept = forward != NULL && forward->src[0] == b;
    const float * dy = (const float *) a->data, * x = (const float *) b->data;
    float * dx = (float *) dst->data;
    int64_t taken = 0, i0, i1;
    while (th_next_chunk(ggml_nelements(dst), ith, nth, &taken, &i0, &i1)) {
        if (kept) {
#pragma GCC ivdep
            for (int64_t i = i0; i < i1; i++) dx[i] = dy[i] * x[i];
        } else {
#pragma GCC ivdep
            for (int64_t i = i0; i < i1; i++) dx[i] = dy[i] * th_gelu_slope(x[i], th_gelu_sigmoid(x[i]));
        }
    }
}

/* ---- GELU, exact (erf) form: one node forward, one backward ----------------------------------
 * nanoGPT's nn.GELU(). ggml 0.25.3's GELU_ERF has no backward, so blocks.gelu_erf builds a SILU
 * named TH_GELU_ERF_NAME where these kernels (or our cuda kernels: cuda_rewrite/gelu.c) compute
 * it (elsewhere Tensor.gelu("none") composes it from ops that have a backward), and the rewrite
 * turns it and its SILU_BACK into:
 *   y  = x Phi(x)                          Phi(x) = 0.5 (1 + erf(x / sqrt 2))
 *   dx = dy (Phi(x) + x exp(-x^2/2) / sqrt(2 pi))
 * erf as Tensor.gelu("none") takes it, Abramowitz and Stegun 7.1.26 (absolute error under
 * 1.5e-7), branch-free with th_expf so that the loops vectorise; the backward takes the exact
 * density. Both elementwise: dst may share a buffer with x or dy. */
static const char TH_GELU_ERF_NAME[] = "th.gelu_erf";

/* e = exp(-x^2/2); Phi(x) from erfc(|x|/sqrt 2) = P(t) e, t = 1 / (1 + p |x|/sqrt 2) */
static inline float th_gelu_erf_phi(float xi, float e) {
    const float t = 1.0f / (1.0f + 0.3275911f * 0.70710678f * fabsf(xi));
    const float p = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t +
                     0.254829592f) * t;
    const float tail = 0.5f * p * e;                       /* Phi(-|x|) */
    return xi >= 0.0f ? 1.0f - tail : tail;
}

static void th_gelu_erf_op(struct ggml_tensor * dst, const struct ggml_tensor * src, int ith, int nth, void * userdata) {
    (void) userdata;
    const float * x = (const float *) src->data;
    float * y = (float *) dst->data;
    int64_t taken = 0, i0, i1;
    while (th_next_chunk(ggml_nelements(dst), ith, nth, &taken, &i0, &i1)) {
#pragma GCC ivdep
        for (int64_t i = i0; i < i1; i++) {
            const float xi = x[i];
            y[i] = xi * th_gelu_erf_phi(xi, th_expf(-0.5f * xi * xi));
        }
    }
}

static void th_gelu_erf_back_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                                int ith, int nth, void * userdata) {
    (void) userdata;
    const float * dy = (const float *) a->data, * x = (const float *) b->data;
    float * dx = (float *) dst->data;
    int64_t taken = 0, i0, i1;
    while (th_next_chunk(ggml_nelements(dst), ith, nth, &taken, &i0, &i1)) {
#pragma GCC ivdep
        for (int64_t i = i0; i < i1; i++) {
            const float xi = x[i], e = th_expf(-0.5f * xi * xi);
            dx[i] = dy[i] * (th_gelu_erf_phi(xi, e) + xi * e * 0.39894228f);     /* 1 / sqrt(2 pi) */
        }
    }
}

static int th_is_gelu_stand_in(const struct ggml_tensor * t, const char * name) {
    return t->op == GGML_OP_UNARY && ggml_get_unary_op(t) == GGML_UNARY_OP_SILU && strcmp(t->name, name) == 0;
}

static int th_is_custom(const struct ggml_tensor * t, void * fun) {
    if (t->op == GGML_OP_MAP_CUSTOM1) {
        struct ggml_map_custom1_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        return (void *) p.fun == fun;
    }
    if (t->op == GGML_OP_MAP_CUSTOM2) {
        struct ggml_map_custom2_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        return (void *) p.fun == fun;
    }
    if (t->op == GGML_OP_CUSTOM) {
        struct ggml_custom_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        return (void *) p.fun == fun;
    }
    return 0;
}

/* A custom op's userdata, set again (th_keep_gelu_slopes) */
static void th_set_userdata(struct ggml_tensor * t, void * ud) {
    if (t->op == GGML_OP_MAP_CUSTOM1) {
        struct ggml_map_custom1_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        p.userdata = ud;
        memcpy(t->op_params, &p, sizeof(p));
    } else if (t->op == GGML_OP_MAP_CUSTOM2) {
        struct ggml_map_custom2_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        p.userdata = ud;
        memcpy(t->op_params, &p, sizeof(p));
    }
}

static void * th_userdata(const struct ggml_tensor * t) {
    if (t->op == GGML_OP_MAP_CUSTOM1) {
        struct ggml_map_custom1_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        return p.userdata;
    }
    struct ggml_map_custom2_op_params p;
    memcpy(&p, t->op_params, sizeof(p));
    return p.userdata;
}

/* ---- SOFT_MAX: softmax(scale * x + mask) per row ---------------------------------------------
 * ggml's kernel spends most of its time per row (a 64-wide attention row takes ~60 ns there).
 * Here: one pass for scale, mask and max, one for exp and the sum (TH_LANES partial sums), one
 * to normalise. Only the plain form: f32 mask or none, no ALiBi slope, no sinks.
 * userdata non-NULL: the mask is the causal one (th_mark_causal), -inf right of each row's
 * diagonal. Those entries' exps are exact zeros that add nothing to their lane's sum, so a row
 * stops at the end of the TH_LANES block that holds its diagonal and writes zeros after it: the
 * same bits, about half the exps. */
/* Packed rows (toyharness/engine/packed.py): the mask, fed per step, is block-diagonal within the
 * causal triangle: row i sees keys [s, i] of its own example only. A row starts at the TH_LANES
 * block that holds its first visible key (found in the mask row) and writes zeros before it: the
 * lanes keep their columns, and the exps left out are exact zeros, so the bits are those of the
 * whole row. */
enum { TH_SOFTMAX_CAUSAL = 1, TH_SOFTMAX_PACKED = 2 };

static int64_t th_packed_row_start(const struct ggml_tensor * mask, int64_t i1, int64_t i2, int64_t i3, int64_t n) {
    const float * m = (const float *) ((const char *) mask->data + i1 * mask->nb[1] + (i2 % mask->ne[2]) * mask->nb[2] +
                                       (i3 % mask->ne[3]) * mask->nb[3]);
    int64_t k = 0;
    while (k < n && m[k] < TH_MASK_SEEN) k++;
    return k / TH_LANES * TH_LANES;
}

static void th_soft_max_op(struct ggml_tensor * dst, const struct ggml_tensor * x, const struct ggml_tensor * mask,
                           int ith, int nth, void * userdata) {
    const int causal = userdata != NULL, packed = (intptr_t) userdata == TH_SOFTMAX_PACKED && mask != NULL;
    float scale;
    memcpy(&scale, (const float *) dst->op_params + TH_PARAM_SLOT, sizeof(float));
    const int64_t nc = x->ne[0], ne1 = x->ne[1], ne2 = x->ne[2], nr = ggml_nrows(x);
    int64_t taken = 0, r0, r1;
    while (th_next_rows(nr, nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
            const float * xp = (const float *) ((const char *) x->data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3]);
            float * y = (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
            const int64_t seen = (i1 + TH_LANES) / TH_LANES * TH_LANES;     /* blocks up to column i1's */
            const int64_t n = causal && seen < nc ? seen : nc;
            const int64_t s0 = packed ? th_packed_row_start(mask, i1, i2, i3, n) : 0;
            for (int64_t k = 0; k < s0; k++) y[k] = 0.0f;
            y += s0, xp += s0;
            th_softmax_input(y, xp, mask, i1, i2, i3, n - s0, scale, s0);
            const float inv = 1.0f / th_exp_row(y, y, n - s0, th_row_max(y, n - s0));
            int64_t k = 0;
            for (; k < n - s0; k++) y[k] *= inv;
            for (; k < nc - s0; k++) y[k] = 0.0f;
        }
    }
}

/* SOFT_MAX_BACK of a packed softmax (srcs dy, y, the mask): dx = scale y (dy - dot(y, dy)) over
 * each row's seen keys (the blocks th_soft_max_op computed), zeros elsewhere. Each element reads
 * its y and dy before dx is written, so dx may be y's buffer: ggml-alloc lets SOFT_MAX_BACK take
 * y's in place when y has no other reader left (a view after the softmax, as packed rows have,
 * leaves the gradient's buffer unusable for that), where ggml's own kernel would read y after
 * overwriting it. */
static void th_soft_max_back_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * dy = dst->src[0], * y = dst->src[1], * mask = dst->src[2];
    float scale;
    memcpy(&scale, (const float *) dst->op_params + TH_PARAM_SLOT, sizeof(float));
    const int64_t nc = y->ne[0], ne1 = y->ne[1], ne2 = y->ne[2], nr = ggml_nrows(y);
    int64_t taken = 0, r0, r1;
    while (th_next_rows(nr, nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const int64_t i1 = r % ne1, i2 = (r / ne1) % ne2, i3 = r / (ne1 * ne2);
            const float * yp = (const float *) ((const char *) y->data + i1 * y->nb[1] + i2 * y->nb[2] + i3 * y->nb[3]);
            const float * g = (const float *) ((const char *) dy->data + i1 * dy->nb[1] + i2 * dy->nb[2] + i3 * dy->nb[3]);
            float * dx = (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
            const int64_t seen = (i1 + TH_LANES) / TH_LANES * TH_LANES;
            const int64_t n = seen < nc ? seen : nc, s0 = th_packed_row_start(mask, i1, i2, i3, n);
            float lane[TH_LANES] = {0};
            for (int64_t k = s0; k < n; k++) lane[(k - s0) % TH_LANES] += yp[k] * g[k];
            float dot = 0.0f;
            for (int j = 0; j < TH_LANES; j++) dot += lane[j];
            for (int64_t k = s0; k < n; k++) dx[k] = (g[k] - dot) * yp[k] * scale;
            for (int64_t k = 0; k < s0; k++) dx[k] = 0.0f;
            for (int64_t k = n; k < nc; k++) dx[k] = 0.0f;
        }
    }
}

/* SOFT_MAX_BACK without a mask (srcs dy, y), as ggml's kernel computes it but safe in place.
 * ggml's writes dx := dy, then dx -= dot(y, dy), then dx *= y: where ggml-alloc gives dx the
 * buffer of y (it may, when the softmax's output has no reader left but this node: a recomputed
 * softmax, engine/recompute.py) the product reads dx for y, a wrong gradient. Here each element
 * reads y and dy before dx is written, with ggml's own vec_dot for the dot and the same operations
 * after it: the bits of ggml's kernel, in place or not. ggml_vec_dot_f32 is ggml-cpu's (exported,
 * not in a public header): found in the loaded library, else SOFT_MAX_BACK stays ggml's. */
typedef void (*th_vec_dot_f32_fn)(int, float *, size_t, const float *, size_t, const float *, size_t, int);
static th_vec_dot_f32_fn th_vec_dot_f32;

static th_vec_dot_f32_fn th_find_vec_dot_f32(void) {
#if defined(__unix__) || defined(__APPLE__)
    static const char * const names[] = {"libggml-cpu.so.0", "libggml-cpu.so", "libggml-cpu.dylib"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && th_vec_dot_f32 == NULL; i++) {
        void * lib = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
        if (lib != NULL) {
            th_vec_dot_f32 = (th_vec_dot_f32_fn) dlsym(lib, "ggml_vec_dot_f32");
            dlclose(lib);    /* NOLOAD took a reference of a library the process keeps loaded */
        }
    }
#endif
    return th_vec_dot_f32;
}

static void th_soft_max_back_rows_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                                     int ith, int nth, void * userdata) {
    (void) userdata;
    float scale;
    memcpy(&scale, (const float *) dst->op_params + TH_PARAM_SLOT, sizeof(float));
    const int64_t nc = dst->ne[0], nr = ggml_nrows(dst);
    int64_t taken = 0, r0, r1;
    while (th_next_rows(nr, nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const float * dy = (const float *) ((const char *) a->data + r * a->nb[1]);
            const float * y = (const float *) ((const char *) b->data + r * b->nb[1]);
            float * dx = (float *) ((char *) dst->data + r * dst->nb[1]);
            float dot = 0.0f;
            th_vec_dot_f32((int) nc, &dot, 0, y, 0, dy, 0, 1);
            const float minus_dot = -dot;
            for (int64_t k = 0; k < nc; k++) dx[k] = ((dy[k] + minus_dot) * y[k]) * scale;
        }
    }
}

static int th_soft_max_back_rows_ok(const struct ggml_tensor * t) {
    float max_bias;
    memcpy(&max_bias, (const float *) t->op_params + 1, sizeof(float));
    return t->op == GGML_OP_SOFT_MAX_BACK && t->type == GGML_TYPE_F32 && t->src[0]->type == GGML_TYPE_F32 &&
           t->src[1]->type == GGML_TYPE_F32 && t->src[2] == NULL && max_bias == 0.0f && ggml_is_contiguous(t) &&
           ggml_is_contiguous(t->src[0]) && ggml_is_contiguous(t->src[1]) && ggml_are_same_shape(t, t->src[0]) &&
           ggml_are_same_shape(t, t->src[1]) && t->ne[0] <= INT32_MAX && th_find_vec_dot_f32() != NULL;
}

/* Whether th_cpu_rewrite will give SOFT_MAX_BACK node `t` the kernel above, which may take y's
 * buffer for dx (engine/graph_rewrites.py keep_softmax_for_backward asks before it keeps y). */
TH_EXPORT int th_cpu_soft_max_back_in_place_ok(const struct ggml_tensor * t) { return th_soft_max_back_rows_ok(t); }

static int th_soft_max_ok(const struct ggml_tensor * t) {
    const struct ggml_tensor * x = t->src[0], * mask = t->src[1];
    float max_bias;
    memcpy(&max_bias, (const float *) t->op_params + 1, sizeof(float));
    if (t->op != GGML_OP_SOFT_MAX || t->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || max_bias != 0.0f ||
        t->src[2] != NULL || !ggml_are_same_shape(t, x) || x->nb[0] != sizeof(float) || t->nb[0] != sizeof(float)) {
        return 0;
    }
    return mask == NULL || (mask->type == GGML_TYPE_F32 && mask->nb[0] == sizeof(float) && mask->ne[0] == x->ne[0] &&
                            mask->ne[1] >= x->ne[1] && x->ne[2] % mask->ne[2] == 0 && x->ne[3] % mask->ne[3] == 0);
}

/* ---- RMS_NORM and RMS_NORM_BACK --------------------------------------------------------------
 * ggml sums each row in double, one element at a time. Here TH_LANES float partial sums (fixed
 * order), then ggml's own formulas:
 *   y  = x / sqrt(mean(x^2) + eps)
 *   dx = (dz - x * sum(x dz) / (sum(x^2) + eps n)) / sqrt(mean(x^2) + eps)
 * dst may share its buffer with x (forward) or dz (backward): ggml plans both in place. */
static float th_lane_dot(const float * a, const float * b, int64_t n) {
    float lane[TH_LANES] = {0};
    int64_t k = 0;
    for (; k + TH_LANES <= n; k += TH_LANES) {
        for (int j = 0; j < TH_LANES; j++) lane[j] += a[k + j] * b[k + j];
    }
    float sum = 0.0f;
    for (int j = 0; j < TH_LANES; j++) sum += lane[j];
    for (; k < n; k++) sum += a[k] * b[k];
    return sum;
}

/* dst = rms_norm(x) when grad is NULL, else its backward applied to grad, or with `gain` to
 * grad * gain (the gradient through a norm's gain, th_fold_norm_gains): that product first
 * written into dst's row, the MUL's one rounding, then the same arithmetic on it */
static void th_rms_norm_rows(struct ggml_tensor * dst, const struct ggml_tensor * grad, const struct ggml_tensor * src,
                             const float * gain, int ith, int nth) {
    float eps;
    memcpy(&eps, (const float *) dst->op_params + TH_PARAM_SLOT, sizeof(float));
    const int64_t n = src->ne[0];
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(src), n, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const float * x = (const float *) th_row(src, r);
            float * y = (float *) th_row(dst, r);
            const float sum_xx = th_lane_dot(x, x, n), rrms = 1.0f / sqrtf(sum_xx / (float) n + eps);
            if (grad == NULL) {
#pragma GCC ivdep
                for (int64_t k = 0; k < n; k++) y[k] = x[k] * rrms;
                continue;
            }
            const float * dz = (const float *) th_row(grad, r);
            if (gain != NULL) {
                for (int64_t k = 0; k < n; k++) y[k] = dz[k] * gain[k];
                dz = y;
            }
            const float scale_x = -th_lane_dot(x, dz, n) / (sum_xx + eps * (float) n);
#pragma GCC ivdep
            for (int64_t k = 0; k < n; k++) y[k] = (dz[k] + x[k] * scale_x) * rrms;
        }
    }
}

static void th_rms_norm_op(struct ggml_tensor * dst, const struct ggml_tensor * src, int ith, int nth, void * userdata) {
    (void) userdata;
    th_rms_norm_rows(dst, NULL, src, NULL, ith, nth);
}

static void th_rms_norm_back_op(struct ggml_tensor * dst, const struct ggml_tensor * grad, const struct ggml_tensor * src,
                                int ith, int nth, void * userdata) {
    (void) userdata;
    th_rms_norm_rows(dst, grad, src, NULL, ith, nth);
}

static int th_rows_ok(const struct ggml_tensor * t) {  /* f32, rows contiguous */
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float);
}

static int th_rms_norm_ok(const struct ggml_tensor * t) {
    return t->op == GGML_OP_RMS_NORM && th_rows_ok(t) && th_rows_ok(t->src[0]) && ggml_are_same_shape(t, t->src[0]);
}

static int th_rms_norm_back_ok(const struct ggml_tensor * t) {
    return t->op == GGML_OP_RMS_NORM_BACK && th_rows_ok(t) && th_rows_ok(t->src[0]) && th_rows_ok(t->src[1]) &&
           ggml_are_same_shape(t, t->src[0]) && ggml_are_same_shape(t, t->src[1]);
}

/* RMS_NORM_BACK(MUL(G, g), x) as one node (th_fold_norm_gains): srcs G, x, g (and the folded
 * MUL's view, not read) */
static void th_rms_norm_back_gain_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    th_rms_norm_rows(dst, dst->src[0], dst->src[1], (const float *) dst->src[2]->data, ith, nth);
}

/* REPEAT_BACK(MUL(a, b)) of a and b (rows of n) into one row of n (a gain's gradient: a the
 * normalised rows, b their gradient) as one node: srcs a, b (and the folded MUL's view, not
 * read). ggml's REPEAT_BACK sums on one thread, row after row, each product rounded first; here
 * the same sums, each column's in row order, with the columns split over the threads in blocks
 * of TH_GAIN_COLS. No contraction: a * b + sum as a fused multiply-add would round once, not twice. */
enum { TH_GAIN_COLS = 64 };
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
static void th_gain_grad_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    (void) userdata;
    const struct ggml_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t n = dst->ne[0], rows = ggml_nelements(a) / n, blocks = (n + TH_GAIN_COLS - 1) / TH_GAIN_COLS;
    const float * pa = (const float *) a->data, * pb = (const float *) b->data;
    float * out = (float *) dst->data;
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(blocks, ith, nth, &taken)) >= 0;) {
        const int64_t c0 = task * TH_GAIN_COLS, w = n - c0 < TH_GAIN_COLS ? n - c0 : TH_GAIN_COLS;
        float acc[TH_GAIN_COLS] = {0};
        for (int64_t r = 0; r < rows; r++) {
            const float * ar = pa + r * n + c0, * br = pb + r * n + c0;
            for (int64_t k = 0; k < w; k++) acc[k] += ar[k] * br[k];
        }
        for (int64_t k = 0; k < w; k++) out[c0 + k] = acc[k];
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* ---- bias rows: y + ones @ b as y + b ---------------------------------------------------------
 * blocks.add_bias writes a bias as y + ones(rows, 1) @ b (then its gradient is one product),
 * the product P named TH_BIAS_ROWS_NAME. P's value is read by that ADD alone (ggml's backward
 * of the ADD and of P reads gradients and P's inputs, never P), so on cpu the ADD adds b to
 * each row of y itself and P is not computed (op NONE). The sum is the same bits: P's elements
 * were 1 * b exactly. Unrewritten, P and the ADD still compute y + b: the rewrite is checked,
 * and skipped when anything else reads P. */
static const char TH_BIAS_ROWS_NAME[] = "th.bias_rows";
static int th_is_folded(const struct ggml_tensor * t);

static void th_add_rows_op(struct ggml_tensor * dst, const struct ggml_tensor * y, const struct ggml_tensor * b,
                           int ith, int nth, void * userdata) {
    (void) userdata;
    const int64_t n = dst->ne[0];
    const float * bias = (const float *) b->data;
    int64_t taken = 0, r0, r1;
    while (th_next_rows(ggml_nrows(dst), n, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const float * yr = (const float *) th_row(y, r);
            float * d = (float *) th_row(dst, r);
#pragma GCC ivdep
            for (int64_t k = 0; k < n; k++) d[k] = yr[k] + bias[k];
        }
    }
}

/* ---- ROPE and ROPE_BACK: the rotation table once per position --------------------------------
 * ggml recomputes cos and sin of a position's angles for every (batch, position) row group:
 * for a batch of B sequences, B times the same table (and cosf, sinf calls cost more than the
 * rotation). Here a task takes a block of positions, makes each position's table once, and
 * rotates every batch and head at it. The table and the rotation are ggml's own arithmetic,
 * operation for operation (ggml_rope_cache_init, rope_yarn without YaRN, rotate_pairs): the
 * same table, and the same bits where ggml's vectorised rotation has no scalar tail (n_dims a
 * multiple of 16, as in the recipes' configs; in a tail the compiler may fuse multiply-adds
 * differently: a last-bit difference). Only the plain forms: NORMAL or NEOX mode, no frequency
 * factors, ext_factor 0, no offset; ROPE_BACK rotates by minus the angle. */
enum { TH_ROPE_MAX_DIM = 1024, TH_ROPE_SLOT_DIMS = 6, TH_ROPE_SLOT_MODE = 7, TH_ROPE_SLOT_BASE = 8,
       TH_ROPE_SLOT_SCALE = 9, TH_ROPE_SLOT_MSCALE = 12, TH_ROPE_SLOT_SIGN = 13 };

/* one position's rotation table (ggml_rope_cache_init's arithmetic): cos and sin of each pair's angle */
static void th_rope_table(float * cache, float theta, int64_t ne0, float freq_scale, float theta_scale, float mscale,
                          float sin_sign) {
    for (int64_t i0 = 0; i0 < ne0; i0 += 2) {
        const float theta_interp = freq_scale * (theta / 1.0f);
        cache[i0 + 0] = cosf(theta_interp) * mscale;
        cache[i0 + 1] = sinf(theta_interp) * mscale;
        cache[i0 + 1] *= sin_sign;
        theta *= theta_scale;
    }
}

static void th_rope_op(struct ggml_tensor * dst, const struct ggml_tensor * x, const struct ggml_tensor * pos,
                       int ith, int nth, void * userdata) {
    (void) userdata;
    const int32_t * params = dst->op_params;
    const int n_dims = params[TH_ROPE_SLOT_DIMS], neox = params[TH_ROPE_SLOT_MODE] == GGML_ROPE_TYPE_NEOX;
    float freq_base, freq_scale, mscale, sin_sign;
    memcpy(&freq_base, params + TH_ROPE_SLOT_BASE, sizeof(float));
    memcpy(&freq_scale, params + TH_ROPE_SLOT_SCALE, sizeof(float));
    memcpy(&mscale, params + TH_ROPE_SLOT_MSCALE, sizeof(float));
    memcpy(&sin_sign, params + TH_ROPE_SLOT_SIGN, sizeof(float));
    const float theta_scale = powf(freq_base, -2.0f / n_dims);
    const int64_t ne0 = dst->ne[0], ne1 = dst->ne[1], ne2 = dst->ne[2], ne3 = dst->ne[3];
    const int64_t per_pos = ne0 * ne1 * ne3, ppt = per_pos >= TH_EW_CHUNK ? 1 : TH_EW_CHUNK / per_pos;
    const int64_t tasks = (ne2 + ppt - 1) / ppt;
    const int32_t * positions = (const int32_t *) pos->data;
    float cache[TH_ROPE_MAX_DIM];
    /* Packed rows rope each head's tokens as one run (toyharness/engine/packed.py): positions
     * repeat B*H times. Then each distinct position's table is made once, ahead (the same
     * arithmetic, so the same bits), instead of once per row. */
    int32_t top = -1, low = 0;
    for (int64_t i2 = 0; i2 < ne2; i2++) {
        if (positions[i2] > top) top = positions[i2];
        if (positions[i2] < low) low = positions[i2];
    }
    float * tables = NULL;
    if (low >= 0 && ne2 >= 4 * ((int64_t) top + 1) && ((int64_t) top + 1) * ne0 <= ((int64_t) 1 << 22)) {
        tables = (float *) malloc((size_t) (top + 1) * (size_t) ne0 * sizeof(float));
        for (int32_t p = 0; tables != NULL && p <= top; p++) {
            th_rope_table(tables + (int64_t) p * ne0, (float) p, ne0, freq_scale, theta_scale, mscale, sin_sign);
        }
    }
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) {
        const int64_t p1 = (task + 1) * ppt < ne2 ? (task + 1) * ppt : ne2;
        for (int64_t i2 = task * ppt; i2 < p1; i2++) {
            const float * table = cache;
            if (tables != NULL) {
                table = tables + (int64_t) positions[i2] * ne0;
            } else {
                th_rope_table(cache, (float) positions[i2], ne0, freq_scale, theta_scale, mscale, sin_sign);
            }
            for (int64_t i3 = 0; i3 < ne3; i3++) {
                for (int64_t i1 = 0; i1 < ne1; i1++) {
                    const float * src = (const float *) ((const char *) x->data + i1 * x->nb[1] + i2 * x->nb[2] +
                                                         i3 * x->nb[3]);
                    float * out = (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
                    const int64_t n_offset = neox ? n_dims / 2 : 1;
                    for (int64_t i0 = 0; i0 < n_dims; i0 += 2) {
                        const int64_t ic = neox ? i0 / 2 : i0;
                        const float cos_theta = table[i0 + 0], sin_theta = table[i0 + 1];
                        const float x0 = src[ic], x1 = src[ic + n_offset];
                        out[ic] = x0 * cos_theta - x1 * sin_theta;
                        out[ic + n_offset] = x0 * sin_theta + x1 * cos_theta;
                    }
                    for (int64_t i0 = n_dims; i0 < ne0; i0++) out[i0] = src[i0];
                }
            }
        }
    }
    free(tables);
}

static int th_rope_ok(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_ROPE && t->op != GGML_OP_ROPE_BACK) return 0;
    const struct ggml_tensor * x = t->src[0], * pos = t->src[1];
    const int32_t * params = t->op_params;
    const int n_dims = params[1], mode = params[2], n_offs = params[15];
    float ext_factor;
    memcpy(&ext_factor, params + 7, sizeof(float));
    return t->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 && pos->type == GGML_TYPE_I32 && t->src[2] == NULL &&
           (mode == GGML_ROPE_TYPE_NORMAL || mode == GGML_ROPE_TYPE_NEOX) && ext_factor == 0.0f && n_offs == 0 &&
           n_dims > 0 && n_dims % 2 == 0 && n_dims <= t->ne[0] && t->ne[0] % 2 == 0 && t->ne[0] <= TH_ROPE_MAX_DIM &&
           ggml_are_same_shape(t, x) && t->nb[0] == sizeof(float) && x->nb[0] == sizeof(float) &&
           pos->ne[0] == t->ne[2] && ggml_is_contiguous(pos);
}

/* after th_set_custom2 has cleared op_params: ROPE's own parameters into the free slots */
static void th_keep_rope_params(struct ggml_tensor * t, const int32_t * rope_params, float sin_sign) {
    t->op_params[TH_ROPE_SLOT_DIMS] = rope_params[1];
    t->op_params[TH_ROPE_SLOT_MODE] = rope_params[2];
    t->op_params[TH_ROPE_SLOT_BASE] = rope_params[5];      /* freq_base */
    t->op_params[TH_ROPE_SLOT_SCALE] = rope_params[6];     /* freq_scale */
    t->op_params[TH_ROPE_SLOT_MSCALE] = rope_params[8];    /* attn_factor */
    memcpy(t->op_params + TH_ROPE_SLOT_SIGN, &sin_sign, sizeof(float));
}

/* ---- CROSS_ENTROPY_LOSS: -mean over rows of sum_v t_v log softmax(x)_v ------------------------
 * ggml's kernel calls scalar expf and logf per element and adds per-thread partial sums. Here
 * the rows are cut into TH_CE_BLOCKS blocks fixed by the shape; each thread sums its blocks'
 * rows in order into the node's spare op_params slots, and the thread that finishes last adds
 * the blocks in order: the scalar does not depend on the thread count. Only the loss's value is
 * computed here (its backward is th_cross_entropy_back_op). */
enum { TH_CE_BLOCKS = 8 };
_Static_assert(TH_PARAM_SLOT + TH_CE_BLOCKS <= GGML_MAX_OP_PARAMS / sizeof(int32_t), "the blocks' sums fit op_params");
_Static_assert(sizeof(struct ggml_map_custom2_op_params) <= (TH_PARAM_SLOT - 1) * sizeof(int32_t),
               "the counter's slot is past the custom op's parameters");

static float th_cross_entropy_rows(const struct ggml_tensor * a, const struct ggml_tensor * b, int64_t r0, int64_t r1) {
    const int64_t nc = a->ne[0];
    float total = 0.0f;
    for (int64_t r = r0; r < r1; r++) {
        const float * x = (const float *) ((const char *) a->data + r * a->nb[1]);
        const float * t = (const float *) ((const char *) b->data + r * b->nb[1]);
        const float max = th_row_max(x, nc);
        const float log_sum = logf(th_lane_sum_exp(x, nc, max));
        float lane[TH_LANES] = {0};
        int64_t k = 0;
        for (; k + TH_LANES <= nc; k += TH_LANES) {
            for (int j = 0; j < TH_LANES; j++) lane[j] += t[k + j] * ((x[k + j] - max) - log_sum);
        }
        float row = 0.0f;
        for (int j = 0; j < TH_LANES; j++) row += lane[j];
        for (; k < nc; k++) row += t[k] * ((x[k] - max) - log_sum);
        total += row;
    }
    return total;
}

static void th_cross_entropy_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                                int ith, int nth, void * userdata) {
    (void) userdata;
    const int64_t nr = ggml_nrows(a);
    /* op_params: the custom op's own in slots 0-5, then a counter of finished threads, then the
     * blocks' sums (TH_PARAM_SLOT + TH_CE_BLOCKS <= 16 slots) */
    int32_t * done = dst->op_params + TH_PARAM_SLOT - 1;
    float * part = (float *) (dst->op_params + TH_PARAM_SLOT);
    for (int blk = ith; blk < TH_CE_BLOCKS; blk += nth) {
        part[blk] = th_cross_entropy_rows(a, b, nr * blk / TH_CE_BLOCKS, nr * (blk + 1) / TH_CE_BLOCKS);
    }
    if (__atomic_add_fetch(done, 1, __ATOMIC_ACQ_REL) != nth) return;
    float total = 0.0f;
    for (int blk = 0; blk < TH_CE_BLOCKS; blk++) total += part[blk];
    *(float *) dst->data = total * (-1.0f / (float) nr);
    __atomic_store_n(done, 0, __ATOMIC_RELAXED);
}

static int th_cross_entropy_ok(const struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    return t->op == GGML_OP_CROSS_ENTROPY_LOSS && t->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 &&
           b->type == GGML_TYPE_F32 && a->nb[0] == sizeof(float) && b->nb[0] == sizeof(float) &&
           ggml_are_same_shape(a, b) && ggml_nrows(a) == a->ne[1] && a->ne[0] > 0;
}

/* ---- CROSS_ENTROPY_LOSS_BACK: dx = (softmax(x) - t) * grad / rows ----------------------------
 * ggml's kernel takes each row's softmax with its own exp, one row a task. Here one exp pass per
 * row (the exps kept in dx, TH_LANES partial sums as the softmax kernel's), then one pass for the
 * difference, rows shared out in tasks of about TH_EW_CHUNK elements. Each element depends on its
 * row alone: the bits do not follow the thread count. srcs: the loss's gradient (a scalar), the
 * logits, the one-hot targets. */
static void th_cross_entropy_back_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * grad = dst->src[0], * a = dst->src[1], * b = dst->src[2];
    const int64_t nc = a->ne[0], nr = ggml_nrows(a);
    const float scale = *(const float *) grad->data / (float) nr;
    int64_t taken = 0, r0, r1;
    while (th_next_rows(nr, nc, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            const float * x = (const float *) ((const char *) a->data + r * a->nb[1]);
            const float * t = (const float *) ((const char *) b->data + r * b->nb[1]);
            float * dx = (float *) ((char *) dst->data + r * dst->nb[1]);
            const float inv = 1.0f / th_exp_row(dx, x, nc, th_row_max(x, nc));
            for (int64_t k = 0; k < nc; k++) dx[k] = (dx[k] * inv - t[k]) * scale;
        }
    }
}

static int th_cross_entropy_back_ok(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_CROSS_ENTROPY_LOSS_BACK) return 0;
    const struct ggml_tensor * g = t->src[0], * a = t->src[1], * b = t->src[2];
    return t->type == GGML_TYPE_F32 && g->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 &&
           b->type == GGML_TYPE_F32 && ggml_nelements(g) == 1 && ggml_are_same_shape(t, a) &&
           ggml_are_same_shape(a, b) && ggml_is_contiguous(t) && a->nb[0] == sizeof(float) &&
           b->nb[0] == sizeof(float) && ggml_nrows(a) == a->ne[1] && a->ne[0] > 0;
}

/* ---- row centring: x @ (I - 1/d), as LayerNorm writes it -------------------------------------
 * blocks.layer_norm centres with a product by the cached constant "centring.<d>" so that ggml
 * can differentiate it; the backward is a product by the same (symmetric) matrix. Both become
 * y = x - mean(x) per row: the row sum in a fixed order, then one subtraction per element.
 * The operand is read through its strides (the backward's is a transposed view). */
static void th_centre_op(struct ggml_tensor * dst, const struct ggml_tensor * x, int ith, int nth, void * userdata) {
    const int out_prod = userdata != NULL;
    const int64_t rows = dst->ne[1], d = dst->ne[0];
    /* row i, column k of the operand: along x's ne1 / ne0 for MUL_MAT, ne0 / ne1 for OUT_PROD */
    const size_t s_row = out_prod ? x->nb[0] : x->nb[1], s_col = out_prod ? x->nb[1] : x->nb[0];
    const int64_t tasks = (rows + TH_GEMM_ROWS - 1) / TH_GEMM_ROWS;
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) {
        const int64_t r0 = task * TH_GEMM_ROWS, r1 = r0 + TH_GEMM_ROWS < rows ? r0 + TH_GEMM_ROWS : rows;
        for (int64_t i = r0; i < r1; i++) {
            const char * row = (const char *) x->data + i * s_row;
            float * y = (float *) ((char *) dst->data + i * dst->nb[1]);
            if (s_col == sizeof(float)) {
                memcpy(y, row, d * sizeof(float));
            } else {
                for (int64_t k = 0; k < d; k++) y[k] = *(const float *) (row + k * s_col);
            }
            /* TH_LANES partial sums, combined in a fixed order: vectorises, same bits every run */
            float lane[TH_LANES] = {0};
            int64_t k = 0;
            for (; k + TH_LANES <= d; k += TH_LANES) {
                for (int j = 0; j < TH_LANES; j++) lane[j] += y[k + j];
            }
            float sum = 0.0f;
            for (int j = 0; j < TH_LANES; j++) sum += lane[j];
            for (; k < d; k++) sum += y[k];
            const float mean = sum / (float) d;
            for (k = 0; k < d; k++) y[k] -= mean;
        }
    }
}

/* t is a d x d f32 constant named "centring.<d>" holding exactly I - 1/d (checked, once per
 * rewrite, so that a user tensor of that name is never mistaken for it). */
static int th_is_centring(const struct ggml_tensor * t) {
    const int64_t d = t->ne[0];
    if (strncmp(t->name, "centring.", 9) != 0 || t->type != GGML_TYPE_F32 || t->ne[1] != d || t->ne[2] != 1 ||
        t->ne[3] != 1 || t->data == NULL || !ggml_is_contiguous(t) || t->op != GGML_OP_NONE) {
        return 0;
    }
    const float * c = (const float *) t->data;
    const float off = -(1.0f / (float) d), diag = 1.0f - 1.0f / (float) d;
    for (int64_t i = 0; i < d; i++) {
        for (int64_t j = 0; j < d; j++) {
            if (c[i * d + j] != (i == j ? diag : off)) return 0;
        }
    }
    return 1;
}

static int th_centre_ok(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD) return 0;
    const struct ggml_tensor * x = t->src[1];
    return t->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->ne[2] == 1 &&
           t->ne[3] == 1 && x->ne[2] == 1 && x->ne[3] == 1 && th_is_centring(t->src[0]);
}

/* FLOPs (2 per multiply-add) of a node's matrix products: MUL_MAT and OUT_PROD, also once
 * rewritten to sgemm, the frozen products and the chunked loss's two products over its weight; 0
 * for other ops (rewritten centring products included: no product is left). A causal product
 * counts whole (the model's FLOPs, not what the masked blocks leave). */
TH_EXPORT double th_node_matmul_flops(const struct ggml_tensor * t) {
    double frozen_flops = 0.0;
    if (th_frozen_kernel_name(t, &frozen_flops) != NULL) return frozen_flops;
    if (th_chunked_loss_kernel_name(t, &frozen_flops) != NULL) return frozen_flops;
    if (t->op == GGML_OP_MAP_CUSTOM2) {
        struct ggml_map_custom2_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        if (p.fun != th_gemm_op) return 0.0;
        return 2.0 * (double) ggml_nelements(t) * (double) (((intptr_t) p.userdata & 1) ? t->src[0]->ne[1] : t->src[0]->ne[0]);
    }
    if (th_is_custom(t, (void *) th_gemm_add_op)) {
        struct ggml_custom_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        return 2.0 * (double) ggml_nelements(t) * (double) (((intptr_t) p.userdata & 1) ? t->src[0]->ne[1] : t->src[0]->ne[0]);
    }
    if (t->op == GGML_OP_MUL_MAT) return 2.0 * (double) ggml_nelements(t) * (double) t->src[0]->ne[0];
    if (t->op == GGML_OP_OUT_PROD) return 2.0 * (double) ggml_nelements(t) * (double) t->src[0]->ne[1];
    return 0.0;
}

/* The name of the kernel here that computes node t (`bench --profile`), or NULL if ggml's own */
TH_EXPORT const char * th_kernel_name(const struct ggml_tensor * t) {
    static const struct { void * fun; const char * name; } kernels[] = {
        {(void *) th_gemm_op, "sgemm"},         {(void *) th_cont_op, "copy"},
        {(void *) th_silu_back_op, "silu_back"}, {(void *) th_gelu_op, "gelu"},
        {(void *) th_gelu_back_op, "gelu_back"}, {(void *) th_soft_max_op, "softmax"},
        {(void *) th_gelu_erf_op, "gelu_erf"},  {(void *) th_gelu_erf_back_op, "gelu_erf_back"},
        {(void *) th_rms_norm_op, "rms_norm"},   {(void *) th_rms_norm_back_op, "rms_norm_back"},
        {(void *) th_add_rows_op, "add_rows"},   {(void *) th_rope_op, "rope"},
        {(void *) th_cross_entropy_op, "cross_entropy"}, {(void *) th_centre_op, "centre"},
        {(void *) th_cross_entropy_back_op, "cross_entropy_back"},
        {(void *) th_adamw_op, "adamw"},         {(void *) th_gemm_add_op, "sgemm+add"},
        {(void *) th_rms_norm_back_gain_op, "rms_norm_back+gain"}, {(void *) th_gain_grad_op, "gain_grad"},
        {(void *) th_dropout_mask_op, "dropout_mask"},
        {(void *) th_soft_max_back_op, "softmax_back packed"}, {(void *) th_gemm_packed_op, "sgemm packed"},
    };
    if (t->op == GGML_OP_MAP_CUSTOM2) {
        struct ggml_map_custom2_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        if (p.fun == th_gemm_op && ((intptr_t) p.userdata >> 1) != TH_CAUSAL_NONE) return "sgemm causal";
    }
    /* a GELU pair that keeps the slope (th_keep_gelu_slopes); a softmax under the causal mask */
    if (th_is_custom(t, (void *) th_gelu_op) && th_userdata(t) != NULL) return "gelu+slope";
    if (th_is_custom(t, (void *) th_gelu_back_op) && th_userdata(t) != NULL) return "gelu_back (kept slope)";
    if (th_is_custom(t, (void *) th_soft_max_op) && (intptr_t) th_userdata(t) == TH_SOFTMAX_PACKED) return "softmax packed";
    if (th_is_custom(t, (void *) th_soft_max_op) && th_userdata(t) != NULL) return "softmax causal";
    for (size_t i = 0; i < sizeof(kernels) / sizeof(kernels[0]); i++) {
        if (th_is_custom(t, kernels[i].fun)) return kernels[i].name;
    }
    double flops;
    const char * frozen = th_frozen_kernel_name(t, &flops);
    return frozen != NULL ? frozen : th_chunked_loss_kernel_name(t, &flops);
}

/* ---- the rewrite ------------------------------------------------------------------------- */
static void th_set_custom1(struct ggml_tensor * t, ggml_custom1_op_t fun, const struct ggml_tensor * src, void * ud) {
    struct ggml_map_custom1_op_params p = {fun, GGML_N_TASKS_MAX, ud};
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, &p, sizeof(p));
    t->op = GGML_OP_MAP_CUSTOM1;
    t->src[0] = (struct ggml_tensor *) src;
    for (int i = 1; i < GGML_MAX_SRC; i++) t->src[i] = NULL;
}

void th_set_custom2(struct ggml_tensor * t, ggml_custom2_op_t fun, void * ud, int n_tasks) {
    struct ggml_map_custom2_op_params p = {fun, n_tasks, ud};
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, &p, sizeof(p));
    t->op = GGML_OP_MAP_CUSTOM2;
}

/* a custom op of any number of srcs (GGML_OP_CUSTOM): the node keeps its srcs */
static void th_set_custom(struct ggml_tensor * t, ggml_custom_op_t fun) {
    struct ggml_custom_op_params p = {fun, GGML_N_TASKS_MAX, NULL};
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, &p, sizeof(p));
    t->op = GGML_OP_CUSTOM;
}

/* The GELU stand-ins (see th_gelu_op): each SILU named k->name becomes the kernels' forward,
 * and the SILU_BACK that ggml built for it (reading its gradient and its input) their backward.
 * A stand-in left as SILU, or a gradient whose SILU_BACK is not found, would compute silu:
 * returns -1 then, and the caller must not compute the graph. Shared with the cuda rewrite
 * (cuda_rewrite/gelu.c), which sets its own kernels. */
int th_rewrite_gelu_pairs(struct ggml_cgraph * graph, const struct th_gelu_kernels * k) {
    int changed = 0;
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (th_is_gelu_stand_in(t, k->name)) {
            const struct ggml_tensor * x = t->src[0];
            if (t->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) ||
                !ggml_is_contiguous(x) || !ggml_are_same_shape(t, x)) {
                return -1;
            }
            k->set_forward(t);
            changed++;
        } else if (!k->is_forward(t)) {
            continue;
        }
        const struct ggml_tensor * grad = ggml_graph_get_grad(graph, t);
        if (grad == NULL) continue;
        int found = 0;
        for (int j = i + 1; j < n && !found; j++) {
            struct ggml_tensor * b = ggml_graph_node(graph, j);
            if (b->src[0] != grad || b->src[1] != t->src[0]) continue;
            if (b->op == GGML_OP_SILU_BACK) {
                if (!ggml_is_contiguous(b) || !ggml_is_contiguous(grad) || !ggml_are_same_shape(b, grad)) return -1;
                k->set_backward(b);
                changed++;
                found = 1;
            } else {
                found = k->is_backward(b);
            }
        }
        if (!found) return -1;
    }
    return changed;
}

static void th_cpu_gelu_forward(struct ggml_tensor * t) { th_set_custom1(t, th_gelu_op, t->src[0], NULL); }
static void th_cpu_gelu_backward(struct ggml_tensor * b) { th_set_custom2(b, th_gelu_back_op, NULL, GGML_N_TASKS_MAX); }
static int th_cpu_is_gelu(const struct ggml_tensor * t) { return th_is_custom(t, (void *) th_gelu_op); }
static int th_cpu_is_gelu_back(const struct ggml_tensor * b) { return th_is_custom(b, (void *) th_gelu_back_op); }

static void th_cpu_gelu_erf_forward(struct ggml_tensor * t) { th_set_custom1(t, th_gelu_erf_op, t->src[0], NULL); }
static void th_cpu_gelu_erf_backward(struct ggml_tensor * b) {
    th_set_custom2(b, th_gelu_erf_back_op, NULL, GGML_N_TASKS_MAX);
}
static int th_cpu_is_gelu_erf(const struct ggml_tensor * t) { return th_is_custom(t, (void *) th_gelu_erf_op); }
static int th_cpu_is_gelu_erf_back(const struct ggml_tensor * b) { return th_is_custom(b, (void *) th_gelu_erf_back_op); }

/* both forms' pairs: tanh (blocks.gelu_tanh) and erf (blocks.gelu_erf) */
static int th_rewrite_gelu(struct ggml_cgraph * graph) {
    static const struct th_gelu_kernels tanh_form = {TH_GELU_NAME, th_cpu_gelu_forward, th_cpu_gelu_backward,
                                                     th_cpu_is_gelu, th_cpu_is_gelu_back};
    static const struct th_gelu_kernels erf_form = {TH_GELU_ERF_NAME, th_cpu_gelu_erf_forward,
                                                    th_cpu_gelu_erf_backward, th_cpu_is_gelu_erf,
                                                    th_cpu_is_gelu_erf_back};
    const int tanh_pairs = th_rewrite_gelu_pairs(graph, &tanh_form);
    const int erf_pairs = tanh_pairs < 0 ? -1 : th_rewrite_gelu_pairs(graph, &erf_form);
    return erf_pairs < 0 ? -1 : tanh_pairs + erf_pairs;
}

/* GELU's slope kept from the forward: the forward takes exp once for y and its slope, and
 * writes the slope over its input x, which only the backward reads after it (a product's output:
 * the product's own backward reads its input and dY, not x). The backward is then one product
 * by dY instead of exp and a division again (a GELU of 1024 x 512 on the AVX2 build: backward
 * 0.18 -> 0.03-0.04 ms, forward 0.135 -> 0.18; no more memory: x is kept for the backward
 * either way). Taken for a pair in this
 * graph when x is computed here (not a leaf, a view, an input, an output or a parameter) and
 * no node but the two reads x or views it; a pair taken by an earlier graph whose x this graph
 * reads otherwise is given back (both nodes: the backward takes the slope from x again).
 * Returns how many pairs are kept. */
static int th_keep_gelu_slopes(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int kept = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!th_is_custom(t, (void *) th_gelu_op)) continue;
        const struct ggml_tensor * x = t->src[0];
        struct ggml_tensor * b = (struct ggml_tensor *) th_userdata(t), * last;
        /* x's readers (its views among them): the forward and, last, its backward; or t alone */
        const int readers = th_readers(graph, x, &last);
        struct ggml_tensor * partner =
            readers == 2 && th_is_custom(last, (void *) th_gelu_back_op) && last->src[1] == x ? last : NULL;
        const int others = x->op == GGML_OP_NONE || x->view_src != NULL || (readers > 1 && partner == NULL) ||
                           (x->flags & (GGML_TENSOR_FLAG_INPUT | GGML_TENSOR_FLAG_OUTPUT | GGML_TENSOR_FLAG_PARAM));
        if (others) {
            if (b != NULL) {             /* kept by an earlier graph: given back, both ways */
                th_set_userdata(b, NULL);
                th_set_userdata(t, NULL);
            }
        } else if (partner != NULL && (b == NULL || b == partner)) {
            th_set_userdata(t, partner);
            th_set_userdata(partner, t);
            kept++;
        }
    }
    return kept;
}

/* The bias-row fusions (see th_add_rows_op). For each P named TH_BIAS_ROWS_NAME: its one reader
 * must be its ADD, directly or through one RESHAPE. Returns how many were fused, or -1 when a
 * P fused by an earlier graph is read in this one (it holds no value any more; its ADD reads b).
 * A fused P (op NONE) that a later graph reaches is one of its leafs, not of its nodes. */
static int th_bias_rows_readers(struct ggml_cgraph * graph, const struct ggml_tensor * p, struct ggml_tensor ** via,
                                struct ggml_tensor ** add) {
    int others = 0;
    *via = *add = NULL;
    for (int j = 0; j < ggml_graph_n_nodes(graph); j++) {
        struct ggml_tensor * u = ggml_graph_node(graph, j);
        for (int k = 0; k < GGML_MAX_SRC; k++) {
            if (u->src[k] == NULL) continue;
            if (u->src[k] == p) {
                if (u->op == GGML_OP_RESHAPE && *via == NULL) *via = u;
                else if (*add == NULL) *add = u;
                else others++;
            } else if (*via != NULL && u->src[k] == *via) {
                if (*add == NULL) *add = u;
                else others++;
            }
        }
    }
    return others;
}

static int th_rewrite_bias_rows(struct ggml_cgraph * graph) {
    for (int i = 0; i < graph->n_leafs; i++) {
        struct ggml_tensor * p = graph->leafs[i], * via, * add;
        if (strcmp(p->name, TH_BIAS_ROWS_NAME) == 0 && p->op == GGML_OP_NONE && !th_is_folded(p) &&
            (th_bias_rows_readers(graph, p, &via, &add) != 0 || add != NULL)) {
            return -1;
        }
    }
    int changed = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * p = ggml_graph_node(graph, i), * via, * add;
        if (strcmp(p->name, TH_BIAS_ROWS_NAME) != 0 || th_is_folded(p)) continue;   /* th_cpu_fold's */
        const int others = th_bias_rows_readers(graph, p, &via, &add);
        if (p->op == GGML_OP_NONE) {          /* fused already: its ADD reads b now, nothing reads P */
            if (add != NULL || others != 0) return -1;
            continue;
        }
        if (add == NULL || others != 0 || add->op != GGML_OP_ADD || add->src[1] != (via ? via : p) ||
            p->op != GGML_OP_MUL_MAT) {
            continue;
        }
        const struct ggml_tensor * b = p->src[0], * ones = p->src[1], * y = add->src[0];
        if (!th_is_ones(ones) || b->ne[0] != 1 || b->type != GGML_TYPE_F32 ||
            !ggml_is_contiguous(b) || b->ne[1] != add->ne[0] || add->type != GGML_TYPE_F32 ||
            y->type != GGML_TYPE_F32 || !ggml_are_same_shape(add, y) || add->nb[0] != sizeof(float) ||
            y->nb[0] != sizeof(float) || ggml_nrows(add) != p->ne[1]) {
            continue;
        }
        th_set_custom2(add, th_add_rows_op, NULL, GGML_N_TASKS_MAX);
        add->src[1] = (struct ggml_tensor *) b;
        p->op = GGML_OP_NONE;
        changed++;
    }
    return changed;
}

/* ---- folds: a node computed by the node that reads it --------------------------------------
 * A product whose one reader adds something to it (a residual, gradients that meet, a bias row)
 * is computed by that reader, which adds as each block of rows is made (th_gemm_add_op): one
 * pass less over the product. The product's node then computes nothing and is shrunk to one
 * element (so that it holds no memory) and marked TH_CPU_FOLDED. A fold changes what nodes read,
 * so it is made before the graph is placed (th_cpu_fold): a placement made before would free the
 * product's sources at the product, not at the node that now reads them. */
enum { TH_CPU_FOLDED = 0x74686664 };   /* op_params[0] of a folded node: "thfd" */

static int th_is_folded(const struct ggml_tensor * t) {
    while (t != NULL && t->view_src != NULL) t = t->view_src;
    return t != NULL && t->op == GGML_OP_NONE && t->op_params[0] == TH_CPU_FOLDED;
}

static void th_fold_away(struct ggml_tensor * t) {
    memset(t->op_params, 0, sizeof(t->op_params));
    t->op_params[0] = TH_CPU_FOLDED;
    t->op = GGML_OP_NONE;
    for (int i = 0; i < GGML_MAX_SRC; i++) t->src[i] = NULL;
    t->ne[0] = t->ne[1] = t->ne[2] = t->ne[3] = 1;
    t->nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; i++) t->nb[i] = sizeof(float);
}

/* The f32 product (MUL_MAT or OUT_PROD, as built) under `t`'s RESHAPE views, each of them and it
 * read by the one above alone (`reader` reads t), 2-D, not an output, that th_cpu_rewrite will
 * compute with th_gemm_op; else NULL. */
static struct ggml_tensor * th_gemm_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                                   struct ggml_tensor * t) {
    struct ggml_tensor * only;
    while (t != NULL && !(t->flags & GGML_TENSOR_FLAG_OUTPUT) && th_readers(graph, t, &only) == 1 && only == reader) {
        if (t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_OUT_PROD) {
            /* a product th_cpu_rewrite will give to sgemm: not a centring product (th_centre_op;
             * its constant may hold no data yet) nor a bias's (th_add_rows_op) */
            const struct ggml_tensor * a = t->src[0];
            return th_gemm_ok(t) && strncmp(a->name, "centring.", 9) != 0 && strcmp(t->name, TH_BIAS_ROWS_NAME) != 0 &&
                   t->ne[2] * t->ne[3] == 1 && a->ne[2] * a->ne[3] == 1 ? t : NULL;
        }
        if (t->op != GGML_OP_RESHAPE) return NULL;
        reader = t;
        t = t->src[0];
    }
    return NULL;
}

/* 0, or -1 when a folded node (maybe by an earlier graph: graphs share nodes) is read in `graph`
 * by a node that is not a view, or is an output: it holds no value. */
static int th_check_folded(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * u = ggml_graph_node(graph, i);
        if ((u->flags & GGML_TENSOR_FLAG_OUTPUT) && th_is_folded(u)) return -1;
        if (u->view_src != NULL) continue;
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            /* a fused node's last sources: the folded node's view it read, kept so that it is freed */
            if (th_is_folded(u->src[j]) && !((j == 3 || j == 4) && th_is_custom(u, (void *) th_gemm_add_op)) &&
                !(j == 3 && th_is_custom(u, (void *) th_rms_norm_back_gain_op)) &&
                !(j == 2 && th_is_custom(u, (void *) th_gain_grad_op))) {
                return -1;
            }
        }
    }
    return 0;
}

/* The bias product ones @ b (blocks.add_bias, TH_BIAS_ROWS_NAME) under `t`'s RESHAPE views, read
 * as th_gemm_under_reshapes requires, whose ADD th_rewrite_bias_rows would make th_add_rows_op;
 * else NULL. */
static struct ggml_tensor * th_bias_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                                   struct ggml_tensor * t, int64_t n) {
    struct ggml_tensor * only;
    while (t != NULL && !(t->flags & GGML_TENSOR_FLAG_OUTPUT) && th_readers(graph, t, &only) == 1 && only == reader) {
        if (t->op == GGML_OP_MUL_MAT && strcmp(t->name, TH_BIAS_ROWS_NAME) == 0) {
            const struct ggml_tensor * b = t->src[0], * ones = t->src[1];
            return th_is_ones(ones) && b->ne[0] == 1 && b->ne[1] == n &&
                   b->type == GGML_TYPE_F32 && ggml_is_contiguous(b) ? t : NULL;
        }
        if (t->op != GGML_OP_RESHAPE) return NULL;
        reader = t;
        t = t->src[0];
    }
    return NULL;
}

/* ADD(x, y) of one shape with x or y a product (residuals; an input's gradient from several
 * projections; blocks.add_bias's y + ones @ b, then with b added to each row): the product folds
 * into the ADD, which becomes th_gemm_add_op. Before the graph is placed (the Trainer calls it
 * before it reserves the training graph): the placement then keeps the product's sources for the
 * ADD. Returns how many were folded. */
static int th_fold_gemm_adds(struct ggml_cgraph * graph) {
    int folded = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * m = NULL, * bias = NULL;
        int j = 1;
        /* not an in-place ADD (a view of its first operand: the product would overwrite it) */
        if (u->op != GGML_OP_ADD || u->view_src != NULL || u->type != GGML_TYPE_F32 || !ggml_is_contiguous(u)) continue;
        /* y + y of a product y: its addend would be the product folded away */
        if (u->src[0] == u->src[1]) continue;
        for (; j >= 0 && m == NULL; j--) {
            const struct ggml_tensor * other = u->src[1 - j];
            if (other->type != GGML_TYPE_F32 || !ggml_is_contiguous(other) || ggml_nelements(other) != ggml_nelements(u) ||
                ggml_nelements(u->src[j]) != ggml_nelements(u)) {
                continue;
            }
            m = th_gemm_under_reshapes(graph, u, u->src[j]);
            if (m != NULL && (m->ne[0] != u->ne[0] || ggml_nelements(m) != ggml_nelements(u))) m = NULL;
        }
        if (m == NULL) continue;
        j++;                                    /* u->src[j] reads the product */
        struct ggml_tensor * product = u->src[j], * addend = u->src[1 - j], * view = NULL;
        if ((bias = th_bias_under_reshapes(graph, u, addend, u->ne[0])) != NULL) {
            view = addend;                      /* what the ADD read of the bias product */
            addend = bias->src[0];              /* b itself: n floats */
        }
        const intptr_t flags = (m->op == GGML_OP_OUT_PROD ? 1 : 0) | (bias != NULL ? 2 : 0);
        struct ggml_tensor * a = m->src[0], * b = m->src[1];
        struct ggml_custom_op_params q = {th_gemm_add_op, GGML_N_TASKS_MAX, (void *) flags};
        memset(u->op_params, 0, sizeof(u->op_params));
        memcpy(u->op_params, &q, sizeof(q));
        u->op = GGML_OP_CUSTOM;
        /* src[3] (and src[4]): what the ADD read of the product (and of the bias product), not read
         * by the kernel: so that ggml-alloc frees their one-element nodes here; a node that
         * nothing reads would stay allocated to the graph's end */
        u->src[0] = a, u->src[1] = b, u->src[2] = addend, u->src[3] = product, u->src[4] = view;
        for (int k = 5; k < GGML_MAX_SRC; k++) u->src[k] = NULL;
        th_fold_away(m);
        if (bias != NULL) th_fold_away(bias);
        folded++;
    }
    return folded;
}

/* A norm's gain in the backward: RMS_NORM_BACK(MUL(G, g), x) reads G and g itself (the MUL folds),
 * and REPEAT_BACK(MUL(t, G)) (the gain's gradient) reads t and G (the MUL folds). Returns how many
 * MULs folded. */
static struct ggml_tensor * th_mul_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                                  struct ggml_tensor * t) {
    struct ggml_tensor * only;
    while (t != NULL && !(t->flags & GGML_TENSOR_FLAG_OUTPUT) && th_readers(graph, t, &only) == 1 && only == reader) {
        if (t->op == GGML_OP_MUL) {
            return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->src[0]->type == GGML_TYPE_F32 &&
                   t->src[1]->type == GGML_TYPE_F32 && ggml_is_contiguous(t->src[0]) && ggml_is_contiguous(t->src[1]) &&
                   ggml_are_same_shape(t, t->src[0]) ? t : NULL;
        }
        if (t->op != GGML_OP_RESHAPE) return NULL;
        reader = t;
        t = t->src[0];
    }
    return NULL;
}

static void th_set_custom_srcs(struct ggml_tensor * t, ggml_custom_op_t fun, struct ggml_tensor * s0,
                               struct ggml_tensor * s1, struct ggml_tensor * s2, struct ggml_tensor * s3) {
    struct ggml_custom_op_params q = {fun, GGML_N_TASKS_MAX, NULL};
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, &q, sizeof(q));
    t->op = GGML_OP_CUSTOM;
    t->src[0] = s0, t->src[1] = s1, t->src[2] = s2, t->src[3] = s3;
    for (int k = 4; k < GGML_MAX_SRC; k++) t->src[k] = NULL;
}

static int th_fold_norm_gains(struct ggml_cgraph * graph) {
    int folded = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * m;
        if (u->op == GGML_OP_RMS_NORM_BACK && u->view_src == NULL && th_rms_norm_back_ok(u) &&
            (m = th_mul_under_reshapes(graph, u, u->src[0])) != NULL && ggml_nelements(m) == ggml_nelements(u) &&
            m->ne[0] == u->ne[0] && ggml_nelements(m->src[1]) == u->ne[0] && m->src[1]->ne[0] == u->ne[0] &&
            m->src[0]->ne[0] == u->ne[0]) {
            float eps;
            memcpy(&eps, u->op_params, sizeof(float));
            struct ggml_tensor * view = u->src[0], * x = u->src[1];
            th_set_custom_srcs(u, th_rms_norm_back_gain_op, m->src[0], x, m->src[1], view);
            memcpy((float *) u->op_params + TH_PARAM_SLOT, &eps, sizeof(float));
            th_fold_away(m);
            folded++;
        } else if (u->op == GGML_OP_REPEAT_BACK && u->view_src == NULL && u->type == GGML_TYPE_F32 &&
                   ggml_is_contiguous(u) && ggml_nelements(u) == u->ne[0] &&
                   (m = th_mul_under_reshapes(graph, u, u->src[0])) != NULL && m->ne[0] == u->ne[0] &&
                   ggml_are_same_shape(m, m->src[1])) {
            struct ggml_tensor * view = u->src[0];
            th_set_custom_srcs(u, th_gain_grad_op, m->src[0], m->src[1], view, NULL);
            th_fold_away(m);
            folded++;
        }
    }
    return folded;
}

/* The folds, for a training graph as built (before th_cpu_rewrite and before it is placed).
 * Returns how many ADDs took a product, or -1 when a node folded earlier is read in this graph. */
TH_EXPORT int th_cpu_fold(struct ggml_cgraph * graph) {
    if (th_check_folded(graph) < 0) return -1;
    const int adds = th_fold_gemm_adds(graph);
    return adds + th_fold_norm_gains(graph);
}

/* Causal attention's products (see th_causal_range): for each softmax of a (.., T, T) input under
 * the causal mask constant (blocks.attention; its values checked), the product that makes its
 * input S and the one that makes its gradient's dP (each read by that node alone), and every
 * product that reads P or dS, get their causal form. Marked as th_gemm_op here, before the main
 * swap; a product another graph marked already is left alone. */
static int th_is_causal_mask(const struct ggml_tensor * m, int64_t T) {
    if (m == NULL || strncmp(m->name, "causal_mask.", 12) != 0 || m->type != GGML_TYPE_F32 || m->op != GGML_OP_NONE ||
        m->ne[0] != T || m->ne[1] != T || m->ne[2] != 1 || m->ne[3] != 1 || m->data == NULL || !ggml_is_contiguous(m)) {
        return 0;
    }
    const float * v = (const float *) m->data;
    for (int64_t i = 0; i < T; i++) {
        for (int64_t j = 0; j < T; j++) {
            const float x = v[i * T + j];
            if (j > i ? !(isinf(x) && x < 0.0f) : x != 0.0f) return 0;
        }
    }
    return 1;
}

/* 1 when t's 2-D slices are the T x T slices of `root` as they are (X), 2 when transposed (X^T),
 * else 0 */
static int th_causal_view(const struct ggml_tensor * t, const struct ggml_tensor * root, int64_t T) {
    const size_t slice = (size_t) (T * T) * sizeof(float);
    if (t == NULL || root == NULL || (t->view_src != NULL ? t->view_src : t) != root || t->type != GGML_TYPE_F32 ||
        t->ne[0] != T || t->ne[1] != T || t->view_offs % slice != 0 || (t->ne[2] > 1 && t->nb[2] % slice != 0) ||
        (t->ne[3] > 1 && t->nb[3] % slice != 0)) {
        return 0;
    }
    if (t->nb[0] == sizeof(float) && t->nb[1] == (size_t) T * sizeof(float)) return 1;
    if (t->nb[1] == sizeof(float) && t->nb[0] == (size_t) T * sizeof(float)) return 2;
    return 0;
}

/* the f32 product that `reader`'s source v is (or views as X, through views each read by the one
 * above alone), itself read by nothing else and not an output; else NULL */
static struct ggml_tensor * th_causal_product_of(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                                 struct ggml_tensor * v, int64_t T) {
    struct ggml_tensor * t = v, * only;
    while (t != NULL && !(t->flags & GGML_TENSOR_FLAG_OUTPUT) && th_readers(graph, t, &only) == 1 && only == reader) {
        if (t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_OUT_PROD) {
            return th_causal_view(v, t, T) == 1 && ggml_is_contiguous(t) && th_gemm_ok(t) ? t : NULL;
        }
        if (t->view_src == NULL) return NULL;
        reader = t;
        t = t->src[0];
    }
    return NULL;
}

static int th_mark_gemm(struct ggml_tensor * t, int causal) {
    if (t == NULL || !th_gemm_ok(t)) return 0;
    th_set_custom2(t, th_gemm_op, (void *) (intptr_t) ((t->op == GGML_OP_OUT_PROD) | (causal << 1)), GGML_N_TASKS_MAX);
    return 1;
}

/* th_mark_gemm, and with a packed mask whose batch rows divide the product's slices (B*H of them,
 * batch-major) the packed form, which reads the mask */
static int th_mark_attention_gemm(struct ggml_tensor * t, int causal, struct ggml_tensor * packed) {
    if (packed == NULL || t == NULL || !th_gemm_ok(t) || t->ne[3] != 1 || t->ne[2] % packed->ne[3] != 0) {
        return th_mark_gemm(t, causal);
    }
    const intptr_t flags = (t->op == GGML_OP_OUT_PROD) | (causal << 1);
    th_set_custom_srcs(t, th_gemm_packed_op, t->src[0], t->src[1], packed, NULL);
    struct ggml_custom_op_params p;
    memcpy(&p, t->op_params, sizeof(p));
    p.userdata = (void *) flags;
    memcpy(t->op_params, &p, sizeof(p));
    return 1;
}

/* a packed rows' mask (toyharness/engine/packed.py, MASK_PREFIX): fed per step, (T, T, 1, B),
 * hiding every key right of the diagonal and more; its values are the harness's, not checked here */
static int th_is_packed_mask(const struct ggml_tensor * m, int64_t T) {
    return m != NULL && strncmp(m->name, "packed_mask.", 12) == 0 && m->type == GGML_TYPE_F32 &&
           m->op == GGML_OP_NONE && m->ne[0] == T && m->ne[1] == T && m->ne[2] == 1 && ggml_is_contiguous(m);
}

/* a SOFT_MAX (or our softmax already) to our kernel; causal: TH_SOFTMAX_CAUSAL or _PACKED (its mask) */
static void th_set_soft_max(struct ggml_tensor * t, int causal) {
    if (t->op == GGML_OP_SOFT_MAX) {
        if (!th_soft_max_ok(t)) return;
        float scale;
        memcpy(&scale, t->op_params, sizeof(float));
        th_set_custom2(t, th_soft_max_op, NULL, GGML_N_TASKS_MAX);
        memcpy((float *) t->op_params + TH_PARAM_SLOT, &scale, sizeof(float));
    }
    if (causal) th_set_userdata(t, (void *) (intptr_t) causal);
}

static int th_mark_causal(struct ggml_cgraph * graph) {
    int marked = 0;
    const struct ggml_tensor * mask_checked = NULL;     /* the layers share one mask: its values read once */
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * sm = ggml_graph_node(graph, i);
        const int64_t T = sm->ne[0];
        if ((sm->op != GGML_OP_SOFT_MAX && !th_is_custom(sm, (void *) th_soft_max_op)) || sm->type != GGML_TYPE_F32 ||
            sm->ne[1] != T || sm->view_src != NULL || !ggml_is_contiguous(sm) || sm->src[1] == NULL) {
            continue;
        }
        const int packed = th_is_packed_mask(sm->src[1], T);
        if (!packed && sm->src[1] != mask_checked && !th_is_causal_mask(sm->src[1], T)) continue;
        if (!packed) mask_checked = sm->src[1];
        th_set_soft_max(sm, packed ? TH_SOFTMAX_PACKED : TH_SOFTMAX_CAUSAL);
        struct ggml_tensor * ds = NULL;
        for (int j = i + 1; j < n && ds == NULL; j++) {
            struct ggml_tensor * u = ggml_graph_node(graph, j);
            if (u->op == GGML_OP_SOFT_MAX_BACK && u->src[1] == sm && u->view_src == NULL && ggml_is_contiguous(u)) ds = u;
        }
        /* dropout on P (Tensor.dropout: P times a mask node of dropout_mask.c) is zero where P is */
        struct ggml_tensor * dropped = NULL;
        for (int j = i + 1; j < n && dropped == NULL; j++) {
            struct ggml_tensor * u = ggml_graph_node(graph, j);
            if (u->op == GGML_OP_MUL && u->src[0] == sm && u->src[1] != NULL && th_is_dropout_mask(u->src[1]) &&
                u->view_src == NULL && ggml_is_contiguous(u) && ggml_are_same_shape(u, sm)) {
                dropped = u;
            }
        }
        struct ggml_tensor * mask = packed ? sm->src[1] : NULL;
        marked += th_mark_attention_gemm(th_causal_product_of(graph, sm, sm->src[0], T), TH_CAUSAL_OUT, mask);
        if (ds != NULL) {
            /* with dropout on P, dS reads dP times the mask: dP's product is that MUL's source */
            struct ggml_tensor * d = ds->src[0], * only;
            const int through_mask = dropped != NULL && d != NULL && d->op == GGML_OP_MUL && d->src[1] == dropped->src[1] &&
                                     !(d->flags & GGML_TENSOR_FLAG_OUTPUT) && th_readers(graph, d, &only) == 1 && only == ds;
            marked += through_mask ? th_mark_attention_gemm(th_causal_product_of(graph, d, d->src[0], T), TH_CAUSAL_OUT, mask)
                                   : th_mark_attention_gemm(th_causal_product_of(graph, ds, ds->src[0], T), TH_CAUSAL_OUT, mask);
        }
        if (ds != NULL && packed && th_is_custom(sm, (void *) th_soft_max_op) && ggml_are_same_shape(ds, sm) &&
            ggml_is_contiguous(ds->src[0])) {
            float scale;
            memcpy(&scale, ds->op_params, sizeof(float));
            th_set_custom_srcs(ds, th_soft_max_back_op, ds->src[0], sm, sm->src[1], NULL);
            memcpy((float *) ds->op_params + TH_PARAM_SLOT, &scale, sizeof(float));
            marked++;
        }
        for (int j = 0; j < n; j++) {
            struct ggml_tensor * u = ggml_graph_node(graph, j);
            if (u->op != GGML_OP_MUL_MAT && u->op != GGML_OP_OUT_PROD) continue;
            const int out_prod = u->op == GGML_OP_OUT_PROD;
            for (int side = 0; side < 3; side++) {
                const struct ggml_tensor * root = side == 2 ? dropped : side ? ds : sm;
                const int v0 = th_causal_view(u->src[0], root, T), v1 = th_causal_view(u->src[1], root, T);
                /* MUL_MAT: A = src1's view, B = src0's view transposed; OUT_PROD: A = src1's transposed,
                 * B = src0's */
                const int causal = v1 ? ((v1 == 1) != out_prod ? TH_CAUSAL_A_LOWER : TH_CAUSAL_A_UPPER)
                                 : v0 ? ((v0 == 1) == out_prod ? TH_CAUSAL_B_LOWER : TH_CAUSAL_B_UPPER)
                                      : TH_CAUSAL_NONE;
                if (causal != TH_CAUSAL_NONE) {
                    marked += th_mark_attention_gemm(u, causal, mask);
                    break;
                }
            }
        }
    }
    return marked;
}

/* Swaps every node that has a kernel here for it; returns how many were swapped, or -1 when a
 * stand-in cannot be swapped (th_rewrite_gelu) or a fused bias product is read elsewhere
 * (th_rewrite_bias_rows). Nodes a previous call swapped (graphs that share nodes) are custom
 * ops by now and left alone. */
TH_EXPORT int th_cpu_rewrite(struct ggml_cgraph * graph) {
    if (th_check_folded(graph) < 0) return -1;
    const int gelu = th_rewrite_gelu(graph), bias_rows = th_rewrite_bias_rows(graph), frozen = th_rewrite_frozen(graph);
    if (gelu < 0 || bias_rows < 0 || frozen < 0) return -1;
    int changed = gelu + bias_rows + frozen + th_mark_causal(graph);
    th_keep_gelu_slopes(graph);
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (th_centre_ok(t)) {
            th_set_custom1(t, th_centre_op, t->src[1], t->op == GGML_OP_OUT_PROD ? (void *) 1 : NULL);
        } else if (th_gemm_ok(t)) {
            th_set_custom2(t, th_gemm_op, t->op == GGML_OP_OUT_PROD ? (void *) 1 : NULL, GGML_N_TASKS_MAX);
        } else if (th_cont_ok(t)) {
            th_set_custom1(t, th_cont_op, t->src[0], NULL);
        } else if (th_silu_back_ok(t)) {
            th_set_custom2(t, th_silu_back_op, NULL, GGML_N_TASKS_MAX);
        } else if (th_soft_max_ok(t)) {
            th_set_soft_max(t, 0);
        } else if (th_soft_max_back_rows_ok(t)) {
            float scale;
            memcpy(&scale, t->op_params, sizeof(float));
            th_set_custom2(t, th_soft_max_back_rows_op, NULL, GGML_N_TASKS_MAX);
            memcpy((float *) t->op_params + TH_PARAM_SLOT, &scale, sizeof(float));
        } else if (th_rms_norm_ok(t) || th_rms_norm_back_ok(t)) {
            float eps;
            memcpy(&eps, t->op_params, sizeof(float));
            if (t->op == GGML_OP_RMS_NORM) {
                th_set_custom1(t, th_rms_norm_op, t->src[0], NULL);
            } else {
                th_set_custom2(t, th_rms_norm_back_op, NULL, GGML_N_TASKS_MAX);
            }
            memcpy((float *) t->op_params + TH_PARAM_SLOT, &eps, sizeof(float));
        } else if (th_rope_ok(t)) {
            int32_t rope_params[16];
            memcpy(rope_params, t->op_params, sizeof(rope_params));
            const float sin_sign = t->op == GGML_OP_ROPE ? 1.0f : -1.0f;
            th_set_custom2(t, th_rope_op, NULL, GGML_N_TASKS_MAX);
            th_keep_rope_params(t, rope_params, sin_sign);
        } else if (th_cross_entropy_ok(t)) {
            th_set_custom2(t, th_cross_entropy_op, NULL, GGML_N_TASKS_MAX);
        } else if (th_cross_entropy_back_ok(t)) {
            th_set_custom(t, th_cross_entropy_back_op);
        } else if (th_adamw_ok(t)) {
            th_set_custom(t, th_adamw_op);
        } else {
            continue;
        }
        changed++;
    }
    return changed;
}
