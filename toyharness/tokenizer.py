"""Tokenizers: the byte tokenizer (ids 0-255) and the one a GGUF carries in `tokenizer.ggml.*`.

`GGUFTokenizer` gives exactly llama.cpp's ids for the same file (tests/data/tokenizer_agreement.json
holds llama.cpp's ids for tricky texts; the `llamacpp` nox session derives them again):

- special-token strings (control, user-defined and unknown tokens) are split off first, longest
  token first, as llama.cpp's `tokenizer_st_partition` does;
- model `gpt2`: byte-level BPE (the `tokenizers` library) after llama.cpp's pre-tokenizer regexes
  for the file's `tokenizer.ggml.pre` (default, gpt2, llama-bpe, smollm, qwen2 and their aliases);
- model `llama`: SentencePiece-style BPE with byte fallback: merges ranked by the merged piece's
  score, spaces escaped as U+2581 and one prepended to each text fragment at the start or after a
  special token (`add_space_prefix`; Gemma 3 files say false), as llama.cpp's SPM tokenizer does;
- model `gemma4`: BPE over raw UTF-8 with the file's ranked merges, spaces escaped as U+2581, the
  text split only into runs of newlines and runs of other characters, a run of newlines that is a
  token taken whole, byte fallback to <0xHH> tokens (llama.cpp's pre-tokenizer `gemma4`);
- BOS/EOS added as the file says (`tokenizer.ggml.add_bos_token`, `add_eos_token`; else llama.cpp's
  defaults for the model and pre-tokenizer; gemma4 always adds BOS, as llama.cpp forces);
- token attributes as llama.cpp derives them beyond the file's types (`_llama_cpp_attributes`):
  end-of-generation texts (<|im_end|>, <end_of_turn>, ...) made control tokens, Phi-3's special
  tokens eating the whitespace after them, and the like. These decide which strings are split off
  as special tokens, what decodes to nothing, and `end_ids`.

tests/test_tokenizer_vocabs.py checks all of this against llama.cpp's own vocabularies and expected
ids (ggml-vocab-*.gguf with .inp/.out in the pinned archive's models folder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's token attributes (llama_token_attr), derived from the types and then adjusted
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER_DEFINED, A_BYTE = 1 << 0, 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5
A_LSTRIP, A_RSTRIP = 1 << 7, 1 << 8
_ATTR_OF_TYPE = {UNKNOWN: A_UNKNOWN, UNUSED: A_UNUSED, NORMAL: A_NORMAL, CONTROL: A_CONTROL,
                 USER_DEFINED: A_USER_DEFINED, BYTE: A_BYTE}
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
# Qwen3.5's: combining marks (\p{M}) stay with the letters they follow
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# GPT-4o's (o200k; Phi-4-mini's, Llama 4's) as llama.cpp writes it: "(?=[\p{L}])([^a-z])" is any
# letter but a-z, so a lowercase non-ASCII letter counts as upper case, as in llama.cpp
_UPPER, _LOWER = r"(?=[\p{L}])(?:[^a-z])", r"(?=[\p{L}])(?:[^A-Z])"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?(?:" + _UPPER + r")*(?:" + _LOWER + r")+" + _CONTRACTIONS + r"?"
          r"|[^\r\n\p{L}\p{N}]?(?:" + _UPPER + r")+(?:" + _LOWER + r")*" + _CONTRACTIONS + r"?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    # our name: (regexes, ignore_merges, add_bos by default)
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False),
    "gpt2": ((_GPT2,), False, False),
    "llama3": ((_LLAMA3,), True, True),
    "smollm": ((r"\p{N}", _GPT2), False, False),
    "qwen2": ((_QWEN2,), False, False),
    "qwen35": ((_QWEN35,), False, False),
    "gpt4o": ((_GPT4O,), False, False),
}
# `tokenizer.ggml.pre` values as llama.cpp spells them (src/llama-vocab.cpp), and our regexes for
# each; any other value is refused by name, as llama.cpp refuses it
PRE_ALIASES = {
    "default": "default",
    "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "roberta-bpe": "gpt2",
    "llama3": "llama3", "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "codeshell": "smollm",
    "exaone": "smollm", "minerva-7b": "smollm",
    "qwen2": "qwen2", "stablelm2": "qwen2", "deepseek-r1-qwen": "qwen2", "hunyuan": "qwen2",
    "qwen35": "qwen35",
    "gpt-4o": "gpt4o", "llama4": "gpt4o", "kanana2": "gpt4o", "talkie": "gpt4o",
}
# llama.cpp's texts of end-of-generation tokens (made control tokens whatever the file's type)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
# texts llama.cpp takes as a special token's when the file names none (key: tokenizer.ggml.KEY_token_id);
# the one it finds is made a control token
SPECIAL_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# the file's keys for them (the last three: older names of the first fim keys)
SPECIAL_KEYS = {"eot": "eot", "eom": "eom", "fim_pre": "fim_pre", "fim_suf": "fim_suf", "fim_mid": "fim_mid",
                "fim_pad": "fim_pad", "fim_rep": "fim_rep", "fim_sep": "fim_sep", "prefix": "fim_pre",
                "suffix": "fim_suf", "middle": "fim_mid"}
MODELS = ("gpt2", "llama", "gemma4")


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

    model: str                    # "gpt2", "llama" or "gemma4"
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
    name: str = ""                # general.name: llama.cpp gives Phi-3's special tokens RSTRIP by it
    special_ids: dict[str, int] = field(default_factory=dict)   # eot, eom, fim_*: as the file names them
    byte_level = False

    def __post_init__(self) -> None:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers

        if len(self.types) < len(self.tokens):
            self.types = list(self.types) + [NORMAL] * (len(self.tokens) - len(self.types))
        # llama.cpp names an empty token text "[EMPTY_<id>]"
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(self.tokens)]
        self.vocab_size = len(self.tokens)
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab[t] = i                 # a repeated text maps to its last id, as in llama.cpp
        self._vocab = vocab
        if self.model not in MODELS:
            raise InputError(f"{self.source}: tokenizer model {self.model!r} is not supported; "
                             f"supported: {', '.join(MODELS)}")
        if self.model == "gpt2":
            if self.pre not in PRE_ALIASES:
                raise InputError(f"{self.source}: pre-tokenizer {self.pre!r} is not supported; "
                                 f"supported: {', '.join(sorted(PRE_ALIASES))}")
            regexes, ignore_merges, _ = PRE_TOKENIZERS[PRE_ALIASES[self.pre]]
            tok = Tokenizer(models.BPE(vocab, self._merge_pairs(), ignore_merges=ignore_merges))
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            self._byte_of = {c: b for b, c in enumerate(byte_unicode_table())}
        else:
            for i, (t, kind) in enumerate(zip(self.tokens, self.types)):
                if kind == BYTE and not _BYTE_TOKEN.fullmatch(t):
                    raise InputError(f"{self.source}: tokenizer.ggml.tokens[{i}] is a byte token (type 6) but "
                                     f"reads {t[:40]!r}, not <0xHH>")
            if self.model == "llama":
                tok = Tokenizer(models.BPE(vocab, spm_merges(self.tokens, self.scores), byte_fallback=True))
            else:
                # gemma4: the file's merges over raw UTF-8; the text is split in encode()
                self.pre, self.add_space_prefix = "gemma4", False
                tok = Tokenizer(models.BPE(vocab, self._merge_pairs(), byte_fallback=True))
        self._tok = tok
        self.attrs, self.end_ids = _llama_cpp_attributes(self)
        # special-token strings, longest first (llama.cpp's cache_special_tokens; a stable sort of ids)
        self._specials = sorted((i for i, a in enumerate(self.attrs) if a & (A_CONTROL | A_USER_DEFINED | A_UNKNOWN)),
                                key=lambda i: -len(self.tokens[i].encode("utf-8")))

    def _merge_pairs(self) -> list[tuple[str, str]]:
        """The file's merges, in rank order, as pairs (llama.cpp splits each at the first space
        after its first character); a merge whose parts or result are no token cannot apply."""
        vocab, pairs = self._vocab, []
        for m in self.merges:
            cut = m.find(" ", 1)
            if cut < 0:
                continue
            a, b = m[:cut], m[cut + 1:]
            if a in vocab and b in vocab and a + b in vocab:
                pairs.append((a, b))
        return pairs

    @classmethod
    def from_gguf(cls, path: str | Path) -> GGUFTokenizer:
        meta = read_metadata(path, prefix="tokenizer.")
        meta["general.name"] = read_metadata(path, prefix="general.name").get("general.name")
        _check_types(path, meta)
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise InputError(f"{path}: no tokenizer (no 'tokenizer.ggml.model' key)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise InputError(f"{path}: no 'tokenizer.ggml.tokens' key")
        n = len(tokens)
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if meta.get(key) is not None and len(meta[key]) < n:
                raise InputError(f"{path}: {key!r} has {len(meta[key])} entries for {n} tokens")
        kw = {"types": meta.get("tokenizer.ggml.token_type") or [NORMAL] * n,
              "chat_template": meta.get("tokenizer.chat_template"), "source": str(path),
              "name": meta.get("general.name") or ""}
        if model == "gpt2":
            pre = meta.get("tokenizer.ggml.pre") or "default"
            bos = eos = 11                           # llama.cpp's defaults for gpt2
            add_bos = PRE_TOKENIZERS[PRE_ALIASES[pre]][2] if pre in PRE_ALIASES else False
            kw |= {"pre": pre, "merges": meta.get("tokenizer.ggml.merges") or []}
        elif model == "llama":
            bos, eos, add_bos = 1, 2, True
            kw |= {"scores": meta.get("tokenizer.ggml.scores") or [0.0] * n,
                   "add_space_prefix": bool(meta.get("tokenizer.ggml.add_space_prefix", True))}
        elif model == "gemma4":
            bos = eos = None
            add_bos = True                           # llama.cpp forces it for gemma4 whatever the file says
            kw |= {"merges": meta.get("tokenizer.ggml.merges") or []}
        else:
            raise InputError(f"{path}: tokenizer model {model!r} is not supported; supported: {', '.join(MODELS)}")
        if model in ("gpt2", "gemma4") and not kw["merges"]:
            raise InputError(f"{path}: a {model} tokenizer needs 'tokenizer.ggml.merges'")

        def special(key: str, default: int | None) -> int | None:
            # llama.cpp: a default out of range is none; a key out of range leaves the default
            default = default if default is not None and 0 <= default < n else None
            value = meta.get(f"tokenizer.ggml.{key}_token_id")
            return value if value is not None and 0 <= value < n else default

        specials = {}
        for key, kind in SPECIAL_KEYS.items():
            value = special(key, specials.get(kind))
            if value is not None:
                specials[kind] = value
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) or model == "gemma4"
        kw |= {"bos_id": special("bos", bos), "eos_id": special("eos", eos), "add_bos": add_bos,
               "add_eos": bool(meta.get("tokenizer.ggml.add_eos_token", False)), "special_ids": specials}
        return cls(model, tokens, **kw)

    # --- encoding --------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Text split around special-token strings: raw pieces (str) and token ids (int), as
        llama.cpp's tokenizer_st_partition splits it (user-defined tokens even without
        parse_special; whitespace after an RSTRIP token, before an LSTRIP one, dropped)."""
        parts: list[str | int] = [text] if text else []
        for sid in self._specials:
            attr, s = self.attrs[sid], self.tokens[sid]
            if not parse_special and attr & (A_CONTROL | A_UNKNOWN):
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or s not in p:
                    out.append(p)
                    continue
                pieces = p.split(s)
                for k, piece in enumerate(pieces):
                    if k and attr & A_RSTRIP:
                        piece = piece.lstrip(_C_SPACE)
                    if k < len(pieces) - 1 and attr & A_LSTRIP:
                        piece = piece.rstrip(_C_SPACE)
                    if k:
                        out.append(sid)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """llama.cpp's ids for `text` (llama_tokenize): with `add_special`, BOS/EOS as the file
        says; with `parse_special`, control-token strings become their ids."""
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self._required(self.bos_id, "BOS"))
        prev_special = True
        for part in self._partition(text, parse_special):
            if isinstance(part, int):
                ids.append(part)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    part = " " + part
                ids.extend(self._tok.encode(part.replace(" ", "\u2581"), add_special_tokens=False).ids)
            elif self.model == "gemma4":
                for word in _GEMMA4_SPLIT.findall(part.replace(" ", "\u2581")):
                    if word[0] == "\n" and word in self._vocab:    # a run of newlines that is a token
                        ids.append(self._vocab[word])
                    else:
                        ids.extend(self._tok.encode(word, add_special_tokens=False).ids)
            else:
                ids.extend(self._tok.encode(part, add_special_tokens=False).ids)
            prev_special = False
        if add_special and self.add_eos:
            ids.append(self._required(self.eos_id, "EOS"))
        return ids

    def _required(self, tid: int | None, what: str) -> int:
        if tid is None:
            raise InputError(f"{self.source}: the tokenizer adds a {what} token but names none "
                             f"(tokenizer.ggml.{what.lower()}_token_id)")
        return tid

    # --- decoding --------------------------------------------------------------------------
    def token_bytes(self, i: int, keep_special: bool = False) -> bytes:
        """The bytes a token stands for (llama.cpp's token_to_piece): control and unknown tokens
        only with `keep_special`; unused ones never."""
        text, attr = self.tokens[i], self.attrs[i]
        if attr & (A_CONTROL | A_UNKNOWN):
            return text.encode("utf-8") if keep_special else b""
        if attr & A_USER_DEFINED:
            return text.encode("utf-8")
        if attr & A_NORMAL:
            if self.model == "gpt2":
                return bytes(self._byte_of.get(c, 0x3F) for c in text)
            return text.replace("\u2581", " ").encode("utf-8")
        if attr & A_BYTE:
            if self.model == "gpt2":
                return bytes(self._byte_of.get(c, 0x3F) for c in text)
            return bytes([int(text[3:5], 16)])
        return b""

    def decode(self, ids, keep_special: bool = False) -> str:
        data = b"".join(self.token_bytes(int(i), keep_special) for i in ids)
        return data.decode("utf-8", errors="replace")


