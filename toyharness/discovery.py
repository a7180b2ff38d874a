"""Plugin discovery through entry points: recipes (``toyharness.recipes``) and observers
(``toyharness.observers``, toyharness/observers/).

Built-in recipes and observers are registered by this distribution's own entry points, exactly
like third-party ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any

from .errors import InputError

GROUP = "toyharness.recipes"
OBSERVER_GROUP = "toyharness.observers"


@dataclass
class RecipeEntry:
    """One entry point of a plugin group: a recipe, or an observer (`kind`)."""

    name: str
    value: str            # "module:object"
    distribution: str
    version: str
    entry_point: Any
    kind: str = "recipe"

    def load(self) -> Any:
        try:
            return self.entry_point.load()
        except Exception as exc:
            raise InputError(f"{self.kind} {self.name!r} from distribution {self.distribution} {self.version} "
                             f"failed to import ({self.value}): {type(exc).__name__}: {exc}") from exc


def discover(group: str = GROUP, kind: str = "recipe") -> dict[str, RecipeEntry]:
    """Every installed recipe (or plugin of another `group`) by name. Two distributions claiming
    one name is an error."""
    found: dict[str, RecipeEntry] = {}
    for ep in metadata.entry_points(group=group):
        dist = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        entry = RecipeEntry(ep.name, ep.value, dist, version, ep, kind)
        other = found.get(ep.name)
        if other is not None and other.distribution != dist:
            raise InputError(f"{kind} name {ep.name!r} is claimed by two distributions: "
                             f"{other.distribution} ({other.value}) and {dist} ({ep.value})")
        found[ep.name] = entry
    return dict(sorted(found.items()))


# The entry point name each loaded recipe object was found under (by id: recipe objects are
# module-level singletons), so that an error in one of its hooks can name it as the user typed it.
_LOADED_AS: dict[int, str] = {}


def get_recipe(name: str) -> tuple[RecipeEntry, Any]:
    recipes = discover()
    if name not in recipes:
        raise InputError(f"unknown recipe {name!r}; installed: {', '.join(recipes) or 'none'}")
    entry = recipes[name]
    obj = entry.load()
    _LOADED_AS[id(obj)] = name
    return entry, obj


def recipe_name(obj: Any) -> str:
    """The name a recipe object goes by in messages: its entry point's, else its ``name``
    attribute, else its class's name."""
    return _LOADED_AS.get(id(obj)) or getattr(obj, "name", "") or type(obj).__name__


def discover_observers() -> dict[str, RecipeEntry]:
    """Every installed observer (logger, experiment tracker) by name."""
    return discover(OBSERVER_GROUP, "observer")
