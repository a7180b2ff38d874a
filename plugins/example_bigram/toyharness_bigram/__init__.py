"""An example third-party recipe: a bigram language model, next byte from this byte.

It is a separate distribution (see this folder's pyproject.toml) that the harness finds
through the ``toyharness.recipes`` entry point, with no change to the core. It shows the
whole plugin API in one screen: options, realize, hp, step, evaluate, export. Its golden
lives in this folder's goldens/ and its own tests check it through the ``toyharness_golden``
fixture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toyharness.engine import write_gguf
from toyharness.hookspecs import hookimpl
from toyharness.options import Options
from toyharness.seeded_init import normal


@dataclass
class BigramOptions(Options):
    # Field defaults are the recipe's defaults; `--set key=value` overrides them.
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
        self.prog = engine.program()
        table = normal(options.seed, "bigram.weight", (vocab, vocab), 0.02 * options.init_scale)
        self.table = self.prog.param("bigram.weight", table)
        tokens = self.prog.input("tokens", (options.t_batch, options.t_seq), "i32", upper=vocab)
        logits = self.table.get_rows(tokens)                        # (batch, seq, vocab)
        self.trainer = self.prog.trainer(self.prog.cross_entropy(logits, "targets"), self.convention)


class Bigram:
    @hookimpl
    def options(self):
        return BigramOptions

    @hookimpl
    def realize(self, engine, options, data):
        return BigramModel(engine, options, data.vocab)

    @hookimpl
    def hp(self, options, step):
        return options.adamw_row().hp_for_step(step)

    @hookimpl
    def step(self, model, batch, hp):
        return model.trainer.step(batch, hp)

    @hookimpl
    def evaluate(self, model, batch):
        return {"loss": model.trainer.eval_loss(batch)}

    @hookimpl
    def export(self, model, options, out_dir):
        table = model.prog.read(model.table)
        return [write_gguf(Path(out_dir) / "model.gguf", "bigram", {"bigram.weight": table},
                           {"bigram.vocab_size": table.shape[0]})]


recipe = Bigram()
