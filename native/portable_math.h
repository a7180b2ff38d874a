/* toyharness portable math: the float32 arithmetic of the portable golden mode, with no ggml in it.
 *
 * Every function here gives the same bits on every CPU: it is plain C compiled with
 * -ffp-contract=off and without -ffast-math (CMakeLists.txt), so each output is the IEEE-754
 * sequence of operations the source spells, whatever SIMD the compiler uses; reductions run in a
 * fixed order (TP_LANES partial sums, combined in a fixed tree); exp, log, sin and cos are our
 * own polynomials, never libm's or a SIMD library's (sqrtf and division are correctly rounded by
 * IEEE-754, so they may stay). portable_kernels.c applies them to ggml's nodes;
 * portable_selftest.c prints their bits so that another CPU (or qemu) can be compared with them.
 */
#ifndef TOYHARNESS_PORTABLE_MATH_H
#define TOYHARNESS_PORTABLE_MATH_H

#include <stdint.h>

/* partial sums of a reduction: a constant of the algorithm, never the SIMD width */
enum { TP_LANES = 16 };

float tp_expf(float x);
float tp_logf(float x);
void tp_sincosf(float x, float * sin_out, float * cos_out);

/* sum_k a[k] b[k] and sum_k a[k]: TP_LANES partial sums, combined in a fixed tree, then the tail */
float tp_dot(const float * a, const float * b, int64_t n);
float tp_sum(const float * a, int64_t n);
float tp_max(const float * a, int64_t n);

/* c[m][n] = sum_k a[m][k] b[n][k] (tp_dot order), all row-major with leading dimensions */
void tp_matmul_nt(const float * a, int64_t lda, const float * b, int64_t ldb, float * c, int64_t ldc, int64_t m,
                  int64_t n, int64_t k);

/* y = softmax(x) of one row (x may be y): max, exp(x - max) summed by tp_sum's order, times 1/sum */
void tp_softmax_row(const float * x, float * y, int64_t n);

/* silu(x) = x / (1 + exp(-x)) and its derivative applied to dy */
float tp_silu(float x);
float tp_silu_back(float x, float dy);

#endif
