"""litekv's attention kernels (litekv/kernels/) as LiteRT custom ops: one query token against the
cache for decode steps (decode_attention.c), a chunk of tokens for prefill (prefill_attention.c).

The kernels are compiled when litekv is installed (a C compiler is needed) into the shared library
`litekv._decode_attention`, loaded here with ctypes. Bundles whose entry points use them say so in
their manifest (`decode_attention` / `prefill_attention: "kernel"`); without the library they
cannot run, and `--decode-attention graph --prefill-attention graph` converts a bundle that needs
nothing beyond LiteRT's builtin ops. Bundles with an int8 or a float16 KV cache use the ops' `_int8`
or `_f16` forms, and an int8 cache with a scale per row their `_int8_rows` forms, which take the
keys' and values' scales as two more inputs. The same library has one-token linears over int4 and
int8 weights and the rotary embedding (`--decode-linears kernel`), sharing the attention's threads.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from dataclasses import astuple, dataclass

import numpy as np

from litekv.errors import ConfigError, MissingDependency
from litekv.kv_cache import KEY_BLOCK_SLOTS as KEY_BLOCK  # noqa: F401 (with the helpers: the kernels' layout)
from litekv.kv_cache import block_keys, unblock_keys  # noqa: F401

OP_NAME = "litekv.decode_attention"
OP_NAME_INT8 = "litekv.decode_attention_int8"  # int8 keys and values: the codes of a statically scaled cache
OP_NAME_F16 = "litekv.decode_attention_f16"  # float16 keys and values
PREFILL_OP_NAME = "litekv.prefill_attention"
PREFILL_OP_NAME_INT8 = "litekv.prefill_attention_int8"
PREFILL_OP_NAME_F16 = "litekv.prefill_attention_f16"
# int8 codes with a float32 scale per slot and KV head, for keys and values ([KVH, S] each)
OP_NAME_INT8_ROWS = "litekv.decode_attention_int8_rows"
PREFILL_OP_NAME_INT8_ROWS = "litekv.prefill_attention_int8_rows"
# int8 keys in blocks of KEY_BLOCK slots (attention_common.h): the decode kernel scores a block's
# slots in one vector without a reduction tree. Or'ed into the cache type at the host-array entries.
CACHE_KEY_BLOCKS = 0x100
# int8 codes of a statically scaled cache whose keys are in blocks of slots (KEY_BLOCK), which the
# ops write themselves: two more inputs, the tokens' new key codes [1, T, KVH*D] and their first slot
OP_NAME_INT8_BLOCKS = "litekv.decode_attention_int8_blocks"
PREFILL_OP_NAME_INT8_BLOCKS = "litekv.prefill_attention_int8_blocks"
# The cache formats the kernels read, in the order of attention_common.h's CacheType, and the
# element types of the first three (the fourth holds int8 codes too).
KV_FORMATS = ("float32", "int8", "float16", "int8_rows")
CACHE_DTYPES = (np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.float16))
ROW_SCALES = KV_FORMATS.index("int8_rows")
# op name -> (CacheType, prefill)
_FORMS = {OP_NAME: (0, False), OP_NAME_INT8: (1, False), OP_NAME_F16: (2, False), OP_NAME_INT8_ROWS: (3, False),
          PREFILL_OP_NAME: (0, True), PREFILL_OP_NAME_INT8: (1, True), PREFILL_OP_NAME_F16: (2, True),
          PREFILL_OP_NAME_INT8_ROWS: (3, True), OP_NAME_INT8_BLOCKS: (1 | CACHE_KEY_BLOCKS, False),
          PREFILL_OP_NAME_INT8_BLOCKS: (1 | CACHE_KEY_BLOCKS, True)}
# One-token linears over quantized weights (kernels/linear.c), taking their rows with the same helper
# thread, so a decode step's parallel work never waits for XNNPACK's worker: op name -> LinearFormat
LINEAR_OP_NAMES = {"litekv.linear_int4": 0, "litekv.linear_int8": 1,  # linear.h's LINEAR_INT4, LINEAR_INT8,
                   "litekv.linear_f32": 3}  # LINEAR_F32: an fp32 LM head's one row
# An fp32 head whose rows an int8 screen picks (kernels/screened_head.c): x, W, the screen's codes, row
# scales and bounds, and bundle.HEAD_KEEP_INPUT
SCREENED_HEAD_OP_NAME = "litekv.linear_f32_screened"
# A decode step's rotary embedding beside them: in XNNPACK its matmul would wake XNNPACK's worker.
ROPE_OP_NAME = "litekv.rope"
# A one-token step's attention with its RoPE, query scale and row writes (kernels/decode_attention.c), over
# a float cache or an int8 one with static scales: op name -> CacheType (float32, int8, float16)
ROPE_ATTENTION_OP_NAMES = {"litekv.decode_attention_rope": 0, "litekv.decode_attention_rope_int8": 1,
                           "litekv.decode_attention_rope_f16": 2}
OP_VERSION = 1
_MODULE = "litekv._decode_attention"
# Caps the instruction sets the kernels use (kernels/cpu_isa.c reads it once, as the library loads), as
# oneDNN's ONEDNN_MAX_CPU_ISA: "avx512" (or unset) what the CPU has, "avx2" as on a CPU without
# AVX-512, "baseline" the portable code only. For tests and comparisons of the paths on one machine.
MAX_ISA_ENV = "LITEKV_MAX_ISA"
MAX_ISA_VALUES = ("avx512", "avx2", "baseline")


def max_isa() -> str:
    """The cap LITEKV_MAX_ISA puts on the kernels' instruction sets: one of MAX_ISA_VALUES ("avx512",
    no cap, when unset or empty). Raises ConfigError for any other value."""
    value = os.environ.get(MAX_ISA_ENV, "").strip().lower()
    if not value:
        return "avx512"
    if value not in MAX_ISA_VALUES:
        raise ConfigError(f"{MAX_ISA_ENV}={os.environ[MAX_ISA_ENV]!r} is not an instruction set cap; use one of "
                          f"{', '.join(MAX_ISA_VALUES)} (or leave it unset).")
    return value


def linear_op_name(weights: str) -> str:
    """The custom op a graph calls for a one-token linear over "int4" or "int8" weights."""
    return f"litekv.linear_{weights}"


def rope_op_name(kv_format: str) -> str:
    """The rope form a one-token step calls over a cache of `kv_format` ("float32", "float16" or "int8",
    static scales)."""
    return next(name for name, form in ROPE_ATTENTION_OP_NAMES.items() if form == KV_FORMATS.index(kv_format))


def op_name(kv_format: str, prefill: bool, key_blocks: bool = False) -> str:
    """The custom op a graph calls for a cache of `kv_format` (one of KV_FORMATS), its int8 keys in
    blocks or not."""
    form = KV_FORMATS.index(kv_format) | (CACHE_KEY_BLOCKS if key_blocks else 0)
    return next(name for name, f in _FORMS.items() if f == (form, prefill))


class AttentionConfig(ctypes.Structure):
    """The kernel's user data (decode_attention.c: AttentionConfig)."""

    _fields_ = [("host_memory", ctypes.c_void_p), ("buffer_size", ctypes.c_void_p),
                ("head_dim", ctypes.c_int32), ("threads", ctypes.c_int32), ("max_slots", ctypes.c_int32),
                ("num_heads", ctypes.c_int32), ("int8_dot", ctypes.c_int32), ("state", ctypes.c_void_p)]


