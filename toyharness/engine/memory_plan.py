"""A run's memory plan: what it will allocate, buffer by buffer, before it allocates anything.

The plan is read from the very graphs ggml will allocate, not from a formula: the recipe is
realized once on a program in planning mode (Program.planner), where parameter inits are
zero-stride placeholders (toyharness.seeded_init.shapes_only), persistent tensors are placed in an
address range that is reserved but never touched (each padded to the buffer type's alignment,
as ggml_backend_alloc_ctx_tensors places them), and the training and evaluation graphs are
sized by ggml's own allocator (ggml_gallocr_reserve_n_size) after the backend's rewrites, as a
step will see them. So the plan is ggml's buffers to the byte; what it leaves out is the
process around them (Python, the libraries, the CUDA context).

`train` checks the plan against what the backend has free (cuda: the driver's free memory; cpu:
available RAM) and refuses a run that cannot fit in one line, exit 2, naming the two options that
would shrink it most. An allocation that fails anyway is `allocation.allocation_failed`: one line, exit 1.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .._ffi import GGML_MAX_SRC, ffi, lib
from ..errors import DoesNotFit, InputError
from ..switches import switch
from .allocation import fmt_bytes, free_memory

# The rows of a plan, in the order of the table, and what each holds.
ROWS = {
    "params": "parameters (trainable, f32)",
    "moments": "AdamW moments (m and v)",
    "grads": "gradient accumulators",
    "accumulators": "gradient sums over micro-batches (accumulate)",
    "frozen_uploaded": "frozen weights (uploaded)",
    "frozen_mapped": "frozen weights (mapped from the file)",
    "inputs": "inputs, targets and constants",
    "compute": "compute buffer of the training graph",
    "compute_eval": "compute buffer of the evaluation graph",
    "granularity": "the driver's 2 MiB pages beyond the buffers",
    "checkpoint": "checkpoint copy (host, while saving)",
}
# What a device's driver takes for a buffer beyond its size: the CUDA driver hands out 2 MiB pages,
# a page run of its own for each buffer of 1 MiB or more, smaller ones packed together into shared
# pages. Measured on an H100 (tools/gpu_memory_plan.sh, 34 cases): the used memory grew by each
# large buffer rounded up to 2 MiB, exactly, and by 0-2 MiB for the small ones together (0 where
# they fit in pages the process already held): counted at their sizes. Backends not named here are
# counted at their buffers' sizes.
ALLOCATION_GRANULARITY = {"cuda": 2 * (1 << 20)}
# ggml's view ops: their result is memory of another tensor
VIEW_OPS = ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")
# Options tried, halved (or turned on), to say what would shrink a plan that does not fit: these,
# where the recipe's options have them, and the sizes its options class names in `plan_sizes`
# (a class attribute: lora's adapter rank).
SHRINK_SIZES = ("t_batch", "t_seq", "n_layer", "d_model", "d_ff")
SHRINK_SWITCHES = ("recompute_blocks",)
# The sizes a plan's header shows (where the options have them), the `plan_sizes` after them.
SHOWN_SIZES = ("t_batch", "t_seq", "n_layer", "d_model", "n_head")


def recipe_sizes(options) -> tuple[str, ...]:
    """The sizes a recipe's options class declares beyond the common ones (`plan_sizes`)."""
    return tuple(getattr(type(options), "plan_sizes", ()))
# TOYHARNESS_MEMORY_CHECK=off skips the check against free memory (the plan is still made when asked)
CHECK_ENV = "TOYHARNESS_MEMORY_CHECK"


@dataclass
class Tensorish:
    """A graph node as the plan reports it: op, shape (numpy order) and padded bytes."""

    op: str
    shape: tuple[int, ...]
    nbytes: int

    def describe(self) -> str:
        return f"{self.op} {tuple(self.shape)}"


