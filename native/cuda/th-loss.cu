// The cross-entropy loss's backward (custom_ops.h: CROSS_ENTROPY_BACK). ggml-cuda's kernel runs a
// warp a row with the whole row in shared memory (128 KB for a 32000-token vocabulary): one CTA,
// one warp, an SM, latency-bound (3.2 ms of the LoRA bench's 1B step, 4096 rows). Ours keeps its
// arithmetic, and so its bits: a warp a row, lane l taking the row's values l, l + 32, ... in
// order for the maximum and the sum of exponentials, ggml's warp reductions, then each value's
// (exp(x - max) / sum - label) d / rows, the exponential computed again where ggml kept it. Eight
// rows a CTA and nothing in shared memory: many warps an SM, bound by memory bandwidth.
// tests/test_cuda_kernels.py compares it with ggml's node (TOYHARNESS_CUDA_CROSS_ENTROPY=ggml).
#include "th-custom.cuh"
#include "common.cuh"               // warp_reduce_max, warp_reduce_sum: ggml's

extern "C" {
#include "custom_ops.h"
}

#define TH_LOSS_ROWS 8              // rows (warps) a CTA

static __global__ void th_cross_entropy_back_kernel(const float * __restrict__ grad, const float * __restrict__ logits,
                                                    const float * __restrict__ labels, float * __restrict__ dst,
                                                    const int nclasses, const int nrows) {
    const int row = blockIdx.x * TH_LOSS_ROWS + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    logits += (int64_t) row * nclasses;
    labels += (int64_t) row * nclasses;
    dst += (int64_t) row * nclasses;

    float maxval = -INFINITY;
    for (int i = lane; i < nclasses; i += WARP_SIZE) maxval = fmaxf(maxval, logits[i]);
    maxval = warp_reduce_max(maxval);

    float sum = 0.0f;
    for (int i = lane; i < nclasses; i += WARP_SIZE) sum += expf(logits[i] - maxval);
    sum = warp_reduce_sum(sum);
    const float sm_scale = 1.0f / sum;

    const float d_by_nrows = *grad / (unsigned) nrows;      // ggml: *grad / gridDim.x, a CTA a row there
    for (int i = lane; i < nclasses; i += WARP_SIZE) {
        const float val = expf(logits[i] - maxval);
        dst[i] = (val * sm_scale - labels[i]) * d_by_nrows;
    }
}

void th_cross_entropy_back(cudaStream_t stream, ggml_tensor * dst) {
    const int nclasses = (int) dst->ne[0], nrows = (int) ggml_nrows(dst);
    const unsigned ctas = (unsigned) ((nrows + TH_LOSS_ROWS - 1) / TH_LOSS_ROWS);
    th_cross_entropy_back_kernel<<<ctas, TH_LOSS_ROWS * WARP_SIZE, 0, stream>>>(
        (const float *) dst->src[0]->data, (const float *) dst->src[1]->data, (const float *) dst->src[2]->data,
        (float *) dst->data, nclasses, nrows);
}
