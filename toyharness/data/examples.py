"""Tokenized examples and the rows a step trains on (one example a row, or packed).

The examples are three flat arrays, O(tokens): every example's ids one after another (`ids`,
int32), whether predicting each id counts in the loss (`counts`, uint8), and where each example
starts (`offsets`, int64, one more than there are examples). Rows are made from them batch by
batch, never held whole.

An example of n ids gives k = min(n - 1, t_seq) positions: inputs ids[:k], targets ids[1:k+1]
(an example longer than t_seq + 1 ids is cut at the end and counted as truncated). An example
none of whose k targets counts is dropped. The last 10% of the examples kept (at least one) are
the held-out split.

- ``pack=false``: each example is one row of t_seq positions, padded at the end; padding never
  counts.
- ``pack=true``: the rule is first fit in file order. Going through a split's examples in file
  order, an example goes into the current row if its k positions fit in what is left of the row's
  t_seq; otherwise it starts a new row (the current row is closed and padded at the end). The
  train and held-out examples are packed apart, each the same way. In a row, each example's
  positions restart at 0 and its tokens attend only to the tokens of the same example (a
  block-diagonal causal mask, fed per step with the positions as ``segments`` and ``positions``);
  padding forms a segment of its own.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from .text import EVAL_FRACTION


class TokenStore:
    """Examples as flat arrays: ids (int32), counts (uint8) and offsets (int64, n + 1)."""

    def __init__(self, ids: np.ndarray, counts: np.ndarray, offsets: np.ndarray):
        self.ids, self.counts, self.offsets = ids, counts, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def first_fit_rows(positions: np.ndarray, t_seq: int) -> np.ndarray:
    """Row boundaries (indices into `positions`, first 0, last len) of the first-fit rule: each
    example (its positions, each <= t_seq) joins the current row if it fits, else starts a new one."""
    bounds, used = [0], 0
    for i, k in enumerate(positions.tolist()):
        if used + k > t_seq:
            bounds.append(i)
            used = 0
        used += k
    bounds.append(len(positions))
    return np.asarray(bounds, np.int64)


def layout(store: TokenStore, t_seq: int, pack: bool) -> dict[str, np.ndarray | int]:
    """Which examples make each row: `order` (the kept examples' indices, train then held out),
    `bounds` (row r holds order[bounds[r]:bounds[r+1]]), `n_train` rows, `truncated`, `dropped`."""
    lengths = store.lengths
    k = np.clip(lengths - 1, 0, t_seq)
    # each example's counted targets within its k positions: sums over [o + 1, o + 1 + k), taken
    # pairwise by reduceat (no cumulative array of the tokens' size); a window of k = 0 sums nothing
    first_target = np.asarray(store.offsets[:-1]) + 1
    counted = np.zeros(len(k), np.int64)
    some = np.nonzero(k > 0)[0]
    if len(some):
        bounds = np.stack([first_target[some], first_target[some] + k[some]], axis=1).reshape(-1)
        counts = np.append(np.asarray(store.counts), np.uint8(0))    # the last window may end at the end
        counted[some] = np.add.reduceat(counts, bounds, dtype=np.int64)[0::2]
    keep = np.nonzero((k > 0) & (counted > 0))[0]
    n = len(keep)
    n_eval = max(1, int(round(n * EVAL_FRACTION))) if n > 1 else 0
    n_train_examples = n - n_eval
    if pack:
        train = first_fit_rows(k[keep[:n_train_examples]], t_seq)
        held = first_fit_rows(k[keep[n_train_examples:]], t_seq) + n_train_examples
        bounds = np.concatenate([train, held[1:]])
        n_train = len(train) - 1
    else:
        bounds = np.arange(n + 1, dtype=np.int64)
        n_train = n_train_examples
    return {"order": keep.astype(np.int64), "bounds": bounds, "n_train": n_train,
            "truncated": int(np.sum(lengths - 1 > t_seq)), "dropped": int(len(store) - n)}


class ExampleData:
    """Examples as rows of t_seq positions, made per batch: `tokens`, `targets` (int32) and `mask`
    (float32), [rows, t_seq]; packed rows add `positions` (int32, restarting at 0 per example) and
    `segments` (int32: the example's index in its row, -1 for padding)."""

    masked = True
    byte_level = False

    def __init__(self, store: TokenStore, vocab: int, source: str, t_seq: int, pad_id: int,
                 byte_level: bool = False, pack: bool = False, rows: dict | None = None):
        self.store, self.vocab, self.source, self.t_seq, self.pad_id = store, vocab, source, t_seq, pad_id
        self.byte_level, self.packed = byte_level, pack
        rows = rows if rows is not None else layout(store, t_seq, pack)
        self.order, self.bounds = rows["order"], rows["bounds"]
        self.truncated, self.dropped = int(rows["truncated"]), int(rows["dropped"])
        self.n_examples = len(self.order)
        if self.n_examples == 0:
            raise InputError(f"data {source}: no example has a token that counts within t_seq={t_seq}")
        n_rows = len(self.bounds) - 1
        self.n_train = int(rows["n_train"])
        self.n_eval = n_rows - self.n_train
        top = int(store.ids.max()) if len(store.ids) else 0
        if top >= vocab:
            raise InputError(f"data {source}: token id {top} is outside the vocabulary of {vocab}")
        self._positions = np.clip(store.lengths - 1, 0, t_seq)

    # --- whole arrays (tests, small data): every row at once -----------------------------------
    @property
    def n_rows(self) -> int:
        return len(self.bounds) - 1

    def rows(self, pick: np.ndarray) -> dict[str, np.ndarray]:
        """The rows `pick` as arrays [len(pick), t_seq]."""
        b, t = len(pick), self.t_seq
        tokens = np.full((b, t), self.pad_id, np.int32)
        targets = np.full((b, t), self.pad_id, np.int32)
        mask = np.zeros((b, t), np.float32)
        positions = np.zeros((b, t), np.int32)
        segments = np.full((b, t), -1, np.int32)
        ids, counts, offsets = self.store.ids, self.store.counts, self.store.offsets
        for r, row in enumerate(np.asarray(pick, np.int64).tolist()):
            col = 0
            for s, e in enumerate(self.order[self.bounds[row]:self.bounds[row + 1]].tolist()):
                k, o = int(self._positions[e]), int(offsets[e])
                tokens[r, col:col + k] = ids[o:o + k]
                targets[r, col:col + k] = ids[o + 1:o + k + 1]
                mask[r, col:col + k] = counts[o + 1:o + k + 1]
                positions[r, col:col + k] = np.arange(k)
                segments[r, col:col + k] = s
                col += k
            positions[r, col:] = np.arange(t - col)      # padding: a segment of its own
        out = {"tokens": tokens, "targets": targets, "mask": mask}
        if self.packed:
            out.update(positions=positions, segments=segments)
        return out

    @property
    def tokens(self) -> np.ndarray:
        return self.rows(np.arange(self.n_rows))["tokens"]

    @property
    def targets(self) -> np.ndarray:
        return self.rows(np.arange(self.n_rows))["targets"]

    @property
    def mask(self) -> np.ndarray:
        return self.rows(np.arange(self.n_rows))["mask"]

    # --- what the runner asks ------------------------------------------------------------------
    def summary(self) -> str:
        dropped = f" ({self.dropped} of them counted nothing within t_seq and were dropped)" if self.dropped else ""
        rows = (f" packed into {self.n_rows} rows ({self.n_train} train, {self.n_eval} held out), "
                f"{self.padding_fraction():.1%} padding" if self.packed
                else f" ({self.n_train} train, {self.n_eval} held out)")
        return (f"data {self.source}: {self.n_examples} examples{rows}, {self.truncated} truncated to "
                f"t_seq={self.t_seq}{dropped}")

    def padding_fraction(self) -> float:
        """Of all rows' positions, the share that is padding."""
        used = int(self._positions[self.order].sum())
        return 1.0 - used / (self.n_rows * self.t_seq)

    def check(self, options) -> None:
        if options.t_seq != self.t_seq:
            raise InputError(f"data {self.source}: made for t_seq={self.t_seq}, the run has {options.t_seq}")
        if self.n_train < 1 or self.n_eval < 1:
            raise InputError(f"data {self.source}: needs at least 2 examples (train and held out), has "
                             f"{self.n_examples}")

    def _rows(self, split: str) -> slice:
        if split == "train":
            return slice(0, self.n_train)
        if split == "eval":
            return slice(self.n_train, self.n_train + self.n_eval)
        raise InputError(f"unknown split {split!r}; allowed: train, eval")

    def pick(self, split: str, index: int, options) -> np.ndarray:
        """The rows of batch `index` of a split: train rows drawn by (seed, index); held-out rows in order."""
        rows = self._rows(split)
        n = rows.stop - rows.start
        if split == "train":
            pick = np.random.default_rng([options.seed, 0, index]).integers(0, n, size=options.t_batch)
        else:
            pick = (index * options.t_batch + np.arange(options.t_batch)) % n
        return pick + rows.start

    def step_batch(self, split: str, index: int, options) -> dict[str, np.ndarray]:
        return self.rows(self.pick(split, index, options))

    def batch_stats(self, split: str, index: int, options) -> dict[str, float]:
        """Of batch `index`: the share of its positions that is padding, and the positions the loss counts."""
        pick = self.pick(split, index, options)
        used = sum(int(self._positions[self.order[self.bounds[r]:self.bounds[r + 1]]].sum()) for r in pick.tolist())
        counted = 0
        for r in pick.tolist():
            for e in self.order[self.bounds[r]:self.bounds[r + 1]].tolist():
                o, k = int(self.store.offsets[e]), int(self._positions[e])
                counted += int(self.store.counts[o + 1:o + k + 1].sum())
        return {"padding": 1.0 - used / (len(pick) * self.t_seq), "counted": counted}

    def step_metrics(self, index: int, options, ms: float) -> dict[str, float]:
        """A train step's metrics.jsonl entries: `padding` (the share of its positions), `counted`
        (positions the loss counts) and `counted_tokens_per_s`."""
        stats = self.batch_stats("train", index, options)
        return {"padding": round(stats["padding"], 4), "counted": stats["counted"],
                "counted_tokens_per_s": round(stats["counted"] / (ms / 1000), 1) if ms > 0 else 0.0}

    @staticmethod
    def run_summary(metrics: list[dict]) -> dict[str, float]:
        """summary.json's: the mean padding share of the steps, and their counted tokens over their time."""
        seen = [m for m in metrics if "counted" in m]
        if not seen:
            return {}
        step_s = sum(m["ms"] for m in seen) / 1000
        return {"padding": round(sum(m["padding"] for m in seen) / len(seen), 4),
                "counted_tokens_per_s": round(sum(m["counted"] for m in seen) / step_s, 1) if step_s else 0.0}

    def eval_batches(self, options) -> int:
        return -(-self.n_eval // options.t_batch)

    def items_per_batch(self, options) -> int:
        return options.t_batch * options.t_seq

    def eval_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = self._rows("eval")
        out = self.rows(np.arange(s.start, s.stop))
        return out["tokens"], out["targets"], out["mask"]
