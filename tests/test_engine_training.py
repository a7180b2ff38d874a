"""The training step: AdamW against numpy (both conventions), resets, determinism across runs
and thread counts, mmap of frozen GGUF weights, and errors raised before ggml is called."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from toyharness.adamw import bias_corrected, constant_betas
from toyharness.engine import GGUFFile, blocks, get_engine, write_gguf
from toyharness.errors import BackendError, GGUFError, InputError, ShapeError


def fma(a, b, c):
    """a*b + c rounded once (the product of two float32s is exact in float64)."""
    return (a.astype(np.float64) * b + c.astype(np.float64)).astype(np.float32)


def numpy_adamw(w, g, m, v, row):
    """ggml's opt_step_adamw in float32, same operation order. Returns, per output, the
    candidates a C compiler may produce: plain, or with either product fused (FMA)."""
    f = np.float32
    lr, b1, b2, eps, wd, s5, s6 = (f(x) for x in row)
    m_c = [m * b1 + g * (f(1) - b1), fma(m, b1, g * (f(1) - b1)), fma(g, f(1) - b1, m * b1)]
    gg = g * g
    v_c = [v * b2 + gg * (f(1) - b2), fma(v, b2, gg * (f(1) - b2)), fma(gg, f(1) - b2, v * b2)]
    w_c = []
    for mn in m_c:
        for vn in v_c:
            step = lr * (mn * s5) / (np.sqrt(vn * s6) + eps)
            keep = f(1) - lr * wd
            w_c += [w * keep - step, fma(w, keep, -step)]
    return w_c, m_c, v_c


def min_ulps(actual: np.ndarray, candidates: list[np.ndarray]) -> int:
    """Largest over elements of the smallest ULP distance to any candidate."""
    per = np.stack([elementwise_ulps(actual, c) for c in candidates])
    return int(per.min(axis=0).max())


def elementwise_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ia = a.astype(np.float32).view(np.int32).astype(np.int64)
    ib = b.astype(np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def tiny_program(threads=2, transposed=False, seed=0):
    """y = x @ W.T (or x @ Wt when transposed), mean CE over 4 classes."""
    rng = np.random.default_rng(seed)
    eng = get_engine("cpu", threads)
    prog = eng.program()
    w0 = rng.normal(size=(6, 4) if transposed else (4, 6)).astype(np.float32)
    w = prog.param("w", w0)
    x = prog.input("x", (5, 6))
    weight = w.transpose().cont() if transposed else w
    logits = blocks.linear(x, weight)
    return prog, w, w0, prog.cross_entropy(logits, "targets")


@pytest.mark.parametrize("convention", ["bias_corrected", "constant_betas"])
@pytest.mark.parametrize("transposed", [False, True])
def test_adamw_step_matches_numpy(convention, transposed):
    prog, w, w0, ce = tiny_program(transposed=transposed)
    tr = prog.trainer(ce, convention)
    row = (bias_corrected if convention == "bias_corrected" else constant_betas)(lr=0.05, weight_decay=0.1)
    rng = np.random.default_rng(1)
    for step in range(3):
        feeds = {"x": rng.normal(size=(5, 6)), "targets": rng.integers(0, 4, 5)}
        # state before the step, and the gradient at it (same graph, no update)
        w_before, m, v = prog.read(w), prog.read(tr.m["w"]), prog.read(tr.v["w"])
        if step == 0:
            m, v = np.zeros_like(m), np.zeros_like(v)
        tr.grads_only(feeds)
        g = prog.read(tr.grad_acc["w"])
        tr.needs_full_reset = step == 0
        tr.step(feeds, row.hp_for_step(step))
        w_c, m_c, v_c = numpy_adamw(w_before, g, m, v, row.hp_for_step(step))
        assert min_ulps(prog.read(w), w_c) <= 1, f"step {step}: w {min_ulps(prog.read(w), w_c)} ULP"
        assert min_ulps(prog.read(tr.m["w"]), m_c) <= 1, f"step {step}: m off"
        assert min_ulps(prog.read(tr.v["w"]), v_c) <= 1, f"step {step}: v off"


def test_grads_only_reset_keeps_moments_and_clears_gradients():
    prog, w, w0, ce = tiny_program()
    tr = prog.trainer(ce, "bias_corrected")
    row = bias_corrected(lr=0.05)
    rng = np.random.default_rng(2)
    a = {"x": rng.normal(size=(5, 6)), "targets": rng.integers(0, 4, 5)}
    b = {"x": rng.normal(size=(5, 6)), "targets": rng.integers(0, 4, 5)}
    tr.step(a, row.hp_for_step(0))
    m1, v1, w1 = prog.read(tr.m["w"]), prog.read(tr.v["w"]), prog.read(w)
    tr.step(b, row.hp_for_step(1))
    g_b = prog.read(tr.grad_acc["w"])
    # the gradient of batch b alone at w1, computed on a fresh program
    prog2, w_2, _, ce2 = tiny_program()
    tr2 = prog2.trainer(ce2, "bias_corrected")
    prog2.write(w_2, w1)
    tr2.grads_only(b)
    expected_g = prog2.read(tr2.grad_acc["w"])
    assert np.array_equal(g_b, expected_g), "gradients were not reset between steps"
    _, m_c, v_c = numpy_adamw(w1, expected_g, m1, v1, row.hp_for_step(1))
    assert min_ulps(prog.read(tr.m["w"]), m_c) <= 1, "moments lost"
    assert min_ulps(prog.read(tr.v["w"]), v_c) <= 1, "moments lost"


def test_full_reset_zeroes_moments():
    prog, w, w0, ce = tiny_program()
    tr = prog.trainer(ce, "bias_corrected")
    rng = np.random.default_rng(3)
    tr.step({"x": rng.normal(size=(5, 6)), "targets": rng.integers(0, 4, 5)}, bias_corrected().hp_for_step(0))
    assert np.abs(prog.read(tr.m["w"])).sum() > 0
    tr.reset_full()
    assert not prog.read(tr.m["w"]).any() and not prog.read(tr.v["w"]).any()


def test_convention_mismatch_raises_before_any_step():
    prog, w, w0, ce = tiny_program()
    tr = prog.trainer(ce, "constant_betas")
    with pytest.raises(InputError, match="declares 'constant_betas'"):
        tr.step({"x": np.zeros((5, 6)), "targets": np.zeros(5, int)}, bias_corrected().hp_for_step(0))
    assert np.array_equal(prog.read(w), w0)


def small_lm_losses(threads: int, steps: int = 4):
    """Losses and final parameters of a 2-layer llama-style stack."""
    rng = np.random.default_rng(0)
    V, D, T, B, H, KV = 32, 16, 8, 2, 4, 2
    eng = get_engine("cpu", threads)
    prog = eng.program()
    P = {"emb": prog.param("emb", rng.normal(0, 0.1, (V, D)))}
    for i in range(2):
        for n, shape in (("q", (D, D)), ("k", (KV * 4, D)), ("v", (KV * 4, D)), ("o", (D, D)), ("g", (24, D)),
                         ("u", (24, D)), ("d", (D, 24))):
            P[f"{n}{i}"] = prog.param(f"{n}{i}", rng.normal(0, 0.2, shape))
    tok = prog.input("tokens", (B, T), "i32", upper=V)
    pos = prog.constant("pos", np.arange(T))
    h = P["emb"].get_rows(tok)
    for i in range(2):
        h = h + blocks.attention(h.rms_norm(1e-5), P[f"q{i}"], P[f"k{i}"], P[f"v{i}"], P[f"o{i}"], H, KV,
                                 rope_positions=pos)
        h = h + blocks.swiglu_mlp(h.rms_norm(1e-5), P[f"g{i}"], P[f"u{i}"], P[f"d{i}"])
    ce = prog.cross_entropy(blocks.linear(h, P["emb"]), "targets")
    tr = prog.trainer(ce, "constant_betas")
    row = constant_betas(lr=3e-3)
    losses = []
    for s in range(steps):
        x = np.random.default_rng(9).integers(0, V, (B, T + 1))  # one batch: the loss must fall
        losses.append(np.float32(tr.step({"tokens": x[:, :-1], "targets": x[:, 1:]}, row.hp_for_step(s))))
    params = {k: prog.read(t) for k, t in P.items()}
    return np.array(losses, np.float32), params


def test_training_is_bit_identical_run_to_run():
    l1, p1 = small_lm_losses(2)
    l2, p2 = small_lm_losses(2)
    assert l1.tobytes() == l2.tobytes()
    assert all(p1[k].tobytes() == p2[k].tobytes() for k in p1)
    assert l1[-1] < l1[0]


def test_reported_loss_and_params_do_not_depend_on_thread_count():
    ref_l, ref_p = small_lm_losses(1)
    for threads in (2, 4):
        losses, p = small_lm_losses(threads)
        assert losses.tobytes() == ref_l.tobytes(), f"{threads} threads: {losses} vs {ref_l}"
        for k in ref_p:
            assert p[k].tobytes() == ref_p[k].tobytes(), f"{threads} threads: parameter {k} differs"
    get_engine("cpu", 2)


def test_mmap_frozen_gguf_does_not_copy(tmp_path):
    """Binding a 100+ MB frozen GGUF on cpu grows RSS by less than 10% of the file."""
    path = tmp_path / "big.gguf"
    write_gguf(path, "llama", {"big.weight": np.ones((6500, 4096), np.float32)})  # 106 MB
    size = path.stat().st_size
    code = textwrap.dedent(f"""
        import numpy as np
        def rss():
            for line in open('/proc/self/status'):
                if line.startswith('VmRSS'):
                    return int(line.split()[1]) * 1024
        from toyharness.engine import GGUFFile, get_engine, blocks
        eng = get_engine('cpu', 1)
        prog = eng.program()
        before = rss()
        f = GGUFFile({str(path)!r})
        w = prog.frozen_gguf(f, 'big.weight', expect_shape=(6500, 4096))
        x = prog.input('x', (1, 4096))
        y = blocks.linear(x, w.view_rows(0, 2))
        prog.allocate()
        out = prog.forward({{'y': y}}).run({{'x': np.ones((1, 4096))}})['y']
        assert out[0, 0] == 4096.0, out
        print(rss() - before)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    grown = int(res.stdout.strip().splitlines()[-1])
    assert grown < 0.1 * size, f"RSS grew {grown / 1e6:.1f} MB for a {size / 1e6:.1f} MB file"


