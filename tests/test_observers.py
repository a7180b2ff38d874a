"""Observers (toyharness/observers/): found through the toyharness.observers entry points, enabled
with --log, called off the step loop. A failing, slow or hung observer is reported in one line naming
it and changes nothing of the run: not a loss bit, not a file, not the exit code. The built-in
tensorboard observer is read back with TensorBoard's own event reader; the mlflow one is tested in
tests/test_observers_mlflow.py (nox -s mlflow)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from toyharness.cli import main
from toyharness.errors import InputError
from toyharness.hookspecs import hookimpl
from toyharness.observers import ObserverBus, load_observers, observer_manager
from toyharness.runner import train

TINY = ["n_layer=1", "d_model=16", "n_head=2", "t_seq=16", "t_batch=2", "eval_every=4", "checkpoint_every=8",
        "eval_batches=2"]
SETS = [a for s in TINY for a in ("--set", s)]

# A third party's observers, in a distribution of their own (written into a folder on the path).
OBSERVERS_MODULE = '''
import json, os, time
from toyharness.hookspecs import hookimpl

def _log(event, **kw):
    with open(os.environ["REC_FILE"], "a") as fh:
        fh.write(json.dumps({"event": event, **kw}, default=str) + "\\n")

class Recorder:
    @hookimpl
    def run_start(self, run, options, fingerprint, tags):
        _log("run_start", recipe=run.recipe, lr=options["lr"], log=options["log"], fingerprint=fingerprint, tags=tags)
    @hookimpl
    def step_end(self, step, loss):
        _log("step_end", step=step, loss=loss)
    @hookimpl
    def eval_end(self, step, loss, accuracy):
        _log("eval_end", step=step, loss=loss, accuracy=accuracy)
    @hookimpl
    def run_end(self, summary, artifacts):
        _log("run_end", steps=summary["steps"], artifacts=sorted(artifacts))
    @hookimpl
    def run_failed(self, error):
        _log("run_failed", error=error)
    @hookimpl
    def sweep_start(self, sweep, grid, seeds, points):
        _log("sweep_start", sweep_id=sweep.sweep_id, grid=grid, seeds=seeds, tags=[p["tags"] for p in points])
    @hookimpl
    def sweep_end(self, sweep, results, artifacts):
        _log("sweep_end", statuses=[p["status"] for p in results["points"]], artifacts=sorted(artifacts))

class Failing:
    @hookimpl
    def step_end(self, step):
        if step == 2:
            raise ValueError("tracker unreachable")

class Slow:
    @hookimpl
    def step_end(self, step):
        time.sleep(float(os.environ.get("SLOW_S", "0.1")))

class Hung:
    @hookimpl
    def run_end(self):
        time.sleep(30)

class Misspelt:
    @hookimpl
    def stepend(self, step):
        pass
'''

ENTRIES = ["recorder = rec_observers:Recorder", "failing = rec_observers:Failing", "slow = rec_observers:Slow",
           "hung = rec_observers:Hung", "misspelt = rec_observers:Misspelt", "broken = no_such_observer_module:X"]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """The fake distribution on sys.path (this process) and PYTHONPATH (a sweep's point processes)."""
    root = tmp_path / "site"
    info = root / "rec_observers-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rec_observers\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[toyharness.observers]\n" + "\n".join(ENTRIES) + "\n")
    (root / "rec_observers.py").write_text(OBSERVERS_MODULE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("REC_FILE", str(tmp_path / "events.jsonl"))
    return tmp_path


def events(site: Path) -> list[dict]:
    path = site / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def loss_hexes(run_dir: Path) -> list[str]:
    return [json.loads(x)["loss_hex"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The reference: the same tiny gpt2 run with no observer."""
    out = tmp_path_factory.mktemp("plain") / "run"
    train("gpt2", steps=12, sets=TINY, out=str(out), progress=False)
    return out


# ---------------------------------------------------------------- discovery and refusal


def test_unknown_log_name_is_refused_by_name_before_the_run(tmp_path, capsys):
    rc = main(["run", "gpt2", "--steps", "2", *SETS, "--out", str(tmp_path / "run"), "--log", "tensorboard,wandbb"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown observer 'wandbb'" in err and "installed: " in err and "tensorboard" in err
    assert not (tmp_path / "run").exists()


def test_unknown_name_in_the_log_option_is_refused_too(tmp_path):
    with pytest.raises(InputError, match="unknown observer 'nope'"):
        train("gpt2", steps=2, sets=[*TINY, "log=nope"], out=str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


def test_recipes_lists_observers_with_their_distributions(site, capsys):
    assert main(["recipes"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "toyharness 0.1.0" in lines["tensorboard"] and "toyharness.observers.tensorboard" in lines["tensorboard"]
    assert "toyharness 0.1.0" in lines["mlflow"]
    assert "rec_observers 1.0" in lines["recorder"] and "rec_observers:Recorder" in lines["recorder"]


def test_an_implementation_of_no_observer_hook_is_refused_by_name(site):
    with pytest.raises(InputError, match=r"observer 'misspelt'.*stepend"):
        load_observers(["misspelt"])


def test_observer_that_fails_to_import_names_its_distribution(site, tmp_path, capsys):
    assert main(["run", "gpt2", "--steps", "2", *SETS, "--out", str(tmp_path / "run"), "--log", "broken"]) == 2
    err = capsys.readouterr().err
    assert "observer 'broken' from distribution rec_observers 1.0 failed to import" in err
    assert "no_such_observer_module" in err and not (tmp_path / "run").exists()


def test_an_argument_the_hook_does_not_have_is_refused_by_name():
    class Wrong:
        @hookimpl
        def step_end(self, step, perplexity):
            pass

    with pytest.raises(InputError, match=r"observer 'wrong'.*perplexity"):
        observer_manager("wrong", Wrong())


# ---------------------------------------------------------------- what observers see


def test_observer_sees_options_fingerprint_steps_evals_and_artifacts(site, plain_run, tmp_path):
    out = tmp_path / "run"
    summary = train("gpt2", steps=12, sets=TINY, out=str(out), progress=False, log="recorder")
    ev = events(site)
    assert [e["event"] for e in ev][0] == "run_start" and ev[-1]["event"] == "run_end"
    start = ev[0]
    assert start["recipe"] == "gpt2" and start["log"] == ["recorder"] and start["tags"] == {}
    assert start["fingerprint"] == json.loads(json.dumps(_config(out)["fingerprint"]))
    steps = [e for e in ev if e["event"] == "step_end"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["loss"]) for e in steps] == [(m["step"], m["loss"]) for m in metrics]
    evals = [e for e in ev if e["event"] == "eval_end"]
    assert [(e["step"], e["loss"], e["accuracy"]) for e in evals] == \
        [(m["step"], m["eval_loss"], None) for m in metrics if "eval_loss" in m]
    assert [e["step"] for e in evals] == [3, 7, 11]
    assert ev[-1]["steps"] == 12 == summary["steps"]
    assert {"config.toml", "metrics.jsonl", "summary.json", "loss.png", "model.gguf", "checkpoint.gguf"} <= \
        set(ev[-1]["artifacts"])
    # an observer changes no loss bit
    assert loss_hexes(out) == loss_hexes(plain_run)


def _config(run_dir: Path) -> dict:
    import tomllib

    return tomllib.loads((run_dir / "config.toml").read_text())


def test_a_failed_run_tells_its_observers_why_and_keeps_its_exit_code(site, tmp_path, capsys):
    rc = main(["run", "gpt2", "--steps", "4", *SETS, "--set", "lr=1e30", "--set", "warmup=0", "--out",
               str(tmp_path / "run"), "--no-progress", "--log", "recorder"])
    assert rc == 1
    ev = events(site)
    assert ev[-1]["event"] == "run_failed" and "run_end" not in [e["event"] for e in ev]
    assert ev[-1]["error"].startswith("CheckFailed: gpt2: loss is ")
    assert "observer" not in capsys.readouterr().err


def test_log_option_is_kept_in_config_toml_and_a_resume_logs_again(site, tmp_path):
    out = tmp_path / "run"
    train("gpt2", steps=8, sets=TINY, out=str(out), progress=False, log="recorder")
    assert _config(out)["log"] == ["recorder"]
    (site / "events.jsonl").unlink()
    train("gpt2", steps=12, resume=str(out), progress=False)
    ev = events(site)
    assert [e["step"] for e in ev if e["event"] == "step_end"] == [8, 9, 10, 11]


# ---------------------------------------------------------------- failing, slow and hung observers


def test_failing_observer_is_reported_in_one_line_and_changes_nothing(site, plain_run, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["run", "gpt2", "--steps", "12", *SETS, "--out", str(out), "--no-progress", "--log",
               "failing", "--log", "recorder"])
    assert rc == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "observer" in line]
    assert err == ["toyharness: observer 'failing' failed in step_end: ValueError: tracker unreachable; it gets no "
                   "further events (the run goes on)"]
    assert loss_hexes(out) == loss_hexes(plain_run)
    assert (out / "summary.json").is_file() and (out / "model.gguf").is_file()
    # the other observer got every event
    assert [e["step"] for e in events(site) if e["event"] == "step_end"] == list(range(12))


def test_slow_observer_does_not_slow_the_step_loop_and_is_reported(site, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLOW_S", "0.25")
    steps = 16
    plain = train("gpt2", steps=steps, sets=TINY, out=str(tmp_path / "plain"), progress=False)
    t0 = time.perf_counter()
    summary = train("gpt2", steps=steps, sets=TINY, out=str(tmp_path / "run"), progress=False, log="slow")
    total = time.perf_counter() - t0
    observer_s = steps * 0.25
    # the loop ran beside the observer: a loop that waited would take the plain run's time plus the
    # observer's 4 s; measured against a plain run of the same process so a loaded machine does not
    # fail it. The run (which waits for the observer at its end) took at least the observer's time.
    assert summary["wall_s"] < plain["wall_s"] + observer_s / 2, (summary, plain)
    assert total >= observer_s
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "observer 'slow'" in x]
    assert "is slow" in line and f"in {steps} calls" in line and "slowest: step_end" in line


def test_hung_observer_is_left_behind_after_the_bounded_wait(site, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOYHARNESS_OBSERVER_WAIT_S", "0.5")
    t0 = time.perf_counter()
    summary = train("gpt2", steps=4, sets=TINY, out=str(tmp_path / "run"), progress=False, log="hung")
    assert time.perf_counter() - t0 < 20
    assert summary["steps"] == 4
    err = capsys.readouterr().err
    assert "toyharness: observer 'hung' was still busy 0.5 s after the run's end" in err


def test_bad_observer_wait_is_refused_by_name(site, tmp_path, monkeypatch):
    monkeypatch.setenv("TOYHARNESS_OBSERVER_WAIT_S", "soon")
    with pytest.raises(InputError, match="TOYHARNESS_OBSERVER_WAIT_S=soon: not a number of seconds >= 0"):
        train("gpt2", steps=2, sets=TINY, out=str(tmp_path / "run"), progress=False, log="recorder")


def test_bus_delivers_in_order_and_isolates_a_failure():
    seen, lines = [], []

    class A:
        @hookimpl
        def step_end(self, step):
            seen.append(("a", step))

    class B:
        @hookimpl
        def step_end(self, step):
            if step == 1:
                raise RuntimeError("boom")
            seen.append(("b", step))

    bus = ObserverBus([("a", observer_manager("a", A())), ("b", observer_manager("b", B()))], report=lines.append,
                      wait_s=5)
    for i in range(4):
        bus.emit("step_end", run=None, step=i, loss=0.0, lr=0.0, ms=0.0, tokens_per_s=0.0, grad_norm=None, metrics={})
    bus.close()
    assert seen == [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("a", 3)]
    assert lines == ["toyharness: observer 'b' failed in step_end: RuntimeError: boom; it gets no further events "
                     "(the run goes on)"]
    t = bus.timings()
    assert t["a"]["calls"] == 4 and t["b"]["calls"] == 2 and t["b"]["failed"]


# ---------------------------------------------------------------- sweeps


def test_sweep_tells_observers_its_grid_and_each_points_tags(site, tmp_path):
    out = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "-m", "toyharness.cli", "sweep", "gpt2", "--grid", "lr=1e-3,3e-3",
                          "--steps", "4", *SETS, "--workers", "2", "--threads", "1", "--out", str(out),
                          "--no-progress", "--log", "recorder"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    ev = events(site)
    starts = [e for e in ev if e["event"] == "sweep_start"]
    (start,) = starts
    doc = json.loads((out / "sweep.json").read_text())
    assert start["sweep_id"] == doc["sweep_id"] and start["grid"] == {"lr": ["1e-3", "3e-3"]}
    assert start["seeds"] == [1337]
    assert [(t["lr"], t["seed"], t["point"]) for t in start["tags"]] == [("1e-3", 1337, 0), ("3e-3", 1337, 1)]
    # each point's run, in its own process, got its tags and the option
    runs = sorted((e for e in ev if e["event"] == "run_start"), key=lambda e: e["tags"]["point"])
    assert [(r["lr"], r["tags"]["lr"], r["tags"]["sweep_id"]) for r in runs] == \
        [(1e-3, "1e-3", doc["sweep_id"]), (3e-3, "3e-3", doc["sweep_id"])]
    assert all(r["log"] == ["recorder"] for r in runs)
    (end,) = [e for e in ev if e["event"] == "sweep_end"]
    assert end["statuses"] == ["done", "done"] and end["artifacts"] == ["sweep.json", "sweep.png"]
    assert [e["event"] for e in ev].index("sweep_start") < [e["event"] for e in ev].index("run_start")


def test_sweep_refuses_an_unknown_log_name_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main(["sweep", "gpt2", "--grid", "lr=1e-3,3e-3", "--steps", "2", *SETS, "--out", str(out), "--no-progress",
               "--log", "tensorbord"])
    assert rc == 2
    assert "unknown observer 'tensorbord'" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------- tensorboard, read back with its own reader


def test_tensorboard_shows_the_gradient_norm_with_grad_clip(tmp_path):
    """train/grad_norm: metrics.jsonl's grad_norm (the norm before clipping), as float32."""
    pytest.importorskip("tensorboard", reason='tensorboard is not installed (pip install "toyharness[tensorboard]")')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train("gpt2", steps=3, sets=[*TINY, "grad_clip=0.1"], out=str(out), progress=False, log="tensorboard")
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [np.float32(m["grad_norm"]) for m in metrics]


def test_tensorboard_events_read_back_with_tensorboards_reader(plain_run, tmp_path):
    pytest.importorskip("tensorboard", reason='tensorboard is not installed (pip install "toyharness[tensorboard]")')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    out = tmp_path / "run"
    train("gpt2", steps=12, sets=TINY, out=str(out), progress=False, log="tensorboard")
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(12))
    # scalars are float32 in the event file: exactly the run's float32 losses
    assert [e.value for e in loss] == [m["loss"] for m in metrics]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == \
        [(m["step"], pytest.approx(m["eval_loss"], rel=1e-6)) for m in metrics if "eval_loss" in m]
    assert [e.value for e in acc.Scalars("train/lr")] == [pytest.approx(m["lr"], rel=1e-6) for m in metrics]

    def text(tag: str) -> str:
        (event,) = acc.Tensors(tag)
        return tensor_util.make_ndarray(event.tensor_proto).item().decode()

    options = text("options")
    assert f"| fingerprint | {_config(out)['fingerprint']} |" in options and "| lr | 0.003 |" in options
    assert f"| model.gguf | {(out / 'model.gguf').resolve()} |" in text("artifacts")
    assert loss_hexes(out) == loss_hexes(plain_run)
