"""The 7-float AdamW row of ggml's ``opt_step_adamw`` (docs/design.md, "The AdamW row").

ggml computes, per parameter and step::

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
    w = w*(1 - lr*wd) - lr*(m*s5)/(sqrt(v*s6) + eps)

with the row ``[lr, beta1, beta2, eps, weight_decay, s5, s6]``. Two conventions fill s5, s6:

- ``bias_corrected``: s5 = 1/(1-b1^t), s6 = 1/(1-b2^t), t = step+1 (PyTorch's AdamW)
- ``constant_betas``: s5 = b1, s6 = b2 (the seeds' from-scratch family)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .errors import InputError

CONVENTIONS = ("bias_corrected", "constant_betas")


class HPRow(tuple):
    """The 7 floats of one step's row, tagged with the convention that produced them."""

    convention: str

    def __new__(cls, values, convention: str) -> HPRow:
        row = super().__new__(cls, (float(v) for v in values))
        if len(row) != 7:
            raise InputError(f"an AdamW row has 7 slots, got {len(row)}")
        row.convention = convention
        return row

    @property
    def lr(self) -> float:
        return self[0]


SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """LR schedule for slot 0: ``constant``; ``cosine`` or ``linear``: `warmup` steps of linear
    warmup (step s at (s+1)/warmup of lr), then a decay over the remaining steps to the floor.

    The floor: `min_lr` where set (an absolute learning rate, nanoGPT's ``min_lr``), else
    `min_lr_ratio` (0.1) of lr, nanoGPT's own default (min_lr = learning_rate/10). nanoGPT's warmup
    is (it+1)/(warmup_iters+1): ours reaches lr at the last warmup step, one step earlier."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 0
    min_lr_ratio: float = 0.1
    min_lr: float | None = None

    def _progress(self, step: int) -> float:
        span = max(1, self.total - self.warmup)
        return min(1.0, (step - self.warmup) / span)

    def _decay(self, step: int) -> float:
        """Where the decay stands, from 1 (lr) to 0 (the floor)."""
        progress = self._progress(step)
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1 + math.cos(math.pi * progress))

    def _check(self) -> None:
        if self.kind not in SCHEDULES:
            raise InputError(f"lr_schedule: unknown schedule {self.kind!r}; allowed: {', '.join(SCHEDULES)}")

    def factor(self, step: int) -> float:
        """lr's multiplier at `step` with the floor a ratio of lr (`min_lr` unset)."""
        self._check()
        if self.kind == "constant":
            return 1.0
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * self._decay(step)

    def learning_rate(self, lr: float, step: int) -> float:
        """The learning rate at 0-indexed `step`: lr * factor(step), or with `min_lr` set, nanoGPT's
        min_lr + coeff * (lr - min_lr) after the warmup."""
        self._check()
        if self.min_lr is None or self.kind == "constant" or (self.warmup > 0 and step < self.warmup):
            return lr * self.factor(step)
        return self.min_lr + self._decay(step) * (lr - self.min_lr)


@dataclass(frozen=True)
class AdamWRow:
    """Hyper-parameters plus the convention that turns them into the 7-float row."""

    convention: str | None
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    schedule: Schedule = field(default_factory=Schedule)

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise InputError(f"adamw_convention: {self.convention!r} is not declared; "
                             f"allowed: {', '.join(CONVENTIONS)}")

    def hp_for_step(self, step: int) -> HPRow:
        """The row for 0-indexed ``step``, slot 0 scaled by the schedule."""
        if step < 0:
            raise InputError(f"step must be >= 0, got {step}")
        lr = self.schedule.learning_rate(self.lr, step)
        b1, b2 = self.beta1, self.beta2
        if self.convention == "bias_corrected":
            t = step + 1
            s5, s6 = 1.0 / (1.0 - b1**t), 1.0 / (1.0 - b2**t)
        else:
            s5, s6 = b1, b2
        return HPRow([lr, b1, b2, self.eps, self.weight_decay, s5, s6], self.convention)

    def with_schedule(self, schedule: Schedule) -> AdamWRow:
        return replace(self, schedule=schedule)


def bias_corrected(lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, schedule: Schedule | None = None) -> AdamWRow:
    return AdamWRow("bias_corrected", lr, beta1, beta2, eps, weight_decay, schedule or Schedule())


def constant_betas(lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8,
                   weight_decay: float = 0.0, schedule: Schedule | None = None) -> AdamWRow:
    return AdamWRow("constant_betas", lr, beta1, beta2, eps, weight_decay, schedule or Schedule())


def check_convention(row: AdamWRow | HPRow, declared: str | None) -> None:
    """Raise unless the row's convention is the one the training graph declared."""
    if declared not in CONVENTIONS:
        raise InputError(f"the training graph declares no AdamW convention ({declared!r}); "
                         f"allowed: {', '.join(CONVENTIONS)}")
    if row.convention != declared:
        raise InputError(f"adamw_convention: the row is {row.convention!r} but the recipe's graph "
                         f"declares {declared!r}")
