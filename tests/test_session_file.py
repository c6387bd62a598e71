"""Saved sessions (litekv.session_file): round trip, damage of every kind, atomic writes."""
from __future__ import annotations

import os

import numpy as np
import pytest

from litekv import session_file as sf
from litekv.errors import LitekvError, SessionFormatError
from litekv.flat_tables import build, parse
from litekv.kv_cache import KVCache

FINGERPRINT = "model-aaaa-q8"


def make_kv(num_tokens: int, seed: int = 0) -> KVCache:
    cache = KVCache.allocate(num_layers=2, batch_size=1, num_kv_heads=2, head_dim=4, capacity=16)
    rng = np.random.default_rng(seed)
    for layer in range(cache.num_layers):
        for buf in (cache.raw_keys(layer), cache.raw_values(layer)):
            buf[...] = rng.standard_normal(buf.shape, dtype=np.float32)
    cache.set_num_tokens(num_tokens)
    return cache


def make_state(num_tokens: int = 6, kv_tokens: int | None = None, **overrides) -> sf.SessionState:
    kv = make_kv(num_tokens if kv_tokens is None else kv_tokens)
    fields = dict(fingerprint=FINGERPRINT, backend="litert", tokens=np.arange(3, 3 + num_tokens, dtype=np.int32),
                  kv_cache=kv.serialize(),
                  sampler=sf.SamplerState(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1,
                                          seed=-12345678901, draws=2**40 + 7),
                  lora_name="french", created_unix=1_700_000_000.123456)
    fields.update(overrides)
    return sf.SessionState(**fields)


def raw_values(state: sf.SessionState, **overrides) -> dict:
    """The table's field values, for building files encode_session refuses to write."""
    s = state.sampler
    values = dict(version=2 if state.lora_fingerprint else 1, fingerprint=state.fingerprint, backend=state.backend,
                  tokens=np.asarray(state.tokens, np.int32), kv_cache=np.frombuffer(state.kv_cache, np.uint8),
                  sampler_temperature=s.temperature, sampler_top_k=s.top_k, sampler_top_p=s.top_p,
                  sampler_repetition_penalty=s.repetition_penalty, sampler_seed=s.seed, sampler_draws=s.draws,
                  lora_name=state.lora_name, created_unix=state.created_unix, checksum=0,
                  lora_fingerprint=state.lora_fingerprint)
    values.update(overrides)
    return values


def build_checksummed(values: dict) -> bytes:
    """A test-only writer: any field values, with a correct checksum."""
    buf = bytearray(build(sf.SCHEMA, values, sf.IDENTIFIER))
    position = sf._checksum_position(buf)
    buf[position:position + 8] = sf._checksum(buf, position).to_bytes(8, "little")
    return bytes(buf)


# ---- round trip -----------------------------------------------------------------------------------
def test_round_trip_restores_every_field_and_the_kv_cache(tmp_path):
    state = make_state()
    path = tmp_path / "chat.lkvs"
    sf.write_session(path, state)
    assert path.read_bytes()[4:8] == b"LKVS"
    loaded = sf.read_session(path, expected_fingerprint=FINGERPRINT)
    assert loaded == state
    assert loaded.tokens == tuple(range(3, 9))
    assert loaded.kv_cache == state.kv_cache
    assert loaded.sampler.seed == -12345678901 and loaded.sampler.draws == 2**40 + 7
    assert loaded.sampler.temperature == pytest.approx(0.7, abs=1e-7)
    assert loaded.created_unix == 1_700_000_000.123456
    assert loaded.lora_name == "french"

    restored = KVCache.allocate(2, 1, 2, 4, 16)
    restored.load(loaded.kv_cache)
    original = make_kv(6)
    assert restored.num_tokens == 6
    for layer in range(2):
        np.testing.assert_array_equal(restored.key_cache(layer), original.key_cache(layer))
        np.testing.assert_array_equal(restored.value_cache(layer), original.value_cache(layer))


def test_round_trip_without_adapter_and_with_the_last_token_not_yet_fed():
    # A live session's cache holds every token but the last (see litekv.engine.Session).
    state = make_state(num_tokens=6, kv_tokens=5, lora_name=None)
    loaded = sf.decode_session(sf.encode_session(state))
    assert loaded == state and loaded.lora_name is None


def test_empty_session_round_trips():
    state = make_state(num_tokens=0)
    assert sf.decode_session(sf.encode_session(state)) == state


def test_encoding_is_deterministic():
    assert sf.encode_session(make_state()) == sf.encode_session(make_state())


