"""Where a sweep's points run: a pool of local workers (default), or one Ray task per point
(`--ray`), whose small files come back to the driver through Ray. Either way each point is a
process of its own (toyharness/sweep/point.py). On cuda each point sees one GPU as its only
device (CUDA_VISIBLE_DEVICES): the local pool hands each worker its own, Ray the GPU it grants."""

from __future__ import annotations

import os
import queue
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..atomic import atomic_write
from ..device_memory import nvidia_gpu_count
from ..engine.backend import default_threads
from ..errors import InputError
from .plan import FAILED
from .point import Outcome, launch_point
from .report import Tracker

# What a Ray worker always sends back; model and checkpoint files only with --keep-models.
SMALL_FILES = ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "confusion.png")


def _cores() -> int:
    return default_threads()


def visible_gpus() -> list[str]:
    """The GPUs a cuda sweep places its points on: CUDA_VISIBLE_DEVICES's entries where it is set
    (a point gets one of them as its own), else every GPU the driver lists (0, 1, ...)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [x.strip() for x in listed.split(",") if x.strip() and x.strip() != "-1"]
    return [str(i) for i in range(nvidia_gpu_count())]


class LocalPool:
    """`workers` local processes at a time, each point with `threads` threads. On cuda, one
    worker per GPU by default, each point with its worker's GPU as its only device; more workers
    than GPUs share them in turn."""

    name = "local"

    def __init__(self, workers: int | None = None, threads: int | None = None, backend: str = "cpu"):
        cores = _cores()
        if (threads is not None and threads < 1) or (workers is not None and workers < 1):
            raise InputError("--workers and --threads must be >= 1")
        self.gpus = visible_gpus() if backend == "cuda" else []
        if backend != "cpu":     # a point per GPU at a time (vulkan: its one device) unless asked
            workers = workers or max(1, len(self.gpus))
        self.threads = threads or max(1, cores // (workers or cores))
        self.workers = workers or max(1, cores // self.threads)
        if backend == "cpu" and self.workers * self.threads > cores:
            raise InputError(f"--workers {self.workers} x --threads {self.threads} = "
                             f"{self.workers * self.threads} threads is more than this machine's {cores} cores "
                             "(ggml's spinning threads would slow every point many times over)")
        self._procs: dict[int, subprocess.Popen] = {}
        self._stopping = False
        self._free_gpus: queue.SimpleQueue[str] = queue.SimpleQueue()   # a worker's GPU while it runs no point
        for i in range(self.workers if self.gpus else 0):
            self._free_gpus.put(self.gpus[i % len(self.gpus)])

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "workers": self.workers, "threads": self.threads,
                **({"gpus": self.gpus} if self.gpus else {})}

    def run(self, specs: list[dict], tracker: Tracker) -> None:
        def one(spec):
            if self._stopping:
                return
            gpu = self._free_gpus.get() if self.gpus else None
            try:
                tracker.started(spec["index"])
                outcome = launch_point(spec, lambda msg: tracker.progress(spec["index"], msg), self._procs,
                                       env=None if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})
            finally:
                if gpu is not None:
                    self._free_gpus.put(gpu)
            if gpu is not None:
                outcome.where = {**outcome.where, "gpu": gpu}
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
    where = {"node": socket.gethostname(), "worker_dir": str(out)}
    if spec.get("backend") == "cuda" and os.environ.get("CUDA_VISIBLE_DEVICES"):
        where["gpu"] = os.environ["CUDA_VISIBLE_DEVICES"]    # Ray's grant: the point's process sees it alone
    return {"status": outcome.status, "message": outcome.message, "resumed_from": outcome.resumed_from,
            "files": files, "where": where}


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
