/* GELU's stand-in pairs (a SILU named "th.gelu_tanh" and its SILU_BACK) marked for our kernels:
 * the pairing is the cpu rewrite's (th_rewrite_gelu_pairs, cpu_kernels.c), the marks ours. The erf
 * form's stand-in ("th.gelu_erf", blocks.gelu_erf) has no kernel here: blocks compose that form on
 * cuda, and a graph that holds its stand-in is refused (-1) rather than computed as silu. */
#include "passes.h"

static void th_gelu_forward(struct ggml_tensor * t) { th_mark(t, TH_CUDA_GELU); }
static void th_gelu_backward(struct ggml_tensor * b) { th_mark(b, TH_CUDA_GELU_BACK); }
static int th_is_gelu(const struct ggml_tensor * t) { return th_marked(t, TH_CUDA_GELU); }
static int th_is_gelu_back(const struct ggml_tensor * b) { return th_marked(b, TH_CUDA_GELU_BACK); }

int th_mark_gelu_pairs(struct ggml_cgraph * graph) {
    static const struct th_gelu_kernels cuda = {"th.gelu_tanh", th_gelu_forward, th_gelu_backward, th_is_gelu,
                                                th_is_gelu_back};
    if (th_has_gelu_erf_stand_in(graph)) return -1;
    return th_rewrite_gelu_pairs(graph, &cuda);
}
