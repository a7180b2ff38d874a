/* Dropout's mask node (dropout_mask.h holds the stream): a GGML_OP_CUSTOM node whose only source
 * is the program's fed key (i32[4]), so ggml's autograd makes no gradient for it; a Tensor's
 * dropout is x * mask, whose MUL backward is dy * mask. The cpu backend computes it here in the
 * fast and the portable mode alike (integer arithmetic: the same bits on any CPU); the cuda
 * rewrite marks it for cuda/th-custom.cu's kernel of the same stream. */
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h" /* struct ggml_custom_op_params */
#include "cpu_kernels.h"
#include "dropout_mask.h"

#define TH_EXPORT __attribute__((visibility("default")))

enum { TH_DROPOUT_TASK_BLOCKS = 1024 };    /* 4096 elements a task: the cut follows the shape alone */
enum { TH_DROPOUT_LANES = 16 };            /* blocks computed side by side: each round one vector op */

/* blocks [b0, b0 + TH_DROPOUT_LANES) into y (4 elements each): th_dropout_block's arithmetic with
 * the blocks as lanes (the compiler makes each round a few vector products), the same words */
static void th_dropout_lanes(float * restrict y, uint64_t b0, const int32_t key[TH_DROPOUT_KEY_WORDS],
                             th_dropout_params p) {
    uint32_t c0[TH_DROPOUT_LANES], c1[TH_DROPOUT_LANES], c2[TH_DROPOUT_LANES], c3[TH_DROPOUT_LANES];
    for (int l = 0; l < TH_DROPOUT_LANES; l++) {
        c0[l] = (uint32_t) (b0 + l), c1[l] = (uint32_t) ((b0 + l) >> 32), c2[l] = p.node, c3[l] = (uint32_t) key[2];
    }
    uint32_t k0 = (uint32_t) key[0], k1 = (uint32_t) key[1];
    for (int r = 0; r < 10; r++) {
#pragma omp simd
        for (int l = 0; l < TH_DROPOUT_LANES; l++) {
            const uint64_t p0 = (uint64_t) 0xD2511F53u * c0[l], p1 = (uint64_t) 0xCD9E8D57u * c2[l];
            const uint32_t n0 = (uint32_t) (p1 >> 32) ^ c1[l] ^ k0, n2 = (uint32_t) (p0 >> 32) ^ c3[l] ^ k1;
            c0[l] = n0, c1[l] = (uint32_t) p1, c2[l] = n2, c3[l] = (uint32_t) p0;
        }
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
    for (int l = 0; l < TH_DROPOUT_LANES; l++) {
        y[4 * l + 0] = (uint64_t) c0[l] < p.threshold ? p.kept : 0.0f;
        y[4 * l + 1] = (uint64_t) c1[l] < p.threshold ? p.kept : 0.0f;
        y[4 * l + 2] = (uint64_t) c2[l] < p.threshold ? p.kept : 0.0f;
        y[4 * l + 3] = (uint64_t) c3[l] < p.threshold ? p.kept : 0.0f;
    }
}

th_dropout_params th_dropout_params_of(const struct ggml_tensor * t, int slot) {
    return th_dropout_params_from(t->op_params + slot);
}

void th_dropout_params_set(struct ggml_tensor * t, int slot, th_dropout_params p) {
    int32_t w[4] = {(int32_t) p.node, (int32_t) (uint32_t) p.threshold, (int32_t) (uint32_t) (p.threshold >> 32), 0};
    memcpy(&w[3], &p.kept, sizeof(float));
    memcpy(t->op_params + slot, w, sizeof(w));
}

void th_dropout_mask_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const th_dropout_params p = th_dropout_params_of(dst, TH_DROPOUT_SLOT);
    int32_t key[TH_DROPOUT_KEY_WORDS];
    memcpy(key, dst->src[0]->data, sizeof(key));
    float * y = (float *) dst->data;
    const int64_t n = ggml_nelements(dst), blocks = (n + 3) / 4;
    const int64_t tasks = (blocks + TH_DROPOUT_TASK_BLOCKS - 1) / TH_DROPOUT_TASK_BLOCKS;
    int64_t taken = 0;
    for (int64_t task; (task = th_next_task(tasks, ith, nth, &taken)) >= 0;) {
        const int64_t b1 = (task + 1) * TH_DROPOUT_TASK_BLOCKS < blocks ? (task + 1) * TH_DROPOUT_TASK_BLOCKS : blocks;
        int64_t b = task * TH_DROPOUT_TASK_BLOCKS;
        if (key[3] != 0) {       /* whole vectors of blocks whose 4 elements all exist */
            for (; b + TH_DROPOUT_LANES <= b1 && 4 * (b + TH_DROPOUT_LANES) <= n; b += TH_DROPOUT_LANES) {
                th_dropout_lanes(y + 4 * b, (uint64_t) b, key, p);
            }
        }
        for (; b < b1; b++) {
            float out[4];
            th_dropout_block(out, (uint64_t) b, key, p);
            const int64_t m = n - 4 * b < 4 ? n - 4 * b : 4;
            for (int64_t j = 0; j < m; j++) y[4 * b + j] = out[j];
        }
    }
}

/* whether t is a mask node made by th_dropout_mask */
int th_is_dropout_mask(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_CUSTOM) return 0;
    struct ggml_custom_op_params q;
    memcpy(&q, t->op_params, sizeof(q));
    return q.fun == th_dropout_mask_op;
}

/* A mask node of shape ne (f32, contiguous) read from `key` (i32[4], the program's fed key):
 * element i is p.kept or 0 by the stream, or 1 where the key is not enabled. NULL for a key that
 * is not i32[4]. */
TH_EXPORT struct ggml_tensor * th_dropout_mask(struct ggml_context * ctx, struct ggml_tensor * key, int64_t ne0,
                                               int64_t ne1, int64_t ne2, int64_t ne3, uint32_t node,
                                               uint64_t threshold, float kept) {
    if (key == NULL || key->type != GGML_TYPE_I32 || ggml_nelements(key) != TH_DROPOUT_KEY_WORDS ||
        !ggml_is_contiguous(key) || threshold > ((uint64_t) 1 << 32)) {
        return NULL;
    }
    struct ggml_tensor * args[1] = {key};
    struct ggml_tensor * t = ggml_custom_4d(ctx, GGML_TYPE_F32, ne0, ne1, ne2, ne3, args, 1, th_dropout_mask_op,
                                            GGML_N_TASKS_MAX, NULL);
    const th_dropout_params p = {node, threshold, kept};
    th_dropout_params_set(t, TH_DROPOUT_SLOT, p);
    return t;
}

/* the stream's 4 words of block b (tests hold them to the numpy reference and Random123's answers) */
TH_EXPORT void th_philox4x32_10_block(uint32_t c[4], uint32_t k0, uint32_t k1) { th_philox4x32_10(c, k0, k1); }
