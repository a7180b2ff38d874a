"""What ggml's buffers take and what the backend has free: a graph's compute buffer measured by
ggml's allocator, the free memory of a device (or the RAM available to this process), and the one
line an allocation the backend refused becomes (exit 1). The memory plan (memory_plan.py) and
Program's allocations both use these."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from .._ffi import ffi, lib, log_level
from ..errors import OutOfMemory

GiB = 1 << 30
MiB = 1 << 20


def fmt_bytes(n: float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if abs(n) >= MiB else f"{n / 1024:.1f} KiB"


def free_memory(engine) -> tuple[int, str]:
    """(bytes, what): the driver's free memory of a device, else the RAM available to this process
    (MemAvailable, or the cgroup's limit less its use where that is smaller)."""
    if not engine.is_cpu:
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(lib.ggml_backend_get_device(engine.handle), free, total)
        return int(free[0]), f"{engine.backend}: the driver's free memory"
    avail = _mem_available()
    what = "cpu: available RAM"
    cg = _cgroup_room()
    if cg is not None and cg < avail:
        avail, what = cg, "cpu: the cgroup's memory limit less its use"
    return avail, what


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - used)


@contextlib.contextmanager
def ggml_quiet() -> Iterator[None]:
    """No ggml log lines within: around an allocation whose failure `allocation_failed` reports in
    one line of its own (ggml would add two or three of its own first)."""
    lib.th_set_log_level(1 << 20)
    try:
        yield
    finally:
        lib.th_set_log_level(log_level())


def graph_buffer_bytes(engine, graph) -> int:
    """The compute buffer ggml's allocator needs for `graph` (measured, nothing allocated)."""
    galloc = lib.ggml_gallocr_new(engine.buffer_type)
    sizes = ffi.new("size_t[1]")
    try:
        lib.ggml_gallocr_reserve_n_size(galloc, graph, ffi.NULL, ffi.NULL, sizes)
    finally:
        lib.ggml_gallocr_free(galloc)
    return int(sizes[0])


def allocation_failed(engine, buffer: str, nbytes: int) -> OutOfMemory:
    """The one-line error for an allocation the backend refused (exit 1)."""
    free, what = free_memory(engine)
    return OutOfMemory(f"{engine.backend}: could not allocate {buffer}: {fmt_bytes(nbytes)} needed, "
                       f"{fmt_bytes(free)} free ({what.split(': ', 1)[-1]})")
