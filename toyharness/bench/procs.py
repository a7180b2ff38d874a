"""The worker processes of `toyharness bench`: each side runs in a process of its own (its own
peak RSS, its threads never sharing a process with the other side's), driven over a pipe.
Nothing here imports either side, so the PyTorch side loads only in its own workers."""

from __future__ import annotations

import importlib
import os
import resource
import sys
from pathlib import Path
from typing import Any, Callable


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB: Linux's VmHWM, which starts afresh when a worker's
    process image is loaded (getrusage's ru_maxrss keeps the parent's peak across the fork and exec
    that start a worker: a parent that imported PyTorch would lend every worker its 200 MB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024.0 if sys.platform != "darwin" else 2.0**20)


def _guarded(conn, target: Callable | str, env: dict[str, str], *args) -> None:
    """Run a worker; an exception goes back to the parent instead of a silent hang. A target named
    "module:function" is imported here, after `env` is set (PyTorch reads OMP_NUM_THREADS once, when
    it is imported)."""
    try:
        os.environ.update(env)
        if isinstance(target, str):
            module, name = target.split(":")
            target = getattr(importlib.import_module(module), name)
        target(conn, *args)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
        conn.send(exc)


def _spawn(ctx, target: Callable | str, *args, env: dict[str, str] | None = None):
    """A worker process running `target(conn, *args)` (a function, or "module:function" imported
    in the worker); returns the process and the parent's end of its pipe."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_guarded, args=(child, target, dict(env or {}), *args), daemon=True)
    proc.start()
    return proc, parent


def _reply(conn, what: str) -> Any:
    if not conn.poll(900):
        raise TimeoutError(f"bench worker gave no answer to {what}")
    out = conn.recv()
    if isinstance(out, BaseException):
        raise out
    return out


def _ask(conn, what) -> Any:
    conn.send(what)
    return _reply(conn, str(what))
