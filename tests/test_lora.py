"""lora: fine-tuning a frozen GGUF base made by the harness; adapter export; bad bases."""

import hashlib
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from helpers import cli

from toyharness.engine import GGUFFile
from toyharness.engine.gguf_io import copy_gguf_as, write_gguf
from toyharness.runner import train

FT = ["t_seq=32", "t_batch=8", "eval_every=20", "checkpoint_every=20", "lr=1e-2", "warmup=2"]


def losses(run_dir):
    return [m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_lora_fine_tune_lowers_the_held_out_loss(llama_base, other_text, tmp_path):
    digest = hashlib.sha256(llama_base.read_bytes()).hexdigest()
    common = FT + [f"base={llama_base}", f"data={other_text}", "eval_batches=16"]
    base_loss = train("lora", steps=1, sets=common + ["lr=1e-9", "eval_every=1"], out=str(tmp_path / "base"),
                      progress=False)["eval_loss"]
    out = tmp_path / "run"
    s = train("lora", steps=150, sets=common + ["targets=q,v,o,up", "eval_every=50", "warmup=5"], out=str(out),
              progress=False)
    print(f"held-out loss on the other text: base {base_loss:.4f}, after 150 LoRA steps {s['eval_loss']:.4f}")
    assert s["eval_loss"] < base_loss - 0.05
    assert hashlib.sha256(llama_base.read_bytes()).hexdigest() == digest, "the base must not change"
    with GGUFFile(out / "checkpoint.gguf") as f:
        trained = {n for n in f.names if not n.startswith("adamw.")}
    assert trained == {f"blk.{i}.{t}.weight.lora_{ab}" for i in range(2) for t in ("attn_q", "attn_v", "attn_output",
                                                                                     "ffn_up") for ab in "ab"}


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_lora_trains_through_every_base_type(llama_base, tmp_path, dtype):
    """Every type stays mmap'd in its own type. Same model up to rounding (tests/test_quant.py
    checks every quantized type against its dequantized weights)."""
    sets = FT + ["targets=q,k,v,o,gate,up,down"]
    ref = train("lora", steps=10, sets=sets + [f"base={llama_base}"], out=str(tmp_path / "f32"), progress=False)
    base = copy_gguf_as(llama_base, tmp_path / f"base-{dtype}.gguf", dtype)
    got = train("lora", steps=10, sets=sets + [f"base={base}"], out=str(tmp_path / dtype), progress=False)
    a, b = losses(tmp_path / "f32"), losses(tmp_path / dtype)
    assert all(np.isfinite(b))
    assert abs(a[0] - b[0]) < 0.02 * a[0] and abs(ref["eval_loss"] - got["eval_loss"]) < 0.05 * ref["eval_loss"]


def test_adapter_gguf_follows_llama_cpp_format(llama_base, other_text, tmp_path):
    out = tmp_path / "run"
    train("lora", steps=5, sets=FT + [f"base={llama_base}", f"data={other_text}", "rank=4", "alpha=8",
                                      "targets=q,k,gate,down", "merged=true"], out=str(out), progress=False)
    r = gguf.GGUFReader(out / "adapter.gguf")
    assert r.fields["general.type"].contents() == "adapter" and r.fields["adapter.type"].contents() == "lora"
    assert r.fields["adapter.lora.alpha"].contents() == 8.0
    assert r.fields["general.architecture"].contents() == "llama"
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}
    assert shapes["blk.1.attn_q.weight.lora_a"] == (4, 64) and shapes["blk.1.attn_q.weight.lora_b"] == (64, 4)
    assert shapes["blk.0.attn_k.weight.lora_b"] == (32, 4) and shapes["blk.0.ffn_down.weight.lora_a"] == (4, 128)
    assert len(shapes) == 2 * 4 * 2
    merged = gguf.GGUFReader(out / "model.gguf")
    assert {t.name for t in merged.tensors} == {t.name for t in gguf.GGUFReader(llama_base).tensors}


def test_step_zero_sees_the_base_exactly(llama_base, tmp_path):
    """B starts at zero: the first LoRA loss is the base model's loss on that batch."""
    from toyharness.discovery import get_recipe
    from toyharness.runner import resolve_options

    out = tmp_path / "lora"
    train("lora", steps=1, sets=FT + [f"base={llama_base}"], out=str(out), progress=False, save_batches=True)
    batch = np.load(out / "batches.npz")
    _, llama = get_recipe("llama")
    opts = resolve_options(llama, None, ["n_layer=2", "d_model=64", "n_head=4", "n_kv_head=2", "d_ff=128",
                                         "t_seq=32"], {})
    with GGUFFile(llama_base) as f:
        params = {n: f.tensor(n).to_numpy() for n in f.names}
    from toyharness.engine import get_engine
    from toyharness.lm import LanguageModel

    model = LanguageModel(llama, get_engine("cpu"), opts, 256, params, batch=8, seq=32)
    logits = model.next_logits(batch["tokens"][0]).astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch["targets"][0][..., None].astype(np.int64), -1).mean()
    assert abs(losses(out)[0] - ce) < 1e-5 * ce


