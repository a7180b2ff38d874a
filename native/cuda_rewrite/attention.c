/* The cuda rewrite's pass: attention's nodes (S, P, O and their backward) become the fused kernels
 * of cuda/th-attention.cu. */
#include "passes.h"
#include "../dropout_mask.h"

static int th_is_attention_node(const struct ggml_tensor * t) {
    return th_marked(t, TH_CUDA_ATTN_FWD) || th_marked(t, TH_CUDA_ATTN_PREP) || th_marked(t, TH_CUDA_ATTN_BWD) ||
           th_marked(t, TH_CUDA_ATTN_DQ);
}

static struct ggml_tensor * th_repeated_of(const struct ggml_tensor * t) {
    struct ggml_tensor * r = NULL;
    if (t != NULL && th_marked(t, TH_CUDA_FOLDED)) memcpy(&r, t->op_params + 2, sizeof(r));
    return r;
}

/* What an attention operand reads: under its RESHAPE views, the view that its CONT copies (a CONT
 * folded into the attention's nodes keeps that source: th_fold_attention_operands); else t. The
 * same operand before and after a fold (graphs share nodes: an earlier graph may have folded it). */
static const struct ggml_tensor * th_operand_source(const struct ggml_tensor * t) {
    for (;;) {          /* through a REPEAT folded for grouped heads: its nodes now read what it repeated */
        t = th_under_reshape_views((struct ggml_tensor *) t);
        const struct ggml_tensor * r = th_repeated_of(t);
        if (r == NULL) break;
        t = r;
    }
    if (t != NULL && t->src[0] != NULL &&
        (t->op == GGML_OP_CONT || th_marked(t, TH_CUDA_CONT) || th_marked(t, TH_CUDA_FOLDED))) {
        return t->src[0];
    }
    return t;
}

/* the node OUT_PROD(a, b) of `graph` (a as an attention operand), b directly or (`transposed`)
 * through a TRANSPOSE view */
static struct ggml_tensor * th_out_prod(struct ggml_cgraph * graph, const struct ggml_tensor * a,
                                        const struct ggml_tensor * b, int transposed) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (u->op != GGML_OP_OUT_PROD || u->src[1] == NULL || th_operand_source(u->src[0]) != th_operand_source(a)) {
            continue;
        }
        const struct ggml_tensor * s = u->src[1];
        if (transposed ? s->op == GGML_OP_TRANSPOSE && s->src[0] == b : s == b) return u;
    }
    return NULL;
}

/* a node whose value the fused kernels compute themselves: it computes nothing, reads nothing
 * and holds one float */
static void th_compute_nothing(struct ggml_tensor * t) {
    t->op = GGML_OP_NONE;
    th_set_srcs(t, NULL, NULL, NULL, NULL, NULL, NULL);
    memset(t->op_params, 0, sizeof(t->op_params));
    th_set_rows(t, 1, 1);
}

/* P's dropout (blocks.attention's `dropout`): the MUL of P by a dropout mask (dropout_mask.h's
 * node, P's shape), where `dropout` lets the kernels draw the mask themselves; else NULL */
static struct ggml_tensor * th_dropout_of(struct ggml_cgraph * graph, struct ggml_tensor * p, const int dropout) {
    struct ggml_tensor * pd = NULL;
    for (int i = 0; i < ggml_graph_n_nodes(graph) && dropout; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (u->op == GGML_OP_MUL && u->src[0] == p && u->src[1] != NULL && th_is_dropout_mask(u->src[1]) &&
            ggml_are_same_shape(u, p) && ggml_are_same_shape(u->src[1], p) && th_f32_contiguous(u->src[1]) &&
            th_f32_contiguous(u)) {
            if (pd != NULL) return NULL;
            pd = u;
        }
    }
    return pd;
}

