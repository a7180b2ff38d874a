"""Our kernels inside ggml-cuda (native/cuda/th-custom.cu) and the rewrite that hands them nodes
(native/cuda_rewrite.c), plus the edits that put the dispatch into ggml-cuda.cu (native/build.py).

The rewrite and the edits are checked here on any machine; the kernels' values where the cuda
backend is built and a device is present (`nox -s tests-cuda`), else those tests skip and say why."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from attention_cases import attention_float64, attention_program
from test_backends import needs
from test_cpu_kernels import gelu_tanh_f64

from toyharness._ffi import GGML_TYPE_F32, cuda_kernels_built, ffi, lib
from toyharness.engine import blocks, get_engine

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(21)


def native_build():
    spec = importlib.util.spec_from_file_location("toyharness_native_build_cuda_edits", ROOT / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def graphs_as_cuda_builds_them(programs_built_as):
    """The rewrite's tests build on cpu the graphs cuda would compute: a cpu Trainer's folds of
    products into ADDs (th_cpu_fold) and grouped kv heads read in place without their REPEATs
    (Program.kv_in_place) are not cuda's, so they stay off here."""
    programs_built_as(cpu_folds=False, kv_in_place=False)


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
    assert edited.count("if (!th_cuda_custom(ctx.stream(), ctx.cublas_handle(), dst))") == 1
    assert edited.count("return th_cuda_custom_supported(op);") == 1
    # the bf16 operand copies' pass over a graph's nodes, begun before the loop and ended after it
    assert edited.count("th_cuda_graph_begin(cgraph);") == 1 and edited.count("th_cuda_graph_end();") == 1
    assert edited.index("th_cuda_graph_begin(cgraph);") < edited.index("th_cuda_graph_end();")
    # 3 of them the precision's (test_precision), 2 the bf16 copies' pass
    assert len(edited.splitlines()) == len(text.splitlines()) + 13


def test_python_asks_for_the_kernels_version_the_native_side_declares():
    """A ggml-cuda built before this version lacks stand-ins blocks now build: _ffi must refuse it."""
    import re

    from toyharness import _ffi

    header = (ROOT / "native" / "custom_ops.h").read_text()
    assert int(re.search(r"#define TH_CUDA_KERNELS_VERSION (\d+)", header).group(1)) == _ffi.CUDA_KERNELS_VERSION


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


def layer_norm_program(backend: str, rows: int, d: int, stand_in: bool, seed: int = 8, residual: bool = False):
    """LayerNorm of x (rows, d) with gain and bias, its loss a weighted sum of its output:
    (program, trainer, forward graph, inputs). `stand_in`: as blocks build it for our cuda kernels.
    `residual`: the output is x + LayerNorm(x)."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(rows, d)) * 3 + rng.normal(size=(rows, 1)) * 5).astype(np.float32)
    gain, bias = rng.normal(size=d).astype(np.float32), rng.normal(size=d).astype(np.float32)
    weights = rng.normal(size=(rows, d)).astype(np.float32)
    prog = get_engine(backend).program()
    prog.cuda_kernels = stand_in
    prog.column_sums_as_products = True           # as on cuda
    xp = prog.param("x", x)
    y = blocks.layer_norm(xp, prog.param("gain", gain), prog.param("bias", bias))
    y = xp + y if residual else y
    trainer = prog.trainer(prog.scalar_loss((y * prog.constant("w", weights)).sum()), "bias_corrected")
    return prog, trainer, prog.forward({"y": y}), (x, gain, bias, weights)


def layer_norm_f64(x, gain, bias, dy, eps=1e-5):
    """LayerNorm and its gradients in float64: y, dx, dgain, dbias."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    c = x - x.mean(axis=1, keepdims=True)
    r = 1.0 / np.sqrt((c * c).mean(axis=1, keepdims=True) + eps)
    t = c * r
    dt = dy * gain
    dx = r * (dt - dt.mean(axis=1, keepdims=True) - t * (dt * t).mean(axis=1, keepdims=True))
    return t * gain + bias, dx, (dy * t).sum(axis=0), dy.sum(axis=0)


def test_the_cuda_rewrite_marks_each_layer_norm_stand_in_and_its_backward():
    """Built on cpu (never computed here): the stand-in RMS_NORM and its RMS_NORM_BACK become our
    kernels' nodes, no centring nodes are built, and the gain and bias fold in: ADD(MUL(t, g), b)
    one pass, which computes the normalization too (t into the norm's node, a room before it in
    every graph), MUL(dy, g) formed inside the backward, the gain's gradient a COLUMN_DOT whose
    sums the backward takes (th_fuse_gain_sums: its node a room)."""
    prog, trainer, fg, _ = layer_norm_program("cpu", 6, 16, stand_in=True)
    assert "SUM_ROWS" not in ops_of(fg.graph)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 2 + 2 + 1 + 2 + 1 + 1
    assert sorted(kernel_names(trainer.gb_grad)) == ["affine", "folded", "folded", "folded", "layer_norm_back",
                                                      "room", "room"]
    ops = ops_of(trainer.gb_grad)
    assert "RMS_NORM" not in ops and "RMS_NORM_BACK" not in ops
    assert ops.count("MUL") == 2 and ops.count("OUT_PROD") == 1       # the loss's weights; the bias's column sum
    # the same nodes, marked already, and AdamW's steps (one a parameter): one run
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(prog.params) >= 2
    for graph in (trainer.gb_grad, trainer.gb_opt, fg.graph):
        lib.th_cuda_rewrite(graph, 1)
        names = kernel_names_in_order(graph)
        assert names.index("room") < names.index("affine")


def test_the_cuda_rewrite_hands_the_gains_column_sums_to_layer_norms_backward():
    """Built on cpu: the gain's gradient (COLUMN_DOT of t and dy) becomes a room that LayerNorm's
    backward writes (src 4, the COLUMN_DOT's scratch src 5), before it in every graph, every reader
    after it; rows wider than the backward's shared memory holds keep the COLUMN_DOT."""
    prog, trainer, fg, _ = layer_norm_program("cpu", 6, 16, stand_in=True, residual=True)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    for graph in (trainer.gb_grad, trainer.gb_opt):
        assert lib.th_cuda_rewrite(graph, 1) >= 0
        nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
        names = kernel_names_in_order(graph)
        back = nodes[names.index("layer_norm_back")]
        room, scratch = lib.th_tensor_src(back, 4), lib.th_tensor_src(back, 5)
        assert ffi.string(lib.ggml_get_name(room)).decode() == "grad for gain"
        at = next(i for i, node in enumerate(nodes) if node == room)
        assert names[at] == "room" and at < names.index("layer_norm_back")
        assert names[next(i for i, node in enumerate(nodes) if node == scratch)] == "folded"
        assert "column_dot" not in names
    prog, trainer, fg, _ = layer_norm_program("cpu", 6, 1537, stand_in=True)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    names = kernel_names(trainer.gb_grad)
    assert "column_dot" in names and names.count("room") == 1       # the norm's t alone


def test_at_bf16_layer_norms_backward_takes_its_bias_gradient_too():
    """Built on cpu: stamped bf16, LayerNorm's bias's gradient (OUT_PROD of dy and ones, a bf16
    product) becomes a room that the backward writes (src 6), before it in every graph, every
    reader after it; stamped fp32 or tf32 the product stays, as it does at bf16 without the gain's
    sums to go with (rows wider than the backward's shared memory holds)."""
    from toyharness.engine.program import PRECISION_CODES

    def stamped(precision, d=16):
        prog, trainer, fg, _ = layer_norm_program("cpu", 6, d, stand_in=True, residual=True)
        assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
        assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES[precision], ffi.NULL, 0) > 0
        return trainer

    trainer = stamped("bf16")
    for graph in (trainer.gb_grad, trainer.gb_opt):
        assert lib.th_cuda_rewrite(graph, 1) >= 0
        nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
        names = kernel_names_in_order(graph)
        back = names.index("layer_norm_back")
        room = lib.th_tensor_src(nodes[back], 6)
        assert room != ffi.NULL, "the backward does not write the bias's gradient"
        assert ffi.string(lib.ggml_get_name(room)).decode() == "grad for bias"
        at = nodes.index(room)
        assert names[at] == "room" and at < back and lib.th_tensor_src(room, 0) == ffi.NULL
        assert not [i for i, node in enumerate(nodes[:back]) if any(
            lib.th_tensor_src(node, j) == room for j in range(10))], "the bias's gradient read before it is written"
        assert "OUT_PROD" not in ops_of(graph)
    for precision, d in (("fp32", 16), ("tf32", 16), ("bf16", 1537)):
        trainer = stamped(precision, d)
        back = lib.ggml_graph_node(trainer.gb_grad, kernel_names_in_order(trainer.gb_grad).index("layer_norm_back"))
        assert lib.th_tensor_src(back, 6) == ffi.NULL, (precision, d)
        assert ops_of(trainer.gb_grad).count("OUT_PROD") == 1, (precision, d)


