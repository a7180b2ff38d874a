"""`precision = fp32 | tf32 | bf16` (issue 32): the option, its refusal where a backend has no such
path, the goldens' precision variants, the stamp that carries it to the cuda dispatch
(native/cuda_precision.c, native/cuda/th-precision.cu), and on a GPU what it computes: products
rounded as TF32 or bf16 and summed in fp32, run-to-run bits, and the losses' agreement with fp32.

The cuda tests skip, saying why, where no cuda build or GPU is present (`nox -s tests-cuda`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, cuda_kernel_names, linear_bias_calls, native_build, needs

from toyharness import goldens
from toyharness._ffi import GGML_TYPE_BF16, GGML_TYPE_F32, GGML_TYPE_Q4_K, cuda_kernels_built, ffi, lib
from toyharness.engine import blocks, get_engine
from toyharness.engine.graph_rewrites import PRECISION_CODES
from toyharness.errors import BackendError, InputError
from toyharness.options import Options, convert

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(32)
# Unit roundoff of an input rounded to nearest: TF32 keeps 10 of fp32's 23 mantissa bits, bf16 7.
UNIT_ROUNDOFF = {"tf32": 2.0**-11, "bf16": 2.0**-8}


def test_precision_defaults_to_fp32_and_is_written_to_the_run_folder(tmp_path):
    assert Options().precision == "fp32"
    res = cli("run", "gpt2", "--steps", "1", "--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=2",
              "--set", "t_seq=16", "--set", "t_batch=2", "--out", str(tmp_path / "run"), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert 'precision = "fp32"' in (tmp_path / "run" / "config.toml").read_text()


def test_an_unknown_precision_is_refused_by_name():
    with pytest.raises(InputError, match=r"option 'precision': 'fp16' is not allowed; allowed: fp32, tf32, bf16"):
        convert(Options, "precision", "fp16")
    res = cli("run", "gpt2", "--steps", "1", "--set", "precision=fp8")
    assert res.returncode == 2
    assert "option 'precision': 'fp8' is not allowed" in res.stderr


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_the_cpu_backend_refuses_tf32_and_bf16_in_one_line_saying_why(precision):
    res = cli("run", "gpt2", "--steps", "1", "--set", f"precision={precision}", "--backend", "cpu")
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [f"toyharness: error: precision {precision} is for the cuda backend: the cpu backend computes "
                     "every matrix product in fp32 (its kernels have no TF32 or bf16 path); use precision=fp32"]
    with pytest.raises(BackendError, match="is for the cuda backend"):
        get_engine("cpu").set_precision(precision)
    assert get_engine("cpu").precision == "fp32"


def test_bench_takes_precision_by_its_own_flag_and_refuses_it_on_cpu():
    res = cli("bench", "gpt2", "--precision", "tf32", "--steps", "10")
    assert res.returncode == 2 and "precision tf32 is for the cuda backend" in res.stderr
    res = cli("bench", "gpt2", "--set", "precision=bf16", "--steps", "10")
    assert res.returncode == 2 and "--set precision=...: use --precision" in res.stderr


def test_a_precision_is_a_golden_variant_of_every_recipe_on_cuda():
    assert goldens.split_precision("gpt2@tf32") == ("gpt2", "tf32")
    assert goldens.split_precision("lora@q4_k@bf16") == ("lora@q4_k", "bf16")
    assert goldens.split_precision("lora@q4_k") == ("lora@q4_k", "fp32")
    assert goldens.golden_sets_for("gpt2@tf32") == goldens.golden_sets_for("gpt2") + ["precision=tf32"]
    assert goldens.golden_sets_for("lora@q4_k@bf16") == goldens.golden_sets_for("lora@q4_k") + ["precision=bf16"]
    assert "gpt2@tf32" not in goldens.golden_names("gpt2")
    assert {"gpt2@tf32", "gpt2@bf16"} <= set(goldens.golden_names("gpt2", "cuda"))
    assert "lora@q4_k@tf32" in goldens.golden_names("lora", "cuda")


def test_the_stamp_marks_every_product_and_nothing_else():
    """Built on cpu, never computed: the products of a small training graph carry the precision
    in the slot th-precision.cu reads; fp32 clears it; an unknown code is refused."""
    prog = get_engine("cpu").program()
    w = prog.param("w", RNG.normal(size=(8, 16)).astype(np.float32))
    x = prog.constant("x", RNG.normal(size=(4, 16)).astype(np.float32))
    trainer = prog.trainer(prog.scalar_loss(x.matmul_t(w).sum()), "bias_corrected")
    graph = trainer.gb_grad
    nodes = [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]
    ops = [ffi.string(lib.ggml_op_desc(n)).decode() for n in nodes]
    products = sum(op in ("MUL_MAT", "OUT_PROD") for op in ops)
    assert products >= 2                                     # the forward and w's gradient at least
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["tf32"], ffi.NULL, 0) == products
    assert [lib.th_cuda_precision_of(n) for n in nodes] == [1 if op in ("MUL_MAT", "OUT_PROD") else 0 for op in ops]
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["bf16"], ffi.NULL, 0) == products
    assert {lib.th_cuda_precision_of(n) for n, op in zip(nodes, ops) if op == "MUL_MAT"} == {2}
    # f32 weights: no product became a frozen one
    assert [ffi.string(lib.ggml_op_desc(n)).decode() for n in nodes] == ops
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["fp32"], ffi.NULL, 0) == products
    assert {lib.th_cuda_precision_of(n) for n in nodes} == {0}
    assert lib.th_cuda_mark_precision(graph, 7, ffi.NULL, 0) == -1


def frozen_training_graph(dtype: str, x_shape: tuple[int, ...] = (4, 16)):
    """Built on cpu, never computed: y = x W^T of a frozen f16/bf16 W (8, 16), x trainable; the
    backward graph, its nodes, and the program (kept by the caller: the graph lives in its
    contexts, freed with it). On cpu (our kernels) W stays in its type, as on cuda at bf16."""
    prog = get_engine("cpu").program()
    w = prog.frozen_array("w", RNG.normal(size=(8, 16)), dtype)
    x = prog.param("x", RNG.normal(size=x_shape).astype(np.float32))
    y = x.matmul_t(w) if len(x_shape) == 2 else x._new(lib.ggml_mul_mat(x._ctx, w.ptr, x.ptr))
    graph = prog.trainer(prog.scalar_loss(y.sum()), "bias_corrected").gb_grad
    return graph, [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))], prog


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_at_bf16_a_frozen_weights_products_become_the_frozen_bf16_kernels(dtype):
    """The forward MUL_MAT(W, x) and the input gradient OUT_PROD(W, dy^T) of a frozen non-f32 W
    become FROZEN_MUL_MAT and FROZEN_OUT_PROD (native/cuda/th-frozen.cu: W's bf16 values), stamped
    bf16; at tf32 they stay ggml's nodes (the cuda graphs then never hold them: Tensor.matmul_t
    dequantizes W there)."""
    graph, nodes, _prog = frozen_training_graph(dtype)
    frozen = [n for n in nodes if ffi.string(lib.ggml_op_desc(n)).decode() in ("MUL_MAT", "OUT_PROD")
              and lib.th_tensor_type(lib.th_tensor_src(n, 0)) != GGML_TYPE_F32]
    assert sorted(ffi.string(lib.ggml_op_desc(n)).decode() for n in frozen) == ["MUL_MAT", "OUT_PROD"]
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["tf32"], ffi.NULL, 0) > 0
    assert all(lib.th_cuda_kernel_name(n) == ffi.NULL for n in frozen)
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    names = sorted(ffi.string(lib.th_cuda_kernel_name(n)).decode() for n in frozen)
    assert names == ["frozen_mul_mat", "frozen_out_prod"]
    assert {lib.th_cuda_precision_of(n) for n in frozen} == {PRECISION_CODES["bf16"]}


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_at_tf32_and_bf16_the_attention_backward_forms_no_ds(precision):
    """Built on cpu, never computed: after the cuda rewrite the attention backward's node holds dS
    (T, T, BH), as fp32's kernels write it; stamped for the tensor-core kernels it holds nothing of
    it, (1, 1, BH) (dQ's kernel computes dS's tiles again, native/cuda/th-attention.cu), and the
    buffer the graph needs shrinks by at least dS's bytes. dQ's node reads the backward's six
    sources (q, k, v^T, dO, the forward's and the prep's nodes: kept alive until dQ runs), then the
    backward's node."""
    from attention_cases import attention_program

    b, t, d, n_head = 2, 64, 64, 4
    sizes, ds_bytes = {}, b * n_head * t * t * 4
    for stamp in ("fp32", precision):
        prog, trainer, _fg = attention_program("cpu", b, t, d, n_head)
        graph = trainer.gb_grad
        assert lib.th_cuda_rewrite(graph, 1) > 0
        assert lib.th_cuda_mark_precision(graph, PRECISION_CODES[stamp], ffi.NULL, 0) > 0
        nodes = {ffi.string(lib.th_cuda_kernel_name(n)).decode(): n
                 for n in (lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph)))
                 if lib.th_cuda_kernel_name(n) != ffi.NULL}
        back, dq = nodes["attention_back"], nodes["attention_dq"]
        ne, nb = ffi.new("int64_t[4]"), ffi.new("size_t[4]")
        lib.th_tensor_shape(back, ne, nb)
        forms_ds = stamp == "fp32"
        assert list(ne) == ([t, t, b * n_head, 1] if forms_ds else [1, 1, b * n_head, 1]), stamp
        assert [lib.th_tensor_src(dq, i) for i in range(6)] == [lib.th_tensor_src(back, i) for i in range(6)]
        assert lib.th_tensor_src(dq, 6) == back
        galloc, size = lib.ggml_gallocr_new(get_engine("cpu").buffer_type), ffi.new("size_t[1]")
        lib.ggml_gallocr_reserve_n_size(galloc, graph, ffi.NULL, ffi.NULL, size)
        lib.ggml_gallocr_free(galloc)
        sizes[stamp] = size[0]
        prog.close()
    assert sizes["fp32"] - sizes[precision] >= ds_bytes, sizes


