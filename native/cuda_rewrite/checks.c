/* The cuda rewrite's pass: the graph-wide checks after the passes (no folded node read, norms' t
 * written where read) and the rooms' order. */
#include "passes.h"

static int th_is_folded(const struct ggml_tensor * t) {
    return t != NULL && th_marked(t->view_src != NULL ? t->view_src : t, TH_CUDA_FOLDED);
}

/* 0, or -1 when a node folded into a later one (graphs share nodes: maybe by an earlier graph) is
 * read in `graph` by a node that is not a view of it (COLUMN_DOT's scratch aside, and LAYER_NORM_BACK's
 * when it took that over: th_fuse_gain_sums), or is an output: it holds no value. */
int th_check_folded(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * u = ggml_graph_node(graph, i);
        if ((u->flags & GGML_TENSOR_FLAG_OUTPUT) && th_is_folded(u)) return -1;
        if (u->view_src != NULL) continue;
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (th_is_folded(u->src[j]) && !(th_marked(u, TH_CUDA_COLUMN_DOT) && j == 2) &&
                !(th_marked(u, TH_CUDA_LAYER_NORM_BACK) && j == 5)) {
                return -1;
            }
        }
    }
    return 0;
}

/* A room comes before the node that writes it, in every graph (graphs share nodes, not their
 * order): it computes nothing and reads nothing, so it can move up to just before its writer.
 * Returns -1 when a graph holds a room but not its writer (it would read what nothing wrote),
 * unless `copies`: a graph of recomputed blocks alone (engine/recompute.py), which reads the
 * forward's block inputs, some of them rooms the forward's graph writes (a residual's sum that the
 * next block's first norm computes); the graphs built from it are checked again whole. */
int th_order_rooms(struct ggml_cgraph * graph, const int copies) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!th_marked(t, TH_CUDA_ROOM)) continue;
        int w = 0;
        for (; w < n; w++) {
            const struct ggml_tensor * u = ggml_graph_node(graph, w);
            if (th_marked(u, TH_CUDA_ATTN_BWD) && (u->src[6] == t || u->src[7] == t)) break;
            if (th_marked(u, TH_CUDA_SWIGLU_BACK) && u->src[3] == t) break;
            if (th_marked(u, TH_CUDA_LAYER_NORM_BACK) && (u->src[4] == t || u->src[6] == t)) break;
            if (th_marked(u, TH_CUDA_AFFINE) && u->src[3] != NULL &&
                (th_norm_under_affine(u) == t || (u->src[4] != NULL && th_under_reshape_views(u->src[3]) == t))) {
                break;
            }
        }
        if (w == n && copies) continue;
        if (w == n) return -1;
        if (w < i) {
            memmove(graph->nodes + w + 1, graph->nodes + w, sizeof(*graph->nodes) * (size_t) (i - w));
            graph->nodes[w] = t;
        }
        /* a norm's output or a sum (th_fuse_norm_affines), or a gain's gradient (th_fuse_gain_sums),
         * is read elsewhere, not only after its writer */
        const struct ggml_tensor * writer = ggml_graph_node(graph, w > i ? w : w + 1);
        if ((th_marked(writer, TH_CUDA_AFFINE) || th_marked(writer, TH_CUDA_LAYER_NORM_BACK)) &&
            th_read_before(graph, t, w > i ? w : w + 1)) {
            return -1;
        }
    }
    return 0;
}

/* -1 when a node other than its AFFINE reads a norm's t that the AFFINE leaves unwritten
 * (th_norm_affine_params.unread: decided in the graph that marked it), else 0 */
int th_check_unread_norms(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (!th_marked(u, TH_CUDA_AFFINE) || u->src[3] == NULL) continue;
        th_norm_affine_params params;
        memcpy(&params, u->op_params + 2, sizeof(params));
        if (params.unread && th_read_elsewhere(graph, th_norm_under_affine(u), u)) return -1;
    }
    return 0;
}
