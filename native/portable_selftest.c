/* The portable math's bits, printed: built from portable_math.c and portable_quant.c alone (no ggml), for this CPU, for
 * other ISA levels, and cross-compiled for aarch64 and run under qemu (tests/test_portable_cross.py).
 * Every build must print tests/data/portable_selftest.txt exactly: the math functions, the
 * reductions, the matrix product and the dequantization of every frozen type give the same
 * float32 bits on every CPU.
 *
 *   cc -O3 -ffp-contract=off native/portable_selftest.c native/portable_math.c native/portable_quant.c \
 *       -o selftest && ./selftest
 *
 * Inputs come from an integer generator, so they are the same bits everywhere too. A line:
 * `<what> <index> <hex bits>`. */
#include <stdio.h>
#include <string.h>

#include "portable_math.h"
#include "portable_quant.h"

static uint32_t tp_state = 12345u;

/* uniform on [-scale, scale), from the top 24 bits of a 32-bit LCG (exact in float) */
static float tp_next(float scale) {
    tp_state = tp_state * 1664525u + 1013904223u;
    return ((float) (tp_state >> 8) * (1.0f / 8388608.0f) - 1.0f) * scale;
}

static void tp_print(const char * what, int i, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof(bits));
    printf("%s %d 0x%08x\n", what, i, bits);
}

enum { N_MATH = 160, M = 7, N = 9, K = 37, LONG = 1000, QUANT_BLOCKS = 3 };

/* QUANT_BLOCKS blocks of random bytes of each frozen type (256 values of f16 and bf16),
 * dequantized: one line per type with
 * a hash (FNV-1a) of all the values' bits and the first 4 values. The f16 scales are kept
 * finite (a NaN's payload is not portable through a product): the top exponent bit cleared. */
static void tp_print_dequantized(void) {
    static const struct { const char * name; int type, f16_at[2]; } types[] = {
        {"f16", TP_TYPE_F16, {-1, -1}}, {"bf16", TP_TYPE_BF16, {-1, -1}}, {"q8_0", TP_TYPE_Q8_0, {0, -1}},
        {"q4_0", TP_TYPE_Q4_0, {0, -1}}, {"q4_1", TP_TYPE_Q4_1, {0, 2}}, {"q5_0", TP_TYPE_Q5_0, {0, -1}},
        {"q5_1", TP_TYPE_Q5_1, {0, 2}}, {"q4_k", TP_TYPE_Q4_K, {0, 2}}, {"q5_k", TP_TYPE_Q5_K, {0, 2}},
        {"q6_k", TP_TYPE_Q6_K, {208, -1}},
    };
    static uint8_t raw[QUANT_BLOCKS * 256];
    static float y[QUANT_BLOCKS * 256];
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        const int block = tp_quant_block(types[t].type), bytes = tp_quant_block_bytes(types[t].type);
        const int blocks = block == 1 ? 256 : QUANT_BLOCKS, n = blocks * block;
        for (int k = 0; k < blocks * bytes; k++) {
            tp_state = tp_state * 1664525u + 1013904223u;
            raw[k] = (uint8_t) (tp_state >> 24);
        }
        for (int b = 0; b < blocks; b++) {
            for (int f = 0; f < 2; f++) {
                if (types[t].f16_at[f] >= 0) raw[b * bytes + types[t].f16_at[f] + 1] &= 0xBF;
            }
            if (block == 1) raw[b * bytes + 1] &= 0xBF;       /* f16 and bf16 values themselves */
        }
        tp_dequantize(types[t].type, raw, y, n);
        uint32_t hash = 2166136261u;
        for (int k = 0; k < n; k++) {
            uint32_t bits;
            memcpy(&bits, &y[k], sizeof(bits));
            for (int j = 0; j < 4; j++) hash = (hash ^ ((bits >> (8 * j)) & 0xFFu)) * 16777619u;
        }
        printf("dequantize_%s %d 0x%08x\n", types[t].name, n, hash);
        for (int k = 0; k < 4; k++) {
            char what[32];
            snprintf(what, sizeof(what), "dequantize_%s", types[t].name);
            tp_print(what, k, y[k]);
        }
    }
}

int main(void) {
    static const float edges[] = {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 88.72f, 88.73f, -87.3f, -103.9f, -104.0f, 1e-30f,
                                  1e-40f, 1e30f, 3.4e38f, 1.17549435e-38f, 0.6931472f, 1.5707964f, 3.1415927f,
                                  1e5f, 1.6e6f};
    const int n_edges = (int) (sizeof(edges) / sizeof(edges[0]));
    for (int i = 0; i < n_edges + N_MATH; i++) {
        /* edges, then exp's and silu's working range, log's positive range over many binades */
        const float x = i < n_edges ? edges[i] : tp_next(90.0f);
        const float pos = i < n_edges ? edges[i] : tp_next(1.0f) * tp_next(1.0f) * 1e3f + 1e-3f;
        float s, c;
        tp_print("exp", i, tp_expf(x));
        tp_print("log", i, tp_logf(pos < 0.0f ? -pos : pos));
        tp_sincosf(i < n_edges ? x : x * 40.0f, &s, &c);
        tp_print("sin", i, s);
        tp_print("cos", i, c);
        tp_print("silu", i, tp_silu(x / 8.0f));
        tp_print("silu_back", i, tp_silu_back(x / 8.0f, 0.75f));
    }
    static float a[LONG], b[LONG], y[LONG];
    for (int k = 0; k < LONG; k++) {
        a[k] = tp_next(1.0f);
        b[k] = tp_next(3.0f);
    }
    /* every length up to 2 TP_LANES + 3 (tails of every size), then long ones */
    for (int n = 0; n <= 2 * TP_LANES + 3; n++) {
        tp_print("dot", n, tp_dot(a, b, n));
        tp_print("sum", n, tp_sum(b, n));
        tp_print("max", n, tp_max(b, n));
    }
    tp_print("dot", LONG, tp_dot(a, b, LONG));
    tp_print("sum", LONG, tp_sum(b, LONG));
    static float ma[M * K], mb[N * K], mc[M * N];
    for (int k = 0; k < M * K; k++) ma[k] = tp_next(1.0f);
    for (int k = 0; k < N * K; k++) mb[k] = tp_next(1.0f);
    tp_matmul_nt(ma, K, mb, K, mc, N, M, N, K);
    for (int k = 0; k < M * N; k++) tp_print("matmul", k, mc[k]);
    tp_softmax_row(b, y, 61);
    for (int k = 0; k < 61; k++) tp_print("softmax", k, y[k]);
    tp_print_dequantized();
    return 0;
}
