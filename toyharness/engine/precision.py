"""The precisions a run's matrix products can take (docs/design.md, "Precision"): the engine owns
the list (`backend.check_precision` says which backend computes which) and the options read it.
This module imports nothing, so that options can name the list without loading ggml."""

PRECISIONS = ("fp32", "tf32", "bf16")