# --- errors before ggml ---------------------------------------------------------------------------
def test_wrong_feed_shape_names_the_input():
    prog, w, w0, ce = tiny_program()
    tr = prog.trainer(ce, "bias_corrected")
    with pytest.raises(ShapeError, match=r"input 'x': expected shape \(5, 6\), got \(5, 7\)"):
        tr.step({"x": np.zeros((5, 7)), "targets": np.zeros(5, int)}, bias_corrected().hp_for_step(0))


def test_out_of_range_ids_are_rejected():
    prog, w, w0, ce = tiny_program()
    tr = prog.trainer(ce, "bias_corrected")
    with pytest.raises(InputError, match=r"'targets': id 4 out of range \[0, 4\)"):
        tr.step({"x": np.zeros((5, 6)), "targets": np.array([0, 1, 2, 3, 4])}, bias_corrected().hp_for_step(0))


def test_bad_feeds_name_the_value_and_write_nothing():
    prog, w, w0, ce = tiny_program()
    ids = prog.input("ids", (3,), "i32", upper=10)
    fg = prog.forward({"x": prog.inputs["x"].tensor.scale(1.0), "ids": ids})
    good = {"x": np.ones((5, 6)), "ids": np.array([1, 2, 3])}
    np.testing.assert_array_equal(fg.run(good)["x"], np.ones((5, 6)))
    x = np.ones((5, 6))
    x[2, 3] = np.nan
    with pytest.raises(InputError, match=r"input 'x': contains NaN or inf"):
        fg.run({"x": x})
    with pytest.raises(InputError, match=r"input 'x': contains NaN or inf"):
        fg.run({"x": np.full((5, 6), 1e39)})                   # finite in float64, inf as float32
    for bad, shown in (([1, -2, 3], -2), ([1, 10, 30], 10)):
        with pytest.raises(InputError, match=rf"'ids': id {shown} out of range \[0, 10\)"):
            fg.run({"ids": np.array(bad)})
    with pytest.raises(InputError, match=r"input 'ids': expected integer ids, got float64"):
        fg.run({"ids": np.array([1.0, 2.0, 3.0])})
    with pytest.raises(InputError, match=r"'ids': id 18446744073709551615 out of range"):
        fg.run({"ids": np.array([1, 2, 2 ** 64 - 1], dtype=np.uint64)})
    out = fg.run({})                                          # nothing of the rejected feeds was written
    np.testing.assert_array_equal(out["x"], np.ones((5, 6)))
    np.testing.assert_array_equal(out["ids"], [1, 2, 3])


