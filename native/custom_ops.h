/* What the cpu side (the shim's rewrite, native/cuda_rewrite.c) and our cuda kernels
 * (native/cuda/th-custom.cu and th-attention.cu, built inside ggml-cuda) agree on: how a
 * GGML_OP_CUSTOM node is marked as ours, which kernel it is, its parameters, the layouts the
 * attention kernels share, and the GELU constants both sides' formula uses. */
#pragma once

#include "ggml.h"

#include <stdlib.h>
#include <string.h>

#define TH_CUDA_MAGIC 0x75636874          /* "thcu", op_params[0] of a node of ours */
/* the widest rows whose gain's gradient LAYER_NORM_BACK sums (its block's 8 warps keep a partial
 * sum of every column in shared memory: 8 x 1536 floats, 48 KiB) */
#define TH_GAIN_SUMS_MAX_COLUMNS 1536
#define TH_CUDA_KERNELS_VERSION 26  /* 7: the precision stamp below (issue 32); 8: frozen products at bf16;
                                       9: SILU_BACK_MUL, SWIGLU_BACK; 10: th_cuda_bf16_keep_nodes;
                                       11: grouped-query heads in the attention kernels (group);
                                       12: AFFINE without a bias (a gain alone), RMS_NORM,
                                           ROPE; 13: th_cuda_bf16_copy_peak_bytes, ATTN_BWD's
                                           dS as bf16 at bf16; 14: our Q4_K dequantizer
                                           (th_cuda_dequantize_bf16), SwiGLU over frozen
                                           products in bf16, CROSS_ENTROPY_BACK; 15:
                                           CROSS_ENTROPY, SWIGLU; 16: ATTN_DQ's
                                           sources, no dS at tf32 and bf16; 17:
                                           th_cuda_bf16_copies_alone (writers' copies alone); 18:
                                           AFFINE computing its norm (th_norm_affine_params);
                                           19: LAYER_NORM_BACK summing its gain's gradient,
                                           an AFFINE's t not written where unread; 20: and
                                           at bf16 its bias's (src 6); 21: DROPOUT_MASK;
                                           22: GELU_ERF, GELU_ERF_BACK; 23: dropout on P
                                           inside the attention kernels (th_attention_params);
                                           24: SCATTER_ROWS; 25: SOFT_MAX_BACK; 26: attention
                                           over packed rows (TH_ATTENTION_PACKED) */
enum {
    TH_CUDA_GELU = 1, TH_CUDA_GELU_BACK = 2, TH_CUDA_CONT = 3,
    /* fused attention (th-attention.cu), each node of one head batch of BH heads of T tokens:
     *   ATTN_FWD   srcs q (hd,T,BH), k (hd,T,BH), vt (T,hd,BH), [dropout's key i32[4], and the
     *              mask and P*mask nodes that compute nothing now]; per head O (T x hd) then L (T)
     *   ATTN_PREP  srcs dO (hd,T,BH), the ATTN_FWD node; per head dK (T x hd),
     *              dV^T (hd x T), D (T): it computes D, and ATTN_BWD (which reads it) writes dK
     *              and dV^T into it, or into their rooms
     *   ATTN_BWD   srcs q, k, vt, dO, ATTN_FWD, ATTN_PREP, [dK's room, dV's room]; dS (T,T,BH),
     *              what SOFT_MAX_BACK gives, in the tiles a causal query sees (the rest unwritten:
     *              ATTN_DQ alone reads it); stamped bf16, or tf32 on the TF32 kernels, no dS:
     *              (1,1,BH), and nothing written
     *   ATTN_DQ    srcs q, k, vt, dO, ATTN_FWD, ATTN_PREP (ATTN_BWD's first six), then the ATTN_BWD
     *              node; dQ = dS K (at tf32 and bf16 dS's tiles computed again from the sources), into
     *              its own node through a map
     *   SLICE      src one of those; per head, `count` floats from `offset` of each `stride`
     * An operand (q, k, vt, dO) may be a strided (hd,T,H,B) or (T,hd,H,B) view, head b H + h:
     * the head-permuted projection a folded CONT would have copied. A room (ROOM) is the CONT
     * that permuted dK or dV back to the projection's layout: ATTN_BWD writes it through a
     * th_attention_map, and the room computes nothing (ATTN_DQ writes its own node, that CONT's
     * for dQ, through one). With grouped-query heads (th_attention_params.group > 1) k and vt hold
     * the BH / group kv heads (no REPEAT: the kernels read head bh / group), and ATTN_BWD writes
     * dK and dV summed over each group (what REPEAT_BACK gave: 0 + the group's first head + the
     * next ..., in fp32, head order) into rooms of BH / group heads, the REPEAT_BACK nodes
     * themselves or the CONTs that permute them back. */
    TH_CUDA_ATTN_FWD = 4, TH_CUDA_ATTN_PREP = 5, TH_CUDA_ATTN_BWD = 6, TH_CUDA_SLICE = 7,
    /* LayerNorm's normalization (blocks.layer_norm), op_params[2] eps:
     *   LAYER_NORM       src x (n, rows); t = (x - mean) / sqrt(mean((x - mean)^2) + eps) per row
     *   LAYER_NORM_BACK  srcs dt, x, [g], [r]; dx (what the centring and RMS_NORM_BACK of ggml's
     *                    nodes give), plus r when given (a residual's gradient: ADD(r, dx));
     *                    with srcs 4 and 5 (g given) the gain's gradient too, COLUMN_DOT(t, dy)'s
     *                    bits into src 4 (that node, now a ROOM) through the scratch of src 5
     *                    (native/cuda_rewrite/gain_sums.c, th_fuse_gain_sums); at bf16 with src 6 the
     *                    bias's gradient too, the column sums of dt's dy in the same order, into
     *                    src 6 (a ROOM; its partials after the gain's in src 5: native/
     *                    cuda_precision.c, th_layer_norm_bias_sums) */
    TH_CUDA_LAYER_NORM = 8, TH_CUDA_LAYER_NORM_BACK = 9,
    /* A bias added to a product's rows (blocks.linear):
     *   LINEAR_BIAS  srcs w (k, n), x (k, m), b (n); y (n, m) = x w^T + b, b added in the product's
     *                epilogue (cuBLASLt), or (no algorithm, or an operand not 16-byte aligned) b
     *                written into every row and cuBLAS's product added to it
     *   FOLDED       the product's own node, which LINEAR_BIAS computes: nothing to do */
    TH_CUDA_LINEAR_BIAS = 10, TH_CUDA_FOLDED = 11,
    /* A norm's gain and bias (blocks.scale_columns, add_bias), and their gradients:
     *   AFFINE      srcs t (n, rows), g (n), b (n); y = t g + b, rounded as MUL then ADD were;
     *               without b (a gain alone, MUL(t, g): RMSNorm's, and any gain's backward) y = t g
     *   COLUMN_DOT  srcs a, c (n, rows), scratch (n, rows); per column the sum over rows of a c
     *   LAYER_NORM_BACK takes the gain as src 2 when its dt was MUL(dy, g): dt formed in place
     *   AFFINE with src 3 x: t is a norm of x (LAYER_NORM or RMS_NORM, th_norm_affine_params), which
     *               the AFFINE computes with that norm's code and writes into t's node (a ROOM) as
     *               it writes y; with srcs 4 and 5 (`add`) x is their sum (a residual's ADD), which
     *               it computes too, into x's node (a ROOM) (native/cuda_rewrite/norm_fusion.c,
     *               th_fuse_norm_affines); t is left unwritten where nothing else reads it */
    TH_CUDA_AFFINE = 12, TH_CUDA_COLUMN_DOT = 13,
    /* GET_ROWS_BACK (an embedding's gradient): srcs grad (n, R) f32, ids (R) i32; dst (n, V) */
    TH_CUDA_GET_ROWS_BACK = 14,
    /* CONT of a permuted view of a SLICE, reading the sliced node itself (the SLICE computes
     * nothing): src that node; the view's strides, bytes, and where it starts, floats */
    TH_CUDA_SLICE_CONT = 15,
    /* ADD of two contiguous f32 tensors of one shape */
    TH_CUDA_ADD = 16,
    TH_CUDA_ATTN_DQ = 17, TH_CUDA_ROOM = 18,
    /* The sum of 2-D products, srcs a0, b0, a1, b1, ...: OUT_PROD(a0, b0) + OUT_PROD(a1, b1) + ...,
     * summed left to right (each product cuBLAS's OUT_PROD call, beta 1 after the first) */
    TH_CUDA_PRODUCT_SUM = 19,
    /* AdamW over a run of consecutive OPT_STEP_ADAMW nodes of one row: each node keeps ggml's
     * srcs (x, g, m, v, the row) and a th_adamw_link in op_params[2..]; the run's last node
     * computes every node of the run (in a few launches, where ggml launches one a parameter),
     * walking back through `prev`; the others compute nothing */
    TH_CUDA_ADAMW = 20,
    /* A frozen weight's products at bf16 (th-frozen.cu; marked by th_cuda_mark_precision, at bf16
     * only): W (K, N) of another type than f32, as its bf16 values (never an f32 copy);
     *   FROZEN_MUL_MAT   srcs W, x (K, M) f32;           y (N, M) = x W^T   (ggml's MUL_MAT(W, x))
     *   FROZEN_OUT_PROD  srcs W, b (M, N) f32 (dy^T);    dx (K, M) = dy W   (ggml's OUT_PROD(W, b))
     * At bf16 a FROZEN_MUL_MAT may read x and write y in bf16 (a SwiGLU's, th_swiglu_bf16). */
    TH_CUDA_FROZEN_MUL_MAT = 21, TH_CUDA_FROZEN_OUT_PROD = 22,
    /* SILU_BACK(MUL(a, b), x) with the MUL read by the SILU_BACK alone (SwiGLU's gate gradient:
     * ggml's backward of GLU builds silu_back(grad * up, gate)): srcs a, b, x of one shape, f32
     * contiguous; y = ggml-cuda's op_silu_back(a * b, x), the product rounded to f32 as the MUL's
     * node stored it. The MUL's node computes nothing (FOLDED). */
    TH_CUDA_SILU_BACK_MUL = 23,
    /* SwiGLU's whole backward, SILU_BACK_MUL's node when up's gradient MUL(SILU(gate), grad) is
     * found beside it: srcs grad, up, gate, and that MUL's node as a room (ROOM, no sources); one
     * pass writes gate's gradient into its own node (SILU_BACK_MUL's bits) and up's into the room,
     * ggml-cuda's op_silu(gate) * grad (its fused SILU + MUL's bits). The SILU folds. */
    TH_CUDA_SWIGLU_BACK = 24,      /* up and gate f32, or both bf16 (th_swiglu_bf16) */
    /* RMS_NORM of contiguous f32 rows (RMSNorm's normalization; LayerNorm's stand-in is
     * LAYER_NORM): src x, eps in op_params[2]; y = ggml-cuda's rms_norm_f32 bit for bit, a warp a
     * row summing in the order of ggml's block of 256 (n < 1024) or 1024 threads */
    TH_CUDA_RMS_NORM = 25,
    /* ROPE or ROPE_BACK of contiguous f32 rows, modes normal and neox (no offset, no sections, no
     * YaRN extrapolation):
     * srcs x (head size, heads, T, ...), positions (T) i32, frequency factors (or none);
     * op_params[2] 1 forward, 0 backward, then ggml's n_dims, mode, n_ctx_orig and its 6 floats
     * (freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow); y = ggml-cuda's
     * rope_norm / rope_neox bit for bit, a thread a rotated pair, the pairs of a row adjacent */
    TH_CUDA_ROPE = 26,
    /* CROSS_ENTROPY_LOSS_BACK (th-loss.cu): srcs grad (a scalar), logits, labels, f32 contiguous rows
     * of one shape; y = ggml-cuda's cross_entropy_loss_back_f32 bit for bit (a warp a row, each lane
     * the row's values lane, lane + 32, ... in order, the same warp reductions), several rows a CTA
     * and no row in shared memory (ggml's takes a CTA of one warp a row and the whole row of shared
     * memory: one warp an SM for a 32000-token vocabulary) */
    TH_CUDA_CROSS_ENTROPY_BACK = 27,
    /* CROSS_ENTROPY_LOSS (th-loss.cu): srcs logits, labels, f32 contiguous rows of one shape; the
     * scalar y = ggml-cuda's bit for bit: each row's -sum(labels (logits - max - log sum exp)) / rows
     * as its cross_entropy_loss_f32 computes it (a warp a row, eight rows a CTA here), then the rows'
     * values summed by cub's DeviceReduce::Sum, as its sum_f32_cuda does */
    TH_CUDA_CROSS_ENTROPY = 28,
    /* GLU SWIGLU of two split halves (ggml_swiglu_split): srcs gate, up, contiguous, of y's shape
     * and type (f32, or bf16 where th_swiglu_bf16 kept them); y = ggml-cuda's op_silu(gate) * up
     * rounded to y's type, bit for bit, 16 bytes a thread where ggml's kernel takes one value and
     * two 64-bit divisions */
    TH_CUDA_SWIGLU = 29,
    /* Dropout's mask (native/dropout_mask.h, the stream; dropout_mask.c builds the node for the
     * cpu): src the fed key i32[4]; th_dropout_params at op_params[TH_DROPOUT_CUDA_SLOT..]; y f32
     * contiguous, element i the stream's value for i, bit for bit the cpu kernel's */
    TH_CUDA_DROPOUT_MASK = 30,
    /* GELU's exact (erf) form (blocks.gelu_erf), as GELU and GELU_BACK are the tanh form's: srcs
     * and types the same (the input f32, or bf16 where th_gelu_bf16 kept it);
     *   GELU_ERF       y = x Phi(x)
     *   GELU_ERF_BACK  srcs dy, x; dx = dy (Phi(x) + x phi(x)) */
    TH_CUDA_GELU_ERF = 31, TH_CUDA_GELU_ERF_BACK = 32,
    /* GET_ROWS_BACK whose ids are distinct (th_ids_distinct: a loss's flat target indices, one per
     * row): srcs grad (n, R) f32, ids (R) i32; dst (n, V) zeroed, then row ids[r] = 0 + grad row r,
     * the sum ggml's kernel forms for an id found once (the same bits), in O(n (V + R)) where
     * GET_ROWS_BACK compares every id for every output row (O(n V R): 28 s a DPO step at 4096 rows
     * of a 128,256-token vocabulary) */
    TH_CUDA_SCATTER_ROWS = 33,
    /* SOFT_MAX_BACK without a mask (th-loss.cu): srcs dy, y (f32, contiguous, dst's shape), the
     * scale at parameter slot 2; dx = scale (dy - dot(y, dy)) y a row, ggml's arithmetic and bits
     * (a warp a row: lane l's products l, l + 32, ... in order, then ggml's warp sum) in two
     * kernels: the rows' dots, loads in flight ahead of the sums, then every element at once.
     * ggml's warp a row waits on one load at a time: 2.1 ms for 256 rows of a 128,256-token
     * vocabulary (logits_chunk's piece), 33 ms of a 1B DPO step */
    TH_CUDA_SOFT_MAX_BACK = 34,
};
/* `t` becomes a node of ours computed by `kernel` (TH_CUDA_*), its parameters cleared */
static inline void th_mark(struct ggml_tensor * t, int kernel) {
    const int32_t params[2] = {TH_CUDA_MAGIC, kernel};
    t->op = GGML_OP_CUSTOM;
    memset(t->op_params, 0, sizeof(t->op_params));
    memcpy(t->op_params, params, sizeof(params));
}
/* which kernel of ours a node is (TH_CUDA_*), 0 for any other node */
static inline int th_kernel_of(const struct ggml_tensor * t) {
    int32_t p[2];
    memcpy(p, t->op_params, sizeof(p));
    return t->op == GGML_OP_CUSTOM && p[0] == TH_CUDA_MAGIC ? p[1] : 0;
}
/* the name of cuda kernel `k` (th_kernel_of), NULL for 0 (a node not marked) or one not known */
static inline const char * th_cuda_kernel_name_of(int k) {
    static const char * names[] = {NULL, "gelu", "gelu_back", "cont", "attention", "attention_prep",
                                   "attention_back", "slice", "layer_norm", "layer_norm_back",
                                   "linear_bias", "folded", "affine", "column_dot", "get_rows_back",
                                   "slice_cont", "add", "attention_dq", "room", "product_sum", "adamw",
                                   "frozen_mul_mat", "frozen_out_prod", "silu_back_mul", "swiglu_back",
                                   "rms_norm", "rope", "cross_entropy_back", "cross_entropy", "swiglu",
                                   "dropout_mask", "gelu_erf", "gelu_erf_back", "scatter_rows",
                                   "soft_max_back"};
    return k > 0 && k < (int) (sizeof(names) / sizeof(*names)) ? names[k] : NULL;
}
/* whether t holds distinct i32 ids by construction: a loss's flat target indices (row r's r V + its
 * class), which the Python side names "<targets>.flat" (engine/losses.py) */
static inline int th_ids_distinct(const struct ggml_tensor * t) {
    const size_t n = strlen(t->name);
    return t->type == GGML_TYPE_I32 && n > 5 && strcmp(t->name + n - 5, ".flat") == 0;
}
/* whether t is a column of ones (rows, 1): the constant the Python side names "ones.ROWS"
 * (Program.cached_constant) for column sums as products */
static inline int th_is_ones(const struct ggml_tensor * t) {
    return t != NULL && strncmp(t->name, "ones.", 5) == 0 && t->ne[0] == 1;
}
/* whether node v, not a view (which computes nothing), reads t or a view of it */
static inline int th_reads_or_views(const struct ggml_tensor * v, const struct ggml_tensor * t) {
    if (v->view_src != NULL) return 0;
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        if (v->src[j] != NULL && (v->src[j] == t || v->src[j]->view_src == t)) return 1;
    }
    return 0;
}
/* whether a node of `graph` before index `before` reads t (th_reads_or_views) */
static inline int th_read_before(struct ggml_cgraph * graph, const struct ggml_tensor * t, const int before) {
    for (int k = 0; k < before; k++) {
        if (th_reads_or_views(ggml_graph_node(graph, k), t)) return 1;
    }
    return 0;
}
/* t under its RESHAPE views (the node whose memory they are) */
static inline struct ggml_tensor * th_under_reshape_views(struct ggml_tensor * t) {
    while (t != NULL && t->op == GGML_OP_RESHAPE) t = t->src[0];
    return t;
}
/* TOYHARNESS_CUDNN_ATTENTION (toyharness/switches.py), which native code never reads from the
 * environment: toyharness/_ffi.py passes it as each program starts to every library that reads it,
 * each holding its own copy: the shim's (cuda_precision.c, th_set_cudnn_attention) and ggml-cuda's
 * (cuda/th-attention.cu, th_cuda_set_cudnn_attention). ON: cuDNN's attention where it takes the
 * shape; OFF: toyharness's kernels; REFUSE: as if cuDNN refused every plan (the fallback, tested). */
