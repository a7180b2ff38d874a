"""What `toyharness bench` runs: a recipe at its bench config (its defaults, a named size, the
recipe's own ``bench_sets``, then --set), realized on an engine, and a step timer over it."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..errors import InputError

N_BATCHES = 8          # distinct batches cycled through (same ones on both sides)
# Named model sizes (`bench --size`), laid over a recipe's bench config before its --set: the
# sizes people train small models at. nano: nanoGPT's shakespeare-char model (on a 2-core cpu, add
# --set t_batch=8); gpt2-small: GPT-2 small's body, on our byte vocabulary.
SIZES: dict[str, tuple[str, ...]] = {
    "default": (),
    "nano": ("n_layer=6", "d_model=384", "n_head=6", "t_seq=256", "t_batch=64"),
    "gpt2-small": ("n_layer=12", "d_model=768", "n_head=12", "t_seq=1024", "t_batch=8"),
}
# PyTorch's side at each precision (`bench --precision`): the modes its workers run, the first the
# one `speedup` compares with. tf32: TF32 matrix products, eager; bf16: bf16 autocast, with
# torch.compile (nanoGPT's defaults) and eager, both reported.
TORCH_MODES: dict[str, tuple[str, ...]] = {"fp32": ("eager",), "tf32": ("eager",), "bf16": ("compile", "eager")}


def has_twin(recipe_obj: Any) -> bool:
    """Whether a recipe supplies a PyTorch twin: a method ``torch_reference(options)`` returning a
    toyharness.bench.torch_side.TorchTwin (asked for only where PyTorch is installed)."""
    return callable(getattr(recipe_obj, "torch_reference", None))


def bench_options(recipe: str, sets: list[str] | None = None):
    """The recipe object and its options at the bench config with `sets` over it."""
    from ..discovery import get_recipe
    from ..runner import resolve_options

    _, obj = get_recipe(recipe)
    return obj, resolve_options(obj, None, list(getattr(obj, "bench_sets", [])) + list(sets or []), {})


def fits_size(recipe: str, size: str) -> bool:
    """Whether `recipe`'s options have every option the size preset sets."""
    _, opts = bench_options(recipe)
    return all(hasattr(opts, kv.split("=", 1)[0]) for kv in SIZES[size])


def size_sets(recipe: str, size: str, sets: list[str] | None = None) -> list[str]:
    """The --set list for `recipe` at the named size: the preset's, then `sets` (which win)."""
    from ..errors import InputError

    if size not in SIZES:
        raise InputError(f"--size {size}: unknown size; known: {', '.join(SIZES)}")
    if not fits_size(recipe, size):
        _, opts = bench_options(recipe)
        missing = [kv.split("=", 1)[0] for kv in SIZES[size] if not hasattr(opts, kv.split("=", 1)[0])]
        raise InputError(f"--size {size}: recipe {recipe} has no option {', '.join(missing)}")
    return list(SIZES[size]) + list(sets or [])


def realize_for_bench(recipe: str, backend: str, threads: int, sets: list[str] | None):
    """The recipe's model at its bench config: (plugin manager, options, data, engine, model)."""
    from ..engine import get_engine
    from ..hookspecs import plugin_manager
    from ..runner import load_data

    obj, opts = bench_options(recipe, sets)
    # bench times one optimizer step per batch beside PyTorch's plain step: the loop's controls
    # are not measured there, so they are refused rather than ignored
    for key, off in (("accumulate", 1), ("grad_clip", 0.0)):
        if getattr(opts, key, off) != off:
            raise InputError(f"option {key!r}: bench times plain steps (one batch, no clipping) beside PyTorch's; "
                             f"leave {key} at {off:g}")
    pm = plugin_manager(obj)
    data = load_data(pm, opts)
    engine = get_engine(backend, threads)
    engine.set_portable(opts.portable)
    engine.set_precision(opts.precision)
    return pm, opts, data, engine, pm.hook.realize(engine=engine, options=opts, data=data)


def step_timer(pm, opts, model, batches: list) -> Callable[[], float]:
    """A function that runs the next training step, cycling through `batches`, and returns its
    ms (the AdamW row is made outside the timing)."""
    done = 0

    def timed_step() -> float:
        nonlocal done
        row = pm.hook.hp(options=opts, step=done)
        t0 = time.perf_counter()
        pm.hook.step(model=model, batch=batches[done % len(batches)], hp=row)
        done += 1
        return (time.perf_counter() - t0) * 1e3

    return timed_step
