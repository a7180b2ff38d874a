"""What the training loop does around each step (toyharness/runner.py): the step's batch as
micro-batches (``accumulate``), the check that the recipe's trainer honours the loop's controls,
evaluation a micro-batch at a time, and the progress bar."""

from __future__ import annotations

import dataclasses

import numpy as np

from .errors import InputError
from .options import Options


def loop_options(options: Options) -> Options:
    """The options the loop runs on: with `devices` N > 1 (data parallel, engine/data_parallel.py)
    a step of N x `accumulate` micro-batches, as accumulate = N x accumulate in one process, of
    which each process computes `accumulate`, one a round."""
    devices = getattr(options, "devices", 1)
    if devices == 1:
        if getattr(options, "gradient_reduce", "in_order") != "in_order":
            raise InputError(f"option 'gradient_reduce={options.gradient_reduce}': for devices > 1 (one process "
                             "has nothing to reduce)")
        return options
    return dataclasses.replace(options, accumulate=devices * options.accumulate)


def options_for_steps(options: Options) -> Options:
    """The options a step's batch is made with: t_batch * accumulate rows (the rows one batch of
    that size holds), split into `accumulate` micro-batches of t_batch rows."""
    if options.accumulate == 1:
        return options
    return dataclasses.replace(options, t_batch=options.t_batch * options.accumulate)


def micro_batches(data, batch: dict[str, np.ndarray], k: int, options) -> list[dict[str, np.ndarray]]:
    """A step's batch as `k` micro-batches of consecutive rows, in order: the data's own
    ``micro_batches(batch, k, options)`` where it has one (inputs that depend on the batch's layout,
    such as image data's class-token rows), else each array split along its first axis."""
    if k == 1:
        return [batch]
    if hasattr(data, "micro_batches"):
        return data.micro_batches(batch, k, options)
    return [{name: np.ascontiguousarray(part) for name, part in zip(batch, parts)}
            for parts in zip(*(np.split(a, k, axis=0) for a in batch.values()))]


def check_loop_controls(recipe: str, trainer, options: Options) -> None:
    """A trainer that was not built with the run's accumulation and clipping (its program made on
    another engine, or by a Trainer of the recipe's own) would silently ignore them: refused by name."""
    loop = getattr(trainer, "loop", None)
    for key in ("accumulate", "grad_clip"):
        wanted, default = getattr(options, key), (1 if key == "accumulate" else 0.0)
        if wanted != default and getattr(loop, key, default) != wanted:
            raise InputError(f"option {key!r}: recipe {recipe}'s trainer was not built with it (its program was not "
                             f"made on the run's engine in realize); leave {key} at {default}")


def split_result(result, what: str) -> tuple[float, dict[str, float]]:
    """A step hook's result: a loss, or a dict of the loss and the recipe's metrics by name."""
    if isinstance(result, dict):
        if "loss" not in result:
            raise InputError(f"{what} returned a dict without 'loss': {sorted(result)}")
        return result["loss"], {k: float(v) for k, v in result.items() if k != "loss"}
    return result, {}


