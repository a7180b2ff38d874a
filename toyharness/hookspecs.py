"""The plugin API. A recipe is an object (or module) implementing the recipe hooks, published
under the entry point group ``toyharness.recipes`` as ``name = "module:object"``. Observers
(loggers, reporters) implement the observer hooks and are registered beside the recipe.

Every recipe hook is `firstresult`: one recipe is active in a run. A minimal recipe::

    from toyharness.hookspecs import hookimpl

    class Bigram:
        @hookimpl
        def options(self): return BigramOptions
        @hookimpl
        def realize(self, engine, options, data): ...
        @hookimpl
        def hp(self, options, step): return options.adamw_row().hp_for_step(step)
        @hookimpl
        def step(self, model, batch, hp): return model.step(batch, hp)

    recipe = Bigram()

See plugins/example_bigram for a complete third-party plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pluggy

PROJECT = "toyharness"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RecipeSpec:
    @hookspec(firstresult=True)
    def options(self) -> type:
        """The recipe's options: a dataclass deriving from `toyharness.options.Options`, whose
        field defaults are the recipe's defaults. Unknown keys are rejected against it."""

    @hookspec(firstresult=True)
    def load_data(self, options) -> Any:
        """Optional. The data for a run (default: `toyharness.data.load_text_data(options.data)`).
        It must offer ``batch(split, index, options) -> dict[str, ndarray]`` (the step's inputs
        by name), ``items_per_batch(options) -> int`` (tokens or images), and ``check(options)``."""

    @hookspec(firstresult=True)
    def realize(self, engine, options, data) -> Any:
        """Build the model on the engine service: parameters and their init (seeded from
        ``options.seed``), forward, loss, backward and the AdamW steps. Return the model object
        later hooks receive; it exposes ``trainer`` (a `toyharness.engine.Trainer`) and
        ``convention``, the AdamW convention its graph declares."""

    @hookspec(firstresult=True)
    def hp(self, options, step: int) -> Any:
        """The 7-slot AdamW row for 0-indexed `step`, as a `toyharness.adamw.HPRow` (the 7
        floats plus the convention they follow). A row whose convention differs from the one
        the model's graph declares stops the run before any step."""

    @hookspec(firstresult=True)
    def step(self, model, batch: dict, hp) -> float:
        """One training step on one batch; return the loss (a float32 value)."""

    @hookspec(firstresult=True)
    def evaluate(self, model, batch: dict) -> dict:
        """Optional. Forward-only metrics on a held-out batch: at least ``{"loss": float}``;
        classifiers add ``"correct"`` (count) and ``"count"``."""

    @hookspec(firstresult=True)
    def export(self, model, options, out_dir: Path) -> list:
        """Optional. Write the trained weights (``model.gguf``, ``adapter.gguf``) into `out_dir`
        atomically; return the paths written."""


class ObserverSpec:
    @hookspec
    def run_start(self, run) -> None:
        """A run begins: `run` has ``recipe``, ``options``, ``out_dir``, ``engine``."""

    @hookspec
    def step_end(self, run, step: int, loss: float, lr: float, ms: float, tokens_per_s: float) -> None:
        """A training step finished (0-indexed `step`)."""

    @hookspec
    def run_end(self, run, summary: dict) -> None:
        """The run finished; `summary` is what summary.json holds."""


def plugin_manager(*plugins: Any) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(RecipeSpec)
    pm.add_hookspecs(ObserverSpec)
    for p in plugins:
        pm.register(p)
    return pm
