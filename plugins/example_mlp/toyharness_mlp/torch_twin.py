"""The mlp recipe in PyTorch, written from the model's description: what `toyharness bench` times
beside ours and what parity replays a run with. Imported only by `MLP.torch_reference`, so the
recipe itself never needs torch.

It has the methods bench and parity call on a twin (the ones `toyharness.bench.torch_side.TorchTwin`
defines): `check`, `parameters`, `forward` and `loss`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class MLPTwin:
    def __init__(self, options):
        self.options = options

    def check(self) -> None:
        """Nothing beyond torch itself to install."""

    def parameters(self, init: dict[str, np.ndarray], device="cpu", frozen_dtype=torch.float32) -> dict:
        """The recipe's own initial arrays (by their GGUF names), all trained."""
        return {n: torch.tensor(a, device=device, requires_grad=True) for n, a in init.items()}

    def forward(self, P: dict, batch: dict) -> torch.Tensor:
        k = self.options.context
        rows = P["token_embd.weight"].t()                     # (vocab, d_embed), as ours reads it
        emb = rows[batch["tokens"].long()]                    # (batch, seq, d_embed)
        # byte t-back at position t, zeros before the sequence starts
        x = torch.cat([F.pad(emb, (0, 0, back, 0))[:, :emb.shape[1]] for back in range(k)], dim=-1)
        h = F.relu(F.linear(x, P["hidden.weight"], P["hidden.bias"]))
        h = torch.tanh(F.linear(h, P["gate_tanh.weight"])) * \
            torch.sigmoid(F.linear(h, P["gate_sigmoid.weight"], P["gate_sigmoid.bias"]))
        return F.linear(F.linear(h, P["proj.weight"]), rows)

    def loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1).long())
