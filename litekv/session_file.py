"""Saved sessions: tokens, KV cache, sampler and adapter state in one checksummed flatbuffer.

Format: litekv/schema/session.fbs. Everything is validated before a `SessionState` is returned.
"""
from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from litekv import kv_cache
from litekv.bundle import write_atomic
from litekv.errors import SessionFormatError
from litekv.flat_tables import FlatTableError, build, parse

FORMAT_VERSION = 1
IDENTIFIER = b"LKVS"
# Field order = vtable slots of litekv/schema/session.fbs.
SCHEMA = (
    ("version", "uint32"), ("fingerprint", "string"), ("backend", "string"), ("tokens", "int32s"),
    ("kv_cache", "bytes"), ("sampler_temperature", "float32"), ("sampler_top_k", "int32"),
    ("sampler_top_p", "float32"), ("sampler_repetition_penalty", "float32"), ("sampler_seed", "int64"),
    ("sampler_draws", "uint64"), ("lora_name", "string"), ("created_unix", "float64"), ("checksum", "uint64"),
)
OPTIONAL = {"lora_name"}
_PACK = {"uint32": "<I", "int32": "<i", "int64": "<q", "uint64": "<Q", "float32": "<f", "float64": "<d"}
_VECTOR_DTYPES = {"int32s": np.dtype("<i4"), "bytes": np.dtype("u1")}


@dataclass(frozen=True)
class SamplerState:
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    draws: int  # random draws made so far: the RNG state

    def __post_init__(self) -> None:
        # The file (and the sampler) keep float32; rounding here makes a saved state equal its reload.
        for name in ("temperature", "top_p", "repetition_penalty"):
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))


@dataclass(frozen=True)
class SessionState:
    fingerprint: str
    backend: str
    tokens: tuple[int, ...]  # an int array is accepted and stored as a tuple (immutable, comparable)
    kv_cache: bytes  # exactly KVCache.serialize(); restore it with KVCache.load
    sampler: SamplerState
    lora_name: str | None = None
    created_unix: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        tokens = self.tokens.tolist() if isinstance(self.tokens, np.ndarray) else self.tokens
        object.__setattr__(self, "tokens", tuple(int(t) for t in tokens))
        object.__setattr__(self, "kv_cache", bytes(self.kv_cache))


def encode_session(state: SessionState) -> bytes:
    """The session as bytes; refuses a state that `decode_session` would refuse."""
    tokens = np.asarray(state.tokens, np.int64)
    if tokens.size and not (0 <= tokens.min() and tokens.max() <= np.iinfo(np.int32).max):
        raise SessionFormatError("cannot save session: token ids must be in 0..2**31-1.")
    kv = np.frombuffer(state.kv_cache, np.uint8)
    _check_contents(state.fingerprint, tokens, kv, None, "cannot save session")
    s = state.sampler
    values = dict(version=FORMAT_VERSION, fingerprint=state.fingerprint, backend=state.backend,
                  tokens=tokens.astype(np.int32), kv_cache=kv, sampler_temperature=s.temperature,
                  sampler_top_k=s.top_k, sampler_top_p=s.top_p, sampler_repetition_penalty=s.repetition_penalty,
                  sampler_seed=s.seed, sampler_draws=s.draws, lora_name=state.lora_name,
                  created_unix=state.created_unix)
    missing = [name for name, _ in SCHEMA[:-1] if values[name] is None and name not in OPTIONAL]
    if missing:
        raise SessionFormatError(f"cannot save session: missing {', '.join(missing)}.")
    try:
        values["checksum"] = _checksum(values)
        return build(SCHEMA, values, IDENTIFIER)
    except (struct.error, TypeError, ValueError, OverflowError) as e:  # a scalar outside its field's type
        raise SessionFormatError(f"cannot save session: a value does not fit the session format ({e}).") from e


def decode_session(data: bytes, expected_fingerprint: str | None = None) -> SessionState:
    """Validate and decode `encode_session` output; raises SessionFormatError on any problem."""
    return _decode(data, expected_fingerprint, "session data")


def write_session(path: str | Path, state: SessionState) -> None:
    """Save atomically: readers see the previous file or the complete new one, never a torn file."""
    write_atomic(Path(path), encode_session(state))


