"""Saved sessions: tokens, KV cache, sampler and adapter state in one checksummed flatbuffer.

Format: litekv/schema/session.fbs. Everything is validated before a `SessionState` is returned.
"""
from __future__ import annotations

import os
import stat
import zlib
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from litekv import kv_cache
from litekv.atomic_file import write_atomic
from litekv.errors import SessionFormatError
from litekv.flat_tables import TABLE_OVERHEAD, FlatTableError, build, max_table_bytes, parse

# 2 when the file holds its adapter's fingerprint, 1 otherwise: a litekv that reads only version 1
# then asks to be upgraded instead of loading the session without checking its adapter.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
IDENTIFIER = b"LKVS"
# Field order = vtable slots of litekv/schema/session.fbs. lora_fingerprint came last, so files
# written before it read as sessions whose adapter cannot be checked.
SCHEMA = (
    ("version", "uint32"), ("fingerprint", "string"), ("backend", "string"), ("tokens", "int32s"),
    ("kv_cache", "bytes"), ("sampler_temperature", "float32"), ("sampler_top_k", "int32"),
    ("sampler_top_p", "float32"), ("sampler_repetition_penalty", "float32"), ("sampler_seed", "int64"),
    ("sampler_draws", "uint64"), ("lora_name", "string"), ("created_unix", "float64"), ("checksum", "uint64"),
    ("lora_fingerprint", "string"),
)
OPTIONAL = {"lora_name", "lora_fingerprint"}
_CHECKSUM_SLOT = [name for name, _ in SCHEMA].index("checksum")
_SAVE = "cannot save the session"


class SessionWriteError(SessionFormatError, OSError):
    """The session file could not be written (its path, permissions or free space); the file that was
    there, if any, is unchanged. An OSError too, as write_session raised before it said which file."""


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
    kv_cache: bytes | memoryview  # exactly KVCache.serialize(); restore it with KVCache.load
    sampler: SamplerState
    lora_name: str | None = None
    created_unix: float = field(default_factory=time.time)
    lora_fingerprint: str | None = None  # the adapter's as loaded (Engine); None in files older than it

    def __post_init__(self) -> None:
        tokens = self.tokens.tolist() if isinstance(self.tokens, np.ndarray) else self.tokens
        object.__setattr__(self, "tokens", tuple(int(t) for t in tokens))
        if not isinstance(self.kv_cache, (bytes, memoryview)):  # e.g. a view into a decoded file: no copy
            object.__setattr__(self, "kv_cache", memoryview(np.ascontiguousarray(self.kv_cache)).cast("B"))


def encode_session(state: SessionState) -> bytes:
    """The session as bytes; refuses a state that `decode_session` would refuse."""
    _check_field_types(state)
    try:
        tokens = np.asarray(state.tokens, np.int64)
    except OverflowError:  # an id past int64: outside the range below too
        tokens = None
    if tokens is None or tokens.size and not (0 <= tokens.min() and tokens.max() <= np.iinfo(np.int32).max):
        raise SessionFormatError(f"{_SAVE}: token ids must be in 0..2**31-1.")
    kv = np.frombuffer(state.kv_cache, np.uint8)
    _check_contents(state.fingerprint, tokens, kv, None, _SAVE)
    if state.lora_fingerprint is not None and state.lora_name is None:
        raise SessionFormatError(f"{_SAVE}: it has an adapter fingerprint but no adapter name.")
    size = (TABLE_OVERHEAD + kv.nbytes + 4 * tokens.size + len(state.fingerprint) + len(state.lora_name or "")
            + len(state.lora_fingerprint or ""))
    if size > max_table_bytes():
        raise SessionFormatError(
            f"{_SAVE}: it takes {size / 2**30:.2f} GiB ({len(tokens)} tokens and their KV cache), over the "
            f"{max_table_bytes() / 2**30:g} GiB limit of litekv's session format; save a shorter context "
            "(e.g. rewind the session first).")
    s = state.sampler
    version = 2 if state.lora_fingerprint is not None else 1  # see FORMAT_VERSION
    values = dict(version=version, fingerprint=state.fingerprint, backend=state.backend,
                  tokens=tokens.astype(np.int32), kv_cache=kv, sampler_temperature=s.temperature,
                  sampler_top_k=s.top_k, sampler_top_p=s.top_p, sampler_repetition_penalty=s.repetition_penalty,
                  sampler_seed=s.seed, sampler_draws=s.draws, lora_name=state.lora_name,
                  created_unix=state.created_unix, lora_fingerprint=state.lora_fingerprint)
    missing = [name for name, _ in SCHEMA if name != "checksum" and values[name] is None and name not in OPTIONAL]
    if missing:
        raise SessionFormatError(f"{_SAVE}: missing {', '.join(missing)}.")
    try:
        buf = bytearray(build(SCHEMA, {**values, "checksum": 0}, IDENTIFIER))
    except (struct.error, TypeError, ValueError, OverflowError) as e:  # a value outside its field's type
        raise SessionFormatError(f"{_SAVE}: a value does not fit the session format ({e}).") from e
    position = _checksum_position(buf)
    struct.pack_into("<Q", buf, position, _checksum(buf, position))
    return bytes(buf)


