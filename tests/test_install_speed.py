"""`pip install -e .` where the cache already holds a build of these sources: pip's build
environment gets no cmake, ninja or pip, and the build runs no cmake; it copies the libraries.

What made such an install slow was not compiling: it was pip installing cmake's wheel into a fresh
build environment at every install, and cmake configuring ggml again with it. The test checks
that neither happens (from the build's own log), not a wall-clock time.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import native_build
from install_steps import checkout_copy, pip_install, venv_sharing_dependencies

NO_INDEX = ("No matching distribution found for setuptools", "Could not find a version that satisfies the requirement")


def test_install_with_a_current_build_runs_no_cmake(tmp_path):
    native = native_build()
    try:
        bdir = native.build()  # what a first install did: the cache now holds these sources' build
    except native.BuildError as exc:
        pytest.skip(f"no native build here to reuse: {native.last_line(str(exc))}")
    built = {soname: path.read_bytes() for soname, path in native.built_libraries(bdir).items()}

    src = checkout_copy(tmp_path / "checkout")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    venv = venv_sharing_dependencies(tmp_path / "venv")
    res = pip_install(venv, "-e", str(src), env=env)
    log = res.stdout + res.stderr
    if res.returncode != 0 and any(line in log for line in NO_INDEX):
        pytest.skip("pip could not get setuptools for its build environment (no package index reachable)")
    assert res.returncode == 0, log[-4000:]

    # pip's build environment: setuptools only, the build being current
    assert "is current: no build tool needed" in log and "native build requirements for pip: none" in log
    build_env = [line for line in log.splitlines() if "Successfully installed" in line and "setuptools" in line]
    assert build_env and not any(tool in build_env[0] for tool in ("cmake", "ninja", " pip-")), log[-4000:]
    assert "ggml (" in log and "cmake not run" in log, log[-4000:]
    assert "configuring ggml" not in log and "ready in" not in log
    installed = src / "toyharness" / "_native"
    assert {soname: (installed / soname).read_bytes() for soname in built} == built

    probe = "from toyharness._ffi import lib, NATIVE_DIR; print(NATIVE_DIR, lib.ggml_tensor_overhead())"
    res = subprocess.run([str(venv / "python"), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(installed) in res.stdout
