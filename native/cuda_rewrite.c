/* toyharness cuda rewrite: hands graph nodes to our kernels inside ggml-cuda (cuda/th-custom.cu).
 *
 * ggml-cuda has no custom ops, so a cuda build patches one dispatch into ggml-cuda.cu
 * (native/build.py, stage_cuda_source): a GGML_OP_CUSTOM node whose op_params start with
 * TH_CUDA_MAGIC goes to th_cuda_custom. Nodes are marked here, on the host, after the Trainer
 * has built the backward (a custom op has none in ggml): the same stand-ins as the cpu rewrite.
 *   - GELU: the SILU named "th.gelu_tanh" and its SILU_BACK (blocks.gelu_tanh), one kernel each
 *     way instead of 5 nodes forward and 12 backward over the MLP's widest activation.
 *   - CONT of a permuted f32 tensor (attention's head permutes), an exact copy at memory speed.
 *   - Attention (blocks.attention), when asked: the nodes ggml's autograd built for
 *       S = MUL_MAT(k, q), P = SOFT_MAX(S, causal mask or none, scale), O = MUL_MAT(vt, P)
 *     and for their backward
 *       dvt = OUT_PROD(P, dO), dP = OUT_PROD(vt, T(dO)), dS = SOFT_MAX_BACK(dP, P),
 *       dk = OUT_PROD(q, dS), dq = OUT_PROD(k, T(dS))
 *     become the fused kernels of cuda/th-attention.cu (custom_ops.h has their layouts): P the
 *     forward (O and L, S then computes nothing), dP the prep (D), dS the backward (dS, dK, dV;
 *     at tf32 and bf16 dK and dV alone: native/cuda_precision.c), dq our dQ kernel. The kernels
 *     read q, k, v^T and dO through their strides, so the CONTs
 *     that permuted them out of the projections' layout fold; the CONTs that permute dK, dV and
 *     dQ back become the nodes those kernels write (dK's and dV's are rooms, moved before their
 *     writer in every graph), and O's copies straight out of the forward's node: 1 of attention's
 *     8 head-permute copies a layer is left. A graph whose nodes
 *     do not have exactly this shape keeps ggml's nodes (or copies, where a CONT is read
 *     elsewhere).
 *   - Products added together (an input's gradient from several projections: q, k and v):
 *     one node, each cuBLAS OUT_PROD call adding into the sum so far (beta 1).
 *   - A residual's gradient added to LayerNorm's input gradient: added by LayerNorm's backward.
 *   - A bias added to a product's rows (blocks.linear: ADD(MUL_MAT(w, x) through reshapes, b)):
 *     the ADD becomes one node of ours, cuBLASLt's product with b added in its epilogue (b
 *     broadcast into its rows then cuBLAS's product added with beta 1 where cuBLASLt has no
 *     algorithm for the shape), instead of a product and a pass that reads it again; the
 *     product's node computes nothing.
 *   - GET_ROWS_BACK (an embedding's gradient): ggml-cuda's kernel gives each output element a
 *     thread that reads all R ids from memory (1 ms a step at nanoGPT's size); ours stages them
 *     in shared memory once per block of 256 threads, a warp compares 32 at once, and it sums
 *     the same rows in the same order, so the bits do not change.
 *   - MUL(t, g) of rows by a gain (RMSNorm's, forward, and the backward's MUL(dy, g); not of one
 *     row, an elementwise product a warp would take alone): AFFINE without a bias, a warp a row
 *     (ggml-cuda's broadcasting kernel computes each element's place).
 *   - RMS_NORM (RMSNorm's normalization): a warp a row where ggml-cuda's takes a block of 256 or
 *     1024 threads for one row, summing in that block's order (the same bits).
 *   - ROPE and ROPE_BACK (modes normal and neox): a thread a rotated pair, adjacent pairs in
 *     adjacent threads, where ggml-cuda's takes a block of 256 threads a row (a head of 64 floats
 *     left 224 idle); each pair computed by ggml's formula (the same bits).
 *   - AdamW: a run of consecutive OPT_STEP_ADAMW nodes (one a parameter, at the end of a
 *     training graph) is one multi-tensor kernel of ggml's formula, a few launches where ggml's
 *     takes one a parameter (196 at GPT-2 small, most of them biases and gains of 768 floats).
 *   - ADD of two contiguous tensors of one shape (residuals, gradients that meet): a float4 at a
 *     time (ggml-cuda's broadcasting kernel computes each element's place).
 *   - SILU_BACK(MUL(a, b), x) (SwiGLU's gate gradient): one kernel, ggml-cuda's formula on the
 *     product rounded as the MUL stored it (the same bits), the MUL computing nothing; with up's
 *     gradient MUL(SILU(x), a) beside it, SwiGLU's whole backward in that kernel, up's gradient
 *     into that MUL's node (a room, as attention's dK and dV), the SILU computing nothing.
 *   - LayerNorm (blocks.layer_norm): the RMS_NORM named TH_LAYER_NORM_NAME stands in for the
 *     normalization of centred rows, and its RMS_NORM_BACK for that one's backward, one kernel
 *     each way instead of the centring's 3 nodes forward and 4 backward and ggml's RMS_NORM.
 *     Its gain and bias, ADD(MUL(t, g), b), are one pass; the backward's MUL(dy, g) is formed
 *     inside LayerNorm's backward, and the gain's gradient, a column sum of MUL(t, dy), is one
 *     kernel that reads t and dy. A product or MUL folded into a later node computes nothing.
 *   - A norm (LayerNorm's or RMSNorm's) and its gain (and bias), and the residual's ADD whose sum
 *     the norm reads: one pass, the AFFINE's, writing the sum and t into the ADD's and the norm's
 *     nodes (rooms) as it writes y; the same bits (th_fuse_norm_affines).
 *   - LayerNorm's gain's gradient (the COLUMN_DOT of t and dy): summed by LayerNorm's backward,
 *     which holds both, in the COLUMN_DOT's order; the same bits (th_fuse_gain_sums).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-impl.h"
#include "cpu_kernels.h"
#include "custom_ops.h"

#define TH_EXPORT __attribute__((visibility("default")))

static int th_marked(const struct ggml_tensor * t, int kernel) { return th_kernel_of(t) == kernel; }

static void th_gelu_forward(struct ggml_tensor * t) { th_mark(t, TH_CUDA_GELU); }
static void th_gelu_backward(struct ggml_tensor * b) { th_mark(b, TH_CUDA_GELU_BACK); }
static int th_is_gelu(const struct ggml_tensor * t) { return th_marked(t, TH_CUDA_GELU); }
static int th_is_gelu_back(const struct ggml_tensor * b) { return th_marked(b, TH_CUDA_GELU_BACK); }

static void th_set_params(struct ggml_tensor * t, const void * params, size_t size) {
    memcpy(t->op_params + 2, params, size);
}

static void th_set_srcs(struct ggml_tensor * t, struct ggml_tensor * s0, struct ggml_tensor * s1,
                        struct ggml_tensor * s2, struct ggml_tensor * s3, struct ggml_tensor * s4,
                        struct ggml_tensor * s5) {
    memset(t->src, 0, sizeof(t->src));
    t->src[0] = s0, t->src[1] = s1, t->src[2] = s2, t->src[3] = s3, t->src[4] = s4, t->src[5] = s5;
}

/* a contiguous f32 shape (ne0, ne1), for a node whose readers are all rewritten here */
static void th_set_rows(struct ggml_tensor * t, int64_t ne0, int64_t ne1) {
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = 1, t->ne[3] = 1;
    t->nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; i++) t->nb[i] = t->nb[i - 1] * t->ne[i - 1];
}

