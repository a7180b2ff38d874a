"""Greedy decoding speed on one GGUF: toyharness with its KV cache, toyharness without (the whole
window's forward per token), and llama.cpp (native/llamacpp/th_generate, built by `nox -s llamacpp`
or `python native/build.py --llamacpp-tool`) on the same file, the same prompt and threads.

    python tools/sample_speed.py MODEL.gguf [--tokens 64] [--threads 2] [--context 256] [--llamacpp TOOL]

tokens/s counts the generation steps only (the prompt's forward excluded), each side timed the
same way; the file is read as a lora base (toyharness's own GGUF reader and forward; its
adapters at B = 0 cost two rank-8 products a layer). The greedy tokens of the three are printed
side by side (the first tokens, and whether they agree).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPT = "The three most useful things to know about the history of the bicycle are"


def ours(model: Path, tokens: int, threads: int, context: int, cache: bool,
         dequantize: bool = False) -> tuple[list[int], float, list[int]]:
    """(greedy tokens, tokens/s over the generation steps, prompt ids)."""
    from toyharness.architectures import read_model
    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options
    from toyharness.sampling import load_cached

    _, obj = get_recipe("lora")
    target = next(iter(read_model(model).arch.targets))
    opts = resolve_options(obj, None, [f"base={model}", f"targets={target}", f"t_seq={context}"], {})
    tok = obj.tokenizer(opts)
    prompt = tok.encode(PROMPT)
    vocab = read_model(model).shape.vocab
    if cache:
        m = load_cached(obj, None, opts, vocab, threads=threads, context=context, dequantize=dequantize)
        m.reset()
        logits = m.extend(prompt)
        out, t0 = [int(np.argmax(logits))], time.perf_counter()
        for _ in range(tokens - 1):
            out.append(int(np.argmax(m.extend(out[-1:]))))
        return out, (tokens - 1) / (time.perf_counter() - t0), prompt
    m = obj.load_for_sampling(None, opts, vocab, threads=threads)
    ids = list(prompt)
    buf = np.zeros((1, context), np.int32)
    out, t0 = [], None
    for i in range(tokens):
        if i == 1:
            t0 = time.perf_counter()
        buf[0, :len(ids)] = ids
        ids.append(int(np.argmax(m.next_logits(buf)[0, len(ids) - 1])))
        out.append(ids[-1])
    return out, (tokens - 1) / (time.perf_counter() - t0), prompt


def llama_cpp(tool: str, model: Path, prompt: list[int], tokens: int, threads: int) -> tuple[list[int], float]:
    gen = str(Path(tool).with_name("th_generate"))
    with tempfile.TemporaryDirectory() as tmp:
        ids = Path(tmp) / "p.ids"
        ids.write_text(" ".join(map(str, prompt)) + "\n")
        res = subprocess.run([gen, str(model), str(ids), str(tokens), str(threads)], capture_output=True, text=True,
                             timeout=600)
    if res.returncode:
        sys.exit(f"th_generate failed: {res.stderr[-2000:]}")
    out = [int(x) for x in res.stdout.split()]
    n, secs = res.stderr.strip().splitlines()[-1].split()[1:]
    return out, int(n) / float(secs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="the KV cache's positions, the no-cache window")
    ap.add_argument("--llamacpp", default=os.environ.get("TOYHARNESS_LLAMACPP_TOOL"),
                    help="th_logits' path (th_generate lies beside it); default $TOYHARNESS_LLAMACPP_TOOL")
    ap.add_argument("--no-nocache", action="store_true", help="skip the (slow) no-cache side")
    args = ap.parse_args(argv)
    print(f"{args.model.name}: greedy, {args.tokens} tokens, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.2f}")
    kv, kv_speed, prompt = ours(args.model, args.tokens, args.threads, args.context, True)
    print(f"toyharness, KV cache:    {kv_speed:7.1f} tokens/s")
    deq, deq_speed, _ = ours(args.model, args.tokens, args.threads, args.context, True, dequantize=True)
    print(f"  with --dequantize:     {deq_speed:7.1f} tokens/s; same tokens: {deq == kv}")
    if not args.no_nocache:
        full, full_speed, _ = ours(args.model, args.tokens, args.threads, args.context, False)
        print(f"toyharness, no cache:    {full_speed:7.1f} tokens/s (window {args.context}); same tokens as the "
              f"cache: {full == kv}")
    if args.llamacpp:
        lc, lc_speed = llama_cpp(args.llamacpp, args.model, prompt, args.tokens, args.threads)
        agree = next((i for i, (a, b) in enumerate(zip(kv, lc)) if a != b), min(len(kv), len(lc)))
        print(f"llama.cpp (th_generate): {lc_speed:7.1f} tokens/s; first {agree} tokens the same as ours")
    else:
        print("llama.cpp: not measured (--llamacpp or TOYHARNESS_LLAMACPP_TOOL: th_logits' path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
