/* The precision of a cuda program's products (issue 32): stamps each node that computes a matrix
 * product (ggml's MUL_MAT and OUT_PROD, our LINEAR_BIAS and PRODUCT_SUM, and every other node of
 * ours, which ignores it) with the program's precision, read back by native/cuda/th-precision.cu
 * inside ggml-cuda (custom_ops.h: th_precision_of). Run after th_cuda_rewrite, which rewrites a
 * node's op_params when it marks it. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "ggml.h"
#include "custom_ops.h"

#define TH_EXPORT __attribute__((visibility("default")))

/* our nodes' parameters end before the stamp's slot */
_Static_assert(2 * sizeof(int32_t) + sizeof(th_slice_cont_params) <= TH_PRECISION_SLOT * sizeof(int32_t),
               "SLICE_CONT's parameters reach the precision stamp");
_Static_assert(2 * sizeof(int32_t) + sizeof(th_attention_params) + 3 * sizeof(th_attention_map) <=
                   TH_PRECISION_SLOT * sizeof(int32_t), "the attention's parameters reach the precision stamp");
_Static_assert(2 * sizeof(int32_t) + sizeof(th_adamw_link) <= TH_PRECISION_SLOT * sizeof(int32_t),
               "AdamW's link reaches the precision stamp");

/* A product of a frozen weight (src 0 of another type than f32: Tensor.matmul_t keeps a LoRA base
 * in its type on cuda at bf16) becomes ours (custom_ops.h: FROZEN_MUL_MAT, FROZEN_OUT_PROD), so
 * that ggml-cuda never multiplies it with quantized activations; 0 for any other node, -1 for one
 * of a shape our kernels do not take. */
static int th_mark_frozen(struct ggml_tensor * t) {
    if ((t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_OUT_PROD) || t->src[0] == NULL || t->src[0]->type == GGML_TYPE_F32) {
        return 0;
    }
    const int mul_mat = t->op == GGML_OP_MUL_MAT;
    if (!th_frozen_product_ok(t, mul_mat)) return -1;
    th_mark(t, mul_mat ? TH_CUDA_FROZEN_MUL_MAT : TH_CUDA_FROZEN_OUT_PROD);
    return 1;
}

/* `t` (contiguous) as bf16 from now on: its strides for two-byte elements */
static void th_retype_bf16(struct ggml_tensor * t) {
    t->type = GGML_TYPE_BF16;
    t->nb[0] = ggml_type_size(GGML_TYPE_BF16);
    for (int d = 1; d < GGML_MAX_DIMS; d++) t->nb[d] = t->nb[d - 1] * t->ne[d - 1];
}

/* a SwiGLU's forward: ggml's GLU node, or ours (SWIGLU, what th_cuda_rewrite made of a split one) */
static int th_is_swiglu(const struct ggml_tensor * u) {
    return (u->op == GGML_OP_GLU && ggml_get_glu_op(u) == GGML_GLU_OP_SWIGLU) || th_kernel_of(u) == TH_CUDA_SWIGLU;
}

static int th_is_attention_reader(const struct ggml_tensor * u) {
    const int k = th_kernel_of(u);
    return k == TH_CUDA_ATTN_FWD || k == TH_CUDA_ATTN_BWD || k == TH_CUDA_ATTN_DQ;
}

/* the product with a bias (LINEAR_BIAS) whose bytes src j of attention node u reads as q, k or v^T
 * (a view of it: the head-permuted projection the attention reads in place), or NULL */
static struct ggml_tensor * th_attention_product(const struct ggml_tensor * u, int j) {
    struct ggml_tensor * s = th_is_attention_reader(u) && j < 3 ? u->src[j] : NULL;
    if (s == NULL) return NULL;
    struct ggml_tensor * root = s->view_src != NULL ? s->view_src : s;
    return th_kernel_of(root) == TH_CUDA_LINEAR_BIAS ? root : NULL;
}

