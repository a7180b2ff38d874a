"""Dropout (toyharness/engine/dropout.py, native/dropout_mask.c, cuda/th-custom.cu): the mask is
the numpy stream bit for bit in every mode (cpu fast and portable, the host's masks of the metal
lowering, vulkan and cuda where present), its statistics are dropout's, the gradient through it is
dy * mask, evaluation computes the model without dropout bit for bit, and training repeats run to
run and across a resume. Bad rates are refused by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import fd_grad, needs

from toyharness import InputError, dropout_mask
from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import get_engine
from toyharness.engine.dropout import keep_threshold, kept_value, node_id, philox4x32_10, stream_words
from toyharness.engine.program import Program
from toyharness.runner import batch_for, train

RNG = np.random.default_rng(5)
SEED = 0x1_2345_6789     # both words of the key in use
TINY = ["n_layer=1", "d_model=32", "n_head=2", "t_seq=24", "t_batch=2", "eval_every=1000",
        "checkpoint_every=1000", "warmup=2", "data=synthetic"]

# Random123's known answers for Philox4x32-10 (its kat_vectors): counter, key, the four words
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

MODES = ["fast", "portable", "metal_lowering", pytest.param("vulkan", marks=needs("vulkan")),
         pytest.param("cuda", marks=needs("cuda"))]


@pytest.fixture
def mode_engine(request, monkeypatch):
    """The engine of a mode, reset after the test."""
    mode = request.param
    if mode == "cuda" and not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine(mode if mode in ("vulkan", "cuda") else "cpu")
    engine.set_portable(mode == "portable")
    if mode == "metal_lowering":
        monkeypatch.setattr(Program, "lowering_target", "metal")
    yield engine
    engine.set_portable(False)


def masked(engine, shape, p, name, forward_index, x, enabled=True):
    """y = x.dropout(p, name) computed once as training forward `forward_index` (or evaluation)."""
    prog = engine.program()
    prog.dropout_seed = SEED
    xt = prog.input("x", shape)
    y = xt.dropout(p, name)
    fg = prog.forward({"y": y})
    prog.feed({"x": x})
    prog.set_dropout(forward_index, enabled)
    prog._compute(fg.graph)
    return prog.read(y), prog


def test_philox_is_random123s_known_answers_in_numpy_and_in_the_native_kernel():
    for counter, key, words in PHILOX_KAT:
        assert [int(w) for w in philox4x32_10(*counter, *key)] == list(words)
        c = ffi.new("uint32_t[4]", list(counter))
        lib.th_philox4x32_10_block(c, *key)
        assert list(c) == list(words)


def test_the_stream_is_philox_of_the_elements_block_node_and_forward_index():
    """Element i is word i % 4 of Philox(i // 4, 0, node, forward index; seed's two words)."""
    words = stream_words(SEED, 7, node_id("m"), 10)
    for i in (0, 3, 4, 9):
        block = philox4x32_10(i // 4, 0, node_id("m"), 7, SEED & 0xFFFFFFFF, SEED >> 32)
        assert words[i] == block[i % 4]
    assert node_id("123456789") == 0xCBF43926    # CRC-32's check value
    assert keep_threshold(0.1) == round(0.9 * 2 ** 32) and keep_threshold(0.0) == 2 ** 32
    assert kept_value(0.1) == np.float32(1 / 0.9)


@pytest.mark.parametrize("mode_engine", MODES, indirect=True)
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 4, 64, 64)])      # a tail of 1 element; a full block
def test_the_mask_is_the_numpy_stream_bit_for_bit(mode_engine, shape):
    x = RNG.normal(size=shape).astype(np.float32)
    for forward_index in (0, 5):
        y, prog = masked(mode_engine, shape, 0.25, "blk.0.m", forward_index, x)
        ref = x * dropout_mask(shape, 0.25, SEED, forward_index, "blk.0.m")
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32)), (forward_index, np.mean(y != ref))
    # evaluation: the mask is 1, x * 1 is x
    y, _ = masked(mode_engine, shape, 0.25, "blk.0.m", 5, x, enabled=False)
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32))


