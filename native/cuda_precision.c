/* The precision of a cuda program's products (issue 32): stamps each node that computes a matrix
 * product (ggml's MUL_MAT and OUT_PROD, our LINEAR_BIAS and PRODUCT_SUM, and every other node of
 * ours, which ignores it) with the program's precision, read back by native/cuda/th-precision.cu
 * inside ggml-cuda (custom_ops.h: th_precision_of). Run after th_cuda_rewrite, which rewrites a
 * node's op_params when it marks it. */
#include <stddef.h>
#include <string.h>

#include "ggml.h"
#include "custom_ops.h"

#define TH_EXPORT __attribute__((visibility("default")))

/* our nodes' parameters end before the stamp's slot */
_Static_assert(2 * sizeof(int32_t) + sizeof(th_slice_cont_params) <= TH_PRECISION_SLOT * sizeof(int32_t),
               "SLICE_CONT's parameters reach the precision stamp");
_Static_assert(2 * sizeof(int32_t) + sizeof(th_attention_params) + 3 * sizeof(th_attention_map) <=
                   TH_PRECISION_SLOT * sizeof(int32_t), "the attention's parameters reach the precision stamp");
_Static_assert(2 * sizeof(int32_t) + sizeof(th_adamw_link) <= TH_PRECISION_SLOT * sizeof(int32_t),
               "AdamW's link reaches the precision stamp");

/* Stamps `precision` (TH_PRECISION_*) on the graph's product nodes; returns how many, or -1 for a
 * precision it does not know. fp32 clears a stamp (a node keeps no other precision's). */
TH_EXPORT int th_cuda_mark_precision(struct ggml_cgraph * graph, int precision) {
    if (precision != TH_PRECISION_FP32 && precision != TH_PRECISION_TF32 && precision != TH_PRECISION_BF16) return -1;
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        int32_t magic;
        memcpy(&magic, t->op_params, sizeof(magic));
        if (t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_OUT_PROD ||
            (t->op == GGML_OP_CUSTOM && magic == TH_CUDA_MAGIC)) {
            th_precision_set(t, precision);
            marked++;
        }
    }
    return marked;
}

/* a node's stamp (tests) */
TH_EXPORT int th_cuda_precision_of(const struct ggml_tensor * t) { return th_precision_of(t); }
