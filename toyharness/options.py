"""Typed options: recipe defaults, then a TOML file, then ``--set key=value`` (later wins).

A recipe declares its options as a dataclass deriving from `Options`; each field's type
(and, for a closed set, ``metadata={"choices": ...}``) is what values are checked against.
Unknown keys and bad values raise `InputError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .adamw import CONVENTIONS, AdamWRow, Schedule
from .errors import InputError
from .hookspecs import plugin_manager

# The precisions a run's matrix products can take (docs/design.md, "Precision"; engine/backend.py says
# which backend computes which).
PRECISIONS = ("fp32", "tf32", "bf16")

# Sizes, counts and seeds beyond this are typos or hostile input (ggml's dims and our int32 ids
# cannot use them); refusing them here keeps a config from sizing an allocation.
MAX_INT = 2**31 - 1

# Model sizes (of the recipes that have them): each must be > 0.
SIZE_KEYS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "patch", "donor_d_in", "rank")


def choice(default: Any, choices: tuple) -> Any:
    return field(default=default, metadata={"choices": choices})


@dataclass
class Options:
    """Options every recipe has (docs/design.md, "Options")."""

    t_seq: int = 64
    t_batch: int = 8
    weight_dtype: str = choice("f32", ("f32", "f16", "bf16"))
    untied: bool = False
    qkv_bias: bool = False
    seed: int = 1337
    init_scale: float = 1.0
    # the AdamW row
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_convention: str = choice("constant_betas", CONVENTIONS)
    lr_schedule: str = choice("constant", ("constant", "cosine"))
    warmup: int = 0
    # the loop
    steps: int = 200
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    data: str = "default"
    # the cpu backend's portable golden mode: the same float32 bits on every CPU (slower)
    portable: bool = False
    # the matrix products' precision (cuda): fp32, tf32 (TF32 tensor cores), bf16 (bf16 inputs);
    # weights, AdamW and every reduction stay fp32 (engine/backend.py, Engine.set_precision)
    precision: str = choice("fp32", PRECISIONS)
    tokenizer: str = ""          # a GGUF whose tokenizer reads the data (language models); empty: bytes
    mask_prompt: bool = True     # JSONL prompt/completion and chat: the loss counts completions only
    # observers (toyharness.observers entry points) that watch the run: `--log tensorboard,mlflow`
    log: tuple[str, ...] = ()

    def adamw_row(self, total_steps: int | None = None) -> AdamWRow:
        schedule = Schedule(self.lr_schedule, self.warmup, total_steps or self.steps)
        return AdamWRow(self.adamw_convention, self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, schedule)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _allowed_keys(cls: type[Options]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def convert(cls: type[Options], key: str, raw: Any) -> Any:
    """Convert `raw` (a TOML value or a --set string) to the type of field `key`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        raise InputError(f"unknown option {key!r}; allowed: {', '.join(_allowed_keys(cls))}")
    f = fields[key]
    hints = typing.get_type_hints(cls)
    typ = hints[key]
    choices = f.metadata.get("choices")
    try:
        if typ is bool:
            if isinstance(raw, bool):
                value = raw
            elif str(raw).lower() in ("true", "1", "yes", "on"):
                value = True
            elif str(raw).lower() in ("false", "0", "no", "off"):
                value = False
            else:
                raise ValueError
        elif typ is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            value = int(raw)
        elif typ is float:
            if isinstance(raw, bool):
                raise ValueError
            value = float(raw)
        elif typ is str:
            if isinstance(raw, (list, dict, tuple)):
                raise ValueError
            value = str(raw)
        elif typing.get_origin(typ) is tuple or typ == tuple[str, ...]:
            if isinstance(raw, (list, tuple)):
                value = tuple(raw)
            else:
                value = tuple(s.strip() for s in str(raw).split(",") if s.strip())
        else:
            value = raw
    except (TypeError, ValueError, OverflowError):
        kind = getattr(typ, "__name__", str(typ))
        raise InputError(f"option {key!r}: {raw!r} is not a valid {kind}") from None
    if typ is int and abs(value) > MAX_INT:
        raise InputError(f"option {key!r}: {raw!r} is out of range (at most {MAX_INT} in size)")
    if choices is not None:
        items = value if isinstance(value, tuple) else (value,)
        bad = [v for v in items if v not in choices]
        if bad:
            raise InputError(f"option {key!r}: {bad[0]!r} is not allowed; allowed: {', '.join(map(str, choices))}")
    return value