@dataclass
class MemoryPlan:
    recipe: str
    backend: str
    sizes: dict[str, Any]                                  # the options that size it (t_batch, t_seq, ...)
    rows: dict[str, int] = field(default_factory=lambda: {k: 0 for k in ROWS})
    activations: int = 0          # forward nodes the backward reads: kept alive until then
    logits: int = 0               # the logits and their gradient (standard cross-entropy)
    largest: list[Tensorish] = field(default_factory=list)
    compute_parts: dict[str, int] = field(default_factory=dict)   # training graph before/after rewrite, eval
    buffers: list[int] = field(default_factory=list)   # each backend buffer ggml will allocate, in bytes
    not_counted: list[str] = field(default_factory=list)   # memory the run takes that the plan cannot size
    free: int | None = None
    free_what: str = ""

    @property
    def device_rows(self) -> list[str]:
        """Rows that take the backend's memory: on cpu every row (one memory, RSS), elsewhere all
        but the checkpoint's host copy."""
        return [k for k in ROWS if self.backend == "cpu" or k != "checkpoint"]

    @property
    def total(self) -> int:
        """What the run needs of the backend's memory at its peak."""
        return sum(self.rows[k] for k in self.device_rows)

    @property
    def ggml_bytes(self) -> int:
        """ggml's buffers alone (no host copies, nothing mapped): what a device's used memory holds."""
        return sum(self.rows[k] for k in ("params", "moments", "grads", "accumulators", "frozen_uploaded", "inputs",
                                          "compute", "compute_eval", "granularity"))

    def table(self) -> str:
        sizes = ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.sizes.items())
        lines = [f"memory plan: {self.recipe} on {self.backend} ({sizes})", f"  {'item':<46}{'size':>12}"]
        for key, label in ROWS.items():
            if key == "checkpoint" and self.backend != "cpu":
                continue
            if key == "granularity" and self.backend not in ALLOCATION_GRANULARITY:
                continue
            if key == "accumulators" and not self.rows[key]:
                continue
            lines.append(f"  {label:<46}{fmt_bytes(self.rows[key]):>12}")
            if key == "compute":
                lines.append(f"    {'activations kept for the backward':<44}{fmt_bytes(self.activations):>12}")
                if self.logits:
                    lines.append(f"    {'logits and their gradient':<44}{fmt_bytes(self.logits):>12}")
                for t in self.largest:
                    lines.append(f"    {'largest: ' + t.describe():<44}{fmt_bytes(t.nbytes):>12}")
        lines.append(f"  {'total on ' + self.backend:<46}{fmt_bytes(self.total):>12}")
        if self.backend != "cpu":
            host = fmt_bytes(self.rows["checkpoint"])
            lines.append(f"  {'and on the host, while saving a checkpoint':<46}{host:>12}")
        if self.free is not None:
            lines.append(f"  {'free (' + self.free_what + ')':<46}{fmt_bytes(self.free):>12}")
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict}; not counted: the process itself (Python, libraries"
                         + (", the CUDA context)" if self.backend == "cuda" else ")"))
        lines += [f"  not counted: {what}" for what in self.not_counted]
        return "\n".join(lines)

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "backend": self.backend, "sizes": dict(self.sizes), "rows": dict(self.rows),
                "total": self.total, "ggml_bytes": self.ggml_bytes, "activations": self.activations,
                "logits": self.logits,
                "compute_parts": dict(self.compute_parts), "buffers": list(self.buffers),
                "largest": [dataclasses.asdict(t) for t in self.largest], "free": self.free,
                "not_counted": list(self.not_counted)}


