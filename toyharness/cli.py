"""toyharness command line. Exit codes: 0 ok, 1 a check or a write failed, 2 usage or input error."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import CheckFailed, ToyharnessError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 too; keep its one-line style
        self.print_usage(sys.stderr)
        self.exit(2, f"toyharness: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="toyharness", description="Small, deterministic training experiments on ggml.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sub.add_parser("recipes", help="list installed recipes (name, distribution, version)",
                   description="List every recipe found through the toyharness.recipes entry points.")

    r = sub.add_parser("run", help="train a recipe and write a run folder",
                       description="Train RECIPE and write its run folder (config.toml, metrics.jsonl, "
                                   "summary.json, loss.png, checkpoint.gguf, model.gguf).")
    r.add_argument("recipe")
    r.add_argument("--steps", type=int, help="number of training steps (default: the recipe's)")
    r.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "metal"])
    r.add_argument("--threads", type=int, help="cpu threads (default: free cores)")
    r.add_argument("--config", help="TOML file of options")
    r.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="set one option (repeatable; wins over --config)")
    r.add_argument("--out", help="run folder (default: runs/RECIPE-TIMESTAMP)")
    r.add_argument("--save-init", action="store_true", help="write init.gguf: every parameter before step 0")
    r.add_argument("--save-batches", action="store_true", help="write batches.npz: every step's exact inputs")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its checkpoint, bit for bit")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")

    g = sub.add_parser("golden", help="check or record golden losses",
                       description="Compare each recipe's first 16 losses with goldens/<fingerprint>/, bit for bit.")
    g.add_argument("action", choices=["check", "record"])
    g.add_argument("recipes", nargs="*", help="default: every installed recipe")
    g.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "metal"])
    g.add_argument("--dir", help="goldens folder (default: ./goldens or $TOYHARNESS_GOLDENS)")

    b = sub.add_parser("bench", help="ms/step, tokens/s, peak RSS beside PyTorch eager; writes bench.json",
                       description="Time each recipe's training step at its bench config (its defaults) beside an "
                                   "equivalent PyTorch eager model with AdamW (toyharness/reference.py, needs torch), "
                                   "in alternating rounds, each side in its own process. Reports medians, the "
                                   "speedup (PyTorch ms / toyharness ms), matmul GFLOP/s against this machine's "
                                   "measured FP32 sgemm ceiling, and the host overhead of a step.")
    b.add_argument("recipes", nargs="*", help="default: every installed recipe with a PyTorch reference")
    b.add_argument("--steps", type=int, default=20, help="timed steps per side (median; default 20)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (default 3)")
    b.add_argument("--threads", type=int, help="threads for both sides (default: free cores)")
    b.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "metal"])
    b.add_argument("--torch-device", help="PyTorch device (default: cuda for --backend cuda, else cpu)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a bench option")
    b.add_argument("--out", default="bench.json", help="where to write the results (default bench.json)")
    b.add_argument("--profile", action="store_true",
                   help="instead: where a toyharness step's time goes, by ggml op (each node timed alone; "
                        "no PyTorch needed, nothing written)")

    s = sub.add_parser("sample", help="generate text from a trained language model",
                       description="Sample text from RUN_DIR's model (checkpoint.gguf), forward only.")
    s.add_argument("run_dir")
    s.add_argument("--prompt", default="")
    s.add_argument("--tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"recipes": cmd_recipes, "run": cmd_run, "golden": cmd_golden, "bench": cmd_bench,
                "sample": cmd_sample}[args.command](args)
    except ToyharnessError as exc:
        print(f"toyharness: {'check failed' if isinstance(exc, CheckFailed) else 'error'}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("toyharness: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:      # e.g. `toyharness bench --profile | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 141


def cmd_recipes(args) -> int:
    from .plugins import discover

    for name, e in discover().items():
        print(f"{name:<14} {e.distribution} {e.version}  ({e.value})")
    return 0


def cmd_run(args) -> int:
    from .runner import train

    summary = train(args.recipe, steps=args.steps, backend=args.backend, threads=args.threads, config=args.config,
                    sets=args.sets, out=args.out, save_init=args.save_init, save_batches=args.save_batches,
                    resume=args.resume, progress=not args.no_progress)
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{summary['recipe']} — {summary['out_dir']}", show_header=False)
    for k in ("steps", "final_loss", "best_loss", "eval_loss", "accuracy", "wall_s", "steps_per_s", "peak_rss_mb",
              "backend", "threads"):
        if k in summary and summary[k] is not None:
            v = summary[k]
            t.add_row(k, f"{v:.4f}" if isinstance(v, float) and k.endswith(("loss", "accuracy")) else str(v))
    Console().print(t)


def cmd_golden(args) -> int:
    from . import goldens
    from .plugins import discover

    root = Path(args.dir) if args.dir else None
    names = args.recipes or list(discover())
    failed = 0
    for name in names:
        if args.action == "record":
            try:
                print(f"recorded {goldens.record(name, args.backend, root)}")
            except FileNotFoundError as exc:
                print(f"SKIP {name}: {exc}")
            continue
        try:
            path, mismatch = goldens.check(name, args.backend, root)
        except FileNotFoundError as exc:
            print(f"SKIP {name}: {exc}")
            continue
        if mismatch:
            failed += 1
            print(f"FAIL {mismatch}")
        else:
            print(f"ok   {name} ({path})")
    return 1 if failed else 0


def cmd_bench(args) -> int:
    import importlib.util

    from . import bench
    from .atomic import atomic_write
    from .engine import get_engine
    from .engine.backend import default_threads
    from .errors import InputError
    from .plugins import discover

    known = list(discover())
    unknown = [n for n in args.recipes if n not in known]
    if unknown:
        raise InputError(f"unknown recipe(s) {', '.join(unknown)}; installed: {', '.join(known)}")
    if args.steps < 10:
        raise InputError(f"--steps {args.steps}: use at least 10 timed steps for a median")
    if args.profile:
        return _bench_profile(args, args.recipes or known)
    if importlib.util.find_spec("torch") is None:
        raise InputError("toyharness bench needs PyTorch for its comparison side: pip install torch")
    from .reference import MODELS  # fails here, not in a worker, if torch is broken

    names = args.recipes or [n for n in known if n in MODELS]
    no_ref = [n for n in names if n not in MODELS]
    if no_ref:
        raise InputError(f"no PyTorch reference for {', '.join(no_ref)} (toyharness/reference.py has "
                         f"{', '.join(MODELS)})")
    threads = args.threads or default_threads()
    engine = get_engine(args.backend, threads)   # fails early on a backend this build lacks
    ceiling = bench.matmul_ceiling(threads) if args.backend == "cpu" else None
    results = {}
    hdr = f"{'recipe':<11}{'toyharness':>12}{'PyTorch':>10}{'speedup':>9}{'items/s':>11}{'RSS MB':>8}" \
          f"{'torch RSS':>10}{'GFLOP/s':>9}{'ceiling':>8}{'host':>7}"
    print(f"{args.backend}, {threads} threads; ms/step medians over {args.steps} steps per side"
          + (f"; FP32 sgemm ceiling {ceiling:.0f} GFLOP/s" if ceiling else ""))
    print(hdr)
    for name in names:
        r = bench.bench_recipe(name, args.backend, threads, args.steps, args.warmup, torch_device=args.torch_device,
                               sets=args.set)
        doc = results[name] = r.to_json(ceiling)
        gf = f"{r.gflops:9.1f}" if r.gflops else f"{'-':>9}"
        ceil = f"{doc['ceiling_pct']:7.0f}%" if "ceiling_pct" in doc else f"{'-':>8}"
        host = f"{r.host_overhead_pct:6.1f}%" if r.host_overhead_pct is not None else f"{'-':>7}"
        print(f"{name:<11}{r.ms_per_step:10.2f}ms{r.torch_ms_per_step:8.2f}ms{r.speedup:8.2f}x"
              f"{doc[r.item + '_per_s']:11,.0f}{r.peak_rss_mb:8.0f}{r.torch_peak_rss_mb:10.0f}{gf}{ceil}{host}")
        drift = r.drift()
        if drift:
            spans = ", ".join(f"{side} rounds {lo:.2f}-{hi:.2f} ms" for side, (lo, hi) in drift.items())
            trips = doc.get("cpu_round_trip_ns")
            if trips:
                spans += f"; CPU round trip {trips[0]:.0f} ns before, {trips[1]:.0f} after"
            print(f"  note: the machine's speed moved during {name} ({spans}); compare several runs")
    doc = {"backend": args.backend, "threads": threads, "fingerprint": engine.fingerprint(),
           "steps": args.steps, "warmup": args.warmup,
           "fp32_ceiling_gflops": None if ceiling is None else round(ceiling, 1),
           "recipes": results}
    atomic_write(Path(args.out), json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _bench_profile(args, names: list[str]) -> int:
    from . import bench
    from .engine.backend import default_threads

    threads = args.threads or default_threads()
    for name in names:
        total, ops = bench.profile_recipe(name, args.backend, threads, args.set)
        print(f"{name}: {args.backend}, {threads} threads; nodes timed one at a time: {total:.2f} ms per step")
        print(f"  {'op':<26}{'kernel':<14}{'nodes':>6}{'ms':>9}{'share':>8}")
        for o in ops:
            if o.ms >= 0.005 * total:
                print(f"  {o.op:<26}{o.kernel:<14}{o.nodes:6d}{o.ms:9.3f}{100 * o.ms / total:7.1f}%")
        rest = [o for o in ops if o.ms < 0.005 * total]
        if rest:
            print(f"  {f'{len(rest)} more ops':<38}{sum(o.nodes for o in rest):6d}{sum(o.ms for o in rest):9.3f}"
                  f"{100 * sum(o.ms for o in rest) / total:7.1f}%")
    return 0


def cmd_sample(args) -> int:
    from .data import decode_bytes
    from .errors import InputError
    from .lm import LMRecipe, sample_text
    from .options import read_toml
    from .plugins import get_recipe
    from .runner import resolve_options

    run_dir = Path(args.run_dir)
    cfg_path, ckpt = run_dir / "config.toml", run_dir / "checkpoint.gguf"
    if not cfg_path.is_file() or not ckpt.is_file():
        raise InputError(f"{run_dir}: not a finished run folder (needs config.toml and checkpoint.gguf)")
    cfg = read_toml(cfg_path)
    _, obj = get_recipe(cfg.get("recipe", "?"))
    if not isinstance(obj, LMRecipe):
        raise InputError(f"recipe {cfg.get('recipe')!r} is not a language model")
    opts = resolve_options(obj, str(cfg_path), [], {})
    from .hookspecs import plugin_manager
    from .runner import load_data

    data = load_data(plugin_manager(obj), opts)
    if not data.byte_level:
        raise InputError("sampling text needs a byte-level model (this run used pre-tokenized ids)")
    model = obj.load_for_sampling(ckpt, opts, data.vocab)
    prompt = list(args.prompt.encode("utf-8"))
    out = sample_text(model, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + decode_bytes(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
