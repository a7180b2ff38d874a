/* The cuda rewrite's pass: the CONTs that permute dK and dV back become rooms the attention's
 * backward writes, and their order. */
#include "passes.h"

/* The copies out of an ATTN_PREP node read what its ATTN_BWD node writes, and ggml built dvt
 * before dP and dS: in each graph (graphs share nodes, not their order) a copy that comes before
 * the ATTN_BWD node moves to just after it. Returns -1 when it cannot (a node between reads it,
 * or the graph lacks the ATTN_BWD node). */
int th_order_attention_copies(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!(th_marked(t, TH_CUDA_SLICE) || th_marked(t, TH_CUDA_SLICE_CONT)) || t->src[0] == NULL ||
            !th_marked(t->src[0], TH_CUDA_ATTN_PREP)) {
            continue;
        }
        int at_bwd = -1;
        for (int j = 0; j < n && at_bwd < 0; j++) {
            const struct ggml_tensor * u = ggml_graph_node(graph, j);
            if (th_marked(u, TH_CUDA_ATTN_BWD) && u->src[5] == t->src[0]) at_bwd = j;
        }
        if (at_bwd < 0) return -1;
        if (at_bwd < i) continue;
        for (int j = i + 1; j <= at_bwd; j++) {
            const struct ggml_tensor * u = ggml_graph_node(graph, j);
            for (int m = 0; m < GGML_MAX_SRC; m++) {
                if (u->src[m] == t) return -1;
            }
        }
        memmove(graph->nodes + i, graph->nodes + i + 1, sizeof(*graph->nodes) * (size_t) (at_bwd - i));
        graph->nodes[at_bwd] = t;
        i--;                                    /* the node now at i is another one */
    }
    return 0;
}

/* a contiguous f32 node's shape as (ne0, ne1, ne2) (the same elements) */
static void th_set_3d(struct ggml_tensor * t, const int64_t ne0, const int64_t ne1, const int64_t ne2) {
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = ne2, t->ne[3] = 1;
    t->nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * t->ne[i - 1];
}

/* The CONTs that permute attention's dK and dV back to the projections' layout become rooms that
 * the backward kernel writes, instead of copies out of the prep node; the SLICEs fold. With
 * grouped heads (group > 1) the room holds the sums over each group: the REPEAT_BACK that summed
 * the SLICE (th_group_sum), or the CONT that permutes that one back (the REPEAT_BACK folds). A room has
 * no sources, so a graph reaches its writer only through the room's other readers: rooms are for
 * the backward's outputs alone (a backward graph is always built before the first rewrite). O
 * stays a copy out of the forward's node (SLICE_CONT), so a forward graph built after a rewrite
 * still reaches the forward. Returns the nodes marked. */
int th_attention_rooms(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * x = ggml_graph_node(graph, i), * src = x->src[0], * writer = NULL;
        if (!th_marked(x, TH_CUDA_SLICE) || src == NULL) continue;
        th_slice_params slice;
        th_attention_params ap;
        memcpy(&slice, x->op_params + 2, sizeof(slice));
        memcpy(&ap, src->op_params + 2, sizeof(ap));
        const int64_t hd = ap.hd, T = ap.T;
        const int dv = th_marked(src, TH_CUDA_ATTN_PREP) && slice.offset == hd * T;
        if (th_marked(src, TH_CUDA_ATTN_PREP) && (slice.offset == 0 || dv)) {
            for (int j = 0; j < n && writer == NULL; j++) {
                struct ggml_tensor * u = ggml_graph_node(graph, j);
                if (th_marked(u, TH_CUDA_ATTN_BWD) && u->src[5] == src) writer = u;
            }
        }
        th_attention_map map;
        const int64_t n0 = dv ? T : hd, n1 = dv ? hd : T, heads = ggml_nelements(x) / (hd * T);
        const int group = writer != NULL ? th_attention_params_of(writer).group : 1;
        struct ggml_tensor * room = NULL;
        if (writer != NULL && x->ne[0] == n0 && x->ne[1] == n1 && group > 1) {
            struct ggml_tensor * sum = th_group_sum(graph, x, hd * T, heads, group);
            if (sum == NULL) continue;                  /* th_check_group_rooms refuses the graph */
            room = th_permuted_cont_of(graph, sum, &map, n0, n1, heads / group);
            if (room != NULL) {
                th_fold(sum, 1);
                marked++;
            } else {                                    /* the sum itself, as (n0, n1, kv heads) */
                room = sum;
                th_set_3d(sum, n0, n1, heads / group);
                map = (th_attention_map) {{0, 1, 2, -1}};
            }
        } else if (writer != NULL && x->ne[0] == n0 && x->ne[1] == n1) {
            room = th_permuted_cont_of(graph, x, &map, n0, n1, heads);
        }
        if (room == NULL) continue;
        if (dv) {                                   /* dV^T's axis 0 is t: the map is (d, t, h, b) */
            const int8_t t_axis = map.axis[0];
            map.axis[0] = map.axis[1], map.axis[1] = t_axis;
        }
        th_mark(room, TH_CUDA_ROOM);
        th_set_srcs(room, NULL, NULL, NULL, NULL, NULL, NULL);
        th_fold(x, 1);
        writer->src[6 + dv] = room;
        th_attention_map_set(writer, dv, map);
        marked += 2;
    }
    return marked;
}

/* -1 when a SLICE, or a copy out of one, reads dK or dV^T from the prep node of a grouped attention
 * (its backward writes the group sums into rooms only), else 0 */
int th_check_group_rooms(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * t = ggml_graph_node(graph, i), * src = t->src[0];
        if ((th_marked(t, TH_CUDA_SLICE) || th_marked(t, TH_CUDA_SLICE_CONT)) && src != NULL &&
            th_marked(src, TH_CUDA_ATTN_PREP) && th_attention_params_of(src).group > 1) {
            return -1;
        }
    }
    return 0;
}
