"""recompute_blocks (toyharness/engine/recompute.py): each block's activations recomputed in the
backward, the same loss bits as without it, less memory in the plan and in ggml's buffers."""

from __future__ import annotations

import pytest

from toyharness.architectures import example_shape, write_example
from toyharness.errors import InputError
from toyharness.lm import seeded_model_file
from toyharness.runner import plan_run, train

STEPS = ["eval_every=2", "eval_batches=1"]


@pytest.fixture(scope="module")
def llama_base() -> str:
    return str(seeded_model_file("llama", ["n_layer=3", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=128"]))


def _losses(recipe: str, sets: list[str]) -> tuple[list[str], list[float]]:
    captured = []

    class Capture:
        from toyharness.hookspecs import hookimpl

        @hookimpl
        def run_end(self, run, summary, artifacts):
            captured.append(run)

    summary = train(recipe, steps=4, sets=sets + STEPS, write_files=False, progress=False, observers=(Capture(),))
    run = captured[0]
    return [m["loss_hex"] for m in run.metrics], [summary["eval_loss"]]


CASES = [("gpt2", ["n_layer=3"]), ("llama", ["n_layer=3"]), ("warm_start", ["n_layer=3"]), ("lora", ["t_seq=128"]),
         ("gpt2", ["n_layer=2", "portable=true"])]


@pytest.mark.parametrize("recipe,sets", CASES, ids=[f"{r}-{'-'.join(s)}" for r, s in CASES])
def test_recompute_keeps_the_loss_bits_and_saves_memory(recipe, sets, llama_base):
    if recipe == "lora":
        sets = sets + [f"base={llama_base}"]
    off, on = sets + ["recompute_blocks=false"], sets + ["recompute_blocks=true"]
    assert _losses(recipe, on) == _losses(recipe, off)
    plan_off, plan_on = plan_run(recipe, sets=off), plan_run(recipe, sets=on)
    assert plan_on.activations < plan_off.activations
    assert plan_on.total < plan_off.total


def test_recompute_is_refused_by_name_where_it_does_nothing(tmp_path):
    with pytest.raises(InputError, match="unknown option 'recompute_blocks'"):
        train("vit_tiny", steps=1, sets=["recompute_blocks=true"], write_files=False, progress=False)
    base = write_example(tmp_path / "qwen3.gguf", example_shape("qwen3"))
    with pytest.raises(InputError, match="option 'recompute_blocks': recipe lora's forward here has no blocks"):
        train("lora", steps=1, sets=[f"base={base}", "recompute_blocks=true"], write_files=False, progress=False)
