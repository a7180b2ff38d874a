"""Numerical truth per architecture: the first 8 LoRA losses over a seeded model of each
architecture (written by the harness in llama.cpp's layout, f32 and quantized) against
transformers' model of that architecture (`LlamaForCausalLM` with rope_scaling llama3,
`Qwen3ForCausalLM`, `Gemma3ForCausalLM`, `Phi3ForCausalLM`, ...) built from the dequantized
weights, with the adapters as W + (alpha/r) B A and the run's own AdamW rows. Run by
`nox -s parity` (torch==2.13.0 and transformers); without them these tests skip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import transformers_replay

from toyharness.architectures import ARCHITECTURES, example_shape, write_example
from toyharness.engine.gguf_io import cached_copy_as
from toyharness.runner import train

torch = pytest.importorskip("torch", reason="PyTorch is not installed: run `nox -s parity` (torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: run `nox -s parity`")

pytestmark = pytest.mark.parity
STEPS = 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
CASES = {   # name: (example_shape arguments, transformers config overrides)
    "llama-rope_freqs": (dict(arch="llama", rope_factors=True, rope_base=500000.0, d_model=128, n_head=4,
                              head_dim=32), {"rope_scaling": LLAMA3_ROPE}),
    "llama-linear": (dict(arch="llama", rope_scale=0.25), {}),
    "qwen2": (dict(arch="qwen2"), {}),
    "qwen3": (dict(arch="qwen3", head_dim=32), {}),
    "gemma3": (dict(arch="gemma3", head_dim=32, n_layer=6, n_head=2, n_kv_head=1, window=8, rope_base=1e6), {}),
    "phi3": (dict(arch="phi3", rope_dims=12, window=64), {}),
    # K-quant blocks are 256 values: a wider gemma3 for q4_k (Gemma 3 Q4_K_M holds q4_k, q5_0, q6_k and q8_0)
    "gemma3-256": (dict(arch="gemma3", d_model=256, d_ff=512, head_dim=128, n_layer=6, n_head=2, n_kv_head=1,
                        window=8, rope_base=1e6), {}),
}
QUANTIZED = {"qwen3@q8_0": ("qwen3", "q8_0"), "gemma3@q5_0": ("gemma3", "q5_0"), "phi3@q4_0": ("phi3", "q4_0"),
             "llama-rope_freqs@q4_1": ("llama-rope_freqs", "q4_1"), "gemma3-256@q4_k": ("gemma3-256", "q4_k"),
             "gemma3-256@q6_k": ("gemma3-256", "q6_k")}


def run_case(tmp_path, shape_args: dict, hf_overrides: dict, dtype: str | None = None):
    s = example_shape(**shape_args)
    base = write_example(tmp_path / f"{s.arch}.gguf", s, std=0.2)
    if dtype:
        base = cached_copy_as(base, dtype)
    targets = ",".join(ARCHITECTURES[s.arch].targets)
    out = tmp_path / "run"
    train("lora", steps=STEPS, sets=["t_seq=32", "t_batch=4", "warmup=2", "lr=5e-3", "eval_every=100",
                                     "checkpoint_every=100", f"base={base}", f"targets={targets}", "init_scale=3"],
          out=str(out), save_init=True, save_batches=True, progress=False)
    ours = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    theirs = transformers_replay(out, base, hf_overrides, STEPS)
    diffs = np.abs(np.array(ours, np.float64) - theirs) / np.abs(theirs)
    print("per-step relative differences", " ".join(f"{d:.1e}" for d in diffs))
    diff = float(diffs.max())
    return ours, theirs, diff


@pytest.mark.parametrize("case", list(CASES))
def test_first_lora_losses_match_transformers(tmp_path, case):
    ours, theirs, diff = run_case(tmp_path, *CASES[case])
    print(f"{case}: largest relative difference over {STEPS} steps {diff:.3g} (loss {ours[0]:.4f} -> {ours[-1]:.4f})")
    assert diff < 2e-5, (ours, theirs)
    assert ours[-1] < ours[0], "the loss must fall for the comparison to mean something"


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_first_lora_losses_over_a_quantized_base_match_transformers(tmp_path, case):
    name, dtype = QUANTIZED[case]
    ours, theirs, diff = run_case(tmp_path, *CASES[name], dtype=dtype)
    print(f"{case}: largest relative difference over {STEPS} steps {diff:.3g}")
    assert diff < 2e-5, (ours, theirs)
