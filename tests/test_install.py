"""Installing the checkout, as a user does: fresh venvs, pip's isolated build, one build cache.

Every pip install builds in a temporary build environment that pip deletes afterwards (its own
cmake and ninja included). A build cache configured by one install must serve the next one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from install_steps import ROOT, checkout_copy, pip_install, venv_sharing_dependencies


def object_times(cache: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in cache.rglob("*.o")}


@pytest.mark.slow      # the first install compiles ggml from scratch: minutes on two cores
def test_second_install_reuses_the_cache_of_the_first(tmp_path):
    src = checkout_copy(tmp_path / "checkout")
    env = {**os.environ, "TOYHARNESS_CACHE": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)
    # The pinned ggml source this checkout already fetched, so the test downloads no archive;
    # the fetch itself is not what is under test.
    ggml_src = subprocess.run([sys.executable, str(ROOT / "native" / "build.py"), "--print-src"],
                              capture_output=True, text=True, env=os.environ.copy()).stdout.strip()
    if not ggml_src or not Path(ggml_src, "CMakeLists.txt").is_file():
        pytest.skip("the pinned ggml source could not be fetched (native/build.py --print-src)")
    env["TOYHARNESS_GGML_SRC"] = ggml_src

    first = venv_sharing_dependencies(tmp_path / "venv-a")
    res = pip_install(first, "-e", str(src), env=env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "configuring ggml" in res.stdout + res.stderr

    objects = object_times(tmp_path / "cache")
    assert len(objects) > 20, "the first install built no ggml objects in the cache"

    second = venv_sharing_dependencies(tmp_path / "venv-b")
    res = pip_install(second, str(src), env=env)   # not editable: a wheel that carries the libraries
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "from scratch" not in res.stdout + res.stderr
    assert object_times(tmp_path / "cache") == objects, "the second install compiled ggml again"

    shutil.rmtree(src)  # the installed package must not need the checkout
    res = subprocess.run([str(second / "toyharness"), "recipes"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gpt2" in res.stdout and "toyharness" in res.stdout
    res = subprocess.run([str(second / "python"), "-c",
                          "from toyharness._ffi import lib, NATIVE_DIR; print(NATIVE_DIR, lib.ggml_tensor_overhead())"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(tmp_path / "venv-b") in res.stdout, res.stdout