def read_session(path: str | Path, expected_fingerprint: str | None = None) -> SessionState:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SessionFormatError(f"cannot read session file '{path}': {e.strerror or e}.") from e
    return _decode(data, expected_fingerprint, f"session file '{path}'")


def _decode(data: bytes, expected_fingerprint: str | None, where: str) -> SessionState:
    try:
        f = parse(SCHEMA, data, IDENTIFIER)
    except (FlatTableError, struct.error) as e:  # struct.error: defence in depth against odd vtables
        raise SessionFormatError(f"{where} is not a litekv session, or is truncated or corrupted: {e}.") from e
    # Version first: a newer format may lay out (and checksum) its fields differently.
    version = f["version"]
    if version is None:
        raise SessionFormatError(f"{where} is incomplete: it has no format version.")
    if version > FORMAT_VERSION:
        raise SessionFormatError(f"{where} has format version {version}, newer than this litekv reads "
                                 f"(version {FORMAT_VERSION}); upgrade litekv to load it.")
    if version != FORMAT_VERSION:
        raise SessionFormatError(f"{where} has unknown format version {version}; this litekv reads "
                                 f"version {FORMAT_VERSION}.")
    missing = [name for name, _ in SCHEMA if f[name] is None and name not in OPTIONAL]
    if missing:
        raise SessionFormatError(f"{where} is incomplete: missing fields {', '.join(missing)}.")
    if _checksum(f) != f["checksum"]:
        raise SessionFormatError(f"{where} failed its checksum: the data is corrupted.")
    _check_contents(f["fingerprint"], f["tokens"], f["kv_cache"], expected_fingerprint, where)
    if f["tokens"].size and f["tokens"].min() < 0:
        raise SessionFormatError(f"{where} is invalid: it contains negative token ids.")
    sampler = SamplerState(f["sampler_temperature"], f["sampler_top_k"], f["sampler_top_p"],
                           f["sampler_repetition_penalty"], f["sampler_seed"], f["sampler_draws"])
    return SessionState(f["fingerprint"], f["backend"], f["tokens"], f["kv_cache"], sampler, f["lora_name"],
                        f["created_unix"])


def _check_contents(fingerprint: str, tokens: np.ndarray, kv_blob: np.ndarray, expected: str | None,
                    where: str) -> None:
    if expected is not None and fingerprint != expected:
        raise SessionFormatError(f"{where} belongs to another model or quantization: it was saved with model "
                                 f"fingerprint {fingerprint!r}, this model's is {expected!r}. Load it with the "
                                 "model that saved it.")
    # Only the header matters here; KVCache.load checks shapes again when the caller restores it.
    try:
        header = parse(kv_cache.SCHEMA, bytearray(kv_blob), kv_cache.IDENTIFIER)
    except (FlatTableError, struct.error) as e:
        raise SessionFormatError(f"{where}: the embedded KV cache is not a serialized litekv KV cache: {e}.") from e
    kv_tokens = header["num_tokens"]
    # A session feeds its last token on the next step, so the cache may lag the tokens by one.
    if kv_tokens is None or not len(tokens) - 1 <= kv_tokens <= len(tokens):
        raise SessionFormatError(f"{where} is inconsistent: it lists {len(tokens)} tokens but its KV cache "
                                 f"holds {kv_tokens} (it must hold all of them or all but the last).")


def _checksum(values: Mapping[str, Any]) -> int:
    """blake2b-64 over every field but the checksum, in schema order (encoding in session.fbs)."""
    digest = hashlib.blake2b(digest_size=8)
    for name, kind in SCHEMA[:-1]:
        value = values.get(name)
        if value is None:
            digest.update(b"\x00")
            continue
        if kind == "string":
            payload: bytes | memoryview = value.encode("utf-8")
        elif kind in _PACK:
            payload = struct.pack(_PACK[kind], value)
        else:
            payload = memoryview(np.ascontiguousarray(value, _VECTOR_DTYPES[kind])).cast("B")
        digest.update(b"\x01" + struct.pack("<Q", len(payload)))
        digest.update(payload)
    return int.from_bytes(digest.digest(), "little")
