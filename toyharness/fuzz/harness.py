"""Running fuzz cases: a worker process reads each case in turn; the parent watches it.

The worker runs readers in-process for speed, each case under a time limit (an interval timer
that raises inside Python code) and with its allocations traced (tracemalloc sees numpy's
buffers): a case whose reader allocates more than `ALLOC_BASE + ALLOC_PER_BYTE * file size`
allocated by a number from the file, not by the file. The worker's address space is capped
(RLIMIT_AS) so such an allocation fails rather than swaps. The parent reads one line per case;
if the worker dies (SIGABRT from a ggml assert, SIGSEGV) or stops answering (a hang in C code),
the parent keeps the case's bytes, records the crash or hang, and starts a new worker at the next
case. So every case runs where an abort would be caught.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .mutate import mutate_bytes

ALLOC_BASE = 64 << 20          # what reading any small file may take (numpy, the engine's tables)
ALLOC_PER_BYTE = 64            # and per byte of the file: decoded arrays are a few times their bytes
ADDRESS_SPACE_HEADROOM = 4 << 30
FAILURES = ("bad_error", "exception", "hang", "crash", "alloc")


@dataclass
class Outcome:
    reader: str
    index: int              # case number (or -1 for a corpus file)
    kind: str               # ok, error, or one of FAILURES
    message: str = ""
    input: str = ""         # where the failing input was kept

    @property
    def failed(self) -> bool:
        return self.kind in FAILURES


@dataclass
class Stats:
    """Counts for one reader: inputs tried, clean reads, project errors, failures, and the
    distinct error messages (numbers and the file's name folded, so one message template with
    different figures counts once)."""

    reader: str
    tried: int = 0
    ok: int = 0
    errors: int = 0
    failures: list[Outcome] = field(default_factory=list)
    messages: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, o: Outcome) -> None:
        self.tried += 1
        if o.kind == "ok":
            self.ok += 1
        elif o.kind == "error":
            self.errors += 1
            self.messages[normalise(o.message)] += 1
        else:
            self.failures.append(o)


def normalise(message: str) -> str:
    """An error message with the case file's path and every number folded."""
    message = re.sub(r"\S*case\.[a-z]+", "<file>", message)
    message = re.sub(r"(\\x[0-9a-f]{2}|[^\x20-\x7e])+", "?", message)    # damaged bytes quoted in a message
    return re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", message)


def make_case(reader, seeds: list[bytes], seed: int, index: int) -> bytes:
    """Case `index` of `reader`: the seeds unchanged first, then 1-3 seeded mutations of one."""
    if index < len(seeds):
        return seeds[index]
    rng = np.random.default_rng([seed, zlib.crc32(reader.name.encode()), index])
    base = seeds[int(rng.integers(len(seeds)))]
    mutate = reader.mutator(base)
    data = base
    for _ in range(1 + int(rng.random() < 0.3) + int(rng.random() < 0.1)):
        try:
            data = mutate(data, rng)
        except Exception:   # a structure-aware mutator given input an earlier mutation broke: bytes then
            data = mutate_bytes(data, rng)
    return data


class CaseTimeout(BaseException):
    """Raised by the interval timer in a case that runs too long (a BaseException so a reader's
    `except Exception` cannot swallow it)."""


def _on_alarm(signum, frame):
    raise CaseTimeout()


def check_one(reader, path: Path, time_limit: float | None) -> Outcome:
    """Read `path` with `reader` in this process and classify what happened (with no timer of
    ours where `time_limit` is None)."""
    from ..errors import ToyharnessError

    size = path.stat().st_size
    cap = ALLOC_BASE + ALLOC_PER_BYTE * size
    tracemalloc.start()
    tracemalloc.reset_peak()
    if time_limit:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, time_limit)
    kind, message = "ok", ""
    try:
        reader.read(path)
    except CaseTimeout:
        kind, message = "hang", f"over {time_limit} s"
    except ToyharnessError as exc:
        message = str(exc)
        if "\n" in message.strip():
            kind = "bad_error"
            message = "several lines: " + message
        elif path.name not in message:
            kind = "bad_error"
            message = "does not name the file: " + message
        else:
            kind = "error"
    except Exception as exc:   # the contract: nothing but the project's own errors
        kind, message = "exception", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    finally:
        if time_limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if kind in ("ok", "error") and peak > cap:
        kind, message = "alloc", f"allocated {peak} bytes reading a {size}-byte file (cap {cap}): {message}"
    return Outcome(reader.name, -1, kind, message)


