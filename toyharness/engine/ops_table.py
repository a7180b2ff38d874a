"""The ops of engine/tensor.py and tensor_shapes.py, each with a float64 numpy reference, and which mode runs each.

`OPS` is the one list of them: tests/test_ops_modes.py checks each against its reference (forward)
and finite differences (backward) in every mode, and `support_table` derives which mode trains
which op from the code itself: it builds each op's training graph (forward, ggml's backward,
AdamW) in each mode and asks that mode's own check (engine/graph_check.py: the portable kernels'
th_portable_first_unsupported, the metal lowering's declarations) whether it would run it.
`python -m toyharness.engine.ops_table` prints the table of docs/ops.md.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import BackendError
from .dropout import dropout_mask

Array = np.ndarray


@dataclass(frozen=True)
class OpCase:
    """One op: `build` on Tensors, `ref` the same on float64 arrays, `shapes` of its inputs,
    `kinks`: where its derivative jumps (relu at 0, clamp at its bounds): the inputs keep away
    from them, finite differences across a kink being meaningless); `training`: the op computes
    another function in training than in evaluation (dropout), `ref` being the training forward's
    (program seed 0, forward index 0)."""

    name: str
    call: str                                   # how a recipe writes it
    build: Callable
    ref: Callable
    shapes: tuple[tuple[int, ...], ...] = ((3, 4),)
    kinks: tuple[float, ...] = ()
    training: bool = False


def _erf(x: Array) -> Array:
    return np.vectorize(math.erf)(x)


def _sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + np.exp(-x))


_C = math.sqrt(2.0 / math.pi)

OPS: tuple[OpCase, ...] = (
    OpCase("relu", "x.relu()", lambda x: x.relu(), lambda x: np.maximum(x, 0.0), kinks=(0.0,)),
    OpCase("leaky_relu", "x.leaky_relu(slope)", lambda x: x.leaky_relu(0.1),
           lambda x: np.where(x > 0, x, 0.1 * x), kinks=(0.0,)),
    OpCase("gelu (tanh)", 'x.gelu(approximate="tanh")', lambda x: x.gelu("tanh"),
           lambda x: 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * x ** 3)))),
    OpCase("gelu (erf)", 'x.gelu(approximate="none")', lambda x: x.gelu("none"),
           lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))),
    OpCase("silu", "x.silu()", lambda x: x.silu(), lambda x: x * _sigmoid(x)),
    OpCase("sigmoid", "x.sigmoid()", lambda x: x.sigmoid(), _sigmoid),
    OpCase("tanh", "x.tanh()", lambda x: x.tanh(), np.tanh),
    OpCase("softplus", "x.softplus()", lambda x: x.softplus(), lambda x: np.log1p(np.exp(x))),
    OpCase("abs", "x.abs()", lambda x: x.abs(), np.abs, kinks=(0.0,)),
    OpCase("clamp", "x.clamp(lo, hi)", lambda x: x.clamp(-0.5, 0.7), lambda x: np.clip(x, -0.5, 0.7),
           kinks=(-0.5, 0.7)),
    OpCase("concat (first axis)", "x.concat([y], axis=0)", lambda x, y: x.concat([y], axis=0),
           lambda x, y: np.concatenate([x, y], axis=0), shapes=((2, 3, 4), (1, 3, 4))),
    OpCase("concat (last axis)", "x.concat([y], axis=-1)", lambda x, y: x.concat(y, axis=-1),
           lambda x, y: np.concatenate([x, y], axis=-1), shapes=((2, 3, 4), (2, 3, 2))),
    OpCase("narrow (middle axis)", "x.narrow(axis, start, length)", lambda x: x.narrow(1, 1, 2),
           lambda x: x[:, 1:3], shapes=((2, 4, 3),)),
    OpCase("slice", "x[1:, ..., :2]", lambda x: x[1:, ..., :2], lambda x: x[1:, ..., :2], shapes=((3, 2, 4),)),
    OpCase("index", "x[:, 1]", lambda x: x[:, 1] * x[:, 2], lambda x: x[:, 1] * x[:, 2], shapes=((3, 4, 2),)),
    OpCase("sum (two consumers)", "x.sum()", lambda x: (x.sum() + x.sqr().sum()).reshape(1),
           lambda x: np.array([x.sum() + (x * x).sum()])),
    OpCase("transpose (two consumers)", "x.transpose()", lambda x: x.transpose() + x.sqr().transpose(),
           lambda x: x.T + (x * x).T),
    OpCase("permute (two consumers)", "x.permute(2, 0, 1)",
           lambda x: x.permute(2, 0, 1) + x.permute(0, 2, 1).permute(1, 0, 2),
           lambda x: np.transpose(x, (2, 0, 1)) + np.transpose(np.transpose(x, (0, 2, 1)), (1, 0, 2)),
           shapes=((2, 3, 4),)),
    OpCase("dropout", "x.dropout(p, name)", lambda x: x.dropout(0.5, "op"),
           lambda x: x * dropout_mask(x.shape, 0.5, 0, 0, "op"), shapes=((4, 6),), training=True),
)

MODES = ("cpu fast", "cpu portable", "metal lowering")


def inputs_for(case: OpCase, rng: np.random.Generator) -> list[Array]:
    """float32-exact inputs in about [-1.5, 1.5], each at least 0.05 from the op's kinks."""
    out = []
    for shape in case.shapes:
        x = rng.uniform(-1.5, 1.5, size=shape)
        for k in case.kinks:
            near = np.abs(x - k) < 0.05
            x[near] = np.where(x[near] >= k, k + 0.08, k - 0.08)
        out.append(x.astype(np.float32).astype(np.float64))
    return out


