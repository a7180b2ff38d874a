"""native/cpu_kernels.c: each stand-in replaces the ggml node it is meant to (counted after the
rewrite), and gives what that node means: a copy bit for bit, SILU_BACK / SOFT_MAX /
CROSS_ENTROPY_LOSS / the GELU stand-ins (tanh and erf forms) against float64 numpy, the centring product as x - mean(x),
a bias added to rows with the bits of the product it replaces. The finite-
difference checks of tests/test_engine_ops.py run through the same kernels."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import attention_float64, attention_program
from helpers import gelu_erf_f64, gelu_tanh_f64

from toyharness._ffi import blas, ffi, lib
from toyharness.engine import blocks, get_engine
from toyharness.engine.lowering import op_name

RNG = np.random.default_rng(7)


def custom_ops(graph) -> int:
    """How many nodes of a computed graph run one of our kernels."""
    names = [ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
             for i in range(lib.ggml_graph_n_nodes(graph))]
    return sum(n.startswith("MAP_CUSTOM") for n in names)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# (0, 3, 1, 2), (2, 0, 3, 1): the source contiguous along the copy's third or fourth axis (dV's heads)
@pytest.mark.parametrize("axes", [(0, 2, 1, 3), (0, 2, 3, 1), (3, 1, 2, 0), (1, 0, 3, 2), (0, 3, 1, 2), (2, 0, 3, 1)])
def test_cont_of_a_permute_is_an_exact_copy(axes):
    x = RNG.normal(size=(3, 37, 5, 33)).astype(np.float32)   # sizes not multiples of the 32 tile
    prog = get_engine("cpu", 2).program()
    t = prog.param("x", x)
    fg = prog.forward({"y": t.permute(*axes).cont()})
    got = fg.run({})["y"]
    assert custom_ops(fg.graph) == 1
    np.testing.assert_array_equal(got, np.transpose(x, axes))


def grad_of(prog, out, name: str, weights: np.ndarray) -> np.ndarray:
    loss = prog.scalar_loss((out * prog.constant("w", weights)).sum())
    tr = prog.trainer(loss, "bias_corrected")
    tr.grads_only({})
    return tr, prog.read(tr.grad_acc[name])


def test_silu_back_matches_the_derivative_including_large_inputs():
    x = np.concatenate([RNG.normal(size=4000) * 4, [-200.0, -88.5, -87.0, -30.0, 0.0, 30.0, 88.5, 200.0]])
    x = x.astype(np.float32)
    dy = RNG.normal(size=x.shape)
    prog = get_engine("cpu", 2).program()
    tr, g = grad_of(prog, prog.param("x", x).silu(), "x", dy)
    assert custom_ops(tr.gb_grad) >= 1
    xd = x.astype(np.float64)
    s = 1 / (1 + np.exp(-xd))
    expected = dy.astype(np.float32).astype(np.float64) * s * (1 + xd * (1 - s))
    assert np.isfinite(g).all()
    # float32 cancels in 1 + x (1 - s) near silu's minimum (x ~ -1.28): bound by |dy| there
    assert (np.abs(g - expected) <= 2e-6 * np.abs(expected) + 2e-7 * np.abs(dy)).all()


def test_centring_product_becomes_row_centring_forward_and_backward():
    d = 24
    x = RNG.normal(size=(50, d)).astype(np.float32) + 3.0
    dy = RNG.normal(size=(50, d))
    prog = get_engine("cpu", 2).program()
    c = prog.cached_constant(f"centring.{d}", lambda: np.eye(d, dtype=np.float32) - np.float32(1.0 / d))
    y = prog.param("x", x).matmul_t(c)
    fg = prog.forward({"y": y})
    tr, g = grad_of(prog, y, "x", dy)
    got = fg.run({})["y"]
    xd = x.astype(np.float64)
    assert rel_err(got, xd - xd.mean(axis=1, keepdims=True)) < 1e-6
    dyd = dy.astype(np.float32).astype(np.float64)
    assert rel_err(g, dyd - dyd.mean(axis=1, keepdims=True)) < 1e-6
    assert custom_ops(fg.graph) == 1 and custom_ops(tr.gb_grad) >= 2   # forward and backward product


def test_a_constant_named_centring_with_other_values_stays_a_product():
    d = 8
    w = RNG.normal(size=(d, d)).astype(np.float32)
    x = RNG.normal(size=(5, d)).astype(np.float32)
    prog = get_engine("cpu", 2).program()
    y = prog.param("x", x).matmul_t(prog.cached_constant(f"centring.{d}", lambda: w))
    got = prog.forward({"y": y}).run({})["y"]
    assert rel_err(got, x.astype(np.float64) @ w.T.astype(np.float64)) < 1e-5   # not x - mean(x)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_with_scale_and_mask(causal):
    s = RNG.normal(size=(2, 3, 40, 40)).astype(np.float32) * 3
    prog = get_engine("cpu", 2).program()
    fg = prog.forward({"p": prog.param("s", s).softmax(scale=0.7, causal=causal)})
    got = fg.run({})["p"]
    assert custom_ops(fg.graph) == 1
    z = 0.7 * s.astype(np.float64) + (np.triu(np.full((40, 40), -np.inf), 1) if causal else 0.0)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    expected = e / e.sum(axis=-1, keepdims=True)
    assert rel_err(got, expected) < 1e-6
    if causal:
        assert (got[..., np.triu_indices(40, 1)[0], np.triu_indices(40, 1)[1]] == 0).all()


def test_cross_entropy_value_matches_numpy_and_the_thread_invariant_report():
    vocab, rows = 37, 90
    logits = (RNG.normal(size=(rows, vocab)) * 4).astype(np.float32)
    targets = RNG.integers(0, vocab, size=rows)
    values = []
    for threads in (1, 2, 3, 9):           # 9: more threads than the kernel's 8 row blocks
        prog = get_engine("cpu", threads).program()
        loss = prog.cross_entropy(prog.param("logits", logits), "targets")
        tr = prog.trainer(loss, "bias_corrected")
        report = tr.grads_only({"targets": targets})
        values.append((tr.train_loss_value(), report))
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    expected = float(np.mean(lse - z[np.arange(rows), targets]))
    train, report = values[0]
    assert abs(train - expected) < 1e-6 * abs(expected) and abs(report - expected) < 1e-6 * abs(expected)
    assert len({v[0] for v in values}) == 1, f"train loss moved with the thread count: {values}"


def test_cross_entropy_gradient_is_softmax_minus_targets_over_rows_at_any_thread_count():
    """CROSS_ENTROPY_LOSS_BACK on our kernel (rows of 37 and 300 classes: a partial lane block):
    (softmax(x) - onehot) / rows against float64, the same bits at 1, 2 and 3 threads; and the
    report is the train loss itself (no second softmax in the graph)."""
    for vocab, rows in ((37, 90), (300, 70)):
        logits = (RNG.normal(size=(rows, vocab)) * 4).astype(np.float32)
        targets = RNG.integers(0, vocab, size=rows)
        grads = []
        for threads in (1, 2, 3):
            prog = get_engine("cpu", threads).program()
            loss = prog.cross_entropy(prog.param("logits", logits), "targets")
            assert loss.report is loss.train
            tr = prog.trainer(loss, "bias_corrected")
            tr.grads_only({"targets": targets})
            grads.append(prog.read(tr.grad_acc["logits"]).copy())
            assert "cross_entropy_back" in kernel_names(tr.gb_grad) and "softmax" not in kernel_names(tr.gb_grad)
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(1, keepdims=True))
        want = (p / p.sum(1, keepdims=True) - np.eye(vocab)[targets]) / rows
        assert rel_err(grads[0], want) < 1e-6
        for g in grads[1:]:
            np.testing.assert_array_equal(g, grads[0])


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
def test_bias_outer_product_is_exact():
    """K = 1 products (our bias broadcast) are written as x * y: the same bits as numpy."""
    a = RNG.normal(size=(70, 1)).astype(np.float32)
    b = RNG.normal(size=(9, 1)).astype(np.float32)
    prog = get_engine("cpu", 2).program()
    fg = prog.forward({"y": prog.param("a", a).matmul_t(prog.param("b", b))})
    np.testing.assert_array_equal(fg.run({})["y"], a * b.T)


def test_rms_norm_forward_and_backward():
    x = (RNG.normal(size=(3, 20, 40)) * 2).astype(np.float32)
    dy = RNG.normal(size=x.shape)
    prog = get_engine("cpu", 2).program()
    y = prog.param("x", x).rms_norm(1e-5)
    fg = prog.forward({"y": y})
    tr, g = grad_of(prog, y, "x", dy)
    got = fg.run({})["y"]
    assert custom_ops(fg.graph) == 1 and custom_ops(tr.gb_grad) >= 2
    xd, dyd = x.astype(np.float64), dy.astype(np.float32).astype(np.float64)
    ms = (xd * xd).mean(-1, keepdims=True) + 1e-5
    assert rel_err(got, xd / np.sqrt(ms)) < 1e-6
    expected = (dyd - xd * (xd * dyd).sum(-1, keepdims=True) / (x.shape[-1] * ms)) / np.sqrt(ms)
    assert rel_err(g, expected) < 1e-5


def gelu_program(x: np.ndarray, dy: np.ndarray, cpu_kernels: bool, forward_first: bool, gelu=blocks.gelu_tanh):
    """GELU of x and the gradient of sum(GELU(x) * dy); `forward_first`: the forward graph is
    computed (and rewritten) before the backward's graph, whose SILU_BACK must still be paired."""
    prog = get_engine("cpu", 2).program()
    prog.cpu_kernels = cpu_kernels
    y = gelu(prog.param("x", x))
    fg = prog.forward({"y": y})
    tr = prog.trainer(prog.scalar_loss((y * prog.constant("w", dy)).sum()), "bias_corrected")
    if forward_first:
        got = fg.run({})["y"]
    tr.grads_only({})
    g = prog.read(tr.grad_acc["x"])     # before another graph reuses the compute buffer it is in
    if not forward_first:
        got = fg.run({})["y"]
    return got, g, fg, tr


