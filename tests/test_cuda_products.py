"""Matrix products on cuda: an input's products summed in one node, a bias folded into its product
(cuBLASLt or the plain way), LoRA's scale on the rank product and frozen inputs' gradients.

The rewrite is checked here on any machine, on graphs built on cpu as cuda builds them; the
kernels' values where the cuda backend is built and a device is present (`nox -s tests-cuda`),
else those tests skip and say why."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import cuda_kernel_names, linear_bias_calls, needs, ops_of

from toyharness._ffi import GGML_TYPE_F32, cuda_kernels_built, ffi, lib
from toyharness.engine import blocks, get_engine

RNG = np.random.default_rng(21)
# every test builds its graphs on cpu as cuda builds them (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("graphs_as_cuda_builds_them")


def products_program(backend: str, n_products: int, only: int | None = None, rows: int = 96, d_in: int = 160,
                     d_out: int = 200, seed: int = 4):
    """sum over i of (x W_i^T) * c_i (term `only` alone, when given): x's gradient is the sum of
    n_products OUT_PRODs."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    prog.grads_as_outputs = True
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
    assert cuda_kernel_names(trainer.gb_grad).count("product_sum") == 1
    assert ops_of(trainer.gb_grad).count("OUT_PROD") == 3          # the weights' gradients
    prog, trainer = products_program("cpu", 6)
    lib.th_cuda_rewrite(trainer.gb_grad, 1)
    assert cuda_kernel_names(trainer.gb_grad).count("product_sum") == 1 and "add" in cuda_kernel_names(trainer.gb_grad)


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
        assert "product_sum" in cuda_kernel_names(trainer.gb_grad)
        summed.append(prog.read(trainer.grad_acc["x"]))
    assert np.array_equal(summed[0], summed[1]), "bits moved between two runs"
    alone = []
    for i in range(3):
        prog_i, trainer_i = products_program(backend, 3, only=i)
        trainer_i.grads_only({})
        assert "product_sum" not in cuda_kernel_names(trainer_i.gb_grad)
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
    prog.grads_as_outputs = True
    x = prog.param("x", RNG.normal(size=(2, 5, 8)).astype(np.float32))
    w, w2 = (prog.param(n, RNG.normal(size=(6, 8)).astype(np.float32)) for n in ("w", "w2"))
    b, b2 = (prog.param(n, RNG.normal(size=6).astype(np.float32)) for n in ("b", "b2"))
    y = blocks.linear(x, w, b)
    raw = x.matmul_t(w2)
    twice = blocks.add_bias(raw, b2) + raw
    trainer = prog.trainer(prog.scalar_loss(y.sum() + twice.sum()), "bias_corrected")
    products = ops_of(trainer.gb_grad).count("MUL_MAT")
    assert lib.th_cuda_rewrite(trainer.gb_grad, 1) == len(cuda_kernel_names(trainer.gb_grad))
    # and x's gradient, its products summed in one node (the parts fold)
    assert [n for n in cuda_kernel_names(trainer.gb_grad) if n != "add"] == [
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
        assert "linear_bias" in cuda_kernel_names(fg.graph) and "linear_bias" in cuda_kernel_names(trainer.gb_grad)
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
    assert "linear_bias" in cuda_kernel_names(fg.graph)
    lt, plain = (now - then for now, then in zip(linear_bias_calls(), calls))
    assert lt == 0 and plain >= 1
    want = x[1:].astype(np.float64) @ w.astype(np.float64).T + b
    assert np.abs(y - want).max() <= 1e-6 * np.sqrt(d_in) * np.abs(want).max()


def lora_program(backend: str, scale: float, output_side: bool, cuda_kernels: bool | None = None, rows: int = 96,
                 d_in: int = 160, d_out: int = 200, rank: int = 8, seed: int = 31):
    """W x + scale B A x (blocks.lora_linear), or with `output_side` the scale written on B A x's
    (rows, d_out) output by hand: the placement lora_linear keeps off cuda."""
    rng = np.random.default_rng(seed)
    prog = get_engine(backend).program()
    if cuda_kernels is not None:
        prog.cuda_kernels = cuda_kernels
    prog.grads_as_outputs = True
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
    prog.grads_as_outputs = True
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
    names = cuda_kernel_names(trainer.gb_grad)
    assert names.count("product_sum") == 1 and names.count("add") == 3
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
            assert cuda_kernel_names(trainer.gb_grad).count("product_sum") == 1, cuda_kernel_names(trainer.gb_grad)
            summed.append(prog.read(trainer.grad_acc["x"]))
        alone = []
        for i in range(4):
            prog_i, trainer_i = frozen_products_program(backend, 3, only=i, dtype=dtype)
            trainer_i.grads_only({})
            assert "product_sum" not in cuda_kernel_names(trainer_i.gb_grad)
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
