"""The KV cache: fixed-shape per-layer K/V buffers, allocated once and updated in place.

Executors are stateless; everything a sequence has seen lives here. Buffers use the layout the
backend's kernels read (`BSHD` = [batch, slot, kv_head, dim] for TFLite, `BHSD` for ONNX
GroupQueryAttention); everything public (views, serialization, copies between caches) speaks the
canonical [batch, token, kv_head, dim] order, so a cache moves between backends.

With `BSHD_KB8` / `BHSD_KB8` the keys' bytes are in blocks of slots (KEY_BLOCK_SLOTS) for the
decode kernel; the canonical views, copies and serialization convert them, so such views are copies.

An int8 cache either holds codes of static scales that the model carries, or (`row_scales`) codes
with a float32 scale per token and KV head, kept beside them in [batch, kv_head, slot] buffers (as
the kernels read them) that every copy, view and serialization carries along, in the canonical
[batch, token, kv_head] order outside.
"""
from __future__ import annotations

import itertools
import math
import mmap
import time
import zlib
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

import numpy as np

from litekv.errors import ConfigError, LitekvError
from litekv.flat_tables import TABLE_OVERHEAD, FlatTableError, build, max_table_bytes, parse
from litekv.validation import is_int

LAYOUTS = ("BSHD", "BHSD", "BSHD_KB8", "BHSD_KB8")
# *_KB8: int8 keys stored in blocks of KEY_BLOCK_SLOTS slots, per KV head each dimension pair's codes
# of the block's slots side by side (litekv/kernels/attention_common.h), which litekv's decode kernel
# scores without reduction trees: BSHD_KB8 keeps a block's KV heads together ([S / 8][KVH][D / 2][8]
# [2]), BHSD_KB8 each KV head's blocks ([KVH][S / 8][D / 2][8][2]). Values stay BSHD / BHSD.
KEY_BLOCK_SLOTS = 8
BLOCK_SIZE = 16  # tokens per block in `block_table`
ALIGNMENT = 64  # LiteRT binds host memory zero-copy only when 64-byte aligned
# A layer of SmolLM2's int8 cache at 4,096 slots is 786 KB: it must be a map too, or heap reuse
# makes calloc clear (and make resident) all of it.
MMAP_MIN_BYTES = 1 << 18
# Linux's transparent huge page size on x86-64 and arm64 (4 KB base pages). A cache of at least this
# many bytes takes its K/V buffers from one map of such pages (`huge_pages`): the decode kernel
# streams every live row each step, and with 4 KB pages that was a page walk every 4 KB.
HUGE_PAGE_BYTES = 2 << 20
# Serialized caches hold [layer, batch, token, kv_head, dim] whatever the layout of the buffers they
# came from; a file that names another order is not one litekv wrote.
SERIALIZED_LAYOUT = "BSHD"
FORMAT_VERSION = 2  # 2 when the cache has row scales (older readers then say so, not "corrupted"); 1 otherwise
READABLE_FORMAT_VERSIONS = (1, 2)
IDENTIFIER = b"LKVC"
# Field order = vtable slots of litekv/schema/kv_cache.fbs. The row scales' slots came last, so
# files written before them read as caches without row scales.
SCHEMA = (
    ("version", "uint32"), ("layout", "string"), ("dtype", "string"), ("num_layers", "uint32"),
    ("batch_size", "uint32"), ("num_kv_heads", "uint32"), ("head_dim", "uint32"), ("num_tokens", "uint32"),
    ("capacity", "uint32"), ("keys", "bytes"), ("values", "bytes"), ("checksum", "uint64"),
    ("row_scales", "uint32"), ("key_scales", "bytes"), ("value_scales", "bytes"),
)
_DATA = ("keys", "values", "checksum", "row_scales", "key_scales", "value_scales")  # not in the checksummed header
_ids = itertools.count(1)


class KVCacheError(LitekvError):
    """A KV cache operation got an incompatible cache or a damaged serialized cache."""


class KVCacheMismatch(KVCacheError):
    """A serialized cache that is sound but of another shape or format than the cache loading it."""


