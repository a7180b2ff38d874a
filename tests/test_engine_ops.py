"""Every op and composed block the recipes use: forward against a float64 numpy reference
(relative error < 1e-5) and backward against central finite differences of that reference
(relative error < 1e-3); on the backend TOYHARNESS_TEST_BACKEND names, and the cpu ones again in
the portable golden mode."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import fd_grad

from toyharness._ffi import available_native_backends
from toyharness.engine import blocks, get_engine
from toyharness.engine.program import Program
from toyharness.errors import InputError
from toyharness.switches import switch

# TOYHARNESS_TEST_BACKEND=cuda runs the same checks on another backend (tools/gpu_check.sh,
# nox -s tests-cuda).
BACKEND = switch("TOYHARNESS_TEST_BACKEND")
if BACKEND not in available_native_backends():
    pytestmark = pytest.mark.skip(reason=f"TOYHARNESS_TEST_BACKEND={BACKEND}: that backend is not built into this "
                                         "install or has no device")
RNG = np.random.default_rng(1234)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))




def check(build, ref, inputs: dict[str, np.ndarray], fwd_tol=1e-5, bwd_tol=1e-3, ids: dict | None = None,
          no_grad: tuple = ()):
    """build(prog, T) -> Tensor; ref(A) -> ndarray (float64). Inputs are trainable params."""
    eng = get_engine(BACKEND)
    prog = eng.program()
    inputs = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    T = {k: prog.param(k, v.astype(np.float32), trainable=k not in no_grad) for k, v in inputs.items()}
    for k, (v, _upper) in (ids or {}).items():
        T[k] = prog.constant(k, v)
    out = build(prog, T)
    A32 = {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}
    A32.update({k: v for k, (v, _) in (ids or {}).items()})
    expected = ref(A32)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    weights = RNG.normal(size=expected.shape)
    w = prog.constant("loss_weights", weights)
    loss = prog.scalar_loss((out * w).sum() if out.is_contiguous() else (out.cont() * w).sum())
    trainer = prog.trainer(loss, "bias_corrected")
    fg = prog.forward({"out": out if out.is_contiguous() else out.cont()})
    got = fg.run({})["out"]
    assert rel_err(got, expected) < fwd_tol, f"forward rel err {rel_err(got, expected):.2e}"
    trainer.grads_only({})
    for k in inputs:
        if k in no_grad:
            continue
        g = prog.read(trainer.grad_acc[k])
        fd = fd_grad(lambda A: float((ref(A) * weights).sum()), A32, k)
        # absolute floor: some gradients are exactly zero (a key bias under softmax)
        err = np.linalg.norm(g - fd)
        assert err <= bwd_tol * np.linalg.norm(fd) + 1e-5, f"grad of {k}: rel err {rel_err(g, fd):.2e}"
    return got


def r(*shape, scale=1.0):
    return RNG.normal(size=shape) * scale


# --- numpy references -----------------------------------------------------------------------
def np_layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def np_rms_norm(x, eps=1e-5):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_gelu_erf(x):
    return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_rope(x, pos, base=10000.0):
    """Adjacent pairs (x[2i], x[2i+1]) rotated by pos * base^(-2i/d); x (B, T, H, d)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-np.arange(0, d, 2) / d)      # (T, d/2)
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def np_attention(x, wq, wk, wv, wo, n_head, n_kv, causal, bq=None, bk=None, bv=None, bo=None, pos=None):
    B, T, D = x.shape
    hd = D // n_head
    q = x @ wq.T + (0 if bq is None else bq)
    k = x @ wk.T + (0 if bk is None else bk)
    v = x @ wv.T + (0 if bv is None else bv)
    q, k, v = q.reshape(B, T, n_head, hd), k.reshape(B, T, n_kv, hd), v.reshape(B, T, n_kv, hd)
    if pos is not None:
        q, k = np_rope(q, pos), np_rope(k, pos)
    rep = n_head // n_kv
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    if causal:
        s = s + np.triu(np.full((T, T), -np.inf), 1)
    a = np_softmax(s)
    o = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, D)
    return o @ wo.T + (0 if bo is None else bo)


