"""Executor interfaces: narrow, stateless contracts; every sequence's state lives in its KVCache.

`ExecutorBase` prefills and manages LoRA adapters and cancellation; `ExternalSamplerExecutor.step`
returns logits for the caller to sample; `InternalSamplerExecutor.sample_tokens` samples inside
the model. Concrete executors implement the three backend hooks at the bottom.
"""
from __future__ import annotations

import math
import sys
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from numbers import Real
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from litekv.bundle import SAMPLER_NON_FINITE, Manifest
from litekv.errors import BackendError, Cancelled, ConfigError, ContextFull
from litekv.kv_cache import KVCache, KVCacheError, KVCacheFormat
from litekv.models.config import ModelConfig
from litekv.resident_pages import ModelFilePages, keep_large_allocations_mapped
from litekv.sampling import step_seed
from litekv.validation import is_int

from .lora import LoraAdapter, LoraError, check_adapter, load_peft_adapter
from .prefill_plan import Chunk, plan_prefill


class LoraInUse(LoraError):
    """The adapter is used by a running call and cannot be unloaded now."""


_FLOAT32_TINY, _FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
TOP_K_MAX = 2**31 - 1  # the sampler graphs' top_k input is int32
# Session files store the seed as int64; step_seed folds it (and the row and position) into the
# sampler graphs' int32 seed input.
SEED_MAX = 2**63 - 1


def _number(name: str, value: object) -> float:
    """A sampler field that must be a finite real number, as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise ConfigError(f"sampler {name} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise ConfigError(f"sampler {name} must be a finite number, got {value!r}.")
    return float(value)


def _whole(name: str, value: object, high: int, meaning: str) -> int:
    """A sampler field that must be an int in 0..high, as an int."""
    if not is_int(value):
        raise ConfigError(f"sampler {name} must be an int ({meaning}), got {value!r}.")
    if not 0 <= value <= high:
        raise ConfigError(f"sampler {name} must lie in 0..{high} ({meaning}), got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class SamplerParams:
    """temperature 0 means greedy; top_k 0 means no top-k limit (64 candidates at most in-graph).

    Checked and normalized on creation (Python float / int): the models compute in float32 with
    int32 top_k and seed inputs, so values outside those are refused here rather than mid-generation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        temperature = _number("temperature", self.temperature)
        # float32 must hold it (logits are divided by it) as a normal number: 0 < t < 1.2e-38 would
        # divide by zero or by a denormal in the graph
        if temperature < 0 or 0 < temperature < _FLOAT32_TINY or temperature > _FLOAT32_MAX:
            raise ConfigError(f"sampler temperature must be 0 (greedy) or lie in {_FLOAT32_TINY:.3g}.."
                              f"{_FLOAT32_MAX:.3g}, got {self.temperature!r}.")
        top_p = _number("top_p", self.top_p)
        if not _FLOAT32_TINY <= top_p <= 1:  # above 0 in float32 too
            raise ConfigError(f"sampler top_p must lie in {_FLOAT32_TINY:.3g}..1 (1 keeps every candidate), got "
                              f"{self.top_p!r}.")
        top_k = _whole("top_k", self.top_k, TOP_K_MAX, "0 = no limit")
        seed = _whole("seed", self.seed, SEED_MAX, "any non-negative int64")
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
            object.__setattr__(self, name, value)

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


def sampler_params(sampler: object) -> SamplerParams:
    """SamplerParams itself, or those of a litekv.SamplerConfig (anything whose `params` is
    SamplerParams: the engine module sits above this one)."""
    if isinstance(sampler, SamplerParams):
        return sampler
    params = getattr(sampler, "params", None)
    if not isinstance(params, SamplerParams):
        raise ConfigError(f"sampler must be a SamplerParams or a litekv.SamplerConfig, got {type(sampler).__name__}.")
    if getattr(sampler, "repetition_penalty", 1.0) != 1.0:  # the in-model samplers have no penalty: not ignored
        raise ConfigError("sample_tokens samples inside the model, which has no repetition penalty; use step() and "
                          "sample on the host (litekv.Session does), or set repetition_penalty=1.0.")
    return params


ACCELERATORS = ("cpu", "gpu", "npu", "auto")


