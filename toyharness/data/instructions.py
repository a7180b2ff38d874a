"""A synthetic instruction set: prompt/completion JSONL whose lengths follow an instruction-tuning
set's shape, for tests, benches and the packed goldens (no download, the same bytes everywhere).

Lengths are of a whole example (prompt + completion), in bytes, which are the byte tokenizer's
tokens: log-normal, median `median` (default 150) and log-spread `sigma` (default 0.9, so about 2%
of examples are longer than 1,000 and a few past 2,000), cut to [`shortest`, `longest`]. That is
the shape of the Stanford Alpaca set (52,002 examples; its Hugging Face data card,
tatsu-lab/alpaca, gives 47.8 MB over four text columns, a few hundred bytes an example, most
short and a long tail of long answers). The prompt takes 20-50% of an example, the completion
the rest. The text is pseudo-English from the synthetic corpus's word list.

Every draw is integer hashing (splitmix64) or the seeded streams of seeded_init, so a file is
the same on every machine and numpy.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..atomic import atomic_write
from ..seeded_init import xorshift_normal
from ..switches import cache_root
from .text import SYNTHETIC_WORDS

ALPACA_MEDIAN = 150
ALPACA_SIGMA = 0.9


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _word_stream(seed: int, n_bytes: int) -> str:
    """Pseudo-English of at least n_bytes: words of SYNTHETIC_WORDS chosen by hash."""
    words = np.array([w + " " for w in SYNTHETIC_WORDS])
    n_words = n_bytes // 3 + 16
    pick = _splitmix64(np.arange(n_words, dtype=np.uint64) + np.uint64(seed) * np.uint64(1 << 32))
    return "".join(words[(pick % np.uint64(len(words))).astype(np.int64)])


def synthetic_instructions(n: int, seed: int = 0, median: float = ALPACA_MEDIAN, sigma: float = ALPACA_SIGMA,
                           shortest: int = 8, longest: int = 4096) -> list[dict[str, str]]:
    """n prompt/completion examples (module docstring: the lengths' shape)."""
    z = xorshift_normal(seed, "synthetic instructions", n)
    lengths = np.clip(np.floor(median * np.exp(sigma * z)), shortest, longest).astype(np.int64)
    h = _splitmix64(np.arange(n, dtype=np.uint64) * np.uint64(2) + np.uint64(seed) * np.uint64(1 << 40))
    share = 0.2 + 0.3 * (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    prompt = np.maximum(1, (lengths * share).astype(np.int64))
    stream = _word_stream(seed, 1 << 20)
    room = len(stream) - longest - 1
    starts = (_splitmix64(h) % np.uint64(room)).astype(np.int64)
    out = []
    for s, lp, total in zip(starts.tolist(), prompt.tolist(), lengths.tolist()):
        text = stream[s:s + total]
        out.append({"prompt": text[:lp], "completion": text[lp:]})
    return out


def write_synthetic_instructions(path: Path, n: int, seed: int = 0, **shape) -> Path:
    rows = synthetic_instructions(n, seed, **shape)
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def synthetic_instruction_file(n: int, seed: int = 0, **shape) -> Path:
    """The set of `synthetic_instructions(n, seed, **shape)` as a JSONL file in the user cache,
    written once (the packed goldens' data)."""
    key = hashlib.sha256(repr((n, seed, sorted(shape.items()))).encode()).hexdigest()[:12]
    path = cache_root() / "data" / f"instructions-{n}-{key}.jsonl"
    if not path.is_file():
        write_synthetic_instructions(path, n, seed, **shape)
    return path


def synthetic_preferences(n: int, seed: int = 0, median: float = 16, sigma: float = 0.4, shortest: int = 8,
                          longest: int = 32) -> list[dict[str, str]]:
    """n preference pairs made from `synthetic_instructions` of those lengths: each example's
    prompt, its own completion as the chosen one and the next example's as the rejected one."""
    rows = synthetic_instructions(n, seed, median, sigma, shortest, longest)
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[(i + 1) % n]["completion"]}
            for i, r in enumerate(rows)]


def synthetic_preference_file(n: int, seed: int = 0, **shape) -> Path:
    """The pairs of `synthetic_preferences(n, seed, **shape)` as a JSONL file in the user cache,
    written once (the dpo and orpo goldens' data)."""
    key = hashlib.sha256(repr(("preferences", n, seed, sorted(shape.items()))).encode()).hexdigest()[:12]
    path = cache_root() / "data" / f"preferences-{n}-{key}.jsonl"
    if not path.is_file():
        rows = synthetic_preferences(n, seed, **shape)
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path