# --- the worker -------------------------------------------------------------------------------
def _cap_address_space() -> None:
    with open("/proc/self/status") as fh:
        vm = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:")), 0)
    if vm:
        limit = vm + ADDRESS_SPACE_HEADROOM
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def load_reader_files(files) -> None:
    """Run Python files that register more readers (a plugin's, or a test's)."""
    import runpy

    for f in files:
        runpy.run_path(str(f), run_name=f"toyharness_fuzz_extra_{Path(f).stem}")


def worker(plan: dict) -> None:
    """Run `plan` ({"seed", "workdir", "time_limit", "reader_files", "tasks": [[reader, start, stop]
    or [reader, "file", path]]}), one JSON line per case on the original stdout."""
    from .readers import READERS

    load_reader_files(plan.get("reader_files", []))

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)               # whatever a reader prints goes to stderr, not into the protocol
    workdir = Path(plan["workdir"])
    seeds_dir = workdir / "seeds"
    seeds_dir.mkdir(exist_ok=True)
    seeds: dict[str, list[bytes]] = {}
    # Build everything the readers use (engine, recipes, seeds) before capping memory.
    for task in plan["tasks"]:
        r = READERS[task[0]]
        if task[0] not in seeds:
            seeds[task[0]] = r.make_seeds(seeds_dir) if r.make_seeds else []
            for data in seeds[task[0]][:1]:     # warm the reader's imports and engine once
                case = workdir / f"warm{r.suffix}"
                case.write_bytes(data)
                check_one(r, case, 60.0)
    _cap_address_space()
    for task in plan["tasks"]:
        r = READERS[task[0]]
        case = workdir / f"case{r.suffix}"
        if task[1] == "file":
            items = [(-1, lambda p=task[2]: Path(p).read_bytes())]
        else:
            items = [(i, lambda i=i, r=r: make_case(r, seeds[r.name], plan["seed"], i))
                     for i in range(task[1], task[2])]
        for index, make in items:
            case.write_bytes(make())
            proto.write(json.dumps({"begin": index, "reader": r.name}) + "\n")
            t0 = time.perf_counter()
            o = check_one(r, case, plan["time_limit"])
            if o.failed:        # kept now: the parent reads the line while this process moves on
                shutil.copyfile(case, workdir / f"failed-{r.name}-{index}{r.suffix}")
            proto.write(json.dumps({"end": index, "reader": r.name, "kind": o.kind, "message": o.message,
                                    "s": time.perf_counter() - t0}) + "\n")
    proto.write(json.dumps({"done": True}) + "\n")