def test_a_layer_norms_t_left_unwritten_is_refused_where_another_node_reads_it():
    """Built on cpu: once LayerNorm's backward sums the gain's gradient, nothing but the forward's
    AFFINE reads t, and the AFFINE leaves it unwritten. A graph built after that which reads t
    (here its SUM beside the AFFINE) is refused (-1), not computed from memory never written; with
    the COLUMN_DOT kept (rows wider than the backward's shared memory holds) t is written and the
    same graph is taken. A forward graph rewritten before the backward (no backward there to say t
    is unread) writes t too."""
    for d, first, want in ((16, "grad", -1), (1537, "grad", 0), (16, "forward", 0)):
        prog, trainer, fg, _ = layer_norm_program("cpu", 6, d, stand_in=True)
        assert lib.th_cuda_rewrite(fg.graph if first == "forward" else trainer.gb_grad, 1) > 0
        assert lib.th_cuda_rewrite(trainer.gb_grad, 1) >= 0
        names = kernel_names_in_order(fg.graph)
        t = lib.ggml_graph_node(fg.graph, names.index("room"))
        affine = lib.ggml_graph_node(fg.graph, names.index("affine"))
        graph = prog._new_graph(64, False)
        lib.ggml_build_forward_expand(graph, affine)
        lib.ggml_build_forward_expand(graph, lib.ggml_sum(prog._ctx_compute, t))
        got = lib.th_cuda_rewrite(graph, 1)
        assert (got < 0) == (want < 0), (d, first, got)


def test_the_cuda_rewrite_keeps_a_norm_whose_output_is_read_before_its_affine():
    """t read by another node ahead of the AFFINE (here the loss reads the normalization itself
    too, and ggml orders that product first): the AFFINE cannot be what writes t, so the norm
    keeps its own node."""
    rng = np.random.default_rng(3)
    prog = get_engine("cpu").program()
    prog.column_sums_as_products = True
    x = prog.param("x", rng.normal(size=(6, 16)).astype(np.float32))
    t = x.rms_norm(1e-5)
    w = prog.constant("w", rng.normal(size=(6, 16)).astype(np.float32))
    y = blocks.scale_columns(t, prog.param("gain", rng.normal(size=16).astype(np.float32)))
    trainer = prog.trainer(prog.scalar_loss((t * w).sum() + y.sum()), "bias_corrected")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    names = kernel_names_in_order(trainer.gb_grad)
    assert "rms_norm" in names and "room" not in names


def test_the_cuda_rewrite_adds_a_residuals_gradient_inside_layer_norms_backward():
    """x + LayerNorm(x): x's gradient is ADD(dy, LAYER_NORM_BACK(...)); the backward's kernel adds
    dy as it writes, and the ADD's node computes it (the backward's own node folds)."""
    prog, trainer, fg, _ = layer_norm_program("cpu", 6, 16, stand_in=True, residual=True)
    # LayerNorm's 9 (see above), the forward's residual ADD, and its gradient's (marked, folding one)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 2 + 2 + 1 + 2 + 1 + 1 + 1 + 2
    names = kernel_names(trainer.gb_grad)
    assert names.count("layer_norm_back") == 1 and names.count("add") == 1
    assert ops_of(trainer.gb_grad).count("ADD") == 0


def gain_program(backend: str, rows: int, d: int, norm: bool = True, seed: int = 15):
    """x (rows, d), RMSNorm'd where `norm`, times a gain, the loss a weighted sum of the output,
    built as cuda builds it: (program, trainer, forward graph, (x, gain, weights))."""
    rng = np.random.default_rng(seed)
    x, gain, weights = (rng.normal(size=s).astype(np.float32) for s in ((rows, d), (d,), (rows, d)))
    prog = get_engine(backend).program()
    prog.column_sums_as_products = True           # as on cuda
    xp, gp = prog.param("x", x), prog.param("gain", gain)
    y = blocks.rms_norm(xp, gp) if norm else blocks.scale_columns(xp, gp)
    trainer = prog.trainer(prog.scalar_loss((y * prog.constant("w", weights)).sum()), "bias_corrected")
    return prog, trainer, prog.forward({"y": y}), (x, gain, weights)


def test_the_cuda_rewrite_takes_a_gain_alone_each_way():
    """Built on cpu (never computed here): RMSNorm's gain, MUL(t, g), and the backward's MUL(dy, g)
    become AFFINE without a bias (ggml's broadcasting MUL computes each element's place), the
    normalization RMS_NORM, computed by the forward's AFFINE (the norm's node a room); the loss's
    MULs of one shape and the gain's gradient (a column dot) are not gains, and RMS_NORM_BACK stays
    ggml's."""
    prog, trainer, fg, _ = gain_program("cpu", 6, 16)
    before = ops_of(trainer.gb_grad).count("MUL")
    # the two gains, the norm, the column dot and its MUL, the norm taken into the forward's gain
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 2 + 1 + 2 + 1
    assert sorted(kernel_names(trainer.gb_grad)) == ["affine", "affine", "column_dot", "folded", "room"]
    ops = ops_of(trainer.gb_grad)
    assert ops.count("MUL") == before - 3 and "RMS_NORM" not in ops and "RMS_NORM_BACK" in ops


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, d", [(70, 384), (5, 37)])            # float4 rows, and a float at a time
def test_a_gain_alone_on_cuda_is_ours_and_rounds_as_one_float32_product(backend, rows, d):
    """y = x g, and x's gradient dy g (dy = the loss's weights): each element one float32
    product, equal bit for bit to numpy's."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    prog, trainer, fg, (x, gain, weights) = gain_program(backend, rows, d, norm=False)
    assert np.array_equal(fg.run({})["y"], x * gain)
    assert kernel_names(fg.graph) == ["affine"]
    trainer.grads_only({})
    assert kernel_names(trainer.gb_grad).count("affine") == 2
    assert np.array_equal(prog.read(trainer.grad_acc["x"]), weights * gain)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, d", [(33, 384), (9, 768), (5, 1000), (4, 1024), (3, 2051), (2, 5)])
def test_rms_norm_on_cuda_is_ours_and_gives_ggmls_bits(backend, rows, d):
    """Our RMS_NORM (a warp a row) sums in the order of ggml-cuda's block of 256 threads (d < 1024)
    or 1024: its output equals ggml-cuda's own kernel's, bit for bit, at partial blocks too, and
    where it keeps a row in registers (384, 768 and 1024 wide)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    x = (RNG.normal(size=(rows, d)) * 3).astype(np.float32)

    def norm(kernels: bool):
        prog = get_engine(backend).program()
        prog.cuda_kernels = kernels
        fg = prog.forward({"y": prog.constant("x", x).rms_norm(1e-5)})
        return fg.run({})["y"], kernel_names(fg.graph)

    (ours, names), (ggmls, none) = norm(True), norm(False)
    assert names == ["rms_norm"] and none == []
    assert np.array_equal(ours, ggmls)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    assert np.abs(ours - want).max() < 1e-5 * np.abs(want).max()          # and it is RMSNorm


ROPE_CASES = {                       # Tensor.rope's keywords: llama's, qwen2's, a partial head, Llama 3's factors
    "normal": {}, "neox": {"neox": True}, "partial": {"n_dims": 32, "neox": True},
    "factors": {"freq_scale": 0.25, "factors": True},
}


