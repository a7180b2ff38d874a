"""The public recipe API: `toyharness` itself exports what a plugin needs; a recipe's options hold
only the keys it reads and validate themselves; an exception in a recipe's hook is one line naming
the recipe and the hook (the traceback with --debug); the golden config is the recipe's to declare;
the golden fixture and every hint it prints work with pytest alone.

The plugins here are written to a temporary folder as their own distributions (an entry point in a
dist-info folder), as a third party would install them."""

import ast
import importlib.util
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import cli

import toyharness
from toyharness import InputError, Options, TextOptions, positive
from toyharness.options import resolve

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "plugins" / "example_bigram"
EXAMPLE_MLP = REPO / "plugins" / "example_mlp"

# A small MLP language model on the core text data, using only the public API. HOOK names the hook
# that raises (None: none does), RAISE what it raises.
MLP_SOURCE = '''
from dataclasses import dataclass

from toyharness import InputError, Recipe, TextOptions, blocks, hookimpl, normal, positive

HOOK = {hook!r}


def boom(hook):
    if hook == HOOK:
        raise {raise_}


@dataclass
class MLPOptions(TextOptions):
    n_ctx: int = positive(4)
    d_hidden: int = 16
    t_seq: int = 8
    t_batch: int = 4
    steps: int = 6
    eval_every: int = 3

    def validate(self):
        super().validate()
        boom("validate")
        if self.d_hidden % 2:
            raise self.invalid("d_hidden", f"must be even, got {{self.d_hidden}}")


class Model:
    def __init__(self, engine, o, vocab):
        prog = engine.program()
        emb = prog.param("emb.weight", normal(o.seed, "emb.weight", (vocab, o.d_hidden), 0.02 * o.init_scale))
        out = prog.param("out.weight", normal(o.seed, "out.weight", (vocab, o.d_hidden), 0.02 * o.init_scale))
        tokens = prog.input("tokens", (o.t_batch, o.t_seq), "i32", upper=vocab)
        logits = blocks.linear(emb.get_rows(tokens), out)
        self.trainer = prog.trainer(prog.cross_entropy(logits, "targets"), "constant_betas")


class MLP(Recipe):
    name = "mlp"
    options_class = MLPOptions
    golden_config = {{"t_seq": 12, "t_batch": 2, "seed": 5, "eval_every": 1000, "checkpoint_every": 1000}}
    golden_steps = 4

    def options(self):              # overrides of Recipe's hooks: hooks without @hookimpl too
        boom("options")
        return super().options()

    @hookimpl
    def realize(self, engine, options, data):
        boom("realize")
        return Model(engine, options, data.vocab)

    def hp(self, options, step):
        boom("hp")
        return super().hp(options, step)

    def step(self, model, batch, hp):
        boom("step")
        return super().step(model, batch, hp)

    def evaluate(self, model, batch):
        boom("evaluate")
        return super().evaluate(model, batch)

    def export(self, model, options, out_dir):
        boom("export")
        return super().export(model, options, out_dir)


if HOOK == "load_data":      # otherwise it trains on the core text data, as a recipe without the hook does
    MLP.load_data = hookimpl(lambda self, options: boom("load_data"))

recipe = MLP()
'''


def mlp_plugin(site: Path, hook: str | None = None, raise_: str = "ZeroDivisionError('boom in ' + hook)") -> dict:
    """The MLP recipe installed as distribution `mlp_plugin` under `site`; the environment that finds it."""
    info = site / "mlp_plugin-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlp_plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[toyharness.recipes]\nmlp = mlp_plugin:recipe\n")
    (site / "mlp_plugin.py").write_text(MLP_SOURCE.format(hook=hook, raise_=raise_))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


# --- the exports -------------------------------------------------------------------------------

def test_every_public_name_is_exported_and_documented():
    names = [n for n in toyharness.__all__ if n != "__version__"]
    for required in ("Recipe", "LMRecipe", "Options", "LMOptions", "choice", "hookimpl", "blocks", "Tensor",
                     "InputError", "normal", "lcg_scaled", "write_gguf"):
        assert required in names
    doc = toyharness.__doc__
    torch_stack = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    for name in names:
        if name in toyharness.NEEDS_TORCH and not torch_stack:
            try:
                assert getattr(toyharness, name) is not None    # its own module may not need both
            except ImportError as exc:
                assert str(exc) == f"toyharness.{name} needs PyTorch: pip install torch transformers"
        else:
            assert getattr(toyharness, name) is not None
        assert f"`{name}`" in doc, f"{name} is exported but not documented in toyharness/__init__.py"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = toyharness.Nope