def test_a_frozen_product_of_a_shape_the_bf16_kernels_do_not_take_is_refused_by_name():
    """A batched (3-D) product of a frozen weight: -2 and a line naming the node and the weight,
    never ggml-cuda's own quantized product in its place."""
    graph, _, _prog = frozen_training_graph("f16", (2, 4, 16))
    why = ffi.new("char[512]")
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["bf16"], why, 512) == -2
    text = ffi.string(why).decode()
    assert "of a frozen f16 weight w (ne 16 x 8)" in text and text.startswith(("MUL_MAT", "OUT_PROD")), text


def frozen_swiglu_graph(up_read_as_f32: bool = False):
    """Built on cpu as cuda builds it, never computed: a llama MLP over a frozen f16 base, y =
    down(swiglu(gate x, up x)), x trainable (LoRA's input gradient needs the frozen products'
    backward); with `up_read_as_f32` the loss also reads up's product itself. The trainer, the
    nodes (gate, up, the GLU) and the program (kept by the caller)."""
    prog = get_engine("cpu").program()
    x = prog.param("x", RNG.normal(size=(4, 16)).astype(np.float32))
    wg, wu, wd = (prog.frozen_array(n, RNG.normal(size=shape), "f16")
                  for n, shape in (("wg", (32, 16)), ("wu", (32, 16)), ("wd", (16, 32))))
    gate, up = x.matmul_t(wg), x.matmul_t(wu)
    glu = gate.swiglu(up)
    loss = glu.matmul_t(wd).sum()
    if up_read_as_f32:
        loss = loss + up.sum()
    return prog.trainer(prog.scalar_loss(loss), "bias_corrected"), (gate, up, glu), prog


def types_of(tensors) -> list[int]:
    return [lib.th_tensor_type(t.ptr) for t in tensors]