static int th_f32_contiguous(const struct ggml_tensor * t) { return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t); }

static int th_shape_is(const struct ggml_tensor * t, int64_t ne0, int64_t ne1, int64_t ne2) {
    return t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1;
}

/* a node computed by a later one (which takes its sources): it computes nothing */
static void th_fold(struct ggml_tensor * t, int shrink) {
    th_mark(t, TH_CUDA_FOLDED);
    th_set_srcs(t, NULL, NULL, NULL, NULL, NULL, NULL);
    if (shrink) th_set_rows(t, 1, 1);
}

static int th_is_attention_node(const struct ggml_tensor * t) {
    return th_marked(t, TH_CUDA_ATTN_FWD) || th_marked(t, TH_CUDA_ATTN_PREP) || th_marked(t, TH_CUDA_ATTN_BWD) ||
           th_marked(t, TH_CUDA_ATTN_DQ);
}

/* a REPEAT of kv heads that grouped-query heads no longer need (th_attention_group): it computes
 * nothing, and keeps the tensor it repeated in op_params[2..] for th_operand_source */
static void th_fold_repeat(struct ggml_tensor * p, struct ggml_tensor * repeated) {
    th_fold(p, 1);
    th_set_params(p, &repeated, sizeof(repeated));
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

/* The forward of one attention whose probabilities P (a SOFT_MAX) every reader of which is one
 * of O, its backward's dvt and dS: P becomes ATTN_FWD, O its copy, S nothing. Returns 3, 0 when
 * the nodes are not attention's (left to ggml). */
static int th_attention_forward(struct ggml_cgraph * graph, struct ggml_tensor * p) {
    struct ggml_tensor * s = p->src[0], * mask = p->src[1], * only;
    if (s == NULL || s->op != GGML_OP_MUL_MAT || p->src[2] != NULL || th_readers(graph, s, &only) != 1) return 0;
    struct ggml_tensor * k = s->src[0], * q = s->src[1];
    const int64_t hd = q->ne[0], T = q->ne[1], heads = q->ne[2];
    float scale, max_bias;
    memcpy(&scale, p->op_params, sizeof(float));
    memcpy(&max_bias, p->op_params + 1, sizeof(float));
    const int causal = mask != NULL;
    if (max_bias != 0.0f || !th_attention_head_dim_ok(hd) || T > INT32_MAX / 2 || !th_f32_contiguous(q) ||
        !th_f32_contiguous(k) || !th_shape_is(k, hd, T, heads) || !th_f32_contiguous(p) ||
        !th_shape_is(p, T, T, heads) ||
        (causal && (strncmp(mask->name, "causal_mask.", 12) != 0 || !th_shape_is(mask, T, T, 1)))) {
        return 0;
    }
    struct ggml_tensor * o = NULL;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (u->src[j] != p) continue;
            if (j == 1 && u->op == GGML_OP_MUL_MAT && o == NULL) {
                o = u;
            } else if (!(j == 0 && u->op == GGML_OP_OUT_PROD) && !(j == 1 && u->op == GGML_OP_SOFT_MAX_BACK)) {
                return 0;          /* P read by a node we do not rewrite: it must stay P */
            }
        }
    }
    struct ggml_tensor * vt = o != NULL ? o->src[0] : NULL;
    if (o == NULL || !th_f32_contiguous(vt) || !th_shape_is(vt, T, hd, heads) || !th_f32_contiguous(o) ||
        !th_shape_is(o, hd, T, heads)) {
        return 0;
    }
    const th_attention_params params = {(int32_t) hd, (int32_t) T, causal, scale, 1};
    th_mark(p, TH_CUDA_ATTN_FWD);
    th_set_params(p, &params, sizeof(params));
    th_set_srcs(p, q, k, vt, NULL, NULL, NULL);
    th_set_rows(p, th_attention_fwd_floats(hd, T), heads);
    th_mark(o, TH_CUDA_SLICE);
    const th_slice_params slice = {th_attention_fwd_floats(hd, T), 0};
    th_set_params(o, &slice, sizeof(slice));
    th_set_srcs(o, p, NULL, NULL, NULL, NULL, NULL);
    s->op = GGML_OP_NONE;
    th_set_srcs(s, NULL, NULL, NULL, NULL, NULL, NULL);
    th_set_rows(s, 1, 1);
    return 3;
}

/* Where `x` (n0, n1, heads), contiguous, reaches a CONT through views alone, each read by the next
 * alone, and those views only permute its axes (heads split into h then b, each kept whole): that
 * CONT, with `map` set to the CONT's axes of x's axis 0, axis 1, h and b. Else NULL. */
