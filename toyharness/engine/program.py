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

import time

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
from ..errors import BackendError, InputError, ShapeError
from . import graph_check, graph_rewrites
from .allocation import allocation_failed, ggml_quiet, graph_buffer_bytes
from .backend import Engine, register_program_class
from .host_values import (
    DTYPE_NAMES,
    FedInput,
    FedTargets,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    feed_input,
    feed_targets,
    upload,
)
from .loop_controls import TrainingLoop
from .losses import CrossEntropy, LossBuilders
from .lowering import Lowering, declares_for
from .origins import located
from .tensor import Tensor
from .trainer import Trainer

# The most tensors ggml_build_backward_expand makes for one forward node (ggml_compute_backward,
# ggml 0.25.3): MUL_MAT's out_prod, view, repeat_back and add for its first operand and transpose,
# out_prod and add for its second (SET also makes 7, every other op fewer). It bounds the scratch
# graph in which a backward is built once to count its nodes (Program._backward_size); a graph
# that overflows aborts the process, so tests/test_graph_size.py holds deep models to it.
BACKWARD_TENSORS_PER_NODE = 7

# The bf16 copies' horizon (Program.bf16_horizon): with recompute_blocks a block's recomputed
# forward and its backward are within 200 nodes of each other in a llama block's training graph
# (LoRA over a Q4_K base: a frozen weight's copy is used at most 172 nodes apart there, by the
# recomputed product and the input gradient), while the forward that made a copy is the blocks
# after it away (about 195 nodes a block). Without recompute a frozen base's copies made by the
# forward would live until their block's backward (the LoRA bench's 1B base: 2 GiB of bf16 values
# through the pass) where converting them again costs about 3% of the step.
BF16_KEEP_NODES = 256


_KEPT_DEVICE_MEMORY: list = []   # see Program.close


