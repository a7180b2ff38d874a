"""Composed blocks the recipes share, built only from ops with a backward in ggml 0.25.3.

ggml 0.25.3 has no backward for NORM (LayerNorm), GELU, GELU_ERF, CONCAT or FLASH_ATTN_EXT, so:
LayerNorm is rms_norm of the centred input; tanh-GELU is x * sigmoid(2u) written as
silu(2u) / w with w = 2u / x (see gelu_tanh); exact GELU is x Phi(x) with erf composed
(gelu_erf); attention is batched over heads with one mul_mat per product.
Every block here has a forward and finite-difference test in tests/test_engine_ops.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._ffi import GGML_TYPE_F32
from ..errors import ShapeError
from .recompute import recomputed_block  # noqa: F401  (blocks.recomputed_block: a block recomputed in the backward)
from .tensor import Tensor

GELU_C = math.sqrt(2.0 / math.pi)
# node names that native/cpu_kernels.c's rewrite looks for (TH_GELU_NAME, TH_BIAS_ROWS_NAME)
GELU_STAND_IN = "th.gelu_tanh"
GELU_ERF_STAND_IN = "th.gelu_erf"
BIAS_ROWS = "th.bias_rows"
# the RMS_NORM that native/cuda_rewrite.c computes as LayerNorm's normalization (TH_LAYER_NORM_NAME)
LAYER_NORM_STAND_IN = "th.layer_norm"


@dataclass
class LoRAWeight:
    """A frozen weight with a low-rank adapter: used wherever a weight is, `linear` computes
    W x + scale * B(A x). Any block built on `linear` takes adapters this way."""

    base: Tensor          # (out, in), frozen
    a: Tensor             # (rank, in), trainable
    b: Tensor             # (out, rank), trainable
    scale: float
    dropout: float = 0.0  # on the adapter's input, as PEFT's lora_dropout: B(A(dropout(x))) * scale
    name: str = ""        # the adapter's dropout mask's name (Tensor.dropout)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape


def linear(x: Tensor, w: Tensor | LoRAWeight, b: Tensor | None = None) -> Tensor:
    """x (..., in) @ w(out, in).T + b(out,), as torch.nn.Linear."""
    if isinstance(w, LoRAWeight):
        return lora_linear(x, w.base, w.a, w.b, w.scale, b, w.dropout, w.name)
    y = x.matmul_t(w)
    return add_bias(y, b) if b is not None else y


def add_bias(y: Tensor, b: Tensor) -> Tensor:
    """y (..., n) + b (n,). On cpu as y + ones (rows, 1) @ b (1, n): the bias gradient is then one
    matrix product (sgemm) instead of ggml's slow broadcast-sum (REPEAT_BACK). On cuda a plain
    broadcast over y as a matrix, whose REPEAT_BACK the Trainer turns into the same product
    (Program.column_sums_as_products)."""
    n = b.shape[-1]
    if y.shape[-1] != n or b.ndim != 1:
        raise ShapeError(f"bias {b.shape} does not fit output {y.shape}")
    if y.prog.column_sums_as_products:
        return (y.reshape(-1, n) + b).reshape(*y.shape)
    rows = y.numel() // n
    ones = y.prog.cached_constant(f"ones.{rows}", lambda: np.ones((rows, 1), np.float32))
    # named for the cpu rewrite, which adds b to y's rows instead (th_add_rows_op)
    return y + ones.matmul_t(b.reshape(n, 1)).named(BIAS_ROWS).reshape(*y.shape)


def scale_columns(x: Tensor, gain: Tensor) -> Tensor:
    """x (..., n) * gain (n,): a norm's gain. On cuda over x as a matrix (rows, n), so that the
    gain's gradient is a column sum the Trainer computes as a product (see add_bias)."""
    n = gain.shape[-1]
    if x.shape[-1] != n or gain.ndim != 1:
        raise ShapeError(f"gain {gain.shape} does not fit input {x.shape}")
    if x.prog.column_sums_as_products:
        return (x.reshape(-1, n) * gain).reshape(*x.shape)
    return x * gain


