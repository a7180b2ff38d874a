"""A run folder's files besides its config and summary: checkpoint.gguf (parameters and AdamW's
moments), metrics.jsonl read back on resume, batches.npz (--save-batches), and the loss and
confusion plots. Every write is atomic (toyharness/atomic.py); every read checks what it reads
and names the file (docs/design.md, "A run's files")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .arrays import load_npz
from .atomic import atomic_write
from .engine import GGUFFile, write_gguf
from .engine.gguf_io import GGUFError
from .errors import InputError
from .options import Options

if TYPE_CHECKING:
    from .runner import Run


def trainer_params(trainer) -> dict[str, np.ndarray]:
    return {name: trainer.prog.read(t) for name, t in trainer.prog.params.items()}


def save_checkpoint(out_dir: Path, trainer, options: Options, steps_done: int) -> None:
    rows = options.t_batch * options.accumulate     # a step's rows
    meta = {"toyharness.step": steps_done, "toyharness.data_position": steps_done * rows,
            "toyharness.seed": options.seed}
    write_gguf(out_dir / "checkpoint.gguf", "toyharness-checkpoint", trainer.state(), meta)


def load_checkpoint(path: Path, trainer, options: Options) -> int:
    shapes = {name: t.shape for name, t in trainer.prog.params.items()}
    step, state = read_checkpoint(path, shapes, options.seed, options.steps)
    trainer.load_state(state, step)
    return step


def read_checkpoint(path: Path, shapes: dict[str, tuple[int, ...]], seed: int,
                    steps: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(steps done, {name, adamw.m.name, adamw.v.name: float32 array}) from a checkpoint whose
    parameters have `shapes`; the step and seed checked against the run's."""
    with GGUFFile(path) as f:
        step = f.require_field("toyharness.step")
        saved_seed = f.require_field("toyharness.seed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise GGUFError(f"{path}: checkpoint step {step!r} is not a step count")
        if steps is not None and step > steps:
            raise InputError(f"{path}: the checkpoint is at step {step}, past the run's {steps} steps; resume "
                             f"with --steps {step} or more")
        if not isinstance(saved_seed, int) or saved_seed != seed:
            raise GGUFError(f"{path}: checkpoint seed {saved_seed!r} differs from the run's seed {seed}")
        state = {}
        for name, shape in shapes.items():
            for key in (name, f"adamw.m.{name}", f"adamw.v.{name}"):
                state[key] = f.tensor(key, expect_shape=shape).to_numpy()
        unused = [name for name in f.names if name not in state]
        if unused:     # a model option changed since (bias, untied ...): never drop a tensor silently
            raise InputError(f"{path}: tensor {unused[0]!r} is not one this run's options make (its model "
                             f"differs from the checkpoint's); resume with the options the run was made with")
    return step, state


def read_metrics(path: Path, steps: int) -> list[dict]:
    """The first `steps` lines of a run's metrics.jsonl, each checked: a JSON object for step i
    with a finite loss. A missing file, or fewer lines than the checkpoint covers, is an error:
    the resumed run's metrics would have a hole."""
    if steps == 0:
        return []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc}); resuming at step {steps} needs "
                         f"the metrics of steps 0-{steps - 1}") from None
    out = []
    for n, line in enumerate(raw.split(b"\n")[:steps], 1):
        try:
            m = json.loads(line)
        except (ValueError, RecursionError) as exc:     # JSONDecodeError, bad UTF-8
            raise InputError(f"{path}:{n}: not a JSON line ({' '.join(str(exc).split())[:120]})") from None
        if not isinstance(m, dict) or m.get("step") != n - 1 or isinstance(m.get("step"), bool) or \
                not isinstance(m.get("loss"), (int, float)) or not math.isfinite(m["loss"]):
            raise InputError(f"{path}:{n}: expected a metrics line for step {n - 1} with a finite loss")
        out.append(m)
    if len(out) < steps:
        raise InputError(f"{path}: {len(out)} lines, but the checkpoint covers {steps} steps")
    return out


def save_batches_npz(path: Path, log: dict[str, list]) -> None:
    import io

    buf = io.BytesIO()
    np.savez(buf, **{k: np.stack(v) for k, v in log.items()})
    atomic_write(path, buf.getvalue())


BATCH_DTYPES = {"tokens": "i", "targets": "i", "labels": "i", "cls_index": "i", "images": "f", "mask": "f",
                "completion": "f", "valid": "f", "pairs": "i"}


def read_batches_npz(path: Path) -> dict[str, np.ndarray]:
    """A run's batches.npz: known arrays only, of the right kind, all with one row per step."""
    arrays = load_npz(path, "batches")
    if not arrays:
        raise InputError(f"batches {path}: holds no arrays")
    steps = None
    for name, a in arrays.items():
        kind = BATCH_DTYPES.get(name)
        if kind is None:
            raise InputError(f"batches {path}: unknown array {name!r}; expected some of {', '.join(BATCH_DTYPES)}")
        if a.dtype.kind != kind or a.dtype.itemsize != 4 or a.ndim < 2:
            raise InputError(f"batches {path}: {name!r} is {a.dtype} with shape {a.shape}; expected "
                             f"{'int32' if kind == 'i' else 'float32'} [steps, batch, ...]")
        if steps is not None and a.shape[0] != steps:
            raise InputError(f"batches {path}: {name!r} has {a.shape[0]} steps, the others {steps}")
        steps = a.shape[0]
    return arrays


def plot_loss(path: Path, run: Run) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([m["step"] for m in run.metrics], [m["loss"] for m in run.metrics], lw=1, label="train")
    if run.evals:
        ax.plot([e["step"] for e in run.evals], [e["loss"] for e in run.evals], "o-", ms=3, label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"{run.recipe}")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def plot_confusion(path: Path, confusion: np.ndarray, title: str) -> None:
    """Counts of (true class, predicted class) on the test split at the end of the run."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = confusion.shape[0]
    fig, ax = plt.subplots(figsize=(4.5, 4), dpi=100)
    ax.imshow(confusion, cmap="Blues")
    for (r, c), v in np.ndenumerate(confusion):
        ax.text(c, r, str(int(v)), ha="center", va="center", fontsize=7,
                color="white" if v > confusion.max() / 2 else "black")
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    acc = np.trace(confusion) / max(confusion.sum(), 1)
    ax.set_title(f"{title}: test accuracy {acc:.2%}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, buf.getvalue())