/* A product with a bias kept bf16 for attention (th_attention_inputs_bf16) says so in its
 * op_params[2] (a LINEAR_BIAS has no parameters; one kept for a GELU holds 0 there), so that a
 * later graph, wherever its readers are, checks it as an attention's input and names it so. */
#define TH_KEPT_FOR_ATTENTION 0x71747461   /* "atte" */
static int th_kept_for_attention(const struct ggml_tensor * t) {
    return th_kernel_of(t) == TH_CUDA_LINEAR_BIAS && t->type == GGML_TYPE_BF16 && t->op_params[2] == TH_KEPT_FOR_ATTENTION;
}

static int th_reads(const struct ggml_tensor * u, const struct ggml_tensor * t) {
    for (int j = 0; j < GGML_MAX_SRC; j++) {
        if (u->src[j] == t) return 1;
    }
    return 0;
}

/* A tensor and its reshapes: a product (2-D) reaches the GLU as a RESHAPE of it (3-D), the GLU's
 * output reaches down's product as one; they share its bytes and must share its type. */
#define TH_FAMILY 16
typedef struct { struct ggml_tensor * t[TH_FAMILY]; int n; } th_family;

static int th_in(const th_family * f, const struct ggml_tensor * t) {
    for (int k = 0; k < f->n; k++) {
        if (f->t[k] == t) return 1;
    }
    return 0;
}

/* `root` and every RESHAPE of a member among the graph's nodes; 0 when there are too many */
static int th_family_of(struct ggml_cgraph * graph, struct ggml_tensor * root, th_family * f) {
    f->n = 1;
    f->t[0] = root;
    for (int k = 0; k < f->n; k++) {
        for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
            struct ggml_tensor * u = ggml_graph_node(graph, i);
            if (u->op != GGML_OP_RESHAPE || u->src[0] != f->t[k] || th_in(f, u)) continue;
            if (f->n == TH_FAMILY) return 0;
            f->t[f->n++] = u;
        }
    }
    return 1;
}

/* every member of `f` contiguous, no output, of `type` */
static int th_family_plain(const th_family * f, enum ggml_type type) {
    for (int k = 0; k < f->n; k++) {
        const struct ggml_tensor * t = f->t[k];
        if (t->type != type || !ggml_is_contiguous(t) || (t->flags & GGML_TENSOR_FLAG_OUTPUT)) return 0;
    }
    return 1;
}

static void th_family_retype(const th_family * f) {
    for (int k = 0; k < f->n; k++) th_retype_bf16(f->t[k]);
}

/* The refusal of a graph that would read `what` (a tensor kept bf16 by an earlier graph of the
 * program, named) as f32: its line in `why`, naming the reader `other` (NULL: an output or another
 * layout); -2, th_cuda_mark_precision's answer. */
static int th_kept_elsewhere(char * why, int why_size, const char * what, const struct ggml_tensor * other) {
    if (why != NULL && why_size > 0) {
        snprintf(why, (size_t) why_size, "%s, kept bf16 in another graph: %s %s reads it here", what,
                 other != NULL ? ggml_op_desc(other) : "an output or another layout", other != NULL ? other->name : "");
    }
    return -2;
}

#define TH_SWIGLU_GLUS 4

/* Whether gate's and up's products (with their reshapes: fg, fu) can be, or are, bf16 in `graph`
 * (`type` what they are now): every reader of them a member, the SwiGLU's GLU (src 0 of fg, src 1
 * of fu), its backward (SWIGLU_BACK: srcs grad, fu's, fg's) or a node of ours that computes
 * nothing (FOLDED, ROOM); each GLU's output (with its reshapes, fo[]) read by members and frozen
 * forward products alone (ggml-cuda's GLU writes its sources' type: the output is bf16 too). Else
 * the reader that is not in *other (NULL: an output, a layout, too many). */
