"""`--log mlflow`: each run an MLflow run, each sweep a parent run with a child per point
(pip install "toyharness[mlflow]").

Where the runs go is MLflow's own setting, ``MLFLOW_TRACKING_URI`` (a server, ``sqlite:///...``,
or a local file store ``file:./mlruns``, which MLflow >= 3.13 accepts only with
``MLFLOW_ALLOW_FILE_STORE=true``); the experiment is ``MLFLOW_EXPERIMENT_NAME``, else
``toyharness-RECIPE``. A run gets its resolved options as params, its backend fingerprint, recipe
and folder (and a sweep point's grid values and seed) as tags, metrics per step (``loss``, ``lr``,
``tokens_per_s``, ``step_ms``; ``eval_loss`` and ``eval_accuracy`` per evaluation) and, at the end,
its files as artifacts: config.toml, metrics.jsonl, summary.json, loss.png and the exported model
under ``model/`` (the checkpoint, init and batches files stay in the run folder). A run that fails
is marked FAILED with its error as the tag ``toyharness.error``; a resumed one (``--resume``) goes on
in the MLflow run of its folder. A sweep's parent run holds the grid, sweep.json and sweep.png; each
point, running in its own process, finds it by the sweep's id (and a resumed sweep reuses it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..hookspecs import hookimpl

MAX_PARAM = 6000          # MLflow's limit on a param value's length
BATCH = 1000              # and on metrics per log_batch call
MODEL_SUFFIXES = (".gguf",)
NOT_LOGGED = ("checkpoint.gguf", "init.gguf", "batches.npz")   # resume/debug files: big, and in the run folder


def _param(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return text if len(text) <= MAX_PARAM else text[:MAX_PARAM - 3] + "..."


class MLflowObserver:
    """One run's (or one sweep's) MLflow run, through MlflowClient (no global active run)."""

    def __init__(self) -> None:
        try:
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise InputError(f"observer 'mlflow' needs the mlflow package ({exc}): "
                             "pip install \"toyharness[mlflow]\"") from None
        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        try:
            self.client = MlflowClient()
            self.client.search_experiments(max_results=1)     # opens the store: a bad URI fails before the run
        except Exception as exc:
            from mlflow import get_tracking_uri

            raise InputError(f"observer 'mlflow': the tracking store {get_tracking_uri()!r} (MLFLOW_TRACKING_URI) "
                             f"cannot be opened: {' '.join(str(exc).split())[:300]}") from None
        self.run_id: str | None = None
        self._pending: list = []

    # -- helpers

    def _experiment(self, recipe: str) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or f"toyharness-{recipe}"
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:        # a sweep's points create it at once: another process won
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _metrics(self, step: int, values: dict[str, float | None]) -> None:
        now = int(time.time() * 1000)
        self._pending += [self._Metric(k, float(v), now, step) for k, v in values.items() if v is not None]
        if len(self._pending) >= BATCH:
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            chunk, self._pending = self._pending[:BATCH], self._pending[BATCH:]
            self.client.log_batch(self.run_id, metrics=chunk)

    def _params(self, params: dict[str, Any]) -> None:
        items = [self._Param(k, _param(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):      # MLflow takes at most 100 params per call
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def _find(self, experiment_id: str, **tags: str) -> str | None:
        """The latest run of the experiment with these toyharness.* tags (a sweep's parent, a run
        being resumed), or None."""
        where = " and ".join(f"tags.`toyharness.{k}` = '{str(v).replace(chr(39), '')}'" for k, v in tags.items())
        runs = self.client.search_runs([experiment_id], filter_string=where, max_results=1,
                                       order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def _reopen(self, run_id: str) -> None:
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")

    # -- a run

    @hookimpl
    def run_start(self, run, options: dict, fingerprint: str, tags: dict) -> None:
        exp = self._experiment(run.recipe)
        out_dir = str(Path(run.out_dir).resolve())
        if run.metrics:       # resumed from a checkpoint: go on with the MLflow run of that folder
            earlier = self._find(exp, out_dir=out_dir)
            if earlier is not None:
                self._reopen(earlier)
                return
        mtags = {"toyharness.recipe": run.recipe, "toyharness.fingerprint": fingerprint,
                 "toyharness.out_dir": out_dir, "toyharness.role": "run"}
        if tags:
            mtags.update({str(k): _param(v) for k, v in tags.items()})
            if "sweep_id" in tags:
                mtags["toyharness.role"] = "point"
                mtags["toyharness.sweep_id"] = str(tags["sweep_id"])
                parent = self._find(exp, sweep_id=tags["sweep_id"], role="sweep")
                if parent is not None:
                    mtags["mlflow.parentRunId"] = parent
        name = str(tags.get("point_name") or Path(run.out_dir).name)
        self.run_id = self.client.create_run(exp, run_name=name, tags=mtags).info.run_id
        self._params(options)

    @hookimpl
    def step_end(self, step: int, loss: float, lr: float, ms: float, tokens_per_s: float,
                 grad_norm: float | None, metrics: dict) -> None:
        self._metrics(step, {"loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "step_ms": ms,
                             "grad_norm": grad_norm, **metrics})

    @hookimpl
    def eval_end(self, step: int, loss: float, accuracy: float | None, metrics: dict) -> None:
        self._metrics(step, {"eval_loss": loss, "eval_accuracy": accuracy,
                             **{f"eval_{k}": v for k, v in metrics.items()}})
        self._flush()

    @hookimpl
    def run_end(self, summary: dict, artifacts: dict) -> None:
        self._flush()
        for name, path in artifacts.items():
            if name in NOT_LOGGED:
                continue
            model = Path(path).suffix in MODEL_SUFFIXES
            self.client.log_artifact(self.run_id, str(path), artifact_path="model" if model else None)
        self.client.log_batch(self.run_id, tags=[self._RunTag("toyharness.wall_s", str(summary.get("wall_s")))])
        self.client.set_terminated(self.run_id, "FINISHED")

    @hookimpl
    def run_failed(self, error: str) -> None:
        if self.run_id is None:
            return
        self._flush()
        self.client.set_tag(self.run_id, "toyharness.error", error[:5000])
        self.client.set_terminated(self.run_id, "FAILED")

    # -- a sweep

    @hookimpl
    def sweep_start(self, sweep, grid: dict, seeds: list, points: list) -> None:
        exp = self._experiment(sweep.recipe)
        earlier = self._find(exp, sweep_id=sweep.sweep_id, role="sweep")
        if earlier is not None:       # `toyharness sweep --resume`: the same parent run
            self._reopen(earlier)
            return
        tags = {"toyharness.recipe": sweep.recipe, "toyharness.role": "sweep", "toyharness.sweep_id": sweep.sweep_id,
                "toyharness.out_dir": str(sweep.out_dir), "toyharness.backend": sweep.backend}
        self.run_id = self.client.create_run(exp, run_name=f"sweep {Path(sweep.out_dir).name}", tags=tags).info.run_id
        self._params({**{f"grid.{k}": v for k, v in grid.items()}, "seeds": seeds, "points": len(points)})

    @hookimpl
    def sweep_end(self, results: dict, artifacts: dict) -> None:
        for path in artifacts.values():
            self.client.log_artifact(self.run_id, str(path))
        best = [c["final_eval_loss_mean"] for c in results.get("configs", []) if c.get("final_eval_loss_mean")
                is not None]
        if best:
            self._metrics(0, {"best_final_eval_loss_mean": min(best)})
            self._flush()
        failed = any(p.get("status") == "failed" for p in results.get("points", []))
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
