"""Splitting a prompt across fixed-length prefill signatures: a pure function."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from litekv.errors import ConfigError, ContextFull


@dataclass(frozen=True)
class Chunk:
    start: int  # position of the chunk's first token
    length: int  # signature length (tokens per call)
    real: int  # prompt tokens in the chunk; the rest is masked padding


def plan_prefill(num_tokens: int, start: int, lengths: Sequence[int], capacity: int) -> list[Chunk]:
    """The fewest calls that cover `num_tokens` tokens written from position `start`.

    `lengths` are the available signature lengths (1, a decode step, is always available).
    Among plans with the fewest calls the least padding wins. A padded chunk never runs past
    `capacity`, because its padding is written to the cache too.
    """
    if num_tokens < 0 or start < 0:
        raise ConfigError("prefill needs a non-negative token count and start position.")
    if start + num_tokens > capacity:
        raise ContextFull(f"{num_tokens} tokens after {start} do not fit the context of {capacity} tokens.")
    sizes = sorted(set(int(n) for n in lengths) | {1})
    chunks: list[Chunk] = []
    pos, left = start, num_tokens
    while left > 0:
        room = capacity - pos
        fitting = [s for s in sizes if s <= room]
        largest = fitting[-1]
        if left >= largest:
            size, real = largest, largest
        else:
            # One padded call if a signature covers the rest, else the largest full chunk.
            covering = [s for s in fitting if s >= left]
            size = covering[0] if covering else max(s for s in fitting if s <= left)
            real = min(size, left)
        chunks.append(Chunk(pos, size, real))
        pos, left = pos + real, left - real
    return chunks