def check_accelerator(backend: str, accelerator: object, provider_lists: bool) -> None:
    """`accelerator` is one of ACCELERATORS or, where the backend takes them (provider_lists:
    ONNX Runtime), a non-empty list of execution provider names or (name, options) pairs."""
    if isinstance(accelerator, str) and accelerator in ACCELERATORS:
        return
    if provider_lists and isinstance(accelerator, (list, tuple)) and accelerator and all(
            isinstance(p, str) or (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                   and isinstance(p[1], dict)) for p in accelerator):
        return
    choices = ", ".join(map(repr, ACCELERATORS))
    lists = " or a list of ONNX Runtime execution providers" if provider_lists else ""
    raise ConfigError(f"unknown accelerator {accelerator!r} for the {backend} backend; use one of {choices}{lists}.")


def check_threads(threads: object, name: str = "threads") -> int | None:
    """`threads`: None (the backend's default) or a positive int; returned as an int."""
    if threads is None:
        return None
    if not is_int(threads) or threads < 1:
        raise ConfigError(f"{name} must be a positive int, or None for the default, got {threads!r}.")
    return int(threads)


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


class _Call:
    """A running prefill, step or sample_tokens, as cancel() sees it. Each call has its own, so a
    cancel marks only the calls running when it came, never a later one."""

    __slots__ = ("kv_cache", "adapter", "lora_id", "cancelled")

    def __init__(self, kv_cache: KVCache | None, adapter: LoraAdapter | None, lora_id: int | None):
        self.kv_cache, self.adapter, self.lora_id = kv_cache, adapter, lora_id
        self.cancelled = False


