/* The cuda rewrite's pass: a norm, its gain (and bias) and the residual ADD it reads: one pass,
 * the AFFINE's. */
#include "passes.h"

/* whether `graph` holds a LAYER_NORM_BACK of the rows x that sums its gain's gradient
 * (th_fuse_gain_sums): LayerNorm's t of x then serves no gradient */
static int th_gain_summed_by_backward(struct ggml_cgraph * graph, struct ggml_tensor * x) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * b = ggml_graph_node(graph, i);
        if (th_marked(b, TH_CUDA_LAYER_NORM_BACK) && b->src[4] != NULL &&
            th_under_reshape_views(b->src[1]) == th_under_reshape_views(x)) {
            return 1;
        }
    }
    return 0;
}

/* A norm (LAYER_NORM or RMS_NORM of ours) whose output t an AFFINE reads (its gain, and bias),
 * every other reader of t after that AFFINE (the gain's gradient's COLUMN_DOT, in the backward):
 * the AFFINE computes the norm as well, writing t into the norm's node (a room, no sources) as it
 * writes y. Where the norm's input is a residual's ADD (ours: two tensors of one shape) read by no
 * node before the AFFINE, the AFFINE computes that sum too, into the ADD's node (a room), as it
 * reads it. One pass over the rows where the ADD, the norm and the AFFINE each read them again.
 * The sum is rounded as the ADD rounds it, t computed by the norm's own code and y by the
 * AFFINE's, so the bits do not change. op_params[2..]: th_norm_affine_params; src 3: the norm's
 * input; srcs 4 and 5: the ADD's, where it computes the sum. Returns the nodes marked. */
int th_fuse_norm_affines(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (!th_marked(u, TH_CUDA_AFFINE) || u->src[3] != NULL) continue;
        struct ggml_tensor * t = th_norm_under_affine(u), * x = t != NULL ? t->src[0] : NULL;
        const int norm = t == NULL ? 0 : th_marked(t, TH_CUDA_LAYER_NORM) ? TH_CUDA_LAYER_NORM
                                       : th_marked(t, TH_CUDA_RMS_NORM)   ? TH_CUDA_RMS_NORM
                                                                          : 0;
        if (norm == 0 || (t->flags & GGML_TENSOR_FLAG_OUTPUT) || !th_f32_contiguous(t) || x == NULL ||
            !th_f32_contiguous(x) || !ggml_are_same_shape(t, x) || ggml_nelements(t) != ggml_nelements(u) ||
            t->ne[0] != u->ne[0] || t->ne[0] > INT32_MAX || th_read_before(graph, t, i)) {
            continue;
        }
        /* t read by nothing else, in a graph that holds the backward (a graph built later reads
         * the same nodes: th_check_unread_norms refuses one that reads t) */
        const int unread = norm == TH_CUDA_LAYER_NORM && !th_read_elsewhere(graph, t, u) &&
                           th_gain_summed_by_backward(graph, x);
        th_norm_affine_params params = {th_eps_of(t, 2), norm, 0, unread};
        u->src[3] = x;
        th_mark(t, TH_CUDA_ROOM);
        th_set_srcs(t, NULL, NULL, NULL, NULL, NULL, NULL);
        marked++;
        struct ggml_tensor * a = th_under_reshape_views(x);
        if (th_marked(a, TH_CUDA_ADD) && !(a->flags & GGML_TENSOR_FLAG_OUTPUT) && th_f32_contiguous(a) &&
            ggml_nelements(a) == ggml_nelements(x) && !th_read_before(graph, a, i)) {
            params.add = 1;
            u->src[4] = a->src[0], u->src[5] = a->src[1];
            th_mark(a, TH_CUDA_ROOM);
            th_set_srcs(a, NULL, NULL, NULL, NULL, NULL, NULL);
            marked++;
        }
        th_set_params(u, &params, sizeof(params));
    }
    return marked;
}
