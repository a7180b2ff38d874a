"""The chunked cross-entropy (native/chunked_loss.c, Program.chunked_cross_entropy): the loss of a
frozen output projection over a large vocabulary without its (rows x vocab) buffers. Its loss and
dL/dh against float64 numpy, against the standard loss, independent of the thread count, its
compute buffer against the standard loss's at Gemma 3's vocabulary, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from toyharness.engine import get_engine
from toyharness.errors import BackendError, ShapeError

RNG = np.random.default_rng(99)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reference(h, w, ids, mask):
    """float64 loss and dL/dh of mean CE over the counted rows of softmax(h @ w.T)"""
    z = h @ w.T
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    rows = np.arange(len(ids))
    count = mask.sum()
    loss = -(logp[rows, ids] * mask).sum() / count
    dz = np.exp(logp)
    dz[rows, ids] -= 1.0
    return loss, (dz * (mask / count)[:, None]) @ w


def run(h, w, ids, mask=None, chunked=True, w_dtype="f32", threads=2):
    eng = get_engine("cpu")
    eng.set_threads(threads)
    prog = eng.program()
    ht = prog.param("h", h.reshape(2, -1, h.shape[-1]))
    wt = prog.frozen_array("w", w, w_dtype)
    logits = ht.matmul_t(wt)
    if chunked:
        ce = prog.chunked_cross_entropy(logits, "targets", "mask" if mask is not None else None)
    elif mask is not None:
        ce = prog.masked_cross_entropy(logits, "targets", "mask")
    else:
        ce = prog.cross_entropy(logits, "targets")
    tr = prog.trainer(ce, "bias_corrected")
    feeds = {"targets": ids.reshape(2, -1)}
    if mask is not None:
        feeds["mask"] = mask.reshape(2, -1).astype(np.float32)
    loss = tr.grads_only(feeds)
    return loss, prog.read(tr.grad_acc["h"]).reshape(h.shape), prog.compute_buffer_bytes()


@pytest.mark.parametrize("w_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("vocab", [37, 300, 5000])
def test_loss_and_hidden_gradient_against_float64(w_dtype, masked, vocab):
    """vocab 37: one partial tile; 300: two chunks, the second short; 5000: 10 chunks of two
    256-class tiles"""
    R, d = 14, 24
    h = RNG.normal(size=(R, d)).astype(np.float32)
    w = (RNG.normal(size=(vocab, d)) * 0.5).astype(np.float32)
    ids = RNG.integers(0, vocab, R)
    mask = (RNG.random(R) < 0.6).astype(np.float64) if masked else np.ones(R)
    mask[0] = 1.0
    loss, grad, _ = run(h, w, ids, mask if masked else None, w_dtype=w_dtype)
    w_seen = {"f32": w, "f16": w.astype(np.float16), "bf16": None}[w_dtype]
    if w_seen is None:   # bf16: the top 16 bits, rounded to nearest even
        bits = w.view(np.uint32).astype(np.uint64)
        w_seen = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    ref_loss, ref_grad = reference(h.astype(np.float64), np.asarray(w_seen, np.float64), ids, mask)
    assert abs(loss - ref_loss) / ref_loss < 2e-6
    assert rel_err(grad, ref_grad) < 2e-5
    assert not grad[mask == 0].any()      # an uncounted row gets no gradient


@pytest.mark.parametrize("w_dtype", ["f32", "f16"])
def test_a_later_tile_that_raises_the_max_rescales_what_came_before(w_dtype):
    """Logits that rise along the vocabulary: every tile's max is above the last, so each chunk's
    running sums are scaled down again and again (the online softmax's rescaling), against float64"""
    R, d, vocab = 10, 16, 3000
    h = np.abs(RNG.normal(size=(R, d))).astype(np.float32)
    w = (np.abs(RNG.normal(size=d)) * np.linspace(0.05, 1.0, vocab)[:, None]).astype(np.float32)
    ids = RNG.integers(0, vocab, R)
    ids[0], ids[1] = 0, vocab - 1          # a target in the first tile and one in the last
    loss, grad, _ = run(h, w, ids, w_dtype=w_dtype)
    w_seen = w if w_dtype == "f32" else w.astype(np.float16)
    z = h.astype(np.float64) @ np.asarray(w_seen, np.float64).T
    assert (np.diff(z, axis=1) > 0).all()      # the premise: each row's logits rise class by class
    ref_loss, ref_grad = reference(h.astype(np.float64), np.asarray(w_seen, np.float64), ids, np.ones(R))
    assert abs(loss - ref_loss) / ref_loss < 2e-6
    assert rel_err(grad, ref_grad) < 2e-5


@pytest.mark.parametrize("masked", [False, True])
def test_agrees_with_the_standard_loss(masked):
    R, d, vocab = 16, 32, 700
    h = RNG.normal(size=(R, d)).astype(np.float32)
    w = (RNG.normal(size=(vocab, d)) * 0.3).astype(np.float32)
    ids = RNG.integers(0, vocab, R)
    mask = (np.arange(R) % 3 != 0).astype(np.float64) if masked else None
    loss_c, grad_c, _ = run(h, w, ids, mask, chunked=True)
    loss_s, grad_s, _ = run(h, w, ids, mask, chunked=False)
    assert abs(loss_c - loss_s) / loss_s < 1e-6
    assert rel_err(grad_c, grad_s) < 1e-5


def test_bits_do_not_depend_on_the_thread_count():
    R, d, vocab = 12, 16, 3000
    h = RNG.normal(size=(R, d)).astype(np.float32)
    w = RNG.normal(size=(vocab, d)).astype(np.float32)
    ids = RNG.integers(0, vocab, R)
    one, two = run(h, w, ids, threads=1), run(h, w, ids, threads=2)
    assert one[0] == two[0]
    assert np.array_equal(one[1], two[1])


def step_flops(chunked: bool, R: int = 12, d: int = 16, vocab: int = 3000) -> tuple[float, list[str]]:
    """The matrix-product FLOPs bench counts in the loss's training graph (th_node_matmul_flops), and
    the kernels the graph's nodes ran."""
    from toyharness._ffi import ffi, lib

    prog = get_engine("cpu").program()
    logits = prog.param("h", RNG.normal(size=(2, R // 2, d)).astype(np.float32)).matmul_t(
        prog.frozen_array("w", RNG.normal(size=(vocab, d)).astype(np.float32), "f16"))
    ce = prog.chunked_cross_entropy(logits, "targets") if chunked else prog.cross_entropy(logits, "targets")
    tr = prog.trainer(ce, "bias_corrected")
    tr.grads_only({"targets": RNG.integers(0, vocab, R).reshape(2, -1)})
    nodes = [lib.ggml_graph_node(tr.gb_grad, i) for i in range(lib.ggml_graph_n_nodes(tr.gb_grad))]
    names = [lib.th_kernel_name(n) for n in nodes]
    return sum(lib.th_node_matmul_flops(n) for n in nodes), [ffi.string(k).decode() for k in names if k != ffi.NULL]


def test_its_two_products_count_in_the_steps_flops_as_the_standard_losss():
    """bench's GFLOP/s counts the chunks node's products over W (the logits, then dL/dh's sum), as it
    counts the standard loss's product and its input gradient: 2 x 2 x R x vocab x d."""
    chunked, kernels = step_flops(True)
    assert "chunked_loss" in kernels
    assert chunked == step_flops(False)[0] == 4.0 * 12 * 3000 * 16


def test_compute_buffer_holds_no_rows_by_vocab_buffer_at_gemma3_vocab():
    """Gemma 3's 262,144 classes over 32 rows: the standard loss's compute buffer holds several
    (rows x vocab) f32 buffers (32 MiB each); the chunked one's is below one of them."""
    R, d, vocab = 32, 16, 262144
    h = RNG.normal(size=(R, d)).astype(np.float32)
    w = (RNG.normal(size=(vocab, d)) * 0.2).astype(np.float32)
    ids = RNG.integers(0, vocab, R)
    one_buffer = R * vocab * 4
    loss_c, grad_c, bytes_c = run(h, w, ids, chunked=True)
    loss_s, grad_s, bytes_s = run(h, w, ids, chunked=False)
    assert bytes_s >= 2 * one_buffer, bytes_s
    assert bytes_c < one_buffer / 8, bytes_c
    assert abs(loss_c - loss_s) / loss_s < 1e-6
    assert rel_err(grad_c, grad_s) < 1e-5


def test_refuses_a_trainable_output_weight_by_name():
    prog = get_engine("cpu").program()
    h = prog.param("h", RNG.normal(size=(2, 3, 8)).astype(np.float32))
    w = prog.param("out.weight", RNG.normal(size=(50, 8)).astype(np.float32))
    with pytest.raises(ShapeError, match=r"output weight out\.weight trains"):
        prog.chunked_cross_entropy(h.matmul_t(w), "targets")


def test_refuses_logits_that_are_not_a_product():
    prog = get_engine("cpu").program()
    logits = prog.param("logits", RNG.normal(size=(2, 3, 50)).astype(np.float32))
    with pytest.raises(ShapeError, match="not a product of the hidden rows and an output weight"):
        prog.chunked_cross_entropy(logits, "targets")


def portable_program():
    eng = get_engine("cpu")
    eng.set_portable(True)
    try:
        return eng.program()
    finally:
        eng.set_portable(False)


def test_is_refused_in_the_portable_mode():
    prog = portable_program()
    h = prog.param("h", RNG.normal(size=(2, 3, 8)).astype(np.float32))
    w = prog.frozen_array("w", RNG.normal(size=(50, 8)))
    with pytest.raises(BackendError, match="cpu backend's fast path only"):
        prog.chunked_cross_entropy(h.matmul_t(w), "targets")


def test_lora_trains_the_same_with_the_chunked_loss(tmp_path):
    """LoRA over a seeded gemma3 base (tied output): chunked_loss=on against off, 6 steps"""
    import json

    from toyharness.architectures import example_shape, write_example
    from toyharness.runner import train

    base = write_example(tmp_path / "gemma3.gguf", example_shape(arch="gemma3", head_dim=32, n_layer=6, n_head=2,
                                                                 n_kv_head=1, window=4))
    losses = {}
    for mode in ("on", "off"):
        out = tmp_path / mode
        sets = ["t_seq=16", "t_batch=2", "warmup=2", "lr=1e-2", "eval_every=100", "checkpoint_every=100",
                f"base={base}", "targets=q,v,down", f"chunked_loss={mode}"]
        train("lora", steps=6, sets=sets, out=str(out), progress=False)
        losses[mode] = np.array([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses["on"][-1] < losses["on"][0]
    assert np.max(np.abs(losses["on"] - losses["off"]) / losses["off"]) < 1e-5, losses


def test_auto_takes_the_chunked_loss_from_4096_classes_on_the_fast_cpu_path():
    from types import SimpleNamespace

    from toyharness.errors import InputError
    from toyharness.lm import CHUNKED_LOSS_VOCAB, use_chunked_loss

    fast = get_engine("cpu").program()
    auto, on = SimpleNamespace(chunked_loss="auto"), SimpleNamespace(chunked_loss="on")
    assert use_chunked_loss(auto, 262144, fast) and not use_chunked_loss(auto, CHUNKED_LOSS_VOCAB - 1, fast)
    for real in (151936, 128256, 49152, 32064):       # Qwen3's, Llama 3's, SmolLM2's, Phi-3's vocabularies
        assert use_chunked_loss(auto, real, fast)
    assert not use_chunked_loss(auto, 256, fast)      # the toy byte vocabulary keeps the standard loss
    assert not use_chunked_loss(SimpleNamespace(), 262144, fast)      # a recipe without the option
    portable = portable_program()
    assert not use_chunked_loss(auto, 262144, portable)
    with pytest.raises(InputError, match="chunked_loss=on: the chunked loss runs on the cpu backend's fast path"):
        use_chunked_loss(on, 100, portable)
