"""Activation recompute by block: recompute a block's activations in the backward instead of
keeping them from the forward (option `recompute_blocks`).

ggml's backward reads the forward's nodes, so every activation of every block stays alive from
the forward to its block's backward. With `recomputed_block(fn, h)` a recipe builds each block twice:
the original, which the forward and the loss use, and a copy (the same ops on the same input h,
which is kept anyway as the block's input). Once the Trainer has built the backward, `apply`
points every backward node that reads an original activation of a block at its copy instead, and
orders each graph again so that a block's copy is computed just before its backward first needs
it. The originals then die within the forward (ggml's allocator frees a node after its last
reader) and the copies live only through their block's backward: one block's activations at a
time instead of all of them, for one more forward of each block.

The copy computes the same operations on the same values in the same order, so every value the
backward reads has the same bits as without recompute, and so have the losses. The cpu backend
(fast and portable) and cuda take it (Program.enable_recompute). On cuda the rewrite
(native/cuda_rewrite.c) runs as on cpu, on the graph as ggml built it, where each attention's
fused backward is paired with its original forward, then on the copies apart; once the backward
reads the copies, its prep and backward nodes read the copy's fused forward node, which holds the
same O and L (the same kernel on the same inputs), computed just before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .._ffi import GGML_MAX_SRC, ffi, lib
from ..errors import InputError

if TYPE_CHECKING:
    from .program import Program
    from .tensor import Tensor

# struct ggml_tensor of ggml 0.25.3 (ggml.h): type, buffer, ne[4], nb[4], op, op_params[16],
# flags, then src[10]. The shim has no setter for a node's inputs; the offset is checked against
# th_tensor_src before any write.
_SRC_OFFSET = 152
_VIEW_OPS = ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")


@dataclass
class Recompute:
    """A program's recomputed blocks: each original activation's copy, by address."""

    copies: dict[int, object] = field(default_factory=dict)
    # each block's copy's output, by group: the blocks of recompute_blocks ("blocks") and those built
    # with always=True ("always"), whose copies are rewritten in graphs of their own (apply)
    outputs: dict[str, list] = field(default_factory=lambda: {"blocks": [], "always": []})
    blocks: int = 0
    # recompute_blocks: every recomputed_block; False: only those called with always=True (the
    # pieces of a chunked output head, engine/losses.py head_token_logps)
    every_block: bool = True


def _addr(t) -> int:
    return int(ffi.cast("uintptr_t", t))


def _op(t) -> str:
    return ffi.string(lib.ggml_op_desc(t)).decode()


def _last(ctx):
    last, t = ffi.NULL, lib.ggml_get_first_tensor(ctx)
    while t != ffi.NULL:
        last, t = t, lib.ggml_get_next_tensor(ctx, t)
    return last


def _after(ctx, last) -> list:
    t = lib.ggml_get_first_tensor(ctx) if last == ffi.NULL else lib.ggml_get_next_tensor(ctx, last)
    out = []
    while t != ffi.NULL:
        out.append(t)
        t = lib.ggml_get_next_tensor(ctx, t)
    return out


def recomputed_block(fn: Callable[..., Tensor], h: Tensor, *args, always: bool = False) -> Tensor:
    """`fn(h, *args)`, a block of the forward; with the program's recompute_blocks on, its
    activations are recomputed in the backward (see the module); `always`: wherever the program
    recomputes at all (Program.enable_recompute). `fn` must build the same ops each time it is
    called (a pure function of its inputs and the parameters)."""
    prog = h.prog
    rec = prog.recompute
    if rec is None or not (rec.every_block or always):
        return fn(h, *args)
    ctx = prog._ctx_compute
    mark = _last(ctx)
    out = fn(h, *args)
    made = _after(ctx, mark)
    mark = _last(ctx)
    copy_out = fn(h, *args)
    again = _after(ctx, mark)
    if len(made) != len(again) or any(_op(a) != _op(b) or _shape(a) != _shape(b) for a, b in zip(made, again)):
        raise InputError("recompute_blocks: a block built different ops the second time (recompute needs a "
                         "block that is a pure function of its input)")
    # The block's output (and what it is a view of) stays the original: the next block reads it.
    keep, t = set(), out.ptr
    while True:
        keep.add(_addr(t))
        if _op(t) not in _VIEW_OPS or lib.th_tensor_src(t, 0) == ffi.NULL:
            break
        t = lib.th_tensor_src(t, 0)
    for a, b in zip(made, again):
        if _addr(a) not in keep:
            rec.copies[_addr(a)] = b
    rec.outputs["always" if always else "blocks"].append(copy_out.ptr)
    rec.blocks += 1
    return out


def _shape(t) -> tuple[int, ...]:
    ne = ffi.new("int64_t[4]")
    lib.th_tensor_shape(t, ne, ffi.new("size_t[4]"))
    return tuple(ne)


def _set_src(node, j: int, value) -> None:
    slots = ffi.cast("ggml_tensor **", ffi.cast("char *", node) + _SRC_OFFSET)
    if slots[j] != lib.th_tensor_src(node, j):
        raise RuntimeError("struct ggml_tensor's layout is not ggml 0.25.3's: update recompute._SRC_OFFSET")
    slots[j] = value


def apply(prog: Program, gf, graphs: list) -> list:
    """Point the backward's reads of recomputed blocks' activations at their copies, then return each of
    `graphs` (built on `gf`, the last holding every node of the others) ordered again: a copy right
    before its first reader.

    The backend's rewrites (Program._prepare: on cpu our kernels, which pair each GELU stand-in
    with the backward node that reads its input, through the graph's gradients) run first, on the
    graph as ggml built it, and on the copies apart; the graphs returned are marked rewritten."""
    rec = prog.recompute
    prog._prepare(graphs[-1])
    # The copies and what they read: the blocks' inputs and everything before them, a graph a group.
    # A chunked head's pieces read the whole forward, the blocks' originals among it: beside the
    # blocks' copies there, the cuda rewrite would see an original and a copy of a block's norm
    # reading the same residual sum, and pair them wrongly.
    for outputs in rec.outputs.values():
        if outputs:
            copies = prog._new_graph(prog._forward_size(outputs), False)
            for out in outputs:
                lib.ggml_build_forward_expand(copies, out)
            prog._prepare(copies, recomputed=True)
    forward = {_addr(lib.ggml_graph_node(gf, i)) for i in range(lib.ggml_graph_n_nodes(gf))}
    graph = graphs[-1]
    for i in range(lib.ggml_graph_n_nodes(graph)):
        node = lib.ggml_graph_node(graph, i)
        if _addr(node) in forward:
            continue
        for j in range(GGML_MAX_SRC):
            src = lib.th_tensor_src(node, j)
            if src != ffi.NULL and _addr(src) in rec.copies:
                _set_src(node, j, rec.copies[_addr(src)])
    out = []
    for graph in graphs:
        again = prog._new_graph(lib.ggml_graph_size(graph) + len(rec.copies), False)
        dead = _dead_views(graph)
        for i in range(lib.ggml_graph_n_nodes(graph)):
            node = lib.ggml_graph_node(graph, i)
            if _addr(node) not in dead:
                lib.ggml_build_forward_expand(again, node)
        if prog.cuda_kernels:
            # Every node is marked already (the rewrite finds nothing new), but the cuda rewrite's
            # orderings and checks are per graph: the copies out of an attention's prep node after
            # its backward node, each room before its writer (gb_grad, never rewritten above, had
            # ggml's order), and no node reading one folded into another, which the copies' own
            # rewrite might have folded where only a copy read it. Refused, not computed, if any fails.
            prog._prepare(again)
        else:
            prog._gemm_rewritten.add(again)     # its nodes are rewritten; a second pass would not pair them
        out.append(again)
    return out


def _dead_views(graph) -> set[int]:
    """Nodes of `graph` that write nothing and that nothing reads: the cpu rewrite turns the nodes
    it replaces into no-ops (op NONE) and leaves views of them that no node reads (th.bias_rows).
    Built into a graph again, a no-op becomes a leaf, which ggml's allocator places: memory
    reserved, never written (44.5 of the 63.4 MiB training buffer of gpt2 with n_layer=8), and a
    cuda buffer would really take it. Found until none is left (a view dropped frees its source)."""
    nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
    dead: set[int] = set()
    while True:
        read = {_addr(lib.th_tensor_src(t, j)) for t in nodes if _addr(t) not in dead for j in range(GGML_MAX_SRC)
                if lib.th_tensor_src(t, j) != ffi.NULL}
        more = {_addr(t) for t in nodes if _addr(t) not in dead and _addr(t) not in read
                and _op(t) in (*_VIEW_OPS, "NONE") and lib.th_tensor_data(t) == ffi.NULL}
        if not more:
            return dead
        dead |= more
