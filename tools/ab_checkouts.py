"""ms per training step of one recipe in two checkouts, side by side: A/B for a change.

    git worktree add /tmp/before HEAD~1 && (cd /tmp/before && python native/build.py --out toyharness/_native)
    python tools/ab_checkouts.py gpt2 /tmp/before . [--rounds 10] [--threads 2]
    python tools/ab_checkouts.py gpt2 . . --set-a portable=true     # one setting A/B
    python tools/ab_checkouts.py gpt2 /tmp/before . \
        --set n_layer=6 --set d_model=384 --set n_head=6 --set t_seq=256 --set t_batch=8   # at nano
    python tools/ab_checkouts.py lora . . --set base=M --set-a chunked_loss=off --set-b chunked_loss=on

Each checkout trains the recipe's bench config in its own process (PYTHONPATH = the checkout,
so each loads its own toyharness and native libraries); the two take turns in rounds of 5
steps, alternating who goes first, so the machine's drift falls on both alike. Prints the
median step of each and their ratio (A / B > 1: B is faster), and the same over the rounds
taken while CPUs 0 and 1 sat far apart: a cache line's round trip between them, timed after
each round, above twice the run's shortest (a shared VM's slow minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from toyharness._ffi import lib

# Written out, not toyharness.bench.step_timer: checkout A may predate it.
WORKER = """
import json, sys, time
from toyharness.bench import realize_for_bench
from toyharness.runner import batch_for
pm, opts, data, engine, model = realize_for_bench(sys.argv[1], "cpu", int(sys.argv[2]), json.loads(sys.argv[3]))
batches = [batch_for(data, "train", i, opts) for i in range(8)]
done = 0
def step():
    global done
    row = pm.hook.hp(options=opts, step=done)
    t0 = time.perf_counter()
    pm.hook.step(model=model, batch=batches[done % 8], hp=row)
    done += 1
    return (time.perf_counter() - t0) * 1e3
for _ in range(3):
    step()
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps([step() for _ in range(int(line))]), flush=True)
"""


def spawn(checkout: Path, recipe: str, threads: int, extra_env: dict[str, str], sets: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(checkout.resolve()),
                                                                    os.environ.get("PYTHONPATH")])), **extra_env)
    probe = subprocess.run([sys.executable, "-P", "-c", "import toyharness; print(toyharness.__file__)"], env=env,
                           capture_output=True, text=True)
    if not probe.stdout.startswith(str(checkout.resolve())):
        raise SystemExit(f"{checkout}: python imports toyharness from {probe.stdout.strip() or probe.stderr}")
    # -P: the working directory must not come first on sys.path (it may be the other checkout)
    proc = subprocess.Popen([sys.executable, "-P", "-c", WORKER, recipe, str(threads), json.dumps(sets)],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"{checkout}: the worker did not start (is its native library built?)")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("a", type=Path, help="checkout A (e.g. before the change)")
    ap.add_argument("b", type=Path, help="checkout B")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--env-a", action="append", default=[], metavar="KEY=VALUE", help="set for A's process")
    ap.add_argument("--env-b", action="append", default=[], metavar="KEY=VALUE", help="set for B's process")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an option over the bench config, for both (e.g. the nano size's: see bench.SIZES)")
    ap.add_argument("--set-a", action="append", default=[], metavar="KEY=VALUE", help="an option for A alone")
    ap.add_argument("--set-b", action="append", default=[], metavar="KEY=VALUE", help="an option for B alone")
    ap.add_argument("--verbose", "-v", action="store_true", help="print each round's medians")
    args = ap.parse_args()
    envs = [dict(kv.split("=", 1) for kv in args.env_a), dict(kv.split("=", 1) for kv in args.env_b)]
    workers = [spawn(args.a, args.recipe, args.threads, envs[0], args.set + args.set_a),
               spawn(args.b, args.recipe, args.threads, envs[1], args.set + args.set_b)]
    rounds: list[list[list[float]]] = []
    trips: list[float] = []
    for r in range(args.rounds):
        steps: list[list[float]] = [[], []]
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            time.sleep(0.3)      # the other side's idle threads stop spinning first
            workers[side].stdin.write("5\n")
            workers[side].stdin.flush()
            steps[side] = json.loads(workers[side].stdout.readline())
        rounds.append(steps)
        trips.append(lib.th_cpu_round_trip_ns(0, 1, 20000))
        if args.verbose:
            print(f"round {r + 1}: A {statistics.median(steps[0]):.2f} ms  B {statistics.median(steps[1]):.2f} ms  "
                  f"CPU round trip {trips[-1]:.0f} ns", flush=True)
    for w in workers:
        w.stdin.close()
        w.wait()

    def report(label: str, chosen: list[list[list[float]]]) -> None:
        a = statistics.median(t for r in chosen for t in r[0])
        b = statistics.median(t for r in chosen for t in r[1])
        print(f"{args.recipe}, {args.threads} threads, {label}, {5 * len(chosen)} steps each: A {a:.2f} ms  "
              f"B {b:.2f} ms  A/B {a / b:.3f}")

    report("all rounds", rounds)
    if min(trips) > 0:       # -1: no two CPUs to pin threads to
        far = [r for r, ns in zip(rounds, trips) if ns > 2 * min(trips)]
        if far:
            report(f"{len(far)} rounds with the CPUs far apart", far)
        print(f"CPU 0-1 round trip after each round: {min(trips):.0f}-{max(trips):.0f} ns")


if __name__ == "__main__":
    main()