static struct ggml_tensor * th_permuted_cont_of(struct ggml_cgraph * graph, struct ggml_tensor * x,
                                                th_attention_map * map, int64_t n0, int64_t n1, int64_t heads) {
    struct ggml_tensor * v = x, * c = NULL;
    for (;;) {
        if (th_readers(graph, v, &c) != 1) return NULL;
        if (c->view_src != x || c->view_offs != 0) break;
        v = c;
    }
    if (v == x || c->src[0] != v || !(c->op == GGML_OP_CONT || th_marked(c, TH_CUDA_CONT)) ||
        !th_f32_contiguous(c) || !ggml_are_same_shape(c, v) || (c->flags & GGML_TENSOR_FLAG_OUTPUT) ||
        !th_f32_contiguous(x) || ggml_nelements(x) != n0 * n1 * heads) {
        return NULL;
    }
    th_attention_map m = {{-1, -1, -1, -1}};
    int64_t H = 1;
    int axes = 0, used = 0;
    for (int pass = 0; pass < 2; pass++) {           /* the h axis first: its size fixes b's stride */
        for (int k = 0; k < GGML_MAX_DIMS; k++) {
            const int64_t ne = v->ne[k], nb = (int64_t) (v->nb[k] / sizeof(float));
            if (ne == 1) continue;
            axes += pass == 0;
            if (pass == 0 && nb == 1 && ne == n0 && m.axis[0] < 0) {
                m.axis[0] = (int8_t) k, used++;
            } else if (pass == 0 && nb == n0 && ne == n1 && m.axis[1] < 0) {
                m.axis[1] = (int8_t) k, used++;
            } else if (pass == 0 && nb == n0 * n1 && heads % ne == 0 && m.axis[2] < 0) {
                m.axis[2] = (int8_t) k, H = ne, used++;
            } else if (pass == 1 && nb == n0 * n1 * H && ne == heads / H && m.axis[3] < 0) {
                m.axis[3] = (int8_t) k, used++;
            }
        }
    }
    if (used != axes) return NULL;                   /* an axis split, merged or strided otherwise */
    *map = m;
    return c;
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
    struct ggml_tensor * dp = ds->src[0];
    if (ds->op != GGML_OP_SOFT_MAX_BACK || dp == NULL || dp->op != GGML_OP_OUT_PROD ||
        th_operand_source(dp->src[0]) != th_operand_source(vt) ||
        dp->src[1] == NULL || dp->src[1]->op != GGML_OP_TRANSPOSE || th_readers(graph, dp, &only) != 1) {
        return -1;
    }
    const int64_t hd = params.hd, T = params.T, heads = q->ne[2] * q->ne[3];   /* q: maybe a (hd, T, H, B) view */
    struct ggml_tensor * dout = dp->src[1]->src[0];
    struct ggml_tensor * dvt = th_out_prod(graph, fwd, dout, 0), * dk = th_out_prod(graph, q, ds, 0);
    struct ggml_tensor * dq = th_out_prod(graph, k, ds, 1);
    int ds_readers = th_readers(graph, ds, &only);
    if (!th_f32_contiguous(dout) || !th_shape_is(dout, hd, T, heads) || !th_f32_contiguous(ds) ||
        (dvt != NULL && !th_f32_contiguous(dvt)) || (dk != NULL && !th_f32_contiguous(dk)) ||
        ds_readers != (dk != NULL) + (dq != NULL)) {
        return -1;
    }
    struct ggml_tensor * dout_t = dp->src[1];
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
    int marked = 2;
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

/* The copies out of an ATTN_PREP node read what its ATTN_BWD node writes, and ggml built dvt
 * before dP and dS: in each graph (graphs share nodes, not their order) a copy that comes before
 * the ATTN_BWD node moves to just after it. Returns -1 when it cannot (a node between reads it,
 * or the graph lacks the ATTN_BWD node). */
static int th_order_attention_copies(struct ggml_cgraph * graph) {
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

/* The REPEAT_BACK that sums `x` (a SLICE of dK or dV^T: `heads` heads of n floats) over each group
 * of `group` consecutive heads, reached through views of x each read by the next alone:
 * REPEAT_BACK(a contiguous (n, group, K, B) view of x, into (n, 1, K, B)), K B = heads / group.
 * Else NULL. */
static struct ggml_tensor * th_group_sum(struct ggml_cgraph * graph, struct ggml_tensor * x, const int64_t n,
                                         const int64_t heads, const int64_t group) {
    struct ggml_tensor * v = x, * c = NULL;
    for (;;) {
        if (th_readers(graph, v, &c) != 1) return NULL;
        if (c->view_src != x || c->view_offs != 0) break;
        v = c;
    }
    if (c->op != GGML_OP_REPEAT_BACK || c->src[0] != v || !th_f32_contiguous(c) || !ggml_is_contiguous(v) ||
        (c->flags & GGML_TENSOR_FLAG_OUTPUT) || !th_f32_contiguous(x) || ggml_nelements(x) != n * heads ||
        v->ne[0] != n || v->ne[1] != group || c->ne[0] != n || c->ne[1] != 1 || c->ne[2] != v->ne[2] ||
        c->ne[3] != v->ne[3] || c->ne[2] * c->ne[3] * group != heads) {
        return NULL;
    }
    return c;
}

static th_attention_params th_attention_params_of(const struct ggml_tensor * t) {
    th_attention_params params;
    memcpy(&params, t->op_params + 2, sizeof(params));
    return params;
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
static int th_attention_group(struct ggml_cgraph * graph, struct ggml_tensor * fwd) {
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

/* Every attention of `graph`: forward and, where the graph has it, backward; with `group`, the
 * kv heads read in place (th_attention_group). Returns the nodes marked, or -1 (see
 * th_attention_backward). */
static int th_rewrite_attention(struct ggml_cgraph * graph, const int group) {
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (t->op == GGML_OP_SOFT_MAX && t->type == GGML_TYPE_F32) {
            marked += th_attention_forward(graph, t);
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

static int th_is_folded(const struct ggml_tensor * t) {
    return t != NULL && th_marked(t->view_src != NULL ? t->view_src : t, TH_CUDA_FOLDED);
}

/* 0, or -1 when a node folded into a later one (graphs share nodes: maybe by an earlier graph) is
 * read in `graph` by a node that is not a view of it (COLUMN_DOT's scratch aside, and LAYER_NORM_BACK's
 * when it took that over: th_fuse_gain_sums), or is an output: it holds no value. */
static int th_check_folded(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * u = ggml_graph_node(graph, i);
        if ((u->flags & GGML_TENSOR_FLAG_OUTPUT) && th_is_folded(u)) return -1;
        if (u->view_src != NULL) continue;
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (th_is_folded(u->src[j]) && !(th_marked(u, TH_CUDA_COLUMN_DOT) && j == 2) &&
                !(th_marked(u, TH_CUDA_LAYER_NORM_BACK) && j == 5)) {
                return -1;
            }
        }
    }
    return 0;
}

/* the node under `t`'s RESHAPE views when each of them, and it, is read by the one above alone
 * (`reader` reads t), and it has op `op`; else NULL */
static struct ggml_tensor * th_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                              struct ggml_tensor * t, enum ggml_op op) {
    struct ggml_tensor * only;
    while (t != NULL && th_readers(graph, t, &only) == 1 && only == reader) {
        if (t->op == op) return t;
        if (t->op != GGML_OP_RESHAPE) return NULL;
        reader = t;
        t = t->src[0];
    }
    return NULL;
}

/* th_under_reshapes for a node of ours: the one under `t`'s RESHAPEs marked `kernel`, else NULL */
static struct ggml_tensor * th_ours_under_reshapes(struct ggml_cgraph * graph, struct ggml_tensor * reader,
                                                   struct ggml_tensor * t, int kernel) {
    struct ggml_tensor * u = th_under_reshapes(graph, reader, t, GGML_OP_CUSTOM);
    return u != NULL && th_marked(u, kernel) ? u : NULL;
}

static int th_is_same_shape_add(const struct ggml_tensor * u) {
    return (u->op == GGML_OP_ADD || th_marked(u, TH_CUDA_ADD)) && th_f32_contiguous(u) && u->src[0] != NULL &&
           u->src[1] != NULL && th_f32_contiguous(u->src[0]) && th_f32_contiguous(u->src[1]) &&
           ggml_nelements(u->src[0]) == ggml_nelements(u) && ggml_nelements(u->src[1]) == ggml_nelements(u);
}

/* A residual's gradient added to a LayerNorm's input gradient, ADD(r, LAYER_NORM_BACK(...)) in
 * either order: LayerNorm's backward adds r as it writes (the same one rounding). Returns the
 * nodes marked. */
static int th_rewrite_norm_residuals(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * b = NULL;
        if (!th_is_same_shape_add(u) || u->ne[0] != u->src[0]->ne[0] || u->ne[0] != u->src[1]->ne[0]) continue;
        int j = 0;
        for (; j < 2 && b == NULL; j++) b = th_ours_under_reshapes(graph, u, u->src[j], TH_CUDA_LAYER_NORM_BACK);
        if (b == NULL || b->src[3] != NULL || !th_f32_contiguous(b) || ggml_nelements(b) != ggml_nelements(u)) continue;
        struct ggml_tensor * r = u->src[2 - j];          /* the other operand (j is one past b's) */
        memcpy(u->op_params, b->op_params, sizeof(u->op_params));
        u->op = GGML_OP_CUSTOM;
        th_set_srcs(u, b->src[0], b->src[1], b->src[2], r, NULL, NULL);
        th_fold(b, 1);
        marked += 2;
    }
    return marked;
}

/* OUT_PROD(a, b) of 2-D f32 operands, as ggml-cuda computes it (one cuBLAS call), else NULL */
static struct ggml_tensor * th_plain_out_prod(struct ggml_tensor * t) {
    if (t == NULL || t->op != GGML_OP_OUT_PROD || !th_f32_contiguous(t) || (t->flags & GGML_TENSOR_FLAG_OUTPUT) ||
        t->ne[2] * t->ne[3] != 1) {
        return NULL;
    }
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    if (a == NULL || b == NULL || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || a->nb[0] != sizeof(float) ||
        a->ne[2] * a->ne[3] != 1 || b->ne[2] * b->ne[3] != 1 || a->ne[0] != t->ne[0] || b->ne[0] != t->ne[1] ||
        a->ne[1] != b->ne[1] || (ggml_is_transposed(b) ? b->nb[1] : b->nb[0]) != sizeof(float) ||
        t->ne[0] > INT32_MAX || t->ne[1] > INT32_MAX || a->ne[1] > INT32_MAX) {
        return NULL;
    }
    return t;
}

/* OUT_PROD(W, dy^T) of a frozen weight W (not f32: only at bf16 do cuda graphs hold one, see
 * Tensor.matmul_t) of a shape the frozen bf16 products take, not an output, else NULL. In a
 * PRODUCT_SUM, cuda/th-frozen.cu computes it with beta 1 (th-custom.cu's supported check asks for
 * bf16's stamp: a frozen product at another precision is refused, never computed otherwise). */
static struct ggml_tensor * th_frozen_out_prod(struct ggml_tensor * t) {
    return t != NULL && t->op == GGML_OP_OUT_PROD && t->src[0] != NULL && t->src[0]->type != GGML_TYPE_F32 &&
                   !(t->flags & GGML_TENSOR_FLAG_OUTPUT) && th_frozen_product_ok(t, 0)
               ? t
               : NULL;
}

/* Products added together, ADD(x, y) where each of x and y is an OUT_PROD (f32, or a frozen
 * weight's input gradient at bf16) or (one of them) a PRODUCT_SUM, through RESHAPEs read by the
 * next alone (the gradient of an input that several projections read: q, k and v, llama's gate
 * and up, a LoRA base's and its adapter's): one PRODUCT_SUM of at most 5 products, cuBLAS adding
 * each product into the sum so far (beta 1): the order and roundings of the ADDs.
 * Returns the nodes marked. */
static int th_rewrite_product_sums(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * part[2], * pairs[10];
        if (!th_is_same_shape_add(u)) continue;
        int sums = 0, count = 0, order[2] = {0, 1};
        for (int j = 0; j < 2; j++) {
            struct ggml_tensor * product = th_under_reshapes(graph, u, u->src[j], GGML_OP_OUT_PROD);
            part[j] = th_plain_out_prod(product);
            if (part[j] == NULL) part[j] = th_frozen_out_prod(product);
            if (part[j] == NULL) {
                part[j] = th_ours_under_reshapes(graph, u, u->src[j], TH_CUDA_PRODUCT_SUM);
                sums += part[j] != NULL;
                if (part[j] != NULL && j == 1) order[0] = 1, order[1] = 0;    /* the sum so far first */
            }
        }
        if (part[0] == NULL || part[1] == NULL || sums > 1 || part[0]->ne[0] != u->ne[0] || part[1]->ne[0] != u->ne[0] ||
            ggml_nelements(part[0]) != ggml_nelements(u) || ggml_nelements(part[1]) != ggml_nelements(u)) {
            continue;
        }
        for (int j = 0; j < 2; j++) {
            struct ggml_tensor * x = part[order[j]];
            for (int k = 0; k < (th_marked(x, TH_CUDA_PRODUCT_SUM) ? GGML_MAX_SRC : 2) && x->src[k] != NULL; k++) {
                if (count < 10) pairs[count] = x->src[k];
                count++;
            }
        }
        if (count > 10) continue;
        th_mark(u, TH_CUDA_PRODUCT_SUM);
        memset(u->src, 0, sizeof(u->src));
        memcpy(u->src, pairs, sizeof(*pairs) * (size_t) count);
        th_fold(part[0], 1);
        th_fold(part[1], 1);
        marked += 3;
    }
    return marked;
}

/* SILU_BACK(MUL(a, b), x), the MUL read by the SILU_BACK alone, not an output, every tensor f32
 * contiguous of one element count (no broadcast): SwiGLU's gate gradient, silu_back(grad * up,
 * gate). One kernel reads a, b and x and writes y (4 passes over the activation where ggml's two
 * nodes make 6); it rounds a * b to f32 as the MUL's node did, then computes ggml-cuda's
 * op_silu_back, so the bits are ggml's. Returns the nodes marked. */
/* up's gradient beside SwiGLU's gate gradient: MUL(SILU(x), grad) in either order, f32 contiguous
 * of grad's element count, the SILU (ggml's, not a stand-in: those are ours by now) of x itself
 * and read by that MUL alone, neither an output; else NULL. */
static struct ggml_tensor * th_swiglu_up_gradient(struct ggml_cgraph * graph, const struct ggml_tensor * grad,
                                                  const struct ggml_tensor * x) {
    const int64_t count = ggml_nelements(grad);
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * d = ggml_graph_node(graph, i), * only;
        if (d->op != GGML_OP_MUL || (d->flags & GGML_TENSOR_FLAG_OUTPUT) || !th_f32_contiguous(d) ||
            ggml_nelements(d) != count || d->src[0] == NULL || d->src[1] == NULL) {
            continue;
        }
        for (int j = 0; j < 2; j++) {
            struct ggml_tensor * s = d->src[j];
            if (d->src[1 - j] == grad && s->op == GGML_OP_UNARY && ggml_get_unary_op(s) == GGML_UNARY_OP_SILU &&
                s->src[0] == x && th_f32_contiguous(s) && ggml_nelements(s) == count &&
                !(s->flags & GGML_TENSOR_FLAG_OUTPUT) && th_readers(graph, s, &only) == 1 && only == d) {
                return d;
            }
        }
    }
    return NULL;
}

