"""`toyharness new-recipe`: the package it writes installs and passes its own tests as written
(its golden recorded by the harness, checked again by the fixture); bad input is one line, exit 2,
and leaves no folder behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli


def install(package: Path, site: Path) -> dict:
    """pip-install `package` into folder `site` (its own distribution); the env that sees it."""
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                          str(package)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def own_tests(package: Path, env: dict) -> str:
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=package,
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_a_recipe_from_the_template_installs_and_passes_its_own_tests(tmp_path):
    out = tmp_path / "charnet"
    res = cli("new-recipe", "charnet", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"wrote {out} (recipe charnet")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        ".github/workflows/test.yml", ".gitignore", "README.md", "goldens/cpu-portable/charnet.yml",
        "pyproject.toml", "tests/test_charnet.py", "toyharness_charnet/__init__.py"]
    assert 'charnet = "toyharness_charnet:recipe"' in (out / "pyproject.toml").read_text()
    golden = (out / "goldens" / "cpu-portable" / "charnet.yml").read_text()
    assert golden.startswith("recipe: charnet\nfingerprint: cpu-portable\n"), golden[:200]
    workflow = (out / ".github" / "workflows" / "test.yml").read_text()
    assert 'pip install -e ".[test]"' in workflow and "python -m pytest" in workflow
    recipe_source = (out / "toyharness_charnet" / "__init__.py").read_text()
    assert "from toyharness import Recipe" in recipe_source and "toyharness." not in recipe_source.replace(
        "toyharness's", "")
    assert not list(tmp_path.glob(".charnet.partial-*")), "the temporary folder was renamed into place"

    env = install(out, tmp_path / "site")
    assert "2 passed" in own_tests(out, env)      # its golden, checked by a fresh run, and that it learns


def test_a_recipe_copied_from_an_installed_one_is_renamed_and_passes_its_own_tests(tmp_path):
    out = tmp_path / "mygpt"
    res = cli("new-recipe", "mygpt", "--from", "gpt2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    source = (out / "toyharness_mygpt" / "__init__.py").read_text()
    assert 'name = "mygpt"' in source and 'name = "gpt2"' not in source
    assert "from .torch_twins" not in source and "from toyharness_recipes.torch_twins" in source
    assert (out / "README.md").read_text().count("copied from the recipe gpt2 of toyharness")

    env = install(out, tmp_path / "site")
    listed = {line.split()[0]: line for line in cli("recipes", env=env).stdout.splitlines()}
    assert "toyharness-mygpt 0.1.0" in listed["mygpt"] and "toyharness 0.1.0" in listed["gpt2"]
    assert "2 passed" in own_tests(out, env)


@pytest.mark.parametrize("args,message", [
    (["Bad-Name"], "recipe name 'Bad-Name': use lowercase letters, digits and _, starting with a letter"),
    (["class"], "recipe name 'class': use lowercase letters, digits and _, starting with a letter"),
    (["gpt2"], "recipe name 'gpt2' is already installed (distribution toyharness); pick another"),
    (["fresh", "--from", "nope"], "--from nope: no such recipe; installed: "),
])
def test_a_bad_name_or_source_is_one_line_and_writes_nothing(args, message, tmp_path):
    res = cli("new-recipe", *args, "--out", str(tmp_path / "pkg"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"toyharness: error: {message}"), res.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_refused_and_left_alone(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "keep.txt").write_text("mine")
    res = cli("new-recipe", "fresh", "--out", str(tmp_path / "pkg"))
    assert res.returncode == 2
    assert res.stderr.strip() == f"toyharness: error: --out {tmp_path / 'pkg'}: already exists; new-recipe writes a " \
                                 "new folder"
    assert [p.name for p in (tmp_path / "pkg").iterdir()] == ["keep.txt"] and len(list(tmp_path.iterdir())) == 1
