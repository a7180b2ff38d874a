// A frozen weight's bf16 values for the bf16 products (th-precision.cu, th_weight_kept): ggml-cuda's
// dequantizer to bf16 for every type but Q4_K, ours for Q4_K. ggml's runs a 32-thread CTA per
// 256-value block, each thread storing eight values two bytes at a time: about 1 TB/s on an H100
// (the LoRA bench's 1B Q4_K base, 2.6 ms a pass). Ours gives a warp a block, each thread one
// 16-byte store of eight adjacent values, eight blocks a CTA. Each value is ggml's expression
// (d1 * q - m1 in fp32, rounded to nearest even bf16), so the bits are ggml's:
// tests/test_precision.py compares the two on random blocks (th_cuda_dequantize_bf16).
#include "th-precision.cuh"
#include "dequantize.cuh"           // get_scale_min_k4, block_q4_K: ggml's

extern "C" {
#include "custom_ops.h"
}

#include <cuda_bf16.h>

#include <cstring>

#define TH_DEQUANT_WARPS 8          // blocks (warps) a CTA

// Block ib's 256 values: thread t writes values 8t .. 8t+7, which are the low (t % 8 < 4) or high
// nibbles of qs[32 il + 8 (t % 4) ..] with il = t / 8, scaled by sub-block t / 4's scale and min
// (ggml's dequantize_q4_K: value 64 il + l is qs[32 il + l]'s low nibble, 64 il + 32 + l its high).
static __global__ void th_dequant_q4_K_bf16_kernel(const block_q4_K * __restrict__ x, __nv_bfloat16 * __restrict__ y,
                                                   const int64_t blocks) {
    const int64_t ib = (int64_t) blockIdx.x * TH_DEQUANT_WARPS + threadIdx.x / 32;
    if (ib >= blocks) return;
    const int t = threadIdx.x % 32;
    const int il = t / 8, high = (t / 4) % 2, at = 8 * (t % 4);
    const block_q4_K * b = x + ib;
    const float dall = __low2half(b->dm);
    const float dmin = __high2half(b->dm);
    uint8_t sc, m;
    get_scale_min_k4(t / 4, b->scales, sc, m);
    const float d1 = dall * sc; const float m1 = dmin * m;
    const uint2 q = *(const uint2 *) (b->qs + 32 * il + at);
    uint32_t pairs[4];
#pragma unroll
    for (int l = 0; l < 8; l += 2) {
        const int b0 = ((l < 4 ? q.x : q.y) >> (8 * (l % 4))) & 0xFF, b1 = ((l < 4 ? q.x : q.y) >> (8 * (l % 4 + 1))) & 0xFF;
        const __nv_bfloat162 v = __floats2bfloat162_rn(d1 * (high ? b0 >> 4 : b0 & 0xF) - m1,
                                                       d1 * (high ? b1 >> 4 : b1 & 0xF) - m1);
        memcpy(&pairs[l / 2], &v, sizeof(v));
    }
    reinterpret_cast<uint4 *>(y)[32 * ib + t] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);   // values 256 ib + 8 t
}

static void th_dequantize_bf16_by(const ggml_type type, const void * src, __nv_bfloat16 * dst, const int64_t n,
                                  cudaStream_t stream, const bool ours) {
    if (ours && type == GGML_TYPE_Q4_K && n % QK_K == 0 && (uintptr_t) src % 8 == 0 && (uintptr_t) dst % 16 == 0) {
        const int64_t blocks = n / QK_K;
        const int64_t ctas = (blocks + TH_DEQUANT_WARPS - 1) / TH_DEQUANT_WARPS;
        th_dequant_q4_K_bf16_kernel<<<(unsigned) ctas, 32 * TH_DEQUANT_WARPS, 0, stream>>>((const block_q4_K *) src, dst,
                                                                                          blocks);
        return;
    }
    ggml_get_to_bf16_cuda(type)(src, dst, n, stream);
}

void th_dequantize_bf16(const ggml_type type, const void * src, __nv_bfloat16 * dst, const int64_t n,
                        cudaStream_t stream) {
    th_dequantize_bf16_by(type, src, dst, n, stream, true);
}

// tests: n values of `type` (host bytes) dequantized to bf16 (host, as uint16) by ours (ours 1) or
// ggml-cuda's; 0 on success, -1 for a type neither takes, -2 for a CUDA error
extern "C" __attribute__((visibility("default"))) int th_cuda_dequantize_bf16(const int type, const void * src,
                                                                             const int64_t n, uint16_t * dst,
                                                                             const int ours) {
    const ggml_type t = (ggml_type) type;
    if (t < 0 || t >= GGML_TYPE_COUNT || n <= 0 || n % ggml_blck_size(t) != 0 || t == GGML_TYPE_F32 ||
        ggml_get_to_bf16_cuda(t) == nullptr) {
        return -1;
    }
    const size_t in_bytes = ggml_row_size(t, n), out_bytes = (size_t) n * sizeof(uint16_t);
    void * d_src = nullptr, * d_dst = nullptr;
    bool ok = cudaMalloc(&d_src, in_bytes) == cudaSuccess && cudaMalloc(&d_dst, out_bytes) == cudaSuccess &&
              cudaMemcpy(d_src, src, in_bytes, cudaMemcpyHostToDevice) == cudaSuccess;
    if (ok) {
        th_dequantize_bf16_by(t, d_src, (__nv_bfloat16 *) d_dst, n, nullptr, ours != 0);
        ok = cudaGetLastError() == cudaSuccess && cudaMemcpy(dst, d_dst, out_bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
    }
    cudaFree(d_src);
    cudaFree(d_dst);
    return ok ? 0 : -2;
}
