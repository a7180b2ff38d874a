"""A sweep's plan: the grid and the seeds expanded into points, each point's options resolved
and validated before anything runs."""

from __future__ import annotations

import itertools
import re
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..discovery import get_recipe
from ..errors import InputError
from ..hookspecs import plugin_manager
from ..options import convert, parse_set, resolve

# The file in the sweep's folder that holds its plan and each point's status and results.
SWEEP_JSON = "sweep.json"

# A point's status in sweep.json.
PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "failed"


@dataclass(frozen=True)
class Point:
    """One run of the sweep: a configuration (grid values as written) and a seed."""

    index: int
    config: tuple[tuple[str, str], ...]
    seed: int
    sets: tuple[str, ...]            # the --set list of the equivalent `toyharness run`

    @property
    def name(self) -> str:
        """The point's folder under DIR/points/: readable, and unique through its index."""
        parts = [f"{k}={_slug(v)}" for k, v in self.config] + [f"seed={self.seed}"]
        return f"{self.index:03d}_" + "_".join(parts)

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config) or "(no grid)"


def _slug(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", value).strip("-") or "-"


@dataclass
class Plan:
    """Everything a sweep runs, resolved and validated; sweep.json holds it."""

    recipe: str
    grid: dict[str, list[str]]
    seeds: list[int]
    sets: list[str]
    steps: int | None
    backend: str
    points: list[Point]
    options: list[dict[str, Any]]    # each point's resolved options, by index
    sweep_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "grid": self.grid, "seeds": self.seeds, "sets": self.sets,
                "steps": self.steps, "backend": self.backend, "sweep_id": self.sweep_id}


def _options_class(recipe: str):
    _, recipe_obj = get_recipe(recipe)
    cls = plugin_manager(recipe_obj).hook.options()
    if cls is None:
        raise InputError(f"recipe {recipe}: it implements no `options` hook")
    return cls


def _is_list_option(cls, key: str) -> bool:
    hints = typing.get_type_hints(cls)
    return key in hints and (typing.get_origin(hints[key]) is tuple or hints[key] == tuple[str, ...])


def parse_grid(items: list[str], cls) -> dict[str, list[str]]:
    """`KEY=V1,V2,...` items into {key: [values]}, in the order given. A list-valued option
    (LoRA's `targets=q,v`) separates its grid values with ';' instead: `targets=q,v;q,k,v,o`."""
    grid: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise InputError(f"--grid {item!r}: expected KEY=V1,V2,...")
        key, raw = parse_set(item)
        if key in grid:
            raise InputError(f"--grid: option {key!r} is given twice; list all its values in one --grid")
        if key == "seed":
            raise InputError("--grid: option 'seed' goes in --seeds (N seeds, or a list S1,S2,...)")
        values = [v.strip() for v in raw.split(";" if _is_list_option(cls, key) else ",")]
        if not all(values):
            raise InputError(f"--grid {item!r}: option {key!r} has an empty value")
        converted = [convert(cls, key, v) for v in values]    # names the key of an unknown or bad one
        if len(set(converted)) != len(converted):
            raise InputError(f"--grid {item!r}: option {key!r} lists a value twice")
        grid[key] = values
    return grid


def parse_seeds(text: str, base_seed: int) -> list[int]:
    """`N` (N seeds from the options' seed on: base, base+1, ...) or a list `S1,S2,...`."""
    try:
        numbers = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise InputError(f"--seeds {text!r}: expected a count N or a list S1,S2,...") from None
    if "," in text:
        seeds = numbers
    elif numbers and numbers[0] >= 1:
        seeds = list(range(base_seed, base_seed + numbers[0]))
    else:
        raise InputError(f"--seeds {text}: must be >= 1")
    if len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


def make_plan(recipe: str, grid_items: list[str], seeds: str = "1", sets: list[str] | None = None,
              steps: int | None = None, backend: str = "cpu") -> Plan:
    """Expand the grid and validate every point's options before anything runs: a bad key or
    value raises InputError naming it (and the point)."""
    cls = _options_class(recipe)
    sets = list(sets or [])
    grid = parse_grid(grid_items, cls)
    given = {parse_set(item)[0]: "--set" for item in sets} | ({"steps": "--steps"} if steps is not None else {})
    for key, flag in given.items():
        if key in grid:
            raise InputError(f"option {key!r} is both in --grid and {flag}; keep one")
    if steps is not None and steps < 1:
        raise InputError(f"--steps {steps}: must be >= 1")
    overrides = {"steps": steps} if steps is not None else {}
    base = resolve(cls, None, sets, overrides)
    seed_list = parse_seeds(str(seeds), base.seed)
    points, options = [], []
    for combo in itertools.product(*grid.values()):
        config = tuple(zip(grid, combo))
        for seed in seed_list:
            point_sets = (*sets, *(f"{k}={v}" for k, v in config), f"seed={seed}")
            point = Point(len(points), config, seed, point_sets)
            try:
                opts = resolve(cls, None, list(point_sets), overrides)
            except InputError as exc:
                raise InputError(f"point {point.label}, seed {seed}: {exc}") from None
            points.append(point)
            options.append(_jsonable(opts.to_dict()))
    return Plan(recipe, grid, seed_list, sets, steps, backend, points, options)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