def rope_program(backend: str, case: str, shape=(3, 40, 5, 64), seed: int = 16, kernels: bool = True):
    """x (B, T, H, hd) rotated as Tensor.rope does it, the loss a weighted sum of the result:
    (program, trainer, forward graph, weights). `kernels` False: ggml-cuda's own nodes only."""
    rng = np.random.default_rng(seed)
    kw = dict(ROPE_CASES[case])
    n_dims = kw.pop("n_dims", shape[-1])
    x, weights = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    prog = get_engine(backend).program()
    prog.cuda_kernels = prog.cuda_kernels and kernels
    if kw.pop("factors", False):
        kw["freq_factors"] = prog.constant("ff", rng.uniform(1, 8, n_dims // 2).astype(np.float32))
    positions = prog.constant("pos", (np.arange(shape[1]) * 7 + 3).astype(np.int32))
    y = prog.param("x", x).rope(positions, n_dims, base=500000.0, **kw)
    trainer = prog.trainer(prog.scalar_loss((y * prog.constant("w", weights)).sum()), "bias_corrected")
    return prog, trainer, prog.forward({"y": y}), weights


def test_the_cuda_rewrite_takes_rope_each_way():
    """Built on cpu (never computed here): ROPE and its ROPE_BACK become ours, keeping ggml's
    parameters."""
    prog, trainer, fg, _ = rope_program("cpu", "factors")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 2
    assert kernel_names(trainer.gb_grad) == ["rope", "rope"]
    ops = ops_of(trainer.gb_grad)
    assert "ROPE" not in ops and "ROPE_BACK" not in ops


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_on_cuda_is_ours_and_gives_ggmls_bits(backend, case):
    """Our ROPE and ROPE_BACK (a thread a pair) against ggml-cuda's own kernels (a block a row):
    the forward's output and x's gradient, bit for bit."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")

    def run(kernels: bool):
        prog, trainer, fg, _ = rope_program(backend, case, kernels=kernels)
        y = fg.run({})["y"]
        trainer.grads_only({})
        return y, prog.read(trainer.grad_acc["x"]), kernel_names(fg.graph) + kernel_names(trainer.gb_grad)

    (y, dx, names), (y_ggml, dx_ggml, none) = run(True), run(False)
    assert names.count("rope") == 3 and none == []                 # the forward graph's, and the training graph's two
    assert np.array_equal(y, y_ggml) and np.array_equal(dx, dx_ggml)
    y_cpu = rope_program("cpu", case)[2].run({})["y"]                  # and it is the rotation (fast sin, cos)
    assert np.abs(y - y_cpu).max() < 1e-3 * np.abs(y_cpu).max()


def test_the_cuda_rewrite_refuses_a_layer_norm_whose_backward_is_ambiguous():
    """A plain rms_norm of the same rows has a backward node that reads the same input: which
    one is LayerNorm's cannot be told, so the graph is refused (-1) rather than computed wrong."""
    prog = get_engine("cpu").program()
    x = prog.param("x", RNG.normal(size=(4, 8)).astype(np.float32))
    y = x.rms_norm(1e-5).named(blocks.LAYER_NORM_STAND_IN) + x.rms_norm(1e-5)
    trainer = prog.trainer(prog.scalar_loss(y.sum()), "bias_corrected")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == -1


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, d", [(300, 384), (7, 100), (33, 1000)])
def test_layer_norm_on_cuda_is_one_kernel_each_way_matches_float64_and_repeats_its_bits(backend, rows, d):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    got = []
    for stand_in in (True, True, False):
        prog, trainer, fg, (x, gain, bias, dy) = layer_norm_program(backend, rows, d, stand_in)
        out = {"y": fg.run({})["y"]}
        trainer.grads_only({})
        out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "gain", "bias")})
        assert ("layer_norm_back" in kernel_names(trainer.gb_grad)) == stand_in
        got.append(out)
    ours, again, composed = got
    assert all(np.array_equal(ours[k], again[k]) for k in ours), "bits moved between two runs"
    want = dict(zip(("y", "x", "gain", "bias"), layer_norm_f64(x, gain, bias, dy)))
    for k, w in want.items():
        scale = np.abs(w).max()
        assert np.abs(ours[k] - w).max() <= 2e-6 * scale, (k, np.abs(ours[k] - w).max() / scale)
        # ggml's own nodes (centring, RMS_NORM and their backward) are no closer to float64
        assert np.abs(ours[k] - w).max() <= 2 * np.abs(composed[k] - w).max() + 1e-7 * scale, k


def summed_norm_inputs(rows: int, d: int, seed: int = 9) -> tuple[np.ndarray, ...]:
    """summed_norm_program's r, z, w (the gradient its norm's output receives), gain and bias"""
    rng = np.random.default_rng(seed)
    r, z, w = ((rng.normal(size=(rows, d)) * 2 + rng.normal(size=(rows, 1)) * 3).astype(np.float32) for _ in range(3))
    return r, z, w, rng.normal(size=d).astype(np.float32), rng.normal(size=d).astype(np.float32)


def summed_norm_program(backend: str, kind: str, rows: int, d: int, seed: int = 9):
    """r + z (two parameters of one shape: a residual's ADD) into LayerNorm with gain and bias
    (`kind` "layer", as blocks build it for our cuda kernels) or RMSNorm with a gain ("rms"), the
    loss a weighted sum of the norm's output plus the sum's (the next residual reads the sum
    too): (program, trainer, forward graph of y, the parameters' names). The norm's backward
    reads the sum: r's and z's gradients have its bits in them."""
    r, z, w, gain, bias = summed_norm_inputs(rows, d, seed)
    prog = get_engine(backend).program()
    prog.cuda_kernels = True
    prog.column_sums_as_products = True           # as on cuda
    s = prog.param("r", r) + prog.param("z", z)
    if kind == "layer":
        y = blocks.layer_norm(s, prog.param("gain", gain), prog.param("bias", bias))
    else:
        y = blocks.rms_norm(s, prog.param("gain", gain))
    trainer = prog.trainer(prog.scalar_loss((y * prog.constant("w", w)).sum() + s.sum()), "bias_corrected")
    names = ("r", "z", "gain", "bias") if kind == "layer" else ("r", "z", "gain")
    return prog, trainer, prog.forward({"y": y}), names


def test_the_cuda_rewrite_computes_a_residuals_sum_in_the_norms_affine():
    """Built on cpu: the ADD whose sum a norm reads, read by nothing before the AFFINE, becomes a
    room that the AFFINE writes (before it in every graph). (Rows wider than LayerNorm's backward
    sums its gain's gradient for: that gradient keeps a COLUMN_DOT, whose room would be the
    backward's, th_fuse_gain_sums.)"""
    for kind in ("layer", "rms"):
        prog, trainer, fg, _ = summed_norm_program("cpu", kind, 6, 1537)
        for graph in (trainer.gb_grad, trainer.gb_opt, fg.graph):
            assert lib.th_cuda_rewrite(graph, 1) >= 0
            names = kernel_names_in_order(graph)
            assert names.count("room") == 2, (kind, names)
            assert max(i for i, k in enumerate(names) if k == "room") < names.index("affine")
        # the forward's ADD is gone (the gradients' ADDs remain)
        assert "add" not in kernel_names(fg.graph), kind


def test_a_graph_holding_a_room_the_norms_affine_writes_but_not_that_affine_is_refused():
    """Once the residual's sum and the norm's t are rooms their AFFINE writes, a graph of one of
    them alone would read what nothing wrote: refused (-1). A graph of recomputed blocks (flag 4)
    reads such a block input from the forward's graph, and is taken (recompute.py checks the graphs
    built from it whole)."""
    prog, trainer, fg, _ = summed_norm_program("cpu", "layer", 6, 16)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    rooms = [lib.ggml_graph_node(fg.graph, i) for i, name in enumerate(kernel_names_in_order(fg.graph))
             if name == "room"]
    assert len(rooms) == 2
    for room in rooms:
        alone = prog._new_graph(16, False)
        lib.ggml_build_forward_expand(alone, room)
        assert lib.th_cuda_rewrite(alone, 1) == -1
        assert lib.th_cuda_rewrite(alone, 1 | 4) >= 0


