"""Write a synthetic instruction set (prompt/completion JSONL) for tests and benches, and time
loading it: its tokenizing (first load) and the cached arrays (second load).

    python tools/synthetic_instructions.py OUT.jsonl [--n 100000] [--seed 0] [--median 150]
        [--sigma 0.9] [--time T_SEQ]

The lengths (bytes, the byte tokenizer's tokens) follow toyharness/data/instructions.py: log-normal,
median 150, about 2% past 1,000 (the shape of the Stanford Alpaca set; that module says more).
With --time, the file is loaded twice with pack=true at T_SEQ through a fresh cache folder next
to it, and the two load times, the rows and the padding are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--median", type=float, default=150)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--time", type=int, metavar="T_SEQ", help="time a first and a second (cached) load")
    args = ap.parse_args()
    from toyharness.data.instructions import write_synthetic_instructions

    t0 = time.perf_counter()
    write_synthetic_instructions(args.out, args.n, args.seed, median=args.median, sigma=args.sigma)
    print(f"wrote {args.out}: {args.n} examples, {args.out.stat().st_size / 1e6:.1f} MB "
          f"in {time.perf_counter() - t0:.1f} s")
    if args.time:
        cache = args.out.parent / (args.out.stem + ".cache")
        shutil.rmtree(cache, ignore_errors=True)
        os.environ["TOYHARNESS_CACHE"] = str(cache)
        from toyharness.data.jsonl import load_jsonl
        from toyharness.tokenizer import ByteTokenizer

        for which in ("first (tokenize, pack, write the cache)", "second (from the cache)"):
            t0 = time.perf_counter()
            data = load_jsonl(args.out, ByteTokenizer(), args.time, pack=True, cache=True, progress=True)
            print(f"{which}: {time.perf_counter() - t0:.3f} s")
        lengths = np.diff(np.asarray(data.store.offsets))
        print(f"{data.summary()}; example lengths: median {np.median(lengths):.0f}, "
              f"{(lengths > 1000).mean():.1%} past 1,000; tokens {len(data.store.ids):,}")


if __name__ == "__main__":
    main()
