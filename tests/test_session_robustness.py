"""Session, Conversation and CLI robustness: failed calls leave state as it was, bad input is a
ConfigError, saved sessions continue exactly, and per-token work does not grow with the context."""
from __future__ import annotations

import builtins
import math
import random

import numpy as np
import pytest

from conformance import checkpoint_dir
from fake_executor import ScriptedExecutor
from litekv import cli
from litekv.engine import (Conversation, Engine, SamplerConfig, SeenTokens, StopStrings,
                           apply_repetition_penalty)
from litekv.errors import BackendError, Cancelled, ConfigError, ContextFull, SessionFormatError
from litekv.sampling import sample_token
from litekv.session_file import SamplerState, SessionState, write_session
from litekv.tokenizer import Tokenizer

ARCH = "llama"


def scripted_engine(text: str, max_context: int = 256, executor_class: type = ScriptedExecutor,
                    **executor_options) -> Engine:
    tokenizer = Tokenizer.from_hf_dir(checkpoint_dir(ARCH))
    script = tokenizer.encode(text, add_special_tokens=False)
    executor = executor_class(script, tokenizer.vocab_size, max_context=max_context, **executor_options)
    return Engine.from_executor(executor, tokenizer, "scripted")


def reference_engine() -> Engine:
    """The numpy reference on a tiny random checkpoint: real logits, no conversion."""
    return Engine(checkpoint_dir(ARCH), backend="reference")


def greedy(session, steps: int = 8) -> list[int]:
    return [c.token_id for c in session.generate(steps, ignore_eos=True)]


class FailingExecutor(ScriptedExecutor):
    """Raises `error` at decode step `fail_at_step` (counting from 0), or in every prefill chunk."""

    def __init__(self, script: list[int], vocab_size: int, max_context: int = 256, error: Exception | None = None,
                 fail_at_step: int | None = None, fail_prefill: bool = False):
        super().__init__(script, vocab_size, max_context)
        self.error = error or BackendError("scripted backend failure")
        self.fail_at_step, self.fail_prefill = fail_at_step, fail_prefill

    def _run_prefill_chunk(self, tokens, chunk, kv_cache, row, adapter) -> None:
        if self.fail_prefill:
            raise self.error
        super()._run_prefill_chunk(tokens, chunk, kv_cache, row, adapter)

    def _decode(self, tokens, kv_cache, adapter) -> np.ndarray:
        if self.steps == self.fail_at_step:
            self.steps += 1
            raise self.error
        return super()._decode(tokens, kv_cache, adapter)


def assert_consistent(session, tokens: list[int]) -> None:
    """The session holds `tokens`, its cache every one but the pending last."""
    assert session.tokens == tokens
    assert session.kv_cache.num_tokens == max(len(tokens) - 1, 0)


# ---- 1. a failed score leaves the session as it was -------------------------------------------------

def test_score_with_a_bad_id_changes_nothing_and_generation_matches_a_fresh_session():
    engine = reference_engine()
    session, fresh = engine.create_session(), engine.create_session()
    for s in (session, fresh):
        s.prefill("Hello world")
    before = session.tokens
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        session.score([5, 6, 10**6])
    assert_consistent(session, before)
    assert greedy(session) == greedy(fresh)


@pytest.mark.parametrize("error", [BackendError("backend failed", status=3), Cancelled("cancelled")])
def test_score_failing_midway_rewinds_the_cache(error):
    engine = scripted_engine("a b c", executor_class=FailingExecutor, error=error, fail_at_step=2)
    session = engine.create_session()
    session.prefill([5, 6, 7])
    with pytest.raises(type(error)):
        session.score([8, 9, 10, 11])  # steps 0 and 1 (pending token, 8) succeed, then step 2 fails
    assert_consistent(session, [5, 6, 7])
    scores = session.score([8, 9])  # and the session still works
    assert scores.shape == (2, engine.config.vocab_size)
    assert_consistent(session, [5, 6, 7, 8, 9])


# ---- 2. every token id is checked, and bad input is a ConfigError ----------------------------------

@pytest.mark.parametrize("ids", [[5, 100000], [-3], [5, -1], ["a"], [1.9, 2.7], [[1, 2]], [True], 7,
                                 np.array([5, 320]), np.array([-1, 5])])
