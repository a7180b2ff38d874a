/* The cuda rewrite's pass: LayerNorm's stand-ins: the RMS_NORM named TH_LAYER_NORM_NAME and its
 * backward. */
#include "passes.h"

/* LayerNorm's stand-ins: every RMS_NORM named TH_LAYER_NORM_NAME, and every RMS_NORM_BACK of one.
 * Returns the nodes marked, or -1 when a stand-in cannot be (it would compute RMSNorm), or when a
 * plain RMS_NORM of the same rows makes a backward ambiguous. */
int th_rewrite_layer_norms(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (t->op != GGML_OP_RMS_NORM || strcmp(t->name, TH_LAYER_NORM_NAME) != 0) continue;
        if (!th_f32_contiguous(t) || !th_f32_contiguous(t->src[0]) || !ggml_are_same_shape(t, t->src[0])) return -1;
        const float eps = th_eps_of(t, 0);
        th_mark(t, TH_CUDA_LAYER_NORM);
        th_set_params(t, &eps, sizeof(eps));
        marked++;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * b = ggml_graph_node(graph, i);
        if (b->op != GGML_OP_RMS_NORM_BACK) continue;
        const struct ggml_tensor * ours = NULL;
        int plain = 0;
        for (int j = 0; j < n; j++) {
            const struct ggml_tensor * f = ggml_graph_node(graph, j);
            if (f->src[0] != b->src[1]) continue;
            if (th_marked(f, TH_CUDA_LAYER_NORM) && th_eps_of(f, 2) == th_eps_of(b, 0)) ours = f;
            if ((f->op == GGML_OP_RMS_NORM && th_eps_of(f, 0) == th_eps_of(b, 0)) ||
                (th_marked(f, TH_CUDA_RMS_NORM) && th_eps_of(f, 2) == th_eps_of(b, 0))) {
                plain = 1;                           /* (marked by an earlier graph's rewrite) */
            }
        }
        if (ours == NULL) continue;                  /* a plain RMS_NORM's backward */
        if (plain || !th_f32_contiguous(b) || !th_f32_contiguous(b->src[0]) || !ggml_are_same_shape(b, b->src[1])) {
            return -1;
        }
        const float eps = th_eps_of(b, 0);
        th_mark(b, TH_CUDA_LAYER_NORM_BACK);
        th_set_params(b, &eps, sizeof(eps));
        marked++;
    }
    return marked;
}
