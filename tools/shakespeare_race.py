#!/usr/bin/env python3
"""The shakespeare-char race's table: `python3 tools/shakespeare_race.py OUT [--target 1.47]`.

Reads what tools/shakespeare_race.sh leaves in OUT: for each seed S, `ours-S/` (a toyharness run
folder: metrics.jsonl rows with `eval_loss` and `wall_s`, summary.json), `torch-S.jsonl`
(tools/nanogpt_shakespeare_torch.py --log) and `process-S.txt` (each side's whole command in
seconds, start-up, graph building and compiling included). Prints per seed and side the final val
loss, the loop's wall seconds, the whole process's seconds and the loop's seconds to the first val
loss <= target; then each side's mean over the seeds (time to target: over the seeds that reach it).
Standard library only: it runs beside either side's Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ours(run: Path, target: float) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_loss" in r]
    if not evals:
        raise ValueError(f"{run}/metrics.jsonl: no eval_loss row")
    if any("wall_s" not in r for r in evals):
        raise ValueError(f"{run}/metrics.jsonl: eval rows without wall_s (a toyharness older than the race)")
    summary = json.loads((run / "summary.json").read_text())
    hit = next((r["wall_s"] for r in evals if r["eval_loss"] <= target), None)
    return {"final": evals[-1]["eval_loss"], "best": min(r["eval_loss"] for r in evals), "wall": summary["wall_s"],
            "to_target": hit, "steps": len(rows)}


def theirs(log: Path, target: float) -> dict:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "val_loss" in r]
    end = next((r for r in rows if r.get("end")), None)
    if not evals or end is None:
        raise ValueError(f"{log}: no eval rows or no end row (did the torch run finish?)")
    hit = next((r["wall_s"] for r in evals if r["val_loss"] <= target), None)
    return {"final": evals[-1]["val_loss"], "best": min(r["val_loss"] for r in evals), "wall": end["wall_s"],
            "to_target": hit, "steps": end["steps"]}


def process_seconds(out: Path, seed: str) -> dict[str, float]:
    path = out / f"process-{seed}.txt"
    if not path.is_file():
        return {}
    return {side: float(s) for side, s in (line.split() for line in path.read_text().splitlines() if line.strip())}


def collect(out: Path, target: float) -> list[dict]:
    seeds = sorted({p.name.split("-", 1)[1] for p in out.glob("ours-*") if p.is_dir()}
                   | {p.stem.split("-", 1)[1] for p in out.glob("torch-*.jsonl")}, key=lambda s: (len(s), s))
    rows = []
    for seed in seeds:
        proc = process_seconds(out, seed)
        for side, read, path in (("toyharness", ours, out / f"ours-{seed}"),
                                 ("torch", theirs, out / f"torch-{seed}.jsonl")):
            if path.exists():
                rows.append({"seed": seed, "side": side, **read(path, target), "process": proc.get(side)})
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def table(rows: list[dict], target: float) -> str:
    to_target = f"to<={target} s"
    head = (f"{'seed':>8} {'side':<11} {'steps':>6} {'final val':>10} {'best val':>9} {'loop s':>9} {'process s':>10} "
            f"{to_target:>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['seed']:>8} {r['side']:<11} {r['steps']:>6} {r['final']:>10.4f} {r['best']:>9.4f} "
                     f"{r['wall']:>9.1f} "
                     f"{_fmt(r['process'], '10.1f'):>10} {_fmt(r['to_target'], '11.1f'):>11}")
    lines.append("-" * len(head))
    for side in ("toyharness", "torch"):
        mine = [r for r in rows if r["side"] == side]
        if not mine:
            continue
        hits = [r["to_target"] for r in mine if r["to_target"] is not None]
        procs = [r["process"] for r in mine if r["process"] is not None]
        lines.append(f"{'mean':>8} {side:<11} {'':>6} {_mean([r['final'] for r in mine]):>10.4f} "
                     f"{_mean([r['best'] for r in mine]):>9.4f} "
                     f"{_mean([r['wall'] for r in mine]):>9.1f} {_fmt(_mean(procs), '10.1f'):>10} "
                     f"{_fmt(_mean(hits), '11.1f'):>11}   ({len(hits)}/{len(mine)} seeds reach {target})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--target", type=float, default=1.47)
    a = p.parse_args(argv)
    try:
        rows = collect(a.out, a.target)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {a.out} holds no ours-SEED/ folder and no torch-SEED.jsonl", file=sys.stderr)
        return 2
    print(table(rows, a.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
