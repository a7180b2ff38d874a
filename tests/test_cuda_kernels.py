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
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 2
    names = [lib.th_cuda_kernel_name(lib.ggml_graph_node(trainer.gb_grad, i))
             for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))]
    assert sorted(ffi.string(n).decode() for n in names if n != ffi.NULL) == ["gelu", "gelu_back"]
    assert "SILU" not in ops_of(trainer.gb_grad) and "SILU_BACK" not in ops_of(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == 0      # the same nodes, marked already


def test_the_cuda_rewrite_takes_conts_of_permutes_and_leaves_plain_ones():
    prog = get_engine("cpu").program()
    x = prog.param("x", RNG.normal(size=(2, 3, 4, 5)).astype(np.float32))
    moved = x.permute(0, 2, 1, 3).cont()           # rows stay contiguous: the row copy
    transposed = x.permute(0, 1, 3, 2).cont()      # the contiguous axis moves: the tiled copy
    plain = (x * 2.0).reshape(6, 20).cont()        # a copy of a contiguous tensor: ggml's memcpy
    graph = prog.forward({"a": moved, "b": transposed, "c": plain}).graph
    assert lib.th_cuda_rewrite(graph, 1) == 2
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


def attention_program(backend: str, b: int, t: int, d: int, n_head: int, n_kv_head: int | None = None,
                      causal: bool = True, seed: int = 5):
    """One attention block, its loss a weighted sum of its output: (program, trainer, forward graph)."""
    rng = np.random.default_rng(seed)
    kv = d // n_head * (n_kv_head or n_head)
    prog = get_engine(backend).program()
    x = prog.param("x", rng.normal(size=(b, t, d)).astype(np.float32))
    w = {n: prog.param(n, (rng.normal(size=(rows, d)) / np.sqrt(d)).astype(np.float32))
         for n, rows in (("wq", d), ("wk", kv), ("wv", kv), ("wo", d))}
    y = blocks.attention(x, w["wq"], w["wk"], w["wv"], w["wo"], n_head, n_kv_head, causal=causal)
    weights = prog.constant("weights", rng.normal(size=(b, t, d)).astype(np.float32))
    trainer = prog.trainer(prog.scalar_loss((y * weights).sum()), "bias_corrected")
    return prog, trainer, prog.forward({"y": y})


def kernel_names(graph) -> list[str]:
    names = (lib.th_cuda_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph)))
    return [ffi.string(n).decode() for n in names if n != ffi.NULL]


def test_the_cuda_rewrite_fuses_attention_and_orders_its_copies_in_every_graph():
    """Built on cpu (never computed here): P, O and the backward's dP, dS, dk, dvt become the fused
    kernels' nodes, S computes nothing, and in each graph dvt's copy follows the backward node."""
    prog, trainer, fg = attention_program("cpu", 2, 8, 32, 2)
    assert ops_of(trainer.gb_grad).count("SOFT_MAX") == 1
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 3 + 4 + 8           # + the 8 head-permute copies
    assert [n for n in kernel_names(trainer.gb_grad) if n != "cont"] == [
        "attention", "slice", "attention_prep", "attention_back", "slice", "slice"]
    ops = ops_of(trainer.gb_grad)
    assert "SOFT_MAX" not in ops and "SOFT_MAX_BACK" not in ops
    assert ops.count("OUT_PROD") == 12 - 3          # of attention's 4, dq stays (cuBLAS's product)
    # gb_opt holds the same nodes in its own order: nothing new to mark, but its copies move
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == 0
    assert [n for n in kernel_names(trainer.gb_opt) if n != "cont"][-3:] == ["attention_back", "slice", "slice"]
    assert lib.th_cuda_rewrite(fg.graph, 1) == 0


@pytest.mark.parametrize("why, kwargs, flag", [
    ("a head size the kernels lack (8)", dict(d=16), 1),
    ("fusion not asked for", dict(d=32), 0),
])
def test_the_cuda_rewrite_leaves_attention_to_ggml(why, kwargs, flag):
    prog, trainer, fg = attention_program("cpu", 2, 8, n_head=2, **kwargs)
    lib.th_cuda_rewrite(trainer.gb_grad, flag)
    assert "attention" not in kernel_names(trainer.gb_grad), why
    assert ops_of(trainer.gb_grad).count("SOFT_MAX_BACK") == 1, why


def test_fused_attention_can_be_turned_off_by_name(monkeypatch):
    from toyharness.errors import InputError

    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION", "ggml")
    assert not get_engine("cpu").program().fused_attention
    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION", "flash")
    with pytest.raises(InputError, match="TOYHARNESS_CUDA_ATTENTION='flash': use fused or ggml"):
        get_engine("cpu").program()


def attention_values(monkeypatch, how: str, **shape) -> dict[str, np.ndarray]:
    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION", how)
    prog, trainer, fg = attention_program("cuda", **shape)
    out = {"y": fg.run({})["y"]}
    trainer.grads_only({})
    out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "wq", "wk", "wv", "wo")})
    kernels = kernel_names(trainer.gb_grad) + kernel_names(fg.graph)
    assert ("attention_back" in kernels) == (how == "fused")
    return out


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", [
    dict(b=2, t=64, d=128, n_head=2),                         # one tile, head size 64
    dict(b=3, t=200, d=64, n_head=2),                         # partial tiles, head size 32
    dict(b=1, t=130, d=96, n_head=6, n_kv_head=2),            # grouped-query heads, head size 16
    dict(b=2, t=37, d=128, n_head=2, causal=False),           # vit's kind: no mask, odd length
    dict(b=1, t=300, d=128, n_head=2, causal=False),
])
def test_fused_attention_on_cuda_matches_ggmls_nodes_and_repeats_its_bits(backend, shape, monkeypatch):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    fused = attention_values(monkeypatch, "fused", **shape)
    again = attention_values(monkeypatch, "fused", **shape)
    ggml = attention_values(monkeypatch, "ggml", **shape)
    for name, want in ggml.items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2e-6, (name, err)
        assert np.array_equal(got, again[name]), name
