"""Observers: loggers and experiment trackers found through the ``toyharness.observers`` entry
point group and enabled per run with ``--log NAME[,NAME]`` (the option ``log``).

`load_observers` turns names into observer objects before a run starts (an unknown name, or one
whose plugin cannot load, is an `InputError`, exit 2); `ObserverBus` (toyharness/observers/bus.py)
delivers the hooks of `toyharness.hookspecs.ObserverSpec` to them off the training loop. The
built-in ones, each an optional extra, are `tensorboard` (toyharness/observers/tensorboard.py) and
`mlflow` (toyharness/observers/mlflow.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import pluggy

from ..discovery import discover_observers
from ..errors import InputError
from ..hookspecs import PROJECT, ObserverSpec
from .bus import ObserverBus

__all__ = ["ObserverBus", "load_observers", "observer_manager"]


def observer_manager(name: str, obj: Any) -> pluggy.PluginManager:
    """A plugin manager holding only `obj`, so each observer's hooks are called (and fail) alone.
    A hook implementation that is not an observer hook, or takes an argument the hook does not
    have, is refused by name."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(ObserverSpec)
    try:
        pm.register(obj, name=name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise InputError(f"observer {name!r}: {' '.join(str(exc).split())}") from None
    if not pm.get_hookcallers(obj):
        raise InputError(f"observer {name!r} implements no observer hook (run_start, step_end, eval_end, "
                         f"run_end, sweep_start, sweep_end; see toyharness/hookspecs.py)")
    return pm


def load_observers(names: Sequence[str]) -> list[tuple[str, pluggy.PluginManager]]:
    """The observers `names` asks for, in order (a name given twice counts once), each made for
    this run and wrapped in its own plugin manager. Raises InputError naming an unknown observer,
    one that fails to import, or one that cannot start here (say, its library is missing)."""
    wanted = list(dict.fromkeys(n for n in names if n))
    if not wanted:
        return []
    installed = discover_observers()
    unknown = [n for n in wanted if n not in installed]
    if unknown:
        raise InputError(f"unknown observer {unknown[0]!r} (--log / option 'log'); installed: "
                         f"{', '.join(installed) or 'none'}")
    out = []
    for name in wanted:
        entry = installed[name]
        obj = entry.load()
        if inspect.isclass(obj):
            try:
                obj = obj()
            except InputError:
                raise
            except Exception as exc:
                raise InputError(f"observer {name!r} from distribution {entry.distribution} {entry.version} "
                                 f"cannot start: {type(exc).__name__}: {exc}") from None
        out.append((name, observer_manager(name, obj)))
    return out
