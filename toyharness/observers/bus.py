"""Delivering observer hooks off the training loop.

The loop only puts an event on a queue (microseconds); one thread of the bus calls each observer
in turn, in the order the events happened. An observer that raises is reported in one line naming
it and dropped: the others, and the run, go on, and the run's losses and exit code never depend on
an observer. Each observer's time in its hooks is measured; at the end of the run the bus waits a
bounded time for what is still queued and reports, in one line each, an observer that did not
finish in time or that was slow (its hooks took a noticeable share of the run's time).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..switches import switch

WAIT_ENV = "TOYHARNESS_OBSERVER_WAIT_S"
DEFAULT_WAIT_S = 30.0
# An observer is reported as slow when its hooks took at least this long in all, and at least this
# share of the time the bus was open: below that, nobody would notice it.
SLOW_MIN_S = 0.5
SLOW_SHARE = 0.05


def wait_limit() -> float:
    """Seconds the end of a run waits for queued observer events (TOYHARNESS_OBSERVER_WAIT_S)."""
    return float(switch(WAIT_ENV))


@dataclass
class _Slot:
    name: str
    pm: Any
    failed: bool = False
    calls: int = 0
    busy_s: float = 0.0
    slowest: tuple[str, float] = ("", 0.0)
    per_hook: dict[str, float] = field(default_factory=dict)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ObserverBus:
    """The observers of one run or sweep: `emit` queues a hook call, `close` ends delivery."""

    def __init__(self, observers: list[tuple[str, Any]], report: Callable[[str], None] = _stderr_line,
                 wait_s: float | None = None):
        self.slots = [_Slot(name, pm) for name, pm in observers]
        self.report = report
        self.wait_s = wait_s if wait_s is not None else wait_limit() if self.slots else DEFAULT_WAIT_S
        self.current: str | None = None           # the observer being called now
        self._queue: queue.Queue = queue.Queue()
        self._t0 = time.perf_counter()
        self._closed = False
        self._thread = None
        if self.slots:
            self._thread = threading.Thread(target=self._deliver, name="toyharness-observers", daemon=True)
            self._thread.start()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def emit(self, hook: str, **kwargs: Any) -> None:
        """Queue `hook(**kwargs)` for every observer; returns at once. Pass values, not objects
        the caller goes on changing (the call happens later)."""
        if self._thread is not None and not self._closed:
            self._queue.put((hook, kwargs))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` s, default the bus's limit) until every event queued so far was
        delivered; False if time ran out."""
        if self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(("", done))
        return done.wait(self.wait_s if timeout is None else timeout)

    def close(self) -> None:
        """Deliver what is queued (waiting at most the bus's limit), stop the thread, and report
        an observer that was still busy or that was slow."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._queue.put(None)
        t_wait = time.perf_counter()
        self._thread.join(self.wait_s)
        waited = time.perf_counter() - t_wait
        if self._thread.is_alive():
            left = self._queue.qsize()
            self.report(f"toyharness: observer {self.current!r} was still busy {waited:.1f} s after the run's end "
                        f"({left} events not delivered; {WAIT_ENV} sets the wait); it was left behind")
        elapsed = time.perf_counter() - self._t0
        for s in self.slots:
            if s.busy_s >= SLOW_MIN_S and s.busy_s >= SLOW_SHARE * elapsed:
                hook, worst = s.slowest
                self.report(f"toyharness: observer {s.name!r} is slow: {s.busy_s:.2f} s in {s.calls} calls over a "
                            f"{elapsed:.2f} s run (slowest: {hook} {worst * 1000:.0f} ms); the step loop did not "
                            f"wait for it" + (f", the run's end waited {waited:.2f} s" if waited >= 0.1 else ""))

    def timings(self) -> dict[str, dict[str, Any]]:
        """Per observer: calls, seconds in its hooks (in all and per hook), whether it failed."""
        return {s.name: {"calls": s.calls, "busy_s": s.busy_s, "per_hook": dict(s.per_hook), "failed": s.failed}
                for s in self.slots}

    def _deliver(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            hook, kwargs = item
            if hook == "":                  # a drain marker
                kwargs.set()
                continue
            for s in self.slots:
                caller = getattr(s.pm.hook, hook)
                if s.failed or not caller.get_hookimpls():
                    continue
                self.current = s.name
                t0 = time.perf_counter()
                try:
                    caller(**kwargs)
                except BaseException as exc:    # an observer's SystemExit must not end delivery either
                    s.failed = True
                    msg = " ".join(str(exc).split())[:200]
                    self.report(f"toyharness: observer {s.name!r} failed in {hook}: {type(exc).__name__}"
                                f"{': ' + msg if msg else ''}; it gets no further events (the run goes on)")
                finally:
                    dt = time.perf_counter() - t0
                    s.calls += 1
                    s.busy_s += dt
                    s.per_hook[hook] = s.per_hook.get(hook, 0.0) + dt
                    if dt > s.slowest[1]:
                        s.slowest = (hook, dt)
                    self.current = None
