"""What an application touches: Engine (a loaded model), Session (one sequence), Conversation (chat).

Generation is layered: `Session.generate_text` joins `Session.generate` (a generator of chunks with
a finish reason), which runs one `Session._next_token` per step on the executor.
"""
from __future__ import annotations

import gc
import hashlib
import math
import os
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from litekv.errors import BackendError, Cancelled, ChatTemplateError, ConfigError, ContextFull, SessionFormatError
from litekv.executor import LoraAdapter, LoraError, LoraInUse, SamplerParams, load_peft_adapter
from litekv.executor.base import non_finite_logits_advice
from litekv.executor.lora import adapter_rank
from litekv.kv_cache import KVCache, KVCacheError, KVCacheMismatch
from litekv.sampling import all_finite, sample_token
from litekv.tokenizer import Tokenizer
from litekv.validation import is_int


@dataclass(frozen=True)
class SamplerConfig:
    """temperature 0 = greedy. repetition_penalty > 1 samples on the host (HF semantics);
    otherwise sampling runs inside the model. The same seed and logits give the same tokens
    on every backend."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):  # models compute in float32
            value = getattr(self, name)
            try:
                with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, refused below
                    object.__setattr__(self, name, float(np.float32(value)))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"sampler {name} must be a number, got {value!r}.") from e
        # Written so that NaN fails too (every comparison with NaN is False).
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(f"repetition_penalty must be a finite number above 0, got {self.repetition_penalty} "
                              "(1.0 disables it).")
        SamplerParams(self.temperature, self.top_k, self.top_p, self.seed)  # validates the rest

    @property
    def params(self) -> SamplerParams:
        return SamplerParams(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass(frozen=True)
class GenerationChunk:
    token_id: int
    text: str  # newly completed text (may be "" while a UTF-8 character is incomplete)
    finish_reason: str | None = None  # "eos", "stop", "length", "cancelled" on the last chunk
    elapsed: float = 0.0  # seconds since generate() started


@dataclass
class _Adapter:
    """A LoRA adapter loaded by name: its executor id, its fingerprint, and the live sessions that use
    it (weakly: a session no one holds any more does not keep the adapter loaded)."""

    lora_id: int
    fingerprint: str
    users: weakref.WeakSet = field(default_factory=weakref.WeakSet)


class Engine:
    """A model ready to run: a converted bundle, or a raw checkpoint with backend="reference"."""

    _adapter_rank_from_file = False  # the reference runs each adapter at its own rank

    def __init__(self, model: str | Path, backend: str | None = None, accelerator: str = "cpu",
                 threads: int | None = None):
        model = _path(model, "the model")
        if backend == "reference":
            self._open_reference(model)
        else:
            from litekv.bundle import read_manifest
            from litekv.executor import open_executor

            if not (model / "litekv.json").exists():
                raise ConfigError(f"{model} is not a converted bundle; convert it with `litekv convert`, or pass "
                                  "backend='reference' to run the checkpoint with the numpy reference.")
            manifest = read_manifest(model)
            if backend is not None and backend != manifest.backend:
                raise ConfigError(f"{model} is a {manifest.backend} bundle, not {backend}.")
            self.executor = open_executor(model, accelerator=accelerator, threads=threads)
            self.tokenizer = Tokenizer.load(model)
            self.fingerprint = manifest.fingerprint
        self.backend = self.executor.backend
        self.config = self.executor.config
        self._adapters: dict[str, _Adapter] = {}

    @classmethod
    def from_executor(cls, executor, tokenizer: Tokenizer, fingerprint: str) -> "Engine":
        """Wrap an executor you built yourself (a custom backend, or a scripted one in tests)."""
        engine = cls.__new__(cls)
        engine.executor, engine.tokenizer, engine.fingerprint = executor, tokenizer, fingerprint
        engine.backend, engine.config, engine._adapters = executor.backend, executor.config, {}
        return engine

    def _open_reference(self, model: Path) -> None:
        from litekv.converters.checkpoint import load_checkpoint
        from litekv.converters.convert import fingerprint
        from litekv.converters.quantize import QuantPlan
        from litekv.executor.lora import LORA_TARGETS_ALL, projection_shape
        from litekv.executor.numpy_executor import NumpyExecutor

        ckpt = load_checkpoint(model)
        # Any rank a projection can have: load_lora reads each adapter at its own rank, unpadded.
        rank = max(min(projection_shape(ckpt.config, target)) for target in LORA_TARGETS_ALL)
        self.executor = NumpyExecutor(ckpt.config, ckpt.weights, max_context=min(ckpt.config.max_position, 4096),
                                      lora_rank=rank)
        self._adapter_rank_from_file = True
        self.tokenizer = ckpt.tokenizer
        self.fingerprint = fingerprint(ckpt.config, ckpt.weights, QuantPlan())

    @property
    def max_context(self) -> int:
        return self.executor.max_context

    def load_lora(self, path: str | Path, name: str | None = None) -> str:
        """Load a PEFT adapter directory under `name` (default: the directory's name); returns the name."""
        path = _path(path, "the adapter directory")
        name = name or path.name
        if not isinstance(name, str):
            raise ConfigError(f"an adapter name must be a str, got {name!r}.")
        if name in self._adapters:
            raise ConfigError(f"an adapter named {name!r} is already loaded; unload it or pick another name.")
        adapter = self._read_adapter(path, name)
        self._adapters[name] = _Adapter(self.executor.load_lora(adapter), adapter_fingerprint(adapter))
        return name

    def _read_adapter(self, path: Path, name: str) -> LoraAdapter:
        executor = self.executor
        if executor.lora_rank is None:
            raise LoraError("this model was converted without LoRA inputs; reconvert it with --lora-rank R.")
        rank = adapter_rank(path) if self._adapter_rank_from_file else executor.lora_rank
        return load_peft_adapter(path, self.config, rank, executor.lora_targets, name)

    def unload_lora(self, name: str) -> None:
        """Unload an adapter. Refused with LoraInUse while a live session uses it (the session's cache
        was computed with it, and its next call could not run): drop those sessions first. A session
        nothing refers to any more does not count."""
        adapter = self._adapter(name, "")
        if adapter.users:
            gc.collect()  # sessions kept only by a reference cycle are gone, not in use
        if adapter.users:
            raise LoraInUse(f"adapter {name!r} is used by {len(adapter.users)} live session(s); delete them (or "
                            "let them go out of scope) before unloading it, or load another adapter under a "
                            "new name.")
        self.executor.unload_lora(adapter.lora_id)
        del self._adapters[name]

    def lora_id(self, name: str | None) -> int | None:
        """The executor's id of a loaded adapter (None for None)."""
        return None if name is None else self._adapter(name, "; call engine.load_lora first").lora_id

    def _adapter(self, name: str, hint: str) -> _Adapter:
        if not isinstance(name, str):
            raise ConfigError(f"an adapter is named by a str, got {name!r}.")
        if name not in self._adapters:
            raise ConfigError(f"no adapter named {name!r} is loaded{hint}.")
        return self._adapters[name]

    def _attach_lora(self, name: str | None, session: "Session") -> tuple[int | None, str | None]:
        """(lora_id, fingerprint) of the adapter a new session uses, counting the session as its user."""
        if name is None:
            return None, None
        adapter = self._adapter(name, "; call engine.load_lora first")
        adapter.users.add(session)
        return adapter.lora_id, adapter.fingerprint

    def create_session(self, sampler: SamplerConfig | SamplerParams = SamplerConfig(),
                       lora: str | None = None) -> "Session":
        """A new, empty session. `sampler` may also be the executors' SamplerParams (no repetition penalty)."""
        return Session(self, sampler, lora)

    def create_conversation(self, system: str | None = None, sampler: SamplerConfig | SamplerParams = SamplerConfig(),
                            lora: str | None = None) -> "Conversation":
        return Conversation(self.create_session(sampler, lora), system)

    def load_session(self, path: str | Path) -> "Session":
        """Restore a session saved with `Session.save`; validated before any state is built.

        Refused with SessionFormatError when it holds more tokens than this engine's context, when its
        KV cache does not fit this bundle's, or when it was saved with another adapter than the one now
        loaded under its adapter's name (files from before litekv recorded adapters' fingerprints load
        without that check)."""
        from litekv.session_file import read_session

        path = _path(path, "the session file")
        state = read_session(path, expected_fingerprint=self.fingerprint, vocab_size=self.config.vocab_size)
        if len(state.tokens) > self.max_context:  # the model fingerprint does not cover the context length
            raise SessionFormatError(
                f"{path} holds {len(state.tokens)} tokens, more than this bundle's context of {self.max_context}; "
                f"load it with a bundle of the same model converted with max_context >= {len(state.tokens)} "
                "(litekv convert --max-context).")
        self._check_session_adapter(path, state.lora_name, state.lora_fingerprint)
        s = state.sampler
        try:
            sampler = SamplerConfig(s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.seed)
        except ConfigError as e:  # a damaged or hand-edited file: say which
            raise SessionFormatError(f"{path} holds sampler settings litekv cannot use: {e} The file is damaged or "
                                     "was edited; save the session again.") from e
        session = Session(self, sampler, state.lora_name)
        try:
            session.kv_cache.load(state.kv_cache)
        except KVCacheMismatch as e:
            raise SessionFormatError(f"{path}: its KV cache does not fit this bundle's: {e} Load it with a bundle of "
                                     "the same model converted with the same KV cache options.") from e
        except KVCacheError as e:  # damaged: another bundle would not help
            raise SessionFormatError(f"{path}: its KV cache cannot be loaded: {e}") from e
        session._tokens = list(state.tokens)
        if session._tokens and session.kv_cache.num_tokens == len(session._tokens):
            # The file may hold the last token in the cache too; a session keeps it pending (fed by the
            # next step), so forget its row rather than feed it twice.
            session.kv_cache.set_num_tokens(len(session._tokens) - 1)
        return session

    def _check_session_adapter(self, path: Path, name: str | None, fingerprint: str | None) -> None:
        if not name:
            return
        loaded = self._adapter(name, "; the session was saved with it: call engine.load_lora before loading the "
                                     "session").fingerprint
        if fingerprint is not None and fingerprint != loaded:
            raise SessionFormatError(
                f"{path} was saved with another adapter than the one loaded as {name!r} (adapter fingerprint "
                f"{fingerprint[:16]}, the loaded one's {loaded[:16]}); load the adapter the session was made "
                "with under that name.")


class Session:
    """One sequence: its tokens, the KV cache it owns, its sampler and adapter.

    Invariant: the cache holds every token but the last, which is fed by the next step (so
    the logits for the next token are always one step away and never stored).
    """

    def __init__(self, engine: Engine, sampler: SamplerConfig | SamplerParams, lora: str | None):
        self.engine = engine
        self.sampler = _sampler_config(sampler)
        self.lora = lora
        self._lora_id, self._lora_fingerprint = engine._attach_lora(lora, self)
        self._tokens: list[int] = []
        self.kv_cache: KVCache = engine.executor.create_kv_cache()
        # a plain flag: Event.set/clear take a lock, which a Ctrl-C handler could wait on forever
        self._cancel = False
        self._running = False
        self._seen: SeenTokens | None = None  # the repetition penalty's ids, made when first needed

    # ---- state ------------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def _room(self) -> int:
        return self.engine.max_context - len(self._tokens)

    def clone(self) -> "Session":
        """An independent continuation: same tokens, a copy of the cache."""
        twin = Session(self.engine, self.sampler, self.lora)
        # Into the cache the twin was made with: one allocation, from the executor (its pool, its bindings).
        twin.kv_cache.select_and_copy_from(self.kv_cache, 0)
        twin._tokens = list(self._tokens)
        return twin

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (their KV rows are simply no longer counted)."""
        if not is_int(num_tokens):
            raise ConfigError(f"rewind takes a whole number of tokens, got {num_tokens!r}.")
        if not 0 <= num_tokens <= len(self._tokens):
            raise ConfigError(f"cannot rewind {num_tokens} tokens of {len(self._tokens)}.")
        del self._tokens[len(self._tokens) - num_tokens:]
        self.kv_cache.set_num_tokens(max(len(self._tokens) - 1, 0))
        self._seen = None  # ids seen only in the forgotten tokens must stop counting

    def cancel(self) -> None:
        """Stop the running prefill or generate of this session (safe from another thread)."""
        self._cancel = True
        if self._running:
            self.engine.executor.cancel(self.kv_cache)  # this session's call only, not the engine's others

    def save(self, path: str | Path) -> None:
        from litekv.session_file import SamplerState, SessionState, write_session

        path = _path(path, "the session file")
        s = self.sampler
        write_session(path, SessionState(
            fingerprint=self.engine.fingerprint, backend=self.engine.backend,
            tokens=np.asarray(self._tokens, np.int32), kv_cache=self.kv_cache.serialize(),
            sampler=SamplerState(s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.seed, len(self._tokens)),
            lora_name=self.lora, created_unix=time.time(), lora_fingerprint=self._lora_fingerprint))

    # ---- prompt ------------------------------------------------------------------------------------
    def _ids(self, text_or_ids: str | Sequence[int]) -> list[int]:
        if isinstance(text_or_ids, str):
            tok = self.engine.tokenizer
            return self._checked_ids(tok.encode(text_or_ids, add_special_tokens=not self._tokens))
        return self._checked_ids(text_or_ids)

    def _checked_ids(self, ids: Iterable[int] | np.ndarray) -> list[int]:
        """`ids` as ints, each checked to lie in the vocabulary: the last one is only fed a step later,
        so the executor's own check would come too late to leave the session unchanged."""
        vocab = self.engine.config.vocab_size
        if isinstance(ids, (bytes, bytearray, memoryview)):  # iterating them would give byte values as ids
            raise ConfigError("got bytes: pass text as a str (decode the bytes first, e.g. data.decode('utf-8')) "
                              "or token ids as a list of ints.")
        if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
            bad = ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise ConfigError(f"token id {int(bad[0])} is outside the vocabulary of {vocab} ids (0..{vocab - 1}).")
            return ids.tolist()
        try:
            items = list(ids)
        except TypeError as e:
            raise ConfigError(f"expected text (a str) or a sequence of token ids, got {type(ids).__name__}.") from e
        for t in items:
            if not is_int(t):
                raise ConfigError(f"token ids must be ints, got {t!r}; pass text as one str, or encode it with "
                                  "engine.tokenizer.encode.")
            if not 0 <= t < vocab:
                raise ConfigError(f"token id {t} is outside the vocabulary of {vocab} ids (0..{vocab - 1}).")
        return [int(t) for t in items]

    def prefill(self, text_or_ids: str | Sequence[int]) -> int:
        """Append a prompt to the context; returns how many tokens were added."""
        ids = self._ids(text_or_ids)
        if not ids:
            return 0
        if len(ids) > self._room():
            raise ContextFull(f"{len(ids)} tokens do not fit: the session holds {len(self._tokens)} of "
                              f"{self.engine.max_context}; rewind or start a new session.")
        feed = (self._tokens[-1:] + ids)[:-1]  # the pending token, then all new ones but the last
        before = self.kv_cache.num_tokens
        try:
            with self._run():
                self.engine.executor.prefill(feed, self.kv_cache, self._lora_id)
        except BaseException:
            if self.kv_cache.num_tokens > before:  # cancelled midway: keep what the cache holds
                self._tokens = (self._tokens + ids)[:self.kv_cache.num_tokens + 1]
            raise
        self._tokens.extend(ids)
        return len(ids)

    # ---- generation ---------------------------------------------------------------------------------
    def _next_token(self) -> int:
        """Feed the pending token, sample the next one, make it the new pending token."""
        executor, pending = self.engine.executor, self._tokens[-1]
        sampler = self.sampler
        if sampler.repetition_penalty == 1.0:
            token = int(executor.sample_tokens(1, [pending], self.kv_cache, self._lora_id, sampler.params)[0, 0])
        else:
            position = self.kv_cache.num_tokens
            # Ours to change: step returns an array no one else holds (ExternalSamplerExecutor._decode).
            logits = executor.step([pending], self.kv_cache, self._lora_id)[0]
            if not all_finite(logits):  # refused as sample_tokens refuses them, the step not committed
                self.kv_cache.set_num_tokens(position)
                raise BackendError(
                    f"the model's logits at position {position} hold NaN or infinite values, so no token can be "
                    f"sampled; the session keeps its {len(self._tokens)} tokens. "
                    f"{non_finite_logits_advice(executor.bundle_path, 'any LoRA adapter')}")
            self._seen_tokens().penalize(logits, sampler.repetition_penalty)
            params = sampler.params
            token = (int(np.argmax(logits)) if params.greedy else
                     sample_token(logits, params.temperature, params.top_k, params.top_p, params.seed_for(position, 0)))
        self._tokens.append(token)
        return token

    def _seen_tokens(self) -> SeenTokens:
        """The distinct ids of the tokens, brought up to date with the tokens added since the last call."""
        if self._seen is None or self._seen.length > len(self._tokens):
            self._seen = SeenTokens(self.engine.config.vocab_size, self._tokens)
        else:
            self._seen.extend(self._tokens[self._seen.length:])
        return self._seen

    def generate(self, max_new_tokens: int = 256, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False) -> Iterator[GenerationChunk]:
        """Stream up to `max_new_tokens` new tokens. The last chunk carries the finish reason; a
        generation that fills the context ends with "length", keeping every token it made.

        Chunk text leaves out special tokens (as generate_text does), so the end-of-generation token
        adds none; a stop string that is a special token's text stops at that token.

        Checks its arguments when called. Raises ContextFull (before touching state) only when the
        context has no room for even one token.
        """
        _check_max_new_tokens(max_new_tokens)
        stops = _stop_strings(stop)
        if not self._tokens:
            raise ConfigError("the session is empty: prefill a prompt first.")
        self._check_room_for_one()
        return self._stream(int(max_new_tokens), stops, ignore_eos)

    def _check_room_for_one(self) -> None:
        if self._room() < 1:
            raise ContextFull(f"the context of {self.engine.max_context} tokens is full; rewind or start "
                              "a new session.")

    def _stream(self, max_new_tokens: int, stops: tuple[str, ...], ignore_eos: bool) -> Iterator[GenerationChunk]:
        tokenizer = self.engine.tokenizer
        eos = set() if ignore_eos else set(tokenizer.eos_token_ids)
        stream = tokenizer.stream_decoder(skip_special_tokens=True)
        started, matcher, stop_ids = time.perf_counter(), StopStrings(stops), _special_stop_ids(tokenizer, stops)
        self._cancel = False
        self._check_room_for_one()  # the state may have changed since generate() was called
        for step in range(max_new_tokens):
            if self._cancel:
                yield GenerationChunk(-1, stream.flush(), "cancelled", time.perf_counter() - started)
                return
            try:
                with self._run():
                    token = self._next_token()
            except Cancelled:
                yield GenerationChunk(-1, stream.flush(), "cancelled", time.perf_counter() - started)
                return
            if token in eos:  # not pushed: the end token's text is no part of the reply
                yield GenerationChunk(token, stream.flush(), "eos", time.perf_counter() - started)
                return
            piece = stream.push(token)
            reason = None
            if stops and (matcher.push(piece) or token in stop_ids):
                reason = "stop"
            elif step == max_new_tokens - 1 or self._room() < 1:  # the context is full: stop, keep the tokens
                reason, piece = "length", piece + stream.flush()
            yield GenerationChunk(token, piece, reason, time.perf_counter() - started)
            if reason:
                return

    def generate_text(self, prompt: str | Sequence[int], max_new_tokens: int = 256,
                      stop: str | Sequence[str] | None = None, ignore_eos: bool = False) -> str:
        """Prefill `prompt` and return the generated text (without the EOS). Raises ContextFull, before
        any state changes, when the prompt leaves no room for a new token."""
        _check_max_new_tokens(max_new_tokens)
        _stop_strings(stop)  # checked before the prefill changes state
        ids = self._ids(prompt)
        if len(ids) + 1 > self._room():
            raise ContextFull(f"a prompt of {len(ids)} tokens leaves no room for a reply: the session holds "
                              f"{len(self._tokens)} of {self.engine.max_context}; rewind or start a new session.")
        self.prefill(ids)
        eos = set(self.engine.tokenizer.eos_token_ids)
        ids = [c.token_id for c in self.generate(max_new_tokens, stop, ignore_eos) if c.token_id >= 0]
        return self.engine.tokenizer.decode([t for t in ids if t not in eos or ignore_eos],
                                            skip_special_tokens=True)

    def score(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced log-probabilities [len(ids), vocab]: row i is log P(next | context + ids[:i+1]).

        The context then includes `ids`.
        """
        if isinstance(ids, str):
            raise ConfigError("score takes token ids; encode the text with engine.tokenizer.encode first.")
        ids = self._checked_ids(ids)
        if not ids:
            return np.zeros((0, self.engine.config.vocab_size), np.float32)
        if len(ids) > self._room():
            raise ContextFull(f"{len(ids)} tokens do not fit the remaining {self._room()} of the context.")
        rows = []
        before = self.kv_cache.num_tokens
        try:
            with self._run():
                if self._tokens:  # the pending token first; its logits predict ids[0], not asked for
                    self.engine.executor.step([self._tokens[-1]], self.kv_cache, self._lora_id)
                for token in ids:
                    logits = self.engine.executor.step([token], self.kv_cache, self._lora_id)[0]
                    rows.append(log_softmax(logits))
        except BaseException:  # all or nothing: the cache must not run ahead of the tokens
            self.kv_cache.set_num_tokens(before)
            raise
        self._tokens.extend(ids)
        self.kv_cache.set_num_tokens(len(self._tokens) - 1)  # the last id becomes the pending token
        return np.stack(rows)

    @contextmanager
    def _run(self) -> Iterator[None]:
        """Marks a model call in progress, so cancel() also interrupts the executor."""
        self._running = True
        try:
            yield
        finally:
            self._running = False


class Conversation:
    """Multi-turn chat over one session: each turn prefills only what the template adds.

    A session that already holds tokens (e.g. one from `Engine.load_session`) is continued: its
    tokens stay as a fixed prefix, and `messages` holds only the messages added after it.
    """

    # A stand-in for the restored history: the template renders the turns that follow it as it
    # would after any earlier exchange, and the text after this reply is what a new turn adds.
    _PAST = ({"role": "user", "content": "litekv-earlier-message"},
             {"role": "assistant", "content": "litekv-earlier-reply"})

    def __init__(self, session: Session, system: str | None = None):
        if not session.engine.tokenizer.chat_template:
            raise ConfigError("this model has no chat template; use a Session with plain prompts instead.")
        self.prefix: tuple[int, ...] = tuple(session.tokens)  # restored history; never rewound
        if system and self.prefix:
            raise ConfigError("the session already holds a conversation, whose tokens include its system "
                              "message; continue it without one, or start from a new session.")
        self.session = session
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.last_prefill = 0  # tokens prefilled by the latest turn
        self._open_turn: weakref.ref | None = None  # the latest send()'s stream (weakly: dropping it closes it)

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the whole conversation, ending with the generation prompt."""
        tokenizer = self.session.engine.tokenizer
        if not self.prefix:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        text = tokenizer.apply_chat_template([*self._PAST, *messages], add_generation_prompt=True, tokenize=False)
        marker = self._PAST[-1]["content"]
        at = text.find(marker)
        if at < 0:
            raise ChatTemplateError("the chat template drops assistant replies, so litekv cannot continue a "
                                    "restored conversation with it; start a new conversation.")
        tail = text[at + len(marker):]
        # A reply that ended with its end-of-turn token already holds the text the template closes it with.
        end = tokenizer.decode([self.prefix[-1]]) if self.prefix[-1] in tokenizer.eos_token_ids else ""
        if end and tail.startswith(end):
            tail = tail[len(end):]
        return [*self.prefix, *tokenizer.encode(tail, add_special_tokens=False)]

    def send(self, text: str, max_new_tokens: int = 256) -> Iterator[GenerationChunk]:
        """Add a user message and stream the assistant's reply.

        The message is recorded once its prompt is prefilled (a failed turn leaves no trace in
        `messages`), the reply when the stream ends however it ends: a caller that stops reading
        (break, an exception, close()) keeps the part it was given, which is what the session holds,
        so the next turn follows an assistant message. A new send() first closes a stream left open.
        Arguments are checked when called."""
        _check_max_new_tokens(max_new_tokens)
        if not isinstance(text, str):
            raise ConfigError(f"a message is a str, got {type(text).__name__}.")
        previous = self._open_turn() if self._open_turn else None
        if previous is not None:
            previous.close()  # records its partial reply before this turn renders the history
        turn = self._turn(text, max_new_tokens)
        self._open_turn = weakref.ref(turn)
        return turn

    def _turn(self, text: str, max_new_tokens: int) -> Iterator[GenerationChunk]:
        session, tokenizer = self.session, self.session.engine.tokenizer
        message = {"role": "user", "content": text}
        ids = self._render([*self.messages, message])
        if len(ids) + 1 > session.engine.max_context:  # checked before the rewind below changes state
            raise ContextFull(f"the conversation needs {len(ids)} tokens and a reply, more than the context of "
                              f"{session.engine.max_context}; start a new conversation.")
        have = session._tokens
        common = 0
        while common < min(len(have), len(ids)) and have[common] == ids[common]:
            common += 1
        if common < len(have):  # the template re-rendered earlier text differently: rewind to agreement
            session.rewind(len(have) - common)
        self.last_prefill = session.prefill(ids[common:])
        self.messages.append(message)
        reply: list[int] = []
        try:
            for chunk in session.generate(max_new_tokens):
                if chunk.token_id >= 0 and chunk.token_id not in tokenizer.eos_token_ids:
                    reply.append(chunk.token_id)
                yield chunk
        finally:  # every token made is in the session: the history must hold it too
            self.messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})


