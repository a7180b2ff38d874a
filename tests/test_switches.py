"""toyharness/switches.py: every TOYHARNESS_ environment variable the sources name is declared there
(and each declared one is used), none is read past it (no os.environ or getenv of one elsewhere, no
getenv of ours in native code), a value a switch does not take is refused by name (one line, exit 2,
through the CLI), and docs/environment.md is the page it generates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli

from toyharness import switches
from toyharness.switches import BY_NAME, SWITCHES, SwitchError, switch

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"TOYHARNESS_[A-Z0-9_]+")
SOURCE_SUFFIXES = {".py", ".c", ".h", ".cu", ".cuh", ".cpp", ".sh", ".yml", ".yaml", ".toml", ".txt", ".cmake"}


def source_files() -> list[Path]:
    """The sources whose TOYHARNESS_ names count: the package, native code and its build, the
    recipes, the test suite, the nox sessions, setup.py and CI."""
    files = [ROOT / "noxfile.py", ROOT / "setup.py"]
    for folder in ("toyharness", "native", "plugins", "tests", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and
                  (p.suffix in SOURCE_SUFFIXES or p.parent.name == ".ci") and "_native" not in p.parts]
    return [p for p in files if p.is_file()]


def not_a_variable(name: str) -> bool:
    """C include guards (TOYHARNESS_CPU_KERNELS_H) and CMake's check results (TOYHARNESS_HAS_*)."""
    return name.endswith("_H") or name.startswith("TOYHARNESS_HAS_")


def cmake_variables() -> set[str]:
    """Names that native/CMakeLists.txt defines for itself (set, cache entries, computed folders,
    flag lists): CMake variables that build.py may pass as -DNAME=..., not environment variables."""
    text = (ROOT / "native" / "CMakeLists.txt").read_text()
    return {n for n in NAME.findall(text) if not not_a_variable(n)} - set(BY_NAME)


def names_in_sources() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in source_files():
        if path == ROOT / "toyharness" / "switches.py":
            continue
        for name in set(NAME.findall(path.read_text(errors="replace"))):
            if not not_a_variable(name):
                found.setdefault(name, []).append(path)
    return found


def test_every_toyharness_variable_in_the_sources_is_a_switch_and_every_switch_is_used():
    found = names_in_sources()
    cmake = cmake_variables()
    undeclared = {n: [str(p.relative_to(ROOT)) for p in paths] for n, paths in found.items()
                  if n not in BY_NAME and n not in cmake}
    assert not undeclared, f"TOYHARNESS_ names read but not declared in toyharness/switches.py: {undeclared}"
    unused = [s.name for s in SWITCHES if s.name not in found]
    assert not unused, f"switches declared but named nowhere in the sources: {unused}"
    # a CMake variable appears in Python only as a -D definition that build.py passes to CMake
    for name in cmake:
        for path in found.get(name, []):
            if path.suffix == ".py":
                for match in re.finditer(name, path.read_text()):
                    text = path.read_text()
                    assert text[max(0, match.start() - 2):match.start()] == "-D", (name, path)


def test_at_most_fifteen_switches_each_with_its_kind_values_and_purpose():
    assert len(SWITCHES) <= 15, [s.name for s in SWITCHES]
    assert len(BY_NAME) == len(SWITCHES)
    for s in SWITCHES:
        assert s.kind in switches.KINDS and s.purpose.endswith("."), s.name
        assert s.values or s.form, s.name
        if s.values and s.form != "list":
            assert s.default in s.values, s.name


# reading a TOYHARNESS_ variable past the registry: os.environ.get / os.environ[...] / getenv
READ = re.compile(r"""(environ\.get\(|environ\[|getenv\(|environ\.setdefault\()\s*["'](TOYHARNESS_[A-Z0-9_]+)""")


def test_no_toyharness_variable_is_read_past_the_registry():
    readers = []
    for path in source_files():
        if path == ROOT / "toyharness" / "switches.py":
            continue
        for match in READ.finditer(path.read_text(errors="replace")):
            readers.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not readers, readers


def test_native_code_reads_no_environment_variable_of_ours():
    """Native code gets the switches it acts on from Python (toyharness/_ffi.py, pass_switches); the
    one getenv left is ggml-cuda's own GGML_CUDA_GRAPH_OPT, read where ggml reads it."""
    calls = []
    for path in (ROOT / "native").rglob("*"):
        if path.suffix in (".c", ".h", ".cu", ".cuh", ".cpp"):
            calls += [(path.name, m) for m in re.findall(r"getenv\(\s*([^)]*)\)", path.read_text())]
    assert calls == [("th-precision.cu", '"GGML_CUDA_GRAPH_OPT"')], calls


