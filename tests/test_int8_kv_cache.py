"""ONNX bundles with an int8 KV cache (GroupQueryAttention codes x static per-channel scales)."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnx
import pytest

from conformance import _ROOT, PREFILL_LENGTHS, checkpoint_dir, executor, reference, relative_error
from litekv.converters.convert import ConvertOptions, convert
from litekv.errors import ConfigError
from litekv.executor import open_executor
from litekv.kv_cache import KVCacheError
from model_factory import ARCHITECTURES

MAX_CONTEXT = 64


@lru_cache(maxsize=None)
def int8_kv_bundle(arch: str):
    options = ConvertOptions(backend="onnx", max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS, kv_cache="int8")
    return convert(checkpoint_dir(arch), _ROOT / f"{arch}-onnx-kv8", options)


def scales(bundle, kind: str, layer: int) -> np.ndarray:
    """The graph's scale for one layer, as [KVH, D] (the dequantized value is code * scale)."""
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    init = next(t for t in model.graph.initializer if t.name == f"kv_scale_{kind}_{layer}")
    return onnx.numpy_helper.to_array(init)[0, :, 0, :]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int8_cache_holds_the_reference_keys_and_values(arch):
    """Layer 0's K/V depend on nothing quantized: within half a step of the reference (or clipped
    at the calibrated range). Later layers also carry the earlier layers' rounding."""
    bundle = int8_kv_bundle(arch)
    ex, ref = open_executor(bundle), reference(arch)
    prompt = np.random.default_rng(3).integers(3, ex.config.vocab_size, 13)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt[:-1], ours)  # 8 + 4 chunks
    ref.prefill(prompt[:-1], theirs)
    ex.step([prompt[-1]], ours)
    ref.step([prompt[-1]], theirs)
    assert ours.dtype == np.int8 and ours.num_tokens == 13
    for layer in range(ex.config.num_layers):
        for kind, codes, exact in (("k", ours.key_cache(layer), theirs.key_cache(layer)),
                                   ("v", ours.value_cache(layer), theirs.value_cache(layer))):
            step = scales(bundle, kind, layer)
            clipped = np.maximum(np.abs(exact) - 127 * step, 0)  # beyond the calibrated range
            error = np.abs(codes.astype(np.float32) * step - exact)
            if layer == 0:
                assert np.all(error <= step / 2 + clipped + 1e-6), kind
            assert np.mean(error / step) < 1.0, (kind, layer)
            assert np.mean(clipped > 0) < 0.02, (kind, layer)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int8_cache_logits_stay_close_to_the_reference(arch):
    ex, ref = open_executor(int8_kv_bundle(arch)), reference(arch)
    prompt = np.random.default_rng(5).integers(3, ex.config.vocab_size, 9)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt[:-1], ours)
    ref.prefill(prompt[:-1], theirs)
    token = prompt[-1]
    for _ in range(8):
        mine, exact = ex.step([token], ours), ref.step([token], theirs)
        assert relative_error(mine, exact) < 0.05
        token = int(np.argmax(exact))


def test_int8_cache_round_trips_through_serialization():
    ex = open_executor(int8_kv_bundle("llama"))
    prompt = list(np.random.default_rng(9).integers(3, ex.config.vocab_size, 10))
    straight = ex.create_kv_cache()
    ex.prefill(prompt, straight)
    expected = ex.sample_tokens(6, [5], straight)
    saved = ex.create_kv_cache()
    ex.prefill(prompt, saved)
    restored = ex.create_kv_cache()
    restored.load(saved.serialize())
    assert restored.dtype == np.int8
    np.testing.assert_array_equal(ex.sample_tokens(6, [5], restored), expected)
    float_cache = executor("llama", "onnx").create_kv_cache()
    before = float_cache.raw_keys(0).copy()
    with pytest.raises(KVCacheError, match="int8"):
        float_cache.load(saved.serialize())
    np.testing.assert_array_equal(float_cache.raw_keys(0), before)


def test_int8_cache_is_refused_for_litert():
    with pytest.raises(ConfigError, match="--backend onnx"):
        ConvertOptions(backend="litert", kv_cache="int8")
    with pytest.raises(ConfigError, match="KV cache format"):
        ConvertOptions(backend="onnx", kv_cache="fp16")
