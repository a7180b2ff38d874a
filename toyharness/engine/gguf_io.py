"""GGUF in and out: validated reading (mmap, in place on cpu) and atomic writing.

Reading checks everything ggml would otherwise abort on: the magic, a header that parses,
every tensor's byte range inside the file, known types, and the expected shape of each tensor
asked for. Errors are `GGUFError`s that name the file, the tensor, and expected vs got.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._ffi import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q8_0, ffi, lib
from ..atomic import atomic_path
from ..errors import GGUFError
from .gguf_layout import check_file
from .tensor import Tensor

if TYPE_CHECKING:
    from .program import Program

FROZEN_TYPES = {GGML_TYPE_F32: "f32", GGML_TYPE_F16: "f16", GGML_TYPE_BF16: "bf16", GGML_TYPE_Q8_0: "q8_0"}


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
        if self.ggml_type in FROZEN_TYPES:
            return FROZEN_TYPES[self.ggml_type]
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.ggml_type).name.lower()
        except ValueError:
            return f"ggml_type_{self.ggml_type}"

    def raw_bytes(self) -> np.ndarray:
        return np.asarray(self.file.mmap[self.offset:self.offset + self.nbytes])

    def to_numpy(self) -> np.ndarray:
        """Values as float32 (f32, f16, bf16; q8_0 dequantised)."""
        raw = self.raw_bytes()
        if self.ggml_type == GGML_TYPE_F32:
            return raw.view(np.float32).reshape(self.shape).copy()
        if self.ggml_type == GGML_TYPE_F16:
            return raw.view(np.float16).reshape(self.shape).astype(np.float32)
        if self.ggml_type == GGML_TYPE_BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        if self.ggml_type == GGML_TYPE_Q8_0:
            blocks = raw.reshape(-1, 34)
            scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            q = blocks[:, 2:].view(np.int8).astype(np.float32)
            return (q * scale).reshape(self.shape)
        raise GGUFError(f"{self.file.path}: tensor {self.name!r} has type {self.dtype}, which toyharness "
                        f"cannot convert (supported: {', '.join(FROZEN_TYPES.values())})")


class GGUFFile:
    """An open GGUF file, memory-mapped read-only. Use as a context manager or keep it open
    for as long as tensors bound in place (cpu) are in use."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: file not found")
        size = self.path.stat().st_size
        check_file(self.path)   # every count, length and offset within the file before gguf-py loops over them
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except MemoryError:     # an allocation sized by a number in the file: a bug to fix, not hide
            raise
        except Exception as exc:  # the reader raises ValueError, IndexError, KeyError... on damage
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF header ({type(exc).__name__}: {exc})") from exc
        self.mmap = self.reader.data
        self.size = size
        self._tensors: dict[str, TensorInfo] = {}
        for t in self.reader.tensors:
            shape = tuple(int(s) for s in reversed(list(t.shape)))
            info = TensorInfo(t.name, shape, int(t.tensor_type), int(t.data_offset), int(t.n_bytes), self)
            if info.offset + info.nbytes > size:
                raise GGUFError(f"{self.path}: truncated: tensor {t.name!r} needs bytes "
                                f"[{info.offset}, {info.offset + info.nbytes}) but the file has {size}")
            self._tensors[t.name] = info
        self._ctx = None
        self._buffer = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars and strings decoded; arrays as lists)."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        if not f.data:
            return default
        parts = [f.parts[i] for i in f.data]
        if len(f.types) and f.types[0].name == "STRING" and len(f.types) == 1:
            return self._text(key, parts[0])
        if f.types and f.types[0].name == "ARRAY":
            if len(f.types) > 1 and f.types[1].name == "STRING":
                return [self._text(key, p) for p in parts]
            return [p.tolist()[0] if hasattr(p, "tolist") else p for p in parts]
        return parts[0].tolist()[0]

    def _text(self, key: str, raw) -> str:
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: metadata {key!r} is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def metadata(self) -> dict[str, TypedValue]:
        """Every metadata key with its GGUF value type, for copying into another file."""
        out = {}
        for key, f in self.reader.fields.items():
            if key.startswith("GGUF.") or not f.types:
                continue
            sub = f.types[-1] if len(f.types) > 1 else None
            try:
                out[key] = TypedValue(f.contents(), f.types[0], sub)
            except UnicodeDecodeError as exc:
                raise GGUFError(f"{self.path}: metadata {key!r} is not UTF-8 ({exc.reason})") from None
        return out

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
        if info.ggml_type not in FROZEN_TYPES:
            raise GGUFError(f"{self.path}: tensor {info.name!r} has type {info.dtype}; toyharness takes "
                            f"{', '.join(FROZEN_TYPES.values())}")
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


def copy_gguf_as(src: str | os.PathLike, dst: str | os.PathLike, matrix_dtype: str) -> Path:
    """A copy of a GGUF with every 2-D tensor stored as `matrix_dtype` (f32, f16, bf16, q8_0, or
    q4_0, which the engine refuses: for error tests); metadata and 1-D tensors kept as they are."""
    import gguf

    kinds = {"f32": None, "f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
    if matrix_dtype not in kinds:
        raise GGUFError(f"copy_gguf_as: dtype {matrix_dtype!r}; allowed: {', '.join(kinds)}")
    dst = Path(dst)
    with GGUFFile(src) as f:
        arch = f.field("general.architecture")
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
        arrays = {name: f.tensor(name).to_numpy() for name in f.names}
    tensors = []
    for name, a in arrays.items():
        kind = kinds[matrix_dtype] if a.ndim == 2 else None
        tensors.append((name, a if kind is None else gguf.quants.quantize(a, kind), kind))
    return _write_atomic(dst, arch, meta, tensors)