static int th_rewrite_silu_back_muls(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i), * m = t->src[0], * only;
        if (t->op != GGML_OP_SILU_BACK || m == NULL || m->op != GGML_OP_MUL || (m->flags & GGML_TENSOR_FLAG_OUTPUT) ||
            th_readers(graph, m, &only) != 1 || only != t) {
            continue;
        }
        struct ggml_tensor * a = m->src[0], * b = m->src[1], * x = t->src[1];
        const int64_t count = ggml_nelements(t);
        if (a == NULL || b == NULL || x == NULL || !th_f32_contiguous(t) || !th_f32_contiguous(m) ||
            !th_f32_contiguous(a) || !th_f32_contiguous(b) || !th_f32_contiguous(x) || ggml_nelements(m) != count ||
            ggml_nelements(a) != count || ggml_nelements(b) != count || ggml_nelements(x) != count) {
            continue;                          /* a broadcast or strided MUL: ggml's nodes */
        }
        struct ggml_tensor * room = th_swiglu_up_gradient(graph, a, x), * silu = NULL;
        if (room != NULL) silu = room->src[0]->op == GGML_OP_UNARY ? room->src[0] : room->src[1];
        th_mark(t, room != NULL ? TH_CUDA_SWIGLU_BACK : TH_CUDA_SILU_BACK_MUL);
        th_set_srcs(t, a, b, x, room, NULL, NULL);
        th_fold(m, 1);
        marked += 2;
        if (room != NULL) {
            th_mark(room, TH_CUDA_ROOM);
            th_set_srcs(room, NULL, NULL, NULL, NULL, NULL, NULL);
            th_fold(silu, 1);
            marked += 2;
        }
    }
    return marked;
}

