"""The shakespeare-char reproduction: the shipped config resolves to nanoGPT's baby GPT, and the race's
table (tools/shakespeare_race.py) reads a real run folder and a torch log."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from helpers import cli

from toyharness.data.text import synthetic_corpus_bytes
from toyharness.discovery import get_recipe
from toyharness.options import resolve_options

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "plugins" / "toyharness_recipes" / "configs" / "shakespeare_char.toml"


def _race_module():
    spec = importlib.util.spec_from_file_location("shakespeare_race", ROOT / "tools" / "shakespeare_race.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_is_nanogpts_baby_gpt():
    _, gpt2 = get_recipe("gpt2")
    o = resolve_options(gpt2, str(CONFIG), None, {})
    # nanoGPT's config/train_shakespeare_char.py and train.py's defaults, under our names
    assert (o.n_layer, o.n_head, o.d_model, o.t_seq, o.t_batch, o.accumulate) == (6, 6, 384, 256, 64, 1)
    assert (o.dropout, o.lr, o.min_lr, o.beta1, o.beta2, o.weight_decay, o.grad_clip) == (
        0.2, 1e-3, 1e-4, 0.9, 0.99, 0.1, 1.0)
    assert (o.lr_schedule, o.warmup, o.steps, o.eval_every, o.eval_batches) == ("cosine", 100, 5000, 250, 200)
    assert o.untied is False and o.adamw_convention == "bias_corrected" and o.precision == "fp32"
    # nanoGPT's warmup then cosine from lr to min_lr over steps 100..5000
    row = o.adamw_row()
    assert row.schedule.learning_rate(o.lr, 4999) == 1e-4 + 0.5 * (1 + math.cos(math.pi * 4899 / 4900)) * (1e-3 - 1e-4)
    assert row.schedule.learning_rate(o.lr, 49) == 1e-3 * 50 / 100


def test_race_table_reads_a_tiny_run(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(synthetic_corpus_bytes())
    out = tmp_path / "race"
    res = cli("run", "gpt2", "--config", str(CONFIG), "--set", f"data={corpus}", "--set", "n_layer=1",
              "--set", "d_model=32", "--set", "n_head=2", "--set", "t_seq=16", "--set", "t_batch=2", "--set",
              "steps=6", "--set", "warmup=1", "--set", "eval_every=3", "--set", "eval_batches=1", "--set",
              "checkpoint_every=6", "--threads", "1", "--out", str(out / "ours-7"), "--no-progress")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in (out / "ours-7" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 5]
    (out / "torch-7.jsonl").write_text(
        json.dumps({"step": 3, "train_loss": 5.0, "val_loss": 2.0, "wall_s": 1.5}) + "\n"
        + json.dumps({"step": 6, "train_loss": 4.0, "val_loss": 1.25, "wall_s": 3.0}) + "\n"
        + json.dumps({"end": True, "steps": 6, "wall_s": 3.25, "target": 1.5, "time_to_target_s": 3.0}) + "\n")
    (out / "process-7.txt").write_text("toyharness 2.5\ntorch 9.75\n")
    race = _race_module()
    got = race.collect(out, target=1.5)
    summary = json.loads((out / "ours-7" / "summary.json").read_text())
    assert got[0] == {"seed": "7", "side": "toyharness", "final": evals[-1]["eval_loss"],
                      "best": min(r["eval_loss"] for r in evals), "wall": summary["wall_s"],
                      "to_target": None, "steps": 6, "process": 2.5}       # a byte model after 6 steps: ~5.5
    assert got[1] == {"seed": "7", "side": "torch", "final": 1.25, "best": 1.25, "wall": 3.25, "to_target": 3.0,
                      "steps": 6, "process": 9.75}
    # a target every eval meets: the first eval's wall_s
    assert race.collect(out, target=100.0)[0]["to_target"] == evals[0]["wall_s"]
    text = race.table(got, 1.5).splitlines()
    assert text[-2].split()[:3] == ["mean", "toyharness", f"{evals[-1]['eval_loss']:.4f}"]
    assert text[-1].split() == ["mean", "torch", "1.2500", "1.2500", "3.2", "9.8", "3.0", "(1/1", "seeds", "reach",
                                "1.5)"]
    assert race.main([str(tmp_path / "empty")]) == 2
