/* The cuda rewrite's pass: the nodes our kernels take one for one: GET_ROWS_BACK (a scatter where
 * its ids are distinct), CONT, ADD,
 * RMS_NORM, ROPE, a gain's MUL, the cross-entropy, SWIGLU, dropout's mask, SOFT_MAX_BACK. */
#include "passes.h"
#include "../dropout_mask.h"

/* A ROPE or ROPE_BACK our kernel computes: contiguous f32 rows, positions i32 one a row of
 * ne[2], modes normal or neox over the first n_dims (even) of each row, no YaRN extrapolation
 * (ext_factor, op_params[7], 0) and no offset (op_params[15]) */
static int th_rope_ours(const struct ggml_tensor * t) {
    const struct ggml_tensor * x = t->src[0], * pos = t->src[1], * ff = t->src[2];
    const int32_t * p = t->op_params;
    const int n_dims = p[1], mode = p[2];
    return th_f32_contiguous(t) && x != NULL && th_f32_contiguous(x) && ggml_are_same_shape(t, x) &&
           pos != NULL && pos->type == GGML_TYPE_I32 && ggml_is_contiguous(pos) && ggml_nelements(pos) == x->ne[2] &&
           (ff == NULL || (th_f32_contiguous(ff) && ggml_nelements(ff) >= n_dims / 2)) &&
           (mode == 0 || mode == GGML_ROPE_TYPE_NEOX) && p[7] == 0 && p[15] == 0 && n_dims > 0 && n_dims % 2 == 0 &&
           n_dims <= x->ne[0] && x->ne[0] % 2 == 0 && ggml_nelements(x) / 2 <= INT32_MAX;
}

/* CROSS_ENTROPY_LOSS_BACK our kernel computes: srcs grad (a scalar), logits and labels, f32
 * contiguous rows of one shape */
static int th_cross_entropy_back_ours(const struct ggml_tensor * t) {
    const struct ggml_tensor * grad = t->src[0], * logits = t->src[1], * labels = t->src[2];
    return th_f32_contiguous(t) && grad != NULL &&
           logits != NULL && labels != NULL && grad->type == GGML_TYPE_F32 && ggml_is_scalar(grad) &&
           th_f32_contiguous(logits) && th_f32_contiguous(labels) && ggml_are_same_shape(t, logits) &&
           ggml_are_same_shape(t, labels) && t->ne[0] <= INT32_MAX && ggml_nrows(t) <= INT32_MAX;
}

/* CROSS_ENTROPY_LOSS our kernel computes: srcs logits and labels, f32 contiguous rows of one shape,
 * a scalar f32 loss */
static int th_cross_entropy_ours(const struct ggml_tensor * t) {
    const struct ggml_tensor * logits = t->src[0], * labels = t->src[1];
    return t->type == GGML_TYPE_F32 && ggml_is_scalar(t) &&
           th_f32_contiguous(logits) && th_f32_contiguous(labels) && ggml_are_same_shape(logits, labels) &&
           logits->ne[0] <= INT32_MAX && ggml_nrows(logits) <= INT32_MAX;
}

/* GLU SWIGLU of split halves (ggml_swiglu_split: src 1 given) our kernel computes: gate, up and y
 * f32 contiguous, one shape. Marked
 * before th_cuda_mark_precision, which may make all three bf16 (th_swiglu_bf16). */
static int th_swiglu_ours(const struct ggml_tensor * t) {
    return t->op == GGML_OP_GLU &&
           ggml_get_glu_op(t) == GGML_GLU_OP_SWIGLU && th_f32_contiguous(t) && th_f32_contiguous(t->src[0]) &&
           th_f32_contiguous(t->src[1]) && ggml_are_same_shape(t, t->src[0]) && ggml_are_same_shape(t, t->src[1]);
}

/* A SOFT_MAX_BACK our kernel computes (th-loss.cu): no mask or ALiBi bias, dy, y and dx f32
 * contiguous rows of one shape (attention's, fused, are gone by now: a loss's pick is left) */
static int th_soft_max_back_ours(const struct ggml_tensor * t) {
    float max_bias;
    memcpy(&max_bias, (const float *) t->op_params + 1, sizeof(float));
    return t->op == GGML_OP_SOFT_MAX_BACK && t->src[2] == NULL && max_bias == 0.0f && th_f32_contiguous(t) &&
           th_f32_contiguous(t->src[0]) && th_f32_contiguous(t->src[1]) && ggml_are_same_shape(t, t->src[0]) &&
           ggml_are_same_shape(t, t->src[1]) && t->ne[0] < INT32_MAX / 2;
}

