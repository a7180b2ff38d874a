"""llama.cpp (built from the same pinned source archive) loads our model.gguf and gives the
logits we give (relative error < 1e-3). Run by `nox -s llamacpp`, which builds the small
native/llamacpp/th_logits tool and points TOYHARNESS_LLAMACPP_TOOL at it."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from toyharness.plugins import get_recipe
from toyharness.runner import resolve_options, train

TOOL = os.environ.get("TOYHARNESS_LLAMACPP_TOOL")
pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(not TOOL or not Path(TOOL).is_file(),
                                 reason="llama.cpp's th_logits is not built: run `nox -s llamacpp`")]

PROMPT = list(b"def main():\n    return 42")
# init_scale 10: attention is far from uniform, so a wrong Q/K layout shows in the logits.
SMALL = ["n_layer=2", "d_model=64", "n_head=4", "t_seq=32", "t_batch=4", "eval_every=30", "checkpoint_every=30",
         "init_scale=10", "lr=1e-3"]
CASES = {"gpt2": [], "llama": [], "llama-gqa-untied": ["n_kv_head=2", "untied=true"],
         "qwen2": ["qkv_bias=true", "n_kv_head=2"]}


def llama_cpp_logits(model: Path, ids: list[int], tmp_path: Path, lora: tuple[Path, float] | None = None):
    out = tmp_path / "logits.f32"
    extra = ["--lora", str(lora[0]), str(lora[1])] if lora else []
    res = subprocess.run([TOOL, str(model), str(out), *extra, *map(str, ids)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    n, vocab = map(int, res.stdout.split())
    return np.fromfile(out, dtype=np.float32).reshape(n, vocab)


def our_logits(run_dir: Path, recipe: str, ids: list[int]) -> np.ndarray:
    _, obj = get_recipe(recipe)
    opts = resolve_options(obj, str(run_dir / "config.toml"), [], {})
    model = obj.load_for_sampling(run_dir / "checkpoint.gguf", opts, 256)
    buf = np.zeros((1, opts.t_seq), np.int32)
    buf[0, :len(ids)] = ids
    return model.next_logits(buf)[0, :len(ids)]


def relative_error(ours, theirs) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_logits_match_ours(case, tmp_path):
    recipe = "gpt2" if case == "gpt2" else "llama"
    out = tmp_path / "run"
    train(recipe, steps=30, sets=SMALL + CASES[case], out=str(out), progress=False)
    theirs = llama_cpp_logits(out / "model.gguf", PROMPT, tmp_path)
    ours = our_logits(out, recipe, PROMPT)
    err = relative_error(ours, theirs)
    print(f"{case}: relative logits error {err:.3g}")
    assert err < 1e-3


@pytest.mark.parametrize("applied", ["adapter", "merged"])
def test_llama_cpp_applies_our_lora_adapter(llama_base, tmp_path, applied):
    out = tmp_path / "lora"
    train("lora", steps=30, sets=["t_seq=32", "t_batch=4", "lr=1e-2", "eval_every=30", "checkpoint_every=30",
                                  f"base={llama_base}", "targets=q,k,v,o,gate,up,down", "merged=true", "init_scale=5"],
          out=str(out), progress=False)
    if applied == "adapter":
        theirs = llama_cpp_logits(llama_base, PROMPT, tmp_path, lora=(out / "adapter.gguf", 1.0))
    else:
        theirs = llama_cpp_logits(out / "model.gguf", PROMPT, tmp_path)
    ours = our_logits(out, "lora", PROMPT)
    base = llama_cpp_logits(llama_base, PROMPT, tmp_path)
    err = relative_error(ours, theirs)
    print(f"lora {applied}: relative logits error {err:.3g} (the adapter moves them by "
          f"{relative_error(base, theirs):.3g})")
    assert err < 1e-3
    assert relative_error(base, theirs) > 1e-2, "the adapter must change the logits for the check to mean something"
