"""The training loop and a run's folder (docs/design.md, "A run's files").

Every file is written atomically (temporary name, then rename; toyharness/atomic.py), and a
write that fails (disk full, quota, read-only folder) is one `WriteError` naming the file, exit 1.
At each checkpoint metrics.jsonl is rewritten whole *before* checkpoint.gguf, so after a kill or a
failed write at any moment it holds at least the steps the checkpoint beside it covers, and
--resume keeps exactly those.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__, launcher
from .adamw import HPRow, check_convention
from .atomic import atomic_write
from .data import load_text_data
from .discovery import get_recipe
from .engine import data_parallel, get_engine, write_gguf
from .engine.memory_plan import check_fits, plan_model
from .errors import CheckFailed, InputError, OutOfMemory, Reported, WriteError
from .hookspecs import plugin_manager
from .observers import ObserverBus, load_observers
from .options import Options, read_toml, resolve_options
from .run_files import (
    load_checkpoint,
    plot_confusion,
    plot_loss,
    read_metrics,
    save_batches_npz,
    save_checkpoint,
    trainer_params,
)
from .training_loop import (
    Progress,
    check_loop_controls,
    evaluate_batch,
    loop_options,
    optimizer_step,
    options_for_steps,
)

GGML_VERSION = "0.25.3"


def float_hex(x: float) -> str:
    """float32 bits as 0x + 8 hex digits."""
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", np.float32(x)))[0]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class Run:
    recipe: str
    options: Options
    out_dir: Path
    engine: Any
    entry: Any = None
    metrics: list[dict] = field(default_factory=list)
    tags: dict[str, Any] = field(default_factory=dict)     # a sweep point's grid values, seed, sweep id
    evals: list[dict] = field(default_factory=list)


# What `sample` and `fuse` call on a finished run's recipe (toyharness.lm.LMRecipe has them all);
# `fuse` also takes a recipe's `fuse_adapters` where it has one (toyharness/merge_adapters.py).
SAMPLE_NEEDS = ("tokenizer", "vocab_for", "params_for_sampling", "load_for_sampling", "build_params", "forward")
FUSE_NEEDS = ("tokenizer", "vocab_for", "params_for_sampling", "write_model")


def load_finished_run(run_dir, needs: tuple[str, ...] = SAMPLE_NEEDS, command: str = "sample"):
    """A finished run folder whose recipe has the methods `needs` (what `command` calls on it): its
    recipe object, resolved options and checkpoint path, or an InputError naming what is missing."""
    run_dir = Path(run_dir)
    cfg_path, ckpt = run_dir / "config.toml", run_dir / "checkpoint.gguf"
    if not cfg_path.is_file() or not ckpt.is_file():
        raise InputError(f"{run_dir}: not a finished run folder (needs config.toml and checkpoint.gguf)")
    name = read_toml(cfg_path).get("recipe", "?")
    _, obj = get_recipe(name)
    missing = [method for method in needs if not callable(getattr(obj, method, None))]
    if missing:
        raise InputError(f"{run_dir}: recipe {name!r} has no {', '.join(missing)}: `{command}` takes a language "
                         "model's recipe (toyharness.lm.LMRecipe has them)")
    return obj, resolve_options(obj, str(cfg_path), [], {}), ckpt


def load_data(pm, options):
    """The recipe's `load_data`, else the core text data (whose windows need ``t_seq``)."""
    data = pm.hook.load_data(options=options)
    if data is None:
        if not hasattr(options, "t_seq"):
            raise InputError(f"options {type(options).__name__}: the recipe has no load_data hook, so it trains on "
                             "the core text data, which reads t_seq and eval_batches: derive its options from "
                             "toyharness.TextOptions, or implement load_data")
        data = load_text_data(options.data)
    # a step's batch holds t_batch * accumulate rows
    data.check(options_for_steps(loop_options(options))) if hasattr(data, "check") else data.check_fits(options.t_seq)
    refuse_unread_eval_batches(data, options)
    return data


