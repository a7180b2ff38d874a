"""Fused attention on cuda (native/cuda/th-attention.cu): the rewrite that fuses it and orders its
copies, grouped kv heads read in place, and its values in fp32, tf32 and bf16 (and cuDNN's).

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import attention_float64, attention_program
from helpers import cuda_kernel_names, needs, ops_of

from toyharness._ffi import cuda_kernels_built, ffi, lib
from toyharness.engine import get_engine

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


@pytest.mark.parametrize("why, kwargs, flag", [
    ("a head size the kernels lack (8)", dict(d=16), 1),
    ("fusion not asked for", dict(d=32), 0),
])
def test_the_cuda_rewrite_leaves_attention_to_ggml(why, kwargs, flag):
    prog, trainer, fg = attention_program("cpu", 2, 8, n_head=2, **kwargs)
    lib.th_cuda_rewrite(trainer.gb_grad, flag)
    assert "attention" not in cuda_kernel_names(trainer.gb_grad), why
    assert ops_of(trainer.gb_grad).count("SOFT_MAX_BACK") == 1, why


def test_fused_attention_can_be_turned_off_by_name(monkeypatch):
    from toyharness.errors import InputError

    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION", "ggml")
    assert not get_engine("cpu").program().fused_attention
    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION", "flash")
    with pytest.raises(InputError, match="TOYHARNESS_CUDA_ATTENTION='flash': use fused, repeat or ggml"):
        get_engine("cpu").program()


def test_the_attention_rows_are_checked_by_name(monkeypatch):
    from toyharness.errors import InputError

    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION_ROWS", "96")
    with pytest.raises(InputError, match="TOYHARNESS_CUDA_ATTENTION_ROWS='96': use 64 or 128"):
        get_engine("cpu").program()
    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION_ROWS", "64")
    assert get_engine("cpu").program().attention_rows == 64


def attention_values(monkeypatch, how: str, **shape) -> dict[str, np.ndarray]:
    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION", how)
    prog, trainer, fg = attention_program("cuda", **shape)
    out = {"y": fg.run({})["y"]}
    trainer.grads_only({})
    out.update({n: prog.read(trainer.grad_acc[n]) for n in ("x", "wq", "wk", "wv", "wo")})
    kernels = cuda_kernel_names(trainer.gb_grad) + cuda_kernel_names(fg.graph)
    assert ("attention_back" in kernels) == (how != "ggml")
    # grouped-query heads: the kv heads read in place (fused) or repeated by ggml's REPEATs (repeat)
    grouped = shape.get("n_kv_head") not in (None, shape["n_head"])
    assert ("REPEAT_BACK" in ops_of(trainer.gb_grad)) == (grouped and how != "fused")
    return out


def attention_values_at(monkeypatch, precision: str, hows: tuple[str, ...], **shape) -> list[dict[str, np.ndarray]]:
    """attention_values for each of `hows` in turn at `precision` (fp32 again after); skips where
    ggml-cuda was built without our kernels."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    engine = get_engine("cuda")
    engine.set_precision(precision)
    try:
        return [attention_values(monkeypatch, how, **shape) for how in hows]
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


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("shape", [
    dict(b=1, t=130, d=96, n_head=6, n_kv_head=2),            # head size 16, groups of 3
    dict(b=2, t=200, d=256, n_head=8, n_kv_head=2),           # head size 32, groups of 4, partial tiles
    dict(b=1, t=256, d=512, n_head=8, n_kv_head=4),           # head size 64, groups of 2
    dict(b=2, t=37, d=128, n_head=4, n_kv_head=2, causal=False),
])
def test_grouped_kv_heads_read_in_place_give_the_repeats_bits(backend, precision, shape, monkeypatch):
    """The kv heads read in place by the fused kernels (the default) against the same kernels over
    ggml's REPEATs with REPEAT_BACK summing dK and dV (TOYHARNESS_CUDA_ATTENTION=repeat): the
    forward and dQ read the same values, and the backward sums each group's dK and dV as
    REPEAT_BACK does (0, then head by head in fp32), so every output has the same bits, in fp32
    and on the tensor cores (bf16); and they repeat."""
    grouped, again, repeated = attention_values_at(monkeypatch, precision, ("fused", "fused", "repeat"), **shape)
    for name, want in repeated.items():
        assert np.isfinite(grouped[name]).all(), name
        assert np.array_equal(grouped[name], want), (name, float(np.abs(grouped[name] - want).max()))
        assert np.array_equal(grouped[name], again[name]), name


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES + [
    dict(b=2, t=256, d=256, n_head=4),                        # whole 128-row blocks, head size 64
    dict(b=1, t=330, d=512, n_head=8, n_kv_head=2),           # grouped, a partial 128-row block
])
def test_bf16_attention_bits_do_not_depend_on_the_rows_a_cta_takes(backend, shape, monkeypatch):
    """The bf16 kernels with 128 rows a CTA (8 warps, the default) against 64
    (TOYHARNESS_CUDA_ATTENTION_ROWS=64): each warp's 16 rows meet the same 64-row tiles in the same
    order, and a warp skips the causal blocks it would not have met with 64 rows, so every output
    has the same bits (dQ's recomputed dS included: T a multiple of 64 or not)."""
    assert_bf16_attention_bits_either_way(monkeypatch, shape, "TOYHARNESS_CUDA_ATTENTION_ROWS", ("64", "128"))


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", [
    dict(b=1, t=130, d=96, n_head=6, n_kv_head=2),            # group 3, head size 16
    dict(b=2, t=200, d=256, n_head=8, n_kv_head=2),           # group 4, head size 32, partial tiles
    dict(b=1, t=330, d=512, n_head=8, n_kv_head=2),           # head size 64, a partial 128-row block
])
def test_bf16_grouped_backward_split_by_query_head_keeps_the_bits(backend, shape, monkeypatch):
    """At bf16 the backward of grouped heads takes a CTA a query head, each head's dK and dV into
    the scratch, then sums each group in head order (th_attn_group_sum_kernel); with
    TOYHARNESS_CUDA_GROUP_SUM=0 a CTA takes a kv head and its group's heads in turn, adding each
    into memory in the same order: every output has the same bits."""
    assert_bf16_attention_bits_either_way(monkeypatch, shape, "TOYHARNESS_CUDA_GROUP_SUM", ("0", "1"))


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES + [
    dict(b=2, t=256, d=256, n_head=4),                        # whole 128-key blocks, head size 64
    dict(b=1, t=330, d=512, n_head=8, n_kv_head=2),           # grouped, a partial 128-key block
])
@pytest.mark.parametrize("rows", ["64", "128"])
def test_bf16_backward_by_chunks_of_16_queries_keeps_the_bits(backend, shape, rows, monkeypatch):
    """The bf16 backward takes a step's 64 queries 16 at a time (th_attn_bwd_chunk_kernel: fewer
    registers, two CTAs an SM) with the products of the whole-step kernel
    (TOYHARNESS_CUDA_ATTN_BWD=rows) in the same order, and skips a chunk that no query of sees
    the warp's keys: every output has the same bits, 4 and 8 warps a CTA."""
    monkeypatch.setenv("TOYHARNESS_CUDA_ATTENTION_ROWS", rows)
    assert_bf16_attention_bits_either_way(monkeypatch, shape, "TOYHARNESS_CUDA_ATTN_BWD", ("rows", "chunks"))