static int th_swiglu_pair_ok(struct ggml_cgraph * graph, const th_family * fg, const th_family * fu, enum ggml_type type,
                             th_family * fo, int * n_glus, struct ggml_tensor ** other) {
    *n_glus = 0;
    *other = NULL;
    if (!th_family_plain(fg, type) || !th_family_plain(fu, type) || ggml_nelements(fg->t[0]) != ggml_nelements(fu->t[0])) {
        return 0;
    }
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        int reads = 0;
        for (int k = 0; k < fg->n; k++) reads |= th_reads(u, fg->t[k]);
        for (int k = 0; k < fu->n; k++) reads |= th_reads(u, fu->t[k]);
        if (!reads || th_in(fg, u) || th_in(fu, u)) continue;
        const int kernel = th_kernel_of(u);
        if (kernel == TH_CUDA_FOLDED || kernel == TH_CUDA_ROOM ||
            (kernel == TH_CUDA_SWIGLU_BACK && th_in(fu, u->src[1]) && th_in(fg, u->src[2]) &&
             !th_in(fg, u->src[0]) && !th_in(fu, u->src[0]))) {
            continue;
        }
        if (!th_is_swiglu(u) || !th_in(fg, u->src[0]) || !th_in(fu, u->src[1]) || *n_glus == TH_SWIGLU_GLUS ||
            !th_family_of(graph, u, &fo[*n_glus]) || !th_family_plain(&fo[*n_glus], type)) {
            *other = u;
            return 0;
        }
        const th_family * o = &fo[(*n_glus)++];
        for (int j = 0; j < ggml_graph_n_nodes(graph); j++) {        /* the GLU's readers: frozen forwards */
            struct ggml_tensor * r = ggml_graph_node(graph, j);
            int reads_o = 0;
            for (int k = 0; k < o->n; k++) reads_o |= th_reads(r, o->t[k]);
            if (reads_o && !th_in(o, r) && !(th_kernel_of(r) == TH_CUDA_FROZEN_MUL_MAT && !th_in(o, r->src[0]))) {
                *other = r;
                return 0;
            }
        }
    }
    return 1;
}

/* At bf16, SwiGLU over two frozen products (a LoRA base's gate and up, FROZEN_MUL_MAT) keeps them,
 * and its own output, as bf16: cuBLAS rounds each product's fp32 sums to bf16 once (what bf16
 * autocast keeps), the GLU computes on those values in fp32 and rounds its output to bf16
 * (ggml-cuda's GLU in bf16), which down's frozen product reads in place (it would have rounded the
 * f32 output to those same bf16 values). Half the bytes of the two products SWIGLU_BACK keeps for
 * the backward (the LoRA bench's 1B base: 2 GiB of 8.3). Pairs are found by their GLU, or by their
 * SWIGLU_BACK alone (recompute_blocks' recomputed products: the same bits as the forward's), each
 * product with its reshapes. Taken only where th_swiglu_pair_ok says. Returns the pairs taken, or
 * -2 (`why`) where a pair already bf16 (taken in another graph of the program) has a reader here
 * that would read it as f32. */