def aligned_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """Zeros whose data pointer is ALIGNMENT-byte aligned.

    Large buffers are anonymous memory maps: the kernel hands out zero pages on first touch, so
    allocating a cache costs nothing up front and only the rows a sequence reaches become resident.
    (np.zeros reuses freed heap memory, which calloc must clear: 18 ms for a 188 MB cache here.)"""
    dtype = np.dtype(dtype)
    nbytes = math.prod(map(int, shape)) * dtype.itemsize
    if nbytes >= MMAP_MIN_BYTES:
        return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)  # page-aligned
    raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def on_huge_pages(num_layers: int, shape: tuple[int, ...], dtype, huge_pages: bool) -> bool:
    """Whether KVCache.allocate puts a cache of these K/V buffer shapes on huge pages when asked to:
    where the platform has them (Linux) and the cache fills at least one."""
    _check_sizes(num_layers=num_layers, shape=shape)
    nbytes = 2 * num_layers * math.prod(map(int, shape)) * np.dtype(dtype).itemsize
    return huge_pages and hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= HUGE_PAGE_BYTES


def _check_sizes(**sizes: int | tuple[int, ...]) -> None:
    """ConfigError unless every size (or every entry of a shape) is a whole number: numpy would fail
    on a float or str with a message that names neither the cache nor the argument."""
    if not all(is_int(v) for value in sizes.values() for v in (value if isinstance(value, tuple) else (value,))):
        given = ", ".join(f"{name}={value!r}" for name, value in sizes.items())
        raise ConfigError(f"KV cache sizes must be whole numbers (an int batch_size, e.g. create_kv_cache(2)), "
                          f"got {given}.")


def _cache_dtype(dtype) -> np.dtype:
    """`dtype` as a numpy dtype of numbers, else ConfigError (numpy would raise a TypeError naming
    neither the cache nor the argument, or make buffers of objects or strings)."""
    try:
        parsed = np.dtype(dtype)
    except TypeError as e:
        raise ConfigError(f"unknown KV cache dtype {dtype!r}; use 'float32', 'float16' or 'int8'.") from e
    if parsed.kind not in "fiu":
        raise ConfigError(f"a KV cache holds numbers, not {parsed}; use 'float32', 'float16' or 'int8'.")
    return parsed


