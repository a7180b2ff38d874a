"""GELU, SwiGLU, RoPE, conts of permutes and adds: our cuda kernels (native/cuda/th-custom.cu) and the
cuda rewrite that hands them nodes (native/cuda_rewrite.c).

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import cuda_kernel_names, gelu_tanh_f64, kernel_names_in_order, needs, ops_of

from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import blocks, get_engine

RNG = np.random.default_rng(21)
# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


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


def test_the_cuda_rewrite_marks_each_gelu_form_with_its_own_kernels():
    """Built on cpu as cuda builds it (never computed here): blocks.gelu_erf builds its stand-in
    there as on cpu (a SILU named "th.gelu_erf", one node), and the rewrite marks it and its
    SILU_BACK gelu_erf and gelu_erf_back, the tanh form's pair in the same graph gelu and gelu_back,
    each kernel over its own form's input; no SILU is left to compute silu."""
    prog = get_engine("cpu").program()
    prog.cpu_kernels, prog.cuda_kernels = False, True
    xt, xe = (prog.param(n, RNG.normal(size=(4, 8)).astype(np.float32)) for n in ("xt", "xe"))
    yt, ye = blocks.gelu_tanh(xt), blocks.gelu_erf(xe)
    assert ye.name == blocks.GELU_ERF_STAND_IN
    assert [op for op in ops_of(prog.forward({"y": ye}).graph) if op != "NONE"] == ["SILU"]      # one node
    trainer = prog.trainer(prog.scalar_loss(yt.sum() + ye.sum()), "bias_corrected")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) >= 4
    nodes = [lib.ggml_graph_node(trainer.gb_grad, i) for i in range(lib.ggml_graph_n_nodes(trainer.gb_grad))]
    marked = {}
    for node in nodes:
        name = lib.th_cuda_kernel_name(node)
        if name != ffi.NULL and ffi.string(name).decode().startswith("gelu"):
            x = lib.th_tensor_src(node, 0 if ffi.string(name).decode() in ("gelu", "gelu_erf") else 1)
            marked[ffi.string(name).decode()] = x
    assert sorted(marked) == ["gelu", "gelu_back", "gelu_erf", "gelu_erf_back"]
    assert marked["gelu"] == marked["gelu_back"] == xt.ptr and marked["gelu_erf"] == marked["gelu_erf_back"] == xe.ptr
    assert "SILU" not in ops_of(trainer.gb_grad) and "SILU_BACK" not in ops_of(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) >= 0      # the same nodes, marked already (AdamW's are new)
    assert sorted(n for n in cuda_kernel_names(trainer.gb_opt) if n.startswith("gelu")) == sorted(marked)


