"""ONNX int4 bundles' decode graph: litekv's linears as ONNX Runtime custom ops (kernels/ort_ops.c,
domain "litekv"), reading the tensors the prefill graph's MatMulNBits reads."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conformance import _ROOT, PREFILL_LENGTHS, checkpoint_dir, relative_error
from litekv import native_attention
from litekv.bundle import HEAD_KEEP_INPUT, BundleError, Manifest, read_manifest
from litekv.converters.convert import ConvertOptions, convert
from litekv.converters.emit_onnx import GATES, KERNEL_DOMAIN
from litekv.converters.quantize import int8_per_channel
from litekv.executor import open_executor
from litekv.native_attention import AttentionKernel
from model_factory import ARCHITECTURES
from test_decode_linears import INTEGER_LINEARS, int4_operands, integer_reference, rounding_bound, signed_nibbles

pytestmark = pytest.mark.skipif(not native_attention.available(), reason="the linears are litekv's kernels")


def kernel_model(graph: onnx.GraphProto) -> bytes:
    """A model of `graph`, which may call litekv's ops (domain "litekv")."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 10
    return model.SerializeToString()


def op_model(op: str, x_width: int, out_width: int, weights: dict[str, np.ndarray], **attributes) -> bytes:
    """A one-node graph: y = op(x, *weights)."""
    node = helper.make_node(op, ["x", *weights], ["y"], domain=KERNEL_DOMAIN, **attributes)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", x_width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", out_width])],
                              [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in weights.items()])
    return kernel_model(graph)


def session(model: bytes, kernel: AttentionKernel) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return kernel.onnx_session(model, options)


def onnx_int4(w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """LinearInt4's inputs for w (MatMulNBits' unsigned nibbles), and the weight they stand for."""
    packed, scales, offset_codes, offset_scales, exact = int4_operands(w)
    unsigned = packed ^ 0x88  # each signed nibble's bits XOR 8: the code + 8
    return {"codes": unsigned.reshape(len(w), -1, 16), "scales": scales, "offsets": offset_codes,
            "offset_scales": offset_scales}, exact


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("vector", [True, False], ids=["vnni-if-present", "portable"])
@pytest.mark.parametrize("out_dim, in_dim", [(960, 576), (38, 1536), (6, 64)])
def test_linears_match_numpy(vector, out_dim, in_dim):
    """LinearInt4 and LinearInt8 against the weights they stand for, one token and three, with
    activations whose blocks differ 1000x in size (the bound is the activations' own rounding)."""
    rng = np.random.default_rng(out_dim)
    w = rng.normal(size=(out_dim, in_dim)).astype(np.float32) + 0.3
    kernel = AttentionKernel(16, 4, 64, threads=2, int8_dot=vector)
    int4_inputs, exact4 = onnx_int4(w)
    codes8, scales8 = int8_per_channel(w)
    cases = ((session(op_model("LinearInt4", in_dim, out_dim, int4_inputs), kernel), exact4),
             (session(op_model("LinearInt8", in_dim, out_dim, {"codes": codes8, "scales": scales8}), kernel),
              codes8 * scales8[:, None]))
    for tokens in (1, 3):
        x = rng.normal(size=(tokens, in_dim)).astype(np.float32)
        x[:, :32] *= 1000.0
        for model, exact in cases:
            got, want = model.run(None, {"x": x})[0], x @ exact.T
            if vector:
                assert np.all(np.abs(got - want) <= 1.01 * rounding_bound(exact, x) + 1e-3)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("vector", [True, False], ids=["vnni-if-present", "portable"])
def test_a_gated_linear_applies_its_activation_to_the_first_half(gate, vector):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(2 * 40, 64)).astype(np.float32)
    inputs, exact = onnx_int4(w)
    kernel = AttentionKernel(16, 4, 64, threads=2, int8_dot=vector)
    model = session(op_model("LinearInt4", 64, 40, inputs, gate=GATES.index(gate) + 1), kernel)
    plain = session(op_model("LinearInt4", 64, 80, inputs), kernel)
    x = rng.normal(size=(2, 64)).astype(np.float32) * 3
    rows = plain.run(None, {"x": x})[0]
    act = {"silu": silu, "gelu_tanh": gelu_tanh}[gate]
    np.testing.assert_allclose(model.run(None, {"x": x})[0], act(rows[:, :40]) * rows[:, 40:], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTEGER_LINEARS, reason="the integer linears need AVX2 (+FMA, F16C) or AVX-512 VNNI")
