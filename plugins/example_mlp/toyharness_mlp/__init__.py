"""An example third-party recipe: a Bengio-style MLP character model, not a transformer.

The next byte is predicted from the previous `context` bytes alone: each byte is embedded, the
`context` embeddings are concatenated, a ReLU layer and a gated layer (tanh times sigmoid) mix
them, and a projection back to the embedding width scores every byte against the embedding table
itself (tied weights). It imports only ``toyharness``'s public names (and numpy); the PyTorch twin
that ``toyharness bench`` puts beside it lives in torch_twin.py, imported only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toyharness import Recipe, TextOptions, blocks, hookimpl, normal, positive


@dataclass
class MLPOptions(TextOptions):
    # TextOptions: the keys every recipe reads plus t_seq and eval_batches (the core text data).
    # `positive` makes Options.validate refuse 0 and negatives by name.
    context: int = positive(4)        # bytes the model sees before the one it predicts
    d_embed: int = positive(16)       # width of one byte's embedding
    hidden: int = positive(128)       # width of the hidden layers
    t_seq: int = 64
    t_batch: int = 16
    lr: float = 1e-2
    steps: int = 300
    eval_every: int = 100
    checkpoint_every: int = 100

    def validate(self) -> None:
        super().validate()            # the base keys and every `positive` key
        if self.context > self.t_seq:
            raise self.invalid("context", f"must be at most t_seq ({self.t_seq}), got {self.context}")


class MLPModel:
    """Logits of byte t+1 from the embeddings of bytes t, t-1, ..., t-context+1 (zeros before the
    sequence starts)."""

    convention = "constant_betas"     # the AdamW row convention this graph is trained with

    def __init__(self, engine, o: MLPOptions, vocab: int):
        self.vocab = vocab
        prog = self.prog = engine.program()

        def param(name: str, shape: tuple[int, ...], std: float):
            return prog.param(name, normal(o.seed, name, shape, std * o.init_scale))

        def zeros(name: str, shape: tuple[int, ...]):
            return prog.param(name, np.zeros(shape, np.float32))

        # One matrix serves both ends: stored (d_embed, vocab), the output projection's layout;
        # its transpose is the (vocab, d_embed) table that both the lookup and the logits read.
        table = param("token_embd.weight", (o.d_embed, vocab), 1.0)
        rows = table.transpose()
        w_in = param("hidden.weight", (o.hidden, o.context * o.d_embed), (o.context * o.d_embed) ** -0.5)
        w_tanh = param("gate_tanh.weight", (o.hidden, o.hidden), o.hidden ** -0.5)
        w_sigm = param("gate_sigmoid.weight", (o.hidden, o.hidden), o.hidden ** -0.5)
        w_out = param("proj.weight", (o.d_embed, o.hidden), o.hidden ** -0.5)

        tokens = prog.input("tokens", (o.t_batch, o.t_seq), "i32", upper=vocab)
        emb = rows.get_rows(tokens)                                    # (batch, seq, d_embed)
        shifted = [emb]
        for back in range(1, o.context):                               # byte t-back at position t
            pad = prog.constant(f"start_pad.{back}", np.zeros((o.t_batch, back, o.d_embed), np.float32))
            shifted.append(pad.concat([emb[:, :o.t_seq - back]], axis=1))
        x = shifted[0].concat(shifted[1:], axis=-1)                    # (batch, seq, context*d_embed)
        h = blocks.linear(x, w_in, zeros("hidden.bias", (o.hidden,))).relu()
        h = blocks.linear(h, w_tanh).tanh() * \
            blocks.linear(h, w_sigm, zeros("gate_sigmoid.bias", (o.hidden,))).sigmoid()   # a gated unit
        logits = blocks.linear(blocks.linear(h, w_out), rows)          # (batch, seq, vocab)
        self.trainer = prog.trainer(prog.cross_entropy(logits, "targets"), self.convention)


class MLP(Recipe):
    name = "char_mlp"
    options_class = MLPOptions
    # The golden run: small enough to record in a second, every op of the model included.
    golden_config = {"context": 3, "d_embed": 8, "hidden": 16, "t_seq": 16, "t_batch": 2, "warmup": 2,
                     "seed": 7, "eval_every": 1000, "checkpoint_every": 1000}

    @hookimpl
    def realize(self, engine, options, data):
        return MLPModel(engine, options, data.vocab)

    def gguf_metadata(self, options, model):
        return "char_mlp", {"char_mlp.vocab_size": model.vocab, "char_mlp.context": options.context}

    def torch_reference(self, options):
        """The PyTorch twin `toyharness bench` and parity run beside ours (imports torch)."""
        from .torch_twin import MLPTwin

        return MLPTwin(options)


recipe = MLP()
