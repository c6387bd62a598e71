"""Where a KV cache's memory comes from: one map of 2 MB pages for a cache that fills one, or 4 KB
pages that become resident only as tokens reach them."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from litekv.kv_cache import HUGE_PAGE_BYTES, KVCache

# SmolLM2's int8 cache at 4,096 slots: 30 layers of 786 KB keys and as many values
SMOLLM2_INT8 = dict(num_layers=30, batch_size=1, num_kv_heads=3, head_dim=64, capacity=4096, layout="BSHD",
                    dtype="int8")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                               or "[never]" in THP.read_text(), reason="no transparent huge pages here")


def smaps_kb(field: str) -> int:
    """This process's total of an smaps field, in KB."""
    for line in Path(f"/proc/{os.getpid()}/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in smaps_rollup")


def buffers(cache: KVCache) -> list[np.ndarray]:
    return cache._s.keys + cache._s.values


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are Linux's")
def test_a_large_cache_takes_its_buffers_from_one_map_on_a_huge_page_boundary():
    cache = KVCache.allocate(**SMOLLM2_INT8)
    assert cache.huge_pages
    arrays = buffers(cache)
    starts = [a.ctypes.data for a in arrays]
    assert starts[0] % HUGE_PAGE_BYTES == 0
    assert all(s % 4096 == 0 for s in starts)  # LiteRT binds 64-byte aligned memory zero-copy
    assert all(b - a == arrays[0].nbytes for a, b in zip(starts, starts[1:]))  # packed, disjoint
    assert all(not a.any() for a in arrays)
    arrays[3][0, :5] = 7  # one buffer's rows are its own
    assert arrays[3].sum() == 7 * 5 * 3 * 64 and not arrays[2].any() and not arrays[4].any()


@needs_thp
def test_a_large_cache_is_backed_by_huge_pages_once_written():
    before = smaps_kb("AnonHugePages")
    cache = KVCache.allocate(**SMOLLM2_INT8)
    for array in buffers(cache):
        array[0, 0] = 1  # the first token of every layer
    assert smaps_kb("AnonHugePages") - before >= 32 * 1024  # 47 MB of buffers, at least 16 huge pages
    assert cache.deep_copy().huge_pages


@needs_thp
def test_asked_for_4kb_pages_a_cache_becomes_resident_only_where_tokens_reach():
    before_huge, before_rss = smaps_kb("AnonHugePages"), smaps_kb("Rss")
    cache = KVCache.allocate(**SMOLLM2_INT8, huge_pages=False)
    assert not cache.huge_pages
    for array in buffers(cache):
        array[0, :10] = 1  # 10 tokens: one 4 KB page of each of the 60 buffers
    assert smaps_kb("AnonHugePages") == before_huge
    assert smaps_kb("Rss") - before_rss < 2 * 1024  # 240 KB of pages, against 47 MB on huge pages
    copy = cache.deep_copy()
    assert not copy.huge_pages and copy.num_tokens == cache.num_tokens


def test_a_cache_smaller_than_a_huge_page_keeps_4kb_pages():
    cache = KVCache.allocate(2, 1, 2, 16, 64, "BSHD", "float32")  # 32 KB
    assert not cache.huge_pages and all(a.ctypes.data % 64 == 0 for a in buffers(cache))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are Linux's")
def test_a_huge_page_cache_copies_serializes_and_loads_like_any_other():
    cache = KVCache.allocate(**SMOLLM2_INT8)
    rng = np.random.default_rng(0)
    for array in buffers(cache):
        array[0, :20] = rng.integers(-127, 128, array[0, :20].shape)
    cache.set_num_tokens(20)
    copy, loaded = cache.deep_copy(), KVCache.allocate(**SMOLLM2_INT8, huge_pages=False)
    loaded.load(cache.serialize())
    for other in (copy, loaded):
        for layer in range(30):
            np.testing.assert_array_equal(other.key_cache(layer), cache.key_cache(layer))
            np.testing.assert_array_equal(other.value_cache(layer), cache.value_cache(layer))
