"""From a fine-tune to a model people run: a run folder's adapters fused into its base GGUF.

A recipe that trains adapters over a frozen base says so with its method
``fuse_adapters(options, checkpoint) -> AdapterFold`` (the built-in lora recipe has one): each
adapted weight becomes W plus the adapter's change (LoRA: (alpha / rank) B A), computed in f32 from
the base's dequantized W, and is stored in the base's own type (`same`: requantized by ggml's own
quantizer, `ggml_quantize_chunk` through our cffi binding) or in the type named. Every other
tensor is carried over as it is stored (its bytes, untouched: no round trip through f32) where
its type is kept, and all the base's metadata (tokenizer, chat template, architecture keys) is
copied; `general.name` says what was fused and the `toyharness.fuse.*` keys note the run.

Runs of a model trained whole (no `fuse_adapters`, or one that returns None) have no adapters:
their trained weights are f32, so `same` is f32, and a type named stores their matrices in it.
Written atomically (a full disk is one WriteError naming the file: exit 1, nothing left under the
final name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .engine import quant
from .engine.gguf_io import GGUFFile, TypedValue, _write_atomic
from .errors import GGUFError, InputError, WriteError
from .runner import FUSE_NEEDS, load_finished_run

# `--type`: `same` (each tensor keeps its type) or one of the frozen types (engine/quant.py)
FUSE_TYPES = ("same", *quant.FROZEN_NAMES)

# llama.cpp's `general.file_type` (enum llama_ftype) for a file whose matrices are mostly of a
# type: what llama-quantize writes, so that tools reading the key see what the file holds.
FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q4_k": 15, "q5_k": 17,
             "q6_k": 18, "bf16": 32}


@dataclass
class AdapterFold:
    """What a recipe that trains adapters over a frozen base gives `fuse` (its method
    ``fuse_adapters(options, checkpoint)``): the base, and the change each adapted tensor gets."""

    base: Path                              # the frozen base GGUF the adapters fold into
    arch: str                               # the fused file's general.architecture
    adapted: frozenset[str]                 # names of the base's tensors that carry an adapter
    delta: Callable[[str], np.ndarray]      # f32 change added to an adapted tensor's dequantized values
    kind: str = "adapters"                  # general.name becomes "BASE + toyharness KIND (RUN)"
    metadata: dict[str, Any] = field(default_factory=dict)   # the recipe's own toyharness.fuse.* keys


@dataclass
class FuseReport:
    """What `fuse` wrote: the file, its tensors' types, and the adapted tensors."""

    path: Path
    types: dict[str, int] = field(default_factory=dict)     # type name -> number of tensors
    fused: list[str] = field(default_factory=list)          # tensors with an adapter folded in
    bytes: int = 0


def default_out(run_dir: Path, dtype: str) -> Path:
    """RUN_DIR/fused.gguf (`same`), else RUN_DIR/fused-TYPE.gguf."""
    return run_dir / ("fused.gguf" if dtype == "same" else f"fused-{dtype}.gguf")


def fuse(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, dtype: str = "same") -> FuseReport:
    """Fuse RUN_DIR's model into one llama.cpp GGUF (see the module's doc); returns what was written."""
    if dtype not in FUSE_TYPES:
        raise InputError(f"--type {dtype!r}: unknown; one of {', '.join(FUSE_TYPES)}")
    run_dir = Path(run_dir)
    obj, opts, ckpt = load_finished_run(run_dir, FUSE_NEEDS, "fuse")
    out = Path(out) if out else default_out(run_dir, dtype)
    fold = obj.fuse_adapters(opts, ckpt) if callable(getattr(obj, "fuse_adapters", None)) else None
    if out.resolve() in {ckpt.resolve(), Path(fold.base if fold else ckpt).resolve()}:
        raise InputError(f"--out {out}: would overwrite the run's checkpoint or base; name another file")
    note = {"toyharness.fuse.recipe": obj.name, "toyharness.fuse.run": run_dir.resolve().name,
            "toyharness.fuse.type": dtype}
    if fold is not None:
        return _fuse_adapters(fold, ckpt, out, dtype, note)
    return _fuse_plain(obj, opts, ckpt, out, dtype, note)


