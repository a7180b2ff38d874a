// cuDNN's fused attention through its frontend's graph API (native/cuda/th-cudnn.cuh), the library
// libtoyharness_cudnn that ggml-cuda links where the build has cuDNN. A plan is built once
// per shape and device, at the first call (ggml-cuda runs a graph's first evaluation without
// capturing it: ggml_backend_cuda_graph_compute's warm-up), with its workspace and, for the
// forward, a bf16 O buffer; later calls (captured into CUDA graphs or not) only execute it.
// Buffers are never freed while the process runs: a captured graph keeps their addresses.
#include "th-cudnn.cuh"     // native/cuda

#include <cstdio>
#include <cstring>


#include <cudnn_frontend.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;

namespace {

enum : int64_t { Q_UID = 1, K_UID, V_UID, O_UID, STATS_UID, DO_UID, DQ_UID, DK_UID, DV_UID };

struct th_plan {
    std::shared_ptr<fe::graph::Graph> graph;
    void * workspace = nullptr;
    void * o = nullptr;           // the forward's bf16 O
    void * inputs = nullptr;      // q, k and v in bf16 where the caller narrows them (inputs16)
};

std::mutex th_plans_mutex;
std::map<std::vector<int64_t>, th_plan> th_plans;
std::map<int, cudnnHandle_t> th_handles;
std::map<std::vector<int64_t>, std::string> th_refused;    // shapes cuDNN refused, and why
std::set<std::vector<int64_t>> th_said;                     // refusals said on stderr

std::vector<int64_t> th_key(const int device, const int backward, const th_sdpa_shape & s) {
    std::vector<int64_t> key = {device, backward, s.B, s.H, s.Hk, s.T, s.D, s.causal, s.inputs16};
    for (const int64_t * a : {s.q, s.k, s.v}) key.insert(key.end(), a, a + 4);
    key.insert(key.end(), s.stats, s.stats + 3);
    int32_t scale_bits;
    memcpy(&scale_bits, &s.scale, sizeof(scale_bits));
    key.push_back(scale_bits);
    return key;
}

// (b, h, t, d) of the query heads (kv false) or the kv heads, and their packed strides
std::vector<int64_t> th_dims(const th_sdpa_shape & s, const bool kv = false) { return {s.B, kv ? s.Hk : s.H, s.T, s.D}; }
std::vector<int64_t> th_packed(const th_sdpa_shape & s, const bool kv = false) {
    return {(kv ? s.Hk : s.H) * s.T * s.D, s.T * s.D, s.D, 1};
}

std::shared_ptr<fe::graph::Tensor_attributes> th_tensor(fe::graph::Graph & g, const char * name, const int64_t uid,
                                                        const std::vector<int64_t> & dims,
                                                        const std::vector<int64_t> & strides) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(strides));
}

std::shared_ptr<fe::graph::Graph> th_graph(const th_sdpa_shape & s, const bool backward) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const std::vector<int64_t> dims = th_dims(s), packed = th_packed(s), kv_dims = th_dims(s, true),
                               kv_packed = th_packed(s, true);
    auto Q = th_tensor(*g, "Q", Q_UID, dims, {s.q[0], s.q[1], s.q[2], s.q[3]});
    auto K = th_tensor(*g, "K", K_UID, kv_dims, {s.k[0], s.k[1], s.k[2], s.k[3]});
    auto V = th_tensor(*g, "V", V_UID, kv_dims, {s.v[0], s.v[1], s.v[2], s.v[3]});
    const std::vector<int64_t> stats_dims = {s.B, s.H, s.T, 1}, stats_strides = {s.stats[0], s.stats[1], s.stats[2], 1};
    if (!backward) {
        auto opts = fe::graph::SDPA_attributes()
                        .set_name("th_sdpa")
                        .set_generate_stats(true)
                        .set_attn_scale(s.scale)
                        .set_causal_mask(s.causal != 0);
        auto [O, stats] = g->sdpa(Q, K, V, opts);
        O->set_output(true).set_dim(dims).set_stride(packed).set_uid(O_UID);
        stats->set_output(true)
            .set_data_type(fe::DataType_t::FLOAT)
            .set_dim(stats_dims)
            .set_stride(stats_strides)
            .set_uid(STATS_UID);
    } else {
        auto O = th_tensor(*g, "O", O_UID, dims, packed);
        auto dO = th_tensor(*g, "dO", DO_UID, dims, packed);
        auto stats = th_tensor(*g, "stats", STATS_UID, stats_dims, stats_strides);
        stats->set_data_type(fe::DataType_t::FLOAT);
        auto opts = fe::graph::SDPA_backward_attributes()
                        .set_name("th_sdpa_backward")
                        .set_attn_scale(s.scale)
                        .set_causal_mask(s.causal != 0)
                        .set_deterministic_algorithm(true);   // dQ summed in a fixed order
        auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, stats, opts);
        dQ->set_output(true).set_dim(dims).set_stride(packed).set_uid(DQ_UID);
        dK->set_output(true).set_dim(kv_dims).set_stride(kv_packed).set_uid(DK_UID);
        dV->set_output(true).set_dim(kv_dims).set_stride(kv_packed).set_uid(DV_UID);
    }
    return g;
}

