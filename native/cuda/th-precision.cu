// The precision of a node's matrix products (see th-precision.cuh): ggml-cuda's f32 cuBLAS calls
// (ggml-cuda.cu's MUL_MAT, out-prod.cu's OUT_PROD) and ours (th-custom.cu) come here. The
// precision is the node's stamp (custom_ops.h, th_precision_of), made current by
// th_cuda_precision_before as the node starts; ggml computes a graph's nodes one at a time on
// one host thread.
#include "th-precision.cuh"
#include "convert.cuh"              // ggml_get_to_bf16_cuda: ggml-cuda's dequantizers, bf16 out

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

extern "C" {
#include "custom_ops.h"
}

static int th_precision_current = TH_PRECISION_FP32;

int th_cuda_precision_now(void) { return th_precision_current; }

static void th_reuse_before(const ggml_tensor * node);

void th_cuda_precision_before(cublasHandle_t cublas, const ggml_tensor * node) {
    th_precision_current = th_precision_of(node);
    th_reuse_before(node);           // the bf16 copies the nodes since the last one overwrote, dropped
    // ggml creates its handle in TF32 mode: fp32 and bf16 (whose products go through GemmEx with
    // their own compute type) turn it off. A host-side setting of the handle, no launch.
    cublasSetMathMode(cublas, th_precision_current == TH_PRECISION_TF32 ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                        : CUBLAS_DEFAULT_MATH);
}

// whether a product is an f32 one (all operands CUDA_R_32F, fp32 compute), which a precision changes
static bool th_f32_product(const cudaDataType at, const cudaDataType bt, const cudaDataType ct,
                           const cublasComputeType_t compute) {
    return at == CUDA_R_32F && bt == CUDA_R_32F && ct == CUDA_R_32F && compute == CUBLAS_COMPUTE_32F;
}

// --- bf16: the operands as bf16 copies --------------------------------------------------------
// CUBLAS_COMPUTE_32F_FAST_16BF only allows cuBLAS to round fp32 operands to bf16: on the H100 it
// chose TF32 kernels for it (the same bits as tf32). So a bf16 product converts its operands to
// bf16 (round to nearest even) into scratch memory and multiplies those (CUDA_R_16BF in, fp32
// accumulation and output). The scratch is one buffer a device, reused product after product on
// the stream; a product that needs more gets a larger one, and the old stays allocated: a CUDA
// graph captured before may still use it.
struct th_scratch {
    int device;
    void * ptr;
    size_t bytes;
};
static std::mutex th_scratch_mutex;
static std::vector<th_scratch> th_scratches;        // the newest of a device last

void * th_scratch_for(const size_t bytes) {
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(th_scratch_mutex);
    for (auto it = th_scratches.rbegin(); it != th_scratches.rend(); ++it) {
        if (it->device == device) {
            if (it->bytes >= bytes) return it->ptr;
            break;
        }
    }
    void * ptr = nullptr;
    const size_t rounded = (bytes + (1 << 20) - 1) & ~(size_t) ((1 << 20) - 1);
    if (cudaMalloc(&ptr, rounded) != cudaSuccess) return nullptr;
    th_scratches.push_back({device, ptr, rounded});
    return ptr;
}

// rows x cols of a column-major fp32 matrix (leading dimension ld), `count` of them, each at
// src + b * stride (or at srcs[b] when srcs is given), into packed bf16 (leading dimension rows).
// Each element rounds to nearest even on its own: how the work is cut does not change a bit.
// The general path: a thread an element, a block row of columns.
static __global__ void th_to_bf16_kernel(const float * __restrict__ src, const float * const * __restrict__ srcs,
                                         const long long stride, const int rows, const int cols, const int ld,
                                         __nv_bfloat16 * __restrict__ dst) {
    const int b = blockIdx.z;
    const float * m = srcs != nullptr ? srcs[b] : src + b * stride;
    __nv_bfloat16 * out = dst + (size_t) b * rows * cols;
    for (int c = blockIdx.y; c < cols; c += gridDim.y) {
        for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
            out[(size_t) c * rows + r] = __float2bfloat16_rn(m[(size_t) c * ld + r]);
        }
    }
}

// The common path: packed matrices (ld == rows, stride == rows * cols or pointer arrays), n floats
// each a multiple of 4 and 16-byte aligned: 8 floats a thread (two float4 loads, one 16-byte
// store), a grid-stride loop over the whole. Before (a thread an element, 2-byte stores): 17.7 ms of
// a bf16 gpt2-small step on the H100 in 632 launches (tools/cuda_kernels.py).
static __global__ void th_to_bf16_packed_kernel(const float * __restrict__ src, const float * const * __restrict__ srcs,
                                                const long long n, __nv_bfloat16 * __restrict__ dst) {
    const int b = blockIdx.y;
    const float * m = srcs != nullptr ? srcs[b] : src + b * n;
    __nv_bfloat16 * out = dst + b * n;
    const long long n8 = n / 8;
    for (long long i = blockIdx.x * (long long) blockDim.x + threadIdx.x; i < n8; i += (long long) gridDim.x * blockDim.x) {
        const float4 x = ((const float4 *) m)[2 * i], y = ((const float4 *) m)[2 * i + 1];
        __nv_bfloat162 h[4] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w),
                               __floats2bfloat162_rn(y.x, y.y), __floats2bfloat162_rn(y.z, y.w)};
        ((uint4 *) out)[i] = *(const uint4 *) h;
    }
    if (blockIdx.x == 0) {                                  // the last n % 8 (a float4 or none)
        for (long long i = 8 * n8 + threadIdx.x; i < n; i += blockDim.x) out[i] = __float2bfloat16_rn(m[i]);
    }
}

// Strided columns (ld > rows), rows a multiple of 8 and ld of 4, 16-byte aligned: 8 rows of a column
// a thread, as the packed kernel does.
static __global__ void th_to_bf16_cols8_kernel(const float * __restrict__ src, const long long stride, const int rows,
                                               const int cols, const int ld, __nv_bfloat16 * __restrict__ dst) {
    const int b = blockIdx.y;
    const float * m = src + b * stride;
    __nv_bfloat16 * out = dst + (size_t) b * rows * cols;
    const int per_col = rows / 8;
    const long long n8 = (long long) per_col * cols;
    for (long long i = blockIdx.x * (long long) blockDim.x + threadIdx.x; i < n8; i += (long long) gridDim.x * blockDim.x) {
        const long long c = i / per_col, r = 8 * (i % per_col);
        const float4 x = *(const float4 *) (m + c * ld + r), y = *(const float4 *) (m + c * ld + r + 4);
        __nv_bfloat162 h[4] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w),
                               __floats2bfloat162_rn(y.x, y.y), __floats2bfloat162_rn(y.z, y.w)};
        *(uint4 *) (out + c * rows + r) = *(const uint4 *) h;
    }
}

