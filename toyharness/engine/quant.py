"""Frozen tensors of quantized types: which types, their blocks, checks, (de)quantization.

A base (lora) or donor (warm_start) is a llama.cpp GGUF as people have them. Its matrices keep
their file type, mmap'd and used in place on cpu (uploaded as they are elsewhere); the products
they take part in compute in f32 from the dequantized weights (native/frozen_matmul.c on cpu;
elsewhere a GET_ROWS that dequantizes into the graph, `Tensor.matmul_t`), or on cuda at precision
bf16 as bf16 from ggml-cuda's dequantizers (native/cuda/th-frozen.cu). The types are those of
llama.cpp's common quantize presets: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K. Any other type is refused before ggml sees it, naming the file, the tensor and the type.

Two dequantizers on purpose: the engine uses ggml's own (`to_float` of each type); this module's
`dequantize` is gguf-py's numpy one, an independent reading of the same blocks, used for host
copies (merged exports, the PyTorch reference, warm-start donors) and by the tests to check the
engine's products. `quantize` is ggml's own `ggml_quantize_chunk` (K-quants too), for copies of
a base in another type (`gguf_io.copy_gguf_as`) and for tests.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .._ffi import ffi, lib
from ..errors import GGUFError


@dataclass(frozen=True)
class QuantType:
    name: str          # llama.cpp's lower-case name: "q4_k"
    ggml_type: int     # enum ggml_type
    block: int         # values per block (1 for f32/f16/bf16)
    block_bytes: int   # bytes per block

    def row_bytes(self, n: int) -> int:
        return n // self.block * self.block_bytes


def _table() -> dict[str, QuantType]:
    ids = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7,
           "q4_k": 12, "q5_k": 13, "q6_k": 14}
    return {name: QuantType(name, t, int(lib.ggml_blck_size(t)), int(lib.ggml_type_size(t))) for name, t in ids.items()}


# The frozen types, by name; FROZEN_BY_ID by enum ggml_type.
FROZEN: dict[str, QuantType] = _table()
FROZEN_BY_ID: dict[int, QuantType] = {q.ggml_type: q for q in FROZEN.values()}
FROZEN_NAMES = tuple(FROZEN)


def type_name(ggml_type: int) -> str:
    """llama.cpp's lower-case name of any ggml type ("q4_k", "iq2_xs"), frozen or not."""
    if ggml_type in FROZEN_BY_ID:
        return FROZEN_BY_ID[ggml_type].name
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name.lower()
    except ValueError:
        return f"ggml_type_{ggml_type}"


def check_frozen(path, tensor: str, ggml_type: int, shape: tuple[int, ...] | None = None) -> QuantType:
    """The type of a tensor to be kept frozen, or a GGUFError naming the file, the tensor and its
    type; with `shape` (numpy order), also that its rows hold whole blocks."""
    q = FROZEN_BY_ID.get(ggml_type)
    if q is None:
        raise GGUFError(f"{path}: tensor {tensor!r} has type {type_name(ggml_type)}, which toyharness does not "
                        f"take (supported: {', '.join(FROZEN_NAMES)})")
    if shape is not None and shape[-1] % q.block:
        raise GGUFError(f"{path}: tensor {tensor!r} of type {q.name} has rows of {shape[-1]} values, not a "
                        f"multiple of its block of {q.block}")
    return q


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored bytes as float32 of `shape` (numpy order), by gguf-py's dequantizer."""
    import gguf

    if math.prod(shape) == 0:      # an empty tensor: rows of no bytes cannot be reshaped by width
        return np.zeros(shape, np.float32)
    if ggml_type == FROZEN["f32"].ggml_type:
        return raw.view(np.float32).reshape(shape).copy()
    if ggml_type == FROZEN["f16"].ggml_type:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    qtype = gguf.GGMLQuantizationType(ggml_type)
    rows = raw.reshape(-1, FROZEN_BY_ID[ggml_type].row_bytes(shape[-1])) if ggml_type in FROZEN_BY_ID else raw
    return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


QUANTIZE_CHUNK_ROWS = 512     # rows a thread quantizes at a time


def quantize(values: np.ndarray, name: str) -> np.ndarray:
    """float32 values (rows along the last axis) in type `name`, by ggml's own quantizer: uint8
    bytes shaped (..., row bytes), as gguf-py's writer takes them with a raw dtype. Any type
    ggml quantizes without an importance matrix, frozen or not (tests write refused types too)."""
    import gguf

    try:
        t = int(gguf.GGMLQuantizationType[name.upper()])
    except KeyError:
        raise GGUFError(f"quantize: unknown type {name!r}") from None
    if lib.ggml_quantize_requires_imatrix(t):
        raise GGUFError(f"quantize: type {name} needs an importance matrix")
    values = np.ascontiguousarray(values, dtype=np.float32)
    n = values.shape[-1]
    block, block_bytes = int(lib.ggml_blck_size(t)), int(lib.ggml_type_size(t))
    if n % block:
        raise GGUFError(f"quantize: rows of {n} values do not fill whole {name} blocks of {block}")
    rows = values.size // n
    out = np.empty((rows, n // block * block_bytes), np.uint8)
    src, dst = ffi.from_buffer("float[]", values), ffi.from_buffer(out, require_writable=True)

    def chunk(first: int) -> None:     # rows first.. of their own bytes: no row depends on another
        lib.ggml_quantize_chunk(t, src, dst, first * n, min(QUANTIZE_CHUNK_ROWS, rows - first), n, ffi.NULL)

    firsts = range(0, rows, QUANTIZE_CHUNK_ROWS)
    if len(firsts) == 1:
        chunk(0)
    else:      # cffi lets go of the GIL in the call: the chunks quantize on every core
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(chunk, firsts))
    return out.reshape(*values.shape[:-1], out.shape[-1])
