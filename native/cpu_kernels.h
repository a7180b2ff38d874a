/* toyharness cpu kernels: what the kernels' files share, so that each includes this header and no
 * other .c file, and none declares another's function itself. Inline helpers (the tasks a
 * kernel's work is cut into, a graph's readers, exp over rows) and, below, each file's functions
 * that another calls: cpu_kernels.c (the rewrite, which swaps in the others' kernels),
 * frozen_matmul.c, frozen_dequant.c, chunked_loss.c and cpu_adamw.c; the cuda rewrite
 * (native/cuda_rewrite/) and portable_kernels.c use it too. */
#ifndef TOYHARNESS_CPU_KERNELS_H
#define TOYHARNESS_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

#include "ggml.h"

/* ---- tasks ----------------------------------------------------------------------------------
 * A kernel's work is cut into tasks fixed by the shapes; what a task computes does not depend
 * on which thread runs it, so the bits do not depend on how tasks meet threads. Thread ith of
 * nth (ggml calls a custom op on each of its threads) takes one contiguous run of them: the
 * ith nth-part, as ggml's own kernels split rows. A row (a token, mostly) then stays with the
 * same thread from node to node, in its cache. That matters on the 2-core VM: at times its two
 * CPUs sit far apart (a cache line's round trip between them goes from about 90 to 400 ns:
 * th_cpu_round_trip_ns, printed by tools/machine_drift.py), and tasks claimed from a shared
 * counter, which scatter rows over the threads, then made a gpt2 step 1.2x slower.
 * Use: int64_t taken = 0; for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) */
static inline int64_t th_next_task(int64_t tasks, int ith, int nth, int64_t * taken) {
    const int64_t task = tasks * ith / nth + (*taken)++;
    return task < tasks * (ith + 1) / nth ? task : -1;
}

/* how many nodes of `graph` read `t`, and the one that does when there is one (the cpu and cuda
 * rewrites' folds take a node read by one other alone) */
static inline int th_readers(struct ggml_cgraph * graph, const struct ggml_tensor * t, struct ggml_tensor ** only) {
    int n = 0;
    *only = NULL;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (u->src[j] == t) {
                n++;
                *only = u;
                break;
            }
        }
    }
    return n;
}

/* exp, branch-free so that a loop of it vectorises (glibc's expf is a scalar call):
 * exp(x) = 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative
 * error below 2e-7 on that interval); x is clamped so that 2^n stays a normal float, and
 * below -87 the result is 0. Inline: each kernel file computes it under its own compile flags. */
static inline float th_expf(float x0) {
    const float x = x0 < -87.0f ? -87.0f : (x0 > 88.0f ? 88.0f : x0);
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;   /* ln2 split hi + lo */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t) n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return x0 < -87.0f ? 0.0f : p * scale; /* exp(-inf) = 0, as a masked softmax needs */
}

enum { TH_EW_CHUNK = 4096 }; /* elements per task of an elementwise kernel */

enum { TH_LANES = 16 };      /* partial sums of a row reduction */

/* y[k] = exp(x[k] - shift) for k < n (y may be x); returns their sum, TH_LANES partial sums
 * combined in a fixed order. Inline: each kernel file computes it under its own compile flags. */
static inline float th_exp_row(float * y, const float * x, int64_t n, float shift) {
    float lane[TH_LANES] = {0};
    int64_t k = 0;
    for (; k + TH_LANES <= n; k += TH_LANES) {
        for (int j = 0; j < TH_LANES; j++) {
            y[k + j] = th_expf(x[k + j] - shift);
            lane[j] += y[k + j];
        }
    }
    float sum = 0.0f;
    for (int j = 0; j < TH_LANES; j++) sum += lane[j];
    for (; k < n; k++) {
        y[k] = th_expf(x[k] - shift);
        sum += y[k];
    }
    return sum;
}

/* Rows per task of a row-wise kernel: about TH_EW_CHUNK elements, at least one row. Fixed by the
 * shape; short rows (a 17-wide attention row) would otherwise make tasks so small that their
 * overhead costs more than their work. */
static inline int64_t th_rows_per_task(int64_t row_len) {
    return row_len >= TH_EW_CHUNK ? 1 : TH_EW_CHUNK / (row_len > 0 ? row_len : 1);
}

/* The next chunk [*i0, *i1) of an elementwise kernel over n elements that this thread takes
 * (TH_EW_CHUNK elements a task); 0 when none is left.
 * Use: int64_t taken = 0, i0, i1; while (th_next_chunk(n, ith, nth, &taken, &i0, &i1)) ... */
static inline int th_next_chunk(int64_t n, int ith, int nth, int64_t * taken, int64_t * i0, int64_t * i1) {
    const int64_t task = th_next_task((n + TH_EW_CHUNK - 1) / TH_EW_CHUNK, ith, nth, taken);
    if (task < 0) return 0;
    *i0 = task * TH_EW_CHUNK;
    *i1 = *i0 + TH_EW_CHUNK < n ? *i0 + TH_EW_CHUNK : n;
    return 1;
}