def test_prefill_refuses_bad_ids_and_keeps_its_state(ids):
    engine = scripted_engine("a b c")
    session = engine.create_session()
    session.prefill([5, 6])
    with pytest.raises(ConfigError):
        session.prefill(ids)
    assert_consistent(session, [5, 6])


def test_prefill_accepts_numpy_ids():
    session = scripted_engine("a b c").create_session()
    assert session.prefill(np.array([5, 6, 319], np.int64)) == 3
    assert session.prefill([np.int32(7)]) == 1
    assert session.tokens == [5, 6, 319, 7] and all(type(t) is int for t in session.tokens)


@pytest.mark.parametrize("count", ["a", 1.5, None, True])
def test_rewind_refuses_what_is_not_a_count(count):
    session = scripted_engine("a b c").create_session()
    session.prefill([5, 6, 7])
    with pytest.raises(ConfigError, match="whole number"):
        session.rewind(count)
    assert_consistent(session, [5, 6, 7])


def test_score_refuses_text():
    session = scripted_engine("a b c").create_session()
    with pytest.raises(ConfigError, match="encode"):
        session.score("hello")


def save_raw(engine: Engine, path, tokens: list[int], kv_tokens: list[int]) -> None:
    """A session file holding `tokens` and a cache of `kv_tokens`, written past Session's checks."""
    cache = engine.executor.create_kv_cache()
    engine.executor.prefill(kv_tokens, cache)
    write_session(path, SessionState(engine.fingerprint, engine.backend, np.array(tokens, np.int32), cache.serialize(),
                                     SamplerState(0.0, 0, 1.0, 1.0, 0, len(tokens))))


def test_load_session_refuses_ids_outside_the_vocabulary(tmp_path):
    engine = reference_engine()
    path = tmp_path / "bad.lkvs"
    save_raw(engine, path, [5, 6, engine.config.vocab_size], [5, 6])
    with pytest.raises(SessionFormatError, match=rf"bad\.lkvs.*token id {engine.config.vocab_size} is outside"):
        engine.load_session(path)


@pytest.mark.parametrize("sampler", [SamplerState(float("nan"), 0, 1.0, 1.0, 0, 3),
                                     SamplerState(0.5, 0, 1.0, float("inf"), 0, 3),
                                     SamplerState(0.5, 0, 0.0, 1.0, 0, 3)])
def test_load_session_names_the_file_whose_sampler_settings_are_unusable(tmp_path, sampler):
    engine = reference_engine()
    path = tmp_path / "edited.lkvs"
    cache = engine.executor.create_kv_cache()
    engine.executor.prefill([5, 6], cache)
    write_session(path, SessionState(engine.fingerprint, engine.backend, np.array([5, 6, 7], np.int32),
                                     cache.serialize(), sampler))
    with pytest.raises(SessionFormatError, match=r"edited\.lkvs holds sampler settings"):
        engine.load_session(path)


def test_load_session_refuses_negative_ids_naming_the_file(tmp_path):
    from test_session_file import build_checksummed, raw_values

    engine = reference_engine()
    path = tmp_path / "negative.lkvs"
    save_raw(engine, path, [5, 6, 7], [5, 6])
    good = engine.load_session(path)
    state = SessionState(engine.fingerprint, engine.backend, (5, 6, 7), good.kv_cache.serialize(),
                         SamplerState(0.0, 0, 1.0, 1.0, 0, 3))
    path.write_bytes(build_checksummed(raw_values(state, tokens=np.array([5, -6, 7], np.int32))))
    with pytest.raises(SessionFormatError, match=r"negative\.lkvs.*negative token ids"):
        engine.load_session(path)


# ---- 3. a file whose cache holds every token --------------------------------------------------------

def test_a_cache_holding_every_token_continues_like_a_normal_file(tmp_path):
    engine = reference_engine()
    ids = engine.tokenizer.encode("Hello world, the capital of France is")
    normal = engine.create_session()
    normal.prefill(ids)
    normal.save(tmp_path / "normal.lkvs")
    save_raw(engine, tmp_path / "full.lkvs", ids, ids)  # the format allows a cache of all the tokens
    a, b = engine.load_session(tmp_path / "normal.lkvs"), engine.load_session(tmp_path / "full.lkvs")
    assert_consistent(b, ids)
    assert greedy(b, 10) == greedy(a, 10)


