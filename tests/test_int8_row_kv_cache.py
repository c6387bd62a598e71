"""LiteRT bundles with `--kv-cache int8-row`: int8 codes with a float32 scale per token and KV head,
computed by the graph as each row is written and read by the kernels' int8_rows forms."""
from __future__ import annotations

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conformance import reference
from kv_formats import (assert_cache_round_trips, assert_steps_follow_reference, kv_format_bundle, prompted_caches,
                        tflite_custom_ops_and_cache_types)
from litekv.bundle import read_manifest
from litekv.converters.convert import ConvertOptions
from litekv.errors import ConfigError
from litekv.executor import open_executor
from litekv.kv_cache import KVCache, KVCacheError
from litekv.native_attention import available as kernel_available
from model_factory import ARCHITECTURES

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the int8-row cache is read by litekv's kernels")


def row_bundle(arch: str, lora_rank: int | None = None):
    return kv_format_bundle(arch, "litert", "int8-row", lora_rank)


def caches_after_a_prompt(ex, ref):
    """(layer, kind, codes, scales, the reference's rows) after kv_formats.prompted_caches."""
    ours, theirs = prompted_caches(ex, ref, np.int8)
    assert ours.row_scales
    for layer in range(ex.config.num_layers):
        yield layer, "k", ours.key_cache(layer), ours.key_scales(layer), theirs.key_cache(layer)
        yield layer, "v", ours.value_cache(layer), ours.value_scales(layer), theirs.value_cache(layer)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_row_holds_the_reference_within_half_its_own_step(arch):
    """A row's scale is its largest |x| / 127, so its largest element is a code of +-127 and every
    element of layer 0 (which depends on nothing quantized) is within half a step. Later layers
    carry the earlier layers' rounding too."""
    ex, ref = open_executor(row_bundle(arch)), reference(arch)
    for layer, kind, codes, scales, exact in caches_after_a_prompt(ex, ref):
        step = scales[..., None]
        error = np.abs(codes.astype(np.float32) * step - exact)
        if layer == 0:
            assert np.all(error <= step / 2 * 1.01 + 1e-7), kind
            np.testing.assert_allclose(scales, np.abs(exact).max(axis=-1) / 127, rtol=1e-5)
        assert np.all(np.abs(codes).max(axis=-1) == 127), (kind, layer)  # every row spends the whole range
        assert np.mean(error / step) < 0.5, (kind, layer)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_stay_closer_to_the_reference_than_with_static_scales(arch):
    """Per-row scales spend all 8 bits on each row: the steps follow the float reference within 1 %
    (the static int8 cache's tolerance is 5 %)."""
    assert_steps_follow_reference(open_executor(row_bundle(arch)), reference(arch), 0.01)


def test_round_trips_through_serialization_and_deep_copies():
    assert_cache_round_trips(open_executor(row_bundle("llama")), "litert", np.int8)


def test_the_entry_points_call_the_int8_rows_forms_on_int8_codes_and_float_scales():
    bundle = row_bundle("llama")
    customs, kv_types = tflite_custom_ops_and_cache_types(bundle / "model.tflite")
    assert customs == {"litekv.decode_attention_int8_rows", "litekv.prefill_attention_int8_rows", "litekv.rope",
                       "litekv.linear_f32_screened"}
    assert kv_types and all(t == schema.TensorType.INT8 for t in kv_types)
    manifest = read_manifest(bundle)
    assert manifest.kv_row_scales and manifest.kv_dtype == "int8"
    decode = manifest.signature("decode")
    layers = manifest.config.num_layers
    for kind in ("k", "v"):
        names = {f"kv_scale_{kind}_{layer}" for layer in range(layers)}
        assert names <= set(decode.inputs) and names <= set(decode.outputs)


def test_a_session_continues_the_same_after_save_and_load(tmp_path):
    import litekv

    engine = litekv.Engine(row_bundle("llama"))
    session = engine.create_session()
    session.prefill(list(np.random.default_rng(4).integers(3, engine.config.vocab_size, 11)))
    session.save(tmp_path / "s.lkvs")
    expected = [c.token_id for c in session.generate(max_new_tokens=6)]
    restored = engine.load_session(tmp_path / "s.lkvs")
    assert restored.kv_cache.row_scales
    assert [c.token_id for c in restored.generate(max_new_tokens=6)] == expected


def test_caches_with_and_without_row_scales_do_not_mix():
    rows = KVCache.allocate(2, 1, 3, 64, 16, dtype="int8", row_scales=True)
    static = KVCache.allocate(2, 1, 3, 64, 16, dtype="int8")
    rows.set_num_tokens(4)
    static.set_num_tokens(4)
    for here, there in ((static, rows), (rows, static)):
        before = here.raw_keys(0).copy()
        with pytest.raises(KVCacheError, match="--kv-cache"):
            here.load(there.serialize())
        np.testing.assert_array_equal(here.raw_keys(0), before)
        assert here.num_tokens == 4
        with pytest.raises(KVCacheError, match="row scales"):
            here.select_and_copy_from(there, 0)
    with pytest.raises(KVCacheError, match="no scales per row"):
        static.key_scales(0)
    with pytest.raises(ConfigError, match="int8"):
        KVCache.allocate(2, 1, 3, 64, 16, dtype="float16", row_scales=True)


