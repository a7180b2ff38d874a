"""Timing a recipe's training steps: ours always, PyTorch's twin beside them where there is one.

Each side runs in its own worker process (toyharness/bench/procs.py). With a PyTorch side the
parent drives them in alternating rounds, toyharness then PyTorch, then PyTorch then toyharness, so
drift of the machine (clock, other load) falls on both sides alike; both train the same model from
the same initial weights on the same batches (the recipe's bench config, toyharness/bench/config.py),
PyTorch's the recipe's twin (toyharness/bench/torch_side.py) with torch.optim.AdamW at the same
thread count. Without one, ours runs alone, in the same rounds.

Figures per recipe: median ms/step over the timed steps, items/s (tokens, or images where the
batches hold images), peak RSS of each worker, the step's matrix-product GFLOP/s (counted from the
ggml graph: MUL_MAT and OUT_PROD) against the FP32 matmul ceiling measured once with a 2048^3 sgemm
at the same thread count, and the host overhead: each timed step minus its ggml graph compute
(timed inside the step), median over the steps, as a share of the median step. Each round's median
per side is kept too; where a side's rounds differ by more than DRIFT, the machine's speed moved
during the recipe (a shared VM's slow minutes) and `bench` says so. On cpu it also keeps the round
trip of a cache line between the first two CPUs before and after the recipe's rounds
(cpu_round_trip_ns): on a 2-core VM it rises from about 90 to about 400 ns in the minutes when the
host puts the two CPUs far apart, and threads that share data slow down then.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from ..device_memory import PeakDeviceMemory
from .config import N_BATCHES, TORCH_MODES, realize_for_bench, step_timer
from .procs import _ask, _reply, _spawn, peak_rss_mb

# Pause before each block of steps: OpenMP threads of the side that just ran spin-wait for a
# while after their last parallel region; on 2 cores they would steal the other side's time.
SETTLE_S = 0.3
# Round medians of one side further apart than this, and `bench` says the machine's speed moved.
DRIFT = 0.2
TORCH_WORKER = "toyharness.bench.torch_side:torch_worker"    # imported in its own process only


def cpu_round_trip_ns() -> float | None:
    """ns for a cache line's round trip between the first two CPUs this process may use
    (native/shim.c, th_cpu_round_trip_ns); None with one CPU, or where threads cannot be pinned."""
    from .._ffi import lib

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return None
    if len(cpus) < 2:
        return None
    ns = lib.th_cpu_round_trip_ns(cpus[0], cpus[1], 20000)
    return round(ns, 1) if ns > 0 else None


# --- the toyharness side --------------------------------------------------------------------------
def _ggml_worker(conn, recipe: str, backend: str, threads: int, sets: list[str]) -> None:
    from .._ffi import lib
    from ..runner import batch_for, items_per_batch

    pm, opts, data, engine, model = realize_for_bench(recipe, backend, threads, sets)
    trainer = getattr(model, "trainer", None)
    batches = [batch_for(data, "train", i, opts) for i in range(N_BATCHES)]
    if trainer is not None:      # trainable only: frozen weights are the twin's to load
        params = {n: trainer.prog.read(t) for n, t in trainer.prog.params.items()}
    else:
        params = model.params() if hasattr(model, "params") else {}
    conn.send({"items": items_per_batch(data, opts), "batches": batches, "params": params,
               "fingerprint": engine.fingerprint(), "options": opts})
    step = step_timer(pm, opts, model, batches)
    device = PeakDeviceMemory() if backend == "cuda" else None

    def timed_step() -> tuple[float, float | None]:
        """One step's ms, and the ms of it spent outside the ggml graph compute (None without a
        ggml trainer)."""
        ms = step()
        return ms, (ms - trainer.prog.last_compute_s * 1e3 if trainer is not None else None)

    while True:
        cmd, n = conn.recv()
        if cmd == "steps":
            times = [timed_step() for _ in range(n)]
            if device is not None:
                device.sample()
            conn.send(times)
        else:
            # Counted after the steps: the first compute swaps in the cpu kernels, and the
            # centring products then no longer multiply.
            flops = None
            if trainer is not None:
                g = trainer.gb_opt
                nodes = (lib.ggml_graph_node(g, i) for i in range(lib.ggml_graph_n_nodes(g)))
                flops = sum(lib.th_node_matmul_flops(node) for node in nodes)
            done = {"peak_rss_mb": peak_rss_mb(), "flops": flops}
            if device is not None:
                done["device_mb"] = device.peak_mb
                if opts.precision == "bf16":     # of which the bf16 copies' memory (th-precision.cu)
                    done["bf16_copies_mb"] = lib.th_cuda_bf16_copy_bytes() / 2**20
                    done["bf16_copies_peak_mb"] = lib.th_cuda_bf16_copy_peak_bytes() / 2**20
            conn.send(done)
            return


def _ceiling_worker(conn, threads: int) -> None:
    """Best GFLOP/s of a 2048^3 FP32 sgemm (OpenBLAS, `threads` threads)."""
    from .._ffi import blas

    if blas is None:
        conn.send(None)
        return
    n = 2048
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = np.random.default_rng(1).random((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    blas.lib.scipy_openblas_set_num_threads(threads)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        blas.sgemm(101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, b.ctypes.data, n, 0.0, c.ctypes.data, n)
        best = min(best, time.perf_counter() - t0)
    conn.send(2 * n**3 / best / 1e9)


def matmul_ceiling(threads: int) -> float | None:
    ctx = mp.get_context("spawn")
    proc, conn = _spawn(ctx, _ceiling_worker, threads)
    try:
        return _reply(conn, "ceiling")
    finally:
        proc.join(30)


# --- the driver ----------------------------------------------------------------------------------
@dataclass
class Result:
    """One recipe's figures; the torch_* ones None where PyTorch's side did not run (`extra`'s
    "torch_absent" says why)."""

    recipe: str
    ms_per_step: float
    torch_ms_per_step: float | None
    items_per_step: int
    item: str
    peak_rss_mb: float
    torch_peak_rss_mb: float | None
    gflops: float | None
    host_overhead_pct: float | None
    config: dict
    extra: dict = field(default_factory=dict)

    def drift(self) -> dict[str, tuple[float, float]]:
        """Each side's slowest and fastest round median, where they differ by more than
        DRIFT (the machine's speed moved during this recipe's rounds)."""
        rounds = self.extra.get("round_medians_ms", {})
        return {side: (min(v), max(v)) for side, v in rounds.items() if v and max(v) > (1 + DRIFT) * min(v)}

    @property
    def speedup(self) -> float | None:
        return None if self.torch_ms_per_step is None else self.torch_ms_per_step / self.ms_per_step

    @property
    def items_per_s(self) -> float:
        return self.items_per_step / self.ms_per_step * 1e3

    def to_json(self, ceiling: float | None) -> dict:
        out = {"ms_per_step": round(self.ms_per_step, 3), "item": self.item,
               f"{self.item}_per_s": round(self.items_per_s, 1), "peak_rss_mb": round(self.peak_rss_mb, 1)}
        if self.torch_ms_per_step is not None:
            out |= {"torch_ms_per_step": round(self.torch_ms_per_step, 3), "speedup": round(self.speedup, 3),
                    f"torch_{self.item}_per_s": round(self.items_per_step / self.torch_ms_per_step * 1e3, 1),
                    "torch_peak_rss_mb": round(self.torch_peak_rss_mb, 1)}
        out |= {"matmul_gflops": None if self.gflops is None else round(self.gflops, 1),
                "host_overhead_pct": None if self.host_overhead_pct is None else round(self.host_overhead_pct, 2),
                "config": self.config, **self.extra}
        if ceiling and self.gflops:
            out["ceiling_pct"] = round(100 * self.gflops / ceiling, 1)
        return out


def bench_recipe(recipe: str, backend: str = "cpu", threads: int = 2, steps: int = 20, warmup: int = 3,
                 round_steps: int = 5, torch_device: str | None = None, sets: list[str] | None = None,
                 torch_modes: tuple[str, ...] | None = None, torch_absent: str | None = None) -> Result:
    """One recipe's steps timed: ours, and beside them (in alternating rounds) one PyTorch worker per
    mode of `torch_modes` (default the precision's TORCH_MODES; the first the one `speedup` compares
    with) running the recipe's twin; `torch_absent`: why PyTorch's side does not run (ours then runs
    alone), kept in the result."""
    ctx = mp.get_context("spawn")
    gproc, g = _spawn(ctx, _ggml_worker, recipe, backend, threads, list(sets or []))
    procs = []
    try:
        info = _reply(g, "start")
        modes = () if torch_absent else tuple(torch_modes or TORCH_MODES[info["options"].precision])
        device = torch_device or ("cuda" if backend == "cuda" else "cpu")
        payload = {k: info[k] for k in ("params", "batches")}
        sides = [g]
        for mode in modes:
            proc, conn = _spawn(ctx, TORCH_WORKER, recipe, info["options"], device, threads, payload, mode,
                                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))})
            procs.append(proc)
            sides.append(conn)
        try:
            tinfo = [_reply(t, "start") for t in sides[1:]]
            trips = [cpu_round_trip_ns()] if backend == "cpu" and threads > 1 else []
            for conn in sides:
                _ask(conn, ("steps", warmup))
            sinks: list[list] = [[] for _ in sides]
            rounds = max(2, -(-steps // round_steps))
            for r in range(rounds):
                order = list(range(len(sides)))
                for i in (order if r % 2 == 0 else order[::-1]):
                    time.sleep(SETTLE_S)
                    sinks[i].append(_ask(sides[i], ("steps", round_steps)))
            if trips:
                trips.append(cpu_round_trip_ns())
            timed, theirs = sinks[0], sinks[1:]
            names = ["pytorch"] + [f"pytorch_{mode}" for mode in modes[1:]]
            by_round = {"toyharness": [statistics.median(ms for ms, _ in rnd) for rnd in timed],
                        **{name: [statistics.median(rnd) for rnd in t] for name, t in zip(names, theirs)}}
            timed = [x for rnd in timed for x in rnd]
            theirs = [[x for rnd in t for x in rnd] for t in theirs]
            mine = _ask(g, ("done", 0))
            others = [_ask(t, ("done", 0)) for t in sides[1:]]
        finally:
            for proc in procs:
                proc.join(30)
    finally:
        gproc.join(30)
    ours = [ms for ms, _ in timed]
    ms = statistics.median(ours)
    host = [h for _, h in timed if h is not None]
    overhead = 100 * max(0.0, statistics.median(host)) / ms if host else None
    item = "images" if "images" in info["batches"][0] else "tokens"
    gflops = mine["flops"] / (ms / 1e3) / 1e9 if mine["flops"] else None
    options = info["options"].to_dict()
    extra = {"timed_steps": len(ours), "fingerprint": info["fingerprint"],
             "precision": options.get("precision", "fp32"),
             "round_medians_ms": {side: [round(x, 3) for x in v] for side, v in by_round.items()}}
    if torch_absent:
        extra["torch_absent"] = torch_absent
    else:
        extra |= {"torch_optimizer": tinfo[0]["optimizer"], "torch_version": tinfo[0]["torch"], "torch_mode": modes[0]}
    for mode, t in zip(modes[1:], theirs[1:]):     # bf16: PyTorch eager beside torch.compile
        extra[f"torch_{mode}_ms_per_step"] = round(statistics.median(t), 3)
        extra[f"speedup_vs_torch_{mode}"] = round(statistics.median(t) / ms, 3)
    if trips and None not in trips:
        extra["cpu_round_trip_ns"] = trips
    if others and others[0].get("device_peak_mb") is not None:
        extra["torch_device_peak_mb"] = round(others[0]["device_peak_mb"], 1)   # its allocator's peak
    # each process's memory on the GPU as the driver counts it (toyharness/device_memory.py)
    if mine.get("device_mb") is not None:
        extra["device_mb"] = round(mine["device_mb"], 1)
    for key in ("bf16_copies_mb", "bf16_copies_peak_mb"):
        if mine.get(key) is not None:
            extra[key] = round(mine[key], 1)
    for mode, other in zip(modes, others):
        if other.get("device_mb") is not None:
            extra["torch_device_mb" if mode == modes[0] else f"torch_{mode}_device_mb"] = round(other["device_mb"], 1)
    return Result(recipe, ms, statistics.median(theirs[0]) if theirs else None, info["items"], item,
                  mine["peak_rss_mb"], others[0]["peak_rss_mb"] if others else None, gflops, overhead,
                  short_config(options), extra)


def short_config(options: dict) -> dict:
    """The options bench.json keeps: every one, a file named by its basename (a cache path says
    nothing of another machine's)."""
    return {k: os.path.basename(v) if isinstance(v, str) and v and os.path.isfile(v) else v
            for k, v in options.items()}
