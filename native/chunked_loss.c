/* toyharness chunked cross-entropy: the loss of a frozen output projection over a large vocabulary
 * without its (rows x vocab) logits.
 *
 * The standard loss (Program.cross_entropy) holds the logits, the one-hot targets, the softmax of
 * the reported loss and the logits' gradient: four (rows x vocab) f32 buffers, 4 GiB for Gemma 3's
 * 262,144 classes at 1,024 rows. Here the vocabulary is cut into C chunks (fixed by the shape) and
 * each chunk's logits exist only a tile (TH_CE_TILE classes x rows) at a time, in a per-thread
 * buffer, in one pass over the output weight W (an online softmax, as flash attention's):
 *   chunks  (d + 3, R, C)  per row and chunk: acc = sum over the chunk's classes v of
 *                          exp(z_v - m) W_v (d values), then the running max m, the sum of
 *                          exp(z_v - m) and the target's logit. A tile whose max raises m scales
 *                          the row's acc and sum by exp(m_old - m) first.
 *   loss    (R,)           per row: logsumexp - target logit (times the mask; 0 where it is 0)
 *   grad    (d, R)         dL/dh = (sum over chunks, in chunk order, of acc exp(m - lse) - W_target)
 *                          times mask / count
 * Two products over W per step (the logits, then acc), as the standard loss's forward and
 * backward; a tile's logits never leave the thread's cache. ggml's autodiff never sees these
 * nodes: they read the hidden rows through an i32 copy (`detach`; ggml takes no gradient through
 * an i32 node), and the Python side trains on sum(h * grad), whose gradient in h is `grad` exactly
 * (Program.chunked_cross_entropy). Every task is a chunk or a block of rows, fixed by the shapes,
 * so bits never depend on the thread count.
 */
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h"
#include "cpu_kernels.h"

#define TH_EXPORT __attribute__((visibility("default")))

enum { TH_CE_TILE = 256, TH_CE_MAX_CHUNKS = 16, TH_CE_STATS = 3 };

/* per-thread buffers: a dequantized tile of W (TH_CE_TILE x d) and its logits (R x TH_CE_TILE) */
static _Thread_local float * th_ce_buf = NULL;
static _Thread_local size_t th_ce_cap = 0;

static float * th_ce_scratch(size_t n) {
    if (n > th_ce_cap) {
        free(th_ce_buf);
        th_ce_buf = (float *) aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
        th_ce_cap = th_ce_buf != NULL ? n : 0;
    }
    return th_ce_buf;
}

static int64_t th_ce_chunk_size(int64_t vocab, int64_t chunks) {
    const int64_t per = (vocab + chunks - 1) / chunks;
    return (per + TH_CE_TILE - 1) / TH_CE_TILE * TH_CE_TILE;
}

/* the logits of rows [0, R) against W's rows [v0, v0 + n): z (R x TH_CE_TILE), tile (n x d) */
static void th_ce_logits(const struct ggml_tensor * h, const struct ggml_tensor * w, int64_t v0, int64_t n,
                         float * tile, float * z) {
    const int64_t d = w->ne[0], R = h->ne[1];
    th_dequantize(w, v0, n, 0, d, tile);
    th_frozen_gemm(0, 1, R, n, d, (const float *) h->data, (int64_t) (h->nb[1] / sizeof(float)), tile, d, 0.0f, z,
                   TH_CE_TILE);
}

/* detach: the hidden rows' bytes into an i32 tensor of the same shape */
static void th_ce_detach_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * h = dst->src[0];
    const int64_t R = h->ne[1], row = h->ne[0] * (int64_t) sizeof(float);
    int64_t taken = 0, r0, r1;
    while (th_next_rows(R, h->ne[0], ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) memcpy((char *) dst->data + r * dst->nb[1], (const char *) h->data + r * h->nb[1], row);
    }
}

