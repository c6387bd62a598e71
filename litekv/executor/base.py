"""Executor interfaces: narrow, stateless contracts; every sequence's state lives in its KVCache.

`ExecutorBase` prefills and manages LoRA adapters and cancellation; `ExternalSamplerExecutor.step`
returns logits for the caller to sample; `InternalSamplerExecutor.sample_tokens` samples inside
the model. Concrete executors implement the three backend hooks at the bottom.
"""
from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from litekv.errors import Cancelled, ConfigError, ContextFull
from litekv.kv_cache import KVCache
from litekv.models.config import ModelConfig
from litekv.resident_pages import ModelFilePages, keep_large_allocations_mapped
from litekv.sampling import step_seed

from .lora import LoraAdapter, LoraError, load_peft_adapter
from .prefill_plan import Chunk, plan_prefill


class LoraInUse(LoraError):
    """The adapter is used by a running call and cannot be unloaded now."""


@dataclass(frozen=True)
class SamplerParams:
    """temperature 0 means greedy; top_k 0 means no top-k limit (64 candidates at most in-graph)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.seed < 0:
            raise ConfigError("sampler needs temperature >= 0, 0 < top_p <= 1, top_k >= 0 and seed >= 0.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def graph_inputs(self, seed: int) -> tuple[float, int, float, int]:
        """Values of the sampler graph's inputs (litekv.bundle.SAMPLER_INPUTS) for one draw; greedy
        runs as temperature 1 with top-k 1."""
        greedy = self.greedy
        return (1.0 if greedy else self.temperature, 1 if greedy else self.top_k, self.top_p, seed)

    def seed_for(self, position: int, row: int) -> int:
        """The draw at absolute `position` of batch `row`: independent of how steps are grouped in calls."""
        return step_seed(self.seed + 7_919 * row, position)


class ReusedArrays:
    """Arrays of one kind handed out as if fresh, but made again only when the caller still holds them.

    A decode step returns its logits in an array of its own (196 KB for SmolLM2). With glibc's mmap
    threshold pinned at 128 KB (keep_large_allocations_mapped), a new array of that size is a fresh
    mapping every step: 49 page faults, 0.18 ms of a 30 ms fp32 step. An array goes out again only
    once nothing but this holder references it (the reference count), so one the caller kept, or a
    view of it, is never overwritten. CPython's reference counts: the runtime's interpreter."""

    KEPT = 3  # arrays held for reuse: a caller keeping the last result or two still reuses the third
    _HOLDERS = 3  # references while only this holder has an array: its list, the loop variable, the call's

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized array of `shape` and `dtype` that no caller references."""
        with self._lock:
            for array in self._arrays:
                if array.shape == shape and array.dtype == dtype and sys.getrefcount(array) <= self._HOLDERS:
                    return array
            array = np.empty(shape, dtype)
            self._arrays = [array, *self._arrays[:self.KEPT - 1]]
            return array


