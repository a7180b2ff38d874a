"""Layer norm, RMS norm and a gain alone: our cuda kernels each way, the residual sums and column sums
they take in, and the cuda rewrite that hands them nodes (native/cuda_rewrite.c).

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import cuda_kernel_names, kernel_names_in_order, needs, ops_of

from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import blocks, get_engine

RNG = np.random.default_rng(21)
# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


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
    assert sorted(cuda_kernel_names(trainer.gb_grad)) == ["affine", "folded", "folded", "folded", "layer_norm_back",
                                                      "room", "room"]
    ops = ops_of(trainer.gb_grad)
    assert "RMS_NORM" not in ops and "RMS_NORM_BACK" not in ops
    assert ops.count("MUL") == 2 and ops.count("OUT_PROD") == 1       # the loss's weights; the bias's column sum
    # the same nodes, marked already, and AdamW's steps (one a parameter): a run for each row of
    # two or more: gain and bias (vectors, no weight decay); x, the one matrix, alone on its row,
    # steps on ggml's own kernel (the same bits, tests/test_cuda_adamw.py)
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(prog.params) - 1 == 2
    assert trainer.decayed == ["x"]
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
    names = cuda_kernel_names(trainer.gb_grad)
    assert "column_dot" in names and names.count("room") == 1       # the norm's t alone


def test_at_bf16_layer_norms_backward_takes_its_bias_gradient_too():
    """Built on cpu: stamped bf16, LayerNorm's bias's gradient (OUT_PROD of dy and ones, a bf16
    product) becomes a room that the backward writes (src 6), before it in every graph, every
    reader after it; stamped fp32 or tf32 the product stays, as it does at bf16 without the gain's
    sums to go with (rows wider than the backward's shared memory holds)."""
    from toyharness.engine.graph_rewrites import PRECISION_CODES

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
    names = cuda_kernel_names(trainer.gb_grad)
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
    assert sorted(cuda_kernel_names(trainer.gb_grad)) == ["affine", "affine", "column_dot", "folded", "room"]
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
    assert cuda_kernel_names(fg.graph) == ["affine"]
    trainer.grads_only({})
    assert cuda_kernel_names(trainer.gb_grad).count("affine") == 2
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
        return fg.run({})["y"], cuda_kernel_names(fg.graph)

    (ours, names), (ggmls, none) = norm(True), norm(False)
    assert names == ["rms_norm"] and none == []
    assert np.array_equal(ours, ggmls)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    assert np.abs(ours - want).max() < 1e-5 * np.abs(want).max()          # and it is RMSNorm


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
        assert ("layer_norm_back" in cuda_kernel_names(trainer.gb_grad)) == stand_in
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
        assert "add" not in cuda_kernel_names(fg.graph), kind


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
        assert "room" in cuda_kernel_names(trainer.gb_grad) and "OUT_PROD" not in ops_of(trainer.gb_grad)
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
        assert cuda_kernel_names(trainer.gb_grad).count("add") == residual       # the forward's
    # the residual's gradient is dy itself: x's gradient is LayerNorm's plus dy, one float32 rounding
    assert np.array_equal(dx[True], dx[False] + dy)
