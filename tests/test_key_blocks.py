"""int8 keys stored in blocks of slots (native_attention.block_keys, attention_common.h's
key_block_offset): the AVX2 integer path scores them in place, every other path reads them as rows
rewritten into scratch. Either way a call gives what the same keys as rows give."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from litekv import native_attention
from test_decode_attention_kernel import (MASKED, avx2_path, avx2_switch, cache_case, head_major_attention,
                                          numpy_attention, quantize_rows)

pytestmark = pytest.mark.skipif(not native_attention.available(),
                                reason="litekv's decode-attention kernel is not built (no C compiler at install)")

BLOCK = native_attention.KEY_BLOCK

SHAPES = [  # heads, kv_heads, head_dim, slots (a multiple of the block), live, window
    (9, 3, 64, 2048, 2048, None),   # SmolLM2 at 2,048 slots: two chunks of whole blocks
    (9, 3, 64, 512, 301, None),     # the span ends inside a block
    (4, 1, 256, 208, 190, 77),      # a group of 4 (2 + 2 heads), a window: both ends inside blocks
    (8, 2, 128, 456, 433, None),    # two chunks
    (10, 2, 64, 104, 98, 31),       # a group of 5 (3 + 2)
    (6, 6, 64, 80, 77, None),       # no grouping
    (2, 2, 128, 16, 13, None),      # fewer live slots than two blocks
    (4, 4, 32, 48, 37, None),       # head_dim 32
    (7, 1, 96, 392, 389, 300),      # a group of 7 (3 + 2 + 2), head_dim 96
]


def blocked(keys: np.ndarray, kv_heads: int, head_dim: int) -> np.ndarray:
    """Keys [S, KVH*D] in block order, as the kernel takes them."""
    slots = keys.shape[0]
    return native_attention.block_keys(keys.reshape(slots, kv_heads, head_dim)).reshape(slots, -1)


def test_a_block_holds_each_dimension_pair_of_its_slots_side_by_side():
    """Slot s, KV head h, dimension c of a [S, KVH*D] cache at (s // 8) * 8 * KVH * D + h * 8 * D +
    (c // 2) * 16 + (s % 8) * 2 + c % 2: the offset the C kernels compute."""
    slots, kv_heads, head_dim = 24, 3, 8
    rows = np.arange(slots * kv_heads * head_dim).astype(np.int8).reshape(slots, kv_heads, head_dim)
    flat = native_attention.block_keys(rows).reshape(-1)
    for s in range(slots):
        for h in range(kv_heads):
            for c in range(head_dim):
                at = (s // BLOCK) * BLOCK * kv_heads * head_dim + h * BLOCK * head_dim + (c // 2) * 2 * BLOCK + \
                    (s % BLOCK) * 2 + c % 2
                assert flat[at] == rows[s, h, c]


@pytest.mark.parametrize("shape", [(16, 3, 64), (2, 40, 1, 32), (1, 8, 2, 2)])
def test_unblocking_gives_the_rows_back(shape):
    rows = np.random.default_rng(0).integers(-127, 128, shape, dtype=np.int8)
    blocks = native_attention.block_keys(rows)
    assert blocks.shape == rows.shape and not np.array_equal(blocks, rows)
    np.testing.assert_array_equal(native_attention.unblock_keys(blocks), rows)


PATHS = {  # name -> (int8_dot, litekv_decode_avx2_allow): which code reads the blocks
    "avx2 integer": (True, 1),  # scores the blocks in place
    "avx2 widened": (True, 2),  # rows rewritten into scratch, codes widened to floats
    "portable": (True, 0),
    "no integer dot products": (False, 1),
}


@pytest.fixture(params=list(PATHS), ids=list(PATHS))
def path(request):
    int8_dot, allow = PATHS[request.param]
    switch = avx2_switch()
    if request.param.startswith("avx2") and not (switch and switch(1)):
        pytest.skip("no AVX2 path on this CPU (the other paths read the blocks as rows)")
    if switch:
        switch(allow)
    yield request.param, int8_dot
    if switch:
        switch(1)


@pytest.mark.parametrize("cache", ["int8", "int8_rows"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", SHAPES)
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_blocked_keys_attend_as_the_same_keys_in_rows(path, cache, heads, kv_heads, head_dim, slots, live, window,
                                                      threads):
    """Against the row layout on the same path: the same result where the blocks are rewritten as
    rows, and the same integer sums in another order of float rounding where they are scored in
    place; both within the integer path's tolerance of float64 numpy."""
    name, int8_dot = path
    q, k, v, m, ks, vs, keys, values = cache_case(cache, heads, kv_heads, head_dim, slots, live, window, seed=11)
    rows = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads, int8_dot, ks, vs)
    got = native_attention.reference(q, blocked(k, kv_heads, head_dim), v, m, kv_heads, head_dim, threads, int8_dot,
                                     ks, vs, key_blocks=True)
    if name == "avx2 integer":  # chunks cut between blocks: the 15-bit numerators round per chunk
        np.testing.assert_allclose(got, rows, atol=4e-4 * float(np.abs(rows).max()), rtol=1e-4)
    else:
        np.testing.assert_array_equal(got, rows)
    expected = numpy_attention(q, keys, values, m, kv_heads, head_dim)
    np.testing.assert_allclose(got, expected, atol=4e-4 * max(1.0, float(np.abs(expected).max())), rtol=1e-4)


@avx2_path
@pytest.mark.parametrize("cache", ["int8", "int8_rows"])
def test_blocked_keys_take_soft_masks_and_masked_holes(cache):
    q, k, v, m, ks, vs, keys, values = cache_case(cache, 9, 3, 64, 904, 861, seed=5)
    m[:861] = np.linspace(-4, 1, 861, dtype=np.float32)
    m[5:800:7] = MASKED
    got = native_attention.reference(q, blocked(k, 3, 64), v, m, 3, 64, 2, True, ks, vs, key_blocks=True)
    expected = numpy_attention(q, keys, values, m, 3, 64)
    np.testing.assert_allclose(got, expected, atol=4e-4 * max(1.0, float(np.abs(expected).max())), rtol=1e-4)


@avx2_path
@pytest.mark.parametrize("lo, hi", [(0, 0), (3, 202), (17, 1000), (0, 1023)])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_blocked_keys_of_a_head_major_cache(lo, hi, threads):
    """ONNX Runtime's [KVH][S][D] layout: each KV head's blocks contiguous ([KVH, S, 1, D] blocked)."""
    heads, kv_heads, head_dim, slots = 9, 3, 64, 1024
    q, k, v, _, _, _, keys, values = cache_case("int8", heads, kv_heads, head_dim, slots, slots, seed=lo)
    k, v = (np.ascontiguousarray(x.reshape(slots, kv_heads, head_dim).transpose(1, 0, 2)) for x in (k, v))
    k_blocks = native_attention.block_keys(k.reshape(kv_heads, slots, 1, head_dim)).reshape(k.shape)
    q = np.ascontiguousarray(q, np.float32)
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, threads)
    try:
        rows = head_major_attention(kernel, q, k, v, lo, hi, 1)
        got = head_major_attention(kernel, q, k_blocks, v, lo, hi, 1 | native_attention.CACHE_KEY_BLOCKS)
    finally:
        kernel.release()
    np.testing.assert_allclose(got, rows, atol=1e-5 * float(np.abs(rows).max()), rtol=1e-5)
    m = np.full(slots, MASKED, np.float32)
    m[lo:hi + 1] = 0.0
    expected = numpy_attention(q, keys, values, m, kv_heads, head_dim)
    np.testing.assert_allclose(got, expected, atol=4e-4 * max(1.0, float(np.abs(expected).max())), rtol=1e-4)


@pytest.mark.parametrize("scaled", [False, True], ids=["int8", "int8_rows"])
def test_a_prefill_chunk_reads_blocked_keys(scaled):
    """The prefill kernels read rows: the blocks are rewritten once per chunk, the result unchanged."""
    rng = np.random.default_rng(3)
    tokens, heads, kv_heads, head_dim, slots = 37, 9, 3, 64, 264
    q = rng.standard_normal((tokens, heads * head_dim)).astype(np.float32) / 8
    k, v = (rng.standard_normal((slots, kv_heads * head_dim)).astype(np.float32) for _ in range(2))
    if scaled:
        (k, ks), (v, vs) = quantize_rows(k, kv_heads, head_dim), quantize_rows(v, kv_heads, head_dim)
    else:
        (k, v), ks, vs = (np.clip(np.rint(x * 40), -127, 127).astype(np.int8) for x in (k, v)), None, None
    start = 200  # the chunk's tokens at slots 200..236, each seeing the slots before it
    mask = np.full((tokens, slots), MASKED, np.float32)
    for t in range(tokens):
        mask[t, :start + t + 1] = 0.0
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, 2)
    try:
        rows = kernel.run_prefill(q, k, v, mask, kv_heads, ks, vs)
        got = kernel.run_prefill(q, blocked(k, kv_heads, head_dim), v, mask, kv_heads, ks, vs, key_blocks=True)
    finally:
        kernel.release()
    np.testing.assert_array_equal(got, rows)


def test_blocked_keys_must_be_int8_codes_of_whole_blocks():
    q, k, v, m, _, _, _, _ = cache_case("int8", 9, 3, 64, 64, 64)
    with pytest.raises(ValueError, match="rejected"):
        native_attention.reference(q, k.astype(np.float32), v.astype(np.float32), m, 3, 64, key_blocks=True)
    with pytest.raises(ValueError, match="rejected"):
        native_attention.reference(q, k[:60], v[:60], m[:60], 3, 64, key_blocks=True)


# ---- litekv's ONNX Runtime Int8 attention ops with key_blocks (ort_ops.c) --------------------------

def head_major_blocks(keys: np.ndarray) -> np.ndarray:
    """An ONNX cache's keys [1, KVH, S, D] in block order."""
    _, kv_heads, slots, head_dim = keys.shape
    return native_attention.block_keys(keys.reshape(kv_heads, slots, 1, head_dim)).reshape(keys.shape)


def head_major_rows(blocks: np.ndarray) -> np.ndarray:
    _, kv_heads, slots, head_dim = blocks.shape
    return native_attention.unblock_keys(blocks.reshape(kv_heads, slots, 1, head_dim)).reshape(blocks.shape)


def ort_int8_op(op: str, tokens: int, position: int, window: int, threads: int):
    """The op's outputs with keys as rows and in blocks, from the same cache and chunk."""
    onnx_ops = pytest.importorskip("test_onnx_decode_attention")
    heads, kv_heads, slots, head_dim, half = 9, 3, 1024, 64, 32
    rng = np.random.default_rng(tokens + position + threads)
    q, k, v, _, _, cos, sin = onnx_ops.operands(rng, heads, kv_heads, slots, head_dim, half, tokens)
    k_scale, v_scale = ((rng.random((1, kv_heads, 1, head_dim)) * 0.02 + 0.01).astype(np.float32) for _ in range(2))
    past_k, past_v = (rng.integers(-127, 128, (1, kv_heads, slots, head_dim)).astype(np.int8) for _ in range(2))
    feeds = {"query": np.concatenate([q, k, v], axis=1)[None], "past_value": past_v,
             "seqlens_k": np.array([position], np.int32), "cos": cos, "sin": sin, "k_scale": k_scale,
             "v_scale": v_scale}
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, threads=threads)
    try:
        runs = {}
        for blocks, keys in ((0, past_k), (1, head_major_blocks(past_k))):
            model = onnx_ops.session(onnx_ops.int8_model(heads, kv_heads, slots, head_dim, half, window, op=op,
                                                         key_blocks=blocks), kernel)
            runs[blocks] = model.run(None, {**feeds, "past_key": keys})
    finally:
        kernel.release()
    return runs[0], runs[1]


@pytest.mark.parametrize("position, window", [(0, -1), (150, -1), (1000, -1), (900, 256)])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_the_onnx_decode_op_writes_and_reads_its_keys_in_blocks(position, window, threads):
    """DecodeAttentionInt8 with key_blocks=1: the new row goes to its block, the others stay, and the
    output is the row layout's to the integer path's rounding."""
    (out, present_k, present_v), (got, blocked_k, got_v) = ort_int8_op("DecodeAttentionInt8", 1, position, window,
                                                                       threads)
    np.testing.assert_array_equal(head_major_rows(blocked_k), present_k)
    np.testing.assert_array_equal(got_v, present_v)
    np.testing.assert_allclose(got, out, atol=4e-4 * float(np.abs(out).max()), rtol=1e-4)


@pytest.mark.parametrize("tokens, position, window", [(7, 6, -1), (100, 99, -1), (64, 300, -1), (100, 400, 40),
                                                     (37, 1023, -1)])
def test_the_onnx_prefill_op_writes_and_reads_its_keys_in_blocks(tokens, position, window):
    """PrefillAttentionInt8 with key_blocks=1: the chunk's rows go to their blocks (across block
    boundaries), and the prefill kernel reads the cache rewritten as rows: the row layout's output."""
    (out, present_k, present_v), (got, blocked_k, got_v) = ort_int8_op("PrefillAttentionInt8", tokens, position,
                                                                       window, 2)
    np.testing.assert_array_equal(head_major_rows(blocked_k), present_k)
    np.testing.assert_array_equal(got_v, present_v)
    np.testing.assert_array_equal(got, out)


def test_key_blocks_are_refused_on_the_float_ops_and_on_caches_of_odd_slots():
    onnx_ops = pytest.importorskip("test_onnx_decode_attention")
    kernel = native_attention.AttentionKernel(64, 4, 64, threads=1)
    try:
        with pytest.raises(Exception, match="key_blocks"):
            node = onnx_ops.helper.make_node(
                "DecodeAttention", ["query", "", "", "past_key", "past_value", "seqlens_k"],
                ["out", "present_key", "present_value"], domain=onnx_ops.KERNEL_DOMAIN, num_heads=4, kv_num_heads=2,
                scale=0.125, key_blocks=1)
            cache = [1, 2, 64, 64]
            types = {"query": (onnx_ops.TensorProto.FLOAT, [1, "T", 8 * 64]),
                     "past_key": (onnx_ops.TensorProto.FLOAT, cache), "past_value": (onnx_ops.TensorProto.FLOAT, cache),
                     "seqlens_k": (onnx_ops.TensorProto.INT32, [1])}
            onnx_ops.session(onnx_ops.one_node(node, types, 4 * 64, onnx_ops.TensorProto.FLOAT, cache), kernel)
        model = onnx_ops.session(onnx_ops.int8_model(4, 2, 60, 64, 32, key_blocks=1), kernel)
        rng = np.random.default_rng(0)
        q, k, v, _, _, cos, sin = onnx_ops.operands(rng, 4, 2, 60, 64, 32)
        with pytest.raises(Exception, match="multiple of 8"):
            model.run(None, {"query": np.concatenate([q, k, v], axis=1)[None],
                             "past_key": np.zeros((1, 2, 60, 64), np.int8), "past_value": np.zeros((1, 2, 60, 64), np.int8),
                             "seqlens_k": np.array([3], np.int32), "cos": cos, "sin": sin,
                             "k_scale": np.ones((1, 2, 1, 64), np.float32), "v_scale": np.ones((1, 2, 1, 64), np.float32)})
    finally:
        kernel.release()


# ---- the KV cache's BHSD_KB8 layout (litekv.kv_cache) ----------------------------------------------

def filled(layout: str, batch: int = 2, tokens: int = 21, capacity: int = 32, seed: int = 0):
    from litekv.kv_cache import KVCache

    cache = KVCache.allocate(3, batch, 2, 8, capacity, layout, "int8")
    rng = np.random.default_rng(seed)
    keys = rng.integers(-127, 128, (3, batch, tokens, 2, 8), dtype=np.int8)
    values = rng.integers(-127, 128, (3, batch, tokens, 2, 8), dtype=np.int8)
    for layer in range(3):
        cache._write(cache.raw_keys(layer), slice(None), tokens, keys[layer], cache.key_blocks)
        cache._write(cache.raw_values(layer), slice(None), tokens, values[layer], False)
    cache.set_num_tokens(tokens)
    return cache, keys, values


@pytest.mark.parametrize("layout", ["BHSD_KB8", "BSHD_KB8"])
def test_a_blocked_cache_holds_its_keys_in_the_kernels_block_order(layout):
    cache, keys, values = filled(layout)
    assert cache.key_blocks and cache.layout == layout
    raw = cache.raw_keys(1)[0]  # batch row 0: [KVH, S, D] or [S, KVH, D], bytes in blocks
    if layout == "BHSD_KB8":  # each KV head's blocks
        rows = native_attention.unblock_keys(raw[:, :, None]).reshape(raw.shape).transpose(1, 0, 2)
    else:  # a block holds every KV head's
        rows = native_attention.unblock_keys(raw)
    np.testing.assert_array_equal(rows[:21], keys[1, 0])
    np.testing.assert_array_equal(cache.key_cache(1), keys[1])
    np.testing.assert_array_equal(cache.value_cache(1), values[1])
    assert not cache.key_cache(1).flags.writeable


@pytest.mark.parametrize("source, target", [("BHSD_KB8", "BHSD"), ("BHSD", "BHSD_KB8"), ("BHSD_KB8", "BHSD_KB8"),
                                            ("BSHD", "BHSD_KB8"), ("BSHD_KB8", "BSHD"), ("BSHD", "BSHD_KB8"),
                                            ("BSHD_KB8", "BHSD_KB8")])
def test_copies_and_saved_caches_move_between_row_and_block_layouts(source, target):
    from litekv.kv_cache import KVCache

    cache, keys, values = filled(source)
    other = KVCache.allocate(3, 1, 2, 8, 32, target, "int8")
    other.select_and_copy_from(cache, 1)
    np.testing.assert_array_equal(other.key_cache(2), keys[2, 1:2])
    wide = KVCache.allocate(3, 2, 2, 8, 32, target, "int8")
    wide.broadcast_and_copy_from(other)
    np.testing.assert_array_equal(wide.key_cache(0), np.repeat(keys[0, 1:2], 2, axis=0))
    loaded = KVCache.allocate(3, 2, 2, 8, 32, target, "int8")
    loaded.load(cache.serialize())
    for layer in range(3):
        np.testing.assert_array_equal(loaded.key_cache(layer), keys[layer])
        np.testing.assert_array_equal(loaded.value_cache(layer), values[layer])
    assert cache.deep_copy().serialize() == cache.serialize()


def test_a_copy_into_a_blocked_cache_keeps_the_codes_past_its_tokens_in_the_last_block():
    """Rewriting 21 tokens touches 3 blocks of 8; slots 21-23 of the third keep what they held."""
    target, _, _ = filled("BHSD_KB8", batch=1, tokens=24, seed=1)  # the same code moves BSHD_KB8's blocks
    before = target.raw_keys(0).copy()
    source, keys, _ = filled("BHSD", batch=1, tokens=21, seed=2)
    target.select_and_copy_from(source, 0)
    rows_before, rows_after = head_major_rows(before), head_major_rows(target.raw_keys(0))
    np.testing.assert_array_equal(rows_after[:, :, 21:24], rows_before[:, :, 21:24])
    np.testing.assert_array_equal(rows_after[0, :, :21].transpose(1, 0, 2), keys[0, 0])


@pytest.mark.parametrize("dtype, capacity", [("float32", 32), ("int8", 30)])
def test_a_blocked_cache_needs_int8_codes_and_whole_blocks(dtype, capacity):
    from litekv.errors import ConfigError
    from litekv.kv_cache import KVCache

    with pytest.raises(ConfigError, match="multiple of 8"):
        KVCache.allocate(1, 1, 2, 8, capacity, "BHSD_KB8", dtype)


def key_blocks_bundle(arch: str, backend: str):
    """A test model converted with an int8 cache whose keys are in blocks (--kv-key-blocks), with
    LiteRT's capacity buckets as the int8 bundles of kv_formats have them."""
    from conformance import _ROOT, PREFILL_LENGTHS, checkpoint_dir
    from kv_formats import KV_BUCKETS, MAX_CONTEXT
    from litekv.converters.convert import ConvertOptions, convert

    path = _ROOT / f"{arch}-{backend}-kvint8-key-blocks"
    if not (path / "litekv.json").exists():
        buckets = dict(kv_buckets=KV_BUCKETS) if backend == "litert" else {}
        convert(checkpoint_dir(arch), path, ConvertOptions(backend=backend, max_context=MAX_CONTEXT,
                                                           prefill_lengths=PREFILL_LENGTHS, kv_cache="int8",
                                                           key_blocks=True, **buckets))
    return path


@pytest.mark.parametrize("backend, layout", [("onnx", "BHSD_KB8"), ("litert", "BSHD_KB8")])
def test_int8_bundles_with_key_blocks_follow_the_reference(backend, layout):
    """--kv-key-blocks: the manifest's layout keeps keys in blocks, caches are made in it, the LiteRT
    graphs call the ops' int8_blocks forms, steps stay within the int8 cache's tolerance of the
    reference across the capacity buckets (LiteRT: 16, 32, 64 slots), and a saved cache loads into a
    row-layout cache unchanged."""
    from conformance import reference
    from kv_formats import assert_steps_follow_reference, tflite_custom_ops_and_cache_types
    from litekv.bundle import read_manifest
    from litekv.executor import open_executor
    from litekv.kv_cache import KVCache

    bundle = key_blocks_bundle("llama", backend)
    assert read_manifest(bundle).kv_layout == layout
    if backend == "litert":
        customs, _ = tflite_custom_ops_and_cache_types(bundle / "model.tflite")
        assert customs == {"litekv.decode_attention_int8_blocks", "litekv.prefill_attention_int8_blocks", "litekv.rope",
                           "litekv.linear_f32_screened"}
    ex = open_executor(bundle)
    cache = ex.create_kv_cache()
    assert cache.key_blocks and cache.layout == layout
    assert_steps_follow_reference(ex, reference("llama"), 0.05, steps=30)  # 9 + 30 tokens: three buckets
    ex.prefill(np.arange(3, 20), cache)
    rows = KVCache.allocate(cache.num_layers, 1, cache.num_kv_heads, cache.head_dim, cache.num_entries,
                            layout.removesuffix("_KB8"), "int8")
    rows.load(cache.serialize())
    for layer in range(cache.num_layers):
        np.testing.assert_array_equal(rows.key_cache(layer), cache.key_cache(layer))


@pytest.mark.parametrize("backend", ["onnx", "litert"])
def test_int8_bundles_keep_their_keys_as_rows_by_default(backend):
    """Blocks are read in place only on x86-64 with AVX2 and no AVX-512: the default stays rows."""
    from kv_formats import kv_format_bundle
    from litekv.bundle import read_manifest

    assert read_manifest(kv_format_bundle("llama", backend, "int8")).kv_layout == ("BSHD" if backend == "litert"
                                                                                 else "BHSD")


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache="fp16"), "int8 cache"),
    (dict(kv_cache="int8", decode_attention="graph", prefill_attention="graph"), "kernel attention"),
    (dict(kv_cache="int8", max_context=60, prefill_lengths=(8,), kv_buckets=(60,)), "multiple of 8"),
])
def test_key_blocks_are_refused_where_nothing_could_read_them(options, message):
    from litekv.converters.convert import ConvertOptions
    from litekv.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        ConvertOptions(backend="litert", key_blocks=True, **options)


