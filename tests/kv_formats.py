"""Checks shared by the tests of the KV cache formats other than float32 (int8, float16)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

from conformance import _ROOT, PREFILL_LENGTHS, checkpoint_dir, executor, relative_error
from litekv.converters.convert import ConvertOptions, convert
from litekv.kv_cache import KVCacheError
from litekv.native_attention import available as kernel_available

MAX_CONTEXT = 64
KV_BUCKETS = (16, 32, 64)
# LiteRT with litekv's kernel (its form for the cache's type) and with builtin ops only.
BACKENDS = ["onnx", pytest.param("litert", marks=pytest.mark.skipif(not kernel_available(), reason="no kernel")),
            "litert-graph"]


@lru_cache(maxsize=None)
def kv_format_bundle(arch: str, backend: str, kv_cache: str, lora_rank: int | None = None) -> Path:
    """A test model converted with a `kv_cache` ("int8", "fp16") cache for one of BACKENDS."""
    attention = "graph" if backend == "litert-graph" else "kernel"
    # int8-row bundles have one capacity; the others get capacity buckets to bind prefixes of the cache
    buckets = dict(kv_buckets=KV_BUCKETS) if kv_cache != "int8-row" else {}
    litert = dict(decode_attention=attention, prefill_attention=attention, **buckets)
    options = ConvertOptions(backend=backend.split("-")[0], max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS,
                             kv_cache=kv_cache, lora_rank=lora_rank, **(litert if backend != "onnx" else {}))
    return convert(checkpoint_dir(arch), _ROOT / f"{arch}-{backend}-kv{kv_cache}-lora{lora_rank}", options)


def assert_steps_follow_reference(ex, ref, tolerance: float, steps: int = 8) -> None:
    """After the same prefill, each step's logits stay within `tolerance` of the reference's, fed
    the reference's greedy tokens."""
    prompt = np.random.default_rng(5).integers(3, ex.config.vocab_size, 9)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt[:-1], ours)
    ref.prefill(prompt[:-1], theirs)
    token = prompt[-1]
    for _ in range(steps):
        mine, exact = ex.step([token], ours), ref.step([token], theirs)
        assert relative_error(mine, exact) < tolerance
        token = int(np.argmax(exact))


def prompted_caches(ex, ref, dtype):
    """(our cache, the reference's) after the same 12-token prefill (8 + 4 chunks) and one step,
    ours checked to hold `dtype` and 13 tokens."""
    prompt = np.random.default_rng(3).integers(3, ex.config.vocab_size, 13)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt[:-1], ours)
    ref.prefill(prompt[:-1], theirs)
    ex.step([prompt[-1]], ours)
    ref.step([prompt[-1]], theirs)
    assert ours.dtype == dtype and ours.num_tokens == 13
    return ours, theirs


def caches_after_a_prompt(ex, ref, dtype):
    """Each layer's (kind, our cache, the reference's) after prompted_caches."""
    ours, theirs = prompted_caches(ex, ref, dtype)
    for layer in range(ex.config.num_layers):
        yield layer, "k", ours.key_cache(layer), theirs.key_cache(layer)
        yield layer, "v", ours.value_cache(layer), theirs.value_cache(layer)


def assert_cache_round_trips(ex, backend: str, dtype) -> None:
    """A serialized cache of `dtype` loads back and samples the same tokens, and so does a deep
    copy (Session.clone's); a float32 cache of the same model refuses it, naming the dtype, and
    stays as it was."""
    prompt = list(np.random.default_rng(9).integers(3, ex.config.vocab_size, 10))
    straight = ex.create_kv_cache()
    ex.prefill(prompt, straight)
    expected = ex.sample_tokens(6, [5], straight)
    saved = ex.create_kv_cache()
    ex.prefill(prompt, saved)
    copy = saved.deep_copy()
    assert copy.dtype == dtype
    np.testing.assert_array_equal(ex.sample_tokens(6, [5], copy), expected)
    restored = ex.create_kv_cache()
    restored.load(saved.serialize())
    assert restored.dtype == dtype
    np.testing.assert_array_equal(ex.sample_tokens(6, [5], restored), expected)
    float_cache = executor("llama", backend.split("-")[0]).create_kv_cache()
    before = float_cache.raw_keys(0).copy()
    with pytest.raises(KVCacheError, match=np.dtype(dtype).name):
        float_cache.load(saved.serialize())
    np.testing.assert_array_equal(float_cache.raw_keys(0), before)


def tflite_custom_ops_and_cache_types(model_file: Path) -> tuple[set[str], list[int]]:
    """The custom op names a TFLite file calls, and the tensor types of its first entry point's
    `kv_cache_k_0` tensors."""
    model = schema.Model.GetRootAs(Path(model_file).read_bytes(), 0)
    customs = {model.OperatorCodes(i).CustomCode().decode() for i in range(model.OperatorCodesLength())
               if model.OperatorCodes(i).CustomCode()}
    graph = model.Subgraphs(0)
    return customs, [graph.Tensors(i).Type() for i in range(graph.TensorsLength())
                     if graph.Tensors(i).Name() == b"kv_cache_k_0"]
