"""Seeded mutations of valid inputs: generic byte damage, and structure-aware damage for GGUF,
.npy/.npz and TOML (truncation at every structural boundary, hostile counts, lengths, dims and
offsets, wrong types, overlapping or out-of-file tensor data, bad UTF-8).

Every mutator is a pure function of (input bytes, numpy Generator): a case is reproduced from
(reader, seed, index) alone.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable

import numpy as np

from ..engine.gguf_layout import Layout, Part, walk

Mutator = Callable[[bytes, np.random.Generator], bytes]

# Sequences that are not UTF-8: a lone continuation byte, an overlong '/', a surrogate, a cut
# 3-byte sequence, bytes that never occur.
BAD_UTF8 = [b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xff\xfe", b"\xf8\x88\x80\x80\x80"]

HOSTILE_U64 = [0, 1, 2, 3, 7, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**48, 2**62,
               2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
HOSTILE_U32 = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 14, 15, 30, 39, 40, 0x7F, 0xFF, 0xFFFF, 2**31 - 1, 2**31,
               2**32 - 1]


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


# --- generic byte damage ------------------------------------------------------------------------
def flip_bits(data: bytes, rng: np.random.Generator) -> bytes:
    if not data:
        return data
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        i = int(rng.integers(len(buf)))
        buf[i] ^= 1 << int(rng.integers(8))
    return bytes(buf)


def set_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    """A few bytes set to values parsers find interesting (0, 0xff, 0x7f, 0x80)."""
    if not data:
        return data
    buf = bytearray(data)
    i = int(rng.integers(len(buf)))
    n = min(len(buf) - i, int(rng.integers(1, 9)))
    buf[i:i + n] = bytes([_pick(rng, [0, 0xFF, 0x7F, 0x80, 0x01])]) * n
    return bytes(buf)


def truncate_anywhere(data: bytes, rng: np.random.Generator) -> bytes:
    return data[:int(rng.integers(len(data) + 1))]


def insert_or_delete(data: bytes, rng: np.random.Generator) -> bytes:
    i = int(rng.integers(len(data) + 1))
    if rng.random() < 0.5 and data:
        return data[:i] + data[i + int(rng.integers(1, 17)):]
    return data[:i] + rng.bytes(int(rng.integers(1, 17))) + data[i:]


def splice_chunk(data: bytes, rng: np.random.Generator) -> bytes:
    """A chunk of the input copied over another place (duplicated structure)."""
    if len(data) < 2:
        return data
    a, b = sorted(int(x) for x in rng.integers(len(data), size=2))
    chunk = data[a:b + 1][:64]
    j = int(rng.integers(len(data)))
    return data[:j] + chunk + data[j + len(chunk):]


BYTE_MUTATORS: list[Mutator] = [flip_bits, set_bytes, truncate_anywhere, insert_or_delete, splice_chunk]


def mutate_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    return _pick(rng, BYTE_MUTATORS)(data, rng)


# --- GGUF ---------------------------------------------------------------------------------------
# The parts of a valid seed come from the same walk that checks user files (engine/gguf_layout.py).


def _fields_of(data: bytes, layout: Layout, kinds: tuple[str, ...]) -> list[Part]:
    return [f for f in layout.parts if f.kind in kinds and f.start + f.size <= len(data)]


def _put(data: bytes, f: Part, raw: bytes) -> bytes:
    return data[:f.start] + raw + data[f.start + len(raw):]


def gguf_truncate_at_boundary(data: bytes, rng, layout) -> bytes:
    """Cut the file where a part starts or ends (or one byte either side)."""
    cuts = sorted({f.start for f in layout.parts} | {f.start + f.size for f in layout.parts})
    cut = _pick(rng, cuts) + int(rng.integers(-1, 2))
    return data[:max(cut, 0)]


def gguf_hostile_number(data: bytes, rng, layout) -> bytes:
    """A count, length, dimension, offset or version replaced by an extreme value."""
    numbers = [p for p in _fields_of(data, layout, ("version", "n_tensors", "n_kv", "str_len", "array_count",
                                                    "n_dims", "dim", "tensor_offset", "value"))
               if p.size in (4, 8)]     # metadata values too: layer counts, sizes, steps
    if not numbers:
        return flip_bits(data, rng)
    f = _pick(rng, numbers)
    size = len(data)
    pool = HOSTILE_U32 if f.size == 4 else HOSTILE_U64 + [size, size + 1, size - 1, size // 2]
    if f.kind == "tensor_offset":
        pool = pool + [size - layout.data_start, size - layout.data_start + 32]
    v = _pick(rng, pool) if rng.random() < 0.8 else int(rng.integers(0, 2**63))
    return _put(data, f, struct.pack("<I" if f.size == 4 else "<Q", v % (2**(8 * f.size))))


def gguf_wrong_type(data: bytes, rng, layout) -> bytes:
    """A metadata value type, array element type or tensor type replaced by another (or none)."""
    types = _fields_of(data, layout, ("value_type", "array_type", "tensor_type"))
    if not types:       # no metadata and no tensors (atheris made such a seed)
        return flip_bits(data, rng)
    f = _pick(rng, types)
    pool = list(range(0, 16)) + list(range(16, 42)) + [2**31, 2**32 - 1] if f.kind == "tensor_type" \
        else list(range(0, 14)) + [99, 2**32 - 1]
    return _put(data, f, struct.pack("<I", _pick(rng, pool)))


def gguf_tensor_data(data: bytes, rng, layout) -> bytes:
    """Tensor data that overlaps another tensor's, lies outside the file, or is misaligned."""
    offsets = _fields_of(data, layout, ("tensor_offset",))
    if not offsets:
        return gguf_hostile_number(data, rng, layout)
    f = _pick(rng, offsets)
    other = _pick(rng, offsets)
    choice = int(rng.integers(4))
    if choice == 0:      # the same bytes as another tensor
        v = struct.unpack_from("<Q", data, other.start)[0]
    elif choice == 1:    # just past the end of the file
        v = len(data) - layout.data_start + int(rng.integers(0, 64))
    elif choice == 2:    # misaligned
        v = struct.unpack_from("<Q", data, f.start)[0] + int(rng.integers(1, 32))
    else:                # overlapping the middle of another
        v = struct.unpack_from("<Q", data, other.start)[0] + 4
    return _put(data, f, struct.pack("<Q", v % 2**64))


