// A feasibility probe (not part of the build; issue 32): cuDNN's fused attention (SDPA) through
// its frontend's graph API, forward and its deterministic backward, at gpt2-small's attention
// shape (and nano's, and gpt2-small's without the causal mask) with q, k and v read as views of
// one (b*s) x 3hd bf16 product, as toyharness's bf16 graphs hold them. Times 12 (6) calls of each,
// checks run-to-run bits of 20 backward passes, the bits of a CUDA graph that captured both, and
// one head against a float64 reference. On the GPU machine (PyTorch's nvidia-cudnn package there;
// the frontend's headers from the nvidia-cudnn-frontend wheel's include/ folder, carried):
//
//   CUDNN=$(python3 -c "import nvidia.cudnn as m; print(m.__path__[0])")
//   nvcc -w -std=c++17 -O2 -arch=sm_90 -I FRONTEND_INCLUDE -I $CUDNN/include scripts/cudnn_attention_probe.cu \
//       -o /tmp/probe -L$CUDNN/lib -l:libcudnn.so.9 -lcuda -lnvrtc -ldl -Xlinker -rpath=$CUDNN/lib && /tmp/probe
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            printf("cuda error %s at line %d\n", cudaGetErrorString(e_), __LINE__);            \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define FE(x)                                                                                  \
    do {                                                                                       \
        auto s_ = (x);                                                                         \
        if (!s_.is_good()) {                                                                   \
            printf("frontend error at line %d: %s\n", __LINE__, s_.get_message().c_str());     \
            return nullptr;                                                                    \
        }                                                                                      \
    } while (0)

struct Shape {
    int64_t b, h, s, d;
    bool causal;
};

enum { Q_UID = 1, K_UID, V_UID, O_UID, STATS_UID, DO_UID, DQ_UID, DK_UID, DV_UID };

static std::vector<int64_t> qkv_stride(const Shape & x) {
    const int64_t row = 3 * x.h * x.d;
    return {x.s * row, x.d, row, 1};
}
static std::vector<int64_t> bhsd(const Shape & x) { return {x.h * x.s * x.d, x.s * x.d, x.d, 1}; }
static std::vector<int64_t> dims(const Shape & x) { return {x.b, x.h, x.s, x.d}; }

static std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph & g, const char * name, int64_t uid,
                                                           std::vector<int64_t> d, std::vector<int64_t> st) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(d).set_stride(st));
}

// a graph of bf16 tensors, fp32 intermediates and compute, holding q, k and v as the product's views
static std::shared_ptr<fe::graph::Graph> qkv_graph(const Shape & x, std::shared_ptr<fe::graph::Tensor_attributes> & Q,
                                                   std::shared_ptr<fe::graph::Tensor_attributes> & K,
                                                   std::shared_ptr<fe::graph::Tensor_attributes> & V) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    Q = input(*g, "Q", Q_UID, dims(x), qkv_stride(x));
    K = input(*g, "K", K_UID, dims(x), qkv_stride(x));
    V = input(*g, "V", V_UID, dims(x), qkv_stride(x));
    return g;
}

static std::shared_ptr<fe::graph::Graph> fwd_graph(cudnnHandle_t h, const Shape & x, float scale) {
    std::shared_ptr<fe::graph::Tensor_attributes> Q, K, V;
    auto g = qkv_graph(x, Q, K, V);
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(scale).set_causal_mask(
        x.causal);
    auto [O, Stats] = g->sdpa(Q, K, V, opts);
    O->set_output(true).set_dim(dims(x)).set_stride(bhsd(x)).set_uid(O_UID);
    Stats->set_output(true)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({x.b, x.h, x.s, 1})
        .set_stride({x.h * x.s, x.s, 1, 1})
        .set_uid(STATS_UID);
    FE(g->build(h, {fe::HeurMode_t::A}));
    return g;
}