# ---- damage ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0, 1, 8, "half", "len-1"])
def test_truncated_data_is_refused(keep):
    data = sf.encode_session(make_state())
    n = {"half": len(data) // 2, "len-1": len(data) - 1}.get(keep, keep)
    with pytest.raises(SessionFormatError):
        sf.decode_session(data[:n])


def test_truncated_file_error_names_the_file(tmp_path):
    path = tmp_path / "cut.lkvs"
    path.write_bytes(sf.encode_session(make_state())[:100])
    with pytest.raises(SessionFormatError, match="cut.lkvs"):
        sf.read_session(path)


def test_every_single_byte_flip_is_refused():
    data = sf.encode_session(make_state())
    rng = np.random.default_rng(1234)
    positions = rng.integers(0, len(data), 200)
    masks = rng.integers(1, 256, 200)  # never 0: every flip changes the byte
    for position, mask in zip(positions, masks):
        damaged = bytearray(data)
        damaged[position] ^= int(mask)
        try:
            sf.decode_session(bytes(damaged))
        except SessionFormatError:
            continue
        pytest.fail(f"flipping byte {position} with mask {mask:#04x} was not detected")


def test_flips_in_the_checksum_and_the_header_are_refused():
    data = sf.encode_session(make_state())
    for position in list(range(16)) + list(range(len(data) - 16, len(data))):
        damaged = bytearray(data)
        damaged[position] ^= 0x01
        with pytest.raises(SessionFormatError):
            sf.decode_session(bytes(damaged))


def test_not_a_session():
    with pytest.raises(SessionFormatError, match="not a litekv session"):
        sf.decode_session(make_kv(3).serialize())  # a KV cache blob: identifier LKVC


def test_missing_file_is_a_session_format_error(tmp_path):
    path = tmp_path / "nope.lkvs"
    with pytest.raises(SessionFormatError, match="nope.lkvs") as info:
        sf.read_session(path)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert isinstance(info.value, LitekvError)


# ---- semantic checks ------------------------------------------------------------------------------
def test_wrong_fingerprint_names_both(tmp_path):
    path = tmp_path / "other.lkvs"
    sf.write_session(path, make_state())
    with pytest.raises(SessionFormatError) as info:
        sf.read_session(path, expected_fingerprint="model-bbbb-q4")
    message = str(info.value)
    assert FINGERPRINT in message and "model-bbbb-q4" in message
    assert "another model, quantization or int8 KV calibration" in message and "other.lkvs" in message


def test_future_version_asks_to_upgrade():
    # A newer writer may change everything after the version, even the checksum: no checksum here.
    values = raw_values(make_state(), version=3)
    del values["checksum"]
    with pytest.raises(SessionFormatError, match=r"format version 3 .*versions 1, 2\).*upgrade litekv"):
        sf.decode_session(build(sf.SCHEMA, values, sf.IDENTIFIER))


def test_unknown_old_version_is_refused():
    with pytest.raises(SessionFormatError, match="unknown format version 0"):
        sf.decode_session(build_checksummed(raw_values(make_state(), version=0)))


def test_test_writer_matches_encode_session():
    # Guards the tests below: their files differ from encode_session's only where they say.
    state = make_state()
    assert build_checksummed(raw_values(state)) == sf.encode_session(state)


@pytest.mark.parametrize("kv_tokens", [3, 4, 7])
def test_token_count_must_match_the_kv_cache(kv_tokens):
    state = make_state(num_tokens=6, kv_tokens=kv_tokens)
    with pytest.raises(SessionFormatError, match=f"lists 6 tokens but its KV cache holds {kv_tokens}"):
        sf.encode_session(state)
    with pytest.raises(SessionFormatError, match=f"lists 6 tokens but its KV cache holds {kv_tokens}"):
        sf.decode_session(build_checksummed(raw_values(state)))


def test_negative_token_ids_are_refused():
    state = make_state()
    with pytest.raises(SessionFormatError, match="token ids"):
        sf.encode_session(make_state(tokens=[3, 4, -1, 5, 6, 7]))
    tokens = np.asarray(state.tokens, np.int32)
    tokens[2] = -1
    with pytest.raises(SessionFormatError, match="negative token ids"):
        sf.decode_session(build_checksummed(raw_values(state, tokens=tokens)))


@pytest.mark.parametrize("field", ["fingerprint", "tokens", "kv_cache", "sampler_seed", "created_unix", "checksum"])
def test_missing_required_field_is_refused(field):
    values = raw_values(make_state())
    values[field] = None
    data = build(sf.SCHEMA, values, sf.IDENTIFIER) if field == "checksum" else build_checksummed(values)
    with pytest.raises(SessionFormatError, match=f"missing fields.*{field}"):
        sf.decode_session(data)


def test_an_adapter_fingerprint_round_trips_in_version_2():
    state = make_state(lora_fingerprint="ab" * 32)
    data = sf.encode_session(state)
    assert sf.decode_session(data) == state
    assert parse(sf.SCHEMA, data, sf.IDENTIFIER)["version"] == 2  # a version-1 reader asks to upgrade
    assert parse(sf.SCHEMA, sf.encode_session(make_state()), sf.IDENTIFIER)["version"] == 1
    assert build_checksummed(raw_values(state)) == data


def test_version_2_needs_the_adapter_fingerprint_and_a_fingerprint_needs_a_name():
    values = raw_values(make_state(lora_fingerprint="ab" * 32), lora_fingerprint=None)
    with pytest.raises(SessionFormatError, match="missing fields lora_fingerprint"):
        sf.decode_session(build_checksummed(values))
    with pytest.raises(SessionFormatError, match="no adapter name"):
        sf.encode_session(make_state(lora_name=None, lora_fingerprint="ab" * 32))


def test_damaged_embedded_kv_cache_is_refused():
    state = make_state()
    with pytest.raises(SessionFormatError, match="embedded KV cache"):
        sf.decode_session(build_checksummed(raw_values(state, kv_cache=np.zeros(64, np.uint8))))


# ---- atomic writes --------------------------------------------------------------------------------
def test_write_replaces_the_file_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "s.lkvs"
    sf.write_session(path, make_state(lora_name="a"))
    sf.write_session(path, make_state(lora_name="b"))
    assert sf.read_session(path).lora_name == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.lkvs"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "s.lkvs"
    sf.write_session(path, make_state(lora_name="old"))
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        sf.write_session(path, make_state(lora_name="new"))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sf.read_session(path).lora_name == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.lkvs"]
