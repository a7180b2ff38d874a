"""toyharness sweep: a grid of points, each an ordinary run with a plain run's bits, through the
local pool and through Ray; a failing point; resume after the driver is killed."""

import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import cli

from toyharness.cli import main
from toyharness.engine import GGUFFile
from toyharness.errors import InputError
from toyharness.hookspecs import hookimpl
from toyharness.runner import train
from toyharness.sweep import make_plan, run_sweep

TINY = ["n_layer=1", "n_head=2", "t_seq=16", "t_batch=2", "eval_every=4", "checkpoint_every=4", "eval_batches=2"]
SETS = [a for s in TINY for a in ("--set", s)]
GRID = ["lr=1e-3,3e-3", "d_model=16,32"]
STEPS = 16


def loss_hexes(run_dir: Path) -> list[str]:
    return [json.loads(x)["loss_hex"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def sweep_doc(out: Path) -> dict:
    return json.loads((out / "sweep.json").read_text())


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """The 2x2 grid with 2 seeds through the local pool (2 workers of 1 thread), from the CLI."""
    out = tmp_path_factory.mktemp("sweep") / "local"
    res = cli("sweep", "llama", "--grid", GRID[0], "--grid", GRID[1], "--seeds", "2", "--steps", str(STEPS), *SETS,
              "--workers", "2", "--threads", "1", "--out", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    return out, res


def test_local_pool_writes_a_run_folder_per_point_and_the_results(local_sweep):
    out, res = local_sweep
    doc = sweep_doc(out)
    assert doc["grid"] == {"lr": ["1e-3", "3e-3"], "d_model": ["16", "32"]}
    assert doc["seeds"] == [1337, 1338]          # --seeds 2: from the options' seed up
    assert [(p["config"]["lr"], p["config"]["d_model"], p["seed"]) for p in doc["points"]] == [
        (lr, d, s) for lr in ("1e-3", "3e-3") for d in ("16", "32") for s in (1337, 1338)]
    for p in doc["points"]:
        assert p["status"] == "done", p
        assert p["options"]["lr"] == float(p["config"]["lr"]) and p["options"]["seed"] == p["seed"]
        assert p["options"]["d_model"] == int(p["config"]["d_model"]) and p["options"]["steps"] == STEPS
        run_dir = out / "points" / p["name"]
        for name in ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "checkpoint.gguf", "model.gguf"):
            assert (run_dir / name).is_file(), (p["name"], name)
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
        assert len(metrics) == STEPS and len(evals) == STEPS // 4
        assert p["final_eval_loss"] == evals[-1] and p["best_eval_loss"] == min(evals)
    # Per configuration: mean and sample std over the seeds, sorted by the mean.
    rows = doc["configs"]
    assert len(rows) == 4 and all(r["done"] == 2 for r in rows)
    for r in rows:
        finals = [p["final_eval_loss"] for p in doc["points"] if p["config"] == r["config"]]
        assert r["final_eval_loss_mean"] == pytest.approx(statistics.mean(finals), rel=1e-12)
        assert r["final_eval_loss_std"] == pytest.approx(statistics.stdev(finals), rel=1e-9)
    means = [r["final_eval_loss_mean"] for r in rows]
    assert means == sorted(means)
    best = rows[0]["config"]
    first_row = next(line for line in res.stdout.splitlines() if re.search(r"\d ± \d", line))
    assert best["lr"] in first_row and best["d_model"] in first_row, res.stdout
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_point_has_the_bits_of_a_plain_run(local_sweep, tmp_path):
    out, _ = local_sweep
    points = sweep_doc(out)["points"]
    # One through the command line, literally `toyharness run` with the point's options ...
    p = points[5]
    plain = tmp_path / "plain"
    res = cli("run", "llama", "--steps", str(STEPS), *[a for s in p["sets"] for a in ("--set", s)],
              "--out", str(plain), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert loss_hexes(plain) == loss_hexes(out / "points" / p["name"])
    # ... and one seed of each configuration through the runner that `toyharness run` calls, in
    # this process (with 2 threads, not 1: the same bits).
    for p in points[::2]:
        if p is not points[5]:
            run = train("llama", steps=STEPS, sets=p["sets"], threads=2, progress=False, write_files=False,
                        observers=(LossHexes(),))
            assert run["loss_hex"] == loss_hexes(out / "points" / p["name"]), p["name"]
    assert len({tuple(loss_hexes(out / "points" / p["name"])) for p in points}) == len(points)


class LossHexes:
    """Puts the run's loss_hex sequence into its summary."""

    @hookimpl
    def run_end(self, run, summary):
        summary["loss_hex"] = [m["loss_hex"] for m in run.metrics]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the driver's point processes through /proc")
def test_failing_points_are_shown_and_the_others_go_on(tmp_path):
    """Point 0's loss turns NaN; point 1's process is killed (as by the kernel's OOM killer, or a
    ggml abort); point 2 finishes, and the sweep exits 1."""
    out = tmp_path / "s"
    driver = subprocess.Popen([sys.executable, "-m", "toyharness.cli", "sweep", "llama", "--grid", "lr=1e30,1e-3,3e-3",
                               "--steps", "4", *SETS, "--set", "d_model=16", "--workers", "1", "--out", str(out),
                               "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, second = time.monotonic() + 300, []
    while not second and driver.poll() is None and time.monotonic() < deadline:
        second = [k for k in _children(driver.pid) if b'"index": 1,' in Path(f"/proc/{k}/cmdline").read_bytes()]
        time.sleep(0.01)
    os.kill(second[0], signal.SIGKILL)
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 1, stderr
    assert "2 of 3 points failed" in stderr
    nan, dead, good = sweep_doc(out)["points"]
    assert nan["status"] == "failed" and dead["status"] == "failed" and good["status"] == "done"
    assert "loss is nan at step" in nan["message"] or "loss is inf at step" in nan["message"]
    assert dead["message"].startswith("the point's process died (SIGKILL)")
    assert f"failed {nan['name']}: llama: loss is" in stdout
    assert f"failed {dead['name']}: the point's process died" in stdout
    assert good["final_eval_loss"] > 0 and len(loss_hexes(out / "points" / good["name"])) == 4
    rows = sweep_doc(out)["configs"]
    assert rows[0]["config"] == {"lr": "3e-3"} and rows[0]["done"] == 1
    assert [r["final_eval_loss_mean"] for r in rows[1:]] == [None, None]


@pytest.mark.parametrize("args,message", [
    (["--grid", "lr=1e-3,abc"], "option 'lr': 'abc' is not a valid float"),
    (["--grid", "n_heads=2,4"], "unknown option 'n_heads'; allowed:"),
    (["--grid", "lr=1e-3,-1"], "point lr=-1, seed 1337: option 'lr': must be > 0"),
    (["--grid", "lr=1e-3", "--set", "lr=1e-2"], "option 'lr' is both in --grid and --set"),
    (["--grid", "seed=1,2"], "option 'seed' goes in --seeds"),
    (["--grid", "lr=1e-3", "--seeds", "0"], "--seeds 0: must be >= 1"),
    (["--grid", "lr=1e-3", "--workers", str(len(os.sched_getaffinity(0)) + 1), "--threads", "1"],
     "threads is more than this machine's"),
    (["--grid", "lr=1e-3", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["--grid", "lr=1e-3", "--workers", "0"], "--workers must be >= 1, got 0"),
    (["--grid", "lr=1e-3", "--keep-models"],
     "--keep-models is for --ray (local points keep their model files where they ran)"),   # was ignored
])
def test_bad_input_exits_2_naming_it_before_anything_runs(args, message, tmp_path, capsys):
    assert main(["sweep", "llama", *args, "--out", str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s").exists(), "a sweep folder was left behind"


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_ray_without_ray_installed_says_how_to_get_it(tmp_path):
    res = cli("sweep", "llama", "--grid", "lr=1e-3", "--ray", "auto", "--out", str(tmp_path / "s"))
    assert res.returncode == 2 and 'pip install "toyharness[ray]"' in res.stderr, res.stderr
    assert not (tmp_path / "s").exists()


def test_list_valued_options_take_semicolons_in_a_grid():
    plan = make_plan("lora", ["targets=q,v;q,k,v,o", "rank=2,4"], seeds="5,9")
    assert [(o["targets"], o["rank"], o["seed"]) for o in plan.options] == [
        (t, r, s) for t in (["q", "v"], ["q", "k", "v", "o"]) for r in (2, 4) for s in (5, 9)]
    with pytest.raises(InputError, match="option 'targets': 'x' is not allowed"):
        make_plan("lora", ["targets=q,x"])


def test_help_explains_with_an_example():
    res = cli("sweep", "--help")
    assert res.returncode == 0
    assert "examples:" in res.stdout and "toyharness sweep llama --grid lr=1e-3,3e-3" in res.stdout
    assert "--resume" in res.stdout and "--ray" in res.stdout


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the driver's point processes through /proc")
def test_resume_after_the_driver_is_killed_gives_the_uninterrupted_bits(local_sweep, tmp_path):
    out = tmp_path / "killed"
    driver = subprocess.Popen([sys.executable, "-m", "toyharness.cli", "sweep", "llama", "--grid", "lr=1e-3,3e-3",
                               "--set", "d_model=16", "--steps", str(STEPS), *SETS, "--workers", "1", "--threads", "1",
                               "--out", str(out), "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = out / "points" / "000_lr=1e-3_seed=1337"
    deadline = time.monotonic() + 300
    while not (first / "metrics.jsonl").exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)      # metrics.jsonl comes with the first checkpoint
    (point,) = _children(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert driver.returncode == -signal.SIGKILL, driver.stderr.read()
    while Path(f"/proc/{point}").exists() and ") Z" not in Path(f"/proc/{point}/stat").read_text() \
            and time.monotonic() < deadline:
        time.sleep(0.05)      # the point's process stops at its next step's end when its driver is gone
    assert not Path(f"/proc/{point}").exists() or ") Z" in Path(f"/proc/{point}/stat").read_text(), \
        "the point's process outlived its driver"
    assert not (first / "summary.json").exists(), "the point finished before the kill: the test needs more steps"
    with GGUFFile(first / "checkpoint.gguf") as f:
        step = int(f.require_field("toyharness.step"))
    assert 4 <= step < STEPS and len(loss_hexes(first)) == step, "the killed point's folder is not whole"
    assert sweep_doc(out)["points"][0]["status"] == "running"

    res = cli("sweep", "--resume", str(out), "--workers", "1", "--no-progress")
    assert res.returncode == 0, res.stderr
    doc = sweep_doc(out)
    assert [p["status"] for p in doc["points"]] == ["done", "done"]
    assert doc["points"][0]["resumed_from"] == step and doc["points"][1]["resumed_from"] == 0
    # The uninterrupted sweep's points with the same options: the local pool's.
    whole, _ = local_sweep
    for p in doc["points"]:
        (same,) = [q for q in sweep_doc(whole)["points"] if q["options"] == p["options"]]
        assert loss_hexes(out / "points" / p["name"]) == loss_hexes(whole / "points" / same["name"]), p["name"]


def test_resume_refuses_a_changed_plan(local_sweep):
    out, _ = local_sweep
    res = cli("sweep", "--resume", str(out), "--grid", "lr=1")
    assert res.returncode == 2 and "--resume takes the sweep from" in res.stderr and "drop --grid" in res.stderr


# ---------------------------------------------------------------- Ray (nox -s ray installs it)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason='Ray is not installed: nox -s ray (pip install "toyharness[ray]")')
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
def test_ray_gives_the_local_pools_bits_and_sends_back_the_small_files(ray_cluster, local_sweep, tmp_path):
    from toyharness.sweep import RayExecutor

    local, _ = local_sweep
    out = tmp_path / "ray"
    plan = make_plan("llama", GRID, seeds="2", sets=TINY, steps=STEPS)
    one = make_plan("llama", ["lr=1e-3"], sets=TINY + ["d_model=16"], steps=4)
    try:
        result = run_sweep(plan, out, RayExecutor(None, threads=1), progress=False)
        assert not result.failed, result.failed
        for rec in result.records:
            run_dir = out / "points" / rec["name"]
            assert loss_hexes(run_dir) == loss_hexes(local / "points" / rec["name"]), rec["name"]
            assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml", "loss.png", "metrics.jsonl",
                                                                  "summary.json"]
            assert (Path(rec["worker_dir"]) / "checkpoint.gguf").is_file()   # stayed on the worker
        assert sweep_doc(out)["executor"] == "ray"

        kept = tmp_path / "kept"
        run_sweep(one, kept, RayExecutor(None, threads=1, keep_models=True), progress=False)
        assert (kept / "points" / one.points[0].name / "model.gguf").is_file()
    finally:
        for p in (plan, one):
            shutil.rmtree(Path(tempfile.gettempdir()) / "toyharness-sweep" / p.sweep_id, ignore_errors=True)


def test_an_unwritable_sweep_folder_is_one_line_exit_1(capsys):
    """mkdir of DIR/points in a folder that cannot be written was an OSError traceback; /proc takes
    no new folder, even from root (chmod 555 does not stop root)."""
    assert main(["sweep", "llama", "--grid", "lr=1e-3", "--steps", "2", "--out", "/proc/toyharness-sweep",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("toyharness: error: cannot write /proc/toyharness-sweep/points: "), err


def test_points_import_toyharness_itself_whatever_the_cwd_holds(tmp_path, monkeypatch, capsys):
    """Run from a folder holding a `toyharness/` of another kind (the clone's own folder, beside the
    user's work), each point's process put the cwd first on sys.path and imported it: every point
    failed. Here the decoy is a package that refuses to import, so a point that sees it fails."""
    decoy = tmp_path / "toyharness"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("the decoy toyharness in the cwd was imported")\n')
    monkeypatch.chdir(tmp_path)
    rc = main(["sweep", "llama", "--grid", "lr=1e-3,3e-3", "--steps", "2", "--set", "d_model=16", *SETS,
               "--workers", "2", "--threads", "1", "--out", "s", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    doc = sweep_doc(tmp_path / "s")
    assert [p["status"] for p in doc["points"]] == ["done", "done"], [p["message"] for p in doc["points"]]
    assert all(p["steps_done"] == 2 for p in doc["points"])


class RecordingTracker:
    """The Tracker's calls a pool makes, kept: which points finished and where."""

    def __init__(self):
        self.where: dict[int, dict] = {}

    def started(self, index):
        pass

    def progress(self, index, msg):
        pass

    def finished(self, index, outcome):
        self.where[index] = outcome.where

    def wait(self, seconds):
        time.sleep(seconds)


@pytest.mark.parametrize("listed, want", [("3,5", ["3", "5"]), ("GPU-8e1f, GPU-77a0", ["GPU-8e1f", "GPU-77a0"]),
                                          ("", []), ("-1", [])])
def test_a_cuda_sweep_places_its_points_on_the_gpus_cuda_visible_devices_lists(listed, want, monkeypatch):
    from toyharness.sweep.executors import LocalPool, visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_gpus() == want
    pool = LocalPool(backend="cuda")
    assert pool.workers == max(1, len(want)) and pool.describe().get("gpus", []) == want


@pytest.mark.parametrize("workers", [None, 3])
def test_the_local_pool_gives_each_running_point_a_gpu_of_its_own(workers, monkeypatch):
    """One worker per GPU by default: no two points that run at once see the same GPU, and each
    point's record says which it had. Three workers on two GPUs: they share them in turn."""
    import threading

    from toyharness.sweep import executors
    from toyharness.sweep.point import Outcome

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    running, lock = set(), threading.Lock()

    def launch(spec, on_progress=None, procs=None, env=None):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            if workers is None:
                assert gpu not in running
            running.add(gpu)
        time.sleep(0.05)
        with lock:
            running.discard(gpu)
        return Outcome("done")

    monkeypatch.setattr(executors, "launch_point", launch)
    pool = executors.LocalPool(workers, backend="cuda")
    tracker = RecordingTracker()
    pool.run([{"index": i} for i in range(7)], tracker)
    assert pool.workers == (workers or 2)
    assert sorted(tracker.where) == list(range(7)) and {w["gpu"] for w in tracker.where.values()} == {"4", "6"}
