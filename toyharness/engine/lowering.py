"""The lowering: each node whose op a backend does not declare (ggml's supports-op) is rewritten
into ops it does, in place, after the backward is built.

Chosen by what the backend declares, never by its name: a node is lowered only where the
declarations say no, and a rewrite is used only where the declarations say yes to every node it
adds (else the next rewrite of that op is tried; with none left the node stays, and the program's
support check names it). Program.lowering_target "metal" (set by tests) adds the pinned ggml-metal's declarations
(toyharness/engine/metal_ops.py, a port of ggml_metal_device_supports_op) to the backend's own, so
that cpu and vulkan compute the graphs a Mac would run.

The rewrites (ggml's semantics, f32 only):
- ADD, SUB, MUL, DIV of an operand whose elements are not adjacent (a transposed view, or its
  gradient): the same op of contiguous copies. ADD1(a, b) = ADD(a, b), b's one element broadcast.
- OUT_PROD(a, b) = a b^T over the two first axes: OUT_PROD of contiguous copies, else
  MUL_MAT(cont(a^T), cont(b^T)).
- CROSS_ENTROPY_LOSS(z, y) = -sum(log(sum_rows(softmax(z) * y))) / rows: exact for one-hot label
  rows, the only labels Program's losses build (a row's picked probability, not y * log p, so an
  underflowed probability elsewhere in the row gives no 0 * -inf).
- CROSS_ENTROPY_LOSS_BACK(d, z, y) = (softmax(z) - y) * (d / rows).
- SOFT_MAX_BACK(dy, y; scale) = scale * y * (dy - sum_rows(dy * y)) (max_bias 0 only).
- RMS_NORM_BACK(dz, x; eps) = (dz - x * (sum_rows(x dz) / n) / (ms + eps)) / sqrt(ms + eps),
  ms = sum_rows(x^2) / n.
- REPEAT_BACK(a -> shape) = for each repeated axis, the axis split into (kept, repeats), the
  repeats moved to the rows and summed with SUM_ROWS.
- GET_ROWS_BACK(g, ids -> (V, D)) where the ids are a loss's flat target indices (named
  "<targets>.flat": one per row, r V + its class, so no two alike) = SET_ROWS(zeros, g, ids);
  else MUL_MAT(cont(g^T), cont(onehot(ids)^T)), the one-hot rows GET_ROWS of an identity
  constant (V <= MAX_ONEHOT_VOCAB).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._ffi import GGML_TYPE_F32, ffi, lib

Declares = Callable[[object], bool]     # ggml_tensor * -> does the backend declare this node?
MAX_ONEHOT_VOCAB = 8192                 # GET_ROWS_BACK's identity constant: V^2 floats at most 256 MB
_NO_COMPUTE = ("NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")


class Unlowerable(Exception):
    """A rewrite that does not apply to this node (shape, type, parameters)."""


def op_name(t) -> str:
    return ffi.string(lib.ggml_op_desc(t)).decode()


def shape(t) -> list[int]:
    ne = ffi.new("int64_t[4]")
    lib.th_tensor_shape(t, ne, ffi.new("size_t[4]"))
    return [int(x) for x in ne]


def src(t, i: int):
    return lib.th_tensor_src(t, i)


def f32_params(t) -> list[float]:
    raw = ffi.new("int32_t[16]")
    lib.th_lowering_op_params(t, raw)
    return list(np.frombuffer(ffi.buffer(raw), dtype=np.float32))


class Lowering:
    """Lowers the graphs of one program (its compute context, its constants)."""

    def __init__(self, prog, declares: Declares):
        self.prog, self.declares = prog, declares
        self.ctx = prog._ctx_compute
        self.lowered: list[str] = []     # "OP -> how (node name)", in graph order

    def needed(self, graph) -> int:
        """How many nodes of `graph` the backend does not declare and a rewrite exists for."""
        return sum(1 for node in _nodes(graph) if rules_for(op_name(node)) and not self.declares(node))

    def lower(self, graph) -> int:
        """Rewrite every undeclared node of `graph` that a declared rewrite exists for; the count."""
        done = 0
        for node in _nodes(graph):
            op = op_name(node)
            if not rules_for(op) or self.declares(node):
                continue
            for rule in rules_for(op):
                try:
                    repl = rule(self, node)
                except Unlowerable:
                    continue
                if not self._all_declared(graph, repl):
                    continue
                status = lib.th_lowering_splice(graph, node, repl)
                if status == -4:
                    raise RuntimeError(f"lowering {op}: no room left in the graph")
                if status != 0:
                    raise RuntimeError(f"lowering {op} ({rule.__name__}): th_lowering_splice returned {status}")
                name = ffi.string(lib.ggml_get_name(node)).decode()
                self.lowered.append(f"{op} -> {rule.__name__} ({name!r})")
                done += 1
                break
        return done

    def _all_declared(self, graph, repl) -> bool:
        out = ffi.new("ggml_tensor *[]", 256)
        n = lib.th_lowering_new_tensors(graph, repl, out, 256)
        if n < 0:
            return False
        return all(op_name(out[i]) in _NO_COMPUTE or self.declares(out[i]) for i in range(n))

    # --- building blocks ----------------------------------------------------------------
    def cont(self, t):
        return lib.ggml_cont(self.ctx, t)

    def cont_t(self, t):
        """A contiguous copy of t with its first two axes swapped."""
        return lib.ggml_cont(self.ctx, lib.ggml_transpose(self.ctx, t))

    def constant(self, name: str, make):
        t = self.prog.cached_constant(name, make)
        self.prog.allocate()
        return t.ptr


def _nodes(graph) -> list:
    return [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]


def _f32(*ts) -> None:
    if any(lib.th_tensor_type(t) != GGML_TYPE_F32 for t in ts):
        raise Unlowerable("f32 only")


# --- the rewrites, in order of preference per op ---------------------------------------------
def out_prod_of_contiguous(lo: Lowering, node):
    a, b = src(node, 0), src(node, 1)
    _f32(a, b)
    if lib.ggml_is_contiguous(a) and lib.ggml_is_contiguous(b):
        raise Unlowerable("already contiguous")
    return lib.ggml_out_prod(lo.ctx, lo.cont(a), lo.cont(b))


_BINARY = {"ADD": lib.ggml_add, "SUB": lib.ggml_sub, "MUL": lib.ggml_mul, "DIV": lib.ggml_div}


def binary_of_contiguous(lo: Lowering, node):
    a, b = src(node, 0), src(node, 1)
    _f32(a, b)
    strided = [not lib.ggml_is_contiguous(t) for t in (a, b)]
    if not any(strided):
        raise Unlowerable("already contiguous")
    a, b = (lo.cont(t) if s else t for t, s in zip((a, b), strided))
    return _BINARY[op_name(node)](lo.ctx, a, b)


def out_prod_as_mul_mat(lo: Lowering, node):
    a, b = src(node, 0), src(node, 1)
    _f32(a, b)
    return lib.ggml_mul_mat(lo.ctx, lo.cont_t(a), lo.cont_t(b))


def cross_entropy_picked(lo: Lowering, node):
    z, y = src(node, 0), src(node, 1)
    _f32(z, y)
    rows = int(np.prod(shape(z)[1:]))
    p = lib.ggml_soft_max(lo.ctx, lo.cont(z))
    picked = lib.ggml_sum_rows(lo.ctx, lib.ggml_mul(lo.ctx, p, lo.cont(y)))
    total = lib.ggml_sum(lo.ctx, lib.ggml_log(lo.ctx, picked))
    return lib.ggml_scale(lo.ctx, total, -1.0 / rows)


def cross_entropy_back_softmax(lo: Lowering, node):
    d, z, y = src(node, 0), src(node, 1), src(node, 2)
    _f32(d, z, y)
    rows = int(np.prod(shape(z)[1:]))
    diff = lib.ggml_sub(lo.ctx, lib.ggml_soft_max(lo.ctx, lo.cont(z)), lo.cont(y))
    return lib.ggml_mul(lo.ctx, diff, lib.ggml_scale(lo.ctx, d, 1.0 / rows))


def soft_max_back_elementwise(lo: Lowering, node):
    dy, y = src(node, 0), src(node, 1)
    _f32(dy, y)
    scale, max_bias = f32_params(node)[:2]
    if max_bias != 0.0:
        raise Unlowerable("ALiBi slopes")
    dy, y = lo.cont(dy), lo.cont(y)
    dot = lib.ggml_sum_rows(lo.ctx, lib.ggml_mul(lo.ctx, dy, y))
    dx = lib.ggml_mul(lo.ctx, lib.ggml_sub(lo.ctx, dy, dot), y)
    return dx if scale == 1.0 else lib.ggml_scale(lo.ctx, dx, float(scale))


def rms_norm_back_elementwise(lo: Lowering, node):
    dz, x = src(node, 0), src(node, 1)
    _f32(dz, x)
    eps = f32_params(node)[0]
    n = shape(x)[0]
    dz, x = lo.cont(dz), lo.cont(x)
    ms = lib.ggml_scale(lo.ctx, lib.ggml_sum_rows(lo.ctx, lib.ggml_sqr(lo.ctx, x)), 1.0 / n)
    ms_eps = lib.ggml_scale_bias(lo.ctx, ms, 1.0, float(eps))
    dot = lib.ggml_scale(lo.ctx, lib.ggml_sum_rows(lo.ctx, lib.ggml_mul(lo.ctx, x, dz)), 1.0 / n)
    coef = lib.ggml_div(lo.ctx, dot, ms_eps)
    return lib.ggml_div(lo.ctx, lib.ggml_sub(lo.ctx, dz, lib.ggml_mul(lo.ctx, x, coef)),
                        lib.ggml_sqrt(lo.ctx, ms_eps))


def repeat_back_by_sum_rows(lo: Lowering, node):
    a = src(node, 0)
    _f32(a)
    have, want = shape(a), shape(node)
    if any(h % w for h, w in zip(have, want)) or have == want:
        raise Unlowerable("not a repeat")
    x, ne = lo.cont(a), list(have)
    for d in range(4):
        k = ne[d] // want[d]
        if k == 1:
            continue
        outer = int(np.prod(ne[:d])) if d else 1
        inner = int(np.prod(ne[d + 1:])) if d < 3 else 1
        # axis d as (kept, repeats): ggml_repeat tiles whole copies, so the repeats vary slowest
        x4 = lib.ggml_reshape_4d(lo.ctx, x, outer, want[d], k, inner)
        rows = lib.ggml_cont(lo.ctx, lib.ggml_permute(lo.ctx, x4, 2, 1, 0, 3))   # (k, kept, outer, inner)
        summed = lib.ggml_sum_rows(lo.ctx, rows)                                  # (1, kept, outer, inner)
        ne[d] = want[d]
        x = lib.ggml_cont_4d(lo.ctx, lib.ggml_permute(lo.ctx, summed, 2, 1, 0, 3), *ne)
    return x


def get_rows_back_distinct(lo: Lowering, node):
    """Only where no id repeats (ggml's GET_ROWS_BACK sums a repeated id's rows; SET_ROWS would keep
    one): Program's flat target indices, distinct by construction (engine/losses.py)."""
    g, ids = src(node, 0), src(node, 1)
    _f32(g)
    if not ffi.string(lib.ggml_get_name(ids)).decode().endswith(".flat"):
        raise Unlowerable("ids that may repeat")
    ne0, ne1 = shape(node)[:2]
    zeros = lo.constant(f"lowering.zeros.{ne0}x{ne1}", lambda: np.zeros((ne1, ne0), np.float32))
    # SET_ROWS is a view of what it writes into; the node takes a contiguous copy's place
    return lo.cont(lib.ggml_set_rows(lo.ctx, lib.ggml_fill(lo.ctx, zeros, 0.0), g, ids))