class StopStrings:
    """Watches streamed text for any of `stops`, searching only where a new match can be.

    The text before the window was searched already and held no stop (generation would have
    ended), so a new match ends in the new piece: it lies in the last len(piece) + longest - 1
    characters. A step's work does not grow with the text generated so far.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._keep = max(max(map(len, self.stops), default=1) - 1, 0)
        self.window = ""  # the last `longest - 1` characters pushed

    def push(self, piece: str) -> bool:
        """Add the next piece of text; True when the text now contains a stop string."""
        recent = self.window + piece
        self.window = recent[-self._keep:] if self._keep else ""
        return any(s in recent for s in self.stops)


class SeenTokens:
    """The distinct ids of a growing token list, for the repetition penalty.

    Adding a token costs O(1), and the penalty touches only the distinct ids: a step's work does
    not grow with the context (np.unique over the whole list took 7.8 ms a token at 32K tokens).
    """

    def __init__(self, vocab_size: int, tokens: Sequence[int] = ()):
        self._mask = np.zeros(vocab_size, bool)
        self._ids = np.empty(vocab_size, np.int64)  # the first `_count` are the distinct ids seen
        self._count = 0
        self.length = 0  # how many tokens of the list have been added
        self.extend(tokens)

    @property
    def ids(self) -> np.ndarray:
        """The distinct ids seen [n] int64, in order of first appearance (a view)."""
        return self._ids[:self._count]

    def extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 1:  # the decode step's case: no array round trip
            token = tokens[0]
            if not self._mask[token]:
                self._mask[token] = True
                self._ids[self._count] = token
                self._count += 1
        elif len(tokens):
            new = np.unique(np.asarray(tokens, np.int64))
            new = new[~self._mask[new]]
            self._mask[new] = True
            self._ids[self._count:self._count + new.size] = new
            self._count += new.size
        self.length += len(tokens)

    def penalize(self, logits: np.ndarray, penalty: float) -> None:
        """Apply the penalty to `logits` [vocab] float32 in place (see apply_repetition_penalty)."""
        _penalize(logits, self.ids, penalty)


def _penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> None:
    values = logits[seen]
    logits[seen] = np.where(values > 0, values / np.float32(penalty), values * np.float32(penalty))


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """Hugging Face semantics: seen tokens' positive logits are divided, negative ones multiplied.

    Returns a penalized copy of `logits` [vocab]; sessions keep a `SeenTokens` instead of a context."""
    out = logits.copy()
    _penalize(out, np.unique(np.asarray(context, np.int64)), penalty)
    return out


def _check_max_new_tokens(max_new_tokens: object) -> None:
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a whole number of at least 1, got {max_new_tokens!r}.")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return (shifted - np.log(np.exp(shifted).sum(dtype=np.float32))).astype(np.float32)


def _path(value: object, what: str) -> Path:
    """`value` as a Path, refusing what Path() would turn into a TypeError (None, a number)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a path (a str or os.PathLike), got {value!r}.")
    return Path(value)


