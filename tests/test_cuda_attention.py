"""Fused attention on cuda (native/cuda/th-attention.cu): the rewrite that fuses it and orders its
copies, grouped kv heads read in place, and its values in fp32, tf32 and bf16 (and cuDNN's).

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import DROPOUT_NAME, attention_float64, attention_program
from helpers import cuda_kernel_names, needs, ops_of

from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import get_engine
from toyharness.engine.dropout import dropout_mask, keep_threshold, kept_value, node_id

# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


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
    assert cuda_kernel_names(trainer.gb_grad) == [
        "folded", "folded", "folded", "attention", "folded", "slice_cont", "folded", "folded", "attention_prep",
        "room", "room", "attention_back", "folded", "folded", "attention_dq", "folded", "folded", "folded",
        "folded", "product_sum"]
    ops = ops_of(trainer.gb_grad)
    assert "SOFT_MAX" not in ops and "SOFT_MAX_BACK" not in ops and "CONT" not in ops
    assert ops.count("OUT_PROD") == 12 - 4 - 3      # the 4 weights' and wo's input's stay
    # gb_opt holds the same nodes in its own order: nothing new to mark but AdamW's run (one a
    # parameter), and its copies follow the backward
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) == len(prog.params)
    names = [n for n in cuda_kernel_names(trainer.gb_opt) if n not in ("folded", "product_sum", "adamw")]
    assert names[-5:] == ["attention_prep", "room", "room", "attention_back", "attention_dq"]
    assert lib.th_cuda_rewrite(fg.graph, 1) == 0


def test_the_cuda_rewrite_fuses_the_backward_after_a_forward_graph_folded_the_operands():
    """A forward-only graph rewritten first (an evaluation before the first step) folds q's, k's
    and v^T's conts; the training graph's backward still finds its products through the folded
    conts, and reads the same views."""
    prog, trainer, fg = attention_program("cpu", 2, 8, 32, 2)
    assert lib.th_cuda_rewrite(fg.graph, 1) == 3 + 3 + 1 + 2
    assert cuda_kernel_names(fg.graph) == ["folded", "folded", "folded", "attention", "folded", "slice_cont"]
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == 4 + 2 + 1 + 2 * 3 + 2 * 3
    assert "attention_dq" in cuda_kernel_names(trainer.gb_grad)
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
    assert cuda_kernel_names(late.graph) == ["attention", "slice_cont"]
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
    names = cuda_kernel_names(trainer.gb_grad)
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
        names, ops = cuda_kernel_names(trainer.gb_grad), ops_of(trainer.gb_grad)
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


def node_params(t) -> list[int]:
    """A node's op_params, as int32 words."""
    params = ffi.new("int32_t[16]")
    lib.th_lowering_op_params(t, params)
    return list(params)


@pytest.mark.parametrize("first", ["training", "forward"])
def test_the_cuda_rewrite_fuses_attention_with_dropout_where_its_kernels_draw_the_mask(first):
    """Dropout on the attention weights with the rewrite's flag 8 (bf16's and tf32's kernels draw
    the mask themselves): the mask node, P times it and dP's MUL by it compute nothing (ops NONE,
    one float each), the forward node reads the program's fed key and carries the mask's stream
    words (node, threshold, kept value: dropout_mask.h's), whichever graph is rewritten first.
    Without flag 8 (fp32's kernels do not draw it) the attention stays composed."""
    p = 0.1
    prog, trainer, fg = attention_program("cpu", 2, 8, 32, 2, dropout=p)
    graph = trainer.gb_grad
    nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
    mask = next(t for t in nodes if ffi.string(lib.ggml_op_desc(t)).decode() == "CUSTOM")
    masked = [t for t in nodes if lib.th_tensor_src(t, 1) == mask]          # P's and dP's MULs
    assert [ffi.string(lib.ggml_op_desc(t)).decode() for t in masked] == ["MUL", "MUL"]
    graphs = [graph, fg.graph] if first == "training" else [fg.graph, graph]
    assert lib.th_cuda_rewrite(graphs[0], 9) > 0 and lib.th_cuda_rewrite(graphs[1], 9) >= 0
    names, ops = cuda_kernel_names(graph), ops_of(graph)
    assert [n for n in names if n.startswith("attention")] == [
        "attention", "attention_prep", "attention_back", "attention_dq"], names
    assert "dropout_mask" not in names and "SOFT_MAX" not in ops and "SOFT_MAX_BACK" not in ops
    for t in [mask, *masked]:                       # compute nothing, hold one float
        assert ffi.string(lib.ggml_op_desc(t)).decode() == "NONE" and lib.ggml_nelements(t) == 1
    fwd = next(t for t in nodes if cuda_kernel_name_of(t) == "attention")
    assert lib.th_tensor_src(fwd, 3) == prog._dropout.key.ptr
    words = np.array(node_params(fwd)[7:11], np.int32)
    threshold = keep_threshold(p)
    assert words[:3].view(np.uint32).tolist() == [node_id(DROPOUT_NAME), threshold & 0xFFFFFFFF, threshold >> 32]
    assert words[3:].view(np.float32)[0] == kept_value(p)
    prog, trainer, fg = attention_program("cpu", 2, 8, 32, 2, dropout=p)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0
    names = cuda_kernel_names(trainer.gb_grad)
    assert "attention" not in names and "dropout_mask" in names, names


