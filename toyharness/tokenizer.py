"""Tokenizers: the byte tokenizer (ids 0-255) and the one a GGUF carries in `tokenizer.ggml.*`.

`GGUFTokenizer` gives exactly llama.cpp's ids for the same file (tests/data/tokenizer_agreement.json
holds llama.cpp's ids for tricky texts; the `llamacpp` nox session derives them again):

- special-token strings (control, user-defined and unknown tokens) are split off first, longest
  token first, as llama.cpp's `tokenizer_st_partition` does;
- model `gpt2`: byte-level BPE (the `tokenizers` library) after llama.cpp's pre-tokenizer regexes
  for the file's `tokenizer.ggml.pre` (default, gpt2, llama-bpe, smollm, qwen2 and their aliases);
- model `llama`: SentencePiece-style BPE with byte fallback: merges ranked by the merged piece's
  score, spaces escaped as U+2581 and one prepended to each text fragment at the start or after a
  special token (`add_space_prefix`), as llama.cpp's SPM tokenizer does;
- BOS/EOS added as the file says (`tokenizer.ggml.add_bos_token`, `add_eos_token`; else llama.cpp's
  defaults for the model and pre-tokenizer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# a SentencePiece byte token's text: <0x0A>
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied one after another, each splitting
# every piece into matches and the gaps between them. Where llama.cpp runs a hand-written matcher
# for the GPT-2 pattern, that matcher also takes the trailing `\s+` alternative, written out here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    # name: (regexes, ignore_merges, add_bos by default)
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False),
    "gpt2": ((_GPT2,), False, False),
    "llama3": ((_LLAMA3,), True, True),
    "smollm": ((r"\p{N}", _GPT2), False, False),
    "qwen2": ((_QWEN2,), False, False),
}
PRE_ALIASES = {
    "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "roberta-bpe": "gpt2",
    "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "codeshell": "smollm", "exaone": "smollm",
    "minerva": "smollm",
    "stablelm2": "qwen2", "deepseek-r1-qwen": "qwen2", "hunyuan": "qwen2",
}
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                     "</s>", "<|end_of_text|>")


def byte_unicode_table() -> list[str]:
    """GPT-2's byte-to-unicode table: the token text of byte b is entry b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class ByteTokenizer:
    """Ids are the UTF-8 bytes (vocabulary 256): the default of models the harness trains from scratch."""

    vocab_size = 256
    byte_level = True
    bos_id: int | None = None
    eos_id: int | None = None
    end_ids: frozenset[int] = frozenset()
    chat_template: str | None = None
    source = "bytes"

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, keep_special: bool = False) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