def test_the_exports_are_the_real_objects():
    from toyharness.engine import Tensor, blocks, write_gguf
    from toyharness.hookspecs import hookimpl
    from toyharness.lm import LMOptions, LMRecipe
    from toyharness.recipe import Recipe

    assert (toyharness.Tensor, toyharness.blocks, toyharness.write_gguf, toyharness.hookimpl) == \
        (Tensor, blocks, write_gguf, hookimpl)
    assert issubclass(LMRecipe, Recipe) and issubclass(LMOptions, TextOptions) and issubclass(TextOptions, Options)
    assert toyharness.LMRecipe is LMRecipe and toyharness.Recipe is Recipe


@pytest.mark.parametrize("name", ["Recipe", "Options", "LMRecipe", "blocks", "normal", "train", "atomic_write"])
def test_each_name_imports_first_in_a_fresh_interpreter(name):
    """No import cycle: each module behind a public name loads first and alone."""
    res = subprocess.run([sys.executable, "-c", f"from toyharness import {name}; print({name})"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_import_toyharness_and_the_recipe_base_load_no_native_library():
    code = ("import sys, toyharness\n"
            "assert [m for m in sys.modules if m.startswith('toyharness')] == ['toyharness'], sys.modules\n"
            "from toyharness import Recipe, Options, TextOptions, choice, positive, hookimpl, InputError\n"
            # the engine's list of precisions (engine/precision.py, no imports) is the one part of it read
            "light = ('toyharness.engine', 'toyharness.engine.precision')\n"
            "heavy = [m for m in sys.modules if m.startswith(('toyharness._ffi', 'toyharness.engine', 'numpy'))\n"
            "         and m not in light]\n"
            "assert not heavy, heavy\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def internal_imports(source: str, filename: str = "<source>") -> list[str]:
    """Each import in `source` of something other than `toyharness`'s public names, as file:line."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "toyharness":
            if node.module != "toyharness":
                bad.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            else:
                bad += [f"{filename}:{node.lineno}: {a.name} is not public" for a in node.names
                        if a.name not in toyharness.__all__]
        elif isinstance(node, ast.Import):
            bad += [f"{filename}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] == "toyharness" and a.name != "toyharness"]
    return bad


def test_the_import_check_catches_internal_imports():
    assert internal_imports("from toyharness import Recipe, hookimpl\nimport toyharness\n") == []
    assert internal_imports("from toyharness.options import Options\n") == [
        "<source>:1: from toyharness.options import ..."]
    assert internal_imports("import toyharness.engine.blocks\n") == ["<source>:1: import toyharness.engine.blocks"]
    assert internal_imports("from toyharness import _ffi\n") == ["<source>:1: _ffi is not public"]


@pytest.mark.parametrize("example,least", [(EXAMPLE, 3), (EXAMPLE_MLP, 3)], ids=["bigram", "mlp"])
def test_example_plugin_imports_only_public_names(example, least):
    sources = sorted(p for p in example.rglob("*.py") if "build" not in p.relative_to(example).parts)
    assert len(sources) >= least, sources      # bigram: recipe, observer, tests; mlp: recipe, twin, tests
    bad = [b for path in sources for b in internal_imports(path.read_text(), str(path.relative_to(REPO)))]
    assert bad == []


# --- options -----------------------------------------------------------------------------------

def test_options_hold_only_what_every_recipe_reads():
    from toyharness import LMOptions

    common = set(Options.__dataclass_fields__)
    assert not common & {"untied", "qkv_bias", "tokenizer", "mask_prompt", "pack", "weight_dtype", "t_seq",
                         "eval_batches"}
    assert {"t_batch", "seed", "init_scale", "lr", "beta1", "beta2", "eps", "weight_decay", "adamw_convention",
            "lr_schedule", "warmup", "min_lr", "steps", "eval_every", "checkpoint_every", "accumulate", "grad_clip",
            "devices", "gradient_reduce",
            "data", "portable", "precision", "log"} == common
    assert set(TextOptions.__dataclass_fields__) - common == {"t_seq", "eval_batches"}
    assert set(LMOptions.__dataclass_fields__) - set(TextOptions.__dataclass_fields__) == \
        {"tokenizer", "mask_prompt", "pack", "weight_dtype"}


@pytest.mark.parametrize("recipe,key", [("vit_tiny", "untied"), ("vit_tiny", "qkv_bias"), ("vit_tiny", "tokenizer"),
                                        ("vit_tiny", "mask_prompt"), ("vit_tiny", "t_seq"), ("gpt2", "qkv_bias"),
                                        ("lora", "untied")])
def test_a_key_the_recipe_does_not_read_is_refused_by_name(recipe, key, tmp_path):
    res = cli("run", recipe, "--set", f"{key}=true", "--out", str(tmp_path / "run"), "--no-progress")
    assert res.returncode == 2
    line = one_line(res)
    assert line.startswith(f"toyharness: error: unknown option {key!r}; allowed: ") and "t_batch" in line
    assert not (tmp_path / "run").exists()


def test_the_example_bigram_refuses_the_language_model_keys():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from toyharness_bigram import BigramOptions
    finally:
        sys.path.remove(str(EXAMPLE))
    for key in ("untied", "qkv_bias", "tokenizer", "mask_prompt", "weight_dtype"):
        with pytest.raises(InputError, match=f"unknown option '{key}'; allowed: t_batch, "):
            resolve(BigramOptions, None, [f"{key}=true"])


def test_weight_dtype_takes_only_the_type_the_harness_trains():
    from toyharness_recipes.gpt2 import GPT2Options

    with pytest.raises(InputError, match="option 'weight_dtype': 'f16' is not allowed; allowed: f32"):
        resolve(GPT2Options, None, ["weight_dtype=f16"])


@dataclass
class EvenOptions(TextOptions):
    n_ctx: int = positive(4)
    width: int = 8

    def validate(self) -> None:
        super().validate()
        if self.width % 2:
            raise self.invalid("width", f"must be even, got {self.width}")


@dataclass
class EvenAgain(EvenOptions):
    n_ctx: int = 6          # declared again, plainly: still positive


def test_validate_is_extended_by_a_recipe_and_names_the_key(tmp_path):
    assert resolve(EvenOptions, None, ["width=10"]).width == 10
    with pytest.raises(InputError, match=r"^option 'width': must be even, got 3$"):
        resolve(EvenOptions, None, ["width=3"])
    config = tmp_path / "c.toml"
    config.write_text("width = 5\n")
    from toyharness.options import load_toml

    with pytest.raises(InputError, match=rf"^config file {config}: option 'width': must be even, got 5$"):
        resolve(EvenOptions, load_toml(config))
    with pytest.raises(InputError, match=r"^option 't_batch': must be > 0, got 0$"):
        resolve(EvenOptions, None, ["t_batch=0"])        # the base's checks come first


@pytest.mark.parametrize("cls", [EvenOptions, EvenAgain])
def test_positive_sizes_are_declared_by_the_recipe(cls):
    with pytest.raises(InputError, match=r"^option 'n_ctx': must be > 0, got 0$"):
        resolve(cls, None, ["n_ctx=0"])
    with pytest.raises(InputError, match=r"^option 'n_ctx': must be > 0, got -2$"):
        resolve(cls, None, ["n_ctx=-2"])


def test_the_core_lists_no_recipe_sizes():
    import toyharness.options as options

    assert not hasattr(options, "SIZE_KEYS")
    from toyharness_recipes.lora import LoRAOptions
    from toyharness_recipes.vit_tiny import ViTOptions
    from toyharness_recipes.warm_start import WarmStartOptions

    for cls, key in ((LoRAOptions, "rank"), (ViTOptions, "patch"), (WarmStartOptions, "donor_d_in"),
                     (WarmStartOptions, "n_kv_head")):
        with pytest.raises(InputError, match=rf"^option '{key}': must be > 0, got 0$"):
            resolve(cls, None, [f"{key}=0"])


def test_a_bad_value_is_one_line_in_run_sweep_and_golden(tmp_path):
    env = mlp_plugin(tmp_path / "site")
    res = cli("run", "mlp", "--set", "n_ctx=0", "--out", str(tmp_path / "run"), env=env)
    assert (res.returncode, one_line(res)) == (2, "toyharness: error: option 'n_ctx': must be > 0, got 0")
    assert not (tmp_path / "run").exists()
    # every point's options are checked before the first one starts
    res = cli("sweep", "mlp", "--grid", "d_hidden=8,7", "--out", str(tmp_path / "sweep"), env=env)
    assert res.returncode == 2
    assert one_line(res) == "toyharness: error: point d_hidden=7, seed 1337: option 'd_hidden': must be even, got 7"
    assert not (tmp_path / "sweep").exists()
    # the golden config is the recipe's: a bad value there is one line too
    site = tmp_path / "site"
    (site / "mlp_plugin.py").write_text((site / "mlp_plugin.py").read_text().replace('"seed": 5', '"d_hidden": 9'))
    res = cli("golden", "record", "mlp", "--dir", str(tmp_path / "goldens"), env=env)
    assert (res.returncode, one_line(res)) == (2, "toyharness: error: option 'd_hidden': must be even, got 9")
    assert not (tmp_path / "goldens").exists()


# --- an exception in a hook --------------------------------------------------------------------

HOOKS = ["options", "load_data", "realize", "hp", "step", "evaluate", "export"]


@pytest.mark.parametrize("hook", HOOKS)
def test_an_exception_in_a_hook_is_one_line_naming_recipe_and_hook(hook, tmp_path):
    env = mlp_plugin(tmp_path / "site", hook)
    res = cli("run", "mlp", "--steps", "3", "--out", str(tmp_path / "run"), "--no-progress", env=env)
    assert res.returncode == 2, res.stderr
    assert one_line(res) == (f"toyharness: error: recipe mlp: hook {hook} raised ZeroDivisionError: boom in {hook} "
                             "(--debug shows the traceback)")


@pytest.mark.parametrize("command,prefix", [(["run", "mlp"], "recipe mlp: "), (["sweep", "mlp", "--seeds", "2"], "")])
def test_an_exception_in_validate_is_one_line_naming_the_options_class(command, prefix, tmp_path):
    env = mlp_plugin(tmp_path / "site", "validate")
    res = cli(*command, env=env, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert one_line(res) == (f"toyharness: error: {prefix}options MLPOptions raised ZeroDivisionError: boom in "
                             "validate (--debug shows the traceback)")
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "runs").exists()


def test_debug_prints_the_traceback_down_to_the_recipes_line(tmp_path):
    env = mlp_plugin(tmp_path / "site", "realize")
    res = cli("run", "mlp", "--steps", "3", "--out", str(tmp_path / "run"), "--debug", env=env)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    raising = MLP_SOURCE.splitlines().index("        raise {raise_}") + 1
    assert f'mlp_plugin.py", line {raising}, in boom' in res.stderr
    assert "ZeroDivisionError: boom in realize" in res.stderr
    assert lines[-1] == ("toyharness: error: recipe mlp: hook realize raised ZeroDivisionError: boom in realize "
                         "(--debug shows the traceback)")


@pytest.mark.parametrize("command", [["golden", "record", "mlp"], ["sweep", "mlp", "--seeds", "2"]])
def test_debug_is_taken_by_golden_and_sweep(command, tmp_path):
    env = mlp_plugin(tmp_path / "site", "options")
    res = cli(*command, "--debug", env=env, cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback (most recent call last):" in res.stderr and "boom in options" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("toyharness: error: recipe mlp: hook options raised")


@pytest.mark.parametrize("argv", [["run", "gpt2"], ["golden", "check"], ["sweep", "gpt2"], ["bench", "gpt2"]])
def test_debug_is_a_flag_of_run_golden_sweep_and_bench(argv):
    from toyharness.cli import build_parser

    assert build_parser().parse_args([*argv, "--debug"]).debug is True
    assert build_parser().parse_args(argv).debug is False


def test_an_input_error_from_a_hook_keeps_its_message(tmp_path):
    env = mlp_plugin(tmp_path / "site", "realize", "InputError('data: no bigrams in this corpus')")
    res = cli("run", "mlp", "--steps", "3", "--out", str(tmp_path / "run"), env=env)
    assert (res.returncode, one_line(res)) == (2, "toyharness: error: data: no bigrams in this corpus")


def test_a_plugin_trains_exports_and_sweeps_through_the_defaults(tmp_path):
    env = mlp_plugin(tmp_path / "site")
    res = cli("run", "mlp", "--out", str(tmp_path / "run"), "--no-progress", env=env)
    assert res.returncode == 0, res.stderr
    from toyharness.engine import GGUFFile

    with GGUFFile(tmp_path / "run" / "model.gguf") as f:        # Recipe's export and gguf_metadata
        assert f.require_field("general.architecture") == "toyharness-mlp"
        assert f.tensor("emb.weight", expect_shape=(256, 16)) is not None


# --- goldens -----------------------------------------------------------------------------------

def test_the_golden_config_is_a_documented_attribute_of_recipe():
    from toyharness.recipe import Recipe

    assert Recipe.golden_config == {"n_layer": 1, "d_model": 32, "n_head": 2, "t_seq": 24, "t_batch": 2,
                                    "eval_every": 1000, "checkpoint_every": 1000, "warmup": 2, "seed": 7}
    assert Recipe.golden_steps == 16
    assert (Recipe.golden_sets, Recipe.golden_variants, Recipe.bench_sets) == ([], {}, [])
    assert Recipe.options_class is Options and Recipe.name == ""
    doc = Recipe.__doc__ + "".join(getattr(Recipe, n).__doc__ or "" for n in ("gguf_metadata", "export"))
    for attribute in ("trainer", "convention", "name", "options_class", "golden_config", "golden_steps",
                      "golden_sets", "golden_variants", "bench_sets", "gguf_metadata"):
        assert f"``{attribute}``" in doc, f"Recipe's docstring does not describe {attribute}"
        if attribute not in ("trainer", "convention"):
            assert hasattr(Recipe, attribute)


def test_a_recipe_declares_its_golden_config(tmp_path):
    env = mlp_plugin(tmp_path / "site")
    goldens = tmp_path / "goldens"
    res = cli("golden", "record", "mlp", "--mode", "portable", "--dir", str(goldens), env=env)
    assert res.returncode == 0, res.stderr
    import yaml

    doc = yaml.safe_load((goldens / "cpu-portable" / "mlp.yml").read_text())
    assert doc["steps"] == 4 and len(doc["losses"]) == 4
    assert (doc["options"]["t_seq"], doc["options"]["t_batch"], doc["options"]["seed"]) == (12, 2, 5)
    assert doc["options"]["data"] == "synthetic"        # the core text data's golden corpus
    assert "n_layer" not in doc["options"]              # golden_config keys it lacks are left out
    res = cli("golden", "check", "mlp", "--mode", "portable", "--dir", str(goldens), env=env)
    assert res.returncode == 0 and res.stdout.startswith("ok   mlp"), res.stdout + res.stderr


def test_the_golden_config_of_a_built_in_recipe_is_unchanged():
    from toyharness import goldens

    assert goldens.golden_sets_for("llama") == ["n_layer=1", "d_model=32", "n_head=2", "t_seq=24", "t_batch=2",
                                                "eval_every=1000", "checkpoint_every=1000", "warmup=2", "seed=7",
                                                "data=synthetic", "n_kv_head=1", "d_ff=48"]


FIXTURE_TEST = '''
from pathlib import Path

GOLDENS = Path(__file__).resolve().parent / "goldens"


def test_mlp_golden(toyharness_golden):
    toyharness_golden("mlp", root=GOLDENS, mode="portable")
'''


def test_the_fixture_and_every_hint_it_prints_work_with_pytest_alone(tmp_path):
    env = mlp_plugin(tmp_path / "site")
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_mlp.py").write_text(FIXTURE_TEST)
    golden = project / "goldens" / "cpu-portable" / "mlp.yml"

    def pytest_run(*flags):
        # -p no:regressions: as after a plain install, without pytest-regressions
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
                               "no:regressions", *flags], cwd=project, capture_output=True, text=True,
                              timeout=300, env=env)

    res = pytest_run()
    assert res.returncode == 0 and "1 skipped" in res.stdout, res.stdout + res.stderr
    message = " ".join(res.stdout.split())
    command = message.split("record one with `")[1].split("`")[0]
    assert shlex.split(command)[:4] == ["toyharness", "golden", "record", "mlp"]
    assert "(or `pytest --toyharness-record`)" in message

    # the first hint, run as written
    ran = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0 and golden.is_file(), ran.stdout + ran.stderr
    res = pytest_run()
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr

    # the second hint: records (and says where), then a plain run checks it
    first = golden.read_text()
    golden.unlink()
    res = pytest_run("--toyharness-record")
    assert res.returncode == 0 and "1 skipped" in res.stdout, res.stdout + res.stderr
    assert f"recorded the golden for mlp at {golden}" in " ".join(res.stdout.split())
    assert golden.read_text() == first
    res = pytest_run()
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr

    # and a changed golden fails, naming the step
    import yaml

    doc = yaml.safe_load(first)
    doc["losses"][2]["hex"] = "0x00000000"
    golden.write_text(yaml.safe_dump(doc, sort_keys=False))
    res = pytest_run()
    assert res.returncode == 1 and "first diverging step 2" in res.stdout, res.stdout
