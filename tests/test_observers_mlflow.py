"""The mlflow observer against MLflow's local file store, read back through mlflow.search_runs:
a run's params, tags, per-step metrics and artifacts; a sweep as one parent run with a child per
point. `nox -s mlflow` installs mlflow-skinny and runs these; without it they skip, saying so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toyharness.runner import train

mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed: nox -s mlflow (the extra toyharness[mlflow])")

pytestmark = pytest.mark.mlflow

TINY = ["n_layer=1", "d_model=16", "n_head=2", "t_seq=16", "t_batch=2", "eval_every=4", "checkpoint_every=8",
        "eval_batches=2"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local file store in tmp_path (MLflow >= 3.13 needs MLFLOW_ALLOW_FILE_STORE for one)."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_is_found_with_its_params_metrics_per_step_and_artifacts(store, tmp_path):
    out = tmp_path / "run"
    train("gpt2", steps=12, sets=TINY, out=str(out), progress=False, log="mlflow")
    (run,) = mlflow.search_runs(experiment_names=["toyharness-gpt2"], output_format="list")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["lr"] == "0.003" and params["d_model"] == "16" and params["log"] == "mlflow"
    import tomllib

    cfg = tomllib.loads((out / "config.toml").read_text())
    assert run.data.tags["toyharness.fingerprint"] == cfg["fingerprint"]
    assert run.data.tags["toyharness.out_dir"] == str(out.resolve())
    client = mlflow.tracking.MlflowClient()
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    metrics = metrics_of(out)
    assert [(m.step, m.value) for m in history] == [(m["step"], m["loss"]) for m in metrics]
    evals = sorted(client.get_metric_history(run.info.run_id, "eval_loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in evals] == [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.toml", "metrics.jsonl", "summary.json", "loss.png", "model"} <= top
    assert "checkpoint.gguf" not in top
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.gguf"]
    local = Path(client.download_artifacts(run.info.run_id, "model/model.gguf", str(tmp_path / "dl")))
    assert local.read_bytes() == (out / "model.gguf").read_bytes()


def test_sweep_is_a_parent_run_with_a_child_per_point(store, tmp_path):
    out = tmp_path / "sweep"
    res = subprocess.run([sys.executable, "-m", "toyharness.cli", "sweep", "gpt2", "--grid", "lr=1e-3,3e-3",
                          "--seeds", "2", "--steps", "4", *[a for s in TINY for a in ("--set", s)], "--workers", "2",
                          "--threads", "1", "--out", str(out), "--no-progress", "--log", "mlflow"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "observer" not in res.stderr, res.stderr
    doc = json.loads((out / "sweep.json").read_text())
    runs = mlflow.search_runs(experiment_names=["toyharness-gpt2"], output_format="list")
    (parent,) = [r for r in runs if r.data.tags.get("toyharness.role") == "sweep"]
    assert parent.data.tags["toyharness.sweep_id"] == doc["sweep_id"] and parent.info.status == "FINISHED"
    assert parent.data.params["grid.lr"] == "1e-3,3e-3" and parent.data.params["seeds"] == "1337,1338"
    children = [r for r in runs if r is not parent]
    assert len(children) == 4
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    by_point = {int(r.data.tags["point"]): r for r in children}
    for p in doc["points"]:
        child = by_point[p["index"]]
        assert child.info.run_name == p["name"] and child.info.status == "FINISHED"
        assert child.data.tags["lr"] == p["config"]["lr"] and child.data.tags["seed"] == str(p["seed"])
        assert child.data.params["seed"] == str(p["seed"])
        assert child.data.metrics["loss"] == metrics_of(Path(p["dir"]))[-1]["loss"]
    client = mlflow.tracking.MlflowClient()
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"sweep.json", "sweep.png"}


def test_a_store_that_cannot_open_is_refused_before_the_run(tmp_path, monkeypatch):
    from toyharness.errors import InputError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracker")
    with pytest.raises(InputError, match="observer 'mlflow': the tracking store .* cannot be opened"):
        train("gpt2", steps=2, sets=TINY, out=str(tmp_path / "run"), progress=False, log="mlflow")
    assert not (tmp_path / "run").exists()


def test_failed_run_is_marked_failed_and_a_resume_goes_on_in_the_same_run(store, tmp_path):
    from toyharness.errors import CheckFailed

    with pytest.raises(CheckFailed):
        train("gpt2", steps=4, sets=[*TINY, "lr=1e30", "warmup=0"], out=str(tmp_path / "bad"), progress=False,
              log="mlflow")
    out = tmp_path / "run"
    train("gpt2", steps=8, sets=TINY, out=str(out), progress=False, log="mlflow")
    train("gpt2", steps=12, resume=str(out), progress=False)          # the option `log` comes from config.toml
    runs = mlflow.search_runs(experiment_names=["toyharness-gpt2"], output_format="list")
    (bad,) = [r for r in runs if r.info.run_name == "bad"]
    assert bad.info.status == "FAILED" and "loss is" in bad.data.tags["toyharness.error"]
    (good,) = [r for r in runs if r.info.run_name == "run"]
    assert good.info.status == "FINISHED"
    history = mlflow.tracking.MlflowClient().get_metric_history(good.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(12))
    assert sorted((m.step, m.value) for m in history) == [(m["step"], m["loss"]) for m in metrics_of(out)]