/* row r of chunk c of a chunks tensor: acc (d values), then m, sum, target logit */
static inline float * th_ce_row(const struct ggml_tensor * chunks, int64_t c, int64_t r) {
    return (float *) ((char *) chunks->data + c * chunks->nb[2] + r * chunks->nb[1]);
}

/* chunks: srcs (hidden as i32, W, ids); dst (d + 3, R, C). One task a chunk: its tiles in order. */
static void th_ce_chunk_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * h = dst->src[0], * w = dst->src[1], * ids = dst->src[2];
    const int64_t d = w->ne[0], V = w->ne[1], R = h->ne[1], C = dst->ne[2], cs = th_ce_chunk_size(V, C);
    const int64_t ld = (int64_t) (dst->nb[1] / sizeof(float));
    const int32_t * id = (const int32_t *) ids->data;
    float * tile = th_ce_scratch((size_t) TH_CE_TILE * d + (size_t) R * TH_CE_TILE), * z = tile + TH_CE_TILE * d;
    int64_t taken = 0;
    for (int64_t c; (c = th_next_task(C, ith, nth, &taken)) >= 0;) {
        float * out = th_ce_row(dst, c, 0);
        for (int64_t r = 0; r < R; r++) {
            float * row = out + r * ld;
            memset(row, 0, (size_t) d * sizeof(float));
            row[d] = -INFINITY;
            row[d + 1] = 0.0f;
            row[d + 2] = 0.0f;
        }
        const int64_t end = (c + 1) * cs < V ? (c + 1) * cs : V;
        for (int64_t v0 = c * cs; v0 < end; v0 += TH_CE_TILE) {
            const int64_t n = end - v0 < TH_CE_TILE ? end - v0 : TH_CE_TILE;
            th_ce_logits(h, w, v0, n, tile, z);
            for (int64_t r = 0; r < R; r++) {
                float * zr = z + r * TH_CE_TILE, * row = out + r * ld;
                float top = zr[0];
                for (int64_t j = 1; j < n; j++) top = zr[j] > top ? zr[j] : top;
                if (top > row[d]) {
                    if (row[d] != -INFINITY) {      /* before the first tile acc and sum are 0 */
                        const float scale = expf(row[d] - top);
                        for (int64_t k = 0; k < d; k++) row[k] *= scale;
                        row[d + 1] *= scale;
                    }
                    row[d] = top;
                }
                if (id[r] >= v0 && id[r] < v0 + n) row[d + 2] = zr[id[r] - v0];
                row[d + 1] += th_exp_row(zr, zr, n, row[d]);
            }
            /* acc += exp(z - m) . W's tile */
            th_frozen_gemm(0, 0, R, d, n, z, TH_CE_TILE, tile, d, 1.0f, out, ld);
        }
    }
}

/* a row's logsumexp from its chunks' (max, sum), in chunk order */
static float th_ce_lse(const struct ggml_tensor * chunks, int64_t r) {
    const int64_t C = chunks->ne[2], d = chunks->ne[0] - TH_CE_STATS;
    float top = th_ce_row(chunks, 0, r)[d];
    for (int64_t c = 1; c < C; c++) top = th_ce_row(chunks, c, r)[d] > top ? th_ce_row(chunks, c, r)[d] : top;
    float sum = 0.0f;
    for (int64_t c = 0; c < C; c++) sum += th_ce_row(chunks, c, r)[d + 1] * expf(th_ce_row(chunks, c, r)[d] - top);
    return top + logf(sum);
}

/* loss: srcs (chunks[, mask]); dst (R,). The target's logit is in its chunk's slot, the others
 * hold 0, so their sum is that logit exactly. */
