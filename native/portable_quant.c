/* toyharness portable dequantization (see portable_quant.h).
 *
 * Each value is the float32 operation sequence gguf-py's numpy dequantizer spells
 * (gguf/quants.py): Q4_1 d q + m, Q4_K (d sc) q - (dmin m), each product and sum rounded on
 * its own. This file is built with -ffp-contract=off and no fast-math (CMakeLists.txt), so no
 * multiply-add is fused on any CPU. (In the formats with an add, Q4_1, Q5_1, Q4_K and Q5_K, the
 * product before it has at most 22 significant bits and is exact, so a fused multiply-add would
 * round the same; ggml's to_float, C that a compiler may contract per build, is left out all the
 * same: the portable mode's bits then depend on no code outside this project.)
 * tests/test_portable_quant.py checks every type bit for bit against gguf-py.
 *
 * Block layouts are ggml's (ggml-common.h), read byte by byte (little-endian, as GGUF files
 * are): QK_K = 256 values in 8 sub-blocks of 32 with 6-bit scales for the K-quants. No ggml
 * in it: portable_selftest.c prints its bits on other CPUs too.
 */
#include "portable_quant.h"

#include <string.h>

enum { TP_QK = 32, TP_QK_K = 256 };

/* IEEE-754 binary16 -> binary32, exact (subnormals, infinities and NaNs included) */
static float tp_half(const uint8_t * p) {
    const uint32_t h = (uint32_t) p[0] | (uint32_t) p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | mant << 13;
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | mant << 13;
    } else if (mant == 0) {
        bits = sign;
    } else {                     /* subnormal: shift the leading 1 into the implicit bit */
        uint32_t e = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        bits = sign | e << 23 | (mant & 0x3FFu) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static float tp_bf16(const uint8_t * p) {
    const uint32_t bits = ((uint32_t) p[0] | (uint32_t) p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* Q4_0, Q4_1, Q5_0, Q5_1: 32 values; value j < 16 is byte j's low nibble, j + 16 its high one,
 * the 5th bit is bit j of the little-endian 32-bit qh. y = d (q - offset), or d q + m. */
static void tp_block_32(int type, const uint8_t * b, float * y) {
    const int has_min = type == TP_TYPE_Q4_1 || type == TP_TYPE_Q5_1;
    const int five = type == TP_TYPE_Q5_0 || type == TP_TYPE_Q5_1;
    const float d = tp_half(b), m = has_min ? tp_half(b + 2) : 0.0f;
    const uint8_t * p = b + (has_min ? 4 : 2);
    uint32_t qh = 0;
    if (five) {
        qh = (uint32_t) p[0] | (uint32_t) p[1] << 8 | (uint32_t) p[2] << 16 | (uint32_t) p[3] << 24;
        p += 4;
    }
    const int offset = has_min ? 0 : five ? 16 : 8;
    for (int j = 0; j < TP_QK; j++) {
        int q = j < 16 ? p[j] & 0x0F : p[j - 16] >> 4;
        if (five) q |= (int) ((qh >> j) & 1u) << 4;
        y[j] = has_min ? d * (float) q + m : d * (float) (q - offset);
    }
}

/* Q4_K and Q5_K scale and min of sub-block j from the 12 packed bytes */
static void tp_scale_min_k4(int j, const uint8_t * s, int * sc, int * m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Q4_K (d, dmin, scales[12], qs[128]) and Q5_K (..., qh[32], qs[128]): value i of sub-block
 * j = i / 32 is the low (j even) or high (j odd) nibble of qs[32 (j / 2) + i % 32], plus for
 * Q5_K bit j of qh[i % 32] as the 5th bit; y = (d sc_j) q - (dmin m_j). */
static void tp_block_k45(int five, const uint8_t * b, float * y) {
    const float d = tp_half(b), dmin = tp_half(b + 2);
    const uint8_t * scales = b + 4, * qh = b + 16, * qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        tp_scale_min_k4(j, scales, &sc, &m);
        const float d1 = d * (float) sc, m1 = dmin * (float) m;
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
            if (five) q |= ((qh[l] >> j) & 1) << 4;
            y[32 * j + l] = d1 * (float) q - m1;
        }
    }
}

/* Q6_K (ql[128], qh[64], scales[16] int8, d): value i, h = i / 128, r = i % 128: low 4 bits
 * from ql[64 h + r % 64] (high nibble when r >= 64), 2 high bits (qh[32 h + r % 32] >> 2 (r / 32))
 * & 3, minus 32; y = (d scale[i / 16]) q. */
static void tp_block_q6_k(const uint8_t * b, float * y) {
    const uint8_t * ql = b, * qh = b + 128;
    const int8_t * scales = (const int8_t *) (b + 192);
    const float d = tp_half(b + 208);
    for (int i = 0; i < TP_QK_K; i++) {
        const int h = i / 128, r = i % 128;
        const int lo = (ql[64 * h + r % 64] >> (r >= 64 ? 4 : 0)) & 0x0F;
        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        y[i] = (d * (float) scales[i / 16]) * (float) ((lo | hi << 4) - 32);
    }
}

int tp_quant_block(int type) {
    switch (type) {
        case TP_TYPE_F16: case TP_TYPE_BF16: return 1;
        case TP_TYPE_Q8_0: case TP_TYPE_Q4_0: case TP_TYPE_Q4_1: case TP_TYPE_Q5_0: case TP_TYPE_Q5_1:
            return TP_QK;
        case TP_TYPE_Q4_K: case TP_TYPE_Q5_K: case TP_TYPE_Q6_K: return TP_QK_K;
        default: return 0;
    }
}

int tp_quant_block_bytes(int type) {
    switch (type) {
        case TP_TYPE_F16: case TP_TYPE_BF16: return 2;
        case TP_TYPE_Q8_0: return 34;
        case TP_TYPE_Q4_0: return 18;
        case TP_TYPE_Q4_1: return 20;
        case TP_TYPE_Q5_0: return 22;
        case TP_TYPE_Q5_1: return 24;
        case TP_TYPE_Q4_K: return 144;
        case TP_TYPE_Q5_K: return 176;
        case TP_TYPE_Q6_K: return 210;
        default: return 0;
    }
}

void tp_dequantize(int type, const void * src, float * dst, int64_t n) {
    const int block = tp_quant_block(type), bytes = tp_quant_block_bytes(type);
    const uint8_t * b = (const uint8_t *) src;
    for (int64_t i = 0; i + block <= n; i += block, b += bytes) {
        float * y = dst + i;
        switch (type) {
            case TP_TYPE_F16: *y = tp_half(b); break;
            case TP_TYPE_BF16: *y = tp_bf16(b); break;
            case TP_TYPE_Q8_0: {
                const float d = tp_half(b);
                for (int j = 0; j < TP_QK; j++) y[j] = (float) (int8_t) b[2 + j] * d;
                break;
            }
            case TP_TYPE_Q4_K: case TP_TYPE_Q5_K: tp_block_k45(type == TP_TYPE_Q5_K, b, y); break;
            case TP_TYPE_Q6_K: tp_block_q6_k(b, y); break;
            default: tp_block_32(type, b, y); break;
        }
    }
}

/* For the tests: n values of `type` from src into dst; -1 (nothing written) for a type not
 * read here or an n that is not a whole number of blocks. */
__attribute__((visibility("default"))) int th_portable_dequantize(int type, const void * src, float * dst, int64_t n) {
    const int block = tp_quant_block(type);
    if (block == 0 || n < 0 || n % block != 0) return -1;
    tp_dequantize(type, src, dst, n);
    return 0;
}
