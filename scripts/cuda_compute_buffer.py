"""The training graph's compute buffer as a cuda run reserves it, measured without a GPU.

    python scripts/cuda_compute_buffer.py RECIPE [--precision fp32|tf32|bf16] [--set KEY=VALUE ...]

Builds the recipe's training graph on the cpu (nothing is computed), applies the cuda rewrite
(native/cuda_rewrite.c: the fused attention and our other kernels' nodes) and the precision's
stamp (native/cuda_precision.c: at tf32 and bf16 the attention backward keeps no (B*H, T, T) dS),
and prints the bytes ggml-alloc reserves for it: what the cuda Trainer's buffer holds for that
graph (Program.reserves_rewritten). Issue 32's "never forming (B*H, T, T)": e.g.

    python scripts/cuda_compute_buffer.py llama --precision bf16 --set n_layer=2 --set d_model=2048 \
        --set n_head=32 --set n_kv_head=8 --set t_seq=4096 --set t_batch=1
"""

from __future__ import annotations

import argparse

from toyharness._ffi import ffi, lib
from toyharness.engine import get_engine
from toyharness.engine.program import PRECISION_CODES
from toyharness.hookspecs import plugin_manager
from toyharness.plugins import get_recipe
from toyharness.runner import load_data, resolve_options


def compute_buffer_bytes(recipe: str, precision: str, sets: list[str]) -> int:
    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, sets, {})
    pm = plugin_manager(obj)
    engine = get_engine("cpu")
    trainer = pm.hook.realize(engine=engine, options=options, data=load_data(pm, options)).trainer
    graph = trainer.gb_opt
    if lib.th_cuda_rewrite(graph, 3) < 0:
        raise SystemExit("the cuda rewrite refused this graph (native/cuda_rewrite.c)")
    if precision != "fp32" and lib.th_cuda_mark_precision(graph, PRECISION_CODES[precision], ffi.NULL, 0) < 0:
        raise SystemExit(f"precision {precision}: the stamp refused this graph (native/cuda_precision.c)")
    galloc, size = lib.ggml_gallocr_new(engine.buffer_type), ffi.new("size_t[1]")
    try:
        lib.ggml_gallocr_reserve_n_size(galloc, graph, ffi.NULL, ffi.NULL, size)
    finally:
        lib.ggml_gallocr_free(galloc)
        trainer.prog.close()
    return int(size[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--precision", choices=sorted(PRECISION_CODES), default="fp32")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    size = compute_buffer_bytes(args.recipe, args.precision, args.sets)
    print(f"{args.recipe} {args.precision} {' '.join(args.sets)}: compute buffer {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
