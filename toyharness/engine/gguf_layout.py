"""A GGUF's layout walked and checked before gguf-py's reader sees the file.

gguf-py's `GGUFReader` trusts the header: an array count or a string length past the end of the
file makes it loop over the count without moving (a hang, and a list as long as the count), and
its other failures come out as assorted exception types. This walk reads every count, length,
type, dimension and offset of the header with `struct`, checks each against the bytes that are
actually left, and raises one `GGUFError` naming the file, the byte offset and what is wrong.
After it passes, every count gguf-py loops over is bounded by the file's size.

`walk` also returns what it read: every metadata value's place (`Field`, decoded only when
asked for: a 49152-token vocabulary stays bytes in the map) and every tensor's name, shape,
type and offset, for `GGUFFile`; and, with `record`, the parts it saw (kind, start, size): the
fuzzer's structure-aware mutations (toyharness/fuzz/mutate.py) use them to find every boundary
and number.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGUFError

# GGUF value types: fixed sizes of the scalars; 8 is a string, 9 an array.
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_DIMS = 4                    # GGML_MAX_DIMS
MIN_KV_BYTES = 8 + 4 + 1        # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dim, type, offset


@dataclass(frozen=True)
class Part:
    """One part of a GGUF header: what it is, where it starts, how many bytes."""

    kind: str       # magic, version, n_tensors, n_kv, str_len, str, value_type, value, array_type,
    #                 array_count, n_dims, dim, tensor_type, tensor_offset, padding, data
    start: int
    size: int


@dataclass(frozen=True)
class Field:
    """A metadata value's place in the file: `offset` of the value (of a string's length, of an
    array's first element), `count` elements (1 for a scalar or a string)."""

    vtype: int
    subtype: int | None
    offset: int
    count: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]      # numpy order (the file stores ggml order)
    ggml_type: int
    offset: int                 # from the start of the data section


@dataclass
class Layout:
    parts: list[Part]
    data_start: int
    alignment: int
    fields: dict[str, Field]
    tensors: list[TensorEntry]


def _block_sizes() -> dict[int, tuple[int, int]]:
    import gguf

    return {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}


class _NoParts(list):
    def append(self, part) -> None:    # checking a user's file needs no record of its parts
        pass