class ExecutorBase(ABC):
    """Runs a converted model; holds weights and adapters, never sequence state."""

    backend: str = ""
    accelerator: str = "cpu"
    # The converted bundle's manifest (None for executors without a bundle): its KV cache format is
    # what create_kv_cache makes.
    manifest: Manifest | None = None
    # The bundle directory it runs, named in errors (None for executors without a bundle).
    bundle_path: Path | None = None
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
        self._lock = threading.Lock()  # adapters and their use; never taken by cancel()
        # The running calls, as an ordered set. Adding, removing and copying it are single operations
        # under CPython's GIL, so calls and cancel() need no lock for it.
        self._calls: dict[_Call, None] = {}
        self._reset_due = False  # a cancel reached the backend: reset it before the next call on an idle executor
        self._logits = ReusedArrays()  # decode steps' outputs
        keep_large_allocations_mapped()  # freed activations go back to the system, not to a growing heap

    # ---- KV caches --------------------------------------------------------------------------------
    @abstractmethod
    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        """A cache this executor can run, of `max_context` entries per sequence. huge_pages: its
        buffers on 2 MB pages, all resident from the first token; False for 4 KB pages that become
        resident as tokens reach them (see KVCache.allocate)."""

    kv_layout = "BSHD"

    @cached_property
    def kv_cache_format(self) -> KVCacheFormat:
        """The format of the caches create_kv_cache makes, the only ones this executor runs."""
        cfg, manifest = self.config, self.manifest
        dtype = str(np.dtype(manifest.kv_dtype)) if manifest is not None else "float32"
        row_scales = bool(manifest.kv_row_scales) if manifest is not None else False
        return KVCacheFormat(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.max_context, self.kv_layout, dtype,
                             row_scales)

    def _check_cache(self, kv_cache: KVCache) -> None:
        """KVCacheError unless `kv_cache` is an unreleased cache of this executor's format."""
        if not isinstance(kv_cache, KVCache):
            raise KVCacheError(f"expected a KVCache from executor.create_kv_cache(), got {type(kv_cache).__name__}.")
        expected = self.kv_cache_format
        actual = kv_cache.format  # KVCacheError if the cache was released
        if actual != expected:
            differences = ", ".join(f"{name} {theirs!r} (this executor's: {ours!r})"
                                    for name, (ours, theirs) in expected.differences(actual).items())
            raise KVCacheError(f"KV cache {kv_cache.cache_id} was not made for this {self.backend} executor: "
                               f"{differences}. Create it with this executor's create_kv_cache() (select_and_copy_from "
                               "copies tokens over from a cache of the same dtype).")

    # ---- prefill --------------------------------------------------------------------------------
    def prefill(self, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache, lora_id: int | None = None) -> None:
        """Append tokens [T] (same for every row) or [batch, T] to the cache.

        Runs in chunks of the available prefill signatures; a cancel stops at the next chunk and
        raises `Cancelled` with the cache holding exactly the chunks that completed.
        """
        tokens = self._token_matrix(inputs, kv_cache)
        with self._call(lora_id, kv_cache) as call:
            start = kv_cache.num_tokens
            if self.model_pages is not None:  # what decode steps read since the last release
                self.model_pages.release_after_steps()
            try:
                for chunk in plan_prefill(tokens.shape[1], start, self._prefill_sizes(), self.max_context):
                    self._check_cancel(call)
                    begin = chunk.start - start
                    try:
                        for row in range(kv_cache.batch_size):
                            self._run_prefill_chunk(tokens[row, begin:begin + chunk.real], chunk, kv_cache, row,
                                                    call.adapter)
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
        """Prefill tokens [T] or [batch, T] as int32 [batch, T], checked."""
        self._check_cache(kv_cache)
        batch = kv_cache.batch_size
        tokens = self._token_array(inputs)
        if tokens.ndim == 1:
            tokens = np.broadcast_to(tokens, (batch, tokens.shape[0]))
        if tokens.ndim != 2 or tokens.shape[0] != batch:
            raise ConfigError(f"tokens must be [T] or [batch={batch}, T], got shape {tokens.shape}.")
        self._check_ids(tokens)
        if kv_cache.num_tokens + tokens.shape[1] > self.max_context:
            raise ContextFull(f"{tokens.shape[1]} new tokens do not fit: the cache holds {kv_cache.num_tokens} of "
                              f"{self.max_context}; start a new sequence or rewind.")
        return tokens.astype(np.int32)

    def _step_tokens(self, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache) -> np.ndarray:
        """A step's next token of each row, int32 [batch], checked (the cache first)."""
        self._check_cache(kv_cache)
        batch = kv_cache.batch_size
        if type(inputs) is list and len(inputs) == batch and all(
                type(t) is int and 0 <= t < self.config.vocab_size for t in inputs):
            tokens = np.array(inputs, np.int32)  # the common call, [id] from a session: no numpy reductions
        else:
            tokens = self._token_array(inputs)
            if tokens.size != batch or tokens.ndim > 2 or (tokens.ndim and tokens.shape[0] != batch):
                raise ConfigError(f"a step takes one token per batch row: [{batch}] (or [{batch}, 1]) ids, got "
                                  f"shape {list(tokens.shape)}.")
            self._check_ids(tokens)
            tokens = tokens.reshape(batch).astype(np.int32)
        if kv_cache.num_tokens >= self.max_context:
            raise ContextFull(f"1 new token does not fit: the cache holds {kv_cache.num_tokens} of "
                              f"{self.max_context}; start a new sequence or rewind.")
        return tokens

    def _token_array(self, inputs: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token ids as an integer array (an empty one is fine)."""
        ids = f"token ids must be ints in 0..{self.config.vocab_size - 1}"
        try:
            tokens = np.asarray(inputs)
        except (ValueError, TypeError) as e:  # ragged nesting
            raise ConfigError(f"{ids}, in a [T] or [batch, T] array: {e}") from e
        if tokens.size and tokens.dtype.kind not in "iu":
            raise ConfigError(f"{ids}, got values such as {tokens.reshape(-1)[:1].tolist()[0]!r}; encode text with "
                              "the tokenizer first.")
        return tokens

    def _check_ids(self, tokens: np.ndarray) -> None:
        vocab = self.config.vocab_size
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            bad = tokens[(tokens < 0) | (tokens >= vocab)].reshape(-1)[0]
            raise ConfigError(f"token id {int(bad)} is outside the vocabulary: ids must lie in 0..{vocab - 1}.")

    # ---- LoRA -------------------------------------------------------------------------------------
    def load_lora(self, adapter: str | Path | LoraAdapter, name: str | None = None) -> int:
        """Load a PEFT adapter directory (or a prepared adapter); returns its lora_id."""
        if self.lora_rank is None:
            raise LoraError("this model was converted without LoRA inputs; reconvert it with --lora-rank R.")
        if isinstance(adapter, LoraAdapter):
            check_adapter(adapter, self.config, self.lora_rank, self.lora_targets)
        else:
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
    def cancel(self, kv_cache: KVCache | None = None) -> None:
        """Stop the calls running now on `kv_cache` (a prefill, step or sample_tokens), or every
        running call when it is None; a no-op when none runs.

        A cancelled call raises `Cancelled` at its next prefill chunk or sample_tokens step, or
        inside its model run where the backend can stop one (the only place a step() stops).
        Only the calls running when cancel() is called are marked: calls that start later, on this
        cache or any other, run normally. It takes no lock, so it may be called from any thread,
        and from a signal handler on the thread of the call it stops (which then stops at its next
        check: the handler runs only between Python bytecodes, never inside a model run).
        """
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise KVCacheError(f"cancel takes the KVCache whose calls to stop, or None, got {type(kv_cache).__name__}.")
        calls = tuple(self._calls)
        if kv_cache is not None:
            cache_id = kv_cache.cache_id
            calls = tuple(c for c in calls if c.kv_cache is not None and c.kv_cache.cache_id == cache_id)
        if not calls:
            return
        for call in calls:
            call.cancelled = True
        self._reset_due = True
        self._interrupt_backend(calls)

    def _interrupt_backend(self, calls: tuple[_Call, ...]) -> None:
        """Stop the model runs of `calls` where the backend allows it; runs of other calls must not
        fail (or must be run again: see _cancelled_on). Called without any lock held."""

    def _reset_backend_cancel(self) -> None:
        """Drop what an earlier cancel left in the backend; called when no call runs."""

    def _cancelled_on(self, kv_cache: KVCache) -> bool:
        """Whether a call running on `kv_cache` was cancelled: a backend interrupt that reached a run
        of another call is not a cancel, and that run is run again."""
        return any(call.cancelled and call.kv_cache is kv_cache for call in tuple(self._calls))

    def _check_cancel(self, call: _Call) -> None:
        if call.cancelled:
            raise Cancelled(f"{self.backend} call cancelled.")

    @contextmanager
    def _call(self, lora_id: int | None, kv_cache: KVCache | None = None) -> Iterator[_Call]:
        call = self._begin_call(lora_id, kv_cache)
        try:
            yield call
        finally:
            self._end_call(call)

    # _call in two halves, for the one-token paths (step, sample_tokens) to skip the generator.
    def _begin_call(self, lora_id: int | None, kv_cache: KVCache | None) -> _Call:
        """Register a running call on `kv_cache` (and its adapter as in use)."""
        if self._reset_due:
            self._reset_if_idle()
        if lora_id is None:
            call = _Call(kv_cache, None, None)
        else:
            with self._lock:
                adapter = self._adapters.get(lora_id)
                if adapter is None:
                    raise LoraError(f"no adapter with lora_id {lora_id} is loaded.")
                self._adapters_in_use[lora_id] = self._adapters_in_use.get(lora_id, 0) + 1
            call = _Call(kv_cache, adapter, lora_id)
        self._calls[call] = None
        return call

    def _end_call(self, call: _Call) -> None:
        del self._calls[call]
        if call.lora_id is not None:
            with self._lock:
                self._adapters_in_use[call.lora_id] -= 1

    def _reset_if_idle(self) -> None:
        """Reset the backend after a cancel once no call runs: no interrupt can be meant for a run then."""
        with self._lock:
            if self._reset_due and not self._calls:
                self._reset_due = False
                self._reset_backend_cancel()

    # ---- backend hooks ---------------------------------------------------------------------------
    @abstractmethod
    def _run_prefill_chunk(self, tokens: np.ndarray, chunk: Chunk, kv_cache: KVCache, row: int,
                           adapter: LoraAdapter | None) -> None:
        """Write `tokens` (chunk.real of them) at chunk.start of batch row `row`; pad to chunk.length."""


class ExternalSamplerExecutor(ExecutorBase):
    """One decode step returns the logits; the caller samples."""

    def step(self, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache, lora_id: int | None = None) -> np.ndarray:
        """inputs: the next token of each row [batch]; returns logits [batch, vocab] float32."""
        tokens = self._step_tokens(inputs, kv_cache)
        call = self._begin_call(lora_id, kv_cache)
        try:
            logits = self._decode(tokens, kv_cache, call.adapter)
            kv_cache.set_num_tokens(kv_cache.num_tokens + 1)
            self._count_steps(len(tokens))
        finally:
            self._end_call(call)
        return logits

    @abstractmethod
    def _decode(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None) -> np.ndarray:
        """One token per row at position num_tokens -> logits [batch, vocab], in an array no caller holds:
        a fresh one, or one from `self._logits.take`."""


def non_finite_logits_advice(bundle_path: Path | None, adapter: str | None) -> str:
    """What an error about logits holding NaN or infinite values tells the user to check."""
    model = "the model" + (f" in {bundle_path}" if bundle_path is not None else "")
    if adapter is not None:
        model += f" and {adapter}"
    return f"Check {model} (damaged weights, or values beyond float32), or reconvert the model."


class InternalSamplerExecutor(ExecutorBase):
    """N decode steps sample inside the model; only token ids come back."""

    def sample_tokens(self, num_steps: int, inputs: Sequence[int] | np.ndarray, kv_cache: KVCache,
                      lora_id: int | None = None, sampler: SamplerParams = SamplerParams()) -> np.ndarray:
        """inputs: the next token of each row [batch]; returns sampled ids [batch, num_steps] int32.

        sampler: SamplerParams, or a litekv.SamplerConfig without repetition penalty. Each step
        feeds the previous step's sample. A cancel stops at the next step and raises `Cancelled`;
        the cache then holds every token that was fed in. A step whose logits hold a NaN or an
        infinity (a broken model or adapter, an overflow) samples nothing and raises BackendError,
        as the host sampler does; the cache then holds the tokens fed in before that step, not the
        one it fed, as when a cancel stops a step inside its model run.
        """
        if not is_int(num_steps) or num_steps < 1:
            raise ConfigError(f"num_steps must be an int of at least 1, got {num_steps!r}.")
        sampler = sampler_params(sampler)
        tokens = self._step_tokens(inputs, kv_cache)
        if kv_cache.num_tokens + num_steps > self.max_context:
            raise ContextFull(f"{num_steps} steps do not fit: the cache holds {kv_cache.num_tokens} of "
                              f"{self.max_context}.")
        batch = len(tokens)
        out = np.empty((batch, num_steps), np.int32)  # every column is written before it is returned
        call = self._begin_call(lora_id, kv_cache)
        adapter = call.adapter
        try:
            for i in range(num_steps):
                self._check_cancel(call)
                tokens = self._sample(tokens, kv_cache, adapter, sampler)
                if tokens.min() < 0:  # SAMPLER_NON_FINITE: not a token to feed, nor to commit the step for
                    raise self._non_finite_logits(tokens, i, kv_cache, call.lora_id)
                kv_cache.set_num_tokens(kv_cache.num_tokens + 1)
                self._count_steps(batch)
                out[:, i] = tokens
        finally:
            self._end_call(call)
        return out

    def _non_finite_logits(self, sampled: np.ndarray, step: int, kv_cache: KVCache,
                           lora_id: int | None) -> BackendError:
        """The error of a step whose sampled ids [batch] hold SAMPLER_NON_FINITE."""
        rows = np.flatnonzero(sampled == SAMPLER_NON_FINITE).tolist()
        where = f"batch row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}"
        adapter = None if lora_id is None else f"LoRA adapter {lora_id}"
        return BackendError(
            f"{self.backend}: the logits of sample_tokens step {step} (position {kv_cache.num_tokens}, {where}) hold "
            f"NaN or infinite values, so no token can be sampled; the KV cache keeps the {kv_cache.num_tokens} tokens "
            f"before that step. {non_finite_logits_advice(self.bundle_path, adapter)}")

    @abstractmethod
    def _sample(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                sampler: SamplerParams) -> np.ndarray:
        """Feed one token per row at position num_tokens; return the sampled next tokens [batch] int32,
        SAMPLER_NON_FINITE for a row whose logits hold a NaN or an infinity."""