/* A ROPE or ROPE_BACK our kernel computes: contiguous f32 rows, positions i32 one a row of
 * ne[2], modes normal or neox over the first n_dims (even) of each row, no YaRN extrapolation
 * (ext_factor, op_params[7], 0) and no offset (op_params[15]) */
static int th_rope_ours(const struct ggml_tensor * t) {
    const struct ggml_tensor * x = t->src[0], * pos = t->src[1], * ff = t->src[2];
    const int32_t * p = t->op_params;
    const int n_dims = p[1], mode = p[2];
    return th_f32_contiguous(t) && x != NULL && th_f32_contiguous(x) && ggml_are_same_shape(t, x) &&
           pos != NULL && pos->type == GGML_TYPE_I32 && ggml_is_contiguous(pos) && ggml_nelements(pos) == x->ne[2] &&
           (ff == NULL || (th_f32_contiguous(ff) && ggml_nelements(ff) >= n_dims / 2)) &&
           (mode == 0 || mode == GGML_ROPE_TYPE_NEOX) && p[7] == 0 && p[15] == 0 && n_dims > 0 && n_dims % 2 == 0 &&
           n_dims <= x->ne[0] && x->ne[0] % 2 == 0 && ggml_nelements(x) / 2 <= INT32_MAX;
}

/* CROSS_ENTROPY_LOSS_BACK our kernel computes: srcs grad (a scalar), logits and labels, f32
 * contiguous rows of one shape */
static int th_cross_entropy_back_ours(const struct ggml_tensor * t) {
    const struct ggml_tensor * grad = t->src[0], * logits = t->src[1], * labels = t->src[2];
    return th_f32_contiguous(t) && grad != NULL &&
           logits != NULL && labels != NULL && grad->type == GGML_TYPE_F32 && ggml_is_scalar(grad) &&
           th_f32_contiguous(logits) && th_f32_contiguous(labels) && ggml_are_same_shape(t, logits) &&
           ggml_are_same_shape(t, labels) && t->ne[0] <= INT32_MAX && ggml_nrows(t) <= INT32_MAX;
}

/* CROSS_ENTROPY_LOSS our kernel computes: srcs logits and labels, f32 contiguous rows of one shape,
 * a scalar f32 loss */
static int th_cross_entropy_ours(const struct ggml_tensor * t) {
    const struct ggml_tensor * logits = t->src[0], * labels = t->src[1];
    return t->type == GGML_TYPE_F32 && ggml_is_scalar(t) &&
           th_f32_contiguous(logits) && th_f32_contiguous(labels) && ggml_are_same_shape(logits, labels) &&
           logits->ne[0] <= INT32_MAX && ggml_nrows(logits) <= INT32_MAX;
}

/* GLU SWIGLU of split halves (ggml_swiglu_split: src 1 given) our kernel computes: gate, up and y
 * f32 contiguous, one shape. Marked
 * before th_cuda_mark_precision, which may make all three bf16 (th_swiglu_bf16). */
static int th_swiglu_ours(const struct ggml_tensor * t) {
    return t->op == GGML_OP_GLU &&
           ggml_get_glu_op(t) == GGML_GLU_OP_SWIGLU && th_f32_contiguous(t) && th_f32_contiguous(t->src[0]) &&
           th_f32_contiguous(t->src[1]) && ggml_are_same_shape(t, t->src[0]) && ggml_are_same_shape(t, t->src[1]);
}

/* MUL(t, g) of f32 rows t (n, rows) and a gain g (n): its g, else NULL */
static struct ggml_tensor * th_gain_of(const struct ggml_tensor * m, int64_t n) {
    const struct ggml_tensor * t = m->src[0];
    struct ggml_tensor * g = m->src[1];
    if (!th_f32_contiguous(m) || t == NULL || !th_f32_contiguous(t) || !ggml_are_same_shape(m, t) || m->ne[0] != n ||
        g == NULL || !th_f32_contiguous(g) || ggml_nelements(g) != n || g->ne[0] != n) {
        return NULL;
    }
    return g;
}

/* ADD(y, b) of a bias b (n) over the rows of y = MUL_MAT(w, x) (n, m), y reached through
 * RESHAPE views only, each node of the way read by the next alone: LINEAR_BIAS and FOLDED.
 * Returns the nodes marked. */
static int th_rewrite_linear_biases(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * a = ggml_graph_node(graph, i), * b = a->src[1], * y;
        if (a->op != GGML_OP_ADD || !th_f32_contiguous(a) || b == NULL || !th_f32_contiguous(b) ||
            ggml_nelements(b) != b->ne[0] || b->ne[0] != a->ne[0] ||
            (y = th_under_reshapes(graph, a, a->src[0], GGML_OP_MUL_MAT)) == NULL) {
            continue;
        }
        struct ggml_tensor * w = y->src[0], * x = y->src[1];
        if (!th_f32_contiguous(y) || !th_f32_contiguous(w) || !th_f32_contiguous(x) || y->ne[2] * y->ne[3] != 1 ||
            w->ne[2] * w->ne[3] != 1 || x->ne[2] * x->ne[3] != 1 || y->ne[0] != a->ne[0] ||
            ggml_nelements(y) != ggml_nelements(a) || y->ne[1] > INT32_MAX || w->ne[0] > INT32_MAX) {
            continue;
        }
        th_mark(a, TH_CUDA_LINEAR_BIAS);
        th_set_srcs(a, w, x, b, NULL, NULL, NULL);
        th_fold(y, 1);
        marked += 2;
    }
    return marked;
}

/* The affine part of norms: ADD(MUL(t, g), b) -> AFFINE; LAYER_NORM_BACK(MUL(dy, g), x) reads dy
 * and g; OUT_PROD(MUL(a, c), ones) -> COLUMN_DOT. Returns the nodes marked. */
static int th_rewrite_norm_affines(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * m, * g;
        if (u->op == GGML_OP_ADD && th_f32_contiguous(u) && u->src[1] != NULL && th_f32_contiguous(u->src[1]) &&
            ggml_nelements(u->src[1]) == u->ne[0] && u->src[1]->ne[0] == u->ne[0] &&
            (m = th_under_reshapes(graph, u, u->src[0], GGML_OP_MUL)) != NULL && (g = th_gain_of(m, u->ne[0])) &&
            ggml_nelements(m) == ggml_nelements(u)) {
            th_mark(u, TH_CUDA_AFFINE);
            th_set_srcs(u, m->src[0], g, u->src[1], NULL, NULL, NULL);
            th_fold(m, 1);
            marked += 2;
        } else if (th_marked(u, TH_CUDA_LAYER_NORM_BACK) && u->src[2] == NULL &&
                   (m = th_under_reshapes(graph, u, u->src[0], GGML_OP_MUL)) != NULL && (g = th_gain_of(m, u->ne[0])) &&
                   ggml_nelements(m) == ggml_nelements(u)) {
            th_set_srcs(u, m->src[0], u->src[1], g, u->src[3], NULL, NULL);     /* keeps a residual */
            th_fold(m, 1);
            marked += 1;
        } else if (u->op == GGML_OP_OUT_PROD && th_f32_contiguous(u) && u->src[1] != NULL &&
                   th_is_ones(u->src[1]) &&
                   (m = th_under_reshapes(graph, u, u->src[0], GGML_OP_MUL)) != NULL && th_f32_contiguous(m) &&
                   m->ne[2] * m->ne[3] == 1 && ggml_nelements(u) == m->ne[0] && u->src[1]->ne[1] == m->ne[1] &&
                   th_f32_contiguous(m->src[0]) && th_f32_contiguous(m->src[1]) && ggml_are_same_shape(m, m->src[0]) &&
                   ggml_are_same_shape(m, m->src[1])) {
            th_mark(u, TH_CUDA_COLUMN_DOT);
            th_set_srcs(u, m->src[0], m->src[1], m, NULL, NULL, NULL);
            th_fold(m, 0);                /* its buffer is COLUMN_DOT's scratch */
            marked += 2;
        }
    }
    return marked;
}

