// The bf16 attention kernels alone (native/cuda/th-attention.cu), at gpt2-small's shape, without a
// ggml build: times the forward, the backward and dQ, and writes their outputs so that two builds
// of the kernels (scripts/attention_bench.sh: the checkout's and a git revision's) can be compared
// bit for bit. The inputs are laid out as a gpt2 graph hands them over: q, k and v read in place
// from the qkv projection's (B, T, 3C) rows, dO from (B, T, C), dQ written to (B, T, C).
//
//   nvcc -arch=sm_90 -O3 -std=c++17 --use_fast_math -I native/cuda -I native -I GGML/include ... \
//        scripts/attention_bench.cu -o attention_bench && ./attention_bench out.bin [B T H reps]
#include "th-attention.cu"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

// the three ggml functions th-attention.cu calls (only from launchers this bench does not use)
extern "C" {
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "abort at %s:%d: %s\n", file, line, fmt);
    exit(1);
}
bool ggml_is_contiguous(const struct ggml_tensor *) { return true; }
int64_t ggml_nelements(const struct ggml_tensor *) { return 0; }
}

// th-precision.cu's bf16 copy for dQ's readers (th-attention.cu's launcher, not used here): none
__nv_bfloat16 * th_copy_for_writer(cudaStream_t, const ggml_tensor *, bool * alone, const ggml_tensor *) {
    if (alone != nullptr) *alone = false;
    return nullptr;
}