def _check_field_types(state: SessionState) -> None:
    """SessionFormatError unless the strings are strings (None only where the format allows it) and the
    sampler is a SamplerState: the size check and the builder would fail on them with a TypeError."""
    strings = dict(fingerprint=state.fingerprint, backend=state.backend, lora_name=state.lora_name,
                   lora_fingerprint=state.lora_fingerprint)
    for name, value in strings.items():
        if value is None and name not in OPTIONAL:
            raise SessionFormatError(f"{_SAVE}: missing {name}.")
        if value is not None and not isinstance(value, str):
            raise SessionFormatError(f"{_SAVE}: {name} must be a str, got {type(value).__name__}.")
    if not isinstance(state.sampler, SamplerState):
        raise SessionFormatError(f"{_SAVE}: sampler must be a litekv.session_file.SamplerState, got "
                                 f"{type(state.sampler).__name__}.")


def decode_session(data: bytes, expected_fingerprint: str | None = None,
                   vocab_size: int | None = None) -> SessionState:
    """Validate and decode `encode_session` output; raises SessionFormatError on any problem.

    vocab_size: when given, every token id must be below it (the model that will run the session)."""
    return _decode(data, expected_fingerprint, vocab_size, "session data")


def write_session(path: str | Path, state: SessionState) -> None:
    """Save atomically: readers see the previous file or the complete new one, never a torn file."""
    path = Path(path)
    if not path.parent.is_dir():  # checked before a large cache is encoded for nothing
        raise SessionFormatError(f"{_SAVE} to '{path}': the directory '{path.parent}' does not exist; create it "
                                 "first or save elsewhere.")
    data = encode_session(state)
    try:
        write_atomic(path, data)
    except OSError as e:  # e.g. the path is a directory, or no space: name the file, not write_atomic's temp file
        raise SessionWriteError(f"{_SAVE} to '{path}': {e.strerror or e}; the file there (if any) is unchanged. "
                                "Save to another path, or check its permissions and the free space.") from e


def read_session(path: str | Path, expected_fingerprint: str | None = None,
                 vocab_size: int | None = None) -> SessionState:
    """`decode_session` of a file's contents; errors name the file."""
    try:
        data = _read_regular_file(path)
    except (OSError, TypeError) as e:  # TypeError: not a path (None, a number)
        raise SessionFormatError(f"cannot read session file '{path}': {getattr(e, 'strerror', None) or e}.") from e
    return _decode(data, expected_fingerprint, vocab_size, f"session file '{path}'")


