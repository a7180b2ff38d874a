"""Data parallel (`devices = N`, engine/data_parallel.py): N processes started by MPI's launcher,
one micro-batch of each step apiece, with the bits of one process accumulating the N micro-batches
(`accumulate = N`): losses, gradient norms, evaluations, a preference recipe's metrics and the
checkpoint's tensors, and a resume from either onto the other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli

from toyharness.engine import GGUFFile
from toyharness.engine.data_parallel import sum_in_order
from toyharness.goldens import golden_sets_for

MPIEXEC = Path(sys.executable).parent / "mpiexec"
try:
    import mpi4py  # noqa: F401
    MPI_MISSING = None if MPIEXEC.is_file() else f"no {MPIEXEC} (the mpich wheel's launcher)"
except ImportError:
    MPI_MISSING = 'mpi4py is not installed (pip install "toyharness[dp]")'
needs_mpi = pytest.mark.skipif(MPI_MISSING is not None, reason=MPI_MISSING or "")
QUIET = ["--threads", "1", "--no-progress"]
TIMING = ("ms", "tokens_per_s", "wall_s")


def sets_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def spread_run(n: int, *args: str) -> subprocess.CompletedProcess:
    """`mpiexec -n N toyharness run ARGS` (each process one thread)."""
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "toyharness.cli", "run", *args, *QUIET]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


def losses(run_dir: Path) -> list[tuple]:
    """Each step's loss bits and gradient norm (a run cut short has its own schedule's lr)."""
    return [(m["loss_hex"], m["grad_norm"]) for m in metrics(run_dir)]


def tensors(path: Path) -> dict[str, np.ndarray]:
    with GGUFFile(path) as f:
        return {n: f.tensor(n).to_numpy() for n in f.names}


def test_the_gathered_gradients_are_summed_in_micro_batch_order_as_accumulation_adds_them():
    g = np.random.default_rng(3).normal(size=(4, 1000)).astype(np.float32) * np.float32(1e4)
    before_last, last = sum_in_order(g)
    want = g[0].copy()
    for k in (1, 2):
        want = g[k] + want             # accumulation's ADD(g_k, sum): one float32 rounding each
    assert np.array_equal(before_last, want) and np.array_equal(last, g[3])
    assert not np.array_equal(before_last, (g[0] + (g[1] + g[2])))    # the order shows in the bits
    with pytest.raises(ValueError, match="float32"):
        sum_in_order(g.astype(np.float64))


def test_rounds_of_gathered_gradients_add_on_to_the_running_sum_in_order():
    """Two rounds of two processes: micro-batches 0, 1 then 2, 3, added as one process adds four."""
    g = np.random.default_rng(4).normal(size=(4, 1000)).astype(np.float32) * np.float32(1e4)
    running, none = sum_in_order(g[:2], None, keep_last=False)
    assert none is None and np.array_equal(running, g[1] + g[0])
    before_last, last = sum_in_order(g[2:], running, keep_last=True)
    assert np.array_equal(before_last, g[2] + (g[1] + g[0])) and np.array_equal(last, g[3])


@needs_mpi
@pytest.mark.parametrize("recipe, extra", [("gpt2", ["dropout=0.1", "grad_clip=0.05"]), ("lora", ["lora_dropout=0.1"]),
                                           ("dpo", [])])
def test_two_processes_give_the_bits_of_one_accumulating_two_micro_batches(recipe, extra, tmp_path):
    # dpo's pairs evaluate every held-out pair (eval_batches is the text data's)
    sets = golden_sets_for(recipe) + extra + ["eval_every=4"] + (["eval_batches=2"] if recipe != "dpo" else [])
    spread = spread_run(2, recipe, "--steps", "8", *sets_args(sets + ["devices=2"]), "--out", str(tmp_path / "dp"))
    assert spread.returncode == 0, spread.stderr[-2000:]
    one = cli("run", recipe, "--steps", "8", *sets_args(sets + ["accumulate=2"]), "--out", str(tmp_path / "acc"),
              *QUIET)
    assert one.returncode == 0, one.stderr[-2000:]
    dp, acc = metrics(tmp_path / "dp"), metrics(tmp_path / "acc")
    assert len(dp) == 8 and dp == acc
    assert "eval_loss" in dp[3] and (recipe != "gpt2" or "grad_norm" in dp[0])
    a, b = tensors(tmp_path / "dp" / "checkpoint.gguf"), tensors(tmp_path / "acc" / "checkpoint.gguf")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@needs_mpi
def test_a_checkpoint_resumes_on_another_number_of_processes_with_the_same_bits(tmp_path):
    # a constant lr: the first half, a run of 4 steps, would have its own cosine
    sets = golden_sets_for("gpt2") + ["dropout=0.1", "grad_clip=0.05", "checkpoint_every=4", "eval_every=100",
                                      "lr_schedule=constant", "warmup=0"]
    full = cli("run", "gpt2", "--steps", "8", *sets_args(sets + ["accumulate=2"]), "--out", str(tmp_path / "full"),
               *QUIET)
    assert full.returncode == 0, full.stderr[-2000:]
    first = spread_run(2, "gpt2", "--steps", "4", *sets_args(sets + ["devices=2"]), "--out", str(tmp_path / "dp"))
    assert first.returncode == 0, first.stderr[-2000:]
    alone = cli("run", "gpt2", "--resume", str(tmp_path / "dp"), "--steps", "8", "--set", "devices=1", "--set",
                "accumulate=2", "--out", str(tmp_path / "alone"), *QUIET)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert losses(tmp_path / "alone") == losses(tmp_path / "full")
    # and the other way: one process's first half, two processes' second
    cli("run", "gpt2", "--steps", "4", *sets_args(sets + ["accumulate=2"]), "--out", str(tmp_path / "one"), *QUIET)
    spread = spread_run(2, "gpt2", "--resume", str(tmp_path / "one"), "--steps", "8", "--set", "devices=2", "--set",
                        "accumulate=1", "--out", str(tmp_path / "spread"))
    assert spread.returncode == 0, spread.stderr[-2000:]
    assert losses(tmp_path / "spread") == losses(tmp_path / "full")


@needs_mpi
def test_allreduce_steps_on_mpis_sum_within_rounding_of_the_ordered_bits(tmp_path):
    """gradient_reduce=allreduce over 3 processes: MPI's sum of the 3 micro-batches' gradients,
    added in its own order: 8 losses within 1e-6 relative of accumulate=3's."""
    sets = golden_sets_for("gpt2") + ["eval_every=100"]
    spread = spread_run(3, "gpt2", "--steps", "8", *sets_args(sets + ["devices=3", "gradient_reduce=allreduce"]),
                        "--out", str(tmp_path / "dp"))
    assert spread.returncode == 0, spread.stderr[-2000:]
    one = cli("run", "gpt2", "--steps", "8", *sets_args(sets + ["accumulate=3"]), "--out", str(tmp_path / "acc"),
              *QUIET)
    assert one.returncode == 0, one.stderr[-2000:]
    a = np.array([m["loss"] for m in metrics(tmp_path / "dp")])
    b = np.array([m["loss"] for m in metrics(tmp_path / "acc")])
    assert len(a) == 8 and np.max(np.abs(a - b) / np.abs(b)) < 1e-6


