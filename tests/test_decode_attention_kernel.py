"""litekv's decode-attention kernel: its arithmetic, and the LiteRT custom op that runs it."""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu_flags import cpu_flags
from litekv import native_attention

pytestmark = pytest.mark.skipif(not native_attention.available(),
                                reason="litekv's decode-attention kernel is not built (no C compiler at install)")

MASKED = np.finfo(np.float32).min


def numpy_attention(query, keys, values, mask, kv_heads, head_dim):
    """float64 attention of one query row: head h reads KV head h // (H / KVH); masked slots dropped."""
    heads = query.size // head_dim
    group = heads // kv_heads
    out = np.zeros(heads * head_dim)
    live = mask > -1e30
    for h in range(heads):
        kv = slice(h // group * head_dim, (h // group + 1) * head_dim)
        if not live.any():
            continue
        scores = keys[live, kv].astype(np.float64) @ query[h * head_dim:(h + 1) * head_dim] + mask[live]
        p = np.exp(scores - scores.max())
        out[h * head_dim:(h + 1) * head_dim] = (p / p.sum()) @ values[live, kv]
    return out


def case(heads, kv_heads, head_dim, slots, live, window=None, seed=0):
    rng = np.random.default_rng(seed)
    query = rng.standard_normal(heads * head_dim).astype(np.float32)
    keys, values = (rng.standard_normal((slots, kv_heads * head_dim)).astype(np.float32) for _ in range(2))
    mask = np.full(slots, MASKED, np.float32)
    mask[:live] = 0.0
    if window is not None:
        mask[:max(0, live - window)] = MASKED
    return query, keys, values, mask


@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", [
    (9, 3, 64, 384, 300, None),   # SmolLM2's heads in a 384-slot bucket
    (4, 1, 256, 128, 128, None),  # Gemma 3 270M's heads, a full bucket
    (8, 4, 32, 64, 40, 16),       # a sliding window: a masked prefix
    (9, 3, 64, 512, 1, None),     # the first token
    (6, 6, 16, 32, 20, None),     # no grouping, a head_dim without a vector path
    (8, 2, 128, 300, 290, 100),   # head_dim 128, a window inside the second chunk
    (9, 3, 64, 1200, 1153, None),  # four chunks, the last of one slot
    (8, 2, 128, 1024, 900, 500),  # a window that starts inside a chunk
])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_kernel_matches_numpy(heads, kv_heads, head_dim, slots, live, window, threads):
    q, k, v, m = case(heads, kv_heads, head_dim, slots, live, window)
    got = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, m, kv_heads, head_dim), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("first, last, slots", [(0, 0, 64), (15, 15, 64), (16, 16, 64), (17, 40, 64), (3, 47, 64),
                                                (48, 63, 64), (63, 63, 64), (0, 63, 64), (31, 32, 64), (0, 0, 8),
                                                (7, 7, 8), (16, 16, 17), (0, 0, 40), (39, 39, 40), (20, 24, 40)])
def test_kernel_attends_over_a_live_span_anywhere_in_the_mask(first, last, slots):
    """The kernel looks for the live span from both ends of the mask, 16 slots at a time, then one
    at a time. A span missed by any slot would drop it, whichever side of a 16-slot boundary or
    tail it is on."""
    q, k, v, _ = case(9, 3, 64, slots, slots)
    m = np.full(slots, MASKED, np.float32)
    m[first:last + 1] = 0.0
    got = native_attention.reference(q, k, v, m, 3, 64, 1)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, m, 3, 64), atol=2e-5, rtol=1e-4)


def test_kernel_returns_zeros_when_every_slot_is_masked():
    q, k, v, _ = case(9, 3, 64, 64, 64)
    got = native_attention.reference(q, k, v, np.full(64, MASKED, np.float32), 3, 64, 1)
    assert not np.any(got)


def int8_case(heads, kv_heads, head_dim, slots, live, window=None):
    q, _, _, m = case(heads, kv_heads, head_dim, slots, live, window)
    rng = np.random.default_rng(1)
    k, v = (rng.integers(-127, 128, (slots, kv_heads * head_dim), dtype=np.int8) for _ in range(2))
    return q / 64, k, v, m  # a query of the size that gives scaled scores


