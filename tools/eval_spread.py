"""How far apart runs of two precisions (or two summation orders) end, on the default eval and a larger one.

    python tools/eval_spread.py OUT.json --recipes gpt2 llama --seeds 1337 1 2 3 \
        --precisions fp32 bf16 --backend cuda|cpu|torch [--steps 600] [--batches 64] [--set KEY=VALUE ...]

Each run is `toyharness run R --steps N --set precision=P --set seed=S` (in process, no files), with
the --set options added (e.g. lr_schedule=cosine: the same runs with the rate decayed to the end). Its
last evaluation is made twice over the same weights: on the recipe's default eval batches (the
eval loss a run reports) and on the first --batches held-out batches (the default ones among them:
batch i of a split depends on (seed, split, i) only). Training never reads the eval, so the two
views are of one trajectory. Written: each run's two eval losses, and per precision against the
first one given (fp32), seed by seed, the relative gap on each view.

Why: at a high learning rate, a few hundred steps amplify any difference in rounding, so two runs
that differ only in summation order (or in precision) can end a few percent apart on the default
eval. The larger eval says how much of a gap is the trained weights and how much the default eval's
few batches.

A TAG=ENV setting can stand for a precision: --precisions fp32 fp32:RERUN=1 runs fp32 twice, the
second with that environment variable set (the same run again: its spread is the noise floor).

--backend torch trains the recipe's PyTorch twin the same way (the recipe's init, batches and
AdamW rows; bf16 as autocast over fp32 master weights; on the GPU where PyTorch sees one): how far
PyTorch's own bf16 run ends from its fp32 run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

from toyharness import runner


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--recipes", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1337])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--backend", default="cuda",
                    help="cpu, cuda, or torch: the recipe's PyTorch twin trained the same way "
                         "(train_reference; on cuda where PyTorch sees a GPU), bf16 as autocast")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batches", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an option for every run")
    ap.add_argument("--check-mean", type=float, default=None, metavar="FRACTION",
                    help="exit 1 unless each precision's mean eval loss over the seeds is within FRACTION "
                         "(e.g. 0.01) of the first precision's, on both evals")
    a = ap.parse_args()

    last: dict[str, float] = {}
    original = runner.evaluate

    def evaluate_twice(pm, model, data, options):
        default = original(pm, model, data, options)
        wide = original(pm, model, data, dataclasses.replace(options, eval_batches=a.batches))
        last.update(default=default["loss"], wide=wide["loss"])
        return default

    runner.evaluate = evaluate_twice
    if a.backend == "torch" and a.threads:
        import torch

        torch.set_num_threads(a.threads)
    results: dict = {"steps": a.steps, "batches": a.batches, "backend": a.backend, "sets": a.set, "runs": {}}
    for recipe in a.recipes:
        for seed in a.seeds:
            for spec in a.precisions:
                precision, _, env = spec.partition(":")
                key, _, value = env.partition("=")
                saved = os.environ.get(key) if key else None
                if key:
                    os.environ[key] = value
                try:
                    if a.backend == "torch":
                        from toyharness.bench.torch_side import train_reference

                        run = train_reference(recipe, a.steps, [*a.set, f"seed={seed}"], precision,
                                              torch_device(), (a.batches,))
                        last.update(default=run["eval"], wide=run["evals"][a.batches])
                    else:
                        summary = runner.train(recipe, steps=a.steps, backend=a.backend, threads=a.threads,
                                               sets=[*a.set, f"precision={precision}", f"seed={seed}"],
                                               progress=False, write_files=False)
                        if summary["eval_loss"] != last["default"]:
                            raise SystemExit(f"{recipe} {spec} seed {seed}: the summary's eval loss is not the "
                                             "last eval's")
                finally:
                    if key:
                        os.environ.pop(key) if saved is None else os.environ.__setitem__(key, saved)
                results["runs"][f"{recipe}/{spec}/{seed}"] = dict(last)
                print(f"{recipe} {spec} seed {seed}: eval {last['default']:.5f} (default batches), "
                      f"{last['wide']:.5f} ({a.batches} batches)", flush=True)
    ref, failed = a.precisions[0], []
    for recipe in a.recipes:
        for spec in a.precisions[1:]:
            row = {}
            for view in ("default", "wide"):
                runs = results["runs"]
                gaps = [abs(runs[f"{recipe}/{spec}/{s}"][view] / runs[f"{recipe}/{ref}/{s}"][view] - 1)
                        for s in a.seeds]
                means = [statistics.fmean(runs[f"{recipe}/{p}/{s}"][view] for s in a.seeds) for p in (ref, spec)]
                mean_gap = abs(means[1] / means[0] - 1)
                row[view] = {"gaps": gaps, "largest": max(gaps), "median": statistics.median(gaps),
                             "within_1pct": sum(g < 0.01 for g in gaps), "means": means, "mean_gap": mean_gap}
                print(f"{recipe} {spec} against {ref}, {view} eval: largest {100 * max(gaps):.2f}%, median "
                      f"{100 * statistics.median(gaps):.2f}%, {row[view]['within_1pct']} of {len(gaps)} seeds "
                      f"within 1%; means {means[0]:.5f} and {means[1]:.5f}, {100 * mean_gap:.2f}% apart")
                if a.check_mean is not None and mean_gap >= a.check_mean:
                    failed.append(f"{recipe} {spec} {view} eval: the means over the seeds are {100 * mean_gap:.3g}% "
                                  f"apart, not under --check-mean {100 * a.check_mean:g}%")
            results[f"{recipe}/{spec}"] = row
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    for line in failed:
        print(f"check failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
