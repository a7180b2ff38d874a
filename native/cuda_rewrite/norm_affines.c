/* The cuda rewrite's pass: a norm's gain and bias, ADD(MUL(t, g), b): one AFFINE node. */
#include "passes.h"

/* The affine part of norms: ADD(MUL(t, g), b) -> AFFINE; LAYER_NORM_BACK(MUL(dy, g), x) reads dy
 * and g; OUT_PROD(MUL(a, c), ones) -> COLUMN_DOT. Returns the nodes marked. */
int th_rewrite_norm_affines(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * m, * g;
        if (u->op == GGML_OP_ADD && th_f32_contiguous(u) && u->src[1] != NULL && th_f32_contiguous(u->src[1]) &&
            ggml_nelements(u->src[1]) == u->ne[0] && u->src[1]->ne[0] == u->ne[0] &&
            (m = th_under_reshapes(graph, u, u->src[0], GGML_OP_MUL)) != NULL && (g = th_gain_of(m, u->ne[0])) &&
            ggml_nelements(m) == ggml_nelements(u)) {
            th_mark(u, TH_CUDA_AFFINE);
            th_set_srcs(u, m->src[0], g, u->src[1], NULL, NULL, NULL);
            th_fold(m, 1);
            marked += 2;
        } else if (th_marked(u, TH_CUDA_LAYER_NORM_BACK) && u->src[2] == NULL &&
                   (m = th_under_reshapes(graph, u, u->src[0], GGML_OP_MUL)) != NULL && (g = th_gain_of(m, u->ne[0])) &&
                   ggml_nelements(m) == ggml_nelements(u)) {
            th_set_srcs(u, m->src[0], u->src[1], g, u->src[3], NULL, NULL);     /* keeps a residual */
            th_fold(m, 1);
            marked += 1;
        } else if (u->op == GGML_OP_OUT_PROD && th_f32_contiguous(u) && u->src[1] != NULL &&
                   th_is_ones(u->src[1]) &&
                   (m = th_under_reshapes(graph, u, u->src[0], GGML_OP_MUL)) != NULL && th_f32_contiguous(m) &&
                   m->ne[2] * m->ne[3] == 1 && ggml_nelements(u) == m->ne[0] && u->src[1]->ne[1] == m->ne[1] &&
                   th_f32_contiguous(m->src[0]) && th_f32_contiguous(m->src[1]) && ggml_are_same_shape(m, m->src[0]) &&
                   ggml_are_same_shape(m, m->src[1])) {
            th_mark(u, TH_CUDA_COLUMN_DOT);
            th_set_srcs(u, m->src[0], m->src[1], m, NULL, NULL, NULL);
            th_fold(m, 0);                /* its buffer is COLUMN_DOT's scratch */
            marked += 2;
        }
    }
    return marked;
}