static __global__ void th_pointers_kernel(const __nv_bfloat16 * base, const size_t stride, const int count,
                                          const void ** out) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < count) out[b] = base + b * stride;
}

static int th_sm_count(void) {
    static int sms[64] = {0};
    int device = 0;
    cudaGetDevice(&device);
    if (device >= 64) return 132;
    if (sms[device] == 0) {
        int n = 0;
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
        sms[device] = n > 0 ? n : 132;
    }
    return sms[device];
}

static void th_to_bf16(cudaStream_t stream, const float * src, const float * const * srcs, const long long stride,
                       const int rows, const int cols, const int ld, const int count, __nv_bfloat16 * dst) {
    const long long n = (long long) rows * cols;
    // pointer arrays: each pointer's alignment is unknown on the host, so they take the general path
    const bool packed = srcs == nullptr && ld == rows && n % 4 == 0 &&
                        (count == 1 || (stride == n && n % 8 == 0 && count <= 65535)) &&
                        (uintptr_t) src % 16 == 0 && (uintptr_t) dst % 16 == 0;
    if (packed) {
        const long long want = (n / 8 + 255) / 256;
        const int blocks = (int) std::max(1LL, std::min(want, (long long) th_sm_count() * 8));
        th_to_bf16_packed_kernel<<<dim3((unsigned) blocks, (unsigned) count), 256, 0, stream>>>(src, nullptr, n, dst);
        return;
    }
    const bool cols8 = srcs == nullptr && rows % 8 == 0 && ld % 4 == 0 && (count == 1 || stride % 4 == 0) &&
                       (uintptr_t) src % 16 == 0 && (uintptr_t) dst % 16 == 0 && count <= 65535;
    if (cols8) {
        const long long want = (n / 8 + 255) / 256;
        const int blocks = (int) std::max(1LL, std::min(want, (long long) th_sm_count() * 8));
        th_to_bf16_cols8_kernel<<<dim3((unsigned) blocks, (unsigned) count), 256, 0, stream>>>(src, stride, rows, cols,
                                                                                               ld, dst);
        return;
    }
    const dim3 grid((unsigned) std::min((rows + 255) / 256, 64), (unsigned) std::min(cols, 65535), (unsigned) count);
    th_to_bf16_kernel<<<grid, 256, 0, stream>>>(src, srcs, stride, rows, cols, ld, dst);
}

// --- bf16: each distinct operand converted once per graph compute ------------------------------
// A layer's input is read by several products (its q, k, v products forward, their weight
// gradients backward) and a weight by two (forward, the input's gradient): each converted its
// operands again. Now a product's operand that is memory of one of its node's sources gets a
// kept bf16 copy ("copy"), looked up by (device, stream, pointer, rows, cols, ld, count, stride),
// which later products of the same graph compute reuse while the source's bytes are not written.
//
// Validity. ggml-cuda computes a graph's nodes in order on one stream (the caller of
// th_cuda_graph_begin says which graph). Before each node that may call cuBLAS, every node from
// the previous such node (again: its own writes happen after its products read) up to this one
// has its writes applied: each copy whose source bytes overlap what the node writes is dropped
// (and its memory freed for later copies; the stream orders the earlier reads before any reuse).
// A node writes its own bytes [data, data + ggml_nbytes); ours that write their sources too say
// so below (th_writes); ggml's optimizer steps, our AdamW run, and any node not known here drop
// every copy. Memory the source tensors do not hold (ggml's pool: a non-contiguous operand made
// contiguous) is never kept. Nodes fused by ggml-cuda or skipped are covered by the range. The
// copies start empty at each graph compute: between computes the host may write anything.
//
// CUDA graphs. What a compute converts and where is decided as its nodes are evaluated (directly
// or while ggml captures them); a replay launches the same conversions into the same memory
// from the same sources, which ggml replays only when no node's data, shape or op changed. The
// memory (chunks) is never freed: a captured graph may still use it.
//
// Bits. A copy is what the conversion writes into scratch (each element rounded to nearest even
// on its own), at the same 256-byte alignment as the scratch's copies: cuBLAS sees the same
// operands and picks the same algorithm.
//
// A horizon (th_cuda_bf16_keep_nodes; 0 none; Program.bf16_horizon sets 256 nodes with
// recompute_blocks or a frozen weight kept in its type): a copy also goes once the pass is past
// the last node, among the horizon's next nodes after a product used it, that reads its source's
// bytes; the next product to need it converts it again. With recompute_blocks a frozen weight's copy
// made by the forward would otherwise live to its block's backward (the whole base's bf16 values
// through the pass: 2 GiB of the LoRA bench's chunks), where the recomputed forward converts it
// again anyway. The same conversion into memory of the same alignment: the bits do not change (a
// reader not seen here only costs a conversion). Without recompute, a LoRA base's copies go after
// the forward's product and its backward converts them again (the LoRA bench: +2.1 ms, 2.3 GiB less).
struct th_copy {
    int device;
    cudaStream_t stream;
    const float * src;                  // (a frozen weight's data when type is not f32)
    int type;                           // the source's ggml type: f32, or a frozen weight's
    int rows, cols, ld, count;
    long long stride;
    uintptr_t lo, hi;                   // the source's bytes
    int chunk;
    size_t off, bytes;                  // the copy's place
    int until;                          // the node after which it goes (INT_MAX: no horizon)
    const ggml_tensor * writer;         // the node that wrote it beside its source (th_copy_for_writer), or none
};
struct th_chunk {
    int device;
    char * ptr;
    size_t bytes;
    std::vector<std::pair<size_t, size_t>> free;   // (offset, bytes), by offset, neighbours merged
};
static std::vector<th_chunk> th_chunks;             // never freed
static std::vector<th_copy> th_copies;
static const ggml_cgraph * th_graph = nullptr;      // the graph being computed, or none
static int th_graph_device = -1;
static int th_prev_node = -1;                       // index of the last node that may call cuBLAS
static const ggml_tensor * th_node = nullptr;       // the node computing now (when in th_graph)
static bool th_reuse = false;
// A writer writing its copy alone (th_copy_for_writer), this pass: its bytes and the later nodes
// reading them that have not computed yet
struct th_alone {
    const ggml_tensor * writer;
    uintptr_t lo, hi;
    std::vector<const ggml_tensor *> readers;
};
static std::vector<th_alone> th_alones;
static int64_t th_alone_count = 0;
static int64_t th_copy_counts[2];                   // operands converted (kept or not), reused
static int th_keep_nodes = 0;                       // the horizon in nodes (0: none)
static int64_t th_copies_held = 0, th_copies_peak = 0;  // bytes of chunks copies take now, at most