def training_program(case: OpCase, engine, arrays: list[Array], target: Array | None = None):
    """(program, output, trainer): the inputs as trainable parameters, loss sum((op - target)^2)
    (target zeros unless given)."""
    prog = engine.program()
    params = [prog.param(f"in{i}", a.astype(np.float32)) for i, a in enumerate(arrays)]
    out = case.build(*params)
    tgt = prog.constant("target", np.zeros(out.shape, np.float32) if target is None else target)
    diff = out - tgt
    loss = prog.scalar_loss(diff.sqr().sum())
    return prog, out, prog.trainer(loss, "bias_corrected")


def _engine_for(mode: str):
    from . import get_engine

    engine = get_engine("cpu")
    engine.set_portable(mode == "cpu portable")
    return engine


def support(case: OpCase, mode: str) -> str:
    """"yes" when `mode` builds and accepts the op's training graph, else its refusal's reason."""
    from .program import Program

    saved = Program.lowering_target
    if mode == "metal lowering":
        Program.lowering_target = "metal"
    engine = _engine_for(mode)
    try:
        training_program(case, engine, inputs_for(case, np.random.default_rng(0)))
        return "yes"
    except BackendError as e:
        text = str(e)
        return "no: " + text.split("cannot run ", 1)[-1].split(" (", 1)[0]
    finally:
        engine.set_portable(False)
        Program.lowering_target = saved


def support_table() -> dict[str, dict[str, str]]:
    """{op: {mode: "yes" or "no: OP"}} for every op of OPS and every mode of MODES."""
    return {case.name: {mode: support(case, mode) for mode in MODES} for case in OPS}


def markdown() -> str:
    table = support_table()
    lines = [
        "# Ops and the modes that train them",
        "",
        "Generated by `python -m toyharness.engine.ops_table > docs/ops.md` (a test checks that this",
        "file is its output). Each cell says whether that mode accepts the op's training graph",
        "(forward, ggml's backward, AdamW), as the mode itself decides when a run starts: the cpu",
        "backend's fast mode (ggml's kernels and ours), its portable mode (every node on",
        "native/portable_kernels.c, the same bits on every CPU) and the lowering for ggml-metal",
        "(`Program.lowering_target = \"metal\"`: the nodes a Mac's ggml-metal declares). A `no` names the",
        "first node the mode refuses. The vulkan backend checks its own ggml's declarations the",
        "same way when the graphs are built, the cuda backend at the first step, after our",
        "kernels have taken their nodes; each refusal is one line naming the op and the recipe's",
        "line that made its node. tests/test_ops_modes.py also runs every op on vulkan and cuda",
        "where they are built (`nox -s tests-vulkan`, and on a GPU).",
        "",
        "Every op is also checked against a float64 numpy reference and finite differences in",
        "each mode (tests/test_ops_modes.py).",
        "",
        "| op | written | " + " | ".join(MODES) + " |",
        "|---|---|" + "---|" * len(MODES),
    ]
    for case in OPS:
        cells = " | ".join(table[case.name][m] for m in MODES)
        lines.append(f"| {case.name} | `{case.call}` | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