static int th_swiglu_bf16(struct ggml_cgraph * graph, char * why, int why_size) {
    int taken = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * n = ggml_graph_node(graph, i), * other = NULL;
        const int glu = th_is_swiglu(n), back = th_kernel_of(n) == TH_CUDA_SWIGLU_BACK;
        if (!glu && !back) continue;
        struct ggml_tensor * gate = th_under_reshape_views(glu ? n->src[0] : n->src[2]);
        struct ggml_tensor * up = th_under_reshape_views(n->src[1]);
        if (gate == NULL || up == NULL || th_kernel_of(gate) != TH_CUDA_FROZEN_MUL_MAT ||
            th_kernel_of(up) != TH_CUDA_FROZEN_MUL_MAT) {
            continue;
        }
        th_family fg, fu, fo[TH_SWIGLU_GLUS];
        int n_glus = 0;
        if (!th_family_of(graph, gate, &fg) || !th_family_of(graph, up, &fu)) continue;
        if (gate->type == GGML_TYPE_BF16 || up->type == GGML_TYPE_BF16) {
            if (th_swiglu_pair_ok(graph, &fg, &fu, GGML_TYPE_BF16, fo, &n_glus, &other)) continue;   /* taken before */
            char what[2 * GGML_MAX_NAME + 32];
            snprintf(what, sizeof what, "SwiGLU over %s and %s", gate->name, up->name);
            return th_kept_elsewhere(why, why_size, what, other);
        }
        if (!th_swiglu_pair_ok(graph, &fg, &fu, GGML_TYPE_F32, fo, &n_glus, &other)) continue;
        th_family_retype(&fg);
        th_family_retype(&fu);
        for (int k = 0; k < n_glus; k++) th_family_retype(&fo[k]);
        taken++;
    }
    return taken;
}

/* a GELU's forward or backward kernel, either form (tanh: GELU, GELU_BACK; erf: GELU_ERF,
 * GELU_ERF_BACK): they read their input alike, so they keep it bf16 alike */
static int th_is_gelu_kernel(int kernel) { return kernel == TH_CUDA_GELU || kernel == TH_CUDA_GELU_ERF; }
static int th_is_gelu_back_kernel(int kernel) { return kernel == TH_CUDA_GELU_BACK || kernel == TH_CUDA_GELU_ERF_BACK; }

/* Whether the MLP's hidden activation `fh` (a LINEAR_BIAS with its reshapes) can be, or is, bf16
 * in `graph` (`type` what it is now): every reader of it a member, a GELU of it (src 0), a
 * GELU_BACK of it (src 1, its gradient src 0 not a member) or a node of ours that computes nothing.
 * Else the reader that is not in *other (NULL: an output or another layout). */
static int th_gelu_input_ok(struct ggml_cgraph * graph, const th_family * fh, enum ggml_type type,
                            struct ggml_tensor ** other) {
    *other = NULL;
    if (!th_family_plain(fh, type)) return 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        int reads = 0;
        for (int k = 0; k < fh->n; k++) reads |= th_reads(u, fh->t[k]);
        if (!reads || th_in(fh, u)) continue;
        const int kernel = th_kernel_of(u);
        if (kernel == TH_CUDA_FOLDED || kernel == TH_CUDA_ROOM || (th_is_gelu_kernel(kernel) && th_in(fh, u->src[0])) ||
            (th_is_gelu_back_kernel(kernel) && th_in(fh, u->src[1]) && !th_in(fh, u->src[0]))) {
            continue;
        }
        *other = u;
        return 0;
    }
    return 1;
}

/* At bf16, a GELU (either form) over a product with a bias (LINEAR_BIAS: the MLP's first product in
 * gpt2 and ViT) keeps that product's output, its hidden activation, as bf16: cuBLASLt rounds the fp32 sums
 * plus the bias (as bf16, as autocast casts it) to bf16 once, what bf16 autocast's linear returns,
 * and GELU and its backward compute in fp32 on those values. Half the bytes the product writes,
 * GELU reads and GELU_BACK reads again (4 x d_model floats a token, each pass). Taken only where
 * th_gelu_input_ok says; found by the GELU or by its GELU_BACK alone (a recomputed product).
 * Returns the products taken, or -2 (`why`) where one already bf16 (taken in another graph of the
 * program) has a reader here that would read it as f32. */