@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", [
    (9, 3, 64, 384, 300, None),
    (4, 1, 256, 128, 100, None),
    (8, 2, 128, 300, 290, 100),
    (6, 6, 16, 32, 20, None),     # no integer path for head_dim 16: the codes are widened
    (9, 3, 64, 1500, 1401, None),  # four chunks, the last of an odd count of slots
    (4, 1, 256, 700, 600, 513),   # Gemma's heads and sliding window
    (10, 2, 64, 260, 259, None),  # five query heads per KV head: a batch of four, then one
    (4, 2, 128, 96, 90, None),    # two per KV head, two 64-dimension segments
])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
@pytest.mark.parametrize("int8_dot", [True, False], ids=["integer dot products", "codes widened to floats"])
def test_int8_form_matches_numpy_on_the_codes(heads, kv_heads, head_dim, slots, live, window, threads, int8_dot):
    """The int8 form attends over the codes as they are (the graph folds the scales into the query
    and the output): the same result as float attention over the codes converted to float. The
    integer paths round the query and the softmax numerators to 15 bits: within a twelfth of one
    code, where rounding to codes moved every element by up to half of one. (Scores here span
    +-64 at head_dim 256, so the query's rounding alone moves a peaked head's output by up to 0.07;
    the AVX-512 path's 14-bit query of before moved it by 0.05 where this moves it by 0.01, and
    the other way round elsewhere: it is chance, not a bias.)"""
    q, k, v, m = int8_case(heads, kv_heads, head_dim, slots, live, window)
    got = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads, int8_dot=int8_dot)
    expected = numpy_attention(q, k.astype(np.float64), v.astype(np.float64), m, kv_heads, head_dim)
    np.testing.assert_allclose(got, expected, atol=1 / 12 if int8_dot else 2e-3, rtol=1e-4)


def quantize_rows(x, kv_heads, head_dim):
    """int8 codes [S, KVH*D] of x with one scale per slot and KV head, and the scales [KVH, S]."""
    rows = x.reshape(x.shape[0], kv_heads, head_dim)
    scales = (np.maximum(np.abs(rows).max(axis=2), 1e-30) / 127.0).astype(np.float32)  # [S, KVH]
    codes = np.clip(np.rint(rows / scales[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(x.shape), np.ascontiguousarray(scales.T)


def rows_case(heads, kv_heads, head_dim, slots, live, window=None):
    """Keys and values whose rows differ in size by 100x, as int8 codes with a scale per row."""
    q, k, v, m = case(heads, kv_heads, head_dim, slots, live, window)
    rng = np.random.default_rng(2)
    k, v = (x * rng.uniform(0.1, 10.0, (slots, 1)).astype(np.float32) for x in (k, v))
    (kc, ks), (vc, vs) = quantize_rows(k, kv_heads, head_dim), quantize_rows(v, kv_heads, head_dim)
    return q / 8, kc, vc, ks, vs, m


def dequantized(codes, scales, kv_heads, head_dim):
    rows = codes.reshape(codes.shape[0], kv_heads, head_dim).astype(np.float64)
    return (rows * scales.T[..., None]).reshape(codes.shape)


@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", [
    (9, 3, 64, 384, 300, None),
    (4, 1, 256, 128, 100, None),
    (8, 2, 128, 300, 290, 100),
    (6, 6, 16, 32, 20, None),     # no integer path for head_dim 16: the codes are widened and scaled
    (9, 3, 64, 1500, 1401, None),  # four chunks, each with its own largest value scale
    (10, 2, 64, 260, 259, None),
])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
@pytest.mark.parametrize("int8_dot", [True, False], ids=["integer dot products", "codes widened to floats"])
def test_int8_rows_form_matches_numpy_on_the_scaled_codes(heads, kv_heads, head_dim, slots, live, window, threads,
                                                          int8_dot):
    """With a scale per row, each slot's codes count times their own scale, in the scores and in the
    weighted values. The rows here differ in size by up to 100x, so a kernel that dropped either
    scale, or applied one row's to another, would be far off."""
    q, k, v, ks, vs, m = rows_case(heads, kv_heads, head_dim, slots, live, window)
    got = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads, int8_dot=int8_dot, key_scales=ks,
                                     value_scales=vs)
    expected = numpy_attention(q, dequantized(k, ks, kv_heads, head_dim), dequantized(v, vs, kv_heads, head_dim), m,
                               kv_heads, head_dim)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=(2e-3 if int8_dot else 2e-5) * scale, rtol=1e-4)


@pytest.mark.parametrize("int8_dot", [True, False], ids=["integer dot products", "codes widened to floats"])
@pytest.mark.parametrize("larger", [1e3, 1e4])
def test_int8_rows_form_keeps_its_precision_beside_a_huge_ignored_row(int8_dot, larger):
    """One value row far larger than the rest, which the query barely attends to (a soft mask of
    -40): the integer path rounds each numerator in the units of the largest weight a head gives,
    not of the largest scale in the chunk, so the rows that matter keep their 15 bits."""
    q, k, v, ks, vs, m = rows_case(9, 3, 64, 384, 300)
    vs[:, 10] *= larger
    m[10] = -40.0
    got = native_attention.reference(q, k, v, m, 3, 64, 1, int8_dot=int8_dot, key_scales=ks, value_scales=vs)
    expected = numpy_attention(q, dequantized(k, ks, 3, 64), dequantized(v, vs, 3, 64), m, 3, 64)
    np.testing.assert_allclose(got, expected, atol=2e-3 * np.abs(expected).max(), rtol=1e-4)


