"""Dropout, exact and repeatable: the mask stream, its numpy reference, and a program's masks.

`Tensor.dropout(p, name)` is ``x * M``: M holds 1 / (1 - p) (rounded to float32) where an element
is kept and 0 where it is dropped, so the kept values are ``x / (1 - p)`` by one float32 multiply
on every backend, and ggml's MUL backward gives the gradient ``dy * M``. M comes from a
counter-based stream: nothing is carried from one step to the next, so a run's bits repeat and a
resumed run draws the masks the uninterrupted run drew.

The stream (native/dropout_mask.h computes the same; docs/design.md, "Dropout"). Element i (the
row-major index over the mask's shape) of the mask node named `name`, in the training forward
`forward_index` of a run seeded `seed`:

    words = Philox4x32-10(counter = (i // 4 mod 2^32, i // 2^34, node, forward_index mod 2^32),
                          key = (seed mod 2^32, seed // 2^32 mod 2^32))
    u = words[i % 4];  node = crc32(name)  (zlib's);  kept iff u < round((1 - p) 2^32)

Philox4x32-10 is Random123's (Salmon et al., SC 2011): 10 rounds of two 32x32->64 products with
0xD2511F53 and 0xCD9E8D57, the key bumped by 0x9E3779B9 and 0xBB67AE85 between rounds.

Where the mask is made: on the cpu (fast and portable) and on cuda with our kernels, one node of
ours (native/dropout_mask.c, cuda/th-custom.cu) whose only source is the program's fed key
(i32[4]: the seed's two words, the forward index, enabled), so no gradient reaches it; on other
backends (vulkan, the metal lowering) an input the host computes with `mask_values` each time the
key changes. Evaluation sets `enabled` to 0: every mask is 1 and x * 1 is x, so evaluation's bits
are those of the model without dropout.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

from .._ffi import GGML_TYPE_F32, GGML_TYPE_I32, ffi, lib
from ..errors import InputError

if TYPE_CHECKING:
    from .program import Program
    from .tensor import Tensor

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_U32 = np.uint64(0xFFFFFFFF)


def check_p(p, what: str = "dropout") -> float:
    """p as a float in [0, 1); InputError naming `what` otherwise (negative, 1 or more, NaN)."""
    try:
        value = float(p)
    except (TypeError, ValueError):
        raise InputError(f"{what}: p must be a number in [0, 1), got {p!r}") from None
    if not 0.0 <= value < 1.0:      # NaN fails both comparisons
        raise InputError(f"{what}: p must be in [0, 1), got {p!r}")
    return value


def node_id(name: str) -> int:
    """The stream's node word for a mask named `name`: zlib's crc32 of its UTF-8 bytes."""
    return zlib.crc32(name.encode())


def keep_threshold(p: float) -> int:
    """An element is kept iff its word u < this: round((1 - p) 2^32), 1 - p in double precision,
    ties to even (Python's round), in [0, 2^32]."""
    return int(round((1.0 - p) * 2.0 ** 32))


def kept_value(p: float) -> np.float32:
    """The mask's value where an element is kept: 1 / (1 - p), computed in double, rounded to float32."""
    return np.float32(1.0 / (1.0 - p))


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int) -> tuple[np.ndarray, ...]:
    """Random123's Philox4x32-10 of counters (c0, c1, c2, c3) (arrays or ints, u32 values) under
    key (k0, k1): four uint32 arrays. Products in uint64, exact."""
    c = [np.asarray(x, dtype=np.uint64) & _U32 for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(k0 & 0xFFFFFFFF), np.uint64(k1 & 0xFFFFFFFF)
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    shift = np.uint64(32)
    for _ in range(PHILOX_ROUNDS):
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> shift) ^ c[1] ^ k0, p1 & _U32, (p0 >> shift) ^ c[3] ^ k1, p0 & _U32]
        k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & _U32, (k1 + np.uint64(PHILOX_W[1])) & _U32
    return tuple(x.astype(np.uint32) for x in c)


def stream_words(seed: int, forward_index: int, node: int, n: int) -> np.ndarray:
    """The stream's words u of elements 0..n-1 (uint32)."""
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    seed &= (1 << 64) - 1
    words = philox4x32_10(blocks & _U32, blocks >> np.uint64(32), node, forward_index & 0xFFFFFFFF,
                          seed & 0xFFFFFFFF, seed >> 32)
    return np.stack(words, axis=1).reshape(-1)[:n]