// nullptr, once `why` is said on stderr (once a shape: th-attention.cu's th_cudnn_takes asks at
// each of an attention's launches); remembered where cuDNN itself refused
th_plan * th_refuse(const std::vector<int64_t> & key, const bool remember, const char * why) {
    if (th_said.insert(key).second) fprintf(stderr, "toyharness: %s; toyharness's attention kernels run it\n", why);
    if (remember) th_refused.emplace(key, why);
    return nullptr;
}

// the plan of (backward, s) on this device, built and its buffers allocated at the first call;
// nullptr with `why` where cuDNN refuses it (or s.refuse: TOYHARNESS_CUDNN_ATTENTION=refuse, which
// stands in for a refusal in tests)
th_plan * th_plan_of(cudaStream_t stream, const th_sdpa_shape & s, const bool backward, cudnnHandle_t * handle,
                     char * why, const size_t why_size) {
    int device = 0;
    cudaGetDevice(&device);
    std::lock_guard<std::mutex> lock(th_plans_mutex);
    const std::vector<int64_t> key = th_key(device, backward, s);
    const char * what = backward ? "backward" : "forward";
    if (s.refuse) {
        snprintf(why, why_size, "cuDNN's plans refused (TOYHARNESS_CUDNN_ATTENTION=refuse): the attention %s (B %lld, "
                 "H %lld, kv heads %lld, T %lld, D %lld)", what, (long long) s.B, (long long) s.H, (long long) s.Hk,
                 (long long) s.T, (long long) s.D);
        return th_refuse(key, false, why);
    }
    auto refused = th_refused.find(key);
    if (refused != th_refused.end()) {
        snprintf(why, why_size, "%s", refused->second.c_str());
        return nullptr;
    }
    auto found = th_plans.find(key);
    auto h = th_handles.find(device);
    if (found != th_plans.end() && h != th_handles.end()) {
        *handle = h->second;
        return &found->second;
    }
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(stream, &capturing);
    if (capturing != cudaStreamCaptureStatusNone) {
        snprintf(why, why_size, "cuDNN's attention plan would be built inside a CUDA graph's capture");
        return th_refuse(key, false, why);
    }
    if (h == th_handles.end()) {
        cudnnHandle_t created;
        if (cudnnCreate(&created) != CUDNN_STATUS_SUCCESS) {
            snprintf(why, why_size, "cudnnCreate failed (cuDNN %zu)", cudnnGetVersion());
            return th_refuse(key, true, why);
        }
        h = th_handles.emplace(device, created).first;
    }
    *handle = h->second;
    th_plan plan;
    plan.graph = th_graph(s, backward);
    fe::error_t built = plan.graph->build(*handle, {fe::HeurMode_t::A});
    if (!built.is_good()) {
        snprintf(why, why_size, "cuDNN %zu cannot take the attention %s (B %lld, H %lld, kv heads %lld, T %lld, D %lld): %s",
                 cudnnGetVersion(), what, (long long) s.B, (long long) s.H, (long long) s.Hk, (long long) s.T,
                 (long long) s.D, built.get_message().c_str());
        return th_refuse(key, true, why);
    }
    int64_t workspace = 0;
    if (!plan.graph->get_workspace_size(workspace).is_good() ||
        cudaMalloc(&plan.workspace, workspace > 0 ? (size_t) workspace : 16) != cudaSuccess ||
        (!backward && cudaMalloc(&plan.o, (size_t) (s.B * s.H * s.T * s.D * 2)) != cudaSuccess) ||
        (s.inputs16 && cudaMalloc(&plan.inputs, (size_t) ((s.H + 2 * s.Hk) * s.B * s.T * s.D * 2)) != cudaSuccess)) {
        snprintf(why, why_size, "cuDNN's attention %s: cannot allocate its workspace (%lld bytes) or buffers", what,
                 (long long) workspace);
        return th_refuse(key, true, why);
    }
    return &th_plans.emplace(key, plan).first->second;
}