# ---- 4. a restored conversation keeps its tokens ----------------------------------------------------

def test_restored_conversation_continues_after_its_tokens_like_the_uninterrupted_one(tmp_path):
    engine = scripted_engine("Hi there!<|im_end|>")
    chat = engine.create_conversation(system="You are terse.")
    list(chat.send("Hello", max_new_tokens=20))
    saved = chat.session.tokens
    chat.session.save(tmp_path / "chat.lkvs")

    restored = Conversation(engine.load_session(tmp_path / "chat.lkvs"))
    engine.executor.steps = 0
    list(restored.send("And again?", max_new_tokens=20))
    engine.executor.steps = 0
    list(chat.send("And again?", max_new_tokens=20))

    assert restored.session.tokens[:len(saved)] == saved  # the history was not rewound
    assert restored.session.tokens == chat.session.tokens
    assert 0 < restored.last_prefill == chat.last_prefill < len(saved)
    assert restored.messages == [{"role": "user", "content": "And again?"},
                                 {"role": "assistant", "content": "Hi there!"}]


def test_restored_conversation_closes_an_unfinished_reply(tmp_path):
    engine = scripted_engine("one two three four five six")
    chat = engine.create_conversation()
    list(chat.send("Count", max_new_tokens=3))  # stopped by length: the reply has no end-of-turn token
    chat.session.save(tmp_path / "chat.lkvs")
    restored = Conversation(engine.load_session(tmp_path / "chat.lkvs"))
    engine.executor.steps = 0
    list(restored.send("More", max_new_tokens=2))
    engine.executor.steps = 0
    list(chat.send("More", max_new_tokens=2))
    assert restored.session.tokens == chat.session.tokens


def test_a_restored_conversation_takes_no_new_system_message(tmp_path):
    engine = scripted_engine("Hi<|im_end|>")
    session = engine.create_session()
    session.prefill([5, 6])
    with pytest.raises(ConfigError, match="system"):
        Conversation(session, system="Be brief.")


def test_cli_chat_load_keeps_the_restored_tokens_as_a_prefix(tmp_path, monkeypatch, capsys):
    engine = scripted_engine("Hi there!<|im_end|>")
    path = tmp_path / "chat.lkvs"
    lines = iter(["Hello", f"/save {path}", f"/load {path}", "And again?", "/quit"])
    sends: list[Conversation] = []
    send = Conversation.send

    def recording_send(self, text, max_new_tokens=256):
        sends.append(self)
        return send(self, text, max_new_tokens)

    monkeypatch.setattr(cli, "_engine", lambda args: engine)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    monkeypatch.setattr(Conversation, "send", recording_send)
    assert cli._chat(cli.build_parser().parse_args(["chat"])) == 0
    out = capsys.readouterr().out
    assert "[loaded" in out and "error" not in out
    first, after_load = sends
    saved = [int(t) for t in engine.load_session(path).tokens]
    assert after_load is not first
    assert after_load.session.tokens[:len(saved)] == saved and len(after_load.session.tokens) > len(saved)


# ---- 5. a full context ends the stream; max_new_tokens is checked -----------------------------------

def test_generation_that_fills_the_context_ends_with_length_and_keeps_its_tokens():
    engine = scripted_engine("a b c d e f g h i j k l", max_context=16)
    session = engine.create_session()
    session.prefill(list(range(5, 15)))
    chunks = list(session.generate(100, ignore_eos=True))
    assert [c.finish_reason for c in chunks] == [None] * 5 + ["length"]
    assert_consistent(session, list(range(5, 15)) + engine.executor.script[:6])
    before = session.tokens
    with pytest.raises(ContextFull):  # no room for even one token: raised at the call, nothing changed
        session.generate(1)
    assert_consistent(session, before)


def test_generate_text_returns_what_it_made_when_the_context_fills():
    engine = scripted_engine("a b c d e f g h i j k l", max_context=16)
    session = engine.create_session()
    text = session.generate_text(list(range(5, 15)), max_new_tokens=100, ignore_eos=True)
    assert text == engine.tokenizer.decode(engine.executor.script[:6], skip_special_tokens=True)
    assert len(session.tokens) == 16


