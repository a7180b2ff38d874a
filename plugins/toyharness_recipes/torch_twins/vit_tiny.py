"""A standard ViT in PyTorch: the vit_tiny recipe's twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toyharness import TorchTwin, class_loss

from .blocks import attention, layer_norm


def vit_tiny(P, batch, o: dict):
    """Patches, linear embedding, [cls; patches] + positions, pre-LN blocks."""
    images = batch["images"]
    b, h, w, c = images.shape
    p = o["patch"]
    patches = images.view(b, h // p, p, w // p, p, c).permute(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
    x = F.linear(patches, P["patch_embd.weight"], P["patch_embd.bias"])
    cls = P["cls_token.weight"].reshape(1, 1, -1).expand(b, 1, -1)
    x = torch.cat([cls, x], dim=1) + P["position_embd.weight"]
    for i in range(o["n_layer"]):
        pre = f"blk.{i}."
        x = x + attention(layer_norm(x, P[pre + "attn_norm.weight"], P[pre + "attn_norm.bias"]), P, pre, o["n_head"],
                          causal=False)
        y = layer_norm(x, P[pre + "ffn_norm.weight"], P[pre + "ffn_norm.bias"])
        y = F.gelu(F.linear(y, P[pre + "ffn_up.weight"], P[pre + "ffn_up.bias"]), approximate="tanh")
        x = x + F.linear(y, P[pre + "ffn_down.weight"], P[pre + "ffn_down.bias"])
    x = layer_norm(x, P["output_norm.weight"], P["output_norm.bias"])
    return F.linear(x[:, 0], P["output.weight"], P["output.bias"])


class ViTTinyTwin(TorchTwin):
    def forward(self, P, batch):
        return vit_tiny(P, batch, self.options.to_dict())

    def loss(self, output, batch):
        return class_loss(output, batch)