class Planner:
    """What a program in planning mode calls instead of allocating (Program.allocate, Trainer)."""

    def __init__(self, engine):
        self.engine = engine
        self.buft = engine.buffer_type
        self.align = int(lib.ggml_backend_buft_get_alignment(self.buft))
        self.rows = {k: 0 for k in ROWS}
        self.placed: set[str] = set()
        self._regions: list[tuple[int, int]] = []     # (address, size) reserved with mmap
        self._buffers: list = []
        self._host: list[np.ndarray] = []             # real memory of planned constants
        self.activations = 0
        self.logits = 0
        self.largest: list[Tensorish] = []
        self.compute_parts: dict[str, int] = {}
        self.buffers: list[int] = []                  # one per Program.allocate, then the two graphs'

    # --- persistent tensors --------------------------------------------------------------
    def place(self, prog) -> None:
        """Give every unplaced tensor of the program's static context an address and count its
        bytes, padded as ggml_backend_alloc_ctx_tensors pads them, so that ggml's graph allocator
        sees it allocated, as in a run. Constants (values pending upload: masks, positions, the
        centring matrix the cpu rewrite recognises by its values) get real host memory; everything
        else an address range that is reserved but never touched."""
        ctx = prog._ctx_static
        pending = {int(ffi.cast("uintptr_t", t.ptr)): data for t, data in prog._pending}
        real, fake = [], []
        t = lib.ggml_get_first_tensor(ctx)
        while t != ffi.NULL:
            if lib.th_tensor_data(t) == ffi.NULL:
                size = _pad(int(lib.ggml_backend_buft_get_alloc_size(self.buft, t)), self.align)
                data = pending.get(int(ffi.cast("uintptr_t", t)))
                (real if data is not None else fake).append((t, size, data))
                name = ffi.string(lib.ggml_get_name(t)).decode()
                self.rows[_kind(prog, name)] += size
                self.placed.add(name)
            t = lib.ggml_get_next_tensor(ctx, t)
        if real or fake:    # a run allocates them as one buffer (ggml_backend_alloc_ctx_tensors)
            self.buffers.append(sum(size for _, size, _ in real + fake))
        for group, is_real in ((real, True), (fake, False)):
            total = sum(size for _, size, _ in group)
            if total == 0:
                continue
            if is_real:
                # ggml_backend_cpu_buffer_from_ptr wants TENSOR_ALIGNMENT (32); a device's own
                # alignment may be less (vulkan)
                align = max(self.align, 64)
                host = np.zeros(total + align, np.uint8)
                self._host.append(host)
                base = _pad(host.ctypes.data, align)
            else:
                base = _reserve(total)
                self._regions.append((base, total))
            buf = lib.ggml_backend_cpu_buffer_from_ptr(ffi.cast("void *", base), total)
            self._buffers.append(buf)
            offset = 0
            for tensor, size, data in group:
                lib.ggml_backend_tensor_alloc(buf, tensor, ffi.cast("char *", base) + offset)
                if data is not None:
                    lib.ggml_backend_tensor_set(tensor, ffi.from_buffer(data), 0, data.nbytes)
                offset += size

    # --- graphs --------------------------------------------------------------------------
    def measure_graphs(self, prog, trainer) -> None:
        """The compute buffers a run ends up with: the training graph's as the Trainer reserves it
        (on cpu before the backend's rewrites, placed again only where ggml finds that placement
        invalid for the rewritten graph; on cuda after them) and the evaluation graph's as its
        first compute places it."""
        # What the plan reports about the buffer's contents, read from the graph as its buffer is
        # reserved: on cpu before the backend's rewrites, on cuda after them (the fused
        # attention's forward node then holds O and L, not ggml's (B*H, T, T) probabilities).
        rewritten_first = prog.reserves_rewritten
        if not rewritten_first:
            self._describe(trainer)
        galloc = lib.ggml_gallocr_new(self.buft)
        sizes = ffi.new("size_t[1]")
        try:
            def size(graph) -> int:
                lib.ggml_gallocr_reserve_n_size(galloc, graph, ffi.NULL, ffi.NULL, sizes)
                return int(sizes[0])

            if rewritten_first:
                # on cuda the Trainer reserves the graph as rewritten (Trainer: the fused
                # kernels' nodes never hold what ggml's graph kept for the backward)
                prog._prepare(trainer.gb_opt)
                self._describe(trainer)
                parts = {"train": size(trainer.gb_opt)}
            else:
                parts = {"train": size(trainer.gb_opt)}
                reserved = self._placement(trainer.gb_opt)
                prog._prepare(trainer.gb_opt)
                # A step's first allocation keeps the placement reserved before the rewrite unless
                # ggml finds it invalid for the rewritten graph (ggml_gallocr_needs_realloc, which
                # is static in ggml-alloc.c: replayed here); only then does ggml place it again.
                if self._needs_realloc(trainer.gb_opt, reserved):
                    parts["train_rewritten"] = size(trainer.gb_opt)
            # accumulation's micro-batch graphs share the training graph's allocator: its buffer is
            # the largest of them
            for j, graph in enumerate(getattr(trainer, "gb_micro", [])):
                parts[f"train_micro_{j}"] = size(graph)
            prog._prepare(trainer.eval_graph)
            parts["eval"] = size(trainer.eval_graph)
        finally:
            lib.ggml_gallocr_free(galloc)
        self.compute_parts = parts
        # each graph has its own allocator (Program.galloc_for), whose buffer only grows
        self.rows["compute"] = max(v for k, v in parts.items() if k.startswith("train"))
        self.rows["compute_eval"] = parts["eval"]
        self.buffers += [self.rows["compute"], self.rows["compute_eval"]]
        self.rows["granularity"] = rounding_to_pages(self.buffers, ALLOCATION_GRANULARITY.get(self.engine.backend, 0))
        # Frozen weights bound in place (mmap'd, cpu) were never placed: the file's pages count
        # in RSS once read, which every step does.
        for name, t in prog.frozen.items():
            if name not in self.placed:
                self.rows["frozen_mapped"] += int(lib.ggml_nbytes(t.ptr))
        # Saving a checkpoint reads parameters and moments back to numpy (Trainer.state).
        self.rows["checkpoint"] = 3 * sum(int(lib.ggml_nbytes(p.ptr)) for p in prog.params.values())

    def _slot(self, t) -> int | None:
        """What ggml_gallocr_reserve records for a tensor: its size when the allocator places it,
        None (buffer_id -1) when it is a view or has memory already."""
        if _view_src(t) != ffi.NULL or lib.th_tensor_data(t) != ffi.NULL:
            return None
        return int(lib.ggml_backend_buft_get_alloc_size(self.buft, t))

    def _placement(self, graph) -> tuple:
        nodes = []
        for i in range(lib.ggml_graph_n_nodes(graph)):
            node = lib.ggml_graph_node(graph, i)
            srcs = [lib.th_tensor_src(node, j) for j in range(GGML_MAX_SRC)]
            nodes.append((self._slot(node), [None if s == ffi.NULL else self._slot(s) for s in srcs]))
        return lib.ggml_graph_n_nodes(graph), lib.th_graph_n_leafs(graph), nodes

    def _valid(self, t, recorded: int | None) -> bool:
        if _view_src(t) != ffi.NULL or lib.th_tensor_data(t) != ffi.NULL:
            return True
        return recorded is not None and recorded >= int(lib.ggml_backend_buft_get_alloc_size(self.buft, t))

    def _needs_realloc(self, graph, reserved: tuple) -> bool:
        """ggml_gallocr_needs_realloc (ggml-alloc.c, 0.25.3) for `graph` against a placement
        recorded by `_placement`."""
        n_nodes, n_leafs, nodes = reserved
        if lib.ggml_graph_n_nodes(graph) != n_nodes or lib.th_graph_n_leafs(graph) != n_leafs:
            return True
        for i, (dst, srcs) in enumerate(nodes):
            node = lib.ggml_graph_node(graph, i)
            if not self._valid(node, dst):
                return True
            for j in range(GGML_MAX_SRC):
                src = lib.th_tensor_src(node, j)
                if src != ffi.NULL and not self._valid(src, srcs[j]):
                    return True
        return False

    def _describe(self, trainer) -> None:
        """Forward activations the backward reads (kept alive until then), the logits and their
        gradient, and the two largest tensors of the training graph."""
        forward = {_addr(lib.ggml_graph_node(trainer.gf, i)) for i in range(lib.ggml_graph_n_nodes(trainer.gf))}
        kept: dict[int, int] = {}
        logits: dict[int, int] = {}
        nodes = []
        for i in range(lib.ggml_graph_n_nodes(trainer.gb_opt)):
            node = lib.ggml_graph_node(trainer.gb_opt, i)
            op = ffi.string(lib.ggml_op_desc(node)).decode()
            if op == "CROSS_ENTROPY_LOSS":
                src = _base(lib.th_tensor_src(node, 0))
                logits[_addr(src)] = self._bytes(src)
            elif op == "CROSS_ENTROPY_LOSS_BACK":
                logits[_addr(node)] = self._bytes(node)
            if _addr(node) in forward:
                continue
            for j in range(GGML_MAX_SRC):
                src = lib.th_tensor_src(node, j)
                if src == ffi.NULL:
                    continue
                src = _base(src)
                if _addr(src) in forward and lib.th_tensor_data(src) == ffi.NULL:
                    kept[_addr(src)] = self._bytes(src)
            # (a view holds no memory of its own, whatever its op: the cuda rewrite leaves views
            # of folded nodes as NONE)
            if op not in VIEW_OPS and lib.th_tensor_data(node) == ffi.NULL and _view_src(node) == ffi.NULL:
                kernel = lib.th_kernel_name(node) if "CUSTOM" in op else ffi.NULL
                label = f"{op} ({ffi.string(kernel).decode()})" if kernel != ffi.NULL else op
                nodes.append(Tensorish(label, _shape(node), self._bytes(node)))
        self.activations = sum(kept.values())
        self.logits = sum(logits.values())
        seen, largest = set(), []
        for n in sorted(nodes, key=lambda n: -n.nbytes):
            if (n.op, n.shape) not in seen:
                seen.add((n.op, n.shape))
                largest.append(n)
            if len(largest) == 2:
                break
        self.largest = largest

    def _bytes(self, t) -> int:
        return _pad(int(lib.ggml_backend_buft_get_alloc_size(self.buft, t)), self.align)

    def close(self) -> None:
        for buf in self._buffers:
            lib.ggml_backend_buffer_free(buf)
        self._buffers = []
        for base, size in self._regions:
            _libc().munmap(ctypes.c_void_p(base), ctypes.c_size_t(size))
        self._regions = []
        self._host = []


