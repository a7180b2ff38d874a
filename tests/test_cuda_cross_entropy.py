"""The losses' kernels on cuda (native/cuda/th-loss.cu): the cross entropy both ways, and the
backward of a softmax whose rows' target probabilities a loss picks (SOFT_MAX_BACK), each with
ggml's bits.

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import cuda_kernel_names, needs, ops_of

from toyharness._ffi import cuda_kernels_built, lib
from toyharness.engine import get_engine

# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


def cross_entropy_program(backend: str, rows: int, vocab: int, seed: int = 5, cuda_kernels: bool = True):
    """Logits a parameter (rows = 2 x rows / 2 tokens, vocab), the mean cross-entropy against random
    targets: the training graph's CROSS_ENTROPY_LOSS_BACK writes the logits' gradient. Without
    `cuda_kernels` a cuda program leaves every node to ggml-cuda (the reference)."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    prog.cuda_kernels = prog.cuda_kernels and cuda_kernels
    logits = prog.param("logits", (rng.normal(size=(2, rows // 2, vocab)) * 3).astype(np.float32))
    trainer = prog.trainer(prog.cross_entropy(logits, "targets"), "bias_corrected")
    return prog, trainer, {"targets": rng.integers(0, vocab, size=(2, rows // 2)).astype(np.int32)}


def test_the_cuda_rewrite_takes_the_cross_entropy_both_ways():
    """Built on cpu: CROSS_ENTROPY_LOSS and its backward become ours."""
    prog, trainer, _ = cross_entropy_program("cpu", 6, 40)
    assert {"CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK"} <= set(ops_of(trainer.gb_grad))
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) >= 2
    assert {"cross_entropy", "cross_entropy_back"} <= set(cuda_kernel_names(trainer.gb_grad))
    assert not {"CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK"} & set(ops_of(trainer.gb_grad))


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, vocab", [(4096, 32000), (34, 37), (6, 50304)])
def test_the_cross_entropy_on_cuda_is_ours_both_ways_and_gives_ggmls_bits(backend, rows, vocab):
    """th-loss.cu against ggml-cuda's nodes (a 32000-token vocabulary over the LoRA bench's 4096 rows;
    rows fewer than a CTA's eight and not a multiple; GPT-2's vocabulary): every bit of the loss
    (the rows' values summed by cub as ggml sums them) and of the logits' gradient; the loss is the
    mean cross-entropy and the gradient softmax - one-hot over the rows (float64)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    grads, losses = {}, {}
    for how in ("ours", "ggml"):
        prog, trainer, feeds = cross_entropy_program(backend, rows, vocab, cuda_kernels=how == "ours")
        trainer.grads_only(feeds)
        names = cuda_kernel_names(trainer.gb_grad)
        assert ("cross_entropy_back" in names, "cross_entropy" in names) == (how == "ours",) * 2
        grads[how] = prog.read(trainer.grad_acc["logits"]).reshape(rows, vocab)
        losses[how] = np.float32(trainer.train_loss_value())
    assert np.array_equal(grads["ours"].view(np.uint32), grads["ggml"].view(np.uint32))
    assert losses["ours"].view(np.uint32) == losses["ggml"].view(np.uint32), losses
    rng = np.random.default_rng(5)
    z = (rng.normal(size=(2, rows // 2, vocab)) * 3).astype(np.float32).astype(np.float64).reshape(rows, vocab)
    ids = rng.integers(0, vocab, size=(2, rows // 2)).reshape(-1)
    log_p = z - z.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    want = -log_p[np.arange(rows), ids].mean()
    print(f"cross-entropy {rows} x {vocab}: loss {float(losses['ours']):.7g}, float64 {want:.7g}")
    assert abs(float(losses["ours"]) - want) <= 1e-5 * want
    p = np.exp(log_p)
    p[np.arange(rows), ids] -= 1.0
    assert np.max(np.abs(grads["ours"] - p / rows)) <= 1e-5 / rows


def picked_softmax_program(backend: str, rows: int, vocab: int, scale: float = 1.0, seed: int = 9,
                           cuda_kernels: bool = True):
    """Each row's target probability picked from the flattened softmax of a parameter (as
    token_logps picks it), the loss a weighted sum of their logs: SOFT_MAX_BACK's dy arrives as a
    view. (program, trainer, z, targets, weights)"""
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, vocab, rows)
    flat = (np.arange(rows) * vocab + targets).astype(np.int32)
    weights = rng.normal(size=(rows, 1)).astype(np.float32)
    prog = get_engine(backend).program()
    prog.cuda_kernels = prog.cuda_kernels and cuda_kernels
    z = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    probabilities = prog.param("z", z).softmax(scale).reshape(rows * vocab, 1)
    picked = probabilities.get_rows(prog.constant("targets.flat", flat)).log()
    trainer = prog.trainer(prog.scalar_loss((picked * prog.constant("w", weights)).sum()), "bias_corrected")
    return prog, trainer, z, targets, weights


def test_the_cuda_rewrite_takes_a_picked_softmaxs_backward():
    """Built on cpu: the pick's SOFT_MAX_BACK becomes ours."""
    _, trainer, _, _, _ = picked_softmax_program("cpu", 6, 40)
    assert "SOFT_MAX_BACK" in ops_of(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) >= 1
    assert "soft_max_back" in cuda_kernel_names(trainer.gb_grad) and "SOFT_MAX_BACK" not in ops_of(trainer.gb_grad)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, vocab, scale", [(256, 128256, 1.0), (5, 17, 1.0), (300, 2049, 0.5), (33, 1000, 1.0)])
def test_a_picked_softmaxs_backward_on_cuda_is_ours_and_gives_ggmls_bits(backend, rows, vocab, scale):
    """th-loss.cu's SOFT_MAX_BACK against ggml-cuda's (a piece of 256 rows of Llama 3's vocabulary,
    as logits_chunk makes them; rows and columns not a multiple of a warp or of the loads a lane
    keeps ahead; a scale): every bit of the gradient, and that gradient w (onehot - softmax(s z)) s
    a row (float64)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    grads = {}
    for how in ("ours", "ggml"):
        prog, trainer, z, targets, weights = picked_softmax_program(backend, rows, vocab, scale,
                                                                    cuda_kernels=how == "ours")
        trainer.grads_only({})
        assert ("soft_max_back" in cuda_kernel_names(trainer.gb_grad)) == (how == "ours")
        grads[how] = prog.read(trainer.grad_acc["z"]).reshape(rows, vocab)
    assert np.array_equal(grads["ours"].view(np.uint32), grads["ggml"].view(np.uint32))
    sz = z.astype(np.float64) * scale
    p = np.exp(sz - sz.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = -p
    want[np.arange(rows), targets] += 1.0
    want *= weights.astype(np.float64) * scale
    assert np.max(np.abs(grads["ours"] - want)) <= 1e-5 * np.max(np.abs(want))