def _sampler_config(sampler: object) -> SamplerConfig:
    """A SamplerConfig, or one made of the executors' SamplerParams (which have no repetition penalty)."""
    if isinstance(sampler, SamplerConfig):
        return sampler
    if isinstance(sampler, SamplerParams):
        return SamplerConfig(sampler.temperature, sampler.top_k, sampler.top_p, seed=sampler.seed)
    raise ConfigError(f"sampler must be a litekv.SamplerConfig (or a SamplerParams), got {type(sampler).__name__}.")


def _stop_strings(stop: object) -> tuple[str, ...]:
    """`stop` (None, a str or an iterable of str) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Iterable) or isinstance(stops, (bytes, bytearray)):
        raise ConfigError(f"stop must be a str or a sequence of str, got {stop!r}.")
    stops = tuple(stops)
    if not all(isinstance(s, str) for s in stops):
        raise ConfigError(f"stop must be a str or a sequence of str, got {stop!r}.")
    if not all(stops):
        raise ConfigError("stop strings must not be empty: \"\" would match before any text; leave it out.")
    return stops


def _special_stop_ids(tokenizer: Tokenizer, stops: tuple[str, ...]) -> frozenset[int]:
    """Ids of the special tokens whose text is a stop string: streamed text leaves them out, so the
    text matcher cannot see them."""
    ids = (tokenizer.token_to_id(s) for s in stops)
    return frozenset(i for i in ids if i is not None and tokenizer.decode([i], skip_special_tokens=True) == "")


def adapter_fingerprint(adapter: LoraAdapter) -> str:
    """SHA-256 (hex) of an adapter's factors as loaded, scales folded in; the same whatever LoRA rank a
    bundle pads them to. A saved session records it, so another adapter under the same name is refused."""
    digest = hashlib.sha256()
    for (layer, target), (a, b) in sorted(adapter.factors.items()):
        digest.update(f"{layer}.{target}".encode())
        digest.update(np.ascontiguousarray(a[:adapter.rank]))
        digest.update(np.ascontiguousarray(b[:, :adapter.rank]))
    return digest.hexdigest()
