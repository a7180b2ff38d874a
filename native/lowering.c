/* Graph surgery for toyharness/engine/lowering.py: a node whose op the backend does not declare
 * is given the op and sources of a replacement expression built (by ggml's own op functions)
 * from its sources, and the expression's new nodes are inserted just before it. The node keeps
 * its identity (name, flags, place in the graph, its gradient slot), so whatever read it reads
 * the replacement's value, and a copy of the graph (ggml_graph_cpy) carries the new nodes. */

#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h"

#if defined(_WIN32)
#define TH_EXPORT __declspec(dllexport)
#else
#define TH_EXPORT __attribute__((visibility("default")))
#endif

static int in_graph(const struct ggml_cgraph * g, struct ggml_tensor * t) {
    return ggml_hash_contains(&g->visited_hash_set, t);
}

/* post-order walk of repl's ancestors that `g` does not hold yet; returns the count or -1 when
 * more than `max` */
static int collect(const struct ggml_cgraph * g, struct ggml_tensor * t, struct ggml_tensor ** out, int n, int max) {
    for (int i = 0; i < n; i++) {
        if (out[i] == t) return n;
    }
    for (int k = 0; k < GGML_MAX_SRC; k++) {
        struct ggml_tensor * s = t->src[k];
        if (s && !in_graph(g, s)) {
            n = collect(g, s, out, n, max);
            if (n < 0) return n;
        }
    }
    if (n >= max) return -1;
    out[n] = t;
    return n + 1;
}

/* The tensors that splicing `repl` in would add to `g` (repl last), in an order that computes
 * each after its sources: count, or -1 when more than `max`. */
TH_EXPORT int th_lowering_new_tensors(const struct ggml_cgraph * g, struct ggml_tensor * repl,
                                      struct ggml_tensor ** out, int max) {
    return collect(g, repl, out, 0, max);
}

static void recount_uses(struct ggml_cgraph * g) {
    for (int i = 0; i < g->n_nodes; i++) {
        g->use_counts[ggml_hash_find(&g->visited_hash_set, g->nodes[i])] = 0;
    }
    for (int i = 0; i < g->n_leafs; i++) {
        g->use_counts[ggml_hash_find(&g->visited_hash_set, g->leafs[i])] = 0;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        for (int k = 0; k < GGML_MAX_SRC; k++) {
            struct ggml_tensor * s = g->nodes[i]->src[k];
            if (s && in_graph(g, s)) {
                g->use_counts[ggml_hash_find(&g->visited_hash_set, s)]++;
            }
        }
    }
}

/* Make `node` of `g` compute `repl` (same type and shape, not a view): repl's new ancestors are
 * inserted before it (leaves must hold data already: constants), then node takes repl's op,
 * parameters and sources. 0 on success; -1 node not in g; -2 repl not of node's type and shape
 * or a view; -3 a new leaf without data; -4 no room in g. Nothing changes unless 0. */
TH_EXPORT int th_lowering_splice(struct ggml_cgraph * g, struct ggml_tensor * node, struct ggml_tensor * repl) {
    int at = -1;
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i] == node) { at = i; break; }
    }
    if (at < 0) return -1;
    if (repl->type != node->type || !ggml_are_same_shape(repl, node) || repl->view_src != NULL ||
        !ggml_is_contiguous(repl) || !ggml_is_contiguous(node)) {
        return -2;
    }
    enum { MAX_NEW = 256 };
    struct ggml_tensor * fresh[MAX_NEW];
    const int n = collect(g, repl, fresh, 0, MAX_NEW);
    if (n < 0) return -4;
    int n_nodes = 0, n_leafs = 0;
    for (int i = 0; i < n - 1; i++) {  /* repl itself (last) becomes node */
        struct ggml_tensor * t = fresh[i];
        if (t->op == GGML_OP_NONE) {
            if (t->data == NULL && t->buffer == NULL) return -3;
            n_leafs++;
        } else {
            n_nodes++;
        }
    }
    if (g->n_nodes + n_nodes > g->size || g->n_leafs + n_leafs > g->size) return -4;
    memmove(&g->nodes[at + n_nodes], &g->nodes[at], (size_t) (g->n_nodes - at) * sizeof(g->nodes[0]));
    int k = at;
    for (int i = 0; i < n - 1; i++) {
        struct ggml_tensor * t = fresh[i];
        ggml_hash_insert(&g->visited_hash_set, t);
        if (t->op == GGML_OP_NONE) {
            g->leafs[g->n_leafs++] = t;
        } else {
            t->flags |= GGML_TENSOR_FLAG_COMPUTE;
            g->nodes[k++] = t;
        }
    }
    g->n_nodes += n_nodes;
    node->op = repl->op;
    memcpy(node->op_params, repl->op_params, sizeof(node->op_params));
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        node->src[s] = repl->src[s];
    }
    recount_uses(g);
    return 0;
}

/* t's 16 op parameters (ints or floats, by op) */
TH_EXPORT void th_lowering_op_params(const struct ggml_tensor * t, int32_t * out) {
    memcpy(out, t->op_params, 16 * sizeof(int32_t));
}
