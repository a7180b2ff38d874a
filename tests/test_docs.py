"""The docs site builds strictly: every internal link and anchor resolves, every page is in the nav
(mkdocs.yml's `validation:`), and the build prints no warning at all."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs not installed: pip install -e '.[docs]'")
def test_docs_build_strict_without_warnings(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})   # Material's banner about its future
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "design" / "index.html").is_file()
