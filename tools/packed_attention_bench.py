"""The cost of packed attention, on the cpu or cuda: a training step (forward and backward, no AdamW) of a small
llama whose attention dominates, on rows of one long example against rows of many short examples
at the same t_seq, and the unpacked causal step beside them (a packed step's time includes making
and feeding its masks, as in a run).

    python tools/packed_attention_bench.py [--t-seq 256 1024] [--short 16] [--reps 20] [--threads 2]
        [--backend cuda --precision bf16]

On the fast cpu path a packed row's softmax and its backward start at the 16-column block of each
row's first key in its own example, and the six products of attention contract (or compute) only
over the terms inside each block of rows' examples (native/cpu_kernels.c, th_packed_range). On
cuda the fused attention walks only the tiles of each row's examples (native/cuda/th-attention.cu).
Prints the median ms of each and the ratio short/long.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def step_ms(model, batch: dict, reps: int) -> float:
    """Median ms of forward and backward, the batch's masks made and fed each time (as a run does)."""
    model.trainer.grads_only(model.feeds(batch))     # the rewrite and allocation happen here
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.trainer.grads_only(model.feeds(batch))
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t-seq", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--short", type=int, default=16, help="positions of each short example")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="n_layer=1,d_model=64,n_head=4,n_kv_head=4,d_ff=128")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"], help="cuda only")
    args = ap.parse_args()
    from toyharness.discovery import get_recipe
    from toyharness.engine import get_engine
    from toyharness.lm import LanguageModel
    from toyharness.options import resolve_options

    _, obj = get_recipe("llama")
    engine = get_engine(args.backend, args.threads)
    if args.backend == "cuda":
        engine.set_precision(args.precision)
    where = f"{args.threads} threads" if args.backend == "cpu" else f"precision {args.precision}"
    print(f"llama {args.shape}, batch {args.batch}, {where}, fingerprint {engine.fingerprint()}")
    for t in args.t_seq:
        options = resolve_options(obj, None, [*args.shape.split(","), f"t_seq={t}"], {})
        params = obj.init_params(options, 256)
        rng = np.random.default_rng(0)
        base = {"tokens": rng.integers(0, 256, (args.batch, t)).astype(np.int32),
                "targets": rng.integers(0, 256, (args.batch, t)).astype(np.int32),
                "mask": np.ones((args.batch, t), np.float32)}
        plain = LanguageModel(obj, engine, options, 256, params, batch=args.batch, masked=True)
        packed = LanguageModel(obj, engine, options, 256, params, batch=args.batch, masked=True, packed=True)
        col = np.arange(t)
        long = {"segments": np.zeros((args.batch, t), np.int32), "positions": np.tile(col, (args.batch, 1))}
        short = {"segments": np.tile(col // args.short, (args.batch, 1)).astype(np.int32),
                 "positions": np.tile(col % args.short, (args.batch, 1)).astype(np.int32)}
        ms_plain = step_ms(plain, base, args.reps)
        ms_long = step_ms(packed, {**base, **long}, args.reps)
        ms_short = step_ms(packed, {**base, **short}, args.reps)
        print(f"t_seq {t}: unpacked causal {ms_plain:.2f} ms; packed, one example a row {ms_long:.2f} ms; "
              f"packed, {t // args.short} examples of {args.short} a row {ms_short:.2f} ms "
              f"(short/long {ms_short / ms_long:.2f})")


if __name__ == "__main__":
    main()
