/* toyharness shim: the few things the Python binding cannot do through ggml's public API.
 *
 * - ggml_tensor is opaque to the binding (we declare no ggml structs), so shapes, strides,
 *   types and data pointers are read here.
 * - ggml aborts the process on internal errors; the abort handler makes that message say
 *   who is speaking before the process ends.
 * - ggml logs to stderr by default; the binding turns that down to warnings and errors.
 * - a step's host work in one call each where numpy's per-call cost showed (th_zero_tensors,
 *   th_feed_*).
 */
#define _GNU_SOURCE /* pthread_setaffinity_np */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-backend.h"
#include "custom_ops.h"
#include "ggml-impl.h" /* ggml_graph_view, for the profiler */

#define TH_EXPORT __attribute__((visibility("default")))

TH_EXPORT int th_tensor_type(const struct ggml_tensor * t) { return (int) t->type; }

TH_EXPORT void th_tensor_shape(const struct ggml_tensor * t, int64_t ne[4], size_t nb[4]) {
    for (int i = 0; i < 4; i++) {
        ne[i] = t->ne[i];
        nb[i] = t->nb[i];
    }
}

/* t's i-th source (NULL where it has none) */
TH_EXPORT struct ggml_tensor * th_tensor_src(const struct ggml_tensor * t, int i) {
    return i >= 0 && i < GGML_MAX_SRC ? t->src[i] : NULL;
}

TH_EXPORT void * th_tensor_data(const struct ggml_tensor * t) { return t->data; }

TH_EXPORT int th_tensor_has_buffer(const struct ggml_tensor * t) { return t->buffer != NULL; }

TH_EXPORT int th_tensor_flags(const struct ggml_tensor * t) { return (int) t->flags; }

TH_EXPORT int th_tensor_op(const struct ggml_tensor * t) { return (int) t->op; }

/* a graph's leaf count (ggml's API gives its nodes only): Program sizes graphs from it */
TH_EXPORT int th_graph_n_leafs(const struct ggml_cgraph * graph) { return graph->n_leafs; }

/* whether t's memory is host memory (numpy may then read and write it in place) */
TH_EXPORT int th_tensor_is_host(const struct ggml_tensor * t) {
    return t->buffer != NULL && ggml_backend_buffer_is_host(t->buffer);
}

/* zero n tensors in one call (a training step's gradient accumulators) */
TH_EXPORT void th_zero_tensors(struct ggml_tensor ** ts, int n) {
    for (int i = 0; i < n; i++) ggml_backend_tensor_memset(ts[i], 0, 0, ggml_nbytes(ts[i]));
}

/* ---- broadcast sums as faster kernels (cuda) ----------------------------------------------
 * The gradient of a bias or norm gain broadcast over a matrix a (ne [n, R]) is REPEAT_BACK(a)
 * into ne [n, 1]: the sum of a's R rows. ggml-cuda sums each column on one thread; OUT_PROD(a,
 * ones), ones of ne [1, R], is the same sum as one cuBLAS product. The Trainer asks which
 * nodes qualify (R, else 0), makes the ones, then rewrites them.
 * The gradient of a row's mean broadcast back over its row (LayerNorm's centring) is REPEAT_BACK
 * into ne [1, R, ...]: each row's sum, which SUM_ROWS computes with a warp a row. */
TH_EXPORT int64_t th_column_sum_rows(const struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0];
    if (t->op != GGML_OP_REPEAT_BACK || t->type != GGML_TYPE_F32 || a->type != GGML_TYPE_F32) return 0;
    if (!ggml_is_contiguous(a) || a->ne[2] != 1 || a->ne[3] != 1) return 0;
    if (t->ne[0] != a->ne[0] || t->ne[1] != 1 || t->ne[2] != 1 || t->ne[3] != 1) return 0;
    return a->ne[1];
}

TH_EXPORT int th_column_sum_as_out_prod(struct ggml_tensor * t, struct ggml_tensor * ones) {
    const int64_t rows = th_column_sum_rows(t);
    if (rows == 0 || ones->type != GGML_TYPE_F32 || !ggml_is_contiguous(ones) || ones->ne[0] != 1 ||
        ones->ne[1] != rows || ones->ne[2] != 1 || ones->ne[3] != 1) {
        return 0;
    }
    t->op = GGML_OP_OUT_PROD;
    t->src[1] = ones;
    memset(t->op_params, 0, sizeof(t->op_params));
    return 1;
}

/* 1 if t was a REPEAT_BACK of contiguous f32 rows into one value a row, now a SUM_ROWS */
TH_EXPORT int th_row_sum_as_sum_rows(struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0];
    if (t->op != GGML_OP_REPEAT_BACK || t->type != GGML_TYPE_F32 || a->type != GGML_TYPE_F32 ||
        !ggml_is_contiguous(a) || !ggml_is_contiguous(t) || t->ne[0] != 1 || a->ne[0] == 1) {
        return 0;
    }
    for (int i = 1; i < 4; i++) {
        if (t->ne[i] != a->ne[i]) return 0;
    }
    t->op = GGML_OP_SUM_ROWS;
    memset(t->op_params, 0, sizeof(t->op_params));
    return 1;
}

