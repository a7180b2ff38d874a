"""Fuzzing the graph API: random graphs built through engine/tensor.py's public ops.

The contract, for every graph a recipe can build through Tensor: building it, its Trainer and one
training step either succeed or raise the project's own error (`toyharness.errors.ToyharnessError`)
in one line; a shape, layout or type error (ShapeError) ends with the line that made the node
"(at file:line)". Never an abort inside ggml, a segfault, a hang or another exception type.

A case is a seeded random graph: one to three parameters of small random shapes, then random ops
(elementwise, binary with broadcasting, transpose, permute, slices, concat, reshape, reductions,
products, softmax) whose operands are drawn from every node made so far, so nodes get several
consumers; some arguments are deliberately wrong (an axis out of range, shapes that do not match).
Even cases run in the cpu fast mode, odd ones in the portable mode.

Cases run in a worker process (`python -m toyharness.fuzz.graphs --worker ...`) that reports one
JSON line per case: if it dies (a ggml abort) or stops answering, the case is recorded as a crash
or a hang and a new worker continues at the next case. `python -m toyharness.fuzz.graphs --cases N`
runs a campaign and prints the counts (the nox session `fuzz` runs 10,000).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

FAILURES = ("bad_error", "exception", "hang", "crash")
MODES = ("fast", "portable")


# --- building a random graph ------------------------------------------------------------------
def _random_shape(rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(n) for n in rng.integers(1, 5, size=int(rng.integers(1, 4))))


def _pick(rng: np.random.Generator, pool: list):
    # favour recent nodes (deeper graphs) but reuse any (several consumers)
    return pool[int(len(pool) - 1 - min(rng.geometric(0.4) - 1, len(pool) - 1))]


def _like_shape(rng: np.random.Generator, x) -> tuple[int, ...]:
    """A shape that usually broadcasts into x's (some of its trailing axes, some set to 1)."""
    shape = list(x.shape[-int(rng.integers(1, x.ndim + 1)):])
    return tuple(1 if rng.random() < 0.3 else n for n in shape)