def test_gradient_reduce_without_devices_is_refused_by_name(tmp_path):
    res = cli("run", "llama", "--steps", "1", "--set", "gradient_reduce=allreduce", "--out", str(tmp_path / "r"),
              *QUIET)
    assert res.returncode == 2 and "gradient_reduce=allreduce" in res.stderr and "devices > 1" in res.stderr


@needs_mpi
def test_devices_under_a_launcher_of_another_size_is_one_line_exit_2(tmp_path):
    res = spread_run(1, "llama", "--steps", "1", "--set", "devices=2", "--out", str(tmp_path / "r"))
    lines = [x for x in res.stderr.strip().splitlines() if x.startswith("toyharness")]
    assert res.returncode == 2 and lines == ["toyharness: error: devices=2: start the run with mpiexec -n 2 (this "
                                             "is one process of 1)"], res.stderr


@needs_mpi
def test_devices_without_a_launcher_starts_mpiexec_itself_with_the_bits_of_accumulation(tmp_path):
    """`toyharness run lora --set devices=2` in a plain shell: MPI's launcher started by the run
    (toyharness/launcher.py), one summary printed, the bits of accumulate=2."""
    sets = golden_sets_for("lora")
    spread = cli("run", "lora", "--steps", "4", *sets_args(sets + ["devices=2"]), "--out", str(tmp_path / "dp"),
                 *QUIET)
    assert spread.returncode == 0, spread.stderr[-2000:]
    assert spread.stdout.count("run folder:") == 1 and not (tmp_path / "dp" / "launcher.log").exists()
    one = cli("run", "lora", "--steps", "4", *sets_args(sets + ["accumulate=2"]), "--out", str(tmp_path / "acc"),
              *QUIET)
    assert one.returncode == 0 and metrics(tmp_path / "dp") == metrics(tmp_path / "acc")


