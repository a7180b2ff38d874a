"""A hostile machine. Writes that fail (a full disk, a file size limit, a read-only folder, a
quota): one line naming the file and the cause, exit 1, no half-written file, and the run's last
good checkpoint still resumes, bit for bit. And a run killed with SIGKILL at random moments:
resumed, its losses are the uninterrupted run's, and no file under a final name is ever partial."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

from toyharness.engine import GGUFFile, write_gguf
from toyharness.errors import WriteError

TINY = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2", "--set", "t_seq=16", "--set", "t_batch=2",
        "--set", "eval_every=4", "--set", "checkpoint_every=4", "--set", "warmup=2"]


def losses(run: Path) -> list[str]:
    return [json.loads(x)["loss_hex"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_one_line_write_error(res, path: Path, cause: str):
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == [f"toyharness: error: cannot write {path}: {cause}"], res.stderr


def assert_every_final_file_parses(run: Path) -> None:
    """No file under a final name is partial: each parses whole (temporary files may remain
    after a kill; they are dot-named and never read)."""
    import tomllib

    for path in run.iterdir():
        if path.name.startswith("."):
            continue
        if path.suffix == ".gguf":
            with GGUFFile(path) as f:
                assert all(f.tensor(n).to_numpy().size > 0 for n in f.names), path
        elif path.suffix == ".jsonl":
            assert all(json.loads(line)["loss_hex"] for line in path.read_text().splitlines()), path
        elif path.suffix == ".json":
            assert json.loads(path.read_text())["steps"] > 0, path
        elif path.suffix == ".toml":
            assert tomllib.loads(path.read_text())["recipe"], path
        elif path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.read_bytes()[-8:-4] == b"IEND", path
        elif path.suffix == ".npz":
            assert np.load(path).files, path


def assert_nothing_half_written(run: Path) -> None:
    assert not list(run.glob(".*.tmp")), "a temporary file was left behind"
    assert_every_final_file_parses(run)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run, and the sizes of its files."""
    out = tmp_path_factory.mktemp("ref") / "run"
    res = cli("run", "gpt2", "--steps", "12", *TINY, "--out", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of our own (root only); skipped, saying why, where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()

    def mount(size_kb: int, *opts: str) -> Path:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size_kb}k", *opts]), "tmpfs", str(mnt)],
                             capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip() or res.returncode}); "
                        f"test_file_size_limit covers the same path without privileges")
        return mnt

    def remount(*opts: str) -> None:
        subprocess.run(["mount", "-o", ",".join(["remount", *opts]), str(mnt)], check=True)

    mount.remount = remount
    yield mount
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)   # lazily: a test's mmap may still be open


def test_full_disk_then_read_only_then_the_last_checkpoint_resumes(small_fs, reference_run):
    ckpt = (reference_run / "checkpoint.gguf").stat().st_size
    # Room for the small files and one checkpoint, not for the second written beside it.
    mnt = small_fs(int((ckpt * 1.5 + 64 * 1024) // 1024))
    run = mnt / "run"
    res = cli("run", "gpt2", "--steps", "12", *TINY, "--out", str(run), "--no-progress")
    assert_one_line_write_error(res, run / "checkpoint.gguf", "No space left on device")
    assert_nothing_half_written(run)
    with GGUFFile(run / "checkpoint.gguf") as f:
        assert f.field("toyharness.step") == 4          # the last good one, intact

    before = {p.name: p.read_bytes() for p in run.iterdir()}
    small_fs.remount("ro")
    res = cli("run", "gpt2", "--steps", "12", "--resume", str(run), "--no-progress")
    assert_one_line_write_error(res, run / "config.toml", "Read-only file system")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before

    small_fs.remount("rw", "size=8m")
    res = cli("run", "gpt2", "--steps", "12", "--resume", str(run), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert losses(run) == losses(reference_run)


def test_file_size_limit(tmp_path, reference_run):
    """RLIMIT_FSIZE (no privileges needed): the checkpoint is the largest file, so its write
    fails first; SIGXFSZ ignored so the write returns EFBIG instead of killing the process."""
    limit = (reference_run / "model.gguf").stat().st_size

    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = tmp_path / "run"
    res = cli("run", "gpt2", "--steps", "12", *TINY, "--out", str(run), "--no-progress", preexec_fn=cap)
    assert_one_line_write_error(res, run / "checkpoint.gguf", "File too large")
    assert_nothing_half_written(run)
    assert not (run / "checkpoint.gguf").exists()


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.ENOSPC, errno.EROFS])
def test_a_failed_gguf_write_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, code):
    import gguf

    path = tmp_path / "checkpoint.gguf"
    write_gguf(path, "x", {"a": np.zeros(4, np.float32)})
    old = path.read_bytes()

    def fail(self, *args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(WriteError) as exc:
        write_gguf(path, "x", {"a": np.ones(4, np.float32)})
    assert str(exc.value) == f"cannot write {path}: {os.strerror(code)}"
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.gguf"]


# --- SIGKILL at random moments ------------------------------------------------------------------
KILL_RUN = ["run", "gpt2", "--steps", "16", "--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2",
            "--set", "t_seq=16", "--set", "t_batch=2", "--set", "eval_every=8", "--set", "checkpoint_every=1",
            "--no-progress"]


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "toyharness.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _where_killed(run: Path, before: set[str]) -> str:
    """Where a kill landed, read from what it left: a temporary file names the write it cut."""
    new = {p.name.split(".")[1] for p in run.glob(".*.tmp") if p.name not in before}
    if new:
        return "inside the write of " + "+".join(sorted(new))
    if not (run / "checkpoint.gguf").exists():
        return "before the first checkpoint"
    if (run / "model.gguf").exists():
        return "inside the export"
    return "inside a step"


def _wait_for_training(proc: subprocess.Popen, run: Path, since_ns: int, timeout: float = 120.0) -> None:
    """Until the process has written config.toml (set-up done, steps begin) or exited."""
    import time

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if (run / "config.toml").stat().st_mtime_ns >= since_ns:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.002)


