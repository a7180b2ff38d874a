/* The precision of a cuda program's products (issue 32): stamps each node that computes a matrix
 * product (ggml's MUL_MAT and OUT_PROD, our LINEAR_BIAS and PRODUCT_SUM, and every other node of
 * ours, which ignores it) with the program's precision, read back by native/cuda/th-precision.cu
 * inside ggml-cuda (custom_ops.h: th_precision_of). Run after th_cuda_rewrite, which rewrites a
 * node's op_params when it marks it. */
#include <stddef.h>
#include <stdio.h>
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

/* A product of a frozen weight (src 0 of another type than f32: Tensor.matmul_t keeps a LoRA base
 * in its type on cuda at bf16) becomes ours (custom_ops.h: FROZEN_MUL_MAT, FROZEN_OUT_PROD), so
 * that ggml-cuda never multiplies it with quantized activations; 0 for any other node, -1 for one
 * of a shape our kernels do not take. */
static int th_mark_frozen(struct ggml_tensor * t) {
    if ((t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD) || t->src[0] == NULL || t->src[0]->type == GGML_TYPE_F32) {
        return 0;
    }
    const int mul_mat = t->op == GGML_OP_MUL_MAT;
    if (!th_frozen_product_ok(t, mul_mat)) return -1;
    const int32_t params[2] = {TH_CUDA_MAGIC, mul_mat ? TH_CUDA_FROZEN_MUL_MAT : TH_CUDA_FROZEN_OUT_PROD};
    t->op = GGML_OP_CUSTOM;
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, params, sizeof(params));
    return 1;
}

/* Stamps `precision` (TH_PRECISION_*) on the graph's product nodes; returns how many, -1 for a
 * precision it does not know, or -2 where bf16 meets a frozen weight's product of a shape the
 * frozen bf16 products do not take (its name in `why`). fp32 clears a stamp (a node keeps no other
 * precision's). At bf16, products of frozen weights become ours first (th_mark_frozen). */
TH_EXPORT int th_cuda_mark_precision(struct ggml_cgraph * graph, int precision, char * why, int why_size) {
    if (precision != TH_PRECISION_FP32 && precision != TH_PRECISION_TF32 && precision != TH_PRECISION_BF16) return -1;
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (precision == TH_PRECISION_BF16 && th_mark_frozen(t) < 0) {
            if (why != NULL && why_size > 0) {
                snprintf(why, (size_t) why_size, "%s %s of a frozen %s weight %s (ne %lld x %lld) and %s (ne %lld x %lld)",
                         ggml_op_desc(t), t->name, ggml_type_name(t->src[0]->type), t->src[0]->name,
                         (long long) t->src[0]->ne[0], (long long) t->src[0]->ne[1], t->src[1] ? t->src[1]->name : "?",
                         t->src[1] ? (long long) t->src[1]->ne[0] : 0LL, t->src[1] ? (long long) t->src[1]->ne[1] : 0LL);
            }
            return -2;
        }
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