def _apply_random_op(rng: np.random.Generator, prog, pool: list, consts: list) -> object:
    """One random op on operands from `pool`; returns the new Tensor (it may raise ShapeError)."""
    x = _pick(rng, pool)
    if x.ndim == 0:              # a sum: ops take it as one value
        x = x.reshape(1)
    op = str(rng.choice([
        "relu", "leaky_relu", "gelu_tanh", "gelu_erf", "silu", "sigmoid", "tanh", "softplus", "abs", "clamp",
        "sqr", "neg", "scale", "add", "mul", "sub", "div", "transpose", "permute", "narrow", "getitem",
        "concat", "reshape", "sum_rows", "softmax", "matmul_t", "bmm_t", "cont", "rms_norm", "sum",
    ]))
    unary = {"relu": lambda t: t.relu(), "leaky_relu": lambda t: t.leaky_relu(0.2),
             "gelu_tanh": lambda t: t.gelu("tanh"), "gelu_erf": lambda t: t.gelu("none"), "silu": lambda t: t.silu(),
             "sigmoid": lambda t: t.sigmoid(), "tanh": lambda t: t.tanh(), "softplus": lambda t: t.softplus(),
             "abs": lambda t: t.abs(), "clamp": lambda t: t.clamp(-0.5, 0.5), "sqr": lambda t: t.sqr(),
             "neg": lambda t: -t, "scale": lambda t: t.scale(0.5), "cont": lambda t: t.cont(),
             "sum_rows": lambda t: t.sum_rows(), "softmax": lambda t: t.softmax(), "sum": lambda t: t.sum(),
             "rms_norm": lambda t: t.rms_norm(1e-5)}
    if op in unary:
        return unary[op](x)
    if op in ("add", "mul", "sub", "div"):
        if rng.random() < 0.6:
            y = _pick(rng, pool)
        else:
            shape = _like_shape(rng, x) if rng.random() < 0.8 else _random_shape(rng)
            y = prog.constant(f"c{len(consts)}", rng.uniform(0.5, 1.5, size=shape).astype(np.float32))
            consts.append(y)
        return {"add": x.__add__, "mul": x.__mul__, "sub": x.__sub__, "div": x.__truediv__}[op](y)
    if op == "transpose":
        return x.transpose()
    if op == "permute":
        axes = [int(a) for a in rng.permutation(x.ndim)]
        if rng.random() < 0.05:
            axes = axes + [x.ndim]          # not a permutation of its axes
        return x.permute(*axes)
    if op == "narrow":
        axis = int(rng.integers(-x.ndim, x.ndim + (1 if rng.random() < 0.05 else 0)))
        size = x.shape[axis] if -x.ndim <= axis < x.ndim else 1
        start = int(rng.integers(0, size))
        length = int(rng.integers(1, size - start + 1 + (1 if rng.random() < 0.05 else 0)))
        return x.narrow(axis, start, length)
    if op == "getitem":
        key = []
        for n in x.shape[: int(rng.integers(1, x.ndim + 1))]:
            kind = rng.random()
            if kind < 0.3:
                key.append(int(rng.integers(-n, n + (1 if rng.random() < 0.05 else 0))))
            elif kind < 0.8:
                a = int(rng.integers(0, n))
                key.append(slice(a, int(rng.integers(a + 1, n + 1))))
            else:
                key.append(Ellipsis if Ellipsis not in key else slice(None))
        return x[tuple(key)]
    if op == "concat":
        axis = int(rng.integers(0, x.ndim))
        if rng.random() < 0.7:
            shape = list(x.shape)
            shape[axis] = int(rng.integers(1, 4))
            others = [x, prog.constant(f"c{len(consts)}", rng.normal(size=shape).astype(np.float32))]
            consts.append(others[-1])
        else:
            others = [_pick(rng, pool)]
        return x.concat(others, axis=axis)
    if op == "reshape":
        n = x.numel()
        dims = [d for d in range(1, n + 1) if n % d == 0]
        a = int(rng.choice(dims))
        shape = (a, n // a) if rng.random() < 0.6 else (a, -1, 1)
        if rng.random() < 0.05:
            shape = (n + 1,)
        return x.reshape(*shape)
    if op == "matmul_t":
        w = _pick(rng, pool)
        if rng.random() < 0.7:
            w = prog.constant(f"c{len(consts)}", rng.normal(size=(int(rng.integers(1, 4)), x.shape[-1]))
                              .astype(np.float32))
            consts.append(w)
        return x.matmul_t(w)
    y = _pick(rng, pool)                                  # bmm_t
    return x.bmm_t(y)


def build_case(engine, seed: int, index: int):
    """(program, trainer) of case `index`: a random graph and its Trainer (may raise)."""
    rng = np.random.default_rng([seed, index])
    prog = engine.program(capacity=4096)
    pool = [prog.param(f"p{i}", rng.normal(size=_random_shape(rng)).astype(np.float32))
            for i in range(int(rng.integers(1, 4)))]
    consts: list = []
    for _ in range(int(rng.integers(2, 9))):
        pool.append(_apply_random_op(rng, prog, pool, consts))
    out = pool[-1]
    if out.ndim == 0:
        out = out.reshape(1)
    if not out.is_contiguous():
        out = out.cont()
    # every parameter reaches the loss (an unused one is refused by name: also a fine outcome,
    # but rarer graphs that train are more useful)
    total = (out * prog.constant("w", rng.normal(size=out.shape).astype(np.float32))).sum()
    for p in pool[: len(prog.params)]:
        if rng.random() < 0.8:
            total = total + p.sqr().sum().scale(1e-3)
    loss = prog.scalar_loss(total)
    return prog, prog.trainer(loss, "bias_corrected")


def run_case(seed: int, index: int) -> tuple[str, str]:
    """(kind, message) of one case in this process: ok, error (the project's one-line error),
    bad_error (a project error on several lines, or a ShapeError without the author's line) or
    exception (another exception type)."""
    from ..adamw import bias_corrected
    from ..engine import get_engine
    from ..errors import ShapeError, ToyharnessError

    engine = get_engine("cpu")
    engine.set_threads(1)      # tiny graphs: one thread, no barriers to spin on (a shared machine)
    engine.set_portable(MODES[index % 2] == "portable")
    prog = None
    try:
        prog, trainer = build_case(engine, seed, index)
        trainer.step({}, bias_corrected(lr=1e-2).hp_for_step(0))
        return "ok", ""
    except ToyharnessError as e:
        text = str(e)
        if "\n" in text or not text:
            return "bad_error", f"{type(e).__name__}: {text}"
        if isinstance(e, ShapeError) and "(at " not in text:
            return "bad_error", f"ShapeError without the author's line: {text}"
        return "error", f"{type(e).__name__}: {text}"
    except Exception as e:   # noqa: BLE001 - any other type is the failure being looked for
        return "exception", f"{type(e).__name__}: {e}"
    finally:
        if prog is not None:
            prog.close()
        engine.set_portable(False)


def worker(seed: int, start: int, stop: int) -> None:
    """Runs cases [start, stop), printing "start I" before and one JSON line after each."""
    for i in range(start, stop):
        print(f"start {i}", flush=True)
        kind, message = run_case(seed, i)
        print(json.dumps({"index": i, "kind": kind, "message": message}), flush=True)


# --- the campaign --------------------------------------------------------------------------------
@dataclass
class GraphStats:
    tried: int = 0
    ok: int = 0
    errors: int = 0
    failures: list[tuple[int, str, str]] = field(default_factory=list)
    messages: Counter = field(default_factory=Counter)

    def add(self, index: int, kind: str, message: str) -> None:
        self.tried += 1
        if kind == "ok":
            self.ok += 1
        elif kind == "error":
            self.errors += 1
            # one message template per op: the figures and the line folded
            template = message.split(" (at ")[0].split()
            self.messages[" ".join(w for w in template if not any(c.isdigit() for c in w))] += 1
        else:
            self.failures.append((index, kind, message))


def _spawn(seed: int, start: int, stop: int) -> subprocess.Popen:
    env = dict(os.environ)
    return subprocess.Popen([sys.executable, "-m", "toyharness.fuzz.graphs", "--worker", str(seed), str(start),
                             str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_graph_campaign(cases: int, seed: int = 0, start: int = 0, time_limit: float = 30.0) -> GraphStats:
    """Cases [start, start + cases) in worker processes; a worker that dies or stays silent past
    `time_limit` seconds on a case records it (crash, hang) and a new one takes the next case."""
    stats = GraphStats()
    i, stop = start, start + cases
    while i < stop:
        proc = _spawn(seed, i, stop)
        running, deadline = None, time.monotonic() + time_limit + 20.0     # the first case imports
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:                      # silent past the limit: a hang
                proc.kill()
                proc.wait()
                at = running if running is not None else i
                stats.add(at, "hang", f"no answer within {time_limit:.0f} s")
                i = at + 1
                break
            line = proc.stdout.readline()
            if not line:                       # the worker died: the case it started crashed it
                proc.wait()
                err = proc.stderr.read().strip().splitlines()
                if running is None:
                    raise RuntimeError(f"the graph fuzz worker did not start: {' '.join(err[-3:])}")
                stats.add(running, "crash", f"exit {proc.returncode}: {' | '.join(err[-2:])}")
                i = running + 1
                break
            if line.startswith("start "):
                running = int(line.split()[1])
                deadline = time.monotonic() + time_limit
                continue
            rec = json.loads(line)
            stats.add(rec["index"], rec["kind"], rec["message"])
            running, i = None, rec["index"] + 1
            if i >= stop:
                proc.wait()
                break
    return stats


def summary(stats: GraphStats) -> str:
    lines = [f"graphs: {stats.tried} tried, {stats.ok} trained a step, {stats.errors} one-line errors, "
             f"{len(stats.failures)} failures"]
    for index, kind, message in stats.failures[:20]:
        lines.append(f"FAIL case {index}: {kind}: {message[:300]}")
    for message, n in stats.messages.most_common(15):
        lines.append(f"  {n:6d}  {message[:150]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toyharness.fuzz.graphs", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1000, help="graphs to try (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first case index (to shard a campaign)")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds per graph before it counts as a hang")
    p.add_argument("--worker", nargs=3, type=int, metavar=("SEED", "START", "STOP"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    stats = run_graph_campaign(args.cases, args.seed, args.start, args.time_limit)
    print(summary(stats))
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
