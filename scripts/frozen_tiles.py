"""The frozen products alone (native/frozen_matmul.c), side by side across builds.

    python scripts/frozen_tiles.py BASE.gguf NATIVE_DIR [NATIVE_DIR...] [--rows M] [--rounds R] [--threads T]

For each named tensor of BASE (default: SmolLM2's output head (token_embd, Q8_0, tied), a Q4_1 attention and
feed-forward matrix of layer 0), times y = x W^T and dx = dy W (one training graph with the
frozen weight, as tests/test_quant.py builds it) at M activation rows, in each build's own worker
process (TOYHARNESS_NATIVE_DIR), the builds taking turns round after round so that the machine's
drift falls on each alike. Prints each build's median ms per product pair and its ratio to the
first build's. Use it to compare tile sizes: build each variant into its own folder with
`python native/build.py --out DIR` and name the folders here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, time
import numpy as np
from toyharness.engine import GGUFFile, get_engine
path, names = sys.argv[1], sys.argv[2].split(",")
rows, threads, reps = (int(a) for a in sys.argv[3:6])
out = {}
f = GGUFFile(path)
for name in names:
    prog = get_engine("cpu", threads).program()
    w = prog.frozen_gguf(f, name)
    k = f.tensor(name).shape[-1]
    rng = np.random.default_rng(0)
    xp = prog.param("x", rng.standard_normal((rows, k), dtype=np.float32))
    y = xp.matmul_t(w)
    r = prog.constant("r", rng.standard_normal(tuple(y.shape), dtype=np.float32))
    trainer = prog.trainer(prog.scalar_loss((y * r).sum()), "bias_corrected")
    trainer.grads_only({})                       # the first compute swaps in the kernels
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        trainer.grads_only({})
        times.append((time.perf_counter() - t0) * 1e3)
    out[name] = sorted(times)[len(times) // 2]
print(json.dumps(out))
"""

SMOLLM2_TENSORS = "token_embd.weight,blk.0.attn_q.weight,blk.0.ffn_up.weight,blk.0.ffn_down.weight"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("builds", nargs="+", help="native library folders (python native/build.py --out DIR), each "
                                              "optionally followed by :VAR=VALUE settings for its worker")
    ap.add_argument("--tensors", default=SMOLLM2_TENSORS)
    ap.add_argument("--rows", type=int, default=1024, help="activation rows M (default 1024: t_seq 64 x 16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="timed products per round and build")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {b: [] for b in args.builds}
    for r in range(args.rounds):
        for build in args.builds if r % 2 == 0 else args.builds[::-1]:
            folder, *assigns = build.split(":")      # DIR[:VAR=VALUE...]: a build, and its environment
            env = {**os.environ, "TOYHARNESS_NATIVE_DIR": folder, **dict(a.split("=", 1) for a in assigns)}
            res = subprocess.run([sys.executable, "-c", WORKER, args.base, args.tensors, str(args.rows),
                                  str(args.threads), str(args.reps)], env=env, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return 1
            got[build].append(json.loads(res.stdout.splitlines()[-1]))
    first = args.builds[0]
    print(f"frozen products, forward + input gradient, M={args.rows}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.reps} reps, ms (median of round medians); load {os.getloadavg()}")
    for name in args.tensors.split(","):
        base = statistics.median(rnd[name] for rnd in got[first])
        cells = []
        for build in args.builds:
            ms = statistics.median(rnd[name] for rnd in got[build])
            cells.append(f"{build}: {ms:.1f} ({base / ms:.2f}x)")
        print(f"  {name}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