static void th_ce_loss_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * chunks = dst->src[0], * mask = dst->src[1];
    const int64_t C = chunks->ne[2], R = chunks->ne[1], d = chunks->ne[0] - TH_CE_STATS;
    int64_t taken = 0, r0, r1;
    while (th_next_rows(R, C * TH_CE_STATS, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            float target = 0.0f;
            for (int64_t c = 0; c < C; c++) target += th_ce_row(chunks, c, r)[d + 2];
            const float m = mask != NULL ? ((const float *) mask->data)[r] : 1.0f;
            ((float *) dst->data)[r] = m != 0.0f ? (th_ce_lse(chunks, r) - target) * m : 0.0f;
        }
    }
}

/* grad: srcs (chunks, W, ids, count[, mask]); dst (d, R): per row, its chunks' acc, each times
 * exp(m - lse), summed in chunk order, less the target's row of W; times mask / count */
static void th_ce_grad_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * chunks = dst->src[0], * w = dst->src[1], * ids = dst->src[2], * mask = dst->src[4];
    const int64_t d = dst->ne[0], R = dst->ne[1], C = chunks->ne[2];
    const float inv_count = 1.0f / *(const float *) dst->src[3]->data;
    const int32_t * id = (const int32_t *) ids->data;
    const int64_t blck = ggml_blck_size(w->type);
    /* the target's row of W, dequantized whole (a row is whole blocks) */
    float * target = th_ce_scratch((size_t) ((d + blck - 1) / blck * blck));
    int64_t taken = 0, r0, r1;
    while (th_next_rows(R, d, ith, nth, &taken, &r0, &r1)) {
        for (int64_t r = r0; r < r1; r++) {
            float * g = (float *) ((char *) dst->data + r * dst->nb[1]);
            const float weight = (mask != NULL ? ((const float *) mask->data)[r] : 1.0f) * inv_count;
            if (weight == 0.0f) {
                memset(g, 0, (size_t) d * sizeof(float));
                continue;
            }
            const float lse = th_ce_lse(chunks, r);
            for (int64_t c = 0; c < C; c++) {
                const float * acc = th_ce_row(chunks, c, r);
                const float f = expf(acc[d] - lse);
                if (c == 0) {
                    for (int64_t k = 0; k < d; k++) g[k] = acc[k] * f;
                } else {
                    for (int64_t k = 0; k < d; k++) g[k] += acc[k] * f;
                }
            }
            th_dequantize(w, id[r], 1, 0, d, target);
            for (int64_t k = 0; k < d; k++) g[k] = (g[k] - target[k]) * weight;
        }
    }
}

/* For `bench --profile` and the FLOP count: "chunked_loss" and the FLOPs of the two products it
 * makes over W (the logits, then acc: 2 x 2 x R x V x d) when t is the chunks node; NULL and 0
 * otherwise (the loss and grad nodes are per-row sums). */
const char * th_chunked_loss_kernel_name(const struct ggml_tensor * t, double * flops) {
    if (t->op != GGML_OP_CUSTOM) return NULL;
    struct ggml_custom_op_params p;
    memcpy(&p, t->op_params, sizeof(p));
    if (p.fun != th_ce_chunk_op) return NULL;
    const struct ggml_tensor * w = t->src[1];
    *flops = 4.0 * (double) t->ne[1] * (double) w->ne[1] * (double) w->ne[0];
    return "chunked_loss";
}

/* The chunked loss of `logits`, which must be a product (MUL_MAT, under reshapes) of a frozen
 * weight W (f32 or a frozen type, contiguous, not a parameter) and f32 hidden rows h (d, R) with
 * contiguous rows; ids: i32 (R,) targets; mask: f32 (R,) or NULL; count: f32 (1,) the number of
 * counted rows. Sets *hidden = h, *grad = dL/dh (d, R), *row_loss = (R,); returns 0, or -1 with
 * `why` filled when logits is not such a product (nothing is added to the context then). */