#define CHECK(x)                                                                        \
    do {                                                                                \
        cudaError_t e = (x);                                                            \
        if (e != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

static float * device_random(const size_t n, uint64_t seed, const float scale) {
    std::vector<float> h(n);
    for (size_t i = 0; i < n; i++) {       // a fixed LCG: the same inputs in every build
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        h[i] = scale * ((float) (seed >> 40) / (float) (1u << 24) - 0.5f);
    }
    float * d;
    CHECK(cudaMalloc(&d, n * sizeof(float)));
    CHECK(cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

static th_opd rows_of(float * p, const int64_t row, const int HD, const int64_t T, const int H) {
    th_opd o;
    o.p = p, o.st = row, o.sd = 1, o.sh = HD, o.sb = T * row, o.H = H, o.g = 1;
    return o;
}

template <typename F>
static float time_ms(F f, const int reps) {        // the median of reps launches
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    f();
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < reps; i++) {
        CHECK(cudaEventRecord(a));
        f();
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: attention_bench OUT.bin [B T H reps]\n");
        return 2;
    }
    constexpr int HD = 64;
    const int B = argc > 2 ? atoi(argv[2]) : 8, T = argc > 3 ? atoi(argv[3]) : 1024, H = argc > 4 ? atoi(argv[4]) : 12;
    const int reps = argc > 5 ? atoi(argv[5]) : 20;
    const int64_t C = (int64_t) H * HD, BH = (int64_t) B * H;
    float * qkv = device_random((size_t) B * T * 3 * C, 1, 4.0f);
    float * dout = device_random((size_t) B * T * C, 2, 0.02f);
    float *fwd, *scratch, *dq, *dummy;
    CHECK(cudaMalloc(&fwd, BH * T * (HD + 1) * sizeof(float)));
    CHECK(cudaMalloc(&scratch, BH * T * (2 * HD + 1) * sizeof(float)));
    CHECK(cudaMalloc(&dq, (size_t) B * T * C * sizeof(float)));
    CHECK(cudaMalloc(&dummy, sizeof(float)));
    CHECK(cudaMemset(scratch, 0, BH * T * (2 * HD + 1) * sizeof(float)));

    th_attn_args a = {};
    a.T = T, a.scale = 1.0f / sqrtf((float) HD), a.causal = 1, a.group = 1;
    a.q = rows_of(qkv, 3 * C, HD, T, H), a.k = rows_of(qkv + C, 3 * C, HD, T, H), a.v = rows_of(qkv + 2 * C, 3 * C, HD, T, H);
    a.dout = rows_of(dout, C, HD, T, H);
    a.o = th_opd_at(fwd, HD, 1, (HD + 1) * T, BH);
    a.out = fwd;
    a.fwd = fwd, a.scratch = scratch;
    a.dk = th_opd_at(scratch, HD, 1, (2 * HD + 1) * T, BH);
    a.dv = th_opd_at(scratch + (int64_t) T * HD, 1, T, (2 * HD + 1) * T, BH);
    a.dq = rows_of(dq, C, HD, T, H);
    cudaStream_t s = 0;

    th_attn_args f = a;
    const float t_fwd = time_ms([&] { th_mma_launch<HD>(s, TH_CUDA_ATTN_FWD, f, (unsigned) BH); }, reps);
    th_attn_args p = a;
    p.scratch = scratch;
    th_attn_prep_kernel<HD><<<(unsigned) ((BH * T + 7) / 8), 256, 0, s>>>(p, BH * T);
    th_attn_args bw = a;
    bw.out = dummy;
    const float t_bwd = time_ms([&] { th_mma_launch<HD>(s, TH_CUDA_ATTN_BWD, bw, (unsigned) BH); }, reps);
    th_attn_args q = a;
    q.out = dq;
    const float t_dq = time_ms([&] { th_mma_launch<HD>(s, TH_CUDA_ATTN_DQ, q, (unsigned) BH); }, reps);
    CHECK(cudaDeviceSynchronize());
#if __has_include("attention_bench_variants.h")
    // other shapes of a kernel's CTA (attention_bench.sh's VARIANTS): their output (out, n floats)
    // must be the default's bits
    const size_t fwd_n = BH * T * (HD + 1), bwd_n = BH * T * (2 * HD + 1), dq_n = (size_t) B * T * C;
    auto variant = [&](const char * name, float * out, const size_t n, auto launch) {
        std::vector<float> ref(n), got(n);
        CHECK(cudaMemcpy(ref.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
        if (out == scratch) {     // the backward's dK and dV zeroed, the prep's D kept
            CHECK(cudaMemset2D(scratch, (2 * HD + 1) * T * sizeof(float), 0, 2 * HD * T * sizeof(float), BH));
        } else {
            CHECK(cudaMemset(out, 0, n * sizeof(float)));
        }
        const float t = time_ms(launch, reps);
        CHECK(cudaMemcpy(got.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost));
        printf("  %-34s %.4f ms  %s\n", name, t,
               memcmp(ref.data(), got.data(), n * sizeof(float)) == 0 ? "same bits" : "BITS DIFFER");
        CHECK(cudaMemcpy(out, ref.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    };
#include "attention_bench_variants.h"
#endif

    // causal products' flops: the forward 2 (S, P V), the backward 4 (S, dP, dV, dK), dQ 3 (S, dP, dQ)
    const double pairs = (double) BH * T * (T + 1) / 2, per = 2.0 * HD * pairs;
    printf("B %d T %d H %d hd %d: forward %.4f ms (%.0f TFLOP/s), backward %.4f ms (%.0f), dQ %.4f ms (%.0f)\n", B, T,
           H, HD, t_fwd, 2 * per / t_fwd / 1e9, t_bwd, 4 * per / t_bwd / 1e9, t_dq, 3 * per / t_dq / 1e9);

    FILE * out = fopen(argv[1], "wb");
    auto dump = [&](const float * d, const size_t n) {
        std::vector<float> h(n);
        CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
        fwrite(h.data(), sizeof(float), n, out);
    };
    dump(fwd, BH * T * (HD + 1));
    dump(scratch, BH * T * (2 * HD + 1));
    dump(dq, (size_t) B * T * C);
    fclose(out);

#ifdef TH_ATTENTION_BF16_OPERANDS
    // q, k and v read as bf16 (an operand kept in bf16 at precision bf16): each the fp32 input rounded
    // to nearest even, as the kernels round it when they read fp32, so every output must keep its bits
    const size_t fwd_elems = BH * T * (HD + 1), bwd_elems = BH * T * (2 * HD + 1), dq_elems = (size_t) B * T * C;
    std::vector<float> ref_fwd(fwd_elems), ref_bwd(bwd_elems), ref_dq(dq_elems), host(B * T * 3 * C);
    CHECK(cudaMemcpy(ref_fwd.data(), fwd, fwd_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ref_bwd.data(), scratch, bwd_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ref_dq.data(), dq, dq_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(host.data(), qkv, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    std::vector<__nv_bfloat16> host16(host.size());
    for (size_t i = 0; i < host.size(); i++) host16[i] = __float2bfloat16_rn(host[i]);
    __nv_bfloat16 * qkv16;
    CHECK(cudaMalloc(&qkv16, host16.size() * sizeof(__nv_bfloat16)));
    CHECK(cudaMemcpy(qkv16, host16.data(), host16.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    th_attn_args a16 = a;
    a16.q = rows_of((float *) qkv16, 3 * C, HD, T, H), a16.k = rows_of((float *) (qkv16 + C), 3 * C, HD, T, H);
    a16.v = rows_of((float *) (qkv16 + 2 * C), 3 * C, HD, T, H);
    a16.q.bf16 = a16.k.bf16 = a16.v.bf16 = 1;
    CHECK(cudaMemset(fwd, 0, fwd_elems * sizeof(float)));
    CHECK(cudaMemset(dq, 0, dq_elems * sizeof(float)));
    CHECK(cudaMemset2D(scratch, (2 * HD + 1) * T * sizeof(float), 0, 2 * HD * T * sizeof(float), BH));
    th_attn_args f16 = a16, bw16 = a16, q16 = a16;
    bw16.out = dummy, q16.out = dq;
    const float t_fwd16 = time_ms([&] { th_mma_launch<HD>(s, TH_CUDA_ATTN_FWD, f16, (unsigned) BH); }, reps);
    const float t_bwd16 = time_ms([&] { th_mma_launch<HD>(s, TH_CUDA_ATTN_BWD, bw16, (unsigned) BH); }, reps);
    const float t_dq16 = time_ms([&] { th_mma_launch<HD>(s, TH_CUDA_ATTN_DQ, q16, (unsigned) BH); }, reps);
    std::vector<float> got_fwd(fwd_elems), got_bwd(bwd_elems), got_dq(dq_elems);
    CHECK(cudaMemcpy(got_fwd.data(), fwd, fwd_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(got_bwd.data(), scratch, bwd_elems * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(got_dq.data(), dq, dq_elems * sizeof(float), cudaMemcpyDeviceToHost));
    const bool same = memcmp(ref_fwd.data(), got_fwd.data(), fwd_elems * sizeof(float)) == 0 &&
                      memcmp(ref_bwd.data(), got_bwd.data(), bwd_elems * sizeof(float)) == 0 &&
                      memcmp(ref_dq.data(), got_dq.data(), dq_elems * sizeof(float)) == 0;
    fprintf(stderr, "q, k, v in bf16: forward %.4f ms, backward %.4f ms, dQ %.4f ms: %s\n", t_fwd16, t_bwd16, t_dq16,
            same ? "the same bits as fp32's inputs" : "OUTPUTS DIFFER from fp32's inputs");
    return same ? 0 : 1;
#else
    return 0;
#endif
}
