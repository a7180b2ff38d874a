"""One attention block and its float64 reference, shared by the kernels' tests (the cuda fused
attention's, tests/test_cuda_attention.py, and the cpu causal products', tests/test_cpu_kernels.py)."""

from __future__ import annotations

import numpy as np

from toyharness.engine import blocks, get_engine

DROPOUT_NAME = "probs"


def attention_arrays(b: int, t: int, d: int, n_head: int, n_kv_head: int | None = None,
                     seed: int = 5) -> dict[str, np.ndarray]:
    """attention_program's inputs: x, wq, wk, wv, wo and the loss's weights."""
    rng = np.random.default_rng(seed)
    kv = d // n_head * (n_kv_head or n_head)
    out = {"x": rng.normal(size=(b, t, d)).astype(np.float32)}
    out.update({n: (rng.normal(size=(rows, d)) / np.sqrt(d)).astype(np.float32)
                for n, rows in (("wq", d), ("wk", kv), ("wv", kv), ("wo", d))})
    out["weights"] = rng.normal(size=(b, t, d)).astype(np.float32)
    return out


def attention_program(backend: str, b: int, t: int, d: int, n_head: int, n_kv_head: int | None = None,
                      causal: bool = True, seed: int = 5, threads: int | None = None, dropout: float = 0.0):
    """One attention block, its loss a weighted sum of its output: (program, trainer, forward graph).
    `dropout`: on the attention weights, mask "probs" (DROPOUT_NAME)."""
    arrays = attention_arrays(b, t, d, n_head, n_kv_head, seed)
    prog = get_engine(backend, threads).program()
    x = prog.param("x", arrays["x"])
    w = {n: prog.param(n, arrays[n]) for n in ("wq", "wk", "wv", "wo")}
    y = blocks.attention(x, w["wq"], w["wk"], w["wv"], w["wo"], n_head, n_kv_head, causal=causal,
                         dropout=dropout, dropout_name=DROPOUT_NAME)
    weights = prog.constant("weights", arrays["weights"])
    trainer = prog.trainer(prog.scalar_loss((y * weights).sum()), "bias_corrected")
    return prog, trainer, prog.forward({"y": y})


def attention_float64(b: int, t: int, d: int, n_head: int, n_kv_head: int | None = None, causal: bool = True,
                      seed: int = 5, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """float64 forward and backward of attention_program's block: y and the gradients of
    sum(y * weights) for x, wq, wk, wv and wo (grouped-query heads repeated as llama's are).
    `mask` (b * n_head, t, t): dropout's multipliers of the attention weights."""
    a = {n: m.astype(np.float64) for n, m in attention_arrays(b, t, d, n_head, n_kv_head, seed).items()}
    x, wq, wk, wv, wo, g = (a[n] for n in ("x", "wq", "wk", "wv", "wo", "weights"))
    hd, kvh = d // n_head, n_kv_head or n_head
    rep = n_head // kvh

    def heads(m, h):                       # (b, t, h hd) -> (b, h, t, hd)
        return m.reshape(b, t, h, hd).transpose(0, 2, 1, 3)

    def flat(m):                           # (b, h, t, hd) -> (b, t, h hd)
        return m.transpose(0, 2, 1, 3).reshape(b, t, -1)

    q = heads(x @ wq.T, n_head)
    k, v = (np.repeat(heads(x @ w.T, kvh), rep, axis=1) for w in (wk, wv))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    if causal:
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = np.ones_like(p) if mask is None else mask.astype(np.float64).reshape(p.shape)
    o = flat((p * keep) @ v)
    do = heads(g @ wo, n_head)
    dp = (do @ v.transpose(0, 1, 3, 2)) * keep               # the gradient of P (before its mask)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(hd)
    dq = flat(ds @ k)
    dk, dv = (flat(m.reshape(b, kvh, rep, t, hd).sum(2))
              for m in (ds.transpose(0, 1, 3, 2) @ q, (p * keep).transpose(0, 1, 3, 2) @ do))

    def outer(dy):
        return np.einsum("btj,bti->ji", dy, x)

    return {"y": o @ wo.T, "wo": np.einsum("btj,bti->ji", g, o), "wq": outer(dq), "wk": outer(dk),
            "wv": outer(dv), "x": dq @ wq + dk @ wk + dv @ wv}
