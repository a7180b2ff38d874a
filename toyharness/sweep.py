"""Sweeps: one recipe over a grid of options and seeds (docs/design.md, "Sweeps").

A *point* is one combination of grid values and one seed. It is an ordinary run: `runner.train`
with the point's `--set` list, exactly what `toyharness run RECIPE --set ...` calls, so its
losses are a plain run's bits. Each point runs in a process of its own (`python -m
toyharness.sweep SPEC`): a point that aborts inside ggml takes down only that process. The
executors only decide where those processes run: a pool of local workers (default) or one Ray
task per point (`--ray`), whose small files come back to the driver through Ray.

DIR/sweep.json is written before anything runs and after every point, so `--resume DIR` knows
the plan; a point's own folder says how far it got (summary.json: finished; checkpoint.gguf:
resume from there, bit for bit).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .errors import InputError, ToyharnessError, WriteError
from .hookspecs import hookimpl

# What a Ray worker always sends back; model and checkpoint files only with --keep-models.
SMALL_FILES = ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "confusion.png")
SWEEP_JSON = "sweep.json"

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Point:
    """One run of the sweep: a configuration (grid values as written) and a seed."""

    index: int
    config: tuple[tuple[str, str], ...]
    seed: int
    sets: tuple[str, ...]            # the --set list of the equivalent `toyharness run`

    @property
    def name(self) -> str:
        """The point's folder under DIR/points/: readable, and unique through its index."""
        parts = [f"{k}={_slug(v)}" for k, v in self.config] + [f"seed={self.seed}"]
        return f"{self.index:03d}_" + "_".join(parts)

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config) or "(no grid)"


def _slug(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", value).strip("-") or "-"


@dataclass
class Plan:
    """Everything a sweep runs, resolved and validated; sweep.json holds it."""

    recipe: str
    grid: dict[str, list[str]]
    seeds: list[int]
    sets: list[str]
    steps: int | None
    backend: str
    points: list[Point]
    options: list[dict[str, Any]]    # each point's resolved options, by index
    sweep_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "grid": self.grid, "seeds": self.seeds, "sets": self.sets,
                "steps": self.steps, "backend": self.backend, "sweep_id": self.sweep_id}


def _options_class(recipe: str):
    from .hookspecs import plugin_manager
    from .plugins import get_recipe

    _, recipe_obj = get_recipe(recipe)
    cls = plugin_manager(recipe_obj).hook.options()
    if cls is None:
        raise InputError(f"recipe {recipe}: it implements no `options` hook")
    return cls


def _is_list_option(cls, key: str) -> bool:
    hints = typing.get_type_hints(cls)
    return key in hints and (typing.get_origin(hints[key]) is tuple or hints[key] == tuple[str, ...])


def parse_grid(items: list[str], cls) -> dict[str, list[str]]:
    """`KEY=V1,V2,...` items into {key: [values]}, in the order given. A list-valued option
    (LoRA's `targets=q,v`) separates its grid values with ';' instead: `targets=q,v;q,k,v,o`."""
    from .options import convert, parse_set

    grid: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise InputError(f"--grid {item!r}: expected KEY=V1,V2,...")
        key, raw = parse_set(item)
        if key in grid:
            raise InputError(f"--grid: option {key!r} is given twice; list all its values in one --grid")
        if key == "seed":
            raise InputError("--grid: option 'seed' goes in --seeds (N seeds, or a list S1,S2,...)")
        values = [v.strip() for v in raw.split(";" if _is_list_option(cls, key) else ",")]
        if not all(values):
            raise InputError(f"--grid {item!r}: option {key!r} has an empty value")
        converted = [convert(cls, key, v) for v in values]    # names the key of an unknown or bad one
        if len(set(converted)) != len(converted):
            raise InputError(f"--grid {item!r}: option {key!r} lists a value twice")
        grid[key] = values
    return grid


def parse_seeds(text: str, base_seed: int) -> list[int]:
    """`N` (N seeds from the options' seed on: base, base+1, ...) or a list `S1,S2,...`."""
    try:
        numbers = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise InputError(f"--seeds {text!r}: expected a count N or a list S1,S2,...") from None
    if "," in text:
        seeds = numbers
    elif numbers and numbers[0] >= 1:
        seeds = list(range(base_seed, base_seed + numbers[0]))
    else:
        raise InputError(f"--seeds {text}: must be >= 1")
    if len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