@pytest.mark.parametrize("int8_dot", [True, False], ids=["integer dot products", "codes widened to floats"])
def test_int8_rows_form_attends_to_zero_rows_as_zeros(int8_dot):
    """Rows the graph stored as zeros have scale 0: their values add nothing, and nothing is NaN."""
    q, k, v, ks, vs, m = rows_case(9, 3, 64, 384, 300)
    vs[...] = 0.0
    got = native_attention.reference(q, k, v, m, 3, 64, 2, int8_dot=int8_dot, key_scales=ks, value_scales=vs)
    assert np.all(got == 0.0)


def test_int8_rows_form_takes_both_scales_that_fit_the_cache():
    q, k, v, ks, vs, m = rows_case(9, 3, 64, 64, 40)
    with pytest.raises(ValueError, match="together"):
        native_attention.reference(q, k, v, m, 3, 64, key_scales=ks)
    with pytest.raises(ValueError, match="do not fit"):
        native_attention.reference(q, k, v, m, 3, 64, key_scales=ks[:, :32], value_scales=vs[:, :32])
    with pytest.raises(ValueError, match="int8 codes"):
        native_attention.reference(q, k.astype(np.float32), v.astype(np.float32), m, 3, 64, key_scales=ks,
                                   value_scales=vs)


@pytest.mark.skipif(not native_attention.available() or not native_attention.int8_dot_available(),
                    reason="this CPU has no AVX-512 VNNI")
def test_int8_caches_use_integer_dot_products_where_the_cpu_has_them():
    """Where the CPU has them the int8 form multiplies the codes as integers: not the float path's
    arithmetic (the query and numerators are rounded), and close to it."""
    q, k, v, m = int8_case(9, 3, 64, 700, 650)
    integer = native_attention.reference(q, k, v, m, 3, 64, int8_dot=True)
    widened = native_attention.reference(q, k, v, m, 3, 64, int8_dot=False)
    assert not np.array_equal(integer, widened)
    np.testing.assert_allclose(integer, widened, atol=0.05, rtol=1e-4)


@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", [
    (9, 3, 64, 384, 300, None),   # SmolLM2's heads
    (4, 1, 256, 128, 128, None),  # Gemma 3 270M's heads
    (8, 2, 128, 1024, 900, 500),  # head_dim 128, a window that starts inside a chunk
    (6, 6, 16, 32, 20, None),     # a head_dim without a vector path (element by element)
    (9, 3, 64, 1200, 1153, None),  # several chunks, the last of one slot
])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_f16_form_matches_numpy_on_the_halves(heads, kv_heads, head_dim, slots, live, window, threads):
    """A float16 cache is widened exactly: the result is the float one on the rounded values."""
    q, k, v, m = case(heads, kv_heads, head_dim, slots, live, window)
    k, v = k.astype(np.float16), v.astype(np.float16)
    k[0, :4] = [6e-8, -3e-6, 65504, -0.0]  # subnormal halves, the largest half, a negative zero
    got = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads)
    want = numpy_attention(q, k.astype(np.float32), v.astype(np.float32), m, kv_heads, head_dim)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache", ["float32", "int8", "float16"])
def test_the_result_does_not_depend_on_the_thread_count(cache):
    """The live span is cut in the same chunks whichever thread takes them, and merged in order."""
    q, k, v, m = int8_case(9, 3, 64, 2048, 2000) if cache == "int8" else case(9, 3, 64, 2048, 2000)
    if cache == "float16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    one, two = (native_attention.reference(q, k, v, m, 3, 64, threads) for threads in (1, 2))
    assert np.array_equal(one, two)


def test_keys_and_values_must_share_a_dtype():
    q, k, v, m = case(4, 2, 16, 32, 10)
    for other in (np.int8, np.float16):
        with pytest.raises(ValueError, match="one dtype"):
            native_attention.reference(q, k.astype(other), v, m, 2, 16)


def test_a_fully_masked_row_attends_to_nothing():
    q, k, v, m = case(4, 2, 16, 32, 0)
    assert not np.any(native_attention.reference(q, k, v, m, 2, 16))


def test_mask_values_are_added_to_the_scores():
    """A soft bias in the mask (not only 0 / masked) shifts the softmax like in the graph form."""
    q, k, v, m = case(4, 2, 16, 32, 32)
    m[:] = np.linspace(-3, 0, 32, dtype=np.float32)
    got = native_attention.reference(q, k, v, m, 2, 16)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, m, 2, 16), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("int8_dot", [True, False], ids=["integer dot products", "codes widened to floats"])
