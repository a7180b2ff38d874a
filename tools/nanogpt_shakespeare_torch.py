#!/usr/bin/env python3
"""The PyTorch side of the shakespeare-char race (tools/shakespeare_race.sh; docs/nanogpt.md).

A nanoGPT-style baby GPT written for this race: learned positions, pre-LayerNorm blocks (no biases
unless --bias), causal self-attention through F.scaled_dot_product_attention with dropout_p, a GELU
MLP, dropout on the embeddings and both residual branches, the head tied to the token embedding;
init N(0, 0.02), the residual projections N(0, 0.02/sqrt(2 n_layer)). AdamW (fused on cuda) with
weight decay on the parameters of 2 or more axes, cosine lr after a linear warmup down to min_lr
(the schedule toyharness's gpt2 runs: step s < warmup at (s+1)/warmup of lr), the gradient clipped
to a global norm, bf16 autocast and torch.compile on cuda.

Data: the bytes of CORPUS as tokens (vocabulary 256), the first 90% to train on and the last 10%
held out, as `toyharness run gpt2 --set data=CORPUS` splits it. Batches start at random offsets
drawn from a generator seeded --seed. Every --eval-every steps (and after the last) the mean loss
over --eval-iters held-out batches is printed with the wall seconds since the loop began (the first
step's compile included); the first time it is <= --target, that time is printed too. --log FILE
writes the same as JSON lines (the race's table reads them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d, 3 * d, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(d, bias=bias)
        self.attn = SelfAttention(d, n_head, dropout, bias)
        self.norm2 = nn.LayerNorm(d, bias=bias)
        self.up = nn.Linear(d, 4 * d, bias=bias)
        self.down = nn.Linear(4 * d, d, bias=bias)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp_drop(self.down(F.gelu(self.up(self.norm2(x)))))


class BabyGPT(nn.Module):
    def __init__(self, vocab: int, t_seq: int, d: int, n_layer: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t_seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, n_head, dropout, bias) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d, bias=bias)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight            # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def learning_rate(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (a.lr - a.min_lr)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("corpus", help="the text file (python -m toyharness.data.corpora shakespeare OUT.txt)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype on cuda")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--t-seq", type=int, default=256)
    p.add_argument("--t-batch", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--bias", action="store_true",
                   help="biases in the linears and LayerNorms (toyharness's gpt2 with bias=true)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--target", type=float, default=1.47, help="report the wall time to the first val loss <= this")
    p.add_argument("--log", type=Path, help="write the evals and the end as JSON lines here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    data = np.frombuffer(Path(a.corpus).read_bytes(), dtype=np.uint8)
    split = int(len(data) * 0.9)
    splits = {"train": torch.from_numpy(data[:split].astype(np.int64)),
              "val": torch.from_numpy(data[split:].astype(np.int64))}
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def batch(name: str):
        toks = splits[name]
        starts = torch.randint(len(toks) - a.t_seq - 1, (a.t_batch,), generator=gen)
        x = torch.stack([toks[s:s + a.t_seq] for s in starts])
        y = torch.stack([toks[s + 1:s + 1 + a.t_seq] for s in starts])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    model = BabyGPT(256, a.t_seq, a.d_model, a.n_layer, a.n_head, a.dropout, a.bias).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, a.beta2), fused=device.type == "cuda")
    step_model = model if a.no_compile else torch.compile(model)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and a.dtype == "bf16"
                else torch.autocast(device.type, enabled=False))
    log = open(a.log, "w") if a.log else None

    def emit(row: dict) -> None:
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total = torch.zeros((), device=device)
        for _ in range(a.eval_iters):
            x, y = batch("val")
            with autocast:
                total += step_model(x, y)
        model.train()
        return float(total) / a.eval_iters

    print(f"{sum(p.numel() for p in params):,} parameters, {len(data):,} bytes ({split:,} train), "
          f"device {device}, seed {a.seed}", flush=True)
    reached = None
    loss = torch.zeros(())
    t0 = time.perf_counter()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, a)
        x, y = batch("train")
        with autocast:
            loss = step_model(x, y)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % a.eval_every == 0 or done == a.steps:
            val = evaluate()
            wall = time.perf_counter() - t0
            if reached is None and val <= a.target:
                reached = wall
            train_loss = float(loss.detach())
            print(f"step {done}: train loss {train_loss:.4f}, val loss {val:.4f}, wall {wall:.1f} s", flush=True)
            emit({"step": done, "train_loss": train_loss, "val_loss": val, "wall_s": round(wall, 3)})
    wall = time.perf_counter() - t0
    print(f"done: {a.steps} steps in {wall:.1f} s; time to val loss <= {a.target}: "
          f"{'not reached' if reached is None else f'{reached:.1f} s'}", flush=True)
    emit({"end": True, "steps": a.steps, "wall_s": round(wall, 3), "target": a.target,
          "time_to_target_s": None if reached is None else round(reached, 3)})
    if log:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