def test_a_gpt2_with_the_exact_gelu_built_as_cuda_builds_it_has_its_kernels_and_keeps_their_input_bf16(monkeypatch):
    """gpt2 gelu=erf's training graph as cuda builds it: each block's MLP a gelu_erf and a
    gelu_erf_back, no tanh GELU and no SILU, and at bf16 the product they read (LINEAR_BIAS) kept
    bf16 as the tanh form's is (th_gelu_bf16)."""
    from helpers import as_cuda_builds_it, graph_nodes

    from toyharness._ffi import GGML_TYPE_BF16

    _, trainer, _ = as_cuda_builds_it("gpt2", ["n_layer=2", "gelu=erf"], "bf16", monkeypatch)
    names = cuda_kernel_names(trainer.gb_opt)
    assert names.count("gelu_erf") == 2 and names.count("gelu_erf_back") == 2
    assert "gelu" not in names and "gelu_back" not in names
    assert "SILU" not in ops_of(trainer.gb_opt) and "SILU_BACK" not in ops_of(trainer.gb_opt)
    inputs = []
    for node in graph_nodes(trainer.gb_opt):
        name = lib.th_cuda_kernel_name(node)
        if name != ffi.NULL and ffi.string(name).decode() == "gelu_erf":
            t = lib.th_tensor_src(node, 0)
            while ffi.string(lib.ggml_op_desc(t)).decode() == "RESHAPE":
                t = lib.th_tensor_src(t, 0)
            inputs.append(t)
    assert [ffi.string(lib.th_cuda_kernel_name(t)).decode() for t in inputs] == ["linear_bias"] * 2
    assert [lib.th_tensor_type(t) for t in inputs] == [GGML_TYPE_BF16] * 2


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
@pytest.mark.parametrize("n", [5012, 5011])        # a float4 at a time, and one float at a time
def test_gelu_erf_on_cuda_is_one_kernel_each_way_and_within_1e6_of_float64(backend, n):
    """The exact GELU's kernels (blocks.gelu_erf on cuda) against float64 from erfc, far into
    both tails: y within 1e-6 relative; the gradient within 1e-6 of |dy| (|Phi| + |x phi|), the
    scale of its two terms (they cancel near GELU's minimum, x = -0.75). Below 1.2e-38 floats
    flush to zero (ggml-cuda's -use_fast_math): x < -13 gives 0 for values of that size."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    specials = [-100.0, -14.0, -12.0, -8.0, -5.0, -0.7518, -1e-3, -1e-30, 0.0, 1e-30, 1e-3, 1.4142, 5.0, 12.0, 100.0]
    x = np.concatenate([RNG.normal(size=n - len(specials)) * 4, specials]).astype(np.float32)
    dy = RNG.normal(size=x.shape)
    prog = get_engine(backend).program()
    y = blocks.gelu_erf(prog.param("x", x))
    trainer = prog.trainer(prog.scalar_loss((y * prog.constant("w", dy)).sum()), "bias_corrected")
    fg = prog.forward({"y": y})
    got = fg.run({})["y"]
    trainer.grads_only({})
    g = prog.read(trainer.grad_acc["x"])
    assert cuda_kernel_names(fg.graph) == ["gelu_erf"] and ops_of(fg.graph).count("CUSTOM") == 1
    assert "SILU" not in ops_of(fg.graph)
    assert "gelu_erf_back" in cuda_kernel_names(trainer.gb_grad) and "SILU_BACK" not in ops_of(trainer.gb_grad)
    xd, dyd = x.astype(np.float64), dy.astype(np.float32).astype(np.float64)
    cdf = 0.5 * np.vectorize(math.erfc)(-xd / math.sqrt(2))          # no cancellation in the lower tail
    slope = xd * np.exp(-0.5 * xd * xd) / math.sqrt(2 * math.pi)
    assert np.isfinite(got).all() and np.isfinite(g).all()
    assert (np.abs(got - xd * cdf) <= 1e-6 * np.abs(xd * cdf) + 1e-37).all()
    assert (np.abs(g - dyd * (cdf + slope)) <= (1e-6 * (cdf + np.abs(slope)) + 1e-35) * np.abs(dyd)).all()
    assert got[x == -5.0][0] < 0 and abs(got[x == -5.0][0] / (-5.0 * 0.5 * math.erfc(5 / math.sqrt(2))) - 1) < 1e-6
    assert np.abs(got - gelu_tanh_f64(xd)[0]).max() > 1e-4            # not the tanh form


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_a_gpt2_step_with_the_exact_gelu_on_cuda_matches_the_composed_form(backend, monkeypatch):
    """gpt2 gelu=erf on cuda, its GELU our two kernels, against the same run with the GELU composed
    from ggml's ops (Tensor.gelu("none"), Abramowitz and Stegun's erf, absolute error 1.5e-7): the
    same losses to float32's noise, step after step; the two forms' erf differ by a few 1e-7, so
    the first loss agrees to 1e-6 and the later ones, through AdamW, to 1e-4."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    from toyharness.hookspecs import hookimpl
    from toyharness.runner import train

    class Losses:
        def __init__(self):
            self.losses: list[float] = []

        @hookimpl
        def step_end(self, step, loss):
            self.losses.append(loss)

    sets = ["n_layer=2", "d_model=64", "n_head=4", "t_seq=32", "t_batch=8", "bias=false", "gelu=erf",
            "eval_every=100", "checkpoint_every=100"]
    runs, built = {}, {}
    for form, gelu in (("kernels", blocks.GELUS["erf"]), ("composed", lambda x: x.gelu("none"))):
        built[form] = []

        def build(x, gelu=gelu, names=built[form]):
            y = gelu(x)
            names.append(y.name)         # what the MLP's GELU is: the stand-in, or the composed form's last node
            return y

        monkeypatch.setitem(blocks.GELUS, "erf", build)
        runs[form] = Losses()
        train("gpt2", steps=6, backend=backend, sets=sets, write_files=False, progress=False, observers=(runs[form],))
    assert len(built["kernels"]) >= 2 and set(built["kernels"]) == {blocks.GELU_ERF_STAND_IN}
    assert len(built["composed"]) >= 2 and blocks.GELU_ERF_STAND_IN not in built["composed"]
    ours, composed = np.array(runs["kernels"].losses), np.array(runs["composed"].losses)
    assert len(ours) == len(composed) == 6 and np.isfinite(ours).all()
    assert abs(ours[0] - composed[0]) <= 1e-6 * abs(composed[0])
    assert (np.abs(ours - composed) <= 1e-4 * np.abs(composed)).all(), (ours, composed)
    assert ours[-1] < ours[0]                                   # it trains


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
    assert cuda_kernel_names(trainer.gb_grad) == ["rope", "rope"]
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
        return y, prog.read(trainer.grad_acc["x"]), cuda_kernel_names(fg.graph) + cuda_kernel_names(trainer.gb_grad)

    (y, dx, names), (y_ggml, dx_ggml, none) = run(True), run(False)
    assert names.count("rope") == 3 and none == []                 # the forward graph's, and the training graph's two
    assert np.array_equal(y, y_ggml) and np.array_equal(dx, dx_ggml)
    y_cpu = rope_program("cpu", case)[2].run({})["y"]                  # and it is the rotation (fast sin, cos)
    assert np.abs(y - y_cpu).max() < 1e-3 * np.abs(y_cpu).max()


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", [(3, 37), (64, 96)])       # a float at a time, and a float4
def test_adds_of_one_shape_on_cuda_are_ours_and_exact(backend, shape):
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    a, b = RNG.normal(size=shape).astype(np.float32), RNG.normal(size=shape).astype(np.float32)
    prog = get_engine(backend).program()
    fg = prog.forward({"y": prog.constant("a", a) + prog.constant("b", b)})
    assert np.array_equal(fg.run({})["y"], a + b)
    assert cuda_kernel_names(fg.graph) == ["add"]


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


