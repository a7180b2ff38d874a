"""The architectures a base or donor may have (toyharness/architectures): the rule that every key
and tensor is used or known not to change the forward, each refusal's message against the file
that causes it, and LoRA training over a seeded model of each architecture. Their numbers against
transformers are in tests/test_arch_parity.py (`nox -s parity`); every new block against float64
numpy in tests/test_engine_ops.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import cli

from toyharness.architectures import ARCHITECTURES, example_shape, example_tensors, read_model, write_example
from toyharness.runner import train

SMALL = ["t_seq=16", "t_batch=2", "warmup=2", "lr=1e-2", "eval_every=100", "checkpoint_every=100"]
EXAMPLES = {
    "llama": dict(arch="llama"),
    "llama-rope_freqs": dict(arch="llama", rope_factors=True),
    "llama-linear": dict(arch="llama", rope_scale=0.25),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "gemma3": dict(arch="gemma3", head_dim=32, n_layer=6, n_head=2, n_kv_head=1, window=4),
    "phi3": dict(arch="phi3", rope_dims=12, window=64),
}


def example(tmp_path, case: str, **meta):
    s = example_shape(**EXAMPLES[case])
    return write_example(tmp_path / f"{case}.gguf", s, extra_meta=meta or None)


@pytest.mark.parametrize("case", list(EXAMPLES))
def test_each_architecture_reads_and_trains(tmp_path, case):
    path = example(tmp_path, case)
    model = read_model(path)
    assert model.arch.name == EXAMPLES[case]["arch"]
    assert sorted(model.tensors) == sorted(example_tensors(model.shape))
    targets = ",".join(model.arch.targets)
    out = tmp_path / "run"
    train("lora", steps=6, sets=SMALL + [f"base={path}", f"targets={targets}"], out=str(out), progress=False)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_gemma3_layers_local_and_global_as_llama_cpp_assigns_them(tmp_path):
    """Every sixth layer (i % 6 == 5) is global: full attention, rope.freq_base and its scaling;
    the others slide over the window with rope.freq_base_swa and no scaling."""
    s = example_shape("gemma3", n_layer=12, head_dim=16, window=4, rope_base=1e6, rope_scale=0.125)
    model = read_model(write_example(tmp_path / "g.gguf", s, extra_meta={"gemma3.rope.freq_base_swa": 5000.0}))
    got = [(lay.window, lay.rope_base, lay.rope_scale) for lay in model.shape.layers]
    assert got == [(None, 1e6, 0.125) if i % 6 == 5 else (4, 5000.0, 1.0) for i in range(12)]
    assert model.shape.embed_scale == pytest.approx(8.0) and model.shape.attn_scale == pytest.approx(0.25)


def test_llama3_rope_freqs_change_the_forward(tmp_path):
    """The bug of issue 31: a Llama 3 file's rope_freqs.weight was ignored. Same weights with and
    without the table give different logits once positions are far enough apart to matter."""
    from toyharness_recipes.lora import recipe as lora

    from toyharness.runner import resolve_options

    s = example_shape("llama", rope_factors=True, rope_base=10.0)
    tensors = example_tensors(s)
    tensors["rope_freqs.weight"] = np.geomspace(1, 32, s.head_dim // 2).astype(np.float32)   # as Llama 3's long waves
    with_table = write_example(tmp_path / "with.gguf", s, tensors=tensors)
    s2 = example_shape("llama", rope_base=10.0)
    without = write_example(tmp_path / "without.gguf", s2, tensors={k: v for k, v in tensors.items()
                                                                     if k != "rope_freqs.weight"})
    ids = np.arange(16, dtype=np.int32).reshape(1, 16) * 7 % 256
    logits = []
    for path in (with_table, without):
        opts = resolve_options(lora, None, [f"base={path}", "t_seq=16"], {})
        model = lora.load_for_sampling(None, opts, 256)
        logits.append(model.next_logits(ids))
        del model
    assert np.abs(logits[0] - logits[1]).max() > 1e-3


REFUSALS = {
    "unknown key": ("llama", {"llama.attention.logit_softcapping": 30.0},
                    "metadata key 'llama.attention.logit_softcapping' is not used by toyharness's llama forward"),
    "yarn": ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
             "llama.rope.scaling.type is 'yarn': not implemented"),
    "llama3 without table": ("llama", {"llama.rope.scaling.type": "llama3"},
                             "rope scaling llama3 needs the tensor 'rope_freqs.weight'"),
    "softcapping": ("gemma3", {"gemma3.final_logit_softcapping": 30.0},
                    "gemma3.final_logit_softcapping: soft-capping is not implemented"),
    "bad window pattern": ("gemma3", {"gemma3.attention.sliding_window_pattern": "six"},
                           "sliding_window_pattern is ['six']"),
    "value length": ("qwen3", {"qwen3.attention.value_length": 16}, "values must be as wide as keys"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_a_key_the_forward_does_not_use_is_refused_by_name(tmp_path, what):
    case, meta, message = REFUSALS[what]
    bad = example(tmp_path, case, **meta)
    res = cli("run", "lora", "--steps", "1", "--set", f"base={bad}", "--out", str(tmp_path / "r"))
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and str(bad) in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("case,tensor,message", [
    ("qwen3", "blk.0.attn_sinks.weight", "tensor 'blk.0.attn_sinks.weight' is not used by toyharness's qwen3 forward"),
    ("phi3", "rope_factors_long.weight", "tensor 'rope_factors_long.weight': Phi-3's LongRoPE"),
])
def test_a_tensor_the_forward_does_not_read_is_refused_by_name(tmp_path, case, tensor, message):
    s = example_shape(**EXAMPLES[case])
    tensors = example_tensors(s) | {tensor: np.ones(6, np.float32)}
    bad = write_example(tmp_path / "bad.gguf", s, tensors=tensors)
    res = cli("run", "lora", "--steps", "1", "--set", f"base={bad}", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and message in res.stderr and str(bad) in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_phi3_targets_are_the_fused_tensors_and_its_window_bounds_t_seq(tmp_path):
    base = example(tmp_path, "phi3")
    res = cli("run", "lora", "--steps", "1", "--set", f"base={base}", "--set", "targets=q,v", "--out",
              str(tmp_path / "r"))
    assert res.returncode == 2 and "'q' is not a projection of phi3 bases" in res.stderr, res.stderr
    assert "qkv, o, up, down" in res.stderr
    res = cli("run", "lora", "--steps", "1", "--set", f"base={base}", "--set", "targets=qkv", "--set", "t_seq=128",
              "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "option 't_seq': 128 is longer than 64" in res.stderr, res.stderr


def test_every_architecture_has_its_transformers_class():
    for arch in ARCHITECTURES.values():
        assert arch.hf_class.endswith("ForCausalLM") and arch.targets