# --- the parent -------------------------------------------------------------------------------
class _Worker:
    def __init__(self, plan: dict, log: Path):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "toyharness.fuzz._worker", json.dumps(plan)],
                                     stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL)
        self.buf = b""

    def line(self, timeout: float) -> dict | None:
        """The next protocol line; {"eof": True} if the worker exited, None if it said nothing for
        `timeout` s."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return {"eof": True}
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait()
        self.proc.stdout.close()
        self.log.close()
        return rc


def _keep(case: Path, reader: str, out_dir: Path | None) -> str:
    """Copy a failing input into `out_dir/<reader>/` (named by its hash) and say where."""
    if out_dir is None or not case.exists():
        return str(case)
    data = case.read_bytes()
    dest = out_dir / reader / (hashlib.sha1(data).hexdigest()[:16] + Path(case.name).suffix)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return str(dest)


def _run_tasks(tasks: list[list], seed: int, time_limit: float, keep_failures: Path | None,
               stats: dict[str, Stats], reader_files: list[str] = ()) -> None:
    from .readers import READERS

    with tempfile.TemporaryDirectory(prefix="toyharness-fuzz-") as tmp:
        workdir = Path(tmp)
        pending = [list(t) for t in tasks]
        while pending:
            plan = {"seed": seed, "workdir": str(workdir), "time_limit": time_limit, "tasks": pending,
                    "reader_files": [str(f) for f in reader_files]}
            w = _Worker(plan, workdir / "worker.log")
            current: dict | None = None
            started = time.monotonic()
            timeout = 600.0            # the first line waits for imports, seeds and the engine
            while True:
                msg = w.line(timeout)
                if msg is None or "done" in msg or "eof" in msg:
                    break
                timeout = time_limit + 30.0
                if "begin" in msg:
                    current = msg
                    continue
                stats.setdefault(msg["reader"], Stats(msg["reader"])).add(
                    Outcome(msg["reader"], msg["end"], msg["kind"], msg["message"]))
                stats[msg["reader"]].seconds += msg["s"]
                if msg["kind"] in FAILURES:
                    suffix = READERS[msg["reader"]].suffix
                    stats[msg["reader"]].failures[-1].input = _keep(
                        workdir / f"failed-{msg['reader']}-{msg['end']}{suffix}", msg["reader"], keep_failures)
                _advance(pending, msg)
                current = None
            hung = msg is None
            rc = w.stop()
            if msg is not None and "done" in msg:
                break
            if current is None:
                tail = (workdir / "worker.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the fuzz worker stopped outside a case (exit {rc}) after "
                                   f"{time.monotonic() - started:.0f} s:\n{tail}")
            name = current["reader"]
            kind = "hang" if hung else "crash"
            how = f"no answer in {time_limit + 30:.0f} s" if hung else \
                f"worker died: {'signal ' + signal.Signals(-rc).name if rc < 0 else f'exit {rc}'}"
            o = Outcome(name, current["begin"], kind, how)
            o.input = _keep(workdir / f"case{READERS[name].suffix}", name, keep_failures)
            stats.setdefault(name, Stats(name)).add(o)
            _advance(pending, {"reader": name, "end": current["begin"]})


def _advance(pending: list[list], msg: dict) -> None:
    """Drop the case just finished from the front of the plan."""
    task = pending[0]
    assert task[0] == msg["reader"], (task, msg)
    if task[1] == "file":
        pending.pop(0)
    else:
        task[1] = msg["end"] + 1
        if task[1] >= task[2]:
            pending.pop(0)


def run_campaign(readers: list[str] | None = None, cases: int = 200, seed: int = 0, start: int = 0,
                 time_limit: float = 10.0, keep_failures: Path | None = None,
                 reader_files: list[str | Path] = ()) -> dict[str, Stats]:
    """`cases` seeded cases (from index `start`) for each reader (default: every registered one);
    stats per reader. `reader_files` are Python files registering more readers."""
    from .readers import READERS

    load_reader_files(reader_files)

    names = readers or list(READERS)
    unknown = [n for n in names if n not in READERS]
    if unknown:
        raise KeyError(f"unknown fuzz readers {unknown}; registered: {', '.join(READERS)}")
    stats: dict[str, Stats] = {n: Stats(n) for n in names}
    _run_tasks([[n, start, start + cases] for n in names], seed, time_limit, keep_failures, stats, reader_files)
    return stats


def replay_corpus(corpus: Path, time_limit: float = 10.0) -> dict[str, Stats]:
    """Every file under `corpus/<reader>/` through its reader."""
    from .readers import READERS

    tasks = [[d.name, "file", str(p)] for d in sorted(corpus.iterdir()) if d.is_dir() and d.name in READERS
             for p in sorted(d.iterdir()) if p.is_file()]
    stats: dict[str, Stats] = {}
    if tasks:
        _run_tasks(tasks, 0, time_limit, None, stats)
    return stats


def table(stats: dict[str, Stats]) -> str:
    """The per-reader summary: inputs tried, clean reads, project errors, crashes (and hangs),
    other failures, distinct error messages, seconds spent reading."""
    rows = [f"{'reader':<14}{'tried':>8}{'clean':>8}{'errors':>8}{'crash/hang':>11}{'other fail':>11}"
            f"{'distinct msgs':>14}{'s':>7}"]
    for s in stats.values():
        crashes = sum(o.kind in ("crash", "hang") for o in s.failures)
        rows.append(f"{s.reader:<14}{s.tried:>8}{s.ok:>8}{s.errors:>8}{crashes:>11}{len(s.failures) - crashes:>11}"
                    f"{len(s.messages):>14}{s.seconds:>7.1f}")
    total = sum(s.tried for s in stats.values())
    bad = sum(len(s.failures) for s in stats.values())
    rows.append(f"{'total':<14}{total:>8}{'':>8}{'':>8}{'':>11}{bad:>11}  (failures of any kind)")
    return "\n".join(rows)


def copy_to_corpus(stats: dict[str, Stats], corpus: Path) -> list[Path]:
    """Keep every failing input under `corpus/<reader>/` for replay."""
    out = []
    for s in stats.values():
        for o in s.failures:
            src = Path(o.input)
            if src.is_file():
                dest = corpus / s.reader / src.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest)
                out.append(dest)
    return out

