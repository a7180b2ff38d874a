"""Packed rows: several examples in one row of t_seq positions, each attending only to itself.

A program built for packed rows (LanguageModel with packed data) holds a `PackedRows` as
`prog.packed_rows`; blocks.attention reads it as it reads a KV cache:

- the softmax of the scores takes a block-diagonal causal mask fed per step, (B, 1, T, T), 0 where
  query i may see key j (j <= i in the same example), -1e30 elsewhere (an input holds no
  infinities; exp of it is exactly 0 as of -inf), broadcast over the heads by ggml's SOFT_MAX;
  one mask per sliding window, which is then measured within the example;
- on cuda, where the fused attention (native/cuda/th-attention.cu) takes the softmax and its
  products, the kernels read each row's bounds instead of the mask, (B, 2, T) i32 fed beside it:
  the first key each query sees, then the end of the queries that see each key; they skip the
  tiles outside every example, so attention costs the sum of the examples' squared lengths, not
  T squared. The mask holds the bounds tensor's address in its op_params (native/custom_ops.h,
  th_packed_bounds_of), where the cuda rewrite finds it; a softmax it does not fuse uses the mask.
  A mask that no rewritten graph reads is then neither made nor fed (at t_seq 4096 it is
  B x 64 MiB a step); a graph prepared later that reads it gets the last batch's (`note_graph`);
- RoPE reads the positions as fed (restarting at 0 in each example): ROPE takes one position per
  index of ggml's third axis, so the heads-first (B, H, T, hd) tensor is roped as one
  (1, B*H*T, 1, hd) run with each token's position repeated over its heads (one input per head count).

`feeds(segments, positions)` turns a batch's segment ids and positions into those inputs.
"""

from __future__ import annotations

import numpy as np

from .._ffi import GGML_MAX_SRC, ffi, lib
from .tensor import Tensor

HIDDEN = np.float32(-1e30)
MASK_PREFIX = "packed_mask."   # native/cpu_kernels.c reads the name: block-diagonal, within the causal triangle
BOUNDS_PREFIX = "packed_bounds."   # native/cuda_rewrite/attention.c reads the name: the fused attention's bounds


class PackedRows:
    def __init__(self, prog, batch: int, seq: int):
        self.prog, self.batch, self.seq = prog, batch, seq
        self.windows: set[int | None] = set()
        self.head_counts: set[int] = set()
        self.masks_read: set[str] | None = None     # by the graphs prepared so far; None: none yet
        self._unfed: set[str] = set()               # masks the last feeds left out
        self._last_segments: np.ndarray | None = None

    def mask_name(self, window: int | None) -> str:
        return f"{MASK_PREFIX}{window or 'all'}"

    def softmax(self, scores: Tensor, scale: float, window: int | None) -> Tensor:
        """softmax(scale * scores + mask) of scores (B*H, T, T) under the fed mask of `window`."""
        bh, tq, tk = scores.shape
        if window is not None and window >= tk:
            window = None            # a window that covers every key is the plain mask
        name = self.mask_name(window)
        mask = (self.prog.inputs[name].tensor if name in self.prog.inputs
                else self._new_mask(name, window, tq, tk))
        self.windows.add(window)
        s = scores if scores.is_contiguous() else scores.cont()
        s = s.reshape(self.batch, bh // self.batch, tq, tk)
        probs = s._new(lib.ggml_soft_max_ext(s._ctx, s.ptr, mask.ptr, float(scale), 0.0))
        return probs.reshape(bh, tq, tk)

    def _new_mask(self, name: str, window: int | None, tq: int, tk: int) -> Tensor:
        mask = self.prog.input(name, (self.batch, 1, tq, tk))
        if self.prog.engine.backend == "cuda" and tq == tk == self.seq:
            bounds = self.prog.input(BOUNDS_PREFIX + name[len(MASK_PREFIX):], (self.batch, 2, self.seq), "i32",
                                     upper=self.seq + 1)
            lib.th_link_packed_bounds(mask.ptr, bounds.ptr)
        return mask

    def note_graph(self, graph) -> None:
        """After `graph`'s rewrites, before its first compute: which masks its nodes still read
        (on cuda the fused attention reads the bounds instead); one the last feeds left out is fed
        now, from the last batch's segments."""
        def address(t) -> int:
            return int(ffi.cast("uintptr_t", t))
        masks = {address(self.prog.inputs[n].tensor.ptr): n for n in map(self.mask_name, self.windows)
                 if n in self.prog.inputs}
        read = set()
        for i in range(lib.ggml_graph_n_nodes(graph)):
            node = lib.ggml_graph_node(graph, i)
            for j in range(GGML_MAX_SRC):
                name = masks.get(address(lib.th_tensor_src(node, j)))
                if name is not None:
                    read.add(name)
        self.masks_read = (self.masks_read or set()) | read
        late = read & self._unfed
        if late and self._last_segments is not None:
            self.prog.feed({n: self.mask(self._last_segments, self._window_of(n)) for n in late})
            self._unfed -= late

    def _window_of(self, mask_name: str) -> int | None:
        return next(w for w in self.windows if self.mask_name(w) == mask_name)

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

    def bounds(self, segments: np.ndarray, window: int | None) -> np.ndarray:
        """(B, 2, T) i32: per row the first key each query sees, then the end (exclusive) of the
        queries that see each key; query i sees key j exactly where first[i] <= j <= i < end[j]
        (the mask's zeros)."""
        b, t = segments.shape
        out = np.empty((b, 2, t), np.int32)
        i = np.arange(t)
        for r in range(b):
            edges = np.array([0, *(np.flatnonzero(np.diff(segments[r])) + 1).tolist(), t])
            example = np.searchsorted(edges, i, side="right") - 1
            start, end = edges[example], edges[example + 1]
            out[r, 0] = start if window is None else np.maximum(start, i - window + 1)
            out[r, 1] = end if window is None else np.minimum(end, i + window)
        return out

    def feeds(self, segments: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The masks (and on cuda their bounds) and rope positions of one batch: `segments` (B, T),
        each position's example in its row (padding: -1, a segment of its own), and `positions` (B, T)."""
        self._last_segments = segments
        names = {self.mask_name(w): w for w in self.windows}
        read = names if self.masks_read is None else {n: w for n, w in names.items() if n in self.masks_read}
        self._unfed = set(names) - set(read)
        out = {n: self.mask(segments, w) for n, w in read.items()}
        for w in self.windows:
            name = BOUNDS_PREFIX + self.mask_name(w)[len(MASK_PREFIX):]
            if name in self.prog.inputs:
                out[name] = self.bounds(segments, w)
        for h in self.head_counts:
            out[f"packed_positions.{h}"] = np.repeat(positions[:, None, :], h, axis=1).reshape(-1).astype(np.int32)
        return out
