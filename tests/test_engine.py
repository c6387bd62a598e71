"""The SDK surface: Engine, Session and Conversation on scripted and converted tiny models."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from conformance import BACKENDS, bundle, checkpoint_dir, reference, relative_error
from fake_executor import ScriptedExecutor
from litekv import ContextFull, Engine, SamplerConfig
from litekv.tokenizer import Tokenizer

ARCH = "llama"


def scripted_engine(text: str, delay: float = 0.0) -> Engine:
    tokenizer = Tokenizer.from_hf_dir(checkpoint_dir(ARCH))
    script = tokenizer.encode(text, add_special_tokens=False)
    executor = ScriptedExecutor(script, tokenizer.vocab_size, delay=delay)
    return Engine.from_executor(executor, tokenizer, "scripted")


@pytest.mark.parametrize("text", ["Grüße 👋🏽 from 東京 — 🚀🔥", "naïve café ☕ 漢字かな交じり文 😀"])
def test_streamed_text_concatenates_to_the_decoded_ids(text):
    engine = scripted_engine(text)
    session = engine.create_session()
    session.prefill("Hello")
    chunks = list(session.generate(max_new_tokens=len(engine.executor.script), ignore_eos=True))
    ids = [c.token_id for c in chunks]
    assert ids == engine.executor.script
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(ids) == text
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_stop_strings_and_eos_end_generation():
    engine = scripted_engine("one two three<|im_end|> four")
    session = engine.create_session()
    session.prefill("x")
    chunks = list(session.generate(max_new_tokens=50, stop=["two"]))
    assert chunks[-1].finish_reason == "stop" and "two" in "".join(c.text for c in chunks)
    session = engine.create_session()
    engine.executor.steps = 0
    assert session.generate_text("x", max_new_tokens=50) == "one two three"


def test_cancel_from_another_thread_during_generate_leaves_the_session_usable():
    engine = scripted_engine("a b c d e f g h i j k l m n o p", delay=0.01)
    session = engine.create_session()
    session.prefill("start")
    timer = threading.Timer(0.05, session.cancel)
    timer.start()
    chunks = list(session.generate(max_new_tokens=100, ignore_eos=True))
    timer.join()
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) < 100
    kept = len(session.tokens)
    assert session.kv_cache.num_tokens == kept - 1  # the cache holds every token but the pending one
    more = list(session.generate(max_new_tokens=3, ignore_eos=True))
    assert [c.finish_reason for c in more] == [None, None, "length"]
    assert len(session.tokens) == kept + 3


def test_context_full_is_raised_before_state_changes():
    engine = scripted_engine("x y z")
    session = engine.create_session()
    session.prefill(list(range(3, 3 + engine.max_context - 1)))
    before = session.tokens
    with pytest.raises(ContextFull):
        session.prefill([5, 6])
    assert session.tokens == before and session.kv_cache.num_tokens == len(before) - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_reproduces(backend):
    engine = Engine(bundle(ARCH, backend))
    sampler = SamplerConfig(temperature=0.9, top_k=30, top_p=0.9, seed=77)
    runs = []
    for _ in range(2):
        session = engine.create_session(sampler)
        session.prefill([5, 6, 7])
        runs.append([c.token_id for c in session.generate(20, ignore_eos=True)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 3


def test_same_seed_same_tokens_on_both_backends():
    sampler = SamplerConfig(temperature=0.9, top_k=30, top_p=0.9, seed=5)
    outs = []
    for backend in BACKENDS:
        session = Engine(bundle(ARCH, backend)).create_session(sampler)
        session.prefill([5, 6, 7])
        outs.append([c.token_id for c in session.generate(16, ignore_eos=True)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_equals_reference_log_softmax_across_a_bucket_change(backend):
    engine = Engine(bundle(ARCH, backend))
    session = engine.create_session()
    context = list(np.random.default_rng(2).integers(3, 300, 10))
    ids = list(np.random.default_rng(3).integers(3, 300, 12))  # positions 10..21 cross the 16-slot bucket
    session.prefill(context)
    scores = session.score(ids)
    ref = reference(ARCH)
    cache = ref.create_kv_cache()
    ref.prefill(context, cache)
    logits = np.stack([ref.step([t], cache)[0] for t in ids])
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    assert scores.shape == (12, engine.config.vocab_size)
    assert relative_error(scores, expected) < 1e-4
    assert session.tokens == context + ids and session.kv_cache.num_tokens == 21


def test_second_conversation_turn_prefills_only_the_new_turn():
    engine = scripted_engine("Hi there!<|im_end|>")
    chat = engine.create_conversation(system="You are terse.")
    first = list(chat.send("Hello", max_new_tokens=20))
    assert first[-1].finish_reason == "eos" and chat.messages[-1] == {"role": "assistant", "content": "Hi there!"}
    after_first_turn = chat.session.tokens
    assert chat.last_prefill == len(after_first_turn) - len(engine.executor.script)  # the whole first prompt
    engine.executor.steps = 0
    list(chat.send("And again?", max_new_tokens=20))
    rendered = engine.tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)
    assert rendered[:len(after_first_turn)] == after_first_turn  # the cached turn is reused as is
    assert chat.last_prefill == len(rendered) - len(after_first_turn)
    assert 0 < chat.last_prefill < len(after_first_turn)


# ---- session files ----------------------------------------------------------------------------------

def greedy_continuation(session, steps=12):
    return [c.token_id for c in session.generate(steps, ignore_eos=True)]


@pytest.mark.parametrize("saver, loader", [("litert", "litert"), ("onnx", "onnx"), ("litert", "onnx"),
                                           ("onnx", "litert")])
def test_save_load_continue_equals_uninterrupted(saver, loader, tmp_path):
    source, target = Engine(bundle(ARCH, saver)), Engine(bundle(ARCH, loader))
    assert source.fingerprint == target.fingerprint
    session = source.create_session(SamplerConfig(temperature=0.8, top_k=20, seed=9))
    session.prefill([5, 6, 7, 8, 9])
    greedy_continuation(session, 4)
    uninterrupted = session.clone()
    session.save(tmp_path / "s.lkvs")
    restored = target.load_session(tmp_path / "s.lkvs")
    assert restored.tokens == session.tokens and restored.sampler == session.sampler
    assert restored.kv_cache.num_tokens == session.kv_cache.num_tokens
    assert greedy_continuation(restored) == greedy_continuation(uninterrupted)


@pytest.mark.parametrize("damage", ["truncate", "flip", "other_model", "future_version"])
def test_corrupted_session_files_raise_and_the_engine_keeps_working(damage, tmp_path):
    from litekv.errors import SessionFormatError
    from litekv.flat_tables import build
    from litekv.session_file import IDENTIFIER, SCHEMA

    engine = Engine(bundle(ARCH, "onnx"))
    session = engine.create_session()
    session.prefill([5, 6, 7, 8])
    path = tmp_path / "s.lkvs"
    if damage == "other_model":
        other = Engine(bundle("qwen3", "onnx")).create_session()
        other.prefill([5, 6])
        other.save(path)
    else:
        session.save(path)
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            for cut in (7, len(data) // 3, len(data) - 1):
                path.write_bytes(bytes(data[:cut]))
                with pytest.raises(SessionFormatError):
                    engine.load_session(path)
        elif damage == "flip":
            for i in np.random.default_rng(0).integers(0, len(data), 25):
                flipped = bytearray(data)
                flipped[i] ^= 0x10
                path.write_bytes(bytes(flipped))
                with pytest.raises(SessionFormatError):
                    engine.load_session(path)
        else:
            path.write_bytes(build(SCHEMA, {"version": 2}, IDENTIFIER))
    with pytest.raises(SessionFormatError):
        engine.load_session(path)
    assert len(greedy_continuation(session, 3)) == 3  # the engine and the live session are unaffected


def test_reference_engine_runs_a_raw_checkpoint_like_a_bundle():
    raw, converted = Engine(checkpoint_dir(ARCH), backend="reference"), Engine(bundle(ARCH, "onnx"))
    assert raw.backend == "numpy" and raw.fingerprint == converted.fingerprint
    outs = []
    for engine in (raw, converted):
        session = engine.create_session()
        outs.append(session.generate_text([5, 6, 7, 8], max_new_tokens=10, ignore_eos=True))
    assert outs[0] == outs[1]
    with pytest.raises(Exception, match="not a converted bundle"):
        Engine(checkpoint_dir(ARCH))


def test_rewind_and_clone():
    engine = Engine(bundle(ARCH, "litert"))
    session = engine.create_session()
    session.prefill([5, 6, 7, 8, 9])
    branch = session.clone()
    first = greedy_continuation(session, 6)
    session.rewind(6)
    assert session.tokens == [5, 6, 7, 8, 9] and session.kv_cache.num_tokens == 4
    assert greedy_continuation(session, 6) == first == greedy_continuation(branch, 6)
    assert branch.kv_cache.cache_id != session.kv_cache.cache_id


def test_lora_adapters_by_name(tmp_path):
    from test_executors import write_peft_adapter

    engine = Engine(bundle(ARCH, "onnx", lora_rank=4))
    write_peft_adapter(tmp_path / "style", engine.config, rank=4, alpha=8, seed=4)
    name = engine.load_lora(tmp_path / "style")
    plain, styled = engine.create_session(), engine.create_session(lora=name)
    for s in (plain, styled):
        s.prefill([5, 6, 7])
    assert greedy_continuation(plain, 8) != greedy_continuation(styled, 8)
    del styled, s  # a live session keeps its adapter loaded (see test_engine_review_fixes.py)
    engine.unload_lora(name)
    with pytest.raises(Exception, match="no adapter named"):
        engine.create_session(lora=name)


def test_convert_function_makes_a_working_bundle(tmp_path):
    import litekv

    path = litekv.convert(checkpoint_dir("qwen2"), tmp_path / "b", backend="onnx", quantize="int8", max_context=64,
                          prefill_lengths=(8,))
    engine = litekv.Engine(path)
    assert engine.backend == "onnx" and engine.config.architecture == "qwen2"
    assert len(engine.create_session().generate_text([4, 5, 6], max_new_tokens=4, ignore_eos=True)) > 0


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from litekv.engine import apply_repetition_penalty

    logits = np.random.default_rng(0).standard_normal(50).astype(np.float32) * 3
    context = [3, 7, 7, 12, 49]
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([context]), torch.tensor(logits[None]))[0].numpy()
    np.testing.assert_allclose(apply_repetition_penalty(logits, context, 1.3), theirs, rtol=1e-6)


def test_repetition_penalty_sampling_is_seeded_and_differs_from_plain():
    engine = Engine(bundle(ARCH, "onnx"))
    outs = []
    for penalty in (1.0, 2.0, 2.0):
        session = engine.create_session(SamplerConfig(repetition_penalty=penalty))
        session.prefill([5, 6, 7])
        outs.append(greedy_continuation(session, 24))
    assert outs[1] == outs[2] and outs[0] != outs[1]
    assert len(set(outs[1])) >= len(set(outs[0]))
