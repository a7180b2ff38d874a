"""The llama family as llama.cpp writes and runs it: `llama` (Llama 2/3, SmolLM2, Mistral-style
files: adjacent-pair rope) and `qwen2` (Qwen2/2.5: q/k/v biases, NeoX rope).

Rope scaling, as llama.cpp's converter writes it: `linear` (`rope.scaling.factor`: frequencies
scaled by 1/factor) and Llama 3.1/3.2's `llama3`, which the converter bakes into a tensor,
`rope_freqs.weight` (head_dim/2 factors dividing the rotation frequencies), with no key at all.
"""

from __future__ import annotations

import math

import numpy as np

from ..engine import blocks
from ..engine.gguf_io import GGUFError
from .spec import DecoderShape, Layer, ModelKeys, rope_scale


def read_common(keys: ModelKeys, vocab: int, names: list[str], neox: bool,
                default_eps: float | None = None) -> DecoderShape:
    """The keys every llama-like file has; head size from `attention.key_length` (qwen3, gemma3)
    where present, else width / heads."""
    n_layer, d = keys.int("block_count"), keys.int("embedding_length")
    n_head = keys.int("attention.head_count")
    n_kv = keys.int("attention.head_count_kv", n_head)
    head_dim = keys.int("attention.key_length", d // n_head if d % n_head == 0 else 0)
    if head_dim == 0:
        raise GGUFError(f"{keys.path}: width {d} does not split into {n_head} heads and no attention.key_length")
    keys.equal("attention.value_length", head_dim, "values must be as wide as keys")
    if n_head % n_kv or n_layer > len(names):
        raise GGUFError(f"{keys.path}: inconsistent sizes: {n_layer} layers in {len(names)} tensors, "
                        f"{n_head} heads, {n_kv} kv heads")
    rope_dims = keys.int("rope.dimension_count", head_dim)
    if rope_dims > head_dim or rope_dims % 2:
        raise GGUFError(f"{keys.path}: metadata {keys.arch}.rope.dimension_count is {rope_dims}, head size {head_dim}")
    factors = "rope_freqs.weight" in names
    scale = rope_scale(keys, factors)
    base = keys.float("rope.freq_base", 10000.0)
    eps = keys.float("attention.layer_norm_rms_epsilon", default_eps)
    return DecoderShape(keys.arch, n_layer, d, n_head, n_kv, head_dim, keys.int("feed_forward_length"), vocab, eps,
                        [Layer(base, scale) for _ in range(n_layer)], rope_dims, neox,
                        rope_factors="rope_freqs.weight" if factors else None)


def tensor_shapes(s: DecoderShape, names: list[str], fused: bool = False) -> dict[str, tuple[int, ...]]:
    """The numpy shape of every tensor a llama-like file holds (llama.cpp's names): the embedding,
    each block's norms and projections (q|k|v and gate|up fused when `fused`: phi3), the final
    norm, and where the file has them an untied output and the rope frequency table."""
    d, q, kv, ff = s.d_model, s.q_width, s.kv_width, s.d_ff
    shapes = {"token_embd.weight": (s.vocab, d), "output_norm.weight": (d,)}
    for i in range(s.n_layer):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (d,)
        if fused:
            shapes[b + "attn_qkv.weight"] = (q + 2 * kv, d)
            shapes[b + "ffn_up.weight"] = (2 * ff, d)
        else:
            shapes |= {b + "attn_q.weight": (q, d), b + "attn_k.weight": (kv, d), b + "attn_v.weight": (kv, d),
                       b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d)}
        shapes |= {b + "attn_output.weight": (d, q), b + "ffn_norm.weight": (d,), b + "ffn_down.weight": (d, ff)}
    if "output.weight" in names:
        shapes["output.weight"] = (s.vocab, d)
    if s.rope_factors:
        shapes[s.rope_factors] = (s.rope_dims // 2,)
    return shapes


def rope_for(P: dict, positions, s: DecoderShape, layer: int) -> blocks.Rope:
    lay = s.layers[layer]
    return blocks.Rope(positions, lay.rope_base, s.rope_neox, s.rope_dims, lay.rope_scale,
                       P[s.rope_factors] if s.rope_factors else None)


def output(P: dict, h, s: DecoderShape):
    """Final norm and the output projection, tied to the embedding unless the file has output.weight."""
    return project(P, final_norm(P, h, s))


def final_norm(P: dict, h, s: DecoderShape):
    return blocks.rms_norm(h, P["output_norm.weight"], s.rms_eps)


def project(P: dict, h):
    """The output projection: logits of normed hidden states."""
    return blocks.linear(h, P.get("output.weight", P["token_embd.weight"]))


def llama_forward(P: dict, h, positions, s: DecoderShape, dropout: float = 0.0):
    """Blocks, final norm and output over embedded tokens `h` (B, T, d). A weight in P may be a
    `blocks.LoRAWeight`. Also the forward of the llama recipe (from scratch) and warm_start.
    `dropout` p > 0: where nanoGPT puts it (on the embeddings, the attention weights and each
    residual branch's output), masks named as `dropout_names` says."""
    return output(P, llama_blocks(P, h, positions, s, dropout), s)


def llama_blocks(P: dict, h, positions, s: DecoderShape, dropout: float = 0.0):
    """`llama_forward` up to its last hidden states (B, T, d), before the final norm and output."""
    h = h.dropout(dropout, "dropout.embd") if dropout else h
    for i in range(s.n_layer):
        h = blocks.recomputed_block(llama_block, h, P, positions, s, i, dropout)
    return h


def llama_block(h, P: dict, positions, s: DecoderShape, i: int, dropout: float = 0.0):
    """Block i: pre-norm attention and SwiGLU MLP, each added to the residual `h` (through
    dropout p = `dropout` when > 0, on the attention weights too)."""
    b = f"blk.{i}."
    names = dropout_names(i)
    x = blocks.rms_norm(h, P[b + "attn_norm.weight"], s.rms_eps)
    attn = blocks.attention(x, P[b + "attn_q.weight"], P[b + "attn_k.weight"], P[b + "attn_v.weight"],
                            P[b + "attn_output.weight"], s.n_head, s.n_kv_head,
                            bq=P.get(b + "attn_q.bias"), bk=P.get(b + "attn_k.bias"),
                            bv=P.get(b + "attn_v.bias"), rope=rope_for(P, positions, s, i),
                            head_dim=s.head_dim, dropout=dropout, dropout_name=names["attn_probs"])
    h = h + (attn.dropout(dropout, names["attn_out"]) if dropout else attn)
    x = blocks.rms_norm(h, P[b + "ffn_norm.weight"], s.rms_eps)
    mlp = blocks.swiglu_mlp(x, P[b + "ffn_gate.weight"], P[b + "ffn_up.weight"], P[b + "ffn_down.weight"])
    return h + (mlp.dropout(dropout, names["ffn_out"]) if dropout else mlp)


def dropout_names(i: int) -> dict[str, str]:
    """Block i's dropout masks' names (their streams' nodes): the attention weights, the
    attention's and the MLP's outputs (the residual branches). gpt2 names its masks the same."""
    return {site: f"dropout.blk.{i}.{site}" for site in ("attn_probs", "attn_out", "ffn_out")}


def common_metadata(s: DecoderShape) -> dict:
    """The keys llama.cpp's converter writes for every llama-like file (the inverse of read_common)."""
    a = s.arch
    meta = {f"{a}.context_length": 2048, f"{a}.embedding_length": s.d_model, f"{a}.feed_forward_length": s.d_ff,
            f"{a}.block_count": s.n_layer, f"{a}.attention.head_count": s.n_head,
            f"{a}.attention.head_count_kv": s.n_kv_head, f"{a}.attention.layer_norm_rms_epsilon": s.rms_eps,
            f"{a}.rope.freq_base": s.layers[-1].rope_base, f"{a}.rope.dimension_count": s.rope_dims,
            f"{a}.vocab_size": s.vocab}
    if s.head_dim * s.n_head != s.d_model:
        meta |= {f"{a}.attention.key_length": s.head_dim, f"{a}.attention.value_length": s.head_dim}
    if s.layers[-1].rope_scale != 1.0:
        meta |= {f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": 1.0 / s.layers[-1].rope_scale}
    return meta


def llama3_rope_factors(head_dim: int, base: float, factor: float = 32.0, low: float = 1.0, high: float = 4.0,
                        old_context: int = 8192) -> np.ndarray:
    """Llama 3.1/3.2's frequency table as llama.cpp's converter computes `rope_freqs.weight`
    (the defaults are Llama 3.2's rope_scaling)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


class Llama:
    """`llama`: adjacent-pair rope (llama.cpp's NORMAL mode), optional rope scaling."""

    name = "llama"
    rope_neox = False
    targets = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
               "up": "ffn_up", "down": "ffn_down"}
    hf_class = "LlamaForCausalLM"
    hf_config_class = "LlamaConfig"

    def read_shape(self, keys: ModelKeys, vocab: int, names: list[str]) -> DecoderShape:
        s = read_common(keys, vocab, names, self.rope_neox)
        if s.rope_dims != s.head_dim:
            raise GGUFError(f"{keys.path}: llama rotates whole heads: rope.dimension_count {s.rope_dims}, "
                            f"head size {s.head_dim}")
        return s

    def tensor_shapes(self, s: DecoderShape, names: list[str]) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(s, names)

    def forward(self, P: dict, h, positions, s: DecoderShape):
        """The logits (B, T, vocab) of embedded tokens `h` (B, T, d): `head` of `hidden`."""
        return self.head(P, self.hidden(P, h, positions, s), s)

    def hidden(self, P: dict, h, positions, s: DecoderShape):
        """The blocks and the final norm: the hidden states (B, T, d) the output projection reads."""
        return final_norm(P, self.decoder_blocks(P, h, positions, s), s)

    def decoder_blocks(self, P: dict, h, positions, s: DecoderShape):
        """The blocks over embedded tokens `h`: the last block's output (B, T, d)."""
        return llama_blocks(P, h, positions, s)

    def head(self, P: dict, h, s: DecoderShape):
        """The output projection: logits (..., vocab) of normed hidden states (..., d), one position
        independent of the others (so it may take them in pieces)."""
        return project(P, h)

    def metadata(self, s: DecoderShape) -> dict:
        return common_metadata(s)

    # llama.cpp's tensor names -> transformers' (per layer, then global)
    hf_layer_names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                      "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
                      "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                      "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                      "ffn_down": "mlp.down_proj"}
    hf_global_names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                       "output.weight": "lm_head.weight"}

    def hf_name(self, name: str) -> str | None:
        """transformers' name of a llama.cpp tensor (None: transformers computes it, as rope_freqs)."""
        if name in self.hf_global_names:
            return self.hf_global_names[name]
        if not name.startswith("blk."):
            return None
        _, layer, stem, kind = name.split(".", 3)
        return f"model.layers.{layer}.{self.hf_layer_names[stem]}.{kind}"

    def hf_weights(self, tensors: dict[str, np.ndarray], s: DecoderShape) -> dict[str, np.ndarray]:
        """The file's tensors as transformers' state dict. llama.cpp's converter permutes a `llama`
        file's Q and K rows for adjacent-pair rope; this undoes it (NeoX files store them as is)."""
        out = {}
        for name, value in tensors.items():
            hf = self.hf_name(name)
            if hf is None:
                continue
            if not self.rope_neox and (".attn_q." in name or ".attn_k." in name):
                heads = s.n_head if ".attn_q." in name else s.n_kv_head
                value = value.reshape(heads, s.head_dim // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
            out[hf] = value
        return out

    def hf_config(self, s: DecoderShape) -> dict:
        """transformers' config of the same model (its counterpart in the parity tests)."""
        cfg = dict(vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.d_ff,
                   num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=s.n_kv_head,
                   head_dim=s.head_dim, rms_norm_eps=s.rms_eps, rope_theta=s.layers[0].rope_base,
                   tie_word_embeddings=True, attention_bias=False, max_position_embeddings=8192)
        if s.extras.get("llama3_rope"):
            cfg["rope_scaling"] = {"rope_type": "llama3", **s.extras["llama3_rope"]}
        elif s.layers[0].rope_scale != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": 1.0 / s.layers[0].rope_scale}
        return cfg


class Qwen2(Llama):
    """`qwen2`: q/k/v biases, NeoX rope."""

    name = "qwen2"
    rope_neox = True
    hf_class = "Qwen2ForCausalLM"
    hf_config_class = "Qwen2Config"

    def tensor_shapes(self, s: DecoderShape, names: list[str]) -> dict[str, tuple[int, ...]]:
        shapes = tensor_shapes(s, names)
        for i in range(s.n_layer):
            b = f"blk.{i}."
            shapes |= {b + "attn_q.bias": (s.q_width,), b + "attn_k.bias": (s.kv_width,),
                       b + "attn_v.bias": (s.kv_width,)}
        return shapes

    def hf_config(self, s: DecoderShape) -> dict:
        cfg = super().hf_config(s)
        cfg.pop("attention_bias")
        return cfg


LLAMA = Llama()
QWEN2 = Qwen2()
