"""JSONL data (text, prompt/completion, chat), its loss mask, truncation, and bad input; a model
trained from scratch with tokenizer=, then LoRA over it on prompt/completion data, then sample."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tokenizer_cases as cases

from toyharness.cli import main
from toyharness.data.jsonl import load_jsonl
from toyharness.engine import GGUFFile
from toyharness.errors import InputError
from toyharness.tokenizer import ByteTokenizer, GGUFTokenizer

SMALL = ["n_layer=1", "d_model=16", "n_head=2", "n_kv_head=1", "d_ff=32", "t_seq=48", "t_batch=2", "eval_every=2",
         "checkpoint_every=2"]


@pytest.fixture(scope="module")
def smollm2():
    return GGUFTokenizer.from_gguf(cases.SMOLLM2_VOCAB)


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_completion_counts_the_answer_and_its_end_of_turn(tmp_path, smollm2):
    data = load_jsonl(write(tmp_path / "d.jsonl", [{"prompt": "n2w 7", "completion": "seven"}] * 3), smollm2, 48)
    counted = data.targets[0][data.mask[0] > 0]
    assert smollm2.decode(counted, keep_special=True) == "seven<|im_end|>\n"
    assert data.mask[0].sum() == len(counted) and data.truncated == 0
    # inputs are the targets shifted by one
    k = int((data.mask[0] > 0).nonzero()[0][-1])
    assert np.array_equal(data.tokens[0, 1:k + 1], data.targets[0, :k])


def test_chat_counts_every_assistant_turn_only(tmp_path, smollm2):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "one"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "two"}]
    data = load_jsonl(write(tmp_path / "c.jsonl", [{"messages": msgs}] * 2), smollm2, 64)
    assert smollm2.decode(data.targets[0][data.mask[0] > 0], keep_special=True) == \
        "one<|im_end|>\ntwo<|im_end|>\n"
    off = load_jsonl(tmp_path / "c.jsonl", smollm2, 64, mask_prompt=False)
    assert off.mask[0].sum() > data.mask[0].sum()


def test_text_counts_all_and_padding_never(tmp_path):
    data = load_jsonl(write(tmp_path / "t.jsonl", [{"text": "abc"}, {"text": "x" * 100}]), ByteTokenizer(), 16)
    assert data.mask[0].tolist() == [1, 1] + [0] * 14       # "abc": 2 predictions, then padding
    assert data.truncated == 1 and data.mask[1].sum() == 16


@pytest.mark.parametrize("rows, message", [
    (['{"prompt": "a", "completion": "b"}', "{not json"], r"d\.jsonl:2: not JSON"),
    ([{"prompt": "a"}], r"d\.jsonl:1: missing key 'completion'"),
    ([{"question": "a"}], r"d\.jsonl:1: missing key"),
    ([{"messages": [{"role": "user", "content": "a"}]}], r"d\.jsonl:1: .*has no chat template"),
    ([{"messages": [{"role": "robot", "content": "a"}]}], r"d\.jsonl:1: messages\[0\] has role 'robot'"),
    (["", "  "], r"d\.jsonl: no examples"),
])
def test_bad_lines_are_named(tmp_path, rows, message):
    with pytest.raises(InputError, match=message):
        load_jsonl(write(tmp_path / "d.jsonl", rows), ByteTokenizer(), 16)


def test_cli_bad_data_exits_2_without_a_run_folder(tmp_path, capsys):
    bad = write(tmp_path / "d.jsonl", ['{"text": "a"}', "oops"])
    out = tmp_path / "run"
    assert main(["run", "llama", "--steps", "2", "--set", f"data={bad}", "--out", str(out), "--no-progress"]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    assert not out.exists()


def test_scratch_with_tokenizer_then_lora_on_prompt_completion_then_sample(tmp_path, capsys):
    data = write(tmp_path / "pc.jsonl", [{"prompt": f"n2w {i}", "completion": f"{i}"} for i in range(20)])
    base = tmp_path / "base"
    assert main(["run", "llama", "--steps", "2", "--set", f"tokenizer={cases.SMOLLM2_VOCAB}", "--set",
                 f"data={data}", *sum((["--set", s] for s in SMALL), []), "--out", str(base), "--no-progress"]) == 0
    tok = GGUFTokenizer.from_gguf(base / "model.gguf")          # the export carries the tokenizer
    assert tok.vocab_size == 49152 and tok.chat_template
    lora = tmp_path / "lora"
    assert main(["run", "lora", "--steps", "2", "--set", f"base={base / 'model.gguf'}", "--set", f"data={data}",
                 *sum((["--set", s] for s in SMALL[-4:]), []), "--out", str(lora), "--save-batches",
                 "--no-progress"]) == 0
    batches = np.load(lora / "batches.npz")
    assert batches["mask"].shape == batches["tokens"].shape == (2, 2, 48)
    assert set(np.unique(batches["mask"])) == {0.0, 1.0}
    summary = json.loads((lora / "summary.json").read_text())
    assert summary["truncated_examples"] == 0
    # warm_start reads text with its donor's tokenizer: the vocabulary is the donor's 49152 tokens
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    ws = tmp_path / "ws"
    assert main(["run", "warm_start", "--steps", "2", "--set", f"donor={base / 'model.gguf'}", "--set",
                 "donor_d_in=16", "--set", f"data={text}", *sum((["--set", s] for s in SMALL), []), "--out", str(ws),
                 "--save-batches", "--no-progress"]) == 0
    with GGUFFile(ws / "model.gguf") as f:
        assert f.tensor("token_embd.weight").shape[0] == 49152
    assert np.load(ws / "batches.npz")["tokens"].max() > 255
    capsys.readouterr()
    assert main(["sample", str(lora), "--prompt", "n2w 3", "--chat", "--tokens", "3", "--temperature", "0"]) == 0
    reply = capsys.readouterr().out
    assert reply.endswith("\n") and "<|im_start|>" not in reply


def test_eval_batches_on_jsonl_data_is_refused_by_name(tmp_path):
    """JSONL examples evaluate every held-out row: an eval_batches the data would not read is refused."""
    path = tmp_path / "ex.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} ", "completion": f"a{i} " * 3}) + "\n" for i in range(20)))
    res = subprocess.run([sys.executable, "-m", "toyharness.cli", "run", "llama", "--steps", "1", "--set",
                          f"data={path}", "--set", "eval_batches=1", "--out", str(tmp_path / "r"), "--no-progress"],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert "option 'eval_batches=1': this data's evaluation goes through every held-out row" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
