"""litekv's prefill-attention kernel: a chunk of query tokens against the cache, on host arrays
and as the custom op of converted bundles."""
from __future__ import annotations

import numpy as np
import pytest

from litekv import native_attention

pytestmark = pytest.mark.skipif(not native_attention.available(),
                                reason="litekv's attention kernels are not built (no C compiler at install)")

MASKED = np.finfo(np.float32).min


def numpy_prefill(query, keys, values, mask, kv_heads, head_dim):
    """float64 attention of every query row; a row with no unmasked slot attends to nothing (zeros)."""
    tokens, slots = mask.shape
    heads = query.shape[1] // head_dim
    group = heads // kv_heads
    out = np.zeros((tokens, heads * head_dim))
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    for h in range(heads):
        kv = slice(h // group * head_dim, (h // group + 1) * head_dim)
        scores = query[:, h * head_dim:(h + 1) * head_dim].astype(np.float64) @ keys[:, kv].T + mask
        open_rows = (mask > -1e30).any(axis=1)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[:, h * head_dim:(h + 1) * head_dim] = np.where(open_rows[:, None], p @ values[:, kv], 0.0)
    return out


def causal_case(heads, kv_heads, head_dim, tokens, slots, start, window=None, int8=False, seed=0):
    """A chunk of `tokens` rows written at `start`: row t sees slots 0..start+t (the last `window`)."""
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((tokens, heads * head_dim)).astype(np.float32) * 0.3
    if int8:
        keys, values = (rng.integers(-127, 128, (slots, kv_heads * head_dim)).astype(np.int8) for _ in range(2))
        query *= 0.02  # codes are ~100x a float cache's values
    else:
        keys, values = (rng.standard_normal((slots, kv_heads * head_dim)).astype(np.float32) for _ in range(2))
    mask = np.full((tokens, slots), MASKED, np.float32)
    for t in range(tokens):
        last = min(start + t, slots - 1)
        mask[t, (0 if window is None else max(0, last - window + 1)):last + 1] = 0.0
    return query, keys, values, mask


def run(query, keys, values, mask, kv_heads, head_dim, threads=2):
    kernel = native_attention.AttentionKernel(head_dim, query.shape[1] // head_dim, mask.shape[1], threads)
    try:
        return kernel.run_prefill(query, keys, values, mask, kv_heads)
    finally:
        kernel.release()


@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens, slots, start, window", [
    (9, 3, 64, 37, 300, 100, None),    # SmolLM2's heads, a chunk after a prefix
    (9, 3, 64, 128, 128, 0, None),     # the first chunk fills the cache: its causal triangle
    (4, 1, 256, 20, 600, 33, None),    # Gemma 3 270M's heads: 4 query rows per token, one KV head
    (4, 1, 256, 40, 600, 300, 64),     # a sliding window: a masked prefix that moves with the row
    (14, 2, 128, 50, 400, 300, None),  # head_dim 128, 7 heads per KV head
    (6, 2, 48, 17, 100, 40, None),     # a head_dim without a vector path
    (64, 1, 64, 3, 50, 10, None),      # more heads per KV head than a tile's rows
    (50, 1, 64, 3, 40, 5, None),       # ... and not a multiple of the 8-row register group
])
@pytest.mark.parametrize("int8", [False, True], ids=["float cache", "int8 codes"])
def test_kernel_matches_numpy(heads, kv_heads, head_dim, tokens, slots, start, window, int8):
    q, k, v, m = causal_case(heads, kv_heads, head_dim, tokens, slots, start, window, int8)
    got = run(q, k, v, m, kv_heads, head_dim)
    want = numpy_prefill(q, k, v, m, kv_heads, head_dim)
    np.testing.assert_allclose(got, want, atol=(2e-3 if int8 else 2e-5), rtol=1e-4)