static int th_gelu_bf16(struct ggml_cgraph * graph, char * why, int why_size) {
    int taken = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * n = ggml_graph_node(graph, i), * other = NULL;
        const int kernel = th_kernel_of(n);
        /* a product kept bf16 by another graph is checked wherever it is, GELU here or not */
        struct ggml_tensor * h = kernel == TH_CUDA_LINEAR_BIAS && n->type == GGML_TYPE_BF16 && !th_kept_for_attention(n) ? n
                               : th_is_gelu_kernel(kernel) ? th_under_reshape_views(n->src[0])
                               : th_is_gelu_back_kernel(kernel) ? th_under_reshape_views(n->src[1]) : NULL;
        th_family fh;
        if (h == NULL || th_kernel_of(h) != TH_CUDA_LINEAR_BIAS || !th_family_of(graph, h, &fh)) continue;
        if (h->type == GGML_TYPE_BF16) {
            if (th_gelu_input_ok(graph, &fh, GGML_TYPE_BF16, &other)) continue;         /* taken before */
            char what[GGML_MAX_NAME + 32];
            snprintf(what, sizeof what, "GELU's input %s", h->name);
            return th_kept_elsewhere(why, why_size, what, other);
        }
        if (!th_gelu_input_ok(graph, &fh, GGML_TYPE_F32, &other)) continue;
        th_family_retype(&fh);
        taken++;
    }
    return taken;
}

/* ---- attention's q, k and v^T in bf16 ----------------------------------------------------- */

/* `p` and every view of it among the graph's nodes and their sources (ggml keeps a view's storage
 * in view_src, whatever views lie between); 0 when there are too many */
static int th_views_of(struct ggml_cgraph * graph, struct ggml_tensor * p, th_family * f) {
    f->n = 1;
    f->t[0] = p;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        for (int j = -1; j < GGML_MAX_SRC; j++) {
            struct ggml_tensor * t = j < 0 ? u : u->src[j];
            if (t == NULL || t->view_src != p || th_in(f, t)) continue;
            if (f->n == TH_FAMILY) return 0;
            f->t[f->n++] = t;
        }
    }
    return 1;
}

/* Whether the product `fp` (a LINEAR_BIAS with its views, fp->t[0]) can be, or is, bf16 in `graph`
 * (`type` what it is now): no output, its views' offsets whole bf16 elements, and every node that
 * reads it a view of it, a node of ours that computes nothing (FOLDED, ROOM), or an attention node
 * that reads it as q, k or v^T (src 0, 1, 2). Else the reader that is not in *other (NULL: an
 * output or a layout). */
static int th_attention_input_ok(struct ggml_cgraph * graph, const th_family * fp, enum ggml_type type,
                                 struct ggml_tensor ** other) {
    *other = NULL;
    const struct ggml_tensor * p = fp->t[0];
    if (p->type != type || !ggml_is_contiguous(p) || (p->flags & (GGML_TENSOR_FLAG_OUTPUT | GGML_TENSOR_FLAG_PARAM))) {
        return 0;
    }
    for (int k = 1; k < fp->n; k++) {
        if (fp->t[k]->type != type || fp->t[k]->view_offs % (type == GGML_TYPE_F32 ? 4 : 2) != 0) return 0;
    }
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        if (th_in(fp, u)) continue;
        const int kernel = th_kernel_of(u);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            if (u->src[j] == NULL || !th_in(fp, u->src[j])) continue;
            if (kernel == TH_CUDA_FOLDED || kernel == TH_CUDA_ROOM || th_attention_product(u, j) == p) continue;
            *other = u;
            return 0;
        }
    }
    return 1;
}

#define TH_ATTENTION_PRODUCTS 256

/* At bf16, an attention whose q, k and v^T are products with a bias (LINEAR_BIAS: gpt2's and
 * ViT's projections) reads them as bf16:
 * cuBLASLt rounds the fp32 sums plus the bias (as bf16, as autocast casts it) to bf16 once, what
 * bf16 autocast's linear returns and its attention reads, where the attention's kernels rounded
 * the f32 product's values to bf16 as they loaded them. Half the bytes the products write and the
 * forward, the backward and dQ read (each reads q, k and v^T again), and no conversion in those
 * kernels. Taken for the three products of an attention together (the kernels read all three of
 * one type), each where th_attention_input_ok says, with all its views (the head-permuted ones
 * the attention reads). Returns the products taken, or -2 (`why`) where one already bf16 (taken
 * in another graph of the program) has a reader here that would read it as f32. */