def refuse_unread_eval_batches(data, options) -> None:
    """Data with its own count of held-out batches (JSONL examples, preference pairs: every held-out
    row) does not read the option eval_batches: a value other than its default is refused by name."""
    if not hasattr(data, "eval_batches") or not hasattr(options, "eval_batches"):
        return
    default = {f.name: f.default for f in dataclasses.fields(options)}.get("eval_batches")
    if options.eval_batches != default:
        n = data.eval_batches(options_for_steps(loop_options(options)))
        raise InputError(f"option 'eval_batches={options.eval_batches}': this data's evaluation goes through every "
                         f"held-out row ({n} batches here), not a number of batches; leave eval_batches unset")


def batch_for(data, split: str, index: int, options) -> dict[str, np.ndarray]:
    if hasattr(data, "step_batch"):
        return data.step_batch(split, index, options)
    x, y = data.batch(split, index, options.t_batch, options.t_seq, options.seed)
    return {"tokens": x, "targets": y}


def items_per_batch(data, options) -> int:
    if hasattr(data, "items_per_batch"):
        return data.items_per_batch(options)
    return options.t_batch * options.t_seq


def config_toml(run: Run, threads: int) -> str:
    import tomli_w

    # an unset optional option (min_lr) is left out: TOML has no null, and absent reads back unset
    options = {k: v for k, v in run.options.to_dict().items() if v is not None}
    doc = {"recipe": run.recipe, **options, "ggml_version": GGML_VERSION,
           "backend": run.engine.backend, "fingerprint": run.engine.fingerprint(), "threads": threads,
           "toyharness_version": __version__}
    return tomli_w.dumps(doc)


