"""DPO on a real model, end to end: SmolLM2-135M-Instruct (Q4_1, fetched into the cache by
toyharness.pretrained_ggufs) taught a house style it does not have, checked on held-out prompts
before and after, in our sampler and in llama.cpp on the fused file.

    python tools/preference_demo.py [--backend cpu|cuda] [--precision fp32|bf16] [--steps 150] [--out DIR]

The preference set is generated here (deterministic, written to OUT/pairs.jsonl, never committed):
short questions of several kinds (sums and products, capitals, word tasks: a word backwards, its
letter count, repeated, in capitals), each answered twice with the same answer: the chosen
side starts with a fixed prefix ("Short answer: 42"), the rejected side is the plain answer ("42").
The base never starts a reply that way, so whether a reply follows the preferred form is a string
check. The last 10% of the pairs are the recipe's held-out split (docs/preference.md).

Phases, each printed as it finishes, then one table:

1. the held-out evaluation of the untrained policy (the base: adapters at their zero init), the
   recipe's own eval metrics (eval_rewards/accuracies, eval_rewards/margins, eval_logps/*);
2. greedy replies (our sampler, toyharness.sampling, with the base's chat template) to the held-out
   prompts: how many start with the prefix, how many contain the answer;
3. `toyharness run dpo` for --steps steps; its last evaluation (metrics.jsonl) and the greedy
   replies of the trained run;
4. `toyharness fuse` into one GGUF (--fuse-type, default q8_0: Q4_1's rounding drowns a short
   fine-tune, docs/finetuning.md "Which type");
5. where llama.cpp's tool is built (`python native/build.py --llamacpp-tool` prints th_logits'
   path; --tool or $TOYHARNESS_LLAMACPP_TOOL), llama.cpp's greedy replies on the fused file, from
   the same prompt token ids, counted the same way.

A reward accuracy at step 0 is 0, not a coin's 0.5: the policy is the reference there, both
sides' rewards are exactly 0, and TRL's rule counts a tie as not preferred. The logps show the
base's own habit: it gives the chosen (prefixed) side the lower log-probability.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "Short answer: "

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi", "Russia": "Moscow",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen", "Poland": "Warsaw",
    "Greece": "Athens", "Turkey": "Ankara", "Ireland": "Dublin", "Austria": "Vienna", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "Australia": "Canberra", "Peru": "Lima", "Chile": "Santiago",
    "Cuba": "Havana", "Thailand": "Bangkok", "Vietnam": "Hanoi", "South Korea": "Seoul", "Iran": "Tehran",
    "Iraq": "Baghdad", "Hungary": "Budapest", "Czechia": "Prague", "Ukraine": "Kyiv", "Colombia": "Bogota",
}
WORDS = ("apple house river garden window planet orange silver forest candle pencil mirror rabbit guitar "
         "bridge castle dragon flower island jacket kitten ladder marble needle ocean pepper quartz rocket "
         "saddle tiger umbrella violin wallet yellow zebra basket cotton desert engine falcon").split()


def questions(seed: int) -> list[tuple[str, str]]:
    """Every (question, answer) of the set, shuffled by `seed`: no question twice."""
    qa = [(f"What is the capital of {country}?", f"{city}.") for country, city in CAPITALS.items()]
    for w in WORDS:
        qa += [(f"Spell the word '{w}' backwards.", w[::-1]),
               (f"How many letters are in the word '{w}'?", str(len(w))),
               (f"Repeat the word '{w}' three times.", " ".join([w] * 3)),
               (f"Write the word '{w}' in capital letters.", w.upper())]
    rng = random.Random(seed)
    for a in range(2, 60):
        for b in range(2, 60):
            if rng.random() < 0.12:
                qa.append((f"What is {a} plus {b}?", str(a + b)))
            if a <= 12 and b <= 12 and rng.random() < 0.3:
                qa.append((f"What is {a} times {b}?", str(a * b)))
    rng.shuffle(qa)
    return qa


def write_pairs(path: Path, n: int, seed: int) -> list[dict]:
    """n preference pairs as JSONL text pairs (each goes through the base's chat template)."""
    qa = questions(seed)
    if n > len(qa):
        sys.exit(f"--pairs {n}: the generator has {len(qa)} distinct questions")
    rows = [{"prompt": q, "chosen": PREFIX + a, "rejected": a, "answer": a.rstrip(".")} for q, a in qa[:n]]
    path.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows))
    return rows


