"""Prompt splitting across fixed-length prefill signatures (a pure function)."""
from __future__ import annotations

import numpy as np
import pytest

from litekv.errors import ContextFull
from litekv.executor import Chunk, plan_prefill
from litekv.executor.prefill_plan import CALL_COST_TOKENS


def test_exact_fit_uses_the_largest_signature_repeatedly():
    assert plan_prefill(256, 0, (32, 128), 4096) == [Chunk(0, 128, 128), Chunk(128, 128, 128)]


def test_padding_is_paid_for_like_prompt_tokens():
    """A 512-token call for a 140-token prompt computes 372 tokens of padding: 128 + 32 costs a third
    (measured on SmolLM2 int8, LiteRT: 1,210 against 405 ms)."""
    assert plan_prefill(140, 0, (32, 128, 512), 4096) == [Chunk(0, 128, 128), Chunk(128, 32, 12)]
    assert plan_prefill(256, 0, (32, 128, 512), 4096) == [Chunk(0, 128, 128), Chunk(128, 128, 128)]
    assert [c.length for c in plan_prefill(1000, 0, (512,), 4096)] == [512, 512]  # 24 padded beat 488 steps


def test_a_few_decode_steps_beat_a_padded_call():
    chunks = plan_prefill(130, 10, (32, 128), 4096)  # 128 + 32 would compute 30 tokens of padding
    assert [c.length for c in chunks] == [128, 1, 1]
    assert sum(c.real for c in chunks) == 130 and chunks[1].start == 138


def test_dynamic_lengths_take_whole_chunks_then_the_rest_unpadded():
    chunks = plan_prefill(700, 5, range(1, 257), 4096)
    assert [(c.length, c.real) for c in chunks] == [(256, 256), (256, 256), (188, 188)]


def brute_force_cost(num_tokens: int, start: int, lengths, capacity: int) -> int:
    """The least cost of any plan, by trying every sequence of calls."""
    best = {0: 0}
    for done in range(num_tokens):
        if done not in best:
            continue
        for size in set(lengths) | {1}:
            if start + done + size <= capacity:
                after = min(num_tokens, done + size)
                cost = best[done] + size + CALL_COST_TOKENS
                best[after] = min(best.get(after, cost), cost)
    return best[num_tokens]


@pytest.mark.parametrize("lengths", [(32, 128, 512), (4, 8), (3, 7, 20), (16,), (384, 512), (96, 128, 160)])
def test_plans_cost_no_more_than_any_other_plan(lengths):
    rng = np.random.default_rng(sum(lengths))
    for num_tokens, start in zip(rng.integers(1, 1200, 40), rng.integers(0, 300, 40)):
        capacity = int(start + num_tokens + rng.integers(0, 40))
        chunks = plan_prefill(int(num_tokens), int(start), lengths, capacity)
        assert sum(c.real for c in chunks) == num_tokens and chunks[0].start == start
        assert all(a.start + a.real == b.start for a, b in zip(chunks, chunks[1:]))
        assert all(c.start + c.length <= capacity and c.real <= c.length for c in chunks)
        cost = sum(c.length + CALL_COST_TOKENS for c in chunks)
        assert cost == brute_force_cost(int(num_tokens), int(start), lengths, capacity)


def test_padding_never_runs_past_the_capacity():
    chunks = plan_prefill(5, 59, (4, 8), 64)  # an 8-token call at 59 would write past slot 63
    assert all(c.start + c.length <= 64 for c in chunks)
    assert sum(c.real for c in chunks) == 5


def test_single_tokens_fall_back_to_decode_steps():
    assert plan_prefill(2, 62, (32,), 64) == [Chunk(62, 1, 1), Chunk(63, 1, 1)]


def test_empty_prompt_and_overflow():
    assert plan_prefill(0, 0, (32,), 64) == []
    with pytest.raises(ContextFull):
        plan_prefill(10, 60, (32,), 64)