class ExecutorBase(ABC):
    """Runs a converted model; holds weights and adapters, never sequence state."""

    backend: str = ""
    accelerator: str = "cpu"
    # The model file's pages to give back after each prefill chunk and every few hundred steps
    # (CPU backends that run on their own copy of the weights set it).
    model_pages: ModelFilePages | None = None

    def __init__(self, config: ModelConfig, max_context: int, prefill_lengths: Sequence[int],
                 lora_rank: int | None, lora_targets: Sequence[str]):
        self.config = config
        self.max_context = max_context
        self.prefill_lengths = tuple(prefill_lengths)
        self.lora_rank = lora_rank
        self.lora_targets = tuple(lora_targets)
        self._adapters: dict[int, LoraAdapter] = {}
        self._prepared: dict[int, object] = {}  # backend-ready inputs of each adapter
        self._adapters_in_use: dict[int, int] = {}
        self._next_lora_id = 1
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._running = 0
        self._logits = ReusedArrays()  # decode steps' outputs
        keep_large_allocations_mapped()  # freed activations go back to the system, not to a growing heap

    # ---- KV caches --------------------------------------------------------------------------------
    @abstractmethod
    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        """A cache this executor can run, of `max_context` entries per sequence. huge_pages: its
        buffers on 2 MB pages, all resident from the first token; False for 4 KB pages that become
        resident as tokens reach them (see KVCache.allocate)."""

    def _check_cache(self, kv_cache: KVCache) -> None:
        cfg = self.config
        if not kv_cache.is_valid():
            raise ConfigError(f"KV cache {kv_cache.cache_id} is not valid (released?); create a new one.")
        expected = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.max_context, self.kv_layout)
        actual = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim, kv_cache.num_entries,
                  kv_cache.layout)
        if expected != actual:
            raise ConfigError(f"KV cache {actual} was not made for this {self.backend} executor {expected}; "
                              "create it with executor.create_kv_cache() (or copy it over with select/broadcast).")

    kv_layout = "BSHD"

    # ---- prefill --------------------------------------------------------------------------------
    def prefill(self, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache, lora_id: int | None = None) -> None:
        """Append tokens [T] (same for every row) or [batch, T] to the cache.

        Runs in chunks of the available prefill signatures; a cancel stops at the next chunk and
        raises `Cancelled` with the cache holding exactly the chunks that completed.
        """
        tokens = self._token_matrix(inputs, kv_cache)
        with self._call(lora_id) as adapter:
            start = kv_cache.num_tokens
            if self.model_pages is not None:  # what decode steps read since the last release
                self.model_pages.release_after_steps()
            try:
                for chunk in plan_prefill(tokens.shape[1], start, self._prefill_sizes(), self.max_context):
                    self._check_cancel()
                    begin = chunk.start - start
                    try:
                        for row in range(kv_cache.batch_size):
                            self._run_prefill_chunk(tokens[row, begin:begin + chunk.real], chunk, kv_cache, row,
                                                    adapter)
                    finally:  # the embedding rows the chunk gathered are not read again
                        if self.model_pages is not None:
                            self.model_pages.release()
                    kv_cache.set_num_tokens(chunk.start + chunk.real)
            finally:
                if self.model_pages is not None:
                    self.model_pages.prefill_done()

    def _count_steps(self, steps: int) -> None:
        if self.model_pages is not None:
            self.model_pages.count_steps(steps)

    def _prefill_sizes(self) -> Sequence[int]:
        return self.prefill_lengths

    def _token_matrix(self, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache) -> np.ndarray:
        self._check_cache(kv_cache)
        tokens = np.asarray(inputs, dtype=np.int64)
        if tokens.ndim == 1:
            tokens = np.broadcast_to(tokens, (kv_cache.batch_size, tokens.shape[0]))
        if tokens.ndim != 2 or tokens.shape[0] != kv_cache.batch_size:
            raise ConfigError(f"tokens must be [T] or [batch={kv_cache.batch_size}, T], got shape {tokens.shape}.")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ConfigError(f"token ids must lie in 0..{self.config.vocab_size - 1}.")
        if kv_cache.num_tokens + tokens.shape[1] > self.max_context:
            raise ContextFull(f"{tokens.shape[1]} new tokens do not fit: the cache holds {kv_cache.num_tokens} of "
                              f"{self.max_context}; start a new sequence or rewind.")
        return tokens.astype(np.int32)

    # ---- LoRA -------------------------------------------------------------------------------------
    def load_lora(self, adapter: str | Path | LoraAdapter, name: str | None = None) -> int:
        """Load a PEFT adapter directory (or a prepared adapter); returns its lora_id."""
        if self.lora_rank is None:
            raise LoraError("this model was converted without LoRA inputs; reconvert it with --lora-rank R.")
        if not isinstance(adapter, LoraAdapter):
            adapter = load_peft_adapter(adapter, self.config, self.lora_rank, self.lora_targets, name)
        prepared = self._prepare_adapter(adapter)
        with self._lock:
            lora_id = self._next_lora_id
            self._next_lora_id += 1
            self._adapters[lora_id] = adapter
            self._prepared[lora_id] = prepared
        return lora_id

    def _prepare_adapter(self, adapter: LoraAdapter | None) -> object:
        """Backend hook: turn an adapter (None = no adapter) into the model's LoRA inputs, once."""
        return None

    def _prepared_inputs(self, adapter: LoraAdapter | None) -> tuple[int | None, object]:
        """(lora_id, prepared inputs) of an adapter handed to a hook."""
        if adapter is None:
            return None, None
        lora_id = next(i for i, a in self._adapters.items() if a is adapter)
        return lora_id, self._prepared[lora_id]

    def unload_lora(self, lora_id: int) -> None:
        with self._lock:
            if lora_id not in self._adapters:
                raise LoraError(f"no adapter with lora_id {lora_id} is loaded.")
            if self._adapters_in_use.get(lora_id):
                raise LoraInUse(f"adapter {lora_id} is used by a running call; unload it after the call returns.")
            del self._adapters[lora_id]
            self._prepared.pop(lora_id, None)

    # ---- cancellation -------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the running prefill / sample_tokens at its next chunk or step; a no-op when idle."""
        with self._lock:
            if self._running:
                self._cancel.set()
                self._interrupt_backend()

    def _interrupt_backend(self) -> None:
        """Stop inside a running model call where the backend allows it."""

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise Cancelled(f"{self.backend} call cancelled.")

    @contextmanager
    def _call(self, lora_id: int | None) -> Iterator[LoraAdapter | None]:
        with self._lock:
            if lora_id is not None and lora_id not in self._adapters:
                raise LoraError(f"no adapter with lora_id {lora_id} is loaded.")
            adapter = self._adapters.get(lora_id) if lora_id is not None else None
            if lora_id is not None:
                self._adapters_in_use[lora_id] = self._adapters_in_use.get(lora_id, 0) + 1
            if self._running == 0:
                self._cancel.clear()
                self._reset_backend_cancel()
            self._running += 1
        try:
            yield adapter
        finally:
            with self._lock:
                self._running -= 1
                if lora_id is not None:
                    self._adapters_in_use[lora_id] -= 1

    def _reset_backend_cancel(self) -> None:
        """Clear a backend-level cancel request before a new call."""

    # ---- backend hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _run_prefill_chunk(self, tokens: np.ndarray, chunk: Chunk, kv_cache: KVCache, row: int,
                           adapter: LoraAdapter | None) -> None:
        """Write `tokens` (chunk.real of them) at chunk.start of batch row `row`; pad to chunk.length."""


