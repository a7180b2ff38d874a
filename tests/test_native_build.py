"""native/build.py's cache of build folders, on a tiny CMake project (seconds, not a ggml build).

A build folder outlives the install that configured it: it must survive that install's tools
being deleted (pip's isolated build environment), another clone building next, and an
interrupted configure or build.
"""

from __future__ import annotations

import importlib.util
import os
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
        assert build_module.cudnn_options() == [f"-DTH_CUDNN_INCLUDE={root / 'include'};{frontend}",
                                                f"-DTH_CUDNN_LIBRARY={root / 'lib' / 'libcudnn.so.9'}"]
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


# build() over a fake ggml and a fake native/ folder: the real CMake flow, in seconds.
FAKE_GGML_LIBS = ("ggml-base", "ggml-cpu", "ggml")


def fake_ggml(folder: Path) -> Path:
    """A source folder native/build.py takes for ggml's: CMakeLists.txt, include/ggml.h, three libraries."""
    (folder / "include").mkdir(parents=True)
    (folder / "include" / "ggml.h").write_text("")
    lines = ["cmake_minimum_required(VERSION 3.21)", "project(fake_ggml C)"]
    for lib in FAKE_GGML_LIBS:
        symbol = lib.replace("-", "_")
        (folder / f"{symbol}.c").write_text(f"int {symbol}_marker(void) {{ return 0; }}\n")
        lines.append(f"add_library({lib} SHARED {symbol}.c)")
    (folder / "CMakeLists.txt").write_text("\n".join(lines) + "\n")
    return folder


def write_shim(native_dir: Path, value: int) -> None:
    (native_dir / "shim.c").write_text(f"int th_value(void) {{ return {value}; }}\n")


def fake_native(folder: Path, value: int = 1) -> Path:
    """A native/ folder: ggml added as a subdirectory, and a shim whose th_value() returns `value`;
    a README and a llamacpp/ folder, which no library build reads."""
    (folder / "llamacpp").mkdir(parents=True)
    (folder / "llamacpp" / "tool.c").write_text("int main(void) { return 0; }\n")
    (folder / "README.md").write_text("the native side\n")
    (folder / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(fake_native C)\n"
        'add_subdirectory("${TOYHARNESS_GGML_SRC}" ggml)\nadd_library(toyharness_shim SHARED shim.c)\n')
    write_shim(folder, value)
    return folder


@pytest.fixture
def fake_tree(native, monkeypatch, tmp_path) -> Path:
    """The fake ggml where the pinned source is cached (so nothing is fetched), the fake native/
    folder as the module's NATIVE_DIR, default backends and SIMD level. Returns the native folder."""
    for name in ("TOYHARNESS_GGML_SRC", "TOYHARNESS_BACKENDS", "TOYHARNESS_SIMD"):
        monkeypatch.delenv(name, raising=False)
    ggml = fake_ggml(native._cache_dir(f"ggml-{native.GGML_VERSION}"))
    (ggml / ".complete").write_text("a fake ggml for tests\n")
    native_dir = fake_native(tmp_path / "clone" / "native")
    monkeypatch.setattr(native, "NATIVE_DIR", native_dir)
    return native_dir


def shim_value(native, bdir: Path, out: Path) -> int:
    """Install the build's libraries into `out` (a new folder each time: the loader caches by
    path) and call the shim."""
    import ctypes

    native.install_into(out, bdir)
    return ctypes.CDLL(str(out / "libtoyharness_shim.so")).th_value()


