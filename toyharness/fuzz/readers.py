"""Every reader a user's file reaches, registered for fuzzing: one function that reads a path
(and returns, or raises the project's error), plus the valid seed files mutations start from.

See the package docstring for how to add one.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .mutate import Mutator, gguf_mutator, mutate_bytes, mutate_jsonl, mutate_npy, mutate_npz, mutate_toml

# A tiny model of each language-model recipe: seeds stay a few kB so each case is fast.
TINY_LLAMA = ("n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=64", "t_seq=8", "t_batch=2", "seed=7")
TINY_GPT2 = ("n_layer=1", "d_model=32", "n_head=2", "t_seq=8", "t_batch=2", "seed=7")


@dataclass
class Reader:
    """A reader under fuzzing. `read(path)` returns or raises; `make_seeds(workdir)` gives the
    valid inputs; `mutate` damages one (or `mutate_for_seed(seed)` gives a mutator that knows
    the seed's structure)."""

    name: str
    read: Callable[[Path], object]
    suffix: str
    mutate: Mutator = mutate_bytes
    mutate_for_seed: Callable[[bytes], Mutator] | None = None
    make_seeds: Callable[[Path], list[bytes]] | None = None
    _mutators: dict = field(default_factory=dict, repr=False)

    def seeds(self, fn: Callable[[Path], list[bytes]]) -> Callable[[Path], list[bytes]]:
        """Decorator: register the function that makes this reader's seed inputs."""
        self.make_seeds = fn
        return fn

    def mutator(self, seed: bytes) -> Mutator:
        if self.mutate_for_seed is None:
            return self.mutate
        key = id(seed)
        if key not in self._mutators:
            self._mutators[key] = self.mutate_for_seed(seed)
        return self._mutators[key]


READERS: dict[str, Reader] = {}


def reader(name: str, suffix: str, mutate: Mutator = mutate_bytes,
           mutate_for_seed: Callable[[bytes], Mutator] | None = None) -> Callable[[Callable], Reader]:
    """Decorator: register `fn(path)` as the reader `name` for files ending in `suffix`."""

    def register(fn: Callable[[Path], object]) -> Reader:
        r = Reader(name, fn, suffix, mutate, mutate_for_seed)
        READERS[name] = r
        return r

    return register


# --- GGUF: any file, a base, a donor, a resume checkpoint, a model to sample from ---------------
def _gguf_seed_files(workdir: Path) -> list[Path]:
    """A metadata-rich GGUF with tensors of several kinds, and a tiny llama model stored as
    f32, f16, bf16, q8_0, q4_0, q4_1, q5_1 and (256 wide) q4_k and q2_k (a type the engine
    refuses: its error path is fuzzed too)."""
    from ..engine.gguf_io import copy_gguf_as, write_gguf
    from ..lm import seeded_model_file

    rich = workdir / "rich.gguf"
    write_gguf(rich, "toyharness-fuzz", {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b.half": np.ones(8, np.float16),
        "c.ids": np.arange(5, dtype=np.int32)},
        {"general.name": "fuzz é", "x.count": 7, "x.neg": -3, "x.big": 2**40, "x.scale": 0.5, "x.flag": True,
         "x.words": ["a", "bc", "déf"], "x.nums": [1, 2, 3], "x.floats": [0.5, 1.5]})
    base = seeded_model_file("llama", list(TINY_LLAMA))
    files = [rich, base]
    for dtype in ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_1"):
        files.append(copy_gguf_as(base, workdir / f"base-{dtype}.gguf", dtype))
    # K-quants' blocks are 256 values wide; q2_k is a type the engine refuses (its error path)
    wide = seeded_model_file("llama", [*TINY_LLAMA, "d_model=256", "d_ff=256"])
    for dtype in ("q4_k", "q2_k"):
        files.append(copy_gguf_as(wide, workdir / f"base-{dtype}.gguf", dtype))
    return files


def _gguf_seeds(workdir: Path) -> list[bytes]:
    return [p.read_bytes() for p in _gguf_seed_files(workdir)]


@reader("gguf", ".gguf", mutate_for_seed=gguf_mutator)
def _gguf(path: Path) -> None:
    """Open, decode every metadata value, and convert every tensor of a supported type."""
    from ..engine.gguf_io import GGUFFile
    from ..engine.quant import FROZEN_BY_ID

    with GGUFFile(path) as f:
        for key in f.metadata():
            f.field(key)
        for name in f.names:
            info = f.tensor(name)
            info.to_numpy() if info.ggml_type in FROZEN_BY_ID else info.raw_bytes()


_gguf.seeds(_gguf_seeds)


@reader("lora_base", ".gguf", mutate_for_seed=gguf_mutator)
def _lora_base(path: Path) -> None:
    """lora's base: checked by read_base, then every tensor mapped into a ggml program as
    training does (mmap'd in place on cpu): where a bad file would make ggml abort."""
    from toyharness_recipes.lora import read_base

    from ..engine import GGUFFile, Program, get_engine

    base = read_base(str(path))
    prog = Program(get_engine("cpu"), capacity=1024)
    with GGUFFile(path) as f:
        for name, shape in base.tensors.items():
            info = f.tensor(name, expect_shape=shape)
            if info.dtype == "bf16":
                info.to_numpy()
            else:
                prog.frozen_gguf(f, name, expect_shape=shape)


@_lora_base.seeds
def _(workdir: Path) -> list[bytes]:
    return [p.read_bytes() for p in _gguf_seed_files(workdir)[1:]]


@reader("donor", ".gguf", mutate_for_seed=gguf_mutator)
def _donor(path: Path) -> None:
    """warm_start's donor: its embedding width and first rows."""
    from toyharness_recipes.warm_start import donor_rows

    donor_rows(str(path), vocab=64, d_in=32)


@_donor.seeds
def _(workdir: Path) -> list[bytes]:
    return [p.read_bytes() for p in _gguf_seed_files(workdir)[1:4]]


@functools.cache
def _tiny_options(recipe: str, sets: tuple[str, ...]):
    from ..discovery import get_recipe
    from ..runner import resolve_options

    _, obj = get_recipe(recipe)
    return obj, resolve_options(obj, None, list(sets), {})


@functools.cache
def _tiny_shapes(recipe: str, sets: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    obj, opts = _tiny_options(recipe, sets)
    return {name: v.shape for name, v in obj.init_params(opts, 256).items()}


@reader("checkpoint", ".gguf", mutate_for_seed=gguf_mutator)
def _checkpoint(path: Path) -> None:
    """A resume checkpoint of a tiny gpt2: step, seed, and every parameter and moment."""
    from ..run_files import read_checkpoint

    _, opts = _tiny_options("gpt2", TINY_GPT2)
    read_checkpoint(path, _tiny_shapes("gpt2", TINY_GPT2), opts.seed, opts.steps)


@_checkpoint.seeds
def _(workdir: Path) -> list[bytes]:
    from ..engine.gguf_io import write_gguf

    obj, opts = _tiny_options("gpt2", TINY_GPT2)
    state = {}
    for name, value in obj.init_params(opts, 256).items():
        state |= {name: value, f"adamw.m.{name}": value * 0.1, f"adamw.v.{name}": value * value}
    meta = {"toyharness.step": 4, "toyharness.data_position": 8, "toyharness.seed": opts.seed}
    return [write_gguf(workdir / "checkpoint.gguf", "toyharness-checkpoint", state, meta).read_bytes()]


@reader("sample_model", ".gguf", mutate_for_seed=gguf_mutator)
def _sample_model(path: Path) -> None:
    """`toyharness sample`'s model: a tiny gpt2's parameters, loaded into a forward program."""
    obj, opts = _tiny_options("gpt2", TINY_GPT2)
    obj.load_for_sampling(path, opts, 256)


@_sample_model.seeds
def _(workdir: Path) -> list[bytes]:
    from ..engine.gguf_io import write_gguf

    obj, opts = _tiny_options("gpt2", TINY_GPT2)
    return [write_gguf(workdir / "init.gguf", "toyharness-gpt2", obj.init_params(opts, 256)).read_bytes()]


# --- data -------------------------------------------------------------------------------------
@reader("token_bin", ".bin")
def _token_bin(path: Path) -> None:
    from ..data import load_text_data

    load_text_data(str(path)).check_fits(4)


@_token_bin.seeds
def _(workdir: Path) -> list[bytes]:
    return [np.arange(200, dtype=np.uint16).tobytes(), (np.arange(64, dtype=np.uint16) * 997).tobytes()]


@reader("token_npy", ".npy", mutate=mutate_npy)
def _token_npy(path: Path) -> None:
    from ..data import load_text_data

    load_text_data(str(path)).check_fits(4)


@_token_npy.seeds
def _(workdir: Path) -> list[bytes]:
    out = []
    for a in (np.arange(100, dtype=np.uint16), np.arange(50, dtype=np.uint32) * 1000):
        buf = io.BytesIO()
        np.save(buf, a)
        out.append(buf.getvalue())
    return out


@reader("text", ".txt")
def _text(path: Path) -> None:
    from ..data import load_text_data

    load_text_data(str(path)).check_fits(4)


@_text.seeds
def _(workdir: Path) -> list[bytes]:
    return ["the quick brown fox jumps over the lazy dog, é, 字\n".encode() * 3]


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@reader("image_npz", ".npz", mutate=mutate_npz)
def _image_npz(path: Path) -> None:
    from ..images import load_image_data

    load_image_data(str(path))


@_image_npz.seeds
def _(workdir: Path) -> list[bytes]:
    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 255, (10, 4, 4), dtype=np.uint8)
    f32 = rng.random((6, 4, 4, 3), dtype=np.float32)
    return [_npz(images=u8, labels=np.arange(10) % 3),
            _npz(images=f32, labels=np.array([0, 1, 2, 0, 1, 2], np.int64), test_images=f32[:2],
                 test_labels=np.array([1, 0], np.int32))]


@reader("batches_npz", ".npz", mutate=mutate_npz)
def _batches_npz(path: Path) -> None:
    from ..run_files import read_batches_npz

    read_batches_npz(path)


@_batches_npz.seeds
def _(workdir: Path) -> list[bytes]:
    toks = np.arange(3 * 2 * 5, dtype=np.int32).reshape(3, 2, 5)
    images = np.zeros((2, 2, 4, 4, 1), np.float32)
    return [_npz(tokens=toks, targets=toks + 1),
            _npz(images=images, cls_index=np.zeros((2, 2), np.int32), labels=np.ones((2, 2), np.int32))]


# --- configs and run folders ------------------------------------------------------------------
@reader("config_toml", ".toml", mutate=mutate_toml)
def _config_toml(path: Path) -> None:
    """--config FILE (and a run folder's config.toml on --resume): parsed, checked, resolved."""
    from ..options import read_toml
    from ..runner import resolve_options

    obj, _ = _tiny_options("gpt2", ())
    read_toml(path)
    resolve_options(obj, str(path), [], {})


@_config_toml.seeds
def _(workdir: Path) -> list[bytes]:
    user = b'n_layer = 2\nd_model = 64\nlr = 3e-4\nseed = 1\nadamw_convention = "bias_corrected"\nuntied = true\n'
    run = (b'recipe = "gpt2"\nt_seq = 16\nt_batch = 2\nweight_dtype = "f32"\nbeta2 = 0.999\n'
           b'eps = 1e-08\nlr_schedule = "cosine"\nwarmup = 2\nsteps = 10\ndata = "default"\n'
           b'ggml_version = "0.25.3"\nbackend = "cpu"\nthreads = 2\n')
    return [user, run]


@reader("metrics_jsonl", ".jsonl", mutate=mutate_jsonl)
def _metrics_jsonl(path: Path) -> None:
    """A run folder's metrics.jsonl as --resume reads it (the checkpoint covers 4 steps)."""
    from ..run_files import read_metrics

    read_metrics(path, 4)


@_metrics_jsonl.seeds
def _(workdir: Path) -> list[bytes]:
    lines = [{"step": i, "loss": 5.5 - i * 0.1, "loss_hex": "0x40b00000", "lr": 1e-3, "ms": 1.5,
              "tokens_per_s": 100.0} for i in range(6)]
    return ["".join(json.dumps(m) + "\n" for m in lines).encode()]


# --- a GGUF's tokenizer, and JSONL examples read through one ---------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer_seed_files(workdir: Path) -> list[Path]:
    """Two small vocabularies as GGUF metadata: byte-level BPE (model gpt2, with merges, special
    tokens and a chat template) and SentencePiece-style BPE (model llama, byte fallback)."""
    from ..engine.gguf_io import write_gguf
    from ..tokenizer import byte_unicode_table

    pieces = ["Ġt", "he", "Ġthe", "Ġa", "in", "er", "Ġw", "or", "ld", "Ġwor", "Ġworld", "12"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r", "Ġ w", "o r", "l d", "Ġw or", "Ġwor ld", "1 2"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe_tokens = byte_unicode_table() + pieces + specials
    bpe = workdir / "bpe.gguf"
    write_gguf(bpe, "llama", {}, {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": bpe_tokens,
        "tokenizer.ggml.token_type": [1] * (256 + len(pieces)) + [3] * len(specials),
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 256 + len(pieces) + 1,
        "tokenizer.ggml.eos_token_id": 256 + len(pieces) + 2, "tokenizer.chat_template": CHAT_TEMPLATE})
    spm_pieces = ["\u2581", "t", "h", "e", "\u2581t", "he", "\u2581the", "w", "o", "r", "l", "d", "\u2581w", "or"]
    spm_tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + spm_pieces
    spm = workdir / "spm.gguf"
    write_gguf(spm, "llama", {}, {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": spm_tokens,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(spm_pieces),
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(spm_pieces))],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True})
    return [bpe, spm]


