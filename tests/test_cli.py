"""The command line: exit codes, one-line errors, the run folder, resume bit for bit."""

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import cli

TINY = ["--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2", "--set", "t_seq=16", "--set", "t_batch=2",
        "--set", "eval_every=4", "--set", "checkpoint_every=4", "--set", "warmup=2"]


def test_recipes_lists_distribution_and_version():
    res = cli("recipes")
    assert res.returncode == 0
    lines = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert "toyharness 0.1.0" in lines["gpt2"] and "toyharness 0.1.0" in lines["llama"]
    assert res.stdout.splitlines()[-1].startswith("lora bases and warm_start donors: GGUFs of architecture llama, "
                                                  "qwen2, qwen3, gemma3, phi3")


@pytest.mark.parametrize("args,message", [
    (["run", "gpt2", "--set", "n_heads=4"], "unknown option 'n_heads'; allowed:"),
    (["run", "gpt2", "--set", "t_seq=abc"], "option 't_seq': 'abc' is not a valid int"),
    (["run", "gpt2", "--set", "adamw_convention=sgd"], "'sgd' is not allowed; allowed: bias_corrected, constant_betas"),
    (["run", "gpt2", "--set", "data=/no/such/corpus.txt"], "data '/no/such/corpus.txt': no such file or folder"),
    (["run", "nosuchrecipe"], "unknown recipe 'nosuchrecipe'; installed:"),
    (["run", "gpt2", "--config", "/no/such.toml"], "config file /no/such.toml not found"),
    # each bad value named by its option, never a traceback (n_head=0 divided by zero, seed=-1
    # reached numpy) nor a silent empty model (n_layer=0 trained one)
    (["run", "gpt2", "--set", "seed=-1"], "toyharness: error: option 'seed': must be >= 0, got -1"),
    (["run", "gpt2", "--set", "n_head=0"], "toyharness: error: option 'n_head': must be > 0, got 0"),
    (["run", "gpt2", "--set", "n_layer=0"], "toyharness: error: option 'n_layer': must be > 0, got 0"),
    (["run", "gpt2", "--set", "d_model=0"], "toyharness: error: option 'd_model': must be > 0, got 0"),
    (["run", "llama", "--set", "n_kv_head=0"], "toyharness: error: option 'n_kv_head': must be > 0, got 0"),
    (["run", "gpt2", "--set", "lr=inf"], "toyharness: error: option 'lr': must be > 0 and finite, got inf"),
    (["run", "gpt2", "--set", "init_scale=0"],
     "toyharness: error: option 'init_scale': must be > 0 and finite, got 0.0"),
    (["run", "gpt2", "--set", "weight_decay=inf"],
     "toyharness: error: option 'weight_decay': must be >= 0 and finite, got inf"),
    (["run", "gpt2", "--set", "warmup=-5"], "toyharness: error: option 'warmup': must be >= 0, got -5"),
])
def test_input_errors_exit_2_with_one_line(args, message, tmp_path):
    res = cli(*args, "--out", str(tmp_path / "run"))
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "run").exists(), "a run folder was left behind"


@pytest.mark.parametrize("args,message", [
    (["run", "gpt2", "--threads", "0"], "toyharness: error: --threads must be >= 1, got 0"),
    (["sample", "RUN", "--threads", "0"], "toyharness: error: --threads must be >= 1, got 0"),
    (["bench", "gpt2", "--profile", "--threads", "0"], "toyharness: error: --threads must be >= 1, got 0"),
    (["bench", "gpt2", "--profile", "--warmup", "-1"], "toyharness: error: --warmup must be >= 0, got -1"),
])
def test_counts_no_command_takes_exit_2(args, message, tmp_path):
    """--threads 0 used to mean the default, silently; --warmup -1 went through."""
    res = cli(*[str(tmp_path) if a == "RUN" else a for a in args])
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == message
    assert res.stdout == ""


def test_unknown_flag_exits_2():
    assert cli("run", "gpt2", "--bogus").returncode == 2


def test_run_writes_the_run_folder(tmp_path):
    out = tmp_path / ("a-folder-name-wider-than-the-summary-table-" * 3) / "run"
    res = cli("run", "llama", "--steps", "6", *TINY, "--out", str(out), "--save-init", "--save-batches",
              "--no-progress")
    assert res.returncode == 0, res.stderr
    for name in ("config.toml", "metrics.jsonl", "summary.json", "loss.png", "init.gguf", "batches.npz",
                 "checkpoint.gguf", "model.gguf"):
        assert (out / name).is_file(), name
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(6))
    assert all(m["loss_hex"].startswith("0x") and len(m["loss_hex"]) == 10 for m in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] > 0 and summary["steps"] == 6
    # each row's wall_s: the run's seconds so far, rising step by step, within the summary's wall_s
    walls = [m["wall_s"] for m in lines]
    assert 0 < walls[0] and walls == sorted(walls) and walls[-1] <= summary["wall_s"]
    assert walls[0] >= lines[0]["ms"] / 1000 - 1e-3
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    # The summary names the run folder whole, on one line, however wide the path.
    assert f"run folder: {out}" in res.stdout.splitlines(), res.stdout


