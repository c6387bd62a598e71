"""litekv's rope forms of the decode-attention op ("litekv.decode_attention_rope", "..._rope_f16",
"..._rope_int8"): a one-token step hands the op q, k and v as projected; the op applies RoPE and the
scale, writes the step's rows into the cache at its slot (float16 rounded, or int8 codes of static
per-channel scales), and attends (kernels/decode_attention.c). Checked in a compiled TFLite model
against numpy: the rows it writes (float16 and int8 rounding included), the rows it leaves, its
output, and its refusals."""
from __future__ import annotations

import numpy as np
import pytest

from litekv import native_attention
from litekv.errors import BackendError

pytestmark = pytest.mark.skipif(not native_attention.available(), reason="no kernel")

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 9, 3, 64, 96
MASKED = np.float32(-3.4028235e38)


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [N, D] * cos + rotate_half(x) * sin, cos and sin full-width [D] (each half repeated)."""
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[:, half:], x[:, :half]], axis=1) * sin


def numpy_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """q [H, D], keys / values [S, KVH, D] -> [H * D] (query head h reads KV head h // (H / KVH))."""
    group = HEADS // KV_HEADS
    out = []
    for h in range(HEADS):
        scores = keys[:, h // group] @ q[h] + mask
        p = np.exp(scores - scores.max())
        out.append(p @ values[:, h // group] / p.sum())
    return np.concatenate(out)


@pytest.fixture(scope="module", params=["float32", "float16", "int8"])
def rope_model(request, tmp_path_factory):
    """A TFLite model of one rope-form call over a cache of the param's dtype, compiled with the
    kernel registered, and host arrays bound to it."""
    from litekv import litert_capi
    from litekv.converters.tflite_writer import TFLiteModelWriter
    from litekv.litert_capi import HostTensorBuffer, aligned_zeros

    dtype = request.param
    name = native_attention.rope_op_name(dtype)
    shapes = {"query": ((1, 1, HEADS * HEAD_DIM), "float32"), "keys": ((1, SLOTS, KV_HEADS * HEAD_DIM), dtype),
              "values": ((1, SLOTS, KV_HEADS * HEAD_DIM), dtype), "mask": ((1, 1, 1, SLOTS), "float32"),
              "key": ((1, 1, KV_HEADS * HEAD_DIM), "float32"), "value": ((1, 1, KV_HEADS * HEAD_DIM), "float32"),
              "cos": ((1, 1, 1, HEAD_DIM), "float32"), "sin": ((1, 1, 1, HEAD_DIM), "float32"),
              "slot": ((1,), "int32"), "scale": ((1,), "float32")}
    if dtype == "int8":  # the query's factors, the rows' inverse scales, the output's factors
        shapes |= {"scale": ((HEADS * HEAD_DIM,), "float32"), "key_inverse": ((KV_HEADS * HEAD_DIM,), "float32"),
                   "value_inverse": ((KV_HEADS * HEAD_DIM,), "float32"), "out_factor": ((HEADS * HEAD_DIM,), "float32")}
    writer = TFLiteModelWriter()
    sg = writer.add_signature("step")
    inputs = [sg.add_input(n, shape, d) for n, (shape, d) in shapes.items()]
    out = sg.tensor("out", (1, 1, HEADS * HEAD_DIM))
    sg.custom_op(name, inputs, [out])
    sg.add_output("out", out)
    path = tmp_path_factory.mktemp("rope") / "rope.tflite"
    writer.write(path)
    kernel = native_attention.AttentionKernel(HEAD_DIM, HEADS, SLOTS, threads=2, litert=litert_capi.library())
    model = litert_capi.CompiledTFLiteModel(path, num_threads=2, custom_ops=[kernel])
    arrays = {n: aligned_zeros(shape, np.dtype(d)) for n, (shape, d) in shapes.items()}
    result = aligned_zeros((1, 1, HEADS * HEAD_DIM))
    buffers = {n: HostTensorBuffer(a) for n, a in arrays.items()}
    run = model.bind("step", buffers, {"out": HostTensorBuffer(result)})
    yield dtype, arrays, result, run
    model.close()
    kernel.release()


def fill(arrays: dict, slot: int, seed: int, identity: bool = False) -> dict:
    """Random inputs; for an int8 cache, random codes and static scales [KVH * D] ("k", "v"), which it
    returns, with the op's factors made from them as the converter makes them."""
    rng = np.random.default_rng(seed)
    for name in ("query", "keys", "values", "key", "value"):
        if arrays[name].dtype == np.int8:
            arrays[name][...] = rng.integers(-127, 128, arrays[name].shape)
        else:
            arrays[name][...] = rng.standard_normal(arrays[name].shape)
    angles = rng.uniform(-np.pi, np.pi, HEAD_DIM // 2)
    arrays["cos"][...] = 1.0 if identity else np.tile(np.cos(angles), 2)
    arrays["sin"][...] = 0.0 if identity else np.tile(np.sin(angles), 2)
    arrays["mask"][...] = MASKED
    arrays["mask"][..., :slot + 1] = 0.0
    arrays["slot"][0] = slot
    if arrays["keys"].dtype != np.int8:
        arrays["scale"][0] = 0.125
        return {}
    scales = {kind: rng.uniform(0.01, 0.05, KV_HEADS * HEAD_DIM).astype(np.float32) for kind in "kv"}
    per_query_head = {kind: np.repeat(scales[kind].reshape(KV_HEADS, HEAD_DIM), HEADS // KV_HEADS, axis=0).reshape(-1)
                      for kind in "kv"}
    arrays["scale"][...] = per_query_head["k"] * np.float32(0.125)
    arrays["key_inverse"][...] = 1.0 / scales["k"]
    arrays["value_inverse"][...] = 1.0 / scales["v"]
    arrays["out_factor"][...] = per_query_head["v"]
    return scales


def int8_codes(x: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    """What the graph's MUL, ROUND (ties to even), MINIMUM, MAXIMUM and CAST store."""
    return np.clip(np.rint(x.astype(np.float32) * inverse), -127, 127).astype(np.int8)


@pytest.mark.parametrize("slot", [0, 37, SLOTS - 1])
def test_the_op_writes_the_rotated_rows_and_attends_over_them(rope_model, slot):
    dtype, arrays, result, run = rope_model
    scales = fill(arrays, slot, seed=slot)
    before_keys, before_values = arrays["keys"].copy(), arrays["values"].copy()
    cos, sin = arrays["cos"].reshape(-1), arrays["sin"].reshape(-1)
    run()
    key = rotate_half(arrays["key"].reshape(KV_HEADS, HEAD_DIM), cos, sin).reshape(-1)
    value = arrays["value"].reshape(-1)
    if dtype == "int8":  # the rotation's rounding may differ from numpy's by an ulp: a code by one at most
        written = arrays["keys"][0, slot].astype(np.int32)
        want_key = int8_codes(key, arrays["key_inverse"]).astype(np.int32)
        assert np.abs(written - want_key).max() <= 1 and np.mean(written == want_key) > 0.97
        np.testing.assert_array_equal(arrays["values"][0, slot], int8_codes(value, arrays["value_inverse"]))
    else:
        np.testing.assert_allclose(arrays["keys"][0, slot].astype(np.float32), key.astype(dtype).astype(np.float32),
                                   rtol=1e-6 if dtype == "float32" else 1e-3, atol=1e-7)
        np.testing.assert_array_equal(arrays["values"][0, slot], value.astype(dtype))
    others = np.arange(SLOTS) != slot  # every other row as it was
    np.testing.assert_array_equal(arrays["keys"][0, others], before_keys[0, others])
    np.testing.assert_array_equal(arrays["values"][0, others], before_values[0, others])
    q = rotate_half(arrays["query"].reshape(HEADS, HEAD_DIM), cos, sin) * np.float32(0.125)
    keys = arrays["keys"][0].astype(np.float64) * (scales["k"] if scales else 1.0)
    values = arrays["values"][0].astype(np.float64) * (scales["v"] if scales else 1.0)
    want = numpy_attention(q.astype(np.float64), keys.reshape(SLOTS, KV_HEADS, HEAD_DIM),
                           values.reshape(SLOTS, KV_HEADS, HEAD_DIM), arrays["mask"].reshape(-1).astype(np.float64))
    # int8: the kernel rounds the query to 16-bit words and the softmax numerators to 15 bits
    tolerance = {"atol": 2e-3, "rtol": 1e-2} if dtype == "int8" else {"atol": 2e-5, "rtol": 1e-4}
    np.testing.assert_allclose(result.reshape(-1), want, **tolerance)


def test_int8_rows_round_like_the_graph(rope_model):
    """With the identity rotation the op's int8 codes are the graph's bit for bit: products that land
    on a half round to even, and values past the calibrated range clip at +-127."""
    dtype, arrays, result, run = rope_model
    if dtype != "int8":
        pytest.skip("an int8 cache's codes")
    fill(arrays, 9, seed=3, identity=True)
    rng = np.random.default_rng(11)
    arrays["key"][...] = (rng.standard_normal(arrays["key"].shape) * 0.05).astype(np.float32)
    ties = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 127.5, 200.0, -1e9, 0.0], np.float32)
    arrays["key_inverse"][:len(ties)] = 1.0
    arrays["key"].reshape(-1)[:len(ties)] = ties
    arrays["value"][...] = arrays["key"]
    arrays["value_inverse"][...] = arrays["key_inverse"]
    run()
    want = int8_codes(arrays["key"].reshape(-1), arrays["key_inverse"])
    assert want[:len(ties)].tolist() == [0, 2, 2, 0, -2, 126, -126, 127, 127, -127, 0]
    np.testing.assert_array_equal(arrays["keys"][0, 9], want)
    np.testing.assert_array_equal(arrays["values"][0, 9], want)


def test_float16_rows_round_like_a_cast(rope_model):
    """With the identity rotation the key row is the input as the op rounds it: ties to even,
    subnormals, the largest half and overflow to infinity, bit for bit as numpy casts. (Not a zero's
    sign: the library is built with -fno-signed-zeros, and the rotation's sum makes -0 + 0.)"""
    dtype, arrays, result, run = rope_model
    if dtype != "float16":
        pytest.skip("float32 rows are copied")
    fill(arrays, 5, seed=1, identity=True)
    special = np.array([0.0, 1.0, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65504.0, 65519.0, 65520.0, -1e6,
                        2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-30, 5.960464477539063e-08,
                        0.1, -0.1, 1 / 3], np.float32)
    rng = np.random.default_rng(7)
    samples = (rng.standard_normal(KV_HEADS * HEAD_DIM) * 10.0 ** rng.uniform(-9, 4, KV_HEADS * HEAD_DIM))
    samples[:len(special)] = special
    arrays["key"][...] = samples.astype(np.float32).reshape(arrays["key"].shape)
    arrays["value"][...] = arrays["key"]
    run()
    with np.errstate(over="ignore"):  # 65,520 and -1e6 overflow, as they should
        want = arrays["key"].reshape(-1).astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(arrays["keys"][0, 5].view(np.uint16), want)
    np.testing.assert_array_equal(arrays["values"][0, 5].view(np.uint16), want)


@pytest.mark.parametrize("slot", [-1, SLOTS])
def test_a_slot_outside_the_cache_is_refused_before_any_write(rope_model, slot):
    """The op returns an error status without touching the cache. (This LiteRT build does not pass a
    custom op's status on, so the run itself may still return; what matters is that no row moved.)"""
    dtype, arrays, result, run = rope_model
    fill(arrays, 3, seed=2)
    arrays["slot"][0] = slot
    keys, values = arrays["keys"].copy(), arrays["values"].copy()
    try:
        run()
    except BackendError:
        pass
    np.testing.assert_array_equal(arrays["keys"], keys)
    np.testing.assert_array_equal(arrays["values"], values)


def test_an_fp32_head_reads_the_table_in_litekvs_linear_and_keeps_its_pages():
    """An fp32 LiteRT bundle that attends in litekv's kernel runs its LM head's row in litekv's op
    (litekv.linear_f32_screened, with its int8 screen) over the embedding table the GATHER reads (no
    FULLY_CONNECTED over it, so XNNPACK packs no copy), in steps and in prefill chunks; the manifest says so, and the executor gives the model file's pages
    back once after loading, not after every prefill; the logits stay the reference's."""
    from ai_edge_litert import schema_py_generated as schema

    from conformance import reference
    from kv_formats import assert_steps_follow_reference, kv_format_bundle
    from litekv.bundle import read_manifest
    from litekv.executor import open_executor

    bundle = kv_format_bundle("llama", "litert", "fp16")
    manifest = read_manifest(bundle)
    assert manifest.lm_head_kernel and manifest.quantization["lm_head"] == "fp32"
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs((bundle / manifest.model_file).read_bytes(), 0))
    codes = model.operatorCodes
    for sig in model.signatureDefs:
        if sig.signatureKey == b"sampler":
            continue
        graph = model.subgraphs[sig.subgraphIndex]
        heads = [op for op in graph.operators if codes[op.opcodeIndex].customCode == b"litekv.linear_f32_screened"]
        gathers = [op for op in graph.operators if codes[op.opcodeIndex].builtinCode == schema.BuiltinOperator.GATHER
                   and graph.tensors[op.inputs[0]].shape.tolist() == [manifest.config.vocab_size,
                                                                       manifest.config.hidden_size]]
        assert len(heads) == 1 and gathers, sig.signatureKey
        head = graph.tensors[heads[0].inputs[1]]
        assert head.shape.tolist() == [manifest.config.vocab_size, manifest.config.hidden_size]
        if manifest.config.tie_embeddings:  # the same bytes as the embedding table, stored once
            assert head.buffer == graph.tensors[gathers[0].inputs[0]].buffer
        assert not [op for op in graph.operators if codes[op.opcodeIndex].builtinCode ==
                    schema.BuiltinOperator.FULLY_CONNECTED and graph.tensors[op.inputs[1]].buffer == head.buffer]
    ex = open_executor(bundle)
    assert ex.model_pages is not None and ex.model_pages.once
    assert_steps_follow_reference(ex, reference("llama"), 0.01)
    graph_bundle = kv_format_bundle("llama", "litert-graph", "fp16")  # builtin attention: no kernel library
    assert not read_manifest(graph_bundle).lm_head_kernel and not open_executor(graph_bundle).model_pages.once