extern "C" __attribute__((visibility("default"))) void th_cuda_bf16_keep_nodes(int nodes) {
    th_keep_nodes = nodes > 0 ? nodes : 0;
}

extern "C" __attribute__((visibility("default"))) void th_cuda_bf16_copies(int64_t * converted, int64_t * reused) {
    *converted = th_copy_counts[0], *reused = th_copy_counts[1];
}

// the device memory the kept copies hold (all devices' chunks; never given back)
extern "C" __attribute__((visibility("default"))) int64_t th_cuda_bf16_copy_bytes(void) {
    int64_t total = 0;
    for (const th_chunk & c : th_chunks) total += (int64_t) c.bytes;
    return total;
}

// the device memory the products' scratch holds (all devices; never given back)
extern "C" __attribute__((visibility("default"))) int64_t th_cuda_bf16_scratch_bytes(void) {
    std::lock_guard<std::mutex> lock(th_scratch_mutex);
    int64_t total = 0;
    for (const th_scratch & s : th_scratches) total += (int64_t) s.bytes;
    return total;
}

// the most bytes of chunks the kept copies took at once (what the chunks need)
extern "C" __attribute__((visibility("default"))) int64_t th_cuda_bf16_copy_peak_bytes(void) { return th_copies_peak; }

// how many writers wrote their bf16 copy alone, not their f32 values (th_copy_for_writer; this process)
extern "C" __attribute__((visibility("default"))) int64_t th_cuda_bf16_copies_alone(void) { return th_alone_count; }

static void th_chunk_free(th_chunk & c, size_t off, size_t bytes) {
    th_copies_held -= (int64_t) bytes;
    auto it = std::lower_bound(c.free.begin(), c.free.end(), std::make_pair(off, (size_t) 0));
    it = c.free.insert(it, {off, bytes});
    if (it + 1 != c.free.end() && it->first + it->second == (it + 1)->first) {      // merge the next
        it->second += (it + 1)->second;
        c.free.erase(it + 1);
    }
    if (it != c.free.begin() && (it - 1)->first + (it - 1)->second == it->first) {   // into the previous
        (it - 1)->second += it->second;
        c.free.erase(it);
    }
}

// `bytes` (a multiple of 256) of this device's chunks, first fit; a new chunk when none has room
static bool th_chunk_alloc(const int device, const size_t bytes, int * chunk, size_t * off) {
    size_t total = 0;
    for (size_t i = 0; i < th_chunks.size(); i++) {
        th_chunk & c = th_chunks[i];
        if (c.device != device) continue;
        total += c.bytes;
        for (size_t f = 0; f < c.free.size(); f++) {
            if (c.free[f].second < bytes) continue;
            *chunk = (int) i, *off = c.free[f].first;
            c.free[f].first += bytes, c.free[f].second -= bytes;
            if (c.free[f].second == 0) c.free.erase(c.free.begin() + f);
            th_copies_held += (int64_t) bytes, th_copies_peak = std::max(th_copies_peak, th_copies_held);
            return true;
        }
    }
    // a quarter of what the device holds (at least 64 MiB): the last chunk, grown into by the
    // pass's peak, holds at most a fifth of the total empty (doubling left up to half: the LoRA
    // bench's 1B base held 4.00 GiB of chunks)
    size_t want = std::max({bytes, total / 4, (size_t) 64 << 20});
    want = (want + (1 << 20) - 1) & ~(size_t) ((1 << 20) - 1);
    void * ptr = nullptr;
    if (cudaMalloc(&ptr, want) != cudaSuccess) {
        cudaGetLastError();            // out of memory: this operand goes through the scratch
        return false;
    }
    th_chunks.push_back({device, (char *) ptr, want, {}});
    if (want > bytes) th_chunks.back().free.push_back({bytes, want - bytes});
    *chunk = (int) th_chunks.size() - 1, *off = 0;
    th_copies_held += (int64_t) bytes, th_copies_peak = std::max(th_copies_peak, th_copies_held);
    return true;
}

// a copy goes: a writer's copy alone goes with it (its tensor's life is over: what reads its bytes
// later reads another tensor)
static void th_copy_gone(const th_copy & k) {
    th_chunk_free(th_chunks[k.chunk], k.off, k.bytes);
    if (k.writer == nullptr) return;
    th_alones.erase(std::remove_if(th_alones.begin(), th_alones.end(),
                                   [&](const th_alone & w) { return w.lo == k.lo && w.hi == k.hi; }),
                    th_alones.end());
}

// the copies of bytes [lo, hi) (all: every copy) dropped, but those `spare` wrote beside them
static void th_drop_copies_if(const uintptr_t lo, const uintptr_t hi, const bool all,
                              const ggml_tensor * spare = nullptr) {
    for (size_t i = 0; i < th_copies.size();) {
        const th_copy & k = th_copies[i];
        if (k.device == th_graph_device && (all || (k.lo < hi && lo < k.hi)) && (spare == nullptr || k.writer != spare)) {
            th_copy_gone(k);
            th_copies.erase(th_copies.begin() + i);
        } else {
            i++;
        }
    }
}

static void th_drop_tensor(const ggml_tensor * t, const ggml_tensor * spare = nullptr) {
    if (t == nullptr || t->data == nullptr) return;
    const uintptr_t lo = (uintptr_t) t->data;
    th_drop_copies_if(lo, lo + ggml_nbytes(t), false, spare);
}