def test_gelu_stand_in_is_gelu_forward_and_backward():
    x = np.concatenate([RNG.normal(size=5000) * 3, [-100.0, -12.0, -5.0, 0.0, 5.0, 12.0, 100.0]]).astype(np.float32)
    dy = RNG.normal(size=x.shape)
    got, g, fg, tr = gelu_program(x, dy, cpu_kernels=True, forward_first=False)
    assert custom_ops(fg.graph) == 1                          # one node forward, not five
    assert custom_ops(tr.gb_grad) >= 2                        # and the SILU_BACK became GELU's derivative
    y64, d64 = gelu_tanh_f64(x.astype(np.float64))
    dyd = dy.astype(np.float32).astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(g).all()
    assert (np.abs(got - y64) <= 1e-6 * np.abs(y64) + 1e-7).all()
    # float32 cancels in s + x s (1 - s) k near GELU's minimum (x ~ -0.75): bound by |dy| there
    assert (np.abs(g - dyd * d64) <= 2e-6 * np.abs(dyd * d64) + 5e-7 * np.abs(dyd)).all()


def test_gelu_stand_in_agrees_with_the_composed_form_and_any_graph_order():
    x = (RNG.normal(size=(64, 33)) * 2).astype(np.float32)
    dy = RNG.normal(size=x.shape)
    fused = gelu_program(x, dy, cpu_kernels=True, forward_first=True)
    composed = gelu_program(x, dy, cpu_kernels=False, forward_first=True)
    assert custom_ops(composed[2].graph) == 0
    assert rel_err(fused[0], composed[0]) < 2e-6 and rel_err(fused[1], composed[1]) < 2e-6


