"""Reading and writing flat flatbuffer tables described by a field list (see litekv/schema/*.fbs).

Our serialized objects (KV caches, sessions) are single tables of scalars, strings and byte or
int vectors; field i of the list is vtable slot i, exactly as `flatc` lays out the .fbs schema.
Parsing validates every offset against the buffer, so damaged input raises instead of crashing.
"""
from __future__ import annotations

import struct
from typing import Any, Mapping, Sequence

import flatbuffers
import numpy as np
from flatbuffers import number_types as N
from flatbuffers.table import Table

_SCALARS = {
    "bool": (N.BoolFlags, "PrependBool"),
    "int32": (N.Int32Flags, "PrependInt32"),
    "uint32": (N.Uint32Flags, "PrependUint32"),
    "int64": (N.Int64Flags, "PrependInt64"),
    "uint64": (N.Uint64Flags, "PrependUint64"),
    "float32": (N.Float32Flags, "PrependFloat32"),
    "float64": (N.Float64Flags, "PrependFloat64"),
}
_VECTORS = {"bytes": np.uint8, "int32s": np.int32, "float32s": np.float32, "uint64s": np.uint64}

Field = tuple[str, str]  # (name, kind): a key of _SCALARS or _VECTORS, or "string"


class FlatTableError(ValueError):
    """The bytes are not a well-formed table of the expected schema."""


def max_table_bytes() -> int:
    """The largest table `build` can write: the flatbuffers builder's limit (2 GiB), read at call
    time so callers can check a size before they copy anything."""
    return flatbuffers.Builder.MAX_BUFFER_SIZE


# What `build` reserves beyond the vectors' bytes: vtable, scalars, short strings.
TABLE_OVERHEAD = 1024


def build(fields: Sequence[Field], values: Mapping[str, Any], identifier: bytes) -> bytes:
    builder = flatbuffers.Builder(TABLE_OVERHEAD + sum(np.asarray(v).nbytes for k, v in values.items()
                                                       if isinstance(v, np.ndarray)))
    offsets: dict[str, int] = {}
    for name, kind in fields:  # vectors and strings must be written before the table starts
        value = values.get(name)
        if value is None:
            continue
        if kind == "string":
            offsets[name] = builder.CreateString(value)
        elif kind in _VECTORS:
            offsets[name] = builder.CreateNumpyVector(np.ascontiguousarray(value, _VECTORS[kind]).reshape(-1))
    builder.StartObject(len(fields))
    for slot, (name, kind) in enumerate(fields):
        value = values.get(name)
        if value is None:
            continue
        if name in offsets:
            builder.PrependUOffsetTRelativeSlot(slot, offsets[name], 0)
        else:
            flags, _ = _SCALARS[kind]
            builder.PrependSlot(flags, slot, value, None)  # None default: always written
    builder.Finish(builder.EndObject(), file_identifier=identifier)
    return bytes(builder.Output())


def parse(fields: Sequence[Field], data: bytes, identifier: bytes) -> dict[str, Any]:
    """Inverse of `build`; absent fields are None. Raises FlatTableError on malformed input."""
    try:
        buf = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data  # no copy
    except TypeError as e:  # not a buffer, or a strided one (a sliced array): no bytes in a row to read
        raise FlatTableError(f"expected contiguous bytes, got {type(data).__name__} ({e})") from e
    if len(buf) < 8:
        raise FlatTableError("too short to be a flatbuffer")
    if bytes(buf[4:8]) != identifier:
        raise FlatTableError(f"file identifier is {bytes(buf[4:8])!r}, expected {identifier!r}")
    root = struct.unpack_from("<I", buf, 0)[0]
    _check_range(buf, root, 4)
    vtable = root - struct.unpack_from("<i", buf, root)[0]
    _check_range(buf, vtable, 4)
    vt_size, table_size = struct.unpack_from("<HH", buf, vtable)
    _check_range(buf, vtable, vt_size)
    _check_range(buf, root, table_size)
    table = Table(buf, root)
    out: dict[str, Any] = {}
    for slot, (name, kind) in enumerate(fields):
        voffset = 4 + 2 * slot
        field_off = table.Offset(voffset) if voffset + 2 <= vt_size else 0  # an odd vt_size ends mid-entry
        if field_off == 0:
            out[name] = None
            continue
        pos = root + field_off
        if kind in _SCALARS:
            flags, _ = _SCALARS[kind]
            _check_range(buf, pos, flags.bytewidth)
            out[name] = table.Get(flags, pos)
            continue
        _check_range(buf, pos, 4)
        target = pos + struct.unpack_from("<I", buf, pos)[0]
        _check_range(buf, target, 4)
        length = struct.unpack_from("<I", buf, target)[0]
        if kind == "string":
            _check_range(buf, target + 4, length)
            try:
                out[name] = bytes(buf[target + 4:target + 4 + length]).decode("utf-8")
            except UnicodeDecodeError as e:
                raise FlatTableError(f"field {name} is not valid UTF-8") from e
        else:
            dtype = np.dtype(_VECTORS[kind])
            _check_range(buf, target + 4, length * dtype.itemsize)
            out[name] = np.frombuffer(buf, dtype, count=length, offset=target + 4)
    return out


def _check_range(buf, start: int, size: int) -> None:
    if start < 0 or size < 0 or start + size > len(buf):
        raise FlatTableError("an offset points outside the data (truncated or corrupted)")