enum { TH_CUDNN_OFF = 0, TH_CUDNN_ON = 1, TH_CUDNN_REFUSE = 2 };
#ifdef __CUDACC__
extern int th_cuda_cudnn_mode;
#define TH_CUDNN_MODE th_cuda_cudnn_mode
#else
extern int th_shim_cudnn_mode;
#define TH_CUDNN_MODE th_shim_cudnn_mode
#endif
/* op_params of an AFFINE node that computes its norm (after TH_CUDA_MAGIC and the kernel): the
 * norm's eps and kernel, TH_CUDA_LAYER_NORM or TH_CUDA_RMS_NORM; add 1: the norm's input is the
 * sum of srcs 4 and 5, which the AFFINE writes into src 3; unread 1: no node but the AFFINE reads
 * t (LayerNorm's backward forms it again and sums the gain's gradient), so t is not written */
typedef struct {
    float eps;
    int32_t norm, add, unread;
} th_norm_affine_params;
/* op_params of a ROPE node of ours (after TH_CUDA_MAGIC and the kernel) */
typedef struct {
    int32_t forward, n_dims, mode, n_ctx_orig;
    float freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
} th_rope_params;
/* Whether `t`, a MUL_MAT (mul_mat true) or OUT_PROD of a frozen weight, has a shape the frozen
 * bf16 products take: W 2-D, contiguous, of another type than f32; the other operand 2-D f32 with
 * unit-stride columns (OUT_PROD: or rows: dy^T as a transposed view); an f32 2-D contiguous result;
 * every size within cuBLAS's int. A forward (MUL_MAT) may also read a contiguous bf16 x and write a
 * bf16 result (SwiGLU kept in bf16: native/cuda_precision.c, th_swiglu_bf16). */