def test_targets_one_hot_follows_each_feed():
    """Fed targets replace the last ones (their one-hot rows are cleared), and a rejected feed
    leaves the last good ones: each step's loss equals a fresh program's on the same batch."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 6))
    batches = [np.array([0, 1, 2, 3, 0]), np.array([3, 3, 1, 0, 2]), np.array([2, 0, 0, 1, 3])]
    prog, w, w0, ce = tiny_program()
    tr = prog.trainer(ce, "bias_corrected")
    for t in batches:
        with pytest.raises(InputError, match=r"'targets': id 7 out of range"):
            tr.eval_loss({"x": x, "targets": np.array([0, 1, 7, 3, 0])})
        with pytest.raises(InputError, match=r"targets 'targets': expected integer class ids"):
            tr.eval_loss({"x": x, "targets": t.astype(float)})
        fresh, _, _, fresh_ce = tiny_program()
        expected = fresh.trainer(fresh_ce, "bias_corrected").eval_loss({"x": x, "targets": t})
        assert tr.eval_loss({"x": x, "targets": t}) == expected


def test_wrong_size_write_is_rejected():
    prog, w, w0, ce = tiny_program()
    with pytest.raises(ShapeError, match=r"w: expected shape \(4, 6\), got \(4, 5\)"):
        prog.write(w, np.zeros((4, 5)))


def test_bad_matmul_shape_is_rejected_before_ggml():
    prog = get_engine("cpu").program()
    x = prog.input("x", (2, 3))
    w = prog.param("w", np.zeros((4, 5)))
    with pytest.raises(ShapeError, match="linear: weight"):
        blocks.linear(x, w)


def test_unknown_backend():
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        get_engine("tpu")


def test_backend_not_built():
    with pytest.raises(BackendError, match="not in this build"):
        get_engine("cuda") if "cuda" not in __import__("toyharness._ffi").\
            _ffi.available_native_backends() else pytest.skip("this build includes cuda")


def test_gguf_errors(tmp_path):
    good = tmp_path / "ok.gguf"
    write_gguf(good, "llama", {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4)})
    with GGUFFile(good) as f:
        assert np.array_equal(f.tensor("a.weight").to_numpy(), np.arange(12).reshape(3, 4))
        with pytest.raises(GGUFError, match="tensor 'b.weight' not found"):
            f.tensor("b.weight")
        with pytest.raises(GGUFError, match=r"has shape \(3, 4\), expected \(4, 3\)"):
            f.tensor("a.weight", expect_shape=(4, 3))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 hello")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(not_gguf)
    data = good.read_bytes()
    for cut in (len(data) - 30, 40, 10):  # (the last 16 bytes are alignment padding)
        trunc = tmp_path / f"trunc{cut}.gguf"
        trunc.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(trunc)
    with pytest.raises(GGUFError, match="file not found"):
        GGUFFile(tmp_path / "missing.gguf")


def test_abort_handler_names_ggml(tmp_path):
    """What does reach a ggml abort prints ggml's message through our handler."""
    code = ("from toyharness._ffi import lib, ffi\n"
            "from toyharness.engine import get_engine\n"
            "p = get_engine('cpu').program()\n"
            "a = p.input('a', (2, 3)); b = p.input('b', (4, 5))\n"
            "lib.ggml_mul_mat(p._ctx_compute, a.ptr, b.ptr)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert res.returncode != 0
    assert "toyharness: ggml aborted the process" in res.stderr and "GGML_ASSERT" in res.stderr


def test_one_hot_targets_built_in_the_graph_train_the_same_bits():
    """cuda builds the one-hot targets in the graph (FILL, SET_ROWS at the flat indices) instead
    of uploading rows x vocab floats each step: forced here on cpu, every loss, both losses'
    bits and the trained weights equal the uploaded one-hot's; a bad id is still named."""
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(5, 6)) for _ in range(4)]
    ys = [rng.integers(0, 4, size=5) for _ in range(4)]
    runs = []
    for in_graph in (False, True):
        eng = get_engine("cpu", 2)
        prog = eng.program()
        prog.onehot_in_graph = in_graph
        w = prog.param("w", np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32))
        x = prog.input("x", (5, 6))
        ce = prog.cross_entropy(blocks.linear(x, w), "targets")
        tr = prog.trainer(ce, "bias_corrected")
        losses = [(tr.step({"x": a, "targets": b}, bias_corrected().hp_for_step(i)), tr.train_loss_value())
                  for i, (a, b) in enumerate(zip(xs, ys))]
        runs.append((losses, prog.read(w)))
        if in_graph:
            with pytest.raises(InputError, match=r"id 4 out of range \[0, 4\)"):
                tr.step({"x": xs[0], "targets": np.array([0, 1, 4, 2, 3])}, bias_corrected().hp_for_step(9))
    assert runs[0][0] == runs[1][0]
    assert np.array_equal(runs[0][1], runs[1][1])