static float th_eps_of(const struct ggml_tensor * t, int at) {
    float eps;
    memcpy(&eps, t->op_params + at, sizeof(eps));
    return eps;
}

/* LayerNorm's stand-ins: every RMS_NORM named TH_LAYER_NORM_NAME, and every RMS_NORM_BACK of one.
 * Returns the nodes marked, or -1 when a stand-in cannot be (it would compute RMSNorm), or when a
 * plain RMS_NORM of the same rows makes a backward ambiguous. */
static int th_rewrite_layer_norms(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (t->op != GGML_OP_RMS_NORM || strcmp(t->name, TH_LAYER_NORM_NAME) != 0) continue;
        if (!th_f32_contiguous(t) || !th_f32_contiguous(t->src[0]) || !ggml_are_same_shape(t, t->src[0])) return -1;
        const float eps = th_eps_of(t, 0);
        th_mark(t, TH_CUDA_LAYER_NORM);
        th_set_params(t, &eps, sizeof(eps));
        marked++;
    }
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * b = ggml_graph_node(graph, i);
        if (b->op != GGML_OP_RMS_NORM_BACK) continue;
        const struct ggml_tensor * ours = NULL;
        int plain = 0;
        for (int j = 0; j < n; j++) {
            const struct ggml_tensor * f = ggml_graph_node(graph, j);
            if (f->src[0] != b->src[1]) continue;
            if (th_marked(f, TH_CUDA_LAYER_NORM) && th_eps_of(f, 2) == th_eps_of(b, 0)) ours = f;
            if ((f->op == GGML_OP_RMS_NORM && th_eps_of(f, 0) == th_eps_of(b, 0)) ||
                (th_marked(f, TH_CUDA_RMS_NORM) && th_eps_of(f, 2) == th_eps_of(b, 0))) {
                plain = 1;                           /* (marked by an earlier graph's rewrite) */
            }
        }
        if (ours == NULL) continue;                  /* a plain RMS_NORM's backward */
        if (plain || !th_f32_contiguous(b) || !th_f32_contiguous(b->src[0]) || !ggml_are_same_shape(b, b->src[1])) {
            return -1;
        }
        const float eps = th_eps_of(b, 0);
        th_mark(b, TH_CUDA_LAYER_NORM_BACK);
        th_set_params(b, &eps, sizeof(eps));
        marked++;
    }
    return marked;
}

/* The norm node whose output an AFFINE node reads as t (src 0, through RESHAPE views): LAYER_NORM or
 * RMS_NORM of ours, or the room of an AFFINE that computes its norm (th_fuse_norm_affines) */
static struct ggml_tensor * th_norm_under_affine(const struct ggml_tensor * u) {
    return th_under_reshape_views(u->src[0]);
}

/* whether a node of `graph` other than `reader` reads t (custom_ops.h, th_reads_or_views) */
static int th_read_elsewhere(struct ggml_cgraph * graph, const struct ggml_tensor * t,
                             const struct ggml_tensor * reader) {
    for (int k = 0; k < ggml_graph_n_nodes(graph); k++) {
        const struct ggml_tensor * v = ggml_graph_node(graph, k);
        if (v != reader && th_reads_or_views(v, t)) return 1;
    }
    return 0;
}

/* whether `graph` holds a LAYER_NORM_BACK of the rows x that sums its gain's gradient
 * (th_fuse_gain_sums): LayerNorm's t of x then serves no gradient */
static int th_gain_summed_by_backward(struct ggml_cgraph * graph, struct ggml_tensor * x) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * b = ggml_graph_node(graph, i);
        if (th_marked(b, TH_CUDA_LAYER_NORM_BACK) && b->src[4] != NULL &&
            th_under_reshape_views(b->src[1]) == th_under_reshape_views(x)) {
            return 1;
        }
    }
    return 0;
}

/* x, where `t` is LayerNorm's output of it: a LAYER_NORM node of ours, or the room of an AFFINE in
 * `graph` that computes that norm (th_fuse_norm_affines); its eps into *eps. Else NULL. */
static struct ggml_tensor * th_layer_norm_input(struct ggml_cgraph * graph, struct ggml_tensor * t, float * eps) {
    if (t == NULL) return NULL;
    if (th_marked(t, TH_CUDA_LAYER_NORM)) {
        *eps = th_eps_of(t, 2);
        return t->src[0];
    }
    if (!th_marked(t, TH_CUDA_ROOM)) return NULL;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * a = ggml_graph_node(graph, i);
        if (!th_marked(a, TH_CUDA_AFFINE) || a->src[3] == NULL || th_under_reshape_views(a->src[0]) != t) continue;
        th_norm_affine_params params;
        memcpy(&params, a->op_params + 2, sizeof(params));
        if (params.norm != TH_CUDA_LAYER_NORM) return NULL;
        *eps = params.eps;
        return a->src[3];
    }
    return NULL;
}

/* LayerNorm's gain's gradient, COLUMN_DOT(t, dy) (either order) of the norm's output t and the
 * gradient dy that its backward reads (LAYER_NORM_BACK with the gain, src 2): that backward holds
 * t (formed again from x, as the forward formed it) and dy already, and sums t dy as well, in the
 * COLUMN_DOT's order (a block a chunk of rows, its 8 warps' partial sums added in order, then the
 * chunks in order: the same bits), into the COLUMN_DOT's node (a room: src 4) through its scratch
 * (src 5). A pass over t and dy fewer a norm. Only for rows of at most TH_GAIN_SUMS_MAX_COLUMNS
 * floats, and where no node between the COLUMN_DOT and the backward reads the gradient (the room
 * then stands before its writer with every reader after it). Returns the nodes marked. */
static int th_fuse_gain_sums(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (!th_marked(u, TH_CUDA_COLUMN_DOT) || u->src[0] == NULL || u->src[1] == NULL) continue;
        for (int j = i + 1; j < n; j++) {
            struct ggml_tensor * b = ggml_graph_node(graph, j);
            if (!th_marked(b, TH_CUDA_LAYER_NORM_BACK) || b->src[2] == NULL || b->src[4] != NULL) continue;
            const int dy_at = u->src[0] == b->src[0] ? 0 : u->src[1] == b->src[0] ? 1 : -1;
            if (dy_at < 0) continue;
            float eps = 0.0f;
            const struct ggml_tensor * x = th_layer_norm_input(graph, th_under_reshape_views(u->src[1 - dy_at]), &eps);
            if (x != NULL && th_under_reshape_views((struct ggml_tensor *) x) == th_under_reshape_views(b->src[1]) &&
                eps == th_eps_of(b, 2) && b->ne[0] <= TH_GAIN_SUMS_MAX_COLUMNS && u->src[0]->ne[0] == b->ne[0] &&
                ggml_nelements(u->src[0]) == ggml_nelements(b) && ggml_nelements(u) == b->ne[0] &&
                !th_read_before(graph, u, j)) {
                b->src[4] = u, b->src[5] = u->src[2];
                th_mark(u, TH_CUDA_ROOM);
                th_set_srcs(u, NULL, NULL, NULL, NULL, NULL, NULL);
                marked++;
            }
            break;
        }
    }
    return marked;
}

