"""Warm start: a random-init Llama whose token embedding is warmed from a donor GGUF.

The seeds' window, in order: (1) random-init Llama (every weight trains, embeddings too);
(2) optionally `warm()` the embedding table from the donor; (3) `bake()` the training graph.
Warming after baking is an error. The embedding is `donor_d_in` wide and a trainable
projection lens maps it to `d_model`; the output is untied (`output.weight`). `lens`: random
(the init stream), or pca (its rows start as the top `d_model` principal directions of the
donor rows). AdamW row `constant_betas`. Export: a plain llama `model.gguf` whose
token_embd.weight is the embedding seen through the lens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toyharness import (
    GGUFError,
    GGUFFile,
    InputError,
    LanguageModel,
    ModelFile,
    blocks,
    choice,
    hookimpl,
    normal,
    positive,
    read_model,
)
from toyharness_recipes.llama import Llama, LlamaOptions, llama_forward, llama_shape


@dataclass
class WarmStartOptions(LlamaOptions):
    donor: str = ""              # a GGUF of any architecture lora takes, token_embd of any frozen type; empty: none
    donor_d_in: int = positive(64)
    lens: str = choice("random", ("random", "pca"))
    untied: bool = True


def read_donor(path: str) -> ModelFile:
    """The donor checked as a model of its architecture (toyharness.architectures: every key and
    tensor read or known not to change its forward), every failure named as the donor's."""
    try:
        return read_model(path, "donor")
    except GGUFError as exc:
        raise GGUFError(f"donor {exc}") from None
    except OSError as exc:
        raise GGUFError(f"donor {path}: read failure ({exc})") from None


def donor_embed_width(path: str) -> int:
    """The donor's embedding width (its architecture's `embedding_length`)."""
    return read_donor(path).shape.d_model


def donor_rows(path: str, vocab: int, d_in: int) -> np.ndarray:
    """The first `vocab` rows of the donor's token_embd.weight as its own forward sees them (times
    its architecture's embedding scale: gemma3's sqrt(d_model), else 1), as f32: any frozen type
    (f32, f16, bf16, q8_0 ... q6_k), only those rows dequantized."""
    donor = read_donor(path)
    width = donor.shape.d_model
    if width != d_in:
        raise GGUFError(f"donor {path}: embedding width mismatch: expected donor_d_in {d_in}, got {width}")
    if donor.shape.vocab < vocab:
        raise GGUFError(f"donor {path}: vocabulary of {donor.shape.vocab} rows is smaller than the model's {vocab}")
    with GGUFFile(path) as f:
        try:      # any frozen type (engine/quant.py), only the rows the model uses dequantized
            rows = f.tensor("token_embd.weight").to_numpy(rows=vocab)
        except GGUFError as exc:
            raise GGUFError(f"donor {exc}") from None
        except (OSError, ValueError) as exc:
            raise GGUFError(f"donor {path}: read failure on token_embd.weight ({exc})") from None
    if donor.shape.embed_scale != 1.0:
        rows = (rows * np.float32(donor.shape.embed_scale)).astype(np.float32)
    return rows


def pca_lens(rows: np.ndarray, d_model: int) -> np.ndarray:
    """(d_model, d_in): the top principal directions of the centred rows (float64 SVD)."""
    if d_model > rows.shape[1]:
        raise InputError(f"lens=pca needs d_model <= donor_d_in, got {d_model} > {rows.shape[1]}")
    centred = rows.astype(np.float64) - rows.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    vt *= np.sign(vt[:, :1] + (vt[:, :1] == 0))      # a fixed sign per direction: deterministic
    return vt[:d_model].astype(np.float32)


class WarmStartWindow:
    """init -> warm (optional) -> bake. The parameters can be changed only before bake."""

    def __init__(self, recipe: WarmStart, o: WarmStartOptions, vocab: int):
        self.recipe, self.options, self.vocab = recipe, o, vocab
        self.params = recipe.init_params(o, vocab)
        self.baked = False

    def warm(self) -> None:
        if self.baked:
            raise InputError("warm_start: warm() called outside its window: the training graph is already baked")
        o = self.options
        rows = donor_rows(o.donor, self.vocab, o.donor_d_in)
        self.params["token_embd.weight"] = rows
        if o.lens == "pca":
            self.params["lens.weight"] = pca_lens(rows, o.d_model)

    def bake(self, engine, masked: bool = False, packed: bool = False) -> LanguageModel:
        self.baked = True
        return LanguageModel(self.recipe, engine, self.options, self.vocab, self.params, masked=masked,
                             packed=packed)


class WarmStart(Llama):
    name = "warm_start"
    options_class = WarmStartOptions
    golden_sets = ["n_kv_head=1", "d_ff=48", "donor_d_in=24"]
    golden_variants: dict[str, list[str]] = {}      # not llama's packed one

    def torch_reference(self, options):
        """Its PyTorch twin (`bench` beside PyTorch, the parity tests); torch loads only here."""
        from .torch_twins.warm_start import WarmStartTwin

        return WarmStartTwin(options)

    def init_params(self, o: WarmStartOptions, vocab: int) -> dict[str, np.ndarray]:
        if not o.untied:
            raise InputError("warm_start: option 'untied' must be true (the embedding is donor_d_in wide)")
        P = super().init_params(o, vocab)
        P["token_embd.weight"] = normal(o.seed, "token_embd.weight", (vocab, o.donor_d_in), 0.02 * o.init_scale)
        P["lens.weight"] = normal(o.seed, "lens.weight", (o.d_model, o.donor_d_in),
                                  o.init_scale / np.sqrt(o.donor_d_in))
        return P

    def forward(self, P, tokens, positions, o: WarmStartOptions):
        h = blocks.lens(P["token_embd.weight"].get_rows(tokens), P["lens.weight"])
        return llama_forward(P, h, positions, llama_shape(o.n_layer, o.d_model, o.n_head, o.n_kv_head, o.d_ff,
                                                          P["token_embd.weight"].shape[0]))

    def tokenizer_file(self, o: WarmStartOptions) -> str:
        """The data is read with the donor's tokenizer, so embedding row i is token i's; the vocabulary
        is then the donor's (bytes for donors the harness made)."""
        if o.donor and o.tokenizer and o.tokenizer != o.donor:
            raise InputError("warm_start reads its data with the donor's tokenizer: leave option 'tokenizer' unset")
        if o.donor:
            donor_embed_width(o.donor)       # a missing or bad donor is named as a donor first
        return o.donor or o.tokenizer

    @hookimpl
    def realize(self, engine, options, data):
        window = WarmStartWindow(self, options, self.vocab_for(options, data.vocab))
        if options.donor:
            window.warm()
        return window.bake(engine, masked=getattr(data, "masked", False), packed=getattr(data, "packed", False))

    def export_tensors(self, params, o: WarmStartOptions):
        out = {k: v for k, v in params.items() if k != "lens.weight"}
        out["token_embd.weight"] = params["token_embd.weight"] @ params["lens.weight"].T
        return super().export_tensors(out, o)

    def gguf_metadata(self, o, vocab):
        arch, meta = super().gguf_metadata(o, vocab)
        return arch, {**meta, "general.name": "toyharness-warm_start"}


recipe = WarmStart()
