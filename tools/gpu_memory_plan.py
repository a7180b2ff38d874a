"""The memory plan against the memory a run takes, recipe by recipe, size by size.

    python tools/gpu_memory_plan.py OUT_DIR [--backend cuda|cpu] [--quick]

Each case runs in a child process of its own: it makes the plan, takes a baseline of the memory
in use (cuda: the driver's used memory of the device, total - free, read through ggml's
ggml_backend_dev_memory, i.e. cudaMemGetInfo; cpu: the process's RSS) after a tiny warm-up run
has created the backend's context, trains a few steps with an evaluation between them, samples
the memory in use after every step and evaluation, and reports the largest growth beside the
plan: on cuda beside ggml's buffers (`ggml_bytes`: parameters, moments, inputs, both compute
buffers), on cpu beside the whole plan (which also counts the checkpoint's host copy). Writes
OUT_DIR/memory_plan_<backend>.json (every case: plan rows, measured growth, ratio) and a table in
OUT_DIR/memory_plan_<backend>.txt. Exit 1 if a case failed to run or fell outside 10%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# (recipe, sets): each recipe at a few sizes, from its default up to what a GPU holds easily
CASES = {
    "gpt2": [[], ["n_layer=6", "d_model=384", "n_head=6", "t_seq=256", "t_batch=64"],
             ["n_layer=12", "d_model=768", "n_head=12", "t_seq=1024", "t_batch=8"]],
    "llama": [[], ["n_layer=6", "d_model=384", "n_head=6", "n_kv_head=2", "d_ff=1024", "t_seq=256", "t_batch=64"],
              ["n_layer=12", "d_model=768", "n_head=12", "n_kv_head=4", "d_ff=2048", "t_seq=1024", "t_batch=8"]],
    "warm_start": [[], ["n_layer=6", "d_model=384", "n_head=6", "t_seq=256", "t_batch=32"],
                   ["n_layer=8", "d_model=512", "n_head=8", "t_seq=512", "t_batch=16"]],
    "vit_tiny": [[], ["t_batch=128"], ["t_batch=512"]],
    "lora": [["t_seq=256", "t_batch=16"], ["t_seq=1024", "t_batch=8", "rank=16"]],
}
# Toy sizes, where the driver's 2 MiB pages weigh most (memory_plan.ALLOCATION_GRANULARITY): the
# first two of each recipe were measured when the page model was fitted, the last two after it
TINY = {"gpt2": [["t_seq=64", "t_batch=8"], ["n_layer=2", "t_seq=128", "t_batch=4"],
                 ["t_seq=32", "t_batch=2"], ["n_layer=1", "t_seq=200", "t_batch=3"]],
        "llama": [["t_seq=96", "t_batch=4"], ["n_layer=3", "t_seq=32", "t_batch=16"],
                  ["t_seq=200", "t_batch=2"], ["n_layer=5", "t_seq=48", "t_batch=6"]],
        "warm_start": [["t_batch=4"], ["t_seq=48", "t_batch=24"], ["t_batch=2"], ["t_seq=80", "t_batch=10"]],
        "vit_tiny": [["t_batch=16"], ["t_batch=40"], ["t_batch=8"], ["t_batch=72"]],
        "lora": [["t_seq=64", "t_batch=4"], ["t_seq=128", "t_batch=2", "rank=4"],
                 ["t_seq=32", "t_batch=2"], ["t_seq=512", "t_batch=1", "rank=2"]]}
QUICK = {"gpt2": [["t_seq=256", "t_batch=16"]], "llama": [["t_seq=256", "t_batch=16"]],
         "warm_start": [["t_seq=256", "t_batch=16"]], "vit_tiny": [["t_batch=256"]],
         "lora": [["t_seq=256", "t_batch=16"]]}
# the base lora trains on: a seeded llama the harness writes itself (as lora's golden does)
LORA_BASE = ["n_layer=4", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=7"]

CHILD = r"""
import json, sys
from toyharness._ffi import ffi, lib
from toyharness.engine import get_engine
from toyharness.hookspecs import hookimpl
from toyharness.runner import plan_run, train