def write_bad(tmp_path, llama_base, kind):
    with GGUFFile(llama_base) as f:
        arrays = {n: f.tensor(n).to_numpy() for n in f.names}
        meta = {k: v for k, v in f.metadata().items() if k != "general.architecture"}
    path = tmp_path / f"{kind}.gguf"
    arch = "llama"
    if kind == "missing":
        del arrays["blk.1.ffn_up.weight"]
    elif kind == "shape":
        arrays["blk.0.attn_v.weight"] = arrays["blk.0.attn_v.weight"][:16]
    elif kind == "arch":
        arch = "gpt2"
    elif kind == "truncated":
        data = llama_base.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path
    elif kind == "dtype":
        return copy_gguf_as(llama_base, path, "iq4_nl")
    write_gguf(path, arch, arrays, meta)
    return path


@pytest.mark.parametrize("kind,message", [
    ("truncated", "truncated"),
    ("arch", "architecture 'gpt2' is not supported as a base; supported: llama, qwen2, qwen3, gemma3, phi3"),
    ("missing", "tensor 'blk.1.ffn_up.weight' not found"),
    ("shape", "tensor 'blk.0.attn_v.weight' has shape (16, 64), expected (32, 64)"),
    ("dtype", "tensor 'token_embd.weight' has type iq4_nl, which toyharness does not take (supported: f32, f16, "
              "bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k)"),
])
def test_bad_base_exits_2_naming_file_and_tensor(llama_base, tmp_path, kind, message):
    bad = write_bad(tmp_path, llama_base, kind)
    res = cli("run", "lora", "--steps", "2", "--set", f"base={bad}", "--out", str(tmp_path / "r"))
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and str(bad) in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "r").exists(), "no run folder may be left behind"


def test_missing_base_option_is_named(tmp_path):
    res = cli("run", "lora", "--steps", "2", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "lora needs a base model: --set base=PATH.gguf" in res.stderr


def test_lora_over_a_100mb_base_maps_it_in_place(tmp_path):
    """RSS grows by less than 10% of the base file beyond adapters, moments and activations.

    Counted as anonymous (private) RSS: the mmap'd base is resident too once the steps have
    read it, but as file pages shared with the page cache, not as a copy (RssFile, reported)."""
    code = f"""
import json, numpy as np, resource
from toyharness.engine.gguf_io import write_gguf
d, ff, layers = 1024, 2048, 3
rng = np.random.default_rng(0)
t = {{"token_embd.weight": rng.standard_normal((256, d), np.float32) * 0.02,
      "output_norm.weight": np.ones(d, np.float32)}}
for i in range(layers):
    b = f"blk.{{i}}."
    t[b + "attn_norm.weight"] = np.ones(d, np.float32); t[b + "ffn_norm.weight"] = np.ones(d, np.float32)
    for n, s in (("attn_q", (d, d)), ("attn_k", (d, d)), ("attn_v", (d, d)), ("attn_output", (d, d)),
                 ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))):
        t[b + n + ".weight"] = rng.standard_normal(s, np.float32) * 0.02
meta = {{f"llama.{{k}}": v for k, v in dict(block_count=layers, embedding_length=d, feed_forward_length=ff,
         context_length=16, **{{"attention.head_count": 8, "attention.head_count_kv": 8,
         "attention.layer_norm_rms_epsilon": 1e-5}}).items()}}
path = write_gguf({str(tmp_path / "big.gguf")!r}, "llama", t, meta)
del t
import gc; gc.collect()
from toyharness.hookspecs import plugin_manager
from toyharness.discovery import get_recipe
from toyharness.runner import resolve_options, load_data, batch_for
from toyharness.engine import get_engine
_, obj = get_recipe("lora")
o = resolve_options(obj, None, [f"base={{path}}", "t_seq=16", "t_batch=2", "rank=4"], {{}})
data = load_data(plugin_manager(obj), o)
eng = get_engine("cpu")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def rss(kind):
    for line in open("/proc/self/status"):
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024
rss0, file0 = rss("RssAnon"), rss("RssFile")
model = obj.realize(eng, o, data)
for i in range(3):
    model.step(batch_for(data, "train", i, o), o.adamw_row().hp_for_step(i))
rss1, file1 = rss("RssAnon"), rss("RssFile")
own = model.prog.persistent_bytes() + model.prog.compute_buffer_bytes()
import os
print(json.dumps({{"file": os.path.getsize(path), "growth": rss1 - rss0, "own": own, "file_pages": file1 - file0}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    fig = json.loads(res.stdout.strip().splitlines()[-1])
    assert fig["file"] > 100e6
    extra = fig["growth"] - fig["own"]
    print(f"base {fig['file'] / 1e6:.1f} MB; RSS growth {fig['growth'] / 1e6:.1f} MB, of which adapters, moments and "
          f"activations {fig['own'] / 1e6:.1f} MB; beyond them {extra / 1e6:.1f} MB "
          f"({100 * extra / fig['file']:.1f}% of the file); mapped file pages {fig['file_pages'] / 1e6:.1f} MB")
    assert extra < 0.10 * fig["file"], fig
