"""lora's `logits_chunk`: the output head and the loss a piece of positions at a time, recomputed in
the backward (Program.head_token_logps), against the whole head's masked cross-entropy: the same
loss and gradients but for rounding, on JSONL examples (the prompt masked) and on text (every
position counts), and a smaller training buffer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from toyharness import InputError, seeded_model_file
from toyharness.data.instructions import write_synthetic_instructions
from toyharness.discovery import get_recipe
from toyharness.engine import get_engine
from toyharness.options import resolve_options
from toyharness.runner import train

SMALL = ["n_layer=1", "d_model=32", "n_head=2", "n_kv_head=1", "d_ff=48", "seed=7"]


@pytest.fixture(scope="module")
def base():
    return seeded_model_file("llama", SMALL)


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return write_synthetic_instructions(tmp_path_factory.mktemp("data") / "instructions.jsonl", 60, median=20)


def lora_sets(base, *extra) -> list[str]:
    return [f"base={base}", "t_seq=32", "t_batch=3", "targets=q,v", "rank=4", "alpha=8", "init_scale=3",
            "chunked_loss=off", "eval_every=2", "checkpoint_every=100", *extra]


def metrics(tmp_path, name: str, sets: list[str]) -> list[dict]:
    out = tmp_path / name
    train("lora", steps=4, sets=sets, out=str(out), progress=False)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("data", ["jsonl", "text"])
def test_the_head_in_pieces_gives_the_whole_heads_losses(base, examples, tmp_path, data, portable):
    """logits_chunk=7 (pieces that straddle rows, the last one short) against 0: four steps' losses
    and the evaluations within 2e-6 relative (log of a picked softmax against ggml's
    cross_entropy_loss: the same sums in other orders)."""
    extra = [f"data={examples}"] if data == "jsonl" else []
    runs = {chunk: metrics(tmp_path, f"{data}-{chunk}", lora_sets(base, f"logits_chunk={chunk}",
                                                                  f"portable={portable}", *extra))
            for chunk in (0, 7)}
    for a, b in zip(runs[0], runs[7]):
        for key in ("loss", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=2e-6), key
    assert "eval_loss" in runs[7][1]


def test_the_head_in_pieces_gives_the_whole_heads_gradients(base, examples):
    """One step's gradients of every adapter, logits_chunk=5 against the whole head, within 1e-5 of
    each gradient's largest element."""
    _, obj = get_recipe("lora")
    grads = []
    for chunk in (0, 5):
        o = resolve_options(obj, None, lora_sets(base, f"data={examples}", f"logits_chunk={chunk}"), {})
        data = obj.load_data(o)
        model = obj.realize(get_engine("cpu"), o, data)
        model.trainer.grads_only(model.feeds(data.step_batch("train", 0, o)))
        grads.append({n: model.prog.read(model.trainer.grad_acc[n]) for n in model.prog.params})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        scale = float(np.abs(g).max())
        if scale == 0:                      # B's init is zero: A's gradient is exactly 0 both ways
            assert not np.any(grads[1][name]), name
            continue
        assert float(np.abs(grads[1][name] - g).max()) <= 1e-5 * scale, name


def test_the_head_in_pieces_shrinks_the_training_buffer(tmp_path):
    """A 2,048-token vocabulary over 4 rows of 48 positions: the head's rows x vocab tensors are most of
    the training graph's buffer; in pieces of 16 positions one piece's are alive at a time."""
    from toyharness.runner import plan_run

    big = seeded_model_file("llama", SMALL, vocab=2048)
    common = [f"base={big}", "t_seq=48", "t_batch=4", "targets=q,v", "chunked_loss=off"]
    whole, pieces = (plan_run("lora", sets=common + [f"logits_chunk={c}"]).rows["compute"] for c in (0, 16))
    assert pieces < 0.5 * whole, (pieces, whole)


@pytest.mark.parametrize("bad, why", [("logits_chunk=-1", "must be >= 0"),
                                      ("chunked_loss=on", "two ways to the same saving")])
def test_a_bad_logits_chunk_is_refused_by_name(base, bad, why):
    _, obj = get_recipe("lora")
    sets = lora_sets(base, "logits_chunk=8") if bad == "chunked_loss=on" else lora_sets(base)
    with pytest.raises(InputError, match=f"option 'logits_chunk'.*{why}"):
        resolve_options(obj, None, sets + [bad], {})
