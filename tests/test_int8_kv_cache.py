"""Bundles with an int8 KV cache: codes x static per-channel scales, in ONNX Runtime's
GroupQueryAttention and in LiteRT (the graph quantizes new rows, litekv's kernel reads the codes)."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnx
import pytest
from ai_edge_litert import schema_py_generated as schema

from conformance import checkpoint_dir, reference, relative_error
from kv_formats import (BACKENDS, assert_cache_round_trips, assert_steps_follow_reference, caches_after_a_prompt,
                        kv_format_bundle, tflite_custom_ops_and_cache_types)
from litekv.converters import kv_calibration
from litekv.converters.checkpoint import load_checkpoint
from litekv.converters.convert import ConvertOptions, convert
from litekv.errors import ConfigError
from litekv.executor import open_executor
from litekv.native_attention import available as kernel_available
from model_factory import ARCHITECTURES


def int8_kv_bundle(arch: str, backend: str = "onnx", lora_rank: int | None = None):
    return kv_format_bundle(arch, backend, "int8", lora_rank)


def scales(bundle, kind: str, layer: int) -> np.ndarray:
    """The graph's scale for one layer, as [KVH, D] (the dequantized value is code * scale)."""
    if (bundle / "model.tflite").exists():  # 1 / scale, a constant [KVH*D] every entry point quantizes with
        kv_heads = open_executor(bundle).config.num_kv_heads
        model = schema.Model.GetRootAs((bundle / "model.tflite").read_bytes(), 0)
        for g in range(model.SubgraphsLength()):
            graph = model.Subgraphs(g)
            for i in range(graph.TensorsLength()):
                tensor = graph.Tensors(i)
                if tensor.Name().decode() == f"kv_inverse_scale.{kind}.{layer}":
                    inverse = model.Buffers(tensor.Buffer()).DataAsNumpy().view(np.float32).reshape(kv_heads, -1)
                    return (1.0 / inverse.astype(np.float64)).astype(np.float32)
        raise AssertionError(f"no scale tensor for {kind} {layer}")
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    init = next(t for t in model.graph.initializer if t.name == f"kv_scale_{kind}_{layer}")
    return onnx.numpy_helper.to_array(init)[0, :, 0, :]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int8_cache_holds_the_reference_keys_and_values(arch, backend):
    """Layer 0's K/V depend on nothing quantized: within half a step of the reference (or clipped
    at the calibrated range). Later layers also carry the earlier layers' rounding."""
    bundle = int8_kv_bundle(arch, backend)
    ex, ref = open_executor(bundle), reference(arch)
    for layer, kind, codes, exact in caches_after_a_prompt(ex, ref, np.int8):
        step = scales(bundle, kind, layer)
        clipped = np.maximum(np.abs(exact) - 127 * step, 0)  # beyond the calibrated range
        error = np.abs(codes.astype(np.float32) * step - exact)
        if layer == 0:
            assert np.all(error <= step / 2 + clipped + 1e-6), kind
        assert np.mean(error / step) < 1.0, (kind, layer)
        assert np.mean(clipped > 0) < 0.02, (kind, layer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int8_cache_logits_stay_close_to_the_reference(arch, backend):
    assert_steps_follow_reference(open_executor(int8_kv_bundle(arch, backend)), reference(arch), 0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_cache_round_trips_through_serialization(backend):
    assert_cache_round_trips(open_executor(int8_kv_bundle("llama", backend)), backend, np.int8)


@pytest.mark.skipif(not kernel_available(), reason="no kernel")
def test_litert_steps_read_int8_codes_in_the_kernel():
    """Decode and prefill entry points call the kernels' int8 forms on int8 cache tensors (decode its
    rope form, which also rotates, quantizes and writes the step's rows); the graph-attention bundle
    dequantizes with builtin ops instead."""
    for backend, ops in (("litert", {"litekv.decode_attention_rope_int8", "litekv.prefill_attention_int8",
                                     "litekv.linear_f32_screened"}),
                         ("litert-graph", set())):
        customs, kv_types = tflite_custom_ops_and_cache_types(int8_kv_bundle("llama", backend) / "model.tflite")
        assert customs == ops
        assert kv_types and all(t == schema.TensorType.INT8 for t in kv_types)


@pytest.mark.skipif(not kernel_available(), reason="no kernel")
def test_litert_decode_quantizes_and_writes_rows_in_the_op():
    """The one-token entry point leaves rotating, quantizing and writing its rows to the rope form (no
    ROUND, CAST or DYNAMIC_UPDATE_SLICE, and the cache tensors are its inputs only); prefill chunks
    still quantize and write theirs with builtin ops."""
    bundle = int8_kv_bundle("llama", "litert")
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs((bundle / "model.tflite").read_bytes(), 0))
    builtin = schema.BuiltinOperator
    row_ops = {builtin.ROUND, builtin.CAST, builtin.DYNAMIC_UPDATE_SLICE}
    seen = set()
    for sig in model.signatureDefs:
        key = sig.signatureKey.decode()
        if key == "sampler":
            continue
        graph = model.subgraphs[sig.subgraphIndex]
        codes = {model.operatorCodes[op.opcodeIndex].builtinCode for op in graph.operators}
        outputs = {o.name.decode() for o in sig.outputs}
        if key.startswith("prefill"):
            assert row_ops <= codes and any(name.startswith("kv_cache_") for name in outputs), key
        else:
            assert not row_ops & codes and not any(name.startswith("kv_cache_") for name in outputs), key
        seen.add(key.startswith("prefill"))
    assert seen == {True, False}


@lru_cache(maxsize=1)
def _checkpoint():
    return load_checkpoint(checkpoint_dir("llama"))


def _calibrate(*texts: str):
    ckpt = _checkpoint()
    return kv_calibration.int8_kv_scales(ckpt.config, ckpt.weights, ckpt.tokenizer, texts)


CALIBRATION_PAIR = ("A short note about trains.", "x = [3 ** i for i in range(9)]  # powers of three")


def test_calibration_takes_the_widest_range_over_its_texts():
    """A text that reaches further in any channel widens that channel's scale, and only that."""
    both, one, two = _calibrate(*CALIBRATION_PAIR), _calibrate(CALIBRATION_PAIR[0]), _calibrate(CALIBRATION_PAIR[1])
    for kind in (0, 1):  # keys, values
        np.testing.assert_allclose(both[kind], np.maximum(one[kind], two[kind]), rtol=1e-6)
        assert np.any(two[kind] > one[kind])  # the second text does reach further


def test_calibration_scales_leave_the_key_and_value_headrooms():
    """code 127 stands for the calibrated bound times KEY_HEADROOM (keys) or VALUE_HEADROOM (values)."""
    ckpt = _checkpoint()
    model = kv_calibration.ReferenceModel(ckpt.config, dict(ckpt.weights))
    bounds = kv_calibration._bounds(ckpt.config, model, kv_calibration._prompt(ckpt.tokenizer, CALIBRATION_PAIR[0]))
    for scales, bound, headroom in zip(_calibrate(CALIBRATION_PAIR[0]), bounds,
                                       (kv_calibration.KEY_HEADROOM, kv_calibration.VALUE_HEADROOM)):
        moved = bound > 1e-2 * bound.max()  # well above the floor a still channel gets
        np.testing.assert_allclose((scales * 127 / bound)[moved], headroom, rtol=1e-5)


def test_the_default_cache_is_int8_only_for_quantized_weights_on_the_kernels():
    """With int4 weights an int8 cache keeps the float16 cache's agreement and decodes faster in
    litekv's kernel, so it is LiteRT's default there, and with int8 weights on litekv's linear
    kernels (their default); fp32 weights keep float16, and so do graph attention (which widens the
    cache every step), LoRA bundles (scales calibrated without adapters) and int8 weights in XNNPACK's
    linears. ONNX int4 and int8 weights on litekv's attention ops get int8 too, whatever runs their
    linears; fp32 weights, GroupQueryAttention and LoRA bundles keep float32."""
    def kv_format(**options):
        return ConvertOptions(max_context=64, prefill_lengths=(8,), **options).kv_format

    defaults = {(backend, quantize): kv_format(backend=backend, quantize=quantize)
                for backend in ("litert", "onnx") for quantize in ("fp32", "int8", "int4")}
    assert defaults == {("litert", "fp32"): "fp16", ("litert", "int8"): "int8", ("litert", "int4"): "int8",
                        ("onnx", "fp32"): "fp32", ("onnx", "int8"): "int8", ("onnx", "int4"): "int8"}
    # ONNX on litekv's attention ops: int8, read by the Int8 ops; GroupQueryAttention keeps float32
    assert kv_format(backend="onnx", quantize="int4", decode_linears="graph") == "int8"
    assert kv_format(backend="onnx", quantize="int4", decode_attention="graph") == "fp32"
    assert kv_format(backend="onnx", quantize="int8", decode_attention="graph") == "fp32"
    assert kv_format(backend="onnx", quantize="int4", lora_rank=4) == "fp32"
    assert kv_format(backend="onnx", quantize="int8", lora_rank=4) == "fp32"
    assert kv_format(backend="litert", quantize="int8", decode_linears="graph") == "fp16"
    assert kv_format(backend="litert", quantize="int8", lora_rank=4) == "fp16"
    assert kv_format(backend="litert", quantize="int4", decode_attention="graph") == "fp16"
    assert kv_format(backend="litert", quantize="int4", lora_rank=4) == "fp16"
    assert kv_format(backend="litert", quantize="int4", kv_cache="fp16") == "fp16"


@pytest.mark.skipif(not kernel_available(), reason="no kernel")
def test_an_int4_litert_bundle_gets_a_calibrated_int8_cache_by_default(tmp_path):
    options = ConvertOptions(backend="litert", quantize="int4", max_context=64, prefill_lengths=(8,), kv_buckets=(64,))
    path = convert(checkpoint_dir("llama"), tmp_path / "int4", options)
    ex = open_executor(path)
    assert ex.manifest.kv_dtype == "int8" and ex.create_kv_cache().dtype == np.int8
    # the scales an explicit --kv-cache int8 gets: calibration runs on the unquantized weights
    for kind in ("k", "v"):
        np.testing.assert_array_equal(scales(path, kind, 0), scales(int8_kv_bundle("llama", "litert"), kind, 0))


def test_unknown_kv_cache_format_is_refused():
    with pytest.raises(ConfigError, match="KV cache format"):
        ConvertOptions(backend="onnx", kv_cache="fp8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_cache_with_a_lora_adapter(backend, tmp_path):
    """LoRA changes the K/V the graph quantizes, not how: steps follow the merged-weights reference."""
    from test_executors import ARCH, merged_reference, write_peft_adapter

    ex = open_executor(int8_kv_bundle(ARCH, backend, lora_rank=4))
    tensors = write_peft_adapter(tmp_path / "adapter", ex.config, rank=4, alpha=1, seed=3)
    adapter = ex.load_lora(tmp_path / "adapter")
    expected = merged_reference(tensors, 4, 1)
    prompt = np.random.default_rng(8).integers(3, ex.config.vocab_size, 9)
    ours, theirs = ex.create_kv_cache(), expected.create_kv_cache()
    ex.prefill(prompt[:-1], ours, lora_id=adapter)
    expected.prefill(prompt[:-1], theirs)
    base = reference(ARCH)
    plain = base.create_kv_cache()
    base.prefill(prompt[:-1], plain)
    token = prompt[-1]
    for step in range(4):
        mine, exact = ex.step([token], ours, lora_id=adapter), expected.step([token], theirs)
        assert relative_error(mine, exact) < 0.05
        if step == 0:  # the adapter moves the logits far more than the tolerance
            assert relative_error(base.step([token], plain), exact) > 0.2
        token = int(np.argmax(exact))


def test_a_cache_saved_in_another_format_is_refused_with_the_remedy():
    """A session from a bundle with a float16 cache does not load into an int8 one (LiteRT int4's
    default since the cache formats differ by weights): the error says what to convert."""
    from litekv.kv_cache import KVCache, KVCacheError

    saved = KVCache.allocate(2, 1, 3, 64, 16, dtype="float16")
    saved.set_num_tokens(4)
    here = KVCache.allocate(2, 1, 3, 64, 16, dtype="int8")
    with pytest.raises(KVCacheError, match="--kv-cache"):
        here.load(saved.serialize())
    assert here.num_tokens == 0


def test_int8_bundles_share_a_fingerprint_that_their_scales_are_part_of():
    """A session's int8 codes mean something only with the scales that wrote them: bundles with the
    same scales (either backend) accept each other's sessions, a float cache's bundle does not."""
    from conformance import bundle as float_cache_bundle
    from litekv.bundle import read_manifest

    onnx, litert = (read_manifest(int8_kv_bundle("llama", b)).fingerprint for b in ("onnx", "litert"))
    assert onnx == litert
    assert onnx != read_manifest(float_cache_bundle("llama", "onnx")).fingerprint
