"""Executor conformance: every backend through the base, external- and internal-sampler interfaces."""
from __future__ import annotations

import json
import random
import threading
import weakref

import numpy as np
import pytest
from safetensors.numpy import save_file

from conformance import BACKENDS, MAX_CONTEXT, PREFILL_LENGTHS, checkpoint_dir, executor, reference, relative_error
from litekv.converters.checkpoint import load_checkpoint
from litekv.errors import Cancelled, ContextFull
from litekv.executor import LoraError, LoraInUse, SamplerParams
from litekv.executor.numpy_executor import NumpyExecutor
from litekv.kv_cache import KVCacheError

ARCH = "llama"
ALL = BACKENDS + ("numpy",)


def get(backend: str, lora_rank: int | None = None):
    return reference(ARCH, lora_rank) if backend == "numpy" else executor(ARCH, backend, lora_rank=lora_rank)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_external_and_internal_greedy_agree(backend):
    ex = get(backend)
    a, b = ex.create_kv_cache(), ex.create_kv_cache()
    ex.prefill(prompt(9), a)
    ex.prefill(prompt(9), b)
    token, external = 5, []
    for _ in range(12):
        token = int(np.argmax(ex.step([token], a)[0]))
        external.append(token)
    internal = ex.sample_tokens(12, [5], b)
    assert internal.tolist() == [external]


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_takes_the_top_logit_without_running_the_sampler_graph(backend, monkeypatch):
    """Greedy steps take the top logit on the host (4 us against the sampler graph's 94-129 for
    SmolLM2, bench/PERFORMANCE.md, thirty-first round); the other samplers run the graph."""
    ex = get(backend)
    owner, name = (ex, "_sample_on_graph") if backend == "onnx" else (ex._sampler, "run")
    original, runs = getattr(owner, name), []
    monkeypatch.setattr(owner, name, lambda *a: runs.append(1) or original(*a))
    cache = ex.create_kv_cache()
    ex.prefill(prompt(5), cache)
    ex.sample_tokens(4, [3], cache)
    ex.sample_tokens(3, [3], cache, sampler=SamplerParams(top_k=1, temperature=0.7))
    assert runs == []
    ex.sample_tokens(2, [3], cache, sampler=SamplerParams(temperature=0.9, seed=3))
    assert runs == [1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_matches_host_sampler(backend):
    ex, ref = get(backend), reference(ARCH)
    sampler = SamplerParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt(6), ours)
    ref.prefill(prompt(6), theirs)
    got = ex.sample_tokens(20, [7], ours, sampler=sampler)
    assert got.tolist() == ref.sample_tokens(20, [7], theirs, sampler=sampler).tolist()
    again = ex.create_kv_cache()
    ex.prefill(prompt(6), again)
    assert ex.sample_tokens(20, [7], again, sampler=sampler).tolist() == got.tolist()
    assert len(set(got[0].tolist())) > 3  # really sampling, not greedy


# ---- KV cache operations -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ALL)
def test_serialize_load_continue_equals_uninterrupted(backend):
    ex = get(backend)
    straight, saved = ex.create_kv_cache(), ex.create_kv_cache()
    ex.prefill(prompt(11), straight)
    ex.prefill(prompt(11), saved)
    restored = ex.create_kv_cache()
    restored.load(saved.serialize())
    assert restored.num_tokens == 11 and restored.cache_id != saved.cache_id
    np.testing.assert_array_equal(restored.key_cache(1), saved.key_cache(1))
    assert ex.sample_tokens(8, [4], restored).tolist() == ex.sample_tokens(8, [4], straight).tolist()


@pytest.mark.parametrize("backend", ALL)
def test_select_and_broadcast_with_batch_three(backend):
    ex = get(backend)
    single = ex.create_kv_cache()
    ex.prefill(prompt(7), single)
    batch = ex.create_kv_cache(batch_size=3)
    batch.broadcast_and_copy_from(single)
    assert batch.num_tokens == 7
    for row in range(3):
        np.testing.assert_array_equal(batch.key_cache(0)[row], single.key_cache(0)[0])
    # Three candidates continue differently; selecting one equals running it alone.
    ex.step([11, 12, 13], batch)
    picked = ex.create_kv_cache()
    picked.select_and_copy_from(batch, 2)
    alone = single.deep_copy()
    ex.step([13], alone)
    np.testing.assert_allclose(picked.key_cache(1)[0], alone.key_cache(1)[0], rtol=0, atol=1e-5)
    assert relative_error(ex.step([21], picked), ex.step([21], alone)) < 1e-5


