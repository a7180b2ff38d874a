/* toyharness portable math (see portable_math.h): built with -ffp-contract=off, no -ffast-math.
 * No libm call here: exp and log are float polynomials after an exact range reduction, sin and
 * cos double polynomials (double is IEEE-754 everywhere too), rounded to float once. */
#include <math.h>
#include <string.h>

#include "portable_math.h"

static inline float tp_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline uint32_t tp_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return bits;
}

/* ln 2 split: LN2_HI has 15 significant bits, so n * LN2_HI is exact for |n| < 2^9 */
#define TP_LN2_HI 0.693145752f
#define TP_LN2_LO 1.42860677e-6f

/* 2^k for k in [-126, 127], built from its bits */
static inline float tp_pow2(int32_t k) { return tp_from_bits((uint32_t) (k + 127) << 23); }

/* exp(x) = 2^n p(r): n = round(x / ln2) (the 1.5 * 2^23 trick rounds to nearest), r = x - n ln2
 * in two exact steps, |r| <= ln2 / 2; p the degree-7 Taylor polynomial (relative error below
 * 6e-9 there). 2^n is applied in two halves so that n = 128 and subnormal results stay right.
 * Not cpu_kernels.c's th_expf: that one's bits are the fast goldens' (built with contraction
 * allowed), and it flushes results below exp(-87) to zero. */
float tp_expf(float x) {
    if (x != x) return x;
    if (x > 88.7228394f) return INFINITY;
    if (x < -103.972084f) return 0.0f;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * TP_LN2_HI) - n * TP_LN2_LO;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t ni = (int32_t) n, n1 = ni / 2, n2 = ni - n1;
    return p * tp_pow2(n1) * tp_pow2(n2);
}

/* log(x) = e ln2 + log(m), x = 2^e m, m in (sqrt(1/2), sqrt(2)]; with f = m - 1 (exact) and
 * s = f / (2 + f): log(m) = 2 atanh(s) = f - s (f - s^2 P(s^2)), P the atanh series to s^10
 * (|s| <= 0.172: truncation below 1e-9 relative). Subnormals are scaled by 2^24 first. */
float tp_logf(float x) {
    if (x != x) return x;
    if (x < 0.0f) return NAN;
    if (x == 0.0f) return -INFINITY;
    if (x == INFINITY) return x;
    int32_t e = 0;
    if (x < 1.17549435e-38f) {
        x = x * 16777216.0f;
        e = -24;
    }
    const uint32_t bits = tp_bits(x);
    e += (int32_t) (bits >> 23) - 127;
    float m = tp_from_bits((bits & 0x7fffffu) | 0x3f800000u);
    if (m > 1.41421356f) {
        m = m * 0.5f;
        e += 1;
    }
    const float f = m - 1.0f, s = f / (2.0f + f), s2 = s * s;
    float p = 2.0f / 11.0f;
    p = p * s2 + 2.0f / 9.0f;
    p = p * s2 + 2.0f / 7.0f;
    p = p * s2 + 2.0f / 5.0f;
    p = p * s2 + 2.0f / 3.0f;
    const float log_m = f - s * (f - s2 * p);
    const float ef = (float) e;
    return ef * TP_LN2_HI + (log_m + ef * TP_LN2_LO);
}

/* sin and cos in double: k = round(x 2/pi), r = x - k pi/2 with pi/2 split in three (fdlibm's
 * 33-bit parts), Taylor polynomials on |r| <= pi/4 (error below 3e-14), the quadrant from k.
 * Defined for |x| < 2^23 (beyond, a float angle's spacing is a radian or more: both are NaN, as
 * for inf and NaN), so k always converts to an integer the same way on every CPU. */
