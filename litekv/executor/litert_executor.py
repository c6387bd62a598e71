"""LiteRT executor: CompiledModel through the C API, with the KV cache bound zero-copy in place.

The cache is allocated once at the bundle's max context, [batch, S_max, KVH, D] per layer. A
signature of capacity bucket S binds the first S slots of a row, a contiguous prefix of that
memory, so moving between buckets as the sequence grows copies nothing, and a step's attention
reads the smallest bucket that holds the live context.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from litekv import litert_capi, native_attention
from litekv.bundle import HEAD_KEEP_INPUT, SAMPLER_INPUTS, SAMPLER_SIGNATURE, BundleError, Manifest
from litekv.catalog import cache_dir
from litekv.durable import exclusive_lock, replace_durably
from litekv.errors import AcceleratorUnavailable, BackendError, Cancelled, MissingDependency
from litekv.kv_cache import KEY_BLOCK_SLOTS, KVCache, aligned_zeros, on_huge_pages
from litekv.litert_capi import CompiledTFLiteModel, HostTensorBuffer
from litekv.resident_pages import FileMappings, ModelFilePages
from litekv.sampling import CANDIDATES

from .base import ExternalSamplerExecutor, InternalSamplerExecutor, SamplerParams, check_accelerator, check_threads
from .lora import LoraAdapter, lora_inputs
from .numpy_executor import host_sample, host_token
from .prefill_plan import Chunk

MASKED = np.finfo(np.float32).min


class _SignatureIO:
    """Host buffers of one signature's small inputs and outputs (shared by every cache)."""

    def __init__(self, name: str, kind: str, tokens: int, capacity: int, vocab: int, sliding: bool,
                 screened_head: bool = False):
        self.name, self.tokens, self.capacity = name, tokens, capacity
        self.arrays = {"tokens": aligned_zeros((1, tokens), np.int32), "input_pos": aligned_zeros((tokens,), np.int32),
                       "mask": aligned_zeros((1, 1, tokens, capacity))}
        if sliding:
            self.arrays["local_mask"] = aligned_zeros((1, 1, tokens, capacity))
        if screened_head:  # 0: every logit; CANDIDATES: the rows the in-graph sampler can draw (bundle.py)
            self.arrays[HEAD_KEEP_INPUT] = aligned_zeros((1,), np.int32)
        self.outputs = {} if kind == "prefill" else {"logits": aligned_zeros((1, 1, vocab))}
        self.buffers = {k: HostTensorBuffer(v) for k, v in {**self.arrays, **self.outputs}.items()}

    def fill(self, tokens: np.ndarray, start: int, window: int | None, head_keep: int = 0) -> None:
        """Tokens at positions start.. (padding repeats the last real row's view of the cache);
        head_keep: the logits wanted exactly, where the head is screened (0: all)."""
        real = len(tokens)
        a = self.arrays
        if HEAD_KEEP_INPUT in a:
            a[HEAD_KEEP_INPUT][0] = head_keep
        a["tokens"][0, :real] = tokens
        a["tokens"][0, real:] = 0
        a["input_pos"][:] = np.arange(start, start + self.tokens, dtype=np.int32)
        # Rows are written in place: a decode step touches one row and allocates nothing sized by the context.
        for row in range(self.tokens):
            last = start + min(row, real - 1)  # the newest slot this row may see
            mask = a["mask"][0, 0, row]
            mask[:last + 1], mask[last + 1:] = 0.0, MASKED
            if "local_mask" in a:
                local = a["local_mask"][0, 0, row]
                local[:] = MASKED
                local[max(0, last - window + 1):last + 1] = 0.0


