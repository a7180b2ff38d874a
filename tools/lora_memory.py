"""Where a LoRA run's resident memory goes, over a base GGUF.

    python tools/lora_memory.py BASE.gguf [--set key=value]... [--steps 2]

Realizes `lora` over BASE (default config: t_seq 256, t_batch 4, targets q,v, rank 8; --set
overrides), runs a few steps on cpu, and prints as JSON the anonymous memory (RssAnon) and the
file pages (RssFile) the program added, next to its own buffers: persistent (adapters, moments,
gradients, one-hot targets, inputs) and compute (activations). `beyond_own_mb` is the anonymous
growth beyond those buffers; a base kept as a mapped file adds nothing there (an f32 copy of it
would add 4 bytes a weight), and `beyond_own_pct_of_file` puts it against the file's size.
Own buffers are allocated in full but not all of their pages are touched, so this figure can
be below zero. Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys


def rss(kind: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {kind} in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from toyharness.discovery import get_recipe
    from toyharness.engine import get_engine
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import batch_for, load_data, resolve_options

    _, obj = get_recipe("lora")
    sets = [f"base={args.base}", "t_seq=256", "t_batch=4", "targets=q,v", "rank=8", *args.set]
    opts = resolve_options(obj, None, sets, {})
    pm = plugin_manager(obj)
    data = load_data(pm, opts)
    batches = [batch_for(data, "train", i, opts) for i in range(args.steps)]
    engine = get_engine("cpu", args.threads)
    gc.collect()
    anon0, file0 = rss("RssAnon"), rss("RssFile")
    model = pm.hook.realize(engine=engine, options=opts, data=data)
    anon_realized = rss("RssAnon")
    for i in range(args.steps):
        pm.hook.step(model=model, batch=batches[i], hp=pm.hook.hp(options=opts, step=i))
    anon1, file1 = rss("RssAnon"), rss("RssFile")
    prog = model.trainer.prog
    persistent, compute = prog.persistent_bytes(), prog.compute_buffer_bytes()
    beyond = anon1 - anon0 - persistent - compute
    size = os.path.getsize(args.base)
    mb = 1e6
    print(json.dumps({
        "base": args.base, "file_mb": size / mb, "sets": sets[1:],
        "anon_after_realize_mb": (anon_realized - anon0) / mb,
        "anon_growth_mb": (anon1 - anon0) / mb, "persistent_mb": persistent / mb, "compute_mb": compute / mb,
        "beyond_own_mb": beyond / mb, "beyond_own_pct_of_file": 100 * beyond / size,
        "file_pages_mb": (file1 - file0) / mb,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
