/* The cuda rewrite's pass: LayerNorm's gain's gradient (a COLUMN_DOT of t and dy): summed by
 * LayerNorm's backward. */
#include "passes.h"

/* x, where `t` is LayerNorm's output of it: a LAYER_NORM node of ours, or the room of an AFFINE in
 * `graph` that computes that norm (th_fuse_norm_affines); its eps into *eps. Else NULL. */
static struct ggml_tensor * th_layer_norm_input(struct ggml_cgraph * graph, struct ggml_tensor * t, float * eps) {
    if (t == NULL) return NULL;
    if (th_marked(t, TH_CUDA_LAYER_NORM)) {
        *eps = th_eps_of(t, 2);
        return t->src[0];
    }
    if (!th_marked(t, TH_CUDA_ROOM)) return NULL;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * a = ggml_graph_node(graph, i);
        if (!th_marked(a, TH_CUDA_AFFINE) || a->src[3] == NULL || th_under_reshape_views(a->src[0]) != t) continue;
        th_norm_affine_params params;
        memcpy(&params, a->op_params + 2, sizeof(params));
        if (params.norm != TH_CUDA_LAYER_NORM) return NULL;
        *eps = params.eps;
        return a->src[3];
    }
    return NULL;
}

/* LayerNorm's gain's gradient, COLUMN_DOT(t, dy) (either order) of the norm's output t and the
 * gradient dy that its backward reads (LAYER_NORM_BACK with the gain, src 2): that backward holds
 * t (formed again from x, as the forward formed it) and dy already, and sums t dy as well, in the
 * COLUMN_DOT's order (a block a chunk of rows, its 8 warps' partial sums added in order, then the
 * chunks in order: the same bits), into the COLUMN_DOT's node (a room: src 4) through its scratch
 * (src 5). A pass over t and dy fewer a norm. Only for rows of at most TH_GAIN_SUMS_MAX_COLUMNS
 * floats, and where no node between the COLUMN_DOT and the backward reads the gradient (the room
 * then stands before its writer with every reader after it). Returns the nodes marked. */
int th_fuse_gain_sums(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (!th_marked(u, TH_CUDA_COLUMN_DOT) || u->src[0] == NULL || u->src[1] == NULL) continue;
        for (int j = i + 1; j < n; j++) {
            struct ggml_tensor * b = ggml_graph_node(graph, j);
            if (!th_marked(b, TH_CUDA_LAYER_NORM_BACK) || b->src[2] == NULL || b->src[4] != NULL) continue;
            const int dy_at = u->src[0] == b->src[0] ? 0 : u->src[1] == b->src[0] ? 1 : -1;
            if (dy_at < 0) continue;
            float eps = 0.0f;
            const struct ggml_tensor * x = th_layer_norm_input(graph, th_under_reshape_views(u->src[1 - dy_at]), &eps);
            if (x != NULL && th_under_reshape_views((struct ggml_tensor *) x) == th_under_reshape_views(b->src[1]) &&
                eps == th_eps_of(b, 2) && b->ne[0] <= TH_GAIN_SUMS_MAX_COLUMNS && u->src[0]->ne[0] == b->ne[0] &&
                ggml_nelements(u->src[0]) == ggml_nelements(b) && ggml_nelements(u) == b->ne[0] &&
                !th_read_before(graph, u, j)) {
                b->src[4] = u, b->src[5] = u->src[2];
                th_mark(u, TH_CUDA_ROOM);
                th_set_srcs(u, NULL, NULL, NULL, NULL, NULL, NULL);
                marked++;
            }
            break;
        }
    }
    return marked;
}
