"""What an application touches: Engine (a loaded model), Session (one sequence), Conversation (chat).

Generation is layered: `Session.generate_text` joins `Session.generate` (a generator of chunks with
a finish reason), which runs one `Session._next_token` per step on the executor.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from litekv.errors import Cancelled, ConfigError, ContextFull
from litekv.executor import SamplerParams
from litekv.kv_cache import KVCache
from litekv.sampling import sample_token
from litekv.tokenizer import Tokenizer


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
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))
        if self.repetition_penalty <= 0:
            raise ConfigError("repetition_penalty must be positive (1.0 disables it).")
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


class Engine:
    """A model ready to run: a converted bundle, or a raw checkpoint with backend="reference"."""

    def __init__(self, model: str | Path, backend: str | None = None, accelerator: str = "cpu",
                 threads: int | None = None):
        model = Path(model)
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
        self._adapters: dict[str, int] = {}

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
        from litekv.executor.numpy_executor import NumpyExecutor

        ckpt = load_checkpoint(model)
        self.executor = NumpyExecutor(ckpt.config, ckpt.weights, max_context=min(ckpt.config.max_position, 4096))
        self.tokenizer = ckpt.tokenizer
        self.fingerprint = fingerprint(ckpt.config, ckpt.weights, QuantPlan())

    @property
    def max_context(self) -> int:
        return self.executor.max_context

    def load_lora(self, path: str | Path, name: str | None = None) -> str:
        name = name or Path(path).name
        if name in self._adapters:
            raise ConfigError(f"an adapter named {name!r} is already loaded; unload it or pick another name.")
        self._adapters[name] = self.executor.load_lora(path, name)
        return name

    def unload_lora(self, name: str) -> None:
        if name not in self._adapters:
            raise ConfigError(f"no adapter named {name!r} is loaded.")
        self.executor.unload_lora(self._adapters[name])
        del self._adapters[name]

    def lora_id(self, name: str | None) -> int | None:
        if name is None:
            return None
        if name not in self._adapters:
            raise ConfigError(f"no adapter named {name!r} is loaded; call engine.load_lora first.")
        return self._adapters[name]

    def create_session(self, sampler: SamplerConfig = SamplerConfig(), lora: str | None = None) -> "Session":
        return Session(self, sampler, lora)

    def create_conversation(self, system: str | None = None, sampler: SamplerConfig = SamplerConfig(),
                            lora: str | None = None) -> "Conversation":
        return Conversation(self.create_session(sampler, lora), system)

    def load_session(self, path: str | Path) -> "Session":
        """Restore a session saved with `Session.save`; validated before any state is built."""
        from litekv.session_file import read_session

        state = read_session(path, expected_fingerprint=self.fingerprint)
        s = state.sampler
        session = Session(self, SamplerConfig(s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.seed),
                          state.lora_name if state.lora_name in self._adapters else None)
        if state.lora_name and state.lora_name not in self._adapters:
            raise ConfigError(f"the session used LoRA adapter {state.lora_name!r}; load it with engine.load_lora "
                              "before loading the session.")
        session.kv_cache.load(state.kv_cache)
        session._tokens = [int(t) for t in state.tokens]
        return session


class Session:
    """One sequence: its tokens, the KV cache it owns, its sampler and adapter.

    Invariant: the cache holds every token but the last, which is fed by the next step (so
    the logits for the next token are always one step away and never stored).
    """

    def __init__(self, engine: Engine, sampler: SamplerConfig, lora: str | None):
        self.engine = engine
        self.sampler = sampler
        self.lora = lora
        self._lora_id = engine.lora_id(lora)
        self._tokens: list[int] = []
        self.kv_cache: KVCache = engine.executor.create_kv_cache()
        self._cancel = threading.Event()
        self._running = False

    # ---- state ------------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def _room(self) -> int:
        return self.engine.max_context - len(self._tokens)

    def clone(self) -> "Session":
        """An independent continuation: same tokens, a deep copy of the cache."""
        twin = Session(self.engine, self.sampler, self.lora)
        twin.kv_cache = self.kv_cache.deep_copy()
        twin._tokens = list(self._tokens)
        return twin

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (their KV rows are simply no longer counted)."""
        if not 0 <= num_tokens <= len(self._tokens):
            raise ConfigError(f"cannot rewind {num_tokens} tokens of {len(self._tokens)}.")
        del self._tokens[len(self._tokens) - num_tokens:]
        self.kv_cache.set_num_tokens(max(len(self._tokens) - 1, 0))

    def cancel(self) -> None:
        """Stop the running prefill or generate of this session (safe from another thread)."""
        self._cancel.set()
        if self._running:
            self.engine.executor.cancel()

    def save(self, path: str | Path) -> None:
        from litekv.session_file import SamplerState, SessionState, write_session

        s = self.sampler
        write_session(path, SessionState(
            fingerprint=self.engine.fingerprint, backend=self.engine.backend,
            tokens=np.asarray(self._tokens, np.int32), kv_cache=self.kv_cache.serialize(),
            sampler=SamplerState(s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.seed, len(self._tokens)),
            lora_name=self.lora, created_unix=time.time()))

    # ---- prompt ------------------------------------------------------------------------------------
    def _ids(self, text_or_ids: str | Sequence[int]) -> list[int]:
        if isinstance(text_or_ids, str):
            tok = self.engine.tokenizer
            return tok.encode(text_or_ids, add_special_tokens=not self._tokens)
        return [int(t) for t in text_or_ids]

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
            logits = executor.step([pending], self.kv_cache, self._lora_id)[0]
            logits = apply_repetition_penalty(logits, self._tokens, sampler.repetition_penalty)
            params = sampler.params
            token = (int(np.argmax(logits)) if params.greedy else
                     sample_token(logits, params.temperature, params.top_k, params.top_p, params.seed_for(position, 0)))
        self._tokens.append(token)
        return token

    def generate(self, max_new_tokens: int = 256, stop: Sequence[str] | None = None,
                 ignore_eos: bool = False) -> Iterator[GenerationChunk]:
        """Stream new tokens. The last chunk carries the finish reason.

        Raises ContextFull (before touching state) when no room is left for another token.
        """
        if not self._tokens:
            raise ConfigError("the session is empty: prefill a prompt first.")
        eos = set(self.engine.tokenizer.eos_token_ids)
        stream = self.engine.tokenizer.stream_decoder()
        started, text, stops = time.perf_counter(), "", tuple(stop or ())
        self._cancel.clear()
        for step in range(max_new_tokens):
            if self._room() < 1:
                raise ContextFull(f"the context of {self.engine.max_context} tokens is full; rewind or start "
                                  "a new session.")
            if self._cancel.is_set():
                yield GenerationChunk(-1, stream.flush(), "cancelled", time.perf_counter() - started)
                return
            try:
                with self._run():
                    token = self._next_token()
            except Cancelled:
                yield GenerationChunk(-1, stream.flush(), "cancelled", time.perf_counter() - started)
                return
            piece = stream.push(token)
            text += piece
            reason = None
            if token in eos and not ignore_eos:
                reason, piece = "eos", piece + stream.flush()
            elif stops and any(s in text for s in stops):
                reason = "stop"
            elif step == max_new_tokens - 1:
                reason, piece = "length", piece + stream.flush()
            yield GenerationChunk(token, piece, reason, time.perf_counter() - started)
            if reason:
                return

    def generate_text(self, prompt: str | Sequence[int], max_new_tokens: int = 256,
                      stop: Sequence[str] | None = None, ignore_eos: bool = False) -> str:
        self.prefill(prompt)
        eos = set(self.engine.tokenizer.eos_token_ids)
        ids = [c.token_id for c in self.generate(max_new_tokens, stop, ignore_eos) if c.token_id >= 0]
        return self.engine.tokenizer.decode([t for t in ids if t not in eos or ignore_eos],
                                            skip_special_tokens=True)

    def score(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced log-probabilities [len(ids), vocab]: row i is log P(next | context + ids[:i+1]).

        The context then includes `ids`.
        """
        ids = [int(t) for t in ids]
        if not ids:
            return np.zeros((0, self.engine.config.vocab_size), np.float32)
        if len(ids) > self._room():
            raise ContextFull(f"{len(ids)} tokens do not fit the remaining {self._room()} of the context.")
        rows = []
        with self._run():
            if self._tokens:  # the pending token first; its logits predict ids[0], not asked for
                self.engine.executor.step([self._tokens[-1]], self.kv_cache, self._lora_id)
            for token in ids:
                logits = self.engine.executor.step([token], self.kv_cache, self._lora_id)[0]
                rows.append(log_softmax(logits))
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
    """Multi-turn chat over one session: each turn prefills only what the template adds."""

    def __init__(self, session: Session, system: str | None = None):
        if not session.engine.tokenizer.chat_template:
            raise ConfigError("this model has no chat template; use a Session with plain prompts instead.")
        self.session = session
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.last_prefill = 0  # tokens prefilled by the latest turn

    def send(self, text: str, max_new_tokens: int = 256) -> Iterator[GenerationChunk]:
        """Add a user message and stream the assistant's reply."""
        self.messages.append({"role": "user", "content": text})
        ids = self.session.engine.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        have = self.session._tokens
        common = 0
        while common < min(len(have), len(ids)) and have[common] == ids[common]:
            common += 1
        if common < len(have):  # the template re-rendered earlier text differently: rewind to agreement
            self.session.rewind(len(have) - common)
        self.last_prefill = self.session.prefill(ids[common:])
        reply = []
        for chunk in self.session.generate(max_new_tokens):
            if chunk.token_id >= 0 and chunk.token_id not in self.session.engine.tokenizer.eos_token_ids:
                reply.append(chunk.token_id)
            yield chunk
        self.messages.append({"role": "assistant",
                              "content": self.session.engine.tokenizer.decode(reply, skip_special_tokens=True)})


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """Hugging Face semantics: seen tokens' positive logits are divided, negative ones multiplied."""
    out = logits.copy()
    seen = np.unique(np.asarray(context, np.int64))
    values = out[seen]
    out[seen] = np.where(values > 0, values / np.float32(penalty), values * np.float32(penalty))
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return (shifted - np.log(np.exp(shifted).sum(dtype=np.float32))).astype(np.float32)