/* Packed rows (toyharness/engine/packed.py): the softmax of S (T, T, BH) reshaped to (T, T, H, B)
 * under the fed mask (T, T, 1, B) of name "packed_mask.*", which holds the address of the fed
 * bounds (custom_ops.h, th_packed_bounds_of: i32 (T, 2, B)); the readers of P read it reshaped
 * back to (T, T, BH). The bounds where p is such a softmax and the mask has them; else NULL. */
static struct ggml_tensor * th_packed_bounds(const struct ggml_tensor * p, const int64_t T) {
    const struct ggml_tensor * mask = p->src[1];
    if (mask == NULL || strncmp(mask->name, "packed_mask.", 12) != 0 || mask->type != GGML_TYPE_F32 ||
        mask->ne[0] != T || mask->ne[1] != T || mask->ne[2] != 1 || p->ne[3] != mask->ne[3]) {
        return NULL;
    }
    struct ggml_tensor * bounds = th_packed_bounds_of(mask);
    if (bounds == NULL || strncmp(bounds->name, "packed_bounds.", 14) != 0 || bounds->type != GGML_TYPE_I32 ||
        bounds->ne[0] != T || bounds->ne[1] != 2 || bounds->ne[2] != mask->ne[3] || bounds->ne[3] != 1 ||
        !ggml_is_contiguous(bounds)) {
        return NULL;
    }
    return bounds;
}

/* a node whose value the fused kernels compute themselves, read through a RESHAPE `view` (of its
 * own shape otherwise): each reader of the view reads t itself, and the view computes nothing */
static void th_read_past_view(struct ggml_cgraph * graph, struct ggml_tensor * view, struct ggml_tensor * t) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (u->src[j] == view) u->src[j] = t;
        }
        if (u->view_src == view) u->view_src = t;          /* a TRANSPOSE of the view */
    }
    th_compute_nothing(view);
}

/* the RESHAPE views of t in `graph` (packed rows' P and dS, seen as (T, T, BH)) read past */
static void th_read_past_views(struct ggml_cgraph * graph, struct ggml_tensor * t) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (u->view_src == t && (u->op == GGML_OP_RESHAPE || u->op == GGML_OP_NONE) && u->view_offs == 0) {
            th_read_past_view(graph, u, t);
        }
    }
}

/* t (contiguous) as (ne0, ne1, heads): packed rows' (T, T, H, B) node as the unpacked one */
static void th_as_heads(struct ggml_tensor * t, const int64_t heads) {
    t->ne[2] = heads, t->ne[3] = 1;
    t->nb[3] = t->nb[2] * (size_t) heads;
}

/* The forward of one attention whose probabilities P (a SOFT_MAX) every reader of which is one
 * of O, its backward's dvt and dS: P becomes ATTN_FWD, O its copy, S nothing. With dropout on P
 * (`dropout`: the kernels at this precision draw its mask; th_dropout_of), O, dvt and dP's MUL
 * read P times the mask instead, and the mask, that product and P's MUL in the backward compute
 * nothing: the kernels draw the mask's elements where they use them. Returns 3 (5 with dropout),
 * 0 when the nodes are not attention's (left to ggml). */