TH_EXPORT int th_chunked_cross_entropy(struct ggml_context * ctx, struct ggml_tensor * logits, struct ggml_tensor * ids,
                                       struct ggml_tensor * mask, struct ggml_tensor * count,
                                       struct ggml_tensor ** hidden, struct ggml_tensor ** grad,
                                       struct ggml_tensor ** row_loss, char * why, int why_len) {
    struct ggml_tensor * t = logits;
    while (t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW) t = t->src[0];
    if (t->op != GGML_OP_MUL_MAT) {
        snprintf(why, why_len, "the logits are not a product of the hidden rows and an output weight (%s)",
                 ggml_op_desc(t));
        return -1;
    }
    struct ggml_tensor * w = t->src[0], * h = t->src[1];
    if (w->flags & GGML_TENSOR_FLAG_PARAM) {
        snprintf(why, why_len, "the output weight %s trains (the chunked loss takes a frozen one)", w->name);
        return -1;
    }
    if ((w->type != GGML_TYPE_F32 && !th_frozen_type_ok(w->type)) || !ggml_is_contiguous(w) || w->ne[2] != 1 ||
        w->ne[3] != 1) {
        snprintf(why, why_len, "the output weight %s (%s) is not a contiguous matrix of a frozen type", w->name,
                 ggml_type_name(w->type));
        return -1;
    }
    if (h->type != GGML_TYPE_F32 || h->nb[0] != sizeof(float) || h->ne[2] != 1 || h->ne[3] != 1 ||
        h->ne[1] > INT32_MAX || w->ne[0] > INT32_MAX) {
        snprintf(why, why_len, "the hidden rows %s are not an f32 matrix with contiguous rows", h->name);
        return -1;
    }
    const int64_t d = w->ne[0], V = w->ne[1], R = h->ne[1];
    if (ggml_nelements(ids) != R || ids->type != GGML_TYPE_I32 || !ggml_is_contiguous(ids) ||
        (mask != NULL && (ggml_nelements(mask) != R || mask->type != GGML_TYPE_F32 || !ggml_is_contiguous(mask))) ||
        ggml_nelements(count) != 1 || count->type != GGML_TYPE_F32) {
        snprintf(why, why_len, "targets, mask or count do not fit %lld rows", (long long) R);
        return -1;
    }
    int64_t C = (V + TH_CE_TILE - 1) / TH_CE_TILE;
    C = C < TH_CE_MAX_CHUNKS ? C : TH_CE_MAX_CHUNKS;
    const int64_t cs = th_ce_chunk_size(V, C);
    C = (V + cs - 1) / cs;
    struct ggml_tensor * args[5] = {h};
    struct ggml_tensor * detached = ggml_custom_4d(ctx, GGML_TYPE_I32, d, R, 1, 1, args, 1, th_ce_detach_op,
                                                   GGML_N_TASKS_MAX, NULL);
    args[0] = detached, args[1] = w, args[2] = ids;
    struct ggml_tensor * chunks = ggml_custom_4d(ctx, GGML_TYPE_F32, d + TH_CE_STATS, R, C, 1, args, 3,
                                                 th_ce_chunk_op, GGML_N_TASKS_MAX, NULL);
    struct ggml_tensor * loss_args[2] = {chunks, mask};
    *row_loss = ggml_custom_4d(ctx, GGML_TYPE_F32, R, 1, 1, 1, loss_args, mask != NULL ? 2 : 1, th_ce_loss_op,
                               GGML_N_TASKS_MAX, NULL);
    args[0] = chunks, args[1] = w, args[2] = ids, args[3] = count, args[4] = mask;
    *grad = ggml_custom_4d(ctx, GGML_TYPE_F32, d, R, 1, 1, args, mask != NULL ? 5 : 4, th_ce_grad_op,
                           GGML_N_TASKS_MAX, NULL);
    *hidden = h;
    ggml_set_name(detached, "chunked_ce.detached");
    ggml_set_name(chunks, "chunked_ce.chunks");
    ggml_set_name(*row_loss, "chunked_ce.row_loss");
    ggml_set_name(*grad, "chunked_ce.grad");
    return 0;
}
