"""Every op of engine/ops_table.py in every mode: forward against a float64 numpy reference,
the gradient against central finite differences of that reference, and a small graph of it that
trains (its loss falls) in the portable mode, where goldens are recorded. A mode this machine
cannot run (vulkan or cuda not built, no device) skips, saying so. Also: shape errors end with
the caller's line, a node a mode cannot run is refused when the Trainer is built, naming the op
and the line, and docs/ops.md is the generator's output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import fd_grad

from toyharness._ffi import available_native_backends, lib
from toyharness.engine import Program, get_engine
from toyharness.engine.ops_table import OPS, inputs_for, markdown, training_program
from toyharness.errors import BackendError, ShapeError

MODES = ("cpu-fast", "cpu-portable", "metal-lowering", "vulkan", "cuda")
HERE = os.path.relpath(__file__)


@pytest.fixture
def engine_for(monkeypatch):
    made = []

    def make(mode: str):
        backend = mode if mode in ("vulkan", "cuda") else "cpu"
        if backend not in available_native_backends():
            pytest.skip(f"the {backend} backend is not built into this install or has no device")
        monkeypatch.setattr(Program, "lowering_target", "metal" if mode == "metal-lowering" else "")
        engine = get_engine(backend)
        if backend == "cpu":
            engine.set_portable(mode == "cpu-portable")
            made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.set_portable(False)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))




@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", OPS, ids=[c.name for c in OPS])
def test_op_forward_and_gradient(case, mode, engine_for):
    engine = engine_for(mode)
    rng = np.random.default_rng(7)
    arrays = inputs_for(case, rng)
    prog = engine.program()
    params = [prog.param(f"in{i}", a.astype(np.float32)) for i, a in enumerate(arrays)]
    out = case.build(*params)
    expected = case.ref(*arrays)
    assert out.shape == expected.shape
    weights = rng.normal(size=expected.shape)
    out = out if out.is_contiguous() else out.cont()
    if case.training:               # its training forward, kept to be read after the step
        lib.ggml_set_output(out.ptr)
    loss = prog.scalar_loss((out * prog.constant("weights", weights)).sum())
    trainer = prog.trainer(loss, "bias_corrected")
    if not case.training:
        got = prog.forward({"out": out}).run({})["out"]
        assert rel_err(got, expected) < 1e-5, f"forward rel err {rel_err(got, expected):.2e}"
    trainer.grads_only({})
    if case.training:
        got = prog.read(out)
        assert rel_err(got, expected) < 1e-5, f"training forward rel err {rel_err(got, expected):.2e}"
    for k in range(len(arrays)):
        g = prog.read(trainer.grad_acc[f"in{k}"])
        fd = fd_grad(lambda A: float((case.ref(*A) * weights).sum()), arrays, k)
        err = np.linalg.norm(g - fd)
        assert err <= 1e-3 * np.linalg.norm(fd) + 1e-5, f"grad of input {k}: rel err {rel_err(g, fd):.2e}"


@pytest.mark.parametrize("case", OPS, ids=[c.name for c in OPS])
def test_op_trains_in_the_portable_mode(case, engine_for):
    from toyharness.adamw import bias_corrected

    engine = engine_for("cpu-portable")
    rng = np.random.default_rng(3)
    arrays = inputs_for(case, rng)
    target = np.clip(case.ref(*inputs_for(case, rng)), -0.4, 0.6).astype(np.float32)
    _, _, trainer = training_program(case, engine, arrays, target)
    row = bias_corrected(lr=0.05)
    losses = [trainer.step({}, row.hp_for_step(step)) for step in range(30)]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.9 * losses[0], losses     # relu and clamp: inputs outside their range stay


def test_a_shape_error_ends_with_the_callers_line(engine_for):
    prog = engine_for("cpu-fast").program()
    x = prog.param("x", np.ones((2, 3), np.float32))
    y = prog.param("y", np.ones((2, 4), np.float32))
    line = sys._getframe().f_lineno + 2
    with pytest.raises(ShapeError) as err:
        x.concat([y], axis=0)
    assert str(err.value).endswith(f"(at {HERE}:{line})"), str(err.value)
    assert str(err.value).count("(at ") == 1


def test_an_index_error_names_the_axis_and_the_line(engine_for):
    prog = engine_for("cpu-fast").program()
    x = prog.param("x", np.ones((2, 3), np.float32))
    with pytest.raises(ShapeError, match=r"index: 3 outside axis 1 of size 3 \(at .*test_ops_modes.py:\d+\)$"):
        x[:, 3]
    with pytest.raises(ShapeError, match="only step 1"):
        x[::2]


def test_a_node_the_mode_cannot_run_is_refused_when_the_trainer_is_built(engine_for):
    prog = engine_for("cpu-portable").program()
    x = prog.param("x", np.ones((3, 3), np.float32))
    line = sys._getframe().f_lineno + 1
    masked = x._new(lib.ggml_diag_mask_inf(prog._ctx_compute, x.ptr, 0))    # no portable kernel takes it
    loss = prog.scalar_loss(masked.softmax().sum())
    with pytest.raises(BackendError) as err:
        prog.trainer(loss, "bias_corrected")
    text = str(err.value)
    assert "portable mode cannot run op DIAG_MASK_INF" in text and f"{HERE}:{line}" in text, text
    assert "\n" not in text


def test_docs_ops_md_is_the_generators_output():
    committed = (Path(__file__).parent.parent / "docs" / "ops.md").read_text()
    assert committed == markdown(), "docs/ops.md is stale: python -m toyharness.engine.ops_table > docs/ops.md"


@pytest.mark.parametrize("mode", ["cpu-fast", "cpu-portable"])
def test_a_product_added_to_itself_has_the_right_gradient(mode, engine_for):
    """y + y of a product y (the cpu fast mode folds a product into the ADD that reads it: not
    when both operands are the product), found by the graph fuzz."""
    prog = engine_for(mode).program()
    x = prog.param("x", np.ones((3, 2), np.float32))
    y = x.matmul_t(prog.constant("w", np.arange(6, dtype=np.float32).reshape(3, 2)))
    trainer = prog.trainer(prog.scalar_loss((y + y).sum()), "bias_corrected")
    trainer.grads_only({})
    # d/dx sum(2 x w^T) = 2 * (column sums of w) in every row
    np.testing.assert_array_equal(prog.read(trainer.grad_acc["x"]), np.tile([12.0, 18.0], (3, 1)))
