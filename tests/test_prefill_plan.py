"""Prompt splitting across fixed-length prefill signatures (a pure function)."""
from __future__ import annotations

import pytest

from litekv.errors import ContextFull
from litekv.executor import Chunk, plan_prefill


def test_exact_fit_uses_the_largest_signature_repeatedly():
    assert plan_prefill(256, 0, (32, 128), 4096) == [Chunk(0, 128, 128), Chunk(128, 128, 128)]


def test_remainder_takes_one_padded_call_with_the_smallest_covering_signature():
    assert plan_prefill(140, 0, (32, 128, 512), 4096) == [Chunk(0, 512, 140)]
    assert plan_prefill(600, 0, (32, 128, 512), 4096) == [Chunk(0, 512, 512), Chunk(512, 128, 88)]


def test_fewest_calls_then_least_padding():
    chunks = plan_prefill(130, 10, (32, 128), 4096)
    assert [c.length for c in chunks] == [128, 32]
    assert sum(c.real for c in chunks) == 130 and chunks[1].start == 138


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
