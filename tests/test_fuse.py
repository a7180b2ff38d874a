"""toyharness fuse: a run's adapters folded into its base, in the base's own types or one named,
every other tensor and all metadata carried over; over every architecture and base type lora
takes, and warm_start's model. Bad input is one line (exit 2), a failed write one line (exit 1)
with nothing left under the final name. llama.cpp's side: tests/test_llamacpp.py."""

import errno
import os

import gguf
import numpy as np
import pytest
from arch_cases import ARCH_EXAMPLES as ARCHES
from helpers import relative_error

from toyharness.architectures import example_file, read_model
from toyharness.cli import main
from toyharness.discovery import get_recipe
from toyharness.engine import GGUFFile, quant
from toyharness.engine.gguf_io import cached_copy_as
from toyharness.merge_adapters import FUSE_TYPES, fuse
from toyharness.runner import resolve_options, train

TINY = ["t_seq=16", "t_batch=2", "eval_every=4", "checkpoint_every=4", "lr=2e-2", "warmup=1", "init_scale=5"]
PROMPT = list(b"The cat sat on")
# 256 wide so that K-quants' blocks fit the rows
WIDE = dict(arch="llama", n_layer=1, d_model=256, n_head=4, n_kv_head=2, d_ff=512)


def lora_run(tmp_path, base, targets: str | None = None, steps: int = 4):
    out = tmp_path / "run"
    targets = targets or ",".join(read_model(base).arch.targets)
    train("lora", steps=steps, sets=TINY + [f"base={base}", f"targets={targets}"], out=str(out), progress=False)
    return out


def logits(base, run=None, targets: str | None = None) -> np.ndarray:
    """Our logits on PROMPT: `base` with RUN's adapters (its checkpoint), or `base` alone."""
    targets = targets or next(iter(read_model(base).arch.targets))    # with B = 0: the base alone
    _, obj = get_recipe("lora")
    opts = resolve_options(obj, None, TINY + [f"base={base}", f"targets={targets}"], {})
    vocab = read_model(base).shape.vocab
    model = obj.load_for_sampling(run / "checkpoint.gguf" if run else None, opts, vocab)
    buf = np.zeros((1, opts.t_seq), np.int32)
    buf[0, :len(PROMPT)] = PROMPT
    return model.next_logits(buf)[0, :len(PROMPT)].astype(np.float64)


@pytest.mark.parametrize("case", list(ARCHES))
def test_fused_f32_gives_base_plus_adapter_for_every_architecture(tmp_path, case):
    base = example_file(**ARCHES[case])
    targets = ",".join(read_model(base).arch.targets)
    run = lora_run(tmp_path, base, targets)
    fused = fuse(run, tmp_path / "fused.gguf", "f32")
    assert len(fused.fused) == read_model(base).shape.n_layer * len(targets.split(","))
    adapted, plain = logits(base, run, targets), logits(base)
    got = logits(fused.path)            # the fused file as a base, no adapter
    err, moved = relative_error(got, adapted), relative_error(plain, adapted)
    print(f"{case}: fused f32 vs base + adapter, relative logits error {err:.3g} (the adapter moves them {moved:.3g})")
    assert moved > 1e-3, "the adapter must change the logits for the check to mean something"
    assert err < 1e-5


def test_fused_file_carries_every_key_and_tensor_and_names_the_run(tmp_path):
    base = example_file(**ARCHES["phi3"])        # fused qkv and gate|up adapters
    run = lora_run(tmp_path, base)
    path = fuse(run, None, "same").path
    assert path == run / "fused.gguf"
    read_model(path)                                # a base like any other (our keys are known)
    with GGUFFile(base) as b, GGUFFile(path) as f:
        bm, fm = b.metadata(), f.metadata()
        for key, v in bm.items():
            if key != "general.name":
                assert fm[key].value == v.value, key
        assert fm["general.name"].value == f"toyharness-example + toyharness lora ({run.name})"
        assert fm["toyharness.fuse.run"].value == run.name and fm["toyharness.fuse.recipe"].value == "lora"
        assert fm["toyharness.fuse.targets"].value == "qkv,o,up,down"
        assert f.names == b.names
        for name in b.names:
            same = np.array_equal(b.tensor(name).raw_bytes(), f.tensor(name).raw_bytes())
            assert same == (".attn_qkv." not in name and ".attn_output." not in name and ".ffn_up." not in name
                            and ".ffn_down." not in name), name