def test_gelu_erf_stand_in_is_exact_gelu_forward_and_backward():
    x = np.concatenate([RNG.normal(size=5000) * 3, [-100.0, -12.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 12.0, 100.0]])
    x = x.astype(np.float32)
    dy = RNG.normal(size=x.shape)
    got, g, fg, tr = gelu_program(x, dy, cpu_kernels=True, forward_first=False, gelu=blocks.gelu_erf)
    assert kernel_names(fg.graph) == ["gelu_erf"]                          # one node forward
    assert "gelu_erf_back" in kernel_names(tr.gb_grad)                     # its SILU_BACK the derivative
    assert "gelu_erf_back" not in kernel_names(gelu_program(x, dy, True, False)[3].gb_grad)   # tanh's own
    y64, d64 = gelu_erf_f64(x.astype(np.float64))
    dyd = dy.astype(np.float32).astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(g).all()
    # Phi within 3e-7: erf by Abramowitz and Stegun 7.1.26 (7.5e-8 in Phi) and float32's rounding
    # of Phi near 1 (6e-8 an ulp)
    assert (np.abs(got - y64) <= 3e-7 * np.abs(x) + 1e-12).all()
    assert (np.abs(g - dyd * d64) <= 3e-7 * (1 + np.abs(x)) * np.abs(dyd)).all()
    tanh_y = gelu_program(x, dy, cpu_kernels=True, forward_first=False)[0]
    assert np.abs(tanh_y - y64).max() > 1e-4                               # not the tanh form


def test_gelu_erf_stand_in_agrees_with_the_composed_form_and_any_graph_order():
    x = (RNG.normal(size=(64, 33)) * 2).astype(np.float32)
    dy = RNG.normal(size=x.shape)
    fused = gelu_program(x, dy, cpu_kernels=True, forward_first=True, gelu=blocks.gelu_erf)
    composed = gelu_program(x, dy, cpu_kernels=False, forward_first=True, gelu=blocks.gelu_erf)
    assert kernel_names(fused[2].graph) == ["gelu_erf"] and custom_ops(composed[2].graph) == 0
    assert np.abs(fused[0] - composed[0]).max() < 1e-6
    assert np.abs(fused[1] - composed[1]).max() < 2e-6 * np.abs(dy).max()


def kernel_names(graph) -> list[str]:
    names = [lib.th_kernel_name(lib.ggml_graph_node(graph, i)) for i in range(lib.ggml_graph_n_nodes(graph))]
    return [ffi.string(n).decode() for n in names if n != ffi.NULL]


def gelu_of_a_product(x_out: str):
    """GELU of x = a * c (a node the program computes, which only GELU's two nodes read), the
    gradient of sum(GELU(x) * dy) in a, and the values of y and x. `x_out`: "before", x is
    also a forward graph's output from the start (the slope cannot be kept in it); "after", that
    graph is built once the training graph has kept the slope (it must give it back); "" never."""
    rng = np.random.default_rng(11)       # the same values for each x_out
    a = (rng.normal(size=(48, 40)) * 2).astype(np.float32)
    c = np.linspace(0.5, 1.5, 40, dtype=np.float32)
    dy = rng.normal(size=a.shape).astype(np.float32)
    prog = get_engine("cpu", 2).program()
    x = prog.param("a", a) * prog.constant("c", c)
    y = blocks.gelu_tanh(x)
    outputs = prog.forward({"x": x, "y": y}) if x_out == "before" else None
    tr = prog.trainer(prog.scalar_loss((y * prog.constant("w", dy)).sum()), "bias_corrected")
    tr.grads_only({})
    grads = [prog.read(tr.grad_acc["a"])]
    names = kernel_names(tr.gb_grad)
    if x_out == "after":
        outputs = prog.forward({"x": x, "y": y})
    values = outputs.run({}) if outputs is not None else prog.forward({"y": y}).run({})
    tr.grads_only({})
    grads.append(prog.read(tr.grad_acc["a"]))
    return a * c, dy, values, grads, names, kernel_names(tr.gb_grad)


