"""GPT-2 in PyTorch: the gpt2 recipe's twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toyharness import TorchTwin

from .blocks import attention, fuse_qkv, layer_norm

# the recipe's `gelu` option as torch's `approximate`: "erf" is nn.GELU()'s exact form
APPROXIMATE = {"tanh": "tanh", "erf": "none"}


def gpt2(P, batch, o: dict):
    """The recipe's forward; biases where P holds them (bias=false: none, P.get gives None)."""
    tokens = batch["tokens"]
    approximate = APPROXIMATE[o["gelu"]]
    h = F.embedding(tokens, P["token_embd.weight"]) + P["position_embd.weight"][: tokens.shape[1]]
    for i in range(o["n_layer"]):
        b = f"blk.{i}."
        h = h + attention(layer_norm(h, P[b + "attn_norm.weight"], P.get(b + "attn_norm.bias")), P, b, o["n_head"])
        x = layer_norm(h, P[b + "ffn_norm.weight"], P.get(b + "ffn_norm.bias"))
        x = F.gelu(F.linear(x, P[b + "ffn_up.weight"], P.get(b + "ffn_up.bias")), approximate=approximate)
        h = h + F.linear(x, P[b + "ffn_down.weight"], P.get(b + "ffn_down.bias"))
    h = layer_norm(h, P["output_norm.weight"], P.get("output_norm.bias"))
    return h @ P.get("output.weight", P["token_embd.weight"]).T


class GPT2Twin(TorchTwin):
    def __init__(self, options):
        super().__init__(options)
        self.sizes = options.to_dict()

    def parameters(self, init, device="cpu", frozen_dtype=torch.float32):
        return super().parameters(fuse_qkv(init), device, frozen_dtype)

    def forward(self, P, batch):
        return gpt2(P, batch, self.sizes)