def _pids_running(marker: str) -> list[int]:
    """The run's Python processes (not MPI's launcher) whose command line holds `marker` (the run's folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.name.isdigit() and args[1:3] == [b"-m", b"toyharness.cli"] and b"--spread-process" in args \
                and marker.encode() in args:
            pids.append(int(entry.name))
    return pids


@needs_mpi
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the run's processes through /proc (Linux)")
def test_a_killed_process_ends_the_run_in_one_line_and_its_checkpoint_resumes_with_the_same_bits(tmp_path):
    """A process killed (a node lost): MPI's launcher stops the other, its banner goes to the run
    folder's launcher.log, the run ends with exit 1 and one line naming the signal and the resume;
    resumed on one process accumulating two, the steps equal an uninterrupted run's."""
    import os
    import signal
    import time

    sets = golden_sets_for("gpt2") + ["dropout=0.1", "grad_clip=0.05", "checkpoint_every=5", "eval_every=1000",
                                      "lr_schedule=constant", "warmup=0"]
    run_dir = tmp_path / "dp"
    # a session of its own: whatever fails below, the run and its launcher are ended with it
    proc = subprocess.Popen([sys.executable, "-m", "toyharness.cli", "run", "gpt2", "--steps", "100000",
                             *sets_args(sets + ["devices=2"]), "--out", str(run_dir), *QUIET],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoint.gguf").is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        pids = _pids_running(str(run_dir))
        assert len(pids) == 2 and (run_dir / "checkpoint.gguf").is_file(), pids
        os.kill(max(pids), signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _pids_running(str(run_dir)):      # a launcher's processes in groups of their own
            os.kill(pid, signal.SIGKILL)
    lines = [x for x in (out + err).splitlines() if x.strip()]
    assert proc.returncode == 1 and lines == [
        f"toyharness: error: a process of the run ended: Killed (signal 9); the others were stopped; resume from "
        f"its last checkpoint: toyharness run --resume {run_dir} (on any number of devices)"], out + err
    assert "BAD TERMINATION" in (run_dir / "launcher.log").read_text()
    done = len(metrics(run_dir))
    assert done >= 5 and done % 5 == 0       # metrics.jsonl as of the last checkpoint
    resumed = cli("run", "gpt2", "--resume", str(run_dir), "--steps", str(done + 3), "--set", "devices=1", "--set",
                  "accumulate=2", "--out", str(tmp_path / "resumed"), *QUIET)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    full = cli("run", "gpt2", "--steps", str(done + 3), *sets_args(sets + ["accumulate=2"]), "--out",
               str(tmp_path / "full"), *QUIET)
    assert full.returncode == 0 and losses(tmp_path / "resumed") == losses(tmp_path / "full")


@needs_mpi
def test_a_process_whose_write_fails_ends_every_process_with_its_one_line(tmp_path):
    """The first process alone writes the run's files: when it cannot (here metrics.jsonl is a
    folder), it says so and ends the other, which would otherwise wait in its next gather."""
    (tmp_path / "dp" / "metrics.jsonl").mkdir(parents=True)
    res = cli("run", "gpt2", "--steps", "40", *sets_args(golden_sets_for("gpt2") + ["devices=2", "checkpoint_every=5"]),
              "--out", str(tmp_path / "dp"), *QUIET, timeout=120)
    lines = [x for x in (res.stdout + res.stderr).splitlines() if x.strip()]
    assert res.returncode == 1 and lines == [f"toyharness: error: cannot write {tmp_path / 'dp' / 'metrics.jsonl'}: "
                                             "Is a directory"], res.stdout + res.stderr


@needs_mpi
def test_two_processes_accumulating_two_rounds_give_the_bits_of_one_accumulating_four(tmp_path):
    """devices=2 with accumulate=2: each process computes micro-batches r and r + 2 of a step's 4, in
    two rounds; the bits of one process with accumulate=4 (dropout's masks, clipping and the
    recipe's own metrics included)."""
    sets = golden_sets_for("lora") + ["lora_dropout=0.1", "grad_clip=0.05", "eval_every=4", "eval_batches=2"]
    spread = spread_run(2, "lora", "--steps", "6", *sets_args(sets + ["devices=2", "accumulate=2"]), "--out",
                        str(tmp_path / "dp"))
    assert spread.returncode == 0, spread.stderr[-2000:]
    one = cli("run", "lora", "--steps", "6", *sets_args(sets + ["accumulate=4"]), "--out", str(tmp_path / "acc"),
              *QUIET)
    assert one.returncode == 0, one.stderr[-2000:]
    dp, acc = metrics(tmp_path / "dp"), metrics(tmp_path / "acc")
    assert len(dp) == 6 and dp == acc and "grad_norm" in dp[0]
    two = cli("run", "lora", "--steps", "6", *sets_args(sets + ["accumulate=2"]), "--out", str(tmp_path / "two"),
              *QUIET)
    assert two.returncode == 0 and metrics(tmp_path / "two")[1]["loss_hex"] != dp[1]["loss_hex"]   # 4, not 2