class ExternalSamplerExecutor(ExecutorBase):
    """One decode step returns the logits; the caller samples."""

    def step(self, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache, lora_id: int | None = None) -> np.ndarray:
        """inputs: the next token of each row [batch]; returns logits [batch, vocab] float32."""
        tokens = self._token_matrix(np.asarray(inputs).reshape(kv_cache.batch_size, 1), kv_cache)
        with self._call(lora_id) as adapter:
            logits = self._decode(tokens[:, 0], kv_cache, adapter)
            kv_cache.set_num_tokens(kv_cache.num_tokens + 1)
            self._count_steps(kv_cache.batch_size)
        return logits

    @abstractmethod
    def _decode(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None) -> np.ndarray:
        """One token per row at position num_tokens -> logits [batch, vocab], in an array no caller holds:
        a fresh one, or one from `self._logits.take`."""


class InternalSamplerExecutor(ExecutorBase):
    """N decode steps sample inside the model; only token ids come back."""

    def sample_tokens(self, num_steps: int, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache,
                      lora_id: int | None = None, sampler: SamplerParams = SamplerParams()) -> np.ndarray:
        """inputs: the next token of each row [batch]; returns sampled ids [batch, num_steps] int32.

        Each step feeds the previous step's sample. A cancel stops at the next step and raises
        `Cancelled`; the cache then holds every token that was fed in.
        """
        if num_steps < 1:
            raise ConfigError("num_steps must be at least 1.")
        tokens = self._token_matrix(np.asarray(inputs).reshape(kv_cache.batch_size, 1), kv_cache)[:, 0]
        if kv_cache.num_tokens + num_steps > self.max_context:
            raise ContextFull(f"{num_steps} steps do not fit: the cache holds {kv_cache.num_tokens} of "
                              f"{self.max_context}.")
        out = np.zeros((kv_cache.batch_size, num_steps), np.int32)
        with self._call(lora_id) as adapter:
            for i in range(num_steps):
                self._check_cancel()
                tokens = self._sample(tokens, kv_cache, adapter, sampler)
                kv_cache.set_num_tokens(kv_cache.num_tokens + 1)
                self._count_steps(kv_cache.batch_size)
                out[:, i] = tokens
        return out

    @abstractmethod
    def _sample(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                sampler: SamplerParams) -> np.ndarray:
        """Feed one token per row at position num_tokens; return the sampled next tokens [batch] int32."""

