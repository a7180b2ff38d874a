"""Sampling (toyharness/sampling.py): the full recompute's window, and the KV cache's logits within
rounding of it and the same tokens, greedy and sampled, over every architecture the
recipes take, past the cache's end too; `sample --prompts FILE` writes JSONL replies and scores
them. The cuda case runs under `nox -s tests-cuda` and skips elsewhere, saying why."""

import json
import subprocess
import sys

import numpy as np
import pytest
from arch_cases import ARCH_EXAMPLES as ARCHES

from toyharness._ffi import available_native_backends
from toyharness.architectures import example_file, read_model
from toyharness.cli import main
from toyharness.discovery import get_recipe
from toyharness.errors import InputError
from toyharness.runner import resolve_options, train
from toyharness.sampling import FullRecompute, generate, load_cached

PROMPT = list(b"Hello there, a")
SEQ = 24


def lora_models(case: str, backend: str = "cpu"):
    base = example_file(**ARCHES[case])
    _, obj = get_recipe("lora")
    opts = resolve_options(obj, None, [f"t_seq={SEQ}", f"base={base}",
                                       f"targets={','.join(read_model(base).arch.targets)}", "init_scale=5"], {})
    return (obj.load_for_sampling(None, opts, 256, backend=backend), load_cached(obj, None, opts, 256, backend),
            obj, opts)


def cached_vs_full_logits(full, kv, ids: list[int]) -> float:
    """The largest relative difference between the cache's logits, token by token after a
    prefill, and the full recompute's at the same positions."""
    buf = np.zeros((1, SEQ), np.int32)
    buf[0, :len(ids)] = ids
    ref = full.next_logits(buf)[0, :len(ids)]
    kv.reset()
    split = len(PROMPT)
    got = [kv.extend(ids[:split])] + [kv.extend([t]) for t in ids[split:]]
    return max(float(np.max(np.abs(ref[split - 1 + i] - g)) / np.max(np.abs(ref))) for i, g in enumerate(got))


def test_the_full_recompute_reads_the_text_left_aligned_in_its_window():
    """The reference: each new token the argmax of the window's forward at the text's last
    position, the text left-aligned and zero-padded; past the window, its last SEQ tokens."""
    full, _, _, _ = lora_models("llama")
    ids = list(PROMPT)
    for _ in range(30):
        window = ids[-SEQ:]
        buf = np.zeros((1, SEQ), np.int32)
        buf[0, :len(window)] = window
        ids.append(int(np.argmax(full.next_logits(buf)[0, len(window) - 1])))
    assert generate(FullRecompute(full), PROMPT, 30, 0.0, 0, 0) == ids[len(PROMPT):]
    with pytest.raises(InputError, match="do not fit a window of 24"):
        FullRecompute(full).extend(list(range(SEQ + 1)))


@pytest.mark.parametrize("case", list(ARCHES))
def test_kv_cache_gives_the_full_recomputes_logits_and_greedy_tokens(case):
    full, kv, _, _ = lora_models(case)
    # 30 new tokens from a 14-token prompt: past the 24 positions of the cache, the sliding window
    want = generate(FullRecompute(full), PROMPT, 30, 0.0, 0, 0)
    got = generate(kv, PROMPT, 30, 0.0, 0, 0)
    err = cached_vs_full_logits(full, kv, PROMPT + want[:SEQ - len(PROMPT)])
    print(f"{case}: KV cache vs full recompute, relative logits error {err:.3g}; {len(got)} tokens")
    assert len(want) == 30 and got == want
    assert err < 5e-6


def test_kv_cache_samples_the_same_tokens_at_a_temperature():
    full, kv, _, _ = lora_models("llama")
    for seed in range(3):
        want = generate(FullRecompute(full), PROMPT, 20, 0.9, 20, seed)
        assert generate(kv, PROMPT, 20, 0.9, 20, seed) == want
    assert generate(kv, PROMPT, 20, 0.9, 20, 0) != generate(kv, PROMPT, 20, 0.9, 20, 1)


def test_a_long_prompt_fills_the_cache_in_chunks(monkeypatch):
    """Prompts are taken 32 tokens a forward (PREFILL); here 4 at a time, then one by one."""
    import toyharness.sampling as sampling

    full, _, obj, opts = lora_models("qwen3")
    kv = sampling.CachedLM(obj, full.prog.engine, opts, 256, obj.init_params(opts, 256), prefill=4)
    assert sorted(kv.graphs) == [1, 4]
    prompt = list(b"A longer prompt, 19.")
    assert generate(kv, prompt, 8, 0.0, 0, 0) == generate(FullRecompute(full), prompt, 8, 0.0, 0, 0)


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in available_native_backends(),
                    reason="the cuda backend is not built into this install (TOYHARNESS_BACKENDS=cpu,cuda) or no GPU")
@pytest.mark.parametrize("case", list(ARCHES))
def test_kv_cache_on_cuda(case):
    full, kv, _, _ = lora_models(case, "cuda")
    want = generate(FullRecompute(full), PROMPT, 30, 0.0, 0, 0)
    err = cached_vs_full_logits(full, kv, PROMPT + want[:SEQ - len(PROMPT)])
    print(f"{case} on cuda: KV cache vs full recompute, relative logits error {err:.3g}")
    assert generate(kv, PROMPT, 30, 0.0, 0, 0) == want
    assert err < 1e-5


