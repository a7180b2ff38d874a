"""What every architecture module shares: the decoder's shape, the metadata reader that records
which keys a forward used, and the rule (docs/design.md, "GGUF names and architectures"): every metadata key and
tensor of a base or donor GGUF is either used by the forward or on a short list of keys known not
to change it. Anything else is refused, naming the file and the key or tensor.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

from ..engine.gguf_io import GGUFError, GGUFFile

# Keys that never change a forward: names, licence, provenance, the tokenizer (read by
# toyharness/tokenizer.py, not the forward), the training context (t_seq is ours), the vocabulary
# size (the embedding's rows are read instead), llama-quantize's notes, our own notes. `{arch}` is the file's.
KNOWN_NOT_FORWARD = (
    "general.*",
    "tokenizer.*",
    "toyharness.*",         # notes of ours (toyharness/merge_adapters.py: the run fused into a file)
    "quantize.imatrix.*",
    "{arch}.context_length",
    "{arch}.vocab_size",
    "{arch}.rope.scaling.finetuned",
)


@dataclass
class Layer:
    """What changes from one layer to the next: its rotary base and scale, its attention window."""

    rope_base: float
    rope_scale: float = 1.0                 # linear rope scaling: 1 / factor
    window: int | None = None               # sliding-window attention (gemma3's local layers)


@dataclass
class DecoderShape:
    """A decoder-only transformer as read from a GGUF: everything its forward needs beyond the
    weights. One dataclass for every architecture; each module reads the fields its keys set."""

    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab: int
    rms_eps: float
    layers: list[Layer]
    rope_dims: int                          # rotated dims per head (phi3 may rotate part of a head)
    rope_neox: bool                         # pairs (j, j + dims/2) instead of (2j, 2j+1)
    rope_factors: str | None = None         # a tensor dividing the rotation frequencies (llama3)
    embed_scale: float = 1.0                # gemma3: sqrt(d_model)
    attn_scale: float | None = None         # None: 1/sqrt(head_dim)
    max_seq: int | None = None              # longer sequences are refused (see phi3)
    max_seq_why: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_head * self.head_dim


class ModelKeys:
    """A GGUF's metadata as an architecture reads it: every key asked for is recorded, so that
    `unread()` lists what the forward did not use. Values are checked by kind and range, and a
    bad one names the file and the key."""

    def __init__(self, f: GGUFFile, arch: str):
        self.f, self.arch, self.path = f, arch, f.path
        self.read: set[str] = {"general.architecture"}

    def _get(self, name: str):
        key = name if "." in name and name.split(".")[0] in ("general", "tokenizer") else f"{self.arch}.{name}"
        self.read.add(key)
        return key, self.f.field(key)

    def has(self, name: str) -> bool:
        return self.f.field(f"{self.arch}.{name}") is not None

    def int(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        key, value = self._get(name)
        if value is None:
            if default is None:
                raise GGUFError(f"{self.path}: missing metadata key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise GGUFError(f"{self.path}: metadata {key} is {value!r}, expected an integer >= {minimum}")
        return value

    def float(self, name: str, default: float | None = None, positive: bool = True) -> float:
        key, value = self._get(name)
        if value is None:
            if default is None:
                raise GGUFError(f"{self.path}: missing metadata key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                (positive and value <= 0):
            raise GGUFError(f"{self.path}: metadata {key} is {value!r}, expected a {'positive ' * positive}number")
        return float(value)

    def str(self, name: str, default: str | None = None) -> str | None:
        key, value = self._get(name)
        if value is not None and not isinstance(value, str):
            raise GGUFError(f"{self.path}: metadata {key} is {value!r}, expected a string")
        return default if value is None else value

    def list(self, name: str) -> list | None:
        key, value = self._get(name)
        if value is not None and not isinstance(value, list):
            return [value]
        return value

    def equal(self, name: str, expected: int, why: str) -> None:
        """A key that, where present, must have the one value the forward supports."""
        key, value = self._get(name)
        if value is not None and value != expected:
            raise GGUFError(f"{self.path}: metadata {key} is {value!r}; {why} ({expected})")

    def unread(self) -> list[str]:
        known = [p.format(arch=self.arch) for p in KNOWN_NOT_FORWARD]
        return [k for k in self.f.keys if k not in self.read and not any(fnmatch.fnmatchcase(k, p) for p in known)]


def check_every_key_read(keys: ModelKeys, role: str) -> None:
    """The rule's first half: a key neither read by the forward nor known not to change it."""
    unread = keys.unread()
    if unread:
        raise GGUFError(f"{keys.path}: metadata key {unread[0]!r} is not used by toyharness's {keys.arch} forward "
                        f"and may change the model: refused as a {role} (a silent wrong forward otherwise)"
                        + (f"; also {', '.join(unread[1:4])}{' ...' if len(unread) > 4 else ''}"
                           if len(unread) > 1 else ""))


def check_every_tensor_used(f: GGUFFile, want: dict[str, tuple[int, ...]], arch: str, role: str) -> None:
    """The rule's second half: a tensor no part of the forward reads."""
    extra = [n for n in f.names if n not in want]
    if extra:
        raise GGUFError(f"{f.path}: tensor {extra[0]!r} is not used by toyharness's {arch} forward: refused as a "
                        f"{role} (a silent wrong forward otherwise)"
                        + (f"; also {', '.join(extra[1:4])}{' ...' if len(extra) > 1 else ''}" if len(extra) > 1
                           else ""))


def rope_scale(keys: ModelKeys, factors_tensor: bool) -> float:
    """llama.cpp's rope scaling for a file's full-attention layers: `linear` (frequency scale
    1/factor), `none`, or Llama 3's (a frequency table in a tensor, `rope_freqs.weight`, and no
    scale). YaRN and LongRoPE are refused by name: not implemented, so never approximated."""
    kind = keys.str("rope.scaling.type")
    has_factor = keys.has("rope.scaling.factor")
    factor = keys.float("rope.scaling.factor", 1.0) if has_factor else 1.0
    if kind in ("yarn", "longrope") or (kind is not None and kind not in ("none", "linear", "llama3")):
        raise GGUFError(f"{keys.path}: metadata {keys.arch}.rope.scaling.type is {kind!r}: not implemented "
                        f"(none, linear and llama3 are)")
    if kind == "llama3" and not factors_tensor:
        raise GGUFError(f"{keys.path}: rope scaling llama3 needs the tensor 'rope_freqs.weight', which is missing")
    if has_factor and kind in ("none", "llama3"):
        raise GGUFError(f"{keys.path}: metadata {keys.arch}.rope.scaling.factor {factor} with scaling type {kind!r}: "
                        f"contradictory, refused")
    for name in ("rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
                 "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_log_multiplier"):
        if keys.has(name):
            raise GGUFError(f"{keys.path}: metadata {keys.arch}.{name}: YaRN/LongRoPE attention scaling is not "
                            f"implemented")
    keys.read.add(f"{keys.arch}.rope.scaling.original_context_length")   # only YaRN/LongRoPE use it
    return 1.0 / factor