def test_each_mode_makes_its_mask_where_it_should():
    """cpu (fast and portable): one node of ours reading the fed key; the metal lowering: an input
    the host fills (no custom node, which metal would not run)."""
    engine = get_engine("cpu")
    for portable, kernel in ((False, "dropout_mask"), (True, "portable")):
        engine.set_portable(portable)
        try:
            prog = engine.program()
            fg = prog.forward({"y": prog.input("x", (4, 8)).dropout(0.5, "m")})
            prog.feed({"x": np.ones((4, 8), np.float32)})
            prog.set_dropout(0, True)
            prog._compute(fg.graph)
            names = [lib.th_portable_kernel_name(n) if portable else lib.th_kernel_name(n)
                     for n in (lib.ggml_graph_node(fg.graph, i) for i in range(lib.ggml_graph_n_nodes(fg.graph)))]
            assert kernel in [ffi.string(n).decode() for n in names if n != ffi.NULL]
        finally:
            engine.set_portable(False)


def test_keep_rate_and_kept_values_are_dropouts():
    shape, p = (64, 1024), 0.1
    x = RNG.normal(size=shape).astype(np.float32)
    y, _ = masked(get_engine("cpu"), shape, p, "stats", 3, x)
    kept = y != 0
    sd = math.sqrt(p * (1 - p) / y.size)
    assert abs(kept.mean() - (1 - p)) < 5 * sd, kept.mean()
    assert np.array_equal(y[kept], x[kept] * np.float32(1 / (1 - p)))      # one float32 multiply
    # other forward indices, names and seeds draw other masks: independent, so agreeing on about
    # p^2 + (1-p)^2 of the elements
    agree = (1 - p) ** 2 + p ** 2
    for other in (dropout_mask(shape, p, SEED, 4, "stats"), dropout_mask(shape, p, SEED, 3, "stats2"),
                  dropout_mask(shape, p, SEED + 1, 3, "stats")):
        assert abs(np.mean((other != 0) == kept) - agree) < 5 * math.sqrt(agree * (1 - agree) / y.size)


def test_the_gradient_through_dropout_is_finite_differences_with_the_mask_fixed():
    shape, p = (6, 10), 0.3
    x0 = RNG.normal(size=shape).astype(np.float32)
    prog = get_engine("cpu").program()
    prog.dropout_seed = SEED
    x = prog.param("x", x0)
    c = prog.constant("c", RNG.normal(size=shape).astype(np.float32))
    loss = ((x.dropout(p, "g") * c).sqr()).sum()
    trainer = prog.trainer(prog.scalar_loss(loss), "bias_corrected")
    trainer.steps_done = 2                 # the mask of training forward 2
    trainer.grads_only({})
    got = prog.read(trainer.grad_acc["x"])
    m = dropout_mask(shape, p, SEED, 2, "g").astype(np.float64)
    cc = prog.read(c).astype(np.float64)
    numeric = fd_grad(lambda a: float(np.sum((a["x"] * m * cc) ** 2)), {"x": x0.astype(np.float64)}, "x")
    assert np.allclose(got, numeric, rtol=1e-4, atol=1e-5)
    assert np.all(got[m == 0] == 0)


def gpt2_model(sets: list[str], backend: str = "cpu"):
    from toyharness.discovery import get_recipe
    from toyharness.options import resolve_options

    _, recipe = get_recipe("gpt2")
    o = resolve_options(recipe, None, [*TINY, *sets], {})
    data = recipe.load_data(o)
    return recipe.realize(get_engine(backend), o, data), data, o


DEVICES = [pytest.param("vulkan", marks=needs("vulkan")), pytest.param("cuda", marks=needs("cuda"))]
EVAL_MODES = ["fast", "portable", *DEVICES]


@pytest.mark.parametrize("mode", EVAL_MODES)
@pytest.mark.parametrize("t_seq", [24, 128])     # 128: the cpu's causal blocks (native/cpu_kernels.c)
def test_evaluation_with_dropout_is_the_model_without_it_bit_for_bit(mode, t_seq):
    backend = mode if mode in ("vulkan", "cuda") else "cpu"
    engine = get_engine(backend)
    engine.set_portable(mode == "portable")
    try:
        with_dropout, data, o = gpt2_model([f"t_seq={t_seq}", "dropout=0.2"], backend)
        without, _, _ = gpt2_model([f"t_seq={t_seq}"], backend)
        for step in range(2):       # train the dropout model: its weights move
            with_dropout.step(batch_for(data, "train", step, o), with_dropout.recipe.hp(o, step))
        without.trainer.load_state(with_dropout.trainer.state(), 2)
        for index in range(3):
            batch = batch_for(data, "eval", index, o)
            a, b = with_dropout.evaluate(batch)["loss"], without.evaluate(batch)["loss"]
            assert np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32), (a, b)
    finally:
        engine.set_portable(False)


