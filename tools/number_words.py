"""A small instruction data set the base model does badly: integers to English words, asked in a
terse format it has not seen ("n2w 347" -> "three hundred forty-seven"), as JSONL prompt/completion
pairs, and its check: the held-out exact match of greedy `sample --chat`.

    python tools/number_words.py write DATA.jsonl [--n 400] [--seed 0]
    python tools/number_words.py score RUN_DIR DATA.jsonl [--base] [--no-loss]
    python tools/number_words.py score RUN_DIR DATA.jsonl --llamacpp FUSED.gguf [--tool TH_LOGITS]
    python tools/number_words.py kl RUN_DIR DATA.jsonl FUSED.gguf...

The run's held-out split is the file's last 10% of examples (toyharness.data.jsonl), so `score`
asks those prompts (greedy, through the KV cache), after the held-out masked loss (as the run's
eval_loss computes it) of the checkpoint; `--base` scores the run's base alone (its adapters at
their zero init). `--llamacpp FUSED.gguf` asks llama.cpp instead, greedy on a file of `toyharness
fuse RUN_DIR` (native/llamacpp/th_generate beside th_logits: `nox -s llamacpp` builds them; --tool
or $TOYHARNESS_LLAMACPP_TOOL names th_logits), on the same token ids: the fused model's rate.
`kl` gives what fusing costs the model: the mean KL divergence from base + adapter to each fused
file (our forward on both), and how often their argmax agree, over every position of the held-out
examples (chat prompt, answer and end of turn).
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


def llama_cpp_greedy(tool: str | None, model: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """llama.cpp's greedy replies (th_generate: each prompt in a fresh context, up to `n` tokens,
    stopping at an end-of-generation token) to token ids."""
    import os
    import subprocess
    import tempfile

    tool = tool or os.environ.get("TOYHARNESS_LLAMACPP_TOOL")
    if not tool:
        sys.exit("--llamacpp needs th_logits' path: --tool or TOYHARNESS_LLAMACPP_TOOL (nox -s llamacpp builds it)")
    with tempfile.TemporaryDirectory() as tmp:
        ids = Path(tmp) / "prompts.ids"
        ids.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
        res = subprocess.run([str(Path(tool).with_name("th_generate")), str(model), str(ids), str(n), "2"],
                             capture_output=True, text=True, timeout=3600)
    if res.returncode:
        sys.exit(f"th_generate failed: {res.stderr[-2000:]}")
    return [[int(x) for x in line.split()] for line in res.stdout.splitlines()]


def score(run_dir: Path, data: Path, base: bool, loss: bool = True, fused: Path | None = None,
          tool: str | None = None) -> float:
    import tomllib

    from toyharness.cli import chat_prompt
    from toyharness.data.jsonl import read_jsonl
    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options
    from toyharness.sampling import generate, load_cached

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
    if loss and not fused:
        pm = plugin_manager(obj)
        lm = LanguageModel(obj, get_engine("cpu"), opts, tok.vocab_size, params, masked=True)
        value = evaluate(pm, lm, load_data(pm, opts), opts)["loss"]
        print(f"{'base' if base else 'checkpoint'} held-out masked loss: {value:.4f}", flush=True)
        del lm
    prompts = [tok.encode(chat_prompt(tok, r["prompt"])) for r in held]
    if fused:
        outs = llama_cpp_greedy(tool, fused, prompts, 12)
    else:
        model = load_cached(obj, None if base else run_dir / "checkpoint.gguf", opts, tok.vocab_size)
        outs = [generate(model, ids, 12, 0.0, 0, 0, tok.end_ids) for ids in prompts]
    hits = 0
    for r, out in zip(held, outs):
        reply = tok.decode(out).strip()
        hits += reply == r["completion"]
        verdict = "ok" if reply == r["completion"] else "want " + r["completion"]
        print(f"{r['prompt']!r:>12} -> {reply!r} ({verdict})", flush=True)
    print(f"exact match: {hits}/{len(held)} = {hits / len(held):.1%}")
    return hits / len(held)


def kl(run_dir: Path, data: Path, fused: list[Path]) -> None:
    import numpy as np

    from toyharness.data.chat import render_chat
    from toyharness.data.jsonl import read_jsonl
    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options

    _, obj = get_recipe("lora")
    opts = resolve_options(obj, str(run_dir / "config.toml"), [], {})
    tok = obj.tokenizer(opts)
    rows = [r for _, r in read_jsonl(data)]
    held = rows[len(rows) - max(1, round(len(rows) * 0.1)):]
    texts = [tok.encode(render_chat(tok, [{"role": "user", "content": r["prompt"]},
                                          {"role": "assistant", "content": r["completion"]}]))[:opts.t_seq]
             for r in held]      # as training renders them

    def logits(model) -> np.ndarray:
        out = []
        for ids in texts:
            buf = np.zeros((model.batch, opts.t_seq), np.int32)
            buf[0, :len(ids)] = ids
            out.append(model.next_logits(buf)[0, :len(ids)])
        x = np.concatenate(out).astype(np.float64)
        x -= x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref = logits(obj.load_for_sampling(run_dir / "checkpoint.gguf", opts, tok.vocab_size))
    for path in fused:
        got = logits(obj.load_for_sampling(None, resolve_options(obj, str(run_dir / "config.toml"),
                                                                 [f"base={path}"], {}), tok.vocab_size))
        value = float(np.mean(np.sum(np.exp(ref) * (ref - got), -1)))
        agree = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
        print(f"{path.name}: KL from base + adapter {value:.3g}, top-1 agreement {agree:.4f} ({len(ref)} positions)",
              flush=True)


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
    s.add_argument("--llamacpp", type=Path, metavar="FUSED.gguf", help="score llama.cpp's greedy replies on this file")
    s.add_argument("--tool", help="th_logits' path (default $TOYHARNESS_LLAMACPP_TOOL)")
    k = sub.add_parser("kl")
    k.add_argument("run_dir", type=Path)
    k.add_argument("data", type=Path)
    k.add_argument("fused", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "kl":
        kl(args.run_dir, args.data, args.fused)
    elif args.cmd == "write":
        write(args.path, args.n, args.seed)
    else:
        score(args.run_dir, args.data, args.base, loss=not args.no_loss, fused=args.llamacpp, tool=args.tool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
