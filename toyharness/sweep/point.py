"""One point, in a process of its own: a point that aborts inside ggml takes down only that
process. The driver starts it (`launch_point`) and reads its progress, one JSON line a step,
from its stdout; the point runs `runner.train` with the point's `--set` list, exactly what
`toyharness run RECIPE --set ...` calls, so its losses are a plain run's bits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ToyharnessError
from ..hookspecs import hookimpl
from ..runner import train
from .plan import DONE, FAILED
from .resume import checkpoint_step

# The folder that holds the toyharness package this process runs: a point imports the same one.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

# What a point's interpreter runs. Python puts the cwd first on sys.path ('' for -c); a folder
# there named like a package (the clone's own folder `toyharness`, beside the user's work) would
# shadow the real one, so the point drops it and finds toyharness where the driver found it.
_POINT_BOOTSTRAP = ("import sys; sys.path[:] = [p for p in sys.path if p != ''] + [{root!r}]; "
                    "from toyharness.sweep.point import point_main; sys.exit(point_main(sys.argv[1:]))")


def run_point(spec: dict[str, Any], observers: tuple = ()) -> dict:
    """Run one point into spec["out"], as `toyharness run` would: from its checkpoint where the
    folder holds one, from scratch otherwise; a finished folder is left as it is."""
    out = Path(spec["out"])
    tags = spec.get("tags")
    if (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    if checkpoint_step(out) is not None:
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


def point_main(argv: list[str]) -> int:
    """The point's process: run the point described by the JSON spec argv[0]."""
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
    where: dict[str, str] = field(default_factory=dict)   # Ray: node and the worker's folder; local cuda: gpu


def launch_point(spec: dict[str, Any], on_progress: Callable[[dict], None] | None = None,
                 procs: dict | None = None, env: dict[str, str] | None = None) -> Outcome:
    """Run one point in a process of its own and wait for it. `on_progress` gets its JSON
    lines ({"start", "of"}, {"step"}); `procs` (index -> Popen) lets the caller stop it; `env`
    adds to this process's environment for it (CUDA_VISIBLE_DEVICES: the GPU it runs on)."""
    cmd = [sys.executable, "-c", _POINT_BOOTSTRAP.format(root=_PACKAGE_ROOT), json.dumps(spec)]
    message, resumed_from = None, 0
    with tempfile.TemporaryFile() as err:
        # a session of its own: Ctrl-C reaches the driver, which stops it
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True, env={**os.environ, **env} if env else None)
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