/* A norm (LAYER_NORM or RMS_NORM of ours) whose output t an AFFINE reads (its gain, and bias),
 * every other reader of t after that AFFINE (the gain's gradient's COLUMN_DOT, in the backward):
 * the AFFINE computes the norm as well, writing t into the norm's node (a room, no sources) as it
 * writes y. Where the norm's input is a residual's ADD (ours: two tensors of one shape) read by no
 * node before the AFFINE, the AFFINE computes that sum too, into the ADD's node (a room), as it
 * reads it. One pass over the rows where the ADD, the norm and the AFFINE each read them again.
 * The sum is rounded as the ADD rounds it, t computed by the norm's own code and y by the
 * AFFINE's, so the bits do not change. op_params[2..]: th_norm_affine_params; src 3: the norm's
 * input; srcs 4 and 5: the ADD's, where it computes the sum. Returns the nodes marked. */
static int th_fuse_norm_affines(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int marked = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (!th_marked(u, TH_CUDA_AFFINE) || u->src[3] != NULL) continue;
        struct ggml_tensor * t = th_norm_under_affine(u), * x = t != NULL ? t->src[0] : NULL;
        const int norm = t == NULL ? 0 : th_marked(t, TH_CUDA_LAYER_NORM) ? TH_CUDA_LAYER_NORM
                                       : th_marked(t, TH_CUDA_RMS_NORM)   ? TH_CUDA_RMS_NORM
                                                                          : 0;
        if (norm == 0 || (t->flags & GGML_TENSOR_FLAG_OUTPUT) || !th_f32_contiguous(t) || x == NULL ||
            !th_f32_contiguous(x) || !ggml_are_same_shape(t, x) || ggml_nelements(t) != ggml_nelements(u) ||
            t->ne[0] != u->ne[0] || t->ne[0] > INT32_MAX || th_read_before(graph, t, i)) {
            continue;
        }
        /* t read by nothing else, in a graph that holds the backward (a graph built later reads
         * the same nodes: th_check_unread_norms refuses one that reads t) */
        const int unread = norm == TH_CUDA_LAYER_NORM && !th_read_elsewhere(graph, t, u) &&
                           th_gain_summed_by_backward(graph, x);
        th_norm_affine_params params = {th_eps_of(t, 2), norm, 0, unread};
        u->src[3] = x;
        th_mark(t, TH_CUDA_ROOM);
        th_set_srcs(t, NULL, NULL, NULL, NULL, NULL, NULL);
        marked++;
        struct ggml_tensor * a = th_under_reshape_views(x);
        if (th_marked(a, TH_CUDA_ADD) && !(a->flags & GGML_TENSOR_FLAG_OUTPUT) && th_f32_contiguous(a) &&
            ggml_nelements(a) == ggml_nelements(x) && !th_read_before(graph, a, i)) {
            params.add = 1;
            u->src[4] = a->src[0], u->src[5] = a->src[1];
            th_mark(a, TH_CUDA_ROOM);
            th_set_srcs(a, NULL, NULL, NULL, NULL, NULL, NULL);
            marked++;
        }
        th_set_params(u, &params, sizeof(params));
    }
    return marked;
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
static int th_attention_rooms(struct ggml_cgraph * graph) {
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
static int th_check_group_rooms(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * t = ggml_graph_node(graph, i), * src = t->src[0];
        if ((th_marked(t, TH_CUDA_SLICE) || th_marked(t, TH_CUDA_SLICE_CONT)) && src != NULL &&
            th_marked(src, TH_CUDA_ATTN_PREP) && th_attention_params_of(src).group > 1) {
            return -1;
        }
    }
    return 0;
}

/* A room comes before the node that writes it, in every graph (graphs share nodes, not their
 * order): it computes nothing and reads nothing, so it can move up to just before its writer.
 * Returns -1 when a graph holds a room but not its writer (it would read what nothing wrote),
 * unless `copies`: a graph of recomputed blocks alone (engine/recompute.py), which reads the
 * forward's block inputs, some of them rooms the forward's graph writes (a residual's sum that the
 * next block's first norm computes); the graphs built from it are checked again whole. */
static int th_order_rooms(struct ggml_cgraph * graph, const int copies) {
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (!th_marked(t, TH_CUDA_ROOM)) continue;
        int w = 0;
        for (; w < n; w++) {
            const struct ggml_tensor * u = ggml_graph_node(graph, w);
            if (th_marked(u, TH_CUDA_ATTN_BWD) && (u->src[6] == t || u->src[7] == t)) break;
            if (th_marked(u, TH_CUDA_SWIGLU_BACK) && u->src[3] == t) break;
            if (th_marked(u, TH_CUDA_LAYER_NORM_BACK) && (u->src[4] == t || u->src[6] == t)) break;
            if (th_marked(u, TH_CUDA_AFFINE) && u->src[3] != NULL &&
                (th_norm_under_affine(u) == t || (u->src[4] != NULL && th_under_reshape_views(u->src[3]) == t))) {
                break;
            }
        }
        if (w == n && copies) continue;
        if (w == n) return -1;
        if (w < i) {
            memmove(graph->nodes + w + 1, graph->nodes + w, sizeof(*graph->nodes) * (size_t) (i - w));
            graph->nodes[w] = t;
        }
        /* a norm's output or a sum (th_fuse_norm_affines), or a gain's gradient (th_fuse_gain_sums),
         * is read elsewhere, not only after its writer */
        const struct ggml_tensor * writer = ggml_graph_node(graph, w > i ? w : w + 1);
        if ((th_marked(writer, TH_CUDA_AFFINE) || th_marked(writer, TH_CUDA_LAYER_NORM_BACK)) &&
            th_read_before(graph, t, w > i ? w : w + 1)) {
            return -1;
        }
    }
    return 0;
}

/* -1 when a node other than its AFFINE reads a norm's t that the AFFINE leaves unwritten
 * (th_norm_affine_params.unread: decided in the graph that marked it), else 0 */
static int th_check_unread_norms(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        const struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (!th_marked(u, TH_CUDA_AFFINE) || u->src[3] == NULL) continue;
        th_norm_affine_params params;
        memcpy(&params, u->op_params + 2, sizeof(params));
        if (params.unread && th_read_elsewhere(graph, th_norm_under_affine(u), u)) return -1;
    }
    return 0;
}

/* A CONT of a permuted view of a SLICE (attention's O, dK and dV^T: copied out of the fused
 * kernels' nodes, then permuted back to the projections' layout): one copy, from the sliced node,
 * and the SLICE computes nothing. Only where the view's strides split into a head's (each below
 * the slice's floats a head) and the heads' (multiples of it). Returns the nodes marked. */