def parse_set(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise InputError(f"--set {item!r}: expected key=value")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; every failure an InputError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {path} not found")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason = " ".join(str(exc).split())[:160]
        raise InputError(f"config file {path}: not valid TOML ({reason})") from None
    except OSError as exc:
        raise InputError(f"config file {path}: cannot read ({exc.strerror or exc})") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """The options in a TOML file (a run folder's bookkeeping keys dropped), tagged with the file
    so `resolve` can name it in an error about one of its values."""
    path = Path(path)
    data = read_toml(path)
    # config.toml of a run folder holds extra bookkeeping keys: not options.
    for extra in ("recipe", "ggml_version", "backend", "fingerprint", "threads", "toyharness_version"):
        data.pop(extra, None)
    return TomlOptions(data, source=str(path))


class TomlOptions(dict):
    """Option values read from a file, with the file's name for error messages."""

    def __init__(self, values: dict[str, Any], source: str):
        super().__init__(values)
        self.source = source


def resolve(cls: type[Options], toml: dict[str, Any] | None = None, sets: list[str] | None = None,
            overrides: dict[str, Any] | None = None) -> Options:
    """Recipe defaults <- TOML <- --set <- overrides (CLI flags such as --steps)."""
    values: dict[str, Any] = {}
    source = getattr(toml, "source", None)
    from_file: set[str] = set()
    for key, raw in (toml or {}).items():
        try:
            values[key] = convert(cls, key, raw)
        except InputError as exc:
            raise InputError(f"config file {source}: {exc}" if source else str(exc)) from None
        from_file.add(key)
    for item in sets or []:
        key, raw = parse_set(item)
        values[key] = convert(cls, key, raw)
        from_file.discard(key)
    for key, raw in (overrides or {}).items():
        values[key] = convert(cls, key, raw)
        from_file.discard(key)
    opts = cls(**values)
    try:
        validate(opts)
    except InputError as exc:
        if source and getattr(exc, "key", None) in from_file:
            raise InputError(f"config file {source}: {exc}") from None
        raise
    return opts


def _invalid(key: str, message: str) -> InputError:
    exc = InputError(message)
    exc.key = key
    return exc


def validate(opts: Options) -> None:
    positive = ["t_seq", "t_batch", "steps", "eval_every", "eval_batches", "checkpoint_every"]
    for key in positive:
        if getattr(opts, key) <= 0:
            raise _invalid(key, f"option {key!r}: must be > 0, got {getattr(opts, key)}")
    # model sizes of any recipe that has them (a 0 would build an empty tensor, divide by zero or
    # silently drop every block)
    for key in SIZE_KEYS:
        if isinstance(getattr(opts, key, None), int) and getattr(opts, key) <= 0:
            raise _invalid(key, f"option {key!r}: must be > 0, got {getattr(opts, key)}")
    for key in ("lr", "eps", "init_scale"):
        if not 0 < getattr(opts, key) < math.inf:
            raise _invalid(key, f"option {key!r}: must be > 0 and finite, got {getattr(opts, key)}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(opts, key) < 1:
            raise _invalid(key, f"option {key!r}: must be in [0, 1), got {getattr(opts, key)}")
    if not 0 <= opts.weight_decay < math.inf:
        raise _invalid("weight_decay", f"option 'weight_decay': must be >= 0 and finite, got {opts.weight_decay}")
    for key in ("warmup", "seed"):
        if getattr(opts, key) < 0:
            raise _invalid(key, f"option {key!r}: must be >= 0, got {getattr(opts, key)}")


def resolve_options(recipe_obj, config: str | None, sets: list[str] | None, overrides: dict) -> Options:
    """A recipe's options, from its `options` hook: its config.toml (or none), the --set list and
    the overrides that are not None."""
    pm = plugin_manager(recipe_obj)
    cls = pm.hook.options()
    if cls is None:
        raise InputError("the recipe implements no `options` hook")
    toml = load_toml(config) if config else {}
    return resolve(cls, toml, sets, {k: v for k, v in overrides.items() if v is not None})
