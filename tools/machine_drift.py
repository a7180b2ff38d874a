"""Watch whether this machine's speed moves, and which part of it: for when bench ratios jump.

    python tools/machine_drift.py [--recipe gpt2] [--seconds 120] [--slow-ms 28]

Each round times one recipe's training step (bench config) at 2 threads and at 1 thread, a
64 MB copy and twenty 256 x 256 matmuls on the main thread (single-threaded: run it with
OPENBLAS_NUM_THREADS=1), and the same matmuls on a thread pinned to CPU 1, then on CPUs 0 and 1
at once, one pinned thread each. From those two it prints how many cores' worth of matmul the
two CPUs give together ("cores": 2.0 when they are two free cores, about 1 when they share
one). Last, the round trip of a cache line between CPUs 0 and 1 ("trip": how far apart they
sit; native/shim.c, th_cpu_round_trip_ns). At the end, the rounds whose 2-thread step is
above --slow-ms are set against the others. On the 2-core VM the slow rounds kept the 1-thread
step, the copy, the matmul and the cores (about 2.0): what changed was the trip, from about
90 ns to about 400 (the host had put the two CPUs far apart).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

from toyharness._ffi import lib
from toyharness.bench import realize_for_bench, step_timer
from toyharness.runner import batch_for


def matmuls_on(cpus: list[int], a: np.ndarray, n: int = 20) -> float:
    """ms for n matmuls a @ a on each of `cpus` at once, one pinned thread each (numpy lets go of
    the GIL in a matmul)."""
    start = threading.Barrier(len(cpus) + 1)

    def work(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})     # Linux: the calling thread only
        start.wait()
        for _ in range(n):
            a.dot(a)

    threads = [threading.Thread(target=work, args=(cpu,)) for cpu in cpus]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="gpt2")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--slow-ms", type=float, default=28.0, help="a 2-thread step above this is a slow round")
    args = ap.parse_args()
    pm, opts, data, engine, model = realize_for_bench(args.recipe, "cpu", 2, [])
    step = step_timer(pm, opts, model, [batch_for(data, "train", i, opts) for i in range(8)])

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    src = np.ones(16 << 20, np.float32)
    dst = np.empty_like(src)
    a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
    for _ in range(3):
        step()
    rounds = []
    end = time.time() + args.seconds
    while time.time() < end:
        engine.set_threads(2)
        two = statistics.median(step() for _ in range(5))
        engine.set_threads(1)
        one = statistics.median(step() for _ in range(3))
        engine.set_threads(2)
        copy = statistics.median(timed(lambda: np.copyto(dst, src)) for _ in range(3))
        matmul = statistics.median(timed(lambda: [a.dot(a) for _ in range(20)]) for _ in range(3))
        alone = statistics.median(matmuls_on([1], a) for _ in range(3))
        both = statistics.median(matmuls_on([0, 1], a) for _ in range(3))
        cores = 2 * alone / both
        trip = lib.th_cpu_round_trip_ns(0, 1, 20000)
        rounds.append((two, one, copy, matmul, alone, both, cores, trip))
        print(f"{time.strftime('%H:%M:%S')}  2 threads {two:6.2f} ms  1 thread {one:6.2f} ms  "
              f"copy 64 MB {copy:5.2f} ms  matmul {matmul:5.2f} ms  on CPU 1 {alone:5.2f} ms  on both {both:5.2f} ms  "
              f"cores {cores:4.2f}  trip {trip:4.0f} ns", flush=True)
        time.sleep(1)
    for label, group in (("slow", [r for r in rounds if r[0] > args.slow_ms]),
                         ("calm", [r for r in rounds if r[0] <= args.slow_ms])):
        if group:
            means = [statistics.mean(col) for col in zip(*group)]
            print(f"{label}: {len(group)} rounds; mean 2 threads {means[0]:.2f}, 1 thread {means[1]:.2f}, "
                  f"copy {means[2]:.2f}, matmul {means[3]:.2f}, on CPU 1 {means[4]:.2f}, on both {means[5]:.2f} ms; "
                  f"cores {means[6]:.2f}, trip {means[7]:.0f} ns")


if __name__ == "__main__":
    main()