@pytest.mark.parametrize("dtype", [t for t in quant.FROZEN_NAMES if t != "f32"])
def test_same_requantizes_each_adapted_tensor_in_the_base_type_by_ggml(tmp_path, dtype):
    """`same`: every tensor keeps the base's type; an adapted one is exactly ggml's quantization of
    the f32 merge (so llama.cpp's quantizer would give the same bytes), the others are untouched."""
    base = cached_copy_as(example_file(**WIDE), dtype)
    run = lora_run(tmp_path, base, "q,v,down", steps=3)
    fused = fuse(run, tmp_path / "fused.gguf")
    _, obj = get_recipe("lora")
    opts = resolve_options(obj, str(run / "config.toml"), [], {})
    with GGUFFile(run / "checkpoint.gguf") as c:
        ab = {n: c.tensor(n).to_numpy() for n in c.names if ".lora_" in n}
    with GGUFFile(base) as b, GGUFFile(fused.path) as f:
        for name in b.names:
            tb, tf = b.tensor(name), f.tensor(name)
            assert tf.ggml_type == tb.ggml_type, name
            if name + ".lora_a" not in ab:
                assert np.array_equal(tb.raw_bytes(), tf.raw_bytes()), name
                continue
            merged = tb.to_numpy() + np.float32(opts.alpha / opts.rank) * (ab[name + ".lora_b"] @ ab[name + ".lora_a"])
            want = quant.quantize(merged.astype(np.float32), dtype) if dtype not in ("f16",) else \
                merged.astype(np.float16)
            assert np.array_equal(np.asarray(want).view(np.uint8).reshape(-1), tf.raw_bytes()), name
            assert not np.array_equal(tb.raw_bytes(), tf.raw_bytes()), f"{name}: the adapter must show"


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0", "q4_k"])
def test_a_named_type_stores_every_matrix_in_it_and_norms_in_f32(tmp_path, dtype):
    base = example_file(**WIDE)
    run = lora_run(tmp_path, base, "q", steps=2)
    r = fuse(run, None, dtype)
    assert r.path == run / f"fused-{dtype}.gguf"
    with GGUFFile(r.path) as f:
        for name in f.names:
            t = f.tensor(name)
            assert t.dtype == (dtype if len(t.shape) == 2 else "f32"), name
        assert f.field("general.file_type") == gguf.LlamaFileType[
            {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_k": "MOSTLY_Q4_K_M"}[dtype]]
    # the fused model is the merge up to the type's rounding: as close to base + adapter as the
    # base stored in that type is to the base (this random 256-wide model amplifies rounding)
    err = relative_error(logits(r.path), logits(base, run))
    rounding = relative_error(logits(cached_copy_as(base, dtype)), logits(base))
    print(f"--type {dtype}: relative logits error against base + adapter {err:.3g} (the base in {dtype}: "
          f"{rounding:.3g})")
    assert err < 2 * rounding


def test_warm_start_model_fuses_to_its_export(tmp_path):
    donor = example_file(**ARCHES["llama"])
    out = tmp_path / "ws"
    train("warm_start", steps=3, sets=["n_layer=1", "d_model=32", "n_head=2", "d_ff=64", "t_seq=16", "t_batch=2",
                                       "eval_every=3", "checkpoint_every=3", f"donor={donor}",
                                       "donor_d_in=64"], out=str(out), progress=False)
    r = fuse(out)
    with GGUFFile(out / "model.gguf") as m, GGUFFile(r.path) as f:
        assert f.names == m.names
        for name in m.names:
            assert np.array_equal(m.tensor(name).to_numpy(), f.tensor(name).to_numpy()), name
        assert f.field("toyharness.fuse.recipe") == "warm_start"
        assert f.field("tokenizer.ggml.tokens") == m.field("tokenizer.ggml.tokens")
    q = fuse(out, None, "q8_0")
    with GGUFFile(q.path) as f:
        assert {f.tensor(n).dtype for n in f.names if len(f.tensor(n).shape) == 2} == {"q8_0"}


def test_cli_fuse_prints_what_it_wrote(tmp_path, capsys):
    run = lora_run(tmp_path, example_file(**ARCHES["llama"]), "q,v", steps=2)
    assert main(["fuse", str(run), "--type", "f16", "--out", str(tmp_path / "x.gguf")]) == 0
    out = capsys.readouterr().out
    assert "fused 4 adapted tensors" in out and f"wrote {tmp_path / 'x.gguf'}" in out


def test_cli_fuse_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert main(["fuse", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"toyharness: error: {tmp_path}: not a finished run folder (needs "
                                               "config.toml and checkpoint.gguf)")
    with pytest.raises(SystemExit) as exc:
        main(["fuse", str(tmp_path), "--type", "q3_k"])
    assert exc.value.code == 2 and "invalid choice: 'q3_k'" in capsys.readouterr().err
    run = lora_run(tmp_path, example_file(**ARCHES["llama"]), "q", steps=2)     # 64 wide: no K-quant fits
    assert main(["fuse", str(run), "--type", "q4_k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["toyharness: error: --type q4_k: tensor 'token_embd.weight' has rows of 64 values, not a multiple "
                   "of q4_k's block of 256; choose another type"]
    assert not (run / "fused-q4_k.gguf").exists()
    assert main(["fuse", str(run), "--out", str(run / "checkpoint.gguf")]) == 2
    assert "would overwrite" in capsys.readouterr().err


def test_fuse_types_are_the_clis():
    from toyharness import cli

    assert cli.FUSE_TYPES == FUSE_TYPES


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_one_line_exit_1_and_no_file(tmp_path, capsys, monkeypatch, code):
    run = lora_run(tmp_path, example_file(**ARCHES["llama"]), "q", steps=2)
    target = tmp_path / "out" / "fused.gguf"

    def fail(self, *args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    assert main(["fuse", str(run), "--out", str(target)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"toyharness: error: cannot write {target}: {os.strerror(code)}"]
    assert list(target.parent.iterdir()) == []


@pytest.mark.parametrize("where", ["folder", "export"])
def test_a_model_without_base_that_cannot_be_written_names_the_file(tmp_path, capsys, monkeypatch, where):
    """A run without a base (gpt2) is exported to a temporary folder first: a read-only folder was
    a traceback from tempfile (exit 1), a full disk named the temporary export, not --out."""
    import tempfile

    run = tmp_path / "run"
    train("gpt2", steps=2, sets=TINY[:4] + ["n_layer=1", "d_model=32", "n_head=2"], out=str(run), progress=False)
    target = tmp_path / "out" / "fused.gguf"
    target.parent.mkdir()

    def fail(*args, **kwargs):
        code = errno.EROFS if where == "folder" else errno.ENOSPC
        raise OSError(code, os.strerror(code))

    if where == "folder":
        monkeypatch.setattr(tempfile, "mkdtemp", fail)
    else:
        monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    assert main(["fuse", str(run), "--out", str(target)]) == 1
    reason = os.strerror(errno.EROFS if where == "folder" else errno.ENOSPC)
    assert capsys.readouterr().err.strip().splitlines() == [f"toyharness: error: cannot write {target}: {reason}"]
    assert list(target.parent.iterdir()) == []


def test_a_run_whose_recipe_lacks_what_fuse_and_sample_call_is_one_line(tmp_path, capsys):
    """fuse and sample take any recipe with the methods they call; one without them (vit_tiny, a
    classifier) is refused naming the methods it lacks."""
    run = tmp_path / "vit"
    train("vit_tiny", steps=1, sets=["n_layer=1", "d_model=16", "n_head=2", "d_ff=32", "t_batch=4", "eval_every=100"],
          out=str(run), progress=False)
    assert main(["fuse", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"toyharness: error: {run}: recipe 'vit_tiny' has no tokenizer, vocab_for, params_for_sampling, write_model: "
        "`fuse` takes a language model's recipe (toyharness.lm.LMRecipe has them)")
    assert main(["sample", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"toyharness: error: {run}: recipe 'vit_tiny' has no tokenizer, vocab_for, params_for_sampling, "
        "load_for_sampling, build_params, forward: `sample` takes a language model's recipe (toyharness.lm.LMRecipe "
        "has them)")
    assert not list(run.glob("fused*"))