def forbid_build_tools(native, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a build tool was looked for or run for a current build")

    for name in ("cmake_build", "run", "find_tool"):
        monkeypatch.setattr(native, name, refuse)


def test_a_current_build_runs_no_cmake_and_a_changed_source_builds_again(native, fake_tree, tmp_path, monkeypatch,
                                                                          capsys):
    bdir = native.build()
    assert "configuring ggml (cpu)" in capsys.readouterr().err
    assert (bdir / native.BUILT_STAMP).is_file()
    assert shim_value(native, bdir, tmp_path / "out-1") == 1

    with monkeypatch.context() as patch:
        forbid_build_tools(native, patch)
        assert native.build() == bdir
        assert "ggml (cpu) up to date in" in capsys.readouterr().err
        assert native.build_requirements() == []  # pip's build environment needs no tool either
        # the same bytes, touched; files no library build reads, changed: still current
        (fake_tree / "shim.c").touch()
        (fake_tree / "README.md").write_text("edited\n")
        (fake_tree / "llamacpp" / "tool.c").write_text("int main(void) { return 1; }\n")
        assert native.build() == bdir
        assert "cmake not run" in capsys.readouterr().err

    write_shim(fake_tree, 2)
    assert native.build() == bdir
    err = capsys.readouterr().err
    assert "ggml (cpu) ready in" in err and "up to date" not in err
    assert shim_value(native, bdir, tmp_path / "out-2") == 2


def test_a_failed_build_is_never_taken_for_a_current_one(native, fake_tree, capsys):
    bdir = native.build()
    write_shim(fake_tree, 2)
    native.build()  # the stamp now records value 2's sources
    (fake_tree / "shim.c").write_text("int th_value(void) { return undefined_name; }\n")
    with pytest.raises(native.BuildError, match="undefined_name"):
        native.build()
    assert not (bdir / native.BUILT_STAMP).exists()
    write_shim(fake_tree, 2)  # the sources of the last finished build again: built again all the same
    capsys.readouterr()
    native.build()
    assert "ggml (cpu) ready in" in capsys.readouterr().err


def test_libraries_changed_behind_the_record_are_built_again(native, fake_tree, capsys):
    """Another clone's build in the same folder (by a toyharness that writes no record), or ninja
    run by hand, leaves other libraries than the recorded ones: cmake runs."""
    bdir = native.build()
    shim = bdir / "libtoyharness_shim.so"
    stat = shim.stat()
    os.utime(shim, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    capsys.readouterr()
    native.build()
    assert "ggml (cpu) ready in" in capsys.readouterr().err


def test_a_compiler_replaced_since_the_build_builds_again(native, fake_tree, capsys):
    bdir = native.build()
    stamp = bdir / native.BUILT_STAMP
    lines = stamp.read_text().splitlines()
    tools = [i for i, line in enumerate(lines) if line.startswith("tool ")]
    assert tools, "the record names no compiler"
    head, size, mtime = lines[tools[0]].rsplit(" ", 2)
    assert Path(head.split(" ", 1)[1]).is_file()
    # what the record would say had the compiler been upgraded after this build
    lines[tools[0]] = f"{head} {size} {int(mtime) - 1_000_000_000}"
    stamp.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    native.build()
    assert "ggml (cpu) ready in" in capsys.readouterr().err


def test_build_inputs_digest_follows_content_options_and_the_ggml_source(build_module, tmp_path):
    ggml = fake_ggml(tmp_path / "ggml")
    clone = fake_native(tmp_path / "a" / "native")
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
    first = build_module.build_inputs_digest(clone, ggml, options)
    # another clone with the same files: the same build
    assert build_module.build_inputs_digest(fake_native(tmp_path / "b" / "native"), ggml, options) == first
    write_shim(clone, 2)
    assert build_module.build_inputs_digest(clone, ggml, options) != first
    write_shim(clone, 1)
    assert build_module.build_inputs_digest(clone, ggml, options) == first
    assert build_module.build_inputs_digest(clone, ggml, [*options, "-DTOYHARNESS_SIMD=avx2"]) != first
    (clone / "cuda").mkdir()
    (clone / "cuda" / "kernel.cu").write_text("// a new kernel\n")
    assert build_module.build_inputs_digest(clone, ggml, options) != first
    (clone / "cuda" / "kernel.cu").unlink()
    (ggml / "ggml.c").write_text("int ggml_marker(void) { return 1; }\n")
    assert build_module.build_inputs_digest(clone, ggml, options) != first


def test_build_requirements_name_only_what_this_machine_lacks(build_module, monkeypatch, tmp_path):
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(build_module, "find_tool", lambda name: None)
    # nothing cached, no tool: what a fresh machine with Python, pip and a C compiler needs
    assert build_module.build_requirements() == ["pip", "cmake>=3.21", "ninja"]
    monkeypatch.setattr(build_module, "find_tool", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(build_module, "tool_version", lambda tool: (3, 16, 3) if "cmake" in tool else (1, 11, 1))
    assert build_module.build_requirements() == ["pip", "cmake>=3.21"]  # too old a cmake
    monkeypatch.setattr(build_module, "tool_version", lambda tool: (3, 25, 1) if "cmake" in tool else None)
    assert build_module.build_requirements() == ["pip", "ninja"]  # a ninja that does not run


def test_the_package_backend_adds_the_native_requirements_to_setuptools(monkeypatch, tmp_path):
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location(
        "toyharness_build_backend_under_test", ROOT / "native" / "backend" / "toyharness_build_backend.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    monkeypatch.setenv("TOYHARNESS_CACHE", str(tmp_path / "empty-cache"))
    for hook in ("get_requires_for_build_editable", "get_requires_for_build_wheel"):
        # (setuptools' own hook runs setup.py egg_info in the clone: stood in for here)
        monkeypatch.setattr(backend._setuptools, hook, lambda config_settings=None: ["setuptools-asks"])
        requirements = getattr(backend, hook)()
        # the ggml source is not cached: the build fetches it with pip
        assert requirements[:2] == ["setuptools-asks", "pip"], requirements
