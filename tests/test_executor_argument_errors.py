"""User mistakes at the executor and KV cache APIs: each raises a litekv error saying what to do,
before anything changes (the cache keeps its tokens and contents)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conformance import BACKENDS, MAX_CONTEXT, bundle, executor, reference
from litekv import SamplerConfig
from litekv.errors import ConfigError
from litekv.executor import SamplerParams, open_executor
from litekv.flat_tables import build, parse
from litekv.kv_cache import _DATA, IDENTIFIER, SCHEMA, KVCache, KVCacheError, _checksum

ARCH = "llama"
ALL = BACKENDS + ("numpy",)


def get(backend: str):
    return reference(ARCH) if backend == "numpy" else executor(ARCH, backend)


def prefilled(ex, n: int = 6, batch_size: int = 1) -> KVCache:
    cache = ex.create_kv_cache(batch_size)
    ex.prefill(np.random.default_rng(n).integers(3, 300, n), cache)
    return cache


def snapshot(cache: KVCache) -> tuple[int, np.ndarray, np.ndarray]:
    return cache.num_tokens, cache.key_cache(0).copy(), cache.value_cache(cache.num_layers - 1).copy()


def assert_unchanged(cache: KVCache, before: tuple[int, np.ndarray, np.ndarray]) -> None:
    num_tokens, keys, values = snapshot(cache)
    assert num_tokens == before[0]
    np.testing.assert_array_equal(keys, before[1])
    np.testing.assert_array_equal(values, before[2])


# ---- 1: sampler parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf), ("temperature", -0.5),
    ("temperature", 1e-45),  # a float32 denormal: the graph would divide by (nearly) zero
    ("temperature", 1e39),  # inf in float32
    ("temperature", "0.7"), ("temperature", None), ("temperature", True),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", 1e-50),
    ("top_k", 2.5), ("top_k", 2**31), ("top_k", 2**40), ("top_k", -1), ("top_k", True), ("top_k", "3"),
    ("top_k", math.nan),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0), ("seed", False), ("seed", "7"),
])
def test_bad_sampler_params_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"sampler {field}"):
        SamplerParams(**{field: value})


@pytest.mark.parametrize("field, value", [("temperature", math.nan), ("top_k", 2**40), ("top_k", 2.5),
                                          ("temperature", math.inf)])
def test_sampler_config_refuses_what_sampler_params_refuses(field, value):
    with pytest.raises(ConfigError, match=f"sampler {field}"):
        SamplerConfig(**{field: value})


def test_sampler_params_keep_python_numbers():
    """numpy scalars are accepted and stored as Python numbers (a numpy int64 seed would overflow in
    the seed derivation)."""
    params = SamplerParams(temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9), seed=np.uint64(7))
    assert (type(params.temperature), type(params.top_k), type(params.top_p), type(params.seed)) == (
        float, int, float, int)
    assert params == SamplerParams(0.5, 5, 0.9, 7)


@pytest.mark.parametrize("backend", ALL)
def test_largest_accepted_top_k_and_seed_run(backend):
    """The bounds SamplerParams lets through are ones the graphs take (int32 top_k, derived int32 seed)."""
    ex = get(backend)
    cache = prefilled(ex)
    extreme = SamplerParams(temperature=0.8, top_k=2**31 - 1, top_p=1.0, seed=2**63 - 1)
    tokens = ex.sample_tokens(4, [5], cache, sampler=extreme)
    assert tokens.shape == (1, 4) and 0 <= tokens.min() and tokens.max() < ex.config.vocab_size
    # top_k that large means no limit: the same draws as top_k 0
    again = prefilled(ex)
    unlimited = SamplerParams(temperature=0.8, top_k=0, top_p=1.0, seed=2**63 - 1)
    assert ex.sample_tokens(4, [5], again, sampler=unlimited).tolist() == tokens.tolist()


# ---- 2: raw exceptions on user mistakes ---------------------------------------------------------

STEP_CALLS = {
    "step": lambda ex, tokens, cache: ex.step(tokens, cache),
    "sample_tokens": lambda ex, tokens, cache: ex.sample_tokens(2, tokens, cache),
}


@pytest.mark.parametrize("call", STEP_CALLS)
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("batch_size, tokens", [(1, [1, 2]), (1, []), (1, [[1, 2]]), (2, [1]), (2, [1, 2, 3]),
                                                (2, [[1, 2]])])
def test_a_step_needs_one_token_per_row(backend, call, batch_size, tokens):
    ex = get(backend)
    cache = prefilled(ex, batch_size=batch_size)
    before = snapshot(cache)
    with pytest.raises(ConfigError, match=rf"one token per batch row: \[{batch_size}\]"):
        STEP_CALLS[call](ex, tokens, cache)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("call", STEP_CALLS)
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("tokens, match", [(["a"], "must be ints"), ([1.5], "must be ints"), ([10**30], "must be ints"),
                                           ([-1], "token id -1 is outside"), ([10**6], "token id 1000000 is outside")])
def test_a_step_refuses_ids_that_are_not_token_ids(backend, call, tokens, match):
    ex = get(backend)
    cache = prefilled(ex)
    before = snapshot(cache)
    with pytest.raises(ConfigError, match=match):
        STEP_CALLS[call](ex, tokens, cache)
    assert_unchanged(cache, before)


RELEASED_CALLS = {
    **STEP_CALLS,
    "prefill": lambda ex, tokens, cache: ex.prefill(tokens, cache),
}


@pytest.mark.parametrize("call", RELEASED_CALLS)
@pytest.mark.parametrize("backend", ALL)
def test_a_released_cache_is_refused_before_it_is_read(backend, call):
    ex = get(backend)
    cache = prefilled(ex)
    cache.release()
    with pytest.raises(KVCacheError, match="was released.*create_kv_cache"):
        RELEASED_CALLS[call](ex, [1], cache)


@pytest.mark.parametrize("access", [
    lambda c: c.key_cache(0), lambda c: c.value_cache(1), lambda c: c.raw_keys(0), lambda c: c.batch_size,
    lambda c: c.num_entries, lambda c: c.num_layers, lambda c: c.dtype, lambda c: c.format, lambda c: c.serialize(),
])
def test_a_released_cache_says_so(access):
    cache = KVCache.allocate(2, 1, 2, 8, 16)
    cache.release()
    with pytest.raises(KVCacheError, match="was released"):
        access(cache)
    assert repr(cache) == f"KVCache(id={cache.cache_id}, released)"
    assert not cache.is_valid()


@pytest.mark.parametrize("access", ["key_cache", "value_cache", "raw_keys", "raw_values", "key_scales", "value_scales",
                                    "raw_key_scales", "raw_value_scales"])
@pytest.mark.parametrize("layer", [2, 99, -1, 1.0, True, "0"])
def test_a_layer_outside_the_cache_names_the_valid_range(access, layer):
    cache = KVCache.allocate(2, 1, 2, 8, 16, dtype="int8", row_scales=True)
    cache.set_num_tokens(3)
    with pytest.raises(KVCacheError, match=r"this cache has layers 0\.\.1"):
        getattr(cache, access)(layer)
    assert getattr(cache, access)(1).shape[0] == 1  # layer 1 exists
    assert cache.num_tokens == 3


@pytest.mark.parametrize("backend", ALL)
def test_sample_tokens_takes_a_sampler_config(backend):
    ex = get(backend)
    config = SamplerConfig(temperature=0.7, top_k=20, top_p=0.9, seed=11)
    via_config = ex.sample_tokens(6, [5], prefilled(ex), None, config)
    via_params = ex.sample_tokens(6, [5], prefilled(ex), None, config.params)
    assert via_config.tolist() == via_params.tolist()


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("sampler, match", [
    ("greedy", "must be a SamplerParams or a litekv.SamplerConfig, got str"),
    (None, "got NoneType"),
    ({"temperature": 0.7}, "got dict"),
    (SamplerConfig(temperature=0.7, repetition_penalty=1.3), "no repetition penalty"),
])
def test_sample_tokens_refuses_other_samplers(backend, sampler, match):
    ex = get(backend)
    cache = prefilled(ex)
    before = snapshot(cache)
    with pytest.raises(ConfigError, match=match):
        ex.sample_tokens(2, [5], cache, None, sampler)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options, match", [
    (dict(accelerator="bogus"), r"unknown accelerator 'bogus'.*'cpu', 'gpu', 'npu', 'auto'"),
    (dict(accelerator="CPU"), "unknown accelerator 'CPU'"),
    (dict(accelerator=3), "unknown accelerator 3"),
    (dict(threads=-1), "threads must be a positive int.*got -1"),
    (dict(threads=0), "threads must be a positive int.*got 0"),
    (dict(threads=1.5), "threads must be a positive int.*got 1.5"),
    (dict(threads=True), "threads must be a positive int.*got True"),
])
def test_open_executor_checks_accelerator_and_threads(backend, options, match):
    with pytest.raises(ConfigError, match=match):
        open_executor(bundle(ARCH, backend), **options)


@pytest.mark.parametrize("backend, accelerator, match", [
    ("litert", ["CPUExecutionProvider"], "for the litert backend"),  # provider lists are ONNX Runtime's
    ("onnx", [], "a list of ONNX Runtime execution providers"),
    ("onnx", [3], "a list of ONNX Runtime execution providers"),
])
def test_provider_lists_are_for_onnx_runtime_only(backend, accelerator, match):
    with pytest.raises(ConfigError, match=match):
        open_executor(bundle(ARCH, backend), accelerator=accelerator)


def test_litert_executor_checks_its_own_options():
    from litekv.bundle import read_manifest
    from litekv.executor.litert_executor import LiteRTExecutor

    path = bundle(ARCH, "litert")
    with pytest.raises(ConfigError, match="attention_threads must be a positive int"):
        LiteRTExecutor(path, read_manifest(path), attention_threads=-2)
    with pytest.raises(ConfigError, match="unknown accelerator 'tpu'"):
        LiteRTExecutor(path, read_manifest(path), accelerator="tpu")


def test_onnx_executor_checks_its_own_options():
    from litekv.bundle import read_manifest
    from litekv.executor.onnx_executor import OnnxExecutor

    path = bundle(ARCH, "onnx")
    with pytest.raises(ConfigError, match="threads must be a positive int"):
        OnnxExecutor(path, read_manifest(path), threads=-1)
    with pytest.raises(ConfigError, match="unknown accelerator 'tpu'"):
        OnnxExecutor(path, read_manifest(path), accelerator="tpu")


def foreign_caches(ex) -> dict[str, tuple[KVCache, str]]:
    """Caches another executor (or format) would make, each with a field its error must name."""
    cfg, layout = ex.config, ex.kv_layout
    other_layout = "BHSD" if layout == "BSHD" else "BSHD"
    shape = (cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim)
    return {
        "float16": (KVCache.allocate(*shape, MAX_CONTEXT, layout, "float16"), "dtype 'float16'"),
        "int8 row scales": (KVCache.allocate(*shape, MAX_CONTEXT, "BSHD", "int8", row_scales=True), "row_scales True"),
        "other layout": (KVCache.allocate(*shape, MAX_CONTEXT, other_layout), f"layout '{other_layout}'"),
        "other capacity": (KVCache.allocate(*shape, MAX_CONTEXT // 2, layout), f"capacity {MAX_CONTEXT // 2}"),
        "other model": (reference("qwen3").create_kv_cache(), "num_layers|num_kv_heads|head_dim"),
    }


@pytest.mark.parametrize("call", RELEASED_CALLS)
@pytest.mark.parametrize("kind", ["float16", "int8 row scales", "other layout", "other capacity", "other model"])
@pytest.mark.parametrize("backend", ALL)
def test_a_cache_of_another_format_is_refused(backend, kind, call):
    ex = get(backend)
    cache, field = foreign_caches(ex)[kind]
    cache.set_num_tokens(3)
    before = snapshot(cache)
    with pytest.raises(KVCacheError, match=rf"not made for this {ex.backend} executor: .*({field}).*create_kv_cache"):
        RELEASED_CALLS[call](ex, [1], cache)
    assert_unchanged(cache, before)


def test_a_cache_of_the_other_backend_is_refused():
    """LiteRT keeps [batch, slot, head, dim], ONNX Runtime [batch, head, slot, dim]: a cache of one
    read by the other would be garbage."""
    litert, onnx = get("litert"), get("onnx")
    for ours, theirs in ((litert, onnx), (onnx, litert)):
        cache = prefilled(theirs)
        before = snapshot(cache)
        with pytest.raises(KVCacheError, match=f"layout '{theirs.kv_layout}'"):
            ours.step([1], cache)
        assert_unchanged(cache, before)


def relabeled(data: bytes, **changes) -> bytes:
    """A serialized cache with header fields changed and the checksum made to match again."""
    fields = parse(SCHEMA, data, IDENTIFIER)
    fields.update(changes)
    header = {k: fields[k] for k, _ in SCHEMA if k not in _DATA}
    scales = (fields["key_scales"], fields["value_scales"]) if fields["row_scales"] else (None, None)
    fields["checksum"] = _checksum(header, fields["keys"], fields["values"], *scales)
    return build(SCHEMA, {k: v for k, v in fields.items() if v is not None}, IDENTIFIER)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD_KB8", "XYZ", ""])
@pytest.mark.parametrize("backend", ALL)
def test_a_serialized_cache_claiming_another_layout_is_refused(backend, layout):
    ex = get(backend)
    source, target = prefilled(ex, 7), prefilled(ex, 4)
    before = snapshot(target)
    data = source.serialize()
    control = ex.create_kv_cache()
    control.load(relabeled(data))  # the relabeling itself keeps a file loadable
    assert control.num_tokens == 7
    with pytest.raises(KVCacheError, match=f"says its data is in '{layout}' order.*'BSHD'"):
        target.load(relabeled(data, layout=layout))
    assert_unchanged(target, before)


# ---- 3: per-token bookkeeping -------------------------------------------------------------------

@pytest.mark.parametrize("backend", ALL)
def test_a_step_of_python_ints_is_checked_without_numpy_reductions(backend, monkeypatch):
    """The call a session makes each token, [id], is range-checked in Python (numpy's min and max
    cost microseconds a step); other inputs still go through the array checks."""
    ex = get(backend)
    cache = prefilled(ex)
    array_checks = []
    original = ex._check_ids
    monkeypatch.setattr(ex, "_check_ids", lambda tokens: array_checks.append(tokens.shape) or original(tokens))
    ex.step([5], cache)
    ex.sample_tokens(1, [5], cache)
    assert array_checks == []
    ex.step(np.array([5]), cache)
    assert array_checks == [(1,)]
    with pytest.raises(ConfigError, match="token id 1000000 is outside"):  # the Python path still checks
        ex.step([10**6], cache)
    assert cache.num_tokens == 9


@pytest.mark.parametrize("backend", ALL)
def test_backend_cancel_state_is_reset_only_after_a_cancel(backend, monkeypatch):
    """Calls skip resetting the backend's cancel state (new RunOptions on ONNX) unless a cancel came;
    a cancel that arrives as a call finishes still does not stop the next call."""
    ex = get(backend)
    cache = prefilled(ex)
    resets = []
    original_reset = ex._reset_backend_cancel
    monkeypatch.setattr(ex, "_reset_backend_cancel", lambda: resets.append(1) or original_reset())
    ex.step([5], cache)
    assert resets == []
    original_decode = ex._decode

    def cancelled_late(*args):
        logits = original_decode(*args)
        ex.cancel()  # while the call still runs: the backend is interrupted, but its run is over
        return logits

    monkeypatch.setattr(ex, "_decode", cancelled_late)
    ex.step([5], cache)
    monkeypatch.setattr(ex, "_decode", original_decode)
    ex.step([6], cache)  # not cancelled: the request was for the finished call
    ex.sample_tokens(2, [6], cache)
    assert resets == [1] and cache.num_tokens == 11