def column_sums_in_chunk_order(dy: np.ndarray) -> np.ndarray:
    """dy's column sums in float32, in the order of th_column_chunks' chunks (th-custom.cu): rows
    cut into chunks (at least 64 rows, at most 1024 chunks), in a chunk warp w's rows w, w + 8, ...
    summed in order from 0, the 8 warps' sums added in order, then the chunks' in order."""
    m = dy.shape[0]
    chunks = min(-(-m // 64), 1024)
    chunk = -(-m // chunks)
    total = None
    for first in range(0, m, chunk):
        block = dy[first:first + chunk]
        warps = []
        for w in range(8):
            s = np.zeros(dy.shape[1], np.float32)
            for row in block[w::8]:
                s = s + row
            warps.append(s)
        part = warps[0]
        for s in warps[1:]:
            part = part + s
        total = part if total is None else total + part
    return total


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, d", [(300, 384), (40, 768), (7, 100), (5, 1030), (70000, 32), (64, 1536)])
def test_at_bf16_the_bias_sums_in_layer_norms_backward_are_fp32_sums_of_dy(backend, rows, d):
    """At bf16 LayerNorm's backward sums its bias's gradient (th_layer_norm_bias_sums) from dy's
    fp32 values, in the gain's chunk order: equal bit for bit to numpy's float32 sums in that order.
    Rows in registers (384, 768) and in shared memory, 16 rows of it at 1030 and 1536 wide (above
    48 KiB)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine(backend)
    engine.set_precision("bf16")
    try:
        prog, trainer, fg, names = summed_norm_program(backend, "layer", rows, d)
        trainer.grads_only({})
        assert "room" in kernel_names(trainer.gb_grad) and "OUT_PROD" not in ops_of(trainer.gb_grad)
        got = {n: prog.read(trainer.grad_acc[n]) for n in names}
    finally:
        engine.set_precision("fp32")
    for name in ("r", "z", "gain"):
        assert np.isfinite(got[name]).all(), name
    w = summed_norm_inputs(rows, d)[2]              # the gradient of the norm's output: the bias's dy
    want = column_sums_in_chunk_order(w)
    assert np.array_equal(got["bias"].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_a_residuals_gradient_added_in_layer_norms_backward_on_cuda_is_the_adds_bits(backend):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    dx = {}
    for residual in (False, True):
        prog, trainer, fg, (x, gain, bias, dy) = layer_norm_program(backend, 300, 384, True, residual=residual)
        trainer.grads_only({})
        dx[residual] = prog.read(trainer.grad_acc["x"])
        assert kernel_names(trainer.gb_grad).count("add") == residual       # the forward's
    # the residual's gradient is dy itself: x's gradient is LayerNorm's plus dy, one float32 rounding
    assert np.array_equal(dx[True], dx[False] + dy)


def products_program(backend: str, n_products: int, only: int | None = None, rows: int = 96, d_in: int = 160,
                     d_out: int = 200, seed: int = 4):
    """sum over i of (x W_i^T) * c_i (term `only` alone, when given): x's gradient is the sum of
    n_products OUT_PRODs."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    x = prog.param("x", rng.normal(size=(rows, d_in)).astype(np.float32))
    drawn = [(rng.normal(size=(d_out, d_in)).astype(np.float32), rng.normal(size=(rows, d_out)).astype(np.float32))
             for _ in range(n_products)]
    terms = [blocks.linear(x, prog.param(f"w{i}", w)) * prog.constant(f"c{i}", c)
             for i, (w, c) in enumerate(drawn) if only is None or i == only]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return prog, prog.trainer(prog.scalar_loss(total.sum()), "bias_corrected")


def test_the_cuda_rewrite_sums_an_inputs_products_in_one_node():
    """Built on cpu: x's gradients from 3 projections (ADD(ADD(p0, p1), p2) of OUT_PRODs) are one
    PRODUCT_SUM; 6 products are more than one node holds (5), so the last ADD stays."""
    prog, trainer = products_program("cpu", 3)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert kernel_names(trainer.gb_grad).count("product_sum") == 1
    assert ops_of(trainer.gb_grad).count("OUT_PROD") == 3          # the weights' gradients
    prog, trainer = products_program("cpu", 6)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert kernel_names(trainer.gb_grad).count("product_sum") == 1 and "add" in kernel_names(trainer.gb_grad)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_products_summed_in_one_node_on_cuda_match_the_adds_and_repeat_their_bits(backend):
    """Each product alone (ggml's OUT_PROD, beta 0), summed left to right in float32, against the
    PRODUCT_SUM that adds each into the sum so far (beta 1). Each product is cuBLAS's same bits
    either way, but where cuBLAS splits the sum over k (this shape) its beta-1 epilogue adds the
    partial sums and the sum so far in its own order: a rounding of the running sum apart
    (measured on the H100: 4842 of 15360 elements differ, by at most 7.6e-6 at magnitudes to 100)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    summed = []
    for _ in range(2):
        prog, trainer = products_program(backend, 3)
        trainer.grads_only({})
        assert "product_sum" in kernel_names(trainer.gb_grad)
        summed.append(prog.read(trainer.grad_acc["x"]))
    assert np.array_equal(summed[0], summed[1]), "bits moved between two runs"
    alone = []
    for i in range(3):
        prog_i, trainer_i = products_program(backend, 3, only=i)
        trainer_i.grads_only({})
        assert "product_sum" not in kernel_names(trainer_i.gb_grad)
        alone.append(prog_i.read(trainer_i.grad_acc["x"]))
    added = (alone[0] + alone[1]) + alone[2]
    magnitude = np.abs(alone[0]) + np.abs(alone[1]) + np.abs(alone[2])
    assert (np.abs(summed[0] - added) <= magnitude * 2.0**-22).all()


def test_the_cuda_rewrite_folds_a_bias_into_its_product_and_only_there():
    """Built on cpu (never computed here): ADD(MUL_MAT(w, x) through reshapes, b) becomes one node
    of ours and the product computes nothing; a product read twice keeps its ADD; a graph that
    reads a folded product (here as an output) is refused."""
    prog = get_engine("cpu").program()
    prog.column_sums_as_products = True          # the broadcast bias blocks build for cuda
    x = prog.param("x", RNG.normal(size=(2, 5, 8)).astype(np.float32))
    w, w2 = (prog.param(n, RNG.normal(size=(6, 8)).astype(np.float32)) for n in ("w", "w2"))
    b, b2 = (prog.param(n, RNG.normal(size=6).astype(np.float32)) for n in ("b", "b2"))
    y = blocks.linear(x, w, b)
    raw = x.matmul_t(w2)
    twice = blocks.add_bias(raw, b2) + raw
    trainer = prog.trainer(prog.scalar_loss(y.sum() + twice.sum()), "bias_corrected")
    products = ops_of(trainer.gb_grad).count("MUL_MAT")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == len(kernel_names(trainer.gb_grad))
    # and x's gradient, its products summed in one node (the parts fold)
    assert [n for n in kernel_names(trainer.gb_grad) if n != "add"] == [
        "folded", "linear_bias", "folded", "folded", "product_sum"]
    assert "ADD" in ops_of(trainer.gb_grad)                   # twice's: its bias's ADD reads the product
    assert ops_of(trainer.gb_grad).count("MUL_MAT") == products - 1
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(prog.params)      # AdamW's run
    assert lib.th_cuda_rewrite(prog.forward({"y": y}).graph, 1) == 0
    prog = get_engine("cpu").program()
    prog.column_sums_as_products = True
    raw = prog.param("x", RNG.normal(size=(5, 8)).astype(np.float32)).matmul_t(
        prog.param("w", RNG.normal(size=(6, 8)).astype(np.float32)))
    biased = blocks.add_bias(raw, prog.param("b", RNG.normal(size=6).astype(np.float32)))
    assert lib.th_cuda_rewrite(prog.forward({"y": biased}).graph, 1) == 2     # (no ADD of one shape here)
    assert lib.th_cuda_rewrite(prog.forward({"raw": raw}).graph, 1) == -1


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows, d_in, d_out", [(300, 64, 96), (7, 40, 24), (1000, 384, 1536)])
def test_a_bias_folded_into_its_product_on_cuda_matches_float64_and_repeats_its_bits(backend, rows, d_in, d_out):
    """y = x W^T + b as one node of ours (cuBLASLt's product, b added in its epilogue), and the
    gradients of x, W and b through it, against float64; two runs, same bits."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    rng = np.random.default_rng(9)
    x, w = rng.normal(size=(rows, d_in)).astype(np.float32), rng.normal(size=(d_out, d_in)).astype(np.float32)
    b, dy = rng.normal(size=d_out).astype(np.float32), rng.normal(size=(rows, d_out)).astype(np.float32)
    runs = []
    calls = linear_bias_calls()
    for _ in range(2):
        prog = get_engine(backend).program()
        y = blocks.linear(prog.param("x", x), prog.param("w", w), prog.param("b", b))
        trainer = prog.trainer(prog.scalar_loss((y * prog.constant("dy", dy)).sum()), "bias_corrected")
        fg = prog.forward({"y": y})
        out = {"y": fg.run({})["y"]}
        trainer.grads_only({})
        out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "w", "b")})
        assert "linear_bias" in kernel_names(fg.graph) and "linear_bias" in kernel_names(trainer.gb_grad)
        runs.append(out)
    lt, plain = (now - then for now, then in zip(linear_bias_calls(), calls))
    assert lt >= 4 and plain == 0          # a forward graph and a backward's, two runs: all cuBLASLt's
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0]), "bits moved between two runs"
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    want = {"y": x64 @ w64.T + b, "x": dy64 @ w64, "w": dy64.T @ x64, "b": dy64.sum(axis=0)}
    for k, v in want.items():
        # float32 sums of d_in (or rows) terms: a relative error of a few 1e-7 of the terms' size
        bound = 1e-6 * np.sqrt(max(d_in, rows, d_out)) * np.abs(v).max()
        assert np.abs(runs[0][k] - v).max() <= bound, (k, np.abs(runs[0][k] - v).max() / np.abs(v).max())


