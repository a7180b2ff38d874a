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


@dataclass(frozen=True)
class Schedule:
    """LR schedule for slot 0: ``constant``, or ``cosine`` (linear warmup, cosine decay to min_lr)."""

    kind: str = "constant"
    warmup: int = 0
    total: int = 0
    min_lr_ratio: float = 0.1

    def factor(self, step: int) -> float:
        if self.kind == "constant":
            return 1.0
        if self.kind != "cosine":
            raise InputError(f"lr_schedule: unknown schedule {self.kind!r}; allowed: constant, cosine")
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


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
        lr = self.lr * self.schedule.factor(step)
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