@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens, slots, start, window", [
    (9, 3, 64, 37, 300, 100, None),    # SmolLM2's heads, a chunk after a prefix
    (4, 1, 256, 40, 600, 300, 64),     # Gemma 3 270M's heads, a sliding window
    (6, 2, 48, 17, 100, 40, None),     # a head_dim without a vector path
])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_float16_cache_matches_numpy_on_the_halves(heads, kv_heads, head_dim, tokens, slots, start, window, threads):
    q, k, v, m = causal_case(heads, kv_heads, head_dim, tokens, slots, start, window)
    k, v = k.astype(np.float16), v.astype(np.float16)
    got = run(q, k, v, m, kv_heads, head_dim, threads)
    want = numpy_prefill(q, k.astype(np.float32), v.astype(np.float32), m, kv_heads, head_dim)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_holes_soft_masks_and_fully_masked_rows():
    """The mask is added as it is: holes inside the span are skipped, soft values bias the scores,
    and a row that sees nothing (masked everywhere) comes out as zeros, not an average."""
    q, k, v, m = causal_case(9, 3, 64, 40, 500, 200)
    m[:, 17:40] = MASKED
    m[5, :100] += np.random.default_rng(1).standard_normal(100).astype(np.float32)
    m[7] = MASKED
    got = run(q, k, v, m, 3, 64)
    np.testing.assert_allclose(got, numpy_prefill(q, k, v, m, 3, 64), atol=2e-5, rtol=1e-4)
    assert not got[7].any()
    m[:] = MASKED
    assert not run(q, k, v, m, 3, 64).any()


def test_minus_infinity_masks_as_well_as_the_float_minimum():
    q, k, v, m = causal_case(9, 3, 64, 30, 200, 60)
    m[m < -1e30] = -np.inf
    m[4] = -np.inf
    got = run(q, k, v, m, 3, 64)
    np.testing.assert_allclose(got, numpy_prefill(q, k, v, np.maximum(m, MASKED), 3, 64), atol=2e-5, rtol=1e-4)
    assert np.isfinite(got).all() and not got[4].any()


@pytest.mark.parametrize("int8", [False, True], ids=["float cache", "int8 codes"])
def test_the_result_does_not_depend_on_the_thread_count(int8):
    """Each tile is computed whole by whichever thread takes it, so two threads give the bits of one."""
    q, k, v, m = causal_case(9, 3, 64, 300, 1024, 500, int8=int8)
    np.testing.assert_array_equal(run(q, k, v, m, 3, 64, threads=1), run(q, k, v, m, 3, 64, threads=2))


def test_a_kernel_serves_decode_and_prefill_calls_in_turn():
    """One registration's helper thread and scratch serve both ops, as a prefill then steps do."""
    q, k, v, m = causal_case(9, 3, 64, 64, 512, 200)
    kernel = native_attention.AttentionKernel(64, 9, 512, 2)
    try:
        for _ in range(3):
            np.testing.assert_allclose(kernel.run_prefill(q, k, v, m, 3), numpy_prefill(q, k, v, m, 3, 64),
                                       atol=2e-5, rtol=1e-4)
            step = kernel.run(q[-1], k, v, m[-1], 3)
            np.testing.assert_allclose(step, numpy_prefill(q[-1:], k, v, m[-1:], 3, 64)[0], atol=2e-5, rtol=1e-4)
    finally:
        kernel.release()


@pytest.mark.parametrize("change", ["slots above the registration", "heads that do not group",
                                    "keys and values of different lengths", "a query of other heads",
                                    "a one-row mask"])
def test_shapes_that_do_not_fit_are_refused(change):
    """Refused before the kernel runs: the C side sizes its reads from the registration's heads."""
    q, k, v, m = causal_case(9, 3, 64, 8, 256, 0)
    kv_heads, slots = 3, 256
    if change == "slots above the registration":
        slots = 128
    elif change == "heads that do not group":
        kv_heads, k, v = 2, k[:, :128], v[:, :128]
    elif change == "keys and values of different lengths":
        v = v[:200]
    elif change == "a query of other heads":
        q = q[:, :8 * 64]
    else:
        m = m[0]
    kernel = native_attention.AttentionKernel(64, 9, slots, 1)
    try:
        with pytest.raises(ValueError, match="prefill attention rejected the shapes"):
            kernel.run_prefill(q, k, v, m, kv_heads)
    finally:
        kernel.release()