/* The next block of rows [*r0, *r1) of a row-wise kernel over nr rows of row_len elements that
 * this thread takes (th_rows_per_task rows a task); 0 when none is left. */
static inline int th_next_rows(int64_t nr, int64_t row_len, int ith, int nth, int64_t * taken, int64_t * r0,
                               int64_t * r1) {
    const int64_t rpt = th_rows_per_task(row_len), task = th_next_task((nr + rpt - 1) / rpt, ith, nth, taken);
    if (task < 0) return 0;
    *r0 = task * rpt;
    *r1 = *r0 + rpt < nr ? *r0 + rpt : nr;
    return 1;
}

/* A softmax row's input: y = x scale, plus the mask's row (i1; broadcast over dims 2 and 3) from
 * its column col0 (x and y start there too) when there is a mask. Inline: each kernel file computes it under its own compile flags. */
static inline void th_softmax_input(float * y, const float * x, const struct ggml_tensor * mask, int64_t i1, int64_t i2,
                                    int64_t i3, int64_t nc, float scale, int64_t col0) {
    if (mask != NULL) {
        const float * m = (const float *) ((const char *) mask->data + i1 * mask->nb[1] + (i2 % mask->ne[2]) * mask->nb[2] +
                                           (i3 % mask->ne[3]) * mask->nb[3]) + col0;
        for (int64_t k = 0; k < nc; k++) y[k] = x[k] * scale + m[k];
    } else {
        for (int64_t k = 0; k < nc; k++) y[k] = x[k] * scale;
    }
}
/* ---- each file's functions that another file calls ------------------------------------------ */
/* cpu_kernels.c: the CBLAS sgemm the binding hands over (th_set_sgemm; NULL without one) */
enum { TH_ROW_MAJOR = 101, TH_NO_TRANS = 111, TH_TRANS = 112 };
typedef void (*th_sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                            const float * a, int lda, const float * b, int ldb, float beta, float * c, int ldc);
extern th_sgemm_fn th_sgemm;

/* cpu_kernels.c: turn node t into a two-source custom op (its op_params cleared first) */
void th_set_custom2(struct ggml_tensor * t, ggml_custom2_op_t fun, void * ud, int n_tasks);

/* cpu_kernels.c: GELU's stand-in pairs (blocks.gelu_tanh, blocks.gelu_erf: a SILU named k->name and the
 * SILU_BACK ggml built for it) handed to a backend's kernels: cpu_kernels.c's, or ggml-cuda's of
 * ours (native/cuda_rewrite/gelu.c). Returns how many nodes were set, or -1 when a pair cannot be. */
struct th_gelu_kernels {
    const char * name;                                    /* the stand-in SILU's name */
    void (*set_forward)(struct ggml_tensor * t);          /* t: the stand-in SILU, its input t->src[0] */
    void (*set_backward)(struct ggml_tensor * b);         /* b: its SILU_BACK(gradient, input) */
    int (*is_forward)(const struct ggml_tensor * t);      /* set already, by an earlier graph */
    int (*is_backward)(const struct ggml_tensor * b);
};
int th_rewrite_gelu_pairs(struct ggml_cgraph * graph, const struct th_gelu_kernels * k);

/* frozen_matmul.c: products with a frozen non-f32 weight (f16, bf16, quantized), in f32 */
int th_rewrite_frozen(struct ggml_cgraph * graph);
const char * th_frozen_kernel_name(const struct ggml_tensor * t, double * flops);
int th_frozen_type_ok(int type);
/* rows [r0, r0 + rows), columns [c0, c0 + cols) of a weight (f32 or a frozen type) as f32 */
void th_dequantize(const struct ggml_tensor * w, int64_t r0, int64_t rows, int64_t c0, int64_t cols, float * out);
/* C (m x n, row-major) = A . B + beta C (A^T, B^T where asked): th_sgemm, or a plain loop */
void th_frozen_gemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, const float * a, int64_t lda,
                    const float * b, int64_t ldb, float beta, float * c, int64_t ldc);

/* frozen_dequant.c: n values of a row of `type` as f32, ggml's values; 0 for a type it leaves to
 * ggml's to_float */
int th_fast_dequantize_row(enum ggml_type type, const void * src, float * dst, int64_t n);

/* chunked_loss.c: the chunked loss's kernel name and its products' FLOPs (bench --profile) */
const char * th_chunked_loss_kernel_name(const struct ggml_tensor * t, double * flops);

/* cpu_adamw.c (built with -fno-math-errno, so that its square root vectorises) */
void th_adamw_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);
int th_adamw_ok(const struct ggml_tensor * t);

#endif