def linear_bias_calls() -> tuple[int, int]:
    """LINEAR_BIAS nodes computed so far in this process: (by cuBLASLt, by the plain path)."""
    lt, plain = ffi.new("int64_t *"), ffi.new("int64_t *")
    lib.th_cuda_linear_bias_calls(lt, plain)
    return lt[0], plain[0]


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_a_bias_on_rows_cublaslt_cannot_take_goes_the_plain_way_and_matches_float64(backend):
    """x a view that starts 41 floats into its tensor (not 16-byte aligned, which the cuBLASLt
    plans declare): b written into the rows, cuBLAS's product added (beta 1); the same values."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    rng = np.random.default_rng(10)
    rows, d_in, d_out = 50, 41, 24
    x, w = rng.normal(size=(rows + 1, d_in)).astype(np.float32), rng.normal(size=(d_out, d_in)).astype(np.float32)
    b = rng.normal(size=d_out).astype(np.float32)
    calls = linear_bias_calls()
    prog = get_engine(backend).program()
    fg = prog.forward({"y": blocks.linear(prog.constant("x", x).view_rows(1, rows), prog.param("w", w),
                                          prog.param("b", b))})
    y = fg.run({})["y"]
    assert "linear_bias" in kernel_names(fg.graph)
    lt, plain = (now - then for now, then in zip(linear_bias_calls(), calls))
    assert lt == 0 and plain >= 1
    want = x[1:].astype(np.float64) @ w.astype(np.float64).T + b
    assert np.abs(y - want).max() <= 1e-6 * np.sqrt(d_in) * np.abs(want).max()


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
    assert kernel_names(trainer.gb_grad) == ["get_rows_back"] and "GET_ROWS_BACK" not in ops_of(trainer.gb_grad)


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
    assert kernel_names(trainer.gb_grad) == ["get_rows_back"]
    want = np.zeros((vocab, d), np.float32)
    for r, v in enumerate(ids):
        want[v] += dy[r]                               # float32, in order
    assert np.array_equal(prog.read(trainer.grad_acc["emb"]), want)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", [(3, 37), (64, 96)])       # a float at a time, and a float4
def test_adds_of_one_shape_on_cuda_are_ours_and_exact(backend, shape):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    a, b = RNG.normal(size=shape).astype(np.float32), RNG.normal(size=shape).astype(np.float32)
    prog = get_engine(backend).program()
    fg = prog.forward({"y": prog.constant("a", a) + prog.constant("b", b)})
    assert np.array_equal(fg.run({})["y"], a + b)
    assert kernel_names(fg.graph) == ["add"]


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
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(kernel_names(trainer.gb_opt))
    assert kernel_names(trainer.gb_opt).count("adamw") == len(ADAMW_SHAPES)       # (and the loss's adds)
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
    assert kernel_names(trainer.gb_opt).count("adamw") == len(ADAMW_MANY)
    for i, shape in enumerate(ADAMW_MANY):
        # adamw_program's draws, then only parameter i in a program of its own
        alone = get_engine(backend).program()
        rng = np.random.default_rng(17)
        drawn = [(rng.normal(size=s).astype(np.float32), rng.normal(size=s).astype(np.float32)) for s in ADAMW_MANY]
        p = alone.param("p", drawn[i][0])
        alone_trainer = alone.trainer(alone.scalar_loss((p * alone.constant("c", drawn[i][1])).sum()), "bias_corrected")
        for row in rows:
            alone_trainer.step({}, row)
        assert "adamw" not in kernel_names(alone_trainer.gb_opt)
        ours, ggmls = prog.read(prog.params[f"p{i}"]), alone.read(p)
        assert np.array_equal(ours, ggmls), (shape, np.abs(ours - ggmls).max())
        assert not np.array_equal(ours, drawn[i][0])                   # it did step


def kernel_names(graph) -> list[str]:
    names = (lib.th_cuda_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph)))
    return [ffi.string(n).decode() for n in names if n != ffi.NULL]


def test_the_cuda_rewrite_fuses_attention_and_orders_its_copies_in_every_graph():
    """Built on cpu (never computed here): P, O and the backward's dP, dS, dk, dvt, dq become the
    fused kernels' nodes, S computes nothing; q, k, v^T and dO are read in place (their conts
    fold); dQ is computed by the cont that permuted it back; the conts that permute dK and dV
    back become rooms that the backward writes (their slices fold), and in each graph a room
    comes just before the node that writes it; O's cont copies out of the forward's node."""
    prog, trainer, fg = attention_program("cpu", 2, 8, 32, 2)
    assert ops_of(trainer.gb_grad).count("SOFT_MAX") == 1
    # 3 + 4 nodes of attention's, dq's product folded into its cont (2), the 4 operand conts
    # folded, the 3 conts left (marked, then a room or a slice_cont with the slice folded: 1 + 2
    # each), and x's gradients from q, k and v: 2 ADDs of products, each marked with its 2 parts folded
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 3 + 4 + 2 + 4 + 3 * 3 + 2 * 3
    assert kernel_names(trainer.gb_grad) == [
        "folded", "folded", "folded", "attention", "folded", "slice_cont", "folded", "folded", "attention_prep",
        "room", "room", "attention_back", "folded", "folded", "attention_dq", "folded", "folded", "folded",
        "folded", "product_sum"]
    ops = ops_of(trainer.gb_grad)
    assert "SOFT_MAX" not in ops and "SOFT_MAX_BACK" not in ops and "CONT" not in ops
    assert ops.count("OUT_PROD") == 12 - 4 - 3      # the 4 weights' and wo's input's stay
    # gb_opt holds the same nodes in its own order: nothing new to mark but AdamW's run (one a
    # parameter), and its copies follow the backward
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(prog.params)
    names = [n for n in kernel_names(trainer.gb_opt) if n not in ("folded", "product_sum", "adamw")]
    assert names[-5:] == ["attention_prep", "room", "room", "attention_back", "attention_dq"]
    assert lib.th_cuda_rewrite(fg.graph, 1) == 0


def test_the_cuda_rewrite_fuses_the_backward_after_a_forward_graph_folded_the_operands():
    """A forward-only graph rewritten first (an evaluation before the first step) folds q's, k's
    and v^T's conts; the training graph's backward still finds its products through the folded
    conts, and reads the same views."""
    prog, trainer, fg = attention_program("cpu", 2, 8, 32, 2)
    assert lib.th_cuda_rewrite(fg.graph, 1) == 3 + 3 + 1 + 2
    assert kernel_names(fg.graph) == ["folded", "folded", "folded", "attention", "folded", "slice_cont"]
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 4 + 2 + 1 + 2 * 3 + 2 * 3
    assert "attention_dq" in kernel_names(trainer.gb_grad)
    assert "CONT" not in ops_of(trainer.gb_grad) and ops_of(trainer.gb_grad).count("OUT_PROD") == 5


def test_a_forward_graph_built_after_the_rewrite_still_reaches_the_fused_forward():
    """Sampling after training: a forward graph built after the training graph was rewritten
    reaches the fused forward through O's copy (O is not a room: a room has no sources). A graph
    that held a room without its writer would be refused, not computed."""
    prog, trainer, early = attention_program("cpu", 2, 8, 32, 2)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    late = prog.forward({"y": early.outputs["y"]})
    assert lib.th_cuda_rewrite(late.graph, 1) == 0          # every node marked already
    # the folded nodes are no one's sources any more: the late graph holds just what computes
    assert kernel_names(late.graph) == ["attention", "slice_cont"]
    assert ops_of(late.graph).count("MUL_MAT") == 4                  # q, k, v and the output's


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_a_forward_graph_built_after_a_step_on_cuda_gives_the_early_graphs_values(backend):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    prog, trainer, early = attention_program(backend, 2, 130, 128, 2)
    trainer.grads_only({})
    late = prog.forward({"y": early.outputs["y"]})
    assert np.array_equal(late.run({})["y"], early.run({})["y"])


def test_the_cuda_rewrite_keeps_conts_that_are_not_a_head_permute_of_one_projection():
    """Grouped-query heads: k and v^T are REPEATs of the kv heads (nothing to fold), q's and dO's
    conts fold, dq's cont computes dQ; dk and dv are sliced whole (REPEAT_BACK sums their heads
    back), and the conts of v's permute and of dv's stay copies."""
    prog, trainer, fg = attention_program("cpu", 2, 8, 64, 2, n_kv_head=1)
    # attention's 3 + 4 + 2, 2 folds, 3 conts (O's then a slice_cont: 2 more) and 2 product sums (3 each)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 3 + 4 + 2 + 2 + 3 + 2 + 2 * 3
    names = kernel_names(trainer.gb_grad)
    assert names.count("attention_dq") == 1 and names.count("slice") == 2 and names.count("cont") == 2
    assert names.count("room") == 0 and names.count("slice_cont") == 1
    assert ops_of(trainer.gb_grad).count("REPEAT_BACK") == 2


def test_the_cuda_rewrite_reads_grouped_kv_heads_in_place_in_either_graph_order():
    """Grouped-query heads (4 query heads, 2 kv heads) with the rewrite's flag 2: the attention's
    nodes read k's and v^T's kv heads themselves (group 2 in their parameters), the REPEATs fold,
    and the REPEAT_BACKs that summed dK and dV over each group become the rooms the backward writes
    the sums into (here the CONTs that permute them back: the sums fold), whether the training
    graph or a forward graph is rewritten first. Flag 1 keeps the repeats, as before."""
    def attention_nodes(graph):
        nodes = (lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph)))
        return [t for t in nodes if lib.th_cuda_kernel_name(t) != ffi.NULL and
                ffi.string(lib.th_cuda_kernel_name(t)).decode().startswith("attention")]

    def group_of(t):                                  # th_attention_params.group: op_params[2 + 4]
        params = ffi.new("int32_t[16]")
        lib.th_lowering_op_params(t, params)
        return params[6]

    def heads(t, src):                                # a source's heads, ne2 ne3
        ne, nb = ffi.new("int64_t[4]"), ffi.new("size_t[4]")
        lib.th_tensor_shape(lib.th_tensor_src(t, src), ne, nb)
        return ne[2] * ne[3]

    for first in ("training", "forward"):
        prog, trainer, fg = attention_program("cpu", 2, 8, 64, 4, n_kv_head=2)
        repeats = ops_of(trainer.gb_grad).count("REPEAT")
        if first == "forward":
            assert lib.th_cuda_rewrite(fg.graph, 3) > 0
            assert "REPEAT" not in ops_of(fg.graph) and "CONT" not in ops_of(fg.graph)
        assert lib.th_cuda_rewrite(trainer.gb_grad, 3) > 0
        names, ops = kernel_names(trainer.gb_grad), ops_of(trainer.gb_grad)
        assert names.count("room") == 2 and "slice" not in names and "cont" not in names, (first, names)
        assert "REPEAT_BACK" not in ops and "CONT" not in ops and ops.count("REPEAT") == repeats - 2, first
        nodes = attention_nodes(trainer.gb_grad)
        assert len(nodes) == 4 and all(group_of(t) == 2 for t in nodes), first
        fwd = next(t for t in nodes if ffi.string(lib.th_cuda_kernel_name(t)).decode() == "attention")
        assert (heads(fwd, 0), heads(fwd, 1), heads(fwd, 2)) == (2 * 4, 2 * 2, 2 * 2)   # q: B H; k, v^T: B Hkv
        assert lib.th_cuda_rewrite(trainer.gb_opt, 3) == len(prog.params)
    prog, trainer, fg = attention_program("cpu", 2, 8, 64, 4, n_kv_head=2)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    assert ops_of(trainer.gb_grad).count("REPEAT_BACK") == 2
    assert all(group_of(t) == 1 for t in attention_nodes(trainer.gb_grad))


@pytest.mark.parametrize("why, kwargs, flag", [
    ("a head size the kernels lack (8)", dict(d=16), 1),
    ("fusion not asked for", dict(d=32), 0),
])
def test_the_cuda_rewrite_leaves_attention_to_ggml(why, kwargs, flag):
    prog, trainer, fg = attention_program("cpu", 2, 8, n_head=2, **kwargs)
    lib.th_cuda_rewrite(trainer.gb_grad, flag)
    assert "attention" not in kernel_names(trainer.gb_grad), why
    assert ops_of(trainer.gb_grad).count("SOFT_MAX_BACK") == 1, why


def attention_values(**shape) -> dict[str, np.ndarray]:
    """The attention block's output and gradients on cuda, on the fused kernels (grouped-query
    heads' kv heads read in place: no REPEAT_BACK)."""
    prog, trainer, fg = attention_program("cuda", **shape)
    out = {"y": fg.run({})["y"]}
    trainer.grads_only({})
    out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "wq", "wk", "wv", "wo")})
    assert "attention_back" in kernel_names(trainer.gb_grad) + kernel_names(fg.graph)
    assert "REPEAT_BACK" not in ops_of(trainer.gb_grad)
    return out


