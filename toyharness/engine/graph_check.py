"""Checks a run makes on its graphs when they are built, before ggml computes any node.

- `cont_strided_operands`: ggml's backward sums the gradients of a tensor with several consumers
  into whichever came first; where that is a permuted view's gradient (a transpose of the tensor),
  ggml's cpu kernels abort on it. Such operands get a contiguous copy first (native/shim.c,
  th_cont_strided_operands): the same values, and no node added to a graph ggml could compute.
- `refuse_unsupported`: a node the run's mode cannot compute (no portable kernel; an op the
  backend, or the metal lowering, does not declare) is refused as the run starts, in one line
  naming the op and the recipe's line that made the node (engine/origins.py records it), not at
  the first compute.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .._ffi import ffi, lib
from ..errors import BackendError
from .origins import node_origin

if TYPE_CHECKING:
    from .program import Program


def cont_strided_operands(prog: Program, graph, grads: bool):
    """`graph`, or a larger copy of it, with every operand ggml's kernels cannot read strided made
    contiguous first (a CONT node just before its reader)."""
    needed = lib.th_cont_strided_operands(prog._ctx_compute, graph, 0)
    if needed == 0:
        return graph
    bigger = prog._new_graph(lib.ggml_graph_size(graph) + needed, grads)
    lib.ggml_graph_cpy(graph, bigger)
    if lib.th_cont_strided_operands(prog._ctx_compute, bigger, 1) != needed:
        raise RuntimeError("th_cont_strided_operands: the graph has no room for the copies it counted")
    return bigger


def origin_of(prog: Program, node) -> tuple[str | None, str | None]:
    """(the recipe's line, the op of the node made there) for `node`: its own when Tensor made it,
    else the nearest node it was derived from (a backward node: the forward node it differentiates)."""
    seen, queue = set(), deque([node])
    while queue:
        t = queue.popleft()
        key = int(ffi.cast("uintptr_t", t))
        if key in seen:
            continue
        seen.add(key)
        where = node_origin(prog, t)
        if where:
            return where, ffi.string(lib.ggml_op_desc(t)).decode()
        for i in range(10):
            src = lib.th_tensor_src(t, i)
            if src != ffi.NULL:
                queue.append(src)
    return None, None


def _describe(prog: Program, node) -> str:
    op = ffi.string(lib.ggml_op_desc(node)).decode()
    where, made = origin_of(prog, node)
    if where is None:
        return f"op {op}"
    return f"op {op} (made at {where})" if made == op else f"op {op} (from the {made} made at {where})"


def mode_name(prog: Program) -> str:
    if prog.portable:
        return "the cpu backend's portable mode"
    target = f" lowered for {prog.lowering_target}" if prog.lowering_target else ""
    return f"the {prog.engine.backend} backend{target}"


def first_unsupported(prog: Program, graph):
    """The first node of `graph` that this program's mode cannot compute, or None. Only where the
    verdict is final before compute: the portable kernels, and backends (or the metal lowering)
    whose nodes no rewrite of ours changes (cuda's kernels rewrite nodes at the first compute)."""
    if prog.portable:
        i = lib.th_portable_first_unsupported(graph)
        return None if i < 0 else lib.ggml_graph_node(graph, i)
    if (prog.engine.is_cpu and not prog.lowering_target) or prog.cuda_kernels or prog.cpu_kernels:
        return None
    for i in range(lib.ggml_graph_n_nodes(graph)):
        node = lib.ggml_graph_node(graph, i)
        if not prog.lowering.declares(node):
            return node
    return None


def refuse_unsupported(prog: Program, graphs) -> None:
    """BackendError (exit 2), one line, for the first node of `graphs` the mode cannot compute."""
    for graph in graphs:
        node = first_unsupported(prog, graph)
        if node is not None:
            raise BackendError(f"{mode_name(prog)} cannot run {_describe(prog, node)}; the run is refused "
                               "before it starts (docs/ops.md lists which op runs in which mode)")
