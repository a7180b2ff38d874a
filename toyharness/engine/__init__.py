"""The engine service: ggml through cffi, shared by every recipe.

    from toyharness.engine import get_engine, blocks
    eng = get_engine("cpu", threads=2)
    prog = eng.program()
"""

from . import blocks
from .backend import Engine, default_threads, get_engine
from .gguf_io import GGUFFile, write_gguf
from .losses import CrossEntropy
from .program import ForwardGraph, Program
from .tensor import Tensor
from .trainer import Trainer

__all__ = ["Engine", "get_engine", "default_threads", "Program", "Trainer", "ForwardGraph", "CrossEntropy",
           "Tensor", "GGUFFile", "write_gguf", "blocks"]