def attention_values_at(precision: str, runs: int, **shape) -> list[dict[str, np.ndarray]]:
    """attention_values `runs` times at `precision` (fp32 again after); skips where ggml-cuda was
    built without our kernels."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine("cuda")
    engine.set_precision(precision)
    try:
        return [attention_values(**shape) for _ in range(runs)]
    finally:
        engine.set_precision("fp32")


# the fused attention's shapes: tiles whole and partial, grouped heads, no mask
ATTENTION_SHAPES = [
    dict(b=2, t=64, d=128, n_head=2),                         # one tile, head size 64
    dict(b=3, t=200, d=64, n_head=2),                         # partial tiles, head size 32
    dict(b=1, t=130, d=96, n_head=6, n_kv_head=2),            # grouped-query heads, head size 16
    dict(b=2, t=37, d=128, n_head=2, causal=False),           # vit's kind: no mask, odd length
    dict(b=1, t=300, d=128, n_head=2, causal=False),
]


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_fused_attention_on_cuda_matches_float64_and_repeats_its_bits(backend, shape):
    """fp32: the fused kernels against the float64 block (to which ggml's fp32 nodes on the cpu agree
    within 2e-6 of the largest element: test_the_float64_attention_reference_agrees_with_ggmls_nodes_on_cpu),
    within 1e-5; the same bits on a second run."""
    fused, again = attention_values_at("fp32", 2, **shape)
    for name, want in attention_float64(**shape).items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, (name, err)
        assert np.array_equal(got, again[name]), name


def test_the_float64_attention_reference_agrees_with_ggmls_nodes_on_cpu():
    """The reference the bf16 test below holds the tensor-core kernels to is the block's own math:
    ggml's fp32 nodes on the cpu agree with it to fp32's rounding."""
    for shape in (dict(b=2, t=37, d=64, n_head=2), dict(b=2, t=37, d=64, n_head=2, causal=False),
                  dict(b=1, t=30, d=96, n_head=6, n_kv_head=2)):
        prog, trainer, fg = attention_program("cpu", **shape)
        got = {"y": fg.run({})["y"]}
        trainer.grads_only({})
        got.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "wq", "wk", "wv", "wo")})
        for name, want in attention_float64(**shape).items():
            err = np.abs(got[name] - want).max() / np.abs(want).max()
            assert err < 2e-6, (shape, name, err)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", [
    *ATTENTION_SHAPES,
    dict(b=1, t=1024, d=128, n_head=2),                       # gpt2-small's length
])
def test_fused_attention_in_bf16_matches_float64_within_its_rounding_and_repeats_its_bits(backend, shape):
    """precision = bf16 (issue 32): the forward, backward and dQ kernels on tensor cores (bf16 tiles,
    fp32 sums; th-attention.cu's mma kernels), the block's products in bf16 too. Against the float64
    block: within 4 u of each output's largest element, u = 2^-8 bf16's unit roundoff (a value passes
    through at most five products, each rounding its inputs by at most u; the errors of the sums
    over d, t and keys partly cancel; fp32's are printed beside for scale).
    The same bits on a second run, and not fp32's."""
    u = 2.0**-8
    fused, again = attention_values_at("bf16", 2, **shape)
    (fp32,) = attention_values_at("fp32", 1, **shape)
    for name, want in attention_float64(**shape).items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"bf16 attention {shape} {name}: {err:.3g} of the largest element from float64 (fp32 fused: "
              f"{float(np.abs(fp32[name] - want).max() / np.abs(want).max()):.3g})")
        assert err < 4 * u, (name, err)
        assert np.array_equal(got, again[name]), name
        assert not np.array_equal(got, fp32[name]), name


# attentions that cuDNN takes at bf16 (head size 32 or 64, T a multiple of 8)
CUDNN_ATTENTION_SHAPES = [
    dict(b=3, t=200, d=64, n_head=2),                         # head size 32, partial tiles
    dict(b=2, t=24, d=64, n_head=2, n_kv_head=1),             # llama's golden config, head size 32: 2 heads on 1 kv
    dict(b=2, t=64, d=64, n_head=2, n_kv_head=1),             # the same, 64 tokens
    dict(b=2, t=200, d=256, n_head=8, n_kv_head=2),           # groups of 4
    dict(b=1, t=256, d=512, n_head=8, n_kv_head=4),           # head size 64, groups of 2
]


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", CUDNN_ATTENTION_SHAPES)
def test_cudnn_attention_in_bf16_matches_float64_as_ours_does(backend, shape, monkeypatch):
    """cuDNN's fused attention at bf16 (th-attention.cu, "cuDNN"): q, k and v read in place (bf16
    products; narrowed f32 operands, as RoPE's outputs are, run in tests/test_precision.py), grouped
    heads' backward with k and v repeated and each group's dK and dV summed by us. Against the
    float64 block within 4 u of each output's largest element (the bound of our bf16 kernels' test
    above), beside our kernels for scale; the same bits on a second run, and not ours (so cuDNN ran).
    (Operands whose batches are laid out unlike each other's, as in llama's graph, are run by
    tests/test_precision.py, test_at_bf16_cudnn_attention_repeats_and_agrees_with_fp32[llama].)"""
    if not lib.th_cudnn_attention_built():
        pytest.skip("this cuda build has no cuDNN attention (native/build.py: TOYHARNESS_CUDNN)")
    u = 2.0**-8
    cudnn, again = attention_values_at("bf16", 2, **shape)
    monkeypatch.setenv("TOYHARNESS_CUDNN_ATTENTION", "0")
    (ours,) = attention_values_at("bf16", 1, **shape)
    errors = {}
    for name, want in attention_float64(**shape).items():
        assert np.isfinite(cudnn[name]).all(), name
        err, err_ours = (float(np.abs(m[name] - want).max() / np.abs(want).max()) for m in (cudnn, ours))
        errors[name] = err
        print(f"cuDNN's attention {shape}, {name}: {err:.3g} of the largest "
              f"element from float64 (ours: {err_ours:.3g})")
    for name, err in errors.items():
        assert err < 4 * u, (name, err)
        assert np.array_equal(cudnn[name], again[name]), name
    assert any(not np.array_equal(cudnn[name], ours[name]) for name in errors)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", [
    *ATTENTION_SHAPES,
    dict(b=1, t=1024, d=128, n_head=2),                       # gpt2-small's length
    dict(b=1, t=330, d=512, n_head=8, n_kv_head=2),           # grouped, split by query head, head size 64
])
def test_fused_attention_in_tf32_matches_float64_within_its_rounding_and_repeats_its_bits(backend, shape):
    """precision = tf32: the forward, backward and dQ kernels on tensor cores in TF32 (fp32 tiles
    rounded to nearest TF32, fp32 sums; th-attention.cu's tf kernels), the block's products in TF32
    too. Against the float64 block: within 4 u of each output's largest element, u = 2^-11 TF32's
    unit roundoff (bf16's bound, argued there), beside fp32's for scale. The same bits on a second
    run, and not fp32's."""
    u = 2.0**-11
    fused, again = attention_values_at("tf32", 2, **shape)
    (fp32,) = attention_values_at("fp32", 1, **shape)
    for name, want in attention_float64(**shape).items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err, err_fp32 = (float(np.abs(m[name] - want).max() / np.abs(want).max()) for m in (fused, fp32))
        print(f"tf32 attention {shape} {name}: {err:.3g} of the largest element from float64 "
              f"(fp32: {err_fp32:.3g})")
        assert err < 4 * u, (name, err)
        assert np.array_equal(got, again[name]), name
        assert not np.array_equal(got, fp32[name]), name