static int th_attention_forward(struct ggml_cgraph * graph, struct ggml_tensor * p, const int dropout) {
    struct ggml_tensor * s = p->src[0], * mask = p->src[1], * only, * s_view = NULL, * p_view = NULL;
    /* packed rows: S and P seen through RESHAPEs (th_packed_bounds), each read by one node */
    if (s != NULL && s->op == GGML_OP_RESHAPE && s->view_offs == 0 && th_readers(graph, s, &only) == 1) {
        s_view = s;
        s = s->src[0];
    }
    if (s == NULL || s->op != GGML_OP_MUL_MAT || p->src[2] != NULL || th_readers(graph, s, &only) != 1) return 0;
    struct ggml_tensor * k = s->src[0], * q = s->src[1];
    const int64_t hd = q->ne[0], T = q->ne[1], heads = q->ne[2];
    float scale, max_bias;
    memcpy(&scale, p->op_params, sizeof(float));
    memcpy(&max_bias, p->op_params + 1, sizeof(float));
    struct ggml_tensor * bounds = s_view != NULL ? th_packed_bounds(p, T) : NULL;
    const int causal = bounds != NULL ? TH_ATTENTION_PACKED : mask != NULL ? TH_ATTENTION_CAUSAL : 0;
    if (s_view != NULL) {               /* P (T, T, H, B) read by one RESHAPE to (T, T, BH) and dS */
        for (int i = 0; i < ggml_graph_n_nodes(graph) && bounds != NULL; i++) {
            struct ggml_tensor * u = ggml_graph_node(graph, i);
            if (u->op == GGML_OP_RESHAPE && u->src[0] == p && p_view == NULL) p_view = u;
        }
        if (bounds == NULL || p_view == NULL || p->ne[2] * p->ne[3] != heads || !th_shape_is(s, T, T, heads) ||
            !th_shape_is(p_view, T, T, heads)) {
            return 0;
        }
    }
    if (max_bias != 0.0f || !th_attention_head_dim_ok(hd) || T > INT32_MAX / 2 || !th_f32_contiguous(q) ||
        !th_f32_contiguous(k) || !th_shape_is(k, hd, T, heads) || !th_f32_contiguous(p) ||
        (bounds == NULL && !th_shape_is(p, T, T, heads)) || (bounds != NULL && (p->ne[0] != T || p->ne[1] != T)) ||
        (causal == TH_ATTENTION_CAUSAL && (strncmp(mask->name, "causal_mask.", 12) != 0 || !th_shape_is(mask, T, T, 1)))) {
        return 0;
    }
    /* what O reads: P, or P times its dropout mask (pd), which P's backward MUL also reads
     * (packed rows: P through its RESHAPE, no dropout) */
    struct ggml_tensor * pd = bounds != NULL ? NULL : th_dropout_of(graph, p, dropout), * drop = pd != NULL ? pd->src[1] : NULL;
    struct ggml_tensor * read = pd != NULL ? pd : p_view != NULL ? p_view : p, * o = NULL;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            const struct ggml_tensor * x = u->src[j];
            if (x == NULL || (x != p && x != read && (drop == NULL || x != drop))) continue;
            if (x == p && u == p_view) continue;
            if (x == read && j == 1 && u->op == GGML_OP_MUL_MAT && o == NULL) {
                o = u;
            } else if (!(x == read && j == 0 && u->op == GGML_OP_OUT_PROD) &&           /* dvt */
                       !(x == p && j == 1 && u->op == GGML_OP_SOFT_MAX_BACK) &&          /* dS */
                       !(x == p && u == pd) && !(x == drop && (u == pd || (j == 1 && u->op == GGML_OP_MUL)))) {
                return 0;          /* read by a node we do not rewrite: P (and its mask) must stay */
            }
        }
    }
    struct ggml_tensor * vt = o != NULL ? o->src[0] : NULL;
    if (o == NULL || !th_f32_contiguous(vt) || !th_shape_is(vt, T, hd, heads) || !th_f32_contiguous(o) ||
        !th_shape_is(o, hd, T, heads)) {
        return 0;
    }
    if (p_view != NULL) {               /* packed rows: P's readers read it as (T, T, BH) */
        th_read_past_view(graph, p_view, p);
        th_compute_nothing(s_view);
        th_as_heads(p, heads);
    }
    th_attention_params params = {(int32_t) hd, (int32_t) T, causal, scale, 1, {0, 0, 0, 0}};
    if (drop != NULL) {
        const th_dropout_params dp = th_dropout_params_of(drop, TH_DROPOUT_SLOT);   /* dropout_mask.h's words */
        params.dropout[0] = (int32_t) dp.node;
        params.dropout[1] = (int32_t) (uint32_t) dp.threshold;
        params.dropout[2] = (int32_t) (uint32_t) (dp.threshold >> 32);
        memcpy(&params.dropout[3], &dp.kept, sizeof(float));
    }
    th_mark(p, TH_CUDA_ATTN_FWD);
    th_set_params(p, &params, sizeof(params));
    /* with dropout: the fed key, then the mask and P times it (computing nothing), which the
     * backward finds its MULs by */
    th_set_srcs(p, q, k, vt, drop != NULL ? drop->src[0] : NULL, drop, pd);
    p->src[TH_ATTENTION_BOUNDS_SRC] = bounds;
    th_set_rows(p, th_attention_fwd_floats(hd, T), heads);
    th_mark(o, TH_CUDA_SLICE);
    const th_slice_params slice = {th_attention_fwd_floats(hd, T), 0};
    th_set_params(o, &slice, sizeof(slice));
    th_set_srcs(o, p, NULL, NULL, NULL, NULL, NULL);
    th_compute_nothing(s);
    if (drop == NULL) return 3;
    th_compute_nothing(pd);
    th_compute_nothing(drop);
    return 5;
}

