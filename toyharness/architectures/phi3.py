"""`phi3` (Phi-3/3.5-mini, Phi-4-mini) as llama.cpp runs it: q, k and v in one fused projection
(`attn_qkv`, rows q|k|v), gate and up in one (`ffn_up`, rows gate|up, SwiGLU), NeoX rope over
`rope.dimension_count` dims of each head (Phi-4-mini rotates 3/4 of a head), a tied or untied output.

LoRA targets the fused tensors as llama.cpp's adapters name them: `qkv` (attn_qkv) and `up`
(the fused gate|up); `q`, `k`, `v` and `gate` do not exist in these files.

Not implemented, so refused by name: the 128k models' LongRoPE (`rope_factors_long/short`,
`rope.scaling.attn_factor`). `attention.sliding_window` is read: llama.cpp ignores Phi-3's window
while transformers applies it, so sequences longer than the window (where the two disagree)
are refused.
"""

from __future__ import annotations

from ..engine import blocks
from ..engine.gguf_io import GGUFError
from .llama import Llama, read_common, rope_for, tensor_shapes
from .spec import DecoderShape, ModelKeys


def phi3_blocks(P: dict, h, positions, s: DecoderShape):
    """The blocks over embedded tokens `h`: the last block's output, before the final norm."""
    for i in range(s.n_layer):
        b = f"blk.{i}."
        x = blocks.rms_norm(h, P[b + "attn_norm.weight"], s.rms_eps)
        h = h + blocks.attention(x, None, None, None, P[b + "attn_output.weight"], s.n_head, s.n_kv_head,
                                 head_dim=s.head_dim, wqkv=P[b + "attn_qkv.weight"], rope=rope_for(P, positions, s, i))
        x = blocks.rms_norm(h, P[b + "ffn_norm.weight"], s.rms_eps)
        h = h + blocks.fused_swiglu_mlp(x, P[b + "ffn_up.weight"], P[b + "ffn_down.weight"])
    return h


class Phi3(Llama):
    name = "phi3"
    rope_neox = True
    targets = {"qkv": "attn_qkv", "o": "attn_output", "up": "ffn_up", "down": "ffn_down"}
    hf_class = "Phi3ForCausalLM"
    hf_config_class = "Phi3Config"

    def read_shape(self, keys: ModelKeys, vocab: int, names: list[str]) -> DecoderShape:
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            if name in names:
                raise GGUFError(f"{keys.path}: tensor {name!r}: Phi-3's LongRoPE (the 128k models) is not implemented")
        s = read_common(keys, vocab, names, self.rope_neox)
        window = keys.int("attention.sliding_window", 0, minimum=0)
        if window:
            s.max_seq = window
            s.max_seq_why = (f"phi3's attention.sliding_window is {window}: llama.cpp ignores the window and "
                             f"transformers applies it, so longer sequences have no one right answer")
        return s

    def tensor_shapes(self, s: DecoderShape, names: list[str]) -> dict[str, tuple[int, ...]]:
        return tensor_shapes(s, names, fused=True)

    def decoder_blocks(self, P, h, positions, s):
        return phi3_blocks(P, h, positions, s)

    def metadata(self, s: DecoderShape) -> dict:
        from .llama import common_metadata
        meta = common_metadata(s)
        if s.max_seq:
            meta[f"{s.arch}.attention.sliding_window"] = s.max_seq
        return meta

    hf_layer_names = {**Llama.hf_layer_names, "ffn_up": "mlp.gate_up_proj"}

    def hf_config(self, s: DecoderShape) -> dict:
        cfg = super().hf_config(s)
        cfg.pop("attention_bias")
        cfg.pop("head_dim")
        cfg |= dict(partial_rotary_factor=s.rope_dims / s.head_dim, sliding_window=s.max_seq,
                    original_max_position_embeddings=4096, pad_token_id=None)
        return cfg


PHI3 = Phi3()
