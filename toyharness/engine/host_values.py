"""Host values into and out of a program's backend tensors: bf16 bits, uploads, and the checks
and native calls that feed a step's inputs and class-id targets (Program.feed). Nothing reaches
ggml unchecked: a value of the wrong shape, a NaN or an id out of range is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._ffi import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_I32, ffi, lib
from ..errors import InputError, ShapeError

if TYPE_CHECKING:
    from .tensor import Tensor

NP_TO_GGML = {np.dtype(np.float32): GGML_TYPE_F32, np.dtype(np.float16): GGML_TYPE_F16,
              np.dtype(np.int32): GGML_TYPE_I32}
DTYPE_NAMES = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16, "bf16": GGML_TYPE_BF16, "i32": GGML_TYPE_I32}


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, as uint16 bits."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class FedInput:
    tensor: Tensor
    upper: int | None  # exclusive bound for ids (vocab size), checked before upload
    # fixed at creation, kept here: a step's feed then makes one native call (th_feed_*)
    shape: tuple[int, ...] = ()
    ids: bool = False
    scratch: np.ndarray | None = None   # ids as i32 on their way to ggml


@dataclass
class FedTargets:
    """Class ids fed by name, turned into what the loss graph reads."""

    shape: tuple[int, ...]
    vocab: int
    onehot: Tensor | None      # None: the loss reads the flat indices only (a GET_ROWS pick)
    flat_index: Tensor
    # The one-hot rows are kept between steps and updated where the ids changed (a full
    # rebuild of rows x vocab floats was most of a step's host time): `mirror` is the tensor's
    # own memory on a host backend, else a host copy that is uploaded; `last` the last ids
    # (valid once `fed`), `scratch` the flat indices on their way to ggml (th_feed_targets).
    mirror: np.ndarray | None = None
    last: np.ndarray | None = None
    scratch: np.ndarray | None = None
    fed: bool = False
    # On a device (Program.onehot_in_graph) the graph itself zeroes the one-hot rows and sets
    # the ones at the flat indices: only those cross the bus, not rows x vocab floats.
    in_graph: bool = False
    # > 0: the flat indices count rows from the start of each piece of `chunk` rows (a loss over
    # the logits of one piece at a time, engine/losses.py head_token_logps)
    chunk: int = 0


def feed_input(name: str, inp: FedInput, value) -> None:
    value = np.asarray(value)
    if value.shape != inp.shape:
        raise ShapeError(f"input {name!r}: expected shape {inp.shape}, got {value.shape}")
    if inp.ids:
        ids = as_ids(f"input {name!r}", value, "integer ids")
        bad = lib.th_feed_ids(inp.tensor.ptr, ffi.from_buffer("int64_t[]", ids), ids.size,
                              inp.upper or 0, ffi.from_buffer("int32_t[]", inp.scratch))
        if bad >= 0:
            raise id_error(name, ids.flat[bad], inp.upper)
        return
    if value.dtype == np.float32:
        x = np.ascontiguousarray(value)
    else:
        with np.errstate(over="ignore"):    # a value past float32's range: our error below, not a warning
            x = np.ascontiguousarray(value, dtype=np.float32)
    if lib.th_feed_f32(inp.tensor.ptr, ffi.from_buffer("float[]", x), x.size) >= 0:
        raise InputError(f"input {name!r}: contains NaN or inf")


def feed_targets(name: str, tg: FedTargets, value) -> None:
    value = np.asarray(value)
    if tuple(value.shape) != tg.shape:
        raise ShapeError(f"targets {name!r}: expected shape {tg.shape}, got {tuple(value.shape)}")
    ids = as_ids(f"targets {name!r}", value, "integer class ids").reshape(-1)
    rows = ids.size
    if tg.in_graph:
        bad = np.flatnonzero((ids < 0) | (ids >= tg.vocab))
        if bad.size:
            raise id_error(name, ids[bad[0]], tg.vocab)
        row = np.arange(rows, dtype=np.int64)
        flat = np.ascontiguousarray((row % tg.chunk if tg.chunk else row) * tg.vocab + ids, dtype=np.int32)
        upload(tg.flat_index, flat)
        tg.fed = True
        return
    if tg.mirror is None:
        if lib.th_tensor_is_host(tg.onehot.ptr):
            buf = ffi.buffer(ffi.cast("float *", lib.th_tensor_data(tg.onehot.ptr)), rows * tg.vocab * 4)
            tg.mirror = np.frombuffer(buf, dtype=np.float32).reshape(rows, tg.vocab)
        else:
            tg.mirror = np.empty((rows, tg.vocab), dtype=np.float32)
        tg.mirror[:] = 0.0
        tg.last, tg.scratch = np.zeros(rows, np.int64), np.empty(rows, np.int32)
    bad = lib.th_feed_targets(tg.onehot.ptr, ffi.from_buffer("float[]", tg.mirror, require_writable=True),
                              tg.flat_index.ptr, ffi.from_buffer("int64_t[]", ids),
                              ffi.from_buffer("int64_t[]", tg.last, require_writable=True), int(tg.fed), rows,
                              tg.vocab, ffi.from_buffer("int32_t[]", tg.scratch, require_writable=True))
    if bad >= 0:
        raise id_error(name, ids[bad], tg.vocab)
    tg.fed = True


def upload(t: Tensor, data: np.ndarray) -> None:
    nbytes = int(lib.ggml_nbytes(t.ptr))
    if data.nbytes != nbytes:
        raise ShapeError(f"{t.name}: upload of {data.nbytes} bytes into a tensor of {nbytes} bytes")
    lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(data), 0, nbytes)


def as_ids(what: str, value: np.ndarray, expected: str) -> np.ndarray:
    """Integer ids as a contiguous int64 array (th_feed_* check their range)."""
    if value.dtype.kind not in "iu":
        raise InputError(f"{what}: expected {expected}, got {value.dtype}")
    if value.dtype == np.uint64 and value.size and value.max() > np.iinfo(np.int64).max:
        raise InputError(f"{what}: id {value.max()} out of range")
    return np.ascontiguousarray(value, dtype=np.int64)


def id_error(name: str, bad, upper: int | None) -> InputError:
    bound = f"[0, {upper})" if upper is not None else f"[0, {2 ** 31})"
    return InputError(f"{name!r}: id {int(bad)} out of range {bound}")