// whether ggml-cuda runs no kernel for `node` (skipped, or a view)
static bool th_computes_nothing(const ggml_tensor * node) {
    if ((node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0 || ggml_is_empty(node)) return true;   // ggml-cuda skips it
    switch (node->op) {
        case GGML_OP_NONE: case GGML_OP_RESHAPE: case GGML_OP_VIEW: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
            return true;
        default:
            return false;
    }
}

// whether what `node` writes is known to be its own bytes and those th_writes names (else every
// copy goes when it computes: ggml's optimizer steps, our AdamW run, a kernel not listed there)
static bool th_writes_known(const ggml_tensor * node) {
    if (node->op == GGML_OP_OPT_STEP_ADAMW || node->op == GGML_OP_OPT_STEP_SGD) return false;   // in place
    if (node->op != GGML_OP_CUSTOM) return true;
    switch (th_kernel_of(node)) {
        case TH_CUDA_GELU: case TH_CUDA_GELU_BACK: case TH_CUDA_GELU_ERF: case TH_CUDA_GELU_ERF_BACK:
        case TH_CUDA_CONT: case TH_CUDA_SLICE_CONT:
        case TH_CUDA_LAYER_NORM: case TH_CUDA_LAYER_NORM_BACK: case TH_CUDA_LINEAR_BIAS: case TH_CUDA_PRODUCT_SUM:
        case TH_CUDA_AFFINE: case TH_CUDA_ADD: case TH_CUDA_GET_ROWS_BACK: case TH_CUDA_SCATTER_ROWS: case TH_CUDA_FOLDED: case TH_CUDA_ROOM:
        case TH_CUDA_FROZEN_MUL_MAT: case TH_CUDA_FROZEN_OUT_PROD: case TH_CUDA_SILU_BACK_MUL: case TH_CUDA_RMS_NORM:
        case TH_CUDA_ROPE: case TH_CUDA_CROSS_ENTROPY_BACK: case TH_CUDA_SWIGLU: case TH_CUDA_CROSS_ENTROPY:
        case TH_CUDA_SOFT_MAX_BACK:
        case TH_CUDA_SWIGLU_BACK: case TH_CUDA_COLUMN_DOT: case TH_CUDA_ATTN_FWD: case TH_CUDA_ATTN_PREP:
        case TH_CUDA_ATTN_BWD: case TH_CUDA_ATTN_DQ: case TH_CUDA_SLICE:
            return true;
        default:
            return false;
    }
}

// what `node` writes, as ggml-cuda computes it: the copies of those bytes dropped
static void th_writes(const ggml_tensor * node) {
    if (th_computes_nothing(node)) return;
    if (!th_writes_known(node)) {                           // a new kernel of ours belongs in th_writes_known and
        th_drop_copies_if(0, 0, true);                      // below, else every copy goes here (test_precision:
        return;                                             // the conversions' count)
    }
    if (node->op != GGML_OP_CUSTOM) {
        th_drop_tensor(node);
        return;
    }
    switch (th_kernel_of(node)) {
        case TH_CUDA_LAYER_NORM_BACK:                       // and, summing its gain's gradient, into its
            th_drop_tensor(node, node);                     // room (src 4) and the scratch (src 5), and
            if (node->src[4] != nullptr) {                  // its bias's into its room (src 6)
                th_drop_tensor(node->src[4], node);
                th_drop_tensor(node->src[5], node);
            }
            if (node->src[6] != nullptr) th_drop_tensor(node->src[6], node);
            return;
        case TH_CUDA_GELU: case TH_CUDA_GELU_BACK: case TH_CUDA_GELU_ERF: case TH_CUDA_GELU_ERF_BACK:
        case TH_CUDA_CONT: case TH_CUDA_SLICE_CONT:
        case TH_CUDA_LAYER_NORM: case TH_CUDA_LINEAR_BIAS: case TH_CUDA_PRODUCT_SUM:
        case TH_CUDA_ADD: case TH_CUDA_GET_ROWS_BACK: case TH_CUDA_SCATTER_ROWS: case TH_CUDA_FOLDED: case TH_CUDA_ROOM:
        case TH_CUDA_FROZEN_MUL_MAT: case TH_CUDA_FROZEN_OUT_PROD: case TH_CUDA_SILU_BACK_MUL: case TH_CUDA_RMS_NORM:
        case TH_CUDA_ROPE: case TH_CUDA_CROSS_ENTROPY_BACK: case TH_CUDA_SWIGLU:
        case TH_CUDA_CROSS_ENTROPY: case TH_CUDA_SOFT_MAX_BACK:    // (and th_scratch_for's memory: no copy there)
            th_drop_tensor(node, node);                     // its own bytes only (FOLDED, ROOM: written by others),
            return;                                         // the copy it wrote beside them kept
        case TH_CUDA_SWIGLU_BACK:                           // and up's gradient, into its room (src 3)
            th_drop_tensor(node, node);                     // (the copies it wrote of both kept)
            th_drop_tensor(node->src[3], node);
            return;
        case TH_CUDA_AFFINE:                                // and, computing its norm (src 3 its input),
            th_drop_tensor(node, node);                     // t into the norm's room (src 0), and the
            if (node->src[3] != nullptr) th_drop_tensor(node->src[0], node);       // sum of srcs 4 and 5
            if (node->src[4] != nullptr) th_drop_tensor(node->src[3], node);       // into src 3's room
            return;
        case TH_CUDA_COLUMN_DOT:                            // and its partial sums, in src 2
        case TH_CUDA_ATTN_FWD: case TH_CUDA_ATTN_PREP: case TH_CUDA_ATTN_BWD: case TH_CUDA_ATTN_DQ:
        case TH_CUDA_SLICE:                                 // D, dK, dV^T, the rooms: into sources
            th_drop_tensor(node, node);                     // (the copies it wrote kept: dQ's, dK's
            for (int j = 0; j < GGML_MAX_SRC; j++) th_drop_tensor(node->src[j], node);  // and dV's rooms')
            return;
        default:                                            // (th_writes_known's list: none left)
            th_drop_copies_if(0, 0, true);
            return;
    }
}

// The node that computed last (th_node) read no copy-alone tensor but through its copy: one that
// did would have read f32 values never written. th_copy_alone_ok admits only readers that take the
// copy (none of the tests' graphs has another); this says so loudly where one does not.
static void th_alone_readers_served(void) {
    if (th_node == nullptr) return;
    for (const th_alone & w : th_alones) {
        if (std::find(w.readers.begin(), w.readers.end(), th_node) != w.readers.end()) {
            GGML_ABORT("toyharness: node %s read %s's values, which were written as their bf16 copy alone, without "
                       "that copy", th_node->name, w.writer->name);
        }
    }
}

static void th_reuse_end(void) {
    th_alone_readers_served();
    th_alones.clear();
    if (th_graph != nullptr) th_drop_copies_if(0, 0, true);
    th_graph = nullptr;
    th_node = nullptr;
    th_prev_node = -1;
}

void th_cuda_graph_begin(const ggml_cgraph * graph) {
    int device = 0;
    cudaGetDevice(&device);
    th_reuse_end();
    th_graph_device = device;
    th_drop_copies_if(0, 0, true);       // (another graph's of this device: none, all dropped at its end)
    for (th_chunk & c : th_chunks) {
        if (c.device == device) c.free.assign(1, {0, c.bytes});
    }
    const char * streams = getenv("GGML_CUDA_GRAPH_OPT");       // nodes on several streams: no reuse
    th_reuse = !(streams != nullptr && atoi(streams) == 1);
    th_graph = th_reuse ? graph : nullptr;
}

void th_cuda_graph_end(void) { th_reuse_end(); }

// `node` is about to compute: the writes of the nodes since the last such node, its own included
static void th_reuse_before(const ggml_tensor * node) {
    th_alone_readers_served();
    th_node = nullptr;
    if (th_graph == nullptr) return;
    int at = -1;
    for (int i = th_prev_node + 1; i < ggml_graph_n_nodes((ggml_cgraph *) th_graph); i++) {
        if (ggml_graph_node((ggml_cgraph *) th_graph, i) == node) {
            at = i;
            break;
        }
    }
    if (at < 0) {                        // not the graph's next node: nothing known, nothing kept
        th_reuse_end();
        return;
    }
    for (int i = th_prev_node < 0 ? 0 : th_prev_node; i <= at; i++) th_writes(ggml_graph_node((ggml_cgraph *) th_graph, i));
    for (size_t i = 0; i < th_copies.size();) {              // past their horizon's last reader
        const th_copy & k = th_copies[i];
        if (k.device == th_graph_device && k.until < at) {
            th_copy_gone(k);
            th_copies.erase(th_copies.begin() + i);
        } else {
            i++;
        }
    }
    th_prev_node = at;
    th_node = node;
}

// whether tensor t's bytes overlap [lo, hi); whether node u reads any of them (a source's do)
static bool th_tensor_overlaps(const ggml_tensor * t, const uintptr_t lo, const uintptr_t hi) {
    return t != nullptr && t->data != nullptr && (uintptr_t) t->data < hi && lo < (uintptr_t) t->data + ggml_nbytes(t);
}
static bool th_reads_bytes(const ggml_tensor * u, const uintptr_t lo, const uintptr_t hi) {
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        if (th_tensor_overlaps(u->src[j], lo, hi)) return true;
    }
    return false;
}