def make_plan(recipe: str, grid_items: list[str], seeds: str = "1", sets: list[str] | None = None,
              steps: int | None = None, backend: str = "cpu") -> Plan:
    """Expand the grid and validate every point's options before anything runs: a bad key or
    value raises InputError naming it (and the point)."""
    from .options import parse_set, resolve

    cls = _options_class(recipe)
    sets = list(sets or [])
    grid = parse_grid(grid_items, cls)
    given = {parse_set(item)[0]: "--set" for item in sets} | ({"steps": "--steps"} if steps is not None else {})
    for key, flag in given.items():
        if key in grid:
            raise InputError(f"option {key!r} is both in --grid and {flag}; keep one")
    if steps is not None and steps < 1:
        raise InputError(f"--steps {steps}: must be >= 1")
    overrides = {"steps": steps} if steps is not None else {}
    base = resolve(cls, None, sets, overrides)
    seed_list = parse_seeds(str(seeds), base.seed)
    points, options = [], []
    for combo in itertools.product(*grid.values()):
        config = tuple(zip(grid, combo))
        for seed in seed_list:
            point_sets = (*sets, *(f"{k}={v}" for k, v in config), f"seed={seed}")
            point = Point(len(points), config, seed, point_sets)
            try:
                opts = resolve(cls, None, list(point_sets), overrides)
            except InputError as exc:
                raise InputError(f"point {point.label}, seed {seed}: {exc}") from None
            points.append(point)
            options.append(_jsonable(opts.to_dict()))
    return Plan(recipe, grid, seed_list, sets, steps, backend, points, options)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


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


# ---------------------------------------------------------------- one point, in its own process


def _checkpoint_step(run_dir: Path) -> int | None:
    """The step the run folder's checkpoint covers, if the folder can be resumed from it:
    config.toml, checkpoint.gguf and a metrics.jsonl that holds at least those steps."""
    from .engine import GGUFFile
    from .engine.gguf_io import GGUFError

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


def run_point(spec: dict[str, Any], observers: tuple = ()) -> dict:
    """Run one point into spec["out"], as `toyharness run` would: from its checkpoint where the
    folder holds one, from scratch otherwise; a finished folder is left as it is."""
    from .runner import train

    out = Path(spec["out"])
    tags = spec.get("tags")
    if (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    if _checkpoint_step(out) is not None:
        return train(spec["recipe"], backend=spec["backend"], threads=spec["threads"], resume=str(out),
                     observers=observers, progress=False, tags=tags)
    for stale in ("checkpoint.gguf", "metrics.jsonl"):   # from a start that never reached a checkpoint
        (out / stale).unlink(missing_ok=True)
    return train(spec["recipe"], steps=spec["steps"], backend=spec["backend"], threads=spec["threads"],
                 sets=list(spec["sets"]), out=str(out), observers=observers, progress=False, tags=tags)


class _StepReporter:
    """Observer in the point's process: its progress, one JSON line a step, to the driver. When
    the driver is gone it ends the process between two steps, where the run folder is whole
    (the runner writes checkpoint.gguf, then metrics.jsonl: not a place to stop)."""

    def __init__(self, stream, driver_gone: threading.Event):
        self.stream, self.driver_gone = stream, driver_gone

    def send(self, msg: dict) -> None:
        self.stream.write(json.dumps(msg) + "\n")
        self.stream.flush()

    @hookimpl
    def run_start(self, run) -> None:
        self.send({"start": len(run.metrics), "of": run.options.steps})

    @hookimpl
    def step_end(self, run, step, loss, lr, ms, tokens_per_s) -> None:
        if self.driver_gone.is_set():
            os._exit(143)
        self.send({"step": step + 1})


def _watch_driver(driver_gone: threading.Event, grace_s: float = 60.0) -> None:
    """The driver holds our stdin open and never writes; EOF means it died (even by kill -9).
    The next step's end stops the process; a point stuck elsewhere is stopped after grace_s."""
    try:
        while os.read(0, 4096):     # the raw fd: a buffered reader's lock would block our exit
            pass
    finally:
        driver_gone.set()
        time.sleep(grace_s)
        os._exit(143)


def _point_main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)            # whatever else writes to stdout goes to stderr, not into the protocol
    driver_gone = threading.Event()
    threading.Thread(target=_watch_driver, args=(driver_gone,), daemon=True).start()
    reporter = _StepReporter(protocol, driver_gone)
    try:
        run_point(spec, observers=(reporter,))
    except ToyharnessError as exc:
        reporter.send({"message": str(exc)})
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


