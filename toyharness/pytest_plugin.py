"""pytest integration (registered through the ``pytest11`` entry point; needs only pytest, which
``pip install toyharness[plugin]`` brings).

Fixture ``toyharness_golden``: ``toyharness_golden(recipe, root=None, backend="cpu", mode="auto")``
runs the recipe's golden config and compares its losses with ``<root>/<fingerprint>/<recipe>.yml``
bit for bit (`root` default: ./goldens or $TOYHARNESS_GOLDENS). Third-party plugins call it from
their own test suites with their own goldens folder.

- a mismatch fails with the first diverging step, both values (hex and decimal), the ULP
  distance and how many later steps differ;
- with no golden for this build's fingerprint it checks the portable one
  (``goldens/cpu-portable/``, the same bits on any CPU), as ``toyharness golden check`` does;
  ``mode="fast"`` or ``"portable"`` picks one; the test's ``golden_mode`` property says which ran;
- a missing golden skips, printing the two ways to record it: the ``toyharness golden record``
  command for exactly that file, or ``pytest --toyharness-record``;
- ``pytest --toyharness-record`` (or pytest-regressions' ``--force-regen``, where that plugin is
  installed) records the golden instead of checking it, and skips the test saying where it wrote
  it: review the file, commit it, and run pytest again to check it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

RECORD_FLAG = "--toyharness-record"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("toyharness").addoption(
        RECORD_FLAG, action="store_true", default=False,
        help="record the goldens the toyharness_golden fixture would check (then review and commit them)")


def record_command(recipe: str, backend: str, root: Path | None, portable: bool) -> str:
    """The `toyharness golden record` command that writes exactly the golden a check would read."""
    from toyharness import goldens

    parts = ["toyharness", "golden", "record", recipe]
    if backend != "cpu":
        parts += ["--backend", backend]
    else:
        parts += ["--mode", "portable" if portable else "fast"]
    parts += ["--dir", str(root if root is not None else goldens.golden_root())]
    return shlex.join(parts)


@pytest.fixture
def toyharness_golden(request: pytest.FixtureRequest):
    def check(recipe: str, root: str | Path | None = None, backend: str = "cpu", mode: str = "auto") -> Path:
        from toyharness import goldens

        root = Path(root) if root else None
        path, portable = goldens.resolve(recipe, backend, root, mode)
        record = request.config.getoption("toyharness_record", default=False) or \
            request.config.getoption("force_regen", default=False)
        if record:
            written = goldens.record(recipe, backend, root, mode)
            pytest.skip(f"recorded the golden for {recipe} at {written} ({RECORD_FLAG}): review and commit it; "
                        f"pytest without the flag checks it")
        if not path.is_file():
            pytest.skip(f"no golden for {recipe} on {path.parent.name} at {path}: record one with "
                        f"`{record_command(recipe, backend, root, portable)}` (or `pytest {RECORD_FLAG}`)")
        request.node.user_properties.append(("golden_mode", goldens.describe(path)))
        _, mismatch = goldens.check(recipe, backend, root, mode)
        if mismatch is not None:
            pytest.fail(f"{mismatch} ({goldens.describe(path)})", pytrace=False)
        return path

    return check