def run_folder(recipe: str, out: str | None, resume_dir: Path | None) -> Path:
    """Where a run writes: `out`, else the resumed run's folder, else runs/RECIPE-TIMESTAMP."""
    return Path(out) if out else (resume_dir or Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")


def train(recipe: str, steps: int | None = None, backend: str | None = None, threads: int | None = None,
          config: str | None = None, sets: list[str] | None = None, out: str | None = None,
          save_init: bool = False, save_batches: bool = False, resume: str | None = None,
          observers: tuple = (), progress: bool = True, write_files: bool = True, log: str | None = None,
          tags: dict[str, Any] | None = None) -> dict:
    """Run a recipe; return the summary. Raises InputError (exit 2) or CheckFailed (exit 1).

    `observers` are called in the loop itself (the harness's own: golden collection, a sweep
    point's progress); `log` (a comma-separated list, else the option ``log``) names observers
    from the ``toyharness.observers`` entry points, called off the loop (toyharness/observers/).
    `tags` reach the observers' run_start (a sweep point's grid values and seed). `backend`: cpu
    by default; a resumed run's own (its config.toml's) unless named."""
    resume_dir = Path(resume) if resume else None
    if resume_dir is not None:
        if not resume_dir.is_dir():
            raise InputError(f"--resume {resume_dir}: no such folder")
        if not (resume_dir / "config.toml").is_file() or not (resume_dir / "checkpoint.gguf").is_file():
            raise InputError(f"--resume {resume_dir}: needs config.toml and checkpoint.gguf there")
        if save_init:
            raise InputError(f"--save-init with --resume {resume_dir}: a resumed run has no step 0 to save "
                             "(init.gguf is written by the run that starts)")
        if config is not None:
            raise InputError(f"--config with --resume {resume_dir}: a resumed run takes its options from "
                             f"{resume_dir / 'config.toml'}; change one with --set KEY=VALUE")
        saved = read_toml(resume_dir / "config.toml")
        if saved.get("recipe") != recipe:
            raise InputError(f"--resume {resume_dir}: that run is recipe {saved.get('recipe')!r}, not {recipe!r}")
        config = str(resume_dir / "config.toml")
    entry, recipe_obj = get_recipe(recipe)
    options = resolve_options(recipe_obj, config, sets, {"steps": steps, "log": log})
    if resume_dir is not None:
        backend = resume_backend(resume_dir, saved, backend, options)
    backend = backend or "cpu"
    if options.devices > 1 and not launcher.under_launcher():
        # started without MPI's launcher: start it on this run and wait (toyharness/launcher.py)
        if observers or not write_files or tags:
            raise InputError(f"devices={options.devices} with observers, tags or write_files=False given in Python: "
                             f"start the run under mpiexec -n {options.devices} (each process then calls train)")
        out_dir = run_folder(recipe, out, resume_dir)
        command = launcher.run_command(recipe, out_dir, steps, backend, threads, config if resume_dir is None else None,
                                       sets, save_init, save_batches, resume_dir, progress, log)
        code = launcher.spread(options.devices, command, out_dir)
        if code != 0:
            raise Reported(code)
        return {**json.loads((out_dir / "summary.json").read_text()), "out_dir": str(out_dir)}
    bus = ObserverBus(load_observers(options.log))      # an unknown --log name stops us here, exit 2
    run_box: list[Run] = []
    try:
        return _train(recipe, entry, recipe_obj, options, bus, backend, threads, out, save_init, save_batches,
                      resume_dir, observers, progress, write_files, dict(tags or {}), run_box)
    except BaseException as exc:
        if run_box:     # run_start was sent: tell the observers how it ended
            reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
            bus.emit("run_failed", run=run_box[0], error=" ".join(reason.split())[:500])
        raise
    finally:
        bus.close()


def plan_run(recipe: str, backend: str | None = None, threads: int | None = None, config: str | None = None,
             sets: list[str] | None = None, resume: str | None = None):
    """The memory plan of the run `train` would make with these arguments (nothing allocated)."""
    if resume:
        resume_dir = Path(resume)
        if not (resume_dir / "config.toml").is_file():
            raise InputError(f"--resume {resume_dir}: needs config.toml there")
        config = str(resume_dir / "config.toml")
        backend = backend or read_toml(config).get("backend")
    backend = backend or "cpu"
    _, recipe_obj = get_recipe(recipe)
    options = resolve_options(recipe_obj, config, sets, {})
    pm = plugin_manager(recipe_obj)
    data = load_data(pm, options)
    engine = get_engine(backend, threads)
    engine.set_portable(options.portable)
    engine.set_precision(options.precision)
    loop = loop_options(options)
    engine.set_training_loop(loop.accumulate, loop.grad_clip, options.devices)
    try:
        return plan_model(recipe, pm, engine, options, data)
    finally:
        engine.set_training_loop()      # the engine is the process's: later programs train plainly


def resume_backend(resume_dir: Path, saved: dict, backend: str | None, options: Options) -> str:
    """The backend a resumed run continues on: the one named, else the run's own (config.toml's).
    A backend or precision that cannot go on here is refused naming the run's settings and what to
    pass instead, before anything loads."""
    from .engine.backend import check_precision

    own = saved.get("backend")
    if backend is None and isinstance(own, str):
        try:
            get_engine(own)
        except InputError as exc:
            raise InputError(f"--resume {resume_dir}: the run ran on the {own} backend: {exc}; to go on elsewhere, "
                             f"name a backend with --backend (not bit for bit)") from None
        backend = own
    backend = backend or "cpu"
    if options.precision == saved.get("precision") and backend != own:
        try:
            check_precision(backend, options.precision)
        except InputError:
            raise InputError(f"--resume {resume_dir}: the run computed its products in {options.precision} on "
                             f"{own}, which the {backend} backend does not; add --set precision=fp32 (not bit "
                             "for bit)") from None
    return backend


def resume_changes(resume_dir: Path, start: int, saved: dict, engine, options: Options,
                   threads: int | None) -> str:
    """One line naming what a resumed run changed from the run it continues (backend, precision,
    the portable mode, a --threads given, the fingerprint), and whether the steps from here keep
    the bits the run would have had; "" when nothing changed."""
    changed, why = [], []
    before = {"backend": saved.get("backend"), "precision": saved.get("precision"),
              "portable": saved.get("portable")}
    now = {"backend": engine.backend, "precision": options.precision, "portable": options.portable}
    reasons = {"backend": "another backend's kernels round otherwise",
               "precision": "another precision rounds the matrix products otherwise",
               "portable": "the portable mode and the fast path sum in other orders"}
    for key in ("backend", "precision", "portable"):
        if before[key] is not None and before[key] != now[key]:
            shown = [str(v).lower() if isinstance(v, bool) else v for v in (before[key], now[key])]
            changed.append(f"{key} {shown[0]} -> {shown[1]}")
            why.append(reasons[key])
    fingerprint = saved.get("fingerprint")
    if not changed and fingerprint is not None and fingerprint != engine.fingerprint():
        changed.append(f"fingerprint {fingerprint} -> {engine.fingerprint()}")
        why.append("another build or device computes other bits")
    if threads is not None and saved.get("threads") not in (None, engine.threads):
        changed.append(f"threads {saved['threads']} -> {engine.threads}")
    if not changed:
        return ""
    head = f"toyharness: resuming {resume_dir} at step {start} with {', '.join(changed)}"
    if why:
        return f"{head}: from here the bits need not be the uninterrupted run's ({'; '.join(why)})"
    return f"{head}: the same bits (the thread count changes no result on any backend)"


def _train(recipe: str, entry, recipe_obj, options: Options, bus: ObserverBus, backend: str, threads: int | None,
           out: str | None, save_init: bool, save_batches: bool, resume_dir: Path | None, observers: tuple,
           progress: bool, write_files: bool, tags: dict[str, Any], run_box: list) -> dict:
    pm = plugin_manager(recipe_obj, *observers)
    data = load_data(pm, options)
    if progress and hasattr(data, "summary"):      # JSONL examples: how many were truncated
        print(data.summary(), file=sys.stderr)
    engine = get_engine(backend, threads)
    engine.set_portable(options.portable)   # each run sets it; a program keeps the mode it was made in
    engine.set_precision(options.precision)
    out_dir = run_folder(recipe, out, resume_dir)
    run = Run(recipe, options, out_dir, engine, entry, tags=tags)

    # The programs the recipe makes now take the run's accumulation and clipping (the engine's,
    # which goes back to its defaults once they are made); with devices > 1, a step of that many
    # micro-batches, this process's one of them (engine/data_parallel.py)
    loop = loop_options(options)
    collective = data_parallel.MpiCollective() if options.devices > 1 else None
    if collective is not None and collective.size != options.devices:
        raise InputError(f"devices={options.devices}: start the run with mpiexec -n {options.devices} (this is "
                         f"one process of {collective.size})")
    if collective is not None and collective.rank != 0:     # the first process alone writes and reports
        write_files, progress, bus = False, False, ObserverBus([])
    engine.set_training_loop(loop.accumulate, loop.grad_clip, options.devices)
    try:
        # Refused here, before anything large is allocated, when it cannot fit (exit 2).
        check_fits(recipe, pm, engine, options, data)
        model = pm.hook.realize(engine=engine, options=options, data=data)
    finally:
        engine.set_training_loop()
    trainer = getattr(model, "trainer", None)
    if trainer is None:
        raise InputError(f"recipe {recipe}: realize returned {type(model).__name__}, which has no `trainer` "
                         "(the Trainer of its program: prog.trainer(loss, convention))")
    check_loop_controls(recipe, trainer, loop)
    if collective is not None:
        trainer.spread_over(collective, options.gradient_reduce)
    step_options = options_for_steps(loop)
    start = 0
    if resume_dir is not None:
        start = load_checkpoint(resume_dir / "checkpoint.gguf", trainer, options)
        run.metrics = read_metrics(resume_dir / "metrics.jsonl", start)
        note = resume_changes(resume_dir, start, read_toml(resume_dir / "config.toml"), engine, options, threads)
        if note:
            print(note, file=sys.stderr)

    # The row's convention must match the graph's before any step runs.
    first_row = pm.hook.hp(options=options, step=start)
    if not isinstance(first_row, HPRow):
        raise InputError(f"recipe {recipe}: the hp hook must return an HPRow (7 floats + convention)")
    # a model that does not say which convention its graph was built for: its trainer's
    check_convention(first_row, getattr(model, "convention", None) or trainer.convention)

    created_dir = write_files and not out_dir.exists()
    if write_files:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WriteError(out_dir, exc) from None
        atomic_write(out_dir / "config.toml", config_toml(run, engine.threads))
        if save_init and resume_dir is None:
            write_gguf(out_dir / "init.gguf", f"toyharness-{recipe}", trainer_params(trainer))
    start_args = {"options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.to_dict().items()},
                  "fingerprint": engine.fingerprint(), "tags": dict(tags)}
    pm.hook.run_start(run=run, **start_args)
    bus.emit("run_start", run=run, **start_args)
    run_box.append(run)

    batches_log: dict[str, list] = {}
    if save_batches:    # a resumed run's file holds every step too: the batches before `start` made again
        for i in range(start):
            for k, v in batch_for(data, "train", i, step_options).items():
                batches_log.setdefault(k, []).append(v)
    per_batch = items_per_batch(data, step_options)
    t_run = time.perf_counter()
    bar = Progress(options.steps - start, recipe, enabled=progress)
    try:
        if write_files and start == options.steps and out_dir != resume_dir:
            # a resume with no step left, into another folder: that folder can be resumed too
            atomic_write(out_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in run.metrics))
            save_checkpoint(out_dir, trainer, loop, start)
        for i in range(start, options.steps):
            batch = batch_for(data, "train", i, step_options)
            if save_batches:
                for k, v in batch.items():
                    batches_log.setdefault(k, []).append(v)
            row = pm.hook.hp(options=options, step=i)
            t0 = time.perf_counter()
            loss, step_metrics = optimizer_step(pm, model, trainer, data, batch, row, loop, recipe)
            loss = float(np.float32(loss))
            ms = (time.perf_counter() - t0) * 1000
            if not math.isfinite(loss):
                raise CheckFailed(f"{recipe}: loss is {loss} at step {i}; stopping (lr {row.lr:g})")
            tps = per_batch / (ms / 1000) if ms > 0 else 0.0
            grad_norm = trainer.grad_norm if options.grad_clip > 0 else None
            run.metrics.append({"step": i, "loss": loss, "loss_hex": float_hex(loss), "lr": row.lr,
                                "ms": round(ms, 3), "tokens_per_s": round(tps, 1)})
            if hasattr(data, "step_metrics"):     # JSONL examples: padding, and the tokens the loss counts
                run.metrics[-1].update(data.step_metrics(i, step_options, ms))
            if grad_norm is not None:
                run.metrics[-1]["grad_norm"] = grad_norm
            run.metrics[-1].update(step_metrics)      # a recipe's own (dpo's rewards/margins, ...)
            step_args = {"step": i, "loss": loss, "lr": row.lr, "ms": ms, "tokens_per_s": tps, "grad_norm": grad_norm}
            pm.hook.step_end(run=run, **step_args, metrics=dict(step_metrics))
            bus.emit("step_end", run=run, **step_args, metrics=dict(step_metrics))
            done = i + 1
            if (done % options.eval_every == 0) or done == options.steps:
                ev = evaluate(pm, model, data, loop)
                ev["step"] = i
                run.evals.append(ev)
                run.metrics[-1]["eval_loss"] = ev["loss"]
                if "accuracy" in ev:
                    run.metrics[-1]["accuracy"] = ev["accuracy"]
                run.metrics[-1].update({f"eval_{k}": v for k, v in ev["metrics"].items()})
                eval_args = {"step": i, "loss": ev["loss"], "accuracy": ev.get("accuracy"),
                             "metrics": dict(ev["metrics"])}
                pm.hook.eval_end(run=run, **eval_args)
                bus.emit("eval_end", run=run, **eval_args)
            # seconds since this process began the run's steps, the step's evaluation included
            run.metrics[-1]["wall_s"] = round(time.perf_counter() - t_run, 3)
            bar.update(loss, tps, run.evals[-1]["loss"] if run.evals else None, grad_norm)
            if write_files and (done % options.checkpoint_every == 0 or done == options.steps):
                atomic_write(out_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in run.metrics))
                save_checkpoint(out_dir, trainer, loop, done)
    except OutOfMemory:
        # A graph's first allocation failed: a folder this run made holds no checkpoint yet, so
        # nothing in it can be resumed; it goes (a resumable one stays).
        if created_dir and not (out_dir / "checkpoint.gguf").exists():
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        bar.close()

    wall = time.perf_counter() - t_run
    losses = [m["loss"] for m in run.metrics]
    summary = {"recipe": recipe, "steps": len(run.metrics), "final_loss": losses[-1] if losses else None,
               "best_loss": min(losses) if losses else None,
               "eval_loss": last_eval_loss(run), "wall_s": round(wall, 3),
               "steps_per_s": round((options.steps - start) / wall, 3) if wall > 0 else None,
               "peak_rss_mb": round(peak_rss_mb(), 1), "backend": engine.backend, "threads": engine.threads}
    if run.evals and "accuracy" in run.evals[-1]:
        summary["accuracy"] = run.evals[-1]["accuracy"]
    if hasattr(data, "truncated"):
        summary["truncated_examples"] = data.truncated
    if hasattr(data, "run_summary"):
        summary.update(data.run_summary(run.metrics))
    exported = []
    if write_files:
        if save_batches:
            save_batches_npz(out_dir / "batches.npz", batches_log)
        exported = pm.hook.export(model=model, options=options, out_dir=out_dir) or []
        atomic_write(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        plot_loss(out_dir / "loss.png", run)
        if run.evals and "confusion" in run.evals[-1]:
            plot_confusion(out_dir / "confusion.png", run.evals[-1]["confusion"], run.recipe)
    summary["out_dir"] = str(out_dir)
    artifacts = run_artifacts(out_dir, exported) if write_files else {}
    pm.hook.run_end(run=run, summary=summary, artifacts=artifacts)
    bus.emit("run_end", run=run, summary=dict(summary), artifacts=dict(artifacts))
    return summary


# The files of a run folder an observer may want, in this order; the recipe's exports come too.
ARTIFACTS = ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "confusion.png", "checkpoint.gguf",
             "init.gguf", "batches.npz")


