"""pytest integration (registered through the ``pytest11`` entry point).

Fixture ``toyharness_golden``: ``toyharness_golden(recipe, root=None)`` runs the recipe's
golden config and compares its losses with ``goldens/<fingerprint>/<recipe>.yml`` bit for
bit. Third-party plugins call it from their own test suites with their own goldens folder.

- a mismatch fails with the first diverging step, both values (hex and decimal), the ULP
  distance and how many later steps differ;
- a missing golden for this fingerprint skips, saying how to record one;
- ``pytest --force-regen`` (pytest-regressions' flag) rewrites the golden instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def toyharness_golden(request):
    def check(recipe: str, root: str | Path | None = None, backend: str = "cpu"):
        from toyharness import goldens
        from toyharness.engine import get_engine

        root = Path(root) if root else None
        path = goldens.path_for(recipe, get_engine(backend).fingerprint(), root)
        force = bool(request.config.getoption("force_regen", default=False))
        if force:
            written = goldens.record(recipe, backend, root)
            pytest.fail(f"golden for {recipe} rewritten at {written} (--force-regen): review and commit it",
                        pytrace=False)
        if not path.is_file():
            pytest.skip(f"no golden for {recipe} on {path.parent.name} at {path}: record one with "
                        f"`toyharness golden record {recipe}` (or pytest --force-regen)")
        _, mismatch = goldens.check(recipe, backend, root)
        if mismatch is not None:
            pytest.fail(str(mismatch), pytrace=False)
        return path

    return check
