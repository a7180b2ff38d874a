"""warm_start: the donor window and every named failure."""


import numpy as np
import pytest
from helpers import cli
from toyharness_recipes.warm_start import WarmStartWindow, donor_embed_width, pca_lens

from toyharness.architectures import example_shape, read_model, write_example
from toyharness.discovery import get_recipe
from toyharness.engine import GGUFFile, get_engine
from toyharness.engine.gguf_io import write_gguf
from toyharness.errors import InputError
from toyharness.runner import resolve_options

SMALL = ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "t_seq=16", "t_batch=2"]


def options(*extra):
    _, obj = get_recipe("warm_start")
    return obj, resolve_options(obj, None, SMALL + list(extra), {})


def test_warm_copies_donor_rows_and_pca_lens(llama_base):
    obj, o = options(f"donor={llama_base}", "donor_d_in=64", "lens=pca")
    assert donor_embed_width(str(llama_base)) == 64
    window = WarmStartWindow(obj, o, 256)
    window.warm()
    with GGUFFile(llama_base) as f:
        rows = f.tensor("token_embd.weight").to_numpy()
    np.testing.assert_array_equal(window.params["token_embd.weight"], rows[:256])
    lens = window.params["lens.weight"]
    assert lens.shape == (32, 64)
    np.testing.assert_allclose(lens @ lens.T, np.eye(32), atol=1e-5)   # orthonormal principal directions
    np.testing.assert_array_equal(lens, pca_lens(rows[:256], 32))
    model = window.bake(get_engine("cpu"))
    with pytest.raises(InputError, match="warm\\(\\) called outside its window"):
        window.warm()
    np.testing.assert_array_equal(model.prog.read(model.P["token_embd.weight"]), rows[:256])


def test_run_with_a_donor_trains(llama_base, tmp_path):
    res = cli("run", "warm_start", "--steps", "6", *[x for s in SMALL for x in ("--set", s)], "--set",
              f"donor={llama_base}", "--set", "donor_d_in=64", "--out", str(tmp_path / "r"), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r" / "model.gguf").is_file()


def donor(tmp_path, kind, llama_base):
    path = tmp_path / f"{kind}.gguf"
    if kind == "missing":
        return tmp_path / "nope.gguf"
    if kind == "not_gguf":
        path.write_text("hello")
    elif kind == "no_width":
        write_gguf(path, "llama", {"token_embd.weight": np.zeros((256, 64), np.float32)})
    elif kind == "unread_key":
        return write_example(path, example_shape("qwen3"), extra_meta={"qwen3.expert_count": 8})
    elif kind == "no_embd":
        write_gguf(path, "llama", {"x.weight": np.zeros((4, 64), np.float32)}, {"llama.embedding_length": 64})
    elif kind == "small_vocab":
        return write_example(path, example_shape("llama", vocab=100))
    elif kind == "width":
        return llama_base
    return path


@pytest.mark.parametrize("kind,d_in,message", [
    ("missing", 64, "nope.gguf: file not found"),
    ("not_gguf", 64, "not a GGUF file"),
    ("no_width", 64, "missing metadata key 'llama.block_count'"),
    ("unread_key", 64, "metadata key 'qwen3.expert_count' is not used by toyharness's qwen3 forward and may change "
                       "the model: refused as a donor"),
    ("width", 48, "embedding width mismatch: expected donor_d_in 48, got 64"),
    ("no_embd", 64, "tensor 'token_embd.weight' not found"),
    ("small_vocab", 64, "vocabulary of 100 rows is smaller than the model's 256"),
])
def test_donor_failures_are_named(llama_base, tmp_path, kind, d_in, message):
    path = donor(tmp_path, kind, llama_base)
    res = cli("run", "warm_start", "--steps", "2", *[x for s in SMALL for x in ("--set", s)], "--set", f"donor={path}",
              "--set", f"donor_d_in={d_in}", "--out", str(tmp_path / "r"))
    assert res.returncode == 2, res.stderr
    assert "donor" in res.stderr and message in res.stderr, res.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "phi3"])
def test_donors_of_every_architecture_warm_the_embedding_as_their_forward_sees_it(tmp_path, arch):
    """A donor of any architecture lora takes; gemma3's rows come scaled by sqrt(d_model), as its
    forward scales them."""
    kw = {"gemma3": dict(head_dim=32, n_head=2, n_kv_head=1), "phi3": dict(rope_dims=12)}.get(arch, {})
    path = write_example(tmp_path / f"{arch}.gguf", example_shape(arch, **kw))
    obj, o = options(f"donor={path}", "donor_d_in=64")
    window = WarmStartWindow(obj, o, 256)
    window.warm()
    with GGUFFile(path) as f:
        rows = f.tensor("token_embd.weight").to_numpy()
    scale = read_model(path).shape.embed_scale
    assert scale == (8.0 if arch == "gemma3" else 1.0)
    np.testing.assert_array_equal(window.params["token_embd.weight"], (rows * np.float32(scale)).astype(np.float32))
    res = cli("run", "warm_start", "--steps", "3", *[x for s in SMALL for x in ("--set", s)], "--set", f"donor={path}",
              "--set", "donor_d_in=64", "--out", str(tmp_path / "r"), "--no-progress")
    assert res.returncode == 0, res.stderr