@pytest.mark.parametrize("lo", [3, 4, 5])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_chunks_cut_between_blocks_hold_their_longest_spans(lo, threads):
    """A 2,048-slot span starting inside a block: its two chunks are cut at a block boundary, so one
    holds up to 8 slots more than half the span. The slots at a chunk's end carry the attention here
    (keys along the query), so a chunk whose softmax numerators overran their row would lose them."""
    heads, kv_heads, head_dim, slots = 9, 3, 64, 2064
    q, k, v, m, ks, vs, keys, values = cache_case("int8", heads, kv_heads, head_dim, slots, slots, seed=lo)
    k = (k // 8).astype(np.int8)  # small codes everywhere but at the chunk ends
    query = q.reshape(heads, head_dim)
    for s in range(lo + 1018, lo + 1036):  # around the cut: the first chunk's last slots, the second's first
        for kv in range(kv_heads):
            k[s, kv * head_dim:(kv + 1) * head_dim] = np.clip(np.rint(query[kv * 3] / np.abs(query[kv * 3]).max()
                                                                      * 127), -127, 127).astype(np.int8)
    keys = k.astype(np.float64)
    m[:lo] = MASKED
    m[lo + 2048:] = MASKED
    got = native_attention.reference(q, blocked(k, kv_heads, head_dim), v, m, kv_heads, head_dim, threads, True,
                                     ks, vs, key_blocks=True)
    expected = numpy_attention(q, keys, values, m, kv_heads, head_dim)
    np.testing.assert_allclose(got, expected, atol=4e-4 * max(1.0, float(np.abs(expected).max())), rtol=1e-4)
