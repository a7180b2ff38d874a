/* toyharness frozen products' dequantization: rows of a quantized or f16 weight to f32, the same
 * values as ggml's own `to_float`, faster.
 *
 * ggml-base (where `to_float` lives) is built for the baseline ISA (SSE2), and several of its
 * loops stay scalar there: on this project's Zen 4 VM, one thread, q4_0 2.2, q4_1 1.7, q5_0 and
 * q5_1 1.2, q6_K 1.0 and f16 1.0 Gfloat/s (q8_0 8.4, q4_K 6.7, q5_K 5.0 and bf16 13.9 vectorise
 * and are left to ggml). The frozen products dequantize a weight up to three times a step, so for
 * SmolLM2's Q4_1 layers that was ~3% of a LoRA step. Here the same arithmetic, written per block
 * so that the compiler vectorises it at the build's SIMD level (CMakeLists.txt builds this file
 * with the kernels' flags).
 *
 * The values are ggml's bit for bit (tests/test_cpu_kernels.py compares every type on random
 * blocks): each is the same float operations in the same order, and a fused multiply-add (this
 * file is built with the kernels' -march, ggml-base without) cannot move them: q * d, an integer
 * of at most 6 bits times an fp16 scale, is exact in float, so q * d + m rounds once either way;
 * q6_K's (d * sc) * q is two products, as ggml makes them. The fp16 conversions are exact. */
#include <stdint.h>
#include <string.h>

#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml.h"
#include "ggml-impl.h"
#include "cpu_kernels.h"

#define TH_EXPORT __attribute__((visibility("default")))

#if defined(__F16C__)
#include <immintrin.h>
#endif

static void th_dq_q4_0(const block_q4_0 * restrict x, float * restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK4_0) {
        const float d = GGML_FP16_TO_FP32(x[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = (float) ((x[i].qs[j] & 0x0F) - 8) * d;
            y[j + QK4_0 / 2] = (float) ((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void th_dq_q4_1(const block_q4_1 * restrict x, float * restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK4_1) {
        const float d = GGML_FP16_TO_FP32(x[i].d), m = GGML_FP16_TO_FP32(x[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            y[j] = (float) (x[i].qs[j] & 0x0F) * d + m;
            y[j + QK4_1 / 2] = (float) (x[i].qs[j] >> 4) * d + m;
        }
    }
}

/* q5_0 / q5_1: the fifth bits of the 32 values, bit j of qh for value j */
static void th_dq_q5(const uint8_t * restrict qs, const uint8_t * restrict qh_bytes, float d, float m, int offset,
                     int with_min, float * restrict y) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof(qh));
    for (int j = 0; j < 16; j++) {
        const int x0 = ((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - offset;
        const int x1 = ((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - offset;
        y[j] = with_min ? (float) x0 * d + m : (float) x0 * d;
        y[j + 16] = with_min ? (float) x1 * d + m : (float) x1 * d;
    }
}

static void th_dq_q6_K(const block_q6_K * restrict x, float * restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        const float d = GGML_FP16_TO_FP32(x[i].d);
        const uint8_t * restrict ql = x[i].ql;
        const uint8_t * restrict qh = x[i].qh;
        const int8_t * restrict sc = x[i].scales;
        for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int half = 0; half < 2; half++) {     /* l in [0, 16) then [16, 32): its scales are sc[is + ...] */
                const float s0 = d * sc[half], s2 = d * sc[half + 2], s4 = d * sc[half + 4], s6 = d * sc[half + 6];
                for (int l = half * 16; l < half * 16 + 16; l++) {
                    const int q1 = (int8_t) ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int8_t) ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int8_t) ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int8_t) ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = s0 * (float) q1;
                    y[l + 32] = s2 * (float) q2;
                    y[l + 64] = s4 * (float) q3;
                    y[l + 96] = s6 * (float) q4;
                }
            }
        }
    }
}

static void th_dq_f16(const ggml_fp16_t * restrict x, float * restrict y, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {        /* the conversion is exact: the same floats as ggml's */
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i))));
    }
#endif
    for (; i < n; i++) y[i] = GGML_FP16_TO_FP32(x[i]);
}

/* n values of one row of type `type` at src into dst; 0 when the type is not one of these
 * (the caller then takes ggml's to_float) */
int th_fast_dequantize_row(enum ggml_type type, const void * src, float * dst, int64_t n) {
    switch (type) {
        case GGML_TYPE_Q4_0: th_dq_q4_0((const block_q4_0 *) src, dst, n / QK4_0); return 1;
        case GGML_TYPE_Q4_1: th_dq_q4_1((const block_q4_1 *) src, dst, n / QK4_1); return 1;
        case GGML_TYPE_Q5_0: {
            const block_q5_0 * x = (const block_q5_0 *) src;
            for (int64_t i = 0; i < n / QK5_0; i++) th_dq_q5(x[i].qs, x[i].qh, GGML_FP16_TO_FP32(x[i].d), 0.0f, 16, 0, dst + i * QK5_0);
            return 1;
        }
        case GGML_TYPE_Q5_1: {
            const block_q5_1 * x = (const block_q5_1 *) src;
            for (int64_t i = 0; i < n / QK5_1; i++) {
                th_dq_q5(x[i].qs, x[i].qh, GGML_FP16_TO_FP32(x[i].d), GGML_FP16_TO_FP32(x[i].m), 0, 1, dst + i * QK5_1);
            }
            return 1;
        }
        case GGML_TYPE_Q6_K: th_dq_q6_K((const block_q6_K *) src, dst, n / QK_K); return 1;
        case GGML_TYPE_F16: th_dq_f16((const ggml_fp16_t *) src, dst, n); return 1;
        default: return 0;
    }
}

/* For the tests: a row through this file (fast = 1) or through ggml's to_float (fast = 0);
 * returns 0 when fast is asked of a type this file leaves to ggml. */
TH_EXPORT int th_dequantize_row(int type, const void * src, float * dst, int64_t n, int fast) {
    if (fast) return th_fast_dequantize_row((enum ggml_type) type, src, dst, n);
    ggml_get_type_traits((enum ggml_type) type)->to_float(src, dst, n);
    return 1;
}
