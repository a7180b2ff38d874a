"""Independent PyTorch implementations of the recipes' models (eager, float32).

Written from the model descriptions, not from the engine code: they are the numerical truth
the `parity` nox session checks our first losses against, and the PyTorch side of
`toyharness bench`. Parameters use the recipes' GGUF names (numpy order, as in init.gguf).
Needs torch (``pip install torch==2.13.0``); the core never imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F


# --- blocks ---------------------------------------------------------------------------------
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
    b, t, d = x.shape
    n_kv_head = n_kv_head or n_head
    hd = d // n_head

    def proj(name):
        return F.linear(x, P[f"{pre}{name}.weight"], P.get(f"{pre}{name}.bias"))

    q = (q_fn(x) if q_fn else proj("attn_q")).view(b, t, n_head, hd)
    k = proj("attn_k").view(b, t, n_kv_head, hd)
    v = proj("attn_v").view(b, t, n_kv_head, hd)
    if rope_base is not None:
        q, k = rope_adjacent(q, rope_base), rope_adjacent(k, rope_base)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    if n_kv_head != n_head:
        k = k.repeat_interleave(n_head // n_kv_head, dim=1)
        v = v.repeat_interleave(n_head // n_kv_head, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(b, t, d)
    return F.linear(out, P[f"{pre}attn_output.weight"], P.get(f"{pre}attn_output.bias"))


# --- models -----------------------------------------------------------------------------------
def gpt2(P, batch, o):
    tokens = batch["tokens"]
    h = P["token_embd.weight"][tokens] + P["position_embd.weight"][: tokens.shape[1]]
    for i in range(o["n_layer"]):
        b = f"blk.{i}."
        h = h + attention(layer_norm(h, P[b + "attn_norm.weight"], P[b + "attn_norm.bias"]), P, b, o["n_head"])
        x = layer_norm(h, P[b + "ffn_norm.weight"], P[b + "ffn_norm.bias"])
        x = F.gelu(F.linear(x, P[b + "ffn_up.weight"], P[b + "ffn_up.bias"]), approximate="tanh")
        h = h + F.linear(x, P[b + "ffn_down.weight"], P[b + "ffn_down.bias"])
    h = layer_norm(h, P["output_norm.weight"], P["output_norm.bias"])
    return h @ P.get("output.weight", P["token_embd.weight"]).T


def llama(P, batch, o, q_fn_for=None):
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


def vit_tiny(P, batch, o):
    """A standard ViT: patches, linear embedding, [cls; patches] + positions, pre-LN blocks."""
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


def lora(P, batch, o):
    """The base's weights with W + (alpha/rank) B A on every adapted projection."""
    scale = o["alpha"] / o["rank"]
    eff = dict(P)
    for name in P:
        if name.endswith(".lora_a"):
            w = name[: -len(".lora_a")]
            eff[w] = P[w] + scale * (P[w + ".lora_b"] @ P[name])
    return llama(eff, batch, o)


def warm_start(P, batch, o):
    eff = dict(P)
    eff["token_embd.weight"] = P["token_embd.weight"] @ P["lens.weight"].T
    return llama(eff, batch, o)


MODELS: dict[str, Callable] = {"gpt2": gpt2, "llama": llama, "vit_tiny": vit_tiny, "lora": lora,
                               "warm_start": warm_start}


def lm_loss(logits, batch):
    if "mask" in batch:     # JSONL examples: the mean over the positions the mask counts
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1).long(),
                              reduction="none")
        mask = batch["mask"].reshape(-1).to(per.dtype)
        return (per * mask).sum() / mask.sum()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1).long())


def class_loss(logits, batch):
    return F.cross_entropy(logits, batch["labels"].long())


LOSSES: dict[str, Callable] = {"gpt2": lm_loss, "llama": lm_loss, "vit_tiny": class_loss, "lora": lm_loss,
                               "warm_start": lm_loss}


# --- the AdamW row (docs/design.md), applied as written --------------------------------------------
@torch.no_grad()
def adamw_row_step(params: dict, m: dict, v: dict, row) -> None:
    lr, b1, b2, eps, wd, s5, s6 = (float(x) for x in row)
    for name, p in params.items():
        g = p.grad
        m[name].mul_(b1).add_(g, alpha=1 - b1)
        v[name].mul_(b2).addcmul_(g, g, value=1 - b2)
        p.mul_(1 - lr * wd).sub_(lr * (m[name] * s5) / ((v[name] * s6).sqrt() + eps))


