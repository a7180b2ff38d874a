"""A ggml tensor seen from Python, with the ops the recipes use.

Layout convention: shapes are numpy's, row-major. A numpy array of shape ``(a, b, c)`` is the
ggml tensor with ``ne = [c, b, a]``; ``Tensor.shape`` reports ``(a, b, c)``. Every op here takes
and returns numpy-order shapes and checks them before ggml sees them (ggml aborts on a bad
shape, Python raises ``ShapeError``).

Every node made here records the recipe's line that made it (the first stack frame outside
toyharness/engine): a shape, layout or type error raised by an op ends with "(at file:line)",
and a mode that cannot run a node names that line when the run starts (engine/graph_check.py).

Views (transpose, permute, a slice) may be read by any op: an op that ggml computes only from
adjacent elements gets a contiguous copy of a strided view first (a CONT: the same values), so
no graph built here reaches ggml in a layout it aborts on.
"""

from __future__ import annotations

import math
from types import FunctionType
from typing import TYPE_CHECKING

import numpy as np

from .._ffi import GGML_TYPE_F32, GGML_TYPE_I32, ffi, lib
from ..errors import ShapeError
from . import quant
from .origins import author_line, located
from .tensor_shapes import ShapeOps

if TYPE_CHECKING:
    from .program import Program

# erf by Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7): gelu(approximate="none")
_ERF_P = 0.3275911
_GELU_C = math.sqrt(2.0 / math.pi)
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


