"""LiteRT through its C API (``libLiteRt.so``, via ctypes): zero-copy numpy tensors of
any rank and runs that another thread can cancel.

litekv's runtime needs two things that ``ai_edge_litert.compiled_model.CompiledModel``
cannot do from Python:

* Bind numpy memory zero-copy to inputs of any rank. The KV cache is allocated once at
  maximum capacity as ``[1, S_max, KVH, D]`` arrays and bound in place (the same buffer
  as input and output ``kv``) to signatures of a smaller capacity S through the
  contiguous prefix view ``cache[:, :S]``. The Python wrapper makes every numpy-backed
  buffer rank 1, which CompiledModel refuses for rank-N inputs.
* Stop a running call (``LiteRtSetCompiledModelCancellationFunction``).

The wheel of ai-edge-litert ships ``libLiteRt.so``, which exports the C API; this module
declares the few functions litekv uses and wraps them::

    model = CompiledTFLiteModel("model.tflite", num_threads=2,
                                weight_cache_path="model.xnnpack_cache")
    cache = aligned_zeros((1, 1024, 2, 64), np.float32)      # allocated once
    kv_256 = HostTensorBuffer(cache[:, :256])                 # prefix view, no copy
    pos, logits = HostTensorBuffer(aligned_zeros((1,), np.int32)), ...
    model.run("decode_256", {"kv": kv_256, "pos": pos}, {"kv": kv_256, "logits": logits})

    model.cancel()          # from any thread: the run in progress raises Cancelled

Runtime facts this relies on are in converters/LITERT_NOTES.md and pinned down by
tests/test_litert_capi.py.

LiteRT's own log (stderr) is filtered by ``LITEKV_LITERT_LOG``: ``verbose``, ``info``,
``warning``, ``error`` (the default) or ``silent``, the least severe message shown. Messages
of loading and compiling below it are dropped (errors quote them all the same); model runs
log only below ``error``: a failed run raises with LiteRT's messages, and a cancel is no error.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import tempfile
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from litekv.errors import (
    AcceleratorUnavailable,
    BackendError,
    BindingError,
    Cancelled,
    ConfigError,
    MissingDependency,
)

__all__ = [
    "ALIGNMENT",
    "BoundRun",
    "CompiledTFLiteModel",
    "Environment",
    "HostTensorBuffer",
    "SignatureInfo",
    "TensorSpec",
    "aligned_zeros",
    "default_environment",
]

# LITERT_HOST_MEMORY_BUFFER_ALIGNMENT: host memory must start on this boundary.
ALIGNMENT = 64

# ------------------------------------------------------------------ C declarations

_STATUS_NAMES = {
    0: "kLiteRtStatusOk",
    1: "kLiteRtStatusErrorInvalidArgument",
    2: "kLiteRtStatusErrorMemoryAllocationFailure",
    3: "kLiteRtStatusErrorRuntimeFailure",
    4: "kLiteRtStatusErrorMissingInputTensor",
    5: "kLiteRtStatusErrorUnsupported",
    6: "kLiteRtStatusErrorNotFound",
    7: "kLiteRtStatusErrorTimeoutExpired",
    8: "kLiteRtStatusErrorWrongVersion",
    9: "kLiteRtStatusErrorUnknown",
    10: "kLiteRtStatusErrorAlreadyExists",
    100: "kLiteRtStatusCancelled",
    500: "kLiteRtStatusErrorFileIO",
    501: "kLiteRtStatusErrorInvalidFlatbuffer",
    502: "kLiteRtStatusErrorDynamicLoading",
    503: "kLiteRtStatusErrorSerialization",
    504: "kLiteRtStatusErrorCompilation",
}

# LiteRtHwAccelerators bits.
_ACCELERATORS = {"cpu": 1 << 0, "gpu": 1 << 1, "npu": 1 << 2}

# LiteRtElementType (= TfLiteType) codes of the dtypes numpy has.
_ELEMENT_TYPES = {
    1: np.dtype(np.float32),
    2: np.dtype(np.int32),
    3: np.dtype(np.uint8),
    4: np.dtype(np.int64),
    6: np.dtype(np.bool_),
    7: np.dtype(np.int16),
    9: np.dtype(np.int8),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    13: np.dtype(np.uint64),
    16: np.dtype(np.uint32),
    17: np.dtype(np.uint16),
}
_ELEMENT_TYPE_OF = {dtype: code for code, dtype in _ELEMENT_TYPES.items()}

_MAX_RANK = 8  # LITERT_TENSOR_MAX_RANK


class _Layout(ctypes.Structure):
    # LiteRtLayout (litert_layout.h): 68 bytes, dimensions at offset 4.
    _fields_ = [
        ("rank", ctypes.c_uint, 7),
        ("has_strides", ctypes.c_uint, 1),
        ("dimensions", ctypes.c_int32 * _MAX_RANK),
        ("strides", ctypes.c_uint32 * _MAX_RANK),
    ]


class _RankedTensorType(ctypes.Structure):
    # LiteRtRankedTensorType (litert_model_types.h): 72 bytes, ABI-stable.
    _fields_ = [("element_type", ctypes.c_int), ("layout", _Layout)]


assert ctypes.sizeof(_RankedTensorType) == 72


class _Any(ctypes.Structure):
    # LiteRtAny (litert_any.h) holding an int: the type, then the 8-byte union.
    _fields_ = [("type", ctypes.c_int), ("int_value", ctypes.c_int64)]


class _EnvOption(ctypes.Structure):
    # LiteRtEnvOption (litert_environment_options.h): 24 bytes, ABI-stable.
    _fields_ = [("tag", ctypes.c_int), ("value", _Any)]


assert ctypes.sizeof(_EnvOption) == 24
_ANY_INT = 2  # kLiteRtAnyTypeInt
_ENV_AUTO_REGISTER_ACCELERATORS = 24  # kLiteRtEnvOptionTagAutoRegisterAccelerators (a LiteRtHwAccelerators mask)
_ENV_MIN_LOGGER_SEVERITY = 25  # kLiteRtEnvOptionTagMinLoggerSeverity
# LiteRtLogSeverity (litert_logging.h), and the names LiteRT's log lines start with.
LOG_LEVELS = {"verbose": 0, "info": 1, "warning": 2, "error": 3, "silent": 4}
LOG_ENV = "LITEKV_LITERT_LOG"

_P = ctypes.c_void_p  # every LiteRt handle is an opaque pointer
_PP = ctypes.POINTER(ctypes.c_void_p)
_SIZE = ctypes.c_size_t
_PSIZE = ctypes.POINTER(ctypes.c_size_t)
_PSTR = ctypes.POINTER(ctypes.c_char_p)
_ST = ctypes.c_int  # LiteRtStatus

# name: (restype, argtypes), from the LiteRT C headers (litert/c/*.h).
_PROTOTYPES = {
    "LiteRtCreateEnvironment": (_ST, [ctypes.c_int, ctypes.POINTER(_EnvOption), _PP]),
    "LiteRtDestroyEnvironment": (None, [_P]),
    # litert/c/internal/litert_accelerator.h, used to explain a missing accelerator.
    "LiteRtGetNumAccelerators": (_ST, [_P, _PSIZE]),
    "LiteRtGetAccelerator": (_ST, [_P, _SIZE, _PP]),
    "LiteRtGetAcceleratorName": (_ST, [_P, _PSTR]),
    "LiteRtGetAcceleratorHardwareSupport": (_ST, [_P, ctypes.POINTER(ctypes.c_int)]),
    "LiteRtCreateModelFromFile": (_ST, [_P, ctypes.c_char_p, _PP]),
    "LiteRtDestroyModel": (None, [_P]),
    "LiteRtGetNumModelSignatures": (_ST, [_P, _PSIZE]),
    "LiteRtGetModelSignature": (_ST, [_P, _SIZE, _PP]),
    "LiteRtGetSignatureKey": (_ST, [_P, _PSTR]),
    "LiteRtGetNumSignatureInputs": (_ST, [_P, _PSIZE]),
    "LiteRtGetNumSignatureOutputs": (_ST, [_P, _PSIZE]),
    "LiteRtGetSignatureInputName": (_ST, [_P, _SIZE, _PSTR]),
    "LiteRtGetSignatureOutputName": (_ST, [_P, _SIZE, _PSTR]),
    "LiteRtGetSignatureInputTensorByIndex": (_ST, [_P, _SIZE, _PP]),
    "LiteRtGetSignatureOutputTensorByIndex": (_ST, [_P, _SIZE, _PP]),
    "LiteRtGetTensorTypeId": (_ST, [_P, ctypes.POINTER(ctypes.c_int)]),
    "LiteRtGetRankedTensorType": (_ST, [_P, ctypes.POINTER(_RankedTensorType)]),
    "LiteRtCreateOptions": (_ST, [_PP]),
    "LiteRtDestroyOptions": (None, [_P]),
    "LiteRtSetOptionsHardwareAccelerators": (_ST, [_P, ctypes.c_int]),
    "LiteRtCreateOpaqueOptions": (_ST, [ctypes.c_char_p, _P, _P, _PP]),
    "LiteRtDestroyOpaqueOptions": (None, [_P]),
    "LiteRtAddOpaqueOptions": (_ST, [_P, _P]),
    "LiteRtCreateCompiledModel": (_ST, [_P, _P, _P, _PP]),
    "LiteRtDestroyCompiledModel": (None, [_P]),
    "LiteRtCompiledModelIsFullyAccelerated": (_ST, [_P, ctypes.POINTER(ctypes.c_bool)]),
    "LiteRtSetCompiledModelCancellationFunction": (_ST, [_P, _P, _P]),
    "LiteRtCompiledModelGetErrorMessages": (_ST, [_P, _PP]),
    "LiteRtCompiledModelClearErrors": (_ST, [_P]),
    "LiteRtCreateTensorBufferFromHostMemory": (
        _ST, [ctypes.POINTER(_RankedTensorType), _P, _SIZE, _P, _PP]),
    "LiteRtDestroyTensorBuffer": (None, [_P]),
    "LiteRtRunCompiledModel": (_ST, [_P, _SIZE, _SIZE, _PP, _SIZE, _PP]),
    # litert/c/litert_options.h and litert_tensor_buffer.h, for custom op kernels
    "LiteRtAddCustomOpKernelOption": (_ST, [_P, ctypes.c_char_p, ctypes.c_int, _P, _P]),
    "LiteRtGetTensorBufferHostMemory": (_ST, [_P, _PP]),
    "LiteRtGetTensorBufferSize": (_ST, [_P, _PSIZE]),
}

_lib: ctypes.CDLL | None = None
_run_unchecked = None  # LiteRtRunCompiledModel without argtypes, set by _load()
_libc: ctypes.CDLL | None = None
_load_lock = threading.Lock()


def _library_path() -> str:
    # find_spec locates the package without importing it: ai_edge_litert/__init__ loads
    # the library itself and imports vendor SDKs, none of which litekv needs.
    try:
        spec = importlib.util.find_spec("ai_edge_litert")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            "running .tflite models needs LiteRT: pip install ai-edge-litert")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, "libLiteRt.so")
        if os.path.isfile(path):
            return path
    raise MissingDependency(
        f"ai_edge_litert is installed at {list(spec.submodule_search_locations)} but has no "
        "libLiteRt.so (the LiteRT C API); install a Linux wheel: pip install -U ai-edge-litert")


def _load() -> ctypes.CDLL:
    """The LiteRT C API with argtypes/restype declared (loaded once)."""
    global _lib, _libc, _run_unchecked
    if _lib is not None:
        return _lib
    with _load_lock:
        if _lib is None:
            path = _library_path()
            try:
                # RTLD_GLOBAL as ai_edge_litert does: accelerator plugins that LiteRT
                # dlopens (GPU, NPU) resolve LiteRt* symbols from this library.
                lib = ctypes.CDLL(path, mode=os.RTLD_LAZY | ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise MissingDependency(
                    f"cannot load {path}: {e}; reinstall ai-edge-litert") from e
            missing = [name for name in _PROTOTYPES if not hasattr(lib, name)]
            if missing:
                raise MissingDependency(
                    f"{path} lacks {', '.join(missing)}; litekv needs ai-edge-litert>=2.3")
            for name, (restype, argtypes) in _PROTOTYPES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            # The hot call without argtypes: _Binding holds ready ctypes objects, which
            # saves ~0.6 us per call of per-argument conversion.
            _run_unchecked = lib["LiteRtRunCompiledModel"]  # a separate function object
            _run_unchecked.restype = ctypes.c_int
            libc = ctypes.CDLL(None)
            libc.strdup.restype, libc.strdup.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
            libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
            _libc, _lib = libc, lib
    return _lib


def library() -> ctypes.CDLL:
    """The loaded LiteRT C API, for code that hands its entry points on (custom op kernels)."""
    return _load()


def _status_text(status: int) -> str:
    return f"{_STATUS_NAMES.get(status, 'unknown LiteRtStatus')} ({status})"


def _check(status: int, what: str, detail: str = "") -> None:
    if status != 0:
        raise BackendError(f"{what} failed: {_status_text(status)}"
                           + (f": {detail}" if detail else ""), status=status)


_stderr_lock = threading.Lock()


def log_level() -> int:
    """The least severe LiteRT message shown (a LOG_LEVELS value), from LITEKV_LITERT_LOG."""
    name = os.environ.get(LOG_ENV, "error").strip().lower()
    if name not in LOG_LEVELS:
        raise ConfigError(f"{LOG_ENV}={name!r} is not a log level; use one of {', '.join(LOG_LEVELS)}.")
    return LOG_LEVELS[name]


_log_severity_set = LOG_LEVELS["info"]  # LiteRT's default in release builds


def _set_log_severity(lib: ctypes.CDLL, severity: int) -> None:
    """Sets the least severe message LiteRT's log prints, process-wide (under _stderr_lock).

    libLiteRt.so exports no logger API, but LiteRtCreateEnvironment applies the option
    kLiteRtEnvOptionTagMinLoggerSeverity to the default logger, which every environment
    shares: an environment that registers no accelerator (about 10 us) is made for it and
    destroyed at once. Cosmetic: a LiteRT that refuses it keeps logging as it did.
    """
    global _log_severity_set
    if severity == _log_severity_set:
        return
    options = (_EnvOption * 2)(_EnvOption(_ENV_MIN_LOGGER_SEVERITY, _Any(_ANY_INT, severity)),
                               _EnvOption(_ENV_AUTO_REGISTER_ACCELERATORS, _Any(_ANY_INT, 0)))
    handle = ctypes.c_void_p()
    if lib.LiteRtCreateEnvironment(len(options), options, ctypes.byref(handle)) == 0:
        lib.LiteRtDestroyEnvironment(handle)
        _log_severity_set = severity


def _shown(log: str, level: int) -> str:
    """The lines of a LiteRT log at `level` or above; a line without a severity goes with the one before."""
    shown, keep = [], True
    for line in log.splitlines(keepends=True):
        severity = LOG_LEVELS.get(line.partition(":")[0].lower())
        if severity is not None:
            keep = severity >= level
        if keep:
            shown.append(line)
    return "".join(shown)


@contextmanager
def _log_severity(during: int, after: int) -> Iterator[None]:
    lib = _load()
    _set_log_severity(lib, during)
    try:
        yield
    finally:
        _set_log_severity(lib, after)


@contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """Captures what native code writes to fd 2 meanwhile, then writes through what log_level() shows.

    LiteRT reports why an accelerator or a model failed only in its log (stderr); the
    captured text, with LiteRT's warnings whatever the level, is yielded (filled on exit)
    so errors can quote it. Afterwards LiteRT logs only below "error" (model runs: see the
    module docstring).
    """
    captured: list[str] = []
    level = log_level()
    after = level if level < LOG_LEVELS["error"] else LOG_LEVELS["silent"]
    with _stderr_lock, _log_severity(min(level, LOG_LEVELS["warning"]), after):
        try:
            saved = os.dup(2)
        except OSError:  # no stderr at all
            captured.append("")
            yield captured
            return
        try:
            with tempfile.TemporaryFile() as tmp:
                os.dup2(tmp.fileno(), 2)
                try:
                    yield captured
                finally:
                    os.dup2(saved, 2)
                    tmp.seek(0)
                    text = tmp.read().decode("utf-8", "replace")
                    shown = _shown(text, level)
                    if shown:
                        os.write(2, shown.encode())
                    captured.append(text)
        finally:
            os.close(saved)


def _problems(log: str, topic: str = "") -> str:
    """The WARNING/ERROR lines of a LiteRT log (those mentioning ``topic``), joined."""
    lines = [ln.strip() for ln in log.splitlines()
             if ln.startswith(("WARNING", "ERROR")) and topic.lower() in ln.lower()]
    return " | ".join(lines)


# ----------------------------------------------------------------------- buffers


def aligned_zeros(shape: int | Sequence[int], dtype=np.float32,
                  align: int = ALIGNMENT) -> np.ndarray:
    """Zeroed C-contiguous array whose data starts on an ``align``-byte boundary."""
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


_parked_handles: list[int] = []
_live_models = 0


def _destroy_parked_handles() -> None:
    if _live_models == 0 and _lib is not None:
        while _parked_handles:
            _lib.LiteRtDestroyTensorBuffer(_parked_handles.pop())


class HostTensorBuffer:
    """A LiteRT tensor buffer over a numpy array's memory (zero-copy, any rank).

    The model reads and writes ``array`` directly: set inputs by writing into the
    array, read outputs from it after ``run``. The buffer keeps the array alive.
    Its tensor type is the array's shape and dtype; ``run`` binds it only to signature
    tensors with exactly that shape and dtype. The array must be C-contiguous and start
    on a 64-byte boundary (see ``aligned_zeros``); views such as the KV prefix
    ``cache[:, :S]`` of an aligned ``cache`` qualify.
    """

    # Incremented by every close(); bindings re-check their buffers when it changed.
    _closes = 0

    def __init__(self, array: np.ndarray):
        self.handle: int | None = None
        lib = _load()
        if not isinstance(array, np.ndarray):
            raise BindingError(f"expected a numpy array, got {type(array).__name__}")
        dtype = array.dtype
        if dtype not in _ELEMENT_TYPE_OF or not dtype.isnative:
            raise BindingError(
                f"dtype {dtype} has no LiteRT element type here; use one of "
                f"{sorted({d.name for d in _ELEMENT_TYPES.values()})} in native byte order")
        if array.ndim > _MAX_RANK:
            raise BindingError(f"rank {array.ndim} exceeds LiteRT's maximum {_MAX_RANK}")
        if not array.flags.c_contiguous:
            raise BindingError(
                f"array of shape {array.shape} is not C-contiguous; LiteRT reads it as "
                "one dense block (a KV prefix must be cache[:, :S], not a strided slice)")
        if array.ctypes.data % ALIGNMENT:
            raise BindingError(
                f"array data at 0x{array.ctypes.data:x} is not {ALIGNMENT}-byte aligned; "
                "allocate it with litekv.litert_capi.aligned_zeros")
        ttype = _RankedTensorType(element_type=_ELEMENT_TYPE_OF[dtype])
        ttype.layout.rank = array.ndim
        for i, d in enumerate(array.shape):
            ttype.layout.dimensions[i] = d
        handle = ctypes.c_void_p()
        _check(lib.LiteRtCreateTensorBufferFromHostMemory(
            ctypes.byref(ttype), array.ctypes.data, array.nbytes, None, ctypes.byref(handle)),
            f"LiteRtCreateTensorBufferFromHostMemory({dtype}{list(array.shape)})")
        self.array = array
        self.handle = handle.value

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def closed(self) -> bool:
        return self.handle is None

    def close(self) -> None:
        """Releases the buffer (the numpy array stays valid). Idempotent.

        The C handle is destroyed only once no compiled model is alive: a compiled model
        remembers the buffers it last ran with by handle address, and a new buffer that
        reused a destroyed handle's address would be taken for the old one and run on the
        old memory. Until then the handle (a few hundred bytes, not the array) is parked.
        """
        handle, self.handle = self.handle, None
        if handle is not None and _lib is not None:
            HostTensorBuffer._closes += 1
            _parked_handles.append(handle)
            _destroy_parked_handles()

    def __enter__(self) -> "HostTensorBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self.array.ctypes.data:x}"
        return f"HostTensorBuffer({self.dtype}{list(self.shape)}, {state})"


# ----------------------------------------------------------------- environment


class Environment:
    """A LiteRT environment: the registry of accelerators that models compile with.

    Creating one loads LiteRT's accelerator plugins; share one per process
    (``default_environment()``) unless models need different environment options.
    """

    def __init__(self):
        self.handle: int | None = None
        lib = _load()
        handle = ctypes.c_void_p()
        with _native_stderr() as log:
            status = lib.LiteRtCreateEnvironment(0, None, ctypes.byref(handle))
        self.log = log[0]  # says why accelerators did or did not register
        _check(status, "LiteRtCreateEnvironment", _problems(self.log))
        self.handle = handle.value

    def accelerators(self) -> dict[str, set[str]]:
        """Registered accelerators: name -> hardware kinds ("cpu", "gpu", "npu")."""
        if self.handle is None:
            raise BackendError("the LiteRT environment is closed")
        lib, n = _load(), ctypes.c_size_t()
        _check(lib.LiteRtGetNumAccelerators(self.handle, ctypes.byref(n)),
               "LiteRtGetNumAccelerators")
        result = {}
        for i in range(n.value):
            acc, name, hw = ctypes.c_void_p(), ctypes.c_char_p(), ctypes.c_int()
            _check(lib.LiteRtGetAccelerator(self.handle, i, ctypes.byref(acc)),
                   "LiteRtGetAccelerator")
            _check(lib.LiteRtGetAcceleratorName(acc, ctypes.byref(name)),
                   "LiteRtGetAcceleratorName")
            _check(lib.LiteRtGetAcceleratorHardwareSupport(acc, ctypes.byref(hw)),
                   "LiteRtGetAcceleratorHardwareSupport")
            result[(name.value or b"?").decode()] = {
                kind for kind, bit in _ACCELERATORS.items() if hw.value & bit}
        return result

    def close(self) -> None:
        """Destroys the environment; close the models created in it first."""
        handle, self.handle = self.handle, None
        if handle is not None and _lib is not None:
            _lib.LiteRtDestroyEnvironment(handle)

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


_default_env: Environment | None = None
_env_lock = threading.Lock()


def default_environment() -> Environment:
    """The process-wide environment models use unless given one (never destroyed)."""
    global _default_env
    with _env_lock:
        if _default_env is None:
            _default_env = Environment()
    return _default_env


# ------------------------------------------------------------------ signatures


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A signature input or output: name, static shape and numpy dtype.

    ``dtype`` is None for element types numpy lacks (int4, bfloat16, ...); such
    tensors cannot be bound from numpy.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype | None
    element_type: int


@dataclasses.dataclass(frozen=True)
class SignatureInfo:
    """A signature of the model, its tensors in SignatureDef order."""

    name: str
    index: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


def _read_signatures(lib: ctypes.CDLL, model: int) -> dict[str, SignatureInfo]:
    def text(getter, *args) -> str:
        out = ctypes.c_char_p()
        _check(getter(*args, ctypes.byref(out)), getter.__name__)
        return out.value.decode()

    def count(getter, handle) -> int:
        out = ctypes.c_size_t()
        _check(getter(handle, ctypes.byref(out)), getter.__name__)
        return out.value

    def spec(sig, getter, index: int, name: str) -> TensorSpec:
        tensor, type_id, ranked = ctypes.c_void_p(), ctypes.c_int(), _RankedTensorType()
        _check(getter(sig, index, ctypes.byref(tensor)), getter.__name__)
        _check(lib.LiteRtGetTensorTypeId(tensor, ctypes.byref(type_id)), "LiteRtGetTensorTypeId")
        if type_id.value != 0:  # kLiteRtRankedTensorType
            return TensorSpec(name, (), None, 0)
        _check(lib.LiteRtGetRankedTensorType(tensor, ctypes.byref(ranked)),
               "LiteRtGetRankedTensorType")
        shape = tuple(ranked.layout.dimensions[i] for i in range(ranked.layout.rank))
        return TensorSpec(name, shape, _ELEMENT_TYPES.get(ranked.element_type),
                          ranked.element_type)

    signatures = {}
    for s in range(count(lib.LiteRtGetNumModelSignatures, model)):
        sig = ctypes.c_void_p()
        _check(lib.LiteRtGetModelSignature(model, s, ctypes.byref(sig)), "LiteRtGetModelSignature")
        inputs = tuple(
            spec(sig, lib.LiteRtGetSignatureInputTensorByIndex, i,
                 text(lib.LiteRtGetSignatureInputName, sig, i))
            for i in range(count(lib.LiteRtGetNumSignatureInputs, sig)))
        outputs = tuple(
            spec(sig, lib.LiteRtGetSignatureOutputTensorByIndex, i,
                 text(lib.LiteRtGetSignatureOutputName, sig, i))
            for i in range(count(lib.LiteRtGetNumSignatureOutputs, sig)))
        key = text(lib.LiteRtGetSignatureKey, sig)
        signatures[key] = SignatureInfo(key, s, inputs, outputs)
    return signatures


# ----------------------------------------------------------------------- model


class CustomOp(Protocol):
    """A custom op kernel for LiteRT's CPU runtime (see litekv.native_attention)."""

    def register(self, lib: ctypes.CDLL, options: int) -> int:
        """Adds the kernel to the LiteRtOptions `options`; returns the LiteRtStatus."""

    def release(self) -> None:
        """Frees what the kernel's runs used; called after the compiled model is destroyed."""


