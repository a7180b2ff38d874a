/* The cuda rewrite's passes (native/cuda_rewrite.c calls them, in its order) and the helpers
 * several of them use. Each pass marks or folds a graph's nodes for our kernels inside ggml-cuda
 * (native/cuda/); returns how many nodes it marked, a check -1 when the graph must not be computed. */
#ifndef TH_CUDA_REWRITE_PASSES_H
#define TH_CUDA_REWRITE_PASSES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h"
#include "../cpu_kernels.h"
#include "../custom_ops.h"

static inline int th_marked(const struct ggml_tensor * t, int kernel) { return th_kernel_of(t) == kernel; }

static inline void th_set_params(struct ggml_tensor * t, const void * params, size_t size) {
    memcpy(t->op_params + 2, params, size);
}

static inline void th_set_srcs(struct ggml_tensor * t, struct ggml_tensor * s0, struct ggml_tensor * s1,
                        struct ggml_tensor * s2, struct ggml_tensor * s3, struct ggml_tensor * s4,
                        struct ggml_tensor * s5) {
    memset(t->src, 0, sizeof(t->src));
    t->src[0] = s0, t->src[1] = s1, t->src[2] = s2, t->src[3] = s3, t->src[4] = s4, t->src[5] = s5;
}

/* a contiguous f32 shape (ne0, ne1), for a node whose readers are all rewritten here */
static inline void th_set_rows(struct ggml_tensor * t, int64_t ne0, int64_t ne1) {
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = 1, t->ne[3] = 1;
    t->nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * t->ne[i - 1];
}

static inline int th_f32_contiguous(const struct ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
}

static inline int th_shape_is(const struct ggml_tensor * t, int64_t ne0, int64_t ne1, int64_t ne2) {
    return t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1;
}

/* a node computed by a later one (which takes its sources): it computes nothing */
static inline void th_fold(struct ggml_tensor * t, int shrink) {
    th_mark(t, TH_CUDA_FOLDED);
    th_set_srcs(t, NULL, NULL, NULL, NULL, NULL, NULL);
    if (shrink) th_set_rows(t, 1, 1);
}

/* Where `x` (n0, n1, heads), contiguous, reaches a CONT through views alone, each read by the next
 * alone, and those views only permute its axes (heads split into h then b, each kept whole): that
 * CONT, with `map` set to the CONT's axes of x's axis 0, axis 1, h and b. Else NULL. */
static inline struct ggml_tensor * th_permuted_cont_of(struct ggml_cgraph * graph, struct ggml_tensor * x,
                                                th_attention_map * map, int64_t n0, int64_t n1, int64_t heads) {
    struct ggml_tensor * v = x, * c = NULL;
    for (;;) {
        if (th_readers(graph, v, &c) != 1) return NULL;
        if (c->view_src != x || c->view_offs != 0) break;
        v = c;
    }
    if (v == x || c->src[0] != v || !(c->op == GGML_OP_CONT || th_marked(c, TH_CUDA_CONT)) ||
        !th_f32_contiguous(c) || !ggml_are_same_shape(c, v) || (c->flags & GGML_TENSOR_FLAG_OUTPUT) ||
        !th_f32_contiguous(x) || ggml_nelements(x) != n0 * n1 * heads) {
        return NULL;
    }
    th_attention_map m = {{-1, -1, -1, -1}};
    int64_t H = 1;
    int axes = 0, used = 0;
    for (int pass = 0; pass < 2; pass++) {           /* the h axis first: its size fixes b's stride */
        for (int k = 0; k < GGML_MAX_DIMS; k++) {
            const int64_t ne = v->ne[k], nb = (int64_t) (v->nb[k] / sizeof(float));
            if (ne == 1) continue;
            axes += pass == 0;
            if (pass == 0 && nb == 1 && ne == n0 && m.axis[0] < 0) {
                m.axis[0] = (int8_t) k, used++;
            } else if (pass == 0 && nb == n0 && ne == n1 && m.axis[1] < 0) {
                m.axis[1] = (int8_t) k, used++;
            } else if (pass == 0 && nb == n0 * n1 && heads % ne == 0 && m.axis[2] < 0) {
                m.axis[2] = (int8_t) k, H = ne, used++;
            } else if (pass == 1 && nb == n0 * n1 * H && ne == heads / H && m.axis[3] < 0) {
                m.axis[3] = (int8_t) k, used++;
            }
        }
    }
    if (used != axes) return NULL;                   /* an axis split, merged or strided otherwise */
    *map = m;
    return c;
}

/* The REPEAT_BACK that sums `x` (a SLICE of dK or dV^T: `heads` heads of n floats) over each group
 * of `group` consecutive heads, reached through views of x each read by the next alone:
 * REPEAT_BACK(a contiguous (n, group, K, B) view of x, into (n, 1, K, B)), K B = heads / group.
 * Else NULL. */
static inline struct ggml_tensor * th_group_sum(struct ggml_cgraph * graph, struct ggml_tensor * x, const int64_t n,
                                         const int64_t heads, const int64_t group) {
    struct ggml_tensor * v = x, * c = NULL;
    for (;;) {
        if (th_readers(graph, v, &c) != 1) return NULL;
        if (c->view_src != x || c->view_offs != 0) break;
        v = c;
    }
    if (c->op != GGML_OP_REPEAT_BACK || c->src[0] != v || !th_f32_contiguous(c) || !ggml_is_contiguous(v) ||
        (c->flags & GGML_TENSOR_FLAG_OUTPUT) || !th_f32_contiguous(x) || ggml_nelements(x) != n * heads ||
        v->ne[0] != n || v->ne[1] != group || c->ne[0] != n || c->ne[1] != 1 || c->ne[2] != v->ne[2] ||
        c->ne[3] != v->ne[3] || c->ne[2] * c->ne[3] * group != heads) {
        return NULL;
    }
    return c;
}

