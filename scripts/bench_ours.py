"""Our side of `toyharness bench` alone, for A/B runs of environment settings on one machine: each
setting a fresh worker process (toyharness.bench's own), its ms/step (median of the steps) and GPU
memory as the driver counts it, printed one line a setting. No PyTorch: compare settings against
each other here, and against PyTorch with `toyharness bench`.

    python scripts/bench_ours.py RECIPE --backend cuda --set precision=bf16 --set ... \\
        [--env ""] [--env "TOYHARNESS_CUDA_DEQUANT=ggml"] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics

from toyharness.bench import _ask, _ggml_worker, _reply, _spawn


def run_setting(recipe: str, backend: str, sets: list[str], env: dict[str, str], steps: int, warmup: int) -> str:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)                           # the spawned worker inherits it
    try:
        proc, conn = _spawn(mp.get_context("spawn"), _ggml_worker, recipe, backend, 2, sets)
        _reply(conn, "start")
        _ask(conn, ("steps", warmup))
        ms = [m for m, _ in _ask(conn, ("steps", steps))]
        done = _ask(conn, ("done", 0))
        proc.join(30)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    memory = f"{done['device_mb'] / 1024:.2f} GiB" if done.get("device_mb") is not None else "-"
    copies = (f" (bf16 copies {done['bf16_copies_mb'] / 1024:.2f}, peak {done['bf16_copies_peak_mb'] / 1024:.2f})"
              if done.get("bf16_copies_mb") is not None else "")
    return f"{statistics.median(ms):8.2f} ms/step (min {min(ms):.2f}, max {max(ms):.2f})  GPU {memory}{copies}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--env", action="append", default=None,
                    help="space-separated KEY=VALUE settings of one run (repeat for each run; '' for none)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    for setting in args.env or [""]:
        env = dict(kv.split("=", 1) for kv in setting.split())
        line = run_setting(args.recipe, args.backend, args.sets, env, args.steps, args.warmup)
        print(f"{setting or '(as is)':48s} {line}", flush=True)


if __name__ == "__main__":
    main()