// With a horizon, the last node among the next th_keep_nodes after the one computing now whose
// sources overlap the bytes [lo, hi) (the node computing now when none does); INT_MAX without one.
static int th_copy_until(const uintptr_t lo, const uintptr_t hi) {
    if (th_keep_nodes <= 0 || th_graph == nullptr) return INT_MAX;
    ggml_cgraph * graph = (ggml_cgraph *) th_graph;
    const int last = std::min(ggml_graph_n_nodes(graph) - 1, th_prev_node + th_keep_nodes);
    for (int i = last; i > th_prev_node; i--) {
        if (th_reads_bytes(ggml_graph_node(graph, i), lo, hi)) return i;
    }
    return th_prev_node;
}

// the source of the node computing now whose memory holds the bytes [lo, hi), or nullptr
static const ggml_tensor * th_source_holding(const uintptr_t lo, const uintptr_t hi) {
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        const ggml_tensor * s = th_node->src[j];
        if (s != nullptr && s->data != nullptr && lo >= (uintptr_t) s->data && hi <= (uintptr_t) s->data + ggml_nbytes(s)) {
            return s;
        }
    }
    return nullptr;
}

// whether `count` rows x cols matrices (leading dimension ld, each `stride` floats after the one
// before) are floats in order, with no gap
static bool th_packed(const int rows, const int cols, const int ld, const int count, const long long stride) {
    return ld == rows && (count == 1 || stride == (long long) rows * cols);
}

// the copy of an operand, converted now or kept from an earlier product; nullptr where it cannot
// be kept (then the caller converts into scratch)
static const __nv_bfloat16 * th_copy_of(cudaStream_t stream, const float * src, const long long stride, const int rows,
                                        const int cols, const int ld, const int count) {
    if (th_node == nullptr || src == nullptr || rows <= 0 || cols <= 0 || count <= 0 || stride < 0 || ld < rows) {
        return nullptr;
    }
    const uintptr_t lo = (uintptr_t) src;
    const uintptr_t hi = lo + sizeof(float) * (uintptr_t) ((long long) (count - 1) * stride + (long long) (cols - 1) * ld + rows);
    const bool inside = th_source_holding(lo, hi) != nullptr;    // (not ggml's pool)
    const bool packed = th_packed(rows, cols, ld, count, stride);
    for (th_copy & k : th_copies) {
        // the same matrices, or the same packed floats read in another shape (an attention's
        // output written as heads, read as rows): a packed copy is the floats in order either way
        const bool same = (k.rows == rows && k.cols == cols && k.ld == ld && k.count == count && k.stride == stride) ||
                          (packed && th_packed(k.rows, k.cols, k.ld, k.count, k.stride) &&
                           (long long) k.rows * k.cols * k.count == (long long) rows * cols * count);
        if (inside && k.device == th_graph_device && k.stream == stream && k.src == src && k.type == GGML_TYPE_F32 &&
            same) {
            th_copy_counts[1]++;
            k.until = std::max(k.until, th_copy_until(k.lo, k.hi));
            for (th_alone & w : th_alones) {                 // a reader of a copy-alone tensor served
                if (w.lo == k.lo && w.hi == k.hi) {
                    w.readers.erase(std::remove(w.readers.begin(), w.readers.end(), th_node), w.readers.end());
                }
            }
            return (const __nv_bfloat16 *) (th_chunks[k.chunk].ptr + k.off);
        }
    }
    for (const th_alone & w : th_alones) {   // a copy-alone tensor's f32 bytes, never written: loudly
        if (w.lo < hi && lo < w.hi) {
            GGML_ABORT("toyharness: node %s reads %s's values otherwise than through their bf16 copy, which was "
                       "written alone", th_node->name, w.writer->name);
        }
    }
    if (!inside) return nullptr;
    const size_t bytes = ((size_t) rows * cols * count * sizeof(__nv_bfloat16) + 255) & ~(size_t) 255;
    int chunk = 0;
    size_t off = 0;
    if (!th_chunk_alloc(th_graph_device, bytes, &chunk, &off)) return nullptr;
    __nv_bfloat16 * dst = (__nv_bfloat16 *) (th_chunks[chunk].ptr + off);
    th_to_bf16(stream, src, nullptr, stride, rows, cols, ld, count, dst);
    th_copies.push_back({th_graph_device, stream, src, GGML_TYPE_F32, rows, cols, ld, count, stride, lo, hi, chunk, off,
                         bytes, th_copy_until(lo, hi), nullptr});
    th_copy_counts[0]++;
    return dst;
}

// whether `u` is a matrix product: ggml's, or ours (whose bf16 operands are copies)
static bool th_is_product(const ggml_tensor * u) {
    switch (th_kernel_of(u)) {
        case TH_CUDA_LINEAR_BIAS: case TH_CUDA_PRODUCT_SUM: case TH_CUDA_FROZEN_MUL_MAT: case TH_CUDA_FROZEN_OUT_PROD:
            return true;
        default:
            return u->op == GGML_OP_MUL_MAT || u->op == GGML_OP_OUT_PROD;
    }
}

