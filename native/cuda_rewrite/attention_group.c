/* The cuda rewrite's pass: grouped-query attention: the kv heads read in place where ggml repeated
 * them. */
#include "passes.h"

/* a REPEAT of kv heads that grouped-query heads no longer need (th_attention_group): it computes
 * nothing, and keeps the tensor it repeated in op_params[2..] for th_operand_source */
static void th_fold_repeat(struct ggml_tensor * p, struct ggml_tensor * repeated) {
    th_fold(p, 1);
    th_set_params(p, &repeated, sizeof(repeated));
}

/* Where attention operand `x` ((n0, n1) a head, `heads` heads) is, under RESHAPE views, the REPEAT
 * of Tensor.repeat_heads: REPEAT(flat (n0 n1, 1, K, B) into (n0 n1, g, K, B)), flat a RESHAPE of a
 * contiguous R of K B = heads / g heads of (n0, n1): that REPEAT, with *repeated R and *group g.
 * Else NULL. */
static struct ggml_tensor * th_heads_repeat(struct ggml_tensor * x, const int64_t n0, const int64_t n1,
                                            const int64_t heads, struct ggml_tensor ** repeated, int * group) {
    while (x != NULL && x->op == GGML_OP_RESHAPE) x = x->src[0];
    if (x == NULL || x->op != GGML_OP_REPEAT || !th_f32_contiguous(x)) return NULL;
    struct ggml_tensor * flat = x->src[0], * r = flat != NULL ? flat->src[0] : NULL;
    const int64_t g = x->ne[1];
    if (flat == NULL || flat->op != GGML_OP_RESHAPE || !th_f32_contiguous(flat) || r == NULL || !th_f32_contiguous(r) || g < 2 ||
        g > INT32_MAX || flat->ne[0] != n0 * n1 || flat->ne[1] != 1 || x->ne[0] != n0 * n1 ||
        x->ne[2] != flat->ne[2] || x->ne[3] != flat->ne[3] || flat->ne[2] * flat->ne[3] * g != heads ||
        r->ne[0] != n0 || r->ne[1] != n1 || r->ne[2] * r->ne[3] * g != heads) {
        return NULL;
    }
    *repeated = r;
    *group = (int) g;
    return x;
}

static void th_attention_set_group(struct ggml_tensor * t, const int group) {
    th_attention_params params = th_attention_params_of(t);
    params.group = group;
    th_set_params(t, &params, sizeof(params));          /* the maps after it keep their bytes */
}

/* whether `s` is `p` or a view of it */
static int th_is_or_views(const struct ggml_tensor * s, const struct ggml_tensor * p) {
    return s != NULL && (s == p || s->view_src == p);
}

/* Grouped-query heads read in place (th_cuda_rewrite's attention flag 2): where the attention of
 * `fwd` (ATTN_FWD) reads k and v^T through REPEATs of the kv heads (Tensor.repeat_heads) that only
 * its nodes read, its nodes read the kv heads themselves (group > 1) and the REPEATs compute
 * nothing; the backward's dK and dV^T, which REPEAT_BACKs summed over each group, go summed by
 * ATTN_BWD into rooms (th_attention_rooms). Only where every SLICE of dK or dV^T out of its prep
 * node in `graph` reaches such a REPEAT_BACK. Returns the REPEATs folded (0: none, as before). */
int th_attention_group(struct ggml_cgraph * graph, struct ggml_tensor * fwd) {
    const th_attention_params params = th_attention_params_of(fwd);
    if (params.group > 1) return 0;                        /* grouped by an earlier graph */
    const int64_t hd = params.hd, T = params.T, heads = fwd->ne[1];
    struct ggml_tensor * rk = NULL, * rv = NULL, * bwd = NULL, * dq = NULL;
    int gk = 0, gv = 0;
    struct ggml_tensor * pk = th_heads_repeat(fwd->src[1], hd, T, heads, &rk, &gk);
    struct ggml_tensor * pv = th_heads_repeat(fwd->src[2], T, hd, heads, &rv, &gv);
    if (pk == NULL || pv == NULL || pk == pv || gk != gv) return 0;
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (th_marked(u, TH_CUDA_ATTN_BWD) && u->src[4] == fwd) bwd = u;
    }
    for (int i = 0; i < n && bwd != NULL; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (th_marked(u, TH_CUDA_ATTN_DQ) && u->src[6] == bwd) dq = u;
    }
    struct ggml_tensor * prep = bwd != NULL ? bwd->src[5] : NULL;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (u->view_src == pk || u->view_src == pv) continue;          /* a view: its readers are checked */
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (th_is_or_views(u->src[j], pk) && !(j == 1 && (u == fwd || u == bwd || u == dq))) return 0;
            if (th_is_or_views(u->src[j], pv) && !(j == 2 && (u == fwd || u == bwd || u == dq))) return 0;
        }
        if (prep != NULL && th_marked(u, TH_CUDA_SLICE) && u->src[0] == prep) {
            th_slice_params slice;
            memcpy(&slice, u->op_params + 2, sizeof(slice));
            if ((slice.offset != 0 && slice.offset != hd * T) || th_group_sum(graph, u, hd * T, heads, gk) == NULL) {
                return 0;
            }
        }
    }
    struct ggml_tensor * nodes[4] = {fwd, prep, bwd, dq};
    for (int i = 0; i < 4; i++) {
        if (nodes[i] == NULL) continue;
        if (i != 1 && th_is_or_views(nodes[i]->src[1], pk)) nodes[i]->src[1] = rk;
        if (i != 1 && th_is_or_views(nodes[i]->src[2], pv)) nodes[i]->src[2] = rv;
        th_attention_set_group(nodes[i], gk);
    }
    th_fold_repeat(pk, rk);
    th_fold_repeat(pv, rv);
    return 2;
}