def test_gelu_keeps_its_slope_from_the_forward_with_the_bits_of_taking_it_again():
    kept, dy, values, grads, names, _ = gelu_of_a_product("")
    assert "gelu+slope" in names and "gelu_back (kept slope)" in names     # the slope kept ...
    apart, _, values_apart, grads_apart, names_apart, _ = gelu_of_a_product("before")
    assert "gelu" in names_apart and "gelu+slope" not in names_apart       # ... not where x is an output
    np.testing.assert_array_equal(values_apart["x"], kept)                 # x itself, not its slope
    np.testing.assert_array_equal(values["y"], values_apart["y"])
    for g in grads + grads_apart:
        np.testing.assert_array_equal(g, grads[0])                         # the same bits either way
    xd = kept.astype(np.float64)
    y64, d64 = gelu_tanh_f64(xd)
    assert rel_err(values["y"], y64) < 2e-6
    c = np.linspace(0.5, 1.5, 40, dtype=np.float64)
    assert rel_err(grads[0], dy * d64 * c) < 2e-6


def test_a_later_graph_reading_gelus_input_gives_the_kept_slope_back():
    kept, _, values, grads, names, names_after = gelu_of_a_product("after")
    assert "gelu+slope" in names and "gelu+slope" not in names_after
    np.testing.assert_array_equal(values["x"], kept)       # the forward graph reads x, not its slope
    np.testing.assert_array_equal(grads[1], grads[0])      # and the backward takes the slope again


def bias_program(cpu_kernels: bool, y: np.ndarray, b: np.ndarray):
    prog = get_engine("cpu", 2).program()
    prog.cpu_kernels = cpu_kernels
    out = blocks.add_bias(prog.param("y", y), prog.param("b", b))
    return prog.forward({"out": out}), grad_of(prog, out, "b", np.ones_like(y))


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
def test_bias_rows_add_b_to_each_row_with_the_same_bits():
    y = RNG.normal(size=(3, 50, 24)).astype(np.float32)
    b = RNG.normal(size=24).astype(np.float32)
    fg, (tr, g) = bias_program(True, y, b)
    got = fg.run({})["out"]
    ops = [ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(fg.graph, i))).decode()
           for i in range(lib.ggml_graph_n_nodes(fg.graph))]
    assert ops.count("MAP_CUSTOM2") == 1 and "MUL_MAT" not in ops      # the product is not computed
    np.testing.assert_array_equal(got, y + b)
    fg0, (tr0, g0) = bias_program(False, y, b)
    np.testing.assert_array_equal(got, fg0.run({})["out"])
    np.testing.assert_array_equal(g, g0)


def bias_rows_by_hand():
    """y (10, 8), b (8,) and the named product ones @ b that blocks.add_bias builds."""
    y = RNG.normal(size=(10, 8)).astype(np.float32)
    b = RNG.normal(size=8).astype(np.float32)
    prog = get_engine("cpu", 2).program()
    ones = prog.constant("ones.10", np.ones((10, 1), np.float32))
    rows = ones.matmul_t(prog.param("b", b).reshape(8, 1)).named(blocks.BIAS_ROWS)
    return prog, prog.param("y", y), rows, y, b


def test_a_fused_bias_product_read_by_a_later_graph_is_an_error():
    prog, yt, rows, y, b = bias_rows_by_hand()
    np.testing.assert_array_equal(prog.forward({"out": yt + rows}).run({})["out"], y + b)
    with pytest.raises(RuntimeError, match="fused node is read"):
        prog.forward({"rows": rows.scale(2.0)}).run({})


def test_a_bias_product_read_elsewhere_in_its_graph_stays_a_product():
    prog, yt, rows, y, b = bias_rows_by_hand()
    out = prog.forward({"out": yt + rows, "twice": rows.scale(2.0)}).run({})
    np.testing.assert_array_equal(out["out"], y + b)
    np.testing.assert_array_equal(out["twice"], np.broadcast_to(2 * b, (10, 8)))


def rope_program(cpu_kernels: bool, x: np.ndarray, dy: np.ndarray, neox: bool, n_dims: int):
    prog = get_engine("cpu", 2).program()
    prog.cpu_kernels = cpu_kernels
    pos = prog.input("pos", (x.shape[1],), "i32")
    y = prog.param("x", x).rope(pos, n_dims, base=10000.0, neox=neox)
    fg = prog.forward({"y": y})
    tr = prog.trainer(prog.scalar_loss((y * prog.constant("w", dy)).sum()), "bias_corrected")
    positions = {"pos": np.arange(3, 3 + x.shape[1], dtype=np.int32)}
    tr.grads_only(positions)
    g = prog.read(tr.grad_acc["x"])     # before another graph reuses the compute buffer it is in
    return fg.run(positions)["y"], g, fg, tr


def rope_f64(x: np.ndarray, positions: np.ndarray, n_dims: int, neox: bool, sign: float = 1.0) -> np.ndarray:
    """x (B, T, H, hd) rotated by position * 10000^(-2i/n_dims) per pair i (sign -1: backward)."""
    out = x.astype(np.float64).copy()
    pairs = n_dims // 2
    theta = positions[:, None].astype(np.float64) * 10000.0 ** (-2.0 * np.arange(pairs) / n_dims)
    cos, sin = np.cos(theta)[None, :, None, :], sign * np.sin(theta)[None, :, None, :]
    first = np.arange(pairs) if neox else 2 * np.arange(pairs)
    second = first + (pairs if neox else 1)
    x0, x1 = out[..., first].copy(), out[..., second].copy()
    out[..., first], out[..., second] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    return out


