"""gpt2 and llama as recipes: attention batched over heads, sampling, option plumbing."""

import subprocess
import sys

import pytest

from toyharness.data import load_text_data
from toyharness.discovery import get_recipe
from toyharness.engine import get_engine
from toyharness.runner import resolve_options, train


def n_nodes(recipe: str, sets: list[str]) -> int:
    _, obj = get_recipe(recipe)
    opts = resolve_options(obj, None, ["n_layer=1", "d_model=64", "t_seq=16", "t_batch=2", *sets], {})
    return obj.realize(get_engine("cpu"), opts, load_text_data()).trainer.n_nodes


@pytest.mark.parametrize("recipe,sets", [("gpt2", []), ("llama", ["n_kv_head={h}"]), ("llama", ["n_kv_head=1"])])
def test_graph_size_does_not_grow_with_heads(recipe, sets):
    counts = {h: n_nodes(recipe, [f"n_head={h}", *(s.format(h=h) for s in sets)]) for h in (2, 4, 8, 16)}
    assert len(set(counts.values())) == 1, counts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "llama"
    train("llama", steps=20, sets=["n_layer=1", "d_model=32", "n_head=2", "t_seq=16", "t_batch=4",
                                   "eval_every=20", "checkpoint_every=20"], out=str(out), progress=False)
    return out


def sample(run_dir, *args):
    return subprocess.run([sys.executable, "-m", "toyharness.cli", "sample", str(run_dir), *args],
                          capture_output=True, text=True, timeout=120)


def test_sample_is_deterministic_with_a_seed(trained):
    a = sample(trained, "--prompt", "The ", "--tokens", "24", "--seed", "3")
    b = sample(trained, "--prompt", "The ", "--tokens", "24", "--seed", "3")
    c = sample(trained, "--prompt", "The ", "--tokens", "24", "--seed", "4")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("The ")
    assert a.stdout != c.stdout


def test_greedy_sample_follows_the_models_argmax(trained):
    import numpy as np

    from toyharness.sampling import FullRecompute, generate

    _, obj = get_recipe("llama")
    opts = resolve_options(obj, str(trained / "config.toml"), [], {})
    model = obj.load_for_sampling(trained / "checkpoint.gguf", opts, 256)
    ids = generate(FullRecompute(model), list(b"The "), 3, temperature=0, top_k=0, seed=0)
    buf = np.zeros((1, 16), np.int32)
    buf[0, :4] = list(b"The ")
    assert ids[0] == int(np.argmax(model.next_logits(buf)[0, 3]))


@pytest.mark.parametrize("args,message", [(["--temperature", "-1"], "--temperature must be >= 0"),
                                          (["--top-k", "-2"], "--top-k must be >= 0")])
def test_sample_bad_arguments_exit_2(trained, args, message):
    res = sample(trained, *args)
    assert res.returncode == 2 and message in res.stderr


def test_sample_needs_a_run_folder(tmp_path):
    res = sample(tmp_path)
    assert res.returncode == 2 and "not a finished run folder" in res.stderr
