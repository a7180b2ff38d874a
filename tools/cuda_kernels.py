"""A training step on cuda, kernel by kernel: ours and PyTorch eager's, side by side.

    python tools/cuda_kernels.py RECIPE SIZE [--torch] [--precision P] [--torch-compile]
                                                              e.g.  gpt2 gpt2-small --torch --precision bf16

Runs 3 warm-up steps of the recipe at `toyharness bench --size SIZE`, then 3 steps under
torch.profiler (CUPTI), which records every kernel of the process: ggml-cuda's, cuBLAS's and ours
(native/cuda). CUDA graphs are off in this process so that each launch is seen. `--torch` does
the same for the PyTorch eager step of the recipe's twin (fused AdamW) after ours.
`--precision` runs both sides at that precision (ours: the recipe's `precision` option; PyTorch's
as `bench --precision` sets it up: TF32 products for tf32, bf16 autocast for bf16), and
`--torch-compile` compiles the twin's module as `bench` does for bf16 (nanoGPT's defaults).
Prints ms per step by kernel name, largest first, and the total. Needs a cuda build of
toyharness and PyTorch with cuda (the GPU machine of tools/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"      # read at the first cuda compute

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from toyharness.bench import realize_for_bench, size_sets  # noqa: E402
from toyharness.bench.torch_side import twin_for, twin_step  # noqa: E402
from toyharness.discovery import get_recipe  # noqa: E402
from toyharness.runner import batch_for  # noqa: E402

STEPS = 3


def kernel_table(prof, title: str, rows: int) -> None:
    found = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            found.append((us / STEPS / 1e3, e.count // STEPS, e.key))
    found.sort(reverse=True)
    print(f"== {title}: {sum(ms for ms, _, _ in found):.2f} ms a step in kernels")
    for ms, count, name in found[:rows]:
        print(f"{ms:8.2f} ms {count:5d}x  {name[:110]}")


def ours(recipe: str, size: str, rows: int, precision: str, extra: list[str] | None = None) -> None:
    sets = size_sets(recipe, size, [*(extra or []), f"precision={precision}"])
    pm, opts, data, engine, model = realize_for_bench(recipe, "cuda", 4, sets)

    def step(i: int) -> None:
        pm.hook.step(model=model, batch=batch_for(data, "train", i, opts), hp=pm.hook.hp(options=opts, step=i))

    for i in range(3):
        step(i)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(STEPS):
            step(3 + i)
        torch.cuda.synchronize()
    kernel_table(prof, f"toyharness {recipe} {size} {precision}", rows)


def pytorch(recipe: str, size: str, rows: int, precision: str, compiled: bool) -> None:
    pm, opts, data, engine, model = realize_for_bench(recipe, "cpu", 2, size_sets(recipe, size))
    opts = dataclasses.replace(opts, precision=precision)     # PyTorch's precision; ours was built at fp32 on cpu
    dev = torch.device("cuda")
    twin = twin_for(get_recipe(recipe)[1], opts)       # the recipe's PyTorch twin, stepped as bench does
    params = twin.parameters({n: model.trainer.prog.read(t) for n, t in model.trainer.prog.params.items()}, dev)
    step, _ = twin_step(twin, params, opts, dev, "compile" if compiled else "eager")
    batch = {k: torch.from_numpy(v).to(dev) for k, v in batch_for(data, "train", 0, opts).items()}
    for _ in range(3):
        step(batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step(batch)
        torch.cuda.synchronize()
    mode = "torch.compile" if compiled else "eager"
    kernel_table(prof, f"PyTorch {mode} {recipe} {size} {precision}", rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("size", help="a bench size: default, nano, gpt2-small")
    ap.add_argument("--torch", action="store_true", help="PyTorch eager's step too")
    ap.add_argument("--rows", type=int, default=30, help="kernels listed (largest first)")
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32", help="both sides' precision")
    ap.add_argument("--torch-compile", action="store_true", help="the twin's module under torch.compile, as bench")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of ours (e.g. lora's base); PyTorch's side does not take it")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_kernels.py: PyTorch sees no cuda device", file=sys.stderr)
        return 2
    ours(args.recipe, args.size, args.rows, args.precision, args.set)
    if args.precision == "bf16":
        from toyharness._ffi import ffi, lib

        converted, reused = ffi.new("int64_t *"), ffi.new("int64_t *")
        lib.th_cuda_bf16_copies(converted, reused)
        print(f"== bf16 operands: {converted[0]} converted, {reused[0]} reused (this process); the kept copies "
              f"hold {lib.th_cuda_bf16_copy_bytes() / 2**20:.0f} MiB of device memory, at most "
              f"{lib.th_cuda_bf16_copy_peak_bytes() / 2**20:.0f} MiB of it in use")
    if args.torch:
        pytorch(args.recipe, args.size, args.rows, args.precision, args.torch_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