def test_row_scales_travel_with_every_copy():
    rng = np.random.default_rng(0)
    source = KVCache.allocate(2, 2, 3, 64, 16, dtype="int8", row_scales=True)
    for layer in range(2):
        for raw in (source.raw_keys(layer), source.raw_values(layer)):
            raw[...] = rng.integers(-127, 128, raw.shape)
        for raw in (source.raw_key_scales(layer), source.raw_value_scales(layer)):
            raw[...] = rng.random(raw.shape)
    source.set_num_tokens(9)
    picked = KVCache.allocate(2, 1, 3, 64, 16, dtype="int8", row_scales=True)
    picked.select_and_copy_from(source, 1)
    spread = KVCache.allocate(2, 3, 3, 64, 16, dtype="int8", row_scales=True)
    spread.broadcast_and_copy_from(picked)
    loaded = KVCache.allocate(2, 3, 3, 64, 16, dtype="int8", row_scales=True)
    loaded.load(spread.serialize())
    for cache in (picked, spread.deep_copy(), loaded):
        for layer in range(2):
            np.testing.assert_array_equal(cache.key_scales(layer)[-1], source.key_scales(layer)[1])
            np.testing.assert_array_equal(cache.value_scales(layer)[-1], source.value_scales(layer)[1])
            np.testing.assert_array_equal(cache.value_cache(layer)[-1], source.value_cache(layer)[1])
    # scales per row add a float per 64 codes: 1/16 of an int8 cache's bytes
    assert source.stats().memory_bytes == 2 * 2 * (2 * 16 * 3 * 64 + 2 * 16 * 3 * 4)


def test_damaged_row_scales_fail_the_checksum():
    cache = KVCache.allocate(1, 1, 1, 64, 8, dtype="int8", row_scales=True)
    cache.raw_key_scales(0)[...] = 0.5
    cache.set_num_tokens(3)
    data = bytearray(cache.serialize())
    at = bytes(data).rfind(np.float32(0.5).tobytes())
    data[at] ^= 1
    with pytest.raises(KVCacheError, match="checksum"):
        KVCache.allocate(1, 1, 1, 64, 8, dtype="int8", row_scales=True).load(bytes(data))


@pytest.mark.parametrize("options, match", [
    (dict(backend="onnx", kv_cache="int8-row"), "LiteRT format"),
    (dict(backend="litert", kv_cache="int8-row", decode_attention="graph"), "kernels only"),
    (dict(backend="litert", kv_cache="int8-row", prefill_attention="graph"), "kernels only"),
    (dict(backend="litert", kv_cache="int8-row", kv_buckets=(2048, 4096)), "one capacity"),
    (dict(backend="litert", kv_cache="int8-row", decode_buckets=(2048, 4096)), "one capacity"),
])
def test_int8_row_needs_litert_and_the_kernels(options, match):
    with pytest.raises(ConfigError, match=match):
        ConvertOptions(**options)


def test_each_batch_rows_scales_bind_64_byte_aligned():
    """LiteRT binds one batch row at a time, zero-copy only at 64-byte alignment: 2 KV heads x 100
    slots is not a multiple of 16 floats, so the rows are padded."""
    cache = KVCache.allocate(1, 3, 2, 64, 100, dtype="int8", row_scales=True)
    for row in range(3):
        for raw in (cache.raw_key_scales(0), cache.raw_value_scales(0)):
            view = raw[row:row + 1]
            assert view.flags.c_contiguous and view.ctypes.data % 64 == 0 and view.shape == (1, 2, 100)


def test_a_batch_steps_each_row_as_a_single_cache_would():
    ex = open_executor(row_bundle("llama"))
    prompt = np.random.default_rng(6).integers(3, ex.config.vocab_size, 7)
    single = ex.create_kv_cache()
    ex.prefill(prompt, single)
    batch = ex.create_kv_cache(batch_size=2)
    batch.broadcast_and_copy_from(single)
    both = ex.step([11, 12], batch)
    np.testing.assert_allclose(both[1], ex.step([12], single)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(batch.key_scales(0)[0, :7], batch.key_scales(0)[1, :7])  # the shared prompt
    assert not np.array_equal(batch.key_scales(0)[0, 7], batch.key_scales(0)[1, 7])  # each row's own token


def test_the_manifest_refuses_row_scales_outside_litert_kernels():
    import json

    from litekv.bundle import MANIFEST, BundleError, Manifest

    data = json.loads((row_bundle("llama") / MANIFEST).read_text())
    Manifest.from_json(json.dumps(data), "as converted")
    for change in ({"backend": "onnx"}, {"decode_attention": "graph"}, {"kv_dtype": "float16"},
                   {"kv_buckets": [32, 64]}):
        with pytest.raises(BundleError, match="row scales"):
            Manifest.from_json(json.dumps({**data, **change}), "changed")


def test_litekv_inspect_names_the_row_scales(capsys):
    from litekv.cli import main

    assert main(["inspect", str(row_bundle("llama"))]) == 0
    assert "KV BSHD int8 with a scale per row" in capsys.readouterr().out