def losses_hex(out) -> list[str]:
    return [json.loads(line)["loss_hex"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe, sets", [("gpt2", ["dropout=0.1"]), ("llama", ["dropout=0.1"])])
def test_two_runs_give_the_same_bits_and_dropout_changes_them(tmp_path, recipe, sets):
    for name in ("a", "b", "off"):
        train(recipe, steps=4, sets=TINY + (sets if name != "off" else []), out=str(tmp_path / name), progress=False)
    assert losses_hex(tmp_path / "a") == losses_hex(tmp_path / "b")
    assert losses_hex(tmp_path / "a") != losses_hex(tmp_path / "off")


class Stop(Exception):
    pass


def test_a_resumed_run_gives_the_losses_of_an_uninterrupted_one(tmp_path):
    from toyharness.hookspecs import hookimpl

    sets = [s for s in TINY if not s.startswith("checkpoint_every")] + ["dropout=0.1", "checkpoint_every=3"]
    train("gpt2", steps=8, sets=sets, out=str(tmp_path / "full"), progress=False)

    class Killer:
        @hookimpl
        def step_end(self, run, step, loss, lr, ms, tokens_per_s):
            if step == 4:
                raise Stop

    with pytest.raises(Stop):
        train("gpt2", steps=8, sets=sets, out=str(tmp_path / "cut"), observers=(Killer(),), progress=False)
    train("gpt2", steps=8, resume=str(tmp_path / "cut"), progress=False)
    assert losses_hex(tmp_path / "cut") == losses_hex(tmp_path / "full")


def test_recompute_and_the_portable_mode_keep_the_masks():
    """recompute_blocks copies each block's mask node (the same name: the same bits)."""
    a = train("gpt2", steps=3, sets=TINY + ["dropout=0.1"], write_files=False, progress=False)
    b = train("gpt2", steps=3, sets=TINY + ["dropout=0.1", "recompute_blocks=true"], write_files=False,
              progress=False)
    assert a["final_loss"] == b["final_loss"]


def test_lora_dropout_trains_and_repeats(tmp_path):
    from toyharness.discovery import get_recipe

    _, lora = get_recipe("lora")
    sets = [*lora.golden_sets, "t_seq=24", "t_batch=2", "eval_every=1000", "checkpoint_every=1000", "data=synthetic"]
    for name, extra in (("a", ["lora_dropout=0.1"]), ("b", ["lora_dropout=0.1"]), ("off", [])):
        train("lora", steps=3, sets=sets + extra, out=str(tmp_path / name), progress=False)
    assert losses_hex(tmp_path / "a") == losses_hex(tmp_path / "b")
    # step 0 sees the base alone (B starts at zero): the same loss; later steps differ
    assert losses_hex(tmp_path / "a")[0] == losses_hex(tmp_path / "off")[0]
    assert losses_hex(tmp_path / "a")[1:] != losses_hex(tmp_path / "off")[1:]


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan")])
def test_a_bad_rate_is_refused_by_name(bad):
    prog = get_engine("cpu").program()
    x = prog.input("x", (2, 3))
    with pytest.raises(InputError, match=r"dropout 'm': p must be in \[0, 1\)"):
        x.dropout(bad, "m")
    for recipe, key in (("gpt2", "dropout"), ("llama", "dropout"), ("lora", "lora_dropout")):
        with pytest.raises(InputError, match=rf"option '{key}': must be in \[0, 1\), got"):
            train(recipe, steps=1, sets=[f"{key}={bad}"], write_files=False, progress=False)


@pytest.mark.parametrize("mode_engine", ["fast", "metal_lowering"], indirect=True)
def test_a_mask_needs_a_name_and_one_name_draws_one_mask(mode_engine):
    prog = mode_engine.program()
    x = prog.input("x", (64, 8))
    with pytest.raises(InputError, match="a mask needs a name"):
        x.dropout(0.1, "")
    assert x.dropout(0.0, "zero") is x           # p == 0: no node
    fg = prog.forward({"a": x.dropout(0.5, "m"), "b": x.dropout(0.5, "m"), "c": x.dropout(0.5, "n")})
    prog.feed({"x": np.ones((64, 8), np.float32)})
    prog.set_dropout(1, True)
    prog._compute(fg.graph)
    a, b, c = (prog.read(fg.outputs[k]) for k in "abc")
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_sampling_a_run_trained_with_dropout(tmp_path):
    """Sampling builds the forward at several lengths (one name, other shapes): no dropout there."""
    from helpers import cli

    out = tmp_path / "run"
    train("gpt2", steps=2, sets=TINY + ["dropout=0.1"], out=str(out), progress=False)
    res = [cli("sample", str(out), "--prompt", "The ", "--tokens", "6", "--temperature", "0") for _ in range(2)]
    assert res[0].returncode == 0 and res[0].stdout == res[1].stdout, res[0].stderr


def test_the_cuda_rewrite_marks_the_mask_for_its_kernel(programs_built_as):
    """Built on cpu as cuda builds it (never computed here): the mask node gets cuda's mark with
    its parameters, and, without the rewrite's flag 8 (fp32: its kernels draw no mask), attention
    with dropout on its weights stays composed (not fused)."""
    from toyharness.engine import blocks

    programs_built_as(cpu_folds=False, kv_in_place=False)
    prog = get_engine("cpu").program()
    x = prog.param("x", RNG.normal(size=(2, 16, 32)).astype(np.float32))
    w = [prog.param(f"w{i}", RNG.normal(size=(32, 32)).astype(np.float32) * 0.1) for i in range(4)]
    y = blocks.attention(x, *w, n_head=2, dropout=0.1, dropout_name="probs").dropout(0.1, "out")
    trainer = prog.trainer(prog.scalar_loss(y.sum()), "bias_corrected")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    names = [lib.th_cuda_kernel_name(lib.ggml_graph_node(trainer.gb_grad, i))
             for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))]
    names = [ffi.string(n).decode() for n in names if n != ffi.NULL]
    assert names.count("dropout_mask") == 2 and "attention" not in names, names