static int th_attention_inputs_bf16(struct ggml_cgraph * graph, char * why, int why_size) {
    struct ggml_tensor * taken[TH_ATTENTION_PRODUCTS];
    int n_taken = 0;
    /* the candidates: every attention operand's product that may be bf16, and every product kept
     * bf16 for attention (by another graph) wherever it is read here */
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i), * other = NULL;
        for (int j = -1; j < 3; j++) {
            struct ggml_tensor * p = j < 0 ? (th_kept_for_attention(u) ? u : NULL) : th_attention_product(u, j);
            th_family fp;
            int seen = 0;
            for (int k = 0; k < n_taken; k++) seen |= taken[k] == p;
            if (p == NULL || seen || !th_views_of(graph, p, &fp)) continue;
            if (p->type == GGML_TYPE_BF16) {
                if (th_attention_input_ok(graph, &fp, GGML_TYPE_BF16, &other)) continue;     /* taken before */
                char what[GGML_MAX_NAME + 32];
                snprintf(what, sizeof what, "attention's input %s", p->name);
                return th_kept_elsewhere(why, why_size, what, other);
            }
            if (n_taken == TH_ATTENTION_PRODUCTS || !th_attention_input_ok(graph, &fp, GGML_TYPE_F32, &other)) continue;
            taken[n_taken++] = p;
        }
    }
    /* an attention node reads q, k and v^T of one type: one that cannot take all three bf16 drops
     * its others, until every attention node takes three or none */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
            const struct ggml_tensor * u = ggml_graph_node(graph, i);
            if (!th_is_attention_reader(u)) continue;
            int in[3] = {0, 0, 0}, all = 1;
            for (int j = 0; j < 3; j++) {
                const struct ggml_tensor * p = th_attention_product(u, j);
                for (int k = 0; k < n_taken && p != NULL; k++) in[j] |= taken[k] == p;
                all &= in[j] || (p != NULL && p->type == GGML_TYPE_BF16);
            }
            for (int j = 0; j < 3 && !all; j++) {
                const struct ggml_tensor * p = th_attention_product(u, j);
                for (int k = 0; k < n_taken && in[j]; k++) {
                    if (taken[k] == p) {
                        taken[k] = taken[--n_taken];
                        changed = 1;
                        break;
                    }
                }
            }
        }
    }
    for (int k = 0; k < n_taken; k++) {
        th_family fp;
        th_views_of(graph, taken[k], &fp);
        th_retype_bf16(taken[k]);
        taken[k]->op_params[2] = TH_KEPT_FOR_ATTENTION;
        for (int v = 1; v < fp.n; v++) {         /* a view keeps its shape: its strides and offset halve */
            struct ggml_tensor * t = fp.t[v];
            t->type = GGML_TYPE_BF16;
            for (int d = 0; d < GGML_MAX_DIMS; d++) t->nb[d] /= 2;
            t->view_offs /= 2;
        }
    }
    return n_taken;
}

/* Where attention's tensor-core kernels take it (custom_ops.h, th_attention_on_tensor_cores), an
 * attention's backward node (ATTN_BWD, stamped) writes dK and dV alone: dQ's kernel computes the
 * tiles of dS again, so the (T, T, BH) scores' gradient is never formed and the node keeps no room
 * for it, (1, 1, BH) (its heads still in ne[2]). */
static void th_attention_drop_ds(struct ggml_tensor * t) {
    if (th_kernel_of(t) != TH_CUDA_ATTN_BWD || !th_attention_on_tensor_cores(t)) return;
    t->ne[0] = 1, t->ne[1] = 1;
    for (int d = 1; d < GGML_MAX_DIMS; d++) t->nb[d] = t->nb[d - 1] * t->ne[d - 1];
}

