"""Atomic writes are durable too: the data and then the rename reach the disk before they return."""
from __future__ import annotations

import os
import stat

import pytest

from litekv.atomic_file import write_atomic


@pytest.fixture
def synced(monkeypatch):
    """What each os.fsync flushed, in order: ("file", size) or ("dir", names in it)."""
    seen, real_fsync = [], os.fsync

    def fsync(fd):
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            seen.append(("dir", sorted(os.listdir(fd))))
        else:
            seen.append(("file", info.st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.mark.skipif(not hasattr(os, "O_DIRECTORY"), reason="directories are synced on POSIX")
def test_write_atomic_flushes_the_data_then_the_directory_holding_the_new_name(tmp_path, synced):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    write_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert synced[0] == ("file", len(b"new contents"))
    # the directory is flushed after the rename: it lists the target and no temporary file
    assert synced[-1] == ("dir", ["state.bin"])


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.bin"]
