"""The masked cross-entropy (toyharness.engine.Program.masked_cross_entropy): the mean over
counted positions only, its gradient, and its bits across thread counts."""

from __future__ import annotations

import numpy as np
import pytest

from toyharness.engine import blocks, get_engine

B, T, V, D = 3, 5, 7, 4


def program(threads: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    prog = get_engine("cpu", threads).program()
    w = prog.param("w", rng.normal(0, 1.0, (V, D)))
    x = prog.input("x", (B, T, D))
    return prog, w, prog.masked_cross_entropy(blocks.linear(x, w), "targets", "mask")


def feeds(seed: int = 1):
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.5).astype(np.float32)
    mask[0, 0] = 1.0
    return {"x": rng.normal(size=(B, T, D)), "targets": rng.integers(0, V, (B, T)), "mask": mask}


def numpy_loss(w: np.ndarray, f: dict) -> float:
    logits = f["x"].astype(np.float64) @ w.astype(np.float64).T
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(logp, f["targets"][..., None], -1)[..., 0]
    return float(-(picked * f["mask"]).sum() / f["mask"].sum())


def test_masked_loss_is_the_mean_over_counted_positions():
    prog, w, ce = program()
    tr = prog.trainer(ce, "constant_betas")
    f = feeds()
    got = tr.eval_loss(f)
    assert got == pytest.approx(numpy_loss(prog.read(w), f), rel=1e-5)
    # what an uncounted position holds does not matter
    g = dict(f, targets=np.where(f["mask"] > 0, f["targets"], (f["targets"] + 3) % V))
    assert tr.eval_loss(g) == got


def test_masked_loss_gradient_matches_finite_differences():
    prog, w, ce = program()
    tr = prog.trainer(ce, "constant_betas")
    f = feeds()
    tr.grads_only(f)
    grad = prog.read(tr.grad_acc["w"]).astype(np.float64)
    w0 = prog.read(w).astype(np.float64)
    eps = 1e-4
    num = np.zeros_like(w0)
    for idx in np.ndindex(*w0.shape):
        hi, lo = w0.copy(), w0.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = (numpy_loss(hi, f) - numpy_loss(lo, f)) / (2 * eps)
    assert np.allclose(grad, num, rtol=1e-3, atol=1e-5), np.abs(grad - num).max()


def test_masked_loss_bits_do_not_depend_on_thread_count():
    f = feeds(3)
    bits = set()
    for threads in (1, 2, 4):
        prog, w, ce = program(threads)
        tr = prog.trainer(ce, "constant_betas")
        losses = [tr.step(f, [1e-2, 0.9, 0.95, 1e-8, 0.0, 0.9, 0.95]) for _ in range(3)]
        bits.add(np.array(losses, np.float32).tobytes() + prog.read(w).tobytes())
    assert len(bits) == 1