static inline int th_frozen_product_ok(const struct ggml_tensor * t, int mul_mat) {
    const struct ggml_tensor * w = t->src[0], * x = t->src[1];
    const int x_bf16 = mul_mat && x != NULL && x->type == GGML_TYPE_BF16 && ggml_is_contiguous(x);
    if (w == NULL || x == NULL || w->type == GGML_TYPE_F32 || (x->type != GGML_TYPE_F32 && !x_bf16) ||
        (t->type != GGML_TYPE_F32 && !(mul_mat && t->type == GGML_TYPE_BF16)) ||
        !ggml_is_contiguous(w) || !ggml_is_contiguous(t) || w->ne[2] * w->ne[3] != 1 || x->ne[2] * x->ne[3] != 1 ||
        t->ne[2] * t->ne[3] != 1 || w->ne[0] > INT32_MAX || w->ne[1] > INT32_MAX || x->ne[0] > INT32_MAX ||
        x->ne[1] > INT32_MAX || (!x_bf16 && (x->nb[0] % sizeof(float) != 0 || x->nb[1] % sizeof(float) != 0))) {
        return 0;
    }
    if (mul_mat) {
        return x->ne[0] == w->ne[0] && t->ne[0] == w->ne[1] && t->ne[1] == x->ne[1] &&
               (x_bf16 || x->nb[0] == sizeof(float));
    }
    return x->ne[1] == w->ne[1] && t->ne[0] == w->ne[0] && t->ne[1] == x->ne[0] &&
           (x->nb[0] == sizeof(float) || x->nb[1] == sizeof(float));
}
typedef struct { struct ggml_tensor * prev, * last; } th_adamw_link;
static inline th_adamw_link th_adamw_link_of(const struct ggml_tensor * t) {
    th_adamw_link link;
    memcpy(&link, (const char *) t->op_params + 2 * sizeof(int32_t), sizeof(link));
    return link;
}
typedef struct { int64_t nb[4]; int64_t offset; } th_slice_cont_params;

