"""The rewrites a graph gets after ggml built it and before it is computed, each where the
program's flags (Program.__init__) ask for it:

- `lowered`: nodes the backend does not declare become ops it does (engine/lowering.py);
- `column_sums_as_products`: a training graph's column sums (REPEAT_BACK) become products with
  a column of ones (Program.column_sums_as_products);
- `fold_cpu_products`: on cpu, products folded into the ADDs that read them (th_cpu_fold);
- `keep_softmax_for_backward`: a training graph's softmaxes that their backward could overwrite
  kept (Trainer, once the backward is built, before any allocator places it);
- `prepare`, once per graph before its first compute: the backend's rewrite (the portable
  kernels, our cpu kernels or the cuda rewrite), the precision stamp of each product, then the
  check that the backend declares every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._ffi import ffi, lib
from ..errors import BackendError
from . import graph_check

if TYPE_CHECKING:
    from .program import Program

# native/custom_ops.h's TH_PRECISION_*
PRECISION_CODES = {"fp32": 0, "tf32": 1, "bf16": 2}

# th_cuda_rewrite's flag for attention: fused (native/cuda/th-attention.cu), grouped-query heads'
# kv heads read in place
FUSED_ATTENTION = 3
# and with dropout on the attention weights, at the precisions whose kernels draw the mask themselves
FUSED_DROPOUT = 8
DROPOUT_FUSING_PRECISIONS = ("tf32", "bf16")


def prepare(prog: Program, graph, recomputed: bool = False) -> None:
    """Once per graph, before its first compute (and in a memory plan, before it is measured):
    the backend's rewrites, then the check that the backend declares every node.
    `recomputed`: a graph of recomputed blocks alone (engine/recompute.py), which may read a
    block input that a node of the forward's graph writes (the cuda rewrite's rooms)."""
    if graph not in prog._gemm_rewritten:
        # On cpu, hot nodes get our kernels (native/cpu_kernels.c: sgemm, copies, SILU_BACK,
        # LayerNorm centring); no backward can be built through a rewritten node, so a
        # Trainer must come before any compute.
        if prog.portable:
            why = ffi.new("char[256]")
            if lib.th_portable_rewrite(graph, why, 256) < 0:
                raise BackendError(f"portable mode: {ffi.string(why).decode()}; not computed "
                                   "(native/portable_kernels.c)")
        elif prog.cpu_kernels and lib.th_cpu_rewrite(graph) < 0:
            raise RuntimeError("a stand-in node could not take its cpu kernel, or a fused node is read "
                               "elsewhere (native/cpu_kernels.c, th_cpu_rewrite): not computed")
        elif prog.cuda_kernels and lib.th_cuda_rewrite(graph, cuda_rewrite_flags(prog, recomputed)) < 0:
            raise RuntimeError("a stand-in node could not take its cuda kernel, an attention's backward "
                               "could not follow its fused forward, the graph holds a node another one "
                               "writes but not that one, or it reads a LayerNorm output that the forward "
                               "no longer writes (native/cuda_rewrite.c, th_cuda_rewrite): not computed")
        if prog.precision != "fp32":
            why = ffi.new("char[512]")
            marked = lib.th_cuda_mark_precision(graph, PRECISION_CODES[prog.precision], why, 512)
            if marked == -2:
                text = ffi.string(why).decode()
                if text.startswith(("SwiGLU", "GELU's input", "attention's input")):   # kept bf16
                    raise BackendError(f"precision {prog.precision}: {text}; not computed")
                raise BackendError(f"precision {prog.precision}: the frozen bf16 products (native/cuda/"
                                   f"th-frozen.cu) do not take {text}")
            if marked < 0:
                raise BackendError(f"precision {prog.precision}: not known to native/cuda_precision.c")
        # after the rewrites: every node as the backend's dispatch will see it (ours included)
        check_supported(prog, graph)
        prog._gemm_rewritten.add(graph)
        if prog.packed_rows is not None:      # which packed masks the graph still reads (engine/packed.py)
            prog.packed_rows.note_graph(graph)


def cuda_rewrite_flags(prog: Program, recomputed: bool = False) -> int:
    """th_cuda_rewrite's flags for `prog`'s graphs (native/cuda_rewrite.c)."""
    return (FUSED_ATTENTION | (FUSED_DROPOUT if prog.precision in DROPOUT_FUSING_PRECISIONS else 0)
            | (4 if recomputed else 0))


_VIEWS = ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")


def keep_softmax_for_backward(prog: Program, graph) -> int:
    """Mark as outputs the softmaxes whose SOFT_MAX_BACK could be placed in their own buffer where
    its kernel is not safe in place; the count. ggml-alloc puts an op that may run in place in the
    buffer of its first source that no later node reads; SOFT_MAX_BACK's are (dy, y), and ggml's cpu
    kernel writes dx = dy before it reads y. Where dy cannot take dx (a view of another node's
    result, as a GET_ROWS pick's gradient reshaped is, or read by another node too) y would, and the
    gradient would be wrong; an output is never reused. Graphs whose dy takes dx (every built-in
    attention's) are left as they are: their memory and bits do not change.

    Kept only where ggml's cpu kernel computes it: ggml-cuda's reads a row's y and dy before it
    writes the row, and ours (native/cpu_kernels.c th_soft_max_back_rows_op, the portable mode's
    tp_soft_max_back) each element before writing it. An output is never freed, so a kept softmax
    holds its memory to the graph's end: with logits_chunk, every piece's (vocabulary x piece)
    probabilities."""
    if prog.cuda_kernels or prog.engine.backend == "cuda" or prog.portable:
        return 0
    nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
    readers: dict[int, int] = {}
    for node in nodes:
        for j in range(10):
            s = lib.th_tensor_src(node, j)
            if s != ffi.NULL:
                key = int(ffi.cast("uintptr_t", s))
                readers[key] = readers.get(key, 0) + 1
    kept = 0
    for node in nodes:
        if ffi.string(lib.ggml_op_desc(node)).decode() != "SOFT_MAX_BACK":
            continue
        if prog.cpu_kernels and lib.th_cpu_soft_max_back_in_place_ok(node):
            continue
        dy, y = lib.th_tensor_src(node, 0), lib.th_tensor_src(node, 1)
        if ffi.string(lib.ggml_op_desc(dy)).decode() in _VIEWS or readers.get(int(ffi.cast("uintptr_t", dy)), 0) > 1:
            lib.ggml_set_output(y)
            kept += 1
    return kept


def lowered(prog: Program, graph, grads: bool):
    """`graph`, or where it holds nodes the backend does not declare and the lowering can
    rewrite, a larger copy of it with them rewritten (the program's `lowering.lowered` says which)."""
    if prog.engine.is_cpu and not prog.lowering_target:
        return graph      # ggml-cpu declares every op our graphs hold
    needed = prog.lowering.needed(graph)
    if not needed:
        return graph
    bigger = prog._new_graph(lib.ggml_graph_size(graph) + 64 * needed, grads)
    lib.ggml_graph_cpy(graph, bigger)
    prog.lowering.lower(bigger)
    return bigger


def check_supported(prog: Program, graph) -> None:
    """ggml aborts on an op its backend lacks: name the op instead, before any compute
    (with Program.lowering_target "metal", the ops ggml-metal lacks too)."""
    if prog.engine.is_cpu and not prog.lowering_target:
        return
    missing = {}
    for i in range(lib.ggml_graph_n_nodes(graph)):
        node = lib.ggml_graph_node(graph, i)
        if not prog.lowering.declares(node):
            op, name = ffi.string(lib.ggml_op_desc(node)).decode(), ffi.string(lib.ggml_get_name(node)).decode()
            missing.setdefault(op, (name, graph_check.origin_of(prog, node)[0]))
    if missing:
        ops = ", ".join(f"{op} (e.g. node {name!r}{f', from {where}' if where else ''})"
                        for op, (name, where) in missing.items())
        where = f" (lowered for {prog.lowering_target})" if prog.lowering_target else ""
        raise BackendError(f"the {prog.engine.backend} backend of this ggml{where} cannot run {ops}")


def column_sums_as_products(prog: Program, graph) -> None:
    """Every REPEAT_BACK that sums the rows of a matrix into one row becomes OUT_PROD(matrix,
    ones): the same sum as a cuBLAS product; one that sums each row into one value becomes
    SUM_ROWS (see Program.column_sums_as_products, native/shim.c)."""
    found = []
    for i in range(lib.ggml_graph_n_nodes(graph)):
        node = lib.ggml_graph_node(graph, i)
        rows = lib.th_column_sum_rows(node)
        if rows > 0:
            found.append((node, rows))
        else:
            lib.th_row_sum_as_sum_rows(node)
    ones = {rows: prog.cached_constant(f"ones.{rows}", lambda rows=rows: np.ones((rows, 1), np.float32))
            for rows in {rows for _, rows in found}}
    prog.allocate()
    for node, rows in found:
        if lib.th_column_sum_as_out_prod(node, ones[rows].ptr) != 1:
            raise RuntimeError("th_column_sum_as_out_prod refused a node th_column_sum_rows accepted")


def fold_cpu_products(prog: Program, graph) -> None:
    """Where our cpu kernels compute the graph (one lowered for metal keeps ggml's nodes), fold
    products into the ADDs that read them."""
    if prog.cpu_kernels and prog.cpu_folds and lib.th_cpu_fold(graph) < 0:
        raise RuntimeError("a product folded into an ADD is read elsewhere (native/cpu_kernels.c, th_cpu_fold)")