/* ---- a step's inputs: checked and written in one call each --------------------------------
 * A tiny model's step takes ~10 ms; numpy's per-call overhead on the feed (shape, dtype, range
 * and finiteness checks, the one-hot update) was ~1% of it. Each returns -1, or the index of
 * the first value that fails its check, and then writes nothing. */
TH_EXPORT int64_t th_feed_f32(struct ggml_tensor * t, const float * x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(x[i])) return i;
    }
    ggml_backend_tensor_set(t, x, 0, (size_t) n * sizeof(float));
    return -1;
}

/* a packed rows' mask (toyharness/engine/packed.py) names the bounds that the cuda attention reads
 * instead of it (custom_ops.h, th_packed_bounds_of) */
TH_EXPORT void th_link_packed_bounds(struct ggml_tensor * mask, const struct ggml_tensor * bounds) {
    th_packed_bounds_set(mask, bounds);
}

/* ids in [0, upper) (upper <= 0: any id an i32 holds), written as i32 through `scratch` */
TH_EXPORT int64_t th_feed_ids(struct ggml_tensor * t, const int64_t * ids, int64_t n, int64_t upper, int32_t * scratch) {
    const int64_t limit = upper > 0 ? upper : (int64_t) INT32_MAX + 1;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= limit) return i;
        scratch[i] = (int32_t) ids[i];
    }
    ggml_backend_tensor_set(t, scratch, 0, (size_t) n * sizeof(int32_t));
    return -1;
}

/* Class ids in [0, vocab) into the loss's inputs: the one-hot rows (n x vocab, kept in `mirror`
 * between steps: the last step's ones, `last` when has_last, are cleared, the new ones set;
 * uploaded unless mirror is the tensor's own memory) and each row's flat index, row * vocab +
 * id (i32 through `scratch`; the caller keeps n * vocab below 2^31). */
TH_EXPORT int64_t th_feed_targets(struct ggml_tensor * onehot, float * mirror, struct ggml_tensor * flat_index,
                                  const int64_t * ids, int64_t * last, int has_last, int64_t n, int64_t vocab,
                                  int32_t * scratch) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= vocab) return i;
    }
    if (has_last) {
        for (int64_t i = 0; i < n; i++) mirror[i * vocab + last[i]] = 0.0f;
    }
    for (int64_t i = 0; i < n; i++) {
        mirror[i * vocab + ids[i]] = 1.0f;
        last[i] = ids[i];
        scratch[i] = (int32_t) (i * vocab + ids[i]);
    }
    if (mirror != onehot->data) ggml_backend_tensor_set(onehot, mirror, 0, (size_t) (n * vocab) * sizeof(float));
    ggml_backend_tensor_set(flat_index, scratch, 0, (size_t) n * sizeof(int32_t));
    return -1;
}

static void th_abort_handler(const char * message) {
    fflush(stdout);
    fprintf(stderr,
            "toyharness: ggml aborted the process: %s\n"
            "toyharness: this is a bug in toyharness (user input should have been rejected before ggml); please report it\n",
            message);
    fflush(stderr);
}

TH_EXPORT void th_install_abort_handler(void) { ggml_set_abort_callback(th_abort_handler); }

static int th_log_min_level = GGML_LOG_LEVEL_WARN;
static int th_log_last_shown = 0;

static void th_log_handler(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    /* a CONT line continues the previous message: shown when that one was */
    int show = level == GGML_LOG_LEVEL_CONT ? th_log_last_shown : (int) level >= th_log_min_level;
    th_log_last_shown = show;
    if (show) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

TH_EXPORT void th_set_log_level(int min_level) {
    th_log_min_level = min_level;
    ggml_log_set(th_log_handler, NULL);
}

/* ggml's graph allocator treats a node whose data is already set as allocated elsewhere and
 * plans around it. Graphs that share nodes (train, eval, sampling) must therefore forget the
 * previous graph's placement before the allocator places them again: clear every tensor of
 * the compute context (never the persistent ones, which live in another context). */
TH_EXPORT void th_clear_ctx_alloc(struct ggml_context * ctx) {
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t != NULL; t = ggml_get_next_tensor(ctx, t)) {
        t->data = NULL;
        t->buffer = NULL;
    }
}

/* Per-node timing for `toyharness bench --profile`: computes the graph one node at a time (a
 * one-node view each) and writes each node's wall time in microseconds. Slower than one whole
 * compute (a thread hand-off per node), but it shows where a step's time goes. */
TH_EXPORT int th_graph_profile(ggml_backend_t backend, struct ggml_cgraph * graph, double * us_per_node) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_cgraph view = ggml_graph_view(graph, i, i + 1);
        const int64_t t0 = ggml_time_us();
        const enum ggml_status status = ggml_backend_graph_compute(backend, &view);
        ggml_backend_synchronize(backend);
        us_per_node[i] = (double) (ggml_time_us() - t0);
        if (status != GGML_STATUS_SUCCESS) return (int) status;
    }
    return 0;
}

