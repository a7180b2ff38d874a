"""Each architecture's transformers counterpart, built from a GGUF's dequantized weights: the
numerical truth of the parity tests (tests/test_arch_parity.py) and the PyTorch side of
`toyharness bench lora` over a base of any architecture. Needs torch and transformers (`nox -s
parity`, `nox -s bench`); the core never imports this module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from ..engine import GGUFFile
from . import read_model


class LoRALinear(torch.nn.Module):
    """y = W x (+ b) + scale * B (A x): the adapter as the lora recipe defines it."""

    def __init__(self, base: torch.nn.Linear, a: np.ndarray, b: np.ndarray, scale: float):
        super().__init__()
        self.base, self.scale = base, scale
        self.a = torch.nn.Parameter(torch.tensor(a))
        self.b = torch.nn.Parameter(torch.tensor(b))

    def forward(self, x):
        return self.base(x) + self.scale * torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b)


def hf_model(base: str | Path, config_overrides: dict | None = None, attention: str = "eager") -> torch.nn.Module:
    """transformers' model of the base's architecture, its weights the file's dequantized by gguf-py,
    frozen, float32; `attention` is transformers' attention implementation (eager, the parity
    tests'; sdpa, its default, for the bf16 bench)."""
    model_file = read_model(base)
    arch, s = model_file.arch, model_file.shape
    with GGUFFile(base) as f:
        weights = {n: f.tensor(n).to_numpy() for n in f.names}
    cfg = getattr(transformers, arch.hf_config_class)(**(arch.hf_config(s) | (config_overrides or {})))
    cfg._attn_implementation = attention
    model = getattr(transformers, arch.hf_class)(cfg).float().eval()
    state = {k: torch.tensor(v) for k, v in arch.hf_weights(weights, s).items()}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not all("rotary" in m or "inv_freq" in m for m in missing):
        raise RuntimeError(f"{base}: transformers' {arch.hf_class} does not take the file's tensors: missing "
                           f"{missing}, unexpected {unexpected}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def add_lora(model: torch.nn.Module, base: str | Path, adapters: dict[str, np.ndarray],
             scale: float) -> dict[str, torch.nn.Parameter]:
    """Wrap each adapted projection of `model` (adapters named as the recipe names them:
    `blk.N.attn_q.weight.lora_a` / `.lora_b`) in a LoRALinear; returns the trainable parameters
    under those names."""
    arch = read_model(base).arch
    params = {}
    for name in adapters:
        if not name.endswith(".lora_a"):
            continue
        w = name[: -len(".lora_a")]
        parent_path, attr = arch.hf_name(w).rsplit(".", 1)[0].rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        wrapped = LoRALinear(getattr(parent, attr), adapters[name], adapters[w + ".lora_b"], scale)
        setattr(parent, attr, wrapped)
        params[name], params[w + ".lora_b"] = wrapped.a, wrapped.b
    return params
