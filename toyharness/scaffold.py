"""`toyharness new-recipe NAME [--from RECIPE] [--out DIR]`: the start of a new recipe plugin.

It writes an installable package, in a folder of its own:

- ``pyproject.toml`` publishing the recipe under the ``toyharness.recipes`` entry point as NAME;
- ``toyharness_NAME/__init__.py``: the recipe, from a small template on the public API, or, with
  ``--from RECIPE``, the module (or package) of an installed recipe, copied and renamed;
- ``tests/test_NAME.py``: its golden through the ``toyharness_golden`` fixture, and that it learns;
- ``goldens/cpu-portable/NAME.yml``: its portable golden, recorded by running the harness on it;
- ``.github/workflows/test.yml``: CI that installs the package and runs its tests;
- ``README.md`` and ``.gitignore``.

The folder is built under a temporary name beside DIR and renamed into place only once the
golden is recorded: a failure leaves nothing behind. The golden run sees the new recipe through a
temporary dist-info (its entry point), so nothing is installed to record it.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import CheckFailed, InputError, WriteError

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*\Z")
VERSION = "0.1.0"


def check_name(name: str) -> None:
    """A recipe name is also part of a Python package name: lowercase letters, digits, `_`."""
    if not NAME_PATTERN.match(name) or keyword.iskeyword(name):
        raise InputError(f"recipe name {name!r}: use lowercase letters, digits and _, starting with a letter")
    from .discovery import discover

    installed = discover()
    if name in installed:
        raise InputError(f"recipe name {name!r} is already installed (distribution {installed[name].distribution}); "
                         "pick another")


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part) or "Recipe"


def template_recipe(name: str) -> str:
    """A small recipe on the public API: the next byte from an embedding of this one, through a
    tanh layer. Every line is the author's to change."""
    cls = class_name(name)
    return f'''"""The {name} recipe: the next byte from this byte's embedding, through a tanh hidden layer.

Written on toyharness's public API only (`from toyharness import ...`); change the model in
`{cls}Model` and the keys in `{cls}Options`, then record the goldens again.
"""

from __future__ import annotations

from dataclasses import dataclass

from toyharness import Recipe, TextOptions, blocks, hookimpl, normal, positive


@dataclass
class {cls}Options(TextOptions):
    # every recipe's keys (batch, seed, AdamW, loop, data) plus t_seq and eval_batches; yours below
    d_embed: int = positive(16)
    hidden: int = positive(64)
    t_seq: int = 32
    t_batch: int = 8
    lr: float = 1e-2
    steps: int = 200
    eval_every: int = 100
    checkpoint_every: int = 100

    def validate(self) -> None:
        super().validate()            # the base keys and every `positive` key
        if self.hidden < self.d_embed:
            raise self.invalid("hidden", f"must be at least d_embed ({{self.d_embed}}), got {{self.hidden}}")


class {cls}Model:
    convention = "constant_betas"     # the AdamW row convention this graph is trained with

    def __init__(self, engine, o: {cls}Options, vocab: int):
        prog = engine.program()

        def param(name, shape, std):
            return prog.param(name, normal(o.seed, name, shape, std * o.init_scale))

        table = param("token_embd.weight", (vocab, o.d_embed), 1.0)
        w_hidden = param("hidden.weight", (o.hidden, o.d_embed), o.d_embed ** -0.5)
        w_out = param("output.weight", (vocab, o.hidden), o.hidden ** -0.5)
        tokens = prog.input("tokens", (o.t_batch, o.t_seq), "i32", upper=vocab)
        h = blocks.linear(table.get_rows(tokens), w_hidden).tanh()
        logits = blocks.linear(h, w_out)
        self.trainer = prog.trainer(prog.cross_entropy(logits, "targets"), self.convention)


class {cls}(Recipe):
    name = "{name}"
    options_class = {cls}Options
    # the options of the golden run, over the defaults above: small, so it records in a second
    golden_config = {{"d_embed": 8, "hidden": 16, "t_seq": 16, "t_batch": 2, "warmup": 2, "seed": 7,
                     "eval_every": 1000, "checkpoint_every": 1000}}

    @hookimpl
    def realize(self, engine, options, data):
        return {cls}Model(engine, options, data.vocab)


recipe = {cls}()
'''


def recipe_tests(name: str) -> str:
    return f'''"""The {name} recipe's own tests: its golden through toyharness's pytest fixture."""

import json
from pathlib import Path

from toyharness import train

GOLDENS = Path(__file__).resolve().parent.parent / "goldens"


def test_{name}_matches_its_portable_golden(toyharness_golden):
    # the portable mode's golden holds the same bits on any CPU; after an intended change to the
    # model, record it again: toyharness golden record {name} --mode portable --dir goldens
    toyharness_golden("{name}", root=GOLDENS, mode="portable")


def test_{name}_learns(tmp_path):
    out = tmp_path / "run"
    train("{name}", steps=30, sets=["eval_every=30", "checkpoint_every=30"], out=str(out), progress=False)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-5:]) / 5 < losses[0], losses
'''