class CompiledTFLiteModel:
    """A ``.tflite`` file compiled by LiteRT for one accelerator, run with host buffers.

    * ``accelerator``: "cpu" (XNNPACK), "gpu" or "npu". If LiteRT cannot use it,
      ``AcceleratorUnavailable`` is raised; nothing falls back to another accelerator.
    * ``num_threads``: CPU threads (XNNPACK's pool size); None leaves LiteRT's default.
    * ``weight_cache_path``: file where XNNPACK stores its packed weights. The first
      load writes it, later loads map it; with several signatures it also keeps one
      packed copy of the shared weights instead of one per signature. Use one file per
      model file and delete it when the model file changes.
    * ``custom_ops``: kernels for the model's custom ops, kept alive with the model.

    ``run`` binds every input and output of a signature by name; ``cancel`` stops a
    run from another thread. Use as a context manager or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike, *, accelerator: str = "cpu",
                 num_threads: int | None = None,
                 weight_cache_path: str | os.PathLike | None = None,
                 environment: Environment | None = None,
                 custom_ops: Sequence["CustomOp"] = ()):
        lib = _load()
        self.path = os.fspath(path)
        if accelerator not in _ACCELERATORS:
            raise ValueError(f"accelerator must be one of {sorted(_ACCELERATORS)}, "
                             f"not {accelerator!r}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads must be a positive int or None, not {num_threads!r}")
        cpu_toml = self._cpu_options_toml(num_threads, weight_cache_path)
        self.accelerator = accelerator
        self.environment = environment or default_environment()
        self._handle: int | None = None
        self._model: int | None = None
        self._options: int | None = None
        self._lock = threading.Lock()  # one run at a time: the interpreter is not reentrant
        self._cancel_flag = (ctypes.c_uint8 * 2)()  # see _install_cancellation
        # run()'s checked bindings; they hold no reference to the model (no cycle).
        self._bindings: dict[tuple, _Binding] = {}
        self._custom_ops = list(custom_ops)  # their kernels and user data must outlive the model

        env = self.environment.handle
        if env is None:
            raise BackendError("the environment is closed")
        if not os.path.isfile(self.path):
            raise BackendError(f"model file not found: {self.path}")
        try:
            model = ctypes.c_void_p()
            with _native_stderr() as log:
                status = lib.LiteRtCreateModelFromFile(env, self.path.encode(),
                                                       ctypes.byref(model))
            _check(status, f"LiteRtCreateModelFromFile({self.path})", _problems(log[0]))
            self._model = model.value
            self.signatures: dict[str, SignatureInfo] = _read_signatures(lib, self._model)

            options = ctypes.c_void_p()
            _check(lib.LiteRtCreateOptions(ctypes.byref(options)), "LiteRtCreateOptions")
            self._options = options.value
            _check(lib.LiteRtSetOptionsHardwareAccelerators(
                self._options, _ACCELERATORS[accelerator]), "LiteRtSetOptionsHardwareAccelerators")
            if cpu_toml:
                self._add_opaque_options(lib, "xnnpack", cpu_toml)
            # Buffer error reporter: the interpreter's messages become retrievable with
            # LiteRtCompiledModelGetErrorMessages instead of going to stderr.
            self._add_opaque_options(lib, "runtime_options_string", "error_reporter_mode = 2\n")
            for op in self._custom_ops:
                _check(op.register(lib, self._options), "LiteRtAddCustomOpKernelOption")

            handle = ctypes.c_void_p()
            with _native_stderr() as log:
                status = lib.LiteRtCreateCompiledModel(env, self._model, self._options,
                                                       ctypes.byref(handle))
            self._handle = handle.value if status == 0 else None
            if self._handle is not None:
                global _live_models
                _live_models += 1
            if status != 0 and accelerator == "cpu":
                problems = _problems(log[0])
                raise BackendError(f"compiling {self.path} failed: LiteRtCreateCompiledModel "
                                   f"returned {_status_text(status)}"
                                   + (f": {problems}" if problems else ""), status=status)
            if accelerator != "cpu":
                self._check_accelerator(status, log[0])
            self._install_cancellation(lib)
        except BaseException:
            self.close()
            raise

    # -- construction helpers

    @staticmethod
    def _cpu_options_toml(num_threads: int | None, weight_cache_path) -> str:
        # CPU options travel as TOML text in opaque options named "xnnpack" (what
        # LrtGetOpaqueCpuOptionsData builds; the Lrt*CpuOptions helpers that would write
        # it are not exported by libLiteRt.so). The parser strips quotes, no escapes.
        toml = ""
        if num_threads is not None:
            toml += f"num_threads = {num_threads}\n"
        if weight_cache_path is not None:
            cache = os.path.abspath(os.fspath(weight_cache_path))
            if os.path.isdir(cache):
                raise ValueError(f"weight_cache_path must be a file path, {cache} is a "
                                 "directory (XNNPACK would run without a cache)")
            if any(c in cache for c in '"\n\r'):
                raise ValueError(f"weight_cache_path cannot contain quotes or newlines: {cache!r}")
            toml += f'weight_cache_file_path = "{cache}"\n'
        return toml

    def _add_opaque_options(self, lib: ctypes.CDLL, identifier: str, toml: str) -> None:
        # The payload is a C string the options free with libc free() when destroyed.
        payload = _libc.strdup(toml.encode())
        if not payload:
            raise MemoryError("strdup failed")
        opaque = ctypes.c_void_p()
        free = ctypes.cast(_libc.free, ctypes.c_void_p)
        status = lib.LiteRtCreateOpaqueOptions(identifier.encode(), payload, free,
                                               ctypes.byref(opaque))
        if status != 0:
            _libc.free(payload)
            _check(status, f"LiteRtCreateOpaqueOptions({identifier})")
        status = lib.LiteRtAddOpaqueOptions(self._options, opaque)  # takes ownership
        if status != 0:
            lib.LiteRtDestroyOpaqueOptions(opaque)
            _check(status, f"LiteRtAddOpaqueOptions({identifier})")

    def _check_accelerator(self, status: int, compile_log: str) -> None:
        """Raises AcceleratorUnavailable unless the model compiled for a registered
        accelerator of the requested kind (so nothing ran on the CPU instead)."""
        registered = self.environment.accelerators()
        available = any(self.accelerator in kinds for kinds in registered.values())
        if status == 0 and available:
            return
        listing = ", ".join(f"{name} ({'/'.join(sorted(kinds))})"
                            for name, kinds in registered.items())
        reason = (f"LiteRtCreateCompiledModel returned {_status_text(status)}"
                  if status else "LiteRT compiled the model without it")
        if not available:
            reason += (f"; no {self.accelerator.upper()} accelerator is registered in the "
                       f"LiteRT environment (registered: {listing or 'none'})")
        problems = _problems(self.environment.log + compile_log, self.accelerator)
        raise AcceleratorUnavailable(self.accelerator,
                                     reason + (f"; LiteRT log: {problems}" if problems else ""))

    def _install_cancellation(self, lib: ctypes.CDLL) -> None:
        # LiteRT polls the callback before every op (a delegated XNNPACK partition is
        # one op) on the running thread, which has released the GIL. A Python callback
        # would take the GIL at each poll (~0.2 us), and stall the run for as long as
        # another thread holds the GIL (tens of ms behind a long C-level call). Instead
        # the callback is libc's strlen() on a 2-byte zeroed buffer: it returns 0 until
        # cancel() sets the first byte, then 1. strlen(const char*) -> size_t and
        # bool (*)(void*) take the pointer and return the result in the same registers,
        # and 0/1 read the same as a bool. Installed once for the model's lifetime
        # (LiteRT rejects a NULL callback anyway); a poll costs a few ns, no GIL.
        _check(lib.LiteRtSetCompiledModelCancellationFunction(
            self._handle, ctypes.addressof(self._cancel_flag),
            ctypes.cast(_libc.strlen, ctypes.c_void_p)),
            "LiteRtSetCompiledModelCancellationFunction")

    # -- introspection

    def signature(self, name: str) -> SignatureInfo:
        try:
            return self.signatures[name]
        except KeyError:
            raise BindingError(f"{self.path} has no signature {name!r}; "
                               f"it has {list(self.signatures)}") from None

    @property
    def fully_accelerated(self) -> bool:
        """True if the accelerator (XNNPACK on CPU) took every op of the model."""
        out = ctypes.c_bool()
        _check(_load().LiteRtCompiledModelIsFullyAccelerated(self._live_handle(),
                                                             ctypes.byref(out)),
               "LiteRtCompiledModelIsFullyAccelerated")
        return out.value

    # -- running

    def bind(self, signature: str, inputs: Mapping[str, HostTensorBuffer],
             outputs: Mapping[str, HostTensorBuffer]) -> "BoundRun":
        """Checks the buffers against the signature once; calling the result runs it.

        Every input and output must be given (LiteRT itself accepts a missing input
        silently and runs on stale memory). A buffer may be both an input and an
        output (in-place KV update).
        """
        return BoundRun(self, self._bind(signature, inputs, outputs))

    def run(self, signature: str, inputs: Mapping[str, HostTensorBuffer],
            outputs: Mapping[str, HostTensorBuffer]) -> None:
        """Runs ``signature`` on the given buffers; results land in the output arrays.

        The checked binding is cached per signature and set of buffers, so repeated runs
        with the same buffers cost about the C call. Raises ``BindingError`` if the
        buffers do not fit (see ``bind``), ``Cancelled`` if ``cancel()`` stopped the
        run, ``BackendError`` if LiteRT failed.
        """
        # The key holds the names and the buffer objects (hashed by identity), so a hit
        # needs no per-name lookups and no checks.
        key = (signature, tuple(inputs.items()), tuple(outputs.items()))
        try:
            binding = self._bindings.get(key)
        except TypeError:  # an unhashable value, so not a buffer: _Binding says so
            self._bind(signature, inputs, outputs)
            raise
        if binding is None:
            binding = self._bind(signature, inputs, outputs)
            if len(self._bindings) >= 16:  # bounded: each entry keeps its buffers alive
                self._bindings.pop(next(iter(self._bindings)), None)
            self._bindings[key] = binding
        self._invoke(binding)

    def _bind(self, signature: str, inputs: Mapping[str, HostTensorBuffer],
              outputs: Mapping[str, HostTensorBuffer]) -> "_Binding":
        sig = self.signature(signature)
        return _Binding(self, sig, *self._ordered(sig, inputs, outputs))

    def _invoke(self, binding: "_Binding") -> None:
        if HostTensorBuffer._closes != binding.closes_seen:
            binding.check_open()
        with self._lock:
            if self._handle is None:
                self._live_handle()  # raises: closed
            # ctypes releases the GIL for the call: other threads run, cancel() works.
            status = _run_unchecked(*binding.args)
            if status != 0:
                self._raise_run_error(status, binding.signature.name)

    def _ordered(self, sig: SignatureInfo, inputs: Mapping[str, HostTensorBuffer],
                 outputs: Mapping[str, HostTensorBuffer]):
        for kind, given, names in (("input", inputs, sig.input_names),
                                   ("output", outputs, sig.output_names)):
            missing = [n for n in names if n not in given]
            unknown = [n for n in given if n not in names]
            if missing or unknown:
                raise BindingError(
                    f"signature {sig.name!r} of {self.path}: "
                    + (f"missing {kind}s {missing}" if missing else "")
                    + ("; " if missing and unknown else "")
                    + (f"unknown {kind}s {unknown}" if unknown else "")
                    + f"; its {kind}s are {list(names)}")
        return (tuple(inputs[n] for n in sig.input_names),
                tuple(outputs[n] for n in sig.output_names))

    def cancel(self) -> None:
        """Stops the run in progress before its next op; it raises ``Cancelled``.

        Safe from any thread, returns at once. A delegated partition (XNNPACK runs
        a whole chain of supported ops as one op) is finished before the run stops. If
        no run is in progress, the next run raises ``Cancelled`` without running. The
        request is consumed by the run that raises; ``clear_cancel()`` drops it.
        """
        self._cancel_flag[0] = 1

    def clear_cancel(self) -> None:
        """Drops a pending cancel request (e.g. when starting an unrelated job)."""
        self._cancel_flag[0] = 0

    @property
    def cancel_requested(self) -> bool:
        return bool(self._cancel_flag[0])

    def _live_handle(self) -> int:
        if self._handle is None:
            raise BackendError(f"the compiled model of {self.path} is closed")
        return self._handle

    def _raise_run_error(self, status: int, signature: str) -> None:
        lib = _load()
        message = ""
        text = ctypes.c_void_p()
        if lib.LiteRtCompiledModelGetErrorMessages(self._handle, ctypes.byref(text)) == 0 \
                and text.value:
            message = ctypes.string_at(text.value).decode("utf-8", "replace").strip()
            _libc.free(text.value)  # the caller owns the string (malloc'ed)
        lib.LiteRtCompiledModelClearErrors(self._handle)
        if self._cancel_flag[0]:
            self._cancel_flag[0] = 0  # consumed: later runs work normally
            raise Cancelled(f"run of signature {signature!r} of {self.path} was cancelled")
        raise BackendError(f"running signature {signature!r} of {self.path} failed: "
                           f"{_status_text(status)}" + (f": {message}" if message else ""),
                           status=status)

    # -- lifetime

    def while_open(self, action: Callable[[], object]) -> None:
        """Calls `action` if the model is open, holding it open meanwhile: its mappings (of the
        model file, say) stay where they are until `action` returns."""
        with self._lock:
            if self._handle is not None:
                action()

    def close(self) -> None:
        """Destroys the compiled model (waits for a run in progress; cancels it first)."""
        self._cancel_flag[0] = 1  # a run in progress stops at its next op
        with self._lock:
            self._bindings.clear()
            lib = _lib
            handle, self._handle = self._handle, None
            options, self._options = self._options, None
            model, self._model = self._model, None
            if lib is None:
                return
            if handle is not None:
                lib.LiteRtDestroyCompiledModel(handle)
            if options is not None:
                lib.LiteRtDestroyOptions(options)  # also frees the opaque options
            if model is not None:
                lib.LiteRtDestroyModel(model)
            if handle is not None:
                global _live_models
                _live_models -= 1
                _destroy_parked_handles()
            for op in self._custom_ops:  # after the model: a kernel's state serves its runs
                op.release()
            self._custom_ops = []

    def __enter__(self) -> "CompiledTFLiteModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return (f"CompiledTFLiteModel({self.path!r}, accelerator={self.accelerator!r}, "
                f"signatures={list(getattr(self, 'signatures', {}))})")


class BoundRun:
    """One signature with checked buffers; calling it runs the model (see ``bind``).

    A call costs the LiteRT call plus a few attribute reads. It keeps the model and
    the buffers alive; closing either makes later calls raise.
    """

    def __init__(self, model: CompiledTFLiteModel, binding: "_Binding"):
        self.model = model
        self._binding = binding

    @property
    def signature(self) -> SignatureInfo:
        return self._binding.signature

    @property
    def buffers(self) -> tuple[HostTensorBuffer, ...]:
        """The bound inputs, then the outputs, in signature order."""
        return self._binding.buffers

    def __call__(self) -> None:
        self.model._invoke(self._binding)


class _Binding:
    """Buffers checked against a signature, and the C arguments of the run call."""

    def __init__(self, model: CompiledTFLiteModel, sig: SignatureInfo,
                 ins: tuple[HostTensorBuffer, ...], outs: tuple[HostTensorBuffer, ...]):
        for kind, specs, bufs in (("input", sig.inputs, ins), ("output", sig.outputs, outs)):
            for spec, buf in zip(specs, bufs):
                _check_compatible(model, sig, kind, spec, buf)
        self.signature = sig
        self.buffers = ins + outs  # keeps them (and their arrays) alive
        # LiteRtRunCompiledModel's arguments, already C-typed (see _run_unchecked).
        self.args = (ctypes.c_void_p(model._live_handle()), ctypes.c_size_t(sig.index),
                     ctypes.c_size_t(len(ins)),
                     (ctypes.c_void_p * len(ins))(*[b.handle for b in ins]),
                     ctypes.c_size_t(len(outs)),
                     (ctypes.c_void_p * len(outs))(*[b.handle for b in outs]))
        self.closes_seen = HostTensorBuffer._closes

    def check_open(self) -> None:
        closed = [b for b in self.buffers if b.closed]
        if closed:
            raise BindingError(f"buffers {closed} were closed after binding signature "
                               f"{self.signature.name!r}")
        self.closes_seen = HostTensorBuffer._closes


def _check_compatible(model: CompiledTFLiteModel, sig: SignatureInfo, kind: str,
                      spec: TensorSpec, buf: HostTensorBuffer) -> None:
    where = f"{kind} {spec.name!r} of signature {sig.name!r} ({model.path})"
    if not isinstance(buf, HostTensorBuffer):
        raise BindingError(f"{where}: expected a HostTensorBuffer, got {type(buf).__name__}")
    if buf.closed:
        raise BindingError(f"{where}: the buffer is closed")
    if spec.dtype is None:
        raise BindingError(f"{where}: element type {spec.element_type} has no numpy dtype")
    if any(d < 0 for d in spec.shape):
        raise BindingError(f"{where}: dynamic shape {list(spec.shape)} is not supported")
    if buf.dtype != spec.dtype or buf.shape != spec.shape:
        raise BindingError(f"{where} is {spec.dtype}{list(spec.shape)}, "
                           f"the buffer is {buf.dtype}{list(buf.shape)}")
    if kind == "output" and not buf.array.flags.writeable:
        raise BindingError(f"{where}: the array is read-only")