@reader("tokenizer", ".gguf", mutate_for_seed=gguf_mutator)
def _tokenizer(path: Path) -> None:
    """A base's, donor's or `tokenizer=` GGUF's tokenizer: built, then encoding and decoding text
    with special tokens, unicode and digits."""
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    ids = tok.encode("<|im_start|>the world 12 café\n\n  wor<s>ld", add_special=True)
    tok.decode(ids)


@_tokenizer.seeds
def _(workdir: Path) -> list[bytes]:
    return [p.read_bytes() for p in _tokenizer_seed_files(workdir)]


@functools.lru_cache(maxsize=1)
def _chat_tokenizer():
    import tempfile

    from ..tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        return load_tokenizer(_tokenizer_seed_files(Path(tmp))[0])


@reader("jsonl_data", ".jsonl", mutate=mutate_jsonl)
def _jsonl_data(path: Path) -> None:
    """`data=FILE.jsonl`: text, prompt/completion and chat examples through a tokenizer with a
    chat template, padded or cut to t_seq, with their loss masks."""
    from ..data import load_jsonl

    load_jsonl(path, _chat_tokenizer(), t_seq=16, mask_prompt=True)


@_jsonl_data.seeds
def _(workdir: Path) -> list[bytes]:
    lines = [{"text": "the world"}, {"prompt": "12 ", "completion": "twelve"},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "the world"}]}]
    return [json.dumps(x).encode() + b"\n" for x in lines] + ["".join(json.dumps(x) + "\n" for x in lines).encode()]