@pytest.mark.parametrize("backend", ALL)
def test_deep_copy_is_independent_and_clone_handle_shares(backend):
    ex = get(backend)
    cache = ex.create_kv_cache()
    ex.prefill(prompt(5), cache)
    copy, handle = cache.deep_copy(), cache.clone_handle()
    assert copy.cache_id != cache.cache_id and handle.cache_id == cache.cache_id
    ex.step([9], cache)
    assert handle.num_tokens == 6 and copy.num_tokens == 5
    np.testing.assert_array_equal(handle.key_cache(0), cache.key_cache(0))
    assert not np.array_equal(copy.raw_keys(0), cache.raw_keys(0))


@pytest.mark.parametrize("backend", ALL)
def test_stats_and_block_table_follow_num_tokens(backend):
    ex = get(backend)
    cache = ex.create_kv_cache()
    ex.prefill(prompt(33), cache)
    stats = cache.stats()
    assert stats.tokens_stored == cache.num_tokens == 33
    assert stats.capacity == MAX_CONTEXT and stats.utilization == pytest.approx(33 / MAX_CONTEXT)
    assert stats.memory_bytes == 2 * ex.config.num_layers * MAX_CONTEXT * ex.config.num_kv_heads * ex.config.head_dim * 4
    assert cache.block_table == [0, 1, 2]  # 16-token blocks
    assert cache.key_cache(0).shape == (1, 33, ex.config.num_kv_heads, ex.config.head_dim)
    assert not cache.key_cache(0).flags.writeable


@pytest.mark.parametrize("damage", ["truncate", "flip", "other_model", "version"])
def test_bad_serialized_cache_leaves_target_unchanged(damage):
    ex = get("onnx")
    source, target = ex.create_kv_cache(), ex.create_kv_cache()
    ex.prefill(prompt(6), source)
    ex.prefill(prompt(4, seed=9), target)
    before = target.key_cache(0).copy()
    data = bytearray(source.serialize())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "other_model":
        data = bytearray(reference("qwen3").create_kv_cache().serialize())
    else:
        from litekv.flat_tables import build
        from litekv.kv_cache import IDENTIFIER, SCHEMA

        data = build(SCHEMA, {"version": 99}, IDENTIFIER)
    with pytest.raises(KVCacheError):
        target.load(bytes(data))
    assert target.num_tokens == 4
    np.testing.assert_array_equal(target.key_cache(0), before)


def test_context_full_is_raised_before_any_state_changes():
    ex = get("onnx")
    cache = ex.create_kv_cache()
    ex.prefill(prompt(MAX_CONTEXT - 2), cache)
    with pytest.raises(ContextFull):
        ex.prefill(prompt(3), cache)
    with pytest.raises(ContextFull):
        ex.sample_tokens(3, [1], cache)
    assert cache.num_tokens == MAX_CONTEXT - 2


# ---- LoRA -----------------------------------------------------------------------------------------

def write_peft_adapter(directory, cfg, rank, alpha, seed, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    rng = np.random.default_rng(seed)
    dims = {"q_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
            "k_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
            "v_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
            "o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for t in targets:
            out_dim, in_dim = dims[t]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{prefix}.lora_A.weight"] = (0.3 * rng.standard_normal((rank, in_dim))).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (0.3 * rng.standard_normal((out_dim, rank))).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": alpha, "target_modules": list(targets), "peft_type": "LORA"}))
    return tensors


