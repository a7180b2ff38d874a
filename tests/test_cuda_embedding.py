"""Embedding gradients on cuda: our kernel sums each row's gradients in order, bit for bit; a
loss's pick of each row's target (distinct flat indices) gets a scatter into zeros instead.

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import as_cuda_builds_it, cuda_kernel_names, needs, ops_of

from toyharness import goldens
from toyharness._ffi import cuda_kernels_built, lib
from toyharness.engine import get_engine

# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


def embedding_program(backend: str, vocab: int, d: int, ids: np.ndarray, seed: int = 12):
    """Rows of an embedding table picked by `ids`, the loss a weighted sum: (program, trainer, dy)."""
    rng = np.random.default_rng(seed)
    dy = rng.normal(size=(len(ids), d)).astype(np.float32)
    prog = get_engine(backend).program()
    rows = prog.param("emb", rng.normal(size=(vocab, d)).astype(np.float32)).get_rows(prog.constant("ids", ids))
    trainer = prog.trainer(prog.scalar_loss((rows * prog.constant("dy", dy)).sum()), "bias_corrected")
    return prog, trainer, dy


def test_the_cuda_rewrite_takes_every_embedding_gradient():
    prog, trainer, _ = embedding_program("cpu", 10, 8, np.array([1, 3, 3, 9], np.int32))
    assert "GET_ROWS_BACK" in ops_of(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 1
    assert cuda_kernel_names(trainer.gb_grad) == ["get_rows_back"] and "GET_ROWS_BACK" not in ops_of(trainer.gb_grad)


def picks_program(backend: str, rows: int, vocab: int, ids_name: str, seed: int = 14):
    """Each row's target logit picked by GET_ROWS at its flat index r V + target, as a loss's
    token_logps picks it, the loss a weighted sum: (program, trainer, flat indices, weights)."""
    rng = np.random.default_rng(seed)
    flat = (np.arange(rows) * vocab + rng.integers(0, vocab, rows)).astype(np.int32)
    dy = rng.normal(size=(rows, 1)).astype(np.float32)
    dy[0] = -0.0                                       # a -0 gradient: ggml's kernel writes 0 + (-0) = +0
    prog = get_engine(backend).program()
    z = prog.param("z", rng.normal(size=(rows, vocab)).astype(np.float32))
    picked = z.reshape(rows * vocab, 1).get_rows(prog.constant(ids_name, flat))
    trainer = prog.trainer(prog.scalar_loss((picked * prog.constant("dy", dy)).sum()), "bias_corrected")
    return prog, trainer, flat, dy


def test_the_cuda_rewrite_scatters_a_losss_picks_and_only_distinct_flat_indices():
    _, trainer, _, _ = picks_program("cpu", 6, 50, "targets.flat")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 1
    assert cuda_kernel_names(trainer.gb_grad) == ["scatter_rows"] and "GET_ROWS_BACK" not in ops_of(trainer.gb_grad)
    _, trainer, _, _ = picks_program("cpu", 6, 50, "targets")          # ids not known distinct: summed rows
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 1
    assert cuda_kernel_names(trainer.gb_grad) == ["get_rows_back"]


@pytest.mark.parametrize("recipe", ["dpo", "orpo"])
def test_the_preference_recipes_picks_are_scattered_on_cuda(recipe, monkeypatch):
    """Their token log-probabilities pick each row's target (engine/losses.py, token_logps)."""
    _, trainer, _ = as_cuda_builds_it(recipe, goldens.golden_sets_for(recipe), "bf16", monkeypatch)
    assert "scatter_rows" in cuda_kernel_names(trainer.gb_opt) and "GET_ROWS_BACK" not in ops_of(trainer.gb_opt)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, vocab", [(7, 3), (4096, 2049), (300, 128256)])
def test_scattered_picks_on_cuda_equal_ggmls_gradient_bit_for_bit(backend, rows, vocab):
    """The gradient of the picked logits: 0 + dy[r] at row r's flat index, +0 everywhere else
    (ggml's GET_ROWS_BACK for ids found once), equal bit for bit; at 300 rows of Llama 3's
    vocabulary the output has 38M rows, which ggml's kernel would compare with every id."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    prog, trainer, flat, dy = picks_program(backend, rows, vocab, "targets.flat")
    trainer.grads_only({})
    assert cuda_kernel_names(trainer.gb_grad) == ["scatter_rows"]
    want = np.zeros(rows * vocab, np.float32)
    want[flat] = np.float32(0.0) + dy[:, 0]
    got = prog.read(trainer.grad_acc["z"]).reshape(-1)
    assert np.array_equal(got, want) and not np.signbit(got).any(where=got == 0)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("vocab, d, n_ids, hot", [(65, 384, 5000, 0.0), (1000, 100, 300, 0.0), (3, 40, 7, 0.0),
                                                  (256, 70, 3000, 0.3)])
def test_embedding_gradients_on_cuda_sum_each_rows_in_order_bit_for_bit(backend, vocab, d, n_ids, hot):
    """Each table row's gradient is the float32 sum of its ids' rows in the order they come, as
    ggml's kernel sums them: equal, bit for bit, to that sum taken here in numpy. `hot`: that
    share of the ids is one id (text's space), more than a staged chunk's and a batch's worth."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    rng = np.random.default_rng(13)
    ids = rng.integers(0, vocab, n_ids).astype(np.int32)
    ids[rng.random(n_ids) < hot] = 32
    ids[: min(n_ids, 3)] = vocab - 1                   # the last row, and rows no id picks (vocab 1000)
    prog, trainer, dy = embedding_program(backend, vocab, d, ids)
    trainer.grads_only({})
    assert cuda_kernel_names(trainer.gb_grad) == ["get_rows_back"]
    want = np.zeros((vocab, d), np.float32)
    for r, v in enumerate(ids):
        want[v] += dy[r]                               # float32, in order
    assert np.array_equal(prog.read(trainer.grad_acc["emb"]), want)