def pyproject(name: str, module: str, attr: str) -> str:
    return f'''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "toyharness-{name.replace("_", "-")}"
version = "{VERSION}"
description = "The {name} recipe for toyharness"
requires-python = ">=3.10"
dependencies = ["toyharness"]

[project.optional-dependencies]
test = ["pytest>=8"]

# how `toyharness run {name}` finds the recipe
[project.entry-points."toyharness.recipes"]
{name} = "{module}:{attr}"

[tool.setuptools]
packages = ["{module}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''


WORKFLOW = '''name: test
on: [push, pull_request]
jobs:
  test:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.11"
      - name: install the recipe and its test dependencies
        run: python -m pip install -e ".[test]"
      - name: its tests (the portable golden holds on any CPU)
        run: python -m pytest -q
'''


def readme(name: str, origin: str) -> str:
    return f'''# toyharness-{name.replace("_", "-")}

The `{name}` recipe for toyharness ({origin}).

```sh
pip install -e ".[test]"
toyharness run {name} --steps 200
pytest                                                    # its golden and that it learns
toyharness golden record {name} --mode portable --dir goldens   # after an intended change
```
'''


def copy_recipe(source: str, name: str, module: str, dest: Path) -> tuple[str, str]:
    """Copy installed recipe `source` into package folder `dest` (named `module`), renamed to
    `name`. Returns (attribute of the recipe object, where it came from)."""
    from .discovery import discover

    installed = discover()
    if source not in installed:
        raise InputError(f"--from {source}: no such recipe; installed: {', '.join(installed) or 'none'}")
    entry = installed[source]
    src_module, _, attr = entry.value.partition(":")
    spec = importlib.util.find_spec(src_module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise InputError(f"--from {source}: its module {src_module} has no Python source to copy")
    origin = Path(spec.origin)
    if origin.name == "__init__.py":          # a package: copy its modules, relative imports intact
        shutil.copytree(origin.parent, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        main = dest / "__init__.py"
    else:                                     # a module of a package: its relative imports point there
        dest.mkdir()
        parent = src_module.rpartition(".")[0]
        text = origin.read_text()
        if parent:
            text = re.sub(r"^(\s*)from \.(?=\w)", rf"\1from {parent}.", text, flags=re.M)
            text = re.sub(r"^(\s*)from \. import", rf"\1from {parent} import", text, flags=re.M)
        main = dest / "__init__.py"
        main.write_text(text)
    text = main.read_text()
    renamed = re.sub(rf'^(\s+name\s*(?::[^=]+)?=\s*)(["\']){re.escape(source)}\2', rf'\g<1>"{name}"', text, flags=re.M)
    main.write_text(renamed)
    return attr or "recipe", f"copied from the recipe {source} of {entry.distribution} {entry.version}"


def record_golden(name: str, module: str, attr: str, package_dir: Path) -> None:
    """Run `toyharness golden record NAME --mode portable` on the new package, seen through a
    temporary dist-info that declares its entry point."""
    dist = f"toyharness_{name}"
    with tempfile.TemporaryDirectory(prefix="toyharness-new-recipe-") as site:
        info = Path(site) / f"{dist}-{VERSION}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n")
        (info / "entry_points.txt").write_text(f"[toyharness.recipes]\n{name} = {module}:{attr}\n")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(package_dir), env.get("PYTHONPATH")) if p)
        res = subprocess.run([sys.executable, "-m", "toyharness.cli", "golden", "record", name, "--mode", "portable",
                              "--dir", str(package_dir / "goldens"), "--no-progress"],
                             cwd=package_dir, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CheckFailed(f"new-recipe {name}: recording its golden failed: {last}")


def new_recipe(name: str, source: str | None = None, out: str | Path | None = None) -> Path:
    """Write the package of recipe `name` into folder `out` (default ./NAME); returns the folder."""
    check_name(name)
    target = Path(out if out is not None else name).resolve()
    if target.exists():
        raise InputError(f"--out {target}: already exists; new-recipe writes a new folder")
    if not target.parent.is_dir():
        raise InputError(f"--out {target}: its parent folder does not exist")
    module = f"toyharness_{name}"
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as exc:
        raise WriteError(f"--out {target}: cannot write there ({exc.strerror})") from exc
    try:
        if source is None:
            (work / module).mkdir()
            (work / module / "__init__.py").write_text(template_recipe(name))
            attr, origin = "recipe", "written from toyharness's template"
        else:
            attr, origin = copy_recipe(source, name, module, work / module)
        (work / "tests").mkdir()
        (work / "tests" / f"test_{name}.py").write_text(recipe_tests(name))
        (work / "pyproject.toml").write_text(pyproject(name, module, attr))
        (work / "README.md").write_text(readme(name, origin))
        (work / ".gitignore").write_text("__pycache__/\n*.egg-info/\nbuild/\n")
        (work / ".github" / "workflows").mkdir(parents=True)
        (work / ".github" / "workflows" / "test.yml").write_text(WORKFLOW)
        record_golden(name, module, attr, work)
        for cache in work.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)
        work.rename(target)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise WriteError(f"--out {target}: {exc}") from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target
