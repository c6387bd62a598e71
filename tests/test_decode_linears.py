"""`--decode-linears kernel`: a LiteRT decode step's int4 and int8 projections, and its rotary
embedding, in litekv's custom ops (kernels/linear.c, kernels/rope.c), which read the weights that
prefill's FULLY_CONNECTED ops use; `--prefill-linears kernel`: a prefill chunk's int4 projections
there too (kernels/linear_avx2_tiles.c on AVX2)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conformance import _ROOT, PREFILL_LENGTHS, checkpoint_dir, relative_error
from cpu_flags import cpu_flags
from litekv.bundle import BundleError, Manifest, read_manifest
from litekv.converters.convert import ConvertOptions, convert
from litekv.converters.quantize import int4_blockwise_asymmetric, int8_per_channel
from litekv.errors import ConfigError
from litekv.executor import open_executor
from litekv.native_attention import LINEAR_OP_NAMES, ROPE_OP_NAME, AttentionKernel
from litekv.native_attention import available as kernel_available
from model_factory import ARCHITECTURES

ROPE_ATTENTION_F16 = "litekv.decode_attention_rope_f16"

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the linears are litekv's kernels")


def int4_operands(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(packed codes, block scales, offset codes, offset scales, the weight they stand for)."""
    codes, scales, offsets = int4_blockwise_asymmetric(w, 32)
    offset_codes, offset_scales = int8_per_channel(offsets)
    nibbles = (codes & 0xF).astype(np.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # TFLite's int4: the even element low
    blocks = codes.reshape(len(w), -1, 32) * scales.astype(np.float32)[..., None]
    exact = (blocks + (offset_codes * offset_scales[:, None])[..., None]).reshape(w.shape)
    return packed, scales, offset_codes, offset_scales, exact


def rounding_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The most that int8 activations with a scale per 32 (half a step each) can move x @ w.T."""
    half_steps = np.repeat(np.abs(x).reshape(len(x), -1, 32).max(axis=2) / 254, 32, axis=1)
    return half_steps @ np.abs(w).T


@pytest.mark.parametrize("vector", [True, False], ids=["vnni-if-present", "portable"])
@pytest.mark.parametrize("out_dim, in_dim", [(960, 576), (37, 1536), (100, 192), (5, 64)])
def test_linears_match_numpy(vector, out_dim, in_dim):
    """Both forms against the weights they stand for, with activations whose blocks differ 1000x
    in size. The integer path is held to its own rounding (a wrong nibble order, scale or offset
    is far outside it); the portable path is float throughout."""
    rng = np.random.default_rng(out_dim)
    w = rng.normal(size=(out_dim, in_dim)).astype(np.float32) + 0.3
    x = rng.normal(size=(3, in_dim)).astype(np.float32)
    x[:, :32] *= 1000.0
    kernel = AttentionKernel(16, 4, 64, threads=2, int8_dot=vector)
    packed, scales, offset_codes, offset_scales, exact4 = int4_operands(w)
    codes8, scales8 = int8_per_channel(w)
    exact8 = codes8 * scales8[:, None]
    for got, exact in ((kernel.run_linear(x, packed, offset_scales, scales, offset_codes), exact4),
                       (kernel.run_linear(x, codes8, scales8), exact8)):
        want = x @ exact.T
        if vector:
            assert np.all(np.abs(got - want) <= 1.01 * rounding_bound(exact, x) + 1e-3)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())


# The linears' integer paths (kernels/linear.c with AVX-512 VNNI, linear_avx2.c with AVX2, FMA and F16C)
_FLAGS = cpu_flags()
INTEGER_LINEARS = {"avx2", "fma", "f16c"} <= _FLAGS or {"avx512f", "avx512bw", "avx512_vnni"} <= _FLAGS


def quantized_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, in] as the integer paths quantize it: per block of 32, codes rint(x * (127 / largest |x|))
    in float32 (ties to even, as vcvtps2dq) and the scale largest / 127: ([T, blocks, 32], [T, blocks])."""
    blocks = x.reshape(len(x), -1, 32)
    largest = np.abs(blocks).max(axis=2)
    inverse = np.divide(np.float32(127), largest, out=np.zeros_like(largest), where=largest > 0)
    return np.rint(blocks * inverse[..., None]).astype(np.float64), (largest / np.float32(127)).astype(np.float64)


def signed_nibbles(packed: np.ndarray) -> np.ndarray:
    """TFLite's int4 [out, in/2] (two's complement, the even element low) as codes [out, in]."""
    codes = np.empty((len(packed), 2 * packed.shape[1]), np.int64)
    codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4
    return (codes ^ 8) - 8


def integer_reference(x: np.ndarray, codes: np.ndarray, row_scales: np.ndarray, block_scales=None, offsets=None):
    """In float64, what the integer paths compute: the quantized activations' dot products with the
    codes per block, times both scales; for int4 plus offset x row scale x x's own block sum.
    Also the magnitude of the terms added, which bounds float32's reordering error."""
    q, x_scales = quantized_blocks(x)
    w = codes.astype(np.float64).reshape(len(codes), -1, 32)
    dots = np.einsum("tbk,obk->tob", q, w)
    if block_scales is None:  # int8: the row's scale
        scales = x_scales[:, None, :] * row_scales.astype(np.float64)[None, :, None]
        magnitude = np.einsum("tbk,obk->tob", np.abs(q), np.abs(w)) * np.abs(scales)
        return (dots * scales).sum(axis=2), magnitude.sum(axis=2)
    weight_scales = block_scales.astype(np.float64)[None]
    offset_terms = (offsets.astype(np.float64) * row_scales.astype(np.float64)[:, None])[None] * \
        x.reshape(len(x), -1, 32).astype(np.float64).sum(axis=2)[:, None, :]
    terms = dots * x_scales[:, None, :] * weight_scales + offset_terms
    # the kernels add code + 8 and take 8 x the codes' sum off again: both count
    code_sums = 8 * np.abs(q.sum(axis=2))[:, None, :]
    magnitude = (np.abs(dots) + code_sums) * x_scales[:, None, :] * np.abs(weight_scales) + np.abs(offset_terms)
    return terms.sum(axis=2), magnitude.sum(axis=2)


@pytest.mark.skipif(not INTEGER_LINEARS, reason="the integer linears need AVX2 (+FMA, F16C) or AVX-512 VNNI")
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])  # from 4 tokens int4 runs in tiles of 8 rows x 4 tokens
@pytest.mark.parametrize("out_dim, in_dim", [(37, 576), (5, 64), (101, 192), (13, 1088), (9, 320), (22, 448),
                                             (11, 384), (3, 1536), (8, 96)])