/* The backward of the attention whose forward node is `fwd` (ATTN_FWD), where `graph` has it.
 * Returns the nodes marked, 0 when the graph has no backward of it, -1 when it has one of
 * another shape (P no longer exists to compute it from). */
static int th_attention_backward(struct ggml_cgraph * graph, struct ggml_tensor * fwd) {
    th_attention_params params;
    memcpy(&params, fwd->op_params + 2, sizeof(params));
    struct ggml_tensor * q = fwd->src[0], * k = fwd->src[1], * vt = fwd->src[2], * ds = NULL, * only;
    for (int i = 0; i < ggml_graph_n_nodes(graph) && ds == NULL; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (u->src[1] == fwd && u->op == GGML_OP_SOFT_MAX_BACK) ds = u;
    }
    if (ds == NULL) return 0;                       /* no backward here, or marked already */
    struct ggml_tensor * dp = ds->src[0], * dp_drop = NULL, * dp_view = NULL;
    if (params.causal == TH_ATTENTION_PACKED) {
        /* packed rows: dS = SOFT_MAX_BACK(dP as (T, T, H, B), P), read as (T, T, BH); P's readers
         * here (dV's product) read it through its RESHAPE, which an earlier graph may have read past */
        th_read_past_views(graph, fwd);
        if (dp == NULL || dp->op != GGML_OP_RESHAPE || dp->view_offs != 0 || th_readers(graph, dp, &only) != 1 ||
            !th_f32_contiguous(ds) || ds->ne[0] != params.T || ds->ne[1] != params.T) {
            return -1;
        }
        dp_view = dp;
        dp = dp->src[0];
        th_read_past_views(graph, ds);              /* dK's and dQ's products read dS as (T, T, BH) */
    }
    if (th_attention_has_dropout(&params)) {       /* dP = MUL(dO V^T, the mask): the kernels apply it */
        dp_drop = dp;
        if (dp_drop == NULL || dp_drop->op != GGML_OP_MUL || dp_drop->src[1] != fwd->src[4] ||
            th_readers(graph, dp_drop, &only) != 1) {
            return -1;
        }
        dp = dp_drop->src[0];
    }
    if (ds->op != GGML_OP_SOFT_MAX_BACK || dp == NULL || dp->op != GGML_OP_OUT_PROD ||
        th_operand_source(dp->src[0]) != th_operand_source(vt) ||
        dp->src[1] == NULL || dp->src[1]->op != GGML_OP_TRANSPOSE || th_readers(graph, dp, &only) != 1) {
        return -1;
    }
    const int64_t hd = params.hd, T = params.T, heads = q->ne[2] * q->ne[3];   /* q: maybe a (hd, T, H, B) view */
    struct ggml_tensor * dout = dp->src[1]->src[0];
    /* dV^T's product reads P, or P times the mask (ATTN_FWD's src 5 with dropout) */
    struct ggml_tensor * dvt = th_out_prod(graph, dp_drop != NULL ? fwd->src[5] : fwd, dout, 0);
    struct ggml_tensor * dk = th_out_prod(graph, q, ds, 0);
    struct ggml_tensor * dq = th_out_prod(graph, k, ds, 1);
    int ds_readers = th_readers(graph, ds, &only);
    if (!th_f32_contiguous(dout) || !th_shape_is(dout, hd, T, heads) || !th_f32_contiguous(ds) ||
        (dvt != NULL && !th_f32_contiguous(dvt)) || (dk != NULL && !th_f32_contiguous(dk)) ||
        ds_readers != (dk != NULL) + (dq != NULL)) {
        return -1;
    }
    struct ggml_tensor * dout_t = dp->src[1];
    if (dp_view != NULL) {                          /* packed rows: dS's readers read it as (T, T, BH) */
        ds->src[0] = dp;
        th_compute_nothing(dp_view);
        th_as_heads(ds, heads);
    }
    if (dp_drop != NULL) {                          /* computes nothing: the backward applies the mask */
        th_compute_nothing(dp_drop);
    }
    th_mark(dp, TH_CUDA_ATTN_PREP);
    th_set_params(dp, &params, sizeof(params));
    th_set_srcs(dp, dout, fwd, NULL, NULL, NULL, NULL);
    th_set_rows(dp, th_attention_prep_floats(hd, T), heads);
    th_mark(ds, TH_CUDA_ATTN_BWD);
    th_set_params(ds, &params, sizeof(params));
    th_set_srcs(ds, q, k, vt, dout, fwd, dp);
    if (th_readers(graph, dout_t, &only) == 0) {
        /* the transposed view of dO that dP read: a view nothing reads would keep dO allocated
         * to the graph's end (ggml-alloc frees a source when its views are done) */
        dout_t->op = GGML_OP_NONE;
    }
    int marked = 2 + (dp_drop != NULL);
    if (dk != NULL) {
        const th_slice_params slice = {th_attention_prep_floats(hd, T), 0};
        th_mark(dk, TH_CUDA_SLICE);
        th_set_params(dk, &slice, sizeof(slice));
        th_set_srcs(dk, dp, NULL, NULL, NULL, NULL, NULL);
        marked++;
    }
    if (dvt != NULL) {
        const th_slice_params slice = {th_attention_prep_floats(hd, T), hd * T};
        th_mark(dvt, TH_CUDA_SLICE);
        th_set_params(dvt, &slice, sizeof(slice));
        th_set_srcs(dvt, dp, NULL, NULL, NULL, NULL, NULL);
        marked++;
    }
    if (dq != NULL) {
        /* dQ's own node, (hd, T, BH); or the CONT that permutes it back to the projection's
         * layout, which then computes it in place of the copy (the product folds) */
        th_attention_map map = {{0, 1, 2, -1}};
        struct ggml_tensor * ds_t = dq->src[1];
        struct ggml_tensor * node = th_permuted_cont_of(graph, dq, &map, hd, T, heads);
        if (node != NULL) {
            th_fold(dq, 1);
            marked++;
        } else {
            if (!th_f32_contiguous(dq) || !th_shape_is(dq, hd, T, heads)) return -1;
            node = dq;
        }
        th_mark(node, TH_CUDA_ATTN_DQ);
        th_set_params(node, &params, sizeof(params));
        th_attention_map_set(node, 0, map);
        /* the backward's sources (at tf32 and bf16 dQ's kernel computes dS's tiles again from them), then dS */
        th_set_srcs(node, q, k, vt, dout, fwd, dp);
        node->src[6] = ds;
        if (th_readers(graph, ds_t, &only) == 0) ds_t->op = GGML_OP_NONE;     /* as dO's view above */
        marked++;
    }
    return marked;
}

