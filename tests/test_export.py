"""model.gguf read back with the `gguf` package: every tensor's name, shape and values, and
the metadata llama.cpp needs. (Loading it in llama.cpp itself: tests/test_llamacpp.py.)"""

import gguf
import numpy as np
import pytest
from toyharness_recipes.llama import adjacent_to_neox

from toyharness.engine import GGUFFile
from toyharness.runner import train

TINY = ["n_layer=2", "d_model=32", "n_head=4", "t_seq=16", "t_batch=2", "eval_every=3", "checkpoint_every=3"]


def run(recipe, tmp_path, extra=()):
    out = tmp_path / recipe
    train(recipe, steps=3, sets=TINY + list(extra), out=str(out), progress=False)
    with GGUFFile(out / "checkpoint.gguf") as f:
        params = {n: f.tensor(n).to_numpy() for n in f.names if not n.startswith("adamw.")}
    return gguf.GGUFReader(out / "model.gguf"), params


def tensors(reader) -> dict[str, np.ndarray]:
    # GGUFReader gives numpy-order arrays (ggml's ne reversed).
    return {t.name: np.array(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in reader.tensors}


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


def test_gpt2_export_has_llama_cpp_names_and_fused_qkv(tmp_path):
    reader, params = run("gpt2", tmp_path)
    got = tensors(reader)
    assert field(reader, "general.architecture") == "gpt2"
    assert field(reader, "gpt2.block_count") == 2 and field(reader, "gpt2.embedding_length") == 32
    assert field(reader, "gpt2.attention.head_count") == 4 and field(reader, "gpt2.context_length") == 16
    expected = {}
    for name, value in params.items():
        if ".attn_q." in name:
            blk, kind = name.split(".attn_q.")
            expected[f"{blk}.attn_qkv.{kind}"] = np.concatenate(
                [params[f"{blk}.attn_{p}.{kind}"] for p in "qkv"], axis=0)
        elif ".attn_k." not in name and ".attn_v." not in name:
            expected[name] = value
    assert sorted(got) == sorted(expected)
    assert "output.weight" not in got, "tied: llama.cpp reuses token_embd.weight"
    for name, value in expected.items():
        assert got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert got["blk.0.attn_qkv.weight"].shape == (96, 32)


def test_gpt2_without_biases_exports_zero_biases_llama_cpp_requires(tmp_path):
    """bias=false trains no bias; llama.cpp's gpt2 loads every bias, so model.gguf holds zeros
    (the same function) beside the trained weights."""
    reader, params = run("gpt2", tmp_path, ["bias=false", "gelu=erf", "scaled_proj_init=true"])
    got = tensors(reader)
    assert not [n for n in params if n.endswith(".bias")]
    with_biases, _ = run("gpt2", tmp_path / "b")
    assert sorted(got) == sorted(tensors(with_biases))
    for name, value in got.items():
        if name.endswith(".bias"):
            np.testing.assert_array_equal(value, np.zeros_like(value), err_msg=name)
    np.testing.assert_array_equal(got["blk.1.ffn_down.weight"], params["blk.1.ffn_down.weight"])
    np.testing.assert_array_equal(got["blk.0.attn_qkv.weight"], np.concatenate(
        [params[f"blk.0.attn_{p}.weight"] for p in "qkv"], axis=0))


@pytest.mark.parametrize("extra,arch", [(["n_kv_head=4"], "llama"), (["untied=true", "n_kv_head=2"], "llama"),
                                        (["qkv_bias=true", "n_kv_head=2"], "qwen2")])
def test_llama_export_round_trip(tmp_path, extra, arch):
    reader, params = run("llama", tmp_path, extra)
    got = tensors(reader)
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.attention.head_count_kv") == (4 if "n_kv_head=4" in extra else 2)
    assert field(reader, f"{arch}.rope.dimension_count") == 8
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert len(field(reader, "tokenizer.ggml.tokens")) == 256
    assert sorted(got) == sorted(params)
    assert ("output.weight" in got) == ("untied=true" in extra)
    for name, value in params.items():
        assert got[name].shape == value.shape, name
        if arch == "qwen2" and (".attn_q." in name or ".attn_k." in name):
            heads = 4 if ".attn_q." in name else 2
            np.testing.assert_array_equal(got[name], adjacent_to_neox(value, heads), err_msg=name)
            assert not np.array_equal(got[name], value) or not value.any()
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_adjacent_to_neox_pairs_rows():
    w = np.arange(2 * 8, dtype=np.float32).reshape(2 * 8, 1)       # 2 heads of head_dim 8
    assert adjacent_to_neox(w, 2)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