class _SamplerIO:
    """The sampler entry point: reads a decode's logits where that decode wrote them.

    LiteRT ties a tensor buffer object to one signature, so each decode entry point's logits
    array gets its own input buffer object here, bound once."""

    PARAMS = tuple((name, np.dtype(dtype)) for name, dtype in SAMPLER_INPUTS)

    def __init__(self, model: CompiledTFLiteModel):
        self.model = model
        self.params = {key: aligned_zeros((1,), dtype) for key, dtype in self.PARAMS}
        self.next_token = aligned_zeros((1,), np.int32)
        self._buffers = {k: HostTensorBuffer(v) for k, v in {**self.params, "next_token": self.next_token}.items()}
        self._runs: dict[str, object] = {}

    def run(self, decode: _SignatureIO, values: tuple) -> int:
        run = self._runs.get(decode.name)
        if run is None:
            inputs = {"logits": HostTensorBuffer(decode.outputs["logits"]),
                      **{key: self._buffers[key] for key, _ in self.PARAMS}}
            run = self._runs[decode.name] = self.model.bind(SAMPLER_SIGNATURE, inputs,
                                                            {"next_token": self._buffers["next_token"]})
        for (key, _), value in zip(self.PARAMS, values):
            self.params[key][0] = value
        run()
        return int(self.next_token[0])


MAX_WEIGHT_CACHES = 32


def xnnpack_cache_file(model: Path, fingerprint: str) -> Path:
    """XNNPACK's packed-weight cache for one model file, in the user cache.

    XNNPACK does not check that a cache file belongs to the model, so the name pins the exact
    file (path, size, modification time); the oldest files beyond MAX_WEIGHT_CACHES are removed.
    """
    stat = model.stat()
    directory = cache_dir() / "xnnpack"
    directory.mkdir(parents=True, exist_ok=True)
    where = hashlib.blake2b(str(model.resolve()).encode(), digest_size=6).hexdigest()
    path = directory / f"{fingerprint[:12]}-{where}-{stat.st_size}-{stat.st_mtime_ns}.xnn"
    if not path.exists():
        others = sorted(directory.glob("*.xnn"), key=lambda p: p.stat().st_mtime)
        for old in others[:max(0, len(others) - MAX_WEIGHT_CACHES + 1)]:
            old.unlink(missing_ok=True)
    return path


def xnnpack_cache_lock(cache: Path) -> Path:
    """The lock file beside a weight cache file, held by the process that opens its model."""
    return cache.with_name(cache.name + ".lock")


def _compile_with_weight_cache(model: Path, cache: Path, num_threads: int,
                               custom_ops: Sequence[litert_capi.CustomOp]) -> CompiledTFLiteModel:
    """Compile `model` for the CPU with XNNPACK's packed weights in the file `cache`.

    XNNPACK writes the file at the path it is given, as it packs. So processes opening the model take
    turns (an advisory lock on xnnpack_cache_lock(cache)): the first builds the file under a temporary
    name and renames it into place complete, the others wait and then map it. A file found damaged
    (left by a litekv without this lock) is rebuilt in place, still under the lock.
    """
    def compile_for(weights: Path) -> CompiledTFLiteModel:
        return CompiledTFLiteModel(model, accelerator="cpu", num_threads=num_threads, weight_cache_path=weights,
                                   custom_ops=custom_ops)

    try:
        with exclusive_lock(xnnpack_cache_lock(cache)):
            return compile_for(cache) if cache.exists() else _build_weight_cache(cache, compile_for)
    except OSError as e:
        raise BackendError(f"cannot write XNNPACK's weight cache {cache} ({e.strerror or e}): make {cache.parent} "
                           "writable, or set LITEKV_CACHE to a writable directory.") from e


def _build_weight_cache(cache: Path, compile_for: Callable[[Path], CompiledTFLiteModel]) -> CompiledTFLiteModel:
    building = cache.with_name(cache.name + ".partial")
    building.unlink(missing_ok=True)  # a killed builder's: XNNPACK would take a complete one as the cache
    compiled = compile_for(building)
    try:
        if building.exists():  # else XNNPACK ran without a cache
            replace_durably(building, cache)  # our mapping of it follows the rename
    except BaseException:
        compiled.close()
        raise
    return compiled


