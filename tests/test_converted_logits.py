"""Converted TFLite and ONNX models give the reference's logits, for every architecture."""
from __future__ import annotations

import numpy as np
import pytest

from conformance import (BACKENDS, KV_BUCKETS, MAX_CONTEXT, PREFILL_LENGTHS, bundle, checkpoint_dir, executor,
                         reference, relative_error)
from litekv.converters.checkpoint import load_checkpoint
from litekv.converters.quantize import QuantPlan, int4_blockwise_asymmetric, int8_per_channel
from litekv.executor.numpy_executor import NumpyExecutor
from model_factory import ARCHITECTURES

TOLERANCE = 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_prefill_length(arch, backend):
    ex, ref = executor(arch, backend), reference(arch)
    for length in PREFILL_LENGTHS:
        prompt = np.random.default_rng(length).integers(3, ex.config.vocab_size, length + 1)
        ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
        ex.prefill(prompt[:-1], ours)
        ref.prefill(prompt[:-1], theirs)
        assert ours.num_tokens == length
        for layer in (0, ex.config.num_layers - 1):
            assert relative_error(ours.key_cache(layer), theirs.key_cache(layer)) < TOLERANCE
            assert relative_error(ours.value_cache(layer), theirs.value_cache(layer)) < TOLERANCE
        assert relative_error(ex.step([prompt[-1]], ours), ref.step([prompt[-1]], theirs)) < TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prompt_then_decode_across_bucket_change(arch, backend):
    ex, ref = executor(arch, backend), reference(arch)
    prompt = np.random.default_rng(7).integers(3, ex.config.vocab_size, 13)  # 8 + 4 + 1 chunks
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt, ours)
    ref.prefill(prompt, theirs)
    token = int(prompt[-1])
    for _ in range(16):  # positions 13..28 cross the 16-slot bucket boundary
        expected = ref.step([token], theirs)
        assert relative_error(ex.step([token], ours), expected) < TOLERANCE
        token = int(np.argmax(expected[0]))
    assert ours.num_tokens == 29 and 16 < ours.num_tokens < KV_BUCKETS[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bundle_manifest_describes_the_model(backend):
    from litekv.bundle import read_manifest

    manifest = read_manifest(bundle("gemma3", backend))
    assert manifest.backend == backend and manifest.config.architecture == "gemma3"
    assert manifest.max_context == 64 and manifest.prefill_lengths == PREFILL_LENGTHS
    assert manifest.kv_layout == ("BSHD" if backend == "litert" else "BHSD")
    assert len(manifest.fingerprint) == 32 and manifest.file_sizes[manifest.model_file] > 0
    names = {s.name for s in manifest.signatures}
    if backend == "litert":
        assert {"decode", "prefill_4", "prefill_8", "decode_s16", "prefill_8_s16", "sampler"} <= names
        decode, prefill = manifest.signature("decode"), manifest.signature("prefill_8")
        assert "kv_cache_k_0" in decode.inputs and "mask" in decode.inputs and "kv_cache_k_0" in prefill.outputs
        # a float cache's steps write their rows in litekv's attention op: the cache is only an input there
        assert manifest.kv_dtype in ("float32", "float16") and "kv_cache_k_0" not in decode.outputs
    else:
        assert manifest.signature("model").inputs[:2] == ("tokens", "input_pos")


def test_same_model_same_fingerprint_on_both_backends():
    from litekv.bundle import read_manifest

    prints = {read_manifest(bundle("llama", b)).fingerprint for b in BACKENDS}
    assert len(prints) == 1
    assert read_manifest(bundle("llama", "onnx", "int8")).fingerprint not in prints


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_lora_inputs_equal_the_model_without_lora(backend):
    from litekv.executor import LoraAdapter

    with_lora, plain = executor("qwen2", backend, lora_rank=4), executor("qwen2", backend)
    zeros = LoraAdapter("zeros", 4, {})  # runs the LoRA entry points with all-zero factors
    zero_id = with_lora.load_lora(zeros)
    tokens = np.random.default_rng(3).integers(3, 300, 10)
    expected_cache = plain.create_kv_cache()
    plain.prefill(tokens, expected_cache)
    expected = plain.step([5], expected_cache)
    for lora_id in (None, zero_id):
        cache = with_lora.create_kv_cache()
        with_lora.prefill(tokens, cache, lora_id=lora_id)
        np.testing.assert_array_equal(cache.key_cache(1), expected_cache.key_cache(1)[:, :10])
        np.testing.assert_array_equal(with_lora.step([5], cache, lora_id=lora_id), expected)


def as_stored(w: np.ndarray, fmt: str, block_size: int) -> np.ndarray:
    """The weight a `fmt` bundle stores, back in float32."""
    if fmt == "fp32":
        return np.asarray(w, np.float32)
    if fmt not in ("int8", "int4"):
        raise ValueError(f"no dequantization for {fmt!r} here")
    if fmt == "int4":
        q, scales, offsets = int4_blockwise_asymmetric(w, block_size)
        blocks = q.reshape(*offsets.shape, block_size).astype(np.float32)
        return (blocks * scales.astype(np.float32)[..., None] + offsets[..., None]).reshape(np.shape(w))
    q, scales = int8_per_channel(w)
    return (q * scales[:, None]).astype(np.float32)


def dequantized_reference(arch: str, quantize: str, lm_head: str | None = None) -> NumpyExecutor:
    """The reference on the weights a `quantize` bundle stores, dequantized: what its graph computes
    up to the kernels' activation rounding."""
    ckpt = load_checkpoint(checkpoint_dir(arch), with_tokenizer=False)
    plan = QuantPlan.named(quantize, lm_head)
    weights = dict(ckpt.weights)
    head = np.asarray(weights.get("lm_head.weight", weights["embed.weight"]), np.float32)
    for name, w in ckpt.weights.items():
        if name.startswith("layers.") and np.ndim(w) == 2:
            weights[name] = as_stored(np.asarray(w, np.float32), plan.weights, plan.block_size)
    assert plan.embedding == "fp16", "dequantize the plan's table format here"
    weights["lm_head.weight"] = as_stored(head, plan.lm_head, plan.block_size)
    weights["embed.weight"] = np.asarray(weights["embed.weight"], np.float16).astype(np.float32)
    return NumpyExecutor(ckpt.config, weights, max_context=MAX_CONTEXT)


@pytest.mark.parametrize("quantize, lm_head", [("int8", None), ("int4", None), ("int4", "int4")])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_graph_computes_its_dequantized_weights(arch, backend, quantize, lm_head):
    """Catches structural errors in the quantized projections (block sums, offsets, scales): the
    bundle matches the reference on its own dequantized weights up to activation rounding, and
    for int4 much more closely than the fp32 reference does. The int4 LM head (the scope
    onnxruntime-genai quantizes) goes through the same check."""
    ex = executor(arch, backend, quantize, lm_head=lm_head)
    dequantized, fp32 = dequantized_reference(arch, quantize, lm_head), reference(arch)
    prompt = np.random.default_rng(3).integers(3, ex.config.vocab_size, 9)
    caches = [m.create_kv_cache() for m in (ex, dequantized, fp32)]
    for model, cache in zip((ex, dequantized, fp32), caches):
        model.prefill(prompt[:-1], cache)
    for token in [prompt[-1], 5, 9, 17]:
        ours, expected, unquantized = (m.step([token], c) for m, c in zip((ex, dequantized, fp32), caches))
        error = relative_error(ours, expected)
        assert error < 2.5e-2, error  # what int8 activations inside the kernels cost
        if quantize == "int4":  # int4 weights differ from fp32 ~10x more than the kernels' rounding
            assert error < relative_error(unquantized, expected) / 4


def test_tflite_int4_projections_read_no_float_matrices(tmp_path):
    """XNNPACK packs its own copy of a constant for every op that uses it, so a float32 matrix
    shared by every int4 projection (the 0/1 block-membership matmul) is read once per projection
    per step, and float32 offsets are 4x the bytes of int8 ones: 26-31 MB per SmolLM2 int4 step,
    against 88 MB of int4 weights and int8 head. The block sums are a reshape and a sum, and the
    offsets are int8 codes. (The graph form, `--prefill-linears graph`: by default decode steps and
    prefill chunks run litekv's linear kernels.)"""
    from ai_edge_litert import schema_py_generated as schema

    from litekv.converters.convert import ConvertOptions, convert

    options = ConvertOptions(backend="litert", quantize="int4", max_context=MAX_CONTEXT,
                             prefill_lengths=PREFILL_LENGTHS, prefill_linears="graph")
    path = convert(checkpoint_dir("llama"), tmp_path / "graph-prefill", options)
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs((path / "model.tflite").read_bytes(), 0))
    decode = next(model.subgraphs[s.subgraphIndex] for s in model.signatureDefs if s.signatureKey.startswith(b"prefill"))
    fully_connected = [i for i, code in enumerate(model.operatorCodes)
                       if code.builtinCode == schema.BuiltinOperator.FULLY_CONNECTED]
    weights = [decode.tensors[op.inputs[1]] for op in decode.operators if op.opcodeIndex in fully_connected]
    offsets = [w for w in weights if w.name.endswith(b".offsets")]
    assert offsets and all(w.type == schema.TensorType.INT8 for w in offsets)
    float_weights = {w.name.decode() for w in weights if w.type == schema.TensorType.FLOAT32}
    assert all(name.startswith("rope.rotate_half") for name in float_weights), float_weights