@dataclass
class GGUFTokenizer:
    """The tokenizer of a GGUF file (see the module docstring)."""

    model: str                    # "gpt2" or "llama"
    tokens: list[str]
    types: list[int]
    pre: str = "default"
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None
    source: str = "<memory>"
    byte_level = False

    def __post_init__(self) -> None:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers

        if len(self.types) < len(self.tokens):
            self.types = list(self.types) + [NORMAL] * (len(self.tokens) - len(self.types))
        self.vocab_size = len(self.tokens)
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab[t] = i                 # a repeated text maps to its last id, as in llama.cpp
        self._vocab = vocab
        if self.model == "gpt2":
            name = PRE_ALIASES.get(self.pre, self.pre)
            if name not in PRE_TOKENIZERS:
                known = sorted({*PRE_TOKENIZERS, *PRE_ALIASES})
                raise InputError(f"{self.source}: pre-tokenizer {self.pre!r} is not supported; "
                                 f"supported: {', '.join(known)}")
            regexes, ignore_merges, _ = PRE_TOKENIZERS[name]
            pairs = []
            for m in self.merges:
                cut = m.find(" ", 1)         # llama.cpp splits at the first space after the first char
                if cut < 0:
                    continue
                a, b = m[:cut], m[cut + 1:]
                if a in vocab and b in vocab and a + b in vocab:
                    pairs.append((a, b))
            tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            self._byte_of = {c: b for b, c in enumerate(byte_unicode_table())}
        elif self.model == "llama":
            for i, (t, kind) in enumerate(zip(self.tokens, self.types)):
                if kind == BYTE and not _BYTE_TOKEN.fullmatch(t):
                    raise InputError(f"{self.source}: tokenizer.ggml.tokens[{i}] is a byte token (type 6) but "
                                     f"reads {t[:40]!r}, not <0xHH>")
            tok = Tokenizer(models.BPE(vocab, spm_merges(self.tokens, self.scores), byte_fallback=True))
        else:
            raise InputError(f"{self.source}: tokenizer model {self.model!r} is not supported; supported: gpt2, llama")
        self._tok = tok
        # special-token strings, longest first (llama.cpp's cache_special_tokens)
        self._specials = sorted((i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)),
                                key=lambda i: -len(self.tokens[i].encode("utf-8")))
        ends = {i for i in (self.eos_id,) if i is not None}
        ends |= {vocab[t] for t in END_OF_TURN_TEXTS if t in vocab and self.types[vocab[t]] == CONTROL}
        self.end_ids = frozenset(ends)

    @classmethod
    def from_gguf(cls, path: str | Path) -> GGUFTokenizer:
        meta = read_metadata(path, prefix="tokenizer.")
        _check_types(path, meta)
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise InputError(f"{path}: no tokenizer (no 'tokenizer.ggml.model' key)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise InputError(f"{path}: no 'tokenizer.ggml.tokens' key")
        kw = {"types": meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens),
              "chat_template": meta.get("tokenizer.chat_template"), "source": str(path)}
        if model == "gpt2":
            pre = meta.get("tokenizer.ggml.pre") or "default"
            name = PRE_ALIASES.get(pre, pre)
            bos = eos = 11                           # llama.cpp's defaults for gpt2
            add_bos = PRE_TOKENIZERS[name][2] if name in PRE_TOKENIZERS else False
            kw |= {"pre": pre, "merges": meta.get("tokenizer.ggml.merges") or []}
            if not kw["merges"]:
                raise InputError(f"{path}: a gpt2 tokenizer needs 'tokenizer.ggml.merges'")
        elif model == "llama":
            bos, eos, add_bos = 1, 2, True
            kw |= {"scores": meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                   "add_space_prefix": bool(meta.get("tokenizer.ggml.add_space_prefix", True))}
        else:
            raise InputError(f"{path}: tokenizer model {model!r} is not supported; supported: gpt2, llama")
        bos = meta.get("tokenizer.ggml.bos_token_id", bos)
        eos = meta.get("tokenizer.ggml.eos_token_id", eos)
        kw |= {"bos_id": bos if bos is not None and 0 <= bos < len(tokens) else None,
               "eos_id": eos if eos is not None and 0 <= eos < len(tokens) else None,
               "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)),
               "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
        return cls(model, tokens, **kw)

    # --- encoding --------------------------------------------------------------------------
    def _partition(self, text: str) -> list[str | int]:
        """Text split around special-token strings: raw pieces (str) and token ids (int)."""
        parts: list[str | int] = [text] if text else []
        for sid in self._specials:
            s = self.tokens[sid]
            if not s:
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or s not in p:
                    out.append(p)
                    continue
                pieces = p.split(s)
                for k, piece in enumerate(pieces):
                    if k:
                        out.append(sid)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """llama.cpp's ids for `text` (special-token strings parsed); with `add_special`, BOS/EOS
        as the file says."""
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        prev_special = True
        for part in self._partition(text):
            if isinstance(part, int):
                ids.append(part)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    part = " " + part
                part = part.replace(" ", "\u2581")
            ids.extend(self._tok.encode(part, add_special_tokens=False).ids)
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    # --- decoding --------------------------------------------------------------------------
    def token_bytes(self, i: int, keep_special: bool = False) -> bytes:
        """The bytes a token stands for (llama.cpp's token_to_piece)."""
        text, kind = self.tokens[i], self.types[i]
        if kind in (CONTROL, UNKNOWN):
            return text.encode("utf-8") if keep_special else b""
        if kind == USER_DEFINED:
            return text.encode("utf-8")
        if kind == BYTE and self.model == "llama":
            return bytes([int(text[3:5], 16)])
        if self.model == "gpt2":
            return bytes(self._byte_of.get(c, 0x3F) for c in text)
        return text.replace("\u2581", " ").encode("utf-8")

    def decode(self, ids, keep_special: bool = False) -> str:
        data = b"".join(self.token_bytes(int(i), keep_special) for i in ids)
        return data.decode("utf-8", errors="replace")


def spm_merges(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: every split (a, b) of a
    token into two tokens, ranked by the merged token's score (highest first), as llama.cpp's SPM
    tokenizer merges the adjacent pair whose concatenation scores highest. (Equal scores of two
    different merged tokens: llama.cpp takes the leftmost pair, this ranking the lower ids; real
    SentencePiece vocabularies have distinct scores.)"""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = scores or [0.0] * len(tokens)
    found = []
    for i, t in enumerate(tokens):
        if vocab[t] != i:
            continue
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                found.append((-scores[i], vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


# What each tokenizer key must hold: a damaged or foreign file is one error naming the key.
_KEY_KINDS = {"tokenizer.ggml.model": "str", "tokenizer.ggml.pre": "str", "tokenizer.chat_template": "str",
              "tokenizer.ggml.tokens": "list[str]", "tokenizer.ggml.merges": "list[str]",
              "tokenizer.ggml.token_type": "list[int]", "tokenizer.ggml.scores": "list[number]",
              "tokenizer.ggml.bos_token_id": "int", "tokenizer.ggml.eos_token_id": "int",
              "tokenizer.ggml.add_bos_token": "bool", "tokenizer.ggml.add_eos_token": "bool",
              "tokenizer.ggml.add_space_prefix": "bool"}


def _check_types(path, meta: dict) -> None:
    def ok(value, kind: str) -> bool:
        if kind.startswith("list["):
            return isinstance(value, list) and all(ok(v, kind[5:-1]) for v in value)
        if kind == "number":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, {"str": str, "bool": (bool, int)}[kind])

    for key, kind in _KEY_KINDS.items():
        if meta.get(key) is not None and not ok(meta[key], kind):
            raise InputError(f"{path}: metadata {key!r} should be {kind}, got {type(meta[key]).__name__}")


def read_metadata(path: str | Path, prefix: str = "") -> dict:
    """The metadata keys of a GGUF that start with `prefix`, decoded. GGUFFile reads the header
    itself and decodes a value only when asked (gguf-py's reader builds an array per string and
    takes seconds over a 49k-token vocabulary)."""
    from .engine.gguf_io import GGUFFile

    with GGUFFile(path) as f:
        return {key: f.field(key) for key in f.keys if key.startswith(prefix)}


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | GGUFTokenizer:
    """The tokenizer of a GGUF file, or the byte tokenizer when `path` is empty."""
    if not path:
        return ByteTokenizer()
    return GGUFTokenizer.from_gguf(path)
