"""A program on an engine: persistent tensors, graphs built from them, and the training step.

Life cycle (docs/design.md, "The training graph")::

    prog = engine.program()
    w = prog.param("w", init=array)             # trainable f32 (persistent)
    x = prog.input("x", (B, T, D))              # fed each step (persistent)
    ...ops on Tensors...                         # graph nodes (compute context)
    ce = prog.cross_entropy(logits, "targets")  # mean CE for training + a thread-invariant report
    trainer = prog.trainer(ce, "bias_corrected")
    loss = trainer.step({"x": ..., "targets": ...}, row.hp_for_step(i))

Persistent tensors live in backend buffers allocated on demand; graph intermediates are
placed by ggml's graph allocator before every compute, so several graphs (train, eval,
sampling) can share nodes safely.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .._ffi import (
    GGML_STATUS_SUCCESS,
    GGML_TYPE_BF16,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_I32,
    cuda_kernels_built,
    ffi,
    lib,
    pass_switches,
)
from ..adamw import AdamWRow, HPRow, check_convention
from ..errors import BackendError, InputError, ShapeError
from .allocation import allocation_failed, ggml_quiet, graph_buffer_bytes
from .backend import Engine
from .lowering import Lowering, declares_for
from .tensor import Tensor

GGML_FLAG_PARAM = 4
GGML_FLAG_LOSS = 8

# The most tensors ggml_build_backward_expand makes for one forward node (ggml_compute_backward,
# ggml 0.25.3): MUL_MAT's out_prod, view, repeat_back and add for its first operand and transpose,
# out_prod and add for its second (SET also makes 7, every other op fewer). It bounds the scratch
# graph in which a backward is built once to count its nodes (Program._backward_size); a graph
# that overflows aborts the process, so tests/test_graph_size.py holds deep models to it.
BACKWARD_TENSORS_PER_NODE = 7

NP_TO_GGML = {np.dtype(np.float32): GGML_TYPE_F32, np.dtype(np.float16): GGML_TYPE_F16,
              np.dtype(np.int32): GGML_TYPE_I32}
# native/custom_ops.h's TH_PRECISION_*
PRECISION_CODES = {"fp32": 0, "tf32": 1, "bf16": 2}
DTYPE_NAMES = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16, "bf16": GGML_TYPE_BF16, "i32": GGML_TYPE_I32}


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, as uint16 bits."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class _Input:
    tensor: Tensor
    upper: int | None  # exclusive bound for ids (vocab size), checked before upload
    # fixed at creation, kept here: a step's feed then makes one native call (th_feed_*)
    shape: tuple[int, ...] = ()
    ids: bool = False
    scratch: np.ndarray | None = None   # ids as i32 on their way to ggml


@dataclass
class _Targets:
    """Class ids fed by name, turned into what the loss graph reads."""

    shape: tuple[int, ...]
    vocab: int
    onehot: Tensor
    flat_index: Tensor
    # The one-hot rows are kept between steps and updated where the ids changed (a full
    # rebuild of rows x vocab floats was most of a step's host time): `mirror` is the tensor's
    # own memory on a host backend, else a host copy that is uploaded; `last` the last ids
    # (valid once `fed`), `scratch` the flat indices on their way to ggml (th_feed_targets).
    mirror: np.ndarray | None = None
    last: np.ndarray | None = None
    scratch: np.ndarray | None = None
    fed: bool = False
    # On a device (Program.onehot_in_graph) the graph itself zeroes the one-hot rows and sets
    # the ones at the flat indices: only those cross the bus, not rows x vocab floats.
    in_graph: bool = False


@dataclass
class CrossEntropy:
    """`train` drives the backward (ggml's op); `report` is the same loss, thread-invariant (on the
    cpu fast path the same tensor: our kernel's train loss is invariant already)."""

    train: Tensor
    report: Tensor
    targets: str


# The bf16 copies' horizon (Program.bf16_horizon): with recompute_blocks a block's recomputed
# forward and its backward are within 200 nodes of each other in a llama block's training graph
# (LoRA over a Q4_K base: a frozen weight's copy is used at most 172 nodes apart there, by the
# recomputed product and the input gradient), while the forward that made a copy is the blocks
# after it away (about 195 nodes a block). Without recompute a frozen base's copies made by the
# forward would live until their block's backward (the LoRA bench's 1B base: 2 GiB of bf16 values
# through the pass) where converting them again costs about 3% of the step.
BF16_KEEP_NODES = 256

# th_cuda_rewrite's flag for attention: fused (native/cuda/th-attention.cu), grouped-query heads'
# kv heads read in place
FUSED_ATTENTION = 3


_KEPT_DEVICE_MEMORY: list = []   # see Program.close


class Program:
    # Declarations the graphs are lowered for besides the backend's own (engine/lowering.py): "" or
    # "metal", the pinned ggml-metal's; tests/test_metal_lowering.py sets it on a machine without
    # metal, where the graphs are then built as on a device (no cpu stand-ins or custom nodes) and
    # hold only ops metal declares.
    lowering_target = ""

    def __init__(self, engine: Engine, capacity: int = 1 << 16):
        self.engine = engine
        # The largest graph (nodes) this program builds; its compute context is reserved for
        # 2 x capacity tensors and 6 such graphs (address space: only the pages used count).
        # Each graph is sized to what it holds (_new_graph): ggml touches memory in proportion
        # to a graph's size, 4.7 MB for a training graph of 65536 nodes.
        self.capacity = capacity
        self._ctx_static = self._new_ctx(lib.ggml_tensor_overhead() * 8192)
        self._ctx_compute = self._new_ctx(lib.ggml_tensor_overhead() * capacity * 2
                                          + 6 * lib.ggml_graph_overhead_custom(capacity, True))
        self._graph_bytes = 0     # of _ctx_compute, taken by graphs (the rest holds tensors)
        self._n_ops = 0
        self._buffers: list = []          # backend buffers of persistent tensors
        self._pending: list[tuple[Tensor, np.ndarray]] = []  # uploads waiting for allocation
        self._unallocated = 0
        self.params: dict[str, Tensor] = {}     # trainable, in creation order
        self.frozen: dict[str, Tensor] = {}
        # whether a frozen weight stays in another type than f32 (a LoRA base: bf16_horizon)
        self.frozen_in_type = False
        self.inputs: dict[str, _Input] = {}
        self._targets: dict[str, _Targets] = {}
        self._keepalive: list = []              # mmaps and host arrays that back tensors
        # One graph allocator per graph computed (the training graph's reserved by its Trainer):
        # a graph keeps the placement it got first. Sharing one allocator made every return to the
        # training graph after an evaluation place it again, after the backend's rewrites, which
        # needed more memory (gpt2 default: 37.3 MB instead of 24.7 MB) and, from about 48 layers,
        # ran ggml's allocator out of free blocks (an abort). Each buffer is kept; an evaluation
        # graph, forward only, costs less than the training graph's re-placement did.
        self._galloc = lib.ggml_gallocr_new(engine.buffer_type)
        self._gallocs: dict[int, object] = {}
        self._last_graph = None
        self._gemm_rewritten: set = set()
        self._constants: dict[str, Tensor] = {}
        # Whether native/cpu_kernels.c stands in for ggml's kernels in this program's graphs
        # (cpu). Blocks may then build stand-in nodes that only
        # these kernels compute right (blocks.gelu_tanh); set before building any graph.
        # The portable golden mode (Engine.set_portable): every node to native/portable_kernels.c,
        # and blocks build no stand-ins (they compose GELU, LayerNorm's centring and biases from
        # plain ops, each of which has a portable kernel).
        self.portable = engine.is_cpu and engine.portable
        self.cpu_kernels = engine.is_cpu and not self.portable
        # With them, whether a Trainer folds products into the ADDs that read them (th_cpu_fold;
        # tests turn it off to see the nodes as built)
        self.cpu_folds = self.cpu_kernels
        # Whether our kernels inside ggml-cuda take GELU's and LayerNorm's stand-ins and the
        # nodes native/cuda_rewrite.c folds
        self.cuda_kernels = engine.backend == "cuda" and cuda_kernels_built()
        if self.cuda_kernels:
            pass_switches()
        # The lowering (engine/lowering.py): nodes the backend does not declare become ops it does.
        if self.lowering_target:
            if self.portable:
                raise BackendError("the metal lowering is not for the portable mode (its kernels are custom nodes)")
            self.cpu_kernels = self.cuda_kernels = False
        self.lowering = Lowering(self, declares_for(engine, self.lowering_target))
        # With the cpu kernels (not under a lowering), whether attention's products read each
        # shared kv head in place for its group of query heads (blocks.attention) instead of
        # ggml's REPEAT copying it per query head
        self.kv_in_place = self.cpu_kernels
        # Whether cross_entropy builds its one-hot targets in the graph (FILL, then SET_ROWS of
        # ones at the flat indices) instead of uploading them: on cuda a step's upload of
        # rows x vocab floats (200 MB for 1024 tokens of a 49152-token vocabulary) was 40% of
        # it. On cpu the one-hot rows are updated in place (th_feed_targets), same values.
        self.onehot_in_graph = engine.backend == "cuda"
        # Whether a bias's or a norm gain's gradient (a sum over every row) is a cuBLAS product
        # with a column of ones. ggml-cuda's REPEAT_BACK gives each column one thread that sums
        # every row: 5.4 ms per gain at nanoGPT's size on an H100, half of a step. Blocks then
        # broadcast over a matrix (blocks.add_bias, scale_columns) and the Trainer turns those
        # REPEAT_BACK nodes into OUT_PROD(grad, ones) (same sum, one gemv-shaped product).
        # Tests set it on the cpu to check the product form there.
        self.column_sums_as_products = engine.backend == "cuda"
        # the precision of this program's matrix products (Engine.set_precision): on cuda each
        # product node is stamped with it after the rewrite (native/cuda_precision.c)
        self.precision = engine.precision
        # At bf16 on cuda a frozen weight (a LoRA base: f16, bf16, quantized) stays in its type in
        # the graph and its products are ours (native/cuda/th-frozen.cu): its values enter them as
        # bf16, dequantized by ggml-cuda's converters, with no f32 copy of it (Tensor.matmul_t)
        self.frozen_bf16 = self.cuda_kernels and self.precision == "bf16"
        self.last_compute_s = 0.0
        # Set while a memory plan is made (toyharness/engine/memory_plan.py): persistent tensors and graph
        # buffers are then measured, never allocated, and parameter values are never copied.
        self.planner = engine.planner
        # Activation checkpointing by block (engine/recompute.py): set by enable_recompute.
        self.recompute = None
        # While set, blocks.attention builds cached attention through it (toyharness/sampling.py)
        self.kv_cache = None
        # Whether frozen_gguf holds a quantized weight as its f32 dequantization (sampling's
        # --dequantize: the same values, 4x the memory, products without a dequantization per call)
        self.dequantize_frozen = False

    # --- contexts and persistent tensors -------------------------------------------------
    def _new_ctx(self, mem: int):
        params = ffi.new("struct ggml_init_params *", {"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": True})
        ctx = lib.ggml_init(params[0])
        if ctx == ffi.NULL:
            raise MemoryError("ggml_init failed")
        return ctx

    def _reachable_bound(self) -> int:
        """At least the number of nodes and leafs any graph of this program can have: each is
        one tensor of its contexts (the compute context's memory less its graphs holds tensors
        of ggml_tensor_overhead() bytes each) or a frozen tensor mapped from a GGUF file."""
        overhead = lib.ggml_tensor_overhead()
        compute = (lib.ggml_used_mem(self._ctx_compute) - self._graph_bytes) // overhead
        return compute + lib.ggml_used_mem(self._ctx_static) // overhead + len(self.frozen)

    def _check_room(self, nbytes: int, what: str) -> None:
        """ggml aborts when a context runs out of memory: refuse first, naming the capacity."""
        if lib.ggml_used_mem(self._ctx_compute) + nbytes > lib.ggml_get_mem_size(self._ctx_compute):
            raise ShapeError(f"{what} does not fit in this program; create it with "
                             f"engine.program(capacity=...) larger than {self.capacity}")

    def _new_graph(self, size: int, grads: bool):
        """A graph for up to `size` nodes and `size` leafs in the compute context."""
        size = max(int(size), 1)
        if size > self.capacity:
            raise ShapeError(f"a graph of {size} nodes is too large for this program; create it with "
                             f"engine.program(capacity=...) larger than {self.capacity}")
        nbytes = lib.ggml_graph_overhead_custom(size, grads)
        self._check_room(nbytes, f"a graph of {size} nodes")
        graph = lib.ggml_new_graph_custom(self._ctx_compute, size, grads)
        self._graph_bytes += nbytes
        return graph

    def _forward_size(self, outputs: list[Tensor]) -> int:
        """The graph size a forward graph over `outputs` needs (its nodes or its leafs, the
        larger), counted by building it once in a scratch graph of _reachable_bound() nodes."""
        bound = self._reachable_bound()
        scratch = self._new_ctx(lib.ggml_graph_overhead_custom(bound, False))
        try:
            graph = lib.ggml_new_graph_custom(scratch, bound, False)
            for t in outputs:
                lib.ggml_build_forward_expand(graph, t.ptr)
            return max(lib.ggml_graph_n_nodes(graph), lib.th_graph_n_leafs(graph))
        finally:
            lib.ggml_free(scratch)

    def _backward_size(self, gf, grad_accs) -> tuple[int, int]:
        """(graph size, new tensors) of gf's backward: ggml_build_backward_expand run once on a
        copy of gf in a scratch context, freed at once. It only adds tensors of its own, so the
        same call on the program's graph then makes exactly as many nodes, leafs and tensors.
        The scratch graph is sized by BACKWARD_TENSORS_PER_NODE; the accumulators are leafs."""
        n_forward = lib.ggml_graph_n_nodes(gf)
        made_max = BACKWARD_TENSORS_PER_NODE * n_forward
        bound = lib.ggml_graph_size(gf) + n_forward + made_max
        graph_bytes = lib.ggml_graph_overhead_custom(bound, True)
        scratch = self._new_ctx(graph_bytes + lib.ggml_tensor_overhead() * made_max)
        try:
            graph = lib.ggml_new_graph_custom(scratch, bound, True)
            lib.ggml_graph_cpy(gf, graph)
            lib.ggml_build_backward_expand(scratch, graph, grad_accs)
            size = max(lib.ggml_graph_n_nodes(graph), lib.th_graph_n_leafs(graph))
            made = (lib.ggml_used_mem(scratch) - graph_bytes) // lib.ggml_tensor_overhead()
        finally:
            lib.ggml_free(scratch)
        return size, made

    def _count_op(self) -> None:
        self._n_ops += 1
        if self._n_ops > self.capacity // 4:
            raise ShapeError(f"graph too large for this program ({self._n_ops} ops); "
                             f"create it with engine.program(capacity=...) larger than {self.capacity}")

    def _new_static(self, name: str, shape: tuple[int, ...], gtype: int) -> Tensor:
        shape = tuple(int(s) for s in shape)
        if not 0 < len(shape) <= 4 or any(s <= 0 for s in shape):
            raise ShapeError(f"{name}: shape {shape} must have 1 to 4 positive dims")
        ne = list(reversed(shape))
        fn = (lib.ggml_new_tensor_1d, lib.ggml_new_tensor_2d, lib.ggml_new_tensor_3d,
              lib.ggml_new_tensor_4d)[len(ne) - 1]
        t = Tensor(self, fn(self._ctx_static, gtype, *ne), len(shape)).named(name)
        self._unallocated += 1
        return t

    def _check_new_name(self, name: str) -> None:
        if name in self.params or name in self.frozen or name in self.inputs or name in self._targets:
            raise InputError(f"tensor name {name!r} is used twice in this program")
        if len(name.encode()) > 63:
            raise InputError(f"tensor name {name!r} is longer than ggml's 63 bytes")

    def param(self, name: str, init: np.ndarray, trainable: bool = True) -> Tensor:
        """A persistent f32 parameter initialised from `init` (numpy, row-major)."""
        self._check_new_name(name)
        init = np.asarray(init)
        if init.dtype.kind != "f":
            raise InputError(f"{name}: parameters are float, got {init.dtype}")
        t = self._new_static(name, init.shape, GGML_TYPE_F32)
        if trainable:
            lib.ggml_set_param(t.ptr)
            self.params[name] = t
        else:
            self.frozen[name] = t
        if self.planner is None:    # a plan needs shapes only (its init values are placeholders)
            self._pending.append((t, np.ascontiguousarray(init, dtype=np.float32)))
        return t

    def frozen_array(self, name: str, array: np.ndarray, dtype: str = "f32") -> Tensor:
        """A frozen weight from numpy, stored as f32, f16 or bf16."""
        self._check_new_name(name)
        if dtype not in ("f32", "f16", "bf16"):
            raise InputError(f"{name}: frozen dtype {dtype!r}; allowed: f32, f16, bf16")
        array = np.asarray(array, dtype=np.float32)
        t = self._new_static(name, array.shape, DTYPE_NAMES[dtype])
        self.frozen[name] = t
        self.frozen_in_type |= dtype != "f32"
        if self.planner is None:
            data = {"f32": lambda a: a, "f16": lambda a: a.astype(np.float16), "bf16": f32_to_bf16_bits}[dtype](array)
            self._pending.append((t, np.ascontiguousarray(data)))
        return t

    def frozen_gguf(self, gguf, name: str, expect_shape: tuple[int, ...] | None = None,
                    as_name: str | None = None) -> Tensor:
        """A frozen weight straight from an open `GGUFFile`: mmap'd in place on cpu, else uploaded."""
        info = gguf.tensor(name, expect_shape=expect_shape)
        local = as_name or name
        if self.dequantize_frozen and info.dtype != "f32":
            return self.frozen_array(local, info.to_numpy())
        self._check_new_name(local)
        if self.engine.is_cpu:
            t = gguf.bind_in_place(self, info, local)
        else:
            t = self._new_static(local, info.shape, info.ggml_type)
            if self.planner is None:     # a plan reads no weights, it counts them
                self._pending.append((t, info.raw_bytes()))
        self.frozen[local] = t
        self.frozen_in_type |= lib.th_tensor_type(t.ptr) != GGML_TYPE_F32
        return t

    def input(self, name: str, shape: tuple[int, ...], dtype: str = "f32", upper: int | None = None) -> Tensor:
        """A persistent input fed by name each step. For i32 ids, `upper` bounds the values."""
        self._check_new_name(name)
        if dtype not in ("f32", "i32"):
            raise InputError(f"{name}: input dtype {dtype!r}; allowed: f32, i32")
        t = self._new_static(name, shape, DTYPE_NAMES[dtype])
        lib.ggml_set_input(t.ptr)
        ids = t.type == GGML_TYPE_I32
        self.inputs[name] = _Input(t, upper, t.shape, ids, np.empty(t.numel(), np.int32) if ids else None)
        return t

    def constant(self, name: str, array: np.ndarray) -> Tensor:
        """A persistent tensor with a fixed value (positions, masks)."""
        array = np.asarray(array)
        dtype = "i32" if array.dtype.kind in "iu" else "f32"
        t = self.input(name, array.shape, dtype)
        self._pending.append((t, np.ascontiguousarray(array, dtype=np.int32 if dtype == "i32" else np.float32)))
        return t

    def enable_recompute(self) -> None:
        """Recompute checkpointed blocks' activations in the backward (engine/recompute.py), for
        graphs built from now on. On cpu and cuda, whose rewrites (native/cpu_kernels.c,
        native/cuda_rewrite.c) recompute.apply runs on the graph as ggml built it and on the copies
        apart; other backends (and the metal lowering, which rewrites the graph before the copies
        are wired in) are refused."""
        from .recompute import Recompute

        if self.engine.backend not in ("cpu", "cuda") or self.lowering_target:
            raise InputError(f"option 'recompute_blocks': the cpu and cuda backends only, not {self.engine.backend}"
                             + (" lowered for " + self.lowering_target if self.lowering_target else ""))
        self.recompute = Recompute()

    def cached_constant(self, name: str, make) -> Tensor:
        """`constant(name, make())` made once per program; blocks share it by name."""
        t = self._constants.get(name)
        if t is None:
            t = self._constants[name] = self.constant(name, make())
        return t

    def allocate(self):
        """Give every persistent tensor created so far backend memory, then upload pending values.
        Returns the backend buffer that now holds the newly allocated tensors (None if none)."""
        if self.planner is not None:
            self.planner.place(self)
            self._pending.clear()
            self._unallocated = 0
            return None
        buf = None
        if self._unallocated:
            with ggml_quiet():
                buf = lib.ggml_backend_alloc_ctx_tensors(self._ctx_static, self.engine.handle)
            if buf == ffi.NULL:
                size = lib.ggml_backend_alloc_ctx_tensors_from_buft_size(self._ctx_static, self.engine.buffer_type)
                raise allocation_failed(self.engine, "persistent tensors (parameters, moments, inputs)", size)
            self._buffers.append(buf)
            self._unallocated = 0
        for t, data in self._pending:
            _upload(t, data)
        self._pending.clear()
        return buf

    # --- host <-> backend ----------------------------------------------------------------
    def _no_plan(self, what: str) -> None:
        # a planned tensor's address is reserved, never backed: any access would fault
        if self.planner is not None:
            raise RuntimeError(f"a program made for a memory plan holds no values ({what})")

    def write(self, t: Tensor, array: np.ndarray) -> None:
        """Set a persistent tensor from numpy (shape checked; converted to its dtype)."""
        self._no_plan("write")
        self.allocate()
        array = np.asarray(array)
        if tuple(array.shape) != t.shape:
            raise ShapeError(f"{t.name}: expected shape {t.shape}, got {tuple(array.shape)}")
        conv = {GGML_TYPE_F32: lambda a: a.astype(np.float32), GGML_TYPE_I32: lambda a: a.astype(np.int32),
                GGML_TYPE_F16: lambda a: a.astype(np.float16), GGML_TYPE_BF16: f32_to_bf16_bits}
        if t.type not in conv:
            raise InputError(f"{t.name}: cannot write a {t.dtype} tensor from numpy")
        _upload(t, np.ascontiguousarray(conv[t.type](array)))

    def read(self, t: Tensor) -> np.ndarray:
        """A copy of a tensor's values as numpy (f16/bf16 widened to f32)."""
        self._no_plan("read")
        self.allocate()
        if lib.th_tensor_data(t.ptr) == ffi.NULL:
            raise InputError(f"{t.name}: has no data (an intermediate not computed yet?)")
        np_dtype = {GGML_TYPE_F32: np.float32, GGML_TYPE_I32: np.int32, GGML_TYPE_F16: np.float16,
                    GGML_TYPE_BF16: np.uint16}.get(t.type)
        if np_dtype is None:
            raise InputError(f"{t.name}: reading {t.dtype} tensors is not supported")
        if not t.is_contiguous():
            raise InputError(f"{t.name}: not contiguous; read a cont() of it")
        out = np.empty(t.shape, dtype=np_dtype)
        lib.ggml_backend_tensor_get(t.ptr, ffi.from_buffer(out), 0, out.nbytes)
        if t.type == GGML_TYPE_BF16:
            return bf16_bits_to_f32(out)
        return out.astype(np.float32) if t.type == GGML_TYPE_F16 else out

    def feed(self, feeds: dict[str, np.ndarray]) -> None:
        """Validate and upload step inputs by name. Nothing reaches ggml unchecked."""
        self._no_plan("feed")
        self.allocate()
        for name, value in feeds.items():
            if name in self._targets:
                self._feed_targets(name, self._targets[name], value)
            elif name in self.inputs:
                self._feed_input(name, self.inputs[name], value)
            else:
                known = sorted([*self.inputs, *self._targets])
                raise InputError(f"unknown input {name!r}; this program takes: {', '.join(known)}")

    def _feed_input(self, name: str, inp: _Input, value) -> None:
        value = np.asarray(value)
        if value.shape != inp.shape:
            raise ShapeError(f"input {name!r}: expected shape {inp.shape}, got {value.shape}")
        if inp.ids:
            ids = _as_ids(f"input {name!r}", value, "integer ids")
            bad = lib.th_feed_ids(inp.tensor.ptr, ffi.from_buffer("int64_t[]", ids), ids.size,
                                  inp.upper or 0, ffi.from_buffer("int32_t[]", inp.scratch))
            if bad >= 0:
                raise _id_error(name, ids.flat[bad], inp.upper)
            return
        if value.dtype == np.float32:
            x = np.ascontiguousarray(value)
        else:
            with np.errstate(over="ignore"):    # a value past float32's range: our error below, not a warning
                x = np.ascontiguousarray(value, dtype=np.float32)
        if lib.th_feed_f32(inp.tensor.ptr, ffi.from_buffer("float[]", x), x.size) >= 0:
            raise InputError(f"input {name!r}: contains NaN or inf")

    def _feed_targets(self, name: str, tg: _Targets, value) -> None:
        value = np.asarray(value)
        if tuple(value.shape) != tg.shape:
            raise ShapeError(f"targets {name!r}: expected shape {tg.shape}, got {tuple(value.shape)}")
        ids = _as_ids(f"targets {name!r}", value, "integer class ids").reshape(-1)
        rows = ids.size
        if tg.in_graph:
            bad = np.flatnonzero((ids < 0) | (ids >= tg.vocab))
            if bad.size:
                raise _id_error(name, ids[bad[0]], tg.vocab)
            flat = np.ascontiguousarray(np.arange(rows, dtype=np.int64) * tg.vocab + ids, dtype=np.int32)
            _upload(tg.flat_index, flat)
            tg.fed = True
            return
        if tg.mirror is None:
            if lib.th_tensor_is_host(tg.onehot.ptr):
                buf = ffi.buffer(ffi.cast("float *", lib.th_tensor_data(tg.onehot.ptr)), rows * tg.vocab * 4)
                tg.mirror = np.frombuffer(buf, dtype=np.float32).reshape(rows, tg.vocab)
            else:
                tg.mirror = np.empty((rows, tg.vocab), dtype=np.float32)
            tg.mirror[:] = 0.0
            tg.last, tg.scratch = np.zeros(rows, np.int64), np.empty(rows, np.int32)
        bad = lib.th_feed_targets(tg.onehot.ptr, ffi.from_buffer("float[]", tg.mirror, require_writable=True),
                                  tg.flat_index.ptr, ffi.from_buffer("int64_t[]", ids),
                                  ffi.from_buffer("int64_t[]", tg.last, require_writable=True), int(tg.fed), rows,
                                  tg.vocab, ffi.from_buffer("int32_t[]", tg.scratch, require_writable=True))
        if bad >= 0:
            raise _id_error(name, ids[bad], tg.vocab)
        tg.fed = True

    # --- loss ------------------------------------------------------------------------------
    def _new_targets(self, logits: Tensor, targets: str, op: str) -> tuple[_Targets, Tensor]:
        """The one-hot rows and flat indices that class ids fed as `targets` become, and the
        one-hot tensor the loss reads (on a device, made in the graph from the indices)."""
        self._check_new_name(targets)
        if logits.type != GGML_TYPE_F32:
            raise ShapeError(f"{op}: logits must be f32, got {logits!r}")
        vocab = logits.shape[-1]
        rows = math.prod(logits.shape[:-1])
        if rows * vocab >= 2 ** 31:    # the flat index into the rows' logits is an i32
            raise ShapeError(f"{op}: {rows} rows x {vocab} classes is too many for i32 indices")
        onehot = self._new_static(f"{targets}.onehot", (rows, vocab), GGML_TYPE_F32)
        flat = self._new_static(f"{targets}.flat", (rows,), GGML_TYPE_I32)
        lib.ggml_set_input(onehot.ptr)
        lib.ggml_set_input(flat.ptr)
        tg = self._targets[targets] = _Targets(tuple(logits.shape[:-1]), vocab, onehot, flat,
                                               in_graph=self.onehot_in_graph)
        if self.onehot_in_graph:     # zeroed, then a one at each row's target, in place
            ctx, ones = self._ctx_compute, self.cached_constant(f"ones.{rows}", lambda: np.ones((rows, 1), np.float32))
            cells = onehot._new(lib.ggml_fill_inplace(ctx, onehot.ptr, 0.0)).reshape(rows * vocab, 1)
            onehot = cells._new(lib.ggml_set_rows(ctx, cells.ptr, ones.ptr, flat.ptr)).reshape(rows, vocab)
        return tg, onehot

    def cross_entropy(self, logits: Tensor, targets: str) -> CrossEntropy:
        """Mean cross-entropy of `logits` (..., V) against integer targets fed as `targets`.

        `train` is ggml's cross_entropy_loss (its CPU kernel adds per-thread partial sums, so
        its scalar moves in the last bits with the thread count). `report` is the same mean,
        computed per row (softmax, pick the target, log) and summed by one thread in a fixed
        order: the loss we report, thread-count invariant. On the cpu fast path `train` is
        our kernel's (native/cpu_kernels.c, th_cross_entropy_op: the rows summed in 8 blocks
        fixed by the shape, the blocks added in order; invariant already), and it is the report
        too: no second softmax over the logits each step.
        """
        tg, onehot = self._new_targets(logits, targets, "cross_entropy")
        rows, vocab, flat = math.prod(tg.shape), tg.vocab, tg.flat_index
        logits2 = logits.reshape(rows, vocab)
        train = logits2._new(lib.ggml_cross_entropy_loss(self._ctx_compute, logits2.ptr, onehot.ptr), 0)
        lib.ggml_set_loss(train.ptr)
        if self.cpu_kernels:
            lib.ggml_set_output(train.ptr)
            named = train.named(f"{targets}.loss")
            return CrossEntropy(named, named, targets)
        picked = logits2.softmax().reshape(rows * vocab, 1).get_rows(flat)
        report = picked.log().sum().scale(-1.0 / rows)
        lib.ggml_set_output(report.ptr)
        return CrossEntropy(train.named(f"{targets}.loss"), report.named(f"{targets}.loss_report"), targets)

    def masked_cross_entropy(self, logits: Tensor, targets: str, mask: str) -> CrossEntropy:
        """Mean cross-entropy over the positions where the f32 input `mask` (fed by name, shaped
        as the logits without their last axis) is 1; positions where it is 0 (a prompt, padding)
        neither count nor get a gradient.

        `train` is ggml's cross_entropy_loss of the logits multiplied by the mask (an uncounted
        row becomes all zeros: a constant loss, a zero gradient), rescaled from a mean over all rows
        to a mean over the counted ones. `report`, as in `cross_entropy`, picks each row's target
        probability, takes log(p * m + (1 - m)) (0 where uncounted, so an underflowed p at padding
        gives no NaN), and sums in one thread in a fixed order: thread-count invariant.
        A batch must count at least one position (the data drops examples that count none)."""
        tg, onehot = self._new_targets(logits, targets, "masked_cross_entropy")
        rows = math.prod(tg.shape)
        m = self.input(mask, tg.shape, "f32").reshape(rows, 1)
        counted = m.sum()
        logits2 = logits.reshape(rows, tg.vocab)
        train = logits2._new(lib.ggml_cross_entropy_loss(self._ctx_compute, (logits2 * m).ptr, onehot.ptr), 0)
        all_rows = self.constant(f"{mask}.rows", np.full(1, rows, np.float32))
        train = train * (all_rows / counted)
        lib.ggml_set_loss(train.ptr)
        picked = logits2.softmax().reshape(rows * tg.vocab, 1).get_rows(tg.flat_index)
        report = -((picked * m + m.scale_bias(-1.0, 1.0)).log().sum() / counted)
        lib.ggml_set_output(report.ptr)
        return CrossEntropy(train.named(f"{targets}.masked_loss"), report.named(f"{targets}.masked_loss_report"),
                            targets)

    def chunked_cross_entropy(self, logits: Tensor, targets: str, mask: str | None = None) -> CrossEntropy:
        """Mean cross-entropy (over the rows `mask` counts, when given) of `logits` = h @ W.T, a
        product of hidden rows and a frozen output weight, without its (rows x vocab) buffers:
        native/chunked_loss.c computes each row's logsumexp and dL/dh a vocabulary tile at a
        time, so the largest loss buffer is (d x rows x 16) instead of four (rows x vocab) ones.
        The graph trains on sum(h * dL/dh), whose gradient in h is dL/dh; `report` is the mean
        of the rows' losses, summed by one thread. Targets are fed as i32 ids (the fast cpu path
        only: the kernels are custom nodes)."""
        if not self.cpu_kernels:
            raise BackendError("the chunked loss runs on the cpu backend's fast path only (native/chunked_loss.c); "
                               "not on this backend or in the portable mode")
        if logits.type != GGML_TYPE_F32:
            raise ShapeError(f"chunked_cross_entropy: logits must be f32, got {logits!r}")
        shape, vocab = tuple(logits.shape[:-1]), logits.shape[-1]
        rows = math.prod(shape)
        ids = self.input(targets, shape, "i32", upper=vocab)
        if mask is not None:
            m = self.input(mask, shape, "f32")
            counted = m.sum()
        else:
            m, counted = None, self.constant(f"{targets}.rows", np.full(1, rows, np.float32))
        out, why = ffi.new("ggml_tensor *[3]"), ffi.new("char[256]")
        if lib.th_chunked_cross_entropy(self._ctx_compute, logits.ptr, ids.ptr, m.ptr if m is not None else ffi.NULL,
                                        counted.ptr, out, out + 1, out + 2, why, 256) < 0:
            raise ShapeError(f"chunked_cross_entropy: {ffi.string(why).decode()}")
        hidden, grad, row_loss = Tensor(self, out[0], 2), Tensor(self, out[1], 2), Tensor(self, out[2], 1)
        train = (hidden * grad).sum()
        lib.ggml_set_loss(train.ptr)
        report = row_loss.sum() / counted if mask is not None else row_loss.sum().scale(1.0 / rows)
        lib.ggml_set_output(report.ptr)
        return CrossEntropy(train.named(f"{targets}.chunked_loss"), report.named(f"{targets}.chunked_loss_report"),
                            targets)

    def scalar_loss(self, value: Tensor, name: str = "loss") -> CrossEntropy:
        """Train on any scalar (tests, custom objectives); it is also what `step` reports."""
        if value.numel() != 1 or value.type != GGML_TYPE_F32:
            raise ShapeError(f"scalar_loss: need an f32 scalar, got {value!r}")
        lib.ggml_set_loss(value.ptr)
        lib.ggml_set_output(value.ptr)
        return CrossEntropy(value.named(name), value, name)

    # --- graphs ----------------------------------------------------------------------------
    def forward(self, outputs: dict[str, Tensor]) -> ForwardGraph:
        return ForwardGraph(self, outputs)

    def trainer(self, loss: CrossEntropy, convention: str) -> Trainer:
        return Trainer(self, loss, convention)

    def _compute(self, graph) -> None:
        self._no_plan("compute")
        same_graph = graph == self._last_graph
        if not same_graph:
            # Shared nodes keep the last graph's placement unless cleared (see the shim).
            lib.th_clear_ctx_alloc(self._ctx_compute)
            self._last_graph = graph
        self._prepare(graph)
        # Computed again, a graph keeps its placement: no walk over its nodes per step; after
        # another graph, its own allocator puts every node back where it was.
        if not same_graph:
            with ggml_quiet():
                placed = lib.ggml_gallocr_alloc_graph(self.galloc_for(graph), graph)
            if not placed:
                raise allocation_failed(self.engine, "a graph's compute buffer", graph_buffer_bytes(self.engine, graph))
        if self.cuda_kernels and self.precision == "bf16":
            lib.th_cuda_bf16_keep_nodes(self.bf16_horizon)
        start = time.perf_counter()
        status = lib.ggml_backend_graph_compute(self.engine.handle, graph)
        self.last_compute_s = time.perf_counter() - start   # the graph alone (bench: host overhead)
        if status != GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml graph compute failed with status {status}")

    @property
    def bf16_horizon(self) -> int:
        """The bf16 operand copies' horizon in nodes on cuda (native/cuda/th-precision.cu,
        th_cuda_bf16_keep_nodes; 0: a copy lives while its bytes are not written), set before each compute
        since the copies are the process's: BF16_KEEP_NODES where blocks are recomputed (a block's forward
        converts its operands again just before its backward) or a frozen weight stays in its type (a LoRA
        base: its bf16 copies would live from the forward to the backward), else none."""
        return BF16_KEEP_NODES if self.recompute is not None or self.frozen_in_type else 0

    @property
    def reserves_rewritten(self) -> bool:
        """Whether the training graph's buffer is reserved for the graph as the backend's rewrite
        leaves it (cuda with our kernels), not as built: reserved before, it kept the places of
        nodes the fused kernels never write (attention's (B*H, T, T) probabilities, kept for the
        backward in ggml's graph; the REPEATs of grouped kv heads) and, only growing, never gave
        them back (iss-32f). (A cpu program that builds graphs as cuda does, in tests, computes none.)"""
        return self.cuda_kernels and self.engine.backend == "cuda"

    def _prepare(self, graph, recomputed: bool = False) -> None:
        """Once per graph, before its first compute (and in a memory plan, before it is measured):
        the backend's rewrites, then the check that the backend declares every node.
        `recomputed`: a graph of recomputed blocks alone (engine/recompute.py), which may read a
        block input that a node of the forward's graph writes (the cuda rewrite's rooms)."""
        if graph not in self._gemm_rewritten:
            # On cpu, hot nodes get our kernels (native/cpu_kernels.c: sgemm, copies, SILU_BACK,
            # LayerNorm centring); no backward can be built through a rewritten node, so a
            # Trainer must come before any compute.
            if self.portable:
                why = ffi.new("char[256]")
                if lib.th_portable_rewrite(graph, why, 256) < 0:
                    raise BackendError(f"portable mode: {ffi.string(why).decode()}; not computed "
                                       "(native/portable_kernels.c)")
            elif self.cpu_kernels and lib.th_cpu_rewrite(graph) < 0:
                raise RuntimeError("a stand-in node could not take its cpu kernel, or a fused node is read "
                                   "elsewhere (native/cpu_kernels.c, th_cpu_rewrite): not computed")
            elif self.cuda_kernels and lib.th_cuda_rewrite(graph, FUSED_ATTENTION | (4 if recomputed else 0)) < 0:
                raise RuntimeError("a stand-in node could not take its cuda kernel, an attention's backward "
                                   "could not follow its fused forward, the graph holds a node another one "
                                   "writes but not that one, or it reads a LayerNorm output that the forward "
                                   "no longer writes (native/cuda_rewrite.c, th_cuda_rewrite): not computed")
            if self.precision != "fp32":
                why = ffi.new("char[512]")
                marked = lib.th_cuda_mark_precision(graph, PRECISION_CODES[self.precision], why, 512)
                if marked == -2:
                    text = ffi.string(why).decode()
                    if text.startswith(("SwiGLU", "GELU's input", "attention's input")):   # kept bf16
                        raise BackendError(f"precision {self.precision}: {text}; not computed")
                    raise BackendError(f"precision {self.precision}: the frozen bf16 products (native/cuda/"
                                       f"th-frozen.cu) do not take {text}")
                if marked < 0:
                    raise BackendError(f"precision {self.precision}: not known to native/cuda_precision.c")
            # after the rewrites: every node as the backend's dispatch will see it (ours included)
            self._check_supported(graph)
            self._gemm_rewritten.add(graph)

    def _lowered(self, graph, grads: bool):
        """`graph`, or where it holds nodes the backend does not declare and the lowering can
        rewrite, a larger copy of it with them rewritten (the program's `lowering.lowered` says which)."""
        if self.engine.is_cpu and not self.lowering_target:
            return graph      # ggml-cpu declares every op our graphs hold
        needed = self.lowering.needed(graph)
        if not needed:
            return graph
        bigger = self._new_graph(lib.ggml_graph_size(graph) + 64 * needed, grads)
        lib.ggml_graph_cpy(graph, bigger)
        self.lowering.lower(bigger)
        return bigger

    def _check_supported(self, graph) -> None:
        """ggml aborts on an op its backend lacks: name the op instead, before any compute
        (with Program.lowering_target "metal", the ops ggml-metal lacks too)."""
        if self.engine.is_cpu and not self.lowering_target:
            return
        missing = {}
        for i in range(lib.ggml_graph_n_nodes(graph)):
            node = lib.ggml_graph_node(graph, i)
            if not self.lowering.declares(node):
                op, name = ffi.string(lib.ggml_op_desc(node)).decode(), ffi.string(lib.ggml_get_name(node)).decode()
                missing.setdefault(op, name)
        if missing:
            ops = ", ".join(f"{op} (e.g. node {name!r})" for op, name in missing.items())
            where = f" (lowered for {self.lowering_target})" if self.lowering_target else ""
            raise BackendError(f"the {self.engine.backend} backend of this ggml{where} cannot run {ops}")

    def galloc_for(self, graph):
        """The graph allocator that places `graph`: the program's first for the first graph
        reserved or computed, a new one for each other graph."""
        key = int(ffi.cast("uintptr_t", graph))
        galloc = self._gallocs.get(key)
        if galloc is None:
            galloc = self._galloc if not self._gallocs else lib.ggml_gallocr_new(self.engine.buffer_type)
            self._gallocs[key] = galloc
        return galloc

    def compute_buffer_bytes(self) -> int:
        """The compute buffers of every graph computed so far (or reserved), together."""
        gallocs = list(self._gallocs.values()) or [self._galloc]
        return sum(int(lib.ggml_gallocr_get_buffer_size(g, 0)) for g in gallocs)

    def persistent_bytes(self) -> int:
        return sum(int(lib.ggml_backend_buffer_get_size(b)) for b in self._buffers)

    def buffer_sizes(self) -> list[int]:
        """Each backend buffer the program holds, in bytes: persistent ones, then each graph's."""
        gallocs = list(self._gallocs.values()) or [self._galloc]
        return ([int(lib.ggml_backend_buffer_get_size(b)) for b in self._buffers]
                + [int(lib.ggml_gallocr_get_buffer_size(g, 0)) for g in gallocs])

    def close(self) -> None:
        for tg in self._targets.values():   # views of the memory freed below
            tg.mirror = tg.ids = None
        if self._galloc is not None:
            lib.ggml_backend_synchronize(self.engine.handle)
            if self.engine.backend == "vulkan":
                # With ggml-vulkan on lavapipe, a freed buffer (the program's or its allocator's,
                # even after a synchronize) crashed lavapipe's worker threads in a later graph of
                # another program (tests/test_engine_ops.py, 1 run in 2): its device memory is
                # kept until the process ends (a run has one program; tests make many small ones).
                _KEPT_DEVICE_MEMORY.append((self._galloc, self._gallocs, self._buffers))
            else:
                every = {int(ffi.cast("uintptr_t", g)): g for g in [self._galloc, *self._gallocs.values()]}
                for galloc in every.values():
                    lib.ggml_gallocr_free(galloc)
                for b in self._buffers:
                    lib.ggml_backend_buffer_free(b)
            lib.ggml_free(self._ctx_compute)
            lib.ggml_free(self._ctx_static)
            self._galloc = None
            self._gallocs = {}
            self._buffers = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class ForwardGraph:
    """A forward-only graph over chosen outputs (evaluation, sampling)."""

    def __init__(self, prog: Program, outputs: dict[str, Tensor]):
        self.prog, self.outputs = prog, outputs
        self.graph = prog._new_graph(prog._forward_size(list(outputs.values())), False)
        for t in outputs.values():
            lib.ggml_set_output(t.ptr)
            lib.ggml_build_forward_expand(self.graph, t.ptr)
        self.graph = prog._lowered(self.graph, False)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.prog.feed(feeds)
        self.prog._compute(self.graph)
        return {k: self.prog.read(t) for k, t in self.outputs.items()}


_VIEW_OPS = ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")


class Trainer:
    """Forward, backward and one AdamW step per trainable tensor, fed by a 7-float row.

    Every parameter's gradient is the (contiguous) node that computes it, a graph output, not an
    accumulator: an accumulator cost an ADD of the gradient into zeros per parameter and a clear of them
    all per step, and adding a gradient to zeros changes no bit of it. `grad_acc` holds them by name,
    valid after a step or `grads_only` until another graph of the program is computed (the compute
    buffer they are in is then reused). The first step after construction does a full reset (gradients
    and moments); later steps reset gradients only, so the moments carry over.
    """

    def __init__(self, prog: Program, loss: CrossEntropy, convention: str):
        check_convention(AdamWRow(convention, 0, 0, 0, 0, 0), convention)
        self.prog, self.loss, self.convention = prog, loss, convention
        ctx = prog._ctx_compute
        if not prog.params:
            raise InputError("the program has no trainable parameters")
        if prog._gemm_rewritten:
            raise InputError("create the Trainer before computing any graph of its program "
                             "(computed graphs have their matrix products rewritten, which have no backward)")
        roots = [loss.train] if loss.report is loss.train else [loss.train, loss.report]
        gf = prog._new_graph(prog._forward_size(roots), False)
        for t in roots:
            lib.ggml_build_forward_expand(gf, t.ptr)
        n = lib.ggml_graph_n_nodes(gf)
        # A persistent gradient accumulator for the loss, in a backend buffer of its own (one left
        # to the graph allocator is overwritten after step 0 and training silently stalls); a
        # parameter's gradient is the node that computes it, kept as a graph output.
        prog.allocate()
        accs = ffi.new("ggml_tensor *[]", n)
        self.grad_acc: dict[str, Tensor] = {}
        reached = set()
        for i in range(n):
            node = lib.ggml_graph_node(gf, i)
            flags = lib.th_tensor_flags(node)
            if flags & (GGML_FLAG_PARAM | GGML_FLAG_LOSS):
                name = ffi.string(lib.ggml_get_name(node)).decode()
                if flags & GGML_FLAG_PARAM:
                    reached.add(name)
                    continue
                ne = ffi.new("int64_t[4]")
                lib.th_tensor_shape(node, ne, ffi.new("size_t[4]"))
                acc = lib.ggml_new_tensor_4d(prog._ctx_static, GGML_TYPE_F32, *ne)
                lib.ggml_set_name(acc, f"grad.{name}"[:63].encode())
                prog._unallocated += 1
                accs[i] = acc
                self._loss_grad = acc
        # ggml only puts leaves with the PARAM flag into the node list.
        unused = [p for p in prog.params if p not in reached]
        if unused:
            raise InputError(f"trainable parameters not used by the loss: {', '.join(unused)}")
        self._grads_buffer = prog.allocate()
        self._one = ffi.new("float *", 1.0)
        self._loss_out = ffi.new("float[1]")
        self._hp_row = ffi.new("float[7]")
        self.hp = prog._new_static("adamw.hp", (7,), GGML_TYPE_F32)
        lib.ggml_set_input(self.hp.ptr)
        self.m: dict[str, Tensor] = {}
        self.v: dict[str, Tensor] = {}
        for name, p in prog.params.items():
            self.m[name] = prog._new_static(f"adamw.m.{name}"[:63], p.shape, GGML_TYPE_F32)
            self.v[name] = prog._new_static(f"adamw.v.{name}"[:63], p.shape, GGML_TYPE_F32)
        prog.allocate()

        # Each graph sized to what it holds (a copy needs at least its source's size): the
        # backward's from a count in a scratch context, plus a cont per parameter (its gradient
        # is a graph output); AdamW adds per parameter at most a cont and its step
        # (nodes), m and v (leafs), and the row (one leaf).
        grad_size, made = prog._backward_size(gf, accs)
        conts = len(prog.params)
        grad_size, made = max(grad_size, lib.ggml_graph_size(gf)) + conts, made + conts
        opt_size = grad_size + 2 * len(prog.params) + 1
        prog._check_room(made * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(grad_size, True)
                         + lib.ggml_graph_overhead_custom(opt_size, True), "the backward graph")
        self.gb_grad = prog._new_graph(grad_size, True)
        lib.ggml_graph_cpy(gf, self.gb_grad)
        lib.ggml_build_backward_expand(ctx, self.gb_grad, accs)
        if prog.column_sums_as_products:
            self._column_sums_as_products(self.gb_grad)
        lowered = prog._lowered(self.gb_grad, True)
        if lowered != self.gb_grad:
            # nodes of gf were rewritten in place: gf again, with the nodes they now read
            self.gb_grad, gf = lowered, prog._new_graph(prog._forward_size(roots), False)
            for t in roots:
                lib.ggml_build_forward_expand(gf, t.ptr)
            opt_size = max(opt_size, lib.ggml_graph_size(self.gb_grad) + 2 * len(prog.params) + 1)
        grads = {}
        for name, p in prog.params.items():
            grad = lib.ggml_graph_get_grad(self.gb_grad, p.ptr)
            if grad == ffi.NULL:
                raise InputError(f"parameter {name} gets no gradient from the loss")
            # kept whole: a RESHAPE's source is kept too (an output view alone would not keep
            # its source's memory); another view becomes a node of its own
            root = grad
            while ffi.string(lib.ggml_op_desc(root)).decode() == "RESHAPE":
                lib.ggml_set_output(root)
                root = lib.th_tensor_src(root, 0)
            if not lib.ggml_is_contiguous(root) or ffi.string(lib.ggml_op_desc(root)).decode() in _VIEW_OPS:
                grad = root = lib.ggml_cont(ctx, grad)
                lib.ggml_build_forward_expand(self.gb_grad, grad)
            lib.ggml_set_output(root)
            self.grad_acc[name] = Tensor(prog, grad, p.ndim)
            grads[name] = grad
        self.gb_opt = prog._new_graph(opt_size, True)
        lib.ggml_graph_cpy(self.gb_grad, self.gb_opt)
        for name, p in prog.params.items():
            grad = grads[name]
            if not lib.ggml_is_contiguous(grad):
                grad = lib.ggml_cont(ctx, grad)
            step = lib.ggml_opt_step_adamw(ctx, p.ptr, grad, self.m[name].ptr, self.v[name].ptr, self.hp.ptr)
            lib.ggml_build_forward_expand(self.gb_opt, step)
        if prog.recompute is not None and prog.recompute.copies:
            from .recompute import apply

            self.gb_grad, self.gb_opt = apply(prog, gf, [self.gb_grad, self.gb_opt])
        # (only where our cpu kernels compute the graph: one lowered for metal keeps ggml's nodes)
        if prog.cpu_kernels and prog.cpu_folds and lib.th_cpu_fold(self.gb_opt) < 0:
            raise RuntimeError("a product folded into an ADD is read elsewhere (native/cpu_kernels.c, th_cpu_fold)")
        self.gf = gf
        self.eval_graph = prog._new_graph(prog._forward_size([loss.report]), False)
        lib.ggml_build_forward_expand(self.eval_graph, loss.report.ptr)
        self.eval_graph = prog._lowered(self.eval_graph, False)
        if prog.planner is not None:
            prog.planner.measure_graphs(prog, self)     # sizes only: nothing reserved
        else:
            if prog.reserves_rewritten:
                prog._prepare(self.gb_opt)
            with ggml_quiet():
                reserved = lib.ggml_gallocr_reserve(prog.galloc_for(self.gb_opt), self.gb_opt)
            if not reserved:
                raise allocation_failed(prog.engine, "the training graph's compute buffer",
                                    graph_buffer_bytes(prog.engine, self.gb_opt))
        self.needs_full_reset = True
        self.steps_done = 0

    def _column_sums_as_products(self, graph) -> None:
        """Every REPEAT_BACK that sums the rows of a matrix into one row becomes OUT_PROD(matrix,
        ones): the same sum as a cuBLAS product; one that sums each row into one value becomes
        SUM_ROWS (see Program.column_sums_as_products, native/shim.c)."""
        prog = self.prog
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

    @property
    def n_nodes(self) -> int:
        return int(lib.ggml_graph_n_nodes(self.gb_opt))

    def reset_full(self) -> None:
        """Zero every gradient accumulator and both AdamW moments; loss gradient = 1.
        What ggml_graph_reset(gb_opt) does, by name: it finds the moments through the graph's
        OPT_STEP_ADAMW nodes, which the cpu rewrite turns into custom ops."""
        moments = [t.ptr for t in (*self.m.values(), *self.v.values())]
        lib.th_zero_tensors(ffi.new("ggml_tensor *[]", moments), len(moments))
        self.reset_grads()

    def reset_grads(self) -> None:
        """Set the loss gradient to 1 (the parameters' gradients are graph outputs, written by each
        step); the moments survive. What ggml_graph_reset(gb_grad) does."""
        lib.ggml_backend_tensor_set(self._loss_grad, self._one, 0, 4)

    def step(self, feeds: dict[str, np.ndarray], hp: HPRow | AdamWRow | list[float],
             step_index: int | None = None) -> float:
        """One training step on one batch; returns the reported (thread-invariant) loss.

        `hp` is a step's row (an `HPRow`, whose convention must be the declared one, or 7 bare
        floats), or an `AdamWRow` evaluated at `step_index` (default: steps done so far).
        """
        if isinstance(hp, HPRow):
            check_convention(hp, self.convention)
        if isinstance(hp, AdamWRow):
            check_convention(hp, self.convention)
            hp = hp.hp_for_step(self.steps_done if step_index is None else step_index)
        try:      # plain floats, no numpy: the host's share of a tiny step counts
            row = [float(v) for v in hp]
        except (TypeError, ValueError):
            row = []
        if len(row) != 7 or not all(map(math.isfinite, row)):
            raise InputError(f"the AdamW row must be 7 finite floats, got {hp!r}")
        self.prog.feed(feeds)
        self._hp_row[0:7] = row
        lib.ggml_backend_tensor_set(self.hp.ptr, self._hp_row, 0, 7 * 4)
        if self.needs_full_reset:
            self.reset_full()
            self.needs_full_reset = False
        else:
            self.reset_grads()
        self.prog._compute(self.gb_opt)
        self.steps_done += 1
        return self.loss_value()

    def grads_only(self, feeds: dict[str, np.ndarray]) -> float:
        """Forward and backward without the AdamW step (gradients land in the accumulators)."""
        self.prog.feed(feeds)
        self.reset_grads()
        self.prog._compute(self.gb_grad)
        return self.loss_value()

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        """The reported loss on a batch, forward only: parameters and moments untouched."""
        self.prog.feed(feeds)
        self.prog._compute(self.eval_graph)
        return self.loss_value()

    def loss_value(self) -> float:
        lib.ggml_backend_tensor_get(self.loss.report.ptr, self._loss_out, 0, 4)
        return float(self._loss_out[0])

    def train_loss_value(self) -> float:
        """ggml's own cross_entropy_loss scalar (moves with the thread count)."""
        out = np.empty(1, dtype=np.float32)
        lib.ggml_backend_tensor_get(self.loss.train.ptr, ffi.from_buffer(out), 0, 4)
        return float(out[0])

    # --- state for checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """Parameters and moments as numpy, by name (for checkpoints)."""
        out = {}
        for name, p in self.prog.params.items():
            out[name] = self.prog.read(p)
            out[f"adamw.m.{name}"] = self.prog.read(self.m[name])
            out[f"adamw.v.{name}"] = self.prog.read(self.v[name])
        return out

    def load_state(self, state: dict[str, np.ndarray], steps_done: int) -> None:
        """Restore parameters and moments; the next step resets gradients only."""
        for name, p in self.prog.params.items():
            for key, t in ((name, p), (f"adamw.m.{name}", self.m[name]), (f"adamw.v.{name}", self.v[name])):
                if key not in state:
                    raise InputError(f"checkpoint lacks tensor {key!r}")
                self.prog.write(t, state[key])
        self.needs_full_reset = False
        self.steps_done = steps_done


def _upload(t: Tensor, data: np.ndarray) -> None:
    nbytes = int(lib.ggml_nbytes(t.ptr))
    if data.nbytes != nbytes:
        raise ShapeError(f"{t.name}: upload of {data.nbytes} bytes into a tensor of {nbytes} bytes")
    lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(data), 0, nbytes)


def _as_ids(what: str, value: np.ndarray, expected: str) -> np.ndarray:
    """Integer ids as a contiguous int64 array (th_feed_* check their range)."""
    if value.dtype.kind not in "iu":
        raise InputError(f"{what}: expected {expected}, got {value.dtype}")
    if value.dtype == np.uint64 and value.size and value.max() > np.iinfo(np.int64).max:
        raise InputError(f"{what}: id {value.max()} out of range")
    return np.ascontiguousarray(value, dtype=np.int64)


def _id_error(name: str, bad, upper: int | None) -> InputError:
    bound = f"[0, {upper})" if upper is not None else f"[0, {2 ** 31})"
    return InputError(f"{name!r}: id {int(bad)} out of range {bound}")
