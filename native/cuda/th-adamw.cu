// AdamW over many parameters in one launch (TH_CUDA_ADAMW, marked by native/cuda_rewrite.c):
// ggml-cuda's OPT_STEP_ADAMW launches once a parameter, and most of GPT-2's 196 parameters are
// biases and gains of 768 floats, each a launch's fixed cost. Here the last node of a run of
// steps computes the run, 32 parameters a launch, 4 consecutive elements a thread (a float4 where
// the tensors allow), each rounded as ggml's kernel rounds it (tests/test_cuda_adamw.py checks
// the bits against ggml's kernel).
#include "th-custom.cuh"

extern "C" {
#include "custom_ops.h"
}

#include <cstdint>
#include <vector>

#define TH_ADAMW_GROUP 32                        // parameters a launch: a 1.6 KB kernel argument
#define TH_ADAMW_THREADS 256
#define TH_ADAMW_PER_BLOCK (4 * TH_ADAMW_THREADS)

struct th_adamw_group {
    float * x[TH_ADAMW_GROUP];
    const float * g[TH_ADAMW_GROUP];
    float * m[TH_ADAMW_GROUP];
    float * v[TH_ADAMW_GROUP];
    int64_t n[TH_ADAMW_GROUP];
    int64_t first_block[TH_ADAMW_GROUP + 1];     // parameter t takes blocks first_block[t] ..
    const float * row;                           // ggml's 7 floats: alpha, beta1, beta2, eps, wd, beta1h, beta2h
    uint32_t vec4;                               // bit t: x, g, m and v of t are 16-byte aligned
    int count;
};

// ggml's opt_step_adamw_f32 for one element, rounded as the compiler rounds ggml's: written out
// with explicit products and fused multiply-adds, since a compiler left to contract the same
// expression in another kernel chose other products to fuse (1 ulp apart). ggml's SASS (sm_90,
// -use_fast_math): m = fma(1 - beta1, g, m beta1), v = fma(g g, 1 - beta2, v beta2),
// x = fma(fma(-alpha, wd, 1), x, -(alpha (m beta1h)) rcp(sqrt(v beta2h) + eps)).
static __device__ __forceinline__ void th_adamw_element(float & x, const float gi, float & gm, float & gv,
                                                        const float alpha, const float beta1, const float beta2,
                                                        const float eps, const float wd, const float beta1h,
                                                        const float beta2h) {
    const float gmi = __fmaf_rn(__fadd_rn(1.0f, -beta1), gi, __fmul_rn(gm, beta1));
    const float gvi = __fmaf_rn(__fmul_rn(gi, gi), __fadd_rn(1.0f, -beta2), __fmul_rn(gv, beta2));
    gm = gmi;
    gv = gvi;
    const float mh = __fmul_rn(gmi, beta1h);
    const float vh = __fadd_rn(sqrtf(__fmul_rn(gvi, beta2h)), eps);
    const float step = __fdividef(__fmul_rn(alpha, mh), vh);
    x = __fmaf_rn(__fmaf_rn(-alpha, wd, 1.0f), x, -step);
}

static __global__ void __launch_bounds__(TH_ADAMW_THREADS) th_adamw_kernel(const th_adamw_group grp) {
    int t = 0;
    while (t + 1 < grp.count && (int64_t) blockIdx.x >= grp.first_block[t + 1]) t++;
    const float alpha = grp.row[0], beta1 = grp.row[1], beta2 = grp.row[2], eps = grp.row[3], wd = grp.row[4];
    const float beta1h = grp.row[5], beta2h = grp.row[6];
    const int64_t n = grp.n[t];
    const int64_t i0 = ((int64_t) blockIdx.x - grp.first_block[t]) * TH_ADAMW_PER_BLOCK + 4 * (int64_t) threadIdx.x;
    float * x = grp.x[t], * m = grp.m[t], * v = grp.v[t];
    const float * g = grp.g[t];
    if ((grp.vec4 >> t & 1u) && i0 + 3 < n) {
        float4 x4 = *(float4 *) (x + i0), m4 = *(float4 *) (m + i0), v4 = *(float4 *) (v + i0);
        const float4 g4 = *(const float4 *) (g + i0);
        th_adamw_element(x4.x, g4.x, m4.x, v4.x, alpha, beta1, beta2, eps, wd, beta1h, beta2h);
        th_adamw_element(x4.y, g4.y, m4.y, v4.y, alpha, beta1, beta2, eps, wd, beta1h, beta2h);
        th_adamw_element(x4.z, g4.z, m4.z, v4.z, alpha, beta1, beta2, eps, wd, beta1h, beta2h);
        th_adamw_element(x4.w, g4.w, m4.w, v4.w, alpha, beta1, beta2, eps, wd, beta1h, beta2h);
        *(float4 *) (m + i0) = m4;
        *(float4 *) (v + i0) = v4;
        *(float4 *) (x + i0) = x4;
    } else {
        for (int64_t i = i0; i < i0 + 4 && i < n; i++) {
            float xi = x[i], mi = m[i], vi = v[i];
            th_adamw_element(xi, g[i], mi, vi, alpha, beta1, beta2, eps, wd, beta1h, beta2h);
            m[i] = mi;
            v[i] = vi;
            x[i] = xi;
        }
    }
}

bool th_adamw_supported(const ggml_tensor * op) {
    const ggml_tensor * row = op->src[4];
    if (row == nullptr || !th_f32_contiguous(row) || ggml_nelements(row) != 7) return false;
    for (int i = 0; i < 4; i++) {
        if (!th_f32_contiguous(op->src[i]) || !ggml_are_same_shape(op->src[0], op->src[i])) return false;
    }
    return true;
}

void th_adamw(cudaStream_t stream, ggml_tensor * dst) {
    if (th_adamw_link_of(dst).last != dst) return;      // the run's last node computes the run
    std::vector<const ggml_tensor *> run;
    for (const ggml_tensor * t = dst; t != nullptr; t = th_adamw_link_of(t).prev) run.push_back(t);
    for (size_t start = 0; start < run.size(); start += TH_ADAMW_GROUP) {
        th_adamw_group grp = {};
        grp.row = (const float *) dst->src[4]->data;
        int64_t blocks = 0;
        for (size_t k = start; k < run.size() && grp.count < TH_ADAMW_GROUP; k++) {
            const ggml_tensor * t = run[k];
            const int c = grp.count++;
            grp.x[c] = (float *) t->src[0]->data;
            grp.g[c] = (const float *) t->src[1]->data;
            grp.m[c] = (float *) t->src[2]->data;
            grp.v[c] = (float *) t->src[3]->data;
            grp.n[c] = ggml_nelements(t->src[0]);
            if (th_aligned16(grp.x[c]) && th_aligned16(grp.g[c]) && th_aligned16(grp.m[c]) && th_aligned16(grp.v[c])) {
                grp.vec4 |= 1u << c;
            }
            grp.first_block[c] = blocks;
            blocks += (grp.n[c] + TH_ADAMW_PER_BLOCK - 1) / TH_ADAMW_PER_BLOCK;
        }
        grp.first_block[grp.count] = blocks;
        if (blocks > 0) th_adamw_kernel<<<(unsigned) blocks, TH_ADAMW_THREADS, 0, stream>>>(grp);
    }
}
