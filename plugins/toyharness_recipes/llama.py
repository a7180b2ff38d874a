"""Llama from scratch: RMSNorm, RoPE (adjacent pairs: llama.cpp's layout, so Q and K export
as they are), grouped-query attention, SwiGLU MLP, tied or untied output, optional q/k/v
biases (as Qwen2). AdamW row `constant_betas`.

Init: the seeded xorshift64 Box-Muller stream, standard deviation 0.02 * init_scale for
matrices and embeddings; norm gains 1, biases 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toyharness import (
    DecoderShape,
    InputError,
    Layer,
    LMOptions,
    LMRecipe,
    choice,
    llama_forward,
    normal,
    positive,
    probability,
    synthetic_instruction_file,
)

RMS_EPS = 1e-5
ROPE_BASE = 10000.0


def llama_shape(n_layer: int, d_model: int, n_head: int, n_kv_head: int, d_ff: int, vocab: int,
                qkv_bias: bool = False) -> DecoderShape:
    """The shape of a llama the recipe trains from scratch (rope on whole heads, adjacent pairs;
    its qwen2 export permutes Q and K for NeoX rope, see export_tensors)."""
    hd = d_model // n_head
    return DecoderShape("qwen2" if qkv_bias else "llama", n_layer, d_model, n_head, n_kv_head, hd, d_ff, vocab,
                        RMS_EPS, [Layer(ROPE_BASE) for _ in range(n_layer)], hd, rope_neox=False)


@dataclass
class LlamaOptions(LMOptions):
    n_layer: int = positive(2)
    d_model: int = positive(128)
    n_head: int = positive(4)
    n_kv_head: int = positive(2)
    d_ff: int = positive(384)
    untied: bool = False         # an output matrix of its own (default: the token embedding, tied)
    qkv_bias: bool = False       # q/k/v biases, as Qwen2 (exported as a qwen2)
    t_seq: int = 64
    t_batch: int = 16
    lr: float = 3e-3
    lr_schedule: str = choice("cosine", ("constant", "linear", "cosine"))
    warmup: int = 20
    steps: int = 600
    eval_every: int = 100
    checkpoint_every: int = 200
    # recompute each block's activations in the backward (engine/recompute.py): less memory, the
    # same losses bit for bit, one more forward of the blocks per step (cpu and cuda backends)
    recompute_blocks: bool = False
    # dropout where nanoGPT puts it: on the embeddings, the attention weights, the attention's and
    # the MLP's outputs; 0 builds no dropout node (Tensor.dropout: masks repeat run to run)
    dropout: float = probability(0.0)


class Llama(LMRecipe):
    name = "llama"
    options_class = LlamaOptions
    golden_sets = ["n_kv_head=1", "d_ff=48"]

    @property
    def golden_variants(self) -> dict[str, list[str]]:
        """llama@packed: the golden config on JSONL instructions packed several to a row (the data
        of lora@packed)."""
        from .lora import PACKED_GOLDEN_DATA

        return {"packed": [f"data={synthetic_instruction_file(**PACKED_GOLDEN_DATA)}", "pack=true"]}

    def torch_reference(self, options):
        """Its PyTorch twin (`bench` beside PyTorch, the parity tests); torch loads only here."""
        from .torch_twins.llama import LlamaTwin

        if options.dropout:
            raise InputError("option 'dropout': the PyTorch twin has no dropout; set dropout=0")
        return LlamaTwin(options)

    def init_params(self, o: LlamaOptions, vocab: int) -> dict[str, np.ndarray]:
        d, hd = o.d_model, o.d_model // o.n_head
        std = 0.02 * o.init_scale

        def mat(name, shape):
            return normal(o.seed, name, shape, std)

        P = {"token_embd.weight": mat("token_embd.weight", (vocab, d))}
        for i in range(o.n_layer):
            b = f"blk.{i}."
            P[b + "attn_norm.weight"] = np.ones(d, np.float32)
            P[b + "attn_q.weight"] = mat(b + "attn_q.weight", (d, d))
            P[b + "attn_k.weight"] = mat(b + "attn_k.weight", (o.n_kv_head * hd, d))
            P[b + "attn_v.weight"] = mat(b + "attn_v.weight", (o.n_kv_head * hd, d))
            if o.qkv_bias:
                P[b + "attn_q.bias"] = np.zeros(d, np.float32)
                P[b + "attn_k.bias"] = np.zeros(o.n_kv_head * hd, np.float32)
                P[b + "attn_v.bias"] = np.zeros(o.n_kv_head * hd, np.float32)
            P[b + "attn_output.weight"] = mat(b + "attn_output.weight", (d, d))
            P[b + "ffn_norm.weight"] = np.ones(d, np.float32)
            P[b + "ffn_gate.weight"] = mat(b + "ffn_gate.weight", (o.d_ff, d))
            P[b + "ffn_up.weight"] = mat(b + "ffn_up.weight", (o.d_ff, d))
            P[b + "ffn_down.weight"] = mat(b + "ffn_down.weight", (d, o.d_ff))
        P["output_norm.weight"] = np.ones(d, np.float32)
        if o.untied:
            P["output.weight"] = mat("output.weight", (vocab, d))
        return P

    def forward(self, P, tokens, positions, o: LlamaOptions):
        embed = P["token_embd.weight"]
        tokens.prog.dropout_seed = o.seed
        return llama_forward(P, embed.get_rows(tokens), positions,
                             llama_shape(o.n_layer, o.d_model, o.n_head, o.n_kv_head, o.d_ff, embed.shape[0]),
                             dropout=o.dropout)

    def gguf_metadata(self, o: LlamaOptions, vocab: int):
        arch = "qwen2" if o.qkv_bias else "llama"
        return arch, {
            f"{arch}.context_length": o.t_seq, f"{arch}.embedding_length": o.d_model,
            f"{arch}.feed_forward_length": o.d_ff, f"{arch}.block_count": o.n_layer,
            f"{arch}.attention.head_count": o.n_head, f"{arch}.attention.head_count_kv": o.n_kv_head,
            f"{arch}.attention.layer_norm_rms_epsilon": RMS_EPS, f"{arch}.rope.freq_base": ROPE_BASE,
            f"{arch}.rope.dimension_count": o.d_model // o.n_head, f"{arch}.vocab_size": vocab,
            "general.name": "toyharness-llama",
        }

    def export_tensors(self, params, o: LlamaOptions):
        """llama.cpp's `llama` rope pairs adjacent dims, as ours: Q and K go out unchanged. Its
        `qwen2` rope pairs dim j with j + head_dim/2 (NeoX), so for qkv_bias the rows of Q and
        K (and their biases) are permuted per head to give the same attention scores."""
        if not o.qkv_bias:
            return params
        out = dict(params)
        for name, value in params.items():
            if ".attn_q." in name:
                out[name] = adjacent_to_neox(value, o.n_head)
            elif ".attn_k." in name:
                out[name] = adjacent_to_neox(value, o.n_kv_head)
        return out


def adjacent_to_neox(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows (heads*hd, ...) reordered per head: [0, 2, 4, ..., 1, 3, 5, ...]."""
    hd = w.shape[0] // heads
    rest = w.shape[1:]
    return np.ascontiguousarray(w.reshape(heads, hd // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape))


recipe = Llama()
