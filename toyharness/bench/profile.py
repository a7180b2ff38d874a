"""`toyharness bench --profile`: one training step of ours timed node by node, per op, per kernel
and per phase (no PyTorch, nothing written)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from .config import realize_for_bench


@dataclass
class OpTime:
    op: str            # the ggml op as the graph was built ("[heads]": a product per attention head)
    kernel: str        # "ggml", the native/cpu_kernels.c kernel's name (th_kernel_name), or "fused away"
    nodes: int
    ms: float


@dataclass
class NodeTime:
    index: int         # the node's place in the training graph
    op: str
    shape: tuple[int, ...]   # the node's ne (ggml order, trailing 1s dropped)
    ms: float


@dataclass
class Profile:
    total_ms: float    # the sum of the node medians
    ops: list[OpTime]  # largest first
    slowest: list[NodeTime]
    floor_us: float | None   # median time of a node that computes nothing (a view): the per-node
                             # cost of launching and waiting, already inside each node's time
    step_ms: float     # a whole step's median (3 steps before the nodes are timed)
    phases: dict[str, float]   # ms per phase: forward, backward, adamw


# Ops that no backend computes (views of another node's memory): their time is the floor.
_NO_COMPUTE = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}


def _shape(node) -> tuple[int, ...]:
    from .._ffi import ffi, lib

    ne, nb = ffi.new("int64_t[4]"), ffi.new("size_t[4]")
    lib.th_tensor_shape(node, ne, nb)
    dims = list(ne)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(int(d) for d in dims)


def _key(node) -> int:
    from .._ffi import ffi

    return int(ffi.cast("uintptr_t", node))


def _op_label(node, op: str) -> str:
    """The op, with "[heads]" on a product batched over heads (attention's scores and its product
    with V, and their gradients) to set it apart from a weight's product or gradient."""
    from .._ffi import ffi, lib

    if op == "MUL_MAT":
        weight_side = lib.th_tensor_src(node, 0)
        if weight_side == ffi.NULL:      # a product the cuda rewrite fused away (attention's scores)
            return op + "[heads]"
    elif op == "OUT_PROD":
        weight_side = node
    else:
        return op
    return op + "[heads]" if len(_shape(weight_side)) > 2 else op


def profile_recipe(recipe: str, backend: str = "cpu", threads: int = 2, sets: list[str] | None = None,
                   repeats: int = 5, n_slowest: int = 10) -> Profile:
    """Time one training step node by node (`toyharness bench --profile`): the step's graph
    computed one node at a time, `repeats` times, after 6 whole steps (the last 3 timed), each node waited
    for before the next starts. The sum of the node medians is above a whole step's time by one
    hand-off per node (cpu: the threads'; cuda: a launch and a wait, with no CUDA graph:
    profiling turns them off, as a graph per one-node view would only add its capture). The
    profile splits the time per op, and per phase: the forward graph's nodes, AdamW's, and the
    rest (the backward)."""
    if backend == "cuda":
        os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"   # read once, at the first cuda compute
    from .._ffi import ffi, lib
    from ..errors import InputError
    from ..runner import batch_for

    pm, opts, data, engine, model = realize_for_bench(recipe, backend, threads, sets)
    trainer = getattr(model, "trainer", None)
    if trainer is None:
        raise InputError(f"recipe {recipe}: no ggml training graph to profile")
    graph = trainer.gb_opt
    n = lib.ggml_graph_n_nodes(graph)
    # each node's op as built, by node (a rewrite may move nodes: cuda's attention copies)
    built = {_key(lib.ggml_graph_node(graph, i)): ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
             for i in range(n)}
    step_ms = []
    for step in range(6):             # the first compute also swaps in our cpu kernels
        t0 = time.perf_counter()
        pm.hook.step(model=model, batch=batch_for(data, "train", step, opts), hp=pm.hook.hp(options=opts, step=step))
        step_ms.append((time.perf_counter() - t0) * 1e3)
    runs = np.empty((repeats, n))
    us = ffi.new("double[]", n)
    for r in range(repeats):
        trainer.reset_grads()
        status = lib.th_graph_profile(engine.handle, graph, us)
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed with status {status}")
        runs[r] = np.frombuffer(ffi.buffer(us, n * 8), dtype=np.float64)
    per_node = np.median(runs, axis=0) / 1e3
    table: dict[tuple[str, str], OpTime] = {}
    n_forward = lib.ggml_graph_n_nodes(trainer.gf)     # gb_opt begins with the forward graph's nodes
    phases = {"forward": 0.0, "backward": 0.0, "adamw": 0.0}
    nodes: list[NodeTime] = []
    idle = []
    for i in range(n):
        node = lib.ggml_graph_node(graph, i)
        op = built[_key(node)]
        phase = "forward" if i < n_forward else "adamw" if op == "OPT_STEP_ADAMW" else "backward"
        phases[phase] += float(per_node[i])
        now = ffi.string(lib.ggml_op_desc(node)).decode()
        name = lib.th_kernel_name(node)
        if name == ffi.NULL:
            name = lib.th_portable_kernel_name(node)
        if name == ffi.NULL and trainer.prog.cuda_kernels:
            name = lib.th_cuda_kernel_name(node)
        kernel = ffi.string(name).decode() if name != ffi.NULL else "ggml"
        if now == "NONE" and op != "NONE":      # folded into another node's kernel
            kernel = "fused away"
        if now in _NO_COMPUTE:
            idle.append(per_node[i])
        label = _op_label(node, op)
        row = table.setdefault((label, kernel), OpTime(label, kernel, 0, 0.0))
        row.nodes += 1
        row.ms += float(per_node[i])
        nodes.append(NodeTime(i, label, _shape(node), float(per_node[i])))
    slowest = sorted(nodes, key=lambda t: -t.ms)[:n_slowest]
    floor = float(np.median(idle)) * 1e3 if idle else None
    return Profile(float(per_node.sum()), sorted(table.values(), key=lambda o: -o.ms), slowest, floor,
                   statistics.median(step_ms[3:]), phases)