def test_at_bf16_a_swiglu_over_frozen_products_keeps_them_in_bf16():
    """Gate's and up's frozen products, read by the GLU and SWIGLU_BACK alone, and the GLU's output
    (read by down's frozen product alone) become bf16 tensors at bf16: half the bytes (what
    SWIGLU_BACK keeps for the backward); a later graph of the same nodes takes them as they are.
    Not where the loss reads up's product as f32, nor at tf32."""
    trainer, nodes, _prog = frozen_swiglu_graph()
    f32_bytes = [lib.ggml_nbytes(t.ptr) for t in nodes]
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0 and "swiglu_back" in cuda_kernel_names(trainer.gb_grad)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["tf32"], ffi.NULL, 0) > 0
    assert types_of(nodes) == [GGML_TYPE_F32] * 3
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert types_of(nodes) == [GGML_TYPE_BF16] * 3
    assert [lib.ggml_nbytes(t.ptr) for t in nodes] == [b // 2 for b in f32_bytes]
    assert lib.th_cuda_rewrite(trainer.gb_opt, 1) >= 0
    assert lib.th_cuda_mark_precision(trainer.gb_opt, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0

    trainer, nodes, _prog2 = frozen_swiglu_graph(up_read_as_f32=True)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert types_of(nodes) == [GGML_TYPE_F32] * 3


@pytest.mark.parametrize("targets, kept", [("q,k,v,o", True), ("q,v,down", False)])
def test_the_lora_recipe_over_a_quantized_base_keeps_its_frozen_swiglus_in_bf16(targets, kept, monkeypatch):
    """The lora recipe's training graph over a two-block Q4_K base, built on cpu as cuda builds it at
    bf16 (the product reaches the GLU through a RESHAPE): with the MLP frozen every block's gate and
    up products, their reshapes and the GLU are bf16; with down targeted (its LoRA reads the GLU's
    output as f32) none is, as in the lora goldens."""
    from helpers import as_cuda_builds_it, cuda_node_name, graph_nodes

    from toyharness.engine.gguf_io import cached_copy_as
    from toyharness.lm import seeded_model_file

    base = seeded_model_file("llama", ["n_layer=2", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=7"])
    sets = ["t_seq=64", f"targets={targets}", f"base={cached_copy_as(base, 'q4_k')}"]
    _, trainer, _ = as_cuda_builds_it("lora", sets, "bf16", monkeypatch)
    glus = [t for t in graph_nodes(trainer.gb_opt) if cuda_node_name(t) == "swiglu"]     # ours (th-custom.cu)
    assert len(glus) == 2
    for glu in glus:
        gate, up = lib.th_tensor_src(glu, 0), lib.th_tensor_src(glu, 1)
        under = [lib.th_tensor_src(t, 0) for t in (gate, up)]
        assert [cuda_node_name(t) for t in under] == ["frozen_mul_mat"] * 2
        want = GGML_TYPE_BF16 if kept else GGML_TYPE_F32
        assert [lib.th_tensor_type(t) for t in (glu, gate, up, *under)] == [want] * 5


def test_a_graph_that_reads_a_swiglu_product_kept_in_bf16_as_f32_is_refused_by_name():
    """After the training graph kept up's product in bf16, a graph whose node reads it as f32 (a
    SCALE of it) is refused, -2 and a line naming the SwiGLU and the reader, never computed wrong."""
    trainer, (gate, up, glu), _prog = frozen_swiglu_graph()
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert lib.th_tensor_type(up.ptr) == GGML_TYPE_BF16
    text = refusal_of_a_scale_of(up, also=glu)
    assert text.startswith("SwiGLU") and "kept bf16 in another graph" in text and "SCALE" in text, text


def refusal_of_a_scale_of(t, also=None) -> str:
    """A new graph of SCALE(t) (and `also`) stamped bf16: refused, -2; the line that says why."""
    scaled = t.scale(3.0)
    graph = lib.ggml_new_graph_custom(scaled._ctx, 64, False)
    if also is not None:
        lib.ggml_build_forward_expand(graph, also.ptr)
    lib.ggml_build_forward_expand(graph, scaled.ptr)
    why = ffi.new("char[512]")
    assert lib.th_cuda_mark_precision(graph, PRECISION_CODES["bf16"], why, 512) == -2
    return ffi.string(why).decode()


def gelu_inputs(trainer) -> list:
    """The products whose output a GELU reads, in the training graph (through RESHAPEs)."""
    from helpers import cuda_node_name, graph_nodes

    def under(t):
        while cuda_node_name(t) == "RESHAPE":
            t = lib.th_tensor_src(t, 0)
        return t

    return [under(lib.th_tensor_src(g, 0)) for g in graph_nodes(trainer.gb_opt) if cuda_node_name(g) == "gelu"]


@pytest.mark.parametrize("recipe, sets", [("gpt2", ["n_layer=2"]), ("vit_tiny", ["n_layer=2"])])
def test_at_bf16_the_gelu_input_is_kept_in_bf16(recipe, sets, monkeypatch):
    """gpt2's and ViT's training graphs, built on cpu as cuda builds them: at bf16 each block's
    first MLP product (a LINEAR_BIAS, read by the GELU and its backward alone) is a bf16 tensor,
    half the bytes; at tf32 it stays f32."""
    from helpers import as_cuda_builds_it, cuda_node_name

    for precision, want in (("bf16", GGML_TYPE_BF16), ("tf32", GGML_TYPE_F32)):
        _, trainer, _ = as_cuda_builds_it(recipe, sets, precision, monkeypatch)
        fcs = gelu_inputs(trainer)
        assert len(fcs) == 2, (recipe, precision)
        assert [cuda_node_name(t) for t in fcs] == ["linear_bias"] * 2
        assert [lib.th_tensor_type(t) for t in fcs] == [want] * 2, (recipe, precision)
        if want == GGML_TYPE_BF16:
            ne = ffi.new("int64_t[4]")
            lib.th_tensor_shape(fcs[0], ne, ffi.new("size_t[4]"))
            assert lib.ggml_nbytes(fcs[0]) == 2 * ne[0] * ne[1] * ne[2] * ne[3]


def test_a_gelu_input_read_otherwise_stays_f32_and_a_later_graph_reading_it_as_f32_is_refused_by_name():
    """A GELU over a product with a bias whose output the loss also reads (a SUM of it) keeps it
    f32. Once a graph kept it bf16, a later graph whose node reads it as f32 (a SCALE) is refused: -2
    and a line naming the product and the reader, never computed wrong; so is the graph itself
    stamped at another precision (whose kernels would write it as f32)."""
    def mlp(read_h: bool):
        prog = get_engine("cpu").program()
        prog.cpu_kernels = prog.cpu_folds = prog.kv_in_place = False    # as helpers.as_cuda_builds_it builds it
        prog.cuda_kernels = prog.column_sums_as_products = True
        x = prog.param("x", RNG.normal(size=(8, 16)).astype(np.float32))
        w1, w2 = (prog.param(n, RNG.normal(size=s).astype(np.float32)) for n, s in (("w1", (32, 16)), ("w2", (16, 32))))
        b1 = prog.param("b1", RNG.normal(size=(32,)).astype(np.float32))
        h = blocks.linear(x, w1, b1)
        loss = blocks.gelu_tanh(h).matmul_t(w2).sum()
        if read_h:
            loss = loss + h.sum()
        return prog.trainer(prog.scalar_loss(loss), "bias_corrected"), h, prog

    trainer, h, _prog = mlp(read_h=True)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0 and "gelu_back" in cuda_kernel_names(trainer.gb_grad)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert "linear_bias" in cuda_kernel_names(trainer.gb_grad) and lib.th_tensor_type(h.ptr) == GGML_TYPE_F32

    trainer, h, _prog2 = mlp(read_h=False)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert lib.th_tensor_type(h.ptr) == GGML_TYPE_BF16
    text = refusal_of_a_scale_of(h)
    assert text.startswith("GELU's input") and "kept bf16 in another graph" in text and "SCALE" in text, text
    why = ffi.new("char[512]")
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["fp32"], why, 512) == -2
    assert "kept bf16 at precision bf16, in a graph at another precision" in ffi.string(why).decode()


def attention_operand_types(graph) -> list[tuple[int, int, int]]:
    """The ggml types of q, k and v^T as each attention node of `graph` reads them."""
    from helpers import cuda_node_name, graph_nodes

    return [tuple(lib.th_tensor_type(lib.th_tensor_src(t, j)) for j in range(3)) for t in graph_nodes(graph)
            if cuda_node_name(t) in ("attention", "attention_back", "attention_dq")]


@pytest.mark.parametrize("recipe, sets", [("gpt2", ["n_layer=2"]), ("vit_tiny", ["n_layer=2"])])
def test_at_bf16_attention_reads_its_q_k_v_products_in_bf16(recipe, sets, monkeypatch):
    """gpt2's and ViT's training graphs, built on cpu as cuda builds them: at bf16 each attention
    node (forward, backward, dQ) reads q, k and v^T as bf16 views of the projections (LINEAR_BIAS),
    which are bf16 tensors of half the bytes (with GELU's 2 inputs: 8 bf16 products); at tf32 all
    three stay f32."""
    from helpers import as_cuda_builds_it, cuda_node_name, graph_nodes

    for precision, want, bf16_products in (("bf16", GGML_TYPE_BF16, 8), ("tf32", GGML_TYPE_F32, 0)):
        _, trainer, _ = as_cuda_builds_it(recipe, sets, precision, monkeypatch)
        assert attention_operand_types(trainer.gb_opt) == [(want,) * 3] * 6, (recipe, precision)
        products = [t for t in graph_nodes(trainer.gb_opt) if cuda_node_name(t) == "linear_bias"]
        kept = [t for t in products if lib.th_tensor_type(t) == GGML_TYPE_BF16]
        assert len(kept) == bf16_products, (recipe, precision)
        for t in kept:
            ne = ffi.new("int64_t[4]")
            lib.th_tensor_shape(t, ne, ffi.new("size_t[4]"))
            assert lib.ggml_nbytes(t) == 2 * ne[0] * ne[1] * ne[2] * ne[3]


def test_an_attention_whose_q_is_read_otherwise_keeps_q_k_v_f32_and_a_later_graph_reading_it_as_f32_is_refused():
    """An attention over products with a bias whose q product the loss also reads (a SUM of it)
    keeps all three f32 (the kernels read q, k and v^T of one type). Without that reader all three
    are bf16; then a later graph whose node reads q's product as f32 (a SCALE) is refused: -2 and a
    line naming the product and the reader, never computed wrong; so is the graph itself stamped at
    another precision (whose kernels would write the product as f32)."""
    def attention(read_q: bool):
        prog = get_engine("cpu").program()
        prog.cpu_kernels = prog.cpu_folds = prog.kv_in_place = False    # as helpers.as_cuda_builds_it builds it
        prog.cuda_kernels = prog.column_sums_as_products = True
        x = prog.param("x", RNG.normal(size=(2, 8, 32)).astype(np.float32))
        w = {n: prog.param(n, 0.2 * RNG.normal(size=(32, 32)).astype(np.float32)) for n in ("wq", "wk", "wv", "wo")}
        b = {n: prog.param(n, RNG.normal(size=(32,)).astype(np.float32)) for n in ("bq", "bk", "bv")}
        q = blocks.linear(x, w["wq"], b["bq"])
        out = blocks.attention(x, w["wq"], w["wk"], w["wv"], w["wo"], 2, bk=b["bk"], bv=b["bv"], q_fn=lambda _: q)
        loss = out.sum() + q.sum() if read_q else out.sum()
        return prog.trainer(prog.scalar_loss(loss), "bias_corrected"), q, prog

    trainer, q, _prog = attention(read_q=True)
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) > 0 and "attention_dq" in cuda_kernel_names(trainer.gb_grad)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert lib.th_tensor_type(q.ptr) == GGML_TYPE_F32
    assert attention_operand_types(trainer.gb_grad) == [(GGML_TYPE_F32,) * 3] * 3

    trainer, q, _prog2 = attention(read_q=False)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["bf16"], ffi.NULL, 0) > 0
    assert lib.th_tensor_type(q.ptr) == GGML_TYPE_BF16
    assert attention_operand_types(trainer.gb_grad) == [(GGML_TYPE_BF16,) * 3] * 3
    text = refusal_of_a_scale_of(q)
    assert text.startswith("attention's input") and "kept bf16 in another graph" in text and "SCALE" in text, text
    why = ffi.new("char[512]")
    assert lib.th_cuda_mark_precision(trainer.gb_grad, PRECISION_CODES["fp32"], why, 512) == -2
    assert ffi.string(why).decode().startswith("attention's input")
    assert "kept bf16 at precision bf16, in a graph at another precision" in ffi.string(why).decode()


def test_the_bf16_copies_horizon_is_on_for_a_base_kept_in_its_type():
    """Program.bf16_horizon: BF16_KEEP_NODES where a frozen weight stays in its type (a LoRA base's
    bf16 copies would otherwise live from the forward to the backward), none for f32 frozen weights
    alone."""
    from toyharness.engine.program import BF16_KEEP_NODES

    _, _, prog = frozen_training_graph("f16")
    assert prog.bf16_horizon == BF16_KEEP_NODES
    plain = get_engine("cpu").program()
    plain.frozen_array("w", RNG.normal(size=(4, 4)), "f32")
    assert plain.bf16_horizon == 0


def test_the_precision_edits_apply_once_to_the_pinned_ggml():
    build = native_build()
    cuda = build.ggml_source() / "src" / "ggml-cuda"
    edited = build.cuda_dispatch_source((cuda / "ggml-cuda.cu").read_text())
    assert edited.count('#include "ggml-cuda/th-precision.cuh"') == 1
    assert edited.count("if (th_calls_cublas(dst)) th_cuda_precision_before(ctx.cublas_handle(), dst);") == 1
    # the hook is the first line of the node's dispatch
    head = edited.split("static bool ggml_cuda_compute_forward(ggml_backend_cuda_context & ctx, "
                        "struct ggml_tensor * dst) {\n", 1)[1]
    assert head.startswith("    if (th_calls_cublas(dst))")
    # the bf16 copies' pass: begun before the node loop, ended after it, once each
    loop = edited.split("            th_cuda_graph_begin(cgraph);  // toyharness\n", 1)[1]
    assert loop.startswith("            for (int i = 0; i < cgraph->n_nodes; i++) {")
    assert loop.count("th_cuda_graph_end();") == 1 and "ggml_cuda_compute_forward(*cuda_ctx, node)" in \
        loop.split("th_cuda_graph_end();")[0]
    out_prod = build.cuda_dispatch_source((cuda / "out-prod.cu").read_text(), build.CUDA_OUT_PROD_EDITS,
                                          "out-prod.cu")
    assert out_prod.count('#define TH_PRECISION_WRAP_CUBLAS\n#include "th-precision.cuh"') == 1
    with pytest.raises(build.BuildError, match=r"out-prod.cu: '#include \"out-prod.cuh\"' found 0 times"):
        build.cuda_dispatch_source("int x;\n", build.CUDA_OUT_PROD_EDITS, "out-prod.cu")


# --- on a GPU ------------------------------------------------------------------------------------
def round_mantissa(a: np.ndarray, bits: int, nearest: bool = True) -> np.ndarray:
    """float32 cut to `bits` explicit mantissa bits, rounded to nearest (ties to even) or toward
    zero (what a tensor core does with the low bits it does not read), as float64."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    if drop == 0:
        return np.asarray(a, np.float64)
    if nearest:
        u = u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)
    u = u >> drop << drop
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def product_on_cuda(precision: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    engine = get_engine("cuda")
    engine.set_precision(precision)
    try:
        prog = engine.program()
        y = prog.constant("a", a).matmul_t(prog.constant("b", b))
        return prog.forward({"y": y}).run({})["y"].astype(np.float64)
    finally:
        engine.set_precision("fp32")


@pytest.mark.parametrize("precision", [pytest.param(p, marks=needs("cuda")) for p in ("fp32", "tf32", "bf16")])
def test_a_product_rounds_its_inputs_to_the_precision_and_sums_in_fp32(precision):
    """Inputs with every mantissa bit used: the cuda product equals float64's product of the
    inputs rounded as the precision says (to fp32's summation error), and not the unrounded one."""
    a = RNG.normal(size=(96, 256)).astype(np.float32)
    b = RNG.normal(size=(80, 256)).astype(np.float32)
    got = product_on_cuda(precision, a, b)
    bits = {"fp32": 23, "tf32": 10, "bf16": 7}[precision]
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64).T
    # the inputs rounded to nearest, or cut (the tensor cores' TF32 reads fp32 and drops bits)
    errs = {mode: float(np.max(np.abs(got - round_mantissa(a, bits, mode == "nearest")
                                      @ round_mantissa(b, bits, mode == "nearest").T) / scale))
            for mode in ("nearest", "toward zero")}
    mode, err_rounded = min(errs.items(), key=lambda kv: kv[1])
    err_exact = float(np.max(np.abs(got - exact) / scale))
    print(f"{precision}: inputs rounded {mode}; error against them {err_rounded:.3g} (the other rounding: "
          f"{max(errs.values()):.3g}), against the exact product {err_exact:.3g} (relative to sum |a||b|)")
    assert err_rounded < 256 * 2.0**-24          # fp32 accumulation over k = 256
    if precision != "fp32":
        # rounding moves the exact product by about u/sqrt(k) of the scale: far above fp32's sums
        assert err_exact > 0.05 * UNIT_ROUNDOFF[precision]


def bias_product_at_bf16(backend: str, rows: int, d_in: int, d_out: int, gelu: bool, form: str = "tanh") -> dict:
    """y = x W^T + b (GELU of it where `gelu`, of that `form`: blocks.GELUS) computed forward at bf16 on
    `backend`, random inputs:
    them, y (float64), the graph, the LINEAR_BIAS calls cuBLASLt and the plain path made, and the
    product's ggml type."""
    x = RNG.normal(size=(rows, d_in)).astype(np.float32)
    w, b = RNG.normal(size=(d_out, d_in)).astype(np.float32), RNG.normal(size=d_out).astype(np.float32)
    engine = get_engine(backend)
    engine.set_precision("bf16")
    try:
        calls = linear_bias_calls()
        prog = engine.program()
        h = blocks.linear(prog.constant("x", x), prog.param("w", w), prog.param("b", b))
        fg = prog.forward({"y": blocks.GELUS[form](h) if gelu else h})
        y = fg.run({})["y"].astype(np.float64)
        lt, plain = (now - then for now, then in zip(linear_bias_calls(), calls))
        return {"x": x, "w": w, "b": b, "y": y, "graph": fg.graph, "lt": lt, "plain": plain,
                "type": lib.th_tensor_type(h.ptr), "kept": (prog, fg)}      # (the graph lives with them)
    finally:
        engine.set_precision("fp32")


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
@pytest.mark.parametrize("form", ["tanh", "erf"])
def test_at_bf16_a_gelus_input_is_the_bias_product_rounded_once_to_bf16(backend, form):
    """y = gelu(x W^T + b) at bf16, either form: the product, written in bf16 (th_gelu_bf16), is the
    sum of the bf16 copies' products plus b's bf16 copy, rounded once to bf16 by cuBLASLt's epilogue,
    and GELU computes on it in fp32. Against float64 on the same roundings: where
    fp32's sum and float64's straddle a bf16 rounding boundary they round one bf16 ulp apart
    (2^-7 of |h| at most), and either GELU's slope is below 1.13; and the bf16 rounding really
    happened (float64's GELU of the unrounded sum is further off)."""
    from helpers import gelu_erf_f64, gelu_tanh_f64

    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    gelu_f64, kernel = {"tanh": (gelu_tanh_f64, "gelu"), "erf": (gelu_erf_f64, "gelu_erf")}[form]
    run = bias_product_at_bf16(backend, 64, 32, 48, gelu=True, form=form)
    x, w, b, y = run["x"], run["w"], run["b"], run["y"]
    assert run["type"] == GGML_TYPE_BF16 and kernel in cuda_kernel_names(run["graph"])
    assert run["lt"] >= 1 and run["plain"] == 0, run
    exact = round_mantissa(x, 7) @ round_mantissa(w, 7).T + round_mantissa(b, 7)
    h16 = round_mantissa(exact.astype(np.float32), 7)
    want = gelu_f64(h16)[0]
    assert (np.abs(y - want) <= 1.13 * 2.0**-7 * np.abs(h16) + 1e-5 * (1 + np.abs(want))).all()
    assert np.mean(np.abs(y - want) <= 1e-5 * (1 + np.abs(want))) > 0.95     # ulp flips are rare
    assert np.abs(y - gelu_f64(exact)[0]).max() > 1e-3


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_a_bias_product_at_bf16_is_cublaslts_on_the_bf16_copies(backend):
    """LINEAR_BIAS at bf16: cuBLASLt multiplies the bf16 copies of x and W (the plain path's fill
    and beta-1 product no more) with b added in the epilogue: float64's product of the inputs
    rounded to bf16, plus b, to fp32's summation error."""
    if not cuda_kernels_built():
        pytest.skip("this ggml-cuda was built without toyharness's kernels (native/cuda)")
    d_in = 256
    run = bias_product_at_bf16(backend, 300, d_in, 96, gelu=False)
    x, w, b, y = run["x"], run["w"], run["b"], run["y"]
    assert "linear_bias" in cuda_kernel_names(run["graph"]) and run["lt"] >= 1 and run["plain"] == 0
    want = round_mantissa(x, 7) @ round_mantissa(w, 7).T + b
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + np.abs(b)
    assert (np.abs(y - want) / scale).max() < d_in * 2.0**-24
    assert (np.abs(y - (x.astype(np.float64) @ w.T.astype(np.float64) + b)) / scale).max() > 1e-4


@pytest.mark.parametrize("precision", [pytest.param(p, marks=needs("cuda")) for p in ("tf32", "bf16")])
@pytest.mark.parametrize("recipe", ["gpt2", "llama"])
def test_the_first_16_losses_repeat_and_agree_with_fp32(recipe, precision):
    """Run to run the same bits; against the fp32 run (the cuda golden's config) each of the first
    16 losses within 2 u relative, u the precision's unit roundoff (TF32 2^-11, bf16 2^-8): each
    product's inputs are rounded with relative error at most u, so the logits move by about u of
    their size (below 1 here); the loss, a mean of log-softmaxes, is 1-Lipschitz in the logits and
    about ln 256 = 5.5, and 16 AdamW steps at lr 1e-3 compound the difference little. And not
    fp32's bits: the precision is really in effect."""
    fp32 = goldens.compute(recipe, "cuda")
    first, second = goldens.compute(f"{recipe}@{precision}", "cuda"), goldens.compute(f"{recipe}@{precision}", "cuda")
    assert goldens.compare(first, second) is None, f"{recipe}@{precision} is not run-to-run deterministic"
    assert first["options"]["precision"] == precision
    ours = np.array([x["value"] for x in first["losses"]], np.float64)
    ref = np.array([x["value"] for x in fp32["losses"]], np.float64)
    rel = np.abs(ours - ref) / np.abs(ref)
    print(f"{recipe}@{precision}: largest relative difference to fp32 over 16 steps {rel.max():.3g} "
          f"(step 0: {rel[0]:.3g}); tolerance {2 * UNIT_ROUNDOFF[precision]:.3g}")
    assert rel.max() < 2 * UNIT_ROUNDOFF[precision]
    assert [x["hex"] for x in first["losses"]] != [x["hex"] for x in fp32["losses"]]


@pytest.fixture(scope="module")
def quantized_bases(tmp_path_factory):
    """A seeded llama base 256 wide (rows that K-quants fill) in q4_k and q8_0 (ggml's quantizer)."""
    from toyharness.engine.gguf_io import copy_gguf_as
    from toyharness.lm import seeded_model_file

    base = seeded_model_file("llama", ["n_layer=1", "d_model=256", "n_head=4", "n_kv_head=2", "d_ff=512", "seed=3"])
    folder = tmp_path_factory.mktemp("quantized")
    return {t: copy_gguf_as(base, folder / f"base-{t}.gguf", t) for t in ("q4_k", "q8_0", "f16", "bf16")}


def frozen_product_on_cuda(path, name: str, precision: str, x: np.ndarray, r: np.ndarray):
    """y = x W^T and dL/dx for L = sum(r * y), W the tensor `name` of `path` uploaded in its type,
    on cuda at `precision`; and how many frozen bf16 products ran."""
    from toyharness.engine import GGUFFile

    engine = get_engine("cuda")
    engine.set_precision(precision)
    before = lib.th_cuda_frozen_products()
    try:
        prog = engine.program()
        w = prog.frozen_gguf(GGUFFile(path), name)
        xp = prog.param("x", x)
        y = xp.matmul_t(w)
        trainer = prog.trainer(prog.scalar_loss((y * prog.constant("r", r)).sum()), "bias_corrected")
        trainer.grads_only({})
        dx = prog.read(trainer.grad_acc["x"]).astype(np.float64)
        fwd = prog.forward({"y": y}).run({})["y"].astype(np.float64)
        return fwd, dx, lib.th_cuda_frozen_products() - before
    finally:
        engine.set_precision("fp32")


@pytest.mark.parametrize("dtype", [pytest.param(t, marks=needs("cuda")) for t in ("q4_k", "q8_0", "f16", "bf16")])
def test_a_frozen_weight_enters_bf16_products_as_its_dequantized_values_rounded_to_bf16(quantized_bases, dtype):
    """At bf16 a frozen W's forward y = x W^T and input gradient dy W (th-frozen.cu) equal float64's
    products of W's dequantized values (gguf-py's reading) and the f32 operand, both rounded to
    nearest bf16, to fp32's summation error plus a few of W's values rounded to the other bf16
    neighbour (ggml-cuda's dequantizer may fuse d q - m into one FMA where gguf-py rounds twice: a
    value within an fp32 ulp of a tie, about 2^-16 of them, moves by up to u = 2^-8 of itself, so a
    sum of k terms by about u/k of its scale; bound 2 u/k). Not the unrounded product (more than
    0.05 u off), and the same bits run to run."""
    from toyharness.engine import GGUFFile
    from toyharness.engine.quant import dequantize

    path, name = quantized_bases[dtype], "blk.0.ffn_down.weight"
    with GGUFFile(path) as f:
        info = f.tensor(name)
        w = dequantize(info.raw_bytes(), info.ggml_type, info.shape).astype(np.float32)
    k = w.shape[1]
    x = RNG.normal(size=(48, k)).astype(np.float32)
    r = RNG.normal(size=(48, w.shape[0])).astype(np.float32)
    y, dx, ran = frozen_product_on_cuda(path, name, "bf16", x, r)
    y2, dx2, _ = frozen_product_on_cuda(path, name, "bf16", x, r)
    assert ran >= 2, "the frozen bf16 products did not run"
    assert np.array_equal(y, y2) and np.array_equal(dx, dx2), "bits moved run to run"
    w16, x16, r16 = (round_mantissa(a, 7) for a in (w, x, r))
    w64, x64, r64 = (a.astype(np.float64) for a in (w, x, r))
    for what, got, rounded, exact, scale, kk in (
            ("forward", y, x16 @ w16.T, x64 @ w64.T, np.abs(x64) @ np.abs(w64).T, k),
            ("input gradient", dx, r16 @ w16, r64 @ w64, np.abs(r64) @ np.abs(w64), w.shape[0])):
        err_rounded = float(np.max(np.abs(got - rounded) / scale))
        err_exact = float(np.max(np.abs(got - exact) / scale))
        print(f"frozen {dtype} at bf16, {what}: error against the bf16-rounded operands {err_rounded:.3g}, "
              f"against the exact product {err_exact:.3g} (relative to sum |a||b|, k = {kk})")
        assert err_rounded < kk * 2.0**-24 + 2 * UNIT_ROUNDOFF["bf16"] / kk, (what, err_rounded)
        assert err_exact > 0.05 * UNIT_ROUNDOFF["bf16"], (what, err_exact)


def random_q4_k_blocks(blocks: int) -> np.ndarray:
    """`blocks` Q4_K blocks (144 bytes: f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of
    nibbles) of random bits, d and dmin finite and spread over six decades."""
    raw = RNG.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    scales = (10.0 ** RNG.uniform(-4, 2, size=(blocks, 2)) * RNG.choice([-1, 1], size=(blocks, 2))).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8).reshape(blocks, 4)
    return raw.reshape(-1)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_our_q4_k_dequantizer_gives_ggml_cudas_bf16_bits(backend):
    """th-dequant.cu's Q4_K kernel (a warp a block, 16-byte stores) against ggml-cuda's dequantizer
    to bf16 on random blocks, 4099 of them (the last CTA part empty): the same bits; and both within
    one bf16 step of gguf-py's float32 values rounded to nearest (d q - m fused into one FMA or
    rounded twice may land either side of a tie), most of them equal."""
    from toyharness.engine.quant import dequantize

    get_engine(backend)
    blocks = 4099
    raw, n = random_q4_k_blocks(blocks), blocks * 256
    ours, theirs = (np.zeros(n, np.uint16) for _ in range(2))
    for out, flag in ((ours, 1), (theirs, 0)):
        status = lib.th_cuda_dequantize_bf16(GGML_TYPE_Q4_K, ffi.from_buffer(raw), n,
                                             ffi.cast("uint16_t *", ffi.from_buffer(out)), flag)
        assert status == 0, status
    assert np.array_equal(ours, theirs), f"{int(np.sum(ours != theirs))} of {n} values differ from ggml-cuda's"
    reference = round_mantissa(dequantize(raw, GGML_TYPE_Q4_K, (n,)), 7)
    got = (ours.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    off = got != reference
    print(f"Q4_K to bf16, {n} values: {int(off.sum())} a bf16 step from gguf-py's rounded float32")
    assert np.all(np.abs(got - reference)[off] <= np.abs(reference[off]) * 2.0**-7), "more than one bf16 step"
    assert off.mean() < 1e-3


@pytest.mark.parametrize("dtype", [pytest.param(t, marks=needs("cuda")) for t in ("q4_k", "q8_0")])
def test_lora_over_a_quantized_base_at_bf16_repeats_and_agrees_with_fp32(dtype):
    """lora@q4_k and lora@q8_0 golden configs at bf16, the base's products through th-frozen.cu:
    the same 16 losses' bits run to run, each within 2 u (bf16, 2^-8) of the fp32 run's (the
    argument of test_the_first_16_losses_repeat_and_agree_with_fp32: now the base's values are
    rounded to bf16 too, also a relative change of at most u of each product input), not fp32's
    bits, and the frozen products really ran."""
    fp32 = goldens.compute(f"lora@{dtype}", "cuda")
    before = lib.th_cuda_frozen_products()
    first = goldens.compute(f"lora@{dtype}@bf16", "cuda")
    ran = lib.th_cuda_frozen_products() - before
    second = goldens.compute(f"lora@{dtype}@bf16", "cuda")
    assert ran > 0, "the base's products did not go through the frozen bf16 products"
    assert goldens.compare(first, second) is None, f"lora@{dtype}@bf16 is not run-to-run deterministic"
    ours = np.array([x["value"] for x in first["losses"]], np.float64)
    ref = np.array([x["value"] for x in fp32["losses"]], np.float64)
    rel = np.abs(ours - ref) / np.abs(ref)
    print(f"lora@{dtype}@bf16: largest relative difference to fp32 over 16 steps {rel.max():.3g} "
          f"(step 0: {rel[0]:.3g}); tolerance {2 * UNIT_ROUNDOFF['bf16']:.3g}; frozen products run {ran}")
    assert rel.max() < 2 * UNIT_ROUNDOFF["bf16"]
    assert [x["hex"] for x in first["losses"]] != [x["hex"] for x in fp32["losses"]]


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=needs("cuda"))])
def test_lora_over_a_frozen_mlp_at_bf16_keeps_swiglu_in_bf16_repeats_and_agrees_with_fp32(backend):
    """lora@q4_k's config with targets q,k,v,o: the MLP frozen, its SwiGLU over two frozen products
    kept in bf16 (th_swiglu_bf16). The same 16 losses' bits run to run, each within 2 u of fp32's
    (gate's and up's values rounded once more, a relative change of at most u, as every product
    input already is)."""
    sets = ["targets=q,k,v,o"]
    ref = np.array([x["value"] for x in goldens.compute("lora@q4_k", backend, extra_sets=sets)["losses"]])
    first = goldens.compute("lora@q4_k@bf16", backend, extra_sets=sets)
    second = goldens.compute("lora@q4_k@bf16", backend, extra_sets=sets)
    assert_bf16_repeats_and_agrees("lora@q4_k@bf16 targets q,k,v,o, SwiGLU", first, second, ref)


