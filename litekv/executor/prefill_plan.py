"""Splitting a prompt across fixed-length prefill signatures: a pure function."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from litekv.errors import ConfigError, ContextFull

# What one more call costs, in tokens of prefill work. A chunk's time is about a + b * length: on
# SmolLM2 int8 (LiteRT, AVX2, 2 threads) 32 / 128 / 512 tokens took 93 / 310 / 1,278 ms, so
# b = 2.5 ms a token and a = 14 ms, about 6 tokens; a decode step, the 1-token call, reads every
# weight once, 3-16 tokens' worth of prefill on the machines measured.
CALL_COST_TOKENS = 8


@dataclass(frozen=True)
class Chunk:
    start: int  # position of the chunk's first token
    length: int  # signature length (tokens per call)
    real: int  # prompt tokens in the chunk; the rest is masked padding


def plan_prefill(num_tokens: int, start: int, lengths: Sequence[int], capacity: int,
                 call_cost: int = CALL_COST_TOKENS) -> list[Chunk]:
    """The cheapest calls that cover `num_tokens` tokens written from position `start`.

    `lengths` are the available signature lengths (1, a decode step, is always available). A call
    of length L costs L + `call_cost` (padding is computed like prompt tokens), so a 140-token prompt
    over lengths 32, 128 and 512 runs as 128 + 32 (12 padded), not as one 512-token call. Ties go to
    fewer calls, then to larger chunks first. A padded chunk never runs past `capacity`, because its
    padding is written to the cache too.
    """
    if num_tokens < 0 or start < 0:
        raise ConfigError("prefill needs a non-negative token count and start position.")
    if start + num_tokens > capacity:
        raise ContextFull(f"{num_tokens} tokens after {start} do not fit the context of {capacity} tokens.")
    sizes = tuple(sorted(set(int(n) for n in lengths) | {1}, reverse=True))
    largest = sizes[0]
    chunks: list[Chunk] = []
    pos, left = start, num_tokens
    # Whole chunks of the largest length cost the least per token, and where every length divides the
    # largest, any plan's chunks regroup into them: the search below covers the rest. Where one does
    # not (384 and 512: 1,152 tokens are three 384s, not 512 + 384 + a padded 384), it covers it all.
    divides = all(largest % size == 0 for size in sizes)
    while divides and left >= 2 * largest and pos + largest <= capacity:
        chunks.append(Chunk(pos, largest, largest))
        pos, left = pos + largest, left - largest
    return chunks + _cheapest_tail(left, pos, sizes, capacity, call_cost)


def _cheapest_tail(left: int, pos: int, sizes: tuple[int, ...], capacity: int, call_cost: int) -> list[Chunk]:
    """The cheapest plan for the last `left` tokens, found backwards: cost[done] and calls[done] of
    covering tokens done..left, whose first call is choice[done] tokens long. Sizes go largest first,
    so of equal plans the larger chunk leads."""
    cost, calls, choice = [0] * (left + 1), [0] * (left + 1), [0] * (left + 1)
    exact = set(sizes)
    for done in range(left - 1, -1, -1):
        remaining, at = left - done, pos + done
        if at + remaining <= capacity:  # a plan without padding in the fewest calls costs the least
            if remaining in exact:
                cost[done], calls[done], choice[done] = remaining + call_cost, 1, remaining
                continue
            if remaining - sizes[0] in exact:  # more than the largest length needs two calls
                cost[done], calls[done], choice[done] = remaining + 2 * call_cost, 2, sizes[0]
                continue
        best = None
        for size in sizes:
            if at + size > capacity:
                continue
            after = done + size if size < remaining else left
            option = (cost[after] + size + call_cost, calls[after] + 1)
            if best is None or option < best:
                best, choice[done] = option, size
        cost[done], calls[done] = best
    chunks, done = [], 0
    while done < left:
        real = min(choice[done], left - done)
        chunks.append(Chunk(pos + done, choice[done], real))
        done += real
    return chunks