class _KVMemoryPool:
    """Keeps the memory of every KV cache LiteRT has run on alive, and reuses it for new caches.

    A compiled model remembers buffers it has run with; after the memory of a dead cache was
    freed, a later run on another cache was seen to read it (wrong logits, reproducibly). So a
    cache's buffers, and their bindings, go back to this pool when the cache dies instead of
    being freed. A cache made elsewhere (KVCache.deep_copy, KVCache.allocate) moves into a free
    set of buffers of its form before LiteRT first runs on it, and its own buffers, which LiteRT
    never saw, are freed: memory stays at the high-water mark of caches alive at once.
    """

    def __init__(self):
        self._free: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self.held_bytes = 0  # KV memory kept for LiteRT: free here or in use by live caches

    def cache(self, shape: tuple, dtype: np.dtype, row_scales: bool, huge_pages: bool, layout: str) -> KVCache | None:
        """A new, empty cache over the buffers of a dead cache of this form, or None."""
        recycled = self._take((shape, np.dtype(dtype), row_scales, huge_pages))
        if recycled is None:
            return None
        keys, values, bindings, key_scales, value_scales = recycled
        cache = KVCache.from_buffers(keys, values, layout, bindings, key_scales, value_scales, huge_pages)
        self._keep(cache._s)
        return cache

    def adopt(self, kv_cache: KVCache) -> None:
        """Keep the memory of a cache LiteRT is about to run on; before its first run, a cache made
        elsewhere moves into free buffers of its form where there are some."""
        storage = kv_cache._s
        if storage.pooled:
            return
        recycled = self._take(self._form(storage))
        if recycled is None:
            with self._lock:
                self.held_bytes += sum(b.nbytes for buffers in _buffer_lists(storage) for b in buffers)
        else:
            _move_into(storage, recycled)
        self._keep(storage)

    @staticmethod
    def _form(storage) -> tuple:
        keys = storage.keys[0]
        return keys.shape, keys.dtype, storage.key_scales is not None, storage.huge_pages

    def _keep(self, storage) -> None:
        storage.pooled = True
        weakref.finalize(storage, self._recycle, storage.keys, storage.values, storage.bindings,
                         storage.key_scales, storage.value_scales, storage.huge_pages)

    def _recycle(self, keys, values, bindings, key_scales, value_scales, huge_pages) -> None:
        if keys:  # a released cache gave its lists up already
            with self._lock:
                self._free.setdefault((keys[0].shape, keys[0].dtype, key_scales is not None, huge_pages), []).append(
                    (keys, values, bindings, key_scales, value_scales))

    def _take(self, form: tuple) -> tuple | None:
        """(keys, values, bindings, key scales, value scales) of a dead cache of this form, or None."""
        with self._lock:
            free = self._free.get(form)
            return free.pop() if free else None


def _buffer_lists(storage) -> list[list[np.ndarray]]:
    """A cache storage's keys, values and (with row scales) their scales."""
    return [storage.keys, storage.values] + ([storage.key_scales, storage.value_scales]
                                             if storage.key_scales is not None else [])


