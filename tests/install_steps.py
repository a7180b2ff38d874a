"""The steps of installing the checkout as a user does (a copy of the checkout, a fresh venv, pip),
shared by tests/test_install.py and tests/test_install_speed.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def checkout_copy(dest: Path) -> Path:
    """The files git would clone (tracked, plus untracked ones it does not ignore), copied."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs git to list the checkout's files")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def venv_sharing_dependencies(path: Path) -> Path:
    """A fresh venv that sees this interpreter's dependencies (numpy, cffi, ...) but no toyharness,
    so the install under test needs `--no-deps` only and the test stays fast and offline-friendly."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    shared = path / "shared-deps"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.startswith(("toyharness", "__editable__", "_toyharness")) or entry.suffix == ".pth":
            continue
        (shared / entry.name).symlink_to(entry)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(path / "bin" / "python"), "-c", purelib],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "shared-deps.pth").write_text(f"{shared}\n")
    return path / "bin"


def pip_install(bin_dir: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # Build isolation stays on (pip's default): the build runs in a temporary environment.
    # -v: pip shows the build's own log, which says whether the cache was configured again.
    return subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "-v", *args],
                          capture_output=True, text=True, env=env)