def optimizer_step(pm, model, trainer, data, batch: dict, row, options: Options,
                   recipe: str) -> tuple[float, dict[str, float]]:
    """One optimizer step: the step hook on the batch, or on each of its `accumulate` micro-batches
    in order (the Trainer sums their gradients and steps on the last); the step's loss and the
    recipe's metrics (the micro-batches' mean: each counts the same rows)."""
    if options.accumulate == 1:
        return split_result(pm.hook.step(model=model, batch=batch, hp=row), f"recipe {recipe}'s step hook")
    before = trainer.steps_done
    if getattr(trainer, "collective", None) is not None:      # data parallel: this process's micro-batches
        dp = trainer.collective
        chunks = micro_batches(data, batch, options.accumulate, options)[dp.rank::dp.size]
        mine = []
        for chunk in chunks:
            _, metrics = split_result(pm.hook.step(model=model, batch=chunk, hp=row), f"recipe {recipe}'s step hook")
            mine.append(metrics)
        if trainer.steps_done != before + 1:
            raise InputError(f"option 'devices': recipe {recipe}'s step hook did not step its trainer once per "
                             "micro-batch (Trainer.step); leave devices at 1")
        names = sorted(mine[0])          # every process's, summed in micro-batch order: accumulation's mean
        sums = {k: 0.0 for k in names}
        if names:
            gathered = dp.allgather(np.array([[m[k] for k in names] for m in mine], np.float64).reshape(-1))
            by_round = gathered.reshape(dp.size, len(chunks), len(names)).transpose(1, 0, 2)
            for round_values in by_round:
                for values in round_values:
                    for k, v in zip(names, values):
                        sums[k] += float(v)
        return trainer.step_loss, {k: v / options.accumulate for k, v in sums.items()}
    sums: dict[str, float] = {}
    for chunk in micro_batches(data, batch, options.accumulate, options):
        _, metrics = split_result(pm.hook.step(model=model, batch=chunk, hp=row), f"recipe {recipe}'s step hook")
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    if trainer.steps_done != before + 1:
        raise InputError(f"option 'accumulate': recipe {recipe}'s step hook did not step its trainer once per "
                         "micro-batch (Trainer.step); leave accumulate at 1")
    return trainer.step_loss, {k: v / options.accumulate for k, v in sums.items()}


def evaluate_batch(pm, model, data, batch: dict, options: Options) -> dict:
    """The evaluate hook on a held-out batch of t_batch * accumulate rows, a micro-batch at a time:
    the loss and a recipe's other float metrics their count-weighted mean (a held-out batch's
    valid rows where it says, else the trainer's counts: rows, or the mask's positions),
    classifiers' counts and confusion matrices summed; a micro-batch with no valid row is skipped."""
    if options.accumulate == 1:
        return pm.hook.evaluate(model=model, batch=batch)
    trainer = model.trainer
    out: dict = {}
    weights = 0.0
    for chunk in micro_batches(data, batch, options.accumulate, options):
        # image data's "valid" is its count of real rows; a preference batch's is a mask of positions
        valid = chunk.get("valid")
        w = float(valid) if valid is not None and np.ndim(valid) == 0 else trainer.micro_count(chunk)
        if w == 0:
            continue
        res = pm.hook.evaluate(model=model, batch=chunk)
        weights += w
        for key in ("correct", "count", "confusion"):
            if key in res:
                out[key] = res[key] if key not in out else out[key] + res[key]
        for key, value in res.items():
            if key not in ("correct", "count", "confusion"):
                out[key] = out.get(key, 0.0) + w * float(value)
    for key in out:
        if key not in ("correct", "count", "confusion"):
            out[key] /= weights
    return out



class Progress:
    """rich progress bar with loss, tokens/s and ETA; a line every 10% when not a terminal."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        if self.console.is_terminal:
            self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                 TextColumn("eval {task.fields[ev]}"), TimeRemainingColumn(), console=self.console)
            self._task = self._bar.add_task(label, total=total, loss="-", tps="-", ev="-")
            self._bar.start()

    def update(self, loss: float, tps: float, ev: float | None, grad_norm: float | None = None) -> None:
        self.done += 1
        if not self.enabled:
            return
        ev_s = f"{ev:.4f}" if ev is not None else "-"
        norm = f"  |g| {grad_norm:.3g}" if grad_norm is not None else ""     # grad_clip on: the norm before clipping
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=f"{loss:.4f}{norm}", tps=f"{tps:,.0f}", ev=ev_s)
        elif self.done == self.total or self.done % max(1, self.total // 10) == 0:
            self.console.print(f"step {self.done}/{self.total}  loss {loss:.4f}{norm}  {tps:,.0f} tok/s  eval {ev_s}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