def test_the_int8_form_adds_soft_masks_and_skips_masked_holes(int8_dot):
    """Biases and masked slots inside the live span (a block table's gaps) in every 16-slot block
    and across chunks: the integer path adds the mask where it scores, and its maxima skip the holes."""
    q, k, v, m = int8_case(9, 3, 64, 700, 661)
    m[:661] = np.linspace(-4, 1, 661, dtype=np.float32)
    m[5:600:7] = MASKED
    got = native_attention.reference(q, k, v, m, 3, 64, threads=2, int8_dot=int8_dot)
    expected = numpy_attention(q, k.astype(np.float64), v.astype(np.float64), m, 3, 64)
    np.testing.assert_allclose(got, expected, atol=0.05 if int8_dot else 2e-3, rtol=1e-4)


def test_shapes_that_do_not_group_are_refused():
    q, k, v, m = case(4, 3, 16, 32, 8)  # 4 query heads over 3 KV heads
    with pytest.raises(ValueError, match="rejected the shapes"):
        native_attention.reference(q, k[:, :48], v[:, :48], m, 3, 16)


@pytest.fixture
def attention_model(tmp_path):
    """A TFLite model of two layers' custom op calls, compiled with the kernel registered."""
    from litekv import litert_capi
    from litekv.converters.tflite_writer import TFLiteModelWriter

    heads, kv_heads, head_dim, slots = 9, 3, 64, 256
    writer = TFLiteModelWriter()
    sg = writer.add_signature("run")
    query = sg.add_input("query", (1, 1, heads * head_dim))
    mask = sg.add_input("mask", (1, 1, 1, slots))
    for layer in range(2):
        keys = sg.add_input(f"k{layer}", (1, slots, kv_heads * head_dim))
        values = sg.add_input(f"v{layer}", (1, slots, kv_heads * head_dim))
        out = sg.tensor(f"out{layer}", (1, 1, heads * head_dim))
        sg.custom_op(native_attention.OP_NAME, [query, keys, values, mask], [out])
        sg.add_output(f"out{layer}", out)
    writer.write(tmp_path / "attention.tflite")
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, threads=2, litert=litert_capi.library())
    model = litert_capi.CompiledTFLiteModel(tmp_path / "attention.tflite", num_threads=2, custom_ops=[kernel])
    yield model, (heads, kv_heads, head_dim, slots)
    model.close()


def test_the_custom_op_runs_in_litert(attention_model):
    from litekv.litert_capi import HostTensorBuffer, aligned_zeros

    model, (heads, kv_heads, head_dim, slots) = attention_model
    rng = np.random.default_rng(3)
    arrays = {"query": aligned_zeros((1, 1, heads * head_dim)), "mask": aligned_zeros((1, 1, 1, slots))}
    for layer in range(2):
        for kind in "kv":
            arrays[f"{kind}{layer}"] = aligned_zeros((1, slots, kv_heads * head_dim))
    outputs = {f"out{layer}": aligned_zeros((1, 1, heads * head_dim)) for layer in range(2)}
    buffers = {name: HostTensorBuffer(a) for name, a in {**arrays, **outputs}.items()}
    run = model.bind("run", {n: buffers[n] for n in arrays}, {n: buffers[n] for n in outputs})
    for live in (1, 100, slots):  # the same bound buffers, rewritten in place between runs
        for name, a in arrays.items():
            a[...] = rng.standard_normal(a.shape)
        arrays["mask"][...] = MASKED
        arrays["mask"][..., :live] = 0.0
        run()
        for layer in range(2):
            want = numpy_attention(arrays["query"].ravel(), arrays[f"k{layer}"][0], arrays[f"v{layer}"][0],
                                   arrays["mask"].ravel(), kv_heads, head_dim)
            np.testing.assert_allclose(outputs[f"out{layer}"].ravel(), want, atol=2e-5, rtol=1e-4)


def test_a_model_that_needs_the_kernel_is_refused_without_it(monkeypatch):
    """A bundle whose decode runs in the kernel names it in its manifest; without the library the
    executor says what to do instead of LiteRT failing on an unresolved custom op."""
    from conformance import bundle
    from litekv.bundle import BundleError, read_manifest
    from litekv.executor.litert_executor import LiteRTExecutor

    path = bundle("llama", "litert")
    manifest = read_manifest(path)
    assert manifest.decode_attention == "kernel"
    monkeypatch.setattr(native_attention, "_library", None)
    monkeypatch.setattr(native_attention, "_load_error", "not built here")
    with pytest.raises(BundleError, match="not built here. Or reconvert the model with --decode-attention graph "
                       "--prefill-attention graph"):
        LiteRTExecutor(path, manifest)