def test_integer_linears_compute_what_they_quantize(tokens, out_dim, in_dim):
    """The integer paths (on this CPU: VNNI, else AVX2) against their own arithmetic in float64, to
    float32's reordering: every block group's tail (in = 64 (2 blocks), 320, 384, 448: 2, 4, 6 left
    over), rows not a multiple of 4 or 8, activations whose blocks differ 1000x in size, and more
    than one token: 4 and 9 take the int4 tiles (two whole tiles of 4 tokens and 1 left; rows past
    the last whole 8 in the one-token path). A wrong nibble, scale, offset or lane is far outside;
    so is the portable path, which does not quantize (in = 96 is an odd number of blocks: int8 only)."""
    rng = np.random.default_rng(out_dim * in_dim + tokens)
    w = rng.normal(size=(out_dim, in_dim)).astype(np.float32) + 0.3
    x = rng.normal(size=(tokens, in_dim)).astype(np.float32)
    x[:, :32] *= 1000.0
    x[:, 32:64] *= 0.001
    kernel = AttentionKernel(16, 4, 64, threads=2)
    codes8, scales8 = int8_per_channel(w)
    cases = [((codes8, scales8), integer_reference(x, codes8, scales8))]
    if in_dim % 64 == 0:
        packed, scales, offset_codes, offset_scales, _ = int4_operands(w)
        cases.append(((packed, offset_scales, scales, offset_codes),
                      integer_reference(x, signed_nibbles(packed), offset_scales, scales, offset_codes)))
    for operands, (want, magnitude) in cases:
        got = kernel.run_linear(x, *operands)
        assert np.all(np.abs(got - want) <= 1e-5 * magnitude), (operands[0].dtype, np.abs(got - want).max())


def test_linear_refuses_shapes_that_do_not_fit():
    kernel = AttentionKernel(16, 4, 64, threads=1)
    with pytest.raises(ValueError, match="rejected"):
        kernel.run_linear(np.ones((1, 64), np.float32), np.ones((4, 32), np.int8), np.ones(5, np.float32))
    with pytest.raises(ValueError, match="rejected"):  # 3 blocks of scales for 2 of offsets
        kernel.run_linear(np.ones((1, 96), np.float32), np.ones((4, 48), np.uint8), np.ones(4, np.float32),
                          np.ones((4, 3), np.float16), np.ones((4, 2), np.int8))


@lru_cache(maxsize=None)
def bundle(arch: str, quantize: str, linears: str) -> Path:
    # one cache for both (the default differs: int8 weights get an int8 cache only with the kernels)
    options = ConvertOptions(backend="litert", quantize=quantize, max_context=64, prefill_lengths=PREFILL_LENGTHS,
                             decode_linears=linears, kv_cache="fp16")
    return convert(checkpoint_dir(arch), _ROOT / f"{arch}-litert-{quantize}-{linears}-linears", options)