static inline th_attention_params th_attention_params_of(const struct ggml_tensor * t) {
    th_attention_params params;
    memcpy(&params, t->op_params + 2, sizeof(params));
    return params;
}

/* the node under `t`'s RESHAPE views when each of them, and it, is read by the one above alone
 * (`reader` reads t), and it has op `op`; else NULL */
static inline struct ggml_tensor * th_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                              struct ggml_tensor * t, enum ggml_op op) {
    struct ggml_tensor * only;
    while (t != NULL && th_readers(graph, t, &only) == 1 && only == reader) {
        if (t->op == op) return t;
        if (t->op != GGML_OP_RESHAPE) return NULL;
        reader = t;
        t = t->src[0];
    }
    return NULL;
}

/* th_under_reshapes for a node of ours: the one under `t`'s RESHAPEs marked `kernel`, else NULL */
static inline struct ggml_tensor * th_ours_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                                   struct ggml_tensor * t, int kernel) {
    struct ggml_tensor * u = th_under_reshapes(graph, reader, t, GGML_OP_CUSTOM);
    return u != NULL && th_marked(u, kernel) ? u : NULL;
}

static inline int th_is_same_shape_add(const struct ggml_tensor * u) {
    return (u->op == GGML_OP_ADD || th_marked(u, TH_CUDA_ADD)) && th_f32_contiguous(u) && u->src[0] != NULL &&
           u->src[1] != NULL && th_f32_contiguous(u->src[0]) && th_f32_contiguous(u->src[1]) &&
           ggml_nelements(u->src[0]) == ggml_nelements(u) && ggml_nelements(u->src[1]) == ggml_nelements(u);
}

/* MUL(t, g) of f32 rows t (n, rows) and a gain g (n): its g, else NULL */
static inline struct ggml_tensor * th_gain_of(const struct ggml_tensor * m, int64_t n) {
    const struct ggml_tensor * t = m->src[0];
    struct ggml_tensor * g = m->src[1];
    if (!th_f32_contiguous(m) || t == NULL || !th_f32_contiguous(t) || !ggml_are_same_shape(m, t) || m->ne[0] != n ||
        g == NULL || !th_f32_contiguous(g) || ggml_nelements(g) != n || g->ne[0] != n) {
        return NULL;
    }
    return g;
}

static inline float th_eps_of(const struct ggml_tensor * t, int at) {
    float eps;
    memcpy(&eps, t->op_params + at, sizeof(eps));
    return eps;
}

/* The norm node whose output an AFFINE node reads as t (src 0, through RESHAPE views): LAYER_NORM or
 * RMS_NORM of ours, or the room of an AFFINE that computes its norm (th_fuse_norm_affines) */
static inline struct ggml_tensor * th_norm_under_affine(const struct ggml_tensor * u) {
    return th_under_reshape_views(u->src[0]);
}

/* whether a node of `graph` other than `reader` reads t (custom_ops.h, th_reads_or_views) */
static inline int th_read_elsewhere(struct ggml_cgraph * graph, const struct ggml_tensor * t,
                             const struct ggml_tensor * reader) {
    for (int k = 0; k < ggml_graph_n_nodes(graph); k++) {
        const struct ggml_tensor * v = ggml_graph_node(graph, k);
        if (v != reader && th_reads_or_views(v, t)) return 1;
    }
    return 0;
}

/* ---- the passes, by file ---------------------------------------------------------------------- */

/* gelu.c */
int th_mark_gelu_pairs(struct ggml_cgraph * graph);

/* attention.c */
int th_rewrite_attention(struct ggml_cgraph * graph, const int group, const int dropout);

/* attention_group.c */
int th_attention_group(struct ggml_cgraph * graph, struct ggml_tensor * fwd);

/* attention_rooms.c */
int th_order_attention_copies(struct ggml_cgraph * graph);
int th_attention_rooms(struct ggml_cgraph * graph);
int th_check_group_rooms(struct ggml_cgraph * graph);

/* slice_conts.c */
int th_merge_slice_conts(struct ggml_cgraph * graph);

/* checks.c */
int th_check_folded(struct ggml_cgraph * graph);
int th_order_rooms(struct ggml_cgraph * graph, const int copies);
int th_check_unread_norms(struct ggml_cgraph * graph);

/* norm_residuals.c */
int th_rewrite_norm_residuals(struct ggml_cgraph * graph);

/* product_sums.c */
int th_rewrite_product_sums(struct ggml_cgraph * graph);

/* silu_back.c */
int th_rewrite_silu_back_muls(struct ggml_cgraph * graph);

/* singles.c */
int th_mark_singles(struct ggml_cgraph * graph);

/* linear_biases.c */
int th_rewrite_linear_biases(struct ggml_cgraph * graph);

/* norm_affines.c */
int th_rewrite_norm_affines(struct ggml_cgraph * graph);

/* layer_norms.c */
int th_rewrite_layer_norms(struct ggml_cgraph * graph);

/* gain_sums.c */
int th_fuse_gain_sums(struct ggml_cgraph * graph);

/* norm_fusion.c */
int th_fuse_norm_affines(struct ggml_cgraph * graph);

/* adamw_runs.c */
int th_rewrite_adamw_runs(struct ggml_cgraph * graph);
int th_check_adamw_runs(struct ggml_cgraph * graph);

#endif
