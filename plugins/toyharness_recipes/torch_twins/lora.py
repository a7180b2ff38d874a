"""LoRA in PyTorch: the lora recipe's twin. Over a plain llama base (no rope scaling) it is the
llama twin with W + (alpha/rank) B A on every adapted projection; over a base of any other
architecture, transformers' model of it with the adapters wrapped in
(toyharness/architectures/hf.py), which needs transformers."""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from toyharness import GGUFFile, InputError, TorchTwin, read_model

from .llama import llama


def lora(P, batch, o: dict):
    """The base's weights with W + (alpha/rank) B A on every adapted projection."""
    scale = o["alpha"] / o["rank"]
    eff = dict(P)
    for name in P:
        if name.endswith(".lora_a"):
            w = name[: -len(".lora_a")]
            eff[w] = P[w] + scale * (P[w + ".lora_b"] @ P[name])
    return llama(eff, batch, o)


def base_config(path: str) -> dict:
    """The sizes the llama twin reads, from the base's own GGUF keys."""
    with GGUFFile(path) as f:
        arch = f.field("general.architecture")
        return dict(n_layer=f.field(f"{arch}.block_count"), n_head=f.field(f"{arch}.attention.head_count"),
                    n_kv_head=f.field(f"{arch}.attention.head_count_kv"),
                    rope_base=f.field(f"{arch}.rope.freq_base", 10000.0),
                    rms_eps=f.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))


def base_arrays(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a base GGUF as f32 numpy, dequantized by gguf-py (engine/quant.py)."""
    with GGUFFile(path) as f:
        return {n: f.tensor(n).to_numpy() for n in f.names}


def transformers_side(base: str) -> bool:
    """Whether the twin over `base` is transformers' model of it: every base but a `llama` one
    without rope scaling, which the llama twin models."""
    s = read_model(base).shape
    return not (s.arch == "llama" and s.rope_factors is None and all(lay.rope_scale == 1.0 for lay in s.layers))


class LoRATwin(TorchTwin):
    def __init__(self, options):
        super().__init__(options)
        self.cfg = {**options.to_dict(), **base_config(options.base)}
        self.hf = transformers_side(options.base)
        self.model = None

    def check(self) -> None:
        if self.hf and importlib.util.find_spec("transformers") is None:
            raise InputError(f"lora over {self.options.base}: its PyTorch twin is transformers' model of that "
                             "architecture (toyharness/architectures/hf.py): pip install transformers")

    def parameters(self, init, device="cpu", frozen_dtype=torch.float32):
        base = self.options.base
        if self.hf:
            from toyharness import add_lora, hf_model

            # in bf16 with PyTorch's fused attention (SDPA), transformers' default; in fp32/tf32 the
            # eager attention of the parity tests
            attention = "sdpa" if self.options.precision == "bf16" else "eager"
            self.model = hf_model(base, attention=attention).to(dtype=frozen_dtype)
            adapters = add_lora(self.model, base, init, self.options.alpha / self.options.rank)
            self.model.to(device)            # the adapters too (made on the host), each keeping its dtype
            return dict(adapters)
        P = super().parameters(init, device)
        P.update({n: torch.from_numpy(a).to(device, frozen_dtype) for n, a in base_arrays(base).items()})
        return P

    def forward(self, P, batch):
        if self.model is not None:
            return self.model(input_ids=batch["tokens"].long()).logits
        return lora(P, batch, self.cfg)
