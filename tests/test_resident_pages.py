"""Releasing the resident pages of read-only file mappings (what LiteRT leaves after packing)."""
from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from litekv.resident_pages import read_only_mappings, release_file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

SIZE = 8 << 20


def resident_kb(path) -> int:
    return sum(kb for _, _, kb in read_only_mappings(path))


def test_read_only_mapping_is_released_and_still_reads_the_same(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # touch every page
        assert resident_kb(path) >= SIZE // 1024 * 0.9
        assert release_file_pages(path) >= SIZE // 1024 * 0.9
        assert resident_kb(path) < SIZE // 1024 * 0.1
        np.testing.assert_array_equal(view, data)  # faults back in, unchanged
        del view


def test_writable_mapping_is_left_alone(tmp_path):
    path = tmp_path / "scratch.bin"
    path.write_bytes(bytes(SIZE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        view[::4096] = 7  # private dirty pages: dropping them would lose these writes
        assert read_only_mappings(path) == []
        assert release_file_pages(path) == 0
        assert np.all(view[::4096] == 7)
        del view