def _move_into(storage, recycled: tuple) -> None:
    """Give `storage` the pooled buffers `recycled`, holding its valid tokens, in place of its own."""
    keys, values, bindings, key_scales, value_scales = recycled
    # the valid slots in whole key blocks: BSHD_KB8 keeps block b's slots in the bytes of rows 8b..8b+7
    slots = min(-(-storage.num_tokens // KEY_BLOCK_SLOTS) * KEY_BLOCK_SLOTS, storage.keys[0].shape[1])
    for new, old in zip([keys, values, key_scales, value_scales], _buffer_lists(storage)):
        for dst, src in zip(new, old):  # the slot axis: 1 of [B, S, KVH, D], 2 of scales [B, KVH, S]
            prefix = (slice(None),) * (1 if dst.ndim == 4 else 2) + (slice(0, slots),)
            dst[prefix] = src[prefix]
    storage.keys, storage.values, storage.key_scales, storage.value_scales = keys, values, key_scales, value_scales
    storage.bindings.update(bindings)  # this executor's, for these buffers; the cache had none of its own


class LiteRTExecutor(ExternalSamplerExecutor, InternalSamplerExecutor):
    backend = "litert"

    def __init__(self, bundle: str | Path, manifest: Manifest, accelerator: str = "cpu", threads: int | None = None,
                 attention_threads: int | None = None):
        """accelerator: "cpu", "gpu", "npu" or "auto" (the first of those that works); threads:
        XNNPACK's pool (default 2); attention_threads: litekv's decode-attention kernel (default:
        threads; it uses at most 2)."""
        check_accelerator(self.backend, accelerator, provider_lists=False)
        threads, attention_threads = check_threads(threads), check_threads(attention_threads, "attention_threads")
        super().__init__(manifest.config, manifest.max_context, manifest.prefill_lengths, manifest.lora_rank,
                         manifest.lora_targets)
        self.manifest = manifest
        self.kv_layout = manifest.kv_layout  # BSHD, or BSHD_KB8 where litekv's ops keep the keys in blocks
        # Capacities per entry point, from the manifest: one-token steps have finer buckets than
        # prefill chunks. Checked before compiling: a step must always find a bucket.
        self._capacities: dict[str, list[int]] = {}
        for sig in manifest.signatures:
            if sig.kind != "sampler" and not sig.lora:
                base = f"prefill_{sig.tokens}" if sig.kind == "prefill" else sig.kind
                self._capacities.setdefault(base, []).append(sig.capacity)
        for base, capacities in self._capacities.items():
            capacities.sort()
            if capacities[-1] != manifest.max_context:
                raise BundleError(f"{bundle}: the {base} entry points stop at {capacities[-1]} tokens, below the max "
                                  f"context {manifest.max_context}; reconvert the model.")
        if "decode" not in self._capacities:
            raise BundleError(f"{bundle}: the bundle has no decode entry point; reconvert the model.")
        self.bundle_path = Path(bundle)
        path = self.bundle_path / manifest.model_file
        weight_cache = xnnpack_cache_file(path, manifest.fingerprint)
        mapped_before = FileMappings(path).ranges  # other models of this file in the process: not ours to release
        cache_mapped_before = FileMappings(weight_cache).ranges
        order = ("gpu", "npu", "cpu") if accelerator == "auto" else (accelerator,)
        errors = []
        for kind in order:
            kernels = self._custom_ops(bundle, manifest, attention_threads or threads or 2)
            self._attention_kernel = kernels[0] if kernels else None
            try:
                if kind == "cpu":
                    self.model = _compile_with_weight_cache(path, weight_cache, threads or 2, kernels)
                else:
                    self.model = CompiledTFLiteModel(path, accelerator=kind, num_threads=threads or 2,
                                                     custom_ops=kernels)
                self.accelerator = kind
                break
            except AcceleratorUnavailable as e:
                errors.append(e)
        else:
            raise errors[-1]
        # On CPU, XNNPACK runs on its packed copy of the weights: the model file pages read while
        # compiling are idle, and a prefill's embedding rows are not needed after it.
        if self.accelerator == "cpu":
            # With the decode linears in litekv's kernels, only prefill reads XNNPACK's packed weights.
            packed = (FileMappings(weight_cache, exclude=cache_mapped_before) if manifest.decode_linears == "kernel"
                      else None)
            self.model_pages = ModelFilePages(FileMappings(path, exclude=mapped_before), guard=self.model.while_open,
                                              prefill_only=packed, once=manifest.lm_head_kernel)
        cfg = self.config
        self._sliding = "sliding" in cfg.layer_types
        self._sampler: _SamplerIO | None = None
        self._io: dict[str, _SignatureIO] = {}
        for sig in manifest.signatures:
            if sig.kind == "sampler":
                self._sampler = _SamplerIO(self.model)
            else:
                self._io[sig.name] = _SignatureIO(sig.name, sig.kind, sig.tokens, sig.capacity, cfg.vocab_size,
                                                  self._sliding, HEAD_KEEP_INPUT in sig.inputs)
        self._run_lock = threading.Lock()  # the signature IO buffers are shared by all caches
        self._in_model: KVCache | None = None  # the cache whose runs hold _run_lock (see _interrupt_backend)
        self._pool = _KVMemoryPool()

    @staticmethod
    def _custom_ops(bundle: str | Path, manifest: Manifest, threads: int) -> list:
        """The kernels the bundle's custom ops need: litekv's attention, if it uses it."""
        if not manifest.uses_attention_kernel:
            return []
        cfg = manifest.config
        try:
            return [native_attention.AttentionKernel(cfg.head_dim, cfg.num_heads, manifest.max_context, threads,
                                                     litert=litert_capi.library())]
        except MissingDependency as e:
            raise BundleError(f"{bundle}: it attends in litekv's attention kernel, and {e}. Or reconvert the model "
                              "with --decode-attention graph --prefill-attention graph, which needs LiteRT's builtin "
                              "ops only.") from e

    def attention_stats(self) -> native_attention.AttentionStats | None:
        """The decode-attention kernel's counters since the executor opened (calls, time inside
        them, the helper thread's share and start delay), or None for a bundle whose decode steps
        attend in builtin ops. Prefill chunks are not counted."""
        if self._attention_kernel is None or self.manifest.decode_attention != "kernel":
            return None
        return self._attention_kernel.stats()

    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        cfg = self.config
        dtype, row_scales = np.dtype(self.manifest.kv_dtype), self.manifest.kv_row_scales
        shape = (batch_size, self.max_context, cfg.num_kv_heads, cfg.head_dim)
        huge = on_huge_pages(cfg.num_layers, shape, dtype, huge_pages)
        cache = self._pool.cache(shape, dtype, row_scales, huge, self.kv_layout)
        if cache is None:
            cache = KVCache.allocate(cfg.num_layers, batch_size, cfg.num_kv_heads, cfg.head_dim, self.max_context,
                                     self.kv_layout, self.manifest.kv_dtype, row_scales, huge_pages)
            self._pool.adopt(cache)
        return cache

    # ---- binding ---------------------------------------------------------------------------------
    def _signature_name(self, kind: str, end: int, adapter: LoraAdapter | None, tokens: int = 1) -> str:
        """The entry point of the smallest capacity bucket that holds positions < end.

        Without an adapter the plain entry points run: a LoRA-ready model then costs nothing extra.
        """
        base = f"prefill_{tokens}" if kind == "prefill" else kind
        capacity = next(s for s in self._capacities[base] if s >= end)
        name = base if capacity == self.max_context else f"{base}_s{capacity}"
        return name + "_lora" if adapter is not None else name

    def _kv_buffers(self, kv_cache: KVCache, row: int, signature: str, capacity: int) -> dict[str, HostTensorBuffer]:
        # One buffer object per signature: LiteRT ties a tensor buffer to the first signature
        # that ran it, so sharing one across signatures made the second read stale memory.
        key = (id(self), "kv", row, signature)
        if key not in kv_cache.bindings:
            self._pool.adopt(kv_cache)  # caches made elsewhere (deep_copy, allocate) too
            buffers = {}
            for layer in range(self.config.num_layers):
                for kind, raw in (("k", kv_cache.raw_keys(layer)), ("v", kv_cache.raw_values(layer))):
                    # The model's cache tensors are [1,S,KVH*D]: the same memory seen as rows.
                    buffers[f"kv_cache_{kind}_{layer}"] = HostTensorBuffer(
                        raw[row:row + 1, :capacity].reshape(1, capacity, -1))
                if kv_cache.row_scales:  # [1, KVH, S]: bundles with row scales have one capacity
                    for kind, raw in (("k", kv_cache.raw_key_scales(layer)), ("v", kv_cache.raw_value_scales(layer))):
                        buffers[f"kv_scale_{kind}_{layer}"] = HostTensorBuffer(raw[row:row + 1])
            kv_cache.bindings[key] = buffers
        return kv_cache.bindings[key]

    def _prepare_adapter(self, adapter: LoraAdapter | None) -> dict[str, HostTensorBuffer]:
        if self.lora_rank is None:
            return {}
        buffers = {}
        m = self.manifest
        for name, array in lora_inputs(adapter, self.config, m.lora_groups, self.lora_rank, m.lora_layout).items():
            aligned = aligned_zeros(array.shape)
            aligned[...] = array
            buffers[name] = HostTensorBuffer(aligned)
        return buffers

    def _bound_run(self, name: str, kv_cache: KVCache, row: int, adapter: LoraAdapter | None):
        io = self._io[name]
        lora_id, lora = self._prepared_inputs(adapter)
        key = (id(self), "run", name, row, lora_id)
        if key not in kv_cache.bindings:
            kv = self._kv_buffers(kv_cache, row, name, io.capacity)
            inputs = {**{k: io.buffers[k] for k in io.arrays}, **kv, **(lora or {})}
            written = self.manifest.signature(name).outputs  # not keys in blocks: the ops write those
            outputs = {**{k: io.buffers[k] for k in io.outputs}, **{k: b for k, b in kv.items() if k in written}}
            kv_cache.bindings[key] = self.model.bind(name, inputs, outputs)
        return io, kv_cache.bindings[key]

    def _run(self, name: str, tokens: np.ndarray, start: int, kv_cache: KVCache, row: int,
             adapter: LoraAdapter | None, head_keep: int = 0) -> _SignatureIO:
        io, run = self._bound_run(name, kv_cache, row, adapter)
        io.fill(tokens, start, self.config.sliding_window, head_keep)
        run()
        return io

    # ---- hooks -----------------------------------------------------------------------------------
    def _run_prefill_chunk(self, tokens: np.ndarray, chunk: Chunk, kv_cache: KVCache, row: int,
                           adapter: LoraAdapter | None) -> None:
        kind = "prefill" if chunk.length > 1 else "decode"
        name = self._signature_name(kind, chunk.start + chunk.length, adapter, chunk.length)
        # a chunk's logits go unread
        self._exclusive(kv_cache, self._run, name, tokens, chunk.start, kv_cache, row, adapter, CANDIDATES)

    def _decode(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None) -> np.ndarray:
        name = self._signature_name("decode", kv_cache.num_tokens + 1, adapter)
        out = self._logits.take((kv_cache.batch_size, self.config.vocab_size), np.float32)
        self._exclusive(kv_cache, self._decode_rows, name, tokens, kv_cache, adapter, out)
        return out

    def _decode_rows(self, name: str, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                     out: np.ndarray) -> None:
        for row in range(kv_cache.batch_size):
            io = self._run(name, tokens[row:row + 1], kv_cache.num_tokens, kv_cache, row, adapter)
            out[row] = io.outputs["logits"][0, 0]

    def _sample(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                sampler: SamplerParams) -> np.ndarray:
        if self._sampler is None:  # a bundle converted with --no-sampler: same algorithm on the host
            return host_sample(self._decode(tokens, kv_cache, adapter), sampler, kv_cache.num_tokens)
        name = self._signature_name("decode", kv_cache.num_tokens + 1, adapter)
        out = np.empty(kv_cache.batch_size, np.int32)
        self._exclusive(kv_cache, self._sample_rows, name, tokens, kv_cache, adapter, sampler, out)
        return out

    def _sample_rows(self, name: str, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                     sampler: SamplerParams, out: np.ndarray) -> None:
        for row in range(kv_cache.batch_size):
            io = self._run(name, tokens[row:row + 1], kv_cache.num_tokens, kv_cache, row, adapter,
                           head_keep=CANDIDATES)  # the sampler draws from these
            token = host_token(io.outputs["logits"][0, 0], sampler, self.manifest.sampler_refuses_non_finite)
            out[row] = (token if token is not None else
                        self._sampler.run(io, sampler.graph_inputs(sampler.seed_for(kv_cache.num_tokens, row))))

    # ---- cancellation ---------------------------------------------------------------------------
    def _exclusive(self, kv_cache: KVCache, work: Callable, *args) -> None:
        """work(*args): runs of the model on `kv_cache`, one caller at a time (the signature IO
        buffers are shared). The model has one cancel flag, so a cancel meant for another cache's
        call can stop these runs: they are run again. That is safe: runs write only the cache rows
        at num_tokens.., which are committed after the hook returns, from inputs they do not change."""
        with self._run_lock:
            self._in_model = kv_cache
            try:
                while True:
                    try:
                        work(*args)
                        return
                    except Cancelled:
                        if self._cancelled_on(kv_cache):
                            raise
            finally:
                self._in_model = None

    def _interrupt_backend(self, calls: tuple) -> None:
        # Set the model's flag only while it runs for a target, or is idle (the next run may be the
        # target's; another call's runs again, see _exclusive): never stop another cache's run in progress.
        running = self._in_model
        if running is None or any(call.kv_cache is running for call in calls):
            self.model.cancel()

    def _reset_backend_cancel(self) -> None:
        self.model.clear_cancel()