/* the RMS_NORM node that stands in for LayerNorm's normalization on cuda (blocks.layer_norm) */
#define TH_LAYER_NORM_NAME "th.layer_norm"

/* op_params[2..] of the attention nodes, and of SLICE. `group`: query heads a key/value head
 * (grouped-query heads, read in place: head bh reads k and v^T's head bh / group, and the
 * backward writes dK and dV summed over each group, into rooms of the kv heads; 1: none).
 * `dropout`: the four words of the dropout mask on P that the kernels draw themselves
 * (dropout_mask.h's th_dropout_params layout: node, threshold's two words, the kept value's
 * bits; all 0: no dropout); ATTN_FWD's src 3 is then the program's fed key. */
typedef struct { int32_t hd, T, causal; float scale; int32_t group; int32_t dropout[4]; } th_attention_params;
/* `causal` TH_ATTENTION_PACKED: packed rows (toyharness/engine/packed.py), several examples a row,
 * each query seeing the keys of its own example up to itself only. ATTN_FWD's src 6 is then the
 * fed bounds, i32 (T, 2, B): per batch row the first key each query sees, then the end of the
 * queries that see each key; the kernels skip the tiles outside every example. (The packed
 * mask's op_params hold that tensor's address, where the harness made one: th_packed_bounds_of.) */