def run_artifacts(out_dir: Path, exported: list) -> dict[str, Path]:
    """The files this run's folder holds, by name, as absolute paths (run_end's `artifacts`)."""
    found = {name: (out_dir / name).resolve() for name in ARTIFACTS if (out_dir / name).is_file()}
    for path in exported:
        path = Path(path)
        if path.is_file():
            found[path.name] = path.resolve()
    return found


def last_eval_loss(run: Run) -> float | None:
    """This invocation's last evaluation, else (a run resumed after its last step, killed in the
    export) the last one its metrics.jsonl records."""
    if run.evals:
        return run.evals[-1]["loss"]
    return next((m["eval_loss"] for m in reversed(run.metrics) if "eval_loss" in m), None)


def evaluate(pm, model, data, options) -> dict:
    """Mean of the evaluate hook over the held-out batches (the data's own count, else
    options.eval_batches); classifiers' counts and confusion matrices are summed; a recipe's other
    metrics (floats beside the loss) are averaged into ``metrics``."""
    step_options = options_for_steps(options)
    n = data.eval_batches(step_options) if hasattr(data, "eval_batches") else getattr(options, "eval_batches", None)
    if n is None:
        raise InputError(f"options {type(options).__name__}: the recipe's data has no eval_batches(options) and its "
                         "options no eval_batches key: add one of them (TextOptions has the key)")
    total, correct, count, confusion = 0.0, 0, 0, None
    sums: dict[str, float] = {}
    for j in range(n):
        res = evaluate_batch(pm, model, data, batch_for(data, "eval", j, step_options), options)
        total += res["loss"]
        correct += res.get("correct", 0)
        count += res.get("count", 0)
        if "confusion" in res:
            confusion = res["confusion"] if confusion is None else confusion + res["confusion"]
        for key, value in res.items():       # a recipe's own metrics (dpo's rewards/margins, ...)
            if key not in ("loss", "correct", "count", "confusion"):
                sums[key] = sums.get(key, 0.0) + float(value)
    out = {"loss": total / n, "metrics": {k: v / n for k, v in sums.items()}}
    if count:
        out["accuracy"] = correct / count
    if confusion is not None:
        out["confusion"] = confusion
    return out