def decode_ops(model_file: Path, signature: str = "decode") -> tuple[set[str], set[str]]:
    """The custom ops of an entry point, and the weight types its FULLY_CONNECTED ops read."""
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(Path(model_file).read_bytes(), 0))
    graph = next(g for g in model.subgraphs if g.name == signature.encode())
    customs, fc_weights = set(), set()
    for op in graph.operators:
        code = model.operatorCodes[op.opcodeIndex]
        if code.customCode:
            customs.add(code.customCode.decode())
        elif code.builtinCode == schema.BuiltinOperator.FULLY_CONNECTED:
            fc_weights.add(graph.tensors[op.inputs[1]].type)
    return customs, fc_weights


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_steps_follow_the_graph_bundle(arch, quantize):
    """The same weights through XNNPACK's FULLY_CONNECTED and through the kernels: the steps agree
    to the activations' rounding (XNNPACK's int8 per token, the kernels' per 32), and so does the
    int4 prefill (its linears the kernel's too); the int8 prefill, still XNNPACK's, agrees exactly."""
    ours, theirs = open_executor(bundle(arch, quantize, "kernel")), open_executor(bundle(arch, quantize, "graph"))
    prompt = np.random.default_rng(4).integers(3, ours.config.vocab_size, 9)
    a, b = ours.create_kv_cache(), theirs.create_kv_cache()
    ours.prefill(prompt[:-1], a)
    theirs.prefill(prompt[:-1], b)
    if quantize == "int8":
        np.testing.assert_array_equal(a.key_cache(0)[:, :8], b.key_cache(0)[:, :8])
    for layer in range(ours.config.num_layers):
        assert relative_error(a.key_cache(layer)[:, :8], b.key_cache(layer)[:, :8]) < 0.05
        assert relative_error(a.value_cache(layer)[:, :8], b.value_cache(layer)[:, :8]) < 0.05
    token = prompt[-1]
    for _ in range(6):
        mine, graph = ours.step([token], a), theirs.step([token], b)
        assert relative_error(mine, graph) < 0.05
        token = int(np.argmax(graph))


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_decode_reads_the_prefill_weights_in_custom_ops(quantize):
    kernel_bundle, graph_bundle = bundle("llama", quantize, "kernel"), bundle("llama", quantize, "graph")
    manifest = read_manifest(kernel_bundle)
    assert manifest.decode_linears == "kernel" and read_manifest(graph_bundle).decode_linears == "graph"
    customs, fc_weights = decode_ops(kernel_bundle / manifest.model_file)
    # the float16 cache's attention op rotates q and k itself (its rope form), so no litekv.rope is left
    assert f"litekv.linear_{quantize}" in customs and ROPE_ATTENTION_F16 in customs and ROPE_OP_NAME not in customs
    assert not fc_weights & {schema.TensorType.INT4, schema.TensorType.INT8}  # no quantized FULLY_CONNECTED left
    # int8 prefill keeps XNNPACK's matmuls, but for the LM head of its last row, which XNNPACK then never
    # packs; int4 prefill runs its projections in the kernel too (--prefill-linears kernel, the default)
    customs, fc_weights = decode_ops(kernel_bundle / manifest.model_file, "prefill_8")
    assert customs & set(LINEAR_OP_NAMES) == ({"litekv.linear_int8", "litekv.linear_int4"} if quantize == "int4"
                                              else {"litekv.linear_int8"})
    assert ROPE_OP_NAME not in customs
    if quantize == "int4":
        assert manifest.prefill_linears == "kernel" and not fc_weights & {schema.TensorType.INT4}
    else:
        assert manifest.prefill_linears == "graph" and schema.TensorType.INT8 in fc_weights
    customs, fc_weights = decode_ops(graph_bundle / manifest.model_file)
    assert not customs & set(LINEAR_OP_NAMES)
    assert ROPE_ATTENTION_F16 in customs  # its attention is litekv's, which takes the RoPE too
    # the weights are stored once: the float scale vectors it adds are smaller than the block-sum
    # matrices and ops the graph form's decode needs
    sizes = [(b / "model.tflite").stat().st_size for b in (kernel_bundle, graph_bundle)]
    assert sizes[0] < 1.05 * sizes[1]