enum { TH_ATTENTION_CAUSAL = 1, TH_ATTENTION_PACKED = 2 };
#define TH_ATTENTION_BOUNDS_SRC 6
static inline struct ggml_tensor * th_packed_bounds_of(const struct ggml_tensor * mask) {
    struct ggml_tensor * bounds = NULL;
    memcpy(&bounds, mask->op_params, sizeof(bounds));
    return bounds;
}
static inline void th_packed_bounds_set(struct ggml_tensor * mask, const struct ggml_tensor * bounds) {
    memcpy(mask->op_params, &bounds, sizeof(bounds));
}
static inline int th_attention_has_dropout(const th_attention_params * ap) { return ap->dropout[3] != 0; }
typedef struct { int64_t stride, offset; } th_slice_params;
/* Where a head's (d, t) elements go in a room: the room's axis that each of d, t, h and b is
 * (-1: that axis has one element), head bh = b H + h, H the h axis's elements. op_params after
 * th_attention_params: ATTN_BWD's dK then dV rooms, ATTN_DQ's own node. */
typedef struct { int8_t axis[4]; } th_attention_map;
static inline th_attention_map th_attention_map_of(const struct ggml_tensor * t, int which) {
    th_attention_map map;
    memcpy(&map, (const char *) t->op_params + 2 * sizeof(int32_t) + sizeof(th_attention_params) + which * sizeof(map),
           sizeof(map));
    return map;
}
static inline void th_attention_map_set(struct ggml_tensor * t, int which, th_attention_map map) {
    memcpy((char *) t->op_params + 2 * sizeof(int32_t) + sizeof(th_attention_params) + which * sizeof(map), &map,
           sizeof(map));
}