def gguf_bad_utf8(data: bytes, rng, layout) -> bytes:
    """A key, string value or tensor name that is not UTF-8."""
    strs = [f for f in _fields_of(data, layout, ("str",)) if f.size]
    if not strs:
        return flip_bits(data, rng)
    f = _pick(rng, strs)
    bad = _pick(rng, BAD_UTF8)[:f.size]
    i = f.start + int(rng.integers(f.size - len(bad) + 1))
    return data[:i] + bad + data[i + len(bad):]


def gguf_mutator(seed: bytes) -> Mutator:
    """A mutator for GGUFs derived from `seed`: structure-aware most of the time, bytes otherwise."""
    layout = walk(seed)
    structural = [gguf_truncate_at_boundary, gguf_hostile_number, gguf_wrong_type, gguf_tensor_data, gguf_bad_utf8]

    def mutate(data: bytes, rng: np.random.Generator) -> bytes:
        if data is seed or len(data) == len(seed):
            if rng.random() < 0.75:
                return _pick(rng, structural)(data, rng, layout)
        return mutate_bytes(data, rng)

    return mutate


# --- .npy / .npz --------------------------------------------------------------------------------
NPY_HEADERS = [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (65536, 65536, 65536), }",
    "{'descr': '<i4', 'fortran_order': False, 'shape': (-1,), }",
    "{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3), }",
    "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
    "{'descr': '<U8', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '|V0', 'fortran_order': False, 'shape': (4,), }",
    "{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '>f8', 'fortran_order': False, 'shape': (), }",
    "{'descr': '?', 'fortran_order': False, 'shape': (0, 0), }",
    "{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '<f4', 'shape': (2,), }",
    "{'descr': '<f2', 'fortran_order': False, 'shape': (0, 1152921504606846976), }",
    "{'descr': 'xyz', 'fortran_order': False, 'shape': (2,), }",
    "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), 'extra': 1}",
    "[1, 2, 3]",
    "{'descr': '<i4', 'fortran_order': False, 'shape': (" + "(" * 200 + "1" + ")" * 200 + "), }",
]