/* An attention on cuDNN's fused attention (custom_ops.h, th_attention_cudnn) keeps dQ, dK and dV
 * in bf16, as cuDNN writes them, in its backward node until its dQ node and the backward itself
 * widen them into their fp32 rooms: (3 hd T / 2, 1, BH) floats. Once q, k and v are typed
 * (th_attention_inputs_bf16), which the choice reads. */
static void th_attention_cudnn_room(struct ggml_cgraph * graph) {
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (th_kernel_of(t) != TH_CUDA_ATTN_BWD || !th_attention_cudnn(t->src[4])) continue;
        th_attention_params ap;
        memcpy(&ap, (const char *) t->op_params + 2 * sizeof(int32_t), sizeof(ap));
        t->ne[0] = 3 * (int64_t) ap.hd * ap.T / 2, t->ne[1] = 1;
        for (int d = 1; d < GGML_MAX_DIMS; d++) t->nb[d] = t->nb[d - 1] * t->ne[d - 1];
    }
}

/* ---- LayerNorm's bias's gradient in its backward ------------------------------------------ */

/* At bf16, LayerNorm's bias's gradient, OUT_PROD(dy, ones) (the column sums of the dy that the
 * norm's AFFINE received), is a bf16 product: dy rounded to bf16 by a conversion pass of its own
 * (24 of a gpt2-small step's 148), then cuBLAS's split-K product and its reduction. Where the
 * norm's backward (LAYER_NORM_BACK, reading that dy) already sums its gain's gradient
 * (th_fuse_gain_sums), it sums dy's columns too, in fp32 from dy's fp32 values, in the gain's
 * order (a block a chunk of rows, its warps' sums in order, then the chunks in order), into the
 * OUT_PROD's node (a ROOM: its src 6), the partials after the gain's in its scratch (src 5, dy's
 * size: 2 x chunks x n floats fit where rows >= 2). The sum is the reduction autocast would do in
 * fp32, without rounding its terms: the bits move (gpt2's and ViT's @bf16 goldens), fp32's and
 * tf32's keep their products. Only where the OUT_PROD comes before the backward and nothing reads
 * it before the backward.
 * Returns the nodes taken. */
static int th_layer_norm_bias_sums(struct ggml_cgraph * graph) {
    const int n = ggml_graph_n_nodes(graph);
    int taken = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * u = ggml_graph_node(graph, i);
        const struct ggml_tensor * ones = u->src[1];
        if (u->op != GGML_OP_OUT_PROD || u->type != GGML_TYPE_F32 || !ggml_is_contiguous(u) || u->src[0] == NULL ||
            !th_is_ones(ones) || ggml_nelements(u) != u->src[0]->ne[0]) {
            continue;
        }
        for (int j = i + 1; j < n; j++) {
            struct ggml_tensor * b = ggml_graph_node(graph, j);
            if (th_kernel_of(b) != TH_CUDA_LAYER_NORM_BACK || b->src[4] == NULL || b->src[6] != NULL ||
                th_under_reshape_views(b->src[0]) != th_under_reshape_views(u->src[0])) {
                continue;
            }
            if (u->src[0]->ne[0] == b->ne[0] && ggml_nelements(u->src[0]) == ggml_nelements(b) &&
                ones->ne[1] == ggml_nrows(b) && ggml_nrows(b) >= 2 && !th_read_before(graph, u, j)) {
                b->src[6] = u;
                th_mark(u, TH_CUDA_ROOM);
                memset(u->src, 0, sizeof(u->src));
                taken++;
            }
            break;
        }
    }
    return taken;
}

