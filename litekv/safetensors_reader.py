"""A validating reader for safetensors files that needs only numpy (bf16 included).

The format is an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw tensor bytes. Every offset and shape is
checked against the file before a tensor is touched, so a damaged file gives a clear error.
"""
from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np

from litekv.errors import CheckpointError, UnsupportedTensorType
from litekv.validation import is_int

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """Tensors of one .safetensors file, memory-mapped; `read` returns float32 for float dtypes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        header, header_len, size = self._read_header()
        self._data_start = 8 + header_len
        self._data_size = size - self._data_start
        self._entries = {name: self._check(name, meta) for name, meta in header.items()}
        self._check_overlaps()
        self._mmap: np.memmap | None = None

    def _read_header(self) -> tuple[dict, int, int]:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                raw_len = f.read(8)
                if len(raw_len) != 8:
                    raise CheckpointError(f"{self.path}: file is too short to be a safetensors file.")
                (header_len,) = struct.unpack("<Q", raw_len)
                if header_len > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: safetensors header length {header_len} is out of range; "
                                          "the file is truncated or not a safetensors file.")
                header = json.loads(f.read(header_len), object_pairs_hook=self._unique_keys)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read the file ({e.strerror or e}).") from e
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"{self.path}: safetensors header is not valid JSON; the file is damaged.") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: safetensors header is a JSON {type(header).__name__}, not an object "
                                  "of tensors; the file is damaged or not a safetensors file.")
        header.pop("__metadata__", None)
        return header, header_len, size

    def _unique_keys(self, pairs: list[tuple[str, object]]) -> dict:
        # json keeps the last of two equal keys; another reader may take the first, so neither is trusted.
        obj = dict(pairs)
        if len(obj) != len(pairs):
            twice = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
            raise CheckpointError(f"{self.path}: safetensors header names {twice!r} twice; the file is damaged.")
        return obj

    def _check(self, name: str, meta: object) -> tuple[str, tuple[int, ...], int, int]:
        where = f"{self.path}: header entry for tensor {name!r}"
        if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
            raise CheckpointError(f"{where} is malformed (it needs dtype, shape and data_offsets); "
                                  "the file is damaged.")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise UnsupportedTensorType(f"{self.path}: tensor {name!r} has dtype {dtype!r}, which litekv cannot "
                                        f"read (known: {', '.join(_DTYPES)}).")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers; "
                                  "the file is damaged.")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} is not two integers; the file is damaged.")
        begin, end = offsets
        nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize  # Python ints: no overflow
        if not (0 <= begin <= end <= self._data_size) or end - begin != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} points outside the file or has the wrong size; "
                                  "the file is truncated or damaged.")
        return dtype, tuple(shape), begin, end

    def _check_overlaps(self) -> None:
        spans = sorted((begin, end, name) for name, (_, _, begin, end) in self._entries.items() if end > begin)
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{self.path}: tensors {first!r} and {second!r} share bytes; "
                                      "the file is damaged.")

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._entries[name]
        try:
            if self._mmap is None:
                self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
            raw = self._mmap[self._data_start + begin:self._data_start + end]
            array = raw.view(_DTYPES[dtype]).reshape(shape)
        except (OSError, ValueError) as e:  # the file shrank or vanished after its header was checked
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r} ({e}); the file changed while "
                                  "it was open: make sure nothing else writes it and try again.") from e
        if dtype == "BF16":  # bf16 is the top half of a float32
            return (array.astype(np.uint32) << 16).view(np.float32)
        if array.dtype.kind == "f":
            return array.astype(np.float32)
        return np.array(array)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._entries:
            yield name, self.read(name)
