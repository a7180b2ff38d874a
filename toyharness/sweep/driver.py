"""The sweep itself: `toyharness sweep` plans it (or reads the plan back for --resume), hands the
points not finished yet to an executor, and keeps DIR/sweep.json up to date as they go."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import atomic_write
from ..discovery import get_recipe
from ..errors import InputError, WriteError
from ..observers import ObserverBus, load_observers
from .executors import LocalPool, RayExecutor
from .plan import DONE, FAILED, PENDING, RUNNING, SWEEP_JSON, Plan, Point, make_plan
from .report import Rank, Tracker, parse_rank, plot_sweep, print_table, read_point, summarize
from .resume import resumed_plan


@dataclass
class SweepResult:
    records: list[dict]
    rows: list[dict]
    plotted: bool

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.records if r["status"] == FAILED]


def point_tags(plan: Plan, point: Point, out_dir: Path) -> dict[str, Any]:
    """What a point's observers get as its run's tags: its grid values (as written), its seed, and
    where it belongs."""
    return {**dict(point.config), "seed": point.seed, "sweep_id": plan.sweep_id,
            "sweep_dir": str(Path(out_dir).resolve()), "point": point.index, "point_name": point.name}


@dataclass
class SweepInfo:
    """The `sweep` argument of the sweep hooks."""

    recipe: str
    sweep_id: str
    out_dir: Path
    backend: str


def observer_names(plan: Plan) -> list[str]:
    """The observers the points log to (the option `log`, from --log or --set): the sweep's too."""
    return list(dict.fromkeys(name for opts in plan.options for name in opts.get("log", [])))


def _point_record(plan: Plan, point: Point, out_dir: Path) -> dict[str, Any]:
    return {"index": point.index, "name": point.name, "dir": str(out_dir / "points" / point.name),
            "config": dict(point.config), "seed": point.seed, "sets": list(point.sets),
            "options": plan.options[point.index], "status": PENDING, "message": None}


def run_sweep(plan: Plan, out_dir: Path, executor, progress: bool = True,
              previous: dict[str, Any] | None = None, bus=None, rank: Rank | None = None) -> SweepResult:
    """Run every point not finished yet; write sweep.json (as it goes) and sweep.png.
    `previous`: the sweep.json of an earlier, interrupted go (--resume); `bus`: the sweep's
    observers (toyharness.observers.ObserverBus), told of its start and end."""
    bus = bus or ObserverBus([])

    out_dir = Path(out_dir)
    records = [_point_record(plan, p, out_dir) for p in plan.points]
    for rec, old in zip(records, (previous or {}).get("points", [])):
        rec.update({k: old[k] for k in ("node", "worker_dir", "gpu", "resumed_from") if k in old})   # where it ran
    for rec in records:  # a point's folder, not sweep.json, says whether it finished; failed ones go again
        rec["status"] = DONE if (Path(rec["dir"]) / "summary.json").is_file() else PENDING
        rec.update(read_point(Path(rec["dir"])))

    def document() -> dict[str, Any]:
        return {"toyharness_version": __version__, **plan.to_json(), **executor.describe(),
                "points": records, "configs": summarize(plan, records, rank)}

    def save() -> None:
        atomic_write(out_dir / SWEEP_JSON, json.dumps(document(), indent=2) + "\n")

    threads = executor.threads
    tags = {p.index: point_tags(plan, p, out_dir) for p in plan.points}
    specs = [{"index": p.index, "name": p.name, "sweep_id": plan.sweep_id, "out": records[p.index]["dir"],
              "recipe": plan.recipe, "sets": list(p.sets), "steps": plan.steps, "backend": plan.backend,
              "threads": threads, "tags": tags[p.index]}
             for p in plan.points if records[p.index]["status"] != DONE]
    try:
        (out_dir / "points").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(out_dir / "points", exc) from None
    info = SweepInfo(plan.recipe, plan.sweep_id, out_dir.resolve(), plan.backend)
    bus.emit("sweep_start", sweep=info, grid={k: list(v) for k, v in plan.grid.items()}, seeds=list(plan.seeds),
             points=[{"index": p.index, "name": p.name, "dir": str(Path(records[p.index]["dir"]).resolve()),
                      "tags": tags[p.index], "options": plan.options[p.index]} for p in plan.points])
    bus.drain()      # a tracker's parent record exists before the first point looks for it
    tracker = Tracker(plan, records, save, progress)
    with tracker.lock:
        save()
    try:
        executor.run(specs, tracker)
    except BaseException:
        with tracker.lock:
            for rec in records:
                if rec["status"] == RUNNING:
                    rec["status"], rec["message"] = PENDING, "interrupted"
            save()
        print(f"toyharness: the sweep stopped; continue it with: toyharness sweep --resume {out_dir}", file=sys.stderr)
        raise
    finally:
        tracker.close()
    plotted = plot_sweep(out_dir / "sweep.png", plan, records)
    artifacts = {name: (out_dir / name).resolve() for name in (SWEEP_JSON, "sweep.png")
                 if (out_dir / name).is_file() and (name != "sweep.png" or plotted)}
    bus.emit("sweep_end", sweep=info, results=json.loads(json.dumps(document())), artifacts=artifacts)
    return SweepResult(records, summarize(plan, records, rank), plotted)


def main(args) -> int:
    """`toyharness sweep`: exit 0 when every point finished, 1 when one failed, 2 on bad input."""
    if args.keep_models and not args.ray:
        raise InputError("--keep-models is for --ray (local points keep their model files where they ran)")
    if args.resume:
        plan, out_dir, previous = resumed_plan(args)
    else:
        if not args.recipe:
            raise InputError("name a RECIPE (or --resume DIR)")
        if not args.grid and not args.seeds:
            raise InputError("nothing to sweep: give --grid KEY=V1,V2 and/or --seeds N")
        logs = getattr(args, "log", None)
        sets = list(args.sets) + ([f"log={','.join(logs)}"] if logs else [])
        plan = make_plan(args.recipe, args.grid, args.seeds or "1", sets, args.steps, args.backend or "cpu")
        out_dir = Path(args.out) if args.out else Path("sweeps") / f"{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (out_dir / SWEEP_JSON).exists():
            raise InputError(f"--out {out_dir}: a sweep is there already; continue it with --resume {out_dir}")
        if out_dir.exists() and any(out_dir.iterdir()):
            raise InputError(f"--out {out_dir}: the folder is not empty")
        previous = None
    _, recipe_obj = get_recipe(plan.recipe)
    # an unknown metric stops the sweep here, before any point runs (exit 2)
    rank = parse_rank(getattr(args, "rank", None), plan.recipe, tuple(getattr(recipe_obj, "metric_names", ())))
    observers = load_observers(observer_names(plan))     # an unknown name stops the sweep here, exit 2
    if args.ray:
        executor = RayExecutor(args.ray, args.threads, plan.backend, args.keep_models, args.workers)
    else:
        executor = LocalPool(args.workers, args.threads, plan.backend)
    bus = ObserverBus(observers)
    try:
        result = run_sweep(plan, out_dir, executor, progress=not args.no_progress, previous=previous, bus=bus,
                           rank=rank)
    finally:
        bus.close()
    print_table(plan, result.rows, result.records, out_dir, rank)
    plot = f", {out_dir / 'sweep.png'}" if result.plotted else " (no sweep.png: no point finished)"
    print(f"wrote {out_dir / SWEEP_JSON}{plot} and {len(plan.points)} run folders under {out_dir / 'points'}")
    if result.failed:
        print(f"toyharness: check failed: {len(result.failed)} of {len(plan.points)} points failed", file=sys.stderr)
        return 1
    return 0
