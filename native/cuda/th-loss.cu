// The cross-entropy loss both ways (custom_ops.h: CROSS_ENTROPY, CROSS_ENTROPY_BACK). ggml-cuda's
// kernels run a warp a row with the whole row in shared memory (128 KB for a 32000-token
// vocabulary): one CTA, one warp, an SM, latency-bound (2.6 ms forward, 3.2 ms backward of the
// LoRA bench's 1B step, 4096 rows). Ours keep their arithmetic, and so their bits: a warp a row,
// lane l taking the row's values l, l + 32, ... in order for the maximum and the sum of
// exponentials, ggml's warp reductions, the exponential computed again where ggml kept it. Eight
// rows a CTA and nothing in shared memory: many warps an SM, bound by memory bandwidth.
//   forward   each row's -sum((x - max - log sum) label) / rows, then the rows' values summed by
//             cub's DeviceReduce::Sum as ggml's sum_f32_cuda sums them (its temporary storage in
//             our scratch where ggml's is its pool)
//   backward  each value's (exp(x - max) / sum - label) d / rows
// And SOFT_MAX_BACK without a mask (a loss's pick of each row's target probability: DPO's and
// ORPO's token log-probabilities), with the bits of ggml's soft_max_back_f32 (see below).
#include "th-custom.cuh"
#include "th-precision.cuh"         // th_scratch_for
#include "common.cuh"               // warp_reduce_max, warp_reduce_sum, GGML_CUDA_USE_CUB: ggml's
#include "sumrows.cuh"              // sum_rows_f32_cuda: ggml's sum without cub

#ifdef GGML_CUDA_USE_CUB
#include <cub/cub.cuh>
#endif

extern "C" {
#include "custom_ops.h"
}

#define TH_LOSS_ROWS 8              // rows (warps) a CTA

// a row's maximum and sum of exp(x - max), every lane given both: lane l takes the values l,
// l + 32, ... in order, then ggml's warp reductions (both of ggml's kernels begin so)
static __device__ __forceinline__ void th_row_max_sum(const float * __restrict__ logits, const int nclasses,
                                                      const int lane, float & max_logit, float & sum) {
    max_logit = -INFINITY;
    for (int i = lane; i < nclasses; i += WARP_SIZE) max_logit = fmaxf(max_logit, logits[i]);
    max_logit = warp_reduce_max(max_logit);
    sum = 0.0f;
    for (int i = lane; i < nclasses; i += WARP_SIZE) sum += expf(logits[i] - max_logit);
    sum = warp_reduce_sum(sum);
}

// row `row`'s loss, -sum((x - max - log sum exp(x - max)) label) / nrows, into row_losses[row]
static __global__ void th_cross_entropy_kernel(const float * __restrict__ logits, const float * __restrict__ labels,
                                               float * __restrict__ row_losses, const int nclasses, const int nrows) {
    const int row = blockIdx.x * TH_LOSS_ROWS + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    logits += (int64_t) row * nclasses;
    labels += (int64_t) row * nclasses;
    float max_logit, sum;
    th_row_max_sum(logits, nclasses, lane, max_logit, sum);
    sum = logf(sum);

    float loss = 0.0f;
    for (int i = lane; i < nclasses; i += WARP_SIZE) loss += (logits[i] - max_logit - sum) * labels[i];
    loss = -warp_reduce_sum(loss) / (float) nrows;          // ggml: / (float) k, k its row count
    if (lane == 0) row_losses[row] = loss;
}

bool th_cross_entropy(cudaStream_t stream, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0], * labels = dst->src[1];
    const int nclasses = (int) logits->ne[0], nrows = (int) ggml_nrows(logits);
    const int64_t ne = nrows;                               // ggml's sum_f32_cuda takes an int64_t count
    size_t tmp_bytes = 0;
#ifdef GGML_CUDA_USE_CUB
    if (cub::DeviceReduce::Sum(nullptr, tmp_bytes, (const float *) nullptr, (float *) nullptr, ne, stream) !=
        cudaSuccess) {
        return false;
    }
#endif
    const size_t rows_bytes = ((size_t) nrows * sizeof(float) + 255) & ~(size_t) 255;
    char * scratch = (char *) th_scratch_for(rows_bytes + tmp_bytes);
    if (scratch == nullptr) return false;
    float * row_losses = (float *) scratch;
    const unsigned ctas = (unsigned) ((nrows + TH_LOSS_ROWS - 1) / TH_LOSS_ROWS);
    th_cross_entropy_kernel<<<ctas, TH_LOSS_ROWS * WARP_SIZE, 0, stream>>>(
        (const float *) logits->data, (const float *) labels->data, row_losses, nclasses, nrows);
#ifdef GGML_CUDA_USE_CUB
    return cub::DeviceReduce::Sum(scratch + rows_bytes, tmp_bytes, (const float *) row_losses, (float *) dst->data, ne,
                                  stream) == cudaSuccess;
