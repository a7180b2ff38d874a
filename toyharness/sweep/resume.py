"""Resuming a sweep: its plan read back from DIR/sweep.json, and how far each point's own folder
got (summary.json: finished; checkpoint.gguf: it goes on from there, bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..engine import GGUFFile
from ..engine.gguf_io import GGUFError
from ..errors import InputError
from .plan import SWEEP_JSON, Plan, Point


def load_plan(out_dir: Path) -> tuple[Plan, dict[str, Any]]:
    """The plan of the sweep in `out_dir` (its sweep.json), and that file's contents."""
    path = out_dir / SWEEP_JSON
    if not path.is_file():
        raise InputError(f"--resume {out_dir}: no {SWEEP_JSON} there (not a sweep folder)")
    try:
        doc = json.loads(path.read_text())
        points = [Point(p["index"], tuple((k, v) for k, v in p["config"].items()), p["seed"], tuple(p["sets"]))
                  for p in doc["points"]]
        plan = Plan(doc["recipe"], doc["grid"], doc["seeds"], doc["sets"], doc["steps"], doc["backend"], points,
                    [p["options"] for p in doc["points"]], doc["sweep_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--resume {out_dir}: {SWEEP_JSON} is not a sweep's ({type(exc).__name__}: {exc})") from None
    return plan, doc


def checkpoint_step(run_dir: Path) -> int | None:
    """The step the run folder's checkpoint covers, if the folder can be resumed from it:
    config.toml, checkpoint.gguf and a metrics.jsonl that holds at least those steps."""
    ckpt, metrics = run_dir / "checkpoint.gguf", run_dir / "metrics.jsonl"
    if not (run_dir / "config.toml").is_file() or not ckpt.is_file() or not metrics.is_file():
        return None
    try:
        with GGUFFile(ckpt) as f:
            step = int(f.require_field("toyharness.step"))
    except GGUFError:
        return None
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    # The runner writes the checkpoint, then metrics.jsonl: a kill between the two leaves
    # fewer metrics than the checkpoint covers, and those steps' losses would be lost.
    return step if len(lines) >= step else None


def resumed_plan(args) -> tuple[Plan, Path, dict[str, Any]]:
    """`toyharness sweep --resume DIR`: the plan, folder and sweep.json contents of the sweep in
    DIR; flags that would change the plan are refused by name."""
    out_dir = Path(args.resume)
    given = [flag for flag, v in (("--grid", args.grid), ("--set", args.sets), ("--seeds", args.seeds),
                                  ("--steps", args.steps), ("--out", args.out),
                                  ("--log", getattr(args, "log", None))) if v]
    if given:
        raise InputError(f"--resume takes the sweep from {out_dir / SWEEP_JSON}; drop {', '.join(given)}")
    plan, previous = load_plan(out_dir)
    if args.recipe and args.recipe != plan.recipe:
        raise InputError(f"--resume {out_dir}: that sweep is recipe {plan.recipe!r}, not {args.recipe!r}")
    if args.backend is not None and args.backend != plan.backend:
        raise InputError(f"--resume {out_dir}: that sweep ran on --backend {plan.backend}")
    return plan, out_dir, previous
