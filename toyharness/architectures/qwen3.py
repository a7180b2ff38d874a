"""`qwen3` (Qwen3 0.6B-32B dense) as llama.cpp runs it: llama's blocks with an RMSNorm of each
head's q and k before the rotation (`attn_q_norm`, `attn_k_norm`, gain (head_dim,)), the head
size from `attention.key_length` (128 whatever the width), NeoX rope, no biases."""

from __future__ import annotations

from ..engine import blocks
from .llama import Llama, rope_for, tensor_shapes
from .spec import DecoderShape


def qwen3_blocks(P: dict, h, positions, s: DecoderShape):
    """The blocks over embedded tokens `h`: the last block's output, before the final norm."""
    for i in range(s.n_layer):
        b = f"blk.{i}."
        x = blocks.rms_norm(h, P[b + "attn_norm.weight"], s.rms_eps)
        h = h + blocks.attention(x, P[b + "attn_q.weight"], P[b + "attn_k.weight"], P[b + "attn_v.weight"],
                                 P[b + "attn_output.weight"], s.n_head, s.n_kv_head, head_dim=s.head_dim,
                                 q_norm=P[b + "attn_q_norm.weight"], k_norm=P[b + "attn_k_norm.weight"],
                                 norm_eps=s.rms_eps, rope=rope_for(P, positions, s, i))
        x = blocks.rms_norm(h, P[b + "ffn_norm.weight"], s.rms_eps)
        h = h + blocks.swiglu_mlp(x, P[b + "ffn_gate.weight"], P[b + "ffn_up.weight"], P[b + "ffn_down.weight"])
    return h


class Qwen3(Llama):
    name = "qwen3"
    rope_neox = True
    hf_class = "Qwen3ForCausalLM"
    hf_config_class = "Qwen3Config"

    def read_shape(self, keys, vocab, names) -> DecoderShape:
        from .llama import read_common
        return read_common(keys, vocab, names, self.rope_neox)

    def tensor_shapes(self, s: DecoderShape, names: list[str]) -> dict[str, tuple[int, ...]]:
        shapes = tensor_shapes(s, names)
        for i in range(s.n_layer):
            shapes |= {f"blk.{i}.attn_q_norm.weight": (s.head_dim,), f"blk.{i}.attn_k_norm.weight": (s.head_dim,)}
        return shapes

    def decoder_blocks(self, P, h, positions, s):
        return qwen3_blocks(P, h, positions, s)


QWEN3 = Qwen3()
