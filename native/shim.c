/* toyharness shim: the few things the Python binding cannot do through ggml's public API.
 *
 * - ggml_tensor is opaque to the binding (we declare no ggml structs), so shapes, strides,
 *   types and data pointers are read here.
 * - ggml aborts the process on internal errors; the abort handler makes that message say
 *   who is speaking before the process ends.
 * - ggml logs to stderr by default; the binding turns that down to warnings and errors.
 */
#include <stdio.h>
#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-impl.h" /* struct ggml_map_custom2_op_params, for the sgemm custom op */

#define TH_EXPORT __attribute__((visibility("default")))

TH_EXPORT int th_tensor_type(const struct ggml_tensor * t) { return (int) t->type; }

TH_EXPORT void th_tensor_shape(const struct ggml_tensor * t, int64_t ne[4], size_t nb[4]) {
    for (int i = 0; i < 4; i++) {
        ne[i] = t->ne[i];
        nb[i] = t->nb[i];
    }
}

TH_EXPORT void * th_tensor_data(const struct ggml_tensor * t) { return t->data; }

TH_EXPORT int th_tensor_has_buffer(const struct ggml_tensor * t) { return t->buffer != NULL; }

TH_EXPORT int th_tensor_flags(const struct ggml_tensor * t) { return (int) t->flags; }

TH_EXPORT int th_tensor_op(const struct ggml_tensor * t) { return (int) t->op; }

static void th_abort_handler(const char * message) {
    fflush(stdout);
    fprintf(stderr,
            "toyharness: ggml aborted the process: %s\n"
            "toyharness: this is a bug in toyharness (user input should have been rejected before ggml); please report it\n",
            message);
    fflush(stderr);
}

TH_EXPORT void th_install_abort_handler(void) { ggml_set_abort_callback(th_abort_handler); }

static int th_log_min_level = GGML_LOG_LEVEL_WARN;
static int th_log_last_shown = 0;

static void th_log_handler(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    /* a CONT line continues the previous message: shown when that one was */
    int show = level == GGML_LOG_LEVEL_CONT ? th_log_last_shown : (int) level >= th_log_min_level;
    th_log_last_shown = show;
    if (show) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

TH_EXPORT void th_set_log_level(int min_level) {
    th_log_min_level = min_level;
    ggml_log_set(th_log_handler, NULL);
}

/* ggml's graph allocator treats a node whose data is already set as allocated elsewhere and
 * plans around it. Graphs that share nodes (train, eval, sampling) must therefore forget the
 * previous graph's placement before the allocator places them again: clear every tensor of
 * the compute context (never the persistent ones, which live in another context). */
TH_EXPORT void th_clear_ctx_alloc(struct ggml_context * ctx) {
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t != NULL; t = ggml_get_next_tensor(ctx, t)) {
        t->data = NULL;
        t->buffer = NULL;
    }
}

static void th_gemm_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                       int ith, int nth, void * userdata);

/* FLOPs (2 per multiply-add) of a node's matrix product: MUL_MAT and OUT_PROD (also once
 * th_blas_rewrite has turned them into sgemm calls), which dominate a training step; 0 for
 * other ops. */
TH_EXPORT double th_node_matmul_flops(const struct ggml_tensor * t) {
    if (t->op == GGML_OP_MAP_CUSTOM2) {
        struct ggml_map_custom2_op_params p;
        memcpy(&p, t->op_params, sizeof(p));
        if (p.fun != th_gemm_op) return 0.0;
        return 2.0 * (double) ggml_nelements(t) * (double) (p.userdata ? t->src[0]->ne[1] : t->src[0]->ne[0]);
    }
    if (t->op == GGML_OP_MUL_MAT) {
        return 2.0 * (double) ggml_nelements(t) * (double) t->src[0]->ne[0];
    }
    if (t->op == GGML_OP_OUT_PROD) {
        return 2.0 * (double) ggml_nelements(t) * (double) t->src[0]->ne[1];
    }
    return 0.0;
}

/* ---- matrix products through an external sgemm ---------------------------------------------
 * ggml 0.25.3 computes a weight's gradient with OUT_PROD, a plain loop at a quarter of the
 * machine's FP32 ceiling, and its f32 MUL_MAT reaches less than half. When the binding hands
 * us a CBLAS sgemm (OpenBLAS from the scipy-openblas32 wheel), th_blas_rewrite turns each f32
 * MUL_MAT and OUT_PROD node of a finished graph into a custom op that calls it. The work is
 * cut into fixed tasks (a batch slice times a block of TH_GEMM_ROWS output rows), each one
 * sgemm call on one thread, so every output element comes from the same call whatever the
 * thread count: the bits do not depend on it. Run only after the backward graph is built
 * (ggml has no backward for custom ops). */