# --- sample --prompts ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample") / "run"
    train("llama", steps=4, sets=["n_layer=1", "d_model=32", "n_head=2", "t_seq=24", "t_batch=2", "eval_every=4",
                                  "checkpoint_every=4"], out=str(out), progress=False)
    return out


def test_sample_prompts_writes_jsonl_replies_and_scores_them(run_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The ", "completion": "x"}) + "\n\n" + json.dumps({"prompt": "A b"})
                       + "\n")
    out = tmp_path / "replies.jsonl"
    assert main(["sample", str(run_dir), "--prompts", str(prompts), "--temperature", "0", "--tokens", "6",
                 "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["The ", "A b"]
    assert rows[0]["completion"] == "x" and rows[0]["match"] == (rows[0]["reply"].strip() == "x")
    assert "match" not in rows[1] and all(r["tokens"] <= 6 for r in rows)
    assert f"2 prompts, {sum(r['tokens'] for r in rows)} tokens in" in err and "exact match" in err
    # the same replies as the full recompute, and as a plain file of one prompt a line
    assert main(["sample", str(run_dir), "--prompts", str(prompts), "--temperature", "0", "--tokens", "6",
                 "--no-cache", "--no-progress"]) == 0
    assert [json.loads(x)["reply"] for x in capsys.readouterr().out.splitlines()] == [r["reply"] for r in rows]
    plain = tmp_path / "p.txt"
    plain.write_text("The \nA b\n")
    assert main(["sample", str(run_dir), "--prompts", str(plain), "--temperature", "0", "--tokens", "6",
                 "--no-progress"]) == 0
    assert [json.loads(x)["reply"] for x in capsys.readouterr().out.splitlines()] == [r["reply"] for r in rows]


def test_sample_prompt_gives_the_same_text_with_and_without_the_cache(run_dir):
    args = [sys.executable, "-m", "toyharness.cli", "sample", str(run_dir), "--prompt", "The", "--temperature", "0",
            "--tokens", "40"]
    a = subprocess.run(args, capture_output=True, text=True, timeout=300)
    b = subprocess.run(args + ["--no-cache"], capture_output=True, text=True, timeout=300)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and len(a.stdout) > 3


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "a", "answer": "b"}\n', "p.jsonl:1: unknown key 'answer'; a prompt line has 'prompt' (and "
                                         "'completion') or 'messages'"),
    ('{"prompt": 3}\n', "p.jsonl:1: 'prompt' must be a string"),
    ('{"prompt": "a"}\n{oops\n', "p.jsonl:2: not JSON"),
    ("\n\n", "no prompts (the file is empty)"),
])
def test_sample_prompts_refuses_a_bad_file_in_one_line(run_dir, tmp_path, capsys, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    assert main(["sample", str(run_dir), "--prompts", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_sample_refuses_contradictory_options(run_dir, tmp_path, capsys):
    assert main(["sample", str(run_dir), "--prompt", "a", "--prompts", str(tmp_path / "x")]) == 2
    assert "--prompt and --prompts: give one" in capsys.readouterr().err
    assert main(["sample", str(run_dir), "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert f"--prompts {tmp_path / 'missing.txt'}: file not found" in capsys.readouterr().err
    assert main(["sample", str(run_dir), "--no-cache", "--context", "8"]) == 2
    assert "--context" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["gpt2", "llama", "warm_start"])
def test_kv_cache_for_the_recipes_trained_whole(tmp_path, recipe):
    extra = [f"donor={example_file(**ARCHES['llama'])}", "donor_d_in=64"] if recipe == "warm_start" else []
    out = tmp_path / "run"
    train(recipe, steps=3, sets=["n_layer=2", "d_model=32", "n_head=2", "t_seq=16", "t_batch=2", "eval_every=3",
                                 "checkpoint_every=3", "init_scale=5", *extra], out=str(out), progress=False)
    _, obj = get_recipe(recipe)
    opts = resolve_options(obj, str(out / "config.toml"), [], {})
    full = obj.load_for_sampling(out / "checkpoint.gguf", opts, 256)
    kv = load_cached(obj, out / "checkpoint.gguf", opts, 256)
    prompt = list(b"To be")
    assert generate(kv, prompt, 24, 0.0, 0, 0) == generate(FullRecompute(full), prompt, 24, 0.0, 0, 0)


@pytest.mark.parametrize("dtype", ["q4_1", "q4_k"])
def test_dequantize_holds_a_quantized_base_as_its_f32_values(dtype):
    """--dequantize: the base's weights as f32 (the same values), the same greedy tokens."""
    from toyharness.engine.gguf_io import cached_copy_as

    base = cached_copy_as(example_file(arch="llama", n_layer=1, d_model=256, n_head=4, n_kv_head=2, d_ff=512), dtype)
    _, obj = get_recipe("lora")
    opts = resolve_options(obj, None, [f"t_seq={SEQ}", f"base={base}", "targets=q"], {})
    kept, f32 = load_cached(obj, None, opts, 256), load_cached(obj, None, opts, 256, dequantize=True)
    q = "blk.0.attn_q.weight"
    assert kept.prog.frozen[q].dtype == dtype and f32.prog.frozen[q].dtype == "f32"
    a, b = kept.extend(PROMPT), f32.extend(PROMPT)
    assert float(np.max(np.abs(a - b)) / np.max(np.abs(a))) < 1e-5
    assert generate(kept, PROMPT, 16, 0.0, 0, 0) == generate(f32, PROMPT, 16, 0.0, 0, 0)
