"""toyharness: small, deterministic training experiments on ggml, gated by bit-exact golden losses.

The public API: what a recipe plugin imports, all from ``toyharness`` itself. Each name loads its
module on first use, so ``import toyharness`` stays light (no native library is loaded by it).

Recipes
    `Recipe`        the base of any recipe: default ``options``, ``hp``, ``step``, ``evaluate``
                    and ``export`` hooks, and every attribute a recipe may declare (``name``,
                    ``options_class``, ``golden_config``, ``golden_steps``, ``golden_sets``,
                    ``golden_variants``, ``bench_sets``, ``gguf_metadata``) with its default.
                    A minimal recipe sets ``options_class`` and implements ``realize``.
    `LMRecipe`      a `Recipe` for language models: supply ``init_params``, ``forward`` and
                    ``gguf_metadata``; data, loss, evaluation, export and sampling are shared.
    `hookimpl`      the marker of a hook implementation (``@hookimpl def realize(...)``); the
                    hooks are documented in toyharness/hookspecs.py.

Options
    `Options`       the keys every recipe reads (batch, seed, init scale, the AdamW row and its
                    schedule, the loop, data, portable, precision, log); a recipe's options
                    dataclass derives from it. ``Options.validate`` is the method a recipe
                    extends to check its values; ``Options.invalid(key, reason)`` makes the error.
    `TextOptions`   `Options` plus ``t_seq`` and ``eval_batches``, the keys of the core text data
                    that a recipe without a ``load_data`` hook trains on.
    `LMOptions`     `TextOptions` plus the language models' keys (``tokenizer``,
                    ``mask_prompt``, ``pack``, ``weight_dtype``).
    `probability`   a field in [0, 1), e.g. a dropout rate: ``dropout: float = probability(0.0)``.
    `choice`        a field restricted to a set of values: ``choice("cosine", ("constant", "cosine"))``.
    `positive`      a size or count that must be > 0: ``d_model: int = positive(128)``.
    `InputError`    the error for bad input (a bad option value, a bad file): one line, exit 2.

Building a model
    `blocks`        the engine's building blocks (linear, layer_norm, rms_norm, attention, MLPs,
                    recomputed_block) over `Tensor`s.
    `Tensor`        a node of a recipe's graph: arithmetic, matmul, reshape, get_rows, ...;
                    ``x.dropout(p, name)`` is dropout whose masks repeat run to run and on resume.
    `dropout_mask`  the numpy reference of those masks (shape, p, seed, forward index, name).
    `normal`        seeded init: N(0, std) of a shape, from (seed, tensor name) alone.
    `lcg_scaled`    seeded init: uniform with mean 0 and standard deviation std, likewise.
    `write_gguf`    write tensors and metadata as a GGUF file, atomically (an ``export`` hook).
    `atomic_write`  write a file atomically (an observer's or an export's own files).
    `DecoderShape`  the shape of a decoder (sizes, heads, norms, RoPE) that `llama_forward` reads.
    `Layer`         one decoder layer's shape within a `DecoderShape`.
    `llama_forward` the llama family's forward (RMSNorm, RoPE attention with grouped kv heads,
                    SwiGLU) from a `DecoderShape` and named tensors: a llama-like recipe's body.

Real models and data
    `GGUFFile`      a GGUF file, memory-mapped: its metadata and tensors in place.
    `GGUFError`     the `InputError` of a damaged or unexpected GGUF file.
    `read_model`    a llama.cpp GGUF base or donor read as a `ModelFile` (its architecture's
                    keys and tensors; a key or tensor the architecture does not read is refused).
    `ModelFile`     what `read_model` returns: the architecture, its `DecoderShape`, the tensors.
    `ARCHITECTURES` the architectures a base may be (llama, qwen2, qwen3, gemma3, phi3), by name.
    `ALL_TARGETS`   every projection an adapter may target across the architectures.
    `example_file`  a small seeded GGUF of any architecture (a base for tests and goldens).
    `seeded_model_file`  a recipe's seeded model exported as a GGUF, cached (a golden's base).
    `cached_copy_as`     a GGUF with its matrices converted to another type, cached.
    `synthetic_instruction_file`  a synthetic prompt/completion JSONL with an instruction set's
                    lengths, cached (the packed goldens' data; toyharness/data/instructions.py).
    `synthetic_preference_file`   synthetic preference pairs ({"prompt", "chosen", "rejected"})
                    as JSONL, cached (the dpo and orpo goldens' data).
    `load_preference_data`  a JSONL file of preference pairs in TRL's forms (strings, or
                    conversations through the chat template) as batches of pairs, both sides of
                    each, the prompt masked (toyharness/data/preference.py).
    `PreferenceModel`  a recipe's forward over preference pairs: each side's summed completion
                    log-probability (`PairLogps`), a loss built from them, the reference policy
                    (the recipe's ``reference_params``: in the step's graph or precomputed), and
                    per-step metrics; its step and evaluate return ``{"loss", **metrics}``.
    `PairLogps`     the per-pair tensors a preference loss is built from (toyharness/preference.py).
    `LanguageModel` a recipe's forward wrapped with inputs, loss and trainer on one program.
    `load_image_data`    image data (the embedded 8x8 digits, or an .npz) for image recipes.
    `CONVENTIONS`   the AdamW row's conventions (``bias_corrected``, ``constant_betas``).
    `AdapterFold`   what a recipe's ``fuse_adapters`` returns: the base and each adapted tensor's
                    change, for ``toyharness fuse`` to fold into one GGUF.

Beside PyTorch
    `TorchTwin`     the base of a recipe's PyTorch twin (what ``torch_reference(options)``
                    returns) for ``bench`` and the parity tests; importing it imports torch.
    `class_loss`    the mean cross-entropy of class logits in PyTorch (a classifier twin's loss).
    `hf_model`      transformers' model of a GGUF base's architecture, loaded with its weights.
    `add_lora`      LoRA adapters on such a model, from a run's initial adapter values.

Testing a plugin
    `train`         run a recipe by name and return its summary (a test's training run).
    The pytest fixture ``toyharness_golden`` (toyharness/pytest_plugin.py) checks a recipe's
    golden from a plugin's own test suite.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "Recipe": ".recipe",
    "LMRecipe": ".lm",
    "hookimpl": ".hookspecs",
    "Options": ".options",
    "TextOptions": ".options",
    "LMOptions": ".lm",
    "choice": ".options",
    "positive": ".options",
    "probability": ".options",
    "InputError": ".errors",
    "blocks": ".engine",
    "Tensor": ".engine",
    "dropout_mask": ".engine.dropout",
    "normal": ".seeded_init",
    "lcg_scaled": ".seeded_init",
    "write_gguf": ".engine",
    "atomic_write": ".atomic",
    "train": ".runner",
    "DecoderShape": ".architectures",
    "Layer": ".architectures",
    "llama_forward": ".architectures.llama",
    "GGUFFile": ".engine",
    "GGUFError": ".errors",
    "read_model": ".architectures",
    "ModelFile": ".architectures",
    "ARCHITECTURES": ".architectures",
    "ALL_TARGETS": ".architectures",
    "example_file": ".architectures",
    "seeded_model_file": ".lm",
    "synthetic_instruction_file": ".data.instructions",
    "cached_copy_as": ".engine.gguf_io",
    "LanguageModel": ".lm",
    "synthetic_preference_file": ".data.instructions",
    "load_preference_data": ".data.preference",
    "PreferenceModel": ".preference",
    "PairLogps": ".preference",
    "load_image_data": ".images",
    "CONVENTIONS": ".adamw",
    "AdapterFold": ".merge_adapters",
    "hf_model": ".architectures.hf",
    "add_lora": ".architectures.hf",
    "TorchTwin": ".bench.torch_side",
    "class_loss": ".bench.torch_side",
}

__all__ = ["__version__", *_EXPORTS]

# names whose module imports torch (the PyTorch side of bench and parity)
NEEDS_TORCH = ("TorchTwin", "class_loss", "hf_model", "add_lora")


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'toyharness' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module, __name__), name)
    except ModuleNotFoundError as exc:
        if name in NEEDS_TORCH and exc.name in ("torch", "transformers"):
            raise ImportError(f"toyharness.{name} needs PyTorch: pip install torch transformers") from None
        raise
    globals()[name] = value      # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
