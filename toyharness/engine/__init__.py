"""The engine service: ggml through cffi, shared by every recipe.

    from toyharness.engine import get_engine, blocks
    eng = get_engine("cpu", threads=2)
    prog = eng.program()

The names below load together on the first use of one of them (Program registers itself with the
backend as it is imported), not with the package: a module of the engine with no native code
(`engine.precision`, which the options read) imports without loading the native libraries.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "get_engine", "default_threads", "Program", "Trainer", "ForwardGraph", "CrossEntropy",
           "Tensor", "GGUFFile", "write_gguf", "blocks"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # not `from . import blocks`: that asks this function for `blocks` before importing it
    import toyharness.engine.blocks as blocks

    from .backend import Engine, default_threads, get_engine
    from .gguf_io import GGUFFile, write_gguf
    from .losses import CrossEntropy
    from .program import ForwardGraph, Program
    from .tensor import Tensor
    from .trainer import Trainer

    globals().update(Engine=Engine, get_engine=get_engine, default_threads=default_threads, Program=Program,
                     Trainer=Trainer, ForwardGraph=ForwardGraph, CrossEntropy=CrossEntropy, Tensor=Tensor,
                     GGUFFile=GGUFFile, write_gguf=write_gguf, blocks=blocks)
    return globals()[name]