@pytest.mark.parametrize("prompt_length", [16, 17])
def test_generate_text_raises_context_full_before_prefilling_a_prompt_that_leaves_no_room(prompt_length):
    session = scripted_engine("a b", max_context=16).create_session()
    with pytest.raises(ContextFull):
        session.generate_text(list(range(5, 5 + prompt_length)), max_new_tokens=4)
    assert_consistent(session, [])


@pytest.mark.parametrize("count", [0, -1, 2.5, "3", None, True])
def test_max_new_tokens_must_be_a_positive_int(count):
    engine = scripted_engine("a b c")
    session = engine.create_session()
    session.prefill([5, 6])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        list(session.generate(count))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        session.generate_text([7, 8], max_new_tokens=count)
    assert_consistent(session, [5, 6])  # generate_text refused before prefilling
    chat = engine.create_conversation()
    with pytest.raises(ConfigError, match="max_new_tokens"):
        list(chat.send("hi", max_new_tokens=count))
    assert chat.messages == [] and chat.session.tokens == []


def test_numpy_max_new_tokens_is_accepted():
    session = scripted_engine("a b c").create_session()
    session.prefill([5, 6])
    assert len(greedy(session, np.int64(3))) == 3


# ---- 6. SamplerConfig refuses NaN and infinite penalties --------------------------------------------

@pytest.mark.parametrize("penalty", [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e39, "x"])
def test_repetition_penalty_must_be_finite_and_positive(penalty):
    with pytest.raises(ConfigError, match="repetition_penalty"):
        SamplerConfig(repetition_penalty=penalty)


def test_a_finite_positive_repetition_penalty_is_kept():
    assert SamplerConfig(repetition_penalty=1.3).repetition_penalty == float(np.float32(1.3))


# ---- 7. a failed send records nothing ---------------------------------------------------------------

def test_send_whose_prompt_does_not_fit_records_no_message():
    engine = scripted_engine("Hi<|im_end|>", max_context=64)
    chat = engine.create_conversation(system="S")
    with pytest.raises(ContextFull):
        list(chat.send("x " * 200))
    assert chat.messages == [{"role": "system", "content": "S"}] and chat.session.tokens == []


def test_send_whose_prefill_fails_records_no_message():
    engine = scripted_engine("Hi<|im_end|>", executor_class=FailingExecutor, fail_prefill=True)
    chat = engine.create_conversation()
    with pytest.raises(BackendError):
        list(chat.send("Hello"))
    assert chat.messages == []
    engine.executor.fail_prefill = False
    list(chat.send("Hello", max_new_tokens=5))
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]


# ---- 8. the repetition penalty: same tokens, work bounded by the distinct ids ------------------------

def old_penalty(logits: np.ndarray, context: list[int], penalty: float) -> np.ndarray:
    """The formula before SeenTokens, kept here as the oracle (Hugging Face semantics)."""
    out = logits.copy()
    seen = np.unique(np.asarray(context, np.int64))
    values = out[seen]
    out[seen] = np.where(values > 0, values / np.float32(penalty), values * np.float32(penalty))
    return out