static int th_merge_slice_conts(struct ggml_cgraph * graph) {
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i), * view = t->src[0], * x = view, * reader = t, * only;
        if (!th_marked(t, TH_CUDA_CONT) || view == NULL || view->view_src == NULL || view->view_offs != 0) continue;
        while (x->view_src != NULL && th_readers(graph, x, &only) == 1 && only == reader) {
            reader = x;
            x = x->src[0];
        }
        if (x != view->view_src || !th_marked(x, TH_CUDA_SLICE) || th_readers(graph, x, &only) != 1 || only != reader) {
            continue;
        }
        th_slice_params slice;
        memcpy(&slice, x->op_params + 2, sizeof(slice));
        const int64_t head = x->ne[0] * x->ne[1];          /* floats a head in the slice */
        th_slice_cont_params p = {{0, 0, 0, 0}, slice.offset};
        int64_t within = 0;
        for (int k = 0; k < GGML_MAX_DIMS; k++) {
            const int64_t stride = (int64_t) (view->nb[k] / sizeof(float));
            p.nb[k] = (int64_t) view->nb[k];
            if (view->ne[k] == 1) continue;
            if (stride % head == 0) {
                p.nb[k] = stride / head * slice.stride * (int64_t) sizeof(float);
            } else {
                within += (view->ne[k] - 1) * stride;
            }
        }
        if (within >= head) continue;
        th_mark(t, TH_CUDA_SLICE_CONT);
        th_set_params(t, &p, sizeof(p));
        th_set_srcs(t, x->src[0], NULL, NULL, NULL, NULL, NULL);
        th_fold(x, 1);
        marked += 2;
    }
    return marked;
}

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
static int th_rewrite_adamw_runs(struct ggml_cgraph * graph) {
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
static int th_check_adamw_runs(struct ggml_cgraph * graph) {
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

/* Returns how many nodes were marked, or -1 when a stand-in cannot be (the graph must then not
 * be computed: it would compute silu where GELU is meant, RMSNorm where LayerNorm is), when an
 * attention's backward cannot follow its fused forward, a folded product is read, a node that
 * another one computes (a room, an AdamW step of a run) is here without that one, or a node reads
 * a LayerNorm's t that its AFFINE leaves unwritten (th_check_unread_norms).
 * `flags`: 1, fuse attention, and with 2 also the kv heads of grouped-query attention read in
 * place (th_attention_group) rather than repeated; 4, `graph` holds recomputed blocks alone
 * (th_order_rooms). */
TH_EXPORT int th_cuda_rewrite(struct ggml_cgraph * graph, int flags) {
    const int attention = flags & 3;
    static const struct th_gelu_kernels cuda = {th_gelu_forward, th_gelu_backward, th_is_gelu, th_is_gelu_back};
    const int gelu = th_rewrite_gelu_pairs(graph, &cuda);
    if (gelu < 0) return -1;
    const int fused = attention ? th_rewrite_attention(graph, (attention & 2) != 0) : 0;
    if (fused < 0) return -1;
    const int norms = th_rewrite_layer_norms(graph);
    if (norms < 0) return -1;
    const int biases = th_rewrite_linear_biases(graph);
    const int affines = th_rewrite_norm_affines(graph);
    const int sums = th_rewrite_product_sums(graph), residuals = th_rewrite_norm_residuals(graph);
    const int silu_backs = th_rewrite_silu_back_muls(graph);    /* after the GELU pairs: theirs are not SILU_BACK now */
    int singles = 0;        /* nodes marked one for one: GET_ROWS_BACK, CONT, ADD, RMS_NORM, ROPE, a gain's MUL,
                               the cross-entropy both ways, SWIGLU */
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i), * gain;
        const struct ggml_tensor * src = t->src[0];
        if (t->op == GGML_OP_GET_ROWS_BACK && th_f32_contiguous(t) && th_f32_contiguous(src) && t->src[1] != NULL &&
            t->src[1]->type == GGML_TYPE_I32 && ggml_is_contiguous(t->src[1]) && ggml_nrows(src) == src->ne[1] &&
            t->ne[2] * t->ne[3] == 1 && src->ne[0] == t->ne[0] && ggml_nelements(t->src[1]) == src->ne[1] &&
            (t->ne[1] + 7) / 8 < 65536) {
            th_mark(t, TH_CUDA_GET_ROWS_BACK);
            singles++;
        } else if (t->op == GGML_OP_CONT && t->type == GGML_TYPE_F32 && src->type == GGML_TYPE_F32 &&
                   ggml_is_contiguous(t) && ggml_are_same_shape(t, src) && !ggml_is_contiguous(src) &&
                   th_cont_axis(src) >= 0 && (src->ne[th_cont_axis(src)] + 31) / 32 < 65536) {
            th_mark(t, TH_CUDA_CONT);
            singles++;
        } else if (t->op == GGML_OP_ADD && th_f32_contiguous(t) && th_f32_contiguous(src) &&
                   th_f32_contiguous(t->src[1]) && ggml_are_same_shape(t, src) && ggml_are_same_shape(t, t->src[1])) {
            th_mark(t, TH_CUDA_ADD);
            singles++;
        } else if (t->op == GGML_OP_RMS_NORM && th_f32_contiguous(t) && th_f32_contiguous(src) &&
                   ggml_are_same_shape(t, src)) {
            const float eps = th_eps_of(t, 0);
            th_mark(t, TH_CUDA_RMS_NORM);
            th_set_params(t, &eps, sizeof(eps));
            singles++;
        } else if (t->op == GGML_OP_CROSS_ENTROPY_LOSS_BACK && th_cross_entropy_back_ours(t)) {
            th_mark(t, TH_CUDA_CROSS_ENTROPY_BACK);
            singles++;
        } else if (t->op == GGML_OP_CROSS_ENTROPY_LOSS && th_cross_entropy_ours(t)) {
            th_mark(t, TH_CUDA_CROSS_ENTROPY);
            singles++;
        } else if (th_swiglu_ours(t)) {
            th_mark(t, TH_CUDA_SWIGLU);
            singles++;
        } else if ((t->op == GGML_OP_ROPE || t->op == GGML_OP_ROPE_BACK) && th_rope_ours(t)) {
            const int32_t * p = t->op_params;
            th_rope_params params = {t->op == GGML_OP_ROPE, p[1], p[2], p[4]};
            memcpy(&params.freq_base, p + 5, 6 * sizeof(float));
            th_mark(t, TH_CUDA_ROPE);
            th_set_params(t, &params, sizeof(params));
            singles++;
        } else if (t->op == GGML_OP_MUL && ggml_nrows(t) > 1 && (gain = th_gain_of(t, t->ne[0])) != NULL) {
            th_mark(t, TH_CUDA_AFFINE);         /* a gain alone (RMSNorm's, or a gain's backward) */
            th_set_srcs(t, (struct ggml_tensor *) src, gain, NULL, NULL, NULL, NULL);
            singles++;
        }
    }
    singles += th_fuse_gain_sums(graph);            /* (before the norms: whether t is read) */
    singles += th_fuse_norm_affines(graph) + th_attention_rooms(graph) + th_merge_slice_conts(graph);
    const int adamw = th_rewrite_adamw_runs(graph);
    if (th_check_folded(graph) < 0 || th_check_group_rooms(graph) < 0 || th_order_attention_copies(graph) < 0 ||
        th_order_rooms(graph, (flags & 4) != 0) < 0 || th_check_unread_norms(graph) < 0 ||
        th_check_adamw_runs(graph) < 0) {
        return -1;
    }
    return gelu + fused + norms + biases + affines + sums + residuals + silu_backs + singles + adamw;
}

/* the kernel's name for a node marked here (bench --profile), else NULL */
TH_EXPORT const char * th_cuda_kernel_name(const struct ggml_tensor * t) {
    return th_cuda_kernel_name_of(th_kernel_of(t));
}