static inline int th_attention_head_dim_ok(int64_t hd) { return hd == 16 || hd == 32 || hd == 64; }
/* floats a head in the ATTN_FWD node (O, L) and in the ATTN_PREP node (dK, dV^T, D) */
static inline int64_t th_attention_fwd_floats(int64_t hd, int64_t T) { return (hd + 1) * T; }
static inline int64_t th_attention_prep_floats(int64_t hd, int64_t T) { return (2 * hd + 1) * T; }

#define TH_GELU_K1 1.5957691216057308f   /* 2 sqrt(2 / pi) */
#define TH_GELU_K3 0.0713548162726009f   /* 0.044715 * 2 sqrt(2 / pi) */

/* CONT of a permuted f32 tensor: the source's axis whose elements are adjacent (stride one float):
 * 0 (rows contiguous: a row copy), 1..3 (a transpose through tiles), -1 when none is. */
static inline int th_cont_axis(const struct ggml_tensor * src) {
    if (src->nb[0] == sizeof(float)) return 0;
    for (int c = 1; c < 4; c++) {
        if (src->ne[c] > 1 && src->nb[c] == sizeof(float)) return c;
    }
    return -1;
}

/* The precision of a program's products (issue 32; Options.precision): th_cuda_mark_precision
 * (native/cuda_precision.c) stamps it into the last op_params slot of every MUL_MAT, OUT_PROD and
 * node of ours, after th_cuda_rewrite; native/cuda/th-precision.cu reads it before the node runs
 * and sets the cuBLAS math mode and compute type of its products. No stamp: fp32. The stamp is in
 * the node, so ggml-cuda's CUDA graph of a program in one precision is never replayed for a graph
 * of another (its update check compares whole nodes). None of our nodes' parameters reach it. */
