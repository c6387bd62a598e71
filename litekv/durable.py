"""Files that other processes may read or write at the same time: flushed renames and advisory locks.

The locks are fcntl.flock locks: the kernel drops them when their holder dies, so a killed process
never leaves one held.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from litekv.atomic_file import fsync_path


def replace_durably(source: Path, target: Path) -> None:
    """Rename `source` to `target` so that after a crash the target is either the old one or all of
    `source`: its data is flushed before the rename, and the rename itself after."""
    fsync_path(source)
    os.replace(source, target)
    fsync_path(target.parent)


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an advisory lock on the file `path` (made if missing), waiting while another holds it.
    The file is removed on release, so none lingers beside what it guards."""
    fd = _acquire(path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a waiter sees it was removed and locks a new one
        os.close(fd)


def _acquire(path: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = _is_linked_as(fd, path)
        except BaseException:
            os.close(fd)
            raise
        if current:
            return fd
        os.close(fd)  # its holder removed it after we opened it: lock the file now at `path`


def _is_linked_as(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def hold_directory(path: Path) -> int:
    """Mark the directory `path` as in use until the returned descriptor is closed; BlockingIOError
    if a live process holds it already."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def directory_in_use(path: Path) -> bool:
    """Whether a live process holds the directory `path` (see hold_directory). A directory that
    cannot be checked counts as in use: callers only delete what is not."""
    try:
        os.close(hold_directory(path))
    except OSError:
        return True
    return False