bool th_execute(cudaStream_t stream, cudnnHandle_t handle, const th_plan & plan,
                std::unordered_map<int64_t, void *> & pack, char * why, const size_t why_size) {
    cudnnSetStream(handle, stream);
    fe::error_t done = plan.graph->execute(handle, pack, plan.workspace);
    if (!done.is_good()) {
        snprintf(why, why_size, "cuDNN's attention failed: %s", done.get_message().c_str());
        return false;
    }
    return true;
}

}  // namespace

TH_CUDNN_API bool th_sdpa_prepare(cudaStream_t stream, const th_sdpa_shape * shape, const bool backward, char * why,
                                  const size_t why_size) {
    cudnnHandle_t handle;
    return th_plan_of(stream, *shape, backward, &handle, why, why_size) != nullptr;
}

TH_CUDNN_API const void * th_sdpa_forward(cudaStream_t stream, const th_sdpa_shape * shape, const void * q,
                                          const void * k, const void * v, float * stats, char * why,
                                          size_t why_size) {
    const th_sdpa_shape & s = *shape;
    cudnnHandle_t handle;
    th_plan * plan = th_plan_of(stream, s, false, &handle, why, why_size);
    if (plan == nullptr) return nullptr;
    std::unordered_map<int64_t, void *> pack = {{Q_UID, (void *) q}, {K_UID, (void *) k}, {V_UID, (void *) v},
                                                {O_UID, plan->o}, {STATS_UID, stats}};
    return th_execute(stream, handle, *plan, pack, why, why_size) ? plan->o : nullptr;
}

TH_CUDNN_API void * th_sdpa_inputs(cudaStream_t stream, const th_sdpa_shape * shape, const bool backward, char * why,
                                   const size_t why_size) {
    cudnnHandle_t handle;
    th_plan * plan = th_plan_of(stream, *shape, backward, &handle, why, why_size);
    if (plan != nullptr && plan->inputs == nullptr) snprintf(why, why_size, "cuDNN's attention: no input buffer");
    return plan != nullptr ? plan->inputs : nullptr;
}

TH_CUDNN_API bool th_sdpa_backward(cudaStream_t stream, const th_sdpa_shape * shape, const void * q, const void * k,
                                   const void * v, const void * o, const void * dout, const float * stats, void * dq,
                                   void * dk, void * dv, char * why, size_t why_size) {
    const th_sdpa_shape & s = *shape;
    cudnnHandle_t handle;
    th_plan * plan = th_plan_of(stream, s, true, &handle, why, why_size);
    if (plan == nullptr) return false;
    std::unordered_map<int64_t, void *> pack = {
        {Q_UID, (void *) q},   {K_UID, (void *) k},         {V_UID, (void *) v}, {O_UID, (void *) o},
        {DO_UID, (void *) dout}, {STATS_UID, (void *) stats}, {DQ_UID, dq},        {DK_UID, dk},
        {DV_UID, dv}};
    return th_execute(stream, handle, *plan, pack, why, why_size);
}

