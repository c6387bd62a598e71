"""LiteRT keeps the KV memory it has run on alive (its compiled model may still read it), but caches
made outside the executor (KVCache.deep_copy, KVCache.allocate + load, as Session.clone and saved
sessions make them) reuse that memory: cloning and dropping a cache again and again holds no more
than the caches alive at once, and the reused memory gives the same steps."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from conformance import executor
from kv_formats import kv_format_bundle
from litekv.executor import open_executor
from litekv.kv_cache import KVCache
from litekv.native_attention import available as kernel_available

ROUNDS = 12
PROMPT = 13  # ends inside a block of 8 slots: keys in blocks move whole blocks


def litert(kv_cache: str):
    if kv_cache == "fp32":
        return executor("llama", "litert")
    return open_executor(kv_format_bundle("llama", "litert", kv_cache))


def copied(base: KVCache, how: str) -> KVCache:
    if how == "deep_copy":
        return base.deep_copy()
    cache = KVCache.allocate(base.num_layers, base.batch_size, base.num_kv_heads, base.head_dim, base.num_entries,
                             base.layout, base.dtype, base.row_scales, base.huge_pages)
    cache.load(base.serialize())
    return cache


def free_sets(ex) -> int:
    return sum(len(free) for free in ex._pool._free.values())


def assert_bounded(ex, one_round) -> None:
    """After a first round, further rounds grow neither the dead caches' memory the pool keeps for
    LiteRT nor the bytes it holds in all."""
    one_round()
    free = free_sets(ex)
    for _ in range(ROUNDS // 2):
        one_round()
    assert free_sets(ex) == free, f"dead caches kept for LiteRT grew from {free} to {free_sets(ex)}"
    held = ex._pool.held_bytes
    for _ in range(ROUNDS // 2):
        one_round()
    assert (free_sets(ex), ex._pool.held_bytes) == (free, held)


@pytest.mark.parametrize("how", ["deep_copy", "load"])
@pytest.mark.parametrize("kv_cache", ["fp32", pytest.param("int8", marks=pytest.mark.skipif(
    not kernel_available(), reason="keys in blocks need litekv's kernel")), "int8-row"])
def test_copies_run_and_dropped_reuse_the_pooled_memory(kv_cache, how):
    ex = litert(kv_cache)
    base = ex.create_kv_cache()
    ex.prefill(np.arange(3, 3 + PROMPT), base)
    expected = ex.step([7], base.deep_copy())

    def one_round():
        copy = copied(base, how)
        np.testing.assert_allclose(ex.step([7], copy), expected, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(copy.key_cache(0)[:, :PROMPT], base.key_cache(0))
        del copy
        gc.collect()

    assert_bounded(ex, one_round)


def test_a_session_clone_pattern_keeps_the_pool_at_the_caches_alive():
    """Session.clone makes a cache with create_kv_cache, drops it for a deep copy, runs the copy."""
    ex = litert("fp32")
    base = ex.create_kv_cache()
    ex.prefill(np.arange(3, 3 + PROMPT), base)

    def one_round():
        twin = ex.create_kv_cache()
        twin = base.deep_copy()
        ex.sample_tokens(3, [7], twin)
        del twin
        gc.collect()

    assert_bounded(ex, one_round)