enum { TH_ROW_MAJOR = 101, TH_NO_TRANS = 111, TH_TRANS = 112, TH_GEMM_ROWS = 64 };
typedef void (*th_sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float * a, int lda, const float * b, int ldb, float beta, float * c, int ldc);
static th_sgemm_fn th_sgemm = NULL;

TH_EXPORT void th_set_sgemm(void * fn) { th_sgemm = (th_sgemm_fn) fn; }

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

/* dst(m, n) as a row-major M x N matrix, M = dst->ne[1], N = dst->ne[0]:
 *   MUL_MAT  dst = b_view   . a_view^T   (a: N x K, b: M x K)
 *   OUT_PROD dst = b_view^T . a_view     (a: K x N, b: K x M)  */
static void th_gemm_op(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                       int ith, int nth, void * userdata) {
    const int out_prod = userdata != NULL;
    int ta, lda, tb, ldb;
    th_operand(b, out_prod, &tb, &ldb);
    th_operand(a, !out_prod, &ta, &lda);
    const int64_t M = dst->ne[1], N = dst->ne[0];
    const int64_t K = out_prod ? a->ne[1] : a->ne[0];
    const int64_t r2 = b->ne[2] / a->ne[2], r3 = b->ne[3] / a->ne[3];
    const int64_t blocks = (M + TH_GEMM_ROWS - 1) / TH_GEMM_ROWS;
    const int64_t tasks = blocks * dst->ne[2] * dst->ne[3];
    for (int64_t task = ith; task < tasks; task += nth) {
        const int64_t blk = task % blocks, i2 = (task / blocks) % dst->ne[2], i3 = task / (blocks * dst->ne[2]);
        const int64_t m0 = blk * TH_GEMM_ROWS, rows = M - m0 < TH_GEMM_ROWS ? M - m0 : TH_GEMM_ROWS;
        const char * pa = (const char *) a->data + (i2 / r2) * a->nb[2] + (i3 / r3) * a->nb[3];
        const char * pb = (const char *) b->data + i2 * b->nb[2] + i3 * b->nb[3];
        /* the first operand's rows m0.. : along b's ne1 for MUL_MAT, along b's ne0 for OUT_PROD */
        pb += m0 * (out_prod ? b->nb[0] : b->nb[1]);
        float * pc = (float *) ((char *) dst->data + m0 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
        th_sgemm(TH_ROW_MAJOR, tb, ta, (int) rows, (int) N, (int) K, 1.0f, (const float *) pb, ldb,
                 (const float *) pa, lda, 0.0f, pc, (int) (dst->nb[1] / sizeof(float)));
    }
}

static int th_gemm_ok(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD) return 0;
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    if (t->type != GGML_TYPE_F32 || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32) return 0;
    if (!ggml_is_contiguous(t) || a->ne[2] == 0 || a->ne[3] == 0) return 0;
    if (b->ne[2] % a->ne[2] || b->ne[3] % a->ne[3] || t->ne[2] != b->ne[2] || t->ne[3] != b->ne[3]) return 0;
    if (t->ne[0] > INT32_MAX || t->ne[1] > INT32_MAX || a->ne[0] > INT32_MAX || a->ne[1] > INT32_MAX) return 0;
    int tr, ld;
    const int out_prod = t->op == GGML_OP_OUT_PROD;
    return th_operand(b, out_prod, &tr, &ld) && th_operand(a, !out_prod, &tr, &ld);
}

/* Returns how many nodes now call sgemm (0 when no sgemm was set). */
TH_EXPORT int th_blas_rewrite(struct ggml_cgraph * graph) {
    if (th_sgemm == NULL) return 0;
    int changed = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!th_gemm_ok(t)) continue;
        struct ggml_map_custom2_op_params p = {th_gemm_op, GGML_N_TASKS_MAX, t->op == GGML_OP_OUT_PROD ? (void *) 1 : NULL};
        memset(t->op_params, 0, sizeof(t->op_params));
        memcpy(t->op_params, &p, sizeof(p));
        t->op = GGML_OP_MAP_CUSTOM2;
        changed++;
    }
    return changed;
}
