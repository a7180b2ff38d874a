"""Where a node came from: the recipe's line (the first stack frame outside toyharness/engine)
that made it, recorded by Tensor for every node and named by a ShapeError of an op
(`located`) and by a mode that cannot run the node (engine/graph_check.py)."""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Callable

from .._ffi import ffi
from ..errors import ShapeError

if TYPE_CHECKING:
    from .program import Program

_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def author_line() -> str | None:
    """"file:line" of the first caller outside toyharness/engine (the recipe's line that made a
    node), the path relative to the working folder where it is inside it; None if there is none."""
    f = sys._getframe(1)
    while f is not None and _in_engine(f.f_code.co_filename):
        f = f.f_back
    return None if f is None else f"{_shown_path(f.f_code.co_filename, os.getcwd())}:{f.f_lineno}"


@functools.lru_cache(maxsize=1024)
def _in_engine(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_ENGINE_DIR)


@functools.lru_cache(maxsize=1024)
def _shown_path(filename: str, cwd: str) -> str:
    """relative to the working folder where the file is inside it"""
    try:
        rel = os.path.relpath(filename, cwd)
    except ValueError:   # another drive
        return filename
    return filename if rel.startswith("..") else rel


def node_origin(prog: Program, ptr) -> str | None:
    """The recipe line that made the node `ptr` through Tensor, if it was made there."""
    origins = getattr(prog, "_node_origins", None)
    return origins.get(int(ffi.cast("uintptr_t", ptr))) if origins else None


def located(fn: Callable) -> Callable:
    """A ShapeError raised inside `fn` ends with the recipe's line that called it (once)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ShapeError as e:
            if getattr(e, "located", False):
                raise
            where = author_line()
            err = type(e)(f"{e} (at {where})" if where else str(e))
            err.located = True
            raise err from None
    return wrapper