def test_manifest_versions(tmp_path):
    """Version 3 bundles (before the kernel) read as builtin-op attention, version 5 bundles (before the
    prefill kernel) as builtin-op prefill; unknown versions and kinds are refused with what to do."""
    import json

    from conformance import bundle
    from litekv.bundle import READABLE_VERSIONS, VERSION, BundleError, Manifest

    data = json.loads((bundle("llama", "litert") / "litekv.json").read_text())
    old = {**data, "version": 3}
    old.pop("decode_attention")
    old.pop("prefill_attention")
    assert Manifest.from_json(json.dumps(old), "old").decode_attention == "graph"
    five = {**data, "version": 5}
    five.pop("prefill_attention")
    manifest = Manifest.from_json(json.dumps(five), "five")
    assert (manifest.decode_attention, manifest.prefill_attention, manifest.uses_attention_kernel) == (
        "kernel", "graph", True)
    eight = {**data, "version": 8}
    eight.pop("decode_linears")  # before the linear kernels: XNNPACK's
    assert Manifest.from_json(json.dumps(eight), "eight").decode_linears == "graph"
    nine = {**data, "version": 9}
    nine.pop("decode_model_file")  # before ONNX decode graphs: none
    assert Manifest.from_json(json.dumps(nine), "nine").decode_model_file is None
    readable = ", ".join(map(str, READABLE_VERSIONS))
    with pytest.raises(BundleError, match=f"version {VERSION + 1} is not supported.*reads versions {readable}"):
        Manifest.from_json(json.dumps({**data, "version": VERSION + 1}), "new")
    onnx = json.loads((bundle("llama", "onnx", "int4") / "litekv.json").read_text())
    assert onnx["decode_attention"] == onnx["prefill_attention"] == "kernel" and onnx["decode_model_file"]
    with pytest.raises(BundleError, match="decode steps run litekv's linears needs its decode graph"):
        Manifest.from_json(json.dumps({**onnx, "decode_model_file": None}), "no decode graph")
    # litekv's attention over ONNX Runtime's linears: one graph, no decode graph (version 12 on)
    one_graph = {**onnx, "decode_model_file": None, "decode_linears": "graph"}
    assert Manifest.from_json(json.dumps(one_graph), "one graph").uses_attention_kernel
    with pytest.raises(BundleError, match="separate decode graph is for ONNX bundles whose decode steps run"):
        Manifest.from_json(json.dumps({**onnx, "decode_attention": "graph", "decode_linears": "graph"}), "graph ops")
    with pytest.raises(BundleError, match="attention ops read a float32 or int8 cache, and this one is float16"):
        Manifest.from_json(json.dumps({**onnx, "kv_dtype": "float16"}), "float16 cache")
    assert Manifest.from_json(json.dumps({**onnx, "kv_dtype": "int8"}), "int8").kv_dtype == "int8"  # the Int8 ops
    with pytest.raises(BundleError, match="unknown KV cache dtype 'bfloat16'; reconvert"):
        Manifest.from_json(json.dumps({**data, "kv_dtype": "bfloat16"}), "new")
    six = dict(data)
    six.pop("prefill_attention")
    with pytest.raises(BundleError, match="incomplete \\(no prefill_attention\\); reconvert"):
        Manifest.from_json(json.dumps(six), "six")
    for key in ("decode_attention", "prefill_attention"):
        with pytest.raises(BundleError, match=f"unknown {key} 'gpu'; reconvert"):
            Manifest.from_json(json.dumps({**data, key: "gpu"}), "odd")
    assert data["lm_head_kernel"]  # an fp32 head in litekv's linear (version 16 on), only beside its attention
    with pytest.raises(BundleError, match="LM head in litekv's linear op needs a LiteRT bundle that attends in"):
        Manifest.from_json(json.dumps({**data, "decode_attention": "graph"}), "head without kernel")
    assert not Manifest.from_json(json.dumps({**data, "version": 15}), "fifteen").lm_head_kernel


def test_two_threads_agree_with_one_over_many_calls_of_any_length():
    """The caller and the helper hand chunks over through one ticket: calls of one chunk (the
    helper is not woken) and of many alternate, as a decode step's layers and steps do, and a late
    helper must never take a chunk of the next call. Every call must equal the one-thread result."""
    rng = np.random.default_rng(7)
    slots = 2048
    q, k, v, _ = int8_case(9, 3, 64, slots, slots)
    kernels = [native_attention.AttentionKernel(64, 9, slots, threads) for threads in (1, 2)]
    try:
        for live in rng.integers(1, slots + 1, 300):
            m = np.full(slots, MASKED, np.float32)
            m[:live] = 0.0
            one, two = (kernel.run(q, k, v, m, 3) for kernel in kernels)
            assert np.array_equal(one, two), f"{live} live slots"
    finally:
        for kernel in kernels:
            kernel.release()


def float_chunk_counts(slots: int, lives: tuple[int, ...]) -> int:
    """The chunks a two-thread kernel cuts float-cache calls of these live spans into."""
    q, k, v, _ = case(9, 3, 64, slots, slots)
    kernel = native_attention.AttentionKernel(64, 9, slots, 2)
    try:
        for live in lives:
            m = np.full(slots, MASKED, np.float32)
            m[:live] = 0.0
            kernel.run(q, k, v, m, 3)
        return kernel.stats().chunks
    finally:
        kernel.release()