/* The nodes our kernels take one for one, each alone (no pass over its neighbours): how many were marked */
int th_mark_singles(struct ggml_cgraph * graph) {
    int singles = 0;        /* nodes marked one for one: GET_ROWS_BACK (or SCATTER_ROWS), CONT, ADD, RMS_NORM, ROPE, a gain's MUL,
                               the cross-entropy both ways, SWIGLU, SOFT_MAX_BACK */
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i), * gain;
        const struct ggml_tensor * src = t->src[0];
        const bool rows_back = t->op == GGML_OP_GET_ROWS_BACK && th_f32_contiguous(t) && th_f32_contiguous(src) &&
                               t->src[1] != NULL && t->src[1]->type == GGML_TYPE_I32 && ggml_is_contiguous(t->src[1]) &&
                               ggml_nrows(src) == src->ne[1] && t->ne[2] * t->ne[3] == 1 && src->ne[0] == t->ne[0] &&
                               ggml_nelements(t->src[1]) == src->ne[1];
        if (rows_back && th_ids_distinct(t->src[1])) {
            th_mark(t, TH_CUDA_SCATTER_ROWS);
            singles++;
        } else if (rows_back && (t->ne[1] + 7) / 8 < 65536) {
            th_mark(t, TH_CUDA_GET_ROWS_BACK);
            singles++;
        } else if (t->op == GGML_OP_CONT && t->type == GGML_TYPE_F32 && src->type == GGML_TYPE_F32 &&
                   ggml_is_contiguous(t) && ggml_are_same_shape(t, src) && !ggml_is_contiguous(src) &&
                   th_cont_axis(src) >= 0 && (src->ne[th_cont_axis(src)] + 31) / 32 < 65536) {
            th_mark(t, TH_CUDA_CONT);
            singles++;
        } else if (t->op == GGML_OP_ADD && th_f32_contiguous(t) && th_f32_contiguous(src) &&
                   th_f32_contiguous(t->src[1]) && ggml_are_same_shape(t, src) && ggml_are_same_shape(t, t->src[1])) {
            th_mark(t, TH_CUDA_ADD);
            singles++;
        } else if (t->op == GGML_OP_RMS_NORM && th_f32_contiguous(t) && th_f32_contiguous(src) &&
                   ggml_are_same_shape(t, src)) {
            const float eps = th_eps_of(t, 0);
            th_mark(t, TH_CUDA_RMS_NORM);
            th_set_params(t, &eps, sizeof(eps));
            singles++;
        } else if (th_soft_max_back_ours(t)) {
            float scale;
            memcpy(&scale, t->op_params, sizeof(float));
            th_mark(t, TH_CUDA_SOFT_MAX_BACK);
            th_set_params(t, &scale, sizeof(scale));
            singles++;
        } else if (t->op == GGML_OP_CROSS_ENTROPY_LOSS_BACK && th_cross_entropy_back_ours(t)) {
            th_mark(t, TH_CUDA_CROSS_ENTROPY_BACK);
            singles++;
        } else if (t->op == GGML_OP_CROSS_ENTROPY_LOSS && th_cross_entropy_ours(t)) {
            th_mark(t, TH_CUDA_CROSS_ENTROPY);
            singles++;
        } else if (th_swiglu_ours(t)) {
            th_mark(t, TH_CUDA_SWIGLU);
            singles++;
        } else if ((t->op == GGML_OP_ROPE || t->op == GGML_OP_ROPE_BACK) && th_rope_ours(t)) {
            const int32_t * p = t->op_params;
            th_rope_params params = {t->op == GGML_OP_ROPE, p[1], p[2], p[4]};
            memcpy(&params.freq_base, p + 5, 6 * sizeof(float));
            th_mark(t, TH_CUDA_ROPE);
            th_set_params(t, &params, sizeof(params));
            singles++;
        } else if (t->op == GGML_OP_MUL && ggml_nrows(t) > 1 && (gain = th_gain_of(t, t->ne[0])) != NULL) {
            th_mark(t, TH_CUDA_AFFINE);         /* a gain alone (RMSNorm's, or a gain's backward) */
            th_set_srcs(t, (struct ggml_tensor *) src, gain, NULL, NULL, NULL, NULL);
            singles++;
        } else if (th_is_dropout_mask(t)) {
            /* dropout's mask: the same stream on the device (cuda/th-custom.cu) */
            const th_dropout_params p = th_dropout_params_of(t, TH_DROPOUT_SLOT);
            th_mark(t, TH_CUDA_DROPOUT_MASK);
            th_dropout_params_set(t, TH_DROPOUT_CUDA_SLOT, p);
            singles++;
        }
    }
    return singles;
}