def _page_aligned_zeros(shape: tuple[int, ...], count: int, dtype) -> list[np.ndarray]:
    """`count` zero arrays of this shape carved from one private anonymous map, each page-aligned, the
    map advised for transparent huge pages (2 MB): an int4 SmolLM2 step at 2,048 tokens spent 4.7 % less
    time in attention (bench/PERFORMANCE.md, thirty-fourth round). The memory becomes resident 2 MB
    at a time, so all of a cache's is at its first token, where 4 KB pages bring in only the rows a
    sequence reaches. Where the kernel has no huge pages the advice fails and 4 KB pages serve."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(map(int, shape)) * dtype.itemsize
    stride = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    region = mmap.mmap(-1, count * stride + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)  # shared maps get no THP
    raw = np.frombuffer(region, np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE_BYTES  # the first buffer on a huge page boundary
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or no THP: the buffers are just page-aligned
        pass
    return [raw[start + i * stride:start + i * stride + nbytes].view(dtype).reshape(shape) for i in range(count)]


@dataclass(frozen=True)
class KVCacheStats:
    memory_bytes: int
    tokens_stored: int
    capacity: int
    utilization: float  # tokens_stored / capacity
    last_access: float  # time.time() of the last read or write


@dataclass(frozen=True)
class KVCacheFormat:
    """What a cache's buffers are, apart from the batch size: an executor runs only caches of the
    format its create_kv_cache() makes (the dtype and layout its kernels read)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    layout: str
    dtype: str
    row_scales: bool

    def differences(self, other: "KVCacheFormat") -> dict[str, tuple[Any, Any]]:
        """{field: (this value, other's)} of the fields that differ."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in dataclass_fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}


@dataclass
class _Storage:
    keys: list[np.ndarray]
    values: list[np.ndarray]
    layout: str
    cache_id: int
    num_tokens: int = 0
    last_access: float = field(default_factory=time.time)
    released: bool = False
    # Backend-owned bindings of these buffers (valid for the storage's lifetime: arrays never move).
    bindings: dict[Any, Any] = field(default_factory=dict)
    pooled: bool = False  # a backend keeps these buffers alive after the cache dies (see LiteRT executor)
    # int8 codes with a scale per row: per layer [batch, kv_head, slot] float32; else None
    key_scales: list[np.ndarray] | None = None
    value_scales: list[np.ndarray] | None = None
    huge_pages: bool = False  # keys and values in one map of 2 MB pages (_page_aligned_zeros)
    format: KVCacheFormat | None = None  # memo of KVCache.format: the buffers never change until release


class KVCache:
    """Per-layer K/V buffers of `batch_size` sequences that share one token count.

    Shapes: `num_entries` = capacity per sequence; `key_cache(l)` / `value_cache(l)` are read-only
    views [batch, num_tokens, num_kv_heads, head_dim] of the valid tokens (with `key_blocks`, the
    keys' is a read-only copy: blocks have no row view).
    """

    device = "cpu"

    def __init__(self, storage: _Storage):
        self._s = storage

    @classmethod
    def allocate(cls, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 layout: str = "BSHD", dtype: str = "float32", row_scales: bool = False,
                 huge_pages: bool = True) -> "KVCache":
        """row_scales: int8 codes with a scale per token and KV head (BSHD only). huge_pages: the K/V
        buffers of a cache of at least HUGE_PAGE_BYTES in one map of 2 MB pages, resident in whole
        from the first token (faster long-context decode); False keeps 4 KB pages, which become
        resident only as tokens reach them (for devices short of memory)."""
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown KV layout {layout!r}; choose one of {LAYOUTS}.")
        _check_sizes(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     capacity=capacity)
        if min(num_layers, batch_size, num_kv_heads, head_dim, capacity) <= 0:
            raise ConfigError("KV cache dimensions and batch size must be positive.")
        dtype = _cache_dtype(dtype)
        if row_scales and (np.dtype(dtype) != np.int8 or layout != "BSHD"):
            raise ConfigError(f"scales per row go with an int8 cache in BSHD layout, not {dtype} in {layout}.")
        if layout.endswith("_KB8") and (np.dtype(dtype) != np.int8 or capacity % KEY_BLOCK_SLOTS or head_dim % 2):
            raise ConfigError(f"keys in blocks ({layout}) need int8 codes, a capacity that is a multiple of "
                              f"{KEY_BLOCK_SLOTS} and an even head_dim, not {dtype}, {capacity} and {head_dim}.")
        shape = ((batch_size, capacity, num_kv_heads, head_dim) if layout.startswith("BSHD")
                 else (batch_size, num_kv_heads, capacity, head_dim))
        scales = (lambda: [_row_scale_buffer(batch_size, num_kv_heads, capacity) for _ in range(num_layers)]) \
            if row_scales else (lambda: None)
        huge = on_huge_pages(num_layers, shape, dtype, huge_pages)
        try:
            buffers = (_page_aligned_zeros(shape, 2 * num_layers, dtype) if huge
                       else [aligned_zeros(shape, dtype) for _ in range(2 * num_layers)])
            key_scales, value_scales = scales(), scales()
        except (OSError, OverflowError, MemoryError, ValueError) as e:  # mmap's ENOMEM, sizes past ssize_t
            nbytes = 2 * num_layers * math.prod(map(int, shape)) * dtype.itemsize
            raise KVCacheError(f"cannot allocate a KV cache of {nbytes / 2**30:.4g} GiB ({num_layers} layers, batch "
                               f"{batch_size}, {capacity} slots of {num_kv_heads} KV heads of {head_dim} {dtype}): "
                               f"{e}. Use a smaller batch_size or max_context.") from e
        return cls(_Storage(buffers[:num_layers], buffers[num_layers:], layout, next(_ids),
                            key_scales=key_scales, value_scales=value_scales, huge_pages=huge))

    @classmethod
    def from_buffers(cls, keys: list[np.ndarray], values: list[np.ndarray], layout: str,
                     bindings: dict[Any, Any] | None = None, key_scales: list[np.ndarray] | None = None,
                     value_scales: list[np.ndarray] | None = None, huge_pages: bool = False) -> "KVCache":
        """A new, empty cache over existing buffers (recycled by a backend's memory pool; huge_pages:
        they came from allocate(huge_pages=True))."""
        return cls(_Storage(keys, values, layout, next(_ids), bindings=bindings or {}, key_scales=key_scales,
                            value_scales=value_scales, huge_pages=huge_pages))

    # ---- shape ------------------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return self._s.layout

    @property
    def huge_pages(self) -> bool:
        """Whether the K/V buffers are in one map of 2 MB pages (see allocate)."""
        return self._s.huge_pages

    @property
    def key_blocks(self) -> bool:
        """Whether the key buffers hold their codes in blocks of slots (layout BSHD_KB8 or BHSD_KB8)."""
        return self._s.layout.endswith("_KB8")

    @property
    def _slot_major(self) -> bool:
        """[batch, slot, kv_head, dim] buffers (BSHD, BSHD_KB8), else [batch, kv_head, slot, dim]."""
        return self._s.layout.startswith("BSHD")

    @property
    def num_layers(self) -> int:
        self._check_valid()
        return len(self._s.keys)

    @property
    def batch_size(self) -> int:
        return self._first_keys().shape[0]

    @property
    def num_entries(self) -> int:
        return self._first_keys().shape[1 if self._slot_major else 2]

    @property
    def num_kv_heads(self) -> int:
        return self._first_keys().shape[2 if self._slot_major else 1]

    @property
    def head_dim(self) -> int:
        return self._first_keys().shape[3]

    @property
    def dtype(self) -> np.dtype:
        return self._first_keys().dtype

    @property
    def format(self) -> KVCacheFormat:
        """Layers, KV heads, head dim, capacity, layout, dtype and row scales (not the batch size)."""
        s = self._s
        self._check_valid()
        if s.format is None:
            s.format = KVCacheFormat(self.num_layers, self.num_kv_heads, self.head_dim, self.num_entries, s.layout,
                                     str(self.dtype), self.row_scales)
        return s.format

    def _first_keys(self) -> np.ndarray:
        """Layer 0's key buffer, whose shape and dtype every buffer of the cache shares."""
        keys = self._s.keys
        if keys:
            return keys[0]
        self._check_valid()  # released: its lists are empty
        raise KVCacheError(f"KV cache {self.cache_id} has no layers.")

    @property
    def row_scales(self) -> bool:
        """Whether the int8 codes have a scale per token and KV head (`key_scales(l)`)."""
        return self._s.key_scales is not None

    @property
    def num_tokens(self) -> int:
        return self._s.num_tokens

    @property
    def cache_id(self) -> int:
        return self._s.cache_id

    @property
    def bindings(self) -> dict[Any, Any]:
        """Backend-private memo of bound buffers; executors key it by their own identity."""
        return self._s.bindings

    def is_valid(self) -> bool:
        return not self._s.released and 0 <= self._s.num_tokens <= self.num_entries

    def release(self) -> None:
        """Drop the buffers (every handle of this storage becomes invalid)."""
        self._check_valid()
        self._s.released = True
        self._s.bindings.clear()
        self._s.keys, self._s.values = [], []
        if self._s.key_scales is not None:
            self._s.key_scales, self._s.value_scales = [], []

    # ---- access -----------------------------------------------------------------------------------
    def key_cache(self, layer: int) -> np.ndarray:
        """Read-only [batch, token, kv_head, dim] view of the layer's keys over the tokens valid now.

        The view shares the cache's memory (keys in blocks: a copy). Before a LiteRT executor first runs
        on a cache made elsewhere (allocate, deep_copy), it may move it into the buffers of a dead cache
        of the same form, so a view taken before that run may keep showing the old memory: take views
        after the cache's first prefill or step, or take them again."""
        return self._valid_view(self._s.keys[self._layer(layer)], self.key_blocks)

    def value_cache(self, layer: int) -> np.ndarray:
        """The layer's values as key_cache shows its keys."""
        return self._valid_view(self._s.values[self._layer(layer)])

    def _layer(self, layer: int) -> int:
        """`layer`, checked to be one of this (unreleased) cache's."""
        self._check_valid()
        count = len(self._s.keys)
        if is_int(layer) and 0 <= layer < count:
            return layer
        raise KVCacheError(f"layer {layer!r} does not exist: this cache has layers 0..{count - 1}.")

    def key_scales(self, layer: int) -> np.ndarray:
        """The valid tokens' row scales [batch, num_tokens, num_kv_heads] of a cache with
        `row_scales`: key_cache(l) * key_scales(l)[..., None] is the keys."""
        return self._valid_scales(self._s.key_scales, layer)

    def value_scales(self, layer: int) -> np.ndarray:
        return self._valid_scales(self._s.value_scales, layer)

    def _valid_scales(self, scales: list[np.ndarray] | None, layer: int) -> np.ndarray:
        layer = self._layer(layer)
        if scales is None:
            raise KVCacheError("this cache has no scales per row: its codes use the model's static scales.")
        view = scales[layer][:, :, :self.num_tokens].transpose(0, 2, 1)
        view.flags.writeable = False
        return view

    def raw_key_scales(self, layer: int) -> np.ndarray:
        """The whole row-scale buffer [batch, kv_head, slot], for executors (writable)."""
        return self._raw_scales(self._s.key_scales, layer)

    def raw_value_scales(self, layer: int) -> np.ndarray:
        return self._raw_scales(self._s.value_scales, layer)

    def _raw_scales(self, scales: list[np.ndarray] | None, layer: int) -> np.ndarray:
        layer = self._layer(layer)
        if scales is None:
            raise KVCacheError("this cache has no scales per row: its codes use the model's static scales.")
        return scales[layer]

    def _buffer_lists(self) -> list[list[np.ndarray]]:
        """Keys, values and (with row scales) their scales: what copies and serialization carry."""
        return [self._s.keys, self._s.values] + ([self._s.key_scales, self._s.value_scales] if self.row_scales else [])

    def _blocked_lists(self) -> list[tuple[list[np.ndarray], bool]]:
        """_buffer_lists, each with whether its buffers hold keys in blocks."""
        return [(buffers, kind == 0 and self.key_blocks) for kind, buffers in enumerate(self._buffer_lists())]

    def raw_keys(self, layer: int) -> np.ndarray:
        """The whole buffer in backend layout, for executors (writable; with key_blocks, its bytes
        are blocks)."""
        return self._s.keys[self._layer(layer)]

    def raw_values(self, layer: int) -> np.ndarray:
        return self._s.values[self._layer(layer)]

    def set_num_tokens(self, n: int) -> None:
        """Executors commit processed tokens here; a smaller value rewinds (stale rows are ignored)."""
        self._check_valid()
        if not is_int(n) or not 0 <= n <= self.num_entries:  # 3.5 would be kept and break every later slice
            raise KVCacheError(f"token count {n!r} must be a whole number in 0..{self.num_entries}.")
        self._s.num_tokens = int(n)  # a numpy int would enter serialize's checksummed header as np.int64(n)
        self._s.last_access = time.time()

    def _valid_view(self, buf: np.ndarray, blocked: bool = False) -> np.ndarray:
        """Read-only canonical view of the valid tokens (with `blocked` keys, a copy: blocks have no row view)."""
        self._check_valid()
        view = self._read(buf, slice(None), self.num_tokens, blocked).view()
        view.flags.writeable = False
        self._s.last_access = time.time()
        return view

    def _canonical(self, buf: np.ndarray, rows: slice | int, n: int) -> np.ndarray:
        """Writable canonical view [rows, n, KVH, D] into a buffer of this cache ([rows, n, KVH] into
        a row-scale buffer)."""
        if buf.ndim == 3:  # row scales [batch, kv_head, slot]
            return buf[rows, :, :n].swapaxes(-2, -1)
        return buf[rows, :n] if self._slot_major else buf[rows, :, :n].swapaxes(-3, -2)

    def _read(self, buf: np.ndarray, rows: slice | int, n: int, blocked: bool) -> np.ndarray:
        """Canonical [rows, n, KVH, D] of the first n tokens of a buffer (a view, or with `blocked` keys a
        copy of the blocks rewritten as rows)."""
        if not blocked:
            return self._canonical(buf, rows, n)
        return self._canonical(self._key_rows(buf, -(-n // KEY_BLOCK_SLOTS)), rows, n)

    def _write(self, buf: np.ndarray, rows: slice | int, n: int, data: np.ndarray, blocked: bool) -> None:
        """Canonical data [rows, n, KVH, D] into the first n tokens of a buffer; with `blocked` keys the
        blocks they touch are rewritten (slots past n in the last block keep their codes)."""
        if not blocked:
            self._canonical(buf, rows, n)[...] = data
            return
        count = -(-n // KEY_BLOCK_SLOTS)
        as_rows = self._key_rows(buf, count)
        self._canonical(as_rows, rows, n)[...] = data
        view = self._block_view(buf, count)
        view[...] = as_rows.reshape(view.shape)

    def _block_view(self, buf: np.ndarray, count: int) -> np.ndarray:
        """The first `count` blocks of a key buffer in blocks, as a writable view in row order."""
        if self._slot_major:  # [B, S, KVH, D]: a block holds every KV head's
            return key_block_view(buf)[:, :count]
        return key_block_view(buf[:, :, :, None])[:, :, :count]  # [B, KVH, S, D]: each KV head's blocks

    def _key_rows(self, buf: np.ndarray, count: int) -> np.ndarray:
        """The first `count` blocks of a key buffer as rows in the buffer's axis order, count * slots
        of them (a copy)."""
        shape = list(buf.shape)
        shape[1 if self._slot_major else 2] = count * KEY_BLOCK_SLOTS
        return np.ascontiguousarray(self._block_view(buf, count)).reshape(shape)

    def _check_valid(self) -> None:
        if self._s.released:
            raise KVCacheError(f"KV cache {self.cache_id} was released and has no buffers any more; create a new "
                               "one with executor.create_kv_cache().")

    # ---- stats and paging metadata ----------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        self._check_valid()
        memory = sum(a.nbytes for buffers in self._buffer_lists() for a in buffers)
        return KVCacheStats(memory, self.num_tokens, self.num_entries, self.num_tokens / self.num_entries,
                            self._s.last_access)

    @property
    def block_table(self) -> list[int]:
        """Physical block of each logical block of BLOCK_SIZE tokens holding valid tokens.

        Storage is contiguous per sequence, so the mapping is the identity; paging and prefix
        sharing build on this table without changing callers.
        """
        self._check_valid()  # a released cache has no blocks
        return list(range(-(-self.num_tokens // BLOCK_SIZE)))

    # ---- copies -----------------------------------------------------------------------------------
    def _check_compatible(self, other: "KVCache") -> None:
        self._check_valid()
        if not isinstance(other, KVCache):
            raise KVCacheError(f"can copy only from another litekv KVCache, got {type(other).__name__}.")
        other._check_valid()
        mine = (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.row_scales)
        theirs = (other.num_layers, other.num_kv_heads, other.head_dim, other.dtype, other.row_scales)
        if mine != theirs:
            raise KVCacheError(f"caches do not match: (layers, kv heads, head dim, dtype, row scales) {mine} vs "
                               f"{theirs}.")
        if other.num_tokens > self.num_entries:
            raise KVCacheError(f"{other.num_tokens} tokens do not fit a cache of {self.num_entries} entries.")

    def select_and_copy_from(self, other: "KVCache", batch_index: int) -> None:
        """other[batch_index] -> this[0] (valid tokens only); this cache takes other's token count."""
        self._check_compatible(other)
        if not is_int(batch_index) or not 0 <= batch_index < other.batch_size:  # a bool is not an index
            raise KVCacheError(f"batch index {batch_index!r} must be a whole number in 0..{other.batch_size - 1}.")
        n = other.num_tokens
        for (mine, blocked), (theirs, their_blocked) in zip(self._blocked_lists(), other._blocked_lists()):
            for dst, src in zip(mine, theirs):
                self._write(dst, slice(0, 1), n, other._read(src, slice(batch_index, batch_index + 1), n, their_blocked),
                            blocked)
        self.set_num_tokens(n)

    def broadcast_and_copy_from(self, other: "KVCache") -> None:
        """other[0] -> every batch row of this cache (valid tokens only)."""
        self._check_compatible(other)
        n = other.num_tokens
        for (mine, blocked), (theirs, their_blocked) in zip(self._blocked_lists(), other._blocked_lists()):
            for dst, src in zip(mine, theirs):
                source = other._read(src, slice(0, 1), n, their_blocked)
                self._write(dst, slice(None), n, np.broadcast_to(source, (self.batch_size, *source.shape[1:])), blocked)
        self.set_num_tokens(n)

    def deep_copy(self) -> "KVCache":
        """An independent cache with the same contents (a new cache_id)."""
        self._check_valid()
        copy = KVCache.allocate(self.num_layers, self.batch_size, self.num_kv_heads, self.head_dim,
                                self.num_entries, self.layout, self.dtype, self.row_scales, self.huge_pages)
        for mine, theirs in zip(copy._buffer_lists(), self._buffer_lists()):
            for dst, src in zip(mine, theirs):
                np.copyto(dst, src)
        copy.set_num_tokens(self.num_tokens)
        return copy

    def clone_handle(self) -> "KVCache":
        """A second reference to the same storage (same cache_id): no copy."""
        self._check_valid()
        return KVCache(self._s)

    # ---- serialization ----------------------------------------------------------------------------
    def serialize(self) -> bytes:
        """Flatbuffer (litekv/schema/kv_cache.fbs) of the valid tokens in canonical layout, checksummed."""
        self._check_valid()
        n = self.num_tokens
        self._check_serializable(n)
        header = dict(version=FORMAT_VERSION if self.row_scales else 1, layout=SERIALIZED_LAYOUT, dtype=str(self.dtype),
                      num_layers=self.num_layers,
                      batch_size=self.batch_size, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                      num_tokens=n, capacity=self.num_entries)
        raw_keys = self._valid_bytes(self._s.keys, blocked=self.key_blocks)
        raw_values = self._valid_bytes(self._s.values)
        scales = {}
        if self.row_scales:
            scales = dict(row_scales=1, key_scales=self._valid_bytes(self._s.key_scales),
                          value_scales=self._valid_bytes(self._s.value_scales))
        checksum = _checksum(header, raw_keys, raw_values, scales.get("key_scales"), scales.get("value_scales"))
        return build(SCHEMA, {**header, "keys": raw_keys, "values": raw_values, "checksum": checksum, **scales},
                     IDENTIFIER)

    def _check_serializable(self, n: int) -> None:
        """Refuse, before copying anything, a cache whose n tokens do not fit the flatbuffer format."""
        per_token = serialized_bytes_per_token(self.num_layers, self.batch_size, self.num_kv_heads, self.head_dim,
                                               self.dtype, self.row_scales)
        limit = max_table_bytes() - TABLE_OVERHEAD
        if n * per_token > limit:
            raise KVCacheError(
                f"cannot serialize the KV cache: its {n} tokens take {n * per_token / 2**30:.2f} GiB, over the "
                f"{max_table_bytes() / 2**30:g} GiB limit of litekv's serialized cache format (only the live tokens "
                f"are written, at most {limit // per_token} of this cache fit). Save a shorter context (e.g. rewind "
                f"the session) or a smaller batch.")

    def _valid_bytes(self, buffers: list[np.ndarray], blocked: bool = False) -> np.ndarray:
        """Every layer's valid tokens of one kind of buffer, canonical order, as contiguous bytes."""
        n = self.num_tokens
        if not n:
            return np.zeros(0, np.uint8)
        stacked = np.stack([self._read(b, slice(None), n, blocked) for b in buffers])
        return np.ascontiguousarray(stacked).view(np.uint8).reshape(-1)

    def load(self, data: bytes) -> None:
        """Restore a serialized cache. Everything is checked first: on error this cache is unchanged."""
        self._check_valid()
        if not _bytes_like(data):
            raise KVCacheError(f"load takes the bytes that KVCache.serialize() returned, got {type(data).__name__}; "
                               "read a saved cache with open(path, 'rb').read().")
        try:
            fields = parse(SCHEMA, data, IDENTIFIER)
        except FlatTableError as e:
            raise KVCacheError(f"not a serialized litekv KV cache: {e}.") from e
        version = fields["version"]
        if version not in READABLE_FORMAT_VERSIONS:  # only a newer version asks for a newer litekv
            newer = version is not None and version > FORMAT_VERSION
            raise KVCacheError(f"serialized KV cache has format version {version}; this litekv reads versions "
                               f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}: "
                               + ("upgrade litekv." if newer else "the data is damaged or was not written by "
                                  "KVCache.serialize(); save the cache again with litekv."))
        header = {k: fields[k] for k, _ in SCHEMA if k not in _DATA}
        if None in header.values() or fields["keys"] is None or fields["values"] is None:
            raise KVCacheError("serialized KV cache is missing fields.")
        row_scales = bool(fields["row_scales"])
        if row_scales and (fields["key_scales"] is None or fields["value_scales"] is None):
            raise KVCacheError("serialized KV cache is missing its row scales.")
        if _checksum(header, fields["keys"], fields["values"], fields["key_scales"] if row_scales else None,
                     fields["value_scales"] if row_scales else None) != fields["checksum"]:
            raise KVCacheError("serialized KV cache failed its checksum: the data is corrupted.")
        if header["layout"] != SERIALIZED_LAYOUT:
            raise KVCacheError(f"serialized KV cache says its data is in {header['layout']!r} order; litekv writes "
                               f"and reads {SERIALIZED_LAYOUT!r} ([layer, batch, token, kv_head, dim]) only, so this "
                               "file was not written by KVCache.serialize(): save the cache again with litekv.")
        expected = dict(num_layers=self.num_layers, batch_size=self.batch_size, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype=str(self.dtype), row_scales=self.row_scales)
        saved = {**header, "row_scales": row_scales}
        mismatched = {k: (saved[k], v) for k, v in expected.items() if saved[k] != v}
        if mismatched:
            hint = (" The bundles' KV cache formats differ: load it into one converted with the same --kv-cache."
                    if "dtype" in mismatched or "row_scales" in mismatched else "")
            raise KVCacheMismatch(f"serialized KV cache does not fit this cache (saved, here): {mismatched}.{hint}")
        n = header["num_tokens"]
        if n > self.num_entries:
            raise KVCacheMismatch(f"serialized KV cache holds {n} tokens; this cache has room for {self.num_entries}.")
        shape = (self.num_layers, self.batch_size, n, self.num_kv_heads, self.head_dim)
        size = int(np.prod(shape)) * self.dtype.itemsize
        if fields["keys"].size != size or fields["values"].size != size:
            raise KVCacheError("serialized KV cache has data of the wrong size.")
        if row_scales and any(fields[k].size != int(np.prod(shape[:-1])) * 4 for k in ("key_scales", "value_scales")):
            raise KVCacheError("serialized KV cache has row scales of the wrong size.")
        arrays = [fields["keys"].view(self.dtype).reshape(shape), fields["values"].view(self.dtype).reshape(shape)]
        if row_scales:
            arrays += [fields[k].view(np.float32).reshape(shape[:-1]) for k in ("key_scales", "value_scales")]
        _check_numbers(arrays, row_scales)
        for (buffers, blocked), saved in zip(self._blocked_lists(), arrays):
            for layer in range(self.num_layers):
                self._write(buffers[layer], slice(None), n, saved[layer], blocked)
        self.set_num_tokens(n)

    def __repr__(self) -> str:
        if self._s.released:
            return f"KVCache(id={self.cache_id}, released)"
        return (f"KVCache(id={self.cache_id}, layers={self.num_layers}, batch={self.batch_size}, "
                f"tokens={self.num_tokens}/{self.num_entries}, layout={self.layout})")


def _check_numbers(arrays: list[np.ndarray], row_scales: bool) -> None:
    """A checksum only proves the bytes are the ones written: a crafted file can carry NaN or
    infinite entries, which would turn every later attention output, and so every token, into NaN
    (and a negative row scale flips its row's sign).
    arrays: keys, values [layer, ...], then the key and value row scales if row_scales."""
    names = ["keys", "values"] + (["key row scales", "value row scales"] if row_scales else [])
    for name, array in zip(names, arrays):
        scales = name.endswith("scales")
        if array.dtype.kind != "f":
            continue  # int8 codes: any value is a number
        for layer, values in enumerate(array):  # a layer's temporary at a time (float16 min/max are 8x slower)
            if np.isfinite(values).all() and not (scales and values.size and values.min() < 0):
                continue
            what = "negative, NaN or infinite" if scales else "NaN or infinite"
            raise KVCacheError(f"serialized KV cache holds {what} {name} (layer {layer}); loaded, they would make "
                               "every later output NaN. The file is damaged or crafted, or was saved from a model "
                               "whose activations overflowed: save a healthy cache again with litekv.")


def key_block_view(blocks: np.ndarray) -> np.ndarray:
    """Keys stored in blocks, [..., S, H, D] as the buffer's shape says, as a writable view in row
    order [..., S / 8, 8, H, D / 2, 2]: for each block of KEY_BLOCK_SLOTS slots and head, the buffer
    holds each dimension pair's codes of the block's slots side by side."""
    *lead, slots, heads, dim = blocks.shape
    n = len(lead)
    grouped = blocks.reshape(*lead, slots // KEY_BLOCK_SLOTS, heads, dim // 2, KEY_BLOCK_SLOTS, 2)
    return grouped.transpose(*range(n), n, n + 3, n + 1, n + 2, n + 4)


def block_keys(rows: np.ndarray) -> np.ndarray:
    """int8 keys as rows, [..., S, H, D], in block order (key_block_view), in an array of the same
    shape. A [S, KVH*D] cache is passed as [S, KVH, D]; a head-major [KVH, S, D] one as
    [KVH, S, 1, D] (each KV head's blocks contiguous). S: a multiple of KEY_BLOCK_SLOTS, D even."""
    blocks = np.empty_like(rows)
    view = key_block_view(blocks)
    view[...] = rows.reshape(view.shape)
    return blocks


def unblock_keys(blocks: np.ndarray) -> np.ndarray:
    """block_keys' inverse: keys in block order, in the shape block_keys returned, as rows."""
    return np.ascontiguousarray(key_block_view(blocks)).reshape(blocks.shape)


def serialized_bytes_per_token(num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, dtype,
                               row_scales: bool) -> int:
    """Bytes one token adds to `KVCache.serialize`: keys and values of every layer and row, plus their
    float32 row scales when the cache has them."""
    per_head = 2 * head_dim * np.dtype(dtype).itemsize + (2 * 4 if row_scales else 0)
    return num_layers * batch_size * num_kv_heads * per_head


def _bytes_like(data: object) -> bool:
    try:
        memoryview(data)
    except TypeError:
        return False
    return True


def _row_scale_buffer(batch_size: int, num_kv_heads: int, capacity: int) -> np.ndarray:
    """Zeros [batch, kv_head, slot] float32 whose batch rows each start 64-byte aligned (LiteRT binds
    one row at a time): rows padded to 16 floats."""
    width = num_kv_heads * capacity
    padded = -(-width // 16) * 16
    return aligned_zeros((batch_size, padded))[:, :width].reshape(batch_size, num_kv_heads, capacity)


def _checksum(header: dict[str, Any], *data: np.ndarray | None) -> int:
    """CRC-32 of the header fields and data (None: absent, as row scales are without them):
    detects damage at several GB/s (not tampering)."""
    crc = zlib.crc32(repr(sorted(header.items())).encode())
    for array in data:
        if array is not None:
            crc = zlib.crc32(memoryview(np.ascontiguousarray(array)), crc)
    return crc