class Program(LossBuilders):
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
        self.inputs: dict[str, FedInput] = {}
        self._targets: dict[str, FedTargets] = {}
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
        self._choose_kernels(engine)
        self.last_compute_s = 0.0
        # Set while a memory plan is made (toyharness/engine/memory_plan.py): persistent tensors and graph
        # buffers are then measured, never allocated, and parameter values are never copied.
        self.planner = engine.planner
        # Activation recompute by block (engine/recompute.py): set by enable_recompute.
        self.recompute = None
        # What its Trainer does beyond one AdamW step per batch (Engine.set_training_loop)
        self.training_loop = engine.training_loop
        # While set, blocks.attention builds cached attention through it (toyharness/sampling.py)
        self.kv_cache = None
        self.packed_rows = None      # engine/packed.py: rows of several examples (masks, positions fed)
        # Whether frozen_gguf holds a quantized weight as its f32 dequantization (sampling's
        # --dequantize: the same values, 4x the memory, products without a dequantization per call)
        self.dequantize_frozen = False
        # Dropout (engine/dropout.py): the masks' state, made by the first Tensor.dropout, and the
        # seed of their stream (a recipe sets its run's seed; the key is fed at each compute)
        self._dropout = None
        self.dropout_seed = 0

    def _choose_kernels(self, engine: Engine) -> None:
        """Which kernels compute this program's graphs and in which form blocks build them, from the
        engine's backend, mode and precision (each flag says why); tests set some of them before
        building any graph."""
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

    def _forward_size(self, outputs: list) -> int:
        """The graph size a forward graph over `outputs` (Tensors or ggml tensor pointers) needs
        (its nodes or its leafs, the larger), counted by building it once in a scratch graph of
        _reachable_bound() nodes."""
        bound = self._reachable_bound()
        scratch = self._new_ctx(lib.ggml_graph_overhead_custom(bound, False))
        try:
            graph = lib.ggml_new_graph_custom(scratch, bound, False)
            for t in outputs:
                lib.ggml_build_forward_expand(graph, getattr(t, "ptr", t))
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
        self.inputs[name] = FedInput(t, upper, t.shape, ids, np.empty(t.numel(), np.int32) if ids else None)
        return t

    def constant(self, name: str, array: np.ndarray) -> Tensor:
        """A persistent tensor with a fixed value (positions, masks)."""
        array = np.asarray(array)
        dtype = "i32" if array.dtype.kind in "iu" else "f32"
        t = self.input(name, array.shape, dtype)
        self._pending.append((t, np.ascontiguousarray(array, dtype=np.int32 if dtype == "i32" else np.float32)))
        return t

    def enable_recompute(self, every_block: bool = True, option: str = "recompute_blocks") -> None:
        """Recompute recomputed blocks' activations in the backward (engine/recompute.py), for
        graphs built from now on; `every_block` False: only blocks built with always=True (a
        chunked output head), `option` the option that asked, named in a refusal. On cpu and
        cuda, whose rewrites (native/cpu_kernels.c, native/cuda_rewrite.c) recompute.apply runs
        on the graph as ggml built it and on the copies apart; other backends (and the metal
        lowering, which rewrites the graph before the copies are wired in) are refused."""
        from .recompute import Recompute

        if self.engine.backend not in ("cpu", "cuda") or self.lowering_target:
            raise InputError(f"option {option!r}: the cpu and cuda backends only, not {self.engine.backend}"
                             + (" lowered for " + self.lowering_target if self.lowering_target else ""))
        if self.recompute is None:
            self.recompute = Recompute(every_block=every_block)
        else:
            self.recompute.every_block |= every_block

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
            upload(t, data)
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
        upload(t, np.ascontiguousarray(conv[t.type](array)))

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
                feed_targets(name, self._targets[name], value)
            elif name in self.inputs:
                feed_input(name, self.inputs[name], value)
            else:
                known = sorted([*self.inputs, *self._targets])
                raise InputError(f"unknown input {name!r}; this program takes: {', '.join(known)}")


    def set_dropout(self, forward_index: int, enabled: bool) -> None:
        """Every dropout mask of the program for training forward `forward_index`, or (not
        `enabled`: evaluation, sampling) all ones; nothing where the program has no dropout."""
        if self._dropout is not None:
            self._dropout.set(forward_index, enabled)

    # --- graphs ----------------------------------------------------------------------------
    def forward(self, outputs: dict[str, Tensor]) -> ForwardGraph:
        return ForwardGraph(self, outputs)

    def trainer(self, loss: CrossEntropy, convention: str, loop: TrainingLoop | None = None) -> Trainer:
        """The training graph of `loss` (engine/trainer.py); `loop`: accumulation and clipping
        (default: the engine's, Engine.set_training_loop, which a run sets from its options)."""
        return Trainer(self, loss, convention, loop)

    def _place(self, graph) -> None:
        """`graph`'s nodes where its allocator puts them. Computed again, a graph keeps its
        placement: no walk over its nodes per step; after another graph, its own allocator puts
        every node back where it was (so a graph's values can be read again after another graph
        computed in another buffer)."""
        same_graph = graph == self._last_graph
        if not same_graph:
            # Shared nodes keep the last graph's placement unless cleared (see the shim).
            lib.th_clear_ctx_alloc(self._ctx_compute)
            self._last_graph = graph
        self._prepare(graph)
        if not same_graph:
            with ggml_quiet():
                placed = lib.ggml_gallocr_alloc_graph(self.galloc_for(graph), graph)
            if not placed:
                raise allocation_failed(self.engine, "a graph's compute buffer", graph_buffer_bytes(self.engine, graph))

    def _compute(self, graph) -> None:
        self._no_plan("compute")
        self._place(graph)
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
        the backend's rewrites, then the check that it declares every node (graph_rewrites.prepare;
        `recomputed`: a graph of recomputed blocks alone, engine/recompute.py)."""
        graph_rewrites.prepare(self, graph, recomputed)

    def galloc_for(self, graph):
        """The graph allocator that places `graph`: the program's first for the first graph
        reserved or computed, a new one for each other graph."""
        key = int(ffi.cast("uintptr_t", graph))
        galloc = self._gallocs.get(key)
        if galloc is None:
            galloc = self._galloc if not self._gallocs else lib.ggml_gallocr_new(self.engine.buffer_type)
            self._gallocs[key] = galloc
        return galloc

    def _distinct_gallocs(self) -> list:
        """Each graph allocator once (a Trainer's training graphs share one: accumulation)."""
        gallocs = {int(ffi.cast("uintptr_t", g)): g for g in self._gallocs.values()}
        return list(gallocs.values()) or [self._galloc]

    def compute_buffer_bytes(self) -> int:
        """The compute buffers of every graph computed so far (or reserved), together."""
        return sum(int(lib.ggml_gallocr_get_buffer_size(g, 0)) for g in self._distinct_gallocs())

    def persistent_bytes(self) -> int:
        return sum(int(lib.ggml_backend_buffer_get_size(b)) for b in self._buffers)

    def buffer_sizes(self) -> list[int]:
        """Each backend buffer the program holds, in bytes: persistent ones, then each graph's."""
        return ([int(lib.ggml_backend_buffer_get_size(b)) for b in self._buffers]
                + [int(lib.ggml_gallocr_get_buffer_size(g, 0)) for g in self._distinct_gallocs()])

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
        self.graph = graph_rewrites.lowered(prog, self.graph, False)
        graph_check.refuse_unsupported(prog, [self.graph])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.prog.feed(feeds)
        self.prog.set_dropout(0, False)      # a forward alone: no dropout
        self.prog._compute(self.graph)
        return {k: self.prog.read(t) for k, t in self.outputs.items()}


# a ShapeError of a graph-building method ends with the recipe's line, as Tensor's ops' do
for _name in ("param", "input", "constant", "cross_entropy", "masked_cross_entropy", "chunked_cross_entropy",
              "token_logps", "scalar_loss"):
    setattr(Program, _name, located(getattr(Program, _name)))
register_program_class(Program)
