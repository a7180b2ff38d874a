/* toyharness cpu kernels: OPT_STEP_ADAMW. Apart from cpu_kernels.c because it is built with
 * -fno-math-errno: with errno kept, the compiler leaves a square root scalar (a call to set
 * errno for a negative input), and the loop with it. The results are the same. */
#include <math.h>
#include <stdint.h>

#include "ggml.h"
#include "cpu_kernels.h"

/* ---- OPT_STEP_ADAMW: ggml's arithmetic, operation for operation, vectorised ------------------
 * ggml 0.25.3 compiles its AdamW loop scalar (its square root keeps errno): 0.6 ms of a 20 ms
 * gpt2 step at 2 threads. The same operations here, with the multiply-adds that ggml's build
 * fuses (read off its machine code) written as fmaf, so that the bits are ggml's:
 *   keep = fma(-alpha, wd, 1),  m = fma(m, beta1, g * (1 - beta1)),
 *   v = fma(v, beta2, g * g * (1 - beta2)),
 *   w = fma(w, keep, -(alpha * (m * beta1h) / (sqrt(v * beta2h) + eps))).
 * tests/test_cpu_kernels.py holds it to ggml's node bit for bit. The hyperparameters are the
 * node's 7-float row (src 4); w is src 0 (the node is a view of it), g, m, v srcs 1-3. */
void th_adamw_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const float * row = (const float *) dst->src[4]->data;
    const float alpha = row[0], beta1 = row[1], beta2 = row[2], eps = row[3], wd = row[4];
    const float beta1h = row[5], beta2h = row[6];
    const float keep = fmaf(-alpha, wd, 1.0f), c1 = 1.0f - beta1, c2 = 1.0f - beta2;
    float * w = (float *) dst->src[0]->data, * m = (float *) dst->src[2]->data, * v = (float *) dst->src[3]->data;
    const float * g = (const float *) dst->src[1]->data;
    int64_t taken = 0, i0, i1;
    while (th_next_chunk(ggml_nelements(dst->src[0]), ith, nth, &taken, &i0, &i1)) {
        for (int64_t i = i0; i < i1; i++) {
            const float mi = fmaf(m[i], beta1, g[i] * c1);
            const float vi = fmaf(v[i], beta2, (g[i] * g[i]) * c2);
            m[i] = mi;
            v[i] = vi;
            w[i] = fmaf(w[i], keep, -(alpha * (mi * beta1h) / (sqrtf(vi * beta2h) + eps)));
        }
    }
}

int th_adamw_ok(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_OPT_STEP_ADAMW) return 0;
    const struct ggml_tensor * w = t->src[0], * row = t->src[4];
    for (int k = 0; k < 4; k++) {
        const struct ggml_tensor * s = t->src[k];
        if (s->type != GGML_TYPE_F32 || !ggml_is_contiguous(s) || !ggml_are_same_shape(s, w)) return 0;
    }
    return row->type == GGML_TYPE_F32 && ggml_nelements(row) == 7 && ggml_is_contiguous(row);
}
