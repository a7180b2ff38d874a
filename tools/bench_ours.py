"""Our side of `toyharness bench` alone, for a machine without PyTorch: the same worker process,
bench config and step timing as `bench`, written in bench's JSON format with PyTorch's figures
left out (null) and the file saying so (`pytorch_side`). `toyharness bench` itself needs PyTorch;
prefer it wherever PyTorch installs.

    python tools/bench_ours.py OUT.json --machine "WHAT IT RAN ON" [RECIPE...] [--steps 5] [--warmup 1]
                               [--threads 2] [--backend cpu] [--size default] [--set KEY=VALUE ...]

The file also names the machine and the commit measured, as tools/benchmarks_page.py requires of
the files in benchmarks/.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
from pathlib import Path

from toyharness import bench
from toyharness.atomic import atomic_write
from toyharness.discovery import discover
from toyharness.engine import get_engine
from toyharness.engine.backend import blas_kernel, build_simd

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The checkout's commit, with "-dirty" where tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "toyharness", "native", "plugins"], cwd=ROOT)
    return head + ("-dirty" if dirty.returncode else "")


def ours(recipe: str, backend: str, threads: int, steps: int, warmup: int, sets: list[str]) -> dict:
    """One recipe's figures from bench's own worker: the median ms/step over `steps` timed steps."""
    proc, conn = bench._spawn(mp.get_context("spawn"), bench._ggml_worker, recipe, backend, threads, sets)
    try:
        info = bench._reply(conn, "start")
        bench._ask(conn, ("steps", warmup))
        timed = bench._ask(conn, ("steps", steps))
        done = bench._ask(conn, ("done", 0))
    finally:
        proc.join(30)
    ms = statistics.median(t for t, _ in timed)
    host = [h for _, h in timed if h is not None]
    item = "images" if "images" in info["batches"][0] else "tokens"
    out = {"ms_per_step": round(ms, 3), "torch_ms_per_step": None, "speedup": None,
           f"{item}_per_s": round(info["items"] / ms * 1e3, 1), "peak_rss_mb": round(done["peak_rss_mb"], 1),
           "matmul_gflops": None if not done["flops"] else round(done["flops"] / (ms / 1e3) / 1e9, 1),
           "host_overhead_pct": round(100 * max(0.0, statistics.median(host)) / ms, 2) if host else None,
           "config": bench._short_config(info["options"]), "timed_steps": len(timed),
           "fingerprint": info["fingerprint"], "precision": info["options"].get("precision", "fp32"),
           "step_ms": [round(t, 3) for t, _ in timed]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("recipes", nargs="*")
    ap.add_argument("--machine", required=True, help="what it ran on: CPU model, cores, VM or not")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--size", default="default", choices=sorted(bench.SIZES))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    args = ap.parse_args()
    known = list(discover())
    unknown = [n for n in args.recipes if n not in known]
    if unknown:
        print(f"bench_ours: unknown recipe(s) {', '.join(unknown)}; installed: {', '.join(known)}", file=sys.stderr)
        return 2
    engine = get_engine(args.backend, args.threads)
    names = args.recipes or [n for n in known if args.size == "default" or bench.fits_size(n, args.size)]
    ceiling = bench.matmul_ceiling(args.threads) if args.backend == "cpu" else None
    results = {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    for name in names:
        r = results[name] = ours(name, args.backend, args.threads, args.steps, args.warmup,
                                 bench.size_sets(name, args.size, args.sets))
        if ceiling and r["matmul_gflops"]:
            r["ceiling_pct"] = round(100 * r["matmul_gflops"] / ceiling, 1)
        print(f"{name:<11}{r['ms_per_step']:10.2f} ms/step  (steps {r['step_ms']})", flush=True)
    doc = {"machine": args.machine, "commit": commit(),
           "pytorch_side": "not measured: PyTorch was not installed on this machine (tools/bench_ours.py); "
                           "toyharness bench measures both sides",
           "backend": args.backend, "threads": args.threads, "size": args.size,
           "precision": ",".join(sorted({r["precision"] for r in results.values()})),
           "torch_modes": [], "fingerprint": engine.fingerprint(),
           "simd": build_simd() if args.backend == "cpu" else "n/a", "blas": blas_kernel() if args.backend == "cpu"
           else "n/a", "steps": args.steps, "warmup": args.warmup,
           "fp32_ceiling_gflops": None if ceiling is None else round(ceiling, 1),
           # other processes' load on the machine while it ran (1, 5, 15-minute averages), before and after
           "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
           "recipes": results}
    atomic_write(args.out, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
