"""The training loop's controls in the training graph (docs/design.md, "Accumulation and clipping"):
gradient accumulation over micro-batches and clipping by the global L2 norm, both built as nodes of
the Trainer's graphs (no host round trip), and which tensors AdamW decays.

Off (accumulate 1, grad_clip 0) none of these nodes exist: the Trainer's graphs are what they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._ffi import GGML_TYPE_F32, lib
from ..errors import InputError

if TYPE_CHECKING:
    from .program import Program

# torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6), clamped to 1
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class TrainingLoop:
    """What a Trainer built on a program does beyond one AdamW step per batch: `accumulate`
    micro-batches per optimizer step (their gradients summed in a fixed order, then divided by the
    count of what they counted), and `grad_clip` > 0 clips the step's gradient to that global L2 norm.
    The runner sets it on the engine for the programs a run makes (Engine.set_training_loop)."""

    accumulate: int = 1
    grad_clip: float = 0.0
    # processes a step's micro-batches are spread over (engine/data_parallel.py): `accumulate`
    # micro-batches, accumulate / devices rounds of one each, so a step's bits are those of one
    # process accumulating them
    devices: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise InputError(f"option 'accumulate': must be an integer >= 1, got {self.accumulate!r}")
        if not 0 <= self.grad_clip < float("inf"):
            raise InputError(f"option 'grad_clip': must be >= 0 and finite (0: off), got {self.grad_clip!r}")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise InputError(f"option 'devices': must be an integer >= 1, got {self.devices!r}")
        if self.devices > 1 and self.accumulate % self.devices:
            raise InputError(f"devices={self.devices}: each process takes one micro-batch of each round, so a "
                             f"step's micro-batches are a multiple of {self.devices} (accumulate "
                             f"{self.accumulate} given)")

    @property
    def is_default(self) -> bool:
        return self.accumulate == 1 and self.grad_clip == 0


def decays(ndim: int) -> bool:
    """Whether AdamW's weight decay applies to a parameter of `ndim` axes: matrices and embeddings
    (2 or more axes) decay; biases, norms' gains and other vectors do not (nanoGPT's
    configure_optimizers: ``p.dim() >= 2``)."""
    return ndim >= 2


def decayed_names(params: dict) -> list[str]:
    """The parameters (name -> Tensor) that weight decay applies to, in the program's order."""
    return [name for name, p in params.items() if decays(p.ndim)]


class GraphControls:
    """The nodes the controls add, built in a program's compute context: accumulators, the sums
    into them, the mean's scale and the clip. Persistent tensors (accumulators, the fed 1/N, the
    clip's bound) are made by `make_state` before the program allocates."""

    def __init__(self, prog: Program, loop: TrainingLoop):
        self.prog, self.loop = prog, loop
        self.accumulators: dict[str, object] = {}
        self.last_gradients: dict[str, object] = {}     # data parallel: the step's last micro-batch's, fed
        self.inv_count = None
        self.max_norm = None
        self.norm = None

    def make_state(self) -> None:
        prog = self.prog
        if self.loop.accumulate > 1:
            for name, p in prog.params.items():
                self.accumulators[name] = prog._new_static(f"grad.sum.{name}"[:63], p.shape, GGML_TYPE_F32)
            # 1/N, N the step's count (rows, or counted positions), fed at the last micro-batch
            self.inv_count = prog._new_static("grad.inv_count", (1,), GGML_TYPE_F32)
            lib.ggml_set_input(self.inv_count.ptr)
        if self.loop.devices > 1:
            for name, p in prog.params.items():
                self.last_gradients[name] = prog._new_static(f"grad.last.{name}"[:63], p.shape, GGML_TYPE_F32)
                lib.ggml_set_input(self.last_gradients[name].ptr)
        if self.loop.grad_clip > 0:
            self.max_norm = prog._new_static("grad_clip.max_norm", (1,), GGML_TYPE_F32)
            lib.ggml_set_input(self.max_norm.ptr)
            if prog.planner is None:
                prog._pending.append((self.max_norm, np.full(1, self.loop.grad_clip, np.float32)))

    @staticmethod
    def extra_nodes(n_params: int, loop: TrainingLoop) -> int:
        """Nodes (and leafs) the controls add to one graph, at most."""
        if loop.is_default:
            return 0
        return 8 * n_params + 16

    def into_accumulators(self, ctx, grads: dict, first: bool) -> list:
        """Nodes that copy (first micro-batch) or add (later ones) each gradient into its
        accumulator, in the program's parameter order."""
        out = []
        for name, g in grads.items():
            acc = self.accumulators[name].ptr
            out.append(lib.ggml_cpy(ctx, g if first else lib.ggml_add(ctx, g, acc), acc))
        return out

    def step_gradients(self, ctx, grads: dict) -> dict:
        """The gradients AdamW steps on: with accumulation the accumulated sum plus this last
        micro-batch's gradient, times 1/N; with clipping, those times min(1, C/(norm + 1e-6)), the
        norm over every trainable tensor's gradient, summed in the parameters' order."""
        out = dict(grads)
        if self.loop.accumulate > 1:
            out = {name: lib.ggml_mul(ctx, lib.ggml_add(ctx, g, self.accumulators[name].ptr), self.inv_count.ptr)
                   for name, g in out.items()}
        if self.loop.grad_clip > 0:
            total = None
            for g in out.values():
                sq = lib.ggml_sum(ctx, lib.ggml_sqr(ctx, g))
                total = sq if total is None else lib.ggml_add(ctx, total, sq)
            self.norm = lib.ggml_sqrt(ctx, total)
            lib.ggml_set_name(self.norm, b"grad_clip.norm")
            lib.ggml_set_output(self.norm)
            # min(1, C/d) as C / (C + relu(d - C)), d = norm + 1e-6: exactly 1 where d <= C, and
            # with ops every backend and the portable mode compute (no clamp there)
            c = self.max_norm.ptr
            over = lib.ggml_relu(ctx, lib.ggml_sub(ctx, lib.ggml_scale_bias(ctx, self.norm, 1.0, CLIP_EPS), c))
            coef = lib.ggml_div(ctx, c, lib.ggml_add(ctx, c, over))
            out = {name: lib.ggml_mul(ctx, g, coef) for name, g in out.items()}
        return out
