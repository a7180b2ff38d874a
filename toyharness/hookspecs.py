"""The plugin API. A recipe is an object (or module) implementing the recipe hooks, published
under the entry point group ``toyharness.recipes`` as ``name = "module:object"``. Observers
(loggers, experiment trackers) implement the observer hooks (`ObserverSpec`) and are published
under ``toyharness.observers``; ``toyharness run RECIPE --log NAME`` enables one.

Every recipe hook is `firstresult`: one recipe is active in a run. `toyharness.Recipe`
implements every hook but `realize` with a default, so a minimal recipe is::

    from toyharness import Recipe, TextOptions, hookimpl

    class Bigram(Recipe):
        name = "bigram"
        options_class = BigramOptions          # a dataclass deriving from TextOptions

        @hookimpl
        def realize(self, engine, options, data): ...

    recipe = Bigram()

An exception raised inside a recipe hook is reported in one line naming the recipe and the
hook, exit 2 (`toyharness.errors.RecipeError`; ``--debug`` prints the traceback); an
`InputError` a hook raises is reported with its own message. See plugins/example_bigram for a
complete third-party plugin.
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
        """The recipe's options: a dataclass deriving from `toyharness.Options` (or
        `TextOptions`, `LMOptions`), whose field defaults are the recipe's defaults. A key it does
        not declare is refused by name; its `validate` method checks the values (`Recipe`'s
        default: ``options_class``)."""

    @hookspec(firstresult=True)
    def load_data(self, options) -> Any:
        """Optional. The data for a run (default: the core text data,
        `toyharness.data.load_text_data(options.data)`, which needs `TextOptions`' keys).
        It must offer ``step_batch(split, index, options) -> dict[str, ndarray]`` (the inputs of
        train step `index`, or of held-out batch `index` for split "eval", by name),
        ``items_per_batch(options) -> int`` (tokens or images), ``check(options)`` (raise
        InputError when the data cannot serve these options) and, optionally,
        ``eval_batches(options) -> int`` (default: the option ``eval_batches``)."""

    @hookspec(firstresult=True)
    def realize(self, engine, options, data) -> Any:
        """Build the model on the engine service: parameters and their init (seeded from
        ``options.seed``), forward, loss, backward and the AdamW steps. Return the model object
        later hooks receive; it exposes ``trainer`` (a `toyharness.engine.Trainer`) and, optionally,
        ``convention``, the AdamW convention its graph declares (default: its trainer's). The
        seeded init helpers `toyharness.normal` and `toyharness.lcg_scaled` give values that the
        memory plan can also build as shapes only."""

    @hookspec(firstresult=True)
    def hp(self, options, step: int) -> Any:
        """The 7-slot AdamW row for 0-indexed `step`, as a `toyharness.adamw.HPRow` (the 7
        floats plus the convention they follow). A row whose convention differs from the one
        the model's graph declares stops the run before any step. `Recipe`'s default:
        ``options.adamw_row().hp_for_step(step)``."""

    @hookspec(firstresult=True)
    def step(self, model, batch: dict, hp) -> float:
        """One training step on one batch; return the loss (a float32 value). `Recipe`'s
        default: ``model.trainer.step(batch, hp)``. With the option ``accumulate`` K > 1 it is
        called K times per optimizer step, once per micro-batch of t_batch rows, with the step's
        row each time; it must call ``Trainer.step`` once per call (the Trainer accumulates and
        steps on the last; the runner reports ``Trainer.step_loss``). With ``devices`` N > 1 each
        of the N processes calls it K times per step, on its own micro-batches (the Trainer
        gathers the others' gradients and steps on the last)."""

    @hookspec(firstresult=True)
    def evaluate(self, model, batch: dict) -> dict:
        """Optional. Forward-only metrics on a held-out batch: at least ``{"loss": float}``;
        classifiers add ``"correct"`` (count) and ``"count"``. `Recipe`'s default: the trainer's
        loss on the batch."""

    @hookspec(firstresult=True)
    def export(self, model, options, out_dir: Path) -> list:
        """Optional. Write the trained weights (``model.gguf``, ``adapter.gguf``) into `out_dir`
        atomically; return the paths written. `Recipe`'s default: ``model.gguf`` of the trainer's
        parameters with the recipe's `gguf_metadata`."""


class ObserverSpec:
    """Observers (loggers, experiment trackers) watch runs and sweeps; they never change one.

    Publish one under the entry point group ``toyharness.observers`` as ``name = "module:object"``
    and enable it with ``toyharness run RECIPE --log NAME[,NAME]`` (or the option ``log``). The
    object is an instance, or a class the harness calls with no arguments for each run and sweep.
    An implementation takes any subset of a hook's arguments, by name.

    These hooks are delivered in order on a thread of their own, off the training loop: the loop
    never waits for an observer, and the arguments are copies made when the event happened. An
    observer that raises is reported in one line naming it and gets no further events; the run's
    losses, files and exit code are unchanged. At the end of a run the harness waits a bounded time
    (``TOYHARNESS_OBSERVER_WAIT_S``, default 30 s) for the events still queued, and reports an
    observer whose calls took a noticeable share of the run's time. ``run``, passed to every run
    hook, has ``recipe``, ``options``, ``out_dir``, ``engine`` and ``tags``; read what you need in
    the hook, not later.
    """

    @hookspec
    def run_start(self, run, options: dict, fingerprint: str, tags: dict) -> None:
        """A run begins, before its first step. `options` are the fully resolved options (as in
        config.toml, lists for list-valued ones), `fingerprint` the backend's (``cpu-avx2-...``,
        ``cpu-portable``, ``cuda-sm90``: what decides the float bits), `tags` what the caller tagged
        the run with: for a sweep point its grid values by option name, ``seed``, ``sweep_id``,
        ``sweep_dir``, ``point`` (its index) and ``point_name``; empty for a plain run."""

    @hookspec
    def step_end(self, run, step: int, loss: float, lr: float, ms: float, tokens_per_s: float,
                 grad_norm: float | None, metrics: dict) -> None:
        """A training step finished (0-indexed `step`): its loss (a float32 value; with
        ``accumulate`` the count-weighted mean of its micro-batches'), the learning rate it used,
        its time in milliseconds, items (tokens or images) per second, with ``grad_clip`` set
        the global L2 norm of its gradient before clipping (None otherwise), and `metrics`: the
        recipe's own metrics of the step by name (dpo's ``rewards/margins``, ...: the recipe's
        ``metric_names``; empty for most recipes), as metrics.jsonl has them. An implementation may
        leave out any of these arguments (grad_norm and metrics among them)."""

    @hookspec
    def eval_end(self, run, step: int, loss: float, accuracy: float | None, metrics: dict) -> None:
        """The held-out evaluation after 0-indexed `step`: mean loss over the eval batches, for
        classifiers the accuracy in [0, 1] (None otherwise), and `metrics`: the recipe's own
        metrics by name, each the mean over the eval batches (metrics.jsonl has them as
        ``eval_NAME``); empty for most recipes. An implementation may leave out any argument."""

    @hookspec
    def run_end(self, run, summary: dict, artifacts: dict) -> None:
        """The run finished; `summary` is what summary.json holds (plus ``out_dir``), `artifacts`
        the files the run wrote, by name (``config.toml``, ``metrics.jsonl``, ``summary.json``,
        ``loss.png``, ``model.gguf`` or ``adapter.gguf``, ``checkpoint.gguf``, ...) to their absolute
        `Path`. Empty when the run writes no files."""

    @hookspec
    def run_failed(self, run, error: str) -> None:
        """The run stopped before its end: `error` is the one-line reason (a NaN loss, a write
        that failed, an interrupt). No `run_end` follows; the steps before it were delivered."""

    @hookspec
    def sweep_start(self, sweep, grid: dict, seeds: list, points: list) -> None:
        """A sweep begins (`toyharness sweep`), before any point runs. `sweep` has ``recipe``,
        ``sweep_id``, ``out_dir`` and ``backend``; `grid` maps each swept option to its values as
        written; `seeds` the seeds of each configuration; `points` one dict per point: ``index``,
        ``name``, ``dir`` (its run folder), ``tags`` (what its run's `run_start` gets) and
        ``options``. Each point is then an ordinary run, in a process of its own, whose run hooks
        go to the same observers there. The harness waits (bounded) for this hook before the
        first point starts, so a tracker can create the sweep's parent record first."""

    @hookspec
    def sweep_end(self, sweep, results: dict, artifacts: dict) -> None:
        """The sweep finished (points may have failed). `results` is sweep.json's content: its
        ``points`` (each with ``status``, ``final_loss``, ``final_eval_loss``, ``best_eval_loss``,
        ``message``) and ``configs`` (mean and std over seeds, sorted); `artifacts` maps
        ``sweep.json`` (and ``sweep.png`` where one was drawn) to their paths."""


class _RecipeHookErrors:
    """Wraps each recipe hook: an exception raised inside one becomes a `RecipeError` naming the
    recipe and the hook (one line, exit 2; the traceback with --debug). The harness's own errors
    (`InputError` and the rest of `ToyharnessError`, a recipe's InputError among them) keep their
    message; MemoryError and interrupts pass as they are."""

    def __init__(self, recipe: str):
        self.recipe = recipe

    def _guard(self, hook: str, keep: tuple[type[BaseException], ...] = ()):
        """A pluggy wrapper's body: yields once; the hook's result, or its exception, comes back
        through that yield. Exceptions of the types in `keep` pass as they are."""
        from .errors import RecipeError, ToyharnessError

        try:
            return (yield)
        except (ToyharnessError, MemoryError, *keep):
            raise
        except Exception as exc:
            raise RecipeError(self.recipe, f"hook {hook}", exc) from exc

    @hookimpl(wrapper=True, tryfirst=True)
    def options(self):
        return (yield from self._guard("options"))

    @hookimpl(wrapper=True, tryfirst=True)
    def load_data(self, options):
        return (yield from self._guard("load_data"))

    @hookimpl(wrapper=True, tryfirst=True)
    def realize(self, engine, options, data):
        # Realized for a memory plan, a program that is asked for values raises RuntimeError, which
        # the plan's check takes as "not plannable" (the run then realizes for real, where the
        # recipe's own RuntimeError, if it was one, is reported as any other).
        planning = getattr(engine, "planner", None) is not None
        return (yield from self._guard("realize", (RuntimeError,) if planning else ()))

    @hookimpl(wrapper=True, tryfirst=True)
    def hp(self, options, step):
        return (yield from self._guard("hp"))

    @hookimpl(wrapper=True, tryfirst=True)
    def step(self, model, batch, hp):
        return (yield from self._guard("step"))

    @hookimpl(wrapper=True, tryfirst=True)
    def evaluate(self, model, batch):
        return (yield from self._guard("evaluate"))

    @hookimpl(wrapper=True, tryfirst=True)
    def export(self, model, options, out_dir):
        return (yield from self._guard("export"))


RECIPE_HOOKS = ("options", "load_data", "realize", "hp", "step", "evaluate", "export")


def plugin_manager(*plugins: Any) -> pluggy.PluginManager:
    """A plugin manager holding `plugins` (a recipe, observers). A plugin that implements a recipe
    hook is the run's recipe: its hooks' exceptions are reported as `_RecipeHookErrors` says."""
    from .discovery import recipe_name

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(RecipeSpec)
    pm.add_hookspecs(ObserverSpec)
    for p in plugins:
        pm.register(p)
    recipe = next((p for p in plugins if any(hasattr(getattr(p, h, None), PROJECT + "_impl") for h in RECIPE_HOOKS)),
                  None)
    if recipe is not None:
        pm.register(_RecipeHookErrors(recipe_name(recipe)))
    return pm