def follows(reply: str) -> bool:
    return reply.strip().startswith(PREFIX.strip())


def count(replies: list[str], held: list[dict]) -> tuple[int, int]:
    """(replies in the preferred form, replies that contain the answer)."""
    return (sum(follows(r) for r in replies),
            sum(h["answer"].lower() in r.lower() for r, h in zip(replies, held)))


def dpo_options(sets: list[str], steps: int):
    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options

    _, obj = get_recipe("dpo")
    return obj, resolve_options(obj, None, sets, {"steps": steps})


def evaluate_untrained(sets: list[str], backend: str, threads: int | None) -> dict[str, float]:
    """The recipe's held-out evaluation of the policy at its init (the base itself)."""
    from toyharness.engine import get_engine
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import evaluate, load_data

    obj, opts = dpo_options(sets, 1)
    pm = plugin_manager(obj)
    data = load_data(pm, opts)
    if data.dropped or data.truncated:
        sys.exit(f"{data.summary()}: raise --t-seq so that every pair fits")
    engine = get_engine(backend, threads)
    engine.set_precision(opts.precision)
    model = pm.hook.realize(engine=engine, options=opts, data=data)
    ev = evaluate(pm, model, data, opts)
    return {"loss": ev["loss"], **ev["metrics"]}


def greedy_ours(sets: list[str], checkpoint: Path | None, prompts: list[str], tokens: int, backend: str,
                threads: int | None) -> tuple[list[str], list[list[int]]]:
    """Greedy replies of our sampler (KV cache) to each prompt as a chat user turn: the base alone
    (checkpoint None) or the trained adapters. Also returns the prompts' token ids."""
    from toyharness.cli import chat_prompt
    from toyharness.sampling import generate, load_cached

    obj, opts = dpo_options(sets, 1)
    tok = obj.tokenizer(opts)
    ids = [tok.encode(chat_prompt(tok, p)) for p in prompts]
    model = load_cached(obj, checkpoint, opts, tok.vocab_size, backend=backend, threads=threads,
                        context=max(map(len, ids)) + tokens)
    outs = [generate(model, x, tokens, 0.0, 0, 0, tok.end_ids) for x in ids]
    return [tok.decode(o) for o in outs], ids


def greedy_llamacpp(tool: str, fused: Path, ids: list[list[int]], tokens: int, sets: list[str]) -> list[str]:
    """llama.cpp's greedy replies on the fused file (th_generate, beside th_logits), decoded by our
    tokenizer."""
    sys.path.insert(0, str(Path(__file__).parent))
    from number_words import llama_cpp_greedy

    obj, opts = dpo_options(sets, 1)
    tok = obj.tokenizer(opts)
    return [tok.decode(o) for o in llama_cpp_greedy(tool, fused, ids, tokens)]


def show(label: str, prompts: list[str], replies: list[str], n: int = 5) -> None:
    for p, r in list(zip(prompts, replies))[:n]:
        print(f"  [{label}] {p!r} -> {r.strip()[:80]!r}", flush=True)


