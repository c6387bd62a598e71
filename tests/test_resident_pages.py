"""Releasing the resident pages of read-only file mappings (what LiteRT leaves after packing)."""
from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from litekv.resident_pages import read_only_mappings, release_file_pages, release_ranges

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


def test_litert_prefill_leaves_no_model_file_pages_resident(tmp_path):
    """Embedding rows a prefill read (and the 64 KB the kernel maps around each) are given back;
    the model keeps giving the reference's logits. Its own bundle: no other test maps that file."""
    from conformance import KV_BUCKETS, MAX_CONTEXT, PREFILL_LENGTHS, checkpoint_dir, reference, relative_error
    from litekv.converters.convert import ConvertOptions, convert
    from litekv.executor import open_executor

    options = ConvertOptions(backend="litert", max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS,
                             kv_buckets=KV_BUCKETS)
    ex, ref = open_executor(convert(checkpoint_dir("llama"), tmp_path / "bundle", options)), reference("llama")
    model_file = ex.model.path
    prompt = np.random.default_rng(2).integers(3, ex.config.vocab_size, 13)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.step([int(prompt[0])], ours)
    ref.step([int(prompt[0])], theirs)
    assert resident_kb(model_file) > 0  # a decode step reads its row from the mapping
    ex.prefill(prompt[1:-1], ours)
    ref.prefill(prompt[1:-1], theirs)
    assert resident_kb(model_file) == 0
    assert relative_error(ex.step([int(prompt[-1])], ours), ref.step([int(prompt[-1])], theirs)) < 1e-4


def test_a_range_that_no_longer_maps_the_file_is_left_alone(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(SIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        ranges = [(start, end) for start, end, _ in read_only_mappings(path)]
        assert ranges
        np.frombuffer(mapped, np.uint8).sum()
    anonymous = mmap.mmap(-1, SIZE)  # may land where the file was mapped
    anonymous[:] = b"\x07" * SIZE
    release_ranges(path, ranges)
    assert anonymous[:4096] == b"\x07" * 4096 and anonymous[-1] == 7
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(SIZE))
    release_ranges(other, ranges)  # the wrong file: nothing happens either
    assert anonymous[SIZE // 2] == 7
    anonymous.close()
