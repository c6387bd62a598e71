"""Bundles with a float16 KV cache: the graph casts new rows, LiteRT's kernels read the halves
(their `_f16` forms; builtin-op attention casts the cache back), and ONNX Runtime's
GroupQueryAttention runs in float16."""
from __future__ import annotations

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conformance import reference
from kv_formats import (BACKENDS, assert_cache_round_trips, assert_steps_follow_reference, caches_after_a_prompt,
                        kv_format_bundle, tflite_custom_ops_and_cache_types)
from litekv.converters.convert import ConvertOptions
from litekv.executor import open_executor
from litekv.native_attention import available as kernel_available
from model_factory import ARCHITECTURES


def fp16_kv_bundle(arch: str, backend: str = "onnx"):
    return kv_format_bundle(arch, backend, "fp16")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp16_cache_holds_the_reference_keys_and_values_rounded(arch, backend):
    """Layer 0's K/V depend on nothing rounded: the reference's within half a float16 ulp (2^-11
    relative), except ONNX keys, which GroupQueryAttention rotates in float16 after the rounding.
    Later layers carry the earlier layers' rounding too: still about 1e-4 of the values' size."""
    ex, ref = open_executor(fp16_kv_bundle(arch, backend)), reference(arch)
    for layer, kind, got, exact in caches_after_a_prompt(ex, ref, np.float16):
        error = np.abs(got.astype(np.float32) - exact)
        if layer == 0 and (kind == "v" or backend != "onnx"):
            assert np.all(error <= np.abs(exact) * 2.0 ** -11 * 1.01 + 1e-6), kind
        assert np.mean(error) < 1e-3 * np.mean(np.abs(exact)), (kind, layer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp16_cache_logits_stay_close_to_the_reference(arch, backend):
    assert_steps_follow_reference(open_executor(fp16_kv_bundle(arch, backend)), reference(arch), 0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_cache_round_trips_through_serialization(backend):
    assert_cache_round_trips(open_executor(fp16_kv_bundle("llama", backend)), backend, np.float16)


def test_litert_steps_read_halves_in_the_kernel():
    """Decode and prefill entry points call the kernels' f16 forms on float16 cache tensors; the
    graph-attention bundle casts the cache with builtin ops instead."""
    expected = [("litert-graph", set())]
    if kernel_available():  # steps in the rope form: RoPE and the row writes in the op
        expected.append(("litert", {"litekv.decode_attention_rope_f16", "litekv.prefill_attention_f16",
                                    "litekv.linear_f32_screened"}))
    for backend, ops in expected:
        customs, kv_types = tflite_custom_ops_and_cache_types(fp16_kv_bundle("llama", backend) / "model.tflite")
        assert customs == ops
        assert kv_types and all(t == schema.TensorType.FLOAT16 for t in kv_types)


def test_the_default_cache_for_float_weights_is_float16_on_litert_and_float32_on_onnx():
    """ONNX Runtime's GroupQueryAttention computes a float16 cache in float16 on the CPU, which ran
    slower than float32 (bench/PERFORMANCE.md); litekv's kernels widen the halves as they read."""
    assert ConvertOptions(backend="litert", quantize="fp32", max_context=64, prefill_lengths=(8,)).kv_format == "fp16"
    assert ConvertOptions(backend="onnx", quantize="fp32", max_context=64, prefill_lengths=(8,)).kv_format == "fp32"
    assert ConvertOptions(backend="litert", max_context=64, prefill_lengths=(8,), kv_cache="fp32").kv_format == "fp32"
    assert open_executor(fp16_kv_bundle("llama", "onnx")).manifest.kv_dtype == "float16"
