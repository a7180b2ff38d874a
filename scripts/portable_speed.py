"""The portable mode's cost on each recipe's golden config (issue 23): wall time of the whole
golden run (16 steps, realize included) and the median step, fast path vs portable mode,
measured side by side in one process, the two modes alternating in each round.

    python scripts/portable_speed.py [RECIPE...] [--rounds 3] [--threads N]

On a loaded machine ggml's spinning barriers stall whole steps (more threads than free cores):
compare with --threads 1 there.
"""

from __future__ import annotations

import argparse
import statistics
import time

from toyharness.goldens import GOLDEN_STEPS, golden_sets_for
from toyharness.hookspecs import hookimpl
from toyharness.plugins import discover
from toyharness.runner import train


class StepTimes:
    def __init__(self):
        self.ms: list[float] = []

    @hookimpl
    def step_end(self, run, step, loss, lr, ms, tokens_per_s):
        self.ms.append(ms)


def timed(recipe: str, portable: bool, threads: int | None) -> tuple[float, float]:
    steps = StepTimes()
    sets = golden_sets_for(recipe) + [f"portable={str(portable).lower()}"]
    t0 = time.perf_counter()
    train(recipe, steps=GOLDEN_STEPS, threads=threads, sets=sets, observers=(steps,), progress=False,
          write_files=False)
    return time.perf_counter() - t0, statistics.median(steps.ms[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="cpu threads (default: free cores)")
    args = ap.parse_args()
    names = args.recipes or ["gpt2", "llama", "lora", "vit_tiny", "warm_start"] + \
        [n for n in discover() if n == "bigram"]
    runs: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for name in names:
            for portable in ((False, True) if r % 2 == 0 else (True, False)):
                runs.setdefault((name, portable), []).append(timed(name, portable, args.threads))
    print(f"medians of {args.rounds} rounds; golden config, {GOLDEN_STEPS} steps; threads {args.threads or 'default'}")
    print(f"{'recipe':<11}{'fast run s':>11}{'portable s':>11}{'ratio':>7}"
          f"{'fast ms/step':>14}{'portable':>10}{'ratio':>7}")
    for name in names:
        f_run, f_step = (statistics.median(x) for x in zip(*runs[(name, False)]))
        p_run, p_step = (statistics.median(x) for x in zip(*runs[(name, True)]))
        print(f"{name:<11}{f_run:11.2f}{p_run:11.2f}{p_run / f_run:6.1f}x"
              f"{f_step:14.2f}{p_step:10.2f}{p_step / f_step:6.1f}x")


if __name__ == "__main__":
    main()