def npy_with_header(header: str, body: bytes, version: int = 1) -> bytes:
    """A .npy file with `header` (padded as numpy pads) followed by `body`."""
    h = header.encode("latin1")
    if version == 1:
        pad = -(10 + len(h) + 1) % 64
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h) + pad + 1) + h + b" " * pad + b"\n" + body
    pad = -(12 + len(h) + 1) % 64
    return b"\x93NUMPY\x02\x00" + struct.pack("<I", len(h) + pad + 1) + h + b" " * pad + b"\n" + body


def _npy_body(npy: bytes) -> bytes:
    """The bytes after a .npy header (empty when the header itself is cut)."""
    v1 = npy[6:7] == b"\x01"
    if len(npy) < (10 if v1 else 12):
        return b""
    hlen = struct.unpack_from("<H", npy, 8)[0] if v1 else struct.unpack_from("<I", npy, 8)[0]
    return npy[(10 if v1 else 12) + hlen:]


HOSTILE_DTYPES = ["<U4", "<c8", "?", "<f2", "<f8", ">i4", "<i8", "<u8", "|V4", "|S3", [("a", "<i4")]]


def hostile_array(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A well-formed array of the wrong kind: another dtype, a zero-sized or extra dimension,
    extreme values (the largest ids, inf, nan)."""
    dtype = np.dtype(_pick(rng, HOSTILE_DTYPES))
    shape = _pick(rng, [shape, (0, *shape[1:]), shape[:1] + (0,) + shape[2:], (), shape[:1], (*shape, 1, 2),
                        tuple(max(1, s // 2) for s in shape)])
    a = np.zeros(shape, dtype)
    if a.size and dtype.kind in "iu":
        a.flat[int(rng.integers(a.size))] = _pick(rng, [np.iinfo(dtype).max, np.iinfo(dtype).min, 2**31 - 1])
    elif a.size and dtype.kind in "fc":
        a.flat[int(rng.integers(a.size))] = _pick(rng, [np.inf, -np.inf, np.nan, 1e30])
    return a


def mutate_npy(npy: bytes, rng: np.random.Generator) -> bytes:
    """A .npy with a hostile header (size, dtype, order), a well-formed array of the wrong kind,
    a body of the wrong length, or byte damage."""
    r = rng.random()
    if r < 0.2 and npy.startswith(b"\x93NUMPY"):
        try:
            shape = np.lib.format.read_array_header_1_0(io.BytesIO(npy[8:]))[0] if npy[6] == 1 else (4, 4)
        except Exception:     # a header already damaged by an earlier mutation
            shape = (4, 4)
        buf = io.BytesIO()
        # a damaged header may declare negative dimensions: the array made from it must not
        np.save(buf, hostile_array(tuple(min(max(int(s), 0), 64) for s in shape), rng))
        return buf.getvalue()
    r = rng.random()
    if r < 0.4 and npy.startswith(b"\x93NUMPY"):
        body = _npy_body(npy)
        if rng.random() < 0.3:
            body = body[:int(rng.integers(len(body) + 1))]
        return npy_with_header(_pick(rng, NPY_HEADERS), body, version=int(rng.integers(1, 3)))
    if r < 0.55 and npy.startswith(b"\x93NUMPY"):
        body = _npy_body(npy)
        return npy[:len(npy) - len(body)] + body[:int(rng.integers(len(body) + 1))] + \
            (rng.bytes(int(rng.integers(1, 9))) if rng.random() < 0.3 else b"")
    return mutate_bytes(npy, rng)


def mutate_npz(npz: bytes, rng: np.random.Generator) -> bytes:
    """Damage one member's .npy (rebuilding a valid zip around it), drop/duplicate/rename members,
    or damage the zip's own bytes."""
    r = rng.random()
    if r < 0.35:
        return mutate_bytes(npz, rng)
    try:
        with zipfile.ZipFile(io.BytesIO(npz)) as zf:
            members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    except Exception:       # the seed is always a valid zip; a mutated one may not be
        return mutate_bytes(npz, rng)
    if not members:
        return npz
    k = int(rng.integers(len(members)))
    name, body = members[k]
    if r < 0.8:
        members[k] = (name, mutate_npy(body, rng))
    elif r < 0.87:
        del members[k]
    elif r < 0.93:
        members.append((name, body))
    else:
        members[k] = (_pick(rng, ["x.npy", "labels", "images.npy/../a.npy", "\u00e9.npy", ".npy"]), body)
    out = io.BytesIO()
    compression = zipfile.ZIP_DEFLATED if rng.random() < 0.2 else zipfile.ZIP_STORED
    with zipfile.ZipFile(out, "w", compression) as zf:
        for n, b in members:
            zf.writestr(n, b)
    return out.getvalue()


# --- TOML / text --------------------------------------------------------------------------------
TOML_VALUES = ["-1", "0", "9223372036854775807", "99999999999999999999999", "1e400", "nan", "inf", "-inf", "true",
               "\"\"", "\"x\"", "[]", "[1, \"a\"]", "{}", "1979-05-27T07:32:00Z", "0x7fffffff", "3.5", "\"\\u0000\"",
               "'''\n'''", "[[1]]"]


def mutate_toml(text: bytes, rng: np.random.Generator) -> bytes:
    """A value of the wrong type or an extreme one, a duplicated or mangled key, a cut line, bad
    UTF-8, or byte damage."""
    lines = text.split(b"\n")
    kv = [i for i, ln in enumerate(lines) if b"=" in ln]
    r = rng.random()
    if r < 0.35 and kv:
        i = _pick(rng, kv)
        key = lines[i].split(b"=", 1)[0]
        lines[i] = key + b"= " + _pick(rng, TOML_VALUES).encode()
    elif r < 0.45 and kv:
        lines.insert(int(rng.integers(len(lines) + 1)), lines[_pick(rng, kv)])
    elif r < 0.55 and kv:
        i = _pick(rng, kv)
        lines[i] = _pick(rng, [b"n_layers", b"[table]", b"a.b.c", b"\"quoted key\"", b"t_seq.x"]) + b" = 1"
    elif r < 0.65:
        i = int(rng.integers(len(lines)))
        lines[i] = lines[i][:int(rng.integers(len(lines[i]) + 1))]
    elif r < 0.75:
        i = int(rng.integers(len(lines)))
        lines[i] = lines[i] + b" " + _pick(rng, BAD_UTF8)
    else:
        return mutate_bytes(text, rng)
    return b"\n".join(lines)


def mutate_jsonl(text: bytes, rng: np.random.Generator) -> bytes:
    """JSON lines with a value of the wrong type, a cut or doubled line, bad UTF-8, or byte damage."""
    lines = text.split(b"\n")
    r = rng.random()
    i = int(rng.integers(len(lines)))
    if r < 0.2:
        lines[i] = lines[i][:int(rng.integers(len(lines[i]) + 1))]
    elif r < 0.35:
        lines[i] = _pick(rng, [b"[]", b"null", b"1", b"\"x\"", b"{}", b"{\"step\": \"a\"}", b"{\"loss\": NaN}",
                               b"{\"step\": 1e999}", b"[" * 5000])
    elif r < 0.45:
        lines.insert(i, lines[int(rng.integers(len(lines)))])
    elif r < 0.55:
        lines[i] = lines[i] + _pick(rng, BAD_UTF8)
    elif r < 0.65 and lines[i]:
        for word in (b"step", b"loss", b"loss_hex"):
            lines[i] = lines[i].replace(word, _pick(rng, [b"steps", b"", word + b"\x00"]), 1)
    else:
        return mutate_bytes(text, rng)
    return b"\n".join(lines)