def test_stats_count_calls_chunks_and_the_helpers_share():
    """The counters a profile reads: every call, its chunks (at most 1,024 slots for an int8 cache,
    two above 192; 192 for a float one), the chunks the helper thread took (none with one thread;
    with two, all chunks are accounted for by the two), and the calls it joined with how late."""
    slots = 2048
    q, k, v, _ = int8_case(9, 3, 64, slots, slots)
    float_chunks = float_chunk_counts(slots, (100, 2048, 700))
    assert float_chunks == 1 + 11 + 4  # 192-slot chunks: a float row is 4x the bytes
    for threads in (1, 2):
        kernel = native_attention.AttentionKernel(64, 9, slots, threads)
        try:
            assert kernel.stats() == native_attention.AttentionStats(0, 0.0, 0, 0, 0, 0.0)
            for live in (100, 2048, 700, 300):
                m = np.full(slots, MASKED, np.float32)
                m[:live] = 0.0
                kernel.run(q, k, v, m, 3)
            stats = kernel.stats()
            assert stats.calls == 4
            assert stats.chunks == 1 + 2 + 2 + 2  # CHUNK_SLOTS and SPLIT_SLOTS in decode_attention.c
            assert stats.seconds > 0 and stats.microseconds_per_call > 0
            assert 0 <= stats.helper_chunks <= stats.chunks
            if threads == 1:
                assert stats.helper_chunks == 0 and stats.helper_share == 0.0
                assert stats.helper_joins == 0 and stats.helper_start_microseconds == 0.0
                assert stats.shared_calls == 0 and stats.wait_microseconds_per_shared_call == 0.0
                assert stats.caller_chunk_seconds == stats.helper_chunk_seconds == 0.0
            else:  # only calls of several chunks are offered to the helper; its counters are in when a call returns
                assert stats.helper_joins <= 3 and (stats.helper_joins > 0) == (stats.helper_chunks > 0)
                assert stats.helper_delay_seconds >= 0.0
                assert stats.shared_calls == 3  # the 2,048-, 700- and 300-slot calls
                # the caller's own chunks and its wait for the helper's lie within its calls
                assert 0.0 < stats.caller_chunk_seconds
                assert stats.caller_chunk_seconds + stats.caller_wait_seconds <= stats.seconds
                assert (stats.helper_chunk_seconds > 0.0) == (stats.helper_joins > 0)
                assert stats.caller_microseconds_per_shared_call == pytest.approx(
                    1e6 * stats.caller_chunk_seconds / 3)
        finally:
            kernel.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names come from /proc")