def assert_bf16_repeats_and_agrees(label: str, first: dict, second: dict, ref, other: dict | None = None,
                                   ways: tuple[str, str] = ("bf16", "other")) -> None:
    """Two bf16 runs (`first`, `second`) give the same bits, and agree with fp32's losses `ref`
    within 2 u; so does `other` where given (a run on another path), whose bits are not theirs (so
    the path ran). `ways` names the two paths in the printed lines."""
    assert goldens.compare(first, second) is None, "not run-to-run deterministic"
    if other is not None:
        assert [x["hex"] for x in first["losses"]] != [x["hex"] for x in other["losses"]]
    for doc in (first, other) if other is not None else (first,):
        rel = np.abs(np.array([x["value"] for x in doc["losses"]]) - ref) / np.abs(ref)
        print(f"{label} {ways[1] if doc is other else ways[0]}: largest relative difference to fp32 over 16 "
              f"steps {rel.max():.3g}; tolerance {2 * UNIT_ROUNDOFF['bf16']:.3g}")
        assert rel.max() < 2 * UNIT_ROUNDOFF["bf16"]


# the golden config with head size 32 (d_model 64, 2 heads), which cuDNN's attention takes
# (custom_ops.h, th_attention_cudnn: head size 32 or 64); the golden config's 16 keeps our kernels.
# gpt2's q, k and v are bf16 products, read in place; llama's (RoPE's outputs, f32) are narrowed,
# and its 2 query heads share 1 kv head (the golden config's n_kv_head=1)
CUDNN_SETS = ["d_model=64"]


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=needs("cuda")) for r in ("gpt2", "llama")])
def test_at_bf16_cudnn_attention_repeats_and_agrees_with_fp32(recipe, monkeypatch):
    """The golden config at bf16 and head size 32 with its attention on cuDNN's fused attention (the
    backward deterministic): the 16 losses' bits repeat run to run, each within 2 u of fp32's, and
    they are not the bits of the same run on our kernels (TOYHARNESS_CUDNN_ATTENTION=0, so cuDNN
    ran), which agrees with fp32 as closely."""
    if not lib.th_cudnn_attention_built():
        pytest.skip("this cuda build has no cuDNN attention (native/build.py: TOYHARNESS_CUDNN, "
                    "pip install nvidia-cudnn-cu13 nvidia-cudnn-frontend)")
    ref = np.array([x["value"] for x in goldens.compute(recipe, "cuda", extra_sets=CUDNN_SETS)["losses"]])
    first = goldens.compute(f"{recipe}@bf16", "cuda", extra_sets=CUDNN_SETS)
    second = goldens.compute(f"{recipe}@bf16", "cuda", extra_sets=CUDNN_SETS)
    monkeypatch.setenv("TOYHARNESS_CUDNN_ATTENTION", "0")
    ours = goldens.compute(f"{recipe}@bf16", "cuda", extra_sets=CUDNN_SETS)
    assert_bf16_repeats_and_agrees(f"{recipe}@bf16 (head size 32), attention", first, second, ref, ours,
                                   ways=("cuDNN's", "ours"))


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=needs("cuda")) for r in ("gpt2", "llama")])
def test_at_bf16_an_attention_cudnn_refuses_runs_on_our_kernels(recipe, monkeypatch, capfd):
    """Where cuDNN refuses an attention's plans (TOYHARNESS_CUDNN_ATTENTION=refuse stands in for a shape,
    a GPU or a cuDNN it cannot take, or a workspace it cannot allocate), all four of the attention's
    nodes run on our kernels: the losses are the bits of the same run with TOYHARNESS_CUDNN_ATTENTION=0,
    and stderr says so once, naming the shape. (t_seq 32: a shape no other test builds plans for.)"""
    if not lib.th_cudnn_attention_built():
        pytest.skip("this cuda build has no cuDNN attention (native/build.py: TOYHARNESS_CUDNN)")
    sets = CUDNN_SETS + ["t_seq=32"]
    monkeypatch.setenv("TOYHARNESS_CUDNN_ATTENTION", "refuse")
    capfd.readouterr()
    refused = goldens.compute(f"{recipe}@bf16", "cuda", extra_sets=sets)
    said = [line for line in capfd.readouterr().err.splitlines() if "TOYHARNESS_CUDNN_ATTENTION=refuse" in line]
    monkeypatch.setenv("TOYHARNESS_CUDNN_ATTENTION", "0")
    ours = goldens.compute(f"{recipe}@bf16", "cuda", extra_sets=sets)
    assert [x["hex"] for x in refused["losses"]] == [x["hex"] for x in ours["losses"]]
    assert len(said) == 1 and "the attention forward" in said[0] and "T 32, D 32" in said[0], said
    assert said[0].endswith("toyharness's attention kernels run it"), said


