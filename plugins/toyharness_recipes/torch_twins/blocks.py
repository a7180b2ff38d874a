"""The layers the built-in twins share. Parameters use the recipes' GGUF names (numpy order, as
in init.gguf), but for a fused `attn_qkv` (fuse_qkv)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

QKV = ("attn_q", "attn_k", "attn_v")


def fuse_qkv(init: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`init` with each block's attn_q, attn_k and attn_v (weights, and biases where all three have
    one) as one `attn_qkv` whose rows are q's, then k's, then v's, as nanoGPT's c_attn holds them:
    one matrix product a block instead of three. AdamW works element by element and decays a
    matrix whole, so training the fused tensor trains the three alike."""
    out = dict(init)
    for name in init:
        if not name.endswith(".attn_q.weight"):
            continue
        pre = name[: -len("attn_q.weight")]
        for kind in ("weight", "bias"):
            parts = [f"{pre}{p}.{kind}" for p in QKV]
            if all(p in init for p in parts):
                out[f"{pre}attn_qkv.{kind}"] = np.concatenate([init[p] for p in parts], axis=0)
                for p in parts:
                    del out[p]
    return out


def layer_norm(x, g, b, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), g, b, eps)


def rms_norm(x, g, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rope_adjacent(x, base: float):
    """x (B, T, H, hd): rotate dims (2i, 2i+1) of position p by p * base^(-2i/hd)."""
    _, t, _, hd = x.shape
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv[None, :]          # (T, hd/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def attention(x, P, pre, n_head, n_kv_head=None, causal=True, rope_base=None, q_fn=None):
    """Multi-head (grouped where n_kv_head < n_head) attention by PyTorch's fused
    scaled_dot_product_attention; q, k and v from one fused `attn_qkv` product where P has it."""
    b, t, d = x.shape
    n_kv_head = n_kv_head or n_head
    hd = d // n_head

    def proj(name):
        return F.linear(x, P[f"{pre}{name}.weight"], P.get(f"{pre}{name}.bias"))

    if q_fn is None and f"{pre}attn_qkv.weight" in P:
        q, k, v = proj("attn_qkv").split([d, n_kv_head * hd, n_kv_head * hd], dim=-1)
    else:
        q, k, v = (q_fn(x) if q_fn else proj("attn_q")), proj("attn_k"), proj("attn_v")
    q, k, v = q.view(b, t, n_head, hd), k.view(b, t, n_kv_head, hd), v.view(b, t, n_kv_head, hd)
    if rope_base is not None:
        q, k = rope_adjacent(q, rope_base), rope_adjacent(k, rope_base)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    if n_kv_head != n_head:
        k = k.repeat_interleave(n_head // n_kv_head, dim=1)
        v = v.repeat_interleave(n_head // n_kv_head, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(b, t, d)
    return F.linear(out, P[f"{pre}attn_output.weight"], P.get(f"{pre}attn_output.bias"))
