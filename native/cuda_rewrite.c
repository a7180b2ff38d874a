/* toyharness cuda rewrite: hands graph nodes to our kernels inside ggml-cuda (cuda/th-custom.cu).
 *
 * ggml-cuda has no custom ops, so a cuda build patches one dispatch into ggml-cuda.cu
 * (native/build.py, stage_cuda_source): a GGML_OP_CUSTOM node whose op_params start with
 * TH_CUDA_MAGIC goes to th_cuda_custom. Nodes are marked here, on the host, after the Trainer
 * has built the backward (a custom op has none in ggml): the same stand-ins as the cpu rewrite.
 *   - GELU: the SILU named "th.gelu_tanh" and its SILU_BACK (blocks.gelu_tanh), one kernel each
 *     way instead of 5 nodes forward and 12 backward over the MLP's widest activation; the exact
 *     form's, "th.gelu_erf" (blocks.gelu_erf), its own two kernels instead of 21 and 36.
 *   - CONT of a permuted f32 tensor (attention's head permutes), an exact copy at memory speed.
 *   - Attention (blocks.attention), when asked: the nodes ggml's autograd built for
 *       S = MUL_MAT(k, q), P = SOFT_MAX(S, causal mask or none, scale), O = MUL_MAT(vt, P)
 *     and for their backward
 *       dvt = OUT_PROD(P, dO), dP = OUT_PROD(vt, T(dO)), dS = SOFT_MAX_BACK(dP, P),
 *       dk = OUT_PROD(q, dS), dq = OUT_PROD(k, T(dS))
 *     (with dropout on P, flag 8: P times its mask read by O and dvt, and dP's MUL by the mask,
 *     which then compute nothing: the kernels draw the mask)
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
 *     the same rows in the same order, so the bits do not change. Where its ids are distinct (a
 *     loss's flat target indices, th_ids_distinct) it is a scatter into zeros instead: no output
 *     row compares ids (at DPO's 4096 rows of a 128,256-token vocabulary, ggml's 28 s a step).
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
/* The passes, one a file, are in native/cuda_rewrite/ (passes.h lists them); this file runs them
 * in order. */
#include "ggml.h"
#include "custom_ops.h"
#include "cuda_rewrite/passes.h"

#define TH_EXPORT __attribute__((visibility("default")))

/* Returns how many nodes were marked, or -1 when a stand-in cannot be (the graph must then not
 * be computed: it would compute silu where GELU is meant, RMSNorm where LayerNorm is), when an
 * attention's backward cannot follow its fused forward, a folded product is read, a node that
 * another one computes (a room, an AdamW step of a run) is here without that one, or a node reads
 * a LayerNorm's t that its AFFINE leaves unwritten (th_check_unread_norms).
 * `flags`: 1, fuse attention, and with 2 also the kv heads of grouped-query attention read in
 * place (th_attention_group) rather than repeated; 4, `graph` holds recomputed blocks alone
 * (th_order_rooms); 8, with 1 an attention with dropout on its weights fused too, the kernels
 * drawing its mask (bf16's and tf32's kernels do; fp32's do not). */
TH_EXPORT int th_cuda_rewrite(struct ggml_cgraph * graph, int flags) {
    const int attention = flags & 3;
    const int gelu = th_mark_gelu_pairs(graph);
    if (gelu < 0) return -1;
    const int fused = attention ? th_rewrite_attention(graph, (attention & 2) != 0, (flags & 8) != 0) : 0;
    if (fused < 0) return -1;
    const int norms = th_rewrite_layer_norms(graph);
    if (norms < 0) return -1;
    const int biases = th_rewrite_linear_biases(graph);
    const int affines = th_rewrite_norm_affines(graph);
    const int sums = th_rewrite_product_sums(graph), residuals = th_rewrite_norm_residuals(graph);
    const int silu_backs = th_rewrite_silu_back_muls(graph);    /* after the GELU pairs: theirs are not SILU_BACK now */
    int singles = th_mark_singles(graph);   /* nodes marked one for one */
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