@pytest.mark.parametrize("neox, n_dims", [(False, 16), (True, 16), (False, 12), (True, 14)])
def test_rope_and_its_backward(neox, n_dims):
    """The position table made once per position: ggml's table, so where ggml's rotation has no
    scalar tail (n_dims a multiple of 16) ggml's bits; otherwise within float32 rounding."""
    x = RNG.normal(size=(3, 29, 4, 16)).astype(np.float32)
    dy = RNG.normal(size=x.shape).astype(np.float32)
    y, g, fg, tr = rope_program(True, x, dy, neox, n_dims)
    assert custom_ops(fg.graph) == 1 and custom_ops(tr.gb_grad) >= 2
    positions = np.arange(3, 3 + x.shape[1])
    assert rel_err(y, rope_f64(x, positions, n_dims, neox)) < 1e-6
    assert rel_err(g, rope_f64(dy, positions, n_dims, neox, sign=-1.0)) < 1e-6
    np.testing.assert_array_equal(y[..., n_dims:], x[..., n_dims:])     # dims past n_dims pass through
    if n_dims % 16 == 0:
        y0, g0, fg0, _ = rope_program(False, x, dy, neox, n_dims)
        assert custom_ops(fg0.graph) == 0
        np.testing.assert_array_equal(y, y0)
        np.testing.assert_array_equal(g, g0)


def adamw_program(cpu_kernels: bool, w: np.ndarray, c: np.ndarray):
    """w trained on loss = sum(w * c): the gradient is c, fed to the AdamW node as is."""
    prog = get_engine("cpu", 2).program()
    prog.cpu_kernels = cpu_kernels
    wt = prog.param("w", w)
    return prog, wt, prog.trainer(prog.scalar_loss((wt * prog.constant("c", c)).sum()), "bias_corrected")


def test_adamw_kernel_gives_ggml_adamw_bits():
    """th_adamw_op (native/cpu_adamw.c) against ggml's own OPT_STEP_ADAMW, bit for bit: weights
    and both moments after each of 5 steps, with weight decay, a moving learning rate, gradients
    from 1e-30 to 1e4 (and exact zeros) and a size with a scalar tail after the vector loop."""
    from toyharness.adamw import HPRow, bias_corrected

    n = 4096 + 4 * 16 + 7
    w = RNG.normal(size=(n,)).astype(np.float32)
    c = (RNG.normal(size=n) * 10.0 ** RNG.uniform(-30, 4, size=n)).astype(np.float32)
    c[::97] = 0.0
    row = bias_corrected(lr=3e-2, weight_decay=0.1)
    runs = []
    for kernels in (True, False):
        prog, wt, tr = adamw_program(kernels, w, c)
        states = []
        for step in range(5):
            hp = row.hp_for_step(step)
            tr.step({}, HPRow([hp.lr / (step + 1), *hp[1:]], hp.convention))
            states.append([prog.read(t).tobytes() for t in (wt, tr.m["w"], tr.v["w"])])
        names = {ffi.string(lib.th_kernel_name(lib.ggml_graph_node(tr.gb_opt, i))).decode()
                 for i in range(lib.ggml_graph_n_nodes(tr.gb_opt))
                 if lib.th_kernel_name(lib.ggml_graph_node(tr.gb_opt, i)) != ffi.NULL}
        assert ("adamw" in names) == kernels
        runs.append(states)
    assert not np.array_equal(np.frombuffer(runs[0][4][0], np.float32), w)   # it trained
    for step, (ours, ggml) in enumerate(zip(*runs)):
        for what, a, b in zip(("w", "m", "v"), ours, ggml):
            assert a == b, f"step {step}: {what} differs from ggml's AdamW"


