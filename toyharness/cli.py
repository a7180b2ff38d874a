"""toyharness command line. Exit codes: 0 ok, 1 a check or a write failed, 2 usage or input error."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .cli_parser import BACKENDS, FUSE_TYPES, build_parser  # noqa: F401  (BACKENDS, FUSE_TYPES: for tests)
from .errors import CheckFailed, Reported, ToyharnessError
from .switches import check_all as check_all_switches


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_all_switches()     # a switch set to a value it does not take, by name, before anything loads
        check_counts(args)
        return {"recipes": cmd_recipes, "run": cmd_run, "golden": cmd_golden, "bench": cmd_bench,
                "sample": cmd_sample, "sweep": cmd_sweep, "fuse": cmd_fuse,
                "new-recipe": cmd_new_recipe}[args.command](args)
    except Reported as exc:          # its one line is printed already
        return exc.exit_code
    except ToyharnessError as exc:
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
        print(f"toyharness: {'check failed' if isinstance(exc, CheckFailed) else 'error'}: {exc}", file=sys.stderr)
        end_every_process(exc.exit_code)          # a data-parallel run's other processes, not left waiting
        return exc.exit_code
    except KeyboardInterrupt:
        print("toyharness: interrupted", file=sys.stderr)
        end_every_process(130)
        return 130
    except Exception:
        from .engine.data_parallel import several_processes

        if several_processes():      # a crash: its traceback, then the other processes end too
            import traceback

            traceback.print_exc()
            end_every_process(1)
        raise
    except BrokenPipeError:      # e.g. `toyharness bench --profile | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 141


def end_every_process(code: int) -> None:
    """A data-parallel run's other processes ended with this one (engine/data_parallel.py)."""
    from .engine.data_parallel import end_every_process as end

    end(code)


def check_counts(args) -> None:
    """Counts no command can take, refused by name before anything loads (`--threads 0` would
    otherwise quietly mean "the default")."""
    from .errors import InputError

    for flag, least in (("threads", 1), ("workers", 1), ("warmup", 0)):
        value = getattr(args, flag, None)
        if value is not None and value < least:
            raise InputError(f"--{flag} must be >= {least}, got {value}")


def cmd_recipes(args) -> int:
    from .architectures import ARCHITECTURES
    from .discovery import discover, discover_observers

    for name, e in discover().items():
        print(f"{name:<14} {e.distribution} {e.version}  ({e.value})")
    print("observers (toyharness run RECIPE --log NAME):")
    for name, e in discover_observers().items():
        print(f"  {name:<12} {e.distribution} {e.version}  ({e.value})")
    print(f"lora bases and warm_start donors: GGUFs of architecture {', '.join(ARCHITECTURES)} "
          f"(docs/architectures.md)")
    return 0


def log_names(values: list[str] | None) -> str | None:
    """Repeated --log flags as one comma-separated list (None: none given, the option decides)."""
    return None if values is None else ",".join(values)


def cmd_run(args) -> int:
    from . import launcher
    from .errors import InputError
    from .runner import plan_run, train

    if args.plan:
        flags = (("--steps", args.steps), ("--out", args.out), ("--save-init", args.save_init),
                 ("--save-batches", args.save_batches), ("--log", args.log))
        unused = [flag for flag, value in flags if value is not None and value is not False]
        if unused:
            raise InputError(f"{', '.join(unused)}: not used by --plan (it prints the memory plan and exits, "
                             "training nothing)")
        print(plan_run(args.recipe, backend=args.backend, threads=args.threads, config=args.config, sets=args.sets,
                       resume=args.resume).table())
        return 0
    summary = train(args.recipe, steps=args.steps, backend=args.backend, threads=args.threads, config=args.config,
                    sets=args.sets, out=args.out, save_init=args.save_init, save_batches=args.save_batches,
                    resume=args.resume, progress=not args.no_progress, log=log_names(args.log))
    if not args.spread_process and launcher.process_rank() == 0:      # one summary a run
        _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=summary["recipe"], show_header=False)
    for k in ("steps", "final_loss", "best_loss", "eval_loss", "accuracy", "wall_s", "steps_per_s", "peak_rss_mb",
              "backend", "threads"):
        if k in summary and summary[k] is not None:
            v = summary[k]
            t.add_row(k, f"{v:.4f}" if isinstance(v, float) and k.endswith(("loss", "accuracy")) else str(v))
    console = Console()
    console.print(t)
    # The path on a line of its own, never wrapped: a table title wraps it over several lines,
    # and people copy it into the next command.
    console.print(f"run folder: {summary['out_dir']}", soft_wrap=True, highlight=False)


