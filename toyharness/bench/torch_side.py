"""The PyTorch side of `bench` and `parity`: what every recipe's PyTorch twin shares.

A recipe that has a PyTorch model of itself (its *twin*: written from the model's description, not
from our engine code) supplies it with a method ``torch_reference(options) -> TorchTwin``, importing
its twin module inside that method so that the recipe imports torch only when bench or parity asks
(the built-in recipes' twins: plugins/toyharness_recipes/torch_twins/). The twin takes the recipe's
options, builds its parameters from the recipe's own init (the arrays our side starts from, by
their GGUF names, numpy order) and computes the loss of a batch as the recipe's data gives it. From
that alone this module

- times its steps beside ours (`torch_worker`: the twin as one nn.Module (`TwinModule`), fused
  torch.optim.AdamW, eager or torch.compile, at fp32, tf32 or bf16 autocast;
  toyharness/bench/run.py drives it),
- replays a run folder's first losses with the run's own AdamW rows (`replay_losses`, the parity
  tests' numerical truth), and
- trains a whole run as `toyharness run` would (`train_reference`).

Needs torch (``pip install torch==2.13.0``). bench imports it only for a recipe that has a twin,
where torch is installed (the twin's check before any worker starts, and its worker); the parity
tools import it too.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from .procs import peak_rss_mb


class TorchTwin:
    """A recipe's model in PyTorch. Subclass it, set `forward` (and `loss` where the recipe's is
    not the language model's), and return an instance from the recipe's ``torch_reference``."""

    def __init__(self, options):
        self.options = options

    def check(self) -> None:
        """Raise InputError, in one line, naming what this twin lacks to run here (a module to
        install); called before any worker starts."""

    def parameters(self, init: dict[str, np.ndarray], device: torch.device | str = "cpu",
                   frozen_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The tensors `forward` reads: the recipe's `init` (trainable: nn.Parameter) and any
        frozen weights the twin loads itself (a base model, in `frozen_dtype`). A twin may hold
        some trained arrays differently from `init`, as long as AdamW treats them alike (element
        by element, decay on the tensors of 2 or more axes): GPT-2's and Llama's fuse q, k and v
        into one projection (torch_twins/blocks.py, fuse_qkv)."""
        return {n: torch.nn.Parameter(torch.tensor(a, device=device)) for n, a in init.items()}

    def forward(self, P: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(output, batch)


def twin_for(recipe_obj: Any, options) -> TorchTwin | None:
    """The recipe's twin for `options`, or None where the recipe has none."""
    make = getattr(recipe_obj, "torch_reference", None)
    return make(options) if callable(make) else None


# --- what twins share -----------------------------------------------------------------------------
def lm_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """A language model's mean cross-entropy over `targets`; with a `mask` (JSONL examples) the
    mean over the positions the mask counts."""
    if "mask" in batch:
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1).long(),
                              reduction="none")
        mask = batch["mask"].reshape(-1).to(per.dtype)
        return (per * mask).sum() / mask.sum()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1).long())


def class_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """A classifier's mean cross-entropy over `labels`."""
    return F.cross_entropy(logits, batch["labels"].long())


@torch.no_grad()
def adamw_row_step(params: dict, m: dict, v: dict, row) -> None:
    """One AdamW step from our 7-slot row (toyharness/adamw.py), applied as written; weight decay
    on tensors of 2 or more axes only, as nanoGPT's configure_optimizers groups them."""
    lr, b1, b2, eps, wd, s5, s6 = (float(x) for x in row)
    for name, p in params.items():
        g = p.grad
        m[name].mul_(b1).add_(g, alpha=1 - b1)
        v[name].mul_(b2).addcmul_(g, g, value=1 - b2)
        decay = wd if p.dim() >= 2 else 0.0
        p.mul_(1 - lr * decay).sub_(lr * (m[name] * s5) / ((v[name] * s6).sqrt() + eps))


