// cuDNN's fused attention (SDPA), forward and its deterministic backward, for the bf16 attention
// nodes that custom_ops.h's th_attention_cudnn gives it; th-attention.cu calls these and converts
// between them and the nodes' fp32 layouts. Built where native/build.py found cuDNN's
// and its frontend's headers (TH_CUDNN_ATTENTION); the functions exist in every cuda build.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// One attention's shapes: B batches of H query heads and Hk kv heads (H a multiple of Hk: grouped
// query heads share one), T tokens, head size D; q (H heads), k and v (Hk heads) bf16 through their
// element strides (b, h, t, d); O, dO and dQ (H heads), dK and dV (Hk heads) bf16 and contiguous
// (b, h, t, d); the softmax statistics (logsumexp per row, fp32) through their float strides
// (b, h, t). inputs16: the plan keeps a buffer for q, k and v (th_sdpa_inputs), packed, which the
// caller fills and passes (where its q, k and v are f32, laid out unlike each other, or k and v
// are repeated for each query head).
struct th_sdpa_shape {
    int64_t B, H, Hk, T, D;
    int64_t q[4], k[4], v[4];
    int64_t stats[3];
    int causal;
    int inputs16;
    float scale;
    int refuse;         // as if cuDNN refused the plans (TOYHARNESS_CUDNN_ATTENTION=refuse: tests the fallback)
};

#ifdef TH_CUDNN_ATTENTION
#define TH_CUDNN_API extern "C" __attribute__((visibility("default")))

// Whether cuDNN takes an attention of shape `s`, forward or backward: its plan built (the first
// time, outside a CUDA graph's capture) or found; false with `why` where cuDNN refuses it (or
// cannot allocate its buffers, or s->refuse), said once on stderr and
// remembered, so that the attention's every node runs on our kernels alike.
TH_CUDNN_API bool th_sdpa_prepare(cudaStream_t stream, const th_sdpa_shape * s, bool backward, char * why,
                                  size_t why_size);

// The forward: the statistics into `stats`; O into a buffer of the plan's, whose address it
// returns (valid until the next forward of that shape on the stream), or nullptr with `why`.
TH_CUDNN_API const void * th_sdpa_forward(cudaStream_t stream, const th_sdpa_shape * s, const void * q,
                                          const void * k, const void * v, float * stats, char * why,
                                          size_t why_size);

// The plan's buffer for q, k and v (inputs16; bf16, packed: q, then k, then v), built with the
// plan at its first call; nullptr with `why`.
TH_CUDNN_API void * th_sdpa_inputs(cudaStream_t stream, const th_sdpa_shape * s, bool backward, char * why,
                                   size_t why_size);

// The backward, deterministic (cuDNN's dP-workspace algorithm: the same bits run to run);
// false with `why` where cuDNN cannot take it. Before cuDNN 9.26 the statistics it reads must be
// packed (stride H T, T, 1): th-attention.cu's prep node packs them.
TH_CUDNN_API bool th_sdpa_backward(cudaStream_t stream, const th_sdpa_shape * s, const void * q, const void * k,
                                   const void * v, const void * o, const void * dout, const float * stats, void * dq,
                                   void * dk, void * dv, char * why, size_t why_size);
#else
// a build without cuDNN: no attention is given to it (custom_ops.h, th_attention_cudnn)
static inline bool th_sdpa_prepare(cudaStream_t, const th_sdpa_shape *, bool, char *, size_t) { return false; }
static inline const void * th_sdpa_forward(cudaStream_t, const th_sdpa_shape *, const void *, const void *,
                                           const void *, float *, char *, size_t) {
    return nullptr;
}
static inline void * th_sdpa_inputs(cudaStream_t, const th_sdpa_shape *, bool, char *, size_t) { return nullptr; }
static inline bool th_sdpa_backward(cudaStream_t, const th_sdpa_shape *, const void *, const void *, const void *,
                                    const void *, const void *, const float *, void *, void *, void *, char *, size_t) {
    return false;
}
#endif