# --- elementwise and shape ops ------------------------------------------------------------------
@pytest.mark.parametrize("op", ["add", "mul", "sub", "div"])
def test_binary_broadcast(op):
    npop = {"add": np.add, "mul": np.multiply, "sub": np.subtract, "div": np.divide}[op]
    pyop = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "sub": lambda a, b: a - b,
            "div": lambda a, b: a / b}[op]
    b = r(5) if op != "div" else RNG.uniform(0.5, 2.0, 5)
    check(lambda p, T: pyop(T["a"], T["b"]), lambda A: npop(A["a"], A["b"]), {"a": r(3, 4, 5), "b": b})


UNARY_CASES = [
    ("scale", lambda t: t.scale(-0.7), lambda a: -0.7 * a, lambda: r(4, 6)),
    ("sqr", lambda t: t.sqr(), lambda a: a * a, lambda: r(4, 6)),
    ("sqrt", lambda t: t.sqrt(), np.sqrt, lambda: RNG.uniform(0.5, 3, (4, 6))),
    ("log", lambda t: t.log(), np.log, lambda: RNG.uniform(0.5, 3, (4, 6))),
    ("exp", lambda t: t.exp(), np.exp, lambda: r(4, 6)),
    ("neg", lambda t: -t, np.negative, lambda: r(4, 6)),
    ("silu", lambda t: t.silu(), lambda a: a / (1 + np.exp(-a)), lambda: r(4, 6)),
    ("softplus", lambda t: t.softplus(), lambda a: np.log1p(np.exp(a)), lambda: r(4, 6)),
    ("sum_rows", lambda t: t.sum_rows(), lambda a: a.sum(-1, keepdims=True), lambda: r(3, 4, 6)),
    ("mean_rows", lambda t: t.mean_rows(), lambda a: a.mean(-1, keepdims=True), lambda: r(3, 4, 6)),
    ("reshape", lambda t: t.reshape(6, 4), lambda a: a.reshape(6, 4), lambda: r(4, 6)),
    ("permute", lambda t: t.permute(0, 2, 1, 3).cont(), lambda a: a.transpose(0, 2, 1, 3), lambda: r(2, 3, 4, 5)),
    ("transpose", lambda t: t.transpose().cont(), lambda a: np.swapaxes(a, -1, -2), lambda: r(3, 4, 5)),
    ("rms_norm", lambda t: t.rms_norm(1e-5), np_rms_norm, lambda: r(3, 4, 8)),
    ("softmax", lambda t: t.softmax(), np_softmax, lambda: r(3, 4, 8)),
    ("softmax_scaled", lambda t: t.softmax(scale=0.3), lambda a: np_softmax(0.3 * a), lambda: r(3, 4, 8)),
    ("causal_softmax", lambda t: t.causal_mask().softmax(),
     lambda a: np_softmax(a + np.triu(np.full((5, 5), -np.inf), 1)), lambda: r(2, 3, 5, 5)),
    ("causal_softmax_fused", lambda t: t.softmax(scale=0.3, causal=True),
     lambda a: np_softmax(0.3 * a + np.triu(np.full((5, 5), -np.inf), 1)), lambda: r(2, 3, 5, 5)),
    ("gelu_tanh", blocks.gelu_tanh, np_gelu_tanh, lambda: r(4, 6, scale=2.0)),
    ("gelu_erf", blocks.gelu_erf, np_gelu_erf, lambda: r(4, 6, scale=2.0)),
]


@pytest.mark.parametrize("name,fn,ref,make", UNARY_CASES)
def test_unary(name, fn, ref, make):
    check(lambda p, T: fn(T["a"]), lambda A: ref(A["a"]), {"a": make()})