def micro_batches(batch: dict, k: int) -> list[dict]:
    """A step's batch (t_batch * k rows, as batches.npz holds it) as k micro-batches of
    consecutive rows; what the loss reads only (images, tokens, targets, labels, mask)."""
    keep = {n: a for n, a in batch.items() if n != "cls_index" and getattr(a, "ndim", 0) >= 1}
    rows = len(next(iter(keep.values())))
    return [{n: a[j * rows // k:(j + 1) * rows // k] for n, a in keep.items()} for j in range(k)]


def accumulated_step(twin, P: dict, train: dict, batch: dict, options) -> float:
    """Forward and backward of one optimizer step as the runner makes it: `accumulate`
    micro-batches, each loss weighted by its count (its mask's positions, else its rows) over the
    step's count, so the gradients sum to the big batch's; then clip_grad_norm_ with `grad_clip`.
    Returns the step's loss (the count-weighted mean)."""
    k = getattr(options, "accumulate", 1)
    parts = micro_batches(batch, k) if k > 1 else [batch]
    counts = [float(p["mask"].sum()) if "mask" in p else 1.0 for p in parts]
    total = sum(counts)
    for p in train.values():
        p.grad = None
    loss_sum = 0.0
    for part, count in zip(parts, counts):
        loss = twin.loss(twin.forward(P, part), part)
        (loss * (count / total)).backward()
        loss_sum += float(loss.detach()) * count
    clip = getattr(options, "grad_clip", 0.0)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(list(train.values()), clip)
    return loss_sum / total


def torch_precision_setup(precision: str) -> Callable[[torch.device], contextlib.AbstractContextManager]:
    """Set PyTorch up for `precision` (fp32, tf32: TF32 products, bf16: bf16 autocast over fp32
    weights); returns the context each forward runs in on a device."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if precision == "bf16":
        return lambda dev: torch.autocast(dev.type, dtype=torch.bfloat16)
    return lambda dev: contextlib.nullcontext()


def _on(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    if "segments" in batch:
        raise InputError("the PyTorch twins take one JSONL example a row, not packed rows: set pack=false to "
                         "compare with PyTorch")
    return {k: torch.from_numpy(np.ascontiguousarray(a)).to(device) for k, a in batch.items()}


# --- bench: the twin's steps timed ------------------------------------------------------------------
def _attribute(name: str) -> str:
    return name.replace(".", "__")       # nn.Module names take no dots; GGUF names never hold "__"


class TwinModule(torch.nn.Module):
    """A twin and its tensors as one nn.Module, as a PyTorch user's model is: the trained tensors its
    parameters, the frozen ones its buffers (the same tensor objects: a twin over transformers'
    model has them inside that model too). `forward(batch)` is the twin's logits; torch.compile
    takes the module whole, its weights the module's own rather than inputs of a function."""

    def __init__(self, twin, P: dict[str, torch.Tensor]):
        super().__init__()
        self.twin = twin
        self.names = {}
        for name, t in P.items():
            attr = _attribute(name)
            if attr in self.names.values():
                raise ValueError(f"TwinModule: tensors {name!r} and another share the attribute name {attr!r}")
            self.names[name] = attr
            if t.requires_grad:
                # a plain leaf tensor (a third-party twin's) becomes a Parameter on its storage;
                # forward reads it from P, so the twin sees this one
                param = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t.detach())
                self.register_parameter(attr, param)
            else:
                self.register_buffer(attr, t)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The twin's P: its tensors by their names."""
        return {name: getattr(self, attr) for name, attr in self.names.items()}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.twin.forward(self.tensors(), batch)


def adamw(params: list[torch.Tensor], options) -> tuple[torch.optim.AdamW, str]:
    """torch.optim.AdamW at bench's hyperparameters: fused (one kernel a step) where this torch
    has it for the device, else foreach (multi-tensor); and which it is."""
    kw = {"lr": 1e-3, "betas": (0.9, getattr(options, "beta2", 0.999)), "eps": 1e-8,
          "weight_decay": getattr(options, "weight_decay", 0.0)}
    try:
        return torch.optim.AdamW(params, fused=True, **kw), "fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **kw), "foreach"


def twin_step(twin, P: dict[str, torch.Tensor], options, dev: torch.device, mode: str = "eager"):
    """One training step of the twin as a PyTorch user writes it (nanoGPT's choices): the twin as
    a module (TwinModule), under torch.compile in mode "compile" (the module, as nanoGPT compiles
    its model; the loss and the fused AdamW step outside it), the loss under the precision's
    autocast. Returns (step, optimizer flavour); step(batch) takes a batch already on `dev` and
    returns the loss as a tensor: reading it is the caller's (a host sync)."""
    autocast = torch_precision_setup(getattr(options, "precision", "fp32"))
    module = TwinModule(twin, P)
    opt, flavour = adamw([p for p in module.parameters() if p.requires_grad], options)
    model = torch.compile(module) if mode == "compile" else module

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with autocast(dev):
            loss = twin.loss(model(batch), batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, flavour


def host_batches(batches: list[dict[str, np.ndarray]], dev: torch.device) -> list[dict[str, torch.Tensor]]:
    """The batches as host tensors, in pinned (page-locked) memory for a cuda device, so that each
    step's copy to the device is asynchronous (nanoGPT's get_batch)."""
    pin = dev.type == "cuda"
    return [{k: (t.pin_memory() if pin else t) for k, t in
             ((k, torch.from_numpy(np.ascontiguousarray(a))) for k, a in b.items())} for b in batches]


def torch_worker(conn, recipe: str, options, device: str, threads: int, payload: dict, mode: str = "eager") -> None:
    """bench's PyTorch worker (toyharness/bench/procs.py): the twin trained from ours's initial
    weights (payload "params") on ours's batches (payload "batches"), timed per step.

    A timed step is what ours's is (toyharness/bench/config.py, step_timer): the batch copied from
    the host to the device (ours uploads its numpy batch each step; here from pinned memory,
    non-blocking, as nanoGPT does), forward, backward and AdamW, then a wait for the device
    (torch.cuda.synchronize, as a PyTorch benchmark waits; no .item() of the loss)."""
    from ..device_memory import PeakDeviceMemory
    from ..discovery import get_recipe

    torch.set_num_threads(threads)
    precision = getattr(options, "precision", "fp32")
    dev = torch.device(device)
    device_memory = PeakDeviceMemory() if dev.type == "cuda" else None
    twin = twin_for(get_recipe(recipe)[1], options)
    # bf16: frozen weights (a base) in bf16, as transformers + PEFT users load them; the trained
    # ones fp32 master weights under bf16 autocast, as ours
    P = twin.parameters(payload["params"], dev, torch.bfloat16 if precision == "bf16" else torch.float32)
    step, flavour = twin_step(twin, P, options, dev, mode)
    batches = host_batches(payload["batches"], dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    conn.send({"ready": True, "optimizer": flavour, "torch": torch.__version__, "mode": mode})
    done = 0
    while True:
        cmd, n = conn.recv()
        if cmd == "steps":
            times = []
            sync()
            for _ in range(n):
                t0 = time.perf_counter()
                step({k: t.to(dev, non_blocking=True) for k, t in batches[done % len(batches)].items()})
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
                done += 1
            if device_memory is not None:
                device_memory.sample()
            conn.send(times)
        else:
            peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None
            conn.send({"peak_rss_mb": peak_rss_mb(), "device_peak_mb": peak,
                       "device_mb": device_memory.peak_mb if device_memory is not None else None})
            return


# --- parity: replay a run folder --------------------------------------------------------------------
def replay_losses(run_dir: str | Path, steps: int) -> list[float]:
    """The first `steps` losses of the run in `run_dir` (its config.toml, init.gguf, batches.npz),
    recomputed by its recipe's twin with the run's AdamW rows. A recipe without a twin is an
    InputError naming it."""
    from ..discovery import get_recipe
    from ..engine import GGUFFile
    from ..options import read_toml, resolve_options
    from ..run_files import read_batches_npz

    run_dir = Path(run_dir)
    recipe = read_toml(run_dir / "config.toml")["recipe"]
    _, obj = get_recipe(recipe)
    opts = resolve_options(obj, str(run_dir / "config.toml"), [], {})
    twin = twin_for(obj, opts)
    if twin is None:
        raise InputError(f"recipe {recipe}: no PyTorch twin (a torch_reference method) to replay {run_dir} with")
    twin.check()
    with GGUFFile(run_dir / "init.gguf") as f:
        init = {n: f.tensor(n).to_numpy() for n in f.names}
    P = twin.parameters(init, "cpu")
    train = {n: p for n, p in P.items() if p.requires_grad}
    m = {n: torch.zeros_like(p) for n, p in train.items()}
    v = {n: torch.zeros_like(p) for n, p in train.items()}
    batches = read_batches_npz(run_dir / "batches.npz")
    losses = []
    for i in range(steps):
        batch = _on({k: batches[k][i] for k in batches}, "cpu")
        losses.append(accumulated_step(twin, P, train, batch, opts))
        adamw_row_step(train, m, v, opts.adamw_row().hp_for_step(i))
    return losses


# --- a whole run in PyTorch ----------------------------------------------------------------------
def train_reference(recipe: str, steps: int, sets: list[str] | None = None, precision: str = "fp32",
                    device: str = "cpu", eval_batches: tuple[int, ...] = ()) -> dict:
    """Train language-model `recipe` (any with a twin, an `init_params` and a `vocab_for`) in
    PyTorch, as `toyharness run` would: the recipe's seeded init, its data's batches, its AdamW rows
    (schedule included), at `precision` (fp32; tf32: TF32 products; bf16: bf16 autocast over fp32
    master weights, as nanoGPT trains). Returns the train losses and, after the last step, the eval
    loss the run reports (`eval`, over the option eval_batches' held-out batches) and the mean loss
    over the first n held-out batches for each n in `eval_batches` (`evals`).

    What it is for: how far PyTorch's own bf16 run ends from its fp32 run, beside ours."""
    from ..discovery import get_recipe
    from ..engine.precision import PRECISIONS
    from ..hookspecs import plugin_manager
    from ..runner import batch_for, load_data, resolve_options
    from ..training_loop import options_for_steps

    _, obj = get_recipe(recipe)
    missing = [m for m in ("torch_reference", "init_params", "vocab_for") if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"train_reference: recipe {recipe!r} has no {', '.join(missing)}")
    if precision not in PRECISIONS:
        raise ValueError(f"train_reference: precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    options = resolve_options(obj, None, sets, {"steps": steps})
    if options.precision != "fp32":     # our engine's option; the reference takes `precision`
        raise ValueError(f"train_reference: the option precision={options.precision} is ours; pass precision=")
    if options.weight_dtype != "f32":   # the reference keeps fp32 weights
        raise ValueError(f"train_reference: weight_dtype={options.weight_dtype} is not modelled; allowed: f32")
    data = load_data(plugin_manager(obj), options)
    vocab = obj.vocab_for(options, data.vocab)
    dev = torch.device(device)
    autocast = torch_precision_setup(precision)
    twin = twin_for(obj, options)
    twin.check()
    P = twin.parameters(obj.init_params(options, vocab), dev)
    train = {n: p for n, p in P.items() if p.requires_grad}
    m = {n: torch.zeros_like(p) for n, p in train.items()}
    v = {n: torch.zeros_like(p) for n, p in train.items()}

    def loss_of(batch):
        return twin.loss(twin.forward(P, batch), batch)

    losses = []
    step_options = options_for_steps(options)      # t_batch * accumulate rows a step
    for i in range(options.steps):
        batch = _on(batch_for(data, "train", i, step_options), dev)
        with autocast(dev):
            losses.append(accumulated_step(twin, P, train, batch, options))
        adamw_row_step(train, m, v, options.adamw_row().hp_for_step(i))
    evals = {}
    with torch.no_grad(), autocast(dev):
        for n in {options.eval_batches, *eval_batches}:
            evals[n] = sum(float(loss_of(_on(batch_for(data, "eval", j, step_options), dev))) for j in range(n)) / n
    return {"losses": losses, "eval": evals[options.eval_batches], "evals": evals}