/* Attention's operands q, k, v^T and dO are CONTs of head-permuted views of the projections
 * (blocks.attention). Where only attention's nodes read one (and views of it), those nodes read
 * the view itself, through its strides, and the CONT folds: it keeps the view as its source, for
 * th_operand_source. An operand's (ne0, ne1) are the CONT's, its heads the CONT's ne2 x ne3.
 * Returns the CONTs folded. */
static int th_fold_attention_operands(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int folded = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        for (int m = 0; m < 4 && th_is_attention_node(u); m++) {
            struct ggml_tensor * c = u->src[m];
            while (c != NULL && c->op == GGML_OP_RESHAPE) c = c->src[0];
            if (c == NULL || !(c->op == GGML_OP_CONT || th_marked(c, TH_CUDA_CONT)) || c->src[0] == NULL ||
                c->src[0]->type != GGML_TYPE_F32 || (c->flags & GGML_TENSOR_FLAG_OUTPUT)) {
                continue;
            }
            struct ggml_tensor * view = c->src[0];
            int ok = 1;
            for (int k = 0; k < GGML_MAX_DIMS; k++) ok &= view->nb[k] % sizeof(float) == 0;
            for (int j = 0; j < n && ok; j++) {
                const struct ggml_tensor * w = ggml_graph_node(graph, j);
                if (w->view_src == c) continue;                    /* a view: its readers are checked */
                for (int k = 0; k < GGML_MAX_SRC; k++) {
                    const struct ggml_tensor * s = w->src[k];
                    if (s == NULL || (s != c && s->view_src != c)) continue;
                    ok &= s == c || (s->op == GGML_OP_RESHAPE && s->view_offs == 0);     /* not a permute */
                    /* a reader of ours, at an operand's place, with the CONT's rows and heads */
                    ok &= th_is_attention_node(w) && k < 4 &&
                          !(th_marked(w, TH_CUDA_ATTN_PREP) && k != 0) && s->ne[0] == c->ne[0] &&
                          s->ne[1] == c->ne[1] && s->ne[2] * s->ne[3] == c->ne[2] * c->ne[3];
                }
            }
            if (!ok) continue;
            for (int j = 0; j < n; j++) {
                struct ggml_tensor * w = ggml_graph_node(graph, j);
                if (!th_is_attention_node(w)) continue;
                for (int k = 0; k < 4; k++) {
                    if (w->src[k] != NULL && (w->src[k] == c || w->src[k]->view_src == c)) w->src[k] = view;
                }
            }
            th_fold(c, 1);
            c->src[0] = view;
            folded++;
        }
    }
    return folded;
}