class Tensor(ShapeOps):
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
        prog = self.prog
        prog._count_op()
        origins = getattr(prog, "_node_origins", None)
        if origins is None:
            origins = prog._node_origins = {}
        origins[int(ffi.cast("uintptr_t", ptr))] = author_line()
        return Tensor(prog, ptr, self.ndim if ndim is None else ndim)

    @property
    def nb(self) -> list[int]:
        """ggml's strides in bytes (dim 0 first)."""
        ne = ffi.new("int64_t[4]")
        nb = ffi.new("size_t[4]")
        lib.th_tensor_shape(self.ptr, ne, nb)
        return [int(x) for x in nb]

    def _rows(self) -> Tensor:
        """self, or a contiguous copy when its elements along the last axis are not adjacent
        (ggml's elementwise kernels read them so; a transposed view's are not)."""
        return self if self.nb[0] == lib.ggml_type_size(self.type) else self.cont()

    def _whole(self) -> Tensor:
        """self, or a contiguous copy when it is not contiguous (or, with an axis of size 1, its
        elements not 4 bytes apart: ggml counts such a transposed vector as contiguous)."""
        ok = self.is_contiguous() and self.nb[0] == lib.ggml_type_size(self.type)
        return self if ok else self.cont()

    def _padded(self) -> Tensor:
        """self, or a contiguous copy where ggml's SCALE cannot read it (ggml_is_padded_1d)."""
        ne, nb = self.ne, self.nb
        ok = nb[0] == lib.ggml_type_size(self.type) and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]
        return self if ok else self.cont()

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
        a = self._rows()
        return a._new(lib.ggml_add(self._ctx, a.ptr, other.ptr), max(self.ndim, other.ndim))

    def __mul__(self, other: Tensor | float) -> Tensor:
        if isinstance(other, (int, float)):
            return self.scale(float(other))
        self._check_broadcast(other, "mul")
        a = self._rows()
        return a._new(lib.ggml_mul(self._ctx, a.ptr, other.ptr), max(self.ndim, other.ndim))

    __rmul__ = __mul__

    def __sub__(self, other: Tensor) -> Tensor:
        # ggml's SUB backward is partial for a broadcast operand; ADD's is whole, and x + (-y)
        # is x - y exactly (negation is exact), without materialising a repeat of y.
        if other.shape != self.shape:
            self._check_broadcast(other, "sub")
            return self + other.scale(-1.0)
        self._check_broadcast(other, "sub")
        a = self._rows()
        return a._new(lib.ggml_sub(self._ctx, a.ptr, other.ptr))

    def __truediv__(self, other: Tensor | float) -> Tensor:
        if isinstance(other, (int, float)):
            return self.scale(1.0 / float(other))
        self._same_program(other)
        if other.shape != self.shape:
            self._check_broadcast(other, "div")
            other = other.repeat_like(self)
        self._check_broadcast(other, "div")
        a = self._rows()
        return a._new(lib.ggml_div(self._ctx, a.ptr, other.ptr))

    def _unary(self, fn) -> Tensor:
        a = self._rows()
        return a._new(fn(self._ctx, a.ptr))

    def __neg__(self) -> Tensor:
        return self._unary(lib.ggml_neg)

    def scale(self, s: float) -> Tensor:
        a = self._padded()
        return a._new(lib.ggml_scale(self._ctx, a.ptr, float(s)))

    def scale_bias(self, s: float, b: float) -> Tensor:
        """s * x + b in one op (its backward scales the gradient by s)."""
        a = self._padded()
        return a._new(lib.ggml_scale_bias(self._ctx, a.ptr, float(s), float(b)))

    def sqr(self) -> Tensor:
        return self._unary(lib.ggml_sqr)

    def sqrt(self) -> Tensor:
        return self._unary(lib.ggml_sqrt)

    def log(self) -> Tensor:
        return self._unary(lib.ggml_log)

    def exp(self) -> Tensor:
        return self._unary(lib.ggml_exp)

    def relu(self) -> Tensor:
        """max(x, 0); its gradient is 1 where x > 0, else 0."""
        return self._unary(lib.ggml_relu)

    def leaky_relu(self, slope: float = 0.01) -> Tensor:
        """x where x > 0, else slope * x: relu(x) - slope * relu(-x), exact (one term is 0)."""
        return self.relu() + (-self).relu().scale(-float(slope))

    def silu(self) -> Tensor:
        return self._unary(lib.ggml_silu)

    def softplus(self) -> Tensor:
        """log(1 + exp(x)), and x itself above 20 (ggml's cutoff)."""
        return self._unary(lib.ggml_softplus)

    def abs(self) -> Tensor:
        """|x|; its gradient is sign(x) (0 at 0)."""
        return self._unary(lib.ggml_abs)

    def sigmoid(self) -> Tensor:
        """1 / (1 + exp(-x)), composed as exp(-softplus(-x)): ops that each have a backward in
        ggml (and no overflow: softplus(-x) is -x below -20)."""
        return (-(-self).softplus()).exp()

    def tanh(self) -> Tensor:
        """2 sigmoid(2x) - 1 (absolute error about 1e-7 near 0, from the composition)."""
        return self.scale(2.0).sigmoid().scale_bias(2.0, -1.0)

    def gelu(self, approximate: str = "tanh") -> Tensor:
        """x Phi(x). approximate="tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's
        (blocks.gelu_tanh). approximate="none": the exact form, Phi from erf by Abramowitz and
        Stegun 7.1.26 (absolute error under 1.5e-7), composed of ops that each have a backward;
        x Phi(x) keeps the gradient Phi(0) = 0.5 at 0, where sign(x) has none."""
        if approximate == "tanh":
            # composed as blocks.gelu_tanh composes it off the cpu and cuda kernels: silu(x w) / w,
            # w = 2 sqrt(2/pi) (1 + 0.044715 x^2) >= 1.59 (blocks' one-node stand-in takes only
            # the consumers a transformer's MLP gives it)
            x = self._rows()
            x._check_f32("gelu")
            w = x.sqr().scale_bias(2.0 * _GELU_C * 0.044715, 2.0 * _GELU_C)
            return (x * w).silu() / w
        if approximate != "none":
            raise ShapeError(f"gelu: approximate={approximate!r}; use 'tanh' or 'none'")
        x = self._whole()
        x._check_f32("gelu")
        z = x.abs().scale(1.0 / math.sqrt(2.0))               # |x| / sqrt(2)
        ones = x.prog.cached_constant(f"ones.{'x'.join(map(str, x.shape))}",
                                      lambda: np.ones(x.shape, np.float32))
        t = ones / z.scale_bias(_ERF_P, 1.0)                  # 1 / (1 + p z)
        a1, a2, a3, a4, a5 = _ERF_A
        q = t.scale_bias(a5, a4)
        for a in (a3, a2, a1):
            q = (q * t).scale_bias(1.0, a)
        erfc = q * t * x.sqr().scale(-0.5).exp()              # erfc(z) = P(t) exp(-z^2), z >= 0
        phi = (lib_sgn(x) * erfc.scale_bias(-1.0, 1.0)).scale_bias(0.5, 0.5)
        return x * phi

    def clamp(self, lo: float | None = None, hi: float | None = None) -> Tensor:
        """min(max(x, lo), hi), exact: x * step(x - lo) + lo * (1 - step(x - lo)), then the same for
        hi (STEP has no gradient: x's is 1 inside (lo, hi), 0 outside and at the bounds)."""
        if lo is None and hi is None:
            raise ShapeError("clamp: give lo, hi or both")
        if lo is not None and hi is not None and not lo <= hi:
            raise ShapeError(f"clamp: lo {lo} is above hi {hi}")
        y = self._whole()
        y._check_f32("clamp")
        if lo is not None:
            inside = lib_step(y.scale_bias(1.0, -float(lo)))           # x > lo
            y = y * inside + inside.scale_bias(-float(lo), float(lo))
        if hi is not None:
            inside = lib_step(y.scale_bias(-1.0, float(hi)))           # x < hi
            y = y * inside + inside.scale_bias(-float(hi), float(hi))
        return y

    def dropout(self, p: float, name: str) -> Tensor:
        """Dropout: x * M, M = 1 / (1 - p) (float32) where an element is kept, 0 where dropped,
        drawn from a counter-based stream keyed by (the program's dropout_seed, the training
        forward's index, `name`) and the element's index (engine/dropout.py): the same bits on
        every backend, run to run and after a resume. Evaluation and sampling compute x * 1 = x.
        p in [0, 1); p == 0 returns x (no node). `name` is the mask's identity: the same name at
        the same shape draws the same mask (a recomputed block's copy), so give each site its own."""
        from .dropout import apply_dropout

        return apply_dropout(self, p, name)

    # --- reductions and shape ----------------------------------------------------------
    def sum(self) -> Tensor:
        """Sum of all elements (one thread in ggml: a fixed order, thread-count invariant)."""
        a = self._rows()
        return a._new(lib.ggml_sum(self._ctx, a.ptr), 0)

    def sum_rows(self) -> Tensor:
        """Sum over the last numpy axis, kept with size 1."""
        a = self._rows()
        return a._new(lib.ggml_sum_rows(self._ctx, a.ptr))

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
        if self.ndim == 0 or w.ndim != 2 or w.shape[1] != self.shape[-1]:
            raise ShapeError(f"linear: weight {w.shape} does not take inputs {self.shape} "
                             f"(need ({'N'}, {self.shape[-1]}))")
        if w.type != GGML_TYPE_F32:
            if not lib.th_frozen_type_ok(w.type):
                raise ShapeError(f"linear: weight {w!r} has a type no frozen product takes")
            if not (self.prog.cpu_kernels or self.prog.portable or self.prog.frozen_bf16):
                w = w.dequantized()
        if w.nb[0] > w.nb[1] or w.nb[0] != lib.ggml_type_size(w.type):   # ggml takes no transposed weight
            w = w.cont()
        lead = self.shape[:-1]
        x2 = self.reshape(-1, self.shape[-1]) if self.ndim != 2 else self._rows()
        y = x2._new(lib.ggml_mul_mat(self._ctx, w.ptr, x2.ptr), 2)
        return y.reshape(*lead, w.shape[0]) if self.ndim != 2 else y

    def bmm_t(self, other: Tensor) -> Tensor:
        """Batched ``self @ other^T`` over leading axes: (..., M, K) x (..., N, K) -> (..., M, N).

        `other`'s leading axes may be a divisor of `self`'s (GQA: key heads shared by
        consecutive query heads, as ggml's mul_mat broadcast does).
        """
        self._same_program(other)
        if self.ndim < 2 or other.ndim < 2:
            raise ShapeError(f"bmm: need (..., M, K) and (..., N, K), got {self.shape} and {other.shape}")
        if self.shape[-1] != other.shape[-1] or self.ndim != other.ndim:
            raise ShapeError(f"bmm: {self.shape} and {other.shape} differ in the contracted axis")
        a_lead, b_lead = self.shape[:-2], other.shape[:-2]
        if any(a % b for a, b in zip(a_lead, b_lead)):
            raise ShapeError(f"bmm: leading axes {b_lead} do not divide {a_lead}")
        if self.ndim == 4 and a_lead != b_lead:
            # ggml's mul_mat broadcast gives wrong input gradients (tests/test_engine_ops.py):
            # repeat the shared heads explicitly instead.
            other = other.repeat_heads(a_lead[1] // b_lead[1])
        other = other.cont() if other.nb[0] > other.nb[1] or other.nb[0] != 4 else other
        a = self._rows()
        return a._new(lib.ggml_mul_mat(self._ctx, other.ptr, a.ptr))

    def dequantized(self) -> Tensor:
        """A 2-D weight of any frozen type as an f32 graph node (GET_ROWS of every row: ggml's
        exact dequantization, on every backend that has GET_ROWS for the type)."""
        n = self.shape[0]
        rows = self.prog.cached_constant(f"row_ids.{n}", lambda: np.arange(n, dtype=np.int32))
        return self._new(lib.ggml_get_rows(self._ctx, self.ptr, rows.ptr), 2)

    # --- nn primitives -----------------------------------------------------------------
    def rms_norm(self, eps: float) -> Tensor:
        a = self._rows()
        return a._new(lib.ggml_rms_norm(self._ctx, a.ptr, float(eps)))

    def softmax(self, scale: float = 1.0, causal: bool = False, window: int | None = None) -> Tensor:
        """softmax(scale * self) over the last axis; `causal` adds the causal mask first, in the
        same op (ggml's soft_max_ext: one pass forward and one backward instead of three).
        `window` (with `causal`): query i sees keys j with i - window < j <= i only (sliding-window
        attention, as llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p1 - p0 >= n_swa); a window that
        covers every key is the plain causal mask."""
        if window is not None and not causal:
            raise ShapeError("softmax: a sliding window needs the causal mask")
        if not self.is_contiguous():
            return self.cont().softmax(scale, causal, window)
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
        gate, up = self._contiguous_1(), up._contiguous_1()
        return gate._new(lib.ggml_swiglu_split(self._ctx, gate.ptr, up.ptr))

    def _contiguous_1(self) -> Tensor:
        """self, or a contiguous copy where ggml's GLU cannot read it (ggml_is_contiguous_1)."""
        ne, nb = self.ne, self.nb
        ok = nb[0] == lib.ggml_type_size(self.type) and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]
        return self if ok else self.cont()

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
        if self.nb[0] != lib.ggml_type_size(self.type):
            return self.cont().rope(positions, n_dims, base, neox, freq_scale, freq_factors)
        factors = freq_factors.ptr if freq_factors is not None else ffi.NULL
        return self._new(lib.ggml_rope_ext(self._ctx, self.ptr, positions.ptr, factors, n_dims, mode,
                                           0, float(base), float(freq_scale), 0.0, 1.0, 0.0, 0.0))

    def get_rows(self, ids: Tensor) -> Tensor:
        """Embedding lookup: table (V, D) and i32 ids of any shape -> ids.shape + (D,)."""
        self._same_program(ids)
        if self.ndim != 2 or ids.type != GGML_TYPE_I32:
            raise ShapeError(f"get_rows: need a (V, D) table and i32 ids, got {self!r}, {ids!r}")
        if self.nb[0] != lib.ggml_type_size(self.type):
            return self.cont().get_rows(ids)
        flat = ids.reshape(ids.numel()) if ids.ndim != 1 else ids
        rows = flat._new(lib.ggml_get_rows(self._ctx, self.ptr, flat.ptr), 2)
        return rows.reshape(*ids.shape, self.shape[1]) if ids.ndim != 1 else rows


# every public op (and operator) ends its ShapeError with the recipe's line
for _name, _fn in [*vars(ShapeOps).items(), *vars(Tensor).items()]:
    if isinstance(_fn, FunctionType) and (not _name.startswith("_") or _name in (
            "__add__", "__mul__", "__rmul__", "__sub__", "__truediv__", "__neg__", "__getitem__")):
        setattr(Tensor, _name, located(_fn))


def lib_sgn(x: Tensor) -> Tensor:
    """sign(x): 1, -1 or 0 (no gradient)."""
    return x._unary(lib.ggml_sgn)


def lib_step(x: Tensor) -> Tensor:
    """1 where x > 0, else 0 (no gradient)."""
    return x._unary(lib.ggml_step)