def cmd_golden(args) -> int:
    from . import goldens
    from .discovery import discover
    from .engine import get_engine
    from .errors import InputError

    root = Path(args.dir) if args.dir else None
    if root is not None and args.action == "check" and not root.is_dir():
        raise InputError(f"--dir {root}: no such folder")
    if args.verbose and args.action != "check":
        raise InputError("--verbose: lists the variants a check finds no golden for; record writes every one")
    if args.recipes or args.threads:
        # a backend this build lacks, named before a precision it would compute; the thread count
        # stays on the process's engine, which every golden run below takes
        get_engine(args.backend, args.threads)
    for name in args.recipes:
        goldens.check_name(name, args.backend)
    names = args.recipes or [name for recipe in discover() for name in goldens.golden_names(recipe, args.backend)]
    failed = 0
    missing: list[goldens.GoldenMissing] = []
    for name in names:
        if args.action == "record":
            try:
                print(f"recorded {goldens.record(name, args.backend, root, args.mode)}")
            except FileNotFoundError as exc:
                print(f"SKIP {name}: {exc}")
            continue
        try:
            path, mismatch = goldens.check(name, args.backend, root, args.mode)
        except goldens.GoldenMissing as exc:
            if args.recipes or args.verbose:    # asked for by name, or a listing asked for
                print(f"SKIP {name}: {exc}")
            missing.append(exc)
            continue
        except FileNotFoundError as exc:
            print(f"SKIP {name}: {exc}")
            continue
        used = goldens.describe(path)
        if mismatch:
            failed += 1
            print(f"FAIL {mismatch} ({used})")
        else:
            print(f"ok   {name} ({used})")
    if missing and not args.recipes:
        print(missing_goldens_line(missing, args.verbose))
    return 1 if failed else 0


def missing_goldens_line(missing: list, listed: bool) -> str:
    """A check's one line for the variants nobody recorded a golden for on this fingerprint (on
    cuda, most precision variants): their count, and how to list them."""
    n = len(missing)
    where = " or ".join(dict.fromkeys(exc.fingerprints for exc in missing))
    what = f"{n} recipe variant{'s' if n != 1 else ''} with no golden for {where}: not checked"
    return what + (" (listed above)" if listed else f"; --verbose lists {'them' if n != 1 else 'it'}")


def cmd_bench(args) -> int:
    from .bench.report import run_bench

    return run_bench(args)


def cmd_sweep(args) -> int:
    from . import sweep

    return sweep.main(args)


def cmd_new_recipe(args) -> int:
    from .scaffold import new_recipe

    folder = new_recipe(args.name, args.source, args.out)
    print(f"wrote {folder} (recipe {args.name}, its portable golden recorded); next: "
          f"pip install -e {folder} && cd {folder} && pytest")
    return 0


def cmd_fuse(args) -> int:
    from .merge_adapters import fuse

    r = fuse(args.run_dir, args.out, args.dtype)
    types = ", ".join(f"{n} {t}" for t, n in sorted(r.types.items(), key=lambda kv: -kv[1]))
    print(f"fused {len(r.fused)} adapted tensors; {sum(r.types.values())} tensors ({types}), "
          f"{r.bytes / 2**20:.1f} MiB" if r.fused else
          f"{sum(r.types.values())} tensors ({types}), {r.bytes / 2**20:.1f} MiB")
    print(f"wrote {r.path}")
    return 0


