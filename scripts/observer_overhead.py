"""What observers cost the step loop (issue 37): the same run with no observer, with each built-in
one, and with a deliberately slow observer (50 ms a step), in alternating rounds in one process;
the loop's time is summary.json's wall_s (steps and evaluations, not the wait at the end).

    python scripts/observer_overhead.py [--recipe gpt2] [--steps 200] [--rounds 3] [--set k=v ...]

mlflow needs MLFLOW_TRACKING_URI (this script points it at a file store in a temporary folder when
unset); a configuration whose observer is not installed is left out, and said so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from toyharness.hookspecs import hookimpl
from toyharness.observers import ObserverBus, observer_manager
from toyharness.runner import train


class Sleepy:
    @hookimpl
    def step_end(self) -> None:
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="gpt2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="observer-overhead-"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", (tmp / "mlruns").as_uri())
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    configs = {"none": None, "tensorboard": "tensorboard", "mlflow": "mlflow",
               "tensorboard,mlflow": "tensorboard,mlflow"}
    for name in ("tensorboard", "mlflow"):
        try:
            __import__(name)
        except ImportError:
            print(f"{name} is not installed: its configurations are left out", file=sys.stderr)
            configs = {k: v for k, v in configs.items() if v is None or name not in v}
    times: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for label, log in configs.items():
            s = train(args.recipe, steps=args.steps, sets=args.sets, out=str(tmp / f"{label}-{r}"), progress=False,
                      log=log)
            times[label].append(s["wall_s"])
    base = statistics.median(times["none"])
    print(f"{args.recipe}, {args.steps} steps, sets {args.sets}, medians of {args.rounds} rounds (loop wall_s):")
    for label, ts in times.items():
        m = statistics.median(ts)
        print(f"  {label:<20} {m:8.3f} s   {m / base:5.3f}x  (rounds: {', '.join(f'{t:.3f}' for t in ts)})")
    # the queue's own cost per event, with an observer that does nothing
    class Nothing:
        @hookimpl
        def step_end(self) -> None:
            pass

    bus = ObserverBus([("nothing", observer_manager("nothing", Nothing()))])
    n = 100_000
    t0 = time.perf_counter()
    for i in range(n):
        bus.emit("step_end", run=None, step=i, loss=0.0, lr=0.0, ms=0.0, tokens_per_s=0.0)
    emit_us = (time.perf_counter() - t0) / n * 1e6
    bus.close()
    print(f"  emit(): {emit_us:.2f} us per event on the loop's side ({n} events)")
    # a slow observer: the loop does not wait for it
    t0 = time.perf_counter()
    bus_sleepy = ObserverBus([("sleepy", observer_manager("sleepy", Sleepy()))], report=lambda line: print("  " + line))
    steps = 40
    for i in range(steps):
        bus_sleepy.emit("step_end", run=None, step=i, loss=0.0, lr=0.0, ms=0.0, tokens_per_s=0.0)
    loop = time.perf_counter() - t0
    bus_sleepy.close()
    print(f"  a 50 ms/step observer: {steps} events queued in {loop * 1000:.2f} ms; the end waited "
          f"{time.perf_counter() - t0 - loop:.2f} s for it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
