"""An example third-party recipe: a bigram language model, next byte from this byte.

It is a separate distribution (see this folder's pyproject.toml) that the harness finds
through the ``toyharness.recipes`` entry point, with no change to the core. It imports only
``toyharness``'s public names. `toyharness.Recipe` gives it the default hooks (``options``,
``hp``, ``step``, ``evaluate``, ``export``), so it writes its options and ``realize``, and says
what its exported GGUF is called. Its golden lives in this folder's goldens/ and its own tests
check it through the ``toyharness_golden`` fixture.
"""

from __future__ import annotations

from dataclasses import dataclass

from toyharness import Recipe, TextOptions, hookimpl, normal


@dataclass
class BigramOptions(TextOptions):
    # TextOptions: the keys every recipe reads, plus t_seq and eval_batches for the core text data
    # it trains on (no load_data hook). Field defaults are the recipe's defaults; `--set key=value`
    # overrides them, and a key not declared is refused by name.
    t_seq: int = 64
    t_batch: int = 16
    lr: float = 1e-1
    steps: int = 300
    eval_every: int = 100
    checkpoint_every: int = 100


class BigramModel:
    """Logits of byte t+1 are row `token_t` of one (vocab, vocab) table."""

    convention = "constant_betas"  # the AdamW row convention this graph is trained with

    def __init__(self, engine, options: BigramOptions, vocab: int):
        self.vocab = vocab
        self.prog = engine.program()
        table = normal(options.seed, "bigram.weight", (vocab, vocab), 0.02 * options.init_scale)
        self.table = self.prog.param("bigram.weight", table)
        tokens = self.prog.input("tokens", (options.t_batch, options.t_seq), "i32", upper=vocab)
        logits = self.table.get_rows(tokens)                        # (batch, seq, vocab)
        self.trainer = self.prog.trainer(self.prog.cross_entropy(logits, "targets"), self.convention)


class Bigram(Recipe):
    name = "bigram"
    options_class = BigramOptions

    @hookimpl
    def realize(self, engine, options, data):
        return BigramModel(engine, options, data.vocab)

    def gguf_metadata(self, options, model):
        """model.gguf (Recipe's export: every parameter by name) is architecture `bigram`."""
        return "bigram", {"bigram.vocab_size": model.vocab}


recipe = Bigram()
