/* The cuda rewrite's pass: a residual's gradient added to LayerNorm's input gradient: added by
 * LayerNorm's backward. */
#include "passes.h"

/* A residual's gradient added to a LayerNorm's input gradient, ADD(r, LAYER_NORM_BACK(...)) in
 * either order: LayerNorm's backward adds r as it writes (the same one rounding). Returns the
 * nodes marked. */
int th_rewrite_norm_residuals(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * b = NULL;
        if (!th_is_same_shape_add(u) || u->ne[0] != u->src[0]->ne[0] || u->ne[0] != u->src[1]->ne[0]) continue;
        int j = 0;
        for (; j < 2 && b == NULL; j++) b = th_ours_under_reshapes(graph, u, u->src[j], TH_CUDA_LAYER_NORM_BACK);
        if (b == NULL || b->src[3] != NULL || !th_f32_contiguous(b) || ggml_nelements(b) != ggml_nelements(u)) continue;
        struct ggml_tensor * r = u->src[2 - j];          /* the other operand (j is one past b's) */
        memcpy(u->op_params, b->op_params, sizeof(u->op_params));
        u->op = GGML_OP_CUSTOM;
        th_set_srcs(u, b->src[0], b->src[1], b->src[2], r, NULL, NULL);
        th_fold(b, 1);
        marked += 2;
    }
    return marked;
}