# --- parity: replay a run folder --------------------------------------------------------------------
def replay_losses(run_dir: str | Path, steps: int) -> list[float]:
    """The first `steps` losses of the run in `run_dir` (its config.toml, init.gguf, batches.npz,
    and for lora its base), recomputed in PyTorch with the run's AdamW rows."""
    from .bench import reference_config
    from .engine import GGUFFile
    from .options import read_toml
    from .plugins import get_recipe
    from .runner import read_batches_npz, resolve_options

    run_dir = Path(run_dir)
    recipe = read_toml(run_dir / "config.toml")["recipe"]
    _, obj = get_recipe(recipe)
    opts = resolve_options(obj, str(run_dir / "config.toml"), [], {})
    with GGUFFile(run_dir / "init.gguf") as f:
        init = {n: f.tensor(n).to_numpy() for n in f.names}
    cfg, frozen = reference_config(opts)    # lora: the frozen base, and its sizes for the forward
    P = {n: torch.tensor(a, requires_grad=n in init) for n, a in {**frozen, **init}.items()}
    train = {n: p for n, p in P.items() if p.requires_grad}
    m = {n: torch.zeros_like(p) for n, p in train.items()}
    v = {n: torch.zeros_like(p) for n, p in train.items()}
    batches = read_batches_npz(run_dir / "batches.npz")
    forward, loss_fn = MODELS[recipe], LOSSES[recipe]
    losses = []
    for i in range(steps):
        batch = {k: torch.from_numpy(np.ascontiguousarray(batches[k][i])) for k in batches}
        for p in train.values():
            p.grad = None
        loss = loss_fn(forward(P, batch, cfg), batch)
        loss.backward()
        losses.append(float(loss.detach()))
        adamw_row_step(train, m, v, opts.adamw_row().hp_for_step(i))
    return losses


# --- a whole run in PyTorch (issue 32's 600-step point) ------------------------------------------
def train_reference(recipe: str, steps: int, sets: list[str] | None = None, precision: str = "fp32",
                    device: str = "cpu", eval_batches: tuple[int, ...] = ()) -> dict:
    """Train language-model `recipe` (gpt2, llama) from scratch in PyTorch, as `toyharness run`
    would: the recipe's seeded init, its data's batches, its AdamW rows (schedule included), at
    `precision` (fp32; tf32: TF32 products; bf16: bf16 autocast over fp32 master weights, as
    nanoGPT trains). Returns the train losses and, after the last step, the eval loss the run
    reports (`eval`, over the option eval_batches' held-out batches) and the mean loss over the
    first n held-out batches for each n in `eval_batches` (`evals`).

    What it is for: how far PyTorch's own bf16 run ends from its fp32 run, beside ours."""
    from .bench import torch_precision_setup
    from .hookspecs import plugin_manager
    from .options import PRECISIONS
    from .plugins import get_recipe
    from .runner import batch_for, load_data, resolve_options

    if recipe not in ("gpt2", "llama"):
        raise ValueError(f"train_reference: recipe {recipe!r}; allowed: gpt2, llama")
    if precision not in PRECISIONS:
        raise ValueError(f"train_reference: precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    _, obj = get_recipe(recipe)
    options = resolve_options(obj, None, sets, {"steps": steps})
    if options.precision != "fp32":     # our engine's option; the reference takes `precision`
        raise ValueError(f"train_reference: the option precision={options.precision} is ours; pass precision=")
    if options.weight_dtype != "f32":   # the reference keeps fp32 weights
        raise ValueError(f"train_reference: weight_dtype={options.weight_dtype} is not modelled; allowed: f32")
    data = load_data(plugin_manager(obj), options)
    vocab = obj.vocab_for(options, data.vocab)
    dev = torch.device(device)
    autocast = torch_precision_setup(torch, precision)
    P = {n: torch.tensor(a, device=dev, requires_grad=True) for n, a in obj.init_params(options, vocab).items()}
    m = {n: torch.zeros_like(p) for n, p in P.items()}
    v = {n: torch.zeros_like(p) for n, p in P.items()}
    cfg, forward = options.to_dict(), MODELS[recipe]

    def on_device(batch):
        return {k: torch.from_numpy(np.ascontiguousarray(a)).to(dev) for k, a in batch.items()}

    losses = []
    for i in range(options.steps):
        batch = on_device(batch_for(data, "train", i, options))
        for p in P.values():
            p.grad = None
        with autocast(dev):
            loss = lm_loss(forward(P, batch, cfg), batch)
        loss.backward()
        losses.append(float(loss.detach()))
        adamw_row_step(P, m, v, options.adamw_row().hp_for_step(i))
    evals = {}
    with torch.no_grad(), autocast(dev):
        for n in {options.eval_batches, *eval_batches}:
            evals[n] = sum(float(lm_loss(forward(P, b, cfg), b))
                           for b in (on_device(batch_for(data, "eval", j, options)) for j in range(n))) / n
    return {"losses": losses, "eval": evals[options.eval_batches], "evals": evals}