static std::shared_ptr<fe::graph::Graph> bwd_graph(cudnnHandle_t h, const Shape & x, float scale, bool det) {
    std::shared_ptr<fe::graph::Tensor_attributes> Q, K, V;
    auto g = qkv_graph(x, Q, K, V);
    auto O = input(*g, "O", O_UID, dims(x), bhsd(x));
    auto dO = input(*g, "dO", DO_UID, dims(x), bhsd(x));
    auto Stats = input(*g, "Stats", STATS_UID, {x.b, x.h, x.s, 1}, {x.h * x.s, x.s, 1, 1});
    Stats->set_data_type(fe::DataType_t::FLOAT);
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("sdpa_backward")
                    .set_attn_scale(scale)
                    .set_causal_mask(x.causal)
                    .set_deterministic_algorithm(det);
    auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
    dQ->set_output(true).set_dim(dims(x)).set_stride(bhsd(x)).set_uid(DQ_UID);
    dK->set_output(true).set_dim(dims(x)).set_stride(bhsd(x)).set_uid(DK_UID);
    dV->set_output(true).set_dim(dims(x)).set_stride(bhsd(x)).set_uid(DV_UID);
    FE(g->build(h, {fe::HeurMode_t::A}));
    return g;
}

static float bf(const __nv_bfloat16 v) { return __bfloat162float(v); }

