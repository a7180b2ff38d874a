"""native/build.py's cache of build folders, on a tiny CMake project (seconds, not a ggml build).

A build folder outlives the install that configured it: it must survive that install's tools
being deleted (pip's isolated build environment), another clone building next, and an
interrupted configure or build.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def native(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("toyharness_native_build_under_test", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.find_tool("cmake") is None:
        pytest.skip("cmake is not installed here")
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "cache"))
    return module


def tiny_project(folder: Path, value: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(tiny C)\nadd_library(tiny SHARED tiny.c)\n")
    (folder / "tiny.c").write_text(f"int tiny_value(void) {{ return {value}; }}\n")
    return folder


def objects(bdir: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in bdir.rglob("*.o")}


def build(native, source: Path, bdir: Path) -> None:
    native.cmake_build(source, bdir, ["-DCMAKE_BUILD_TYPE=Release"], "tiny")


def test_tools_gone_reconfigures_and_keeps_objects(native, tmp_path, capsys):
    bdir = tmp_path / "cache" / "build" / "tiny"
    build(native, tiny_project(tmp_path / "clone"), bdir)
    before = objects(bdir)
    assert before
    cache = bdir / "CMakeCache.txt"
    text = cache.read_text()
    for key in ("CMAKE_COMMAND", "CMAKE_MAKE_PROGRAM"):
        text = "\n".join(f"{line.split('=')[0]}=/tmp/pip-build-env-gone/bin/tool" if line.startswith(key + ":")
                         else line for line in text.splitlines())
    cache.write_text(text + "\n")
    capsys.readouterr()

    build(native, tmp_path / "clone", bdir)

    err = capsys.readouterr().err
    assert "names tools that no longer exist (/tmp/pip-build-env-gone/bin/tool" in err
    assert objects(bdir) == before, "reconfiguring compiled the objects again"
    assert "/tmp/pip-build-env-gone" not in cache.read_text()


def test_each_clone_builds_its_own_sources(native, tmp_path):
    bdir = tmp_path / "cache" / "build" / "tiny"
    build(native, tiny_project(tmp_path / "clone-a", value=1), bdir)
    build(native, tiny_project(tmp_path / "clone-b", value=2), bdir)
    assert "return 2;" in (bdir / "source" / "tiny.c").read_text()
    shutil.rmtree(tmp_path / "clone-a")  # the clone that configured the folder is gone
    tiny_project(tmp_path / "clone-b", value=3)
    build(native, tmp_path / "clone-b", bdir)
    assert "return 3;" in (bdir / "source" / "tiny.c").read_text()


def test_interrupted_configure_is_built_again(native, tmp_path, capsys):
    bdir = tmp_path / "cache" / "build" / "tiny"
    build(native, tiny_project(tmp_path / "clone"), bdir)
    (bdir / native.STAMP).unlink()  # as if the configure had been killed before it finished
    capsys.readouterr()
    build(native, tmp_path / "clone", bdir)
    err = capsys.readouterr().err
    assert "has no record of a finished configure" in err and "from scratch" in err
    assert (bdir / native.STAMP).is_file()


def test_broken_build_folder_is_built_again_but_a_compile_error_is_reported(native, tmp_path, capsys):
    bdir = tmp_path / "cache" / "build" / "tiny"
    clone = tiny_project(tmp_path / "clone")
    build(native, clone, bdir)
    # Damage the folder as an interrupted build can: the generated build file half written.
    generated = bdir / ("build.ninja" if (bdir / "build.ninja").is_file() else "Makefile")
    generated.write_text(generated.read_text()[:200])
    capsys.readouterr()
    build(native, clone, bdir)
    assert "building it again from scratch" in capsys.readouterr().err

    (clone / "tiny.c").write_text("int tiny_value(void) { return undefined_name; }\n")
    with pytest.raises(native.BuildError, match="undefined_name"):
        build(native, clone, bdir)
    assert "from scratch" not in capsys.readouterr().err


@pytest.fixture
def build_module():
    spec = importlib.util.spec_from_file_location("toyharness_native_build_cudnn", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_cudnn(folder: Path) -> tuple[Path, Path]:
    """A cuDNN folder (include/cudnn.h, lib/libcudnn.so.9) and a frontend's include folder, empty files."""
    (folder / "cudnn" / "include").mkdir(parents=True)
    (folder / "cudnn" / "lib").mkdir()
    (folder / "cudnn" / "include" / "cudnn.h").write_text("")
    (folder / "cudnn" / "lib" / "libcudnn.so.9").write_text("")
    (folder / "frontend").mkdir()
    (folder / "frontend" / "cudnn_frontend.h").write_text("")
    return folder / "cudnn", folder / "frontend"


def test_cudnn_options_name_the_found_folders(build_module, monkeypatch, tmp_path):
    """TOYHARNESS_CUDNN=DIR:DIR: cuDNN's folder and the frontend's, searched first (on: both found)."""
    root, frontend = fake_cudnn(tmp_path)
    for folders in (f"{root}:{frontend}", f"{frontend}:{root}"):
        monkeypatch.setenv("TOYHARNESS_CUDNN", folders)
        assert build_module.cudnn_options() == [f"-DTOYHARNESS_CUDNN_INCLUDE={root / 'include'};{frontend}",
                                                f"-DTOYHARNESS_CUDNN_LIBRARY={root / 'lib' / 'libcudnn.so.9'}"]
        # a build without cuda has no cuDNN option (and so keeps its build folder's key)
        assert not any("CUDNN" in option for option in build_module.cmake_options(["cpu"]))
    monkeypatch.setenv("TOYHARNESS_CUDNN", "off")
    assert build_module.cudnn_options() == []


def test_cudnn_missing_is_off_for_auto_and_an_error_naming_what_for_on(build_module, monkeypatch, tmp_path, capsys):
    root, frontend = fake_cudnn(tmp_path)
    (frontend / "cudnn_frontend.h").unlink()
    monkeypatch.setattr(build_module.sys, "path", [])             # no frontend wheel installed either
    monkeypatch.setenv("TOYHARNESS_CUDNN", "auto")
    assert build_module.cudnn_options() == []
    assert "cuDNN attention: off, not found: " in capsys.readouterr().err
    monkeypatch.setenv("TOYHARNESS_CUDNN", f"{root}:{frontend}")
    with pytest.raises(build_module.BuildError, match=r"TOYHARNESS_CUDNN=.*: not found: cuDNN's frontend headers "
                                                       r"\(pip install nvidia-cudnn-frontend"):
        build_module.cudnn_options()
    monkeypatch.setenv("TOYHARNESS_CUDNN", "maybe")
    with pytest.raises(build_module.BuildError, match=r"TOYHARNESS_CUDNN=maybe: not one of auto, on, off or folders"):
        build_module.cudnn_options()