enum { TH_PRECISION_FP32 = 0, TH_PRECISION_TF32 = 1, TH_PRECISION_BF16 = 2 };
#define TH_PRECISION_SLOT (GGML_MAX_OP_PARAMS / (int) sizeof(int32_t) - 1)
#define TH_PRECISION_TAG 0x70720000      /* "pr" in the high half, the precision in the low */
static inline int th_precision_of(const struct ggml_tensor * t) {
    int32_t v;
    memcpy(&v, (const char *) t->op_params + TH_PRECISION_SLOT * sizeof(int32_t), sizeof(v));
    return (v & ~0xffff) == TH_PRECISION_TAG ? (v & 0xffff) : TH_PRECISION_FP32;
}
static inline void th_precision_set(struct ggml_tensor * t, int precision) {
    const int32_t v = precision == TH_PRECISION_FP32 ? 0 : TH_PRECISION_TAG | precision;
    memcpy((char *) t->op_params + TH_PRECISION_SLOT * sizeof(int32_t), &v, sizeof(v));
}
/* Whether an attention node of ours, as stamped, runs on the tensor-core kernels
 * (cuda/th-attention.cu): at bf16 and tf32. Their backward writes no dS (dQ's kernel computes its tiles again), so
 * th_cuda_mark_precision shapes that node (1, 1, BH); fp32's write dS (T, T, BH) and read it. */
