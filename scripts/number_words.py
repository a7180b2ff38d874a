"""A small instruction data set the base model does badly: integers to English words, asked in a
terse format it has not seen ("n2w 347" -> "three hundred forty-seven"), as JSONL prompt/completion
pairs, and the acceptance check of issue 18 (held-out exact match of greedy `sample --chat`).

    python scripts/number_words.py write DATA.jsonl [--n 400] [--seed 0]
    python scripts/number_words.py score RUN_DIR DATA.jsonl [--base] [--no-loss]

The run's held-out split is the file's last 10% of examples (toyharness.data.jsonl), so `score`
asks those prompts, after the held-out masked loss (as the run's eval_loss computes it) of the
checkpoint; `--base` scores the run's base alone (its adapters at their zero init).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
       "seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    return ONES[n // 100] + " hundred" + (" " + words(n % 100) if n % 100 else "")


def write(path: Path, n: int, seed: int) -> None:
    numbers = random.Random(seed).sample(range(1, 1000), n)
    lines = [json.dumps({"prompt": f"n2w {k}", "completion": words(k)}) for k in numbers]
    path.write_text("\n".join(lines) + "\n")


def score(run_dir: Path, data: Path, base: bool, batch: int = 8, loss: bool = True) -> float:
    import tomllib

    from toyharness.cli import chat_prompt
    from toyharness.data.jsonl import read_jsonl
    from toyharness.lm import generate
    from toyharness.plugins import get_recipe
    from toyharness.runner import resolve_options

    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    _, obj = get_recipe(cfg["recipe"])
    opts = resolve_options(obj, str(run_dir / "config.toml"), [], {})
    tok = obj.tokenizer(opts)
    rows = [obj_ for _, obj_ in read_jsonl(data)]
    held = rows[len(rows) - max(1, round(len(rows) * 0.1)):]
    from toyharness.engine import GGUFFile, get_engine
    from toyharness.hookspecs import plugin_manager
    from toyharness.lm import LanguageModel
    from toyharness.runner import evaluate, load_data

    params = obj.init_params(opts, tok.vocab_size)     # lora: the adapters, B at zero (the base alone)
    if not base:
        with GGUFFile(run_dir / "checkpoint.gguf") as f:
            params = {n: f.tensor(n, expect_shape=v.shape).to_numpy() for n, v in params.items()}
    if loss:
        pm = plugin_manager(obj)
        lm = LanguageModel(obj, get_engine("cpu"), opts, tok.vocab_size, params, masked=True)
        value = evaluate(pm, lm, load_data(pm, opts), opts)["loss"]
        print(f"{'base' if base else 'checkpoint'} held-out masked loss: {value:.4f}", flush=True)
        del lm
    model = obj.load_for_sampling(None if base else run_dir / "checkpoint.gguf", opts, tok.vocab_size, batch=batch)
    hits = 0
    for i in range(0, len(held), batch):
        chunk = held[i:i + batch]
        prompts = [tok.encode(chat_prompt(tok, r["prompt"])) for r in chunk]
        outs = generate(model, prompts, 12, 0.0, 0, 0, tok.end_ids)
        for r, out in zip(chunk, outs):
            reply = tok.decode(out).strip()
            hits += reply == r["completion"]
            verdict = "ok" if reply == r["completion"] else "want " + r["completion"]
            print(f"{r['prompt']!r:>12} -> {reply!r} ({verdict})", flush=True)
    print(f"exact match: {hits}/{len(held)} = {hits / len(held):.1%}")
    return hits / len(held)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("path", type=Path)
    w.add_argument("--n", type=int, default=400)
    w.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("score")
    s.add_argument("run_dir", type=Path)
    s.add_argument("data", type=Path)
    s.add_argument("--base", action="store_true")
    s.add_argument("--no-loss", action="store_true", help="skip the held-out loss (a finished run's eval_loss is it)")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        write(args.path, args.n, args.seed)
    else:
        score(args.run_dir, args.data, args.base, loss=not args.no_loss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
