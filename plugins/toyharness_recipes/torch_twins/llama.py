"""Llama in PyTorch: the llama recipe's twin (and the model under lora's and warm_start's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toyharness import TorchTwin

from .blocks import attention, fuse_qkv, rms_norm


def llama(P, batch, o: dict, q_fn_for=None):
    """`o` may carry a base's `rope_base` and `rms_eps` (lora over a real model); else llama's."""
    rope_base, eps = o.get("rope_base", 10000.0), o.get("rms_eps", 1e-5)
    h = F.embedding(batch["tokens"], P["token_embd.weight"])
    for i in range(o["n_layer"]):
        b = f"blk.{i}."
        x = rms_norm(h, P[b + "attn_norm.weight"], eps)
        q_fn = q_fn_for(i) if q_fn_for else None
        h = h + attention(x, P, b, o["n_head"], o["n_kv_head"], rope_base=rope_base, q_fn=q_fn)
        x = rms_norm(h, P[b + "ffn_norm.weight"], eps)
        x = F.silu(F.linear(x, P[b + "ffn_gate.weight"])) * F.linear(x, P[b + "ffn_up.weight"])
        h = h + F.linear(x, P[b + "ffn_down.weight"])
    h = rms_norm(h, P["output_norm.weight"], eps)
    return h @ P.get("output.weight", P["token_embd.weight"]).T


class LlamaTwin(TorchTwin):
    def __init__(self, options):
        super().__init__(options)
        self.sizes = options.to_dict()

    def parameters(self, init, device="cpu", frozen_dtype=torch.float32):
        return super().parameters(fuse_qkv(init), device, frozen_dtype)

    def forward(self, P, batch):
        return llama(P, batch, self.sizes)