def test_gelu_is_finite_for_large_inputs():
    """1/(1+exp(-2u)) overflows for large negative x and its backward gives NaN; ours must not."""
    x = np.array([[-60.0, -30.0, -5.0, 0.0, 5.0, 30.0, 60.0, 1.0]])
    prog = get_engine(BACKEND).program()
    t = prog.param("x", x)
    loss = prog.scalar_loss(blocks.gelu_tanh(t).sum())
    tr = prog.trainer(loss, "bias_corrected")
    tr.grads_only({})
    g = prog.read(tr.grad_acc["x"])
    assert np.isfinite(g).all(), g
    assert abs(g[0, 0]) < 1e-6 and abs(g[0, -2] - 1.0) < 1e-6


def test_linear_matmul():
    check(lambda p, T: blocks.linear(T["x"], T["w"], T["b"]), lambda A: A["x"] @ A["w"].T + A["b"],
          {"x": r(2, 3, 8), "w": r(5, 8), "b": r(5)})


def test_weight_used_only_through_transpose():
    """A parameter used through a transpose gets a non-contiguous gradient in ggml."""
    check(lambda p, T: blocks.linear(T["x"], T["wt"].transpose().cont()), lambda A: A["x"] @ A["wt"],
          {"x": r(4, 6), "wt": r(6, 3)})


