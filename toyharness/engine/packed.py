"""Packed rows: several examples in one row of t_seq positions, each attending only to itself.

A program built for packed rows (LanguageModel with packed data) holds a `PackedRows` as
`prog.packed_rows`; blocks.attention reads it as it reads a KV cache:

- the softmax of the scores takes a block-diagonal causal mask fed per step, (B, 1, T, T), 0 where
  query i may see key j (j <= i in the same example), -1e30 elsewhere (an input holds no
  infinities; exp of it is exactly 0 as of -inf), broadcast over the heads by ggml's SOFT_MAX;
  one mask per sliding window, which is then measured within the example;
- RoPE reads the positions as fed (restarting at 0 in each example): ROPE takes one position per
  index of ggml's third axis, so the heads-first (B, H, T, hd) tensor is roped as one
  (1, B*H*T, 1, hd) run with each token's position repeated over its heads (one input per head count).

`feeds(segments, positions)` turns a batch's segment ids and positions into those inputs.
"""

from __future__ import annotations

import numpy as np

from .._ffi import lib
from .tensor import Tensor

HIDDEN = np.float32(-1e30)
MASK_PREFIX = "packed_mask."   # native/cpu_kernels.c reads the name: block-diagonal, within the causal triangle


class PackedRows:
    def __init__(self, prog, batch: int, seq: int):
        self.prog, self.batch, self.seq = prog, batch, seq
        self.windows: set[int | None] = set()
        self.head_counts: set[int] = set()

    def mask_name(self, window: int | None) -> str:
        return f"{MASK_PREFIX}{window or 'all'}"

    def softmax(self, scores: Tensor, scale: float, window: int | None) -> Tensor:
        """softmax(scale * scores + mask) of scores (B*H, T, T) under the fed mask of `window`."""
        bh, tq, tk = scores.shape
        if window is not None and window >= tk:
            window = None            # a window that covers every key is the plain mask
        name = self.mask_name(window)
        mask = (self.prog.inputs[name].tensor if name in self.prog.inputs
                else self.prog.input(name, (self.batch, 1, tq, tk)))
        self.windows.add(window)
        s = scores if scores.is_contiguous() else scores.cont()
        s = s.reshape(self.batch, bh // self.batch, tq, tk)
        probs = s._new(lib.ggml_soft_max_ext(s._ctx, s.ptr, mask.ptr, float(scale), 0.0))
        return probs.reshape(bh, tq, tk)

    def rope_positions(self, heads: int) -> Tensor:
        """The positions of a heads-first (B, heads, T, hd) tensor's tokens, flattened, (B*heads*T,)."""
        name = f"packed_positions.{heads}"
        self.head_counts.add(heads)
        if name in self.prog.inputs:
            return self.prog.inputs[name].tensor
        return self.prog.input(name, (self.batch * heads * self.seq,), "i32", upper=self.seq)

    def _causal(self, window: int | None) -> np.ndarray:
        """(T, T): 0 where j <= i (and i - j < window), HIDDEN elsewhere; made once per window."""
        cache = self.__dict__.setdefault("_causal_blocks", {})
        if window not in cache:
            i, j = np.arange(self.seq)[:, None], np.arange(self.seq)[None, :]
            seen = (j <= i) if window is None else (j <= i) & (i - j < window)
            cache[window] = np.where(seen, np.float32(0), HIDDEN).astype(np.float32)
        return cache[window]

    def mask(self, segments: np.ndarray, window: int | None) -> np.ndarray:
        """(B, 1, T, T): each example's causal block on the diagonal, HIDDEN elsewhere. An
        example's positions are contiguous in its row, so a block per example (a slice copy)
        makes it, not a comparison per pair of positions."""
        b, t = segments.shape
        causal = self._causal(window)
        out = np.full((b, 1, t, t), HIDDEN, np.float32)
        for r in range(b):
            edges = [0, *(np.flatnonzero(np.diff(segments[r])) + 1).tolist(), t]
            for s, e in zip(edges[:-1], edges[1:]):
                out[r, 0, s:e, s:e] = causal[:e - s, :e - s]
        return out

    def feeds(self, segments: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The masks and rope positions of one batch: `segments` (B, T), each position's example
        in its row (padding: -1, a segment of its own), and `positions` (B, T)."""
        out = {self.mask_name(w): self.mask(segments, w) for w in self.windows}
        for h in self.head_counts:
            out[f"packed_positions.{h}"] = np.repeat(positions[:, None, :], h, axis=1).reshape(-1).astype(np.int32)
        return out