def merged_reference(tensors, rank, alpha):
    """The reference with W + (alpha / r) B A folded into the weights: independent of LoRA inputs."""
    ckpt = load_checkpoint(checkpoint_dir(ARCH), with_tokenizer=False)
    weights = dict(ckpt.weights)
    for key, a in tensors.items():
        if key.endswith("lora_A.weight"):
            b = tensors[key.replace("lora_A", "lora_B")]
            parts = key.split(".")
            layer, target = parts[4], parts[6][0]
            name = f"layers.{layer}.{target}.weight"
            weights[name] = weights[name] + (alpha / rank) * (b @ a)
    return NumpyExecutor(ckpt.config, weights, max_context=MAX_CONTEXT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_matches_merged_weights_and_switches_per_call(backend, tmp_path):
    ex = get(backend, lora_rank=8)
    cfg = ex.config
    first = write_peft_adapter(tmp_path / "a", cfg, rank=4, alpha=8, seed=1)  # lower rank: zero-padded
    second = write_peft_adapter(tmp_path / "b", cfg, rank=8, alpha=4, seed=2)
    id_a, id_b = ex.load_lora(tmp_path / "a"), ex.load_lora(tmp_path / "b")
    plain = get(backend)
    for lora_id, expected_model in ((id_a, merged_reference(first, 4, 8)), (None, reference(ARCH)),
                                    (id_b, merged_reference(second, 8, 4)), (None, plain)):
        ours, theirs = ex.create_kv_cache(), expected_model.create_kv_cache()
        ex.prefill(prompt(9), ours, lora_id=lora_id)
        expected_model.prefill(prompt(9), theirs)
        assert relative_error(ex.step([3], ours, lora_id=lora_id), expected_model.step([3], theirs)) < 1e-4
    ex.unload_lora(id_a)
    with pytest.raises(LoraError):
        ex.step([3], ex.create_kv_cache(), lora_id=id_a)


def test_lora_rejects_mismatches(tmp_path):
    ex = get("onnx", lora_rank=4)
    write_peft_adapter(tmp_path / "big", ex.config, rank=8, alpha=8, seed=1)
    with pytest.raises(LoraError, match="rank 8 is higher"):
        ex.load_lora(tmp_path / "big")
    write_peft_adapter(tmp_path / "mlp", ex.config, rank=2, alpha=2, seed=1, targets=("q_proj",))
    bad = tmp_path / "mlp" / "adapter_model.safetensors"
    from safetensors.numpy import load_file

    tensors = load_file(str(bad))
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = np.zeros((2, 64), np.float32)
    save_file(tensors, str(bad))
    with pytest.raises(LoraError, match="not a LoRA factor"):
        ex.load_lora(tmp_path / "mlp")
    with pytest.raises(LoraError, match="without LoRA inputs"):
        get("onnx").load_lora(tmp_path / "big")
    write_peft_adapter(tmp_path / "shape", ex.config, rank=2, alpha=2, seed=1, targets=("v_proj",))
    shaped = tmp_path / "shape" / "adapter_model.safetensors"
    tensors = load_file(str(shaped))
    tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] = np.zeros((7, 2), np.float32)
    save_file(tensors, str(shaped))
    with pytest.raises(LoraError, match=r"layer 1 v has A \(2, 64\) and B \(7, 2\)"):
        ex.load_lora(tmp_path / "shape")


def test_unloading_an_adapter_in_use_is_refused(tmp_path):
    ex = get("onnx", lora_rank=4)
    write_peft_adapter(tmp_path / "a", ex.config, rank=4, alpha=4, seed=3)
    lora_id = ex.load_lora(tmp_path / "a")
    cache = ex.create_kv_cache()
    ex.prefill(prompt(4), cache, lora_id=lora_id)
    errors = []
    with ex._call(lora_id):  # what a running call holds
        try:
            ex.unload_lora(lora_id)
        except LoraInUse as e:
            errors.append(e)
    assert len(errors) == 1
    ex.unload_lora(lora_id)


# ---- cancellation -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_from_another_thread_stops_sample_tokens_within_one_step(backend):
    """50 cancels from another thread at random steps of a 200-step sample_tokens: alternately
    while a step's model call is about to run (the backend's own interrupt stops it) and after
    the call returned (the step completes, the next one never starts)."""
    steps, prompt_len = 200, 4
    ex = executor(ARCH, backend, max_context=256)
    baseline_cache = ex.create_kv_cache()
    ex.prefill(prompt(prompt_len), baseline_cache)
    baseline = ex.sample_tokens(steps, [8], baseline_cache)[0].tolist()
    rng = random.Random(5)
    for trial in range(50):
        target = prompt_len + rng.randint(0, steps - 2)
        cancel_once(ex, baseline, steps, prompt_len, target, trial, inside_call=trial % 2 == 0)


