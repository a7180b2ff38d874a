"""Tensor's reshaping, viewing and joining ops (Tensor inherits them): reshape, permute,
transpose, narrow and numpy-style indexing, concat, row and column views. Each checks its
shapes before ggml sees them, as every op of engine/tensor.py does."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .._ffi import ffi, lib
from ..errors import ShapeError

if TYPE_CHECKING:
    from .tensor import Tensor


class ShapeOps:
    __slots__ = ()

    def reshape(self, *shape: int) -> Tensor:
        shape = _shape_arg(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.numel() // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel() or not 1 <= len(shape) <= 4:
            raise ShapeError(f"reshape: cannot view {self.shape} as {shape}")
        src = self if self.is_contiguous() else self.cont()
        ne = list(reversed(shape))
        fn = (lib.ggml_reshape_1d, lib.ggml_reshape_2d, lib.ggml_reshape_3d, lib.ggml_reshape_4d)[len(ne) - 1]
        return src._new(fn(self._ctx, src.ptr, *ne), len(shape))

    def permute(self, *axes: int) -> Tensor:
        """numpy's ``transpose(axes)``: output axis i is input axis ``axes[i]``."""
        axes = _shape_arg(axes)
        n = self.ndim
        if sorted(axes) != list(range(n)):
            raise ShapeError(f"permute: {axes} is not a permutation of {n} axes")
        # ggml_permute(a, p): input dim j goes to output position p[j] (ggml dims = reversed).
        ggml_pos = [0, 1, 2, 3]
        for out_np, in_np in enumerate(axes):
            ggml_pos[n - 1 - in_np] = n - 1 - out_np
        src = self._view_source(moves_rows=n > 0 and axes[-1] != n - 1)
        return src._new(lib.ggml_permute(self._ctx, src.ptr, *ggml_pos))

    def transpose(self) -> Tensor:
        """Swap the last two numpy axes (a view; `cont()` makes it contiguous)."""
        src = self._view_source(moves_rows=True)
        return src._new(lib.ggml_transpose(self._ctx, src.ptr), max(self.ndim, 2))

    def _view_source(self, moves_rows: bool) -> Tensor:
        """What a transpose or permute of self views. ggml's backward hands self the view's
        gradient as a strided view too, and the backward of most ops aborts on that (SCALE's,
        CONT's, VIEW's, a product's when the last axis moved). A leaf and a RESHAPE take it (the
        RESHAPE's backward makes it contiguous), and a MUL takes one whose last axis stays (the
        attention blocks' permutes): those are viewed as they are; anything else through an
        identity RESHAPE of it, a node of no cost."""
        op = ffi.string(lib.ggml_op_desc(self.ptr)).decode()
        if op in ("NONE", "RESHAPE") or (op == "MUL" and not moves_rows):
            return self
        return self.reshape(*self.shape) if self.ndim else self.reshape(1)

    def cont(self) -> Tensor:
        return self._new(lib.ggml_cont(self._ctx, self.ptr))

    def _axis(self, axis: int, op: str) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise ShapeError(f"{op}: axis {axis} outside a {self.ndim}-axis tensor {self.shape}")
        return axis % self.ndim

    def narrow(self, axis: int, start: int, length: int) -> Tensor:
        """numpy's ``x[..., start:start+length, ...]`` on `axis`, contiguous.

        A view of an identity RESHAPE of self: the view's backward adds its gradient into a
        contiguous zero tensor, and the RESHAPE's makes that a contiguous gradient for self
        (summed with the gradients of its other consumers, whatever their layout)."""
        axis = self._axis(axis, "narrow")
        size = self.shape[axis]
        if start < 0:
            start += size
        if not (0 <= start and length > 0 and start + length <= size):
            raise ShapeError(f"narrow: [{start}, {start + length}) outside axis {axis} of {self.shape}")
        if start == 0 and length == size:
            return self
        src = self.reshape(*self.shape)    # a contiguous node of its own (see above)
        ne, nb = src.ne, src.nb
        d = self.ndim - 1 - axis
        ne[d] = length
        view = src._new(lib.ggml_view_4d(self._ctx, src.ptr, *ne, nb[1], nb[2], nb[3], start * nb[d]))
        return view if view.is_contiguous() else view.cont()

    def __getitem__(self, key) -> Tensor:
        """Basic numpy indexing: integers, slices with step 1 and one Ellipsis; an integer drops
        its axis (as numpy does), except the last one left, kept with size 1 (a graph node has at
        least one axis)."""
        key = key if isinstance(key, tuple) else (key,)
        if key.count(Ellipsis) > 1:
            raise ShapeError("index: at most one Ellipsis")
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1:]
        if len(key) > self.ndim:
            raise ShapeError(f"index: {len(key)} indices for a {self.ndim}-axis tensor {self.shape}")
        out, dropped = self, []
        for axis, k in enumerate(key):
            size = self.shape[axis]
            if isinstance(k, slice):
                start, stop, step = k.indices(size)
                if step != 1:
                    raise ShapeError(f"index: slice step {k.step} on axis {axis}; only step 1 is supported")
                if stop <= start:
                    raise ShapeError(f"index: slice {k} of axis {axis} (size {size}) is empty")
                out = out.narrow(axis, start, stop - start)
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                i = int(k) + size if k < 0 else int(k)
                if not 0 <= i < size:
                    raise ShapeError(f"index: {k} outside axis {axis} of size {size}")
                out = out.narrow(axis, i, 1)
                dropped.append(axis)
            else:
                raise ShapeError(f"index: {k!r} on axis {axis}; use integers, slices or ...")
        if dropped:
            shape = [n for i, n in enumerate(out.shape) if i not in dropped]
            if not shape:
                shape = [1]
            out = out.reshape(*shape)
        return out

    def concat(self, others: Tensor | Sequence[Tensor], axis: int = 0) -> Tensor:
        """numpy's ``concatenate([self, *others], axis)``: each part added (ACC) into its place of
        a zero constant, ops with a backward in ggml (its CONCAT has none)."""
        parts = [self, *([others] if isinstance(others, ShapeOps) else list(others))]
        axis = self._axis(axis, "concat")
        for p in parts[1:]:
            if not isinstance(p, ShapeOps):
                raise ShapeError(f"concat: {p!r} is not a Tensor")
            self._same_program(p)
            if p.ndim != self.ndim or any(a != b for i, (a, b) in enumerate(zip(p.shape, self.shape)) if i != axis):
                raise ShapeError(f"concat: {p.shape} does not fit {self.shape} along axis {axis}")
        for p in parts:
            p._check_f32("concat")
        if len(parts) == 1:
            return self
        shape = list(self.shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        zeros = self.prog.cached_constant(f"zeros.{'x'.join(map(str, shape))}",
                                          lambda: np.zeros(shape, np.float32))
        nb = zeros.nb
        d = self.ndim - 1 - axis
        out, at = zeros, 0
        for p in parts:
            p = p._whole()
            out = out._new(lib.ggml_acc(self._ctx, out.ptr, p.ptr, nb[1], nb[2], nb[3], at * nb[d]), self.ndim)
            at += p.shape[axis]
        return out

    def view_rows(self, start: int, count: int) -> Tensor:
        """Rows ``[start, start+count)`` of a contiguous 2-D tensor (numpy ``x[start:start+count]``)."""
        if self.ndim != 2 or not self.is_contiguous():
            raise ShapeError(f"view_rows needs a contiguous 2-D tensor, got {self!r}")
        rows, cols = self.shape
        if not (0 <= start and count > 0 and start + count <= rows):
            raise ShapeError(f"view_rows: rows [{start}, {start + count}) outside {rows}")
        nb1 = cols * 4
        return self._new(lib.ggml_view_2d(self._ctx, self.ptr, cols, count, nb1, start * nb1))

    def view_columns(self, start: int, count: int) -> Tensor:
        """Columns ``[start, start+count)`` of a contiguous 2-D tensor (numpy ``x[:, start:start+count]``),
        made contiguous: how a fused projection's output (phi3's qkv, its gate and up) is split."""
        if self.ndim != 2 or not self.is_contiguous():
            raise ShapeError(f"view_columns needs a contiguous 2-D tensor, got {self!r}")
        rows, cols = self.shape
        if not (0 <= start and count > 0 and start + count <= cols):
            raise ShapeError(f"view_columns: columns [{start}, {start + count}) outside {cols}")
        view = self._new(lib.ggml_view_2d(self._ctx, self.ptr, count, rows, cols * 4, start * 4))
        return view.cont()


def _shape_arg(shape: Sequence) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return tuple(int(s) for s in shape)