def get_rows_back_onehot(lo: Lowering, node):
    g, ids = src(node, 0), src(node, 1)    # the table's shape is the node's own
    _f32(g)
    vocab = shape(node)[1]
    if vocab > MAX_ONEHOT_VOCAB:
        raise Unlowerable(f"vocabulary {vocab} > {MAX_ONEHOT_VOCAB}")
    eye = lo.constant(f"lowering.eye.{vocab}", lambda: np.eye(vocab, dtype=np.float32))
    onehot = lib.ggml_get_rows(lo.ctx, eye, ids)               # (V, N): row n is e_{ids[n]}
    return lib.ggml_mul_mat(lo.ctx, lo.cont_t(g), lo.cont_t(onehot))


RULES: dict[str, tuple] = {
    "OUT_PROD": (out_prod_of_contiguous, out_prod_as_mul_mat),
    "CROSS_ENTROPY_LOSS": (cross_entropy_picked,),
    "CROSS_ENTROPY_LOSS_BACK": (cross_entropy_back_softmax,),
    "SOFT_MAX_BACK": (soft_max_back_elementwise,),
    "RMS_NORM_BACK": (rms_norm_back_elementwise,),
    "REPEAT_BACK": (repeat_back_by_sum_rows,),
    "GET_ROWS_BACK": (get_rows_back_distinct, get_rows_back_onehot),
}

def add1_as_add(lo: Lowering, node):
    a, b = src(node, 0), src(node, 1)
    _f32(a, b)
    return lib.ggml_add(lo.ctx, a if lib.ggml_is_contiguous(a) else lo.cont(a), b)


# Rewrites for nodes only the Tensor API's graphs hold (tests/test_ops_modes.py checks them): a
# strided operand of a binary op made contiguous, and ADD1 (SUM's backward into a gradient already
# begun) as an ADD of its one-element operand, broadcast.
API_RULES: dict[str, tuple] = {**{op: (binary_of_contiguous,) for op in _BINARY}, "ADD1": (add1_as_add,)}


def rules_for(op: str) -> tuple:
    return RULES.get(op, ()) + API_RULES.get(op, ())


def backend_declares(engine) -> Declares:
    return lambda node: bool(lib.ggml_backend_supports_op(engine.handle, node))


def declares_for(engine, target: str) -> Declares:
    """The backend's declarations, and with target "metal" also the pinned ggml-metal's."""
    own = backend_declares(engine)
    if target != "metal":
        return own
    from .metal_ops import metal_supports_op

    return lambda node: own(node) and metal_supports_op(node)
