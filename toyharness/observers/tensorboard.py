"""`--log tensorboard`: TensorBoard event files in RUN_DIR/tensorboard/ (pip install "toyharness[tensorboard]").

Written with TensorBoard's own event writer (no TensorFlow): scalars ``train/loss``, ``train/lr``,
``train/tokens_per_s``, ``train/step_ms`` per step, ``eval/loss`` (and ``eval/accuracy``) per
evaluation, and text: ``options`` (resolved options and backend fingerprint), ``tags`` (a sweep
point's grid values and seed), ``summary`` and ``artifacts`` at the end (``error`` if it failed). A
resumed run appends a new event file to the same folder. A sweep writes its grid and
its results table to SWEEP_DIR/tensorboard/, beside each point's own folder, so
``tensorboard --logdir SWEEP_DIR`` shows every point of it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..hookspecs import hookimpl

SUBDIR = "tensorboard"


def _markdown_table(rows: dict[str, Any], head: tuple[str, str] = ("key", "value")) -> str:
    lines = [f"| {head[0]} | {head[1]} |", "| --- | --- |"]
    lines += [f"| {k} | {', '.join(map(str, v)) if isinstance(v, (list, tuple)) else v} |" for k, v in rows.items()]
    return "\n".join(lines)


class TensorBoardObserver:
    """One run's (or one sweep's) event file."""

    def __init__(self) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.plugins.text.summary_v2 import text_pb
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise InputError(f"observer 'tensorboard' needs the tensorboard package ({exc}): "
                             "pip install \"toyharness[tensorboard]\"") from None
        self._event, self._summary, self._text_pb, self._writer_cls = event_pb2, summary_pb2, text_pb, EventFileWriter
        self.writer = None
        self.logdir: Path | None = None

    # -- writing

    def _open(self, logdir: Path) -> None:
        self.logdir = logdir
        self.writer = self._writer_cls(str(logdir), flush_secs=30)

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary.Summary(value=[self._summary.Summary.Value(tag=tag, simple_value=float(v))
                                               for tag, v in values.items() if v is not None])
        self.writer.add_event(self._event.Event(wall_time=time.time(), step=step, summary=summary))

    def _text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_event(self._event.Event(wall_time=time.time(), step=step, summary=self._text_pb(tag, text)))

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # -- a run

    @hookimpl
    def run_start(self, run, options: dict, fingerprint: str, tags: dict) -> None:
        self._open(Path(run.out_dir) / SUBDIR)
        self._text("options", _markdown_table({"recipe": run.recipe, "fingerprint": fingerprint, **options},
                                              ("option", "value")))
        if tags:
            self._text("tags", _markdown_table(tags, ("tag", "value")))

    @hookimpl
    def step_end(self, step: int, loss: float, lr: float, ms: float, tokens_per_s: float,
                 grad_norm: float | None, metrics: dict) -> None:
        self._scalars(step, {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s,
                             "train/step_ms": ms, "train/grad_norm": grad_norm,
                             **{f"train/{k}": v for k, v in metrics.items()}})

    @hookimpl
    def eval_end(self, step: int, loss: float, accuracy: float | None, metrics: dict) -> None:
        self._scalars(step, {"eval/loss": loss, "eval/accuracy": accuracy,
                             **{f"eval/{k}": v for k, v in metrics.items()}})
        self.writer.flush()

    @hookimpl
    def run_end(self, summary: dict, artifacts: dict) -> None:
        step = max(int(summary.get("steps") or 1) - 1, 0)
        self._text("summary", _markdown_table({k: v for k, v in summary.items() if v is not None}), step)
        if artifacts:
            self._text("artifacts", _markdown_table({k: str(v) for k, v in artifacts.items()}, ("file", "path")), step)
        self._close()

    @hookimpl
    def run_failed(self, error: str) -> None:
        if self.writer is not None:
            self._text("error", error)
            self._close()

    # -- a sweep

    @hookimpl
    def sweep_start(self, sweep, grid: dict, seeds: list, points: list) -> None:
        self._open(Path(sweep.out_dir) / SUBDIR)
        self._text("sweep/grid", _markdown_table({**grid, "seeds": seeds, "points": len(points),
                                                  "sweep_id": sweep.sweep_id}, ("option", "values")))

    @hookimpl
    def sweep_end(self, results: dict) -> None:
        rows = ["| configuration | final eval loss (mean) | std | seeds done |", "| --- | --- | --- | --- |"]
        for c in results.get("configs", []):
            label = ", ".join(f"{k}={v}" for k, v in c["config"].items()) or "(no grid)"
            mean, std = c.get("final_eval_loss_mean"), c.get("final_eval_loss_std")
            rows.append(f"| {label} | {'-' if mean is None else f'{mean:.4f}'} | "
                        f"{'-' if std is None else f'{std:.4f}'} | {c['done']}/{c['seeds']} |")
        self._text("sweep/results", "\n".join(rows))
        for p in results.get("points", []):
            if p.get("final_eval_loss") is not None:
                self._scalars(p["index"], {"sweep/final_eval_loss": p["final_eval_loss"]})
        self._close()