def test_the_helper_thread_is_named_for_profilers():
    def names():
        return [Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")]

    before = names().count("litekv-attn")
    kernel = native_attention.AttentionKernel(64, 9, 64, 2)
    try:
        q, k, v, m = int8_case(9, 3, 64, 64, 64)
        kernel.run(q, k, v, m, 3)  # the state, and its helper, are made on the first call
        assert names().count("litekv-attn") == before + 1
    finally:
        kernel.release()
    assert names().count("litekv-attn") == before


# ---- the AVX2 path (decode_attention_avx2.c), on x86-64 CPUs with AVX2 and no AVX-512 ----------

def avx2_switch():
    """litekv_decode_avx2_allow, or None where the library has no AVX2 path (not x86-64)."""
    lib = native_attention._load()
    if not hasattr(lib, "litekv_decode_avx2_allow"):
        return None
    lib.litekv_decode_avx2_allow.argtypes = [ctypes.c_int]
    lib.litekv_decode_avx2_allow.restype = ctypes.c_int
    return lib.litekv_decode_avx2_allow


def avx2_runs() -> bool:
    allow = avx2_switch() if native_attention.available() else None
    return bool(allow and allow(1))


avx2_path = pytest.mark.skipif(not avx2_runs(), reason="decode attention takes no AVX2 path on this CPU "
                               "(no AVX2, or AVX-512 takes the portable path's wide vectors)")


@pytest.fixture
def portable_path():
    """Decode attention on the portable path for the test's duration, where the AVX2 path would run."""
    allow = avx2_switch()
    assert allow(0) == 0
    yield
    allow(1)


CACHES = ("float32", "float16", "int8", "int8_rows")


def cache_case(cache, heads, kv_heads, head_dim, slots, live, window=None, seed=0):
    """(query, keys, values, mask, key scales, value scales) in the kernel's form for `cache`, and
    the keys and values numpy attends to (the codes dequantized, the halves widened)."""
    q, k, v, m = case(heads, kv_heads, head_dim, slots, live, window, seed)
    ks = vs = None
    if cache == "float16":
        k, v = k.astype(np.float16), v.astype(np.float16)
        return q, k, v, m, ks, vs, k.astype(np.float64), v.astype(np.float64)
    if cache == "int8":
        rng = np.random.default_rng(seed + 1)
        k, v = (rng.integers(-127, 128, (slots, kv_heads * head_dim), dtype=np.int8) for _ in range(2))
        return q / 64, k, v, m, ks, vs, k.astype(np.float64), v.astype(np.float64)
    if cache == "int8_rows":
        rng = np.random.default_rng(seed + 2)
        k, v = (x * rng.uniform(0.1, 10.0, (slots, 1)).astype(np.float32) for x in (k, v))
        (k, ks), (v, vs) = quantize_rows(k, kv_heads, head_dim), quantize_rows(v, kv_heads, head_dim)
        return (q / 8, k, v, m, ks, vs, dequantized(k, ks, kv_heads, head_dim),
                dequantized(v, vs, kv_heads, head_dim))
    return q, k, v, m, ks, vs, k.astype(np.float64), v.astype(np.float64)


def within_float_rounding(got, expected, cache):
    """The float path's tolerance: float32 arithmetic on the values numpy attends to (int8 codes are
    up to 127, row-scaled ones up to 10x larger)."""
    scale = max(1.0, float(np.abs(expected).max())) if cache.startswith("int8") else 1.0
    np.testing.assert_allclose(got, expected, atol=2e-5 * scale, rtol=1e-4)


AVX2_SHAPES = [
    (9, 3, 64, 301, 301, None),    # SmolLM2's groups of 3: 4-slot blocks, the last of one slot
    (4, 1, 256, 203, 190, 77),     # a group of 4 (2 + 2 heads), head_dim 256, a window
    (8, 2, 128, 450, 433, None),   # two chunks (int8) or three of 192 slots (float), none a multiple of 64
    (9, 3, 64, 4096, 3001, None),  # four chunks of 751 (int8) merged, sixteen of 188 (float)
    (10, 2, 64, 99, 98, 31),       # a group of 5 (3 + 2)
    (6, 6, 64, 77, 77, None),      # no grouping: 8-slot blocks, the last of 5 slots
    (2, 2, 128, 13, 13, None),     # fewer slots than a block
    (4, 4, 32, 41, 37, None),      # head_dim 32: one 32-dimension pass
    (7, 1, 96, 390, 389, 300),     # a group of 7 (3 + 2 + 2), head_dim 96, a window across chunks
]


@avx2_path
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", AVX2_SHAPES)
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_avx2_path_matches_numpy(cache, heads, kv_heads, head_dim, slots, live, window, threads):
    """Every cache type, head dims 32-256 and groups of 1-7 query heads per KV head, spans that end
    inside a block of slots, against float64 numpy on the values the cache holds."""
    q, k, v, m, ks, vs, keys, values = cache_case(cache, heads, kv_heads, head_dim, slots, live, window)
    got = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads, int8_dot=False, key_scales=ks,
                                     value_scales=vs)
    within_float_rounding(got, numpy_attention(q, keys, values, m, kv_heads, head_dim), cache)


@avx2_path
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_avx2_path_adds_soft_masks_and_skips_masked_holes(cache, head_dim):
    """A bias on every slot and masked slots inside the span, in every block and across chunks."""
    q, k, v, m, ks, vs, keys, values = cache_case(cache, 8, 2, head_dim, 900, 861, seed=5)
    m[:861] = np.linspace(-4, 1, 861, dtype=np.float32)
    m[5:800:7] = MASKED
    got = native_attention.reference(q, k, v, m, 2, head_dim, 2, int8_dot=False, key_scales=ks, value_scales=vs)
    within_float_rounding(got, numpy_attention(q, keys, values, m, 2, head_dim), cache)


@avx2_path
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", AVX2_SHAPES[:5])
def test_avx2_path_agrees_with_the_portable_path(portable_path, cache, heads, kv_heads, head_dim, slots, live,
                                                 window):
    """The two paths compute the same sums in another order: they agree to float32 rounding, 10x
    inside numpy's tolerance for the codes (a path that dropped a slot or a scale would not)."""
    q, k, v, m, ks, vs, _, _ = cache_case(cache, heads, kv_heads, head_dim, slots, live, window, seed=3)
    portable = native_attention.reference(q, k, v, m, kv_heads, head_dim, 1, int8_dot=False, key_scales=ks,
                                          value_scales=vs)
    avx2_switch()(1)
    vector = native_attention.reference(q, k, v, m, kv_heads, head_dim, 1, int8_dot=False, key_scales=ks,
                                        value_scales=vs)
    scale = float(np.abs(portable).max())
    np.testing.assert_allclose(vector, portable, atol=1e-5 * scale, rtol=1e-5)


