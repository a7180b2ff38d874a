"""Preference training (DPO, ORPO) around a language-model recipe's forward: `PreferenceModel`.

A batch of t_batch pairs is one forward of 2 * t_batch rows, each pair's chosen and rejected side
next to each other (TRL's concatenated forward). From the logits the graph takes each row's
log-probability of its targets (`Program.token_logps`) and sums it over the completion
(`PairLogps`); a recipe's `loss` turns those into the scalar the trainer steps on, and its
`metrics` the same values, read back after the step, into what it logs.

With the option ``logits_chunk`` N > 0 the recipe's `hidden` and `head` are used instead of its
`forward`, and the head's logits are made N positions at a time and recomputed in the backward
(Program.head_token_logps): on a large vocabulary the logits of every position, their softmax and
their gradients are most of a step's memory.

The reference policy (DPO) is the recipe's forward over `reference_params`, the same frozen
tensors with the adapters left out: with ``reference="in_step"`` it is a second forward in the same
step's graph (no trainable tensor in it, so no gradient); with ``reference="precomputed"`` its
log-probabilities are computed once over every pair, forward only, before the first step, and fed
with each batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

from ._ffi import ffi, lib
from .engine import Program, Tensor
from .errors import InputError
from .lm import head_in_pieces

REFERENCE_MODES = ("in_step", "precomputed")


@dataclass
class PairLogps:
    """A batch's per-pair values, each (t_batch,) f32 tensors (numpy arrays once read back).

    `chosen`/`rejected`: the summed log-probability of each side's completion; `chosen_count`/
    `rejected_count`: its tokens; `chosen_all`/`chosen_all_count`: the same over every target of
    the chosen side, prompt included (ORPO's NLL); `ref_chosen`/`ref_rejected`: the reference
    policy's completion log-probabilities (None without a reference)."""

    chosen: Tensor
    rejected: Tensor
    chosen_count: Tensor
    rejected_count: Tensor
    chosen_all: Tensor
    chosen_all_count: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None


def _sides(rows: Tensor, pairs: int) -> tuple[Tensor, Tensor]:
    """(2 * pairs, 1) row values, chosen and rejected alternating, as two (pairs,) tensors."""
    both = rows.reshape(pairs, 2)
    return both.narrow(1, 0, 1).reshape(pairs), both.narrow(1, 1, 1).reshape(pairs)


class PreferenceModel:
    """A recipe's forward, its per-pair log-probabilities, a preference loss and its trainer, on one
    program. `loss(values: PairLogps) -> Tensor` builds the scalar loss; `metrics(values: dict of
    numpy arrays, by PairLogps's field names) -> dict[str, float]` what a step and an evaluation log
    beside it. `reference`: None (no reference policy), "in_step" or "precomputed"."""

    def __init__(self, recipe, engine, options, vocab: int, params: dict[str, np.ndarray], data,
                 loss: Callable[[PairLogps], Tensor], metrics: Callable[[dict[str, np.ndarray]], dict[str, float]],
                 reference: str | None = None):
        if reference not in (None, *REFERENCE_MODES):
            raise InputError(f"option 'reference': {reference!r}; allowed: {', '.join(REFERENCE_MODES)}")
        if not getattr(data, "preference", False):
            raise InputError(f"recipe {recipe.name}: trains on preference pairs (a JSONL file of "
                             "{\"prompt\", \"chosen\", \"rejected\"}); the data given is not")
        self.recipe, self.options, self.vocab, self.data = recipe, options, vocab, data
        self.metrics_of, self.reference = metrics, reference
        self.pairs = pairs = options.t_batch
        rows, seq = 2 * pairs, options.t_seq
        self.prog: Program = engine.program()
        if getattr(options, "recompute_blocks", False):
            self.prog.enable_recompute()
        chunk = getattr(options, "logits_chunk", 0)
        if chunk:
            head_in_pieces(recipe, self.prog)
        self.P = recipe.build_params(self.prog, options, vocab, params, True)
        self.tokens = self.prog.input("tokens", (rows, seq), "i32", upper=vocab)
        self.positions = self.prog.constant("positions", np.arange(seq, dtype=np.int32))
        completion = self.prog.input("completion", (rows, seq), "f32")

        def row_logps(P, trained: bool = True) -> tuple[Tensor, Tensor]:
            """(completion's summed log-probs, every target's), each (rows, 1)."""
            if chunk:
                h = recipe.hidden(P, self.tokens, self.positions, options)
                if h.ndim != 3 or h.shape[:2] != (rows, seq):
                    raise InputError(f"recipe {recipe.name}: hidden gave {h.shape}, expected ({rows}, {seq}, d)")
                tok = self.prog.head_token_logps(lambda x: recipe.head(P, x, options), h, vocab, "targets", "valid",
                                                 chunk, recompute=trained)
            else:
                logits = recipe.forward(P, self.tokens, self.positions, options)
                if logits.shape != (rows, seq, vocab):
                    raise InputError(f"recipe {recipe.name}: forward gave logits {logits.shape}, expected "
                                     f"{(rows, seq, vocab)}")
                tok = self.prog.token_logps(logits, "targets", "valid")
            return (tok * completion).sum_rows(), tok.sum_rows()

        policy, policy_all = row_logps(self.P)
        counts = completion.sum_rows()
        valid_counts = self.prog.inputs["valid"].tensor.sum_rows()
        # read back after each step (metrics): kept as outputs, so no later node reuses their memory
        self._readouts: dict[str, Tensor] = {"policy": policy, "policy_all": policy_all, "counts": counts,
                                             "valid_counts": valid_counts}
        chosen, rejected = _sides(policy, pairs)
        chosen_count, rejected_count = _sides(counts, pairs)
        chosen_all, _ = _sides(policy_all, pairs)
        chosen_all_count, _ = _sides(valid_counts, pairs)
        values = PairLogps(chosen, rejected, chosen_count, rejected_count, chosen_all, chosen_all_count)
        self._ref_graph = None
        self.ref_table: np.ndarray | None = None
        if reference is not None:
            ref_params = recipe.reference_params(self.P)
            if reference == "in_step":
                ref, _ = row_logps(ref_params, trained=False)
                self._readouts["ref"] = ref
            else:
                self._ref_rows, _ = row_logps(ref_params, trained=False)   # once, forward only (precompute)
                ref = self.prog.input("ref_logps", (rows, 1), "f32")
            values.ref_chosen, values.ref_rejected = _sides(ref, pairs)
        for t in self._readouts.values():     # the allocator keeps an output's memory for reading
            lib.ggml_set_output(t.ptr)
        self.loss = self.prog.scalar_loss(loss(values), f"{recipe.name}.loss")
        # a value the loss does not use is not computed by its graphs: not read back either
        graph = self.prog._new_graph(self.prog._forward_size([self.loss.train]), False)
        lib.ggml_build_forward_expand(graph, self.loss.train.ptr)
        used = {int(ffi.cast("uintptr_t", lib.ggml_graph_node(graph, i))) for i in range(lib.ggml_graph_n_nodes(graph))}
        self._readouts = {k: t for k, t in self._readouts.items() if int(ffi.cast("uintptr_t", t.ptr)) in used}
        self.convention = options.adamw_convention
        self.trainer = self.prog.trainer(self.loss, self.convention)

    # --- the reference, precomputed ------------------------------------------------------------
    def precompute_reference(self) -> np.ndarray:
        """The reference policy's completion log-probabilities of every kept pair, [pairs, 2],
        forward only, t_batch pairs at a time (the last batch filled with repeats)."""
        if self.ref_table is None:
            data, n = self.data, self.data.n_pairs
            if self._ref_graph is None:
                self._ref_graph = self.prog.forward({"ref": self._ref_rows})
            table = np.zeros((n, 2), np.float32)
            for start in range(0, n, self.pairs):
                pick = (start + np.arange(self.pairs)) % n
                out = self._ref_graph.run(self._program_feeds(data.rows(pick)))["ref"].reshape(self.pairs, 2)
                got = min(self.pairs, n - start)
                table[start:start + got] = out[:got]
            self.ref_table = table
        return self.ref_table

    # --- steps ---------------------------------------------------------------------------------
    def _program_feeds(self, batch: dict) -> dict:
        rows = 2 * self.pairs
        return {name: np.ascontiguousarray(batch[name]).reshape(rows, -1)
                for name in ("tokens", "targets", "completion", "valid")}

    def feeds(self, batch: dict) -> dict:
        """A batch of pairs ([pairs, 2, t_seq] arrays) as the program's (2 * pairs, t_seq) inputs."""
        missing = [k for k in ("tokens", "targets", "completion", "valid", "pairs") if k not in batch]
        if missing:
            raise InputError(f"a preference batch needs {', '.join(missing)} (toyharness/data/preference.py)")
        feeds = self._program_feeds(batch)
        if self.reference == "precomputed":
            table = self.precompute_reference()
            feeds["ref_logps"] = table[np.asarray(batch["pairs"], np.int64)].reshape(2 * self.pairs, 1)
        return feeds

    def read_values(self) -> dict[str, np.ndarray]:
        """The last computed step's or evaluation's per-pair values (PairLogps's names), float32:
        those the loss uses (the others are not computed)."""
        got = {name: self.prog.read(t).reshape(self.pairs, 2) for name, t in self._readouts.items()}
        names = {"policy": ("chosen", "rejected"), "counts": ("chosen_count", "rejected_count"),
                 "policy_all": ("chosen_all", None), "valid_counts": ("chosen_all_count", None),
                 "ref": ("ref_chosen", "ref_rejected")}
        out = {}
        for key, value in got.items():
            for side, name in enumerate(names[key]):
                if name is not None:
                    out[name] = value[:, side]
        return out

    def _metrics(self, feeds: dict) -> dict[str, float]:
        values = self.read_values()
        if self.reference == "precomputed":
            ref = feeds["ref_logps"].reshape(self.pairs, 2)
            values["ref_chosen"], values["ref_rejected"] = ref[:, 0], ref[:, 1]
        return {k: float(v) for k, v in self.metrics_of(values).items()}

    def step(self, batch: dict, hp) -> dict[str, float]:
        feeds = self.feeds(batch)
        loss = self.trainer.step(feeds, hp)
        return {"loss": loss, **self._metrics(feeds)}

    def evaluate(self, batch: dict) -> dict[str, float]:
        feeds = self.feeds(batch)
        loss = self.trainer.eval_loss(feeds)
        # the eval graph computes the loss's nodes (the readouts among them)
        return {"loss": loss, **self._metrics(feeds)}

    def params(self) -> dict[str, np.ndarray]:
        return {name: self.prog.read(t) for name, t in self.prog.params.items()}


PAIR_FIELDS = tuple(f.name for f in fields(PairLogps))