/* ---- how far apart two CPUs are ------------------------------------------------------------
 * ns for one round trip of a cache line between a thread pinned to cpu_a and one pinned to
 * cpu_b (the median of 5 runs of `rounds` trips), or -1 where threads cannot be pinned there
 * (or cpu_a == cpu_b). On the
 * 2-core VM this is about 90 ns most of the time and about 400 ns in phases when the host puts
 * its two CPUs far apart; threads that share data then pay for it (native/cpu_kernels.c, tasks). */
#if defined(__linux__)
struct th_ping {
    _Alignas(64) volatile int turn;
    int cpu, rounds, ok;
};

static int th_pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

static void * th_pong(void * arg) {
    struct th_ping * p = arg;
    p->ok = th_pin_self(p->cpu);
    __atomic_store_n(&p->turn, 2, __ATOMIC_RELEASE);      /* ready */
    for (int i = 0; i < 5 * p->rounds; i++) {
        while (__atomic_load_n(&p->turn, __ATOMIC_ACQUIRE) != 1) {}
        __atomic_store_n(&p->turn, 0, __ATOMIC_RELEASE);
    }
    return NULL;
}

static int th_cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

TH_EXPORT double th_cpu_round_trip_ns(int cpu_a, int cpu_b, int rounds) {
    struct th_ping p = {.turn = 0, .cpu = cpu_b, .rounds = rounds > 0 ? rounds : 1, .ok = 0};
    if (cpu_a == cpu_b) return -1.0;   /* two threads on one CPU would take turns, not trips */
    cpu_set_t before;
    pthread_t t;
    if (pthread_getaffinity_np(pthread_self(), sizeof(before), &before) != 0) return -1.0;
    if (!th_pin_self(cpu_a)) return -1.0;
    if (pthread_create(&t, NULL, th_pong, &p) != 0) {
        pthread_setaffinity_np(pthread_self(), sizeof(before), &before);
        return -1.0;
    }
    while (__atomic_load_n(&p.turn, __ATOMIC_ACQUIRE) != 2) {}
    __atomic_store_n(&p.turn, 0, __ATOMIC_RELEASE);
    double ns[5];
    for (int run = 0; run < 5; run++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int i = 0; i < p.rounds; i++) {
            __atomic_store_n(&p.turn, 1, __ATOMIC_RELEASE);
            while (__atomic_load_n(&p.turn, __ATOMIC_ACQUIRE) != 0) {}
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ns[run] = ((double) (t1.tv_sec - t0.tv_sec) * 1e9 + (double) (t1.tv_nsec - t0.tv_nsec)) / p.rounds;
    }
    pthread_join(t, NULL);
    pthread_setaffinity_np(pthread_self(), sizeof(before), &before);
    if (!p.ok) return -1.0;
    qsort(ns, 5, sizeof(double), th_cmp_double);
    return ns[2];
}
#else
TH_EXPORT double th_cpu_round_trip_ns(int cpu_a, int cpu_b, int rounds) {
    (void) cpu_a, (void) cpu_b, (void) rounds;
    return -1.0;
}
#endif

/* Operands ggml's cpu kernels cannot read strided, made contiguous: a binary op (ADD, SUB, MUL,
 * DIV) whose first operand's elements are not adjacent, an ACC whose first operand is not
 * contiguous. ggml's backward makes such nodes where a tensor with several consumers gets a
 * permuted view's gradient first (the gradients are summed into that view: an abort inside ggml
 * at compute time). A CONT copies floats (no bit changes) and is inserted just before the node
 * that reads it. With apply = 0 only counts; with apply = 1 rewrites (-1: the graph has no room).
 * A graph that ggml could compute as it was gets no node. */
static int th_strided_operand(const struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0];
    if (a == NULL) return 0;
    switch (t->op) {
        case GGML_OP_ADD: case GGML_OP_SUB: case GGML_OP_MUL: case GGML_OP_DIV:
            return a->nb[0] != ggml_type_size(a->type);
        case GGML_OP_ACC:
            return !ggml_is_contiguous(a);
        default:
            return 0;
    }
}

TH_EXPORT int th_cont_strided_operands(struct ggml_context * ctx, struct ggml_cgraph * g, int apply) {
    int needed = 0;
    for (int i = 0; i < g->n_nodes; i++) needed += th_strided_operand(g->nodes[i]);
    if (!apply || needed == 0) return needed;
    if (g->n_nodes + needed > g->size) return -1;
    for (int i = 0; i < g->n_nodes; i++) {
        struct ggml_tensor * t = g->nodes[i];
        if (!th_strided_operand(t)) continue;
        struct ggml_tensor * c = ggml_cont(ctx, t->src[0]);
        memmove(&g->nodes[i + 1], &g->nodes[i], (size_t) (g->n_nodes - i) * sizeof(g->nodes[0]));
        c->flags |= GGML_TENSOR_FLAG_COMPUTE;
        ggml_hash_insert(&g->visited_hash_set, c);
        g->nodes[i] = c;
        g->n_nodes++;
        t->src[0] = c;
        i++;   /* t, now at i + 1 */
    }
    return needed;
}
