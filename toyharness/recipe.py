"""`Recipe`: the base of any recipe, with a default for every hook but `realize`.

A minimal recipe declares its options class and builds its model::

    from dataclasses import dataclass

    from toyharness import Recipe, TextOptions, hookimpl, normal

    @dataclass
    class BigramOptions(TextOptions):
        lr: float = 1e-1

    class Bigram(Recipe):
        name = "bigram"
        options_class = BigramOptions

        @hookimpl
        def realize(self, engine, options, data):
            ...   # a model object with `trainer` (and `convention`)

    recipe = Bigram()      # published as `bigram = "package:recipe"` (entry point group toyharness.recipes)

Everything else a recipe may declare is an attribute or method below, each with its default. A
recipe need not derive from `Recipe`: the harness reads each attribute with the same default from
any object that implements the hooks (toyharness/hookspecs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from .hookspecs import PROJECT, RECIPE_HOOKS, hookimpl
from .options import Options

# The golden config (toyharness/goldens.py) every recipe starts from: small, fast, and it exercises
# every block. Keys a recipe's options do not have are left out. t_seq 24, not 16: on cuda, ggml
# sends f32 products with at most 16 columns to kernels that round to TF32.
GOLDEN_CONFIG: dict[str, Any] = {"n_layer": 1, "d_model": 32, "n_head": 2, "t_seq": 24, "t_batch": 2,
                                 "eval_every": 1000, "checkpoint_every": 1000, "warmup": 2, "seed": 7}
# How many training steps a golden holds.
GOLDEN_STEPS = 16


class Recipe:
    """The base of a recipe. Subclass it, set `options_class` and implement `realize`.

    The model `realize` returns exposes:

    - ``trainer``: the `Trainer` of its program (``prog.trainer(loss, convention)``), which
      `step`, `evaluate` and `export` below use, and the memory plan sizes;
    - ``convention`` (optional): the AdamW convention its graph was built for
      (``constant_betas`` or ``bias_corrected``); the run refuses an `hp` row of another one
      before any step. Default: its trainer's (the one given to ``prog.trainer``).

    A subclass's method named after a hook (``realize``, ``step``, ...) is that hook's
    implementation, with or without ``@hookimpl``: overriding `step` never unhooks it.

    Attributes a recipe may declare (class attributes or properties), each with its default:

    - ``name`` (""): the recipe's name in messages and in the exported file's architecture; the
      entry point's name is what users type, and what errors name.
    - ``options_class`` (`Options`): the options dataclass, deriving from `Options`,
      `TextOptions` or `toyharness.LMOptions`, plus the recipe's own keys; a key it does not
      declare is refused by name, and its ``validate`` checks the values.
    - ``golden_config`` (`GOLDEN_CONFIG`: n_layer 1, d_model 32, n_head 2, t_seq 24, t_batch 2,
      eval_every and checkpoint_every 1000, warmup 2, seed 7): the options the golden run sets
      over the recipe's defaults; keys its options lack are left out, so one dict serves every
      recipe. A recipe on the core text data (no ``load_data`` of its own) also trains its golden
      on ``data=synthetic``, the same corpus on every Python version, unless the dict sets data.
    - ``golden_steps`` (16): how many steps the golden run trains and records.
    - ``golden_sets`` ([]): ``KEY=VALUE`` options added after `golden_config` (sizes only this
      recipe has); None: the recipe has no golden (it needs inputs, such as a base model, that a
      machine may not have), and a check skips it.
    - ``golden_variants`` ({}): more goldens, variant name -> ``KEY=VALUE`` options added last,
      each checked as ``RECIPE@VARIANT`` (lora's ``lora@q4_k``: its golden over a quantized base).
    - ``bench_sets`` ([]): ``KEY=VALUE`` options ``toyharness bench`` adds to the recipe's
      defaults, before ``--set``.
    - ``metric_names`` (()): the metrics its step and evaluate hooks return beside the loss (a
      dict ``{"loss": ..., NAME: float}``); each step's go into metrics.jsonl by name and each
      evaluation's as ``eval_NAME``, and ``toyharness sweep --rank`` ranks by them.
    - ``gguf_metadata`` (a method, ``(options, model) -> (arch, metadata)``; default
      ``toyharness-NAME`` and no keys): the exported GGUF's
      architecture and metadata, as the default ``export`` writes them.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in RECIPE_HOOKS:
            method = cls.__dict__.get(hook)
            if callable(method) and not hasattr(method, PROJECT + "_impl"):
                setattr(cls, hook, hookimpl(method))

    # (each attribute is described in the class's docstring)
    name: ClassVar[str] = ""
    options_class: ClassVar[type[Options]] = Options
    golden_config: ClassVar[dict[str, Any]] = GOLDEN_CONFIG
    golden_steps: ClassVar[int] = GOLDEN_STEPS
    golden_sets: ClassVar[list[str] | None] = []
    golden_variants: ClassVar[dict[str, list[str]]] = {}
    bench_sets: ClassVar[list[str]] = []
    metric_names: ClassVar[tuple[str, ...]] = ()

    # --- hooks ---------------------------------------------------------------------------------
    @hookimpl
    def options(self) -> type[Options]:
        """The options class: `options_class`."""
        return self.options_class

    @hookimpl
    def hp(self, options: Options, step: int):
        """The AdamW row of 0-indexed `step` from the options (lr, betas, eps, weight decay, the
        schedule and its warmup)."""
        return options.adamw_row().hp_for_step(step)

    @hookimpl
    def step(self, model, batch: dict, hp) -> float:
        """One step of ``model.trainer`` on `batch`; the loss."""
        return model.trainer.step(batch, hp)

    @hookimpl
    def evaluate(self, model, batch: dict) -> dict:
        """``{"loss": ...}``: the trainer's loss on a held-out batch, forward only."""
        return {"loss": model.trainer.eval_loss(batch)}

    @hookimpl
    def export(self, model, options: Options, out_dir: Path) -> list:
        """``model.gguf`` in `out_dir`: every parameter of ``model.trainer`` by its name, with the
        architecture and metadata of `gguf_metadata`."""
        from .engine import write_gguf

        prog = model.trainer.prog
        params = {name: prog.read(t) for name, t in prog.params.items()}
        arch, meta = self.gguf_metadata(options, model)
        return [write_gguf(Path(out_dir) / "model.gguf", arch, params, meta)]

    # --- what the default hooks read -----------------------------------------------------------
    def gguf_metadata(self, options: Options, model) -> tuple[str, dict[str, Any]]:
        """The exported GGUF's architecture name and its metadata (key -> value). Default:
        ``toyharness-NAME`` and no keys. (`toyharness.LMRecipe`'s takes the vocabulary size in
        place of the model: it also writes the tokenizer.)"""
        return f"toyharness-{self.name or type(self).__name__.lower()}", {}
