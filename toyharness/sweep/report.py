"""A sweep's progress and results: the live progress line, each point's results read from its run
folder, one row per configuration (mean and std over its seeds), the table and DIR/sweep.png."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import tomllib

from ..atomic import atomic_write
from ..errors import InputError
from .plan import DONE, FAILED, PENDING, RUNNING, Plan
from .point import Outcome

# what `--rank` may name beside a recipe's own metrics (its metric_names, and eval_NAME for each)
BUILTIN_RANKS = ("eval_loss", "loss", "accuracy")


@dataclass(frozen=True)
class Rank:
    """What the table sorts configurations by: the mean over seeds of a metric's last value in each
    point's metrics.jsonl (eval_loss: the last evaluation's), lowest first, or highest with `best_high`."""

    metric: str = "eval_loss"
    best_high: bool = False

    @property
    def label(self) -> str:
        return f"mean final {self.metric.replace('_', ' ') if self.metric == 'eval_loss' else self.metric}" + (
            ", highest first" if self.best_high else "")


def parse_rank(spec: str | None, recipe: str, metric_names: tuple[str, ...]) -> Rank:
    """`--rank METRIC[:max|:min]` checked against the metrics the recipe logs; an unknown name is
    refused naming the ones it has."""
    if not spec:
        return Rank()
    name, _, order = spec.partition(":")
    if order not in ("", "min", "max"):
        raise InputError(f"--rank {spec}: the order after ':' is min or max, not {order!r}")
    known = [*BUILTIN_RANKS, *metric_names, *(f"eval_{n}" for n in metric_names)]
    if name not in known:
        raise InputError(f"--rank {spec}: recipe {recipe} logs no metric {name!r}; it logs: {', '.join(known)}")
    return Rank(name, order == "max")


class Tracker:
    """The sweep's state as points start, step and finish; draws the live progress line
    (points done, running, failed, ETA) and saves sweep.json after every change of status."""

    def __init__(self, plan: Plan, records: list[dict], save: Callable[[], None], progress: bool):
        self.plan, self.records, self.save = plan, records, save
        self.lock = threading.RLock()
        self.changed = threading.Event()
        self.t0 = time.perf_counter()
        self.total_steps = {p.index: self.plan.options[p.index]["steps"] for p in plan.points}
        self.done_steps: dict[int, int] = {}
        self.first_step: dict[int, int] = {}
        self.console = self.live = None
        if progress:
            from rich.console import Console
            from rich.live import Live

            self.console = Console(stderr=True, soft_wrap=True)
            if self.console.is_terminal:
                self.live = Live(get_renderable=self.line, console=self.console, refresh_per_second=4,
                                 transient=True)
                self.live.start()

    def _count(self, status: str) -> int:
        return sum(r["status"] == status for r in self.records)

    def line(self) -> str:
        with self.lock:        # rich's refresh thread calls this too
            done, running, failed = self._count(DONE), self._count(RUNNING), self._count(FAILED)
            left = sum(self.total_steps[i] - self.done_steps.get(i, 0) for i in self.total_steps
                       if self.records[i]["status"] in (PENDING, RUNNING))
            ran = sum(self.done_steps[i] - self.first_step.get(i, 0) for i in self.done_steps)
        elapsed = time.perf_counter() - self.t0
        eta = "-"
        if ran:
            s = int(elapsed / ran * left)
            eta = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
        return (f"sweep {self.plan.recipe}: {done}/{len(self.records)} done, {running} running, "
                f"{failed} failed, ETA {eta}")

    def started(self, index: int) -> None:
        with self.lock:
            self.records[index]["status"] = RUNNING
            self.save()

    def progress(self, index: int, msg: dict) -> None:
        with self.lock:
            if "start" in msg:
                self.first_step[index] = self.done_steps[index] = msg["start"]
                self.total_steps[index] = msg["of"]
            if "step" in msg:
                self.done_steps[index] = msg["step"]

    def finished(self, index: int, outcome: Outcome) -> None:
        with self.lock:
            rec = self.records[index]
            self.done_steps[index] = self.total_steps[index]
            self.first_step.setdefault(index, outcome.resumed_from)
            rec.update(status=outcome.status, message=outcome.message, resumed_from=outcome.resumed_from,
                       **outcome.where)
            rec.update(read_point(Path(rec["dir"])))
            self.save()
            if self.console is not None:
                if outcome.status == FAILED:
                    self.console.print(f"[red]failed[/red] {rec['name']}: {outcome.message}")
                elif self.live is None:
                    self.console.print(f"done {rec['name']}  ({self.line()})")
        self.changed.set()

    def wait(self, seconds: float) -> None:
        self.changed.wait(seconds)
        self.changed.clear()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def read_point(run_dir: Path) -> dict[str, Any]:
    """A point's results from its run folder: final train loss, final and best eval loss (and
    accuracy for classifiers), steps done, wall time, backend fingerprint."""
    rec: dict[str, Any] = {"steps_done": 0, "final_loss": None, "final_eval_loss": None, "best_eval_loss": None}
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        metrics = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        rec["steps_done"] = len(metrics)
        if metrics:
            rec["final_loss"] = metrics[-1]["loss"]
        if evals:
            rec["final_eval_loss"], rec["best_eval_loss"] = evals[-1], min(evals)
        acc = [m["accuracy"] for m in metrics if "accuracy" in m]
        if acc:
            rec["accuracy"] = acc[-1]
        # every numeric metric's last value (a recipe's own, eval_NAME ones at the last evaluation)
        final: dict[str, float] = {}
        for m in metrics:
            final.update({k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        rec["final_metrics"] = final
    if (run_dir / "summary.json").is_file():
        rec["wall_s"] = json.loads((run_dir / "summary.json").read_text()).get("wall_s")
    if (run_dir / "config.toml").is_file():
        rec["fingerprint"] = tomllib.loads((run_dir / "config.toml").read_text()).get("fingerprint")
    return rec


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return mean, std


def summarize(plan: Plan, records: list[dict], rank: Rank | None = None) -> list[dict]:
    """One row per configuration, sorted by `rank` (default: mean final eval loss, lowest first;
    configurations with no finished seed last): mean and sample std over its finished seeds."""
    rank = rank or Rank()
    rows = []
    for config, group in itertools.groupby(plan.points, key=lambda p: p.config):
        recs = [records[p.index] for p in group]
        ok = [r for r in recs if r["status"] == DONE and r["final_eval_loss"] is not None]
        mean, std = _mean_std([r["final_eval_loss"] for r in ok])
        best, _ = _mean_std([r["best_eval_loss"] for r in ok])
        row = {"config": dict(config), "seeds": len(recs), "done": len(ok),
               "failed": sum(r["status"] == FAILED for r in recs),
               "final_eval_loss_mean": mean, "final_eval_loss_std": std, "best_eval_loss_mean": best}
        acc = [r["accuracy"] for r in ok if "accuracy" in r]
        if acc:
            row["accuracy_mean"] = sum(acc) / len(acc)
        if rank.metric != "eval_loss":
            done = [r for r in recs if r["status"] == DONE and rank.metric in r.get("final_metrics", {})]
            row["rank_metric"] = rank.metric
            row["rank_mean"], _ = _mean_std([r["final_metrics"][rank.metric] for r in done])
        rows.append(row)
    key = "final_eval_loss_mean" if rank.metric == "eval_loss" else "rank_mean"
    sign = -1.0 if rank.best_high else 1.0
    return sorted(rows, key=lambda r: (r[key] is None, sign * (r[key] or 0.0)))


def print_table(plan: Plan, rows: list[dict], records: list[dict], out_dir: Path, rank: Rank | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    rank = rank or Rank()
    t = Table(title=f"sweep {plan.recipe} — {out_dir} ({len(plan.seeds)} seed(s) per configuration; "
                    f"sorted by {rank.label})")
    for key in plan.grid:
        t.add_column(key)
    if rank.metric != "eval_loss":
        t.add_column(f"{rank.metric} (mean)", justify="right")
    t.add_column("final eval loss (mean ± std)", justify="right")
    t.add_column("best eval loss (mean)", justify="right")
    has_acc = any("accuracy_mean" in r for r in rows)
    if has_acc:
        t.add_column("accuracy", justify="right")
    t.add_column("seeds ok", justify="right")
    for r in rows:
        cells = [r["config"][k] for k in plan.grid]
        if rank.metric != "eval_loss":
            cells.append("-" if r.get("rank_mean") is None else f"{r['rank_mean']:.4g}")
        if r["final_eval_loss_mean"] is None:
            cells += ["-", "-"]
        else:
            std = r["final_eval_loss_std"]
            cells += [f"{r['final_eval_loss_mean']:.4f}" + (f" ± {std:.4f}" if std is not None else ""),
                      f"{r['best_eval_loss_mean']:.4f}"]
        if has_acc:
            cells.append(f"{r['accuracy_mean']:.2%}" if "accuracy_mean" in r else "-")
        cells.append(f"{r['done']}/{r['seeds']}" + (f" ({r['failed']} failed)" if r["failed"] else ""))
        t.add_row(*cells)
    console = Console()
    console.print(t)
    for rec in records:
        if rec["status"] == FAILED:
            console.print(f"[red]failed[/red] {rec['name']}: {rec['message']}")


def plot_sweep(path: Path, plan: Plan, records: list[dict]) -> bool:
    """Train and eval loss per configuration: the mean over its finished seeds, with a band
    from the lowest to the highest seed. False (nothing written) when no point finished."""
    import io

    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = []
    for config, group in itertools.groupby(plan.points, key=lambda p: p.config):
        runs = []
        for p in group:
            rec = records[p.index]
            if rec["status"] == DONE and (Path(rec["dir"]) / "metrics.jsonl").is_file():
                runs.append([json.loads(x) for x in (Path(rec["dir"]) / "metrics.jsonl").read_text().splitlines()
                             if x.strip()])
        if runs:
            curves.append((", ".join(f"{k}={v}" for k, v in config) or plan.recipe, runs))
    if not curves:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for i, (label, runs) in enumerate(curves):
        color = plt.cm.tab10(i % 10) if len(curves) <= 10 else plt.cm.tab20(i % 20)
        for ax, key in zip(axes, ("loss", "eval_loss")):
            steps = [m["step"] for m in runs[0] if key in m]
            ys = np.array([[m[key] for m in r if key in m] for r in runs if len(r) == len(runs[0])])
            if not steps or ys.size == 0:
                continue
            ax.plot(steps, ys.mean(axis=0), color=color, lw=1.2, marker="o" if key == "eval_loss" else None,
                    ms=3, label=label)
            ax.fill_between(steps, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.2, lw=0)
    for ax, title in zip(axes, ("train loss", "eval loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.set_title(f"{plan.recipe}: {title} (mean over seeds, band min-max)", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, buf.getvalue())
    return True
