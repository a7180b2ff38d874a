"""Atomic file writing: a temporary name in the same folder, then one rename.

A run killed at any moment, or a disk that fills up, never leaves a half-written file under a
final name, and the previous file of that name (the last good checkpoint) stays intact. A write
that fails for want of space, quota or permission is one `WriteError` naming the file and the
cause (exit 1), not a traceback from whichever library was writing.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import WriteError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; write it whole inside the block; it becomes `path`
    on success. On any failure the temporary file is removed and an OSError becomes WriteError."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise WriteError(path, exc) from None
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        cause = failure_cause(tmp, exc)
        tmp.unlink(missing_ok=True)
        raise WriteError(path, cause) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def failure_cause(tmp: Path, exc: OSError) -> str:
    """What went wrong, in the system's words. Some writers (numpy's tofile, used by gguf's
    writer) report a short write with no errno ("65536 requested and 58752 written"); a probe
    write to the same file then shows the cause (no space, quota, file size limit)."""
    if exc.errno:
        return exc.strerror or str(exc)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND)
    except OSError as probe:
        return probe.strerror or str(exc)
    try:
        os.write(fd, b"\0" * 65536)
    except OSError as probe:
        return probe.strerror or str(exc)
    finally:
        os.close(fd)
    return str(exc)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` atomically."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    return path