def causal_products(sets: list[str]) -> int:
    """How many of a gpt2 training graph's products the cpu computes as causal blocks."""
    model, data, o = gpt2_model(sets)
    model.step(batch_for(data, "train", 0, o), model.recipe.hp(o, 0))
    graph = model.trainer.gb_opt
    names = (lib.th_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph)))
    return sum(1 for n in names if n != ffi.NULL and ffi.string(n).decode() == "sgemm causal")


def test_attention_dropout_keeps_the_cpus_causal_blocks():
    """P times its mask is zero above the diagonal as P is: the products that read it still skip
    those blocks (native/cpu_kernels.c, th_mark_causal)."""
    off = causal_products(["t_seq=128"])
    assert off >= 4 and causal_products(["t_seq=128", "dropout=0.1"]) == off


@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("name", ["gpt2@dropout", "lora@dropout"])
def test_dropout_goldens_repeat_bit_for_bit_on_a_device_and_differ_from_no_dropout(backend, name):
    """On cuda (the mask kernel of cuda/th-custom.cu, attention unfused at fp32) and vulkan (the host's
    masks): two runs, the same bits; and dropout does change the run."""
    from toyharness import goldens

    if backend == "cuda" and not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    first, second = goldens.compute(name, backend), goldens.compute(name, backend)
    assert goldens.compare(first, second) is None
    assert goldens.compare(goldens.compute(name.split("@")[0], backend), first) is not None


@pytest.mark.parametrize("portable", [False, True])
def test_the_thread_count_changes_no_bit_of_a_dropout_run(portable):
    from toyharness import goldens

    ref = goldens.compute("gpt2@dropout", threads=2, portable=portable)
    for threads in (1, 3):
        assert goldens.compare(ref, goldens.compute("gpt2@dropout", threads=threads, portable=portable)) is None