# struct ggml_tensor of ggml 0.25.3 (ggml.h): type, buffer, ne[4], nb[4], op, op_params[16],
# flags, src[10], view_src, view_offs, data, name[64], ... The shim has no getter for view_src,
# which ggml's allocator tests; its offset is checked against `data` and `name` on first use.
_VIEW_SRC_OFFSET, _DATA_OFFSET, _NAME_OFFSET = 232, 248, 256
_layout_checked = False


def _view_src(t):
    global _layout_checked
    raw = ffi.cast("char *", t)
    if not _layout_checked:
        if (ffi.cast("void **", raw + _DATA_OFFSET)[0] != lib.th_tensor_data(t)
                or ffi.string(raw + _NAME_OFFSET, 64) != ffi.string(lib.ggml_get_name(t))):
            raise RuntimeError("struct ggml_tensor's layout is not ggml 0.25.3's: update memory_plan._VIEW_SRC_OFFSET")
        _layout_checked = True
    return ffi.cast("void **", raw + _VIEW_SRC_OFFSET)[0]


def _addr(t) -> int:
    return int(ffi.cast("uintptr_t", t))


def _base(t):
    """The tensor whose memory a chain of views reads."""
    while ffi.string(lib.ggml_op_desc(t)).decode() in VIEW_OPS and lib.th_tensor_src(t, 0) != ffi.NULL:
        t = lib.th_tensor_src(t, 0)
    return t