/* Every attention of `graph`: forward and, where the graph has it, backward; with `group`, the
 * kv heads read in place (th_attention_group); with `dropout`, an attention with dropout on P
 * too (the precision's kernels draw its mask: bf16's and tf32's). Returns the nodes marked, or -1
 * (see th_attention_backward). */
int th_rewrite_attention(struct ggml_cgraph * graph, const int group, const int dropout) {
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (t->op == GGML_OP_SOFT_MAX && t->type == GGML_TYPE_F32) {
            marked += th_attention_forward(graph, t, dropout);
        }
        if (th_marked(t, TH_CUDA_ATTN_FWD)) {
            const int back = th_attention_backward(graph, t);
            if (back < 0) return -1;
            marked += back;
            for (int j = 0; j < ggml_graph_n_nodes(graph); j++) {    /* nothing else reads P */
                const struct ggml_tensor * u = ggml_graph_node(graph, j);
                for (int m = 0; m < GGML_MAX_SRC; m++) {
                    if (u->src[m] == t && !th_marked(u, TH_CUDA_SLICE) && !th_marked(u, TH_CUDA_SLICE_CONT) &&
                        !th_marked(u, TH_CUDA_ATTN_PREP) && !th_marked(u, TH_CUDA_ATTN_BWD) &&
                        !th_marked(u, TH_CUDA_ATTN_DQ)) {
                        return -1;
                    }
                }
            }
            if (group) marked += th_attention_group(graph, t);
        }
    }
    return marked + th_fold_attention_operands(graph);
}