def test_the_kernels_are_the_default_for_quantized_weights():
    def kind(**options):
        return ConvertOptions(max_context=64, prefill_lengths=(8,), **options).linears_kind

    assert kind(backend="litert", quantize="int4") == kind(backend="litert", quantize="int8") == "kernel"
    assert kind(backend="onnx", quantize="int4") == "kernel"
    assert kind(backend="litert", quantize="fp32") == kind(backend="onnx", quantize="int8") == "graph"
    assert kind(backend="litert", quantize="int4", lora_rank=4) == "graph"  # LoRA's matmuls stay in XNNPACK
    assert kind(backend="onnx", quantize="int4", lora_rank=4) == "graph"
    assert kind(backend="litert", quantize="int4", decode_attention="graph", prefill_attention="graph") == "graph"
    assert kind(backend="litert", quantize="int4", decode_linears="graph") == "graph"


def test_prefill_linears_default_to_the_kernel_for_int4_weights_only():
    def kind(**options):
        return ConvertOptions(max_context=64, prefill_lengths=(8,), **options).prefill_linears_kind

    assert kind(backend="litert", quantize="int4") == "kernel"
    assert kind(backend="litert", quantize="int8") == kind(backend="litert", quantize="fp32") == "graph"
    assert kind(backend="onnx", quantize="int4") == "kernel"
    assert kind(backend="onnx", quantize="int8") == "graph"
    assert kind(backend="litert", quantize="int4", lora_rank=4) == "graph"
    assert kind(backend="litert", quantize="int4", decode_linears="graph") == "graph"
    assert kind(backend="litert", quantize="int4", prefill_linears="graph") == "graph"
    assert kind(backend="litert", quantize="int8", prefill_linears="kernel") == "graph"  # no int4 projection
    with pytest.raises(ConfigError, match="unknown prefill linears"):
        ConvertOptions(backend="litert", quantize="int4", prefill_linears="fast")


def test_a_manifest_with_unknown_prefill_linears_is_refused():
    manifest = read_manifest(bundle("llama", "int4", "kernel"))
    assert manifest.prefill_linears == "kernel"
    text = manifest.to_json().replace('"prefill_linears": "kernel"', '"prefill_linears": "fast"')
    with pytest.raises(BundleError, match="unknown prefill_linears 'fast'; reconvert"):
        Manifest.from_json(text, "litekv.json")


def test_fp32_weights_keep_graph_linears_and_onnx_takes_kernels_for_int4_only():
    assert ConvertOptions(backend="litert", quantize="fp32", decode_linears="kernel").linears_kind == "graph"
    with pytest.raises(ConfigError, match="int4 weights"):
        ConvertOptions(backend="onnx", quantize="int8", decode_linears="kernel")
    with pytest.raises(ConfigError, match="no LoRA graph"):
        ConvertOptions(backend="onnx", quantize="int4", decode_linears="kernel", lora_rank=4)
    with pytest.raises(ConfigError, match="unknown decode linears"):
        ConvertOptions(backend="litert", quantize="int4", decode_linears="fast")


def test_an_onnx_manifest_with_kernel_linears_and_no_decode_graph_is_refused():
    manifest = read_manifest(bundle("llama", "int4", "kernel"))
    text = manifest.to_json().replace('"backend": "litert"', '"backend": "onnx"')
    with pytest.raises(BundleError, match="reconvert"):
        Manifest.from_json(text, "litekv.json")


def test_each_phase_gives_the_other_phases_weights_back(tmp_path):
    """Decode reads the model file's weights and an int8 prefill XNNPACK's packed copy: after a
    prefill neither that copy nor the file's weights are resident, after steps the copy still is
    not, and the logits do not change when they fault back in. Its own bundle: no other test maps
    its files."""
    from litekv.executor.litert_executor import xnnpack_cache_file
    from test_resident_pages import resident_kb

    options = ConvertOptions(backend="litert", quantize="int8", max_context=64, prefill_lengths=PREFILL_LENGTHS,
                             decode_linears="kernel")
    path = convert(checkpoint_dir("llama"), tmp_path / "bundle", options)
    ex = open_executor(path)
    packed = xnnpack_cache_file(Path(ex.model.path), read_manifest(path).fingerprint)
    prompt = np.random.default_rng(6).integers(3, ex.config.vocab_size, 9)
    first, again = ex.create_kv_cache(), ex.create_kv_cache()
    ex.prefill(prompt[:-1], first)
    assert resident_kb(packed) == 0 and resident_kb(ex.model.path) == 0
    logits = ex.step([int(prompt[-1])], first)
    assert resident_kb(ex.model.path) > 0 and resident_kb(packed) == 0
    ex.prefill(prompt[:-1], again)  # the packed copy faults back in, and goes again
    assert resident_kb(packed) == 0
    np.testing.assert_array_equal(ex.step([int(prompt[-1])], again), logits)