def _read_regular_file(path: str | Path) -> bytes:
    """The bytes of a regular file no larger than a session can be. A FIFO would block the open and
    the read, and a device such as /dev/zero would be read until memory runs out."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without a writer
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SessionFormatError(f"cannot read session file '{path}': it is not a regular file (a device, "
                                     "pipe or socket); give the path of a file saved with Session.save.")
        if info.st_size > max_table_bytes():
            raise SessionFormatError(f"session file '{path}' is larger than the {max_table_bytes() / 2**30:g} GiB a "
                                     "litekv session can be: it is not one.")
        return f.read(info.st_size + 1)  # bounded even if the file grows meanwhile (decoding then refuses it)


def _decode(data: bytes, expected_fingerprint: str | None, vocab_size: int | None, where: str) -> SessionState:
    try:
        buf = memoryview(data).cast("B")
    except TypeError as e:  # not bytes, or a strided buffer
        raise SessionFormatError(f"{where}: expected the bytes encode_session returned (bytes, bytearray or a "
                                 f"contiguous buffer), got {type(data).__name__}.") from e
    try:
        f = parse(SCHEMA, buf, IDENTIFIER)
    except (FlatTableError, struct.error) as e:  # struct.error: defence in depth against odd vtables
        raise SessionFormatError(f"{where}: not a litekv session, or truncated or corrupted ({e}).") from e
    # Version first: a newer format may lay out (and checksum) its fields differently.
    version = f["version"]
    if version is None:
        raise SessionFormatError(f"{where}: incomplete, it has no format version.")
    readable = ", ".join(map(str, READABLE_FORMAT_VERSIONS))
    if version > FORMAT_VERSION:
        raise SessionFormatError(f"{where}: format version {version} is newer than this litekv reads "
                                 f"(versions {readable}); upgrade litekv to load it.")
    if version not in READABLE_FORMAT_VERSIONS:
        raise SessionFormatError(f"{where}: unknown format version {version}; this litekv reads "
                                 f"versions {readable}.")
    optional = OPTIONAL if version == 1 else set()  # version 2 is written for a session with an adapter
    missing = [name for name, _ in SCHEMA if f[name] is None and name not in optional]
    if missing:
        raise SessionFormatError(f"{where}: incomplete, missing fields {', '.join(missing)}.")
    # Whole-buffer checksum: a damaged byte anywhere (padding and offsets too) is caught, not only in values.
    if _checksum(buf, _checksum_position(buf)) != f["checksum"]:
        raise SessionFormatError(f"{where}: checksum mismatch, the data is corrupted.")
    _check_contents(f["fingerprint"], f["tokens"], f["kv_cache"], expected_fingerprint, where)
    tokens = f["tokens"]
    if vocab_size is not None and tokens.size and tokens.max() >= vocab_size:
        raise SessionFormatError(f"{where}: token id {int(tokens.max())} is outside the model's vocabulary of "
                                 f"{vocab_size} ids; the file is damaged or was written by another program. "
                                 "Start a new session.")
    sampler = SamplerState(f["sampler_temperature"], f["sampler_top_k"], f["sampler_top_p"],
                           f["sampler_repetition_penalty"], f["sampler_seed"], f["sampler_draws"])
    return SessionState(f["fingerprint"], f["backend"], f["tokens"], f["kv_cache"], sampler, f["lora_name"],
                        f["created_unix"], f["lora_fingerprint"] if version == 2 else None)


def _check_contents(fingerprint: str, tokens: np.ndarray, kv_blob: np.ndarray, expected: str | None,
                    where: str) -> None:
    if expected is not None and fingerprint != expected:
        raise SessionFormatError(f"{where}: the session belongs to another model, quantization or int8 KV "
                                 f"calibration (saved with model fingerprint {fingerprint!r}, this model's is "
                                 f"{expected!r}); load it with the model that saved it.")
    if tokens.size and tokens.min() < 0:
        raise SessionFormatError(f"{where}: negative token ids (such as {int(tokens.min())}); the data is damaged or "
                                 "was written by another program.")
    # Only the header matters here; KVCache.load checks shapes again when the caller restores it.
    try:
        header = parse(kv_cache.SCHEMA, kv_blob, kv_cache.IDENTIFIER)
    except (FlatTableError, struct.error) as e:
        raise SessionFormatError(f"{where}: the embedded KV cache is not a serialized litekv KV cache ({e}).") from e
    kv_tokens = header["num_tokens"]
    # A session feeds its last token on the next step, so the cache may lag the tokens by one.
    if kv_tokens is None or not len(tokens) - 1 <= kv_tokens <= len(tokens):
        raise SessionFormatError(f"{where}: the session lists {len(tokens)} tokens but its KV cache holds "
                                 f"{kv_tokens}; the cache must hold all of them or all but the last.")


def _checksum_position(buf: bytearray) -> int:
    """Where the checksum scalar sits in a buffer that `parse` accepted (so every offset is in range)."""
    root = struct.unpack_from("<I", buf, 0)[0]
    vtable = root - struct.unpack_from("<i", buf, root)[0]
    return root + struct.unpack_from("<H", buf, vtable + 4 + 2 * _CHECKSUM_SLOT)[0]


def _checksum(buf: bytearray, position: int) -> int:
    """CRC-32 of the whole buffer with the checksum's own 8 bytes read as zero.

    CRC-32 catches every burst error up to 32 bits at several GB/s (blake2b was 5x slower and
    made loading a session cost a sizeable part of re-prefilling it); it guards against damage,
    not tampering.
    """
    view = memoryview(buf)
    crc = zlib.crc32(view[:position])
    crc = zlib.crc32(bytes(8), crc)
    return zlib.crc32(view[position + 8:], crc)
