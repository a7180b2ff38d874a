/* toyharness cuda rewrite: hands graph nodes to our kernels inside ggml-cuda (cuda/th-custom.cu).
 *
 * ggml-cuda has no custom ops, so a cuda build patches one dispatch into ggml-cuda.cu
 * (native/build.py, stage_cuda_source): a GGML_OP_CUSTOM node whose op_params start with
 * TH_CUDA_MAGIC goes to th_cuda_custom. Nodes are marked here, on the host, after the Trainer
 * has built the backward (a custom op has none in ggml): the same stand-ins as the cpu rewrite.
 *   - GELU: the SILU named "th.gelu_tanh" and its SILU_BACK (blocks.gelu_tanh), one kernel each
 *     way instead of 5 nodes forward and 12 backward over the MLP's widest activation.
 *   - CONT of a permuted f32 tensor (attention's head permutes), an exact copy at memory speed.
 */
#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h"
#include "cpu_kernels.h"
#include "custom_ops.h"

#define TH_EXPORT __attribute__((visibility("default")))

static void th_mark(struct ggml_tensor * t, int kernel) {
    const int32_t params[2] = {TH_CUDA_MAGIC, kernel};
    t->op = GGML_OP_CUSTOM;
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, params, sizeof(params));
}

static int th_marked(const struct ggml_tensor * t, int kernel) {
    int32_t params[2];
    memcpy(params, t->op_params, sizeof(params));
    return t->op == GGML_OP_CUSTOM && params[0] == TH_CUDA_MAGIC && params[1] == kernel;
}

static void th_gelu_forward(struct ggml_tensor * t) { th_mark(t, TH_CUDA_GELU); }
static void th_gelu_backward(struct ggml_tensor * b) { th_mark(b, TH_CUDA_GELU_BACK); }
static int th_is_gelu(const struct ggml_tensor * t) { return th_marked(t, TH_CUDA_GELU); }
static int th_is_gelu_back(const struct ggml_tensor * b) { return th_marked(b, TH_CUDA_GELU_BACK); }

/* Returns how many nodes were marked, or -1 when a stand-in cannot be (the graph must then not
 * be computed: it would compute silu where GELU is meant). */
TH_EXPORT int th_cuda_rewrite(struct ggml_cgraph * graph) {
    static const struct th_gelu_kernels cuda = {th_gelu_forward, th_gelu_backward, th_is_gelu, th_is_gelu_back};
    const int gelu = th_rewrite_gelu_pairs(graph, &cuda);
    if (gelu < 0) return -1;
    int conts = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        const struct ggml_tensor * src = t->src[0];
        if (t->op == GGML_OP_CONT && t->type == GGML_TYPE_F32 && src->type == GGML_TYPE_F32 &&
            ggml_is_contiguous(t) && ggml_are_same_shape(t, src) && !ggml_is_contiguous(src) &&
            th_cont_axis(src) >= 0 &&
            (src->ne[th_cont_axis(src)] + 31) / 32 < 65536) {
            th_mark(t, TH_CUDA_CONT);
            conts++;
        }
    }
    return gelu + conts;
}

/* "gelu", "gelu_back" or "cont" for a node marked here (bench --profile), else NULL */
TH_EXPORT const char * th_cuda_kernel_name(const struct ggml_tensor * t) {
    return th_is_gelu(t) ? "gelu" : th_is_gelu_back(t) ? "gelu_back" : th_marked(t, TH_CUDA_CONT) ? "cont" : NULL;
}
