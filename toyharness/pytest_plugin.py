"""pytest integration (registered through the ``pytest11`` entry point).

Fixture ``toyharness_golden``: ``toyharness_golden(recipe, root=None)`` runs the recipe's
golden config and compares its losses with ``goldens/<fingerprint>/<recipe>.yml`` bit for
bit. Third-party plugins call it from their own test suites with their own goldens folder.

- a mismatch fails with the first diverging step, both values (hex and decimal), the ULP
  distance and how many later steps differ;
- with no golden for this build's fingerprint it checks the portable one
  (``goldens/cpu-portable/``, the same bits on any CPU), as ``toyharness golden check`` does;
  ``mode="fast"`` or ``"portable"`` picks one; the test's ``golden_mode`` property says which ran;
- a missing golden skips, saying how to record one;
- ``pytest --force-regen`` (pytest-regressions' flag) rewrites the golden instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def toyharness_golden(request):
    def check(recipe: str, root: str | Path | None = None, backend: str = "cpu", mode: str = "auto"):
        from toyharness import goldens

        root = Path(root) if root else None
        path, portable = goldens.resolve(recipe, backend, root, mode)
        force = bool(request.config.getoption("force_regen", default=False))
        if force:
            written = goldens.record(recipe, backend, root, mode)
            pytest.fail(f"golden for {recipe} rewritten at {written} (--force-regen): review and commit it",
                        pytrace=False)
        if not path.is_file():
            flag = " --mode portable" if portable else ""
            pytest.skip(f"no golden for {recipe} on {path.parent.name} at {path}: record one with "
                        f"`toyharness golden record {recipe}{flag}` (or pytest --force-regen)")
        request.node.user_properties.append(("golden_mode", goldens.describe(path)))
        _, mismatch = goldens.check(recipe, backend, root, mode)
        if mismatch is not None:
            pytest.fail(f"{mismatch} ({goldens.describe(path)})", pytrace=False)
        return path

    return check