FOLD_DY = None


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
def test_products_fold_into_the_adds_that_read_them_with_the_same_bits():
    global FOLD_DY
    x = RNG.normal(size=(3, 70, 24)).astype(np.float32)      # 210 rows: blocks of 64 and a tail
    w1, w2 = (RNG.normal(size=(20, 24)).astype(np.float32) for _ in range(2))
    b = RNG.normal(size=20).astype(np.float32)
    r = RNG.normal(size=(3, 70, 20)).astype(np.float32)
    FOLD_DY = RNG.normal(size=r.shape).astype(np.float32)
    runs = []
    for folds in (True, False):
        prog = get_engine("cpu", 2).program()
        prog.cpu_folds = folds
        xt = prog.param("x", x)
        out = blocks.linear(xt, prog.param("w1", w1), prog.param("b", b)) + (
            xt.matmul_t(prog.param("w2", w2)) + prog.param("r", r))
        fg = prog.forward({"out": out})
        tr, gx = grad_of(prog, out, "x", FOLD_DY)
        # read before another graph computes (gradients live in the training graph's buffer)
        grads = [gx.copy()] + [prog.read(tr.grad_acc[n]).copy() for n in ("w1", "w2", "b", "r")]
        got = fg.run({})["out"]
        names = [lib.th_kernel_name(lib.ggml_graph_node(g, i)) for g in (fg.graph, tr.gb_grad)
                 for i in range(lib.ggml_graph_n_nodes(g))]
        fused = sum(ffi.string(n).decode() == "sgemm+add" for n in names if n != ffi.NULL)
        # forward: the bias's product and W2's (the residual's ADD) in each graph; backward: x's
        # gradient, two products added
        assert fused == (5 if folds else 0), fused
        runs.append((got, grads))
    np.testing.assert_allclose(runs[0][0], (x @ w1.T + b) + (x @ w2.T + r), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for ours, theirs in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(ours, theirs)


def gemm_cut(m: int, n: int) -> tuple[int, int]:
    rows, cols = ffi.new("int64_t *"), ffi.new("int64_t *")
    lib.th_gemm_cut(m, n, rows, cols)
    return rows[0], cols[0]


def test_product_tiles_merge_rows_and_cut_columns_by_the_shape_alone():
    assert gemm_cut(2048, 384) == (256, 384)       # 32 blocks of 64: 8 calls of 256 rows
    assert gemm_cut(1024, 128) == (128, 128)       # 8 calls of 128 rows
    assert gemm_cut(128, 512) == (64, 512)         # 2 blocks: as they were, every column a call
    assert gemm_cut(384, 1536) == (192, 384)       # a weight's gradient: 2 x 192 rows, 4 x 384 columns
    assert gemm_cut(384, 384) == (192, 192)
    assert gemm_cut(448, 1000) == (192, 336)       # 7 blocks: 3 calls of 192 rows, 3 column tiles
    assert gemm_cut(448, 300) == (192, 300)        # too few columns to cut


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
@pytest.mark.parametrize("m, n", [(384, 768), (1100, 40), (200, 900)])
def test_tiled_products_and_their_folds_keep_their_bits_at_any_thread_count(m, n):
    """Tiles of merged rows and cut columns (th_gemm_cut), with and without an addend folded in:
    float64's values within float32's error, and the same bits at 1, 2, 3 and 5 threads."""
    x = RNG.normal(size=(m, 48)).astype(np.float32)
    w = RNG.normal(size=(n, 48)).astype(np.float32)
    b = RNG.normal(size=n).astype(np.float32)
    r = RNG.normal(size=(m, n)).astype(np.float32)
    dy = RNG.normal(size=(m, n)).astype(np.float32)
    results = []
    for threads in (1, 2, 3, 5):
        prog = get_engine("cpu", threads).program()
        xt = prog.param("x", x)
        out = blocks.linear(xt, prog.param("wl", w), prog.param("b", b)) + prog.param("r", r)
        tr, gx = grad_of(prog, out, "x", dy)
        grads = [gx.copy()] + [prog.read(tr.grad_acc[k]).copy() for k in ("wl", "b")]
        g = tr.gb_grad
        names = [lib.th_kernel_name(lib.ggml_graph_node(g, i)) for i in range(lib.ggml_graph_n_nodes(g))]
        assert "sgemm+add" in {ffi.string(k).decode() for k in names if k != ffi.NULL}
        results.append([prog.forward({"out": out}).run({})["out"]] + grads)
    xd, wd, dyd = (a.astype(np.float64) for a in (x, w, dy))
    expected = [xd @ wd.T + b + r, dyd @ wd, dyd.T @ xd, dyd.sum(0)]
    for got, want in zip(results[0], expected):
        assert rel_err(got, want) < 1e-5
    for other in results[1:]:
        for got, same in zip(other, results[0]):
            np.testing.assert_array_equal(got, same)


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
@pytest.mark.parametrize("rows, n", [(1100, 40), (128, 300), (1024, 512), (37, 9)])
def test_a_bias_gradient_sums_its_column_in_blocks_of_128_rows_at_any_thread_count(rows, n):
    """ones^T dY (th_column_product): each column summed down the rows in float32, 128 rows a block
    and the blocks' sums in turn; numpy's sequential float32 sums give the same bits, float64's
    within float32's error, and 1, 2 and 3 threads the same bits."""
    x = RNG.normal(size=(rows, 16)).astype(np.float32)
    w = RNG.normal(size=(n, 16)).astype(np.float32)
    b = RNG.normal(size=n).astype(np.float32)
    dy = RNG.normal(size=(rows, n)).astype(np.float32)
    got = []
    for threads in (1, 2, 3):
        prog = get_engine("cpu", threads).program()
        out = blocks.linear(prog.param("x", x), prog.param("wl", w), prog.param("b", b))
        tr, gb = grad_of(prog, out, "b", dy)
        got.append(gb.copy())
    total = np.zeros(n, np.float32)
    for k0 in range(0, rows, 128):
        total = total + np.cumsum(dy[k0:k0 + 128], axis=0, dtype=np.float32)[-1]
    np.testing.assert_array_equal(got[0], total)
    assert rel_err(got[0], dy.astype(np.float64).sum(0)) < 1e-5
    for other in got[1:]:
        np.testing.assert_array_equal(other, got[0])


def causal_attention(shape: dict, threads: int = 2) -> dict[str, np.ndarray]:
    """attention_program's output and gradients, its causal products in blocks of 64 rows or columns;
    checks that the six products of causal attention took their causal form."""
    prog, trainer, fg = attention_program("cpu", **shape, threads=threads)
    got = {"y": fg.run({})["y"]}
    trainer.grads_only({})
    got.update({n: prog.read(trainer.grad_acc[n]).copy() for n in ("x", "wq", "wk", "wv", "wo")})
    g = trainer.gb_grad
    names = [lib.th_kernel_name(lib.ggml_graph_node(g, i)) for i in range(lib.ggml_graph_n_nodes(g))]
    # S and P V; dP, P^T dO, dS^T Q and dS K; and the softmax
    assert sum(ffi.string(n).decode() == "sgemm causal" for n in names if n != ffi.NULL) == 6
    assert sum(ffi.string(n).decode() == "softmax causal" for n in names if n != ffi.NULL) == 1
    return got


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
@pytest.mark.parametrize("shape", [dict(b=2, t=128, d=64, n_head=2), dict(b=1, t=200, d=96, n_head=6, n_kv_head=2)])
def test_causal_attention_products_leave_out_the_masked_terms(shape):
    """The products of causal attention contract only over the terms the mask leaves, in blocks of
    64 rows or columns (a length with a partial block; grouped-query heads): float64's values, the
    same bits at 1, 2 and 3 threads."""
    runs = [causal_attention(shape, threads) for threads in (1, 2, 3)]
    for name, want in attention_float64(**shape).items():
        assert rel_err(runs[0][name], want) < 2e-6, name
        for other in runs[1:]:
            np.testing.assert_array_equal(other[name], runs[0][name], err_msg=name)


@pytest.mark.parametrize("T", [5, 37, 64, 70])
def test_a_causal_softmax_stops_at_each_rows_diagonal_block_with_the_bits_of_whole_rows(T):
    """Under the causal mask a row's exps right of its diagonal are exact zeros: the kernel stops
    at the end of the 16-wide block that holds the diagonal. The same bits as the whole rows
    (the same mask's values under another name, which the rewrite does not take as causal), and
    float64's softmax."""
    x = (RNG.normal(size=(3, T, T)) * 3).astype(np.float32)
    prog = get_engine("cpu", 2).program()
    t = prog.param("x", x)
    masked = np.triu(np.full((T, T), -np.inf, np.float32), k=1)
    plain_mask = prog.constant("other_mask", masked)
    plain = t._new(lib.ggml_soft_max_ext(t._ctx, t.ptr, plain_mask.ptr, 0.5, 0.0))
    fg = prog.forward({"causal": t.softmax(scale=0.5, causal=True), "plain": plain})
    got = fg.run({})
    assert sorted(kernel_names(fg.graph)) == ["softmax", "softmax causal"]
    np.testing.assert_array_equal(got["causal"], got["plain"])
    z = x.astype(np.float64) * 0.5 + masked
    want = np.exp(z - z.max(-1, keepdims=True))
    assert rel_err(got["causal"], want / want.sum(-1, keepdims=True)) < 1e-6


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
@pytest.mark.parametrize("shape", [dict(b=2, t=65, d=64, n_head=4), dict(b=1, t=200, d=64, n_head=2)])
def test_attention_without_a_mask_takes_no_causal_form(shape):
    """A softmax with no mask (ViT's attention) is not causal: every product contracts over every
    term and the softmax reads whole rows (stop 66: a mask-less softmax passed th_mark_causal's
    check, and at 128 keys or more its products left terms out), float64's values."""
    prog, trainer, fg = attention_program("cpu", **shape, causal=False)
    got = {"y": fg.run({})["y"]}
    trainer.grads_only({})
    got.update({n: prog.read(trainer.grad_acc[n]).copy() for n in ("x", "wq", "wk", "wv", "wo")})
    names = kernel_names(trainer.gb_grad)
    assert "sgemm" in names and not [n for n in names if "causal" in n]
    for name, want in attention_float64(**shape, causal=False).items():
        assert rel_err(got[name], want) < 2e-6, name


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
@pytest.mark.parametrize("shape", [dict(b=2, t=96, d=96, n_head=6, n_kv_head=2),
                                   dict(b=1, t=70, d=64, n_head=4, n_kv_head=1)])
def test_grouped_kv_heads_read_in_place_give_the_repeats_bits(shape, programs_built_as):
    """Grouped-query heads on the cpu kernels: the products read each kv head in place for its group
    (no REPEAT node, no copies: a smaller compute buffer) against ggml's REPEATs (a program built
    with kv_in_place off, as other backends build it): the forward reads the same values and
    REPEAT_BACK sums each group's dK and dV in the same order, so y and every gradient keep their bits."""
    runs = {}
    for in_place in (True, False):
        if not in_place:
            programs_built_as(kv_in_place=False)
        prog, trainer, fg = attention_program("cpu", **shape)
        got = {"y": fg.run({})["y"]}
        trainer.grads_only({})
        got.update({n: prog.read(trainer.grad_acc[n]).copy() for n in ("x", "wq", "wk", "wv", "wo")})
        g = trainer.gb_grad
        ops = [op_name(lib.ggml_graph_node(g, i)) for i in range(lib.ggml_graph_n_nodes(g))]
        runs[in_place] = got, ops.count("REPEAT"), prog.compute_buffer_bytes()
    (in_place, repeats, in_place_bytes), (repeated, copies, repeated_bytes) = runs[True], runs[False]
    assert copies - repeats == 2 and in_place_bytes < repeated_bytes     # k's and v's REPEATs gone
    for name, want in repeated.items():
        np.testing.assert_array_equal(in_place[name], want, err_msg=name)
    for name, want in attention_float64(**shape).items():
        assert rel_err(in_place[name], want) < 2e-6, name


def product_of_params():
    """A program with p = x w^T of parameters x (10, 8) and w (6, 8), and an r (10, 6) to add to it:
    (program, p, (x, w, r))."""
    x = RNG.normal(size=(10, 8)).astype(np.float32)
    w = RNG.normal(size=(6, 8)).astype(np.float32)
    r = RNG.normal(size=(10, 6)).astype(np.float32)
    prog = get_engine("cpu", 2).program()
    return prog, prog.param("x", x).matmul_t(prog.param("wt", w)), (x, w, r)


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
def test_a_folded_product_read_by_a_later_graph_is_an_error():
    prog, p, (x, w, r) = product_of_params()
    out = p + prog.param("r", r)
    grad_of(prog, out, "wt", np.ones_like(r))          # the Trainer folds p into the ADD
    np.testing.assert_allclose(prog.forward({"out": out}).run({})["out"], x @ w.T + r, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="fused node is read"):
        prog.forward({"twice": p.scale(2.0)}).run({})


@pytest.mark.skipif(blas is None, reason="scipy-openblas32 is not installed: no sgemm to call")
def test_a_product_read_elsewhere_in_its_graph_is_not_folded():
    prog, p, (x, w, r) = product_of_params()
    out, twice = p + prog.param("r", r), p.scale(2.0)
    tr, _ = grad_of(prog, out + twice, "wt", np.ones_like(r))
    names = [lib.th_kernel_name(lib.ggml_graph_node(tr.gb_opt, i)) for i in range(lib.ggml_graph_n_nodes(tr.gb_opt))]
    assert "sgemm+add" not in {ffi.string(n).decode() for n in names if n != ffi.NULL}
    got = prog.forward({"out": out, "twice": twice}).run({})
    np.testing.assert_array_equal(got["out"], got["twice"] / 2 + r)


def test_a_norm_gain_folds_into_the_norm_backward_and_its_gradient_with_the_same_bits():
    """blocks.rms_norm (rms_norm(x) * g): the backward's MUL(dy, g) read by RMS_NORM_BACK, and
    MUL(normalised, dy) summed over the rows for g's gradient (REPEAT_BACK), each fold into the node
    that reads it (th_fold_norm_gains): the same gradients as the unfolded graph, bit for bit."""
    x = RNG.normal(size=(3, 50, 40)).astype(np.float32)        # 150 rows; 40 columns: a partial block
    g = (1 + RNG.normal(size=40) * 0.3).astype(np.float32)
    dy = RNG.normal(size=x.shape).astype(np.float32)
    runs = []
    for folds in (True, False):
        prog = get_engine("cpu", 2).program()
        prog.cpu_folds = folds
        out = blocks.rms_norm(prog.param("x", x), prog.param("g", g))
        tr, gx = grad_of(prog, out, "x", dy)
        names = {ffi.string(n).decode() for n in (lib.th_kernel_name(lib.ggml_graph_node(tr.gb_opt, i))
                                                  for i in range(lib.ggml_graph_n_nodes(tr.gb_opt))) if n != ffi.NULL}
        assert ({"rms_norm_back+gain", "gain_grad"} <= names) == folds, names
        runs.append((gx.copy(), prog.read(tr.grad_acc["g"]).copy()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    # and against float64: g's gradient is the column sum of dy * x / rms(x)
    xd = x.astype(np.float64).reshape(-1, 40)
    normed = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + 1e-5)
    assert rel_err(runs[0][1], (normed * dy.reshape(-1, 40)).sum(axis=0)) < 1e-5


# The fields of a block that hold fp16 scales (byte offsets), for the types frozen_dequant.c takes
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """n values of type qtype as raw blocks: random bytes, with finite random fp16 scales (normal,
    subnormal, zero and negative ones) where the block keeps them"""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n // block, size), dtype=np.uint8)
    halves = np.concatenate([rng.standard_normal(n // block) * 10.0 ** rng.integers(-7, 3, n // block),
                             [0.0, -0.0, 6e-8, -3e-5]])[: n // block].astype(np.float16)
    for offset in FP16_FIELDS.get(qtype.name, ()):
        raw[:, offset:offset + 2] = rng.permutation(halves).view(np.uint8).reshape(-1, 2)
    if qtype.name == "F16":
        raw = halves.repeat(2)[:n].astype(np.float16).view(np.uint8).reshape(n, 2)
        raw[: n // 2] = rng.standard_normal(n // 2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "F16"])
def test_fast_dequantization_gives_ggml_values_bit_for_bit(name):
    """frozen_dequant.c against ggml's own to_float, every value's bits (fp16 scales of every
    magnitude, subnormals and signed zeros among them)"""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(7)
    n = 256 * 96
    raw = random_blocks(qtype, n, rng)
    ours, ggml = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
    src = ffi.from_buffer(raw)
    assert lib.th_dequantize_row(int(qtype), src, ffi.cast("float *", ffi.from_buffer(ours)), n, 1) == 1
    assert lib.th_dequantize_row(int(qtype), src, ffi.cast("float *", ffi.from_buffer(ggml)), n, 0) == 1
    assert np.isfinite(ggml).all() and np.count_nonzero(ggml) > n // 2
    np.testing.assert_array_equal(ours.view(np.uint32), ggml.view(np.uint32))


def test_types_whose_ggml_dequantization_is_fast_are_left_to_ggml():
    import gguf

    out = np.zeros(256, np.float32)
    for name in ("Q8_0", "Q4_K", "Q5_K", "BF16"):
        raw = np.zeros(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1] * 256, np.uint8)
        assert lib.th_dequantize_row(int(gguf.GGMLQuantizationType[name]), ffi.from_buffer(raw),
                                     ffi.cast("float *", ffi.from_buffer(out)), 256, 1) == 0, name