@dataclass
class Outcome:
    status: str                   # DONE or FAILED
    message: str | None = None
    resumed_from: int = 0         # the step its checkpoint covered, when it resumed
    where: dict[str, str] = field(default_factory=dict)   # Ray: node and the worker's folder


def launch_point(spec: dict[str, Any], on_progress: Callable[[dict], None] | None = None,
                 procs: dict | None = None) -> Outcome:
    """Run one point in a process of its own and wait for it. `on_progress` gets its JSON
    lines ({"start", "of"}, {"step"}); `procs` (index -> Popen) lets the caller stop it."""
    cmd = [sys.executable, "-m", "toyharness.sweep", json.dumps(spec)]
    message, resumed_from = None, 0
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)   # Ctrl-C reaches the driver, which stops it
        if procs is not None:
            procs[spec["index"]] = proc
        try:
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "message" in msg:
                    message = msg["message"]
                if "start" in msg:
                    resumed_from = msg["start"]
                if on_progress is not None:
                    on_progress(msg)
            rc = proc.wait()
        finally:
            proc.stdin.close()
            if procs is not None:
                procs.pop(spec["index"], None)
        err.seek(0)
        tail = [x for x in err.read().decode("utf-8", "replace").splitlines() if x.strip()]
    if rc == 0:
        return Outcome(DONE, None, resumed_from)
    if message is None:
        if rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            said = next((x for x in tail if re.search(r"ggml aborted|Fatal Python error|Error", x)), tail[-1] if tail
                        else None)
            message = f"the point's process died ({name})" + (f": {said.strip()}" if said else "")
        else:
            message = tail[-1].strip() if tail else f"the point's process exited with {rc}"
    return Outcome(FAILED, message, resumed_from)


# ---------------------------------------------------------------- executors


def _cores() -> int:
    from .engine.backend import default_threads

    return default_threads()


