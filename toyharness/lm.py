"""What every language-model recipe shares: its options (`LMOptions`), the program around a
recipe's forward, the training step, evaluation, export and sampling. A recipe (an `LMRecipe`)
supplies three things:

- ``init_params(options, vocab) -> {gguf_name: ndarray}``  (seeded init)
- ``forward(P, tokens, positions, options) -> logits``      (composing engine blocks)
- ``gguf_metadata(options, vocab) -> (arch, {key: value})`` and, if its names differ from
  what llama.cpp expects, ``export_tensors(params, options) -> {name: ndarray}``

Parameters are named with llama.cpp's GGUF names from the start, so checkpoints,
``init.gguf`` and ``model.gguf`` share one naming.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .data import load_lm_data
from .discovery import get_recipe
from .engine import GGUFFile, Program, Tensor, get_engine, write_gguf
from .errors import InputError
from .hookspecs import hookimpl
from .options import TextOptions, choice, resolve_options
from .recipe import Recipe
from .seeded_init import with_values
from .switches import cache_root
from .tokenizer import ByteTokenizer, GGUFTokenizer, byte_unicode_table, load_tokenizer, read_metadata

# From this many classes `chunked_loss=auto` takes the chunked loss: the standard loss's four
# (rows x vocab) f32 buffers (4 GiB for Gemma 3's 262,144 classes at 1,024 rows) and its passes
# over them cost more than the chunked loss's tiles, which make the same two products over the
# output weight. Our step alone, the two alternating (tools/ab_checkouts.py --set-a
# chunked_loss=off --set-b chunked_loss=on, 2 threads, AVX-512; standard / chunked): seeded
# one-layer llama bases at 1,024 rows, vocabulary x width 2,048 x 512 1.03, 4,096 x 512 1.16,
# 8,192 x 512 1.08, 16,384 x 512 1.23, 32,000 x 2,048 1.08, 128,256 x 2,048 1.16; the whole
# SmolLM2-135M step (49,152 classes) 1.09 at 1,024 rows and 1.11 at 128; but the toy byte
# vocabulary (256 classes) 0.93, where the standard loss's buffers are small.
CHUNKED_LOSS_VOCAB = 4096


def use_chunked_loss(options, vocab: int, prog: Program) -> bool:
    """Whether a recipe with a `chunked_loss` option (auto, on, off) trains on
    Program.chunked_cross_entropy: `on` always (refused off the fast cpu path), `auto` on the
    fast cpu path from CHUNKED_LOSS_VOCAB classes; recipes without the option never."""
    want = getattr(options, "chunked_loss", "off")
    if want == "on" and not prog.cpu_kernels:
        raise InputError("chunked_loss=on: the chunked loss runs on the cpu backend's fast path only "
                         "(not on this backend or in the portable mode); set chunked_loss=off")
    return want == "on" or (want == "auto" and prog.cpu_kernels and vocab >= CHUNKED_LOSS_VOCAB)


def head_in_pieces(recipe, prog: Program) -> None:
    """The option logits_chunk on `prog`: refused for a recipe without `hidden` and `head`, else the
    program recomputes the head's pieces in the backward (cpu and cuda)."""
    if getattr(type(recipe), "hidden", LMRecipe.hidden) is LMRecipe.hidden:
        raise InputError(f"option 'logits_chunk': recipe {recipe.name} has no hidden and head to apply "
                         "the output head in pieces; leave it 0")
    prog.enable_recompute(every_block=False, option="logits_chunk")


@dataclass
class LMOptions(TextOptions):
    """`TextOptions` plus the keys every language model reads: its tokenizer, the loss mask of
    JSONL data, and the weights' type. A recipe adds its sizes and switches (untied output, q/k/v
    biases, ...) to it."""

    # a GGUF whose tokenizer reads the data; empty: bytes
    tokenizer: str = ""
    # JSONL prompt/completion and chat: the loss counts completions only
    mask_prompt: bool = True
    # JSONL data: several examples a row, each attending only to itself (toyharness/data/examples.py)
    pack: bool = True
    # the trained weights' type: f32 is the one the harness trains (a frozen base keeps its own
    # types); the key stays so that run folders' config.toml files read back
    weight_dtype: str = choice("f32", ("f32",))


