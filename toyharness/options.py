"""Typed options: recipe defaults, then a TOML file, then ``--set key=value`` (later wins).

A recipe declares its options as a dataclass deriving from `Options` (the keys every recipe
reads), `TextOptions` (adds the keys of the core text data) or `toyharness.lm.LMOptions` (the
language models' keys); each field's type (and, for a closed set, `choice`; for a size that must
be > 0, `positive`) is what values are checked against. A key the class does not declare is
refused by name: a recipe's options hold exactly the keys it reads. `Options.validate`, which a
recipe extends, checks the values once they are all set. Unknown keys and bad values raise
`InputError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from .adamw import CONVENTIONS, SCHEDULES, AdamWRow, Schedule
from .discovery import recipe_name
from .engine.precision import PRECISIONS
from .errors import InputError, RecipeError, ToyharnessError
from .hookspecs import plugin_manager

# Sizes, counts and seeds beyond this are typos or hostile input (ggml's dims and our int32 ids
# cannot use them); refusing them here keeps a config from sizing an allocation.
MAX_INT = 2**31 - 1


def choice(default: Any, choices: tuple) -> Any:
    """A field whose value (each value, for a tuple) must be one of `choices`:
    ``lens: str = choice("random", ("random", "pca"))``."""
    return field(default=default, metadata={"choices": choices})


def positive(default: int) -> Any:
    """A size or count that must be > 0 (`Options.validate` refuses 0 and negatives by name):
    ``d_model: int = positive(128)``. A subclass that declares the key again with a plain default
    keeps the rule."""
    return field(default=default, metadata={"positive": True})


def probability(default: float) -> Any:
    """A rate in [0, 1) (`Options.validate` refuses a negative value, 1 or more and NaN by
    name): ``dropout: float = probability(0.0)``."""
    return field(default=default, metadata={"probability": True})


def positive_keys(cls: type, rule: str = "positive") -> list[str]:
    """The keys declared with `positive` (or `rule`: "probability") by `cls` or any options
    class it derives from."""
    keys: list[str] = []
    for klass in reversed(cls.__mro__):
        for f in getattr(klass, "__dataclass_fields__", {}).values():
            if f.metadata.get(rule) and f.name not in keys:
                keys.append(f.name)
    return keys


@dataclass
class Options:
    """The options every recipe reads: the batch, the seed and init scale, the AdamW row and its
    schedule, the loop, the data, the cpu's portable mode, the products' precision and the
    observers. A recipe derives its options class from this one (or from `TextOptions`, or
    `toyharness.LMOptions`), declaring its own keys as fields whose defaults are its defaults;
    it may declare a key of these classes again to change its default (docs/design.md, "Options").

    Extend `validate` to check values (call ``super().validate()`` first)."""

    t_batch: int = positive(8)
    seed: int = 1337
    init_scale: float = 1.0
    # the AdamW row
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # decays matrices and embeddings only (2 or more axes); biases, norms' gains and other vectors
    # step with weight_decay 0 (nanoGPT's configure_optimizers; engine/loop_controls.decays)
    weight_decay: float = 0.0
    adamw_convention: str = choice("constant_betas", CONVENTIONS)
    # constant | linear | cosine: `warmup` steps of linear warmup, then a decay to min_lr
    lr_schedule: str = choice("constant", SCHEDULES)
    warmup: int = 0
    # the decay's floor, an absolute learning rate; unset: lr/10 (nanoGPT's default min_lr)
    min_lr: float | None = None
    # micro-batches of t_batch rows per optimizer step (each process's, with devices > 1), their
    # gradients summed (1: off); a step's rows are those one batch of t_batch * accumulate holds
    accumulate: int = positive(1)
    # clip each step's gradient to this global L2 norm, as torch.nn.utils.clip_grad_norm_ (0: off)
    grad_clip: float = 0.0
    # processes a step is spread over, each computing `accumulate` micro-batches of t_batch rows
    # (started by `mpiexec -n N`): the bits of accumulate = N x accumulate in one process
    # (engine/data_parallel.py)
    devices: int = positive(1)
    # how devices > 1 combine their gradients: in_order (accumulation's bits) or
    # allreduce (MPI's sum, less traffic for full training; its order is MPI's, the bits may differ)
    gradient_reduce: str = choice("in_order", ("in_order", "allreduce"))
    # the loop
    steps: int = positive(200)
    eval_every: int = positive(50)
    checkpoint_every: int = positive(50)
    data: str = "default"
    # the cpu backend's portable golden mode: the same float32 bits on every CPU (slower)
    portable: bool = False
    # the matrix products' precision (cuda): fp32, tf32 (TF32 tensor cores), bf16 (bf16 inputs);
    # weights, AdamW and every reduction stay fp32 (engine/backend.py, Engine.set_precision)
    precision: str = choice("fp32", PRECISIONS)
    # observers (toyharness.observers entry points) that watch the run: `--log tensorboard,mlflow`
    log: tuple[str, ...] = ()

    def adamw_row(self, total_steps: int | None = None) -> AdamWRow:
        schedule = Schedule(self.lr_schedule, self.warmup, total_steps or self.steps, min_lr=self.min_lr)
        return AdamWRow(self.adamw_convention, self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, schedule)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check the values once every one is set (after defaults, TOML, --set and flags); raise
        `InputError` naming the key, e.g. ``raise self.invalid("n_ctx", "must be even, got 3")``.
        A recipe's options class extends it, calling ``super().validate()`` first. Keys declared
        with `positive` must be > 0; the base checks the AdamW row, the loop and the seed."""
        for key in positive_keys(type(self)):
            value = getattr(self, key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise self.invalid(key, f"must be > 0, got {value}")
        for key in positive_keys(type(self), "probability"):
            if not 0 <= getattr(self, key) < 1:       # NaN fails it too
                raise self.invalid(key, f"must be in [0, 1), got {getattr(self, key)}")
        for key in ("lr", "eps", "init_scale"):
            if not 0 < getattr(self, key) < math.inf:
                raise self.invalid(key, f"must be > 0 and finite, got {getattr(self, key)}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise self.invalid(key, f"must be in [0, 1), got {getattr(self, key)}")
        if not 0 <= self.weight_decay < math.inf:
            raise self.invalid("weight_decay", f"must be >= 0 and finite, got {self.weight_decay}")
        for key in ("warmup", "seed"):
            if getattr(self, key) < 0:
                raise self.invalid(key, f"must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.grad_clip < math.inf:
            raise self.invalid("grad_clip", f"must be >= 0 and finite (0: off), got {self.grad_clip}")
        if self.min_lr is not None:
            if not 0 <= self.min_lr <= self.lr:
                raise self.invalid("min_lr", f"must be in [0, lr={self.lr:g}], got {self.min_lr:g}")
            if self.lr_schedule == "constant":
                raise self.invalid("min_lr", "the constant schedule has no floor; set lr_schedule=cosine or linear "
                                   "(or leave min_lr unset)")

    @staticmethod
    def invalid(key: str, reason: str) -> InputError:
        """The error for a bad value of option `key`: ``option 'key': reason``. A config file that
        set the key is named in front of it."""
        exc = InputError(f"option {key!r}: {reason}")
        exc.key = key
        return exc


@dataclass
class TextOptions(Options):
    """`Options` plus the keys of the core text data (`toyharness.data.load_text_data`), which a
    recipe with no `load_data` hook trains on: windows of `t_seq` tokens, `eval_batches` batches
    per evaluation."""

    t_seq: int = positive(64)
    eval_batches: int = positive(4)


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
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in typing.get_args(typ):
        # an optional value (min_lr): "none" or "" unsets it, else the value's own type
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none")):
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
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
    try:
        opts = cls(**values)
        opts.validate()
    except InputError as exc:
        if source and getattr(exc, "key", None) in from_file:
            raise InputError(f"config file {source}: {exc}") from None
        raise
    except (ToyharnessError, MemoryError):
        raise
    except Exception as exc:       # a bug in the recipe's __post_init__ or validate: one line, not a traceback
        raise RecipeError(None, f"options {cls.__name__}", exc) from exc
    return opts


def validate(opts: Options) -> None:
    """`opts.validate()` (kept for callers of the module function)."""
    opts.validate()


def options_class(recipe_obj) -> type[Options]:
    """The recipe's options class (its `options` hook), checked to be an `Options` dataclass."""
    cls = plugin_manager(recipe_obj).hook.options()
    name = recipe_name(recipe_obj)
    if cls is None:
        raise InputError(f"recipe {name}: it implements no `options` hook")
    if not (isinstance(cls, type) and issubclass(cls, Options) and dataclasses.is_dataclass(cls)):
        raise InputError(f"recipe {name}: its options hook returned {cls!r}, not a dataclass deriving from "
                         "toyharness.Options")
    return cls


def resolve_options(recipe_obj, config: str | None, sets: list[str] | None, overrides: dict) -> Options:
    """The recipe's options: its defaults <- `config` (TOML) <- `sets` <- `overrides` that are not
    None, validated (`Options.validate`). An exception other than InputError from the options class
    itself (its ``__post_init__`` or ``validate``) is one line naming the recipe."""
    cls = options_class(recipe_obj)
    toml = load_toml(config) if config else {}
    try:
        return resolve(cls, toml, sets, {k: v for k, v in overrides.items() if v is not None})
    except RecipeError as exc:
        if exc.recipe:
            raise
        raise RecipeError(recipe_name(recipe_obj), exc.hook, exc.cause) from exc.cause