def test_nan_loss_stops_with_exit_1(tmp_path):
    res = cli("run", "gpt2", "--steps", "4", *TINY, "--set", "lr=1e30", "--set", "warmup=0", "--out",
              str(tmp_path / "r"), "--no-progress")
    assert res.returncode == 1, res.stderr
    assert "loss is nan at step" in res.stderr or "loss is inf at step" in res.stderr


@pytest.mark.parametrize("recipe", ["gpt2", "llama"])
def test_resume_after_kill_is_bit_identical(tmp_path, recipe):
    steps = 10
    full = tmp_path / "full"
    assert cli("run", recipe, "--steps", str(steps), *TINY, "--out", str(full), "--no-progress").returncode == 0
    killed = tmp_path / "killed"
    # Kill the process hard right after step 5 (the checkpoint covers steps 0-3).
    code = textwrap.dedent(f"""
        import os
        from toyharness.hookspecs import hookimpl
        from toyharness.runner import train
        class Killer:
            @hookimpl
            def step_end(self, run, step, loss, lr, ms, tokens_per_s):
                if step == 5:
                    os._exit(137)
        train({recipe!r}, steps={steps}, sets={[s for s in TINY if s != "--set"]!r}, out={str(killed)!r},
              observers=(Killer(),), progress=False)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 137, res.stderr
    assert not (killed / "summary.json").exists()
    res = cli("run", recipe, "--steps", str(steps), "--resume", str(killed), "--no-progress")
    assert res.returncode == 0, res.stderr
    a = [json.loads(x)["loss_hex"] for x in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["loss_hex"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == steps
    assert a == b


def test_every_argument_of_every_command_has_help():
    """sample's --prompt, --tokens, --temperature, --top-k, --seed, the --backend flags and golden's
    check|record showed bare in --help."""
    import argparse

    from toyharness.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {a.option_strings or a.dest}" for name, parser in sub.choices.items() for a in parser._actions
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert bare == []
    assert set(sub.choices) == {"recipes", "run", "golden", "bench", "sweep", "fuse", "sample", "new-recipe"}


@pytest.mark.parametrize("args,message", [
    (["run", "gpt2", "--plan", "--steps", "0", "--out", "x"],
     "toyharness: error: --steps, --out: not used by --plan (it prints the memory plan and exits, training nothing)"),
    (["run", "gpt2", "--plan", "--save-init", "--log", "tensorboard"],
     "toyharness: error: --save-init, --log: not used by --plan (it prints the memory plan and exits, training "
     "nothing)"),
    (["bench", "gpt2", "--profile", "--steps", "5", "--out", "b.json"],   # --steps is --profile's too now
     "toyharness: error: --out: not used by --profile (it times steps node by node, without PyTorch, and writes "
     "nothing)"),
])
def test_flags_a_mode_does_not_use_are_refused_by_name(args, message, tmp_path):
    """run --plan dropped --steps, --out, --save-init, --save-batches and --log without a word; bench
    --profile dropped --out, --warmup, --torch-device and --torch-modes."""
    res = cli(*args, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == message
    assert res.stdout == "" and not list(tmp_path.iterdir())


def test_save_init_with_resume_is_refused_by_name(tmp_path):
    """--save-init on a resumed run wrote no init.gguf and said nothing."""
    (tmp_path / "config.toml").write_text('recipe = "gpt2"\n')
    (tmp_path / "checkpoint.gguf").write_bytes(b"")
    res = cli("run", "gpt2", "--resume", str(tmp_path), "--save-init", "--steps", "3")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (f"toyharness: error: --save-init with --resume {tmp_path}: a resumed run has no step "
                                  "0 to save (init.gguf is written by the run that starts)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.gguf", "config.toml"]


def test_resume_of_a_missing_folder_says_so(tmp_path):
    """--resume /no/such said "needs config.toml and checkpoint.gguf there", as if the folder were there."""
    res = cli("run", "gpt2", "--resume", str(tmp_path / "nosuch"), "--steps", "3")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"toyharness: error: --resume {tmp_path / 'nosuch'}: no such folder"


def test_resume_with_fewer_steps_than_the_checkpoint_says_what_to_pass(tmp_path):
    """--resume of a run at step 4 with --steps 2 said "checkpoint step 4 is not a step count in [0, 2]"."""
    part = tmp_path / "part"
    assert cli("run", "gpt2", "--steps", "4", *TINY, "--out", str(part), "--no-progress").returncode == 0
    before = {p.name: p.read_bytes() for p in part.iterdir()}
    res = cli("run", "gpt2", "--steps", "2", "--resume", str(part), "--no-progress")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (f"toyharness: error: {part / 'checkpoint.gguf'}: the checkpoint is at step 4, past "
                                  "the run's 2 steps; resume with --steps 4 or more")
    assert {p.name: p.read_bytes() for p in part.iterdir()} == before


def test_resume_with_a_model_option_changed_refuses_the_tensor_it_would_drop(tmp_path):
    """A checkpoint of gpt2 with biases resumed with bias=false: the biases would be dropped
    without a word; refused by the first tensor's name, nothing written."""
    part = tmp_path / "part"
    assert cli("run", "gpt2", "--steps", "4", *TINY, "--out", str(part), "--no-progress").returncode == 0
    before = {p.name: p.read_bytes() for p in part.iterdir()}
    res = cli("run", "gpt2", "--steps", "8", "--resume", str(part), "--set", "bias=false", "--no-progress")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (f"toyharness: error: {part / 'checkpoint.gguf'}: tensor 'blk.0.attn_norm.bias' is "
                                  "not one this run's options make (its model differs from the checkpoint's); "
                                  "resume with the options the run was made with")
    assert {p.name: p.read_bytes() for p in part.iterdir()} == before


def test_chat_on_the_byte_tokenizer_names_it(tmp_path):
    """sample --chat on a run of the byte tokenizer began "bytes: has no chat template", as if a file
    called bytes lacked one."""
    run = tmp_path / "run"
    assert cli("run", "gpt2", "--steps", "1", *TINY, "--out", str(run), "--no-progress").returncode == 0
    res = cli("sample", str(run), "--chat", "--prompt", "hi")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == ("toyharness: error: the byte tokenizer has no chat template; chat data and --chat "
                                  "need a GGUF tokenizer with tokenizer.chat_template (lora's base, or --set "
                                  "tokenizer=FILE.gguf)")


def test_save_batches_after_a_resume_holds_every_step(tmp_path):
    """A resumed run's batches.npz held only the resumed steps; docs/design.md has it hold every step's inputs,
    the same arrays as the run that was never stopped."""
    import numpy as np

    full, part = tmp_path / "full", tmp_path / "part"
    assert cli("run", "gpt2", "--steps", "8", *TINY, "--out", str(full), "--save-batches",
               "--no-progress").returncode == 0
    assert cli("run", "gpt2", "--steps", "4", *TINY, "--out", str(part), "--no-progress").returncode == 0
    res = cli("run", "gpt2", "--steps", "8", "--resume", str(part), "--save-batches", "--no-progress")
    assert res.returncode == 0, res.stderr
    a, b = np.load(full / "batches.npz"), np.load(part / "batches.npz")
    assert sorted(a.files) == sorted(b.files) == ["targets", "tokens"]
    for name in a.files:
        assert a[name].shape[0] == 8
        assert np.array_equal(a[name], b[name]), name


def test_a_resume_with_no_step_left_into_another_folder_leaves_a_resumable_run(tmp_path):
    """--resume DIR --steps N --out OTHER, DIR already at step N, wrote OTHER without checkpoint.gguf
    or metrics.jsonl: a run folder nothing could resume. OTHER now resumes as DIR does, bit for bit."""
    part, other = tmp_path / "part", tmp_path / "other"
    assert cli("run", "gpt2", "--steps", "4", *TINY, "--out", str(part), "--no-progress").returncode == 0
    res = cli("run", "gpt2", "--steps", "4", "--resume", str(part), "--out", str(other), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert (other / "checkpoint.gguf").read_bytes() == (part / "checkpoint.gguf").read_bytes()
    assert (other / "metrics.jsonl").read_text() == (part / "metrics.jsonl").read_text()
    for run in (other, part):       # other first: part's files must still be as the first run left them
        res = cli("run", "gpt2", "--steps", "8", "--resume", str(run), "--no-progress")
        assert res.returncode == 0, res.stderr
    a, b = ([json.loads(x)["loss_hex"] for x in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (part, other))
    assert len(a) == 8 and a == b
