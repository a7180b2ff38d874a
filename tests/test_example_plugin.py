"""A third-party recipe plugin, installed as its own distribution, works with no change to
the core: listed, run, and gated by its golden from its own test suite. Broken plugins give
errors that name the distribution."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "plugins" / "example_bigram"


def env_with(path: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def install_into(target: Path, plugin: Path, dist: str) -> dict:
    """pip-install an example plugin into its own folder (a separate distribution): the env that
    puts it on the path."""
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(plugin)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert list(target.glob(f"{dist}-0.1.0.dist-info")), list(target.iterdir())
    return env_with(target)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_into(tmp_path_factory.mktemp("site"), PLUGIN, "toyharness_example_bigram")


def test_plugin_is_listed_with_its_distribution(installed):
    res = cli("recipes", env=installed)
    assert res.returncode == 0, res.stderr
    lines = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert "toyharness-example-bigram 0.1.0" in lines["bigram"]
    assert "toyharness 0.1.0" in lines["gpt2"], "built-ins are still there"
    assert "toyharness-example-bigram 0.1.0" in lines["losscsv"] and "toyharness_bigram.observer:LossCSV" in \
        lines["losscsv"], "its observer too"


def test_plugin_runs(installed, tmp_path):
    res = cli("run", "bigram", "--steps", "40", "--set", "eval_every=40", "--out", str(tmp_path / "run"),
              "--no-progress", env=installed)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "run" / "model.gguf").is_file() and (tmp_path / "run" / "summary.json").is_file()


def test_plugin_observer_logs_any_recipe(installed, tmp_path):
    res = cli("run", "gpt2", "--steps", "6", "--set", "n_layer=1", "--set", "d_model=16", "--set", "n_head=2",
              "--set", "eval_every=3", "--out", str(tmp_path / "run"), "--no-progress", "--log", "losscsv",
              env=installed)
    assert res.returncode == 0, res.stderr
    lines = (tmp_path / "run" / "losses.csv").read_text().splitlines()
    assert lines[0] == "step,loss,eval_loss" and len(lines) == 7
    assert lines[3].split(",")[0] == "2" and lines[3].split(",")[2] != ""    # the eval after step 2


def test_plugin_passes_its_golden_from_its_own_suite(installed):
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=PLUGIN,
                         capture_output=True, text=True, timeout=600, env=installed)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 passed" in res.stdout and "skipped" not in res.stdout, res.stdout


def _fake_dist(site: Path, dist: str, entry: str) -> None:
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[toyharness.recipes]\n{entry}\n")


def test_two_plugins_claiming_one_name_is_an_error(tmp_path):
    _fake_dist(tmp_path, "rival_recipes", "gpt2 = rival_recipes:recipe")
    res = cli("recipes", env=env_with(tmp_path))
    assert res.returncode == 2
    assert "recipe name 'gpt2' is claimed by two distributions" in res.stderr
    assert "rival_recipes" in res.stderr and "toyharness" in res.stderr


def test_plugin_that_fails_to_import_names_its_distribution(tmp_path):
    _fake_dist(tmp_path, "broken_recipes", "broken = broken_recipes_module:recipe")
    (tmp_path / "broken_recipes_module.py").write_text("import no_such_module_here\n")
    res = cli("run", "broken", "--out", str(tmp_path / "run"), env=env_with(tmp_path))
    assert res.returncode == 2
    assert "recipe 'broken' from distribution broken_recipes 1.0 failed to import" in res.stderr
    assert "no_such_module_here" in res.stderr
    assert not (tmp_path / "run").exists()


# --- the second example: an MLP character model (plugins/example_mlp), installed the same way ----------
MLP_PLUGIN = REPO / "plugins" / "example_mlp"


@pytest.fixture(scope="module")
def mlp_installed(tmp_path_factory):
    return install_into(tmp_path_factory.mktemp("site_mlp"), MLP_PLUGIN, "toyharness_example_mlp")


def test_mlp_plugin_runs_and_its_loss_falls(mlp_installed, tmp_path):
    import json

    res = cli("run", "char_mlp", "--steps", "60", "--set", "eval_every=60", "--out", str(tmp_path / "run"),
              "--no-progress", env=mlp_installed)
    assert res.returncode == 0, res.stderr
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] > 5.0 and max(losses[-5:]) < 3.0, losses


@pytest.mark.parametrize("key,line", [
    ("typo=1", "toyharness: error: unknown option 'typo'; allowed: "),
    ("context=0", "toyharness: error: option 'context': must be > 0, got 0"),
])
def test_mlp_plugin_refuses_a_bad_option_in_one_line(mlp_installed, tmp_path, key, line):
    res = cli("run", "char_mlp", "--set", key, "--out", str(tmp_path / "run"), "--no-progress", env=mlp_installed)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), res.stderr
    assert not (tmp_path / "run").exists()


def test_mlp_plugin_passes_its_goldens_and_its_own_suite(mlp_installed):
    # the portable golden: the same bits on any CPU (the fast one is this fingerprint's only)
    res = cli("golden", "check", "char_mlp", "--dir", str(MLP_PLUGIN / "goldens"), "--mode", "portable",
              env=mlp_installed)
    assert res.returncode == 0 and "ok   char_mlp (portable mode" in res.stdout, res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=MLP_PLUGIN,
                         capture_output=True, text=True, timeout=600, env=mlp_installed)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 passed" in res.stdout and "skipped" not in res.stdout, res.stdout