static inline int th_attention_on_tensor_cores(const struct ggml_tensor * t) {
    const int precision = th_precision_of(t);
    return precision == TH_PRECISION_BF16 || precision == TH_PRECISION_TF32;
}
/* Whether an attention, by its forward node `fwd` (ATTN_FWD), runs on cuDNN's fused attention
 * (cudnn/th_cudnn.cpp, cuda/th-attention.cu's "cuDNN" section): a build with cuDNN
 * (TH_CUDNN_ATTENTION: native/build.py), stamped bf16, its q, k and v^T all bf16 (read in place:
 * native/cuda_precision.c, th_attention_inputs_bf16) or all f32 (narrowed to bf16 for cuDNN:
 * llama's, after RoPE), grouped-query heads or not, head size 32 or 64, T a multiple of 8 (the
 * softmax statistics' rows 16-byte aligned), and TOYHARNESS_CUDNN_ATTENTION not 0 (TH_CUDNN_MODE). Its prep,
 * backward and dQ nodes follow their forward (src[1], src[4], src[4]): the backward then holds dQ,
 * dK and dV in bf16, (3 hd T / 2, 1, BH) floats (th_cuda_mark_precision). */
static inline int th_attention_cudnn(const struct ggml_tensor * fwd) {
#ifdef TH_CUDNN_ATTENTION
    if (fwd == NULL || th_kernel_of(fwd) != TH_CUDA_ATTN_FWD || th_precision_of(fwd) != TH_PRECISION_BF16 ||
        TH_CUDNN_MODE == TH_CUDNN_OFF) {
        return 0;
    }
    th_attention_params ap;
    memcpy(&ap, (const char *) fwd->op_params + 2 * sizeof(int32_t), sizeof(ap));
    if ((ap.hd != 32 && ap.hd != 64) || ap.T % 8 != 0 || th_attention_has_dropout(&ap) ||   /* our stream's masks */
        ap.causal == TH_ATTENTION_PACKED) {                                                /* our bounds */
        return 0;
    }
    for (int j = 0; j < 3; j++) {    /* all three bf16 (read in place) or all f32 (narrowed) */
        if (fwd->src[j] == NULL || fwd->src[j]->type != fwd->src[0]->type) return 0;
    }
    return fwd->src[0]->type == GGML_TYPE_BF16 || fwd->src[0]->type == GGML_TYPE_F32;
#else
    (void) fwd;
    return 0;
#endif
}
