/* The cuda rewrite's pass: products added together (an input's gradient from several projections):
 * one node. */
#include "passes.h"

/* OUT_PROD(a, b) of 2-D f32 operands, as ggml-cuda computes it (one cuBLAS call), else NULL */
static struct ggml_tensor * th_plain_out_prod(struct ggml_tensor * t) {
    if (t == NULL || t->op != GGML_OP_OUT_PROD || !th_f32_contiguous(t) || (t->flags & GGML_TENSOR_FLAG_OUTPUT) ||
        t->ne[2] * t->ne[3] != 1) {
        return NULL;
    }
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    if (a == NULL || b == NULL || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || a->nb[0] != sizeof(float) ||
        a->ne[2] * a->ne[3] != 1 || b->ne[2] * b->ne[3] != 1 || a->ne[0] != t->ne[0] || b->ne[0] != t->ne[1] ||
        a->ne[1] != b->ne[1] || (ggml_is_transposed(b) ? b->nb[1] : b->nb[0]) != sizeof(float) ||
        t->ne[0] > INT32_MAX || t->ne[1] > INT32_MAX || a->ne[1] > INT32_MAX) {
        return NULL;
    }
    return t;
}

/* OUT_PROD(W, dy^T) of a frozen weight W (not f32: only at bf16 do cuda graphs hold one, see
 * Tensor.matmul_t) of a shape the frozen bf16 products take, not an output, else NULL. In a
 * PRODUCT_SUM, cuda/th-frozen.cu computes it with beta 1 (th-custom.cu's supported check asks for
 * bf16's stamp: a frozen product at another precision is refused, never computed otherwise). */
static struct ggml_tensor * th_frozen_out_prod(struct ggml_tensor * t) {
    return t != NULL && t->op == GGML_OP_OUT_PROD && t->src[0] != NULL && t->src[0]->type != GGML_TYPE_F32 &&
                   !(t->flags & GGML_TENSOR_FLAG_OUTPUT) && th_frozen_product_ok(t, 0)
               ? t
               : NULL;
}

/* Products added together, ADD(x, y) where each of x and y is an OUT_PROD (f32, or a frozen
 * weight's input gradient at bf16) or (one of them) a PRODUCT_SUM, through RESHAPEs read by the
 * next alone (the gradient of an input that several projections read: q, k and v, llama's gate
 * and up, a LoRA base's and its adapter's): one PRODUCT_SUM of at most 5 products, cuBLAS adding
 * each product into the sum so far (beta 1): the order and roundings of the ADDs.
 * Returns the nodes marked. */
int th_rewrite_product_sums(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * part[2], * pairs[10];
        if (!th_is_same_shape_add(u)) continue;
        int sums = 0, count = 0, order[2] = {0, 1};
        for (int j = 0; j < 2; j++) {
            struct ggml_tensor * product = th_under_reshapes(graph, u, u->src[j], GGML_OP_OUT_PROD);
            part[j] = th_plain_out_prod(product);
            if (part[j] == NULL) part[j] = th_frozen_out_prod(product);
            if (part[j] == NULL) {
                part[j] = th_ours_under_reshapes(graph, u, u->src[j], TH_CUDA_PRODUCT_SUM);
                sums += part[j] != NULL;
                if (part[j] != NULL && j == 1) order[0] = 1, order[1] = 0;    /* the sum so far first */
            }
        }
        if (part[0] == NULL || part[1] == NULL || sums > 1 || part[0]->ne[0] != u->ne[0] || part[1]->ne[0] != u->ne[0] ||
            ggml_nelements(part[0]) != ggml_nelements(u) || ggml_nelements(part[1]) != ggml_nelements(u)) {
            continue;
        }
        for (int j = 0; j < 2; j++) {
            struct ggml_tensor * x = part[order[j]];
            for (int k = 0; k < (th_marked(x, TH_CUDA_PRODUCT_SUM) ? GGML_MAX_SRC : 2) && x->src[k] != NULL; k++) {
                if (count < 10) pairs[count] = x->src[k];
                count++;
            }
        }
        if (count > 10) continue;
        th_mark(u, TH_CUDA_PRODUCT_SUM);
        memset(u->src, 0, sizeof(u->src));
        memcpy(u->src, pairs, sizeof(*pairs) * (size_t) count);
        th_fold(part[0], 1);
        th_fold(part[1], 1);
        marked += 3;
    }
    return marked;
}