def test_kernel_bundles_prefill_in_the_custom_op_at_one_capacity():
    """A default LiteRT bundle's prefill entry points run the prefill op, one per chunk length at
    max context, and their logits match a builtin-op bundle's with capacity buckets."""
    from conformance import checkpoint_dir, relative_error, scratch_dir
    from litekv.converters.convert import ConvertOptions, convert
    from litekv.executor import open_executor
    from ai_edge_litert import schema_py_generated as schema

    def model_custom_op_names(path):
        model = schema.Model.GetRootAs(path.read_bytes(), 0)
        return {model.OperatorCodes(i).CustomCode().decode() for i in range(model.OperatorCodesLength())
                if model.OperatorCodes(i).CustomCode()}

    kinds = {}
    for attention in ("kernel", "graph"):
        options = ConvertOptions(backend="litert", max_context=512, prefill_lengths=(8, 64),
                                 prefill_attention=attention, kv_cache="fp32")  # the kernel against builtin ops, exactly
        kinds[attention] = convert(checkpoint_dir("gemma3"), scratch_dir("litekv-prefill-op-") / attention, options)
    kernel, graph = (open_executor(kinds[a]) for a in ("kernel", "graph"))
    assert {s.capacity for s in kernel.manifest.signatures if s.kind == "prefill"} == {512}
    assert len({s.capacity for s in graph.manifest.signatures if s.kind == "prefill"}) > 1
    assert native_attention.PREFILL_OP_NAME in model_custom_op_names(kinds["kernel"] / "model.tflite")
    assert native_attention.PREFILL_OP_NAME not in model_custom_op_names(kinds["graph"] / "model.tflite")
    prompt = np.random.default_rng(3).integers(3, kernel.config.vocab_size, 500)  # chunks in every bucket
    caches = [ex.create_kv_cache() for ex in (kernel, graph)]
    for ex, cache in zip((kernel, graph), caches):
        ex.prefill(prompt, cache)
    assert relative_error(kernel.step([7], caches[0]), graph.step([7], caches[1])) < 1e-4


@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens, slots, start, window", [
    (9, 3, 64, 37, 300, 100, None),    # SmolLM2's heads, a chunk after a prefix
    (4, 1, 256, 40, 600, 300, 64),     # Gemma 3 270M's heads, a sliding window
    (6, 2, 48, 17, 100, 40, None),     # a head_dim without a vector path
])
def test_int8_rows_form_matches_numpy_on_the_scaled_codes(heads, kv_heads, head_dim, tokens, slots, start, window):
    """Codes with a scale per slot and KV head, rows differing in size by up to 100x: each counts
    times its own scale in the scores and the weighted values."""
    q, k, v, m = causal_case(heads, kv_heads, head_dim, tokens, slots, start, window)
    rng = np.random.default_rng(3)
    codes, scales = [], []
    for x in (k, v):
        rows = (x * rng.uniform(0.1, 10.0, (slots, 1))).reshape(slots, kv_heads, head_dim)
        scale = np.abs(rows).max(axis=2) / 127.0
        codes.append(np.rint(rows / scale[..., None]).astype(np.int8).reshape(slots, -1))
        scales.append(np.ascontiguousarray(scale.T, np.float32))
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, 2)
    try:
        got = kernel.run_prefill(q / 8, codes[0], codes[1], m, kv_heads, key_scales=scales[0], value_scales=scales[1])
    finally:
        kernel.release()
    k_float, v_float = ((c.reshape(slots, kv_heads, head_dim) * s.T[..., None]).reshape(slots, -1)
                        for c, s in zip(codes, scales))
    want = numpy_prefill(q / 8, k_float, v_float, m, kv_heads, head_dim)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=1e-4)


def prefill_avx2(enable: int) -> bool:
    """The kernel's AVX2 prefill path on (1) or off (0), or as it is (-1); whether it is on. It is on
    by default only on x86-64 CPUs with AVX2, FMA and F16C and without AVX-512."""
    import ctypes
    lib = native_attention._load()
    lib.litekv_prefill_avx2.argtypes, lib.litekv_prefill_avx2.restype = [ctypes.c_int], ctypes.c_int
    return bool(lib.litekv_prefill_avx2(enable))


@pytest.fixture(params=["avx2", "portable"])
def prefill_path(request):
    """Runs a test on the AVX2 path (skipped where the CPU does not take it) and on the portable one."""
    default = prefill_avx2(-1)
    on = prefill_avx2(int(request.param == "avx2"))
    try:
        if request.param == "avx2" and not on:
            pytest.skip("this CPU does not take the AVX2 prefill path (no AVX2, or AVX-512)")
        yield request.param
    finally:
        prefill_avx2(int(default))


def cache_operands(cache, keys, values, kv_heads, head_dim, rng):
    """keys and values as a `cache` stores them, with their row scales (int8_rows), and the floats
    they stand for."""
    slots = len(keys)
    if cache == "float32":
        return (keys, values), {}, (keys, values)
    if cache == "float16":
        stored = keys.astype(np.float16), values.astype(np.float16)
        return stored, {}, tuple(x.astype(np.float32) for x in stored)
    if cache == "int8":  # codes; their static scales live in the query and the output
        stored = tuple(np.clip(np.rint(x * 40), -127, 127).astype(np.int8) for x in (keys, values))
        return stored, {}, tuple(x.astype(np.float32) for x in stored)
    codes, scales, floats = [], [], []
    for x in (keys, values):
        rows = (x * rng.uniform(0.1, 10.0, (slots, 1))).reshape(slots, kv_heads, head_dim)
        scale = (np.abs(rows).max(axis=2) / 127.0).astype(np.float32)
        code = np.rint(rows / scale[..., None]).astype(np.int8)
        codes.append(code.reshape(slots, -1))
        scales.append(np.ascontiguousarray(scale.T))
        floats.append((code * scale[..., None]).reshape(slots, -1))
    return tuple(codes), {"key_scales": scales[0], "value_scales": scales[1]}, tuple(floats)


