"""Caches and sessions too large for the flatbuffer format (2 GiB) are refused up front, with a
litekv error, before anything is copied or a file is touched. The limit is lowered here instead
of allocating gigabytes."""
from __future__ import annotations

import flatbuffers
import numpy as np
import pytest

from litekv import session_file as sf
from litekv.errors import SessionFormatError
from litekv.kv_cache import KVCacheError, serialized_bytes_per_token

from test_session_file import make_kv, make_state


def test_bytes_per_token_of_a_large_cache_exceed_the_format_at_long_context():
    # An 8B-class model: 32 layers, 8 KV heads of 128, float32 cache: 256 KiB a token.
    per_token = serialized_bytes_per_token(32, 1, 8, 128, np.float32, row_scales=False)
    assert per_token == 32 * 8 * 128 * 4 * 2
    assert 16384 * per_token > flatbuffers.Builder.MAX_BUFFER_SIZE
    assert serialized_bytes_per_token(32, 1, 8, 128, np.int8, row_scales=True) == 32 * 8 * (128 * 2 + 8)


def test_serialize_over_the_format_limit_is_a_kv_cache_error(monkeypatch):
    cache = make_kv(6)  # 2 layers, 2 KV heads of 4, float32: 128 bytes a token
    monkeypatch.setattr(flatbuffers.Builder, "MAX_BUFFER_SIZE", 1024 + 5 * 128)
    with pytest.raises(KVCacheError, match=r"6 tokens .* limit .* at most 5 of this cache fit.*shorter context"):
        cache.serialize()
    cache.set_num_tokens(5)
    assert len(cache.serialize()) > 5 * 128  # the largest that fits still serializes


def test_session_over_the_format_limit_is_refused_before_the_file_is_touched(tmp_path, monkeypatch):
    state = make_state(6)
    path = tmp_path / "s.lkvs"
    sf.write_session(path, make_state(3))
    before = path.read_bytes()
    monkeypatch.setattr(flatbuffers.Builder, "MAX_BUFFER_SIZE", len(state.kv_cache) + 1024)
    with pytest.raises(SessionFormatError, match=r"cannot save the session: .* limit of litekv's session format"):
        sf.write_session(path, state)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.lkvs"]
