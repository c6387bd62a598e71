"""The external data an ONNX model names, read from its protobuf without the onnx package.

onnx is a conversion-time dependency only, and litekv needs just the tensors whose data lives in
another file (data_location EXTERNAL) and the "location" each names, to check them before ONNX
Runtime opens those files. The model is mapped, not read: weights stored inside it are skipped.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Iterator

EXTERNAL = 1  # TensorProto.DataLocation
_NAME, _EXTERNAL_DATA, _DATA_LOCATION = 8, 13, 14  # TensorProto fields
_KEY, _VALUE = 1, 2  # StringStringEntryProto fields

# Messages on the way to a TensorProto, and for each the fields (by number) that hold one of them.
_MODEL, _TRAINING, _FUNCTION, _GRAPH, _NODE, _ATTRIBUTE, _SPARSE, _TENSOR = range(8)
_HOLDS = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNCTION},  # graph, training_info, functions
    _TRAINING: {1: _GRAPH, 2: _GRAPH},  # initialization, algorithm
    _FUNCTION: {7: _NODE, 11: _ATTRIBUTE},  # node, attribute_proto (attribute defaults)
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},  # node, initializer, sparse_initializer
    _NODE: {5: _ATTRIBUTE},  # attribute
    # t, g, tensors, graphs (subgraphs: If, Loop, Scan), sparse_tensor, sparse_tensors
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},  # values, indices
}


def external_tensors(path: str | Path) -> list[tuple[str, str | None]]:
    """(name, location) of each tensor in the ONNX model at `path` whose data is external, in file order;
    location None if the tensor names none. ValueError if the file is not a well-formed protobuf."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses empty files; an empty model names nothing
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(buf)


def _walk(buf: mmap.mmap) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    pending = [(_MODEL, 0, len(buf))]  # depth first, without recursion: subgraphs nest arbitrarily
    while pending:
        kind, start, end = pending.pop()
        if kind == _TENSOR:
            found.extend(_tensor(buf, start, end))
            continue
        holds = _HOLDS[kind]
        inner = [(holds[number], a, b) for number, wire, a, b in _fields(buf, start, end)
                 if wire == 2 and number in holds]
        pending.extend(reversed(inner))
    return found


def _tensor(buf: mmap.mmap, start: int, end: int) -> list[tuple[str, str | None]]:
    """[(name, location)] if the TensorProto in buf[start:end] is external, else []."""
    name, location, external = "", None, False
    for number, wire, a, b in _fields(buf, start, end):
        if number == _NAME and wire == 2:
            name = _text(buf, a, b)
        elif number == _DATA_LOCATION and wire == 0:
            external = a == EXTERNAL
        elif number == _EXTERNAL_DATA and wire == 2:
            entry = {n: _text(buf, x, y) for n, w, x, y in _fields(buf, a, b) if w == 2}
            if entry.get(_KEY) == "location":
                location = entry.get(_VALUE, "")
    return [(name, location)] if external else []


def _text(buf: mmap.mmap, start: int, end: int) -> str:
    return buf[start:end].decode("utf-8")  # UnicodeDecodeError is a ValueError


def _fields(buf: mmap.mmap, pos: int, end: int) -> Iterator[tuple[int, int, int, int | None]]:
    """(number, wire type, value, None) of each varint field of the message in buf[pos:end] and
    (number, 2, start, end) of each length-delimited one; fixed-size fields are skipped."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, None
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            if pos + size > end:
                raise ValueError(f"field {number} at byte {pos} runs past its message")
            yield number, wire, pos, pos + size
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise ValueError(f"field {number} runs past its message")
        else:  # 3, 4: groups, which ONNX does not use; 6, 7: invalid
            raise ValueError(f"field {number} at byte {pos} has wire type {wire}")


def _varint(buf: mmap.mmap, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError(f"a truncated or overlong varint before byte {pos}")
