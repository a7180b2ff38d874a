"""Our kernels inside ggml-cuda (native/cuda/th-custom.cu) and the rewrite that hands them nodes
(native/cuda_rewrite.c), plus the edits that put the dispatch into ggml-cuda.cu (native/build.py).

The rewrite and the edits are checked here on any machine; the kernels' values where the cuda
backend is built and a device is present (`nox -s tests-cuda`), else those tests skip and say why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from test_backends import needs
from test_cpu_kernels import gelu_tanh_f64

from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import blocks, get_engine

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(21)


def native_build():
    spec = importlib.util.spec_from_file_location("toyharness_native_build_cuda_edits", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ops_of(graph) -> list[str]:
    return [ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
            for i in range(lib.ggml_graph_n_nodes(graph))]


def test_the_cuda_rewrite_marks_each_gelu_stand_in_and_its_backward():
    """Built on cpu (never computed here): the pairing the cuda rewrite shares with the cpu one."""
    prog = get_engine("cpu").program()
    prog.cpu_kernels = True          # blocks build the stand-in
    y = blocks.gelu_tanh(prog.param("x", RNG.normal(size=(4, 8)).astype(np.float32)))
    trainer = prog.trainer(prog.scalar_loss(y.sum()), "bias_corrected")
    assert lib.th_cuda_rewrite(trainer.gb_grad) == 2
    names = [lib.th_cuda_kernel_name(lib.ggml_graph_node(trainer.gb_grad, i))
             for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))]
    assert sorted(ffi.string(n).decode() for n in names if n != ffi.NULL) == ["gelu", "gelu_back"]
    assert "SILU" not in ops_of(trainer.gb_grad) and "SILU_BACK" not in ops_of(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_opt) == 0      # the same nodes, marked already


def test_the_cuda_rewrite_takes_conts_of_permutes_and_leaves_plain_ones():
    prog = get_engine("cpu").program()
    x = prog.param("x", RNG.normal(size=(2, 3, 4, 5)).astype(np.float32))
    moved = x.permute(0, 2, 1, 3).cont()           # rows stay contiguous: the row copy
    transposed = x.permute(0, 1, 3, 2).cont()      # the contiguous axis moves: the tiled copy
    plain = (x * 2.0).reshape(6, 20).cont()        # a copy of a contiguous tensor: ggml's memcpy
    graph = prog.forward({"a": moved, "b": transposed, "c": plain}).graph
    assert lib.th_cuda_rewrite(graph) == 2
    names = [lib.th_cuda_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph))]
    assert [ffi.string(n).decode() for n in names if n != ffi.NULL] == ["cont", "cont"]
    assert ops_of(graph).count("CONT") == 1


def test_the_dispatch_edits_apply_once_to_the_pinned_ggml():
    build = native_build()
    text = (build.ggml_source() / "src" / "ggml-cuda" / "ggml-cuda.cu").read_text()
    edited = build.cuda_dispatch_source(text)
    assert edited.count('#include "ggml-cuda/th-custom.cuh"') == 1
    assert edited.count("if (!th_cuda_custom(ctx.stream(), dst))") == 1
    assert edited.count("return th_cuda_custom_supported(op);") == 1
    assert len(edited.splitlines()) == len(text.splitlines()) + 8


def test_a_ggml_without_the_anchor_is_refused_by_name():
    build = native_build()
    with pytest.raises(build.BuildError, match=r"'#include \"ggml-cuda/common.cuh\"' found 0 times"):
        build.cuda_dispatch_source("int main(void) { return 0; }\n")


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_gelu_on_cuda_is_one_kernel_each_way_and_matches_float64(backend):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    x = np.concatenate([RNG.normal(size=5000) * 3, [-100.0, -12.0, -5.0, 0.0, 5.0, 12.0, 100.0]]).astype(np.float32)
    dy = RNG.normal(size=x.shape)
    prog = get_engine(backend).program()
    y = blocks.gelu_tanh(prog.param("x", x))
    trainer = prog.trainer(prog.scalar_loss((y * prog.constant("w", dy)).sum()), "bias_corrected")
    fg = prog.forward({"y": y})
    got = fg.run({})["y"]
    trainer.grads_only({})
    g = prog.read(trainer.grad_acc["x"])
    assert ops_of(fg.graph).count("CUSTOM") == 1 and ops_of(trainer.gb_grad).count("CUSTOM") == 2
    y64, d64 = gelu_tanh_f64(x.astype(np.float64))
    dyd = dy.astype(np.float32).astype(np.float64)
    # ggml-cuda builds with -use_fast_math (expf is __expf): a few ulp, far inside 1e-4
    assert np.isfinite(got).all() and np.isfinite(g).all()
    assert (np.abs(got - y64) <= 1e-5 * np.abs(y64) + 1e-6).all()
    assert (np.abs(g - dyd * d64) <= 2e-5 * np.abs(dyd * d64) + 2e-6 * np.abs(dyd)).all()


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_conts_of_every_permute_on_cuda_are_exact_copies(backend):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    import itertools

    x = RNG.normal(size=(3, 37, 5, 70)).astype(np.float32)   # odd sizes: partial tiles and rows
    prog = get_engine(backend).program()
    X = prog.param("x", x)
    perms = [p for p in itertools.permutations(range(4)) if p != (0, 1, 2, 3)]
    graph = prog.forward({str(p): X.permute(*p).cont() for p in perms})
    got = graph.run({})
    assert ops_of(graph.graph).count("CUSTOM") == len(perms)
    for p in perms:
        assert np.array_equal(got[str(p)], np.transpose(x, p)), p
