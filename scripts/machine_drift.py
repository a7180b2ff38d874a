"""Watch whether this machine's speed moves, and which part of it: for when bench ratios jump.

    python scripts/machine_drift.py [--recipe gpt2] [--seconds 120] [--slow-ms 28]

Each round times one recipe's training step (bench config) at 2 threads and at 1 thread, a
64 MB copy and twenty 256 x 256 matmuls on the main thread (single-threaded: run it with
OPENBLAS_NUM_THREADS=1), and prints a line. At the end, the rounds whose 2-thread step is above
--slow-ms are set against the others. On the 2-core VM the slow rounds kept the 1-thread step,
the copy and the matmul: only the second thread's CPU had slowed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from toyharness.bench import realize_for_bench, step_timer
from toyharness.runner import batch_for


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
        rounds.append((two, one, copy, matmul))
        print(f"{time.strftime('%H:%M:%S')}  2 threads {two:6.2f} ms  1 thread {one:6.2f} ms  "
              f"copy 64 MB {copy:5.2f} ms  matmul {matmul:5.2f} ms", flush=True)
        time.sleep(1)
    for label, group in (("slow", [r for r in rounds if r[0] > args.slow_ms]),
                         ("calm", [r for r in rounds if r[0] <= args.slow_ms])):
        if group:
            means = [statistics.mean(col) for col in zip(*group)]
            print(f"{label}: {len(group)} rounds; mean 2 threads {means[0]:.2f}, 1 thread {means[1]:.2f}, "
                  f"copy {means[2]:.2f}, matmul {means[3]:.2f} ms")


if __name__ == "__main__":
    main()
