"""Seeded parameter init streams, reproducible from (seed, tensor name) alone.

Each tensor draws from its own stream keyed by the run seed and a CRC32 of its name, so
adding a tensor does not shift the others. A stream is LANES generators stepped together
(vectorised in numpy), each seeded through splitmix64; value i comes from lane i % LANES.

- `lcg_uniform`: 64-bit LCG (Knuth's MMIX constants), top 24 bits -> [0, 1)  (gpt2's init)
- `xorshift_normal`: xorshift64 uniforms through Box-Muller -> N(0, 1)      (llama, vit)
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Iterator

import numpy as np

LANES = 1024
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        z = x
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _lane_states(seed: int, name: str) -> np.ndarray:
    key = (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32)) | np.uint64(zlib.crc32(name.encode()))
    with np.errstate(over="ignore"):
        states = _splitmix64(key + np.arange(LANES, dtype=np.uint64) * np.uint64(0x632BE59BD9B4E019))
    return np.where(states == 0, np.uint64(1), states)


def lcg_uniform(seed: int, name: str, n: int) -> np.ndarray:
    state = _lane_states(seed, name)
    out = np.empty(((n + LANES - 1) // LANES, LANES), dtype=np.float64)
    a, c = np.uint64(6364136223846793005), np.uint64(1442695040888963407)
    with np.errstate(over="ignore"):
        for i in range(out.shape[0]):
            state = state * a + c
            out[i] = (state >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return out.reshape(-1)[:n]


def _xorshift_uniform(state: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.empty((rows, LANES), dtype=np.float64)
    for i in range(rows):
        state ^= state << np.uint64(13)
        state ^= state >> np.uint64(7)
        state ^= state << np.uint64(17)
        out[i] = ((state >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    return out, state


def xorshift_normal(seed: int, name: str, n: int) -> np.ndarray:
    rows = (n + 2 * LANES - 1) // (2 * LANES)
    u, _ = _xorshift_uniform(_lane_states(seed, name), 2 * rows)
    u1, u2 = u[0::2], u[1::2]
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)], axis=0)
    return z.reshape(-1)[:n]


# Set while a memory plan realizes a recipe (toyharness/engine/memory_plan.py): the plan needs each
# parameter's shape, not its values, and drawing billions of them would take minutes and the
# very memory the plan is about. The streams then return read-only zero-stride placeholders.
_SHAPES_ONLY = False


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Within this block `normal` and `lcg_scaled` return zeros of the right shape that use no
    memory (np.broadcast_to), for a memory plan."""
    global _SHAPES_ONLY
    before, _SHAPES_ONLY = _SHAPES_ONLY, True
    try:
        yield
    finally:
        _SHAPES_ONLY = before


@contextlib.contextmanager
def with_values() -> Iterator[None]:
    """Real values within this block, even inside `shapes_only`: for weights that are written to a
    file (a seeded base or donor made on first use must never be written as placeholders)."""
    global _SHAPES_ONLY
    before, _SHAPES_ONLY = _SHAPES_ONLY, False
    try:
        yield
    finally:
        _SHAPES_ONLY = before


def _placeholder(shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(np.float32(0.0), tuple(int(s) for s in shape))


def normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    if _SHAPES_ONLY:
        return _placeholder(shape)
    n = int(np.prod(shape))
    return (xorshift_normal(seed, name, n) * std).astype(np.float32).reshape(shape)


def lcg_scaled(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Uniform on [-sqrt(3) std, sqrt(3) std): mean 0, standard deviation `std`."""
    if _SHAPES_ONLY:
        return _placeholder(shape)
    n = int(np.prod(shape))
    u = lcg_uniform(seed, name, n)
    return ((2.0 * u - 1.0) * np.sqrt(3.0) * std).astype(np.float32).reshape(shape)
