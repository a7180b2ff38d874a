/* GELU's stand-in pairs marked for our kernels, both forms: a SILU named "th.gelu_tanh" (blocks.gelu_tanh)
 * or "th.gelu_erf" (blocks.gelu_erf) and its SILU_BACK. The pairing is the cpu rewrite's
 * (th_rewrite_gelu_pairs, cpu_kernels.c), the marks ours: GELU and GELU_BACK for the tanh form,
 * GELU_ERF and GELU_ERF_BACK for the exact one. A stand-in that cannot be paired refuses the graph
 * (-1) rather than have it computed as silu. */
#include "passes.h"

static void th_gelu_forward(struct ggml_tensor * t) { th_mark(t, TH_CUDA_GELU); }
static void th_gelu_backward(struct ggml_tensor * b) { th_mark(b, TH_CUDA_GELU_BACK); }
static int th_is_gelu(const struct ggml_tensor * t) { return th_marked(t, TH_CUDA_GELU); }
static int th_is_gelu_back(const struct ggml_tensor * b) { return th_marked(b, TH_CUDA_GELU_BACK); }

static void th_gelu_erf_forward(struct ggml_tensor * t) { th_mark(t, TH_CUDA_GELU_ERF); }
static void th_gelu_erf_backward(struct ggml_tensor * b) { th_mark(b, TH_CUDA_GELU_ERF_BACK); }
static int th_is_gelu_erf(const struct ggml_tensor * t) { return th_marked(t, TH_CUDA_GELU_ERF); }
static int th_is_gelu_erf_back(const struct ggml_tensor * b) { return th_marked(b, TH_CUDA_GELU_ERF_BACK); }

int th_mark_gelu_pairs(struct ggml_cgraph * graph) {
    static const struct th_gelu_kernels tanh_form = {"th.gelu_tanh", th_gelu_forward, th_gelu_backward, th_is_gelu,
                                                     th_is_gelu_back};
    static const struct th_gelu_kernels erf_form = {"th.gelu_erf", th_gelu_erf_forward, th_gelu_erf_backward,
                                                    th_is_gelu_erf, th_is_gelu_erf_back};
    const int tanh_pairs = th_rewrite_gelu_pairs(graph, &tanh_form);
    if (tanh_pairs < 0) return -1;
    const int erf_pairs = th_rewrite_gelu_pairs(graph, &erf_form);
    return erf_pairs < 0 ? -1 : tanh_pairs + erf_pairs;
}