BF16_RUN = """
import json, sys
from toyharness import goldens
from toyharness._ffi import ffi, lib
doc = goldens.compute(sys.argv[1], "cuda")
converted, reused = ffi.new("int64_t *"), ffi.new("int64_t *")
lib.th_cuda_bf16_copies(converted, reused)
print(json.dumps({"hex": [x["hex"] for x in doc["losses"]], "converted": converted[0], "reused": reused[0],
                  "held": lib.th_cuda_bf16_copy_bytes(), "peak": lib.th_cuda_bf16_copy_peak_bytes(),
                  "alone": lib.th_cuda_bf16_copies_alone()}))
"""


def bf16_run(name: str) -> dict:
    """The golden config `name` in a fresh process (no CUDA graph of another run to replay): its
    losses' bits and how many operands it converted and reused."""
    done = subprocess.run([sys.executable, "-c", BF16_RUN, name], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


@pytest.mark.parametrize("name, writes_alone", [pytest.param(n, a, marks=needs("cuda")) for n, a in (
    ("gpt2@bf16", True), ("vit_tiny@bf16", True), ("llama@bf16", True),
    # a frozen base keeps its copies within a horizon of nodes (Program.bf16_horizon), which may drop
    # a copy before its last reader: nothing is written alone there
    ("lora@q4_k@bf16", False))])
def test_bf16_products_reuse_their_operands_copies_and_writers_write_them_alone(name, writes_alone):
    """Each distinct fp32 operand of a graph's bf16 products is converted once and its copy reused
    while its bytes are not written (th-precision.cu): copies were really reused, and what they took
    at most lies within the chunks held. A writer whose output only products read, each through its
    bf16 copy, writes the copy alone (th_copy_alone_ok) where no horizon drops copies (a product
    reading those bytes otherwise would have aborted the run). The losses are the golden's bits
    (toyharness golden check holds them)."""
    run = bf16_run(name)
    print(f"{name}: operands converted {run['converted']}, reused {run['reused']}, writers that wrote their "
          f"copy alone {run['alone']}")
    assert run["converted"] > 0 and run["reused"] > 0
    assert 0 < run["peak"] <= run["held"], run
    assert (run["alone"] > 0) == writes_alone