def _shape(t) -> tuple[int, ...]:
    ne = ffi.new("int64_t[4]")
    lib.th_tensor_shape(t, ne, ffi.new("size_t[4]"))
    shape = tuple(int(x) for x in reversed(list(ne)))
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _kind(prog, name: str) -> str:
    if name in prog.params:
        return "params"
    if name.startswith(("adamw.m.", "adamw.v.")):
        return "moments"
    if name.startswith("grad.sum."):
        return "accumulators"
    if name.startswith("grad."):
        return "grads"
    if name in prog.frozen:
        return "frozen_uploaded"
    return "inputs"


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def rounding_to_pages(buffers: list[int], page: int) -> int:
    """What a driver that allocates in pages of `page` bytes takes beyond the buffers' sizes: each
    buffer of half a page or more is rounded up to whole pages of its own; smaller ones share pages
    with each other and with the process's own allocations, and count at their sizes. 0 for a
    page of 0."""
    if not page:
        return 0
    return sum(_pad(b, page) - b for b in buffers if b >= page // 2)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mmap.restype = ctypes.c_void_p
        _LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return _LIBC


def _reserve(size: int) -> int:
    """An address range of `size` bytes that no access may touch (PROT_NONE, no swap reserved):
    a planned tensor that something did read would fault at once instead of reading garbage."""
    map_noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000)
    addr = _libc().mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_noreserve, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise DoesNotFit(f"the plan's {fmt_bytes(size)} of persistent tensors do not fit in this process's "
                         f"address space")
    return int(addr)