class LocalPool:
    """`workers` local processes at a time, each point with `threads` threads."""

    name = "local"

    def __init__(self, workers: int | None = None, threads: int | None = None, backend: str = "cpu"):
        cores = _cores()
        if (threads is not None and threads < 1) or (workers is not None and workers < 1):
            raise InputError("--workers and --threads must be >= 1")
        if backend != "cpu":     # one accelerator: its points one at a time unless asked
            workers = workers or 1
        self.threads = threads or max(1, cores // (workers or cores))
        self.workers = workers or max(1, cores // self.threads)
        if backend == "cpu" and self.workers * self.threads > cores:
            raise InputError(f"--workers {self.workers} x --threads {self.threads} = "
                             f"{self.workers * self.threads} threads is more than this machine's {cores} cores "
                             "(ggml's spinning threads would slow every point many times over)")
        self._procs: dict[int, subprocess.Popen] = {}
        self._stopping = False

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "workers": self.workers, "threads": self.threads}

    def run(self, specs: list[dict], tracker: Tracker) -> None:
        def one(spec):
            if self._stopping:
                return
            tracker.started(spec["index"])
            outcome = launch_point(spec, lambda msg: tracker.progress(spec["index"], msg), self._procs)
            if not self._stopping:     # a point we killed stays "running": run_sweep marks it interrupted
                tracker.finished(spec["index"], outcome)

        with ThreadPoolExecutor(self.workers) as pool:
            futures = [pool.submit(one, s) for s in specs]
            try:
                while not all(f.done() for f in futures):
                    tracker.wait(0.2)
                for f in futures:
                    f.result()
            except BaseException:
                self._stopping = True
                for f in futures:
                    f.cancel()
                procs = list(self._procs.values())
                for proc in procs:      # as if the driver were gone: each stops at its next step's end
                    proc.stdin.close()
                deadline = time.monotonic() + 10
                for proc in procs:
                    try:
                        proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        proc.kill()
                raise


def _ray_point(spec: dict[str, Any], keep_models: bool) -> dict[str, Any]:
    """A Ray task: the point runs on this worker, in a folder on the worker's own disk (the
    driver's DIR need not be reachable); its small files go back as bytes in the result."""
    import socket

    out = Path(tempfile.gettempdir()) / "toyharness-sweep" / spec["sweep_id"] / spec["name"]
    spec = {**spec, "out": str(out)}
    outcome = launch_point(spec)
    files = {}
    if out.is_dir():
        for p in sorted(out.iterdir()):
            if p.is_file() and not p.name.startswith(".") and (keep_models or p.name in SMALL_FILES):
                files[p.name] = p.read_bytes()
    return {"status": outcome.status, "message": outcome.message, "resumed_from": outcome.resumed_from,
            "files": files, "where": {"node": socket.gethostname(), "worker_dir": str(out)}}


class RayExecutor:
    """One Ray task per point asking for `threads` CPUs (and a GPU for the cuda backend).
    `address`: "auto" (the cluster this machine belongs to), HOST:PORT, ray://HOST:PORT, or
    "local" (start one here); None uses the Ray this process already initialised."""

    name = "ray"

    def __init__(self, address: str | None, threads: int | None = None, backend: str = "cpu",
                 keep_models: bool = False, max_in_flight: int | None = None):
        try:
            import ray
        except ImportError:
            raise InputError('--ray needs Ray: pip install "toyharness[ray]"') from None
        self.ray = ray
        if threads is not None and threads < 1:
            raise InputError("--threads must be >= 1")
        self.threads = threads or 1
        self.backend, self.keep_models, self.max_in_flight = backend, keep_models, max_in_flight
        if not ray.is_initialized():
            try:
                if address == "local":
                    ray.init(include_dashboard=False, logging_level="WARNING")
                else:
                    ray.init(address=address, logging_level="WARNING")
            except (ConnectionError, RuntimeError, ValueError) as exc:
                hint = "" if os.environ.get("RAY_AUTH_MODE") else "; a cluster with token authentication needs " \
                    "RAY_AUTH_MODE=token here (docs/sweeps.md: On a Ray cluster)"
                raise InputError(f"--ray {address}: cannot connect to a Ray cluster ({exc}){hint}") from None
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        largest = max((n.get("CPU", 0) for n in nodes), default=0)
        if self.threads > largest:      # Ray would wait for such a node for ever
            raise InputError(f"--threads {self.threads}: the Ray cluster's largest node has {largest:g} CPUs")
        if backend == "cuda" and not any(n.get("GPU", 0) >= 1 for n in nodes):
            raise InputError("--backend cuda: the Ray cluster has no GPU")
        self.address = address

    def _capacity(self) -> int:
        """Points Ray can run at once now (nodes may join): more in flight would only queue, and
        show as running."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        res = self.ray.cluster_resources()
        n = int(res.get("CPU", 0) // self.threads)
        if self.backend == "cuda":
            n = min(n, int(res.get("GPU", 0)))
        return max(1, n)

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "address": self.address, "threads": self.threads,
                "keep_models": self.keep_models}

    def run(self, specs: list[dict], tracker: Tracker) -> None:
        from .runner import atomic_write

        ray = self.ray
        task = ray.remote(_ray_point).options(num_cpus=self.threads,
                                              num_gpus=1 if self.backend == "cuda" else 0)
        queue, in_flight = list(specs), {}
        try:
            while queue or in_flight:
                capacity = self._capacity() if queue else 0
                while queue and len(in_flight) < capacity:
                    spec = queue.pop(0)
                    in_flight[task.remote(spec, self.keep_models)] = spec
                    tracker.started(spec["index"])
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.2)
                for ref in ready:
                    spec = in_flight.pop(ref)
                    try:
                        res = ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        tracker.finished(spec["index"], Outcome(FAILED, f"Ray: {str(exc).strip().splitlines()[0]}"))
                        continue
                    for name, data in res["files"].items():
                        atomic_write(Path(spec["out"]) / name, data)
                    tracker.finished(spec["index"], Outcome(res["status"], res["message"], res["resumed_from"],
                                                            res["where"]))
        except BaseException:
            for ref in in_flight:
                ray.cancel(ref, force=True)
            raise


# ---------------------------------------------------------------- progress and results


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
    import tomllib

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


def summarize(plan: Plan, records: list[dict]) -> list[dict]:
    """One row per configuration, sorted by mean final eval loss (configurations with no
    finished seed last): mean and sample std over its finished seeds."""
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
        rows.append(row)
    return sorted(rows, key=lambda r: (r["final_eval_loss_mean"] is None, r["final_eval_loss_mean"] or 0.0))


def print_table(plan: Plan, rows: list[dict], records: list[dict], out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"sweep {plan.recipe} — {out_dir} ({len(plan.seeds)} seed(s) per configuration; "
                    "sorted by mean final eval loss)")
    for key in plan.grid:
        t.add_column(key)
    t.add_column("final eval loss (mean ± std)", justify="right")
    t.add_column("best eval loss (mean)", justify="right")
    has_acc = any("accuracy_mean" in r for r in rows)
    if has_acc:
        t.add_column("accuracy", justify="right")
    t.add_column("seeds ok", justify="right")
    for r in rows:
        cells = [r["config"][k] for k in plan.grid]
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

    from .runner import atomic_write

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


# ---------------------------------------------------------------- the sweep


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
              previous: dict[str, Any] | None = None, bus=None) -> SweepResult:
    """Run every point not finished yet; write sweep.json (as it goes) and sweep.png.
    `previous`: the sweep.json of an earlier, interrupted go (--resume); `bus`: the sweep's
    observers (toyharness.observers.ObserverBus), told of its start and end."""
    from .observers import ObserverBus
    from .runner import atomic_write

    bus = bus or ObserverBus([])

    out_dir = Path(out_dir)
    records = [_point_record(plan, p, out_dir) for p in plan.points]
    for rec, old in zip(records, (previous or {}).get("points", [])):
        rec.update({k: old[k] for k in ("node", "worker_dir", "resumed_from") if k in old})   # where Ray ran it
    for rec in records:  # a point's folder, not sweep.json, says whether it finished; failed ones go again
        rec["status"] = DONE if (Path(rec["dir"]) / "summary.json").is_file() else PENDING
        rec.update(read_point(Path(rec["dir"])))

    def document() -> dict[str, Any]:
        return {"toyharness_version": __version__, **plan.to_json(), **executor.describe(),
                "points": records, "configs": summarize(plan, records)}

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
    return SweepResult(records, summarize(plan, records), plotted)


def main(args) -> int:
    """`toyharness sweep`: exit 0 when every point finished, 1 when one failed, 2 on bad input."""
    if args.keep_models and not args.ray:
        raise InputError("--keep-models is for --ray (local points keep their model files where they ran)")
    if args.resume:
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
    from .observers import ObserverBus, load_observers

    observers = load_observers(observer_names(plan))     # an unknown name stops the sweep here, exit 2
    if args.ray:
        executor = RayExecutor(args.ray, args.threads, plan.backend, args.keep_models, args.workers)
    else:
        executor = LocalPool(args.workers, args.threads, plan.backend)
    bus = ObserverBus(observers)
    try:
        result = run_sweep(plan, out_dir, executor, progress=not args.no_progress, previous=previous, bus=bus)
    finally:
        bus.close()
    print_table(plan, result.rows, result.records, out_dir)
    plot = f", {out_dir / 'sweep.png'}" if result.plotted else " (no sweep.png: no point finished)"
    print(f"wrote {out_dir / SWEEP_JSON}{plot} and {len(plan.points)} run folders under {out_dir / 'points'}")
    if result.failed:
        print(f"toyharness: check failed: {len(result.failed)} of {len(plan.points)} points failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_point_main(sys.argv[1:]))