// Whether a product `u` takes its f32 operands as bf16 copies through th_copy_of (ours; ggml's
// OUT_PROD, and MUL_MAT where ggml-cuda gives it to cuBLAS: f32, more than a few columns)
static bool th_reads_copies(const ggml_tensor * u) {
    if (!th_is_product(u)) return false;
    if (u->op != GGML_OP_MUL_MAT && u->op != GGML_OP_OUT_PROD) return true;
    const bool f32 = u->type == GGML_TYPE_F32 && u->src[0] != nullptr && u->src[1] != nullptr &&
                     u->src[0]->type == GGML_TYPE_F32 && u->src[1]->type == GGML_TYPE_F32;
    if (u->op == GGML_OP_OUT_PROD) return f32;
    // (ggml-cuda's own f32 kernels take up to 16 columns, mmvf 8 and mmf 16, or src0 of one row
    // and src1 as the matrix; cuBLAS the rest)
    return u->op == GGML_OP_MUL_MAT && f32 && u->src[1]->ne[1] > 16 && u->src[0]->ne[1] > 1;
}

// Whether the f32 values of `dst` (the node computing now, index th_prev_node) need not be written
// beside their bf16 copy: no one else reads them. It is not an output, parameter or input; no
// horizon drops copies; every later node that reads its bytes, up to the first that writes them,
// is a product that takes copies (th_reads_copies: in the copy's shape, or th_copy_of aborts), and
// no node that drops every copy computes before the last such reader. `readers`: those products.
static bool th_copy_alone_ok(const ggml_tensor * dst, const uintptr_t lo, const uintptr_t hi,
                             std::vector<const ggml_tensor *> & readers) {
    const int32_t kept = GGML_TENSOR_FLAG_INPUT | GGML_TENSOR_FLAG_OUTPUT | GGML_TENSOR_FLAG_PARAM | GGML_TENSOR_FLAG_LOSS;
    if (th_keep_nodes > 0 || (dst->flags & kept) != 0 || dst->view_src != nullptr) return false;
    ggml_cgraph * graph = (ggml_cgraph *) th_graph;
    bool dropped = false;                // a node that drops every copy has computed
    for (int i = th_prev_node + 1; i < ggml_graph_n_nodes(graph); i++) {
        const ggml_tensor * u = ggml_graph_node(graph, i);
        const int kernel = th_kernel_of(u);
        if (th_computes_nothing(u) || kernel == TH_CUDA_FOLDED || kernel == TH_CUDA_ROOM) continue;
        const bool reads = th_reads_bytes(u, lo, hi);
        if (reads && (dropped || !th_reads_copies(u))) return false;
        if (reads) readers.push_back(u);
        // a node that writes these bytes ends dst's life (ggml-alloc gives them to a later tensor
        // after dst's last reader): what reads them after it reads that tensor
        if (th_tensor_overlaps(u, lo, hi)) break;
        dropped = dropped || !th_writes_known(u);
    }
    return !readers.empty();
}

// A copy its writer fills as it writes `dst` (f32, contiguous: rows ne[0], cols its rows, as a
// product reads it), where a bf16 product will convert it otherwise: at bf16, reuse on, `dst` the
// node computing now, a later product of the graph reading its bytes (one that reads them in
// another shape converts them again: the copy is then only memory). The writer rounds each value to nearest even as th_to_bf16 would (the same
// bits); the copy is kept as a converted one is, and goes as one does when its bytes are written
// (the writer's own writes aside). nullptr: none wanted or no memory (the writer writes f32 alone).
// Not counted as a conversion (a product that uses it counts a reuse).
// *alone (where given): the writer writes the copy alone, not its f32 values (th_copy_alone_ok:
// only products read them, each through this copy); a writer that cannot write the copy alone
// passes nullptr.
// `written` (where given): a tensor other than dst that dst's kernel writes (the attention
// backward's rooms for dK and dV), whose copy this is; dst stays its writer.
__nv_bfloat16 * th_copy_for_writer(cudaStream_t stream, const ggml_tensor * writer, bool * alone,
                                   const ggml_tensor * written) {
    if (alone != nullptr) *alone = false;
    const ggml_tensor * dst = written != nullptr ? written : writer;
    if (th_precision_current != TH_PRECISION_BF16 || th_node != writer || dst->data == nullptr ||
        dst->type != GGML_TYPE_F32 || !ggml_is_contiguous(dst) || dst->ne[0] > INT_MAX || ggml_nrows(dst) > INT_MAX) {
        return nullptr;
    }
    const uintptr_t lo = (uintptr_t) dst->data, hi = lo + ggml_nbytes(dst);
    bool product_reads = false;          // a later product's operand (a gain's backward, say, is not)
    ggml_cgraph * graph = (ggml_cgraph *) th_graph;
    for (int i = th_prev_node + 1; i < ggml_graph_n_nodes(graph) && !product_reads; i++) {
        const ggml_tensor * u = ggml_graph_node(graph, i);
        product_reads = th_is_product(u) && th_reads_bytes(u, lo, hi);
    }
    if (!product_reads) return nullptr;
    const int rows = (int) dst->ne[0], cols = (int) ggml_nrows(dst);
    const size_t bytes = ((size_t) rows * cols * sizeof(__nv_bfloat16) + 255) & ~(size_t) 255;
    int chunk = 0;
    size_t off = 0;
    if (!th_chunk_alloc(th_graph_device, bytes, &chunk, &off)) return nullptr;
    th_copies.push_back({th_graph_device, stream, (const float *) dst->data, GGML_TYPE_F32, rows, cols, rows, 1, 0, lo,
                         hi, chunk, off, bytes, th_copy_until(lo, hi), writer});
    std::vector<const ggml_tensor *> readers;
    if (alone != nullptr && th_copy_alone_ok(dst, lo, hi, readers)) {
        th_alones.push_back({writer, lo, hi, std::move(readers)});
        th_alone_count++;
        *alone = true;
    }
    return (__nv_bfloat16 *) (th_chunks[chunk].ptr + off);
}

