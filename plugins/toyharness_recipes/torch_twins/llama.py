"""Llama in PyTorch: the llama recipe's twin (and the model under lora's and warm_start's)."""

from __future__ import annotations

import torch.nn.functional as F

from toyharness import TorchTwin

from .blocks import attention, rms_norm


def llama(P, batch, o: dict, q_fn_for=None):
    """`o` may carry a base's `rope_base` and `rms_eps` (lora over a real model); else llama's."""
    rope_base, eps = o.get("rope_base", 10000.0), o.get("rms_eps", 1e-5)
    h = P["token_embd.weight"][batch["tokens"]]
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
    def forward(self, P, batch):
        return llama(P, batch, self.options.to_dict())
