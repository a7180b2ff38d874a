"""Token data: the embedded default corpus and user corpora, with deterministic batches.

- ``default``: the help texts every CPython carries (``pydoc_data.topics``, ~465 kB of
  English), byte-level tokens (vocabulary 256).
- ``synthetic``: seeded pseudo-English (~70 kB) that is the same under every Python; the goldens use it.
- a text file, or a folder of text files (sorted by name, joined by newlines): byte-level.
- ``.bin`` (raw uint16, as nanoGPT writes) or ``.npy`` (uint16 / uint32) token arrays:
  the vocabulary is the largest id + 1.

The last 10% of tokens are the held-out split. Batch ``i`` of a split is a pure function
of (seed, split, i): resuming at step k needs only k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..arrays import load_npy
from ..errors import InputError

EVAL_FRACTION = 0.1
# Token ids size the embedding table: a damaged file's huge id must not size the model.
# The largest real vocabularies are ~2.6e5.
MAX_VOCAB = 2**24


def default_corpus_bytes() -> bytes:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


SYNTHETIC_WORDS = (
    "the of and to in is that it for as with was on be by at this are from or an which not have one all but can "
    "their has will each model data train step loss layer weight value table file number order first time small "
    "test run gate bit byte token text word line page code name").split()


def synthetic_corpus_bytes(n_words: int = 12000) -> bytes:
    """Pseudo-English from a fixed word list and our seeded LCG: the same bytes on every machine
    and Python version. The goldens train on it; the default corpus (pydoc_data.topics) changes
    with the Python version."""
    from ..seeded_init import lcg_uniform

    u = lcg_uniform(20241121, "synthetic corpus", 2 * n_words)
    words = np.array(SYNTHETIC_WORDS)[(u[0::2] * len(SYNTHETIC_WORDS)).astype(np.int64)]
    seps = np.where(u[1::2] < 0.08, ". ", np.where(u[1::2] < 0.12, ", ", " "))
    return "".join(w + s for w, s in zip(words, seps)).encode("ascii")


def encode_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode_bytes(ids) -> str:
    return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


@dataclass
class TokenData:
    tokens: np.ndarray     # int32, whole corpus
    vocab: int
    source: str
    byte_level: bool

    @property
    def split_at(self) -> int:
        return int(len(self.tokens) * (1 - EVAL_FRACTION))

    def split(self, name: str) -> np.ndarray:
        if name == "train":
            return self.tokens[: self.split_at]
        if name == "eval":
            return self.tokens[self.split_at:]
        raise InputError(f"unknown split {name!r}; allowed: train, eval")

    def check_fits(self, t_seq: int) -> None:
        for name in ("train", "eval"):
            n = len(self.split(name))
            if n < t_seq + 2:
                raise InputError(f"data {self.source}: the {name} split has {n} tokens, fewer than t_seq+2 = "
                                 f"{t_seq + 2}")

    def batch(self, split: str, index: int, t_batch: int, t_seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int32 [t_batch, t_seq]; targets are inputs shifted by one."""
        toks = self.split(split)
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
        starts = rng.integers(0, len(toks) - t_seq - 1, size=t_batch)
        x = np.stack([toks[s:s + t_seq] for s in starts]).astype(np.int32)
        y = np.stack([toks[s + 1:s + t_seq + 1] for s in starts]).astype(np.int32)
        return x, y


def load_text_data(spec: str = "default") -> TokenData:
    if spec in ("", "default"):
        return TokenData(np.frombuffer(default_corpus_bytes(), np.uint8).astype(np.int32), 256,
                         "pydoc_data.topics", True)
    if spec == "synthetic":
        return TokenData(np.frombuffer(synthetic_corpus_bytes(), np.uint8).astype(np.int32), 256, "synthetic", True)
    path = Path(spec).expanduser()
    if not path.exists():
        raise InputError(f"data {spec!r}: no such file or folder")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise InputError(f"data {spec!r}: the folder holds no files")
        raw = b"\n".join(p.read_bytes() for p in files)
        return _bytes_data(raw, str(path))
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise InputError(f"data {spec!r}: a .bin token file holds uint16 ids, but its size is odd")
        return _id_data(np.fromfile(path, dtype=np.uint16), str(path))
    if path.suffix == ".npy":
        arr = load_npy(path, "data")
        if arr.dtype not in (np.uint16, np.uint32) or arr.ndim != 1:
            raise InputError(f"data {spec!r}: expected a 1-D uint16 or uint32 token array, got {arr.dtype} "
                             f"with shape {arr.shape}")
        return _id_data(arr, str(path))
    return _bytes_data(path.read_bytes(), str(path))


def _bytes_data(raw: bytes, source: str) -> TokenData:
    if not raw:
        raise InputError(f"data {source!r}: empty")
    return TokenData(np.frombuffer(raw, np.uint8).astype(np.int32), 256, source, True)


def _id_data(ids: np.ndarray, source: str) -> TokenData:
    if ids.size == 0:
        raise InputError(f"data {source!r}: no tokens")
    if int(ids.max()) >= MAX_VOCAB:
        raise InputError(f"data {source!r}: token id {int(ids.max())} too large (ids are below {MAX_VOCAB}; "
                         f"the vocabulary, and so the model, is sized by the largest)")
    return TokenData(ids.astype(np.int32), int(ids.max()) + 1, source, False)
