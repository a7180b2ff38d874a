"""Reading .npy and .npz files a user hands us, with every size checked before numpy allocates.

numpy trusts a file's header: `np.load` of a .npy whose header declares shape (2**40,) allocates
that many elements before it notices the file is short, and inside an .npz it does so for each
member. These readers compare what each header declares with the bytes actually there first, so
a damaged or hostile file costs at most a small multiple of its own size, and every failure is an
`InputError` naming the file (and the member) and what is wrong.
"""

from __future__ import annotations

import os
import tokenize
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import InputError

# Deflate cannot expand by more than about 1032:1; a member claiming more is lying about its size.
MAX_DEFLATE_RATIO = 1100


MAX_HEADER_BYTES = 10000    # numpy's own limit, which it applies only after reading that many bytes


def _npy_header(fh, where: str) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """(shape, dtype, fortran_order, data bytes) from an open .npy stream positioned at its start."""
    # numpy reads as many header bytes as the length field says before checking it: check first.
    head = fh.read(12)
    if len(head) >= 10 and head[:6] == b"\x93NUMPY":
        hlen = int.from_bytes(head[8:10] if head[6] == 1 else head[8:12], "little")
        if hlen > MAX_HEADER_BYTES:
            raise InputError(f"{where}: a .npy header of {hlen} bytes (at most {MAX_HEADER_BYTES})")
    fh.seek(0)
    try:
        version = np.lib.format.read_magic(fh)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"unknown .npy format version {version}")
        reader = {(1, 0): np.lib.format.read_array_header_1_0}.get(version, np.lib.format.read_array_header_2_0)
        shape, fortran_order, dtype = reader(fh, max_header_size=MAX_HEADER_BYTES)
    except (ValueError, TypeError, SyntaxError, UnicodeError, OverflowError, EOFError, KeyError,
            RecursionError, tokenize.TokenError, MemoryError) as exc:
        # numpy parses the header with Python's own parser, which says MemoryError ("too complex")
        # for deep nesting; the header is at most MAX_HEADER_BYTES, so it is no real allocation.
        reason = _one_line(exc) or ("too deeply nested" if isinstance(exc, MemoryError) else type(exc).__name__)
        raise InputError(f"{where}: not a readable .npy header ({reason})") from None
    if dtype.itemsize == 0:
        raise InputError(f"{where}: dtype {dtype} has no size")
    if dtype.hasobject:
        raise InputError(f"{where}: holds Python objects (dtype {dtype}); only plain numeric arrays are read")
    if any(int(s) < 0 for s in shape):
        raise InputError(f"{where}: negative dimension in shape {shape}")
    count, spanned = 1, dtype.itemsize
    for s in shape:
        count *= int(s)
        spanned *= max(int(s), 1)
    # numpy refuses a shape whose nonzero dimensions span more than its index type, even when
    # another dimension is zero and the array is empty: (0, 2**60) holds nothing but cannot be made
    if spanned >= 2**63:
        raise InputError(f"{where}: shape {tuple(int(s) for s in shape)} is too large for any array")
    return tuple(int(s) for s in shape), dtype, bool(fortran_order), count * dtype.itemsize


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def load_npy(path: str | os.PathLike, what: str = "") -> np.ndarray:
    """A .npy file's array; its declared size checked against the file's before reading."""
    path = Path(path)
    where = f"{what} {path}".strip()
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            shape, dtype, fortran, nbytes = _npy_header(fh, where)
            start = fh.tell()
            if nbytes != size - start:
                raise InputError(f"{where}: the header declares {shape} of {dtype} ({nbytes} bytes) but "
                                 f"{size - start} bytes follow it")
            flat = np.fromfile(fh, dtype=dtype, count=nbytes // dtype.itemsize)
    except OSError as exc:
        raise InputError(f"{where}: cannot read ({exc.strerror or exc})") from None
    return flat.reshape(shape, order="F" if fortran else "C")


def load_npz(path: str | os.PathLike, what: str = "") -> dict[str, np.ndarray]:
    """Every array of an .npz (a zip of .npy members), each member's declared size checked
    against the zip's own sizes before anything is allocated."""
    path = Path(path)
    where = f"{what} {path}".strip()
    try:
        size = path.stat().st_size
        zf = zipfile.ZipFile(path)
    except OSError as exc:
        raise InputError(f"{where}: cannot read ({exc.strerror or exc})") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, UnicodeError, NotImplementedError) as exc:
        raise InputError(f"{where}: not a readable .npz file ({_one_line(exc)})") from None
    arrays: dict[str, np.ndarray] = {}
    with zf:
        for info in zf.infolist():
            member = f"{where} member {info.filename!r}"
            if not info.filename.endswith(".npy"):
                raise InputError(f"{member}: not an .npy member")
            name = info.filename[:-4]
            if name in arrays:
                raise InputError(f"{member}: the array {name!r} appears twice")
            if info.compress_size > size:
                raise InputError(f"{member}: claims {info.compress_size} compressed bytes in a {size}-byte file")
            limit = info.compress_size if info.compress_type == zipfile.ZIP_STORED else \
                info.compress_size * MAX_DEFLATE_RATIO
            if info.file_size > limit:
                raise InputError(f"{member}: claims {info.file_size} bytes from {info.compress_size} stored")
            try:
                with zf.open(info) as fh:
                    shape, dtype, fortran, nbytes = _npy_header(fh, member)
                    header_len = fh.tell()
                    if nbytes != info.file_size - header_len:
                        raise InputError(f"{member}: the header declares {shape} of {dtype} ({nbytes} bytes) but "
                                         f"{info.file_size - header_len} bytes follow it")
                    raw = fh.read(nbytes)
            except InputError:
                raise
            except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError,
                    RuntimeError, UnicodeError) as exc:
                raise InputError(f"{member}: damaged ({_one_line(exc)})") from None
            if len(raw) != nbytes:
                raise InputError(f"{member}: truncated: {len(raw)} of {nbytes} bytes")
            flat = np.frombuffer(raw, dtype=dtype, count=nbytes // dtype.itemsize)
            arrays[name] = flat.reshape(shape, order="F" if fortran else "C")
    return arrays