def swiglu_program(backend: str, rows: int, d: int, seed: int = 23, cuda_kernels: bool = True):
    """y = silu(g) * u weighted by constants c: g's gradient is SILU_BACK(MUL(c, u), g), u's
    MUL(SILU(g), c). g and u are 2 times parameters holding their halves (exact), so that their
    gradients are nodes of the graph as in a model (a parameter's gradient is a graph output, which
    the rewrite leaves alone), and the parameters' gradients twice theirs, exactly. Without
    `cuda_kernels` a cuda program leaves every node to ggml-cuda (the reference)."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    prog.cuda_kernels = prog.cuda_kernels and cuda_kernels
    g = prog.param("g", (rng.normal(size=(rows, d)) * 2).astype(np.float32)).scale(2.0)
    u = prog.param("u", (rng.normal(size=(rows, d)) * 0.5).astype(np.float32)).scale(2.0)
    y = g.swiglu(u) * prog.constant("c", rng.normal(size=(rows, d)).astype(np.float32))
    return prog, prog.trainer(prog.scalar_loss(y.sum()), "bias_corrected")


def room_before_writer(graph) -> bool:
    names = kernel_names_in_order(graph)
    return names.index("room") < names.index("swiglu_back")


def kernel_names_in_order(graph) -> list[str]:
    out = []
    for i in range(lib.ggml_graph_n_nodes(graph)):
        name = lib.th_cuda_kernel_name(lib.ggml_graph_node(graph, i))
        out.append(ffi.string(name).decode() if name != ffi.NULL else "")
    return out


def test_the_cuda_rewrite_computes_swiglus_backward_in_one_node():
    """Built on cpu: ggml's backward of SwiGLU, silu_back(grad * up, gate) for gate and
    silu(gate) * grad for up, is one node of ours writing up's gradient into that MUL's node (a
    room, placed before it in every graph), the inner MUL and the SILU folded."""
    prog, trainer = swiglu_program("cpu", 6, 10)
    muls = ops_of(trainer.gb_grad).count("MUL")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) >= 4
    names = kernel_names(trainer.gb_grad)
    assert names.count("swiglu_back") == 1 and names.count("room") == 1 and "silu_back_mul" not in names
    assert "SILU_BACK" not in ops_of(trainer.gb_grad) and "SILU" not in ops_of(trainer.gb_grad)
    assert ops_of(trainer.gb_grad).count("MUL") == muls - 2 and room_before_writer(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) >= 0 and kernel_names(trainer.gb_opt).count("swiglu_back") == 1
    assert room_before_writer(trainer.gb_opt)


def test_without_ups_gradient_the_cuda_rewrite_fuses_the_gate_gradient_alone():
    """up a constant (no gradient): silu_back(grad * up, gate) alone, SILU_BACK_MUL, no room."""
    rng = np.random.default_rng(2)
    prog = get_engine("cpu").program()
    g = prog.param("g", rng.normal(size=(6, 10)).astype(np.float32))
    u = prog.constant("u", rng.normal(size=(6, 10)).astype(np.float32))
    trainer = prog.trainer(prog.scalar_loss((g.swiglu(u) * u).sum()), "bias_corrected")
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    names = kernel_names(trainer.gb_grad)
    assert names.count("silu_back_mul") == 1 and "swiglu_back" not in names and "room" not in names


def swiglu_gradients(backend: str, ours: bool, rows: int, d: int) -> dict[str, np.ndarray]:
    """g's and u's gradients on our kernels, or (not `ours`) on ggml-cuda's nodes alone"""
    prog, trainer = swiglu_program(backend, rows, d, cuda_kernels=ours)
    trainer.grads_only({})
    assert ("swiglu_back" in kernel_names(trainer.gb_grad)) == ours
    return {n: prog.read(trainer.grad_acc[n]) for n in ("g", "u")}


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows,d", [(96, 160), (7, 13)])      # float4 path; odd count: one float at a time
def test_swiglus_backward_in_one_kernel_on_cuda_is_ggmls_bits(backend, rows, d):
    """The fused kernel against ggml's nodes (MUL then SILU_BACK for gate, SILU then MUL for up,
    which ggml-cuda fuses itself): every bit of both gradients."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    fused = swiglu_gradients(backend, True, rows, d)
    ggml = swiglu_gradients(backend, False, rows, d)
    for name in ("g", "u"):
        assert np.isfinite(fused[name]).all(), name
        assert np.array_equal(fused[name].view(np.uint32), ggml[name].view(np.uint32)), name
    # and it is silu's derivative: float64 within fast-math's expf and division (a few ulp)
    rng = np.random.default_rng(23)
    g = 2 * (rng.normal(size=(rows, d)) * 2).astype(np.float32).astype(np.float64)
    u = 2 * (rng.normal(size=(rows, d)) * 0.5).astype(np.float32).astype(np.float64)
    c = rng.normal(size=(rows, d)).astype(np.float32).astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-g))
    want_g, want_u = c * u * s * (1.0 + g * (1.0 - s)), c * g * s
    assert (np.abs(fused["g"] / 2 - want_g) <= 1e-5 * np.abs(c * u) + 1e-6).all()
    assert (np.abs(fused["u"] / 2 - want_u) <= 1e-5 * np.abs(c * g) + 1e-6).all()


def test_the_cuda_rewrite_takes_a_split_swiglu():
    """Built on cpu: the GLU of split halves (ggml_swiglu_split) becomes ours, in the forward and the
    training graph."""
    prog, trainer = swiglu_program("cpu", 6, 10)
    assert "SWIGLU" in ops_of(trainer.gb_grad)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert kernel_names(trainer.gb_grad).count("swiglu") == 1 and "SWIGLU" not in ops_of(trainer.gb_grad)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("rows,d", [(96, 160), (7, 13)])      # float4 path; odd count: one float at a time
def test_swiglu_on_cuda_is_ours_and_gives_ggmls_bits(backend, rows, d):
    """Our SwiGLU forward against ggml-cuda's GLU node: every bit of silu(g) * u, and it is that
    (float64, within fast-math's expf and division)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    rng = np.random.default_rng(29)
    g, u = (rng.normal(size=(rows, d)) * 3).astype(np.float32), rng.normal(size=(rows, d)).astype(np.float32)
    out = {}
    for how in ("ours", "ggml"):
        prog = get_engine(backend).program()
        prog.cuda_kernels = how == "ours"           # else every node ggml-cuda's
        fg = prog.forward({"y": prog.constant("g", g).swiglu(prog.constant("u", u))})
        out[how] = fg.run({})["y"]
        assert kernel_names(fg.graph) == (["swiglu"] if how == "ours" else [])
    assert np.array_equal(out["ours"].view(np.uint32), out["ggml"].view(np.uint32))
    g64 = g.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u
    assert (np.abs(out["ours"] - want) <= 1e-6 * np.abs(want) + 1e-7).all()


def lora_program(backend: str, scale: float, output_side: bool, cuda_kernels: bool | None = None, rows: int = 96,
                 d_in: int = 160, d_out: int = 200, rank: int = 8, seed: int = 31):
    """W x + scale B A x (blocks.lora_linear), or with `output_side` the scale written on B A x's
    (rows, d_out) output by hand: the placement lora_linear keeps off cuda."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    if cuda_kernels is not None:
        prog.cuda_kernels = cuda_kernels
    x = prog.param("x", rng.normal(size=(rows, d_in)).astype(np.float32))
    w = prog.param("w", (rng.normal(size=(d_out, d_in)) * 0.1).astype(np.float32))
    a = prog.param("a", (rng.normal(size=(rank, d_in)) * 0.1).astype(np.float32))
    b = prog.param("b", (rng.normal(size=(d_out, rank)) * 0.1).astype(np.float32))
    if output_side:
        y = blocks.linear(x, w) + blocks.linear(blocks.linear(x, a), b).scale(scale)
    else:
        y = blocks.lora_linear(x, w, a, b, scale)
    loss = prog.scalar_loss((y * prog.constant("c", rng.normal(size=(rows, d_out)).astype(np.float32))).sum())
    return prog, y, prog.trainer(loss, "bias_corrected")


def scale_sizes(graph) -> list[int]:
    """the element count of each SCALE node (rows x rank or rows x out)"""
    nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
    return [int(lib.ggml_nelements(t)) for t in nodes if ffi.string(lib.ggml_op_desc(t)).decode() == "SCALE"]


@pytest.mark.parametrize("scale,where", [(1.0, []), (2.0, [96 * 8]), (0.5, [96 * 8]), (-4.0, [96 * 8]),
                                         (0.3, [96 * 200]), (1.5, [96 * 200])])
def test_on_cuda_an_exact_lora_scale_goes_on_the_rank_product(scale, where):
    """Built on cpu as cuda builds it (cuda_kernels): a power of two scales A x (rows, rank), 1
    adds no node, any other scale stays on the (rows, out) output; without our cuda kernels
    (cpu, vulkan, metal) the output keeps it whatever it is."""
    prog, y, trainer = lora_program("cpu", scale, False, cuda_kernels=True)
    assert scale_sizes(prog.forward({"y": y}).graph) == where
    prog, y, trainer = lora_program("cpu", scale, False, cuda_kernels=False)
    assert scale_sizes(prog.forward({"y": y}).graph) == [96 * 200]
    assert not blocks.exact_power_of_two(0.0) and not blocks.exact_power_of_two(float("inf"))


def lora_values(scale: float, output_side: bool) -> dict[str, np.ndarray]:
    prog, y, trainer = lora_program("cuda", scale, output_side)
    out = {"y": prog.forward({"y": y}).run({})["y"]}
    trainer.grads_only({})
    out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "w", "a", "b")})
    return out


@pytest.mark.parametrize("precision", [pytest.param(p, marks=needs("cuda")) for p in ("fp32", "bf16")])
@pytest.mark.parametrize("scale", [2.0, 0.5, 1.0])
def test_an_exact_lora_scale_on_the_rank_product_changes_no_bit_on_cuda(precision, scale):
    """s B (A x) with s on the (rows, rank) product against s on the (rows, out) output: the same
    bits of y and of every gradient, fp32 and bf16 (a power of two commutes with each rounding)."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine("cuda")
    engine.set_precision(precision)
    try:
        ours, by_hand = lora_values(scale, False), lora_values(scale, True)
    finally:
        engine.set_precision("fp32")
    for name, want in by_hand.items():
        assert np.isfinite(ours[name]).all() and np.abs(want).max() > 0, name
        assert np.array_equal(ours[name].view(np.uint32), want.view(np.uint32)), (precision, scale, name)


def frozen_products_program(backend: str, n_products: int, only: int | None = None, dtype: str = "bf16",
                            rows: int = 96, d_in: int = 256, d_out: int = 192, seed: int = 5):
    """sum over i of (x W_i^T) * c_i with frozen W_i (`dtype`), and a LoRA-like f32 term (x A^T B^T)
    * c (rank 16): x's gradient is n_products frozen OUT_PRODs (th-frozen.cu at bf16) and A's f32 one."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    x = prog.param("x", rng.normal(size=(rows, d_in)).astype(np.float32))
    a = (rng.normal(size=(16, d_in)) * 0.1).astype(np.float32)
    b = (rng.normal(size=(d_out, 16)) * 0.1).astype(np.float32)
    ca = rng.normal(size=(rows, d_out)).astype(np.float32)
    terms = []
    if only in (None, 0):       # (a parameter the loss does not use is refused)
        lora = blocks.linear(blocks.linear(x, prog.param("a", a)), prog.param("b", b))
        terms.append(lora * prog.constant("ca", ca))
    for i in range(n_products):
        w = rng.normal(size=(d_out, d_in)) * 0.05
        c = rng.normal(size=(rows, d_out)).astype(np.float32)
        if only in (None, i + 1):
            terms.append(blocks.linear(x, prog.frozen_array(f"w{i}", w, dtype)) * prog.constant(f"c{i}", c))
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return prog, prog.trainer(prog.scalar_loss(total.sum()), "bias_corrected")


def test_the_cuda_rewrite_sums_frozen_input_gradients_with_the_others():
    """Built on cpu (frozen weights stay in their type there, as on cuda at bf16): x's gradient
    from 3 frozen products and one f32 product is one PRODUCT_SUM; no frozen OUT_PROD is left."""
    prog, trainer = frozen_products_program("cpu", 3)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    # (the forward's 3 ADDs of the terms stay ADDs)
    assert kernel_names(trainer.gb_grad).count("product_sum") == 1 and kernel_names(trainer.gb_grad).count("add") == 3
    nodes = [lib.ggml_graph_node(trainer.gb_grad, i) for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))]
    frozen = [n for n in nodes if ffi.string(lib.ggml_op_desc(n)).decode() == "OUT_PROD"
              and lib.th_tensor_type(lib.th_tensor_src(n, 0)) != GGML_TYPE_F32]
    assert frozen == []


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_frozen_input_gradients_summed_in_one_node_on_cuda_match_the_adds(backend, dtype):
    """At bf16: the PRODUCT_SUM with frozen terms (each added into the sum so far, beta 1) against
    each term computed alone (FROZEN_OUT_PROD or ggml's OUT_PROD, beta 0) summed left to right in
    float32: within a rounding of the running sum (a split k adds its partial sums in cuBLAS's
    order), and its bits run to run."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine(backend)
    engine.set_precision("bf16")
    try:
        summed = []
        for _ in range(2):
            prog, trainer = frozen_products_program(backend, 3, dtype=dtype)
            trainer.grads_only({})
            assert kernel_names(trainer.gb_grad).count("product_sum") == 1, kernel_names(trainer.gb_grad)
            summed.append(prog.read(trainer.grad_acc["x"]))
        alone = []
        for i in range(4):
            prog_i, trainer_i = frozen_products_program(backend, 3, only=i, dtype=dtype)
            trainer_i.grads_only({})
            assert "product_sum" not in kernel_names(trainer_i.gb_grad)
            alone.append(prog_i.read(trainer_i.grad_acc["x"]))
    finally:
        engine.set_precision("fp32")
    assert np.array_equal(summed[0].view(np.uint32), summed[1].view(np.uint32)), "bits moved between two runs"
    added = ((alone[0] + alone[1]) + alone[2]) + alone[3]
    magnitude = sum(np.abs(t) for t in alone)
    differ = int(np.sum(summed[0] != added))
    print(f"frozen product sum ({dtype}): {differ} of {added.size} elements differ from the ADDs' "
          f"(largest {float(np.max(np.abs(summed[0] - added))):.3g})")
    assert (np.abs(summed[0] - added) <= magnitude * 2.0**-22).all()


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
    assert {"cross_entropy", "cross_entropy_back"} <= set(kernel_names(trainer.gb_grad))
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
        names = kernel_names(trainer.gb_grad)
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
