"""A data-parallel run started without MPI's launcher (engine/data_parallel.py).

``toyharness run RECIPE --set devices=N`` in a plain shell starts ``mpiexec -n N`` on the same run
itself (MPICH's launcher, from the ``mpich`` wheel beside this Python, or else the one on PATH),
passes the processes' output through, and waits. When a process ends without finishing (killed,
out of memory, a crash), MPI's launcher ends the others and prints a banner of its own: that is kept
in the run folder's ``launcher.log`` and the run ends with one line that says what ended and how to
resume from the last checkpoint. A process's own error (bad input, a NaN loss) is its one line,
printed once though every process may say it. Under a launcher (``mpiexec -n N toyharness run ...``
by hand, or a cluster's) the run starts as it is."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from .errors import InputError

# what MPI launchers set in the processes they start (MPICH's hydra, Open MPI, PMIx; switches.FOREIGN)
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
# what MPICH says when a process ends badly: hydra's banner (each line of it), and MPI_Abort's note
_BANNER = re.compile(r"^(=+|=   .*|YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*|This typically refers to a "
                     r"problem with your application\.|Please see the FAQ page for debugging suggestions|"
                     r"Abort\(\d+\) on node \d+ .*: application called MPI_Abort\(.*)$")
_EXIT_STRING = re.compile(r"EXIT STRING: (.*)$")


def under_launcher() -> bool:
    """Whether an MPI launcher started this process."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def process_rank() -> int:
    """This process's rank among those a launcher started (0 without one)."""
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def find_mpiexec(what: str) -> str:
    """MPI's launcher: the mpich wheel's beside this Python, else mpiexec on PATH; `what` needs it."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.is_file() else shutil.which("mpiexec")
    if not found:
        raise InputError(f"{what}: needs MPI's launcher mpiexec beside {sys.executable} or on PATH "
                         '(pip install "toyharness[dp]")')
    return found


def run_command(recipe: str, out_dir: Path, steps: int | None, backend: str, threads: int | None,
                config: str | None, sets: list[str] | None, save_init: bool, save_batches: bool,
                resume: Path | None, progress: bool, log: str | None) -> list[str]:
    """`toyharness run` with these arguments, as each process runs it (the run folder named)."""
    cmd = [sys.executable, "-m", "toyharness.cli", "run", recipe, "--backend", backend, "--spread-process"]
    cmd += ["--resume", str(resume)] if resume is not None else []
    cmd += ["--out", str(out_dir)] if resume is None or out_dir != resume else []
    for flag, value in (("--steps", steps), ("--threads", threads), ("--config", config), ("--log", log)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += [a for s in sets or [] for a in ("--set", s)]
    cmd += ["--save-init"] * save_init + ["--save-batches"] * save_batches + ["--no-progress"] * (not progress)
    return cmd


def spread(devices: int, command: list[str], out_dir: Path) -> int:
    """Run `command` in `devices` processes under mpiexec; their output passed through, the
    launcher's own banner kept in out_dir/launcher.log. The exit code: 0 when all finished;
    else a process's own error's code (its one line printed once), or 1 with one line here."""
    mpiexec = find_mpiexec(f"devices={devices}")
    proc = subprocess.Popen([mpiexec, "-n", str(devices), *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    banner: list[str] = []
    said: set[str] = set()           # the processes' error lines, each printed once
    lock = threading.Lock()

    def forward(stream, to) -> None:
        blank = False                # a blank line, held: the banner begins with one
        for line in stream:
            text = line.rstrip("\n")
            with lock:
                if _BANNER.match(text):
                    banner.append(text)
                    blank = False
                    continue
                if blank:
                    to.write("\n")
                blank = text == ""
                if blank:
                    continue
                if text.startswith("toyharness: "):
                    if text in said:
                        continue
                    said.add(text)
                to.write(line)
                to.flush()

    readers = [threading.Thread(target=forward, args=(proc.stdout, sys.stdout), daemon=True),
               threading.Thread(target=forward, args=(proc.stderr, sys.stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise
    for t in readers:
        t.join()
    if banner and out_dir.is_dir():
        (out_dir / "launcher.log").write_text("\n".join(banner) + "\n")
    if code == 0:
        return 0
    if said:                         # a process said why (bad input 2, a failed check 1)
        return code if code in (1, 2) else 1
    how = next((m.group(1) for m in map(_EXIT_STRING.search, banner) if m), f"exit {code}")
    checkpoint = out_dir / "checkpoint.gguf"
    resume = (f"resume from its last checkpoint: toyharness run --resume {out_dir} (on any number of devices)"
              if checkpoint.is_file() else "no checkpoint had been written (checkpoint_every)")
    print(f"toyharness: error: a process of the run ended: {how}; the others were stopped; {resume}",
          file=sys.stderr)
    return 1
