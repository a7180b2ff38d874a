/* Dropout's mask stream (toyharness/engine/dropout.py is the numpy reference; docs/design.md,
 * "Dropout"): element i of a mask node keyed by (seed, forward index, node) is kept iff
 * u < threshold, u = Philox4x32-10 (Salmon et al. 2011; Random123's constants and round order)
 * of counter (i / 4 low word, i / 4 high word, node, forward index) under key (seed low word,
 * seed high word), word i % 4. Kept: the value 1 / (1 - p) as float32, dropped 0, a key whose
 * `enabled` word is 0 (evaluation): 1. Integer arithmetic only, so every backend and CPU makes
 * the same bits. Plain C that nvcc compiles too (TH_DROPOUT_FN). */
#ifndef TH_DROPOUT_MASK_H
#define TH_DROPOUT_MASK_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TH_DROPOUT_FN static __host__ __device__ __forceinline__
#else
#define TH_DROPOUT_FN static inline
#endif

/* op_params slots (int32) of a mask node after the custom op's own (cpu, portable: slots 0-5 hold
 * ggml_custom_op_params; cuda: 0-1 hold the mark): node id, threshold's low and high words,
 * the kept value's float bits */
enum { TH_DROPOUT_SLOT = 8, TH_DROPOUT_CUDA_SLOT = 2 };
/* the fed key, i32[4]: seed's low and high words, forward index, enabled */
enum { TH_DROPOUT_KEY_WORDS = 4 };

typedef struct {
    uint32_t node;
    uint64_t threshold;       /* keep iff u < threshold, in [0, 2^32] */
    float kept;               /* 1 / (1 - p) rounded to float32 */
} th_dropout_params;

/* a mask node's parameters from its four op_params words at its slot (the layout above) */
TH_DROPOUT_FN th_dropout_params th_dropout_params_from(const int32_t w[4]) {
    th_dropout_params p;
    p.node = (uint32_t) w[0];
    p.threshold = (uint64_t) (uint32_t) w[1] | (uint64_t) (uint32_t) w[2] << 32;
    memcpy(&p.kept, &w[3], sizeof(float));
    return p;
}

TH_DROPOUT_FN void th_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; r++) {
        const uint64_t p0 = (uint64_t) 0xD2511F53u * c[0], p1 = (uint64_t) 0xCD9E8D57u * c[2];
        const uint32_t hi0 = (uint32_t) (p0 >> 32), lo0 = (uint32_t) p0;
        const uint32_t hi1 = (uint32_t) (p1 >> 32), lo1 = (uint32_t) p1;
        const uint32_t c1 = c[1], c3 = c[3];
        c[0] = hi1 ^ c1 ^ k0, c[1] = lo1, c[2] = hi0 ^ c3 ^ k1, c[3] = lo0;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
}

/* the mask's values for elements [4 b, 4 b + 4) (block b): out[j] for element 4 b + j */
TH_DROPOUT_FN void th_dropout_block(float out[4], uint64_t b, const int32_t key[TH_DROPOUT_KEY_WORDS],
                                    th_dropout_params p) {
    if (key[3] == 0) {
        out[0] = out[1] = out[2] = out[3] = 1.0f;
        return;
    }
    uint32_t c[4] = {(uint32_t) b, (uint32_t) (b >> 32), p.node, (uint32_t) key[2]};
    th_philox4x32_10(c, (uint32_t) key[0], (uint32_t) key[1]);
    for (int j = 0; j < 4; j++) out[j] = (uint64_t) c[j] < p.threshold ? p.kept : 0.0f;
}

#ifndef __CUDACC__
struct ggml_tensor;
/* dropout_mask.c: the cpu kernel (a ggml_custom_op_t), and a node's parameters at `slot` */
void th_dropout_mask_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);
int th_is_dropout_mask(const struct ggml_tensor * t);
th_dropout_params th_dropout_params_of(const struct ggml_tensor * t, int slot);
void th_dropout_params_set(struct ggml_tensor * t, int slot, th_dropout_params p);
#endif

#endif