def _fuse_adapters(fold: AdapterFold, ckpt: Path, out: Path, dtype: str, note: dict) -> FuseReport:
    report = FuseReport(out)
    tensors = []
    with GGUFFile(fold.base) as f:
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
        for name in f.names:
            info = f.tensor(name)
            src = quant.type_name(info.ggml_type)
            want = src if dtype == "same" or len(info.shape) != 2 else dtype
            if name in fold.adapted:
                # in f32 from the dequantized base, as the run's forward saw it (W x + its adapter's)
                w = info.to_numpy() + fold.delta(name)
                tensors.append(_stored(name, w.astype(np.float32), want))
                report.fused.append(name)
            elif want == src:
                tensors.append(_kept(info, src))
            else:
                tensors.append(_stored(name, info.to_numpy(), want))
    if not report.fused:
        raise InputError(f"{ckpt}: no adapter matches a tensor of the base {fold.base}")
    name = meta.get("general.name")
    base_name = name.value if isinstance(name, TypedValue) else (name or Path(fold.base).stem)
    meta["general.name"] = f"{base_name} + toyharness {fold.kind} ({note['toyharness.fuse.run']})"
    meta.update(note)
    meta |= {"toyharness.fuse.base": Path(fold.base).name, **fold.metadata}
    if dtype != "same":
        meta["general.file_type"] = FILE_TYPE[dtype]
    return _write(out, fold.arch, meta, tensors, report)


def _fuse_plain(obj, opts, ckpt: Path, out: Path, dtype: str, note: dict) -> FuseReport:
    """A model trained whole: its export, with matrices in `dtype`."""
    import tempfile

    vocab = _vocab(obj, opts)
    params = obj.params_for_sampling(ckpt, opts, vocab)
    # the recipe's own export (lens folded in, its metadata and tokenizer), then re-stored
    # the intermediate export sits beside `out` (same disk); a failure to write it is `out`'s
    try:
        tmpdir = tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent if out.parent.is_dir() else None)
    except OSError as exc:
        raise WriteError(out, exc) from None
    with tmpdir as tmp:
        try:
            exported = obj.write_model(Path(tmp) / "model.gguf", params, opts, vocab)
        except WriteError as exc:
            raise WriteError(out, exc.reason) from None
        report = FuseReport(out)
        with GGUFFile(exported) as f:
            arch = f.field("general.architecture")
            meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
            tensors = []
            for name in f.names:
                info = f.tensor(name)
                want = dtype if dtype != "same" and len(info.shape) == 2 else quant.type_name(info.ggml_type)
                tensors.append(_stored(name, info.to_numpy(), want))
    name = meta.get("general.name")
    base_name = name.value if isinstance(name, TypedValue) else (name or obj.name)
    meta["general.name"] = f"{base_name} ({note['toyharness.fuse.run']})"
    meta.update(note)
    if dtype != "same":
        meta["general.file_type"] = FILE_TYPE[dtype]
    return _write(out, arch, meta, tensors, report)


def _vocab(obj, opts) -> int:
    """The model's vocabulary: its tokenizer's, or for byte-level runs the data's."""
    tok = obj.tokenizer(opts)
    if not tok.byte_level:
        return obj.vocab_for(opts, tok.vocab_size)
    from .hookspecs import plugin_manager
    from .runner import load_data

    return obj.vocab_for(opts, load_data(plugin_manager(obj), opts).vocab)


def _raw_type(name: str):
    import gguf

    return None if name in ("f32", "f16") else gguf.GGMLQuantizationType[name.upper()]


def _kept(info, src: str) -> tuple[str, np.ndarray, object]:
    """A tensor whose type does not change, as stored: its bytes (rows of whole blocks, the
    writer's raw layout), or for f32/f16 its values, which the writer stores exactly."""
    if src in ("f32", "f16"):
        return info.name, info.to_numpy().astype(np.float16 if src == "f16" else np.float32), None
    row = quant.FROZEN[src].row_bytes(info.shape[-1])
    return info.name, info.raw_bytes().reshape(*info.shape[:-1], row).copy(), _raw_type(src)


def _stored(name: str, values: np.ndarray, dtype: str) -> tuple[str, np.ndarray, object]:
    """`values` (f32) as a tensor of `dtype` for the writer: f32 and f16 as numpy arrays, every
    other type quantized by ggml's own quantizer; a row that does not fill whole blocks of the
    type is refused naming the tensor (never silently stored in another type)."""
    if dtype == "f32":
        return name, np.ascontiguousarray(values, np.float32), None
    if dtype == "f16":
        return name, values.astype(np.float16), None
    q = quant.FROZEN[dtype]
    if values.shape[-1] % q.block:
        raise InputError(f"--type {dtype}: tensor {name!r} has rows of {values.shape[-1]} values, not a multiple of "
                         f"{dtype}'s block of {q.block}; choose another type")
    try:
        return name, quant.quantize(values, dtype), _raw_type(dtype)
    except GGUFError as exc:
        raise InputError(f"--type {dtype}: tensor {name!r}: {exc}") from None


def _write(out: Path, arch: str, meta: dict, tensors: list, report: FuseReport) -> FuseReport:
    for _name, data, raw in tensors:
        t = "f32" if raw is None and data.dtype == np.float32 else "f16" if raw is None else raw.name.lower()
        report.types[t] = report.types.get(t, 0) + 1
    _write_atomic(out, arch, meta, tensors)
    report.bytes = out.stat().st_size
    return report
