"""Data for runs: text and token arrays (`text`), JSONL examples with loss masks (`jsonl`),
chat templates (`chat`). `load_lm_data` picks by the `data=` spec and the model's tokenizer."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .jsonl import ExampleData, load_jsonl
from .text import (
    EVAL_FRACTION,
    TokenData,
    decode_bytes,
    default_corpus_bytes,
    encode_bytes,
    load_text_data,
    synthetic_corpus_bytes,
)

__all__ = ["EVAL_FRACTION", "ExampleData", "TokenData", "decode_bytes", "default_corpus_bytes", "encode_bytes",
           "load_jsonl", "load_lm_data", "load_text_data", "synthetic_corpus_bytes"]


def load_lm_data(spec: str, tokenizer, options) -> TokenData | ExampleData:
    """`data=` for a language model: JSONL examples, or text / token arrays. Text goes through
    `tokenizer` (a GGUF's) unless it is the byte tokenizer, which keeps today's byte path."""
    path = Path(spec).expanduser() if spec not in ("", "default", "synthetic") else None
    if path is not None and path.suffix == ".jsonl":
        if not path.is_file():
            raise InputError(f"data {spec!r}: no such file")
        return load_jsonl(path, tokenizer, options.t_seq, getattr(options, "mask_prompt", True),
                          pack=getattr(options, "pack", False), cache=True, progress=True)
    if getattr(options, "pack", True) is False:
        # text is one stream cut into rows of t_seq: there are no examples for a row to keep apart
        raise InputError(f"option 'pack': false keeps each JSONL example a row of its own, but data "
                         f"{spec or 'default'!r} is text (one stream cut into rows of t_seq); leave pack unset")
    data = load_text_data(spec)
    if tokenizer.byte_level:
        return data
    if data.byte_level:   # text: tokenize it with the model's tokenizer
        import numpy as np

        text = data.tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        ids = np.asarray(tokenizer.encode(text, add_special=True), np.int32)
        return TokenData(ids, tokenizer.vocab_size, data.source, False)
    if data.vocab > tokenizer.vocab_size:
        raise InputError(f"data {data.source}: token id {data.vocab - 1} is outside the tokenizer's vocabulary "
                         f"of {tokenizer.vocab_size}")
    data.vocab = tokenizer.vocab_size
    return data