class CustomOpKernel(ctypes.Structure):
    """LiteRtCustomOpKernel: Init, GetOutputLayouts, Run, Destroy."""

    _fields_ = [("init", ctypes.c_void_p), ("output_layouts", ctypes.c_void_p), ("run", ctypes.c_void_p),
                ("destroy", ctypes.c_void_p)]


_library: ctypes.CDLL | None = None
_library_path: str | None = None
_load_error: str | None = None
_lock = threading.Lock()
_ort_lock = threading.Lock()


def _load() -> ctypes.CDLL:
    global _library, _library_path, _load_error
    with _lock:
        if _library is None and _load_error is None:
            max_isa()  # the library reads LITEKV_MAX_ISA as it loads, and ignores a value it does not know
            spec = importlib.util.find_spec(_MODULE)
            if spec is None or spec.origin is None:
                _load_error = ("litekv's decode-attention kernel is not built in this installation (it needs a C "
                               "compiler at install time): reinstall litekv with gcc or clang available")
            else:
                try:
                    lib = ctypes.CDLL(spec.origin)
                except OSError as e:
                    _load_error = f"cannot load {spec.origin}: {e}; reinstall litekv"
                else:
                    lib.litekv_attention_kernel.argtypes = [ctypes.POINTER(CustomOpKernel), ctypes.c_int,
                                                            ctypes.c_int]
                    lib.litekv_attention_kernel.restype = ctypes.c_int
                    lib.litekv_attention_release.argtypes = [ctypes.POINTER(AttentionConfig)]
                    lib.litekv_attention_release.restype = None
                    lib.litekv_attention_int8_dot.argtypes = []
                    lib.litekv_attention_int8_dot.restype = ctypes.c_int
                    lib.litekv_attention_stats.argtypes = [ctypes.POINTER(AttentionConfig),
                                                           ctypes.POINTER(ctypes.c_uint64 * 11)]
                    lib.litekv_attention_stats.restype = None
                    lib.litekv_attention_run.restype = ctypes.c_int
                    lib.litekv_attention_run.argtypes = [ctypes.POINTER(AttentionConfig), *[ctypes.c_void_p] * 7,
                                                         *[ctypes.c_int] * 4]
                    try:
                        lib.litekv_prefill_attention_run.restype = ctypes.c_int
                        lib.litekv_prefill_attention_run.argtypes = lib.litekv_attention_run.argtypes
                        lib.litekv_linear_kernel.argtypes = [ctypes.POINTER(CustomOpKernel), ctypes.c_int]
                        lib.litekv_linear_kernel.restype = ctypes.c_int
                        lib.litekv_rope_kernel.argtypes = [ctypes.POINTER(CustomOpKernel)]
                        lib.litekv_rope_kernel.restype = ctypes.c_int
                        lib.litekv_attention_rope_kernel.argtypes = [ctypes.POINTER(CustomOpKernel), ctypes.c_int]
                        lib.litekv_attention_rope_kernel.restype = ctypes.c_int
                        lib.litekv_linear_run.restype = ctypes.c_int
                        lib.litekv_linear_run.argtypes = [ctypes.POINTER(AttentionConfig), ctypes.c_int,
                                                          *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 4,
                                                          ctypes.c_void_p]  # no lent threads from Python
                        lib.litekv_screened_head_kernel.argtypes = [ctypes.POINTER(CustomOpKernel)]
                        lib.litekv_screened_head_kernel.restype = ctypes.c_int
                        lib.litekv_screened_head_run.restype = ctypes.c_int
                        lib.litekv_screened_head_run.argtypes = [ctypes.POINTER(AttentionConfig),
                                                                 *[ctypes.c_void_p] * 6, *[ctypes.c_int] * 3,
                                                                 ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
                        lib.litekv_screened_head_stats.argtypes = [ctypes.POINTER(AttentionConfig),
                                                                   ctypes.POINTER(ctypes.c_uint64 * 2)]
                        lib.litekv_screened_head_stats.restype = None
                        lib.litekv_ort_prepare.argtypes = [ctypes.POINTER(AttentionConfig)]
                        lib.litekv_ort_prepare.restype = None
                        lib.litekv_ort_take.argtypes = []
                        lib.litekv_ort_take.restype = ctypes.c_void_p
                        lib.litekv_ort_release.argtypes = [ctypes.c_void_p]
                        lib.litekv_ort_release.restype = None
                    except AttributeError:  # a library built before one of these
                        _load_error = (f"{spec.origin} is out of date (no prefill kernel, linears, ONNX Runtime "
                                       "ops or screened head); reinstall litekv")
                    else:
                        _library, _library_path = lib, spec.origin
    if _library is None:
        raise MissingDependency(_load_error)
    return _library


@dataclass(frozen=True)
class AttentionStats:
    """What one registration of the kernel did since it was made (every layer's call counts)."""

    calls: int
    seconds: float       # wall time inside the calls, as the calling thread saw it
    chunks: int          # pieces the calls were cut into: int8 cache <= 1,024 slots (two above 384), float 192
    helper_chunks: int   # of those, the ones the helper thread computed (0 with one thread)
    helper_joins: int = 0  # calls the helper took a chunk of
    helper_delay_seconds: float = 0.0  # from the caller's offer to the helper's start, summed over those
    pool_chunks: int = 0  # chunks (and linear tasks) a worker of ONNX Runtime's pool computed, not the caller
    shared_calls: int = 0  # calls of several chunks offered to the helper thread
    caller_chunk_seconds: float = 0.0  # the caller's time in its own chunks of those calls
    caller_wait_seconds: float = 0.0   # ... and waiting for the helper's chunks after them
    helper_chunk_seconds: float = 0.0  # the helper's time in its chunks

    def __add__(self, other: AttentionStats) -> AttentionStats:
        return AttentionStats(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __sub__(self, other: AttentionStats) -> AttentionStats:
        """The counts between two readings: `after - before`."""
        return AttentionStats(*(a - b for a, b in zip(astuple(self), astuple(other))))

    @property
    def microseconds_per_call(self) -> float:
        return 1e6 * self.seconds / self.calls if self.calls else 0.0

    @property
    def helper_start_microseconds(self) -> float:
        """How late the helper thread joins a call, on average: what the other core was busy with
        first (beside XNNPACK's pool, its worker's spin after its last task)."""
        return 1e6 * self.helper_delay_seconds / self.helper_joins if self.helper_joins else 0.0

    @property
    def caller_microseconds_per_shared_call(self) -> float:
        """The caller's time in its own chunks of a call it shared with the helper."""
        return 1e6 * self.caller_chunk_seconds / self.shared_calls if self.shared_calls else 0.0

    @property
    def helper_microseconds_per_join(self) -> float:
        """The helper's time in its chunks of a call it joined."""
        return 1e6 * self.helper_chunk_seconds / self.helper_joins if self.helper_joins else 0.0

    @property
    def wait_microseconds_per_shared_call(self) -> float:
        """How long the caller waits for the helper's chunks after finishing its own: what an uneven
        split of a call between the two threads costs it."""
        return 1e6 * self.caller_wait_seconds / self.shared_calls if self.shared_calls else 0.0

    @property
    def helper_share(self) -> float:
        """The helper thread's share of the chunks: 0.5 when two threads split the work evenly."""
        return self.helper_chunks / self.chunks if self.chunks else 0.0


def _host_arrays(query, keys, values, mask, num_kv_heads, key_scales=None, value_scales=None) -> tuple:
    """Contiguous float32 query and mask, keys and values of one of CACHE_DTYPES (others are read
    as float32), the row scales as float32 or None (checked to hold num_kv_heads x the mask's last
    axis); and the kernel's code for that format."""
    kv_dtype = np.asarray(keys).dtype
    if kv_dtype != np.asarray(values).dtype:
        raise ValueError(f"keys and values must have one dtype, not {kv_dtype} and {np.asarray(values).dtype}")
    if (key_scales is None) != (value_scales is None):
        raise ValueError("give the keys' and the values' row scales together, or neither")
    if key_scales is not None and kv_dtype != np.int8:
        raise ValueError(f"row scales go with int8 codes, not {kv_dtype} keys and values")
    kv_dtype = kv_dtype if kv_dtype in CACHE_DTYPES else np.dtype(np.float32)
    query, mask = (np.ascontiguousarray(a, np.float32) for a in (query, mask))
    keys, values = (np.ascontiguousarray(a, kv_dtype) for a in (keys, values))
    if key_scales is None:
        return query, keys, values, mask, None, None, CACHE_DTYPES.index(kv_dtype)
    key_scales, value_scales = (np.ascontiguousarray(a, np.float32) for a in (key_scales, value_scales))
    slots = mask.shape[-1]
    if key_scales.size != num_kv_heads * slots or value_scales.size != key_scales.size:
        raise ValueError(f"row scales of {key_scales.size} and {value_scales.size} elements do not fit "
                         f"{num_kv_heads} KV heads x {slots} slots")
    return query, keys, values, mask, key_scales, value_scales, ROW_SCALES


def _pointer(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def available() -> bool:
    """Whether the kernel library is built and loads."""
    try:
        _load()
    except MissingDependency:
        return False
    return True


def int8_dot_available() -> bool:
    """Whether int8 caches are multiplied as integers here (AVX-512 VNNI, or AVX2's vpmaddwd); else
    their codes are widened to floats, about twice as slow."""
    return bool(_load().litekv_attention_int8_dot())


_LINEAR_PATHS = {0: "portable", 1: "avx512-vnni", 2: "avx2"}


def cpu_paths() -> dict[str, str]:
    """Which code each kernel family runs on this CPU: "avx512-vnni", "avx2", "portable" or, for
    attention, "vector" (GCC vector extensions compiled per ISA: AVX-512 where the CPU has it;
    decode attention's "avx512-vnni" is that too, with int8 caches multiplied as integers).
    Speed differs by several times between them, so benchmarks and bug reports should name them.
    LITEKV_MAX_ISA (`max_isa`) caps them: "avx2" as on a CPU without AVX-512, "baseline" the
    portable linears and the attention's "vector" code."""
    lib = _load()
    if lib.litekv_attention_int8_dot() == 2:
        decode = "avx512-vnni"
    elif hasattr(lib, "litekv_decode_avx2") and lib.litekv_decode_avx2():
        decode = "avx2"
    else:
        decode = "vector"
    prefill = "avx2" if hasattr(lib, "litekv_prefill_avx2") and lib.litekv_prefill_avx2(-1) else "vector"
    linears = _LINEAR_PATHS.get(lib.linear_cpu_vector(), "portable") if hasattr(lib, "linear_cpu_vector") else "portable"
    return {"linears": linears, "decode_attention": decode, "prefill_attention": prefill}


class AttentionKernel:
    """One registration of the kernel for one compiled model: its config, scratch and helper thread.

    `litert` (the loaded LiteRT C API) is needed to register it as a custom op; without it the
    kernel only runs on host arrays (`run`). `release()` must come after the compiled model is
    destroyed: it stops the helper thread and frees the scratch the model's runs use.
    """

    def __init__(self, head_dim: int, num_heads: int, max_slots: int, threads: int, litert: ctypes.CDLL | None = None,
                 int8_dot: bool = True):
        lib = _load()
        self._lib = lib
        self._onnx_registrations: list[int] = []  # litekv_ort_take()'s, freed by release()
        # One config (scratch, helper thread) serves every op: a model uses the pair for its cache type.
        self.kernels = {name: CustomOpKernel()
                        for name in (*_FORMS, *LINEAR_OP_NAMES, ROPE_OP_NAME, *ROPE_ATTENTION_OP_NAMES,
                                     SCREENED_HEAD_OP_NAME)}
        for name, kernel in self.kernels.items():
            if name == ROPE_OP_NAME:
                status = lib.litekv_rope_kernel(ctypes.byref(kernel))
            elif name == SCREENED_HEAD_OP_NAME:
                status = lib.litekv_screened_head_kernel(ctypes.byref(kernel))
            elif name in ROPE_ATTENTION_OP_NAMES:
                status = lib.litekv_attention_rope_kernel(ctypes.byref(kernel), ROPE_ATTENTION_OP_NAMES[name])
            elif name in LINEAR_OP_NAMES:
                status = lib.litekv_linear_kernel(ctypes.byref(kernel), LINEAR_OP_NAMES[name])
            else:
                status = lib.litekv_attention_kernel(ctypes.byref(kernel), *map(int, _FORMS[name]))
            if status != 0:
                raise MissingDependency(f"the attention library has no {name} form; reinstall litekv")
        entry = (lambda name: ctypes.cast(getattr(litert, name), ctypes.c_void_p)) if litert else (lambda name: None)
        self.config = AttentionConfig(
            host_memory=entry("LiteRtGetTensorBufferHostMemory"), buffer_size=entry("LiteRtGetTensorBufferSize"),
            head_dim=head_dim, threads=max(1, min(2, threads)), max_slots=max_slots, num_heads=num_heads,
            int8_dot=int(int8_dot))

    def register(self, litert: ctypes.CDLL, options: int) -> int:
        """LiteRtAddCustomOpKernelOption on `options` for every op; returns the first failing LiteRtStatus, or 0."""
        for name, kernel in self.kernels.items():
            status = litert.LiteRtAddCustomOpKernelOption(options, name.encode(), OP_VERSION, ctypes.byref(kernel),
                                                          ctypes.byref(self.config))
            if status != 0:
                return status
        return 0

    def run(self, query: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray, num_kv_heads: int,
            key_scales: np.ndarray | None = None, value_scales: np.ndarray | None = None,
            key_blocks: bool = False) -> np.ndarray:
        """The op on host arrays: query [H*D], keys/values [S, KVH*D] (float32, int8 codes for the
        int8 forms, or float16), mask [S] float32 -> [H*D]. With int8 codes, `key_scales` and
        `value_scales` [KVH, S] give each row's scale (the `_int8_rows` form), and `key_blocks` says
        the keys' bytes are in blocks of KEY_BLOCK slots (`block_keys`)."""
        query, keys, values, mask, key_scales, value_scales, cache_type = _host_arrays(
            query, keys, values, mask, num_kv_heads, key_scales, value_scales)
        out = np.empty_like(query)
        pointers = (_pointer(a) for a in (query, keys, values, key_scales, value_scales, mask, out))
        status = self._lib.litekv_attention_run(ctypes.byref(self.config), *pointers,
                                                query.size // self.config.head_dim, num_kv_heads, mask.size,
                                                cache_type | (CACHE_KEY_BLOCKS if key_blocks else 0))
        if status != 0:
            raise ValueError(f"decode attention rejected the shapes (status {status})")
        return out

    def run_prefill(self, query: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray,
                    num_kv_heads: int, key_scales: np.ndarray | None = None,
                    value_scales: np.ndarray | None = None, key_blocks: bool = False) -> np.ndarray:
        """The prefill op on host arrays: query [T, H*D], keys/values [S, KVH*D] (float32, int8
        codes or float16), mask [T, S] float32 -> [T, H*D]; row scales [KVH, S] and `key_blocks`
        as for `run`."""
        query, keys, values, mask, key_scales, value_scales, cache_type = _host_arrays(
            query, keys, values, mask, num_kv_heads, key_scales, value_scales)
        if mask.ndim != 2:
            raise ValueError(f"prefill attention rejected the shapes: mask {mask.shape} is not [T, S]")
        tokens, slots = mask.shape
        width = num_kv_heads * self.config.head_dim
        if (keys.shape != (slots, width) or values.shape != (slots, width)
                or query.shape != (tokens, self.config.num_heads * self.config.head_dim)):
            raise ValueError(f"prefill attention rejected the shapes: query {query.shape}, keys {keys.shape}, values "
                             f"{values.shape}, mask {mask.shape} (want [T, H*D], [S, KVH*D] twice, [T, S])")
        out = np.empty_like(query)
        pointers = (_pointer(a) for a in (query, keys, values, key_scales, value_scales, mask, out))
        status = self._lib.litekv_prefill_attention_run(ctypes.byref(self.config), *pointers, tokens, num_kv_heads,
                                                        slots, cache_type | (CACHE_KEY_BLOCKS if key_blocks else 0))
        if status != 0:
            raise ValueError(f"prefill attention rejected the shapes (status {status})")
        return out

    def run_linear(self, x: np.ndarray, codes: np.ndarray, row_scales: np.ndarray,
                   block_scales: np.ndarray | None = None, offsets: np.ndarray | None = None) -> np.ndarray:
        """The linear ops on host arrays: x [tokens, in] float32 -> [tokens, out].

        int8 (`litekv.linear_int8`): codes int8 [out, in], row_scales [out]. int4
        (`litekv.linear_int4`): codes uint8 [out, in/2], two's-complement nibbles with the even
        element low; block_scales float16 [out, blocks]; offsets int8 [out, blocks]; row_scales [out],
        the offsets' scale."""
        x = np.ascontiguousarray(x, np.float32)
        int4 = block_scales is not None
        codes = np.ascontiguousarray(codes, np.uint8 if int4 else np.int8)
        row_scales = np.ascontiguousarray(row_scales, np.float32)
        out = row_scales.size
        tokens, width = x.shape
        if codes.shape != (out, width // 2 if int4 else width) or (int4 and offsets is None):
            raise ValueError(f"linear rejected the shapes: x {x.shape}, codes {codes.shape}, {out} row scales")
        block = 0
        if int4:
            block_scales = np.ascontiguousarray(block_scales, np.float16)
            offsets = np.ascontiguousarray(offsets, np.int8)
            if block_scales.ndim != 2 or block_scales.shape[0] != out or offsets.shape != block_scales.shape:
                raise ValueError(f"linear rejected the shapes: block scales {block_scales.shape}, offsets "
                                 f"{offsets.shape} for {out} rows")
            block = width // block_scales.shape[1]
        y = np.empty((tokens, out), np.float32)
        status = self._lib.litekv_linear_run(ctypes.byref(self.config), LINEAR_OP_NAMES["litekv.linear_int4" if int4
                                                                                        else "litekv.linear_int8"],
                                             *(_pointer(a) for a in (x, y, codes, block_scales, offsets, row_scales)),
                                             tokens, width, out, block, None)
        if status != 0:
            raise ValueError(f"linear rejected the shapes (status {status})")
        return y

    def run_screened_head(self, x: np.ndarray, weight: np.ndarray, codes: np.ndarray, row_scales: np.ndarray,
                          bounds: np.ndarray, keep: int) -> tuple[np.ndarray, int]:
        """The screened head on host arrays: x [in], W [out, in] float32, the screen from
        converters.quantize.head_screen, keep (0: the whole head) -> (y [out], rows computed exactly).
        Rows that cannot rank among the `keep` largest come back as the lowest float32."""
        x, weight, row_scales, bounds = (np.ascontiguousarray(a, np.float32) for a in (x, weight, row_scales, bounds))
        codes = np.ascontiguousarray(codes, np.int8)
        out, width = weight.shape
        if x.shape != (width,) or codes.shape != weight.shape or row_scales.shape != (out,) or bounds.shape != (out,):
            raise ValueError(f"screened head rejected the shapes: x {x.shape}, W {weight.shape}, codes {codes.shape}, "
                             f"row scales {row_scales.shape}, bounds {bounds.shape}")
        y, computed = np.empty(out, np.float32), ctypes.c_int(0)
        status = self._lib.litekv_screened_head_run(ctypes.byref(self.config),
                                                    *(_pointer(a) for a in (x, y, weight, codes, row_scales, bounds)),
                                                    int(keep), width, out, None, ctypes.byref(computed))
        if status != 0:
            raise ValueError(f"screened head rejected its inputs (status {status})")
        return y, computed.value

    def screened_head_counts(self) -> tuple[int, int]:
        """(screened calls, rows they computed exactly) since this registration was made."""
        counters = (ctypes.c_uint64 * 2)()
        self._lib.litekv_screened_head_stats(ctypes.byref(self.config), ctypes.byref(counters))
        return int(counters[0]), int(counters[1])

    def onnx_session(self, model, options, providers=None):
        """An onnxruntime.InferenceSession of `model` (a path or the model's bytes) whose graph may
        call litekv's linears (domain "litekv", ops "LinearInt4" and "LinearInt8"), running on this
        kernel's state and helper thread. The session keeps this kernel alive: the ops' state and
        their registration are freed only after the session, and every IO binding holding it, is gone."""
        import onnxruntime

        with _ort_lock:  # the library takes the config of the registration in progress
            self._lib.litekv_ort_prepare(ctypes.byref(self.config))
            options.register_custom_ops_library(_library_path)
            registration = self._lib.litekv_ort_take()
        if not registration:
            raise MissingDependency("onnxruntime did not register litekv's linear ops; upgrade onnxruntime")
        self._onnx_registrations.append(registration)
        session = onnxruntime.InferenceSession(model, options, providers=providers)
        session.litekv_kernel = self
        return session

    def stats(self) -> AttentionStats:
        """Counters since this registration was made; read them between model calls."""
        counters = (ctypes.c_uint64 * 11)()
        self._lib.litekv_attention_stats(ctypes.byref(self.config), ctypes.byref(counters))
        (calls, nanoseconds, chunks, helper_chunks, joins, delay_nanoseconds, pool_chunks, shared_calls,
         caller_nanoseconds, wait_nanoseconds, helper_nanoseconds) = counters
        return AttentionStats(calls, nanoseconds / 1e9, chunks, helper_chunks, joins, delay_nanoseconds / 1e9,
                              pool_chunks, shared_calls, caller_nanoseconds / 1e9, wait_nanoseconds / 1e9,
                              helper_nanoseconds / 1e9)

    def release(self) -> None:
        self._lib.litekv_attention_release(ctypes.byref(self.config))
        while self._onnx_registrations:
            self._lib.litekv_ort_release(self._onnx_registrations.pop())

    def __del__(self) -> None:
        config = getattr(self, "config", None)  # None: __init__ failed before making it
        if getattr(self, "_lib", None) is not None and config is not None and (config.state or self._onnx_registrations):
            self.release()


def reference(query: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray, num_kv_heads: int,
              head_dim: int, threads: int = 1, int8_dot: bool = True, key_scales: np.ndarray | None = None,
              value_scales: np.ndarray | None = None, key_blocks: bool = False) -> np.ndarray:
    """The kernel's arithmetic on host arrays, without LiteRT (for tests): see AttentionKernel.run."""
    kernel = AttentionKernel(head_dim, np.asarray(query).size // head_dim, np.asarray(mask).size, threads,
                             int8_dot=int8_dot)
    try:
        return kernel.run(query, keys, values, mask, num_kv_heads, key_scales, value_scales, key_blocks)
    finally:
        kernel.release()
