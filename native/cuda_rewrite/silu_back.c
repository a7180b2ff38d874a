/* The cuda rewrite's pass: SwiGLU's backward (SILU_BACK of a MUL, with up's gradient beside it):
 * one kernel. */
#include "passes.h"

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

int th_rewrite_silu_back_muls(struct ggml_cgraph * graph) {
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