@pytest.mark.parametrize("out_dim, in_dim", [(37, 576), (5, 64), (13, 1088), (22, 448), (11, 384)])
def test_linear_int4_computes_what_it_quantizes(out_dim, in_dim):
    """LinearInt4's unsigned nibbles (MatMulNBits' layout, LINEAR_UINT4) on the integer path (this
    CPU's VNNI or AVX2) against its own arithmetic in float64, one token and three (the one-token
    rows) and 4 and 9 (the tiles, a prefill chunk's path), every block group's tail, rows not a
    multiple of 4 or 8; gated, the gate of those rows."""
    rng = np.random.default_rng(out_dim * in_dim)
    w = rng.normal(size=(2 * out_dim, in_dim)).astype(np.float32) - 0.2
    kernel = AttentionKernel(16, 4, 64, threads=2)
    inputs, _ = onnx_int4(w)
    plain = session(op_model("LinearInt4", in_dim, 2 * out_dim, inputs), kernel)
    gated = session(op_model("LinearInt4", in_dim, out_dim, inputs, gate=GATES.index("silu") + 1), kernel)
    signed = signed_nibbles(inputs["codes"].reshape(len(w), -1) ^ 0x88)
    for tokens in (1, 3, 4, 9):
        x = rng.normal(size=(tokens, in_dim)).astype(np.float32)
        x[:, :32] *= 1000.0
        want, magnitude = integer_reference(x, signed, inputs["offset_scales"], inputs["scales"], inputs["offsets"])
        got = plain.run(None, {"x": x})[0]
        assert np.all(np.abs(got - want) <= 1e-5 * magnitude)
        with np.errstate(over="ignore"):  # e^-x of the large rows: silu is 0 there, as the kernel's
            act = silu(got[:, :out_dim].astype(np.float64))
        np.testing.assert_allclose(gated.run(None, {"x": x})[0], act * got[:, out_dim:], rtol=1e-5,
                                   atol=1e-5 * np.abs(got).max())