// The product in bf16: the operands (op(A) m x k, op(B) k x n; A stored rows x cols as its op
// says) as bf16 copies (kept ones, or converted into scratch), then one cuBLAS call on them.
// `a`/`b` strided by sa/sb, or pointer arrays `as`/`bs` (then c is `cs`); count products.
bool th_bf16_operands(cudaStream_t stream, const float * a, const long long sa, const int a_rows, const int a_cols,
                      const int lda, const float * b, const long long sb, const int b_rows, const int b_cols,
                      const int ldb, const int count, const void ** a16, const void ** b16, const float * c,
                      const int c_n, const void ** c16) {
    const size_t a_size = (size_t) a_rows * a_cols, b_size = (size_t) b_rows * b_cols, c_size = c != nullptr ? c_n : 0;
    const __nv_bfloat16 * a_kept = th_copy_of(stream, a, sa, a_rows, a_cols, lda, count);
    const __nv_bfloat16 * b_kept = th_copy_of(stream, b, sb, b_rows, b_cols, ldb, count);
    const __nv_bfloat16 * c_kept = c != nullptr ? th_copy_of(stream, c, 0, c_n, 1, c_n, 1) : nullptr;
    const bool c_new_wanted = c != nullptr && c_kept == nullptr;
    const size_t bytes =
        (((a_kept ? 0 : a_size) + (b_kept ? 0 : b_size)) * count + (c_new_wanted ? c_size : 0)) * sizeof(__nv_bfloat16) + 768;
    const bool all_kept = a_kept != nullptr && b_kept != nullptr && !c_new_wanted;
    char * scratch = all_kept ? nullptr : (char *) th_scratch_for(bytes);
    if (scratch == nullptr && !all_kept) return false;
    th_copy_counts[0] += (a_kept == nullptr) + (b_kept == nullptr) + c_new_wanted;
    __nv_bfloat16 * a_new = (__nv_bfloat16 *) scratch;              // each copy 256-byte aligned
    if (a_kept == nullptr) th_to_bf16(stream, a, nullptr, sa, a_rows, a_cols, lda, count, a_new);
    __nv_bfloat16 * b_new = a_kept != nullptr ? a_new
                          : (__nv_bfloat16 *) (((uintptr_t) (a_new + a_size * count) + 255) & ~(uintptr_t) 255);
    if (b_kept == nullptr) th_to_bf16(stream, b, nullptr, sb, b_rows, b_cols, ldb, count, b_new);
    __nv_bfloat16 * c_new = b_kept != nullptr ? b_new
                          : (__nv_bfloat16 *) (((uintptr_t) (b_new + b_size * count) + 255) & ~(uintptr_t) 255);
    if (c_new_wanted) th_to_bf16(stream, c, nullptr, 0, c_n, 1, c_n, 1, c_new);
    *a16 = a_kept != nullptr ? a_kept : a_new;
    *b16 = b_kept != nullptr ? b_kept : b_new;
    if (c != nullptr) *c16 = c_kept != nullptr ? c_kept : c_new;
    return cudaGetLastError() == cudaSuccess;
}