def oracle_tokens(engine: Engine, sampler: SamplerConfig, prompt: list[int], steps: int) -> list[int]:
    executor, params, tokens = engine.executor, sampler.params, list(prompt)
    cache = executor.create_kv_cache()
    executor.prefill(tokens[:-1], cache)
    for _ in range(steps):
        position = cache.num_tokens
        logits = old_penalty(executor.step([tokens[-1]], cache)[0], tokens, sampler.repetition_penalty)
        tokens.append(int(np.argmax(logits)) if params.greedy else
                      sample_token(logits, params.temperature, params.top_k, params.top_p,
                                   params.seed_for(position, 0)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("sampler", [SamplerConfig(repetition_penalty=1.8),
                                     SamplerConfig(temperature=0.9, top_k=20, seed=4, repetition_penalty=1.4)])
def test_repetition_penalty_gives_the_old_formulas_tokens_through_rewind_and_clone(sampler):
    engine = reference_engine()
    prompt = [5, 6, 7, 5, 9]
    session = engine.create_session(sampler)
    session.prefill(prompt)
    first = greedy(session, 12)
    assert first == oracle_tokens(engine, sampler, prompt, 12)
    session.rewind(7)  # the ids seen only in the forgotten tokens must stop counting
    kept = session.tokens
    twin = session.clone()
    again = greedy(session, 10)
    assert again == oracle_tokens(engine, sampler, kept, 10) == greedy(twin, 10)


def test_seen_tokens_keep_the_distinct_ids_and_penalize_only_those():
    rng = np.random.default_rng(1)
    context = rng.integers(0, 50, 40).tolist()
    seen = SeenTokens(200, context[:25])
    for token in context[25:]:
        seen.extend([token])
    assert sorted(seen.ids.tolist()) == sorted(set(context)) and seen.length == len(context)
    logits = rng.standard_normal(200).astype(np.float32) * 3
    expected = apply_repetition_penalty(logits, context, 1.3)
    np.testing.assert_array_equal(expected, old_penalty(logits, context, 1.3))
    seen.penalize(logits, 1.3)  # in place
    np.testing.assert_array_equal(logits, expected)
    assert np.array_equal(logits[50:], expected[50:])  # ids never seen are untouched


def test_penalty_work_per_token_does_not_grow_with_the_context(monkeypatch):
    engine = scripted_engine("a b c d e f g h")
    session = engine.create_session(SamplerConfig(repetition_penalty=1.5))
    session.prefill(list(range(3, 203)))  # a long context
    added: list[int] = []
    penalized: list[np.ndarray] = []
    extend, penalize = SeenTokens.extend, SeenTokens.penalize
    monkeypatch.setattr(SeenTokens, "extend", lambda self, tokens: (added.append(len(tokens)), extend(self, tokens)))
    monkeypatch.setattr(SeenTokens, "penalize",
                        lambda self, logits, p: (penalized.append(logits), penalize(self, logits, p)))
    step = engine.executor.step
    stepped: list[np.ndarray] = []
    monkeypatch.setattr(engine.executor, "step", lambda *a: stepped.append(step(*a)) or stepped[-1])
    greedy(session, 20)
    assert added[0] == 200 and added[1:] == [1] * 19  # built once, then one token a step
    # The penalty edits the step's own logits: no copy of the [vocab] row per token.
    assert all(p.base is s for p, s in zip(penalized, stepped)) and len(penalized) == 20


# ---- 9. stop strings: searched only where a new match can be ----------------------------------------

def test_stop_strings_find_what_a_whole_text_search_finds_with_a_bounded_window():
    rng = random.Random(5)
    alphabet = "ab 東\n"
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        matcher, text = StopStrings(stops), ""
        for _ in range(40):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
            text += piece
            expected = any(s in text for s in stops)
            assert matcher.push(piece) == expected
            assert len(matcher.window) <= max(map(len, stops)) - 1
            if expected:
                break


def test_stop_string_spanning_tokens_ends_generation_at_the_token_that_completes_it():
    engine = scripted_engine("one two three four five")
    script, tokenizer = engine.executor.script, engine.tokenizer
    for stop in ("o thr", "e f", "four five", "x"):
        engine.executor.steps = 0
        session = engine.create_session()
        session.prefill([5])
        chunks = list(session.generate(len(script), stop=[stop, "zzzz"], ignore_eos=True))
        ends = [i for i in range(1, len(script) + 1) if stop in tokenizer.decode(script[:i])]
        expected = ends[0] if ends else len(script)
        assert len(chunks) == expected
        assert chunks[-1].finish_reason == ("stop" if ends else "length")


def test_a_single_stop_string_is_one_string_not_its_characters():
    engine = scripted_engine("one two three")
    session = engine.create_session()
    session.prefill([5])
    chunks = list(session.generate(20, stop="two", ignore_eos=True))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and text.rstrip().endswith("two")


# ---- 10. the command line checks its numbers --------------------------------------------------------

@pytest.mark.parametrize("argv, option", [
    (["generate", "--prompt", "x", "--threads", "-1"], "--threads"),
    (["generate", "--prompt", "x", "--threads", "0"], "--threads"),
    (["generate", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["chat", "--threads", "-2"], "--threads"),
    (["bench", "--new-tokens", "0"], "--new-tokens"),
    (["bench", "--prompt-tokens", "-5"], "--prompt-tokens"),
])
def test_cli_refuses_counts_below_one_with_a_clean_message(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert option in err and "must be at least 1" in err and "Traceback" not in err


def test_cli_accepts_positive_counts():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--threads", "1", "--max-new-tokens", "7"])
    assert (args.threads, args.max_new_tokens) == (1, 7)