def main(argv: list[str] | None = None) -> int:
    import os

    from toyharness.pretrained_ggufs import fetch_smollm2
    from toyharness.runner import train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=None,
                    help="SmolLM2-135M-Instruct.Q4_1.gguf (default: fetched into the cache; a machine without "
                         "network: copy it from another's cache)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", type=Path, default=Path("runs/preference-demo"))
    ap.add_argument("--pairs", type=int, default=500, help="pairs written (the last 10%% held out; default 500)")
    ap.add_argument("--ask", type=int, default=0, help="held-out prompts asked for greedy replies (default: all)")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per greedy reply (default 24)")
    ap.add_argument("--t-batch", type=int, default=8, help="pairs per step (default 8)")
    ap.add_argument("--t-seq", type=int, default=64, help="positions per side (default 64)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fuse-type", default="q8_0", help="`toyharness fuse --type` (default q8_0)")
    ap.add_argument("--tool", default=os.environ.get("TOYHARNESS_LLAMACPP_TOOL"),
                    help="th_logits' path (default $TOYHARNESS_LLAMACPP_TOOL); th_generate lies beside it")
    args = ap.parse_args(argv)

    out = args.out
    if out.exists() and any(out.iterdir()):
        sys.exit(f"--out {out}: exists and is not empty; name a new folder")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    base = args.base or fetch_smollm2()
    if not Path(base).is_file():
        sys.exit(f"--base {base}: no such file")
    rows = write_pairs(out / "pairs.jsonl", args.pairs, args.seed)
    held = rows[len(rows) - max(1, round(len(rows) * 0.1)):]      # the recipe's held-out split
    n_train = len(rows) - len(held)
    if args.ask:
        held = held[:args.ask]
    prompts = [h["prompt"] for h in held]
    sets = [f"base={base}", f"data={out / 'pairs.jsonl'}", f"t_seq={args.t_seq}", f"t_batch={args.t_batch}",
            f"lr={args.lr}", f"beta={args.beta}", f"rank={args.rank}", f"alpha={2 * args.rank}",
            f"targets={args.targets}", f"precision={args.precision}", f"seed={args.seed}",
            f"warmup={min(10, args.steps // 10)}", f"eval_every={max(args.steps, 1)}",
            f"checkpoint_every={max(args.steps, 1)}"]
    print(f"base {base}\n{len(rows)} pairs in {out / 'pairs.jsonl'}, {len(held)} held-out prompts asked", flush=True)

    before = evaluate_untrained(sets, args.backend, args.threads)
    print("step 0 held-out eval: " + ", ".join(f"{k} {v:.4f}" for k, v in before.items()), flush=True)
    replies_before, ids = greedy_ours(sets, None, prompts, args.tokens, args.backend, args.threads)
    show("base", prompts, replies_before)

    run_dir = out / "run"
    t0 = time.perf_counter()
    train("dpo", steps=args.steps, backend=args.backend, threads=args.threads, sets=sets, out=str(run_dir),
          progress=sys.stderr.isatty())
    train_s = time.perf_counter() - t0
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    after = {k[len("eval_"):]: v for k, v in last.items() if k.startswith("eval_")}
    print(f"trained {args.steps} steps in {train_s:.0f} s; last held-out eval: "
          + ", ".join(f"{k} {v:.4f}" for k, v in after.items()), flush=True)
    replies_after, _ = greedy_ours(sets, run_dir / "checkpoint.gguf", prompts, args.tokens, args.backend, args.threads)
    show("dpo", prompts, replies_after)

    fused = run_dir / f"fused-{args.fuse_type}.gguf"
    subprocess.run([sys.executable, "-m", "toyharness.cli", "fuse", str(run_dir), "--type", args.fuse_type,
                    "--out", str(fused)], check=True)
    replies_cpp = None
    if args.tool and Path(args.tool).with_name("th_generate").is_file():
        replies_cpp = greedy_llamacpp(args.tool, fused, ids, args.tokens, sets)
        show("llama.cpp", prompts, replies_cpp)
    else:
        print("llama.cpp: no th_generate (build it: python native/build.py --llamacpp-tool; then --tool PATH or "
              "TOYHARNESS_LLAMACPP_TOOL): its row is left out", flush=True)

    n = len(held)
    table = [("base (step 0), ours", before, replies_before),
             (f"dpo ({args.steps} steps), ours", after, replies_after)]
    if replies_cpp is not None:
        table.append((f"dpo fused {args.fuse_type}, llama.cpp", None, replies_cpp))
    print(f"\nSmolLM2-135M-Instruct Q4_1, dpo on {n_train} pairs "
          f"({args.backend}, {args.precision}, t_batch {args.t_batch}, lr {args.lr:g}, beta {args.beta:g}, "
          f"rank {args.rank}, targets {args.targets}); {n} held-out prompts, greedy, {args.tokens} tokens")
    print(f"{'model':34} {'eval acc':>8} {'margin':>8} {'logp ch':>8} {'logp rej':>8} {'prefixed':>9} {'answer':>7}")
    for label, ev, replies in table:
        pref, ans = count(replies, held)
        cells = (f"{ev['rewards/accuracies']:8.3f} {ev['rewards/margins']:8.3f} {ev['logps/chosen']:8.2f} "
                 f"{ev['logps/rejected']:8.2f}" if ev else f"{'-':>8} {'-':>8} {'-':>8} {'-':>8}")
        print(f"{label:34} {cells} {pref:4}/{n:<4} {ans:3}/{n:<3}")
    print(f"({time.perf_counter() - t_start:.0f} s in all; the run, its pairs and the fused file in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