def layer_norm(x: Tensor, gain: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last axis = rms_norm(x - mean(x)) * g + b (same eps placement); `bias`
    None: no b (torch's LayerNorm(bias=False), nanoGPT's default).

    On cpu x - mean(x) is x @ (I - 1/d), one matrix product forward and one backward: ggml's
    sum_rows, broadcast and their backward ops (REPEAT, REPEAT_BACK) took 3x longer. On cuda
    those ops are memory passes, cheaper than the d x d products (2 d^2 FLOPs per row each
    way), once the Trainer sums the mean's gradient with SUM_ROWS (Program.column_sums_as_products);
    with our cuda kernels, centring and normalization are one kernel each way."""
    d = x.shape[-1]
    if x.prog.cuda_kernels and x.type == GGML_TYPE_F32:
        # one kernel each way, our cuda kernels' (native/cuda/th-custom.cu): an RMS_NORM named
        # LAYER_NORM_STAND_IN that the cuda rewrite computes as the normalization of centred rows
        normed = x.reshape(-1, d).rms_norm(eps).named(LAYER_NORM_STAND_IN).reshape(*x.shape)
        return _with_bias(scale_columns(normed, gain), bias)
    if x.prog.column_sums_as_products:
        rows = x.reshape(-1, d)
        centred = (rows - rows.mean_rows()).reshape(*x.shape)
    else:
        centring = x.prog.cached_constant(f"centring.{d}", lambda: np.eye(d, dtype=np.float32) - np.float32(1.0 / d))
        centred = x.matmul_t(centring)
    return _with_bias(scale_columns(centred.rms_norm(eps), gain), bias)


def _with_bias(y: Tensor, b: Tensor | None) -> Tensor:
    return add_bias(y, b) if b is not None else y


def rms_norm(x: Tensor, gain: Tensor, eps: float = 1e-5) -> Tensor:
    return scale_columns(x.rms_norm(eps), gain)


def gelu_tanh(x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).

    With the cpu kernels, one node each way: a SILU node named "th.gelu_tanh" that the cpu
    rewrite computes as GELU, and its SILU_BACK as GELU's derivative (native/cpu_kernels.c,
    th_gelu_op); on cuda the same stand-ins go to our kernels inside ggml-cuda
    (native/cuda_rewrite.c, native/cuda/th-custom.cu). Elsewhere composed as silu(x w) / w with
    w = 2 sqrt(2/pi) (1 + 0.044715 x^2) = 2u / x: w >= 1.59, so no division by zero and no
    overflow, and silu, div and scale_bias have a backward (5 nodes forward, 12 backward: 7% of a GPT-2 step on cpu)."""
    if (x.prog.cpu_kernels or x.prog.cuda_kernels) and x.type == GGML_TYPE_F32 and x.is_contiguous():
        return x.silu().named(GELU_STAND_IN)
    w = x.sqr().scale_bias(2.0 * GELU_C * 0.044715, 2.0 * GELU_C)
    return (x * w).silu() / w


def gelu_erf(x: Tensor) -> Tensor:
    """x Phi(x), Phi(x) = 0.5 (1 + erf(x / sqrt 2)): the exact GELU (torch's nn.GELU(), nanoGPT's).

    ggml 0.25.3's GELU_ERF has no backward. With the cpu kernels, one node each way: a SILU
    node named "th.gelu_erf" that the cpu rewrite computes as exact GELU and its SILU_BACK as
    its derivative (native/cpu_kernels.c, th_gelu_erf_op, erf by Abramowitz and Stegun 7.1.26,
    absolute error under 1.5e-7); on cuda the same stand-ins go to our kernels inside ggml-cuda
    (native/cuda_rewrite/gelu.c, native/cuda/th-custom.cu: CUDA's normcdff, within 1e-6 relative).
    Elsewhere (the portable mode, the lowerings, vulkan, metal) composed from ops that each have a
    backward (Tensor.gelu("none"), erf by Abramowitz and Stegun too): no backend sees a GELU node
    it could take for the tanh form, and a stand-in that no rewrite pairs is refused rather than
    computed as silu."""
    if (x.prog.cpu_kernels or x.prog.cuda_kernels) and x.type == GGML_TYPE_F32 and x.is_contiguous():
        return x.silu().named(GELU_ERF_STAND_IN)
    return x.gelu("none")


GELUS = {"tanh": gelu_tanh, "erf": gelu_erf}


def swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    return linear(linear(x, w_gate).swiglu(linear(x, w_up)), w_down)


def geglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """gelu_tanh(x W_gate) * (x W_up), then W_down: Gemma's feed-forward."""
    return linear(gelu_tanh(linear(x, w_gate)) * linear(x, w_up), w_down)


def fused_swiglu_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """silu(gate) * up with gate and up the two halves of one fused product (gate first): Phi-3's
    `ffn_up`, (2 d_ff, D)."""
    d_ff = w_gate_up.shape[0] // 2
    y = linear(x, w_gate_up)
    lead = y.shape[:-1]
    y = y.reshape(-1, 2 * d_ff)
    return linear(y.view_columns(0, d_ff).swiglu(y.view_columns(d_ff, d_ff)).reshape(*lead, d_ff), w_down)


def gelu_mlp(x: Tensor, w_fc: Tensor, b_fc: Tensor | None, w_proj: Tensor, b_proj: Tensor | None,
             gelu: str = "tanh") -> Tensor:
    """W_proj gelu(W_fc x + b_fc) + b_proj: GPT-2's feed-forward; `gelu` "tanh" (gelu_tanh) or
    "erf" (gelu_erf); a bias None: none."""
    if gelu not in GELUS:
        raise ShapeError(f"gelu_mlp: gelu={gelu!r}; use one of {sorted(GELUS)}")
    return linear(GELUS[gelu](linear(x, w_fc, b_fc)), w_proj, b_proj)


def lora_linear(x: Tensor, w: Tensor, a: Tensor, b: Tensor, scale: float, bias: Tensor | None = None,
                dropout: float = 0.0, dropout_name: str = "") -> Tensor:
    """W x + scale * B(A x): w (out, in) frozen, a (rank, in), b (out, rank) trainable. With
    `dropout` p > 0 the adapter reads dropout(x) (PEFT's lora_dropout; mask `dropout_name`)."""
    if a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
        raise ShapeError(f"lora: W {w.shape}, A {a.shape}, B {b.shape} do not compose")
    h = linear(x.dropout(dropout, dropout_name) if dropout else x, a)
    if x.prog.cuda_kernels and exact_power_of_two(scale):
        # On cuda the scale goes on the rank-r product A x (rows x r) instead of the (rows x out)
        # output: a pass over the layer's widest activation less each way (129 launches, 3.3 ms of
        # a step at the 1B LoRA bench), and none at all for scale 1. Multiplying by a power of two
        # commutes exactly with every rounding (fp32 products, bf16 operand copies, sums), so each
        # bit of the output and of every gradient is the output-side scale's; any other scale
        # keeps its place. Other backends keep theirs (the cpu folds read these ADDs).
        return linear(x, w, bias) + linear(h if scale == 1.0 else h.scale(scale), b)
    return linear(x, w, bias) + linear(h, b).scale(scale)


def exact_power_of_two(s: float) -> bool:
    """Whether s is +-2^k (k an integer), so that s * v is exact for every float32 v of our range."""
    return math.isfinite(s) and s != 0.0 and abs(math.frexp(s)[0]) == 0.5


def lens(embeddings: Tensor, projection: Tensor) -> Tensor:
    """Projection lens: (..., d_in) @ projection(d_model, d_in).T."""
    return linear(embeddings, projection)


@dataclass
class Rope:
    """A layer's rotary embedding: what ggml's ROPE takes besides the tensor (Tensor.rope)."""

    positions: Tensor
    base: float = 10000.0
    neox: bool = False                  # pair dim j with j + dims/2 (llama.cpp's NEOX layout)
    dims: int | None = None             # rotated dims per head; None: the whole head
    freq_scale: float = 1.0             # linear scaling: 1 / factor
    freq_factors: Tensor | None = None  # Llama 3's rope_freqs.weight, Phi-3's rope factors


def attention(x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, n_head: int, n_kv_head: int | None = None,
              causal: bool = True, bq: Tensor | None = None, bk: Tensor | None = None, bv: Tensor | None = None,
              bo: Tensor | None = None, rope_positions: Tensor | None = None, rope_base: float = 10000.0,
              rope_neox: bool = False, q_fn=None, *, rope: Rope | None = None, head_dim: int | None = None,
              wqkv: Tensor | LoRAWeight | None = None, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
              norm_eps: float = 1e-6, window: int | None = None, scale: float | None = None,
              dropout: float = 0.0, dropout_name: str = "attn_probs") -> Tensor:
    """Multi-head self-attention of x (B, T, D), batched over heads (no per-head loop).

    Grouped-query heads when n_kv_head < n_head: query heads share key/value heads in
    consecutive groups (llama's repeat_interleave), through mul_mat's broadcast.
    `q_fn(x)`, when given, replaces the query projection. RoPE pairs adjacent dims, or dim j
    with j + hd/2 when `rope_neox` (llama.cpp's qwen2 layout); `rope` gives the whole rotation
    instead (partial dims, scaling, frequency factors).

    What the newer architectures add: `head_dim` (heads need not split D: qwen3, gemma3),
    `wqkv` (one fused q|k|v projection: phi3), `q_norm`/`k_norm` (RMSNorm of each head's q and
    k before the rotation, gain (hd,): qwen3, gemma3), `window` (sliding-window attention:
    gemma3's local layers) and `scale` (the scores' scale, default 1/sqrt(hd)).
    `dropout` p > 0: dropout on the attention weights after the softmax (nanoGPT's attn_dropout),
    mask `dropout_name` (on cuda at bf16 and tf32 the fused attention draws it in its kernels;
    elsewhere the softmax and the product stay separate nodes).
    """
    bsz, seq, d_model = x.shape
    n_kv_head = n_kv_head or n_head
    if head_dim is None and d_model % n_head or n_head % n_kv_head:
        raise ShapeError(f"attention: d_model {d_model}, n_head {n_head}, n_kv_head {n_kv_head} do not divide")
    hd = head_dim or d_model // n_head
    if wqkv is not None:
        qkv = linear(x, wqkv).reshape(bsz * seq, (n_head + 2 * n_kv_head) * hd)
        q = qkv.view_columns(0, n_head * hd)
        k = qkv.view_columns(n_head * hd, n_kv_head * hd)
        v = qkv.view_columns((n_head + n_kv_head) * hd, n_kv_head * hd)
    else:
        q = q_fn(x) if q_fn is not None else linear(x, wq, bq)
        k = linear(x, wk, bk)
        v = linear(x, wv, bv)
    q = q.reshape(bsz, seq, n_head, hd)
    k = k.reshape(bsz, seq, n_kv_head, hd)
    v = v.reshape(bsz, seq, n_kv_head, hd)
    if q_norm is not None:
        q = rms_norm(q, q_norm, norm_eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, norm_eps)
    q = q.permute(0, 2, 1, 3)                 # (B, H, T, hd)
    k = k.permute(0, 2, 1, 3)                 # (B, Hkv, T, hd)
    if rope is None and rope_positions is not None:
        rope = Rope(rope_positions, rope_base, rope_neox)
    if rope is not None:
        q = _rope_heads_first(q, rope)
        k = _rope_heads_first(k, rope)
    cache = x.prog.kv_cache
    if cache is not None:
        # sampling with a KV cache (toyharness/sampling.py): this call's k and v join the layer's
        # cache, and the queries attend over every cached position its mask lets them see
        if not causal:
            raise ShapeError("attention: a KV cache is for causal attention")
        return linear(cache.attend(q, k, v, hd, 1.0 / math.sqrt(hd) if scale is None else scale, window), wo, bo)
    # Grouped heads (Program.kv_in_place, cpu): the products read each kv head in place for its
    # group of query heads, by mul_mat's broadcast over the flattened B*H axis (query head b*H + j
    # reads kv head (b*H + j) // g = b*Hkv + j // g, g = H / Hkv), and ggml's backward sums each
    # group's gradient with the REPEAT_BACK that REPEAT's backward was: the same bits, without
    # ggml's REPEAT (one thread copying every kv head g times) or the copies' memory. Elsewhere the
    # copies stay: the cuda rewrite reads them in place itself, and device lowerings take REPEAT.
    rep = 1 if x.prog.kv_in_place else n_head // n_kv_head
    k = k.repeat_heads(rep)                   # (B, Hkv or H, T, hd)
    vt = v.permute(0, 2, 3, 1).cont().repeat_heads(rep)   # (B, Hkv or H, hd, T)
    # Batch and heads as one axis (B*H): each batched product and its gradients is then one
    # strided cuBLAS call (ggml-cuda loops over a 4th axis, one call per batch element). On cpu
    # every head's product is the same sgemm call either way: the bits do not change.
    heads, kv_heads = bsz * n_head, bsz * k.shape[1]
    scores = q.reshape(heads, seq, hd).bmm_t(k.reshape(kv_heads, seq, hd))      # (B*H, Tq, Tk)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if x.prog.packed_rows is not None and causal:   # several examples a row: the fed block-diagonal mask
        probs = x.prog.packed_rows.softmax(scores, scale, window)
    else:
        probs = scores.softmax(scale=scale, causal=causal, window=window)
    if dropout:
        probs = probs.dropout(dropout, dropout_name)
    out = probs.bmm_t(vt.reshape(kv_heads, hd, seq)).reshape(bsz, n_head, seq, hd)
    out = out.permute(0, 2, 1, 3).cont().reshape(bsz, seq, n_head * hd)
    return linear(out, wo, bo)


def _rope_heads_first(x: Tensor, rope: Rope) -> Tensor:
    """RoPE of (B, H, T, hd) with tokens on ggml's third axis, where ROPE reads positions. Roped
    after the permute (not before) so that ROPE_BACK receives a contiguous gradient: the cuda
    backend of ggml 0.25.3 has no ROPE_BACK for the permuted one."""
    b, h, t, d = x.shape
    packed = x.prog.packed_rows
    if packed is not None:       # positions per row (packed rows): one ROPE over every head's tokens
        return x.cont().reshape(1, b * h * t, 1, d).rope(
            packed.rope_positions(h), rope.dims or d, rope.base, neox=rope.neox, freq_scale=rope.freq_scale,
            freq_factors=rope.freq_factors).reshape(b, h, t, d)
    return x.cont().reshape(b * h, t, 1, d).rope(rope.positions, rope.dims or d, rope.base, neox=rope.neox,
                                                 freq_scale=rope.freq_scale,
                                                 freq_factors=rope.freq_factors).reshape(b, h, t, d)