def mask_values(shape: tuple[int, ...], p: float, seed: int, forward_index: int, node: int,
                enabled: bool = True) -> np.ndarray:
    """The mask (float32, `shape`): kept_value(p) or 0 by the stream; all 1 where not `enabled`."""
    n = int(np.prod(shape, dtype=np.int64))
    if not enabled:
        return np.ones(shape, np.float32)
    keep = stream_words(seed, forward_index, node, n).astype(np.uint64) < np.uint64(keep_threshold(p))
    return np.where(keep, kept_value(p), np.float32(0.0)).astype(np.float32).reshape(shape)


def dropout_mask(shape: tuple[int, ...], p: float, seed: int, forward_index: int, name: str,
                 enabled: bool = True) -> np.ndarray:
    """The numpy reference of the mask `Tensor.dropout(p, name)` multiplies by in training forward
    `forward_index` of a program whose dropout_seed is `seed` (float32, `shape`)."""
    return mask_values(tuple(shape), check_p(p), seed, forward_index, node_id(name), enabled)


def key_words(seed: int, forward_index: int, enabled: bool) -> np.ndarray:
    """The fed key, i32[4]: the seed's low and high words, the forward index, enabled."""
    seed &= (1 << 64) - 1
    words = np.array([seed & 0xFFFFFFFF, seed >> 32, forward_index & 0xFFFFFFFF, int(bool(enabled))], np.uint32)
    return words.view(np.int32)


class Dropout:
    """A program's dropout: its fed key (in-graph masks) or the masks the host computes, and the
    names used so far. `Program.set_dropout` sets the key before each compute."""

    def __init__(self, prog: Program):
        self.prog = prog
        # masks made by a node of ours where a kernel of ours computes the program's graphs
        self.in_graph = prog.cpu_kernels or prog.portable or prog.cuda_kernels
        self.key: Tensor | None = None
        # the host's masks by (name, shape, p): a program may build its forward again at other
        # shapes (sampling's graphs), and a recomputed block builds its masks twice
        self.host: dict[tuple, tuple[Tensor, tuple[int, ...], float, int]] = {}
        self.last: tuple | None = None

    def mask(self, x: Tensor, p: float, name: str) -> Tensor:
        """The mask for `x` (its shape), named `name`: a node of ours, or the host's input."""
        prog, shape = self.prog, x.shape
        ne = list(reversed(shape)) + [1] * (4 - len(shape))
        if self.in_graph:
            if self.key is None:
                self.key = prog._new_static("dropout.key", (4,), GGML_TYPE_I32)
                lib.ggml_set_input(self.key.ptr)
                prog._pending.append((self.key, key_words(0, 0, False)))     # off until a step turns it on
            ptr = lib.th_dropout_mask(prog._ctx_compute, self.key.ptr, *ne, node_id(name), keep_threshold(p),
                                      float(kept_value(p)))
            if ptr == ffi.NULL:
                raise RuntimeError("th_dropout_mask refused the program's key")
            return x._new(ptr, len(shape))
        key = (name, shape, p)
        if key not in self.host:
            t = prog._new_static(f"dropout.{len(self.host)}.{name}"[:63], shape, GGML_TYPE_F32)
            lib.ggml_set_input(t.ptr)
            prog._pending.append((t, np.ones(shape, np.float32)))
            self.host[key] = (t, shape, p, node_id(name))
        return self.host[key][0]

    def set(self, forward_index: int, enabled: bool) -> None:
        """Every mask for training forward `forward_index` (enabled) or evaluation (all ones)."""
        prog = self.prog
        if prog.planner is not None:
            return
        state = (prog.dropout_seed, forward_index if enabled else 0, bool(enabled))
        if state == self.last:
            return
        prog.allocate()
        from .host_values import upload

        if self.key is not None:
            upload(self.key, key_words(*state))
        for t, shape, p, node in self.host.values():
            upload(t, mask_values(shape, p, state[0], state[1], node, state[2]))
        self.last = state


def apply_dropout(x: Tensor, p: float, name: str) -> Tensor:
    """x * M (see the module); p == 0 returns x itself (no node)."""
    p = check_p(p, f"dropout {name!r}" if isinstance(name, str) and name else "dropout")
    if not isinstance(name, str) or not name:
        raise InputError(f"dropout: a mask needs a name (its stream's node), got {name!r}")
    if p == 0.0:
        return x
    x._check_f32("dropout")
    prog = x.prog
    if prog._dropout is None:
        prog._dropout = Dropout(prog)
    return x * prog._dropout.mask(x, p, name)