def assert_bf16_attention_bits_either_way(monkeypatch, shape: dict, env: str, settings: tuple[str, str]) -> None:
    """The bf16 attention block's outputs and gradients with `env` at each of `settings`: finite,
    and the same bits."""
    values = []
    for setting in settings:
        monkeypatch.setenv(env, setting)
        values += attention_values_at(monkeypatch, "bf16", ("fused",), **shape)
    first, second = values
    for name, want in first.items():
        assert np.isfinite(second[name]).all(), name
        assert np.array_equal(second[name], want), (name, float(np.abs(second[name] - want).max()))


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
def test_fused_attention_in_bf16_matches_float64_within_its_rounding_and_repeats_its_bits(backend, shape,
                                                                                           monkeypatch):
    """precision = bf16 (issue 32): the forward, backward and dQ kernels on tensor cores (bf16 tiles,
    fp32 sums; th-attention.cu's mma kernels), the block's products in bf16 too. Against the float64
    block: within 4 u of each output's largest element, u = 2^-8 bf16's unit roundoff (a value passes
    through at most five products, each rounding its inputs by at most u; the errors of the sums
    over d, t and keys partly cancel, and ggml's own nodes in bf16 are printed beside for scale).
    The same bits on a second run, and not fp32's."""
    u = 2.0**-8
    fused, again, nodes = attention_values_at(monkeypatch, "bf16", ("fused", "fused", "ggml"), **shape)
    fp32 = attention_values(monkeypatch, "fused", **shape)
    for name, want in attention_float64(**shape).items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err, err_nodes = (float(np.abs(m[name] - want).max() / np.abs(want).max()) for m in (fused, nodes))
        print(f"bf16 attention {shape} {name}: {err:.3g} of the largest element from float64 "
              f"(ggml's nodes in bf16: {err_nodes:.3g}; fp32 fused: "
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
@pytest.mark.parametrize("inputs", ["bf16", "f32"])
@pytest.mark.parametrize("shape", CUDNN_ATTENTION_SHAPES)
def test_cudnn_attention_in_bf16_matches_float64_as_ours_does(backend, shape, inputs, monkeypatch):
    """cuDNN's fused attention at bf16 (th-attention.cu, "cuDNN"): q, k and v read in place (bf16
    products) or narrowed (f32: TOYHARNESS_BF16_ATTENTION_INPUTS=f32, as RoPE's outputs are), grouped
    heads' backward with k and v repeated and each group's dK and dV summed by us. Against the
    float64 block within 4 u of each output's largest element (the bound of our bf16 kernels' test
    above), beside our kernels for scale; the same bits on a second run, and not ours (so cuDNN ran).
    (Operands whose batches are laid out unlike each other's, as in llama's graph, are run by
    tests/test_precision.py, test_at_bf16_cudnn_attention_repeats_and_agrees_with_fp32[llama].)"""
    if not lib.th_cudnn_attention_built():
        pytest.skip("this cuda build has no cuDNN attention (native/build.py: TOYHARNESS_CUDNN)")
    u = 2.0**-8
    monkeypatch.setenv("TOYHARNESS_BF16_ATTENTION_INPUTS", inputs)
    cudnn, again = attention_values_at(monkeypatch, "bf16", ("fused", "fused"), **shape)
    monkeypatch.setenv("TOYHARNESS_CUDNN_ATTENTION", "0")
    (ours,) = attention_values_at(monkeypatch, "bf16", ("fused",), **shape)
    errors = {}
    for name, want in attention_float64(**shape).items():
        assert np.isfinite(cudnn[name]).all(), name
        err, err_ours = (float(np.abs(m[name] - want).max() / np.abs(want).max()) for m in (cudnn, ours))
        errors[name] = err
        print(f"cuDNN's attention {shape} inputs {inputs}, {name}: {err:.3g} of the largest "
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
def test_fused_attention_in_tf32_matches_float64_within_its_rounding_and_repeats_its_bits(backend, shape,
                                                                                           monkeypatch):
    """precision = tf32: the forward, backward and dQ kernels on tensor cores in TF32 (fp32 tiles
    rounded to nearest TF32, fp32 sums; th-attention.cu's tf kernels), the block's products in TF32
    too. Against the float64 block: within 4 u of each output's largest element, u = 2^-11 TF32's
    unit roundoff (bf16's bound, argued there), beside fp32's kernels at tf32
    (TOYHARNESS_CUDA_TF32_ATTENTION=fp32) for scale. The same bits on a second run, and not those."""
    u = 2.0**-11
    fused, again = attention_values_at(monkeypatch, "tf32", ("fused", "fused"), **shape)
    monkeypatch.setenv("TOYHARNESS_CUDA_TF32_ATTENTION", "fp32")
    (simt,) = attention_values_at(monkeypatch, "tf32", ("fused",), **shape)
    for name, want in attention_float64(**shape).items():
        got = fused[name]
        assert np.isfinite(got).all(), name
        err, err_simt = (float(np.abs(m[name] - want).max() / np.abs(want).max()) for m in (fused, simt))
        print(f"tf32 attention {shape} {name}: {err:.3g} of the largest element from float64 "
              f"(fp32's kernels at tf32: {err_simt:.3g})")
        assert err < 4 * u, (name, err)
        assert np.array_equal(got, again[name]), name
        assert not np.array_equal(got, simt[name]), name
