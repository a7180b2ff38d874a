"""Sweeps: one recipe over a grid of options and seeds.

A *point* is one combination of grid values and one seed. It is an ordinary run: `runner.train`
with the point's `--set` list, exactly what `toyharness run RECIPE --set ...` calls, so its
losses are a plain run's bits. Each point runs in a process of its own (point.py): a point that
aborts inside ggml takes down only that process. The executors only decide where those processes
run: a pool of local workers (default) or one Ray task per point (`--ray`), whose small files come
back to the driver through Ray.

DIR/sweep.json is written before anything runs and after every point, so `--resume DIR` knows
the plan; a point's own folder says how far it got (summary.json: finished; checkpoint.gguf:
resume from there, bit for bit).

- plan.py: the grid and seeds expanded into points, each point's options validated
- point.py: one point in its own process, and the driver's side of it
- executors.py: the local pool and Ray
- report.py: progress, each point's results, the table and sweep.png
- resume.py: the plan read back from sweep.json, and how far a point's folder got
- driver.py: `toyharness sweep` (`main`) and `run_sweep`
"""

from .driver import SweepInfo, SweepResult, main, observer_names, point_tags, run_sweep
from .executors import SMALL_FILES, LocalPool, RayExecutor
from .plan import DONE, FAILED, PENDING, RUNNING, SWEEP_JSON, Plan, Point, make_plan, parse_grid, parse_seeds
from .point import Outcome, launch_point, run_point
from .report import Tracker, plot_sweep, print_table, read_point, summarize
from .resume import checkpoint_step, load_plan

__all__ = [
    "DONE", "FAILED", "PENDING", "RUNNING", "SMALL_FILES", "SWEEP_JSON", "LocalPool", "Outcome", "Plan", "Point",
    "RayExecutor", "SweepInfo", "SweepResult", "Tracker", "checkpoint_step", "launch_point", "load_plan", "main",
    "make_plan", "observer_names", "parse_grid", "parse_seeds", "plot_sweep", "point_tags", "print_table",
    "read_point", "run_point", "run_sweep", "summarize",
]
