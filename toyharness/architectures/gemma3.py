"""`gemma3` (Gemma 3 270M-27B text) as llama.cpp runs it (src/models/gemma3.cpp of the pinned
source): token embeddings scaled by sqrt(d_model); an RMSNorm of each head's q and k; norms after
attention and after the feed-forward too (`post_attention_norm`, `post_ffw_norm`); GeGLU (tanh
GELU on the gate); head size from `attention.key_length` (256); NeoX rope; a tied output.

Sliding-window attention: with `attention.sliding_window` set, layer i is local (keys within the
window) unless i % 6 == 5 (`attention.sliding_window_pattern` changes the 6, or lists the layers),
and local layers rotate with their own base (`rope.freq_base_swa`, default 10000) and no scaling;
global layers with `rope.freq_base` and `rope.scaling.*`. Norm weights are used as stored: the
converter already folds Gemma's "1 + w". Queries are scaled by 1/sqrt(head_dim), except for the
27B (62 layers), which llama.cpp scales by 1/sqrt(d_model / n_head) as gemma_pytorch does.
"""

from __future__ import annotations

import math

from ..engine import blocks
from ..engine.gguf_io import GGUFError
from .llama import Llama, read_common, rope_for, tensor_shapes
from .spec import DecoderShape, ModelKeys


def gemma3_blocks(P: dict, h, positions, s: DecoderShape):
    """The blocks over embedded tokens `h`: the last block's output, before the final norm."""
    h = h.scale(s.embed_scale)
    for i in range(s.n_layer):
        b = f"blk.{i}."
        x = blocks.rms_norm(h, P[b + "attn_norm.weight"], s.rms_eps)
        a = blocks.attention(x, P[b + "attn_q.weight"], P[b + "attn_k.weight"], P[b + "attn_v.weight"],
                             P[b + "attn_output.weight"], s.n_head, s.n_kv_head, head_dim=s.head_dim,
                             q_norm=P[b + "attn_q_norm.weight"], k_norm=P[b + "attn_k_norm.weight"],
                             norm_eps=s.rms_eps, rope=rope_for(P, positions, s, i), window=s.layers[i].window,
                             scale=s.attn_scale)
        h = h + blocks.rms_norm(a, P[b + "post_attention_norm.weight"], s.rms_eps)
        x = blocks.rms_norm(h, P[b + "ffn_norm.weight"], s.rms_eps)
        f = blocks.geglu_mlp(x, P[b + "ffn_gate.weight"], P[b + "ffn_up.weight"], P[b + "ffn_down.weight"])
        h = h + blocks.rms_norm(f, P[b + "post_ffw_norm.weight"], s.rms_eps)
    return h


def local_layers(keys: ModelKeys, n_layer: int) -> list[bool]:
    """Which layers use the sliding window, as llama.cpp's set_swa_pattern(6) decides (or the
    file's `attention.sliding_window_pattern`, a period or a per-layer list)."""
    pattern = keys.list("attention.sliding_window_pattern")
    if pattern is None:
        pattern = [6]
    if len(pattern) == n_layer and all(isinstance(p, bool) for p in pattern):
        return list(pattern)
    if len(pattern) != 1 or isinstance(pattern[0], bool) or not isinstance(pattern[0], int) or pattern[0] < 0:
        raise GGUFError(f"{keys.path}: metadata {keys.arch}.attention.sliding_window_pattern is {pattern!r}: "
                        f"expected a period or one flag per layer")
    n = pattern[0]
    return [n == 0 or i % n < n - 1 for i in range(n_layer)]


class Gemma3(Llama):
    name = "gemma3"
    rope_neox = True
    hf_class = "Gemma3ForCausalLM"
    hf_config_class = "Gemma3TextConfig"

    def read_shape(self, keys: ModelKeys, vocab: int, names: list[str]) -> DecoderShape:
        s = read_common(keys, vocab, names, self.rope_neox, default_eps=1e-6)
        if keys.has("final_logit_softcapping") or keys.has("attn_logit_softcapping"):
            which = "final_logit_softcapping" if keys.has("final_logit_softcapping") else "attn_logit_softcapping"
            keys.float(which)
            raise GGUFError(f"{keys.path}: metadata {keys.arch}.{which}: soft-capping is not implemented "
                            f"(tanh has no backward in the pinned ggml)")
        window = keys.int("attention.sliding_window", 0, minimum=0)
        if window:
            local_base = keys.float("rope.freq_base_swa", 10000.0)
            for layer, local in zip(s.layers, local_layers(keys, s.n_layer)):
                if local:
                    layer.window, layer.rope_base, layer.rope_scale = window, local_base, 1.0
        s.embed_scale = math.sqrt(s.d_model)
        # llama.cpp: the 27B (62 layers) scales queries by 1/sqrt(d_model / n_head), as gemma_pytorch
        s.attn_scale = 1.0 / math.sqrt(s.d_model / s.n_head if s.n_layer == 62 else s.head_dim)
        return s

    def tensor_shapes(self, s: DecoderShape, names: list[str]) -> dict[str, tuple[int, ...]]:
        shapes = tensor_shapes(s, names)
        for i in range(s.n_layer):
            b = f"blk.{i}."
            shapes |= {b + "attn_q_norm.weight": (s.head_dim,), b + "attn_k_norm.weight": (s.head_dim,),
                       b + "post_attention_norm.weight": (s.d_model,), b + "post_ffw_norm.weight": (s.d_model,)}
        return shapes

    def decoder_blocks(self, P, h, positions, s):
        return gemma3_blocks(P, h, positions, s)

    def metadata(self, s: DecoderShape) -> dict:
        from .llama import common_metadata
        meta = common_metadata(s)
        glob = next(lay for lay in s.layers if lay.window is None)
        meta[f"{s.arch}.rope.freq_base"] = glob.rope_base
        local = [lay for lay in s.layers if lay.window is not None]
        if local:
            meta |= {f"{s.arch}.attention.sliding_window": local[0].window,
                     f"{s.arch}.rope.freq_base_swa": local[0].rope_base}
        meta |= {f"{s.arch}.attention.key_length": s.head_dim, f"{s.arch}.attention.value_length": s.head_dim}
        return meta

    hf_layer_names = {**Llama.hf_layer_names, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    def hf_weights(self, tensors, s):
        """transformers' Gemma3RMSNorm multiplies by 1 + w: the converter's folded 1 comes off."""
        out = super().hf_weights(tensors, s)
        return {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in out.items()}

    def hf_config(self, s: DecoderShape) -> dict:
        local = [lay for lay in s.layers if lay.window is not None]
        glob = next(lay for lay in s.layers if lay.window is None)
        cfg = dict(vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.d_ff,
                   num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=s.n_kv_head,
                   head_dim=s.head_dim, rms_norm_eps=s.rms_eps, rope_theta=glob.rope_base,
                   rope_local_base_freq=local[0].rope_base if local else 10000.0,
                   sliding_window=local[0].window if local else 4096,
                   layer_types=["sliding_attention" if lay.window else "full_attention" for lay in s.layers],
                   query_pre_attn_scalar=round((1.0 / s.attn_scale) ** 2), hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True, attention_bias=False, max_position_embeddings=8192, pad_token_id=0,
                   final_logit_softcapping=None, attn_logit_softcapping=None)
        if glob.rope_scale != 1.0:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": 1.0 / glob.rope_scale}
        return cfg


GEMMA3 = Gemma3()
