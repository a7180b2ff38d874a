// A frozen weight's products at bf16 (issue 32: "frozen LoRA bases dequantize to bf16 for their
// products, no f32 copy of the base anywhere"). On cuda at bf16, Tensor.matmul_t keeps a frozen
// weight W (f16, bf16, quantized) in its type, and th_cuda_mark_precision hands its two products
// to these nodes (custom_ops.h):
//   FROZEN_MUL_MAT   y (N, M) = x W^T   the forward                 cuBLAS: y = op_T(W) x
//   FROZEN_OUT_PROD  dx (K, M) = dy W   the input gradient         cuBLAS: dx = W op(dy^T)
// W enters as its bf16 values (ggml-cuda's dequantizer to bf16, kept for the graph pass:
// th_frozen_gemm_bf16, th-precision.cu), the f32 operand as its bf16 copy, one cuBLAS GemmEx with
// fp32 accumulation and output: ggml's own product of a quantized W (mmq, mmvq) would quantize the
// activations to q8_1 instead, and the f32 path would dequantize W into an f32 node first.
#include "th-custom.cuh"
#include "th-precision.cuh"

extern "C" {
#include "custom_ops.h"
}

// the frozen products evaluated on the host so far (a replayed CUDA graph evaluates none): tests
static int64_t th_frozen_count = 0;
extern "C" __attribute__((visibility("default"))) int64_t th_cuda_frozen_products(void) { return th_frozen_count; }

bool th_frozen_supported(const ggml_tensor * op, const int kernel) {
    return th_precision_of(op) == TH_PRECISION_BF16 && th_frozen_type_ok(op->src[0]->type) &&
           th_frozen_product_ok(op, kernel == TH_CUDA_FROZEN_MUL_MAT);
}

// dst (K, M) = dy W + beta dst: FROZEN_OUT_PROD (beta 0) and a PRODUCT_SUM's frozen terms
// (th-custom.cu; beta 1 after the first: the running sum of an input's gradients)
bool th_frozen_out_prod_into(cublasHandle_t cublas, const ggml_tensor * w, const ggml_tensor * x, ggml_tensor * dst,
                             const float beta) {
    const int K = (int) w->ne[0], N = (int) w->ne[1];
    th_frozen_count++;
    // b = dy^T, ne [M, N]: rows of b (unit stride along M) are read as M x N and transposed;
    // a transposed view of dy (unit stride along N) is dy itself, N x M
    const int M = (int) x->ne[0];
    const bool rows = x->nb[0] == sizeof(float);
    const int b_rows = rows ? M : N, b_cols = rows ? N : M;
    const int ldb = (int) ((rows ? x->nb[1] : x->nb[0]) / sizeof(float));
    return th_frozen_gemm_bf16(cublas, w, CUBLAS_OP_N, rows ? CUBLAS_OP_T : CUBLAS_OP_N, K, M, N, x->data, false,
                               b_rows, b_cols, ldb, dst->data, CUDA_R_32F, K, beta) == CUBLAS_STATUS_SUCCESS;
}

bool th_frozen(cublasHandle_t cublas, ggml_tensor * dst, const int kernel) {
    const ggml_tensor * w = dst->src[0], * x = dst->src[1];
    const int K = (int) w->ne[0], N = (int) w->ne[1];
    if (kernel != TH_CUDA_FROZEN_MUL_MAT) return th_frozen_out_prod_into(cublas, w, x, dst, 0.0f);
    th_frozen_count++;
    const int M = (int) x->ne[1];
    // a SwiGLU's at bf16 (th_swiglu_bf16): bf16 x (down's, the GLU's output), bf16 y (gate's, up's)
    const bool x_bf16 = x->type == GGML_TYPE_BF16;
    return th_frozen_gemm_bf16(cublas, w, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, x->data, x_bf16, K, M,
                               (int) (x->nb[1] / ggml_type_size(x->type)), dst->data,
                               dst->type == GGML_TYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F, N, 0.0f) == CUBLAS_STATUS_SUCCESS;
}