@pytest.mark.parametrize("vector", [True, False], ids=["vector-if-present", "portable"])
def test_linear_f32_takes_any_width(vector):
    """LinearF32 over widths below one vector, between vectors and past the 32-float loop: 1, 5, 8,
    33, 100, 257; rows not a multiple of 8, three tokens."""
    rng = np.random.default_rng(12)
    kernel = AttentionKernel(16, 4, 64, threads=2, int8_dot=vector)
    for in_dim, out_dim in ((1, 3), (5, 11), (8, 9), (33, 17), (100, 35), (257, 6)):
        w = rng.normal(size=(out_dim, in_dim)).astype(np.float32)
        x = rng.normal(size=(3, in_dim)).astype(np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        got = session(op_model("LinearF32", in_dim, out_dim, {"weight": w}), kernel).run(None, {"x": x})[0]
        assert np.all(np.abs(got - want) <= 1e-5 * (np.abs(x) @ np.abs(w).T))


def test_shapes_that_disagree_and_unknown_gates_are_refused():
    rng = np.random.default_rng(1)
    inputs, _ = onnx_int4(rng.normal(size=(8, 64)).astype(np.float32))
    kernel = AttentionKernel(16, 4, 64, threads=1)
    short = {**inputs, "offset_scales": inputs["offset_scales"][:5]}  # 5 row scales for 8 rows
    with pytest.raises(Exception, match="shapes disagree"):
        session(op_model("LinearInt4", 64, 8, short), kernel).run(None, {"x": np.ones((1, 64), np.float32)})
    with pytest.raises(Exception, match=r"tensor\(float\)' of input parameter \(scales\)"):  # the op's declared types
        session(op_model("LinearInt4", 64, 8, {**inputs, "scales": inputs["scales"].astype(np.float32)}),
                kernel).run(None, {"x": np.ones((1, 64), np.float32)})
    with pytest.raises(Exception, match="unknown gate"):
        session(op_model("LinearInt4", 64, 4, inputs, gate=7), kernel)


def offsets_model(in_dim: int, out_dim: int, offsets: np.ndarray, scales: np.ndarray) -> bytes:
    """out = Int4Offsets(y, x, offsets, offset scales); the graph leaves the op to check the tokens."""
    node = helper.make_node("Int4Offsets", ["y", "x", "offsets", "scales"], ["out"], domain=KERNEL_DOMAIN)
    graph = helper.make_graph(
        [node], "offsets", [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", out_dim]),
                            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", in_dim])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, "T", out_dim])],
        [numpy_helper.from_array(offsets, "offsets"), numpy_helper.from_array(scales, "scales")])
    return kernel_model(graph)


@pytest.mark.parametrize("tokens, in_dim, out_dim", [(1, 64, 6), (7, 576, 960), (70, 1536, 38), (256, 576, 200),
                                                     (5, 64, 77), (12, 96, 3072), (47, 1536, 129)])
def test_int4_offsets_add_the_offsets_share(tokens, in_dim, out_dim):
    """Int4Offsets (a prefill chunk's int4 projection after MatMulNBits) against numpy: y plus each
    block's sum of x times the block's offset, over token counts and widths that leave partial
    tiles and token groups, on two threads."""
    rng = np.random.default_rng(tokens)
    offsets = rng.integers(-128, 128, (out_dim, in_dim // 32), dtype=np.int8)
    scales = rng.random(out_dim).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    model = AttentionKernel(16, 4, 64, threads=2).onnx_session(offsets_model(in_dim, out_dim, offsets, scales),
                                                               options)
    x = rng.normal(size=(1, tokens, in_dim)).astype(np.float32)
    y = rng.normal(size=(1, tokens, out_dim)).astype(np.float32)
    sums, weights = x.reshape(tokens, -1, 32).sum(-1, dtype=np.float64), offsets * scales[:, None].astype(np.float64)
    bound = 1e-5 * (np.abs(sums) @ np.abs(weights).T + np.abs(y))  # float32 rounding, summed in any order
    assert np.all(np.abs(model.run(None, {"y": y, "x": x})[0] - (y + sums @ weights.T)) <= bound)


def test_int4_offsets_refuse_shapes_that_disagree():
    kernel = AttentionKernel(16, 4, 64, threads=1)
    offsets, scales = np.ones((8, 2), np.int8), np.ones(8, np.float32)
    bad = {"blocks that do not divide x": (offsets[:, :1].repeat(3, 1), scales, 64),
           "a scale short": (offsets, scales[:5], 64)}
    for name, (codes, row_scales, in_dim) in bad.items():
        model = session(offsets_model(in_dim, 8, np.ascontiguousarray(codes), row_scales), kernel)
        with pytest.raises(Exception, match="shapes disagree"):
            model.run(None, {"y": np.ones((1, 2, 8), np.float32), "x": np.ones((1, 2, in_dim), np.float32)})
    model = session(offsets_model(64, 8, offsets, scales), kernel)
    with pytest.raises(Exception, match="shapes disagree"):  # y's tokens are not x's
        model.run(None, {"y": np.ones((1, 3, 8), np.float32), "x": np.ones((1, 2, 64), np.float32)})


def normed_model(op: str, in_width: int, out_width: int, weights: dict[str, np.ndarray], norm_weight: np.ndarray,
                 skip: bool, sum_output: bool, **attributes) -> bytes:
    """One linear with the RMSNorm before it as its inputs: y (, s) = op(x (+ skip), weights, norm)."""
    norm = numpy_helper.from_array(np.ascontiguousarray(norm_weight), "norm")
    node = helper.make_node(op, ["x", *weights, "skip" if skip else "", "norm"], ["y", *(["s"] if sum_output else [])],
                            domain=KERNEL_DOMAIN, **attributes)
    row = lambda name, width: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", width])
    graph = helper.make_graph([node], "normed", [row("x", in_width), *([row("skip", in_width)] if skip else [])],
                              [row("y", out_width), *([row("s", in_width)] if sum_output else [])],
                              [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in weights.items()] + [norm])
    return kernel_model(graph)


def rms_norm(x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + epsilon) * weight


@pytest.mark.parametrize("skip, sum_output", [(True, True), (True, False), (False, False), (False, True)])
def test_a_linear_applies_the_norm_before_it(skip, sum_output):
    """The norm inputs: y = linear(rms_norm(x + skip) * weight) and s = x + skip, for LinearInt4 with
    and without its gate and for LinearInt8, against numpy on the portable path (exact weights)."""
    rng = np.random.default_rng(11)
    in_dim, out_dim, epsilon = 64, 80, 1e-5
    w = rng.normal(size=(out_dim, in_dim)).astype(np.float32)
    norm_weight = (rng.random(in_dim) + 0.5).astype(np.float32)
    kernel = AttentionKernel(16, 4, 64, threads=2, int8_dot=False)
    int4_inputs, exact4 = onnx_int4(w)
    codes8, scales8 = int8_per_channel(w)
    x, residual = (rng.normal(size=(3, in_dim)).astype(np.float32) * 4 for _ in range(2))
    total = x + residual if skip else x
    normed = rms_norm(total, norm_weight, epsilon)
    rows4 = normed @ exact4.T
    cases = (("LinearInt4", int4_inputs, {}, out_dim, rows4),
             ("LinearInt4", int4_inputs, {"gate": 1}, out_dim // 2, silu(rows4[:, :40]) * rows4[:, 40:]),
             ("LinearInt8", {"codes": codes8, "scales": scales8}, {}, out_dim, normed @ (codes8 * scales8[:, None]).T))
    for op, weights, attributes, width, want in cases:
        model = session(normed_model(op, in_dim, width, weights, norm_weight, skip, sum_output, epsilon=epsilon,
                                     **attributes), kernel)
        got = model.run(None, {"x": x, **({"skip": residual} if skip else {})})
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        if sum_output:
            np.testing.assert_array_equal(got[1], total)


@pytest.mark.parametrize("vector", [True, False], ids=["vnni-if-present", "portable"])
@pytest.mark.parametrize("out_dim, in_dim", [(4099, 576), (7, 70)])
def test_linear_f32_matches_numpy(vector, out_dim, in_dim):
    """LinearF32 (an fp32 LM head over W itself, [out, in]) against numpy in float64: one token and
    three, widths that leave a partial vector and a partial task, plain and after its norm."""
    rng = np.random.default_rng(out_dim)
    w = rng.normal(size=(out_dim, in_dim)).astype(np.float32)
    norm_weight = (rng.random(in_dim) + 0.5).astype(np.float32)
    kernel = AttentionKernel(16, 4, 64, threads=2, int8_dot=vector)
    plain = session(op_model("LinearF32", in_dim, out_dim, {"weight": w}), kernel)
    normed = session(normed_model("LinearF32", in_dim, out_dim, {"weight": w}, norm_weight, False, False), kernel)
    for tokens in (1, 3):
        x = rng.normal(size=(tokens, in_dim)).astype(np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(plain.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        want = rms_norm(x, norm_weight, 1e-6) @ w.T.astype(np.float64)
        np.testing.assert_allclose(normed.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_linear_on_the_pool_shares_its_rows_with_the_sessions_workers(threads):
    """on_pool=1 (the converter's choice in graphs whose session has a pool): the same result, the
    rows taken by the session's threads (a worker's share counted in pool_chunks); on_pool=0 leaves
    them to litekv's helper, so the pool's worker takes none."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(8192, 576)).astype(np.float32)
    codes8, scales8 = int8_per_channel(w)
    kernel = AttentionKernel(16, 4, 64, threads=2)
    x = rng.normal(size=(1, 576)).astype(np.float32)
    for op, weights, exact in (("LinearF32", {"weight": w}, w),
                               ("LinearInt8", {"codes": codes8, "scales": scales8}, codes8 * scales8[:, None])):
        want = x @ exact.T
        for on_pool in (0, 1):
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            model = kernel.onnx_session(op_model(op, 576, len(w), weights, on_pool=on_pool), options)
            before = kernel.stats()
            for _ in range(50):  # back to back, as a graph's nodes run: the pool's worker is awake
                got = model.run(None, {"x": x})[0]
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-2 * np.abs(want).max())
            if op == "LinearF32":  # 144 tasks a call, enough for the worker to join every time
                assert ((kernel.stats() - before).pool_chunks > 0) == (threads == 2 and on_pool == 1)
    with pytest.raises(Exception, match="on_pool must be 0"):
        session(op_model("LinearF32", 576, len(w), {"weight": w}, on_pool=2), kernel)


def gate_model(width: int, gate: int) -> bytes:
    node = helper.make_node("Gate", ["x"], ["y"], domain=KERNEL_DOMAIN, gate=gate)
    graph = helper.make_graph([node], "gate", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", width // 2])])
    return kernel_model(graph)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("vector", [True, False], ids=["vnni-if-present", "portable"])
def test_gate_applies_its_activation_to_the_first_half(gate, vector):
    """Gate: act(x[:, :h]) * x[:, h:], h = 1536 (SmolLM2's MLP) and 21 (a partial vector)."""
    rng = np.random.default_rng(5)
    kernel = AttentionKernel(16, 4, 64, threads=1, int8_dot=vector)
    act = {"silu": silu, "gelu_tanh": gelu_tanh}[gate]
    for half in (1536, 21):
        x = rng.normal(size=(3, 2 * half)).astype(np.float32) * 4
        got = session(gate_model(2 * half, GATES.index(gate) + 1), kernel).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, act(x[:, :half].astype(np.float64)) * x[:, half:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate", GATES)
def test_gate_holds_at_extremes_and_every_tail(gate):
    """Gate (on this CPU's vector path, else the scalar one) where exp saturates or underflows
    (|x| up to 200), at 0, and over widths leaving every partial vector (1-9, 15-17), three tokens."""
    rng = np.random.default_rng(13)
    kernel = AttentionKernel(16, 4, 64, threads=1)
    act = {"silu": silu, "gelu_tanh": gelu_tanh}[gate]
    for half in (*range(1, 10), 15, 16, 17, 64):
        x = (rng.normal(size=(3, 2 * half)) * 30).astype(np.float32)
        x[0, : min(half, 6)] = np.array([-200, -90, -0.0, 0.0, 90, 200], np.float32)[: min(half, 6)]
        got = session(gate_model(2 * half, GATES.index(gate) + 1), kernel).run(None, {"x": x})[0]
        want = act(x[:, :half].astype(np.float64)) * x[:, half:]
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


def test_gate_refuses_an_odd_width_and_unknown_gates():
    kernel = AttentionKernel(16, 4, 64, threads=1)
    with pytest.raises(Exception, match="must be even"):
        session(gate_model(7, 1), kernel).run(None, {"x": np.ones((1, 7), np.float32)})
    for gate in (0, 3):
        with pytest.raises(Exception, match="unknown gate"):
            session(gate_model(8, gate), kernel)


def test_norm_inputs_that_disagree_are_refused():
    rng = np.random.default_rng(2)
    inputs, _ = onnx_int4(rng.normal(size=(8, 64)).astype(np.float32))
    kernel = AttentionKernel(16, 4, 64, threads=1)
    x = np.ones((1, 64), np.float32)
    no_weight = onnx.load_from_string(normed_model("LinearInt4", 64, 8, inputs, np.ones(64, np.float32), True, True))
    del no_weight.graph.node[0].input[-1]  # a skip, and a sum output, without the norm's weight
    with pytest.raises(Exception, match="shapes disagree"):
        session(no_weight.SerializeToString(), kernel).run(None, {"x": x, "skip": x})
    with pytest.raises(Exception, match="shapes disagree"):  # a norm weight of the wrong width
        session(normed_model("LinearInt4", 64, 8, inputs, np.ones(32, np.float32), False, False), kernel).run(
            None, {"x": x})
    with pytest.raises(Exception, match="epsilon"):
        session(normed_model("LinearInt4", 64, 8, inputs, np.ones(64, np.float32), False, False, epsilon=-1.0),
                kernel)


def test_the_library_registers_only_through_litekv():
    options = ort.SessionOptions()
    native_attention._load()
    with pytest.raises(Exception, match="through litekv"):
        options.register_custom_ops_library(native_attention._library_path)


@lru_cache(maxsize=None)
def bundle(arch: str, kind: str) -> Path:
    """An ONNX int4 bundle with a float32 cache whose linears and attention are litekv's kernels
    ("kernel"; a chunk's projections still MatMulNBits) or ONNX Runtime's own ops (MatMulNBits,
    GroupQueryAttention: "graph")."""
    options = ConvertOptions(backend="onnx", quantize="int4", max_context=64, prefill_lengths=PREFILL_LENGTHS,
                             decode_linears=kind, decode_attention=kind, prefill_attention=kind, kv_cache="fp32",
                             prefill_linears="graph")
    return convert(checkpoint_dir(arch), _ROOT / f"{arch}-onnx-int4-{kind}-ops", options)


def prefill_calls(executor, tokens: np.ndarray, kv_cache) -> list[int]:
    """Prefill `tokens`; the number of tokens in each model call it made."""
    lengths, run = [], executor._run_prefill_chunk

    def counted(chunk_tokens, *rest):
        lengths.append(len(chunk_tokens))
        run(chunk_tokens, *rest)

    executor._run_prefill_chunk = counted
    try:
        executor.prefill(tokens, kv_cache)
    finally:
        del executor._run_prefill_chunk
    return lengths


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_steps_follow_the_graph_bundle(arch):
    """The same weights through ONNX Runtime's ops and through litekv's. The prompt is one chunk
    of the model graph in both: MatMulNBits on the same input, then the offsets' share by
    Int4Offsets or by two MatMuls and an Add, attention PrefillAttention or GroupQueryAttention;
    so the first layer's cache agrees to float reordering (4.8e-7 at most here). The steps agree
    to the activations' rounding only: MatMulNBits (accuracy_level 4) rounds them to int8 per
    block of 32, and so does LinearInt4 with AVX-512 VNNI, but not on its float path (AVX2 here),
    where a tiny llama's first-layer keys after 8 steps were 5.9e-3 off MatMulNBits'."""
    ours, theirs = open_executor(bundle(arch, "kernel")), open_executor(bundle(arch, "graph"))
    assert ours.decode_session is not ours.session and theirs.decode_session is theirs.session
    prompt = np.random.default_rng(4).integers(3, ours.config.vocab_size, 9)
    a, b = ours.create_kv_cache(), theirs.create_kv_cache()
    assert prefill_calls(ours, prompt[:-1], a) == prefill_calls(theirs, prompt[:-1], b) == [8]
    np.testing.assert_allclose(a.key_cache(0), b.key_cache(0), rtol=1e-5, atol=1e-5)  # [batch, 8 tokens, ..]
    np.testing.assert_allclose(a.value_cache(0), b.value_cache(0), rtol=1e-5, atol=1e-5)
    token = prompt[-1]
    for _ in range(6):
        mine, graph = ours.step([token], a), theirs.step([token], b)
        assert relative_error(mine, graph) < 0.05
        token = int(np.argmax(graph))
    assert a.num_tokens == b.num_tokens == 14
    np.testing.assert_allclose(a.key_cache(1), b.key_cache(1), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_cache_prefill_and_steps_follow_group_query_attention(arch):
    """An int8 cache through litekv's Int8 attention ops (the default with litekv's linears) and
    through GroupQueryAttention: the first layer's codes (the same K, quantized alike but at a .5)
    and the steps' logits agree to the rows' rounding."""
    def converted(kind: str) -> Path:
        options = ConvertOptions(backend="onnx", quantize="int4", max_context=64, prefill_lengths=PREFILL_LENGTHS,
                                 kv_cache="int8", decode_attention=kind, prefill_attention=kind)
        return convert(checkpoint_dir(arch), _ROOT / f"{arch}-onnx-int4-kvint8-{kind}-attention", options)

    ours, theirs = open_executor(converted("kernel")), open_executor(converted("graph"))
    assert ours.manifest.decode_attention == ours.manifest.prefill_attention == "kernel"
    layers = ours.config.num_layers
    assert op_types(converted("kernel") / "model_decode.onnx")["DecodeAttentionInt8"] == layers
    assert op_types(converted("kernel") / "model.onnx")["PrefillAttentionInt8"] == layers
    prompt = np.random.default_rng(5).integers(3, ours.config.vocab_size, 9)
    a, b = ours.create_kv_cache(), theirs.create_kv_cache()
    assert a.dtype == np.int8
    ours.prefill(prompt[:-1], a)
    theirs.prefill(prompt[:-1], b)
    token = prompt[-1]
    for _ in range(6):
        mine, graph = ours.step([token], a), theirs.step([token], b)
        assert relative_error(mine, graph) < 0.05
        token = int(np.argmax(graph))
    assert a.num_tokens == 14
    assert np.abs(a.key_cache(0).astype(int) - b.key_cache(0)).max() <= 1  # [batch, tokens, KV heads, D]


def op_types(path: Path) -> dict[str, int]:
    model = onnx.load(path, load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("arch, gate", [("llama", "silu"), ("gemma3", "gelu_tanh")])
def test_the_decode_graph_reads_the_prefill_weights(arch, gate):
    path = bundle(arch, "kernel")
    manifest = read_manifest(path)
    assert manifest.decode_linears == "kernel" and manifest.decode_model_file == "model_decode.onnx"
    assert [s.kind for s in manifest.signatures] == ["step", "decode"]
    layers = manifest.config.num_layers
    decode, prefill = op_types(path / manifest.decode_model_file), op_types(path / manifest.model_file)
    assert decode["LinearInt4"] == 4 * layers and decode["LinearInt8"] == 1 and "MatMulNBits" not in decode
    assert prefill["MatMulNBits"] == 4 * layers and prefill["LinearInt8"] == 1 and "LinearInt4" not in prefill
    assert "Gate" not in decode and prefill["Gate"] == layers  # the decode graph's LinearInt4 gates its rows
    # a chunk's offsets come from litekv's op, on the int8 offsets the decode graph's LinearInt4 reads
    assert prefill["Int4Offsets"] == 4 * layers and "MatMul" not in prefill
    # the gated MLP's slices and activation are the op's gate; every residual add is in a norm
    assert not {"Sigmoid", "Tanh", "Add"} & set(decode)
    gated = [n for n in onnx.load(path / manifest.decode_model_file, load_external_data=False).graph.node
             if n.op_type == "LinearInt4" and any(a.name == "gate" for a in n.attribute)]
    assert len(gated) == layers and all(a.i == GATES.index(gate) + 1 for n in gated for a in n.attribute
                                        if a.name == "gate")
    # the norms before the qkv and gate/up projections are those linears' inputs; attention is litekv's
    normed = [n for n in onnx.load(path / manifest.decode_model_file, load_external_data=False).graph.node
              if any(a.name == "epsilon" for a in n.attribute) and n.op_type == "LinearInt4"]
    assert len(normed) == 2 * layers and all(len(n.input) == 7 for n in normed)
    assert sum(len(n.output) == 2 for n in normed) >= layers  # each residual sum comes out of its norm's linear
    assert decode["DecodeAttention"] == layers and "GroupQueryAttention" not in decode
    if arch == "llama":  # the final norm (before the last-row slice) is the only norm node left
        assert decode.get("SimplifiedLayerNormalization", 0) + decode["SkipSimplifiedLayerNormalization"] == 1
    # its weights are the prefill graph's, in the one data file
    model = onnx.load(path / manifest.decode_model_file, load_external_data=False)
    external = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert all(n.input[1] in external for n in model.graph.node if n.op_type.startswith("Linear"))
    prefill_model = onnx.load(path / manifest.model_file, load_external_data=False)
    offsets = {n.input[2] for n in prefill_model.graph.node if n.op_type == "Int4Offsets"}
    assert offsets == {n.input[3] for n in model.graph.node if n.op_type == "LinearInt4"}
    assert all(len(t.raw_data) < 1024 for t in model.graph.initializer)  # the rest: shapes, a few constants


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_chunks_run_their_int4_projections_in_linear_int4(arch):
    """The default ONNX int4 bundle (--prefill-linears kernel): a chunk's int4 projections are
    LinearInt4 on the session's pool (no MatMulNBits, no Int4Offsets), reading the tensors the
    decode graph's read. Its prefill agrees with MatMulNBits' to the activations' rounding (both
    int8 per 32; the integer tiles on this CPU), and so do the steps that follow."""
    options = ConvertOptions(backend="onnx", quantize="int4", max_context=64, prefill_lengths=PREFILL_LENGTHS,
                             kv_cache="fp32")
    path = convert(checkpoint_dir(arch), _ROOT / f"{arch}-onnx-int4-kernel-prefill", options)
    manifest = read_manifest(path)
    assert manifest.prefill_linears == "kernel" and manifest.decode_linears == "kernel"
    layers = manifest.config.num_layers
    prefill = op_types(path / manifest.model_file)
    assert prefill["LinearInt4"] == 4 * layers and not {"MatMulNBits", "Int4Offsets"} & set(prefill)
    model = onnx.load(path / manifest.model_file, load_external_data=False)
    step = onnx.load(path / manifest.decode_model_file, load_external_data=False)
    chunk_codes = {n.input[1] for n in model.graph.node if n.op_type == "LinearInt4"}
    assert chunk_codes == {n.input[1] for n in step.graph.node if n.op_type == "LinearInt4"}
    assert all(a.i == 1 for n in model.graph.node if n.op_type == "LinearInt4" for a in n.attribute
               if a.name == "on_pool")
    ours, theirs = open_executor(path), open_executor(bundle(arch, "kernel"))
    prompt = np.random.default_rng(7).integers(3, ours.config.vocab_size, 9)
    a, b = ours.create_kv_cache(), theirs.create_kv_cache()
    ours.prefill(prompt[:-1], a)
    theirs.prefill(prompt[:-1], b)
    for layer in range(layers):
        assert relative_error(a.key_cache(layer), b.key_cache(layer)) < 0.05
        assert relative_error(a.value_cache(layer), b.value_cache(layer)) < 0.05
    token = prompt[-1]
    for _ in range(4):
        mine, graph = ours.step([token], a), theirs.step([token], b)
        assert relative_error(mine, graph) < 0.05
        token = int(np.argmax(graph))


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama3", True), ("gemma3", True)])
def test_an_fp32_bundle_runs_its_head_and_gates_in_litekv_ops(arch, tied):
    """An fp32 ONNX bundle attends in litekv's ops, so its LM head (one row) is LinearF32Screened
    over W [vocab, hidden] itself, and over the embedding table the Gather reads when they are tied
    (no transposed copy in the file), with its int8 screen beside it; each gated MLP's activation is
    one Gate node over the gate/up projection. The conformance suite checks the logits of these
    bundles against the reference."""
    from conformance import bundle as conformance_bundle

    path = conformance_bundle(arch, "onnx")
    manifest = read_manifest(path)
    model = onnx.load(path / manifest.model_file, load_external_data=False)
    nodes = {n.op_type: n for n in model.graph.node}
    counts = op_types(path / manifest.model_file)
    assert counts["LinearF32Screened"] == 1 and counts["Gate"] == manifest.config.num_layers
    assert "LinearF32" not in counts and not {"Sigmoid", "QuickGelu", "Tanh", "Split"} & set(counts)
    head = nodes["LinearF32Screened"]
    assert head.input[1] == (nodes["Gather"].input[0] if tied else "lm_head.rows")
    assert head.input[5] == HEAD_KEEP_INPUT and HEAD_KEEP_INPUT in {i.name for i in model.graph.input}
    vocab, hidden = manifest.config.vocab_size, manifest.config.hidden_size
    initializers = {t.name: t for t in model.graph.initializer}
    assert initializers[head.input[2]].data_type == onnx.TensorProto.INT8  # the screen's codes
    shapes = [list(t.dims) for t in model.graph.initializer]
    assert [vocab, hidden] in shapes and [hidden, vocab] not in shapes
    assert shapes.count([vocab, hidden]) == (2 if tied else 3)  # W (or the table), the screen's codes
    assert all(a.i == 1 for n in model.graph.node for a in n.attribute if a.name == "on_pool")


def test_a_manifest_naming_a_missing_decode_graph_is_refused(tmp_path):
    source = bundle("llama", "kernel")
    manifest = read_manifest(source)
    data = json.loads(manifest.to_json())
    data["decode_model_file"] = None
    with pytest.raises(BundleError, match="decode graph"):
        Manifest.from_json(json.dumps(data), "litekv.json")
    for name in ("litekv.json", "model.onnx"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with pytest.raises(BundleError, match="model_decode.onnx is missing"):
        read_manifest(tmp_path)