static cublasStatus_t th_gemm_bf16(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void * alpha, const float * a, const float * const * as, int lda,
                                   long long sa, const float * b, const float * const * bs, int ldb, long long sb,
                                   const void * beta, float * c, void * const * cs, int ldc, long long sc,
                                   int count, bool batched) {
    cudaStream_t stream = nullptr;
    if (cublasGetStream(h, &stream) != CUBLAS_STATUS_SUCCESS) return CUBLAS_STATUS_INTERNAL_ERROR;
    const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
    const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
    const size_t a_size = (size_t) a_rows * a_cols, b_size = (size_t) b_rows * b_cols;
    if (as == nullptr) {                        // one operand each (kept copies where they can be)
        const void * a_use = nullptr, * b_use = nullptr;
        if (!th_bf16_operands(stream, a, sa, a_rows, a_cols, lda, b, sb, b_rows, b_cols, ldb, count, &a_use, &b_use)) {
            return CUBLAS_STATUS_ALLOC_FAILED;
        }
        if (batched) {
            return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a_use, CUDA_R_16BF, a_rows, (long long) a_size,
                                              b_use, CUDA_R_16BF, b_rows, (long long) b_size, beta, c, CUDA_R_32F, ldc,
                                              sc, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        }
        return cublasGemmEx(h, ta, tb, m, n, k, alpha, a_use, CUDA_R_16BF, a_rows, b_use, CUDA_R_16BF, b_rows, beta, c,
                            CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    // pointer arrays (where they point is on the device, so never kept): both copies and the
    // arrays of their pointers in the scratch
    const size_t bytes = (a_size + b_size) * count * sizeof(__nv_bfloat16) + 3 * (size_t) count * sizeof(void *) + 512;
    char * scratch = (char *) th_scratch_for(bytes);
    if (scratch == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
    th_copy_counts[0] += 2;
    __nv_bfloat16 * a16 = (__nv_bfloat16 *) scratch;
    th_to_bf16(stream, a, as, sa, a_rows, a_cols, lda, count, a16);
    __nv_bfloat16 * b16 = (__nv_bfloat16 *) (((uintptr_t) (a16 + a_size * count) + 255) & ~(uintptr_t) 255);
    th_to_bf16(stream, b, bs, sb, b_rows, b_cols, ldb, count, b16);
    if (cudaGetLastError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    const void ** ptrs = (const void **) (((uintptr_t) (b16 + b_size * count) + 255) & ~(uintptr_t) 255);
    th_pointers_kernel<<<(count + 255) / 256, 256, 0, stream>>>(a16, a_size, count, ptrs);
    th_pointers_kernel<<<(count + 255) / 256, 256, 0, stream>>>(b16, b_size, count, ptrs + count);
    return cublasGemmBatchedEx(h, ta, tb, m, n, k, alpha, ptrs, CUDA_R_16BF, a_rows, ptrs + count, CUDA_R_16BF,
                               b_rows, beta, cs, CUDA_R_32F, ldc, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// --- bf16: products of a frozen weight (a LoRA base) --------------------------------------------
// A frozen weight W of another type than f32 (f16, bf16, quantized; ggml ne [K, N], contiguous)
// enters a bf16 product as its bf16 values, never as an f32 copy: ggml-cuda's dequantizer of its
// type with bf16 output (each value computed in fp32 as ggml's to-float computes it, then rounded
// to nearest even; for Q4_K ours, the same bits: th-dequant.cu); a bf16 W is used in place. Within a graph pass W's copy is kept as an
// operand's is (the forward's product and the input gradient's share it): W is frozen, but its
// copy goes like any other with an optimizer step or a node not known to write only its own bytes.
static const __nv_bfloat16 * th_weight_kept(cudaStream_t stream, const ggml_tensor * w) {
    if (th_node == nullptr) return nullptr;
    const float * key = (const float *) w->data;
    const int rows = (int) w->ne[0], cols = (int) w->ne[1];
    for (th_copy & k : th_copies) {
        if (k.device == th_graph_device && k.stream == stream && k.src == key && k.type == (int) w->type &&
            k.rows == rows && k.cols == cols) {
            th_copy_counts[1]++;
            k.until = std::max(k.until, th_copy_until(k.lo, k.hi));
            return (const __nv_bfloat16 *) (th_chunks[k.chunk].ptr + k.off);
        }
    }
    const size_t bytes = ((size_t) ggml_nelements(w) * sizeof(__nv_bfloat16) + 255) & ~(size_t) 255;
    int chunk = 0;
    size_t off = 0;
    if (!th_chunk_alloc(th_graph_device, bytes, &chunk, &off)) return nullptr;
    __nv_bfloat16 * dst = (__nv_bfloat16 *) (th_chunks[chunk].ptr + off);
    th_dequantize_bf16(w->type, w->data, dst, ggml_nelements(w), stream);
    const uintptr_t lo = (uintptr_t) w->data;
    th_copies.push_back({th_graph_device, stream, key, (int) w->type, rows, cols, rows, 1, 0, lo, lo + ggml_nbytes(w),
                         chunk, off, bytes, th_copy_until(lo, lo + ggml_nbytes(w)), nullptr});
    th_copy_counts[0]++;
    return dst;
}

bool th_frozen_type_ok(const ggml_type type) {
    return type == GGML_TYPE_BF16 || (type != GGML_TYPE_F32 && ggml_get_to_bf16_cuda(type) != nullptr);
}

cublasStatus_t th_frozen_gemm_bf16(cublasHandle_t h, const ggml_tensor * w, cublasOperation_t tw, cublasOperation_t tb,
                                   int m, int n, int k, const void * b, const bool b_bf16, int b_rows, int b_cols,
                                   int ldb, void * c, const cudaDataType ct, int ldc, const float beta) {
    cudaStream_t stream = nullptr;
    if (cublasGetStream(h, &stream) != CUBLAS_STATUS_SUCCESS) return CUBLAS_STATUS_INTERNAL_ERROR;
    if (!th_frozen_type_ok(w->type)) return CUBLAS_STATUS_NOT_SUPPORTED;
    const size_t w_size = (size_t) ggml_nelements(w), b_size = (size_t) b_rows * b_cols;
    const __nv_bfloat16 * w16 = w->type == GGML_TYPE_BF16 ? (const __nv_bfloat16 *) w->data : th_weight_kept(stream, w);
    const __nv_bfloat16 * b16 = b_bf16 ? (const __nv_bfloat16 *) b : th_copy_of(stream, (const float *) b, 0, b_rows,
                                                                                 b_cols, ldb, 1);
    const size_t w_bytes = w16 != nullptr ? 0 : (w_size * sizeof(__nv_bfloat16) + 255) & ~(size_t) 255;
    char * scratch = (char *) th_scratch_for(w_bytes + (b16 != nullptr ? 0 : b_size * sizeof(__nv_bfloat16)) + 512);
    if (scratch == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
    if (w16 == nullptr) {                       // not kept (no reuse, or no memory for it): into scratch
        th_dequantize_bf16(w->type, w->data, (__nv_bfloat16 *) scratch, (int64_t) w_size, stream);
        th_copy_counts[0]++;
        w16 = (const __nv_bfloat16 *) scratch;
    }
    if (b16 == nullptr) {
        __nv_bfloat16 * dst = (__nv_bfloat16 *) (scratch + w_bytes);
        th_to_bf16(stream, (const float *) b, nullptr, 0, b_rows, b_cols, ldb, 1, dst);
        th_copy_counts[0]++;
        b16 = dst;
    }
    if (cudaGetLastError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
    const float alpha = 1.0f;
    return cublasGemmEx(h, tw, tb, m, n, k, &alpha, w16, CUDA_R_16BF, (int) w->ne[0], b16, CUDA_R_16BF,
                        b_bf16 ? ldb : b_rows, &beta, c, ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t th_cublas_sgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                               const float * alpha, const float * a, int lda, const float * b, int ldb,
                               const float * beta, float * c, int ldc) {
    if (th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, a, nullptr, lda, 0, b, nullptr, ldb, 0, beta, c, nullptr, ldc, 0,
                            1, false);
    }
    return cublasSgemm_v2(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);   // tf32: the math mode
}

cublasStatus_t th_cublas_sgemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                       int k, const float * alpha, const float * const a[], int lda,
                                       const float * const b[], int ldb, const float * beta, float * const c[],
                                       int ldc, int count) {
    if (th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, nullptr, a, lda, 0, nullptr, b, ldb, 0, beta, nullptr,
                            (void * const *) c, ldc, 0, count, true);
    }
    return cublasSgemmBatched(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, count);
}

cublasStatus_t th_cublas_sgemm_strided_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                               int n, int k, const float * alpha, const float * a, int lda,
                                               long long sa, const float * b, int ldb, long long sb,
                                               const float * beta, float * c, int ldc, long long sc, int count) {
    if (th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, a, nullptr, lda, sa, b, nullptr, ldb, sb, beta, c, nullptr, ldc,
                            sc, count, true);
    }
    return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, count);
}

cublasStatus_t th_cublas_gemm_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                 const void * alpha, const void * a, cudaDataType at, int lda, const void * b,
                                 cudaDataType bt, int ldb, const void * beta, void * c, cudaDataType ct, int ldc,
                                 cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, (const float *) a, nullptr, lda, 0, (const float *) b, nullptr,
                            ldb, 0, beta, (float *) c, nullptr, ldc, 0, 1, false);
    }
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_TF32) {
        compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, compute, algo);
}

cublasStatus_t th_cublas_gemm_batched_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const void * alpha, const void * const a[], cudaDataType at, int lda,
                                         const void * const b[], cudaDataType bt, int ldb, const void * beta,
                                         void * const c[], cudaDataType ct, int ldc, int count,
                                         cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, nullptr, (const float * const *) a, lda, 0, nullptr,
                            (const float * const *) b, ldb, 0, beta, nullptr, c, ldc, 0, count, true);
    }
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_TF32) {
        compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return cublasGemmBatchedEx(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, count, compute,
                               algo);
}

cublasStatus_t th_cublas_gemm_strided_batched_ex(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                                 int n, int k, const void * alpha, const void * a, cudaDataType at,
                                                 int lda, long long sa, const void * b, cudaDataType bt, int ldb,
                                                 long long sb, const void * beta, void * c, cudaDataType ct, int ldc,
                                                 long long sc, int count, cublasComputeType_t compute,
                                                 cublasGemmAlgo_t algo) {
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_BF16) {
        return th_gemm_bf16(h, ta, tb, m, n, k, alpha, (const float *) a, nullptr, lda, sa, (const float *) b, nullptr,
                            ldb, sb, beta, (float *) c, nullptr, ldc, sc, count, true);
    }
    if (th_f32_product(at, bt, ct, compute) && th_precision_current == TH_PRECISION_TF32) {
        compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    }
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc, sc,
                                      count, compute, algo);
}