def _kill_at_nth_write(proc: subprocess.Popen, run: Path, before: set[str], nth: int) -> bool:
    """SIGKILL the moment the `nth` new temporary file is seen in `run`; False if the run ended first."""
    seen: set[str] = set()
    while proc.poll() is None:
        try:
            names = os.listdir(run)
        except FileNotFoundError:
            continue
        seen |= {n for n in names if n.startswith(".") and n.endswith(".tmp") and n not in before}
        if len(seen) >= nth:
            proc.kill()
            return True
    return False


def _kill_trial(rng: np.random.Generator, run: Path, setup_s: float, train_s: float, kills: int) -> list[str]:
    """Kill the run `kills` times at random moments (resuming after each), then let it finish.
    Most kills land in the training part (steps, checkpoint and metrics writes, the export):
    the moment is drawn after set-up ends, so a loaded machine does not push them all into the
    imports; some land during set-up, and about a third hunt a write (the n-th temporary file)."""
    import time

    landed = []
    for k in range(kills + 1):
        resume = (run / "checkpoint.gguf").exists() and (run / "config.toml").exists()
        before = {p.name for p in run.glob(".*.tmp")} if run.exists() else set()
        since = time.time_ns()
        proc = _start(*(["run", "gpt2", "--steps", "16", "--resume", str(run), "--no-progress"] if resume
                        else [*KILL_RUN, "--out", str(run)]))
        if k == kills:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            break
        mode = rng.random()
        if mode < 0.15:
            delay = rng.uniform(0, setup_s)
        else:
            _wait_for_training(proc, run, since)
            delay = rng.uniform(0, train_s)
        if 0.15 <= mode < 0.5:
            # Hunt a write: kill as soon as the n-th new temporary file appears (a checkpoint or
            # metrics write lasts milliseconds; a random moment rarely lands in one).
            killed = _kill_at_nth_write(proc, run, before, int(rng.integers(1, 7)))
        else:
            try:
                proc.wait(timeout=float(delay))
                killed = False
            except subprocess.TimeoutExpired:
                proc.kill()
                killed = True
        proc.wait()
        landed.append(_where_killed(run, before) if killed else "after the run finished")
        proc.stderr.close()
        if run.exists():
            assert_every_final_file_parses(run)
    assert_every_final_file_parses(run)
    return landed


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path, pytestconfig):
    import concurrent.futures
    import time
    from collections import Counter

    reference = tmp_path / "reference"
    since, t0 = time.time_ns(), time.monotonic()
    proc = _start(*KILL_RUN, "--out", str(reference))
    _wait_for_training(proc, reference, since)
    setup_s = time.monotonic() - t0
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    proc.stderr.close()
    train_s = time.monotonic() - t0 - setup_s
    # (tests/conftest.py's --kill-trials and --kill-seed: nox -s fuzz runs many more)
    rng = np.random.default_rng(pytestconfig.getoption("kill_seed"))
    plans = [(tmp_path / f"trial{i}", int(rng.integers(1, 4))) for i in range(pytestconfig.getoption("kill_trials"))]
    seeds = rng.integers(2**31, size=len(plans))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        landed = list(pool.map(lambda p, s: _kill_trial(np.random.default_rng(s), p[0], setup_s, train_s, p[1]),
                               plans, seeds))
    tally = Counter(where for trial in landed for where in trial)
    print(f"\n{sum(tally.values())} SIGKILLs over {len(plans)} trials (set-up {setup_s:.1f} s, steps to end "
          f"{train_s:.1f} s): {dict(tally)}")
    for run, _ in plans:
        assert losses(run) == losses(reference), run
        for name in ("checkpoint.gguf", "model.gguf"):
            assert (run / name).read_bytes() == (reference / name).read_bytes(), f"{run}/{name}"