#else
    sum_rows_f32_cuda(row_losses, (float *) dst->data, nrows, 1, stream);
    return cudaGetLastError() == cudaSuccess;
#endif
}

static __global__ void th_cross_entropy_back_kernel(const float * __restrict__ grad, const float * __restrict__ logits,
                                                    const float * __restrict__ labels, float * __restrict__ dst,
                                                    const int nclasses, const int nrows) {
    const int row = blockIdx.x * TH_LOSS_ROWS + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    logits += (int64_t) row * nclasses;
    labels += (int64_t) row * nclasses;
    dst += (int64_t) row * nclasses;
    float maxval, sum;
    th_row_max_sum(logits, nclasses, lane, maxval, sum);
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

// --- SOFT_MAX_BACK: dx = scale (dy - dot(y, dy)) y, a row ------------------------------------------
// ggml's soft_max_back_f32 gives a row one warp: lane l sums y[i] dy[i] over i = l, l + 32, ... in
// order (one fused multiply-add each), ggml's warp_reduce_sum gives every lane the dot, and the lane
// then writes its columns. Each step of a lane's sum waits on its two loads: 2.1 ms for 256 rows of a
// 128,256-token vocabulary on the H200. Here the same sums in the same order with TH_SMB_AHEAD
// columns' loads a lane in flight, the rows' dots into scratch; then a second kernel writes every
// element, (scale (dy - dot)) y as ggml's (dx may be dy's or y's memory: an element is read by the
// thread that writes it, after every dot is taken).
#define TH_SMB_AHEAD 16             // columns a lane loads before it adds them
#define TH_SMB_ROWS 2               // rows (warps) a CTA: a piece of 256 rows spans 128 CTAs

static __global__ void th_soft_max_back_dots_kernel(const float * __restrict__ dy, const float * __restrict__ y,
                                                    float * __restrict__ dots, const int ncols, const int64_t nrows) {
    const int64_t row = (int64_t) blockIdx.x * TH_SMB_ROWS + threadIdx.x / WARP_SIZE;
    if (row >= nrows) return;
    const int lane = threadIdx.x % WARP_SIZE;
    dy += row * ncols;
    y += row * ncols;
    float dot = 0.0f;
    int col = lane;
    for (; col + (TH_SMB_AHEAD - 1) * WARP_SIZE < ncols; col += TH_SMB_AHEAD * WARP_SIZE) {
        float a[TH_SMB_AHEAD], b[TH_SMB_AHEAD];
#pragma unroll
        for (int k = 0; k < TH_SMB_AHEAD; k++) {
            a[k] = y[col + k * WARP_SIZE];
            b[k] = dy[col + k * WARP_SIZE];
        }
#pragma unroll
        for (int k = 0; k < TH_SMB_AHEAD; k++) dot = __fmaf_rn(a[k], b[k], dot);     // ggml: dot += y dy
    }
    for (; col < ncols; col += WARP_SIZE) dot = __fmaf_rn(y[col], dy[col], dot);
    dot = warp_reduce_sum(dot);
    if (lane == 0) dots[row] = dot;
}

static __global__ void th_soft_max_back_rows_kernel(const float * dy, const float * y, const float * __restrict__ dots,
                                                    float * dx, const int ncols, const int64_t nrows,
                                                    const float scale) {
    for (int64_t row = blockIdx.y; row < nrows; row += gridDim.y) {
        const float dot = dots[row];
        const int64_t at = row * ncols;
        for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < ncols; col += gridDim.x * blockDim.x) {
            dx[at + col] = __fmul_rn(__fmul_rn(scale, __fsub_rn(dy[at + col], dot)), y[at + col]);
        }
    }
}

bool th_soft_max_back(cudaStream_t stream, ggml_tensor * dst) {
    const int ncols = (int) dst->ne[0];
    const int64_t nrows = ggml_nrows(dst);
    float * dots = (float *) th_scratch_for((size_t) nrows * sizeof(float));
    if (dots == nullptr) return false;
    const float scale = th_params_of<float>(dst);
    th_soft_max_back_dots_kernel<<<(unsigned) ((nrows + TH_SMB_ROWS - 1) / TH_SMB_ROWS), TH_SMB_ROWS * WARP_SIZE, 0,
                                   stream>>>((const float *) dst->src[0]->data, (const float *) dst->src[1]->data, dots,
                                             ncols, nrows);
    const int per_row = (ncols + 4 * 256 - 1) / (4 * 256);          // 4 columns a thread
    const dim3 grid((unsigned) per_row, (unsigned) (nrows < 65535 ? nrows : 65535));
    th_soft_max_back_rows_kernel<<<grid, 256, 0, stream>>>((const float *) dst->src[0]->data,
                                                           (const float *) dst->src[1]->data, dots, (float *) dst->data,
                                                           ncols, nrows, scale);
    return cudaGetLastError() == cudaSuccess;
}
