"""`toyharness bench`: a recipe's training steps timed, beside its PyTorch twin where it has one.

Any installed recipe benches: ms/step, items/s (tokens or images), peak memory (RSS on cpu; the
driver's count on a GPU), matrix-product GFLOP/s and host overhead. A recipe that supplies a PyTorch
twin (a ``torch_reference(options)`` method: toyharness/bench/torch_side.py says what it returns)
runs beside it where PyTorch is installed; otherwise the PyTorch columns are absent and the table
says why.

- config.py: the bench config of a recipe (sizes, --set, the recipe's ``bench_sets``), realized
- procs.py: the worker processes each side runs in
- run.py: the timing of ours, the driver of both sides' rounds, and a recipe's `Result`
- torch_side.py: the PyTorch side (imports torch: loaded only where a recipe runs beside PyTorch, and by parity)
- profile.py: `--profile`, our step node by node
- report.py: the command: its checks, its table and its JSON
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name from the module that holds it, imported when first asked for: importing one part
# (torch_side in a PyTorch worker, config for the CLI's parser) loads no other.
_WHERE = {
    "config": ("N_BATCHES", "SIZES", "TORCH_MODES", "bench_options", "fits_size", "has_twin", "realize_for_bench",
               "size_sets", "step_timer"),
    "procs": ("_ask", "_reply", "_spawn", "peak_rss_mb"),
    "profile": ("NodeTime", "OpTime", "Profile", "profile_recipe"),
    "run": ("DRIFT", "Result", "_ggml_worker", "bench_recipe", "cpu_round_trip_ns", "matmul_ceiling"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
