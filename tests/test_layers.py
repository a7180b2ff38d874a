"""The import layers of toyharness (pyproject.toml, [tool.importlinter]): `lint-imports` keeps
both contracts, and refuses an upward import by name."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("importlinter") is None,
                                reason="import-linter is not installed (the test extra has it: pip install -e .[test])")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports as its console script runs it, over the toyharness package found in `cwd`."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_the_layers_and_no_cycles_contracts_are_kept():
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Contracts: 2 kept, 0 broken." in res.stdout


def test_an_import_from_a_lower_layer_breaks_the_contract(tmp_path):
    """The same package with one upward import: the engine reaching for the runner."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "toyharness", tmp_path / "toyharness",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so*", "*.dylib", "*.dll"))
    quant = tmp_path / "toyharness" / "engine" / "quant.py"
    quant.write_text(quant.read_text() + "\n\ndef upward():\n    from ..runner import train\n\n    return train\n")
    res = lint_imports(tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "toyharness.engine is not allowed to import toyharness.runner" in res.stdout, res.stdout
    assert "toyharness.engine.quant -> toyharness.runner" in res.stdout, res.stdout
    assert "Contracts: 0 kept, 2 broken." in res.stdout, res.stdout