def cancel_once(ex, baseline, steps, prompt_len, target, trial, inside_call: bool):
    """Another thread cancels at step `target`, which is held open (before or after its model
    call) until the request has been made, so the outcome does not depend on scheduling."""
    cache = ex.create_kv_cache()
    ex.prefill(prompt(prompt_len), cache)
    step_reached, cancel_sent = threading.Event(), threading.Event()
    original = ex._sample

    def hold() -> None:
        step_reached.set()
        assert cancel_sent.wait(30), "the cancelling thread never ran"

    def observed(tokens, kv_cache, *args):
        at_target = kv_cache.num_tokens == target
        if at_target and inside_call:
            hold()
        out = original(tokens, kv_cache, *args)
        if at_target and not inside_call:
            hold()
        return out

    def canceller():
        if step_reached.wait(30):
            ex.cancel()
        cancel_sent.set()

    thread = threading.Thread(target=canceller)
    thread.start()
    ex._sample = observed
    try:
        with pytest.raises(Cancelled):
            ex.sample_tokens(steps, [8], cache)
    finally:
        del ex._sample
        thread.join()
    assert step_reached.is_set(), f"trial {trial}: step {target} never ran"
    # Inside the call the backend's interrupt stops the step (nothing committed); after it the
    # step is committed and no further step starts.
    expected = target if inside_call else target + 1
    assert cache.num_tokens == expected, f"trial {trial}: {cache.num_tokens} tokens, expected {expected}"
    done = cache.num_tokens - prompt_len
    # Continuing from exactly the committed tokens reproduces the uncancelled run.
    last = baseline[done - 1] if done else 8
    rest = ex.sample_tokens(steps - done, [last], cache)[0].tolist()
    assert baseline[:done] + rest == baseline, f"trial {trial}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_stops_prefill_after_at_most_one_further_chunk(backend):
    ex = get(backend)
    long_prompt = prompt(MAX_CONTEXT - 1, seed=4)
    expected = ex.create_kv_cache()
    ex.prefill(long_prompt, expected)
    for stop_after in (1, 2, 5):
        cache, calls = ex.create_kv_cache(), []
        original = ex._run_prefill_chunk

        def observed(tokens, chunk, *args):
            original(tokens, chunk, *args)
            calls.append(chunk)
            if len(calls) == stop_after:
                ex.cancel()

        ex._run_prefill_chunk = observed
        ex._prefill_sizes = lambda: PREFILL_LENGTHS  # chunks of 8: an ONNX graph would take the prompt in one
        try:
            with pytest.raises(Cancelled):
                ex.prefill(long_prompt, cache)
        finally:
            del ex._run_prefill_chunk, ex._prefill_sizes
        assert len(calls) <= stop_after + 1
        assert cache.num_tokens == sum(c.real for c in calls)
        ex.prefill(long_prompt[cache.num_tokens:], cache)
        np.testing.assert_allclose(cache.key_cache(1), expected.key_cache(1), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_from_another_thread_during_prefill(backend):
    ex = get(backend)
    long_prompt = prompt(MAX_CONTEXT - 1, seed=4)
    expected = ex.create_kv_cache()
    ex.prefill(long_prompt, expected)
    for _ in range(10):
        cache = ex.create_kv_cache()
        timer = threading.Timer(0.0005, ex.cancel)
        timer.start()
        try:
            ex.prefill(long_prompt, cache)
        except Cancelled:
            pass
        timer.join()
        n = cache.num_tokens
        assert 0 <= n <= len(long_prompt)
        np.testing.assert_allclose(cache.key_cache(0), expected.key_cache(0)[:, :n], atol=1e-5)
        ex.prefill(long_prompt[n:], cache)  # the executor keeps working and completes the prompt
        np.testing.assert_allclose(cache.key_cache(2 % ex.config.num_layers), expected.key_cache(2 % ex.config.num_layers), atol=1e-5)


def test_cancel_when_idle_is_a_noop():
    ex = get("onnx")
    ex.cancel()
    cache = ex.create_kv_cache()
    ex.prefill(prompt(5), cache)
    assert cache.num_tokens == 5


# ---- accelerators ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_accelerator_reports_what_it_got(backend):
    from conformance import bundle
    from litekv.executor import open_executor

    ex = open_executor(bundle(ARCH, backend), accelerator="auto")
    assert ex.accelerator in ("gpu", "npu", "cpu")
    cache = ex.create_kv_cache()
    ex.prefill(prompt(5), cache)
    assert relative_error(ex.step([3], cache), get(backend).step([3], _prefilled(get(backend), 5))) < 1e-3


def _prefilled(ex, n):
    cache = ex.create_kv_cache()
    ex.prefill(prompt(n), cache)
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("accelerator", ["gpu", "npu"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_accelerator_delegate_matches_reference(backend, accelerator):
    """Desktop GPU-delegate test: runs where the accelerator exists, skipped with the reason elsewhere."""
    from conformance import bundle
    from litekv.errors import AcceleratorUnavailable
    from litekv.executor import open_executor

    try:
        ex = open_executor(bundle(ARCH, backend), accelerator=accelerator)
    except AcceleratorUnavailable as e:
        assert e.reason  # never a silent fallback: the backend says why
        pytest.skip(f"{backend} {accelerator} unavailable: {e.reason[:200]}")
    assert ex.accelerator == accelerator
    ref = reference(ARCH)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt(9), ours)
    ref.prefill(prompt(9), theirs)
    assert relative_error(ex.step([3], ours), ref.step([3], theirs)) < 1e-2  # GPU kernels may use fp16


@pytest.mark.parametrize("backend", ALL)
def test_caches_created_and_dropped_repeatedly_stay_correct(backend):
    """Regression: LiteRT once read the freed memory of an earlier cache after it was dropped."""
    ex, ref = get(backend), reference(ARCH)
    for length in (4, 8, 5, 8, 13, 8):
        tokens = prompt(length + 1, seed=length)
        ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()  # the previous `ours` dies here
        ex.prefill(tokens[:-1], ours)
        ref.prefill(tokens[:-1], theirs)
        garbage = [np.full(4096, 7.0, np.float32) for _ in range(64)]  # reuse freed memory
        assert relative_error(ex.step([tokens[-1]], ours), ref.step([tokens[-1]], theirs)) < 1e-4
        del garbage


@pytest.mark.parametrize("backend", BACKENDS)
def test_bundle_without_in_graph_sampler_samples_on_the_host(tmp_path, backend):
    from litekv.converters.convert import ConvertOptions, convert
    from litekv.executor import open_executor

    options = ConvertOptions(backend=backend, max_context=64, prefill_lengths=(8,), sampler=False)
    ex = open_executor(convert(checkpoint_dir(ARCH), tmp_path / "b", options))
    sampler = SamplerParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
    ours, theirs = ex.create_kv_cache(), reference(ARCH).create_kv_cache()
    ex.prefill(prompt(6), ours)
    reference(ARCH).prefill(prompt(6), theirs)
    assert ex.sample_tokens(10, [7], ours, sampler=sampler).tolist() == \
        reference(ARCH).sample_tokens(10, [7], theirs, sampler=sampler).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_logits_the_caller_keeps_are_never_overwritten(backend):
    """Steps reuse the memory of logits the caller dropped, and only that: kept arrays and views keep their values."""
    ex = get(backend)
    cache = ex.create_kv_cache()
    ex.prefill(prompt(6), cache)
    kept, copies, view, view_copy = [], [], None, None
    for i, token in enumerate(prompt(9, seed=3)):
        logits = ex.step([int(token)], cache)
        if i % 3 == 0:
            kept.append(logits)
            copies.append(logits.copy())
        elif i == 4:
            view, view_copy = logits[0, 10:20], logits[0, 10:20].copy()
        del logits
    for array, copy in zip(kept, copies):
        np.testing.assert_array_equal(array, copy)
    np.testing.assert_array_equal(view, view_copy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_reuses_the_logits_memory_the_caller_dropped(backend):
    """A fresh logits array every step was a fresh mapping (49 page faults a SmolLM2 step)."""
    ex = get(backend)
    cache = ex.create_kv_cache()
    ex.prefill(prompt(6), cache)
    first = ex.step([5], cache)
    dropped, token = weakref.ref(first), int(np.argmax(first[0]))
    del first
    second = ex.step([token], cache)
    assert dropped() is second
    third = ex.step([int(np.argmax(second[0]))], cache)  # `second` is still held here
    assert third is not second


@pytest.mark.parametrize("backend", ALL)
def test_caches_on_huge_pages_and_on_4kb_pages_give_the_same_steps(backend, monkeypatch):
    """The tiny model's cache is under a huge page: a smaller threshold puts it in one map as a large
    model's is, bound in place like any other buffers."""
    import litekv.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "HUGE_PAGE_BYTES", 4096)
    ex = get(backend)
    huge, small = ex.create_kv_cache(), ex.create_kv_cache(huge_pages=False)
    assert huge.huge_pages and not small.huge_pages
    for cache in (huge, small):
        ex.prefill(prompt(9), cache)
    for token in (3, 17, 250):
        assert relative_error(ex.step([token], huge), ex.step([token], small)) < 1e-6
    assert len(_maps(huge)) == 1 and len(_maps(small)) == 2 * ex.config.num_layers
    kept = _maps(huge)
    del huge  # LiteRT recycles its buffers: of the kind asked for only
    again = ex.create_kv_cache(huge_pages=False)
    assert not again.huge_pages and not _maps(again) & kept


def _maps(cache) -> set[int]:
    """The memory a cache's K/V buffers are views of (a map, or a heap array), by identity."""
    roots = set()
    for array in cache._s.keys + cache._s.values:
        while isinstance(array.base, np.ndarray):
            array = array.base
        roots.add(id(array if array.base is None else array.base))
    return roots
