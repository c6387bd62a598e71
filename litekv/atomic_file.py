"""Atomic, durable file writes: readers see the old content or the new one, never a torn file, and
once a write returns, a crash keeps the new one."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a file so readers see the old or the new content, never a torn one, and after a crash
    the new one once this returns (the data, then the rename, are flushed)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except FileNotFoundError as e:  # say which file, not the temporary name mkstemp picked
        raise FileNotFoundError(errno.ENOENT, f"cannot write {path}: its directory {path.parent} does not exist; "
                                "create it first") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # POSIX: the rename lives in the directory's entries; elsewhere the file
        fsync_path(path.parent)     # system orders it


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