def test_the_cuda_rewrite_computes_swiglus_backward_in_one_node():
    """Built on cpu: ggml's backward of SwiGLU, silu_back(grad * up, gate) for gate and
    silu(gate) * grad for up, is one node of ours writing up's gradient into that MUL's node (a
    room, placed before it in every graph), the inner MUL and the SILU folded."""
    prog, trainer = swiglu_program("cpu", 6, 10)
    muls = ops_of(trainer.gb_grad).count("MUL")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) >= 4
    names = cuda_kernel_names(trainer.gb_grad)
    assert names.count("swiglu_back") == 1 and names.count("room") == 1 and "silu_back_mul" not in names
    assert "SILU_BACK" not in ops_of(trainer.gb_grad) and "SILU" not in ops_of(trainer.gb_grad)
    assert ops_of(trainer.gb_grad).count("MUL") == muls - 2 and room_before_writer(trainer.gb_grad)
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) >= 0 and cuda_kernel_names(trainer.gb_opt).count("swiglu_back") == 1
    assert room_before_writer(trainer.gb_opt)


def test_without_ups_gradient_the_cuda_rewrite_fuses_the_gate_gradient_alone():
    """up a constant (no gradient): silu_back(grad * up, gate) alone, SILU_BACK_MUL, no room."""
    rng = np.random.default_rng(2)
    prog = get_engine("cpu").program()
    g = prog.param("g", rng.normal(size=(6, 10)).astype(np.float32))
    u = prog.constant("u", rng.normal(size=(6, 10)).astype(np.float32))
    trainer = prog.trainer(prog.scalar_loss((g.swiglu(u) * u).sum()), "bias_corrected")
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    names = cuda_kernel_names(trainer.gb_grad)
    assert names.count("silu_back_mul") == 1 and "swiglu_back" not in names and "room" not in names


def swiglu_gradients(backend: str, ours: bool, rows: int, d: int) -> dict[str, np.ndarray]:
    """g's and u's gradients on our kernels, or (not `ours`) on ggml-cuda's nodes alone"""
    prog, trainer = swiglu_program(backend, rows, d, cuda_kernels=ours)
    trainer.grads_only({})
    assert ("swiglu_back" in cuda_kernel_names(trainer.gb_grad)) == ours
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
    assert cuda_kernel_names(trainer.gb_grad).count("swiglu") == 1 and "SWIGLU" not in ops_of(trainer.gb_grad)


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
        assert cuda_kernel_names(fg.graph) == (["swiglu"] if how == "ours" else [])
    assert np.array_equal(out["ours"].view(np.uint32), out["ggml"].view(np.uint32))
    g64 = g.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u
    assert (np.abs(out["ours"] - want) <= 1e-6 * np.abs(want) + 1e-7).all()
