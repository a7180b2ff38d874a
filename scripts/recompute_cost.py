"""What recompute_blocks saves and costs (issue 35): for a recipe and options, runs with and without
it (alternating, each in a child process of its own), and reports the memory plan, the measured
peak RSS growth over the process's baseline, the median ms/step and whether the losses are the
same bits.

    python scripts/recompute_cost.py gpt2 --set n_layer=8 [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
from toyharness.runner import plan_run, train
recipe, sets, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
plan = plan_run(recipe, sets=sets)
train(recipe, steps=1, sets=[s for s in sets if s.startswith("base=")] + ["t_batch=1", "t_seq=8"],
      out=out + "-warmup", progress=False)
base = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
train(recipe, steps=steps, sets=sets + [f"eval_every={steps}", "eval_batches=1", f"checkpoint_every={steps}"],
      out=out, progress=False)
metrics = [json.loads(line) for line in open(out + "/metrics.jsonl")]
# VmHWM, this process's own peak (ru_maxrss keeps the parent's RSS at fork across the exec)
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps({"plan": plan.total, "compute": plan.rows["compute"], "growth": peak - base,
                  "ms": [m["ms"] for m in metrics[1:]], "losses": [m["loss_hex"] for m in metrics]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    got: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            with tempfile.TemporaryDirectory() as d:
                sets = args.sets + [f"recompute_blocks={str(on).lower()}"]
                r = subprocess.run([sys.executable, "-c", CHILD, args.recipe, json.dumps(sets), str(args.steps),
                                    d + "/run"], capture_output=True, text=True, cwd=d)
                if r.returncode != 0:
                    print(r.stderr[-2000:], file=sys.stderr)
                    return 1
                got[on].append(json.loads(r.stdout.strip().splitlines()[-1]))
    ms = {on: statistics.median(m for g in got[on] for m in g["ms"]) for on in got}
    for on in (False, True):
        g = got[on][0]
        print(f"recompute_blocks={str(on).lower():<5}  plan {g['plan'] / 2**20:8.1f} MiB (training graph "
              f"{g['compute'] / 2**20:7.1f} MiB)  RSS growth {g['growth'] / 2**20:8.1f} MiB  {ms[on]:8.1f} ms/step")
    same = all(g["losses"] == got[False][0]["losses"] for on in got for g in got[on])
    print(f"losses the same bits: {same}; time x{ms[True] / ms[False]:.2f}; "
          f"plan -{(got[False][0]['plan'] - got[True][0]['plan']) / 2**20:.1f} MiB")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
