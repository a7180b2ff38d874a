/* The cuda rewrite's pass: runs of consecutive AdamW steps: one multi-tensor AdamW. */
#include "passes.h"

/* an OPT_STEP_ADAMW node that the multi-tensor kernel takes, with `row` its hyperparameters */
static int th_adamw_takes(const struct ggml_tensor * t, const struct ggml_tensor * row) {
    if (t->op != GGML_OP_OPT_STEP_ADAMW || t->src[4] != row || !th_f32_contiguous(row) || ggml_nelements(row) != 7) {
        return 0;
    }
    for (int i = 0; i < 4; i++) {
        if (!th_f32_contiguous(t->src[i]) || !ggml_are_same_shape(t->src[0], t->src[i])) return 0;
    }
    return 1;
}

/* Runs of two or more consecutive AdamW steps sharing a row become one multi-tensor AdamW (the
 * run's last node computes it). Consecutive: between the first and the last nothing else is
 * computed or allocated (a step's node is a view of its parameter), so every gradient the run
 * reads is still in place when the last node runs. */
int th_rewrite_adamw_runs(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n;) {
        const struct ggml_tensor * first = ggml_graph_node(graph, i);
        if (!th_adamw_takes(first, first->src[4])) {
            i++;
            continue;
        }
        int end = i + 1;
        while (end < n && th_adamw_takes(ggml_graph_node(graph, end), first->src[4])) end++;
        if (end - i >= 2) {
            th_adamw_link link = {NULL, ggml_graph_node(graph, end - 1)};
            for (int k = i; k < end; k++) {
                struct ggml_tensor * t = ggml_graph_node(graph, k);
                th_mark(t, TH_CUDA_ADAMW);
                th_set_params(t, &link, sizeof(link));
                link.prev = t;
                marked++;
            }
        }
        i = end;
    }
    return marked;
}

/* every AdamW node of a run (marked by any graph) sits in this graph, its whole run consecutive
 * and ending at the run's last node, which computes them all: else -1 (a step would be skipped,
 * or would read a gradient whose memory another node took in between) */
int th_check_adamw_runs(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!th_marked(t, TH_CUDA_ADAMW)) continue;
        const struct ggml_tensor * last = th_adamw_link_of(t).last;
        int found = 0;
        for (int j = i; j < n && !found; j++) found = ggml_graph_node(graph, j) == last;
        if (!found) return -1;
        if (t != last) continue;
        int at = i;
        for (const struct ggml_tensor * u = th_adamw_link_of(t).prev; u != NULL; u = th_adamw_link_of(u).prev) {
            if (--at < 0 || ggml_graph_node(graph, at) != u || !th_marked(u, TH_CUDA_ADAMW) ||
                th_adamw_link_of(u).last != last) {
                return -1;
            }
        }
    }
    return 0;
}
