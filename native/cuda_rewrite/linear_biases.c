/* The cuda rewrite's pass: a bias added to a product's rows: cuBLASLt's product with the bias in
 * its epilogue. */
#include "passes.h"

/* ADD(y, b) of a bias b (n) over the rows of y = MUL_MAT(w, x) (n, m), y reached through
 * RESHAPE views only, each node of the way read by the next alone: LINEAR_BIAS and FOLDED.
 * Returns the nodes marked. */
int th_rewrite_linear_biases(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * a = ggml_graph_node(graph, i), * b = a->src[1], * y;
        if (a->op != GGML_OP_ADD || !th_f32_contiguous(a) || b == NULL || !th_f32_contiguous(b) ||
            ggml_nelements(b) != b->ne[0] || b->ne[0] != a->ne[0] ||
            (y = th_under_reshapes(graph, a, a->src[0], GGML_OP_MUL_MAT)) == NULL) {
            continue;
        }
        struct ggml_tensor * w = y->src[0], * x = y->src[1];
        if (!th_f32_contiguous(y) || !th_f32_contiguous(w) || !th_f32_contiguous(x) || y->ne[2] * y->ne[3] != 1 ||
            w->ne[2] * w->ne[3] != 1 || x->ne[2] * x->ne[3] != 1 || y->ne[0] != a->ne[0] ||
            ggml_nelements(y) != ggml_nelements(a) || y->ne[1] > INT32_MAX || w->ne[0] > INT32_MAX) {
            continue;
        }
        th_mark(a, TH_CUDA_LINEAR_BIAS);
        th_set_srcs(a, w, x, b, NULL, NULL, NULL);
        th_fold(y, 1);
        marked += 2;
    }
    return marked;
}