@pytest.mark.parametrize("kv", [3, 1])
def test_bmm_with_head_broadcast(kv):
    check(lambda p, T: T["q"].bmm_t(T["k"]),
          lambda A: np.einsum("bhqd,bhkd->bhqk", A["q"], np.repeat(A["k"], 3 // kv, axis=1)),
          {"q": r(2, 3, 4, 5), "k": r(2, kv, 6, 5)})


def test_get_rows_embedding():
    ids = RNG.integers(0, 7, (2, 5)).astype(np.int32)
    check(lambda p, T: T["emb"].get_rows(T["ids"]), lambda A: A["emb"][A["ids"]], {"emb": r(7, 4)},
          ids={"ids": (ids, 7)})


def test_softmax_whose_gradient_arrives_as_a_view():
    """Each row's target probability picked from the flattened softmax (as token_logps picks it):
    SOFT_MAX_BACK's gradient is then a view, and ggml-alloc would give dx the softmax's own buffer,
    which ggml's cpu kernel reads after writing (graph_rewrites.keep_softmax_for_backward)."""
    rows, vocab = 6, 9
    picks = RNG.integers(0, vocab, rows)
    flat = (np.arange(rows) * vocab + picks).astype(np.int32)
    check(lambda p, T: T["x"].softmax().reshape(rows * vocab, 1).get_rows(T["flat"]).log(),
          lambda A: np.log(np_softmax(A["x"])[np.arange(rows), picks])[:, None], {"x": r(rows, vocab)},
          ids={"flat": (flat, rows * vocab)})


def test_rope_adjacent_pairs():
    pos = np.arange(5, dtype=np.int32)
    check(lambda p, T: T["x"].rope(T["pos"], 8), lambda A: np_rope(A["x"], A["pos"].astype(np.float64)),
          {"x": r(2, 5, 3, 8)}, ids={"pos": (pos, None)})


def test_swiglu():
    check(lambda p, T: T["g"].swiglu(T["u"]), lambda A: A["g"] / (1 + np.exp(-A["g"])) * A["u"],
          {"g": r(3, 6), "u": r(3, 6)})


# --- composed blocks ----------------------------------------------------------------------------
# column_sums: how a bias's or gain's gradient (a sum over rows) is formed: ggml's REPEAT_BACK (cpu's
# default) or OUT_PROD with a column of ones (cuda's default; Program.column_sums_as_products, set by
# the programs_built_as fixture to check either form on any backend)
COLUMN_SUMS = ["repeat_back", "product"]


@pytest.mark.parametrize("column_sums", COLUMN_SUMS)
def test_layer_norm(column_sums, programs_built_as):
    programs_built_as(column_sums_as_products=column_sums == "product")
    check(lambda p, T: blocks.layer_norm(T["x"], T["g"], T["b"]), lambda A: np_layer_norm(A["x"], A["g"], A["b"]),
          {"x": r(2, 3, 8), "g": r(8), "b": r(8)})


@pytest.mark.parametrize("column_sums", COLUMN_SUMS)
def test_rms_norm_block(column_sums, programs_built_as):
    programs_built_as(column_sums_as_products=column_sums == "product")
    check(lambda p, T: blocks.rms_norm(T["x"], T["g"]), lambda A: np_rms_norm(A["x"]) * A["g"],
          {"x": r(2, 3, 8), "g": r(8)})


def test_column_sums_as_products_leave_no_repeat_back_and_keep_the_forward_bits(programs_built_as):
    """The point of the product form: no REPEAT_BACK left in the backward (ggml-cuda's is one
    thread per column) and a gain's and a bias's forward bit for bit as before. (LayerNorm's
    centring differs in its last bits: a mean subtracted instead of a product; test_layer_norm.)"""
    from toyharness._ffi import ffi, lib

    x, g, b = r(4, 5, 16).astype(np.float32), r(16).astype(np.float32), r(16).astype(np.float32)
    outs, ops = {}, {}
    for mode in COLUMN_SUMS:
        programs_built_as(column_sums_as_products=mode == "product")
        prog = get_engine(BACKEND).program()
        prog.cpu_folds = False      # the nodes as built (on cpu the gain's REPEAT_BACK would fold)
        X, G, B = prog.param("x", x), prog.param("g", g), prog.param("b", b)
        out = blocks.add_bias(blocks.rms_norm(X, G), B)
        trainer = prog.trainer(prog.scalar_loss(out.sum()), "bias_corrected")
        graph = trainer.gb_opt
        ops[mode] = [ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
                     for i in range(lib.ggml_graph_n_nodes(graph))]
        outs[mode] = prog.forward({"out": out}).run({})["out"]
    if BACKEND == "cpu":   # cpu's bias is ones @ b, whose gradient is already a product
        assert ops["repeat_back"].count("REPEAT_BACK") == 1
    assert "REPEAT_BACK" not in ops["product"]
    assert np.array_equal(outs["repeat_back"], outs["product"])


def test_layer_norm_with_column_sums_as_products_leaves_no_repeat_back(programs_built_as):
    """Its centring's gradient (a row sum) becomes SUM_ROWS, its gain's and bias's OUT_PROD (with
    our cuda kernels there is no centring node: one kernel each way normalizes, and the gain's
    gradient is summed inside the norm's backward)."""
    from toyharness._ffi import ffi, lib

    programs_built_as(column_sums_as_products=True)
    prog = get_engine(BACKEND).program()
    X, G, B = prog.param("x", r(4, 5, 16)), prog.param("g", r(16)), prog.param("b", r(16))
    graph = prog.trainer(prog.scalar_loss(blocks.layer_norm(X, G, B).sum()), "bias_corrected").gb_opt
    ops = [ffi.string(lib.ggml_op_desc(lib.ggml_graph_node(graph, i))).decode()
           for i in range(lib.ggml_graph_n_nodes(graph))]
    # with our cuda kernels the gain's gradient is summed by the norm's backward kernel (the
    # cuda rewrite's gain sums), so only the bias's column sum is a product there
    assert "REPEAT_BACK" not in ops and ops.count("OUT_PROD") >= (1 if prog.cuda_kernels else 2)
    assert ("SUM_ROWS" in ops) == (not prog.cuda_kernels)


@pytest.mark.parametrize("column_sums", COLUMN_SUMS)
def test_attention_gpt2_style_with_biases_and_layer_norm(column_sums, programs_built_as):
    programs_built_as(column_sums_as_products=column_sums == "product")
    D = 8
    inputs = {"x": r(2, 4, D), "g": r(D), "b": r(D), "wq": r(D, D, scale=0.5), "wk": r(D, D, scale=0.5),
              "wv": r(D, D, scale=0.5), "wo": r(D, D, scale=0.5), "bq": r(D), "bk": r(D), "bv": r(D), "bo": r(D)}
    check(lambda p, T: blocks.attention(blocks.layer_norm(T["x"], T["g"], T["b"]), T["wq"], T["wk"], T["wv"],
                                        T["wo"], 2, bq=T["bq"], bk=T["bk"], bv=T["bv"], bo=T["bo"]),
          lambda A: np_attention(np_layer_norm(A["x"], A["g"], A["b"]), A["wq"], A["wk"], A["wv"], A["wo"], 2, 2,
                                 True, A["bq"], A["bk"], A["bv"], A["bo"]), inputs)


def test_attention_gpt2_style_with_biases():
    D = 8
    inputs = {"x": r(2, 4, D), "wq": r(D, D, scale=0.5), "wk": r(D, D, scale=0.5), "wv": r(D, D, scale=0.5),
              "wo": r(D, D, scale=0.5), "bq": r(D), "bk": r(D), "bv": r(D), "bo": r(D)}
    check(lambda p, T: blocks.attention(T["x"], T["wq"], T["wk"], T["wv"], T["wo"], 2, bq=T["bq"], bk=T["bk"],
                                        bv=T["bv"], bo=T["bo"]),
          lambda A: np_attention(A["x"], A["wq"], A["wk"], A["wv"], A["wo"], 2, 2, True, A["bq"], A["bk"],
                                 A["bv"], A["bo"]), inputs)


def test_attention_gqa_rope_noncausal_free():
    D, H, KV = 8, 4, 2
    pos = np.arange(4, dtype=np.int32)
    inputs = {"x": r(2, 4, D), "wq": r(D, D, scale=0.5), "wk": r(KV * 2, D, scale=0.5),
              "wv": r(KV * 2, D, scale=0.5), "wo": r(D, D, scale=0.5)}
    check(lambda p, T: blocks.attention(T["x"], T["wq"], T["wk"], T["wv"], T["wo"], H, KV,
                                        rope_positions=T["pos"]),
          lambda A: np_attention(A["x"], A["wq"], A["wk"], A["wv"], A["wo"], H, KV, True,
                                 pos=A["pos"].astype(np.float64)), inputs, ids={"pos": (pos, None)})


def test_attention_non_causal():
    D = 8
    inputs = {"x": r(2, 3, D), "wq": r(D, D, scale=0.5), "wk": r(D, D, scale=0.5), "wv": r(D, D, scale=0.5),
              "wo": r(D, D, scale=0.5)}
    check(lambda p, T: blocks.attention(T["x"], T["wq"], T["wk"], T["wv"], T["wo"], 2, causal=False),
          lambda A: np_attention(A["x"], A["wq"], A["wk"], A["wv"], A["wo"], 2, 2, False), inputs)


def test_swiglu_mlp():
    check(lambda p, T: blocks.swiglu_mlp(T["x"], T["g"], T["u"], T["d"]),
          lambda A: ((A["x"] @ A["g"].T) / (1 + np.exp(-(A["x"] @ A["g"].T))) * (A["x"] @ A["u"].T)) @ A["d"].T,
          {"x": r(2, 3, 6), "g": r(10, 6), "u": r(10, 6), "d": r(6, 10)})


def test_lora_linear_frozen_base():
    check(lambda p, T: blocks.lora_linear(T["x"], T["w"], T["a"], T["b"], scale=2.0),
          lambda A: A["x"] @ A["w"].T + 2.0 * (A["x"] @ A["a"].T) @ A["b"].T,
          {"x": r(3, 6), "w": r(5, 6), "a": r(2, 6), "b": r(5, 2)}, no_grad=("w",))


def test_projection_lens():
    check(lambda p, T: blocks.lens(T["e"], T["p"]), lambda A: A["e"] @ A["p"].T, {"e": r(7, 12), "p": r(4, 12)})


def test_cross_entropy_report_and_gradient():
    """The reported loss matches numpy; the training loss's gradient matches finite differences."""
    V, N = 6, 5
    logits = r(N, V)
    targets = RNG.integers(0, V, N)
    prog = get_engine(BACKEND).program()
    t = prog.param("logits", logits)
    ce = prog.cross_entropy(t, "targets")
    tr = prog.trainer(ce, "bias_corrected")
    loss = tr.grads_only({"targets": targets})

    def ref(L):
        ls = L - L.max(-1, keepdims=True)
        ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
        return -ls[np.arange(N), targets].mean()

    L32 = logits.astype(np.float32).astype(np.float64)
    assert abs(loss - ref(L32)) / ref(L32) < 1e-6
    g = prog.read(tr.grad_acc["logits"])
    assert rel_err(g, fd_grad(lambda A: ref(A["l"]), {"l": L32.copy()}, "l")) < 1e-3


# --- what the newer architectures add (toyharness/architectures: qwen3, gemma3, phi3, llama3 rope) -----
def np_rope_ext(x, pos, base, neox, dims, freq_scale=1.0, factors=None):
    """ggml's ROPE with rotated `dims` of each head, NeoX or adjacent pairs, linear scaling and
    frequency factors: pair i turns by pos * freq_scale * base^(-2i/dims) / factors[i]."""
    theta = pos[:, None] * freq_scale * base ** (-np.arange(0, dims, 2) / dims)
    if factors is not None:
        theta = theta / factors[None, :]
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    out = x.copy()
    i0, i1 = (np.arange(dims // 2), np.arange(dims // 2) + dims // 2) if neox else (np.arange(0, dims, 2),
                                                                                   np.arange(1, dims, 2))
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def np_attention_ext(x, wq, wk, wv, wo, H, KV, hd, pos, base=10000.0, neox=True, dims=None, freq_scale=1.0,
                     factors=None, q_norm=None, k_norm=None, window=None, scale=None, wqkv=None, eps=1e-6):
    B, T, _ = x.shape
    if wqkv is not None:
        wq, wk, wv = wqkv[:H * hd], wqkv[H * hd:(H + KV) * hd], wqkv[(H + KV) * hd:]
    q, k, v = (x @ wq.T).reshape(B, T, H, hd), (x @ wk.T).reshape(B, T, KV, hd), (x @ wv.T).reshape(B, T, KV, hd)
    if q_norm is not None:
        q = np_rms_norm(q, eps) * q_norm
        k = np_rms_norm(k, eps) * k_norm
    q = np_rope_ext(q, pos, base, neox, dims or hd, freq_scale, factors)
    k = np_rope_ext(k, pos, base, neox, dims or hd, freq_scale, factors)
    k, v = np.repeat(k, H // KV, axis=2), np.repeat(v, H // KV, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(hd) if scale is None else scale)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    s = np.where(visible, s, -np.inf)
    o = np.einsum("bhqk,bkhd->bqhd", np_softmax(s), v).reshape(B, T, H * hd)
    return o @ wo.T


POS6 = np.arange(6, dtype=np.int32)


@pytest.mark.parametrize("neox,rot,freq_scale,ff", [(False, 4, 1.0, np.array([1.0, 8.0], np.float32)),
                                                     (True, 4, 0.25, None), (True, 2, 1.0, None)])
def test_attention_llama3_rope_factors_linear_scale_partial_neox(neox, rot, freq_scale, ff):
    """Llama 3's rope_freqs (factors), linear scaling and Phi-4's partial NeoX rotation."""
    D, H, KV, hd = 16, 4, 2, 4
    inputs = {"x": r(2, 6, D), "wq": r(H * hd, D, scale=0.5), "wk": r(KV * hd, D, scale=0.5),
              "wv": r(KV * hd, D, scale=0.5), "wo": r(D, H * hd, scale=0.5)}
    ids = {"pos": (POS6, None)} | ({"ff": (ff, None)} if ff is not None else {})
    check(lambda p, T: blocks.attention(
              T["x"], T["wq"], T["wk"], T["wv"], T["wo"], H, KV, head_dim=hd,
              rope=blocks.Rope(T["pos"], 100.0, neox, rot, freq_scale, T.get("ff"))),
          lambda A: np_attention_ext(A["x"], A["wq"], A["wk"], A["wv"], A["wo"], H, KV, hd,
                                     A["pos"].astype(np.float64), 100.0, neox, rot, freq_scale,
                                     None if ff is None else ff.astype(np.float64)), inputs, ids=ids)


def test_attention_qk_norm_head_dim_window_and_scale():
    """qwen3/gemma3: heads wider than D / H, RMSNorm of each head's q and k, gemma3's sliding
    window (keys i - window < j <= i) and its own query scale."""
    D, H, KV, hd = 8, 2, 1, 8
    inputs = {"x": r(2, 6, D), "wq": r(H * hd, D, scale=0.5), "wk": r(KV * hd, D, scale=0.5),
              "wv": r(KV * hd, D, scale=0.5), "wo": r(D, H * hd, scale=0.5), "qn": 1 + r(hd, scale=0.3),
              "kn": 1 + r(hd, scale=0.3)}
    for w in (2, 6):
        check(lambda p, T, window=w: blocks.attention(
                  T["x"], T["wq"], T["wk"], T["wv"], T["wo"], H, KV, head_dim=hd, q_norm=T["qn"], k_norm=T["kn"],
                  rope=blocks.Rope(T["pos"], 10000.0, True), window=window, scale=0.3),
              lambda A, window=w: np_attention_ext(A["x"], A["wq"], A["wk"], A["wv"], A["wo"], H, KV, hd,
                                                   A["pos"].astype(np.float64), q_norm=A["qn"], k_norm=A["kn"],
                                         window=window, scale=0.3), inputs, ids={"pos": (POS6, None)})


def test_attention_fused_qkv():
    """phi3: q|k|v rows of one projection, split after the product."""
    D, H, KV, hd = 8, 4, 2, 2
    inputs = {"x": r(2, 6, D), "wqkv": r((H + 2 * KV) * hd, D, scale=0.5), "wo": r(D, H * hd, scale=0.5)}
    check(lambda p, T: blocks.attention(T["x"], None, None, None, T["wo"], H, KV, head_dim=hd, wqkv=T["wqkv"],
                                        rope=blocks.Rope(T["pos"], 10000.0, True)),
          lambda A: np_attention_ext(A["x"], None, None, None, A["wo"], H, KV, hd, A["pos"].astype(np.float64),
                                     wqkv=A["wqkv"]), inputs, ids={"pos": (POS6, None)})


def test_geglu_mlp():
    check(lambda p, T: blocks.geglu_mlp(T["x"], T["g"], T["u"], T["d"]),
          lambda A: (np_gelu_tanh(A["x"] @ A["g"].T) * (A["x"] @ A["u"].T)) @ A["d"].T,
          {"x": r(2, 3, 6), "g": r(10, 6, scale=0.5), "u": r(10, 6, scale=0.5), "d": r(6, 10, scale=0.5)})


def test_fused_swiglu_mlp():
    def ref(A):
        y = A["x"] @ A["gu"].T
        gate, up = y[..., :10], y[..., 10:]
        return (gate / (1 + np.exp(-gate)) * up) @ A["d"].T
    check(lambda p, T: blocks.fused_swiglu_mlp(T["x"], T["gu"], T["d"]), ref,
          {"x": r(2, 3, 6), "gu": r(20, 6, scale=0.5), "d": r(6, 10, scale=0.5)})


def test_rope_refuses_what_it_cannot_rotate():
    prog = get_engine(BACKEND).program()
    x = prog.param("x", np.zeros((1, 4, 2, 6), np.float32))
    pos = prog.constant("pos", np.arange(4, dtype=np.int32))
    with pytest.raises(InputError, match="rope: 8 rotated dims do not fit a head of 6"):
        x.rope(pos, 8)
    with pytest.raises(InputError, match=r"rope: frequency factors .* expected f32 \(3,\)"):
        x.rope(pos, 6, freq_factors=prog.constant("ff", np.ones(2, np.float32)))


@pytest.fixture
def portable(monkeypatch):
    """The cpu engine in the portable mode for the test; every graph computed is checked to be
    a portable program's (so the op tests below really ran on the portable kernels). The portable
    mode is the cpu backend's: with TOYHARNESS_TEST_BACKEND set to another backend, these skip."""
    if BACKEND != "cpu":
        pytest.skip(f"the portable mode is the cpu backend's, and TOYHARNESS_TEST_BACKEND={BACKEND}")
    engine = get_engine("cpu")
    engine.set_portable(True)
    computed = []
    real = Program._compute

    def compute(self, graph):
        computed.append(self.portable)
        return real(self, graph)

    monkeypatch.setattr(Program, "_compute", compute)
    yield engine
    engine.set_portable(False)
    assert computed and all(computed), "a graph was computed outside the portable mode"


# --- every op of tests/test_engine_py in the portable mode ------------------------------------
@pytest.mark.parametrize("op", ["add", "mul", "sub", "div"])
def test_portable_binary_broadcast(portable, op):
    test_binary_broadcast(op)


@pytest.mark.parametrize("name,fn,ref,make", [c for c in UNARY_CASES if c[0] != "softplus"],
                         ids=[c[0] for c in UNARY_CASES if c[0] != "softplus"])
def test_portable_unary(portable, name, fn, ref, make):
    test_unary(name, fn, ref, make)


@pytest.mark.parametrize("kv", [3, 1])
def test_portable_bmm_with_head_broadcast(portable, kv):
    test_bmm_with_head_broadcast(kv)


BLOCKS = [test_gelu_is_finite_for_large_inputs, test_linear_matmul,
          test_weight_used_only_through_transpose, test_get_rows_embedding, test_rope_adjacent_pairs,
          test_swiglu, test_attention_gpt2_style_with_biases,
          test_attention_gqa_rope_noncausal_free, test_attention_non_causal, test_swiglu_mlp,
          test_lora_linear_frozen_base, test_projection_lens, test_cross_entropy_report_and_gradient]


@pytest.mark.parametrize("block_test", BLOCKS, ids=lambda f: f.__name__[len("test_"):])
def test_portable_block(portable, block_test):
    block_test()


# what the base architectures add (toyharness/architectures): Llama 3's frequency table, linear
# scaling and partial NeoX rope; q/k norms, head size and the sliding window; fused projections; GeGLU
ARCH_BLOCKS = [test_attention_qk_norm_head_dim_window_and_scale, test_attention_fused_qkv,
               test_geglu_mlp, test_fused_swiglu_mlp]


@pytest.mark.parametrize("block_test", ARCH_BLOCKS, ids=lambda f: f.__name__[len("test_"):])
def test_portable_architecture_block(portable, block_test):
    block_test()


@pytest.mark.parametrize("neox,rot,freq_scale,ff", [(False, 4, 1.0, np.array([1.0, 8.0], np.float32)),
                                                     (True, 4, 0.25, None), (True, 2, 1.0, None)])
def test_portable_scaled_rope(portable, neox, rot, freq_scale, ff):
    test_attention_llama3_rope_factors_linear_scale_partial_neox(neox, rot, freq_scale, ff)


@pytest.mark.parametrize("column_sums", COLUMN_SUMS)   # a gain's gradient by REPEAT_BACK or a product
@pytest.mark.parametrize("block_test", [test_layer_norm, test_rms_norm_block],
                         ids=lambda f: f.__name__[len("test_"):])
def test_portable_norm_block(portable, block_test, column_sums, programs_built_as):
    block_test(column_sums, programs_built_as)
