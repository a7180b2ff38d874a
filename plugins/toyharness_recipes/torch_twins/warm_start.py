"""warm_start in PyTorch: llama whose token embedding is the donor's through the trained lens."""

from __future__ import annotations

from toyharness import TorchTwin

from .llama import llama


def warm_start(P, batch, o: dict):
    eff = dict(P)
    eff["token_embd.weight"] = P["token_embd.weight"] @ P["lens.weight"].T
    return llama(eff, batch, o)


class WarmStartTwin(TorchTwin):
    def forward(self, P, batch):
        return warm_start(P, batch, self.options.to_dict())