# C's isspace in the "C" locale: what llama.cpp strips beside an LSTRIP/RSTRIP token
_C_SPACE = " \t\n\v\f\r"
# llama.cpp's gemma4 pre-tokenizer: runs of newlines and runs of anything else
_GEMMA4_SPLIT = re.compile(r"[^\n]+|\n+")


def _llama_cpp_attributes(tok: GGUFTokenizer) -> tuple[list[int], frozenset[int]]:
    """Each token's attributes and the end-of-generation ids, as llama.cpp's llama_vocab::load
    derives them from the file's types, special ids, token texts and general.name."""
    attrs = [_ATTR_OF_TYPE.get(t, 0) for t in tok.types]
    vocab, specials = tok._vocab, dict(tok.special_ids)

    def make_control(tid: int) -> None:
        attrs[tid] |= A_CONTROL

    for kind, texts in SPECIAL_TEXTS.items():
        if kind in specials:
            continue
        found = [vocab[t] for t in texts if t in vocab]
        if kind not in ("eot", "eom") and len(found) > 1 and not all(attrs[i] & A_CONTROL for i in found):
            # llama.cpp takes the first its hash map yields and makes only that one a control
            # token: not a rule we can reproduce (an eot or eom text is an end of generation,
            # made a control token below, whichever is taken)
            raise InputError(f"{tok.source}: tokens {[tok.tokens[i] for i in found]} could each be the "
                             f"{kind} token and the file names none (tokenizer.ggml.{kind}_token_id)")
        if found:
            specials[kind] = min(found)
            make_control(specials[kind])
    for tid, attr in enumerate(attrs):
        if attr & A_CONTROL and "unused" in tok.tokens[tid]:
            attrs[tid] |= A_UNUSED
    eog = {specials[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in specials}
    for text in EOG_TEXTS:
        if text in vocab:
            eog.add(vocab[text])
            make_control(vocab[text])
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):   # gpt-oss
        if text in vocab:
            attrs[vocab[text]] = A_USER_DEFINED
    eog |= {i for i in (tok.eos_id, specials.get("eot"), specials.get("eom")) if i is not None}
    texts = {tok.tokens[i]: i for i in sorted(eog)}
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                               or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
        eog.discard(texts["<|end|>"])                 # o200k_harmony and solar-open: <|end|> is no end
        attrs[texts["<|end|>"]] = A_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])                    # gemma4 and plamo: </s> is a normal token
        attrs[texts["</s>"]] = A_NORMAL
    if "phi-3" in tok.name.lower() or "phi3" in tok.name.lower():
        for tid, attr in enumerate(attrs):
            if attr & (A_CONTROL | A_USER_DEFINED | A_UNKNOWN):
                attrs[tid] |= A_RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text in vocab:
                attrs[vocab[text]] = attrs[vocab[text]] | A_RSTRIP if on else attrs[vocab[text]] & ~A_RSTRIP
    return attrs, frozenset(eog)


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
              "tokenizer.ggml.add_space_prefix": "bool", "general.name": "str",
              **{f"tokenizer.ggml.{k}_token_id": "int" for k in SPECIAL_KEYS}}


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
