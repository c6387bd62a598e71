"""Tests for converters/tflite_writer.py, run on ai_edge_litert's CompiledModel (CPU/XNNPACK).

Besides checking the writer, these tests pin down runtime facts that
converters/LITERT_NOTES.md relies on (in-place KV buffers, zero-copy host
buffers, quantized weights on XNNPACK, C-API cancellation via ctypes).
"""
from __future__ import annotations

import ctypes
import math
import os
import time

import numpy as np
import pytest

from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.compiled_model import (
    CompiledModel,
    CpuOptions,
    HardwareAccelerator,
    Options,
    TensorBuffer,
)
from ai_edge_litert.interpreter import Interpreter
from converters.tflite_writer import (
    PerChannelQuant,
    TFLiteModelWriter,
    pack_int4,
    quantize_blockwise_int4,
    quantize_per_channel_int8,
)

RNG = np.random.default_rng(1234)
_NP = {"float32": np.float32, "float16": np.float16, "int32": np.int32,
       "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


# ----------------------------------------------------------------- helpers


def aligned(shape, dtype, align: int = 64) -> np.ndarray:
    """Zeroed array whose data starts on an ``align`` boundary.

    TensorBuffer.create_from_host_memory silently binds a *copy* when the
    array is not 64-byte aligned, so zero-copy needs this.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def compile_model(path, threads: int = 1, **cpu) -> CompiledModel:
    opts = Options(HardwareAccelerator.CPU, cpu_options=CpuOptions(num_threads=threads, **cpu))
    return CompiledModel.from_file(str(path), options=opts)


def run(cm: CompiledModel, signature: str, **inputs) -> dict[str, np.ndarray]:
    """Runs with runtime-allocated buffers (copying in and out)."""
    in_bufs = {}
    for name, value in inputs.items():
        buf = cm.create_input_buffer_by_name(signature, name)
        buf.write(np.ascontiguousarray(value))
        in_bufs[name] = buf
    details = cm.get_output_tensor_details(signature)
    out_bufs = {n: cm.create_output_buffer_by_name(signature, n) for n in details}
    cm.run_by_name(signature, in_bufs, out_bufs)
    result = {}
    for name, d in details.items():
        shape = tuple(d["shape"])
        result[name] = out_bufs[name].read(int(np.prod(shape)), _NP[d["dtype"]]).reshape(shape)
    return result


def per_call_us(fn, n: int) -> float:
    for _ in range(min(n, 20)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def fc_model(weight_const_fn, x_shape, out_dim, path):
    w = TFLiteModelWriter()
    weight = weight_const_fn(w)
    sg = w.add_signature("main")
    x = sg.add_input("x", x_shape)
    y = sg.tensor("y", (*x_shape[:-1], out_dim))
    sg.op("FULLY_CONNECTED", [x, sg.use(weight), -1], [y], keep_num_dims=True)
    sg.add_output("y", y)
    w.write(path)
    return path


# ------------------------------------------------------------------- tests


def test_fc_add_softmax_matches_numpy(tmp_path):
    W = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal(16).astype(np.float32)
    X = RNG.standard_normal((1, 3, 8)).astype(np.float32)

    w = TFLiteModelWriter()
    weight = w.add_constant(W, "fc.weight")
    sg = w.add_signature("main")
    x = sg.add_input("x", (1, 3, 8))
    h = sg.tensor("h", (1, 3, 16))
    h2 = sg.tensor("h2", (1, 3, 16))
    y = sg.tensor("probs", (1, 3, 16))
    sg.op("FULLY_CONNECTED", [x, sg.use(weight), -1], [h], keep_num_dims=True)
    sg.op("ADD", [h, sg.const(b)], [h2])
    sg.op("SOFTMAX", [h2], [y])  # writer defaults beta to 1.0
    sg.add_output("probs", y)
    path = tmp_path / "tiny.tflite"
    w.write(path)

    z = X @ W.T + b
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)

    cm = compile_model(path)
    assert cm.get_signature_list() == {"main": {"inputs": ["x"], "outputs": ["probs"]}}
    np.testing.assert_allclose(run(cm, "main", x=X)["probs"], ref, rtol=1e-5, atol=1e-6)
    assert cm.is_fully_accelerated()

    interp = Interpreter(model_path=str(path))
    out = interp.get_signature_runner("main")(x=X)["probs"]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_equal_inline_constants_share_one_tensor(tmp_path):
    """Fewer tensors: LiteRT holds an in-memory copy of each one for the life of the model."""
    w = TFLiteModelWriter()
    sg = w.add_signature("main")
    x = sg.add_input("x", (2, 3))
    shape_a, shape_b = sg.const(np.array([3, 2], np.int32)), sg.const(np.array([3, 2], np.int32))
    other = sg.const(np.array([6], np.int32))
    assert shape_a == shape_b and other != shape_a
    assert sg.const(np.array([3, 2], np.int32), name="named") != shape_a  # named constants stay apart
    assert sg.const(np.array([3, 2], np.float32)) != shape_a  # the same values as floats
    zeros = sg.const(np.zeros(2, np.int32))
    assert sg.const(np.zeros(2, np.float32)) != zeros  # the same bytes, another dtype
    assert sg.const(np.array([[3, 2]], np.int32)) != shape_a  # the same bytes, another shape
    y, z = sg.tensor("y", (3, 2)), sg.tensor("z", (6,))
    sg.op("RESHAPE", [x, shape_a], [y])
    sg.op("RESHAPE", [y, other], [z])
    sg.add_output("z", z)
    path = tmp_path / "shared.tflite"
    w.write(path)
    X = RNG.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(run(compile_model(path), "main", x=X)["z"], X.reshape(6))


def test_two_signatures_share_one_weight_buffer(tmp_path):
    W = RNG.standard_normal((256, 128)).astype(np.float32)  # 128 KiB

    def build(signatures):
        w = TFLiteModelWriter()
        weight = w.add_constant(W, "shared.weight")
        for key, rows in signatures:
            sg = w.add_signature(key)
            x = sg.add_input("x", (rows, 128))
            y = sg.tensor("y", (rows, 256))
            sg.op("FULLY_CONNECTED", [x, sg.use(weight), -1], [y])
            sg.add_output("y", y)
        path = tmp_path / f"share{len(signatures)}.tflite"
        return path, w.write(path)

    p1, size1 = build([("decode", 1)])
    p2, size2 = build([("decode", 1), ("prefill_4", 4)])
    print(f"\n1 signature: {size1} B, 2 signatures: {size2} B, weight {W.nbytes} B")
    assert size1 > W.nbytes
    assert size2 - size1 < 4096  # only graph metadata, never a second copy of W

    m = schema.Model.GetRootAs(p2.read_bytes(), 0)
    weight_buffers = {m.Subgraphs(i).Tensors(1).Buffer() for i in range(m.SubgraphsLength())}
    assert len(weight_buffers) == 1

    cm = compile_model(p2)
    for key, rows in [("decode", 1), ("prefill_4", 4)]:
        X = RNG.standard_normal((rows, 128)).astype(np.float32)
        np.testing.assert_allclose(run(cm, key, x=X)["y"], X @ W.T, rtol=1e-4, atol=1e-4)


def _kv_model(path, seq_lens, heads, dim, flat_kv):
    """decode_<S>: writes ``new`` into the cache at ``pos``; output ``kv`` is the cache.

    Inputs bound to numpy host memory must be rank 1 (see the notes), so
    ``pos`` and ``new`` are flat. ``flat_kv`` makes the cache flat too.
    """
    w = TFLiteModelWriter()
    for S in seq_lens:
        sg = w.add_signature(f"decode_{S}")
        pos = sg.add_input("pos", (1,), "int32")
        new = sg.add_input("new", (heads * dim,))
        if flat_kv:
            kv = sg.add_input("kv", (S * heads * dim,))
            start = sg.tensor("start", (1,), "int32")
            sg.op("MUL", [pos, sg.const(np.array([heads * dim], np.int32))], [start])
            out = sg.tensor("kv_out", (S * heads * dim,))
            sg.op("DYNAMIC_UPDATE_SLICE", [kv, new, start], [out])
        else:
            kv = sg.add_input("kv", (1, S, heads, dim))
            new4 = sg.tensor("new4", (1, 1, heads, dim))
            sg.op("RESHAPE", [new, sg.const([1, 1, heads, dim])], [new4])
            zero = sg.const(np.zeros(1, np.int32))
            start = sg.tensor("start", (4,), "int32")
            sg.op("CONCATENATION", [zero, pos, zero, zero], [start], axis=0)
            out = sg.tensor("kv_out", (1, S, heads, dim))
            sg.op("DYNAMIC_UPDATE_SLICE", [kv, new4, start], [out])
        total = sg.tensor("new_sum", (1,))
        sg.op("SUM", [new, sg.const(np.array([0], np.int32))], [total], keep_dims=True)
        sg.add_output("kv", out)  # same name as the input: bind one buffer to both
        sg.add_output("new_sum", total)
    w.write(path)


def test_in_place_kv_update_one_buffer_for_input_and_output(tmp_path):
    S, H, D = 8, 2, 4
    path = tmp_path / "kv.tflite"
    _kv_model(path, [S], H, D, flat_kv=False)
    cm = compile_model(path)
    sig = f"decode_{S}"
    assert cm.get_signature_list()[sig] == {"inputs": ["pos", "new", "kv"],
                                            "outputs": ["kv", "new_sum"]}

    kv = cm.create_input_buffer_by_name(sig, "kv")  # rank-4 runtime buffer
    kv.write(np.zeros((1, S, H, D), np.float32))
    # Small per-step inputs: numpy host memory bound once, then only mutated.
    pos, new, total = aligned((1,), np.int32), aligned((H * D,), np.float32), aligned((1,), np.float32)
    inputs = {"kv": kv,
              "pos": TensorBuffer.create_from_host_memory(pos),
              "new": TensorBuffer.create_from_host_memory(new)}
    outputs = {"kv": kv, "new_sum": TensorBuffer.create_from_host_memory(total)}

    expected = np.zeros((1, S, H, D), np.float32)
    for step in range(5):
        pos[0] = step
        new[:] = RNG.standard_normal(H * D)
        cm.run_by_name(sig, inputs, outputs)
        expected[0, step] = new.reshape(H, D)
        assert total[0] == pytest.approx(new.sum(), rel=1e-5, abs=1e-5)  # host output, no read()
        np.testing.assert_array_equal(kv.read(S * H * D, np.float32).reshape(1, S, H, D), expected)


def test_in_place_kv_on_numpy_memory_and_prefix_view(tmp_path):
    S_MAX, S_SMALL, H, D = 16, 8, 2, 4
    path = tmp_path / "kv_flat.tflite"
    _kv_model(path, [S_MAX, S_SMALL], H, D, flat_kv=True)
    cm = compile_model(path)

    cache = aligned((1, S_MAX, H, D), np.float32)  # allocated once at max capacity
    pos, new, total = aligned((1,), np.int32), aligned((H * D,), np.float32), aligned((1,), np.float32)
    tb_pos, tb_new, tb_total = (TensorBuffer.create_from_host_memory(a) for a in (pos, new, total))
    # Full cache and a zero-copy view of its first S_SMALL positions (contiguous in [1,S,H,D]).
    full = TensorBuffer.create_from_host_memory(cache.reshape(-1))
    prefix_view = cache[:, :S_SMALL].reshape(-1)
    assert np.shares_memory(prefix_view, cache) and prefix_view.ctypes.data % 64 == 0
    prefix = TensorBuffer.create_from_host_memory(prefix_view)

    expected = np.zeros_like(cache)
    for step in range(6):  # short context: the small signature on the prefix view
        pos[0], new[:] = step, step + 1.0
        cm.run_by_name(f"decode_{S_SMALL}", {"kv": prefix, "pos": tb_pos, "new": tb_new},
                       {"kv": prefix, "new_sum": tb_total})
        expected[0, step] = step + 1.0
        np.testing.assert_array_equal(cache, expected)  # numpy sees the update, no read()
    for step in range(6, 12):  # longer context: the big signature on the same memory
        pos[0], new[:] = step, step + 1.0
        cm.run_by_name(f"decode_{S_MAX}", {"kv": full, "pos": tb_pos, "new": tb_new},
                       {"kv": full, "new_sum": tb_total})
        expected[0, step] = step + 1.0
    np.testing.assert_array_equal(cache, expected)


def test_host_memory_buffers_are_rank1_so_nd_inputs_reject_them(tmp_path):
    """Python TensorBuffer.create_from_host_memory always makes a 1-D buffer;
    CompiledModel then refuses it for an input of higher rank (outputs accept it)."""
    path = tmp_path / "kv4.tflite"
    _kv_model(path, [4], 2, 4, flat_kv=False)
    cm = compile_model(path)
    cache = aligned((1, 4, 2, 4), np.float32)
    host = TensorBuffer.create_from_host_memory(cache)
    assert host.get_tensor_details()["shape"] == [cache.size]
    small = {n: TensorBuffer.create_from_host_memory(aligned(s, t))
             for n, s, t in [("pos", (1,), np.int32), ("new", (8,), np.float32)]}
    total = TensorBuffer.create_from_host_memory(aligned((1,), np.float32))
    with pytest.raises(RuntimeError):
        cm.run_by_name("decode_4", {"kv": host, **small}, {"kv": host, "new_sum": total})
    runtime_kv = cm.create_input_buffer_by_name("decode_4", "kv")
    cm.run_by_name("decode_4", {"kv": runtime_kv, **small}, {"kv": host, "new_sum": total})


def test_aliased_dynamic_update_slice_does_not_copy_the_cache(tmp_path):
    S, H, D = 4096, 4, 128  # 8 MiB cache
    path = tmp_path / "kv_big.tflite"
    _kv_model(path, [S], H, D, flat_kv=True)
    cm = compile_model(path)
    sig = f"decode_{S}"
    cache, other = aligned((S * H * D,), np.float32), aligned((S * H * D,), np.float32)
    tb_cache, tb_other = TensorBuffer.create_from_host_memory(cache), TensorBuffer.create_from_host_memory(other)
    small = {"pos": TensorBuffer.create_from_host_memory(aligned((1,), np.int32)),
             "new": TensorBuffer.create_from_host_memory(aligned((H * D,), np.float32))}
    total = TensorBuffer.create_from_host_memory(aligned((1,), np.float32))
    ins = {"kv": tb_cache, **small}
    aliased = per_call_us(lambda: cm.run_by_name(sig, ins, {"kv": tb_cache, "new_sum": total}), 50)
    separate = per_call_us(lambda: cm.run_by_name(sig, ins, {"kv": tb_other, "new_sum": total}), 50)
    print(f"\nDUS on 8 MiB cache: aliased in/out {aliased:.0f} us, separate output {separate:.0f} us")
    assert aliased * 4 < separate


def test_int8_per_channel_fully_connected_on_xnnpack(tmp_path):
    O, I = 96, 256
    W = RNG.standard_normal((O, I)).astype(np.float32)
    X = RNG.standard_normal((2, I)).astype(np.float32)
    q, scales = quantize_per_channel_int8(W, axis=0)
    path = fc_model(lambda w: w.add_constant(q, "w.int8", quant=PerChannelQuant(tuple(scales), axis=0)),
                    (2, I), O, tmp_path / "int8.tflite")
    assert os.path.getsize(path) < W.nbytes / 3

    cm = compile_model(path)
    assert cm.is_fully_accelerated()  # the whole graph went to XNNPACK
    ref = X @ (q.astype(np.float32) * scales[:, None]).T
    out = run(cm, "main", x=X)["y"]
    # XNNPACK quantizes activations dynamically to int8, hence ~1% error.
    assert np.abs(out - ref).max() < 0.02 * np.abs(ref).max()


def test_int4_blockwise_fully_connected_on_xnnpack(tmp_path):
    O, I, BLOCK = 96, 256, 32
    W = RNG.standard_normal((O, I)).astype(np.float32)
    X = RNG.standard_normal((2, I)).astype(np.float32)
    q, scales = quantize_blockwise_int4(W, BLOCK)
    assert scales.dtype == np.float16 and scales.shape == (O, I // BLOCK)
    path = fc_model(lambda w: w.add_blockwise_int4(q, scales, "w.int4", BLOCK),
                    (2, I), O, tmp_path / "int4.tflite")

    m = schema.Model.GetRootAs(path.read_bytes(), 0)
    tensors = {m.Subgraphs(0).Tensors(i).Name().decode(): m.Subgraphs(0).Tensors(i)
               for i in range(m.Subgraphs(0).TensorsLength())}
    t = tensors["w.int4"]
    assert t.Type() == schema.TensorType.INT4
    assert t.Quantization().DetailsType() == schema.QuantizationDetails.BlockwiseQuantization
    assert m.Buffers(t.Buffer()).DataLength() == O * I // 2  # two int4 per byte
    assert tensors["w.int4.scales"].Type() == schema.TensorType.FLOAT16

    cm = compile_model(path)
    assert cm.is_fully_accelerated()
    ref = X @ (q.astype(np.float32) * np.repeat(scales.astype(np.float32), BLOCK, axis=1)).T
    out = run(cm, "main", x=X)["y"]
    assert np.abs(out - ref).max() < 0.02 * np.abs(ref).max()


def test_fp16_weights_via_dequantize_fully_connected(tmp_path):
    W = RNG.standard_normal((64, 32)).astype(np.float32)
    X = RNG.standard_normal((1, 32)).astype(np.float32)
    w = TFLiteModelWriter()
    w16 = w.add_constant(W.astype(np.float16), "w.fp16")
    sg = w.add_signature("main")
    x = sg.add_input("x", (1, 32))
    w32 = sg.tensor("w.fp32", (64, 32))
    sg.op("DEQUANTIZE", [sg.use(w16)], [w32])
    y = sg.tensor("y", (1, 64))
    sg.op("FULLY_CONNECTED", [x, w32, -1], [y])
    sg.add_output("y", y)
    w.write(tmp_path / "fp16.tflite")
    cm = compile_model(tmp_path / "fp16.tflite")
    assert cm.is_fully_accelerated()
    ref = X @ W.astype(np.float16).astype(np.float32).T
    np.testing.assert_allclose(run(cm, "main", x=X)["y"], ref, rtol=1e-4, atol=1e-4)


def test_pack_int4_low_nibble_first():
    np.testing.assert_array_equal(pack_int4(np.array([1, -1, -8, 7, 3])),
                                  np.array([0xF1, 0x78, 0x03], np.uint8))


def test_fully_connected_speed(tmp_path):
    W = RNG.standard_normal((1536, 576)).astype(np.float32)
    # Rank-1 input/output so numpy host memory binds zero-copy (see the notes).
    path = fc_model(lambda w: w.add_constant(W, "w"), (576,), 1536, tmp_path / "fc.tflite")
    x, y = aligned((576,), np.float32), aligned((1536,), np.float32)
    x[:] = RNG.standard_normal(576)
    for threads in (1, 2):
        cm = compile_model(path, threads=threads)
        tx, ty = TensorBuffer.create_from_host_memory(x), TensorBuffer.create_from_host_memory(y)
        us = per_call_us(lambda: cm.run_by_name("main", {"x": tx}, {"y": ty}), 300)
        print(f"\nFULLY_CONNECTED [1,576]x[1536,576]^T fp32, {threads} thread(s): {us:.1f} us/call")
        np.testing.assert_allclose(y, x @ W.T, rtol=1e-4, atol=1e-3)
        assert us < 5000


def test_per_call_overhead_of_trivial_signature(tmp_path):
    w = TFLiteModelWriter()
    sg = w.add_signature("add")
    a = sg.add_input("a", (1,))
    b = sg.tensor("b", (1,))
    sg.op("ADD", [a, a], [b])
    sg.add_output("b", b)
    w.write(tmp_path / "add.tflite")
    cm = compile_model(tmp_path / "add.tflite")
    av, bv = aligned((1,), np.float32), aligned((1,), np.float32)
    ta, tb = TensorBuffer.create_from_host_memory(av), TensorBuffer.create_from_host_memory(bv)
    by_name = per_call_us(lambda: cm.run_by_name("add", {"a": ta}, {"b": tb}), 3000)
    by_index = per_call_us(lambda: cm.run_by_index(0, [ta], [tb]), 3000)
    print(f"\ntrivial signature: run_by_name {by_name:.1f} us, run_by_index {by_index:.1f} us")
    av[0] = 21.0
    cm.run_by_index(0, [ta], [tb])
    assert bv[0] == 42.0
    assert by_name < 200


def test_external_buffer_data_loads_everywhere(tmp_path):
    W = RNG.standard_normal((64, 32)).astype(np.float32)
    q, s = quantize_blockwise_int4(W, 32)
    X = RNG.standard_normal((2, 32)).astype(np.float32)
    w = TFLiteModelWriter()
    dense, int4 = w.add_constant(W, "w"), w.add_blockwise_int4(q, s, "w4")
    sg = w.add_signature("main")
    x = sg.add_input("x", (2, 32))
    for name, const in [("y", dense), ("y4", int4)]:
        y = sg.tensor(name, (2, 64))
        sg.op("FULLY_CONNECTED", [x, sg.use(const), -1], [y])
        sg.add_output(name, y)
    plain, ext = tmp_path / "plain.tflite", tmp_path / "ext.tflite"
    w.write(plain, external_data=False)
    w.write(ext, external_data=True)

    m = schema.Model.GetRootAs(ext.read_bytes(), 0)
    assert all(m.Buffers(i).DataLength() == 0 for i in range(m.BuffersLength()))
    assert any(m.Buffers(i).Offset() > 1 for i in range(m.BuffersLength()))

    ref = run(compile_model(plain), "main", x=X)
    np.testing.assert_allclose(ref["y"], X @ W.T, rtol=1e-5, atol=1e-5)
    for got in (run(compile_model(ext), "main", x=X),
                run(CompiledModel.from_buffer(ext.read_bytes()), "main", x=X),
                Interpreter(model_path=str(ext)).get_signature_runner("main")(x=X)):
        np.testing.assert_allclose(got["y"], ref["y"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["y4"], ref["y4"], rtol=1e-2, atol=1e-2)


def test_write_is_atomic_and_readable(tmp_path):
    path = tmp_path / "m.tflite"
    path.write_bytes(b"old")
    w = TFLiteModelWriter()
    sg = w.add_signature("s")
    x = sg.add_input("x", (1,))
    sg.add_output("x", x)
    size = w.write(path)
    assert path.stat().st_size == size and path.read_bytes()[4:8] == b"TFL3"
    assert (path.stat().st_mode & 0o777) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["m.tflite"]
    assert w.to_bytes() == path.read_bytes()


def test_bad_ops_and_options_are_rejected():
    sg = TFLiteModelWriter().add_signature("s")
    with pytest.raises(ValueError, match="unknown builtin op"):
        sg.op("NOT_AN_OP", [], [])
    with pytest.raises(ValueError, match="no field"):
        sg.op("SOFTMAX", [], [], temperature=2.0)
    with pytest.raises(ValueError, match="takes no options"):
        sg.op("RSQRT", [], [], axis=1)
    with pytest.raises(ValueError, match="dtype"):
        sg.tensor("t", (1,), "complex64")


# --------------------------------------------------------------- op zoo

_A = RNG.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
_B = RNG.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
_erf = np.vectorize(math.erf)

# name: (op, [(input, as_signature_input)], [(out_shape, dtype)], options, reference or None)
_ZOO = {
    "add": ("ADD", [_A, _B], [((2, 3), "float32")], {}, lambda: _A + _B),
    "mul": ("MUL", [_A, _B], [((2, 3), "float32")], {}, lambda: _A * _B),
    "sub": ("SUB", [_A, _B], [((2, 3), "float32")], {}, lambda: _A - _B),
    "div": ("DIV", [_A, _B], [((2, 3), "float32")], {}, lambda: _A / _B),
    "pow": ("POW", [_A, _B], [((2, 3), "float32")], {}, lambda: _A ** _B),
    "maximum": ("MAXIMUM", [_A, _B], [((2, 3), "float32")], {}, lambda: np.maximum(_A, _B)),
    "minimum": ("MINIMUM", [_A, _B], [((2, 3), "float32")], {}, lambda: np.minimum(_A, _B)),
    "rsqrt": ("RSQRT", [_A], [((2, 3), "float32")], {}, lambda: 1 / np.sqrt(_A)),
    "sqrt": ("SQRT", [_A], [((2, 3), "float32")], {}, lambda: np.sqrt(_A)),
    "tanh": ("TANH", [_A], [((2, 3), "float32")], {}, lambda: np.tanh(_A)),
    "logistic": ("LOGISTIC", [_A], [((2, 3), "float32")], {}, lambda: 1 / (1 + np.exp(-_A))),
    "exp": ("EXP", [_A], [((2, 3), "float32")], {}, lambda: np.exp(_A)),
    "square": ("SQUARE", [_A], [((2, 3), "float32")], {}, lambda: _A * _A),
    "neg": ("NEG", [_A], [((2, 3), "float32")], {}, lambda: -_A),
    "sin": ("SIN", [_A], [((2, 3), "float32")], {}, lambda: np.sin(_A)),
    "cos": ("COS", [_A], [((2, 3), "float32")], {}, lambda: np.cos(_A)),
    "gelu": ("GELU", [_A], [((2, 3), "float32")], {}, lambda: 0.5 * _A * (1 + _erf(_A / np.sqrt(2)))),
    "gelu_tanh": ("GELU", [_A], [((2, 3), "float32")], {"approximate": True},
                  lambda: 0.5 * _A * (1 + np.tanh(np.sqrt(2 / np.pi) * (_A + 0.044715 * _A**3)))),
    "softmax": ("SOFTMAX", [_A], [((2, 3), "float32")], {},
                lambda: np.exp(_A) / np.exp(_A).sum(1, keepdims=True)),
    "reshape": ("RESHAPE", [_A, ("const", np.array([3, 2], np.int32))], [((3, 2), "float32")], {},
                lambda: _A.reshape(3, 2)),
    "transpose": ("TRANSPOSE", [_A, ("const", np.array([1, 0], np.int32))], [((3, 2), "float32")], {},
                  lambda: _A.T),
    "concatenation": ("CONCATENATION", [_A, _B], [((2, 6), "float32")], {"axis": 1},
                      lambda: np.concatenate([_A, _B], 1)),
    "gather": ("GATHER", [_A, ("const", np.array([2, 0], np.int32))], [((2, 2), "float32")], {"axis": 1},
               lambda: _A[:, [2, 0]]),
    "slice": ("SLICE", [_A, ("const", np.array([0, 1], np.int32)), ("const", np.array([2, 2], np.int32))],
              [((2, 2), "float32")], {}, lambda: _A[:, 1:3]),
    "strided_slice": ("STRIDED_SLICE", [_A, ("const", np.array([0, 0], np.int32)),
                                        ("const", np.array([2, 3], np.int32)),
                                        ("const", np.array([1, 2], np.int32))],
                      [((2, 2), "float32")], {}, lambda: _A[:, ::2]),
    "dynamic_update_slice": ("DYNAMIC_UPDATE_SLICE", [_A, ("const", np.zeros((1, 2), np.float32)),
                                                      ("const", np.array([1, 1], np.int32))],
                             [((2, 3), "float32")], {},
                             lambda: np.where(np.arange(6).reshape(2, 3) >= 4, 0, _A)),
    "mean": ("MEAN", [_A, ("const", np.array([1], np.int32))], [((2, 1), "float32")], {"keep_dims": True},
             lambda: _A.mean(1, keepdims=True)),
    "sum": ("SUM", [_A, ("const", np.array([0], np.int32))], [((3,), "float32")], {}, lambda: _A.sum(0)),
    "reduce_max": ("REDUCE_MAX", [_A, ("const", np.array([1], np.int32))], [((2,), "float32")], {},
                   lambda: _A.max(1)),
    "arg_max": ("ARG_MAX", [_A, ("const", np.array(1, np.int32))], [((2,), "int32")], {},
                lambda: _A.argmax(1).astype(np.int32)),
    "cast": ("CAST", [_A * 3], [((2, 3), "int32")], {}, lambda: (_A * 3).astype(np.int32)),
    "greater": ("GREATER", [_A, _B], [((2, 3), "bool")], {}, lambda: _A > _B),
    "less": ("LESS", [_A, _B], [((2, 3), "bool")], {}, lambda: _A < _B),
    "select_v2": ("SELECT_V2", [("const", _A > _B), _A, _B], [((2, 3), "float32")], {},
                  lambda: np.where(_A > _B, _A, _B)),
    "topk_v2": ("TOPK_V2", [_A, ("const", np.array(2, np.int32))], [((2, 2), "float32"), ((2, 2), "int32")],
                {}, lambda: np.sort(_A, 1)[:, ::-1][:, :2]),
    "cumsum": ("CUMSUM", [_A, ("const", np.array(1, np.int32))], [((2, 3), "float32")], {},
               lambda: np.cumsum(_A, 1)),
    "broadcast_to": ("BROADCAST_TO", [_A[:1], ("const", np.array([2, 3], np.int32))], [((2, 3), "float32")],
                     {}, lambda: np.broadcast_to(_A[:1], (2, 3))),
    "dequantize_fp16": ("DEQUANTIZE", [_A.astype(np.float16)], [((2, 3), "float32")], {},
                        lambda: _A.astype(np.float16).astype(np.float32)),
    "batch_matmul_adj_y": ("BATCH_MATMUL", [_A[None], _B[None]], [((1, 2, 2), "float32")], {"adj_y": True},
                           lambda: (_A @ _B.T)[None]),
    "fully_connected_keep_dims": ("FULLY_CONNECTED", [_A[None], ("const", _B), -1], [((1, 2, 2), "float32")],
                                  {"keep_num_dims": True}, lambda: (_A @ _B.T)[None]),
    "random_uniform": ("RANDOM_UNIFORM", [("const", np.array([4, 5], np.int32))], [((4, 5), "float32")],
                       {"seed": 1, "seed2": 2}, None),
    "multinomial": ("MULTINOMIAL", [("const", np.log(np.array([[1e-9, 1.0, 1e-9]], np.float32))),
                                    ("const", np.array(4, np.int32))], [((1, 4), "int32")], {}, None),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """All zoo ops as signatures of one model (one subgraph per signature)."""
    w = TFLiteModelWriter()
    feeds = {}
    for key, (op, inputs, outputs, options, _) in _ZOO.items():
        sg = w.add_signature(key)
        idx, feeds[key] = [], {}
        for i, value in enumerate(inputs):
            if isinstance(value, int):
                idx.append(value)
            elif isinstance(value, tuple):
                idx.append(sg.const(value[1]))
            else:
                idx.append(sg.add_input(f"in{i}", value.shape, value.dtype))
                feeds[key][f"in{i}"] = value
        outs = [sg.tensor(f"out{j}", shape, dtype) for j, (shape, dtype) in enumerate(outputs)]
        sg.op(op, idx, outs, **options)
        for j, t in enumerate(outs):
            sg.add_output(f"out{j}", t)
    path = tmp_path_factory.mktemp("zoo") / "zoo.tflite"
    w.write(path)
    return compile_model(path), feeds


@pytest.mark.parametrize("key", list(_ZOO))
def test_op_zoo(zoo, key):
    cm, feeds = zoo
    out = run(cm, key, **feeds[key])["out0"]
    reference = _ZOO[key][4]
    if reference is not None:
        np.testing.assert_allclose(out, reference(), rtol=1e-5, atol=1e-5)
    elif key == "random_uniform":
        assert out.shape == (4, 5) and 0 <= out.min() and out.max() < 1 and out.std() > 0
    elif key == "multinomial":
        np.testing.assert_array_equal(out, np.ones((1, 4), np.int32))


# ------------------------------------------------------- C-API cancellation


def test_c_api_cancellation_via_ctypes(tmp_path):
    """libLiteRt.so exports the C API; driving it with ctypes gives rank-N
    zero-copy host buffers and LiteRtSetCompiledModelCancellationFunction."""
    import ai_edge_litert

    so = os.path.join(os.path.dirname(ai_edge_litert.__file__), "libLiteRt.so")
    if not os.path.exists(so):
        pytest.skip("libLiteRt.so not shipped")
    lib = ctypes.CDLL(so)
    if not hasattr(lib, "LiteRtSetCompiledModelCancellationFunction"):
        pytest.skip("cancellation symbol not exported")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t

    w = TFLiteModelWriter()
    sg = w.add_signature("main")
    h = sg.add_input("x", (1, 4, 8))
    axis = sg.const(np.array(2, np.int32))
    for i in range(20):  # many non-delegated ops: cancellation is checked between ops
        y = sg.tensor(f"y{i}", (1, 4, 8))
        sg.op("CUMSUM", [h, axis], [y])
        h = y
    sg.add_output("y", h)
    path = tmp_path / "cancel.tflite"
    w.write(path)

    def ok(status):
        assert status == 0, f"LiteRt status {status}"

    env, model, opts, cm, sig = vp(), vp(), vp(), vp(), vp()
    ok(lib.LiteRtCreateEnvironment(0, None, ctypes.byref(env)))
    ok(lib.LiteRtCreateModelFromFile(env, str(path).encode(), ctypes.byref(model)))
    ok(lib.LiteRtCreateOptions(ctypes.byref(opts)))
    ok(lib.LiteRtSetOptionsHardwareAccelerators(opts, 1))  # kLiteRtHwAcceleratorCpu
    ok(lib.LiteRtCreateCompiledModel(env, model, opts, ctypes.byref(cm)))
    ok(lib.LiteRtGetModelSignature(model, sz(0), ctypes.byref(sig)))

    def host_buffer(getter, array):
        tensor, ranked = vp(), (ctypes.c_uint8 * 72)()  # LiteRtRankedTensorType is 72 bytes
        ok(getter(sig, sz(0), ctypes.byref(tensor)))
        ok(lib.LiteRtGetRankedTensorType(tensor, ranked))
        buf = vp()
        ok(lib.LiteRtCreateTensorBufferFromHostMemory(ranked, vp(array.ctypes.data), sz(array.nbytes),
                                                      None, ctypes.byref(buf)))
        return buf

    x, y = aligned((1, 4, 8), np.float32), aligned((1, 4, 8), np.float32)
    x[:] = 0.5
    ins = (vp * 1)(host_buffer(lib.LiteRtGetSignatureInputTensorByIndex, x))  # rank-3 host buffer
    outs = (vp * 1)(host_buffer(lib.LiteRtGetSignatureOutputTensorByIndex, y))
    state = {"calls": 0, "cancel": False}

    @ctypes.CFUNCTYPE(ctypes.c_bool, vp)
    def check_cancelled(_data):
        state["calls"] += 1
        return state["cancel"]

    def run_c():
        return lib.LiteRtRunCompiledModel(cm, sz(0), sz(1), ins, sz(1), outs)

    try:
        ok(run_c())
        ref = x.copy()
        for _ in range(20):
            ref = np.cumsum(ref, axis=2)
        np.testing.assert_allclose(y, ref, rtol=1e-5)

        ok(lib.LiteRtSetCompiledModelCancellationFunction(cm, None, check_cancelled))
        ok(run_c())
        assert state["calls"] >= 20  # polled before every op
        state.update(cancel=True, calls=0)
        assert run_c() != 0 and state["calls"] == 1  # aborted at the first check
        state["cancel"] = False
        ok(run_c())  # the model stays usable after a cancelled run
    finally:
        for buf in (*ins, *outs):
            lib.LiteRtDestroyTensorBuffer(vp(buf))
        lib.LiteRtDestroyCompiledModel(cm)
        lib.LiteRtDestroyOptions(opts)
        lib.LiteRtDestroyModel(model)
        lib.LiteRtDestroyEnvironment(env)