recipe, backend, sets, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]

def used() -> int:
    if backend == "cpu":
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    lib.ggml_backend_dev_memory(lib.ggml_backend_get_device(get_engine(backend).handle), free, total)
    return int(total[0]) - int(free[0])

class Sampler:
    peak = 0
    @hookimpl
    def step_end(self, run, step, loss, lr, ms, tokens_per_s):
        self.peak = max(self.peak, used())
    @hookimpl
    def eval_end(self, run, step, loss, accuracy):
        self.peak = max(self.peak, used())

plan = plan_run(recipe, backend=backend, sets=sets)
base_only = [s for s in sets if s.startswith("base=")]
train(recipe, backend=backend, steps=1, sets=base_only + ["t_batch=1", "t_seq=8"], out=out + "-warmup",
      progress=False)
baseline = used()
sampler = Sampler()
train(recipe, backend=backend, steps=3, sets=sets + ["eval_every=1", "eval_batches=1", "checkpoint_every=3"],
      out=out, progress=False, observers=(sampler,))
measured = sampler.peak - baseline
if backend == "cpu":    # VmHWM, this process's own peak (ru_maxrss keeps the parent's RSS at fork)
    hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
    measured = max(measured, hwm - baseline)
print(json.dumps({"plan": plan.to_json(), "baseline": baseline, "peak": sampler.peak, "measured": measured}))
"""


def run_case(recipe: str, backend: str, sets: list[str], work: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, recipe, backend, json.dumps(sets), str(work / "run")],
                       capture_output=True, text=True, cwd=work)
    if r.returncode != 0:
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        return {"recipe": recipe, "sets": sets, "error": lines[-1] if lines else f"exit {r.returncode}"}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    planned = got["plan"]["ggml_bytes"] if backend != "cpu" else got["plan"]["total"]
    return {"recipe": recipe, "sets": sets, "planned": planned, "measured": got["measured"],
            "ratio": got["measured"] / planned if planned else None, "baseline": got["baseline"], "plan": got["plan"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu", "vulkan"])
    ap.add_argument("--quick", action="store_true", help="one small size per recipe (a check of the script)")
    ap.add_argument("--tiny", action="store_true", help="also toy sizes held out from fitting the page rounding")
    ap.add_argument("--recipes", help="comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = QUICK if args.quick else {k: v + (TINY[k] if args.tiny else []) for k, v in CASES.items()}
    names = args.recipes.split(",") if args.recipes else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        print(f"gpu_memory_plan: unknown recipe(s) {', '.join(unknown)}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    from toyharness.lm import seeded_model_file

    base = seeded_model_file("llama", LORA_BASE)
    results, bad = [], 0
    lines = [f"{'recipe':<11}{'sets':<62}{'plan MiB':>10}{'used MiB':>10}{'ratio':>7}"]
    for name in names:
        for sets in cases[name]:
            sets = sets + ([f"base={base}"] if name == "lora" else [])
            with tempfile.TemporaryDirectory() as work:
                res = run_case(name, args.backend, sets, Path(work))
            results.append(res)
            shown = " ".join(s for s in sets if not s.startswith("base=")) or "(defaults)"
            if "error" in res:
                bad += 1
                line = f"{name:<11}{shown:<62}  failed: {res['error']}"
            else:
                ok = res["ratio"] is not None and 0.9 <= res["ratio"] <= 1.1
                bad += not ok
                line = (f"{name:<11}{shown:<62}{res['planned'] / 2**20:10.1f}{res['measured'] / 2**20:10.1f}"
                        f"{res['ratio']:7.3f}" + ("" if ok else "  outside 10%"))
            lines.append(line)
            print(line, flush=True)
    what = "the driver's used memory of the device" if args.backend != "cpu" else "the process's RSS"
    doc = {"backend": args.backend, "measured": what, "cases": results}
    (out / f"memory_plan_{args.backend}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"memory_plan_{args.backend}.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/memory_plan_{args.backend}.json and .txt; {bad} case(s) failed or outside 10%")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
