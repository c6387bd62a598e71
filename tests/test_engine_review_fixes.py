"""Review fixes at the Engine level: clones allocate one cache, abandoned chat streams keep the history
consistent, sessions are refused by bundles they do not fit, adapters' lifecycle by name, arguments
refused with litekv errors, and end-of-generation tokens add no text to the stream."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conformance import checkpoint_dir, reference
from fake_executor import ScriptedExecutor
from litekv import kv_cache as kv_module
from litekv.atomic_file import write_atomic
from litekv.engine import Engine, SamplerConfig
from litekv.errors import ConfigError, LitekvError, SessionFormatError
from litekv.executor import SamplerParams
from litekv.kv_cache import KVCache, KVCacheError
from litekv.session_file import read_session, write_session
from litekv.tokenizer import Tokenizer
from test_executors import write_peft_adapter
from test_session_robustness import FailingExecutor

ARCH = "llama"


def scripted_engine(text: str, max_context: int = 256, executor_class: type = ScriptedExecutor,
                    tokenizer: Tokenizer | None = None, **options) -> Engine:
    tokenizer = tokenizer or Tokenizer.from_hf_dir(checkpoint_dir(ARCH))
    script = tokenizer.encode(text, add_special_tokens=False)
    executor = executor_class(script, tokenizer.vocab_size, max_context=max_context, **options)
    return Engine.from_executor(executor, tokenizer, "scripted")


def greedy(session, steps: int = 6) -> list[int]:
    return [c.token_id for c in session.generate(steps, ignore_eos=True)]


# ---- 1. a clone allocates one cache ---------------------------------------------------------------

def count_caches(monkeypatch) -> list[KVCache]:
    """Every KVCache constructed from now on (allocate, from_buffers, deep_copy, clone_handle)."""
    made: list[KVCache] = []
    init = KVCache.__init__

    def counting_init(self, storage):
        made.append(self)
        init(self, storage)

    monkeypatch.setattr(KVCache, "__init__", counting_init)
    return made


def test_clone_copies_into_the_one_cache_the_executor_made_for_it(monkeypatch):
    engine = Engine(checkpoint_dir(ARCH), backend="reference")
    session = engine.create_session()
    session.prefill([5, 6, 7, 8, 9])
    made, created = count_caches(monkeypatch), []
    create = engine.executor.create_kv_cache

    def recording_create(*args, **options):
        created.append(create(*args, **options))
        return created[-1]

    monkeypatch.setattr(engine.executor, "create_kv_cache", recording_create)
    twin = session.clone()
    assert len(created) == 1 and made == created and twin.kv_cache is created[0]
    assert twin.kv_cache.num_tokens == session.kv_cache.num_tokens == 4 and twin.tokens == session.tokens
    assert greedy(twin) == greedy(session)  # independent continuations of the same context


# ---- 2. an abandoned chat stream keeps user/assistant alternation ---------------------------------

def roles(chat) -> list[str]:
    return [m["role"] for m in chat.messages]


def test_a_stream_the_caller_breaks_out_of_records_the_partial_reply():
    engine = scripted_engine("Hi there my good friend<|im_end|>")
    chat = engine.create_conversation()
    for i, chunk in enumerate(chat.send("Hello")):
        if i == 1:
            break
    reply = engine.executor.script[:2]
    assert roles(chat) == ["user", "assistant"]
    assert chat.messages[-1]["content"] == engine.tokenizer.decode(reply, skip_special_tokens=True)
    assert chat.session.tokens[-2:] == reply  # the history says what the session holds
    before = chat.session.tokens
    engine.executor.steps = 0
    list(chat.send("Again?", max_new_tokens=3))
    assert roles(chat) == ["user", "assistant", "user", "assistant"]
    assert chat.session.tokens[:len(before)] == before  # the partial reply was kept, not rewound


def test_an_exception_in_the_callers_loop_records_the_partial_reply():
    engine = scripted_engine("Hi there my good friend<|im_end|>")
    chat = engine.create_conversation()
    with pytest.raises(RuntimeError):
        for _ in chat.send("Hello"):
            raise RuntimeError("the UI failed")
    assert roles(chat) == ["user", "assistant"]


def test_a_stream_left_open_is_closed_by_the_next_send():
    engine = scripted_engine("Hi there my good friend<|im_end|>")
    chat = engine.create_conversation()
    stream = chat.send("Hello")
    next(stream), next(stream)
    engine.executor.steps = 0
    list(chat.send("Again?", max_new_tokens=3))
    assert roles(chat) == ["user", "assistant", "user", "assistant"]
    assert list(stream) == [] and len(chat.messages) == 4  # closed: it records nothing more


def test_a_generation_error_mid_stream_records_what_was_made():
    engine = scripted_engine("Hi there my good friend<|im_end|>", executor_class=FailingExecutor, fail_at_step=2)
    chat = engine.create_conversation()
    with pytest.raises(LitekvError):
        list(chat.send("Hello"))
    assert roles(chat) == ["user", "assistant"]
    assert chat.messages[-1]["content"] == engine.tokenizer.decode(engine.executor.script[:2])


# ---- 3. a session longer than the bundle's context is refused --------------------------------------

@pytest.mark.parametrize("length", [33, 40])
def test_load_session_refuses_more_tokens_than_the_context_naming_the_file(tmp_path, length):
    big, small = scripted_engine("a b", max_context=64), scripted_engine("a b", max_context=32)
    session = big.create_session()
    session.prefill(list(range(5, 5 + length)))
    path = tmp_path / "long.lkvs"
    session.save(path)
    with pytest.raises(SessionFormatError, match=rf"long\.lkvs holds {length} tokens.*max_context >= {length}"):
        small.load_session(path)


def test_a_session_of_exactly_the_context_loads(tmp_path):
    big, small = scripted_engine("a b", max_context=64), scripted_engine("a b", max_context=32)
    session = big.create_session()
    session.prefill(list(range(5, 37)))
    session.save(tmp_path / "full.lkvs")
    assert small.load_session(tmp_path / "full.lkvs").tokens == session.tokens


class WideExecutor(ScriptedExecutor):
    """Caches with two KV heads: a session of the one-head executor does not fit them."""

    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        return KVCache.allocate(1, batch_size, 2, 8, self.max_context, "BSHD", huge_pages=huge_pages)


def test_a_kv_cache_that_does_not_fit_is_a_session_format_error_naming_the_file(tmp_path):
    session = scripted_engine("a b").create_session()
    session.prefill([5, 6, 7])
    session.save(tmp_path / "narrow.lkvs")
    with pytest.raises(SessionFormatError, match=r"narrow\.lkvs: its KV cache does not fit") as info:
        scripted_engine("a b", executor_class=WideExecutor).load_session(tmp_path / "narrow.lkvs")
    assert isinstance(info.value.__cause__, KVCacheError)


def test_a_kv_cache_holding_nan_is_refused_as_damaged_not_as_another_bundles(tmp_path):
    session = scripted_engine("a b").create_session()
    session.prefill([5, 6, 7])
    session.kv_cache.raw_values(0)[0, 1, 0, 2] = np.nan  # as a model that overflowed would leave it
    session.save(tmp_path / "nan.lkvs")
    with pytest.raises(SessionFormatError, match=r"nan\.lkvs: its KV cache cannot be loaded: .*NaN or infinite "
                                                 r"values \(layer 0\)") as info:
        scripted_engine("a b").load_session(tmp_path / "nan.lkvs")
    assert "same KV cache options" not in str(info.value)
    assert isinstance(info.value.__cause__, KVCacheError)


# ---- 4. adapters by name ----------------------------------------------------------------------------

@pytest.fixture
def adapters(tmp_path):
    cfg = reference(ARCH).config
    for name, seed in (("a", 1), ("b", 2)):
        write_peft_adapter(tmp_path / name, cfg, rank=4, alpha=8, seed=seed)
    return tmp_path


def lora_engine(rank: int = 4, fingerprint: str = "fp") -> Engine:
    tokenizer = Tokenizer.from_hf_dir(checkpoint_dir(ARCH))
    return Engine.from_executor(reference(ARCH, lora_rank=rank), tokenizer, fingerprint)


def test_unload_is_refused_while_a_live_session_uses_the_adapter(adapters):
    from litekv.executor.base import LoraInUse

    engine = lora_engine()
    engine.load_lora(adapters / "a", "style")
    session = engine.create_session(lora="style")
    session.prefill([5, 6, 7])
    twin, chat = session.clone(), engine.create_conversation(lora="style")
    with pytest.raises(LoraInUse, match=r"'style' is used by 3 live session"):
        engine.unload_lora("style")
    assert len(greedy(session, 2)) == 2  # still usable
    del session, twin, chat
    engine.unload_lora("style")  # dropped sessions do not pin it
    with pytest.raises(ConfigError, match="no adapter named"):
        engine.create_session(lora="style")


def saved_session_with_adapter(adapters, path):
    """(engine, session): a session that uses adapter "a" as "style", saved to `path`."""
    engine = lora_engine()
    engine.load_lora(adapters / "a", "style")
    session = engine.create_session(lora="style")
    session.prefill([5, 6, 7])
    session.save(path)
    return engine, session


def test_a_session_saved_with_another_adapter_of_that_name_is_refused(adapters, tmp_path):
    engine, session = saved_session_with_adapter(adapters, tmp_path / "s.lkvs")
    expected = greedy(session.clone())
    del session
    engine.unload_lora("style")
    engine.load_lora(adapters / "b", "style")
    with pytest.raises(SessionFormatError, match=r"s\.lkvs was saved with another adapter than the one loaded as"):
        engine.load_session(tmp_path / "s.lkvs")
    engine.unload_lora("style")
    engine.load_lora(adapters / "a", "style")  # the same adapter again: accepted
    assert greedy(engine.load_session(tmp_path / "s.lkvs")) == expected


def test_a_session_file_without_an_adapter_fingerprint_still_loads(adapters, tmp_path):
    engine, _ = saved_session_with_adapter(adapters, tmp_path / "new.lkvs")
    state = read_session(tmp_path / "new.lkvs")
    assert state.lora_fingerprint is not None
    write_session(tmp_path / "old.lkvs", replace(state, lora_fingerprint=None))  # as litekv wrote it before
    assert read_session(tmp_path / "old.lkvs").lora_fingerprint is None
    assert engine.load_session(tmp_path / "old.lkvs").tokens == [5, 6, 7]


def test_the_reference_backend_runs_adapters_like_an_executor_with_lora_inputs(adapters, tmp_path):
    raw = Engine(checkpoint_dir(ARCH), backend="reference")
    padded = lora_engine(rank=8, fingerprint=raw.fingerprint)  # padded to rank 8: same adapter, same results
    for engine in (raw, padded):
        engine.load_lora(adapters / "a", "style")
    outs = []
    for engine in (raw, padded):
        session = engine.create_session(lora="style")
        session.prefill([5, 6, 7])
        outs.append(greedy(session))
    plain = raw.create_session()
    plain.prefill([5, 6, 7])
    assert outs[0] == outs[1] != greedy(plain)
    session = raw.create_session(lora="style")
    session.prefill([5, 6, 7])
    session.save(tmp_path / "raw.lkvs")  # the fingerprint does not depend on the padding
    assert greedy(padded.load_session(tmp_path / "raw.lkvs")) == outs[0]


# ---- 5. arguments are refused with litekv errors before any state changes ---------------------------

def test_create_session_takes_the_executors_sampler_params():
    engine = scripted_engine("a b c")
    session = engine.create_session(SamplerParams(temperature=0.5, top_k=3, seed=2))
    assert session.sampler == SamplerConfig(temperature=0.5, top_k=3, seed=2)
    assert session.generate_text("Hi", max_new_tokens=2, ignore_eos=True)
    with pytest.raises(ConfigError, match="SamplerConfig"):
        engine.create_session("greedy")


@pytest.mark.parametrize("stop", [5, [""], "", [b"x"], b"x", ["ok", None]])
def test_bad_stop_arguments_are_refused_before_anything_changes(stop):
    session = scripted_engine("a b c").create_session()
    session.prefill([5, 6])
    with pytest.raises(ConfigError, match="stop"):
        session.generate(3, stop=stop)
    with pytest.raises(ConfigError, match="stop"):
        session.generate_text([7, 8], max_new_tokens=3, stop=stop)
    assert session.tokens == [5, 6]


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"hello"), memoryview(b"hello")])
def test_bytes_are_not_token_ids(prompt):
    session = scripted_engine("a b c").create_session()
    with pytest.raises(ConfigError, match="bytes"):
        session.prefill(prompt)
    with pytest.raises(ConfigError, match="bytes"):
        session.score(prompt)
    assert session.tokens == []


def test_kv_cache_arguments_are_refused_with_kv_cache_errors():
    source = KVCache.allocate(1, 2, 1, 8, 16)
    source.set_num_tokens(3)
    target = KVCache.allocate(1, 1, 1, 8, 16)
    for index in (0.5, True, "1"):
        with pytest.raises(KVCacheError, match="batch index"):
            target.select_and_copy_from(source, index)
    target.select_and_copy_from(source, np.int64(1))
    assert target.num_tokens == 3
    with pytest.raises(KVCacheError, match="bytes that KVCache.serialize"):
        target.load("not bytes")
    assert target.num_tokens == 3


@pytest.mark.parametrize("batch_size", [1.5, "2", True, None])
def test_cache_sizes_must_be_whole_numbers(batch_size):
    with pytest.raises(ConfigError, match="whole numbers"):
        KVCache.allocate(1, batch_size, 1, 8, 16)
    with pytest.raises(ConfigError, match="whole numbers"):
        kv_module.on_huge_pages(30, (batch_size, 256, 3, 64), np.int8, True)
    with pytest.raises(ConfigError, match="whole numbers"):
        scripted_engine("a").executor.create_kv_cache(batch_size)


def test_saving_into_a_missing_directory_names_it(tmp_path):
    session = scripted_engine("a b").create_session()
    session.prefill([5, 6])
    target = tmp_path / "no" / "such" / "s.lkvs"
    with pytest.raises(SessionFormatError, match=r"directory '.*no/such' does not exist"):
        session.save(target)
    with pytest.raises(FileNotFoundError, match=rf"cannot write {target}: its directory .* does not exist") as info:
        write_atomic(target, b"data")
    assert ".tmp" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", [None, 3])
def test_paths_that_are_not_paths_are_config_errors(path):
    engine = scripted_engine("a b")
    session = engine.create_session()
    session.prefill([5, 6])
    with pytest.raises(ConfigError, match="path"):
        engine.load_session(path)
    with pytest.raises(ConfigError, match="path"):
        session.save(path)
    with pytest.raises(ConfigError, match="path"):
        Engine(path)
    with pytest.raises(ConfigError, match="path"):
        engine.load_lora(path)


# ---- 6. end-of-generation and other special tokens add no text to the stream -------------------------

def two_eos_tokenizer() -> Tokenizer:
    """The test tokenizer with `<|endoftext|>` as a second end-of-generation id (as SmolLM2's GGUF has)."""
    base = Tokenizer.from_hf_dir(checkpoint_dir(ARCH))
    return Tokenizer(base.backend, bos_token=base.bos_token, eos_token=base.eos_token,
                     eos_token_ids=[base.token_to_id("<|endoftext|>")], chat_template=base.chat_template)


@pytest.mark.parametrize("end", ["<|im_end|>", "<|endoftext|>"])
def test_every_end_of_generation_token_stops_without_text(end):
    engine = scripted_engine(f"Hi there{end} more", tokenizer=two_eos_tokenizer())
    session = engine.create_session()
    session.prefill("x")
    chunks = list(session.generate(20))
    assert chunks[-1].finish_reason == "eos" and chunks[-1].token_id == engine.tokenizer.token_to_id(end)
    assert "".join(c.text for c in chunks) == "Hi there"


def test_streamed_text_matches_generate_text_and_special_tokens_still_stop():
    engine = scripted_engine("Hi<|im_start|> there")
    session = engine.create_session()
    session.prefill("x")
    steps = len(engine.executor.script)
    streamed = "".join(c.text for c in session.generate(steps, ignore_eos=True))
    engine.executor.steps = 0
    assert streamed == engine.create_session().generate_text("x", steps, ignore_eos=True) == "Hi there"
    engine.executor.steps = 0
    session = engine.create_session()
    session.prefill("x")
    chunks = list(session.generate(10, stop="<|im_start|>"))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token_id == engine.tokenizer.token_to_id("<|im_start|>")
