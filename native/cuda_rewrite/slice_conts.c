/* The cuda rewrite's pass: a CONT of a permuted SLICE of a fused attention node copies straight
 * out of that node. */
#include "passes.h"

/* A CONT of a permuted view of a SLICE (attention's O, dK and dV^T: copied out of the fused
 * kernels' nodes, then permuted back to the projections' layout): one copy, from the sliced node,
 * and the SLICE computes nothing. Only where the view's strides split into a head's (each below
 * the slice's floats a head) and the heads' (multiples of it). Returns the nodes marked. */
int th_merge_slice_conts(struct ggml_cgraph * graph) {
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i), * view = t->src[0], * x = view, * reader = t, * only;
        if (!th_marked(t, TH_CUDA_CONT) || view == NULL || view->view_src == NULL || view->view_offs != 0) continue;
        while (x->view_src != NULL && th_readers(graph, x, &only) == 1 && only == reader) {
            reader = x;
            x = x->src[0];
        }
        if (x != view->view_src || !th_marked(x, TH_CUDA_SLICE) || th_readers(graph, x, &only) != 1 || only != reader) {
            continue;
        }
        th_slice_params slice;
        memcpy(&slice, x->op_params + 2, sizeof(slice));
        const int64_t head = x->ne[0] * x->ne[1];          /* floats a head in the slice */
        th_slice_cont_params p = {{0, 0, 0, 0}, slice.offset};
        int64_t within = 0;
        for (int k = 0; k < GGML_MAX_DIMS; k++) {
            const int64_t stride = (int64_t) (view->nb[k] / sizeof(float));
            p.nb[k] = (int64_t) view->nb[k];
            if (view->ne[k] == 1) continue;
            if (stride % head == 0) {
                p.nb[k] = stride / head * slice.stride * (int64_t) sizeof(float);
            } else {
                within += (view->ne[k] - 1) * stride;
            }
        }
        if (within >= head) continue;
        th_mark(t, TH_CUDA_SLICE_CONT);
        th_set_params(t, &p, sizeof(p));
        th_set_srcs(t, x->src[0], NULL, NULL, NULL, NULL, NULL);
        th_fold(x, 1);
        marked += 2;
    }
    return marked;
}
