"""The cache of tokenized JSONL data: a second run over the same file starts from arrays.

Two levels under ``<cache>/data/`` (`toyharness.switches.cache_root`):

- ``tokens-<key>/``: the examples' flat arrays (ids, counts, offsets; examples.TokenStore), keyed
  by the file's SHA-256, the tokenizer (its vocabulary, merges, special tokens and chat template),
  `mask_prompt`, and the code that tokenizes (this package's and tokenizer.py's sources), so that
  a change to any of them tokenizes again;
- ``rows-<key>-<t_seq>-<pack>.npz``: which examples make each row (examples.layout).

Each is written to a temporary name and renamed, so a killed run leaves no half-written entry;
arrays are read with mmap, so loading costs what the file's pages cost.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..switches import cache_root
from .examples import TokenStore, layout

# what makes the key besides the inputs: these sources decide the ids and the rows
_CODE = ("jsonl.py", "chat.py", "examples.py", "cache.py", "../tokenizer.py")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_key(tokenizer) -> str:
    """What decides a tokenizer's ids: for a GGUF's, every field but the file's path."""
    if not is_dataclass(tokenizer):
        return f"{type(tokenizer).__name__}:{tokenizer.vocab_size}"
    return repr([(f.name, getattr(tokenizer, f.name)) for f in fields(tokenizer) if f.name != "source"])


def code_key() -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _CODE)).hexdigest()


def tokens_key(path: Path, tokenizer, mask_prompt: bool) -> str:
    parts = [file_sha256(path), hashlib.sha256(tokenizer_key(tokenizer).encode()).hexdigest(), str(mask_prompt),
             code_key()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _write_folder(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    for name, value in arrays.items():
        np.save(tmp / f"{name}.npy", value)
    try:
        os.replace(tmp, folder)
    except OSError:       # another process wrote it first: theirs is the same
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


def _write_npz(path: Path, arrays: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def cached_examples(path: Path, tokenizer, mask_prompt: bool, t_seq: int, pack: bool,
                    encode: Callable[[], TokenStore]) -> tuple[TokenStore, dict]:
    """The file's TokenStore and row layout, from the cache where present, else made (`encode`)
    and kept."""
    root = cache_root() / "data"
    key = tokens_key(path, tokenizer, mask_prompt)
    folder = root / f"tokens-{key}"
    names = ("ids", "counts", "offsets")
    if all((folder / f"{n}.npy").is_file() for n in names):
        store = TokenStore(*(np.load(folder / f"{n}.npy", mmap_mode="r") for n in names))
    else:
        store = encode()
        _write_folder(folder, {"ids": store.ids, "counts": store.counts, "offsets": store.offsets})
    rows_path = root / f"rows-{key}-{t_seq}-{'packed' if pack else 'rows'}.npz"
    if rows_path.is_file():
        with np.load(rows_path) as z:
            rows = {k: z[k] if z[k].ndim else int(z[k]) for k in z.files}
    else:
        rows = layout(store, t_seq, pack)
        _write_npz(rows_path, rows)
    return store, rows
