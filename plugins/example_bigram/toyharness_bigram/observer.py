"""An example third-party observer: each run's losses as a CSV file beside its metrics.

Published under the entry point group ``toyharness.observers`` (see this folder's pyproject.toml)
and enabled with ``toyharness run RECIPE --log losscsv``; it works for any recipe. The hooks it
implements are documented in ``toyharness/hookspecs.py`` (`ObserverSpec`). They are called off the
training loop: a slow or failing observer never slows or stops the run.
"""

from __future__ import annotations

from pathlib import Path

from toyharness import atomic_write, hookimpl


class LossCSV:
    """``losses.csv``: step, train loss, eval loss (empty between evaluations). The harness makes
    one instance per run, as this is a class."""

    def __init__(self) -> None:
        self.rows: dict[int, list] = {}          # step -> [train loss, eval loss or None]

    @hookimpl
    def step_end(self, step: int, loss: float) -> None:      # any subset of the hook's arguments
        self.rows[step] = [loss, None]

    @hookimpl
    def eval_end(self, step: int, loss: float) -> None:
        self.rows[step][1] = loss

    @hookimpl
    def run_end(self, summary: dict) -> None:
        lines = ["step,loss,eval_loss"] + [f"{step},{loss!r},{'' if ev is None else repr(ev)}"
                                           for step, (loss, ev) in sorted(self.rows.items())]
        atomic_write(Path(summary["out_dir"]) / "losses.csv", "\n".join(lines) + "\n")