def cuda_kernel_name_of(t) -> str | None:
    name = lib.th_cuda_kernel_name(t)
    return None if name == ffi.NULL else ffi.string(name).decode()


@pytest.mark.parametrize("why, kwargs, flag", [
    ("a head size the kernels lack (8)", dict(d=16), 1),
    ("fusion not asked for", dict(d=32), 0),
])
def test_the_cuda_rewrite_leaves_attention_to_ggml(why, kwargs, flag):
    prog, trainer, fg = attention_program("cpu", 2, 8, n_head=2, **kwargs)
    lib.th_cuda_rewrite(trainer.gb_grad, flag)
    assert "attention" not in cuda_kernel_names(trainer.gb_grad), why
    # its softmax's backward is then ours alone, with ggml's bits (tests/test_cuda_cross_entropy.py)
    assert cuda_kernel_names(trainer.gb_grad).count("soft_max_back") == 1, why
    assert "SOFT_MAX_BACK" not in ops_of(trainer.gb_grad), why


def attention_values(**shape) -> dict[str, np.ndarray]:
    """The attention block's output and gradients on cuda, on the fused kernels (grouped-query
    heads' kv heads read in place: no REPEAT_BACK). With `dropout`, the gradients are those of
    the first training forward (dropout_seed DROPOUT_SEED), y evaluation's (no mask)."""
    prog, trainer, fg = attention_program("cuda", **shape)
    prog.dropout_seed = DROPOUT_SEED
    out = {"y": fg.run({})["y"]}
    trainer.grads_only({})
    out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "wq", "wk", "wv", "wo")})
    assert "attention_back" in cuda_kernel_names(trainer.gb_grad) + cuda_kernel_names(fg.graph)
    assert "dropout_mask" not in cuda_kernel_names(trainer.gb_grad)
    assert "REPEAT_BACK" not in ops_of(trainer.gb_grad)
    return out


DROPOUT_SEED = 1337


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


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("precision, u", [("tf32", 2.0**-11), ("bf16", 2.0**-8)])
@pytest.mark.parametrize("shape", [
    dict(b=2, t=64, d=128, n_head=2),                         # one tile, head size 64
    dict(b=3, t=201, d=64, n_head=2),                         # partial tiles, an odd length: pairs across rows
    dict(b=1, t=130, d=96, n_head=6, n_kv_head=2),            # grouped-query heads, head size 16
    dict(b=1, t=256, d=384, n_head=6),                        # nanoGPT's shakespeare-char attention, one row
])
def test_fused_attention_with_dropout_matches_float64_under_the_numpy_mask(backend, precision, u, shape):
    """Dropout 0.2 on the attention weights inside the tensor-core kernels (th-attention.cu,
    "Dropout on P"): the gradients of the first training forward against the float64 block with
    the numpy reference's mask (engine/dropout.py's stream, the mask node's element order), within
    4 u of each one's largest element (the bound of the tests without dropout above); the
    evaluation forward is the block without dropout. The same bits on a second run."""
    p = 0.2
    fused, again = attention_values_at(precision, 2, dropout=p, **shape)
    b, t, heads = shape["b"], shape["t"], shape["n_head"]
    mask = dropout_mask((b * heads, t, t), p, DROPOUT_SEED, 0, DROPOUT_NAME)
    want = attention_float64(**shape, mask=mask)
    want["y"] = attention_float64(**shape)["y"]
    without = attention_float64(**shape)
    for name, ref in want.items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        print(f"{precision} attention with dropout {shape} {name}: {err:.3g} of the largest element from float64")
        assert err < 4 * u, (name, err)
        assert np.array_equal(got, again[name]), name
        if name != "y":    # the mask mattered: its gradients are not those without dropout
            assert float(np.abs(got - without[name]).max() / np.abs(ref).max()) > 16 * u, name