void tp_sincosf(float xf, float * sin_out, float * cos_out) {
    const double x = xf;
    if (!(x > -8388608.0 && x < 8388608.0)) {  /* also inf and nan */
        *sin_out = *cos_out = NAN;
        return;
    }
    const double k = (x * 0.63661977236758134308 + 6755399441055744.0) - 6755399441055744.0;
    const double r = ((x - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) -
                     k * 2.02226624879595063154e-21;
    const double r2 = r * r;
    double ps = -1.0 / 6227020800.0;
    ps = ps * r2 + 1.0 / 39916800.0;
    ps = ps * r2 - 1.0 / 362880.0;
    ps = ps * r2 + 1.0 / 5040.0;
    ps = ps * r2 - 1.0 / 120.0;
    ps = ps * r2 + 1.0 / 6.0;
    const double s = r - r * r2 * ps;      /* r - r^3/6 + r^5/120 - ... */
    double pc = 1.0 / 87178291200.0;
    pc = pc * r2 - 1.0 / 479001600.0;
    pc = pc * r2 + 1.0 / 3628800.0;
    pc = pc * r2 - 1.0 / 40320.0;
    pc = pc * r2 + 1.0 / 720.0;
    pc = pc * r2 - 1.0 / 24.0;
    pc = pc * r2 + 0.5;
    const double c = 1.0 - r2 * pc;        /* 1 - r^2/2 + r^4/24 - ... */
    const int64_t q = (int64_t) k & 3;
    const double sv = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
    const double cv = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
    *sin_out = (float) sv;
    *cos_out = (float) cv;
}

/* the TP_LANES partial sums combined in a fixed tree: lane j + lane j + w, w = 8, 4, 2, 1 */
static inline float tp_combine(float * lane) {
    for (int w = TP_LANES / 2; w >= 1; w /= 2) {
        for (int j = 0; j < w; j++) lane[j] = lane[j] + lane[j + w];
    }
    return lane[0];
}

float tp_dot(const float * a, const float * b, int64_t n) {
    float lane[TP_LANES] = {0};
    int64_t k = 0;
    for (; k + TP_LANES <= n; k += TP_LANES) {
        for (int j = 0; j < TP_LANES; j++) lane[j] = lane[j] + a[k + j] * b[k + j];
    }
    float sum = tp_combine(lane);
    for (; k < n; k++) sum = sum + a[k] * b[k];
    return sum;
}

float tp_sum(const float * a, int64_t n) {
    float lane[TP_LANES] = {0};
    int64_t k = 0;
    for (; k + TP_LANES <= n; k += TP_LANES) {
        for (int j = 0; j < TP_LANES; j++) lane[j] = lane[j] + a[k + j];
    }
    float sum = tp_combine(lane);
    for (; k < n; k++) sum = sum + a[k];
    return sum;
}

/* in order (a max is exact in any order, but NaN and -0 make the order visible) */
float tp_max(const float * a, int64_t n) {
    float max = -INFINITY;
    for (int64_t k = 0; k < n; k++) max = a[k] > max ? a[k] : max;
    return max;
}

void tp_matmul_nt(const float * a, int64_t lda, const float * b, int64_t ldb, float * c, int64_t ldc, int64_t m,
                  int64_t n, int64_t k) {
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) c[i * ldc + j] = tp_dot(a + i * lda, b + j * ldb, k);
    }
}

void tp_softmax_row(const float * x, float * y, int64_t n) {
    const float max = tp_max(x, n);
    for (int64_t k = 0; k < n; k++) y[k] = tp_expf(x[k] - max);
    const float inv = 1.0f / tp_sum(y, n);
    for (int64_t k = 0; k < n; k++) y[k] = y[k] * inv;
}

float tp_silu(float x) { return x / (1.0f + tp_expf(-x)); }

/* ggml's formula: dy s (1 + x (1 - s)), s = sigmoid(x) */
float tp_silu_back(float x, float dy) {
    const float s = 1.0f / (1.0f + tp_expf(-x));
    return dy * s * (1.0f + x * (1.0f - s));
}
