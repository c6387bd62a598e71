"""litekv's DecodeAttention and PrefillAttention as ONNX Runtime custom ops (kernels/ort_ops.c): RoPE,
the cache write and attention of a step or a prefill chunk over GroupQueryAttention's head-major
float32 cache, against numpy."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from litekv import native_attention
from litekv.converters.emit_onnx import KERNEL_DOMAIN
from litekv.native_attention import AttentionKernel
from test_onnx_linears import kernel_model, session
from test_prefill_attention_kernel import prefill_path  # noqa: F401 (a fixture: the AVX2 and portable paths)

pytestmark = pytest.mark.skipif(not native_attention.available(), reason="the op is litekv's kernel")

INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "cos", "sin")


def attention_model(heads: int, kv_heads: int, slots: int, head_dim: int, packed: bool, rotary_half: int | None,
                    window: int = -1, scale: float | None = 0.125, positions: int = 0, shaped: bool = True,
                    op: str = "DecodeAttention") -> bytes:
    """One DecodeAttention node; absent inputs are empty names, as the converter writes them. Not
    `shaped`: its inputs declare no shapes, so ONNX Runtime leaves every shape check to the op."""
    present = {"key": not packed, "value": not packed, "cos": rotary_half is not None, "sin": rotary_half is not None}
    names = [n if present.get(n, True) else "" for n in INPUTS]
    while not names[-1]:
        names.pop()
    attributes = dict(num_heads=heads, kv_num_heads=kv_heads, local_window_size=window)
    if scale is not None:
        attributes["scale"] = scale
    node = helper.make_node(op, names, ["out", "present_key", "present_value"], domain=KERNEL_DOMAIN,
                            **attributes)
    width = (heads + 2 * kv_heads) * head_dim if packed else heads * head_dim
    cache = [1, kv_heads, slots, head_dim]
    shapes = {"query": [1, "T", width], "key": [1, "T", kv_heads * head_dim], "value": [1, "T", kv_heads * head_dim],
              "past_key": cache, "past_value": cache, "seqlens_k": [1], "cos": [positions, rotary_half or 1],
              "sin": [positions, rotary_half or 1]}
    types = {n: (TensorProto.INT32 if n == "seqlens_k" else TensorProto.FLOAT, shapes[n] if shaped else None)
             for n in names if n}
    return one_node(node, types, heads * head_dim, TensorProto.FLOAT, cache)


def one_node(node, inputs: dict, width: int, cache_type: int, cache: list) -> bytes:
    """A model of one attention node: inputs name -> (type, shape), outputs out [1, T, width] and
    present_key / present_value of `cache_type` and shape."""
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "T", width]),
               helper.make_tensor_value_info("present_key", cache_type, cache),
               helper.make_tensor_value_info("present_value", cache_type, cache)]
    return kernel_model(helper.make_graph([node], "attention",
                                          [helper.make_tensor_value_info(n, *t) for n, t in inputs.items()], outputs))


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE over the first 2 * len(cos) elements of the last axis (transformers' rotate_half)."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


def numpy_step(q, k, v, past_k, past_v, position, cos, sin, window, scale):
    """(out [T, H*D], present keys, present values) of T tokens (q [T, H*D], k and v [T, KVH*D]) whose
    last sits at slot `position`, in float64."""
    kv_heads, slots, head_dim = past_k.shape[1:]
    tokens = len(q)
    heads = q.shape[1] // head_dim
    q, k, v = (x.reshape(tokens, -1, head_dim).astype(np.float64) for x in (q, k, v))
    first = position - tokens + 1
    if cos is not None:
        at = slice(first, position + 1)
        q, k = rotate_half(q, cos[at, None], sin[at, None]), rotate_half(k, cos[at, None], sin[at, None])
    keys, values = past_k[0].astype(np.float64), past_v[0].astype(np.float64)
    keys[:, first:position + 1], values[:, first:position + 1] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    out = np.empty((tokens, heads, head_dim))
    for t in range(tokens):
        last = first + t
        lo = 0 if window < 0 else max(0, last - window + 1)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = keys[kv, lo:last + 1] @ q[t, h] * scale
            weights = np.exp(scores - scores.max())
            out[t, h] = weights @ values[kv, lo:last + 1] / weights.sum()
    return out.reshape(tokens, -1), keys[None], values[None]


def operands(rng, heads, kv_heads, slots, head_dim, rotary_half, tokens=1):
    q = rng.normal(size=(tokens, heads * head_dim)).astype(np.float32)
    k, v = (rng.normal(size=(tokens, kv_heads * head_dim)).astype(np.float32) for _ in range(2))
    past_k, past_v = (rng.normal(size=(1, kv_heads, slots, head_dim)).astype(np.float32) for _ in range(2))
    cos = sin = None
    if rotary_half:
        angles = np.arange(slots)[:, None] * (1e-4 ** (np.arange(rotary_half) / rotary_half))[None]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return q, k, v, past_k, past_v, cos, sin


def feeds(q, k, v, past_k, past_v, position, cos, sin, packed):
    query = np.concatenate([q, k, v], axis=1) if packed else q
    out = {"query": query[None], "past_key": past_k, "past_value": past_v, "seqlens_k": np.array([position], np.int32)}
    if not packed:
        out |= {"key": k[None], "value": v[None]}
    if cos is not None:
        out |= {"cos": cos, "sin": sin}
    return out


@pytest.mark.parametrize("head_dim, rotary_half", [(64, 32), (128, 64), (64, 16), (48, 24), (64, None)],
                         ids=["d64", "d128", "partial-rotary", "d48-portable", "no-rotary"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_matches_numpy(head_dim, rotary_half, packed, threads):
    """Contexts inside one chunk and across several (192 slots a chunk), with and without a window;
    a plain run's present is a copy of past with the step's row written, past left as it was."""
    heads, kv_heads, slots = 9, 3, 1024
    rng = np.random.default_rng(head_dim + threads)
    kernel = AttentionKernel(head_dim, heads, slots, threads=threads)
    for position, window in ((0, -1), (37, -1), (700, -1), (700, 100), (1023, 512)):
        model = session(attention_model(heads, kv_heads, slots, head_dim, packed, rotary_half, window,
                                        positions=slots), kernel)
        q, k, v, past_k, past_v, cos, sin = operands(rng, heads, kv_heads, slots, head_dim, rotary_half)
        before = past_k.copy()
        out, present_k, present_v = model.run(None, feeds(q, k, v, past_k, past_v, position, cos, sin, packed))
        want, want_k, want_v = numpy_step(q, k, v, past_k, past_v, position, cos, sin, window, 0.125)
        np.testing.assert_allclose(out[0], want, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(present_k, want_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(present_v, want_v.astype(np.float32))
        np.testing.assert_array_equal(past_k, before)


@pytest.mark.parametrize("head_dim, rotary_half", [(64, 32), (128, 64), (64, 16), (48, 24), (256, 128), (40, 20)],
                         ids=["d64", "d128", "partial-rotary", "d48", "d256", "d40"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate"])
def test_a_prefill_chunk_matches_numpy(prefill_path, head_dim, rotary_half, packed):
    """Chunks of 1 to 100 tokens at the start of the cache and after it, causal, with and without a
    window; each token attends to the chunk's earlier rows as written by the op itself. On the
    prefill kernel's AVX2 path (where the CPU takes it) and its portable one."""
    heads, kv_heads, slots = 9, 3, 512
    rng = np.random.default_rng(head_dim)
    kernel = AttentionKernel(head_dim, heads, slots, threads=2)
    for tokens, position, window in ((1, 0, -1), (7, 6, -1), (100, 99, -1), (64, 300, -1), (100, 400, 40),
                                     (48, 511, 512)):
        model = session(attention_model(heads, kv_heads, slots, head_dim, packed, rotary_half, window,
                                        positions=slots, op="PrefillAttention"), kernel)
        q, k, v, past_k, past_v, cos, sin = operands(rng, heads, kv_heads, slots, head_dim, rotary_half, tokens)
        out, present_k, present_v = model.run(None, feeds(q, k, v, past_k, past_v, position, cos, sin, packed))
        want, want_k, want_v = numpy_step(q, k, v, past_k, past_v, position, cos, sin, window, 0.125)
        np.testing.assert_allclose(out[0], want, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(present_k, want_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(present_v, want_v.astype(np.float32))


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_token_prefill_calls_share_their_chunks_with_the_sessions_pool(int8, threads):
    """A bundle whose steps run its prefill graph (ONNX Runtime's own linears) attends one token in
    PrefillAttention: the decode kernel's chunks, taken by the session's pool instead of litekv's
    helper thread, give numpy's answer at every context, and the helper computes none of them."""
    heads, kv_heads, slots, head_dim, half = 9, 3, 2048, 64, 32
    rng = np.random.default_rng(threads + 2 * int8)
    kernel = AttentionKernel(head_dim, heads, slots, threads=2)
    if int8:
        graph = int8_model(heads, kv_heads, slots, head_dim, half, op="PrefillAttentionInt8")
    else:
        graph = attention_model(heads, kv_heads, slots, head_dim, True, half, positions=slots, op="PrefillAttention")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    model = kernel.onnx_session(graph, options)
    before = kernel.stats()
    for position in (0, 191, 700, 2047):  # one chunk, then 4 to 11 (192 float32 slots a chunk; int8: 2)
        q, k, v, past_k, past_v, cos, sin = operands(rng, heads, kv_heads, slots, head_dim, half)
        query = np.concatenate([q, k, v], axis=1)
        if int8:
            scale = np.full((1, kv_heads, 1, head_dim), 0.02, np.float32)
            past_k, past_v = (rng.integers(-127, 128, past_k.shape).astype(np.int8) for _ in range(2))
            feed = {"query": query[None], "past_key": past_k, "past_value": past_v, "cos": cos, "sin": sin,
                    "seqlens_k": np.array([position], np.int32), "k_scale": scale, "v_scale": scale}
        else:
            feed = feeds(q, k, v, past_k, past_v, position, cos, sin, True)
        out, present_k, present_v = model.run(None, feed)
        keys, values = (present_k * 0.02, present_v * 0.02) if int8 else (present_k, present_v)
        q_rot = rotate_half(q.reshape(heads, head_dim), cos[position], sin[position]).reshape(1, -1)
        want, _, _ = numpy_step(q_rot, keys[0, :, position].reshape(1, -1), values[0, :, position].reshape(1, -1),
                                keys, values, position, None, None, -1, 0.125)
        np.testing.assert_allclose(out[0], want, rtol=2e-4, atol=2e-3 * 127 * 0.02 if int8 else 2e-5)
    done = kernel.stats() - before
    assert done.calls == 4 and done.chunks == (1 + 1 + 2 + 2 if int8 else 1 + 1 + 4 + 11)
    for _ in range(30):  # back to back, as a model's layers call it: the pool's worker takes chunks
        model.run(None, feed)
    done = kernel.stats() - before
    assert done.helper_chunks == 0
    assert (done.pool_chunks > 0) == (threads == 2)


def test_a_step_takes_one_token():
    kernel = AttentionKernel(64, 4, 64, threads=1)
    model = session(attention_model(4, 2, 64, 64, True, 32, positions=64), kernel)
    q, k, v, past_k, past_v, cos, sin = operands(np.random.default_rng(6), 4, 2, 64, 64, 32, tokens=2)
    with pytest.raises(Exception, match="T = 1 for DecodeAttention"):
        model.run(None, feeds(q, k, v, past_k, past_v, 5, cos, sin, True))


def test_present_bound_to_past_is_written_in_place():
    """Bound as litekv's executor binds them, the step writes one row into the caller's buffers."""
    heads, kv_heads, slots, head_dim = 4, 2, 64, 64
    kernel = AttentionKernel(head_dim, heads, slots, threads=2)
    model = session(attention_model(heads, kv_heads, slots, head_dim, True, 32, positions=slots), kernel)
    q, k, v, past_k, past_v, cos, sin = operands(np.random.default_rng(3), heads, kv_heads, slots, head_dim, 32)
    want, want_k, want_v = numpy_step(q, k, v, past_k, past_v, 20, cos, sin, -1, 0.125)
    want = want.reshape(-1)
    io = model.io_binding()
    for name, value in feeds(q, k, v, past_k, past_v, 20, cos, sin, True).items():
        io.bind_cpu_input(name, value)
    for kind, buffer in (("key", past_k), ("value", past_v)):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        io.bind_ortvalue_input(f"past_{kind}", value)
        io.bind_ortvalue_output(f"present_{kind}", value)
    out = np.zeros((1, 1, heads * head_dim), np.float32)
    io.bind_ortvalue_output("out", ort.OrtValue.ortvalue_from_numpy(out))
    model.run_with_iobinding(io)
    np.testing.assert_allclose(out.reshape(-1), want, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(past_k, want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(past_v, want_v.astype(np.float32))


def test_calls_outside_the_cache_or_with_disagreeing_shapes_are_refused():
    heads, kv_heads, slots, head_dim = 4, 2, 64, 64
    kernel = AttentionKernel(head_dim, heads, slots, threads=1)
    model = session(attention_model(heads, kv_heads, slots, head_dim, False, 32, shaped=False), kernel)
    q, k, v, past_k, past_v, cos, sin = operands(np.random.default_rng(5), heads, kv_heads, slots, head_dim, 32)
    for position in (-1, slots):
        with pytest.raises(Exception, match="outside the cache"):
            model.run(None, feeds(q, k, v, past_k, past_v, position, cos, sin, False))
    with pytest.raises(Exception, match="shapes disagree"):
        model.run(None, feeds(q, k[:, :head_dim], v[:, :head_dim], past_k, past_v, 3, cos, sin, False))
    with pytest.raises(Exception, match="outside the cache"):  # RoPE tables shorter than the cache
        model.run(None, feeds(q, k, v, past_k, past_v, 40, cos[:32], sin[:32], False))
    wide = AttentionKernel(32, heads, slots, threads=1)  # a head_dim other than the bundle's
    other = session(attention_model(heads, kv_heads, slots, head_dim, False, 32, shaped=False), wide)
    with pytest.raises(Exception, match="refused the call"):
        other.run(None, feeds(q, k, v, past_k, past_v, 3, cos, sin, False))
    with pytest.raises(Exception, match="scale"):
        session(attention_model(heads, kv_heads, slots, head_dim, False, 32, scale=None, positions=slots), kernel)
    with pytest.raises(Exception, match="multiple of kv_num_heads"):
        session(attention_model(heads, 3, slots, head_dim, False, 32, positions=slots), kernel)


def int8_model(heads: int, kv_heads: int, slots: int, head_dim: int, rotary_half: int, window: int = -1,
               op: str = "DecodeAttentionInt8", key_blocks: int | None = None) -> bytes:
    """One DecodeAttentionInt8 (or PrefillAttentionInt8) node over an int8 cache with per-channel
    scales, q/k/v packed; `key_blocks` its attribute, if given."""
    names = ["query", "", "", "past_key", "past_value", "seqlens_k", "cos", "sin", "k_scale", "v_scale"]
    blocks = {} if key_blocks is None else {"key_blocks": key_blocks}
    node = helper.make_node(op, names, ["out", "present_key", "present_value"],
                            domain=KERNEL_DOMAIN, num_heads=heads, kv_num_heads=kv_heads, local_window_size=window,
                            scale=0.125, **blocks)
    cache, scales = [1, kv_heads, slots, head_dim], [1, kv_heads, 1, head_dim]
    types = {"query": (TensorProto.FLOAT, [1, "T", (heads + 2 * kv_heads) * head_dim]),
             "past_key": (TensorProto.INT8, cache), "past_value": (TensorProto.INT8, cache),
             "seqlens_k": (TensorProto.INT32, [1]), "cos": (TensorProto.FLOAT, [slots, rotary_half]),
             "sin": (TensorProto.FLOAT, [slots, rotary_half]), "k_scale": (TensorProto.FLOAT, scales),
             "v_scale": (TensorProto.FLOAT, scales)}
    return one_node(node, types, heads * head_dim, TensorProto.INT8, cache)


@pytest.mark.parametrize("head_dim", [64, 48], ids=["d64", "d48-portable"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("int8_dot", [True, False], ids=["integer dot products", "codes widened to floats"])
def test_an_int8_step_matches_numpy_on_the_dequantized_cache(head_dim, threads, int8_dot):
    """The step's rows are quantized with the cache's scales (to the nearest code, saturated), and
    the query attends to codes x scales: numpy on the dequantized cache. Contexts in one chunk and
    several, with a window; the integer path (d64 on a CPU with VNNI or AVX2) within its rounding."""
    heads, kv_heads, slots, half = 9, 3, 1024, head_dim // 2
    rng = np.random.default_rng(head_dim + 10 * threads)
    kernel = AttentionKernel(head_dim, heads, slots, threads=threads, int8_dot=int8_dot)
    integer = int8_dot and head_dim % 64 == 0 and native_attention.int8_dot_available()
    for position, window in ((0, -1), (150, -1), (900, -1), (900, 256)):
        model = session(int8_model(heads, kv_heads, slots, head_dim, half, window), kernel)
        q, k, v, _, _, cos, sin = operands(rng, heads, kv_heads, slots, head_dim, half)
        k_scale, v_scale = ((rng.random((1, kv_heads, 1, head_dim)) * 0.02 + 0.01).astype(np.float32) for _ in range(2))
        past_k, past_v = (rng.integers(-127, 128, (1, kv_heads, slots, head_dim)).astype(np.int8) for _ in range(2))
        before = past_k.copy()
        feeds_ = {"query": np.concatenate([q, k, v], axis=1)[None], "past_key": past_k, "past_value": past_v,
                  "seqlens_k": np.array([position], np.int32), "cos": cos, "sin": sin, "k_scale": k_scale,
                  "v_scale": v_scale}
        out, present_k, present_v = model.run(None, feeds_)
        k_rot = rotate_half(k.reshape(kv_heads, head_dim), cos[position], sin[position])
        want_k = np.clip(np.rint(k_rot / k_scale[0, :, 0]), -128, 127).astype(np.int8)
        want_v = np.clip(np.rint(v.reshape(kv_heads, head_dim) / v_scale[0, :, 0]), -128, 127).astype(np.int8)
        assert np.abs(present_k[0, :, position].astype(int) - want_k).max() <= 1  # x / scale at a .5 may round apart
        assert np.abs(present_v[0, :, position].astype(int) - want_v).max() <= 1
        np.testing.assert_array_equal(np.delete(present_k, position, axis=2), np.delete(before, position, axis=2))
        # the reference attends to what the op wrote, dequantized; RoPE already in the cache's keys
        keys = present_k.astype(np.float32) * k_scale
        values = present_v.astype(np.float32) * v_scale
        q_rot = rotate_half(q.reshape(heads, head_dim), cos[position], sin[position]).reshape(1, -1)
        want, _, _ = numpy_step(q_rot, keys[0, :, position].reshape(1, -1), values[0, :, position].reshape(1, -1),
                                keys, values, position, None, None, window, 0.125)
        atol = 2e-3 * 127 * float(v_scale.max()) if integer else 2e-5  # as test_decode_attention_kernel's
        np.testing.assert_allclose(out[0], want, rtol=2e-4, atol=atol)


def test_int8_scales_of_the_wrong_size_are_refused():
    kernel = AttentionKernel(64, 4, 64, threads=1)
    model = onnx.load_from_string(int8_model(4, 2, 64, 64, 32))
    for value in model.graph.input:  # no declared shapes: the op's own check
        value.type.tensor_type.ClearField("shape")
    rng = np.random.default_rng(8)
    q, k, v, _, _, cos, sin = operands(rng, 4, 2, 64, 64, 32)
    feeds_ = {"query": np.concatenate([q, k, v], axis=1)[None], "past_key": np.zeros((1, 2, 64, 64), np.int8),
              "past_value": np.zeros((1, 2, 64, 64), np.int8), "seqlens_k": np.array([3], np.int32), "cos": cos,
              "sin": sin, "k_scale": np.ones((1, 2, 1, 32), np.float32), "v_scale": np.ones((1, 2, 1, 64), np.float32)}
    with pytest.raises(Exception, match="int8 scales"):
        session(model.SerializeToString(), kernel).run(None, feeds_)


@pytest.mark.parametrize("tokens, position, window", [(7, 6, -1), (100, 99, -1), (64, 300, -1), (100, 400, 40),
                                                     (53, 52, 17), (37, 511, -1)])
def test_an_int8_prefill_chunk_matches_numpy_on_the_dequantized_cache(prefill_path, tokens, position, window):
    """PrefillAttentionInt8: the chunk's rows quantized with the cache's scales, each token attending
    causally (and in its window) to codes x scales, the chunk's own rows as the op wrote them; on
    the prefill kernel's AVX2 path (the value scales applied to its output rows) and its portable one."""
    heads, kv_heads, slots, head_dim, half = 9, 3, 512, 64, 32
    rng = np.random.default_rng(tokens + position)
    kernel = AttentionKernel(head_dim, heads, slots, threads=2)
    model = session(int8_model(heads, kv_heads, slots, head_dim, half, window, op="PrefillAttentionInt8"), kernel)
    q, k, v, _, _, cos, sin = operands(rng, heads, kv_heads, slots, head_dim, half, tokens)
    k_scale, v_scale = ((rng.random((1, kv_heads, 1, head_dim)) * 0.02 + 0.01).astype(np.float32) for _ in range(2))
    past_k, past_v = (rng.integers(-127, 128, (1, kv_heads, slots, head_dim)).astype(np.int8) for _ in range(2))
    out, present_k, present_v = model.run(None, {
        "query": np.concatenate([q, k, v], axis=1)[None], "past_key": past_k, "past_value": past_v,
        "seqlens_k": np.array([position], np.int32), "cos": cos, "sin": sin, "k_scale": k_scale, "v_scale": v_scale})
    first = position - tokens + 1
    at = slice(first, position + 1)
    k_rot = rotate_half(k.reshape(tokens, kv_heads, head_dim), cos[at, None], sin[at, None])
    want_k = np.clip(np.rint(k_rot / k_scale[0, :, 0]), -128, 127)
    assert np.abs(present_k[0, :, at].transpose(1, 0, 2) - want_k).max() <= 1
    keys, values = present_k.astype(np.float32) * k_scale, present_v.astype(np.float32) * v_scale
    q_rot = rotate_half(q.reshape(tokens, heads, head_dim), cos[at, None], sin[at, None]).reshape(tokens, -1)
    rows = lambda cache: cache[0, :, at].transpose(1, 0, 2).reshape(tokens, -1)
    want, _, _ = numpy_step(q_rot, rows(keys), rows(values), keys, values, position, None, None, window, 0.125)
    np.testing.assert_allclose(out[0], want, rtol=2e-4, atol=2e-5)