static void run(cudnnHandle_t handle, const Shape & x, int layers, int reps) {
    const float scale = 1.0f / sqrtf((float) x.d);
    const int64_t nqkv = x.b * x.s * 3 * x.h * x.d, n = x.b * x.h * x.s * x.d, nst = x.b * x.h * x.s;
    std::vector<__nv_bfloat16> hqkv(nqkv), hdo(n);
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto & v : hqkv) v = __float2bfloat16(nd(rng));
    for (auto & v : hdo) v = __float2bfloat16(0.1f * nd(rng));
    __nv_bfloat16 *qkv, *o, *dout, *dq, *dk, *dv;
    float * stats;
    CK(cudaMalloc(&qkv, nqkv * 2));
    CK(cudaMalloc(&o, n * 2));
    CK(cudaMalloc(&dout, n * 2));
    CK(cudaMalloc(&dq, n * 2));
    CK(cudaMalloc(&dk, n * 2));
    CK(cudaMalloc(&dv, n * 2));
    CK(cudaMalloc(&stats, nst * 4));
    CK(cudaMemcpy(qkv, hqkv.data(), nqkv * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dout, hdo.data(), n * 2, cudaMemcpyHostToDevice));

    auto t0 = std::chrono::steady_clock::now();
    auto fwd = fwd_graph(handle, x, scale);
    auto t1 = std::chrono::steady_clock::now();
    auto bwd = bwd_graph(handle, x, scale, true);
    auto t2 = std::chrono::steady_clock::now();
    auto bwdn = bwd_graph(handle, x, scale, false);
    if (!fwd || !bwd) {
        printf("shape b%ld h%ld s%ld d%ld: not supported\n", x.b, x.h, x.s, x.d);
        return;
    }
    int64_t wf = 0, wb = 0, wbn = 0;
    (void) fwd->get_workspace_size(wf);
    (void) bwd->get_workspace_size(wb);
    if (bwdn) (void) bwdn->get_workspace_size(wbn);
    printf("shape b%ld h%ld s%ld d%ld causal %d: build fwd %.1f ms, bwd %.1f ms; workspace fwd %ld, bwd det %ld, bwd nondet %ld bytes\n",
           x.b, x.h, x.s, x.d, (int) x.causal, std::chrono::duration<double, std::milli>(t1 - t0).count(),
           std::chrono::duration<double, std::milli>(t2 - t1).count(), wf, wb, wbn);
    void * ws;
    const int64_t wmax = std::max(wf, std::max(wb, wbn));
    CK(cudaMalloc(&ws, wmax > 0 ? wmax : 16));
    std::unordered_map<int64_t, void *> pf = {{Q_UID, qkv}, {K_UID, qkv + x.h * x.d}, {V_UID, qkv + 2 * x.h * x.d},
                                              {O_UID, o}, {STATS_UID, stats}};
    std::unordered_map<int64_t, void *> pb = {{Q_UID, qkv}, {K_UID, qkv + x.h * x.d}, {V_UID, qkv + 2 * x.h * x.d},
                                              {O_UID, o}, {STATS_UID, stats}, {DO_UID, dout}, {DQ_UID, dq},
                                              {DK_UID, dk}, {DV_UID, dv}};
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudnnSetStream(handle, stream);
    auto exec = [&](std::shared_ptr<fe::graph::Graph> & g, std::unordered_map<int64_t, void *> & p) {
        auto s = g->execute(handle, p, ws);
        if (!s.is_good()) {
            printf("execute: %s\n", s.get_message().c_str());
            exit(1);
        }
    };
    exec(fwd, pf);
    exec(bwd, pb);
    CK(cudaStreamSynchronize(stream));
    std::vector<__nv_bfloat16> o1(n), dq1(n), dk1(n), dv1(n), dq2(n), dk2(n), dv2(n), o2(n);
    std::vector<float> st1(nst);
    CK(cudaMemcpy(o1.data(), o, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(st1.data(), stats, nst * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dq1.data(), dq, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dk1.data(), dk, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dv1.data(), dv, n * 2, cudaMemcpyDeviceToHost));

    // run-to-run bits: 20 more backward passes, each against the first
    int diff = 0;
    for (int r = 0; r < 20; ++r) {
        exec(bwd, pb);
        CK(cudaMemcpy(dq2.data(), dq, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(dk2.data(), dk, n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(dv2.data(), dv, n * 2, cudaMemcpyDeviceToHost));
        diff += memcmp(dq1.data(), dq2.data(), n * 2) != 0;
        diff += memcmp(dk1.data(), dk2.data(), n * 2) != 0;
        diff += memcmp(dv1.data(), dv2.data(), n * 2) != 0;
    }
    printf("  deterministic backward, 20 runs: %d of 60 outputs differ from the first run's\n", diff);
    if (bwdn) {
        int diffn = 0;
        for (int r = 0; r < 5; ++r) {
            exec(bwdn, pb);
            CK(cudaMemcpy(dq2.data(), dq, n * 2, cudaMemcpyDeviceToHost));
            diffn += memcmp(dq1.data(), dq2.data(), n * 2) != 0;
        }
        printf("  default backward, 5 runs: dQ differs from the deterministic one's in %d\n", diffn);
    }

    // the same under stream capture: one graph of fwd + deterministic bwd, replayed
    cudaGraph_t graph;
    cudaGraphExec_t inst;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    exec(fwd, pf);
    exec(bwd, pb);
    CK(cudaStreamEndCapture(stream, &graph));
    CK(cudaGraphInstantiate(&inst, graph, 0));
    CK(cudaMemset(dq, 0, n * 2));
    CK(cudaMemset(o, 0, n * 2));
    CK(cudaGraphLaunch(inst, stream));
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(o2.data(), o, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dq2.data(), dq, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dk2.data(), dk, n * 2, cudaMemcpyDeviceToHost));
    printf("  captured graph replay: O %s, dQ %s, dK %s the eager bits\n",
           memcmp(o1.data(), o2.data(), n * 2) ? "differs from" : "equals",
           memcmp(dq1.data(), dq2.data(), n * 2) ? "differs from" : "equals",
           memcmp(dk1.data(), dk2.data(), n * 2) ? "differs from" : "equals");

    // timings: `layers` calls a pass, as a step's layers, median of reps
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto timeit = [&](std::shared_ptr<fe::graph::Graph> & g, std::unordered_map<int64_t, void *> & p) {
        std::vector<float> ms;
        for (int r = 0; r < reps; ++r) {
            CK(cudaEventRecord(e0, stream));
            for (int l = 0; l < layers; ++l) exec(g, p);
            CK(cudaEventRecord(e1, stream));
            CK(cudaEventSynchronize(e1));
            float t;
            CK(cudaEventElapsedTime(&t, e0, e1));
            ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        return ms[ms.size() / 2];
    };
    const float tf = timeit(fwd, pf), tb = timeit(bwd, pb), tbn = bwdn ? timeit(bwdn, pb) : 0.0f;
    printf("  %d calls: forward %.3f ms, deterministic backward %.3f ms, default backward %.3f ms\n", layers, tf, tb,
           tbn);

    // one head (b last, h last) against float64
    const int64_t bb = x.b - 1, hh = x.h - 1, row = 3 * x.h * x.d;
    auto at = [&](int which, int64_t s, int64_t d) {
        return (double) bf(hqkv[(bb * x.s + s) * row + which * x.h * x.d + hh * x.d + d]);
    };
    const int64_t S = x.s, D = x.d;
    std::vector<double> P(S * S), Or(S * D, 0), dOr(S * D), dP(S * S), dQr(S * D, 0), dKr(S * D, 0), dVr(S * D, 0);
    for (int64_t i = 0; i < S; ++i)
        for (int64_t d = 0; d < D; ++d) dOr[i * D + d] = bf(hdo[((bb * x.h + hh) * S + i) * D + d]);
    for (int64_t i = 0; i < S; ++i) {
        double m = -1e300;
        for (int64_t j = 0; j < S; ++j) {
            double s = 0;
            for (int64_t d = 0; d < D; ++d) s += at(0, i, d) * at(1, j, d);
            s *= scale;
            if (x.causal && j > i) s = -1e300;
            P[i * S + j] = s;
            m = std::max(m, s);
        }
        double l = 0;
        for (int64_t j = 0; j < S; ++j) l += (P[i * S + j] = (P[i * S + j] <= -1e299 ? 0 : exp(P[i * S + j] - m)));
        for (int64_t j = 0; j < S; ++j) P[i * S + j] /= l;
        for (int64_t j = 0; j < S; ++j)
            for (int64_t d = 0; d < D; ++d) Or[i * D + d] += P[i * S + j] * at(2, j, d);
    }
    for (int64_t i = 0; i < S; ++i) {
        double Di = 0;
        for (int64_t d = 0; d < D; ++d) Di += dOr[i * D + d] * Or[i * D + d];
        for (int64_t j = 0; j < S; ++j) {
            double dp = 0;
            for (int64_t d = 0; d < D; ++d) dp += dOr[i * D + d] * at(2, j, d);
            const double ds = P[i * S + j] * (dp - Di) * scale;
            for (int64_t d = 0; d < D; ++d) {
                dQr[i * D + d] += ds * at(1, j, d);
                dKr[j * D + d] += ds * at(0, i, d);
                dVr[j * D + d] += P[i * S + j] * dOr[i * D + d];
            }
        }
    }
    auto err = [&](const std::vector<__nv_bfloat16> & got, const std::vector<double> & ref) {
        double num = 0, den = 0, mx = 0;
        for (int64_t i = 0; i < S * D; ++i) {
            const double g = bf(got[((bb * x.h + hh) * S) * D + i]);
            num += (g - ref[i]) * (g - ref[i]);
            den += ref[i] * ref[i];
            mx = std::max(mx, fabs(g - ref[i]));
        }
        return std::make_pair(sqrt(num / den), mx);
    };
    auto eo = err(o1, Or), eq = err(dq1, dQr), ek = err(dk1, dKr), ev = err(dv1, dVr);
    printf("  head (%ld, %ld) against float64: relative rms O %.2e, dQ %.2e, dK %.2e, dV %.2e (max abs %.2e %.2e %.2e %.2e)\n",
           bb, hh, eo.first, eq.first, ek.first, ev.first, eo.second, eq.second, ek.second, ev.second);
    cudaFree(qkv), cudaFree(o), cudaFree(dout), cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(stats), cudaFree(ws);
}

int main() {
    cudnnHandle_t handle;
    if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS) {
        printf("cudnnCreate failed\n");
        return 1;
    }
    printf("cuDNN %zu (frontend %d)\n", cudnnGetVersion(), CUDNN_FRONTEND_VERSION);
    run(handle, {8, 12, 1024, 64, true}, 12, 15);    // gpt2-small
    run(handle, {64, 6, 256, 64, true}, 6, 15);      // nano
    run(handle, {8, 12, 1024, 64, false}, 12, 15);   // non-causal (ViT-like at this size)
    return 0;
}