# --- making a plan -------------------------------------------------------------------------------
def plan_model(recipe: str, pm, engine, options, data) -> MemoryPlan:
    """Realize the recipe in planning mode on `engine` and return its plan (nothing allocated)."""
    from ..seeded_init import shapes_only

    planner = Planner(engine)
    engine.planner = planner
    model = None
    try:
        with shapes_only():
            model = pm.hook.realize(engine=engine, options=options, data=data)
        if getattr(model, "trainer", None) is None:
            raise InputError(f"recipe {recipe}: its model has no trainer to plan")
    finally:
        engine.planner = None
        trainer = getattr(model, "trainer", None)
        if trainer is not None:
            trainer.prog.close()
        planner.close()
    plan = MemoryPlan(recipe, engine.backend, _sizes(options), dict(planner.rows), planner.activations,
                      planner.logits, planner.largest, planner.compute_parts, planner.buffers)
    plan.free, plan.free_what = free_memory(engine)
    if engine.backend == "cuda" and getattr(options, "precision", "fp32") == "bf16":
        # sized by what the products convert as the step runs (native/cuda/th-precision.cu)
        plan.not_counted.append("bf16 copies of the products' operands, a frozen base's bf16 values among "
                                "them (kept for reuse within a step: 2 GiB at gpt2-small, 4 GiB for adapters over "
                                "a 1B base, 0.5 GiB there with recompute_blocks, whose copies go past a horizon "
                                "of nodes; native/README.md, Precision)")
    return plan


def _sizes(options) -> dict[str, Any]:
    d = options.to_dict()
    keys = (*SHOWN_SIZES, *recipe_sizes(options), "recompute_blocks")
    shown = {k: d[k] for k in keys if k in d}
    if d.get("accumulate", 1) != 1:       # shown where it is on (a plan without it reads as before)
        shown["accumulate"] = d["accumulate"]
    return shown


def shrink_suggestions(plan: MemoryPlan, replan: Callable[[dict[str, Any]], MemoryPlan],
                       options) -> list[tuple[str, int]]:
    """The two changes of one option (a size halved, or recompute_blocks on) that save the most,
    as ("key=value", bytes saved), largest first; candidates the recipe refuses are skipped."""
    d = options.to_dict()
    tries: list[dict[str, Any]] = []
    for key in (*SHRINK_SIZES, *recipe_sizes(options)):
        if isinstance(d.get(key), int) and d[key] > 1:
            tries.append({key: d[key] // 2})
    for key in SHRINK_SWITCHES:
        if d.get(key) is False:
            tries.append({key: True})
    found = []
    for change in tries:
        try:
            smaller = replan(change)
        except InputError:
            continue
        saved = plan.total - smaller.total
        if saved > 0:
            found.append((", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items()),
                          saved))
    return sorted(found, key=lambda f: -f[1])[:2]


def refusal(plan: MemoryPlan, suggestions: list[tuple[str, int]]) -> str:
    line = (f"{plan.recipe} needs {fmt_bytes(plan.total)} on {plan.backend}, {fmt_bytes(plan.free or 0)} free "
            f"({plan.free_what})")
    if suggestions:
        line += "; shrink it most with " + " or ".join(f"{s} (-{fmt_bytes(b)})" for s, b in suggestions)
    return line + f"; `toyharness run ... --plan` shows the plan ({CHECK_ENV}=off skips this check)"


def check_enabled() -> bool:
    return switch(CHECK_ENV) == "on"


def check_fits(recipe: str, pm, engine, options, data) -> MemoryPlan | None:
    """Plan the run and refuse it (DoesNotFit, exit 2) when it needs more than the backend has free."""
    if not check_enabled():
        return None
    try:
        plan = plan_model(recipe, pm, engine, options, data)
    except RuntimeError as exc:
        # a recipe whose realize reads or computes values (a third-party plugin) cannot be planned
        # without allocating: say so, and run as before
        print(f"toyharness: note: no memory plan for {recipe} ({exc}); not checked against free memory",
              file=sys.stderr)
        return None
    if not plan.fits:
        def replan(change):
            return plan_model(recipe, pm, engine, dataclasses.replace(options, **change), data)

        raise DoesNotFit(refusal(plan, shrink_suggestions(plan, replan, options)))
    return plan