@pytest.mark.parametrize("name, raw, message", [
    ("TOYHARNESS_GGML_LOG", "banana", "TOYHARNESS_GGML_LOG=banana: not one of 1, 2, 3, 4, 5"),
    ("TOYHARNESS_SIMD", "sse9", "TOYHARNESS_SIMD=sse9: not one of native, avx2, none"),
    ("TOYHARNESS_BACKENDS", "cpu,opengl", "TOYHARNESS_BACKENDS=cpu,opengl: not a comma list of cpu, cuda, vulkan, "
                                          "metal"),
    ("TOYHARNESS_OBSERVER_WAIT_S", "soon", "TOYHARNESS_OBSERVER_WAIT_S=soon: not a number of seconds >= 0"),
    ("TOYHARNESS_OBSERVER_WAIT_S", "inf", "TOYHARNESS_OBSERVER_WAIT_S=inf: not a number of seconds >= 0"),
    ("TOYHARNESS_MEMORY_CHECK", "maybe", "TOYHARNESS_MEMORY_CHECK=maybe: not one of on, off"),
    ("TOYHARNESS_CUDNN", "maybe", "TOYHARNESS_CUDNN=maybe: not one of auto, on, off or folders (DIR[:DIR])"),
    ("TOYHARNESS_CUDNN_ATTENTION", "no", "TOYHARNESS_CUDNN_ATTENTION=no: not one of 1, 0, refuse"),
])
def test_a_value_a_switch_does_not_take_is_refused_by_name(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(SwitchError, match=re.escape(message)):
        switch(name)


def test_values_defaults_and_forms(monkeypatch, tmp_path):
    for s in SWITCHES:
        monkeypatch.delenv(s.name, raising=False)
        assert switch(s.name) == s.default, s.name
    monkeypatch.setenv("TOYHARNESS_BACKENDS", " CPU, cuda ")
    assert switch("TOYHARNESS_BACKENDS") == "cpu,cuda"
    monkeypatch.setenv("TOYHARNESS_OBSERVER_WAIT_S", "0.5")
    assert switch("TOYHARNESS_OBSERVER_WAIT_S") == "0.5"
    monkeypatch.setenv("TOYHARNESS_CUDNN", f"{tmp_path}:{tmp_path}/include")
    assert switch("TOYHARNESS_CUDNN") == f"{tmp_path}:{tmp_path}/include"
    monkeypatch.setenv("TOYHARNESS_GGML_LOG", "")            # empty: the default
    assert switch("TOYHARNESS_GGML_LOG") == "3"
    unknown = "TOYHARNESS_" + "NOPE"          # (spelled apart: no undeclared name in the sources)
    with pytest.raises(SwitchError, match=f"{unknown} is not a toyharness switch"):
        switch(unknown)


def test_a_switch_error_is_an_input_error_inside_the_package():
    from toyharness.errors import InputError

    assert issubclass(SwitchError, InputError)


def test_the_cli_refuses_a_bad_value_in_one_line_exit_2():
    done = cli("recipes", env={**os.environ, "TOYHARNESS_GGML_LOG": "banana"}, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "toyharness: error: TOYHARNESS_GGML_LOG=banana: not one of 1, 2, 3, 4, 5\n"
    assert done.stdout == ""
    assert cli("recipes", env={**os.environ, "TOYHARNESS_GGML_LOG": "4"}, cwd=ROOT).returncode == 0


def test_native_build_refuses_a_bad_value_by_name_before_anything_builds(tmp_path):
    """native/build.py loads the registry by its path (the package is not importable while it is
    built) and names the switch in its BuildError."""
    done = subprocess.run([sys.executable, str(ROOT / "native" / "build.py"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env={**os.environ, "TOYHARNESS_BACKENDS": "cpu,opengl"})
    assert done.returncode != 0
    assert "TOYHARNESS_BACKENDS=cpu,opengl: not a comma list of cpu, cuda, vulkan, metal" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_environment_page_is_current():
    page = ROOT / "docs" / "environment.md"
    assert page.read_text() == switches.markdown(), (
        "docs/environment.md is stale: python -m toyharness.switches --markdown > docs/environment.md")


def test_the_module_writes_the_page():
    done = subprocess.run([sys.executable, "-m", "toyharness.switches", "--markdown"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == switches.markdown()
    assert subprocess.run([sys.executable, "-m", "toyharness.switches"], capture_output=True,
                          cwd=ROOT).returncode == 2