@pytest.mark.parametrize("cache", ["float32", "float16", "int8", "int8_rows"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, tokens, slots, start, window", [
    (9, 3, 64, 37, 300, 100, None),    # SmolLM2: 48-row tiles in blocks of 6, a last tile of 15 rows
    (9, 3, 64, 53, 53, 0, None),       # a chunk filling the cache: spans not a multiple of 16 slots
    (14, 2, 128, 23, 400, 301, 70),    # 7 heads per KV head (42-row tiles), a window
    (4, 1, 256, 13, 600, 250, None),   # Gemma 3: head_dim 256, a 48-row tile and one of 4 rows
    (5, 5, 40, 19, 150, 60, 33),       # head_dim 40: value sums of 16 + 16 + 8 dimensions; 1 head per KV head
    (2, 1, 8, 9, 70, 3, None),         # the narrowest vector head
])
def test_both_paths_match_numpy_on_every_cache(prefill_path, cache, heads, kv_heads, head_dim, tokens, slots, start,
                                               window):
    """Each path against float64 numpy on what the cache holds, for every cache type and row and
    dimension tail of the AVX2 path's register blocks (6 rows x 16 slots or dimensions)."""
    rng = np.random.default_rng(head_dim + tokens)
    q, k, v, m = causal_case(heads, kv_heads, head_dim, tokens, slots, start, window, seed=head_dim)
    (k_stored, v_stored), scales, (k_float, v_float) = cache_operands(cache, k, v, kv_heads, head_dim, rng)
    if cache == "int8":
        q = q / 40
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, 2)
    try:
        got = kernel.run_prefill(q, k_stored, v_stored, m, kv_heads, **scales)
    finally:
        kernel.release()
    want = numpy_prefill(q, k_float, v_float, m, kv_heads, head_dim)
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, np.abs(want).max()), rtol=1e-4)


@pytest.mark.parametrize("cache", ["float32", "float16", "int8", "int8_rows"])
def test_the_paths_agree_on_a_long_chunk_after_a_prefix(cache):
    """256 tokens at slot 768 of a 2,048-slot cache, as a prompt after a first turn: the AVX2 path
    (where the CPU takes it) and the portable one within float reordering of each other."""
    rng = np.random.default_rng(5)
    q, k, v, m = causal_case(9, 3, 64, 256, 2048, 768, seed=5)
    (k_stored, v_stored), scales, _ = cache_operands(cache, k, v, 3, 64, rng)
    default = prefill_avx2(-1)
    got = {}
    try:
        for path in (0, 1):
            prefill_avx2(path)
            kernel = native_attention.AttentionKernel(64, 9, 2048, 2)
            try:
                got[path] = kernel.run_prefill(q, k_stored, v_stored, m, 3, **scales)
            finally:
                kernel.release()
    finally:
        prefill_avx2(int(default))
    np.testing.assert_allclose(got[1], got[0], atol=1e-6 * np.abs(got[0]).max(), rtol=1e-5)


def test_holes_and_masked_rows_on_both_paths(prefill_path):
    """A mask with holes, soft values and fully masked rows, over spans the AVX2 mask scan reads 32
    entries at a time (and the entries after the last whole 32 one by one)."""
    q, k, v, m = causal_case(9, 3, 64, 40, 1000, 700)
    m[:, 3:40] = MASKED
    m[:, 701:733] = MASKED
    m[9, :500] += np.random.default_rng(2).standard_normal(500).astype(np.float32)
    m[11] = MASKED
    m[12] = -np.inf
    m[13, :] = MASKED
    m[13, 999] = 0.0  # one slot at the very end: the span's scan from the end stops there
    got = run(q, k, v, m, 3, 64)
    np.testing.assert_allclose(got, numpy_prefill(q, k, v, np.maximum(m, MASKED), 3, 64), atol=2e-5, rtol=1e-4)
    assert not got[11].any() and not got[12].any()
