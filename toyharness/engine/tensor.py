"""A ggml tensor seen from Python, with the ops the recipes use.

Layout convention: shapes are numpy's, row-major. A numpy array of shape ``(a, b, c)`` is the
ggml tensor with ``ne = [c, b, a]``; ``Tensor.shape`` reports ``(a, b, c)``. Every op here takes
and returns numpy-order shapes and checks them before ggml sees them (ggml aborts on a bad
shape, Python raises ``ShapeError``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .._ffi import GGML_TYPE_F32, GGML_TYPE_I32, ffi, lib
from ..errors import ShapeError
from . import quant

if TYPE_CHECKING:
    from .program import Program



class Tensor:
    __slots__ = ("prog", "ptr", "ndim")

    def __init__(self, prog: Program, ptr, ndim: int):
        self.prog, self.ptr, self.ndim = prog, ptr, ndim

    # --- introspection ---------------------------------------------------------------
    @property
    def ne(self) -> list[int]:
        ne = ffi.new("int64_t[4]")
        nb = ffi.new("size_t[4]")
        lib.th_tensor_shape(self.ptr, ne, nb)
        return [int(x) for x in ne]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne[: self.ndim]))

    @property
    def type(self) -> int:
        return lib.th_tensor_type(self.ptr)

    @property
    def dtype(self) -> str:
        return "i32" if self.type == GGML_TYPE_I32 else quant.type_name(self.type)

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_get_name(self.ptr)).decode()

    def named(self, name: str) -> Tensor:
        lib.ggml_set_name(self.ptr, name.encode()[:63])
        return self

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, shape={self.shape}, {self.dtype})"

    def numel(self) -> int:
        return int(lib.ggml_nelements(self.ptr))

    def is_contiguous(self) -> bool:
        return bool(lib.ggml_is_contiguous(self.ptr))

    # --- plumbing ----------------------------------------------------------------------
    def _new(self, ptr, ndim: int | None = None) -> Tensor:
        self.prog._count_op()
        return Tensor(self.prog, ptr, self.ndim if ndim is None else ndim)

    @property
    def _ctx(self):
        return self.prog._ctx_compute

    def _same_program(self, other: Tensor) -> None:
        if other.prog is not self.prog:
            raise ShapeError(f"{self!r} and {other!r} belong to different programs")

    def _check_broadcast(self, other: Tensor, op: str) -> None:
        """ggml broadcasts `other` into `self` when each of its dims divides self's."""
        self._same_program(other)
        if not lib.ggml_can_repeat(other.ptr, self.ptr):
            raise ShapeError(f"{op}: cannot broadcast {other.shape} into {self.shape} "
                             "(the second operand must repeat into the first)")

    def _check_f32(self, op: str) -> None:
        if self.type != GGML_TYPE_F32:
            raise ShapeError(f"{op}: needs f32, got {self!r}")

    # --- elementwise -------------------------------------------------------------------
    def __add__(self, other: Tensor) -> Tensor:
        self._check_broadcast(other, "add")
        return self._new(lib.ggml_add(self._ctx, self.ptr, other.ptr), max(self.ndim, other.ndim))

    def __mul__(self, other: Tensor | float) -> Tensor:
        if isinstance(other, (int, float)):
            return self.scale(float(other))
        self._check_broadcast(other, "mul")
        return self._new(lib.ggml_mul(self._ctx, self.ptr, other.ptr), max(self.ndim, other.ndim))

    __rmul__ = __mul__

    def __sub__(self, other: Tensor) -> Tensor:
        # ggml's SUB backward is partial for a broadcast operand; ADD's is whole, and x + (-y)
        # is x - y exactly (negation is exact), without materialising a repeat of y.
        if other.shape != self.shape:
            self._check_broadcast(other, "sub")
            return self + other.scale(-1.0)
        self._check_broadcast(other, "sub")
        return self._new(lib.ggml_sub(self._ctx, self.ptr, other.ptr))

    def __truediv__(self, other: Tensor | float) -> Tensor:
        if isinstance(other, (int, float)):
            return self.scale(1.0 / float(other))
        other = other.repeat_like(self) if other.shape != self.shape else other
        self._check_broadcast(other, "div")
        return self._new(lib.ggml_div(self._ctx, self.ptr, other.ptr))

    def __neg__(self) -> Tensor:
        return self._new(lib.ggml_neg(self._ctx, self.ptr))

    def scale(self, s: float) -> Tensor:
        return self._new(lib.ggml_scale(self._ctx, self.ptr, float(s)))

    def scale_bias(self, s: float, b: float) -> Tensor:
        """s * x + b in one op (its backward scales the gradient by s)."""
        return self._new(lib.ggml_scale_bias(self._ctx, self.ptr, float(s), float(b)))

    def sqr(self) -> Tensor:
        return self._new(lib.ggml_sqr(self._ctx, self.ptr))

    def sqrt(self) -> Tensor:
        return self._new(lib.ggml_sqrt(self._ctx, self.ptr))

    def log(self) -> Tensor:
        return self._new(lib.ggml_log(self._ctx, self.ptr))

    def exp(self) -> Tensor:
        return self._new(lib.ggml_exp(self._ctx, self.ptr))

    def relu(self) -> Tensor:
        return self._new(lib.ggml_relu(self._ctx, self.ptr))

    def silu(self) -> Tensor:
        return self._new(lib.ggml_silu(self._ctx, self.ptr))

    def softplus(self) -> Tensor:
        return self._new(lib.ggml_softplus(self._ctx, self.ptr))

    # --- reductions and shape ----------------------------------------------------------
    def sum(self) -> Tensor:
        """Sum of all elements (one thread in ggml: a fixed order, thread-count invariant)."""
        return self._new(lib.ggml_sum(self._ctx, self.ptr), 0)

    def sum_rows(self) -> Tensor:
        """Sum over the last numpy axis, kept with size 1."""
        return self._new(lib.ggml_sum_rows(self._ctx, self.ptr))

    def mean_rows(self) -> Tensor:
        return self.sum_rows().scale(1.0 / self.shape[-1])

    def repeat_like(self, other: Tensor) -> Tensor:
        self._same_program(other)
        if not lib.ggml_can_repeat(self.ptr, other.ptr):
            raise ShapeError(f"repeat: {self.shape} does not repeat into {other.shape}")
        return self._new(lib.ggml_repeat(self._ctx, self.ptr, other.ptr), other.ndim)

    def repeat_heads(self, rep: int) -> Tensor:
        """(B, Hkv, T, d) -> (B, Hkv*rep, T, d), head h reading head h // rep (llama's GQA)."""
        if self.ndim != 4:
            raise ShapeError(f"repeat_heads needs (B, H, T, d), got {self.shape}")
        if rep == 1:
            return self
        b, h, t, d = self.shape
        flat = self.reshape(b, h, 1, t * d)
        tiled = flat._new(lib.ggml_repeat_4d(self._ctx, flat.ptr, t * d, rep, h, b), 4)
        return tiled.reshape(b, h * rep, t, d)

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
        return self._new(lib.ggml_permute(self._ctx, self.ptr, *ggml_pos))

    def transpose(self) -> Tensor:
        """Swap the last two numpy axes (a view; `cont()` makes it contiguous)."""
        return self._new(lib.ggml_transpose(self._ctx, self.ptr), max(self.ndim, 2))

    def cont(self) -> Tensor:
        return self._new(lib.ggml_cont(self._ctx, self.ptr))

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

    # --- linear algebra ----------------------------------------------------------------
    def matmul_t(self, w: Tensor) -> Tensor:
        """``self @ w.T`` over the last axis: self (..., K), w (N, K) -> (..., N).

        Leading axes are flattened into one 2-D product (one fixed summation order for every
        shape; ggml's batched and flattened forms give different bits).

        A frozen `w` of another type than f32 (f16, bf16, quantized) multiplies in f32 from its
        dequantized values, never with quantized activations (what ggml's own product does): on
        cpu the kernels of native/frozen_matmul.c take the product and its input gradient (in
        the portable mode, those of native/portable_kernels.c, through our own dequantization);
        on cuda at precision bf16, `w` stays in its type and the product and its input gradient are
        ours (native/cuda/th-frozen.cu: `w` dequantized to bf16, never to f32); on other backends
        a GET_ROWS of all its rows dequantizes `w` into the
        graph first (an f32 copy of `w` in the compute buffer).
        """
        self._same_program(w)
        if w.ndim != 2 or w.shape[1] != self.shape[-1]:
            raise ShapeError(f"linear: weight {w.shape} does not take inputs {self.shape} "
                             f"(need ({'N'}, {self.shape[-1]}))")
        if w.type != GGML_TYPE_F32:
            if not lib.th_frozen_type_ok(w.type):
                raise ShapeError(f"linear: weight {w!r} has a type no frozen product takes")
            if not (self.prog.cpu_kernels or self.prog.portable or self.prog.frozen_bf16):
                w = w.dequantized()
        lead = self.shape[:-1]
        x2 = self.reshape(-1, self.shape[-1]) if self.ndim != 2 else self
        y = x2._new(lib.ggml_mul_mat(self._ctx, w.ptr, x2.ptr), 2)
        return y.reshape(*lead, w.shape[0]) if self.ndim != 2 else y

    def bmm_t(self, other: Tensor) -> Tensor:
        """Batched ``self @ other^T`` over leading axes: (..., M, K) x (..., N, K) -> (..., M, N).

        `other`'s leading axes may be a divisor of `self`'s (GQA: key heads shared by
        consecutive query heads, as ggml's mul_mat broadcast does).
        """
        self._same_program(other)
        if self.shape[-1] != other.shape[-1] or self.ndim != other.ndim:
            raise ShapeError(f"bmm: {self.shape} and {other.shape} differ in the contracted axis")
        a_lead, b_lead = self.shape[:-2], other.shape[:-2]
        if any(a % b for a, b in zip(a_lead, b_lead)):
            raise ShapeError(f"bmm: leading axes {b_lead} do not divide {a_lead}")
        if self.ndim == 4 and a_lead != b_lead:
            # ggml's mul_mat broadcast gives wrong input gradients (tests/test_engine_ops.py):
            # repeat the shared heads explicitly instead.
            other = other.repeat_heads(a_lead[1] // b_lead[1])
        return self._new(lib.ggml_mul_mat(self._ctx, other.ptr, self.ptr))

    def dequantized(self) -> Tensor:
        """A 2-D weight of any frozen type as an f32 graph node (GET_ROWS of every row: ggml's
        exact dequantization, on every backend that has GET_ROWS for the type)."""
        n = self.shape[0]
        rows = self.prog.cached_constant(f"row_ids.{n}", lambda: np.arange(n, dtype=np.int32))
        return self._new(lib.ggml_get_rows(self._ctx, self.ptr, rows.ptr), 2)

    # --- nn primitives -----------------------------------------------------------------
    def rms_norm(self, eps: float) -> Tensor:
        return self._new(lib.ggml_rms_norm(self._ctx, self.ptr, float(eps)))

    def softmax(self, scale: float = 1.0, causal: bool = False, window: int | None = None) -> Tensor:
        """softmax(scale * self) over the last axis; `causal` adds the causal mask first, in the
        same op (ggml's soft_max_ext: one pass forward and one backward instead of three).
        `window` (with `causal`): query i sees keys j with i - window < j <= i only (sliding-window
        attention, as llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p1 - p0 >= n_swa); a window that
        covers every key is the plain causal mask."""
        if window is not None and not causal:
            raise ShapeError("softmax: a sliding window needs the causal mask")
        if scale == 1.0 and not causal:
            return self._new(lib.ggml_soft_max(self._ctx, self.ptr))
        if window is not None and window < self.shape[-1]:
            mask = self._window_mask_constant(window)
        else:
            mask = self._causal_mask_constant() if causal else None
        return self._new(lib.ggml_soft_max_ext(self._ctx, self.ptr, mask.ptr if mask else ffi.NULL, float(scale), 0.0))

    def _window_mask_constant(self, window: int) -> Tensor:
        tq, tk = self.shape[-2:]

        def make():
            i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
            return np.where((j <= i) & (i - j < window), 0.0, -np.inf).astype(np.float32)
        return self.prog.cached_constant(f"window_mask.{tq}x{tk}.{window}", make)

    def causal_mask(self) -> Tensor:
        """-inf above the diagonal of the last two axes (query i sees keys <= i), added as a
        constant (Tq, Tk) mask: the backward of ggml's DIAG_MASK_INF (DIAG_MASK_ZERO) has no
        cuda kernel in ggml 0.25.3. x + 0 and x + -inf give what the masking op gives."""
        return self + self._causal_mask_constant()

    def _causal_mask_constant(self) -> Tensor:
        tq, tk = self.shape[-2:]
        return self.prog.cached_constant(f"causal_mask.{tq}x{tk}",
                                         lambda: np.triu(np.full((tq, tk), -np.inf, np.float32), 1))

    def swiglu(self, up: Tensor) -> Tensor:
        """silu(self) * up."""
        self._same_program(up)
        if self.shape != up.shape:
            raise ShapeError(f"swiglu: gate {self.shape} and up {up.shape} differ")
        return self._new(lib.ggml_swiglu_split(self._ctx, self.ptr, up.ptr))

    def rope(self, positions: Tensor, n_dims: int, base: float = 10000.0, neox: bool = False,
             freq_scale: float = 1.0, freq_factors: Tensor | None = None) -> Tensor:
        """Rotary embedding of a (B, T, H, hd) tensor; positions is an i32 input of shape (T,).

        Default mode rotates adjacent pairs (llama.cpp's ``llama`` layout). The first `n_dims`
        dims rotate (the rest pass through); pair i turns by position * freq_scale *
        base^(-2i/n_dims) / freq_factors[i] (linear rope scaling: freq_scale = 1/factor; Llama 3's
        scaling: llama.cpp's `rope_freqs.weight` as freq_factors, an f32 (n_dims/2,) tensor).
        """
        if self.ndim != 4 or positions.type != GGML_TYPE_I32 or positions.shape != (self.shape[1],):
            raise ShapeError(f"rope: need x (B, T, H, hd) and i32 positions (T,), got {self.shape}, "
                             f"{positions!r}")
        if n_dims <= 0 or n_dims % 2 or n_dims > self.shape[-1]:
            raise ShapeError(f"rope: {n_dims} rotated dims do not fit a head of {self.shape[-1]}")
        if freq_factors is not None and (freq_factors.type != GGML_TYPE_F32 or freq_factors.shape != (n_dims // 2,)):
            raise ShapeError(f"rope: frequency factors {freq_factors!r}, expected f32 ({n_dims // 2},)")
        mode = 2 if neox else 0
        factors = freq_factors.ptr if freq_factors is not None else ffi.NULL
        return self._new(lib.ggml_rope_ext(self._ctx, self.ptr, positions.ptr, factors, n_dims, mode,
                                           0, float(base), float(freq_scale), 0.0, 1.0, 0.0, 0.0))

    def get_rows(self, ids: Tensor) -> Tensor:
        """Embedding lookup: table (V, D) and i32 ids of any shape -> ids.shape + (D,)."""
        self._same_program(ids)
        if self.ndim != 2 or ids.type != GGML_TYPE_I32:
            raise ShapeError(f"get_rows: need a (V, D) table and i32 ids, got {self!r}, {ids!r}")
        flat = ids.reshape(ids.numel()) if ids.ndim != 1 else ids
        rows = flat._new(lib.ggml_get_rows(self._ctx, self.ptr, flat.ptr), 2)
        return rows.reshape(*ids.shape, self.shape[1]) if ids.ndim != 1 else rows


def _shape_arg(shape: Sequence) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return tuple(int(s) for s in shape)
