"""GGUF in and out: validated reading (mmap, in place on cpu) and atomic writing.

Reading checks everything ggml would otherwise abort on: the magic, a header that parses,
every tensor's byte range inside the file, known types, and the expected shape of each tensor
asked for. Errors are `GGUFError`s that name the file, the tensor, and expected vs got.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._ffi import GGML_TYPE_COUNT, ffi, lib
from ..atomic import atomic_path
from ..errors import GGUFError
from . import quant
from .gguf_layout import Field, walk
from .tensor import Tensor

if TYPE_CHECKING:
    from .program import Program


@dataclass
class TypedValue:
    """A metadata value with its GGUF type (kept when copying metadata between files)."""

    value: Any
    vtype: Any
    subtype: Any = None


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # numpy order
    ggml_type: int
    offset: int                 # absolute, in the file
    nbytes: int
    file: GGUFFile

    @property
    def dtype(self) -> str:
        return quant.type_name(self.ggml_type)

    def raw_bytes(self) -> np.ndarray:
        return np.asarray(self.file.mmap[self.offset:self.offset + self.nbytes])

    def check_frozen(self) -> quant.QuantType:
        """This tensor's type if a frozen weight may have it, else a GGUFError naming the file,
        the tensor and the type."""
        return quant.check_frozen(self.file.path, self.name, self.ggml_type, self.shape)

    def to_numpy(self, rows: int | None = None) -> np.ndarray:
        """Values as float32, dequantized (by gguf-py, independently of the engine) from any
        frozen type; with `rows`, only the first rows of a 2-D tensor (a donor's vocabulary)."""
        q = self.check_frozen()
        if rows is None or len(self.shape) != 2:
            return quant.dequantize(self.raw_bytes(), self.ggml_type, self.shape)
        rows = min(rows, self.shape[0])
        raw = np.asarray(self.file.mmap[self.offset:self.offset + rows * q.row_bytes(self.shape[1])])
        return quant.dequantize(raw, self.ggml_type, (rows, self.shape[1]))


class GGUFFile:
    """An open GGUF file, memory-mapped read-only. Use as a context manager or keep it open
    for as long as tensors bound in place (cpu) are in use.

    The header is read here, not by gguf-py's GGUFReader: that one turns every element of every
    metadata array into numpy objects (for a 49152-token vocabulary, 165 MB of memory per open
    file, more than the quantized weights). Here an array is its place in the file, decoded
    when asked for (`field`, `metadata`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: file not found")
        with open(self.path, "rb") as fh:
            if fh.seek(0, 2) == 0:
                raise GGUFError(f"{self.path}: empty file, not a GGUF")
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self._map)
        self.mmap = np.frombuffer(self._map, dtype=np.uint8)
        # every count, length and offset checked against the file before anything is decoded
        layout = walk(self._map, self.path, record=False)
        self._fields = layout.fields
        self._tensors: dict[str, TensorInfo] = {}
        for t in layout.tensors:
            info = TensorInfo(t.name, t.shape, t.ggml_type, layout.data_start + t.offset,
                              _tensor_bytes(self.path, t.name, t.shape, t.ggml_type), self)
            if info.offset + info.nbytes > self.size:
                raise GGUFError(f"{self.path}: truncated: tensor {t.name!r} needs bytes "
                                f"[{info.offset}, {info.offset + info.nbytes}) but the file has {self.size}")
            self._tensors[t.name] = info
        self._ctx = None
        self._buffer = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def keys(self) -> list[str]:
        """The metadata keys, in file order."""
        return list(self._fields)

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars and strings decoded; arrays as lists; an empty array or a
        missing key: `default`)."""
        f = self._fields.get(key)
        if f is None or (f.vtype == _ARRAY and f.count == 0):
            return default
        return self._decode(key, f)

    def _decode(self, key: str, f: Field) -> Any:
        try:
            return _decode(self._map, f)
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: metadata {key!r} is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def metadata(self) -> dict[str, TypedValue]:
        """Every metadata key with its GGUF value type, for copying into another file."""
        import gguf

        return {key: TypedValue(self._decode(key, f), gguf.GGUFValueType(f.vtype),
                                None if f.subtype is None else gguf.GGUFValueType(f.subtype))
                for key, f in self._fields.items()}

    def require_field(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return value

    def tensor(self, name: str, expect_shape: tuple[int, ...] | None = None) -> TensorInfo:
        info = self._tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor {name!r} not found ({len(self._tensors)} tensors in the file)")
        if expect_shape is not None and tuple(expect_shape) != info.shape:
            raise GGUFError(f"{self.path}: tensor {name!r} has shape {info.shape}, expected {tuple(expect_shape)}")
        return info

    def bind_in_place(self, prog: Program, info: TensorInfo, name: str) -> Tensor:
        """A ggml tensor whose data is the mmap'd bytes in the file (cpu only, no copy)."""
        info.check_frozen()
        if self._ctx is None:
            params = ffi.new("struct ggml_init_params *", {
                "mem_size": lib.ggml_tensor_overhead() * (len(self._tensors) + 1),
                "mem_buffer": ffi.NULL, "no_alloc": True})
            self._ctx = lib.ggml_init(params[0])
            base = ffi.cast("void *", self.mmap.ctypes.data)
            self._base = base
            self._buffer = lib.ggml_backend_cpu_buffer_from_ptr(base, self.size)
        ne = list(reversed(info.shape)) + [1] * (4 - len(info.shape))
        ptr = lib.ggml_new_tensor_4d(self._ctx, info.ggml_type, *ne)
        if int(lib.ggml_nbytes(ptr)) != info.nbytes:
            raise GGUFError(f"{self.path}: tensor {info.name!r}: {info.nbytes} bytes stored for shape {info.shape} "
                            f"of type {info.dtype}, expected {int(lib.ggml_nbytes(ptr))}")
        lib.ggml_set_name(ptr, name.encode()[:63])
        status = lib.ggml_backend_tensor_alloc(self._buffer, ptr, ffi.cast("char *", self._base) + info.offset)
        if status != 0:
            raise GGUFError(f"{self.path}: could not map tensor {info.name!r} in place (status {status})")
        prog._keepalive.append(self)
        return Tensor(prog, ptr, len(info.shape))

    def close(self) -> None:
        # Tensors bound in place keep the file open through the program's keepalive list.
        pass


# --- the GGUF header (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) -----------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
              7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


def _decode(buf, f: Field) -> Any:
    """A field's value: a Python scalar or str; an array as a list."""
    if f.vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, f.offset)
        return bytes(buf[f.offset + 8:f.offset + 8 + n]).decode("utf-8")
    if f.vtype in _SCALAR:
        return struct.unpack_from(_SCALAR[f.vtype], buf, f.offset)[0]
    if f.subtype in _NP_SCALAR:
        return np.frombuffer(buf, dtype=_NP_SCALAR[f.subtype], count=f.count, offset=f.offset).tolist()
    out, pos = [], f.offset
    for _ in range(f.count):
        (n,) = struct.unpack_from("<Q", buf, pos)
        out.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"))
        pos += 8 + n
    return out


def _tensor_bytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of tensor `name` of `shape` (numpy order) and `ggml_type`, or a GGUFError."""
    if not 0 <= ggml_type < GGML_TYPE_COUNT or lib.ggml_blck_size(ggml_type) <= 0:
        raise GGUFError(f"{path}: corrupt GGUF header: tensor {name!r} has unknown type {ggml_type}")
    block, block_bytes = int(lib.ggml_blck_size(ggml_type)), int(lib.ggml_type_size(ggml_type))
    if shape[-1] % block:
        raise GGUFError(f"{path}: tensor {name!r} of type {quant.type_name(ggml_type)} has rows of {shape[-1]} "
                        f"values, not a multiple of its block of {block}")
    return math.prod(shape[:-1]) * (shape[-1] // block) * block_bytes


def write_gguf(path: str | os.PathLike, arch: str, tensors: dict[str, np.ndarray],
               metadata: dict[str, Any] | None = None) -> Path:
    """Write a GGUF atomically (temporary name in the same folder, then rename).

    `tensors` are numpy arrays in numpy order (float32, float16, or int32); `metadata` values
    are str, bool, int (stored as uint32, or int64 when negative or large), float (float32),
    or lists of str / numbers.
    """
    return _write_atomic(Path(path), arch, metadata or {},
                         [(name, np.ascontiguousarray(array), None) for name, array in tensors.items()])


def _write_atomic(path: Path, arch: str, metadata: dict[str, Any], tensors: list[tuple[str, np.ndarray, Any]]) -> Path:
    """Write (name, data, raw ggml type or None) tensors and metadata to a temporary file, then rename."""
    import gguf

    with atomic_path(path) as tmp:      # a failed write (disk full...) is one WriteError naming `path`
        w = gguf.GGUFWriter(tmp, arch)
        try:
            for key, value in metadata.items():
                _add_field(w, key, value)
            for name, data, raw in tensors:
                w.add_tensor(name, data, raw_dtype=raw) if raw is not None else w.add_tensor(name, data)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
    return path


def _add_field(w, key: str, value: Any) -> None:
    if isinstance(value, TypedValue):
        w.add_key_value(key, value.value, value.vtype, sub_type=value.subtype)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        if 0 <= value < 2**32:
            w.add_uint32(key, value)
        else:
            w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"GGUF metadata {key!r}: unsupported value type {type(value).__name__}")


def cached_copy_as(src: str | os.PathLike, matrix_dtype: str) -> Path:
    """`copy_gguf_as(src, ..., matrix_dtype)` kept beside `src` (a base in the cache, e.g. for a
    golden over a quantized base): made once, then found by name."""
    src = Path(src)
    dst = src.with_name(f"{src.stem}.{matrix_dtype}.gguf")
    return dst if dst.is_file() else copy_gguf_as(src, dst, matrix_dtype)


def copy_gguf_as(src: str | os.PathLike, dst: str | os.PathLike, matrix_dtype: str) -> Path:
    """A copy of a GGUF with every 2-D tensor stored as `matrix_dtype`, quantized by ggml's own
    quantizer (engine/quant.py: any frozen type, and types the engine refuses, for error tests;
    K-quants need rows of a multiple of 256 values); metadata and 1-D tensors kept as they are."""
    dst = Path(dst)
    with GGUFFile(src) as f:
        arch = f.field("general.architecture")
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
        arrays = {name: f.tensor(name).to_numpy() for name in f.names}
    tensors = []
    for name, a in arrays.items():
        if a.ndim != 2 or matrix_dtype == "f32":
            tensors.append((name, a, None))
            continue
        import gguf

        tensors.append((name, quant.quantize(a, matrix_dtype), gguf.GGMLQuantizationType[matrix_dtype.upper()]))
    return _write_atomic(dst, arch, meta, tensors)
