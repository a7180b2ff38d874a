"""The losses a program trains on: cross-entropy (plain, masked, or chunked over the vocabulary)
and any scalar, and each position's log-probability of its target (what preference losses are
made of). Each builds its nodes in the program's compute context and returns a
CrossEntropy: the tensor the backward starts from and a thread-invariant one to report."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .._ffi import GGML_TYPE_F32, GGML_TYPE_I32, ffi, lib
from ..errors import BackendError, ShapeError
from .host_values import FedTargets
from .tensor import Tensor


@dataclass
class CrossEntropy:
    """`train` drives the backward (ggml's op); `report` is the same loss, thread-invariant (on the
    cpu fast path the same tensor: our kernel's train loss is invariant already)."""

    train: Tensor
    report: Tensor
    targets: str
    # what a micro-batch of gradient accumulation counts (engine/loop_controls.py): its rows, or the
    # positions the f32 input named `mask` counts (its sum, from the feeds)
    rows: int = 1
    mask: str | None = None


class LossBuilders:
    """Program's loss methods (Program inherits them); they declare the targets each loss is fed."""

    def _new_targets(self, logits: Tensor, targets: str, op: str,
                     onehot: bool = True) -> tuple[FedTargets, Tensor | None]:
        """The one-hot rows and flat indices that class ids fed as `targets` become, and the
        one-hot tensor the loss reads (on a device, made in the graph from the indices). With
        `onehot` False only the flat indices (row r's: r V + its id, distinct rows by
        construction): what a loss that picks each row's target by GET_ROWS reads."""
        self._check_new_name(targets)
        if logits.type != GGML_TYPE_F32:
            raise ShapeError(f"{op}: logits must be f32, got {logits!r}")
        vocab = logits.shape[-1]
        rows = math.prod(logits.shape[:-1])
        if rows * vocab >= 2 ** 31:    # the flat index into the rows' logits is an i32
            raise ShapeError(f"{op}: {rows} rows x {vocab} classes is too many for i32 indices")
        flat = self._new_static(f"{targets}.flat", (rows,), GGML_TYPE_I32)
        lib.ggml_set_input(flat.ptr)
        if not onehot:
            self._targets[targets] = tg = FedTargets(tuple(logits.shape[:-1]), vocab, None, flat, in_graph=True)
            return tg, None
        onehot = self._new_static(f"{targets}.onehot", (rows, vocab), GGML_TYPE_F32)
        lib.ggml_set_input(onehot.ptr)
        tg = self._targets[targets] = FedTargets(tuple(logits.shape[:-1]), vocab, onehot, flat,
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
            return CrossEntropy(named, named, targets, rows)
        picked = logits2.softmax().reshape(rows * vocab, 1).get_rows(flat)
        report = picked.log().sum().scale(-1.0 / rows)
        lib.ggml_set_output(report.ptr)
        return CrossEntropy(train.named(f"{targets}.loss"), report.named(f"{targets}.loss_report"), targets, rows)

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
                            targets, rows, mask)

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
                            targets, rows, mask)

    def token_logps(self, logits: Tensor, targets: str, mask: str) -> Tensor:
        """Each position's log-probability of its target where the f32 input `mask` is 1, and 0
        where it is 0: logits (R, T, V), integer targets fed as `targets` and `mask` fed by name,
        both (R, T) -> (R, T). What preference losses are built from: summed over a row's
        completion (``(logps * completion).sum_rows()``), a sequence's log-likelihood.

        log p is the log of the target's softmax probability, picked by GET_ROWS at the row's flat
        index (no one-hot rows: on a 128k vocabulary those and their product were two more
        rows x vocab tensors), taken as log(p m + 1 - m), so that a masked position (padding)
        adds 0 and gets no gradient. Called again with the same `targets` and `mask` (another
        model's logits of the same rows) it reads the same fed inputs. A counted target whose
        probability underflows float32 (log p below about -87) gives -inf: a loss the run
        stops on."""
        if logits.ndim != 3:
            raise ShapeError(f"token_logps: logits must be (rows, positions, vocab), got {logits.shape}")
        # a second model's logits of the same rows (a reference policy) read the same fed targets
        made = self.__dict__.setdefault("_token_targets", {})
        if (targets, mask) in made:
            tg, m = made[targets, mask]
            if (*tg.shape, tg.vocab) != logits.shape:
                raise ShapeError(f"token_logps: logits {logits.shape} differ from the {(*tg.shape, tg.vocab)} that "
                                 f"targets {targets!r} were declared for")
            if tg.chunk:
                raise ShapeError(f"token_logps: targets {targets!r} were declared for head_token_logps's pieces")
        else:
            tg, _ = self._new_targets(logits, targets, "token_logps", onehot=False)
            m = self.input(mask, tg.shape, "f32").reshape(math.prod(tg.shape), 1)
            made[targets, mask] = tg, m
        (rows, seq), vocab = tg.shape, tg.vocab
        picked = logits.reshape(rows * seq, vocab).softmax().reshape(rows * seq * vocab, 1).get_rows(tg.flat_index)
        logp = (picked * m + m.scale_bias(-1.0, 1.0)).log()
        return logp.reshape(rows, seq).named(f"{targets}.logps")

    def head_token_logps(self, head: Callable[[Tensor], Tensor], h: Tensor, vocab: int, targets: str, mask: str,
                         chunk: int, recompute: bool = True) -> Tensor:
        """token_logps of ``head(h)``, the logits of hidden states h (R, T, d) (`head` maps (n, d)
        to (n, vocab)), `chunk` positions at a time: each piece's logits, softmax and pick built
        apart and, with `recompute`, recomputed in the backward (engine/recompute.py; the program
        recomputes: Program.enable_recompute), so that one piece's rows x vocab tensors are alive
        at a time, not every position's. Each position's value is made by token_logps's ops on its
        own row. `recompute` False: a forward no gradient flows through (a reference policy's),
        whose pieces die within the forward anyway. Called again with the same `targets` and
        `mask` (another model's hidden states of the same rows) it reads the same fed inputs."""
        if h.ndim != 3:
            raise ShapeError(f"head_token_logps: hidden states must be (rows, positions, d), got {h.shape}")
        rows, seq, d = h.shape
        n = rows * seq
        if not 0 < chunk:
            raise ShapeError(f"head_token_logps: chunk must be > 0 positions, got {chunk}")
        chunk = min(chunk, n)
        made = self.__dict__.setdefault("_token_targets", {})
        if (targets, mask) in made:
            tg, m = made[targets, mask]
            if (tg.shape, tg.vocab, tg.chunk) != ((rows, seq), vocab, chunk):
                raise ShapeError(f"head_token_logps: {(rows, seq)} positions of {vocab} classes in pieces of {chunk} "
                                 f"differ from the {tg.shape}, {tg.vocab}, {tg.chunk} that targets {targets!r} were "
                                 "declared for")
        else:
            self._check_new_name(targets)
            if chunk * vocab >= 2 ** 31:    # the flat index into a piece's logits is an i32
                raise ShapeError(f"head_token_logps: {chunk} positions x {vocab} classes is too many for i32 "
                                 "indices; use smaller pieces")
            flat = self._new_static(f"{targets}.flat", (n,), GGML_TYPE_I32)
            lib.ggml_set_input(flat.ptr)
            tg = self._targets[targets] = FedTargets((rows, seq), vocab, None, flat, in_graph=True, chunk=chunk)
            m = self.input(mask, (rows, seq), "f32").reshape(n, 1)
            made[targets, mask] = tg, m

        def picked(hc: Tensor, ids: Tensor) -> Tensor:
            logits = head(hc)
            if logits.shape != (hc.shape[0], vocab):
                raise ShapeError(f"head_token_logps: the head gave {logits.shape} for {hc.shape[0]} positions, "
                                 f"expected {(hc.shape[0], vocab)}")
            return logits.softmax().reshape(hc.shape[0] * vocab, 1).get_rows(ids)

        from .recompute import recomputed_block

        flat_h, pieces = h.reshape(n, d), []
        for start in range(0, n, chunk):
            length = min(chunk, n - start)
            # distinct ids by construction, as the whole .flat tensor's (the cuda scatter reads the name)
            ids = tg.flat_index if length == n else tg.flat_index.narrow(0, start, length).named(
                f"{targets}.{start}.flat")
            hc = flat_h.narrow(0, start, length)
            p = recomputed_block(picked, hc, ids, always=True) if recompute else picked(hc, ids)
            mc = m.narrow(0, start, length)
            pieces.append((p * mc + mc.scale_bias(-1.0, 1.0)).log())
        return pieces[0].concat(pieces[1:], axis=0).reshape(rows, seq).named(f"{targets}.logps")

    def scalar_loss(self, value: Tensor, name: str = "loss") -> CrossEntropy:
        """Train on any scalar (tests, custom objectives); it is also what `step` reports."""
        if value.numel() != 1 or value.type != GGML_TYPE_F32:
            raise ShapeError(f"scalar_loss: need an f32 scalar, got {value!r}")
        lib.ggml_set_loss(value.ptr)
        lib.ggml_set_output(value.ptr)
        return CrossEntropy(value.named(name), value, name)
