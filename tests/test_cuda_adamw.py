"""A run of AdamW steps taken as one node by the cuda rewrite, and on cuda ggml's steps bit for bit.

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import cuda_kernel_names, needs, ops_of

from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import get_engine

# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


ADAMW_SHAPES = [(1,), (3,), (5, 7), (768,), (64, 100), (4099,)]     # a float at a time, float4s, both
ADAMW_MANY = ADAMW_SHAPES + [(n,) for n in range(5, 39)]             # 40 parameters: two launches of a run


def adamw_program(backend: str, shapes: list[tuple[int, ...]], seed: int = 17):
    """Parameters of `shapes`, the loss sum_i sum(p_i * c_i): each gradient is its constant c_i."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    total = None
    for i, shape in enumerate(shapes):
        term = (prog.param(f"p{i}", rng.normal(size=shape).astype(np.float32))
                * prog.constant(f"c{i}", rng.normal(size=shape).astype(np.float32))).sum()
        total = term if total is None else total + term
    return prog, prog.trainer(prog.scalar_loss(total), "bias_corrected")


def test_the_cuda_rewrite_takes_a_run_of_adamw_steps_as_one_and_refuses_a_part_of_it():
    """Built on cpu (never computed here): the AdamW steps at the end of the training graph, one a
    parameter, are one run (its last node computes it); a lone step stays ggml's; a graph that
    holds a step of the run but not the run's last node is refused."""
    prog, trainer = adamw_program("cpu", ADAMW_SHAPES)
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(cuda_kernel_names(trainer.gb_opt))
    assert cuda_kernel_names(trainer.gb_opt).count("adamw") == len(ADAMW_SHAPES)       # (and the loss's adds)
    assert "OPT_STEP_ADAMW" not in ops_of(trainer.gb_opt)
    nodes = [lib.ggml_graph_node(trainer.gb_opt, i) for i in range(lib.ggml_graph_n_nodes(trainer.gb_opt))]
    first = next(t for t in nodes if lib.th_cuda_kernel_name(t) != ffi.NULL
                 and ffi.string(lib.th_cuda_kernel_name(t)).decode() == "adamw")
    last = [t for t in nodes if lib.th_cuda_kernel_name(t) != ffi.NULL][-1]
    for alone in (first, last):          # a step without its run's last node; the last without its run
        part = prog._new_graph(lib.ggml_graph_size(trainer.gb_opt), True)
        lib.ggml_build_forward_expand(part, alone)
        assert lib.th_cuda_rewrite(part, 1) == -1
    prog, trainer = adamw_program("cpu", [(4, 4)])
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == 0 and "OPT_STEP_ADAMW" in ops_of(trainer.gb_opt)


def test_matrices_and_vectors_interleaved_still_make_runs_of_adamw_steps():
    """A vector steps on the AdamW row without weight decay, a matrix on the other: the Trainer puts
    each row's steps together, so that weight, bias, weight, bias ... still makes two runs (no step
    left to ggml's lone kernel)."""
    shapes = [(5, 7), (7,), (6, 3), (3,), (4, 4), (4,)]
    prog, trainer = adamw_program("cpu", shapes)
    assert trainer.hp_no_decay is not None
    lib.th_cuda_rewrite(trainer.gb_opt, 1)
    assert cuda_kernel_names(trainer.gb_opt).count("adamw") == len(shapes)
    assert "OPT_STEP_ADAMW" not in ops_of(trainer.gb_opt)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_adamw_over_a_run_on_cuda_gives_ggmls_steps_bit_for_bit(backend):
    """Three steps of the run's kernel (ours: 4 floats a thread, float4s where they fit, 32
    parameters a launch) for 40 parameters, against each parameter alone in a program of its own,
    whose lone step is ggml-cuda's OPT_STEP_ADAMW."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    rows = [[1e-2, 0.9, 0.999, 1e-8, 0.1, 1 / (1 - 0.9**k), 1 / (1 - 0.999**k)] for k in (1, 2, 3)]
    prog, trainer = adamw_program(backend, ADAMW_MANY)
    for row in rows:
        trainer.step({}, row)
    assert cuda_kernel_names(trainer.gb_opt).count("adamw") == len(ADAMW_MANY)
    for i, shape in enumerate(ADAMW_MANY):
        # adamw_program's draws, then only parameter i in a program of its own
        alone = get_engine(backend).program()
        rng = np.random.default_rng(17)
        drawn = [(rng.normal(size=s).astype(np.float32), rng.normal(size=s).astype(np.float32)) for s in ADAMW_MANY]
        p = alone.param("p", drawn[i][0])
        alone_trainer = alone.trainer(alone.scalar_loss((p * alone.constant("c", drawn[i][1])).sum()), "bias_corrected")
        for row in rows:
            alone_trainer.step({}, row)
        assert "adamw" not in cuda_kernel_names(alone_trainer.gb_opt)
        ours, ggmls = prog.read(prog.params[f"p{i}"]), alone.read(p)
        assert np.array_equal(ours, ggmls), (shape, np.abs(ours - ggmls).max())
        assert not np.array_equal(ours, drawn[i][0])                   # it did step


def test_the_cuda_rewrite_takes_accumulations_and_clippings_graphs():
    """gpt2 with accumulate=2 and grad_clip, built on cpu as cuda builds it: the last micro-batch's
    graph (the AdamW steps on the clipped sum, two runs) and both earlier micro-batches' graphs are
    graphs the rewrite accepts, every step in a run."""
    from toyharness.discovery import get_recipe
    from toyharness.goldens import golden_sets_for
    from toyharness.hookspecs import plugin_manager
    from toyharness.runner import load_data, resolve_options

    _, obj = get_recipe("gpt2")
    options = resolve_options(obj, None, golden_sets_for("gpt2"), {})
    pm = plugin_manager(obj)
    engine = get_engine("cpu")
    engine.set_training_loop(2, 0.05)
    try:
        trainer = pm.hook.realize(engine=engine, options=options, data=load_data(pm, options)).trainer
    finally:
        engine.set_training_loop()
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) > 0
    assert cuda_kernel_names(trainer.gb_opt).count("adamw") == len(trainer.prog.params)
    for graph in trainer.gb_micro:
        assert lib.th_cuda_rewrite(graph, 1) >= 0
    trainer.prog.close()