def cmd_sample(args) -> int:
    from .errors import InputError
    from .runner import load_finished_run
    from .sampling import FullRecompute, generate, load_cached, read_prompts

    obj, opts, ckpt = load_finished_run(args.run_dir)
    if args.prompts and args.prompt:
        raise InputError("--prompt and --prompts: give one")
    if args.out and not args.prompts:
        raise InputError("--out writes the replies of --prompts; with --prompt the text goes to stdout")
    if args.tokens < 0:
        raise InputError(f"--tokens must be >= 0, got {args.tokens}")
    if args.context is not None and (args.no_cache or args.context < 1):
        raise InputError("--context: a positive number of positions, and only with the KV cache")
    if args.dequantize and args.no_cache:
        raise InputError("--dequantize is for the KV cache's sampler; --no-cache is the reference as it is")
    tok = obj.tokenizer(opts)
    if tok.byte_level:
        from .hookspecs import plugin_manager
        from .runner import load_data

        data = load_data(plugin_manager(obj), opts)
        if not data.byte_level:
            raise InputError("sampling text needs a tokenizer: this run used pre-tokenized ids and bytes")
        vocab = data.vocab
    else:
        vocab = tok.vocab_size
    rows = read_prompts(args.prompts, tok, args.chat) if args.prompts else None
    if args.no_cache:
        model = FullRecompute(obj.load_for_sampling(ckpt, opts, vocab, args.backend, args.threads))
    else:
        model = load_cached(obj, ckpt, opts, vocab, args.backend, args.threads, args.context, args.dequantize)

    def ask(ids: list[int]) -> list[int]:
        return generate(model, ids, args.tokens, args.temperature, args.top_k, args.seed, tok.end_ids)
    if rows is None:
        text = chat_prompt(tok, args.prompt) if args.chat else args.prompt
        out = ask(tok.encode(text, add_special=not args.chat))
        print(tok.decode(out) if args.chat else args.prompt + tok.decode(out))
        return 0
    return _sample_prompts(args, rows, tok, ask)


def _sample_prompts(args, rows: list[dict], tok, ask) -> int:
    """Every prompt of --prompts: JSONL replies (to --out, atomically, or stdout) and a summary."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .atomic import atomic_write

    lines, n_tokens, hits, scored = [], 0, 0, 0
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]sample"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[rate]}"), console=_stderr_console(), disable=args.no_progress,
                  transient=True) as bar:
        task = bar.add_task("sample", total=len(rows), rate="")
        for row in rows:
            out = ask(tok.encode(row["text"], add_special=not row["chat"]))
            n_tokens += len(out)
            reply = tok.decode(out)
            doc = {"prompt": row["prompt"], "reply": reply.strip() if row["chat"] else reply, "tokens": len(out)}
            if "completion" in row:
                doc["completion"] = row["completion"]
                doc["match"] = doc["reply"].strip() == row["completion"].strip()
                hits, scored = hits + doc["match"], scored + 1
            line = json.dumps(doc, ensure_ascii=False)
            if args.out:
                lines.append(line)
            else:
                print(line, flush=True)
            bar.update(task, advance=1, rate=f"{n_tokens / (time.perf_counter() - t0):.1f} tokens/s")
    wall = time.perf_counter() - t0
    if args.out:
        atomic_write(Path(args.out), "\n".join(lines) + "\n")
    summary = f"{len(rows)} prompts, {n_tokens} tokens in {wall:.1f} s ({n_tokens / wall:.1f} tokens/s)"
    if scored:
        summary += f"; exact match {hits}/{scored} = {hits / scored:.1%}"
    print(summary + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def chat_prompt(tokenizer, prompt: str) -> str:
    """`prompt` as one user message, rendered up to the assistant's turn."""
    from .data.chat import render_chat

    return render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)


if __name__ == "__main__":
    sys.exit(main())