class LanguageModel:
    """A recipe's forward wrapped with inputs, loss and trainer on one program."""

    def __init__(self, recipe: LMRecipe, engine, options, vocab: int, params: dict[str, np.ndarray],
                 trainable: bool = True, batch: int | None = None, seq: int | None = None, masked: bool = False,
                 packed: bool = False):
        self.recipe, self.options, self.vocab = recipe, options, vocab
        self.batch = batch or options.t_batch
        self.seq = seq or options.t_seq
        self.prog: Program = engine.program()
        if getattr(options, "recompute_blocks", False) and trainable:
            self.prog.enable_recompute()
        # the output head in pieces of this many positions (0: whole), the loss built from them
        chunk = getattr(options, "logits_chunk", 0) if trainable else 0
        if chunk:
            head_in_pieces(recipe, self.prog)
        self.P: dict[str, Tensor] = recipe.build_params(self.prog, options, vocab, params, trainable)
        self.tokens = self.prog.input("tokens", (self.batch, self.seq), "i32", upper=vocab)
        if packed:
            # rows of several examples (data/examples.py): positions restart per example and attention
            # stays within it, both fed per step (engine/packed.py)
            from .engine.packed import PackedRows

            self.prog.packed_rows = PackedRows(self.prog, self.batch, self.seq)
            self.positions = self.prog.input("positions", (self.batch, self.seq), "i32", upper=self.seq)
        else:
            self.positions = self.prog.constant("positions", np.arange(self.seq, dtype=np.int32))
        self.masked = masked
        if chunk:
            self._hidden = recipe.hidden(self.P, self.tokens, self.positions, options)
            self.logits = None               # made by next_logits where asked: the loss reads pieces
        else:
            self.logits = recipe.forward(self.P, self.tokens, self.positions, options)
        if (getattr(options, "recompute_blocks", False) and trainable and self.prog.recompute is not None
                and not self.prog.recompute.blocks):
            raise InputError(f"option 'recompute_blocks': recipe {recipe.name}'s forward here has no blocks to "
                             f"recompute (blocks.recomputed_block); set recompute_blocks=false")
        got = self._hidden.shape[:2] if chunk else self.logits.shape
        if got != ((self.batch, self.seq) if chunk else (self.batch, self.seq, vocab)):
            raise InputError(f"recipe {recipe.name}: {'hidden' if chunk else 'forward'} gave {got}, "
                             f"expected {(self.batch, self.seq) + (() if chunk else (vocab,))}")
        self.convention = options.adamw_convention
        if trainable:
            # data with a loss mask (JSONL examples): the mean over the positions that count
            mask = "mask" if masked else None
            if chunk:
                # each position's log-probability, a piece of positions at a time (text data: every
                # position counts, a mask of ones fed by `feeds`)
                logps = self.prog.head_token_logps(lambda h: recipe.head(self.P, h, options), self._hidden, vocab,
                                                   "targets", "mask", chunk)
                counted = self.prog.inputs["mask"].tensor.sum()
                self.loss = self.prog.scalar_loss(-(logps.sum() / counted), "targets.loss")
            elif use_chunked_loss(options, vocab, self.prog):
                self.loss = self.prog.chunked_cross_entropy(self.logits, "targets", mask)
            else:
                self.loss = (self.prog.masked_cross_entropy(self.logits, "targets", "mask") if masked
                             else self.prog.cross_entropy(self.logits, "targets"))
            self.trainer = self.prog.trainer(self.loss, self.convention)
        else:
            self.trainer = None
        self._logits_graph = None

    def feeds(self, batch: dict) -> dict:
        """A batch as the program's inputs: packed rows' segments become their masks."""
        if not self.masked and "mask" in self.prog.inputs and "mask" not in batch:     # logits_chunk on text
            batch = {**batch, "mask": np.ones(batch["targets"].shape, np.float32)}
        packed = self.prog.packed_rows
        if packed is None:
            return batch
        if "segments" not in batch:
            raise InputError("a model built for packed rows needs each batch's 'segments' and 'positions'")
        feeds = {k: v for k, v in batch.items() if k != "segments"}
        return {**feeds, **packed.feeds(batch["segments"], batch["positions"])}

    def step(self, batch: dict, hp) -> float:
        return self.trainer.step(self.feeds(batch), hp)

    def evaluate(self, batch: dict) -> dict:
        return {"loss": self.trainer.eval_loss(self.feeds(batch))}

    def params(self) -> dict[str, np.ndarray]:
        """Every parameter (trainable, or frozen when loaded for sampling) as numpy, by name."""
        return {name: self.prog.read(t) for name, t in {**self.prog.params, **self.prog.frozen}.items()}

    def next_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits (batch, seq, vocab) of a forward-only graph."""
        if self._logits_graph is None:
            if self.logits is None:          # logits_chunk: the whole head, for this forward only
                self.logits = self.recipe.head(self.P, self._hidden, self.options)
            self._logits_graph = self.prog.forward({"logits": self.logits})
        return self._logits_graph.run({"tokens": tokens})["logits"]


class LMRecipe(Recipe):
    """A `Recipe` for language models: subclass it, set `options_class` (an `LMOptions`) and fill
    the three parts below; data loading (text, JSONL, a GGUF's tokenizer), the model around the
    forward, its loss, evaluation, export (a llama.cpp-loadable ``model.gguf``) and sampling are
    shared."""

    name = "lm"
    options_class: type = LMOptions

    # --- what a recipe supplies ------------------------------------------------------------
    def init_params(self, options, vocab: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def forward(self, P: dict[str, Tensor], tokens: Tensor, positions: Tensor, options) -> Tensor:
        raise NotImplementedError

    def hidden(self, P: dict[str, Tensor], tokens: Tensor, positions: Tensor, options) -> Tensor | None:
        """Optional, with `head`: `forward` up to the hidden states (B, T, d) that its output
        projection reads (after the final norm), so that a loss can apply the projection to pieces
        of the positions (preference training's `logits_chunk`). None: the recipe has `forward` only."""
        return None

    def head(self, P: dict[str, Tensor], h: Tensor, options) -> Tensor:
        """With `hidden`: the output projection, logits (..., vocab) of hidden states (..., d),
        each position's its own (no norm over positions); ``forward == head(hidden)``."""
        raise NotImplementedError(f"recipe {self.name} has no head (it defines forward only)")

    def gguf_metadata(self, options, vocab: int) -> tuple[str, dict[str, Any]]:
        """llama.cpp's architecture name and its keys (sizes, norms' eps) for the exported GGUF;
        the tokenizer's keys are added by the harness."""
        raise NotImplementedError

    def export_tensors(self, params: dict[str, np.ndarray], options) -> dict[str, np.ndarray]:
        return params

    def build_params(self, prog: Program, options, vocab: int, values: dict[str, np.ndarray],
                     trainable: bool) -> dict:
        """The weights `forward` receives, made on `prog` from `values` (init or checkpoint).
        Recipes with frozen weights (a GGUF base) override this."""
        return {name: prog.param(name, value, trainable=trainable) for name, value in values.items()}

    # --- hooks (`options` and `hp` are Recipe's) ----------------------------------------------
    def tokenizer_file(self, options) -> str:
        """The GGUF whose tokenizer reads the data (`tokenizer=`; lora: its base, warm_start: its
        donor); empty for the byte tokenizer."""
        return getattr(options, "tokenizer", "")

    def tokenizer(self, options) -> ByteTokenizer | GGUFTokenizer:
        """The tokenizer of `tokenizer_file`, loaded once; bytes for models the harness made (their
        GGUF holds the byte vocabulary) and for files with no tokenizer."""
        path = self.tokenizer_file(options)
        cache = self.__dict__.setdefault("_tokenizers", {})
        if path not in cache:
            cache[path] = model_tokenizer(path)
        return cache[path]

    @hookimpl
    def load_data(self, options):
        return load_lm_data(options.data, self.tokenizer(options), options)

    def vocab_for(self, options, data_vocab: int) -> int:
        """The model's vocabulary (the data's, unless a base model fixes it)."""
        return data_vocab

    @hookimpl
    def realize(self, engine, options, data):
        vocab = self.vocab_for(options, data.vocab)
        return LanguageModel(self, engine, options, vocab, self.init_params(options, vocab),
                             masked=getattr(data, "masked", False), packed=getattr(data, "packed", False))

    @hookimpl
    def step(self, model, batch, hp):
        return model.step(batch, hp)

    @hookimpl
    def evaluate(self, model, batch):
        return model.evaluate(batch)

    @hookimpl
    def export(self, model, options, out_dir):
        return [self.write_model(Path(out_dir) / "model.gguf", model.params(), options, model.vocab)]

    def write_model(self, path: Path, params: dict[str, np.ndarray], options, vocab: int) -> Path:
        """A llama.cpp-loadable GGUF of `params` (our names) with the tokenizer metadata."""
        arch, meta = self.gguf_metadata(options, vocab)
        tok_file = self.tokenizer_file(options)
        if tok_file and not self.tokenizer(options).byte_level:     # the vocabulary it was trained on
            with GGUFFile(tok_file) as f:      # with their GGUF types, as llama.cpp reads them
                meta = {**meta, **{k: v for k, v in f.metadata().items() if k.startswith("tokenizer.")}}
        else:
            meta = {**meta, **tokenizer_metadata(vocab)}
        return write_gguf(path, arch, self.export_tensors(params, options), meta)

    # --- loading a trained model back (sampling) -----------------------------------------------
    def load_for_sampling(self, path: Path | None, options, vocab: int, backend: str = "cpu",
                          threads: int | None = None, batch: int = 1) -> LanguageModel:
        """The model from a run folder's init/checkpoint naming (our parameter names); `path`
        None: the seeded init (for lora, the base itself: its B matrices start at zero)."""
        params = self.params_for_sampling(path, options, vocab)
        vocab = self.vocab_for(options, vocab)
        return LanguageModel(self, get_engine(backend, threads), options, vocab, params, trainable=False,
                             batch=batch, seq=options.t_seq)

    def params_for_sampling(self, path: Path | None, options, vocab: int) -> dict[str, np.ndarray]:
        """The parameters a sampler runs: read from `path` by our names, each checked against the
        shape the options give it; `path` None: the seeded init."""
        expected = self.init_params(options, vocab)
        if path is None:
            return expected
        with GGUFFile(path) as f:
            unused = [n for n in f.names if n not in expected and not n.startswith(("adamw.m.", "adamw.v."))]
            if unused:     # a model option differs from the run's (bias, untied ...): never drop a tensor
                raise InputError(f"{path}: tensor {unused[0]!r} is not one these options make (the model "
                                 f"differs from the one that wrote it)")
            return {name: f.tensor(name, expect_shape=value.shape).to_numpy() for name, value in expected.items()}


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the token text of byte b is entry b."""
    return byte_unicode_table()


def model_tokenizer(path: str) -> ByteTokenizer | GGUFTokenizer:
    """`load_tokenizer`, except that a GGUF holding the harness's byte vocabulary (or none) reads
    as bytes: the ids are the same, and bytes keep the byte path (and its goldens)."""
    if not path:
        return ByteTokenizer()
    meta = read_metadata(path, prefix="tokenizer.ggml.")
    if meta.get("tokenizer.ggml.model") in (None, "none") or (
            meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.tokens") == byte_unicode_table()):
        return ByteTokenizer()
    return load_tokenizer(path)


def tokenizer_metadata(vocab: int) -> dict[str, Any]:
    """A tokenizer llama.cpp can use. Byte-level models (vocab 256) get GPT-2's byte-level BPE
    with no merges, so llama.cpp's token ids are the bytes, as ours; other vocabularies are
    pre-tokenized ids and get llama.cpp's "none" tokenizer. llama.cpp requires the merges key
    and the gguf writer drops empty arrays, so it holds one inert empty merge."""
    if vocab != 256:
        return {"tokenizer.ggml.model": "none"}
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": byte_tokens(), "tokenizer.ggml.token_type": [1] * 256,
            "tokenizer.ggml.merges": [""], "tokenizer.ggml.bos_token_id": ord("\n"),
            "tokenizer.ggml.eos_token_id": ord("\n")}




def seeded_model_file(recipe: str, sets: list[str], vocab: int = 256) -> Path:
    """A language-model recipe's seeded initial weights at `sets`, exported as its GGUF and kept
    in the cache: the same bytes on every machine, so a golden or a benchmark can use it as a
    base model without shipping one."""
    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, sets, {})
    # the training loop's controls change no initial weight: left out, so the key (the file's name)
    # stays what it was before they existed
    values = {k: v for k, v in options.to_dict().items() if k not in ("accumulate", "grad_clip", "min_lr")}
    key = hashlib.sha256(repr((recipe, sorted(values.items()), vocab)).encode()).hexdigest()[:12]
    path = cache_root() / "models" / f"{recipe}-init-{key}.gguf"
    if not path.is_file():
        with with_values():
            obj.write_model(path, obj.init_params(options, vocab), options, vocab)
    return path