@avx2_path
@pytest.mark.parametrize("cache", ["int8", "int8_rows"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, slots, live, window", AVX2_SHAPES)
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_avx2_integer_path_matches_numpy(cache, heads, kv_heads, head_dim, slots, live, window, threads):
    """With int8_dot the AVX2 path multiplies int8 codes as integers (vpmaddwd): the query in int16
    words and the softmax numerators in 15 bits, over every shape the float path takes. Within a
    twentieth of a code of float64 numpy, and not the widened path's arithmetic (switched to with
    litekv_decode_avx2_allow(2)), so the integer loops did run."""
    q, k, v, m, ks, vs, keys, values = cache_case(cache, heads, kv_heads, head_dim, slots, live, window, seed=7)
    got = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads, int8_dot=True, key_scales=ks,
                                     value_scales=vs)
    expected = numpy_attention(q, keys, values, m, kv_heads, head_dim)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(got, expected, atol=4e-4 * scale, rtol=1e-4)
    avx2_switch()(2)
    try:
        widened = native_attention.reference(q, k, v, m, kv_heads, head_dim, threads, int8_dot=True, key_scales=ks,
                                             value_scales=vs)
    finally:
        avx2_switch()(1)
    within_float_rounding(widened, expected, cache)
    assert not np.array_equal(got, widened)


def head_major_attention(kernel, query, keys, values, lo, hi, cache_type):
    """litekv_attention_head_major (ONNX Runtime's ops' entry): keys and values [KVH, S, D]."""
    lib = native_attention._load()
    lib.litekv_attention_head_major.argtypes = [ctypes.POINTER(native_attention.AttentionConfig),
                                                *[ctypes.c_void_p] * 4, *[ctypes.c_int] * 7, ctypes.c_void_p]
    lib.litekv_attention_head_major.restype = ctypes.c_int
    kv_heads, slots, head_dim = keys.shape
    out = np.empty_like(query)
    status = lib.litekv_attention_head_major(ctypes.byref(kernel.config), query.ctypes.data, keys.ctypes.data,
                                             values.ctypes.data, out.ctypes.data, query.size // head_dim, kv_heads,
                                             slots, head_dim, lo, hi, cache_type, None)
    assert status == 0
    return out


@avx2_path
@pytest.mark.parametrize("cache", ["float32", "int8"])  # the head-major forms ONNX Runtime's ops use
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("lo, hi", [(0, 0), (3, 202), (17, 1000), (0, 1023)])
@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_avx2_path_reads_a_head_major_cache(cache, head_dim, lo, hi, threads):
    """A [KVH][S][D] cache (Job.head_stride S * D): each KV head's rows are their own span, for the
    scores, the weighted values and the prefetches."""
    heads, kv_heads, slots = 9, 3, 1024
    q, k, v, _, _, _, keys, values = cache_case(cache, heads, kv_heads, head_dim, slots, slots, seed=head_dim + lo)
    k, v = (np.ascontiguousarray(x.reshape(slots, kv_heads, head_dim).transpose(1, 0, 2)) for x in (k, v))
    kernel = native_attention.AttentionKernel(head_dim, heads, slots, threads, int8_dot=False)
    try:
        got = head_major_attention(kernel, np.ascontiguousarray(q, np.float32), k, v, lo, hi,
                                   native_attention.KV_FORMATS.index(cache))
    finally:
        kernel.release()
    m = np.full(slots, MASKED, np.float32)
    m[lo:hi + 1] = 0.0
    within_float_rounding(got, numpy_attention(q, keys, values, m, kv_heads, head_dim), cache)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or os.uname().machine != "x86_64",
                    reason="reads x86-64 CPU flags from /proc/cpuinfo")
def test_cpu_paths_follow_the_cpus_instruction_sets():
    """Each kernel family takes the fastest path the CPU has: AVX-512 VNNI, else AVX2 + FMA + F16C,
    else the portable code (a CPU that lost its fast path ran 10-20x slower before it had one)."""
    flags, paths = cpu_flags(), native_attention.cpu_paths()
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= flags
    avx2 = {"avx2", "fma", "f16c"} <= flags
    assert paths["linears"] == ("avx512-vnni" if vnni else "avx2" if avx2 else "portable")
    assert paths["decode_attention"] == ("avx512-vnni" if vnni else "avx2" if avx2 and "avx512f" not in flags
                                         else "vector")
    assert paths["prefill_attention"] == ("avx2" if avx2 and "avx512f" not in flags else "vector")


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_library_without_an_op_form_is_a_missing_dependency(monkeypatch):
    """A library older than the Python side (a form it cannot register) says to reinstall, and the
    half-made kernel is collected without an error of its own."""
    import gc

    from litekv.errors import MissingDependency

    class Outdated:  # every entry point fails, as registering an unknown form does
        def __getattr__(self, name):
            return lambda *args: 1

    monkeypatch.setattr(native_attention, "_load", lambda: Outdated())
    with pytest.raises(MissingDependency, match="reinstall litekv"):
        native_attention.AttentionKernel(64, 9, 64, 1)
    gc.collect()