def walk(buf, name: str | Path = "<bytes>", record: bool = True) -> Layout:
    """Walk the GGUF in `buf` (bytes, mmap); raise GGUFError at the first thing out of bounds.
    With `record`, the layout lists every part (for the fuzzer); without, it is empty."""
    size = len(buf)
    parts: list[Part] = [] if record else _NoParts()
    pos = 0

    def fail(what: str):
        raise GGUFError(f"{name}: {what} (at byte {pos} of {size})")

    def take(kind: str, fmt: str) -> int:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            fail(f"truncated: the file ends inside the header ({kind})")
        parts.append(Part(kind, pos, n))
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += n
        return v

    def string(what: str) -> bytes:
        nonlocal pos
        n = take("str_len", "<Q")
        if n > size - pos:
            fail(f"truncated or corrupt: {what} of {n} bytes, but only {size - pos} bytes are left")
        parts.append(Part("str", pos, n))
        pos += n
        return bytes(buf[pos - n:pos])

    def utf8_string(what: str) -> str:
        raw = string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            fail(f"{what} is not UTF-8 ({raw[:40]!r})")

    def strings(count: int, key: str) -> None:
        """An array of strings (a vocabulary: 10^5 of them), in a tight loop."""
        nonlocal pos
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                fail(f"truncated: the file ends inside metadata {key!r}")
            (n,) = unpack(buf, pos)
            if n > size - pos - 8:
                fail(f"truncated or corrupt: a string of {n} bytes in metadata {key!r}, but only "
                     f"{size - pos - 8} bytes are left")
            if record:
                parts.extend((Part("str_len", pos, 8), Part("str", pos + 8, n)))
            pos += 8 + n

    def value(vtype: int, key: str) -> int | None:
        nonlocal pos
        if vtype == STRING:
            fields[key] = Field(vtype, None, pos, 1)
            string(f"metadata {key!r}: a string")
            return None
        if vtype == ARRAY:
            sub = take("array_type", "<I")
            if sub not in SCALAR_SIZES and sub not in (STRING, ARRAY):
                fail(f"metadata {key!r}: unknown array element type {sub}")
            count = take("array_count", "<Q")
            fields[key] = Field(vtype, sub, pos, count)
            smallest = SCALAR_SIZES.get(sub, 8)
            if count > (size - pos) // smallest:
                fail(f"truncated or corrupt: metadata {key!r} is an array of {count} elements, which cannot fit "
                     f"in the {size - pos} bytes left")
            if sub in SCALAR_SIZES:
                parts.append(Part("value", pos, count * smallest))
                pos += count * smallest
            elif sub == STRING:
                strings(count, key)
            else:
                fail(f"metadata {key!r}: an array of arrays (not supported)")
            return None
        if vtype not in SCALAR_SIZES:
            fail(f"metadata {key!r}: unknown value type {vtype}")
        fields[key] = Field(vtype, None, pos, 1)
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[SCALAR_SIZES[vtype]]
        return take("value", fmt)

    if size < 4 or bytes(buf[:4]) != b"GGUF":
        fail(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    parts.append(Part("magic", 0, 4))
    pos = 4
    version = take("version", "<I")
    if version not in (2, 3):
        fail(f"GGUF version {version}; readable: 2, 3")
    n_tensors = take("n_tensors", "<Q")
    n_kv = take("n_kv", "<Q")
    if n_kv > (size - pos) // MIN_KV_BYTES:
        fail(f"truncated or corrupt: {n_kv} metadata entries cannot fit in the {size - pos} bytes left")
    alignment = 32
    fields: dict[str, Field] = {}
    for _ in range(n_kv):
        key = utf8_string("a metadata key")
        vtype = take("value_type", "<I")
        v = value(vtype, key)
        if key == "general.alignment":
            if vtype != 4 or not v or v & (v - 1):
                fail(f"general.alignment must be a uint32 power of two, got {v!r} (type {vtype})")
            alignment = v
    if n_tensors > (size - pos) // MIN_TENSOR_INFO_BYTES:
        fail(f"truncated or corrupt: {n_tensors} tensors cannot fit in the {size - pos} bytes left")
    blocks = _block_sizes()
    tensors = []
    entries: list[TensorEntry] = []
    for _ in range(n_tensors):
        tname = utf8_string("a tensor name")
        n_dims = take("n_dims", "<I")
        if not 1 <= n_dims <= MAX_DIMS:
            fail(f"tensor {tname!r}: {n_dims} dimensions; ggml takes 1 to {MAX_DIMS}")
        dims = [take("dim", "<Q") for _ in range(n_dims)]
        ttype = take("tensor_type", "<I")
        if ttype not in blocks:
            fail(f"tensor {tname!r}: unknown ggml type {ttype}")
        offset = take("tensor_offset", "<Q")
        block, type_size = blocks[ttype]
        if dims[0] % block:
            fail(f"tensor {tname!r}: first dimension {dims[0]} is not a multiple of its type's block of {block}")
        n = 1
        for d in dims:
            n *= d
        if offset % alignment:
            fail(f"tensor {tname!r}: data offset {offset} is not a multiple of the alignment {alignment}")
        tensors.append((tname, offset, n // block * type_size))
        entries.append(TensorEntry(tname, tuple(reversed(dims)), ttype, offset))
    data_start = -(-pos // alignment) * alignment
    if data_start > size:
        fail("truncated: the file ends before its tensor data")
    if data_start > pos:
        parts.append(Part("padding", pos, data_start - pos))
    if data_start < size:
        parts.append(Part("data", data_start, size - data_start))
    pos = data_start
    end_prev, name_prev = 0, None
    for tname, offset, nbytes in sorted(tensors, key=lambda t: t[1]):
        if data_start + offset + nbytes > size:
            fail(f"truncated: tensor {tname!r} needs bytes [{data_start + offset}, {data_start + offset + nbytes}) "
                 f"but the file has {size}")
        if offset < end_prev:
            fail(f"tensor {tname!r}: its data overlaps tensor {name_prev!r}'s")
        end_prev, name_prev = offset + nbytes, tname
    return Layout(parts, data_start, alignment, fields, entries)