/* Stamps `precision` (TH_PRECISION_*) on the graph's product nodes; returns how many, -1 for a
 * precision it does not know, or -2 where bf16 meets a frozen weight's product of a shape the
 * frozen bf16 products do not take, or a SwiGLU, a GELU's or an attention's input kept bf16 that a node here reads
 * as f32 (its name in `why`). fp32 clears a stamp (a node keeps no other precision's). At bf16, products of frozen
 * weights become ours first (th_mark_frozen), then SwiGLUs over them keep bf16 (th_swiglu_bf16),
 * as do GELUs' inputs (th_gelu_bf16) and attention's q, k and v (th_attention_inputs_bf16), and at tf32
 * and bf16 attention's backward nodes drop dS
 * (th_attention_drop_ds). Before all that, at bf16, LayerNorm's backward takes its bias's gradient
 * (th_layer_norm_bias_sums). */
TH_EXPORT int th_cuda_mark_precision(struct ggml_cgraph * graph, int precision, char * why, int why_size) {
    if (precision != TH_PRECISION_FP32 && precision != TH_PRECISION_TF32 && precision != TH_PRECISION_BF16) return -1;
    if (precision == TH_PRECISION_BF16) th_layer_norm_bias_sums(graph);    /* (rooms now: stamped below) */
    int marked = 0;
    for (int i = 0; i < ggml_graph_n_nodes(graph); i++) {
        struct ggml_tensor * t = ggml_graph_node(graph, i);
        if (precision == TH_PRECISION_BF16 && th_mark_frozen(t) < 0) {
            if (why != NULL && why_size > 0) {
                snprintf(why, (size_t) why_size, "%s %s of a frozen %s weight %s (ne %lld x %lld) and %s (ne %lld x %lld)",
                         ggml_op_desc(t), t->name, ggml_type_name(t->src[0]->type), t->src[0]->name,
                         (long long) t->src[0]->ne[0], (long long) t->src[0]->ne[1], t->src[1] ? t->src[1]->name : "?",
                         t->src[1] ? (long long) t->src[1]->ne[0] : 0LL, t->src[1] ? (long long) t->src[1]->ne[1] : 0LL);
            }
            return -2;
        }
        if (precision != TH_PRECISION_BF16 && th_kernel_of(t) == TH_CUDA_LINEAR_BIAS && t->type == GGML_TYPE_BF16) {
            if (why != NULL && why_size > 0) {      /* only bf16's kernels write it (th_gelu_bf16, th_attention_inputs_bf16) */
                snprintf(why, (size_t) why_size, "%s %s, kept bf16 at precision bf16, in a graph at another precision",
                         th_kept_for_attention(t) ? "attention's input" : "GELU's input", t->name);
            }
            return -2;
        }
        if (t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_OUT_PROD || th_kernel_of(t) != 0) {
            th_precision_set(t, precision);
            marked++;
        }
        th_attention_drop_ds(t);
    }
    if (precision == TH_PRECISION_BF16 && th_swiglu_bf16(graph, why, why_size) < 0) return -2;
    if (precision == TH_PRECISION_BF16 && th_gelu_bf16(graph, why, why_size) < 0) return -2;
    if (precision == TH_PRECISION_BF16 && th_attention_inputs_bf16(graph, why, why_size) < 0) return -2;
    if (precision == TH_PRECISION_BF16) th_attention_cudnn_room(graph);
    return marked;
}

/* a node's stamp (tests) */
TH_EXPORT int th_cuda_precision_of(const struct ggml_tensor * t) { return th_precision_of(t); }

/* TOYHARNESS_CUDNN_ATTENTION as toyharness/_ffi.py passed it (custom_ops.h, TH_CUDNN_MODE): the shim's copy */
int th_shim_cudnn_mode = TH_CUDNN_ON;

TH_EXPORT void th_set_cudnn_attention(int mode) { th_shim_cudnn_mode = mode; }

/* whether this build takes bf16 attention to cuDNN (native/build.py, TOYHARNESS_CUDNN; tests) */
TH_EXPORT int th_cudnn_attention_built(void) {
#ifdef TH_CUDNN_ATTENTION
    return 1;
#else
    return 0;
#endif
}
