"""GPT-2 from scratch: learned positions, pre-LayerNorm blocks, causal attention with q/k/v/o
biases, tanh-GELU MLP, final LayerNorm, tied unembedding. AdamW row `bias_corrected`.

Init (the seeds' scheme): matrices and embeddings from the seeded LCG stream with standard
deviation 0.02, LayerNorm gains 1, biases 0.

nanoGPT's model (karpathy/nanoGPT model.py with train.py's defaults) is `bias=false gelu=erf
scaled_proj_init=true`: no bias in any linear layer or LayerNorm, the exact GELU (nn.GELU()),
and the residual projections (attn_output, ffn_down) drawn at 0.02/sqrt(2 n_layer).

The exported model.gguf is llama.cpp's gpt2, which has biases and the tanh GELU: with
bias=false it holds zero biases (the same function); with gelu=erf llama.cpp still computes the
tanh form, so its logits differ from ours by the two forms' difference (under 5e-4 per
activation). `toyharness sample` runs this recipe's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toyharness import InputError, LMOptions, LMRecipe, blocks, choice, lcg_scaled, positive, probability


@dataclass
class GPT2Options(LMOptions):
    n_layer: int = positive(2)
    d_model: int = positive(128)
    n_head: int = positive(4)
    untied: bool = False         # an output matrix of its own (default: the token embedding, tied)
    t_seq: int = 64
    t_batch: int = 16
    lr: float = 3e-3
    beta2: float = 0.999
    adamw_convention: str = choice("bias_corrected", ("bias_corrected", "constant_betas"))
    lr_schedule: str = choice("cosine", ("constant", "linear", "cosine"))
    warmup: int = 20
    steps: int = 1500
    eval_every: int = 250
    checkpoint_every: int = 250
    # recompute each block's activations in the backward (engine/recompute.py): less memory, the
    # same losses bit for bit, one more forward of the blocks per step (cpu and cuda backends)
    recompute_blocks: bool = False
    # dropout where nanoGPT puts it: on the embeddings, the attention weights, the attention's and
    # the MLP's outputs; 0 builds no dropout node (Tensor.dropout: masks repeat run to run)
    dropout: float = probability(0.0)
    # nanoGPT's model: no biases (linear layers and LayerNorms), the exact GELU (erf), and the
    # residual projections (attn_output, ffn_down) drawn at 0.02 / sqrt(2 n_layer)
    bias: bool = True
    gelu: str = choice("tanh", ("tanh", "erf"))
    scaled_proj_init: bool = False


class GPT2(LMRecipe):
    name = "gpt2"
    options_class = GPT2Options
    # gpt2@dropout: the golden config with dropout 0.1 at its four sites; gpt2@accum: two
    # micro-batches of the golden t_batch a step; gpt2@clip: a global norm bound below every step's
    # gradient norm at the golden config, so that every step clips
    # gpt2@nanogpt: nanoGPT's model (no biases, exact GELU, scaled residual projections)
    # gpt2@dp2: gpt2@accum's two micro-batches a step in two processes (the same bits)
    golden_variants = {"dropout": ["dropout=0.1"], "accum": ["accumulate=2"], "clip": ["grad_clip=0.05"],
                       "nanogpt": ["bias=false", "gelu=erf", "scaled_proj_init=true"], "dp2": ["devices=2"]}

    def torch_reference(self, options):
        """Its PyTorch twin (`bench` beside PyTorch, the parity tests); torch loads only here."""
        from .torch_twins.gpt2 import GPT2Twin

        if options.dropout:
            raise InputError("option 'dropout': the PyTorch twin has no dropout; set dropout=0")
        return GPT2Twin(options)

    def init_params(self, o: GPT2Options, vocab: int) -> dict[str, np.ndarray]:
        d = o.d_model

        def mat(name, shape, std=0.02):
            return lcg_scaled(o.seed, name, shape, std * o.init_scale)

        def norm(name):
            P[name + ".weight"] = np.ones(d, np.float32)
            if o.bias:
                P[name + ".bias"] = np.zeros(d, np.float32)

        def linear(name, shape, std=0.02):
            P[name + ".weight"] = mat(name + ".weight", shape, std)
            if o.bias:
                P[name + ".bias"] = np.zeros(shape[0], np.float32)

        # the residual projections: GPT-2 paper's 1/sqrt(N) for N residual layers, as nanoGPT draws them
        proj_std = 0.02 / np.sqrt(2 * o.n_layer) if o.scaled_proj_init else 0.02
        P = {"token_embd.weight": mat("token_embd.weight", (vocab, d)),
             "position_embd.weight": mat("position_embd.weight", (o.t_seq, d))}
        for i in range(o.n_layer):
            b = f"blk.{i}."
            norm(b + "attn_norm")
            for part in ("attn_q", "attn_k", "attn_v"):
                linear(b + part, (d, d))
            linear(b + "attn_output", (d, d), proj_std)
            norm(b + "ffn_norm")
            linear(b + "ffn_up", (4 * d, d))
            linear(b + "ffn_down", (d, 4 * d), proj_std)
        norm("output_norm")
        if o.untied:
            P["output.weight"] = mat("output.weight", (vocab, d))
        return P

    def forward(self, P, tokens, positions, o: GPT2Options):
        tokens.prog.dropout_seed = o.seed
        h = P["token_embd.weight"].get_rows(tokens) + P["position_embd.weight"].get_rows(positions)
        if o.dropout:
            h = h.dropout(o.dropout, "dropout.embd")
        for i in range(o.n_layer):
            h = blocks.recomputed_block(self.block, h, P, f"blk.{i}.", o)
        h = blocks.layer_norm(h, P["output_norm.weight"], P.get("output_norm.bias"))
        return blocks.linear(h, P.get("output.weight", P["token_embd.weight"]))

    @staticmethod
    def block(h, P, b: str, o: GPT2Options):
        """One pre-LayerNorm block (`b`: its tensors' prefix, blk.N.); with dropout p > 0 on the
        attention weights and each residual branch, masks named dropout.blk.N.SITE."""
        p = o.dropout
        x = blocks.layer_norm(h, P[b + "attn_norm.weight"], P.get(b + "attn_norm.bias"))
        attn = blocks.attention(x, P[b + "attn_q.weight"], P[b + "attn_k.weight"], P[b + "attn_v.weight"],
                                P[b + "attn_output.weight"], o.n_head, bq=P.get(b + "attn_q.bias"),
                                bk=P.get(b + "attn_k.bias"), bv=P.get(b + "attn_v.bias"),
                                bo=P.get(b + "attn_output.bias"), dropout=p, dropout_name=f"dropout.{b}attn_probs")
        h = h + (attn.dropout(p, f"dropout.{b}attn_out") if p else attn)
        x = blocks.layer_norm(h, P[b + "ffn_norm.weight"], P.get(b + "ffn_norm.bias"))
        mlp = blocks.gelu_mlp(x, P[b + "ffn_up.weight"], P.get(b + "ffn_up.bias"), P[b + "ffn_down.weight"],
                              P.get(b + "ffn_down.bias"), o.gelu)
        return h + (mlp.dropout(p, f"dropout.{b}ffn_out") if p else mlp)

    def gguf_metadata(self, o: GPT2Options, vocab: int):
        return "gpt2", {
            "gpt2.context_length": o.t_seq, "gpt2.embedding_length": o.d_model,
            "gpt2.feed_forward_length": 4 * o.d_model, "gpt2.block_count": o.n_layer,
            "gpt2.attention.head_count": o.n_head, "gpt2.attention.layer_norm_epsilon": 1e-5,
            "gpt2.vocab_size": vocab, "general.name": "toyharness-gpt2",
        }

    def export_tensors(self, params, o: GPT2Options):
        """llama.cpp's gpt2 takes a fused attn_qkv (rows q, k, v), and requires every bias: with
        bias=false each is written as zeros (the same function)."""
        if not o.bias:
            params = {**params, **{name: np.zeros(params[name.replace(".bias", ".weight")].shape[0], np.float32)
                                   for name in self._bias_names(o)}}
        out = {}
        for name, value in params.items():
            if ".attn_k." in name or ".attn_v." in name:
                continue
            if ".attn_q." in name:
                kind = name.rsplit(".", 1)[1]
                blk = name.split(".attn_q.")[0]
                out[f"{blk}.attn_qkv.{kind}"] = np.concatenate(
                    [params[f"{blk}.attn_{p}.{kind}"] for p in ("q", "k", "v")], axis=0)
                continue
            out[name] = value
        return out

    @staticmethod
    def _bias_names(o: GPT2Options) -> list[str]:
        """The biases bias=true gives (each the size of its weight's rows)."""
        names = [f"blk.{i}.{part}.bias" for i in range(o.n_layer)
                 for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_up",
                              "ffn_down")]
        return names + ["output_norm.bias"]


recipe = GPT2()
