"""The training step on a program: its training graph (forward, backward, one AdamW step per
trainable tensor), the moments, and step, evaluation and checkpoint state (Trainer).
Built by `Program.trainer(loss, convention)` (docs/design.md, "The training graph")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .._ffi import GGML_TYPE_F32, ffi, lib
from ..adamw import AdamWRow, HPRow, check_convention
from ..errors import InputError
from . import graph_check, graph_rewrites
from .allocation import allocation_failed, ggml_quiet, graph_buffer_bytes
from .loop_controls import GraphControls, TrainingLoop, decayed_names
from .tensor import Tensor

if TYPE_CHECKING:
    from .losses import CrossEntropy
    from .program import Program

GGML_FLAG_PARAM = 4
GGML_FLAG_LOSS = 8


_VIEW_OPS = ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE")


class Trainer:
    """Forward, backward and one AdamW step per trainable tensor, fed by a 7-float row.

    Every parameter's gradient is the (contiguous) node that computes it, a graph output, not an
    accumulator: an accumulator cost an ADD of the gradient into zeros per parameter and a clear of them
    all per step, and adding a gradient to zeros changes no bit of it. `grad_acc` holds them by name,
    valid after a step or `grads_only` until another graph of the program is computed (the compute
    buffer they are in is then reused). The first step after construction does a full reset (gradients
    and moments); later steps reset gradients only, so the moments carry over.

    `loop` (engine/loop_controls.py; default the program's, which its engine gave it) adds gradient
    accumulation over micro-batches (each `step` call one micro-batch; `gb_micro` the graphs of all
    but a step's last, `controls.accumulators` the sums) and clipping by the global norm
    (`grad_norm` after each step). Weight decay applies to `decayed` (tensors of 2 or more axes);
    the others step on a second row, `hp_no_decay`, the same with weight_decay 0.
    """

    def __init__(self, prog: Program, loss: CrossEntropy, convention: str, loop: TrainingLoop | None = None):
        check_convention(AdamWRow(convention, 0, 0, 0, 0, 0), convention)
        self.prog, self.loss, self.convention = prog, loss, convention
        # accumulation and clipping (engine/loop_controls.py): the program's (its engine's) unless given
        self.loop = loop or prog.training_loop
        if not prog.params:
            raise InputError("the program has no trainable parameters")
        if prog._gemm_rewritten:
            raise InputError("create the Trainer before computing any graph of its program "
                             "(computed graphs have their matrix products rewritten, which have no backward)")
        roots = [loss.train] if loss.report is loss.train else [loss.train, loss.report]
        gf = self._forward_graph(roots)
        accs = self._loss_gradient(gf)
        self.controls = GraphControls(prog, self.loop)
        self._grads_buffer = prog.allocate()
        self._optimizer_state()
        gf, opt_size = self._backward_graph(gf, accs, roots)
        grads = self._keep_gradients()
        self._optimizer_graph(grads, opt_size)
        # accumulation: the first micro-batch's graph copies the gradients into the accumulators, a
        # later one's adds them; gb_opt (the last micro-batch's) steps on the accumulated sum
        self.gb_micro: list = []
        if self.loop.accumulate > 1:
            self.gb_micro = [self._micro_graph(grads, first, opt_size) for first in (True, False)]
        if prog.recompute is not None and prog.recompute.copies:
            from .recompute import apply

            graphs = [self.gb_grad, *self.gb_micro, self.gb_opt]
            if self.gb_micro:      # apply wants a last graph holding every node of the others
                graphs.append(self._union_graph(graphs))
            graphs = apply(prog, gf, graphs)
            self.gb_grad, self.gb_micro, self.gb_opt = graphs[0], graphs[1:1 + len(self.gb_micro)], \
                graphs[1 + len(self.gb_micro)]
        for graph in (self.gb_opt, *self.gb_micro):
            graph_rewrites.fold_cpu_products(prog, graph)
        self.gf = gf
        self.eval_graph = prog._new_graph(prog._forward_size([loss.report]), False)
        lib.ggml_build_forward_expand(self.eval_graph, loss.report.ptr)
        self.eval_graph = graph_rewrites.lowered(prog, self.eval_graph, False)
        graph_check.refuse_unsupported(prog, [self.gb_opt, *self.gb_micro, self.eval_graph,
                                              *([self.gb_apply] if self.gb_apply is not None else [])])
        for graph in self.gb_micro:     # one compute buffer for every training graph: the largest
            prog._gallocs[int(ffi.cast("uintptr_t", graph))] = prog.galloc_for(self.gb_opt)
        self._reserve()
        self.needs_full_reset = True
        self.steps_done = 0
        self.micro = 0                  # the next micro-batch's index within its step
        self._micro_count = 0.0         # the step's count so far, and its count-weighted loss sum
        self._micro_loss = 0.0
        self.step_loss: float | None = None
        self.grad_norm: float | None = None
        self.collective = None          # data parallel: the processes a step is spread over (spread_over)
        self._spread_sum = None         # data parallel: the step's gradients summed so far (flat, host)
        self.reduce = "in_order"

    @property
    def forwards_done(self) -> int:
        """Training forwards computed so far: steps_done * accumulate + the micro-batch index."""
        return self.steps_done * self.loop.accumulate + self.micro

    def _forward_graph(self, roots: list[Tensor]):
        gf = self.prog._new_graph(self.prog._forward_size(roots), False)
        for t in roots:
            lib.ggml_build_forward_expand(gf, t.ptr)
        return gf

    def _loss_gradient(self, gf):
        """The gradient accumulators ggml_build_backward_expand takes, by node of `gf`: one for
        the loss, persistent, in a backend buffer of its own (one left to the graph allocator is
        overwritten after step 0 and training silently stalls); a parameter's gradient is the
        node that computes it, kept as a graph output. Refuses a parameter the loss does not use."""
        prog = self.prog
        n = lib.ggml_graph_n_nodes(gf)
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
        return accs

    def _optimizer_state(self) -> None:
        """The AdamW row (fed each step) and both moments of every parameter, persistent."""
        prog = self.prog
        self._one = ffi.new("float *", 1.0)
        self._loss_out = ffi.new("float[1]")
        self._hp_row = ffi.new("float[7]")
        self.hp = prog._new_static("adamw.hp", (7,), GGML_TYPE_F32)
        lib.ggml_set_input(self.hp.ptr)
        # weight decay on matrices only (loop_controls.decays): the others step on a second row, the
        # same with weight_decay 0
        self.decayed = decayed_names(prog.params)
        self.hp_no_decay = None
        if len(self.decayed) < len(prog.params):
            self._hp_row_no_decay = ffi.new("float[7]")
            self.hp_no_decay = prog._new_static("adamw.hp_no_decay", (7,), GGML_TYPE_F32)
            lib.ggml_set_input(self.hp_no_decay.ptr)
        self.controls.make_state()
        self._count_in = ffi.new("float *", 1.0)
        self.m: dict[str, Tensor] = {}
        self.v: dict[str, Tensor] = {}
        for name, p in prog.params.items():
            self.m[name] = prog._new_static(f"adamw.m.{name}"[:63], p.shape, GGML_TYPE_F32)
            self.v[name] = prog._new_static(f"adamw.v.{name}"[:63], p.shape, GGML_TYPE_F32)
        prog.allocate()

    def _backward_graph(self, gf, accs, roots: list[Tensor]):
        """gb_grad: gf and its backward, with column sums as products and the lowering applied.
        Returns gf (built again where the lowering rewrote its nodes) and the optimizer graph's size."""
        prog, ctx = self.prog, self.prog._ctx_compute
        # Each graph sized to what it holds (a copy needs at least its source's size): the
        # backward's from a count in a scratch context, plus a cont per parameter (its gradient
        # is a graph output); AdamW adds per parameter at most a cont and its step
        # (nodes), m and v (leafs), and the row (one leaf).
        grad_size, made = prog._backward_size(gf, accs)
        conts = len(prog.params)
        grad_size, made = max(grad_size, lib.ggml_graph_size(gf)) + conts, made + conts
        opt_size = grad_size + 2 * len(prog.params) + 1 + self._extra_leafs()
        prog._check_room(made * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(grad_size, True)
                         + lib.ggml_graph_overhead_custom(opt_size, True), "the backward graph")
        self.gb_grad = prog._new_graph(grad_size, True)
        lib.ggml_graph_cpy(gf, self.gb_grad)
        lib.ggml_build_backward_expand(ctx, self.gb_grad, accs)
        self.gb_grad = graph_check.cont_strided_operands(prog, self.gb_grad, True)
        opt_size = max(opt_size, lib.ggml_graph_size(self.gb_grad) + 2 * len(prog.params) + 1 + self._extra_leafs())
        if prog.column_sums_as_products:
            graph_rewrites.column_sums_as_products(prog, self.gb_grad)
        lowered = graph_rewrites.lowered(prog, self.gb_grad, True)
        if lowered != self.gb_grad:
            # nodes of gf were rewritten in place: gf again, with the nodes they now read
            self.gb_grad, gf = lowered, self._forward_graph(roots)
            opt_size = max(opt_size, lib.ggml_graph_size(self.gb_grad) + 2 * len(prog.params) + 1 + self._extra_leafs())
        graph_rewrites.keep_softmax_for_backward(prog, self.gb_grad)     # before any allocator places it
        return gf, opt_size

    def _extra_leafs(self) -> int:
        """What the second AdamW row and the loop's controls add to the optimizer graph."""
        return (self.hp_no_decay is not None) + GraphControls.extra_nodes(len(self.prog.params), self.loop)

    def _keep_gradients(self) -> dict:
        """Each parameter's gradient node, made a contiguous graph output (grad_acc holds it)."""
        prog, ctx = self.prog, self.prog._ctx_compute
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
        return grads

    def _optimizer_graph(self, grads: dict, opt_size: int) -> None:
        """gb_opt: gb_grad and one AdamW step per parameter (on the accumulated and clipped
        gradient where the loop's controls are on). Data parallel, also gb_apply: those steps alone,
        on the fed last micro-batch's gradients (engine/data_parallel.py)."""
        prog = self.prog
        self._check_controls_room()
        self.gb_opt = prog._new_graph(opt_size, True)
        lib.ggml_graph_cpy(self.gb_grad, self.gb_opt)
        self._add_steps(self.gb_opt, grads)
        self.gb_apply = None
        if self.loop.devices > 1:
            self._check_controls_room()
            self.gb_apply = prog._new_graph(12 * len(prog.params) + 64, False)
            self._add_steps(self.gb_apply, {name: t.ptr for name, t in self.controls.last_gradients.items()})

    def _add_steps(self, graph, grads: dict) -> None:
        """The loop's controls on `grads` (node by parameter name), then AdamW's steps, into `graph`."""
        prog, ctx = self.prog, self.prog._ctx_compute
        stepped = self.controls.step_gradients(ctx, grads)
        decayed = set(self.decayed)
        # the decayed tensors' steps, then the others': each row's steps consecutive, so that the
        # cuda rewrite takes each as one run (native/cuda_rewrite/adamw_runs.c); the order of
        # independent steps changes no bit
        order = [*self.decayed, *(n for n in prog.params if n not in decayed)]
        if not self.loop.is_default:
            # the controls' nodes (sums, scale, clip) all before the first step: the steps stay
            # consecutive (the cuda rewrite's runs)
            for name in order:
                lib.ggml_build_forward_expand(graph, stepped[name])
        for name in order:
            p = prog.params[name]
            grad = stepped[name]
            if not lib.ggml_is_contiguous(grad):
                grad = lib.ggml_cont(ctx, grad)
            row = self.hp if name in decayed else self.hp_no_decay
            step = lib.ggml_opt_step_adamw(ctx, p.ptr, grad, self.m[name].ptr, self.v[name].ptr, row.ptr)
            lib.ggml_build_forward_expand(graph, step)

    def _check_controls_room(self) -> None:
        """Room in the compute context for one graph's control nodes (ggml aborts when it runs out)."""
        extra = GraphControls.extra_nodes(len(self.prog.params), self.loop)
        if extra:
            self.prog._check_room(extra * lib.ggml_tensor_overhead(), "the training loop's controls")

    def _micro_graph(self, grads: dict, first: bool, size: int):
        """A micro-batch's graph before the step's last: gb_grad, then its gradients copied (the
        first) or added (later ones) into the accumulators."""
        prog = self.prog
        self._check_controls_room()
        graph = prog._new_graph(size, True)
        lib.ggml_graph_cpy(self.gb_grad, graph)
        for node in self.controls.into_accumulators(prog._ctx_compute, grads, first):
            lib.ggml_build_forward_expand(graph, node)
        return graph

    def _union_graph(self, graphs: list):
        """Every node of `graphs` in one graph (for recompute.apply, which rewires reads in its last)."""
        prog = self.prog
        union = prog._new_graph(sum(lib.ggml_graph_size(g) for g in graphs), True)
        lib.ggml_graph_cpy(self.gb_opt, union)
        for graph in graphs:
            for i in range(lib.ggml_graph_n_nodes(graph)):
                lib.ggml_build_forward_expand(union, lib.ggml_graph_node(graph, i))
        return union

    def _reserve(self) -> None:
        """The training graph's compute buffer, reserved now (in a memory plan, measured only)."""
        prog = self.prog
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

        With accumulation (`loop.accumulate` K > 1) each call is one micro-batch of the step, in
        order: the K-th runs AdamW, and `step_loss` is then the step's loss (the count-weighted
        mean of its micro-batches'); each call returns its own micro-batch's loss.
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
        if self.collective is not None:
            return self._spread_step(feeds, row)
        k, last = self.micro, self.micro == self.loop.accumulate - 1
        count = self.micro_count(feeds) if self.loop.accumulate > 1 else 1.0
        self.prog.feed(feeds)
        self.prog.set_dropout(self._forward_index(), True)
        if last:
            self._feed_rows(row)
        if self.needs_full_reset:
            self.reset_full()
            self.needs_full_reset = False
        else:
            self.reset_grads()
        if self.loop.accumulate == 1:
            self.prog._compute(self.gb_opt)
        else:
            # the loss gradient seeded with the micro-batch's count: its gradients are sums
            self._count_in[0] = count
            lib.ggml_backend_tensor_set(self._loss_grad, self._count_in, 0, 4)
            if k == 0:
                self._micro_count, self._micro_loss = 0.0, 0.0
            self._micro_count += count
            if last:
                self._count_in[0] = 1.0 / self._micro_count
                lib.ggml_backend_tensor_set(self.controls.inv_count.ptr, self._count_in, 0, 4)
            self.prog._compute(self.gb_opt if last else self.gb_micro[0 if k == 0 else 1])
        loss = self.loss_value()
        self._micro_loss += count * loss
        self.micro = 0 if last else k + 1
        if last:
            self.steps_done += 1
            self.step_loss = loss if self.loop.accumulate == 1 else self._micro_loss / self._micro_count
            self.grad_norm = self._read_grad_norm()
        return loss

    def spread_over(self, collective, reduce: str = "in_order") -> None:
        """Data parallel (engine/data_parallel.py): from now on each `step` call is this process's
        micro-batch of a round, number `collective.rank` of `collective.size`, the trainer built
        with that many devices (TrainingLoop.devices); a step is accumulate / devices calls, and every
        process steps the same parameters.
        `reduce`: "in_order" (accumulation's bits) or "allreduce" (the collective's sum)."""
        if self.gb_apply is None or collective.size != self.loop.devices:
            raise InputError(f"a trainer built for {self.loop.devices} device(s) cannot be spread over "
                             f"{collective.size} processes")
        if reduce not in ("in_order", "allreduce"):
            raise InputError(f"option 'gradient_reduce': {reduce!r}; allowed: in_order, allreduce")
        self.collective, self.reduce = collective, reduce

    def _spread_step(self, feeds: dict[str, np.ndarray], row: list[float]) -> float:
        """One micro-batch of a data-parallel step (engine/data_parallel.py), this process's of the
        round: its gradients, every process's gathered and added in micro-batch order as
        accumulation adds them (data_parallel.sum_in_order); in the step's last round, gb_apply, the
        last micro-batch's graph's controls and AdamW steps on them: the bits of one process
        accumulating the same micro-batches."""
        from .data_parallel import sum_in_order

        prog, dp, acc = self.prog, self.collective, self.controls.accumulators
        rounds = self.loop.accumulate // dp.size
        k = self.micro // dp.size                   # this round; the micro-batch is k * size + rank
        last_round = k == rounds - 1
        count = self.micro_count(feeds)
        self.micro = k * dp.size + dp.rank
        prog.feed(feeds)
        prog.set_dropout(self._forward_index(), True)
        if self.needs_full_reset:
            self.reset_full()
            self.needs_full_reset = False
        else:
            self.reset_grads()
        self._count_in[0] = count        # the loss gradient seeded with the count: gradients are sums
        lib.ggml_backend_tensor_set(self._loss_grad, self._count_in, 0, 4)
        prog._compute(self.gb_micro[0])             # this micro-batch's gradients, into the accumulators
        loss = self.loss_value()
        names = list(prog.params)
        parts = [prog.read(acc[n]) for n in names]
        mine = np.concatenate([part.reshape(-1) for part in parts])
        if k == 0:
            self._spread_sum, self._micro_count, self._micro_loss = None, 0.0, 0.0
        for c, micro_loss in dp.allgather(np.array([count, loss], np.float64)):     # in micro-batch order
            self._micro_count += float(c)
            self._micro_loss += float(c) * float(micro_loss)
        if self.reduce == "allreduce":      # this process's own sum; MPI's sum of those in the last round
            self._spread_sum = mine if self._spread_sum is None else np.add(mine, self._spread_sum)
        else:
            self._spread_sum, last = sum_in_order(dp.allgather(mine), self._spread_sum, keep_last=last_round)
        if not last_round:
            self.micro = (k + 1) * dp.size
            return loss
        if self.reduce == "allreduce":
            before_last = dp.allreduce_sum(self._spread_sum)
            last = np.zeros_like(before_last)
        else:
            before_last = self._spread_sum
        at = 0
        for n, part in zip(names, parts):
            prog.write(acc[n], before_last[at:at + part.size].reshape(part.shape))
            prog.write(self.controls.last_gradients[n], last[at:at + part.size].reshape(part.shape))
            at += part.size
        self._count_in[0] = 1.0 / self._micro_count
        lib.ggml_backend_tensor_set(self.controls.inv_count.ptr, self._count_in, 0, 4)
        self._feed_rows(row)
        prog._compute(self.gb_apply)
        self.grad_norm = self._read_grad_norm()
        prog._place(self.gb_micro[0])       # its own buffer, untouched: a recipe reads the step's values there
        self.micro, self._spread_sum = 0, None
        self.steps_done += 1
        self.step_loss = self._micro_loss / self._micro_count
        return loss

    def micro_count(self, feeds: dict[str, np.ndarray]) -> float:
        """What a micro-batch counts: the positions its loss's mask counts (the mask's sum), else its
        rows (equal for every micro-batch: a scalar loss counts 1)."""
        mask = self.loss.mask
        if mask is None or mask not in feeds:
            return float(self.loss.rows)
        counted = float(np.sum(np.asarray(feeds[mask], dtype=np.float64)))
        if not counted > 0:
            raise InputError(f"accumulate={self.loop.accumulate}: micro-batch {self.micro} of step "
                             f"{self.steps_done} counts no position of its loss (its {mask!r} is all 0); "
                             "use fewer micro-batches or more rows each")
        return counted

    def _feed_rows(self, row: list[float]) -> None:
        self._hp_row[0:7] = row
        lib.ggml_backend_tensor_set(self.hp.ptr, self._hp_row, 0, 7 * 4)
        if self.hp_no_decay is not None:
            self._hp_row_no_decay[0:7] = row
            self._hp_row_no_decay[4] = 0.0
            lib.ggml_backend_tensor_set(self.hp_no_decay.ptr, self._hp_row_no_decay, 0, 7 * 4)

    def _read_grad_norm(self) -> float | None:
        """The step's global gradient norm before clipping (grad_clip on), else None."""
        if self.controls.norm is None:
            return None
        out = ffi.new("float[1]")
        lib.ggml_backend_tensor_get(self.controls.norm, out, 0, 4)
        return float(out[0])

    def _forward_index(self) -> int:
        """The training forward about to run, counted from 0 over the run: the dropout stream's
        counter (engine/dropout.py), so a resumed run draws the masks of the uninterrupted one, and
        each micro-batch of an accumulated step draws its own."""
        return self.forwards_done

    def grads_only(self, feeds: dict[str, np.ndarray]) -> float:
        """Forward and backward without the AdamW step (gradients land in the accumulators)."""
        self.prog.feed(feeds)
        self.prog.set_dropout(self._forward_index(), True)
        self.reset_grads()
        self.prog._compute(self.gb_grad)
        return self.loss_value()

    def eval_loss(self, feeds: dict[str, np.ndarray]) -> float:
        """The reported loss on a batch, forward only: parameters and moments untouched."""
        self.prog.feed(feeds)
        self.prog.set_dropout(0, False)      # evaluation: every mask 1, the bits of no dropout
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
        self.micro = 0
