"""The KV cache object and session files as an app and a hostile file use them: copies between
layouts stay exact and independent, argument mistakes and damaged or crafted data raise litekv
errors (never numpy's, struct's or the OS's), and a failed call leaves the cache as it was."""
from __future__ import annotations

import errno
import os
import struct
import threading

import flatbuffers
import numpy as np
import pytest

from litekv import flat_tables
from litekv import session_file as sf
from litekv.errors import ConfigError, SessionFormatError
from litekv.kv_cache import _DATA, IDENTIFIER, SCHEMA, KVCache, KVCacheError, _checksum

from test_session_file import make_kv, make_state

# (layout, dtype, row scales): every kind of buffer a cache can have
FORMATS = [("BSHD", "float32", False), ("BHSD", "float16", False), ("BSHD", "int8", True),
           ("BSHD_KB8", "int8", False), ("BHSD_KB8", "int8", False)]


def filled(layout: str, dtype: str, row_scales: bool, batch: int = 2, capacity: int = 24, tokens: int = 11,
           seed: int = 0) -> KVCache:
    """A cache of 2 layers, 3 KV heads of 4, every buffer (and row scale) random."""
    cache = KVCache.allocate(2, batch, 3, 4, capacity, layout, dtype, row_scales)
    rng = np.random.default_rng(seed)
    for layer in range(2):
        for buf in (cache.raw_keys(layer), cache.raw_values(layer)):
            buf[...] = rng.integers(-100, 100, buf.shape).astype(buf.dtype)
        if row_scales:
            for buf in (cache.raw_key_scales(layer), cache.raw_value_scales(layer)):
                buf[...] = rng.random(buf.shape, dtype=np.float32)
    cache.set_num_tokens(tokens)
    return cache


def contents(cache: KVCache, row: int | None = None) -> list[np.ndarray]:
    """Copies of every canonical view (keys, values and row scales of each layer), of one batch row or all."""
    views = []
    for layer in range(cache.num_layers):
        views += [cache.key_cache(layer), cache.value_cache(layer)]
        if cache.row_scales:
            views += [cache.key_scales(layer), cache.value_scales(layer)]
    return [np.array(v if row is None else v[row]) for v in views]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def with_checksum(data: bytes | bytearray) -> bytes:
    """A serialized cache (parseable, with its data vectors) with its checksum made to match again."""
    fields = flat_tables.parse(SCHEMA, bytes(data), IDENTIFIER)
    header = {k: fields[k] for k, _ in SCHEMA if k not in _DATA}
    scales = (fields["key_scales"], fields["value_scales"]) if fields["row_scales"] else (None, None)
    fields["checksum"] = _checksum(header, fields["keys"], fields["values"], *scales)
    return flat_tables.build(SCHEMA, {k: v for k, v in fields.items() if v is not None}, IDENTIFIER)


def vtable_ending_mid_entry(data: bytes) -> bytes:
    """The table's vtable moved to the end of the data with an odd size: its last entry has one byte."""
    buf = bytearray(data) + bytes(5)
    root = struct.unpack_from("<I", buf, 0)[0]
    vtable = len(buf) - 5
    if root + 4 > vtable:  # (a fuzzed root outside the data: left as it is)
        return bytes(data)
    struct.pack_into("<i", buf, root, root - vtable)
    struct.pack_into("<HH", buf, vtable, 5, 4)
    return bytes(buf)


# ---- copies, views and serialization across layouts -----------------------------------------------

@pytest.mark.parametrize("source_format", FORMATS, ids=lambda f: "-".join(map(str, f)))
@pytest.mark.parametrize("tokens", [0, 1, 8, 11, 24])
def test_every_copy_between_layouts_is_exact_and_independent(source_format, tokens):
    source = filled(*source_format, tokens=tokens)
    for layout, dtype, row_scales in FORMATS:
        if (dtype, row_scales) != source_format[1:]:
            continue
        loaded = filled(layout, dtype, row_scales, capacity=32, tokens=5, seed=1)
        loaded.load(source.serialize())
        assert loaded.num_tokens == tokens and loaded.block_table == list(range(-(-tokens // 16)))
        assert_same(contents(loaded), contents(source))
        selected = filled(layout, dtype, row_scales, batch=3, capacity=32, tokens=20, seed=2)
        selected.select_and_copy_from(source, 1)
        assert selected.num_tokens == tokens
        assert_same(contents(selected, 0), contents(source, 1))
        broadcast = filled(layout, dtype, row_scales, batch=3, capacity=32, tokens=3, seed=3)
        broadcast.broadcast_and_copy_from(source)
        for row in range(3):
            assert_same(contents(broadcast, row), contents(source, 0))
    copy = source.deep_copy()
    assert copy.cache_id != source.cache_id and copy.num_tokens == tokens
    before = contents(source)
    assert_same(contents(copy), before)
    for buffers in copy._buffer_lists():  # writing the copy leaves its source alone
        for buf in buffers:
            buf[...] = 0
    assert_same(contents(source), before)


def test_a_cache_counted_with_a_numpy_int_serializes_a_file_that_loads():
    # The count entered serialize's checksummed header as np.int64(5), which load (reading 5) rejected
    # as corrupted: a session saved after such a rewind could never be restored.
    cache = make_kv(9)
    cache.set_num_tokens(np.int64(5))
    assert type(cache.num_tokens) is int
    restored = KVCache.allocate(2, 1, 2, 4, 16)
    restored.load(cache.serialize())
    assert restored.num_tokens == 5
    assert_same(contents(restored), contents(cache))


@pytest.mark.parametrize("count", [3.5, "3", None, True])
def test_set_num_tokens_takes_only_a_whole_number(count):
    cache = make_kv(6)
    before = contents(cache)
    with pytest.raises(KVCacheError, match=r"token count .* whole number in 0\.\.16"):
        cache.set_num_tokens(count)
    assert cache.num_tokens == 6
    assert_same(contents(cache), before)


@pytest.mark.parametrize("call", ["select", "broadcast"])
@pytest.mark.parametrize("other", [None, b"not a cache", np.zeros((1, 16, 2, 4), np.float32)])
def test_copies_refuse_what_is_not_a_kv_cache(call, other):
    cache = make_kv(6)
    before = contents(cache)
    with pytest.raises(KVCacheError, match="only from another litekv KVCache"):
        cache.select_and_copy_from(other, 0) if call == "select" else cache.broadcast_and_copy_from(other)
    assert cache.num_tokens == 6
    assert_same(contents(cache), before)


def test_block_table_of_a_released_cache_says_it_was_released():
    cache = filled("BSHD", "float32", False, capacity=32, tokens=20)
    assert cache.block_table == [0, 1]
    cache.release()
    with pytest.raises(KVCacheError, match="was released"):
        cache.block_table


@pytest.mark.parametrize("dtype", ["foo", object, "U4", "bool"])
def test_allocate_refuses_a_dtype_that_is_not_numbers(dtype):
    with pytest.raises(ConfigError, match="dtype|holds numbers"):
        KVCache.allocate(2, 1, 2, 4, 8, "BSHD", dtype)


@pytest.mark.parametrize("sizes", [
    (1, 2**62, 1, 1, 1),  # bytes past ssize_t
    (1, 2**31, 2**31, 4, 4),  # 2**66 bytes: numpy's int64 product wrapped to 0 and mapped nothing
])
def test_a_cache_too_large_to_allocate_is_a_kv_cache_error(sizes):
    with pytest.raises(KVCacheError, match=r"cannot allocate a KV cache of .* GiB.*smaller batch_size or max_context"):
        KVCache.allocate(*sizes, huge_pages=False)


# ---- loading damaged or crafted caches --------------------------------------------------------------

def test_load_refuses_a_strided_buffer_and_keeps_the_cache():
    cache = make_kv(6)
    before = contents(cache)
    data = np.frombuffer(make_kv(4, seed=1).serialize() * 2, np.uint8)[::2]
    with pytest.raises(KVCacheError, match="contiguous bytes"):
        cache.load(data)
    assert cache.num_tokens == 6
    assert_same(contents(cache), before)


def test_a_vtable_ending_mid_entry_is_refused_as_damage():
    cache = make_kv(6)
    before = contents(cache)
    data = vtable_ending_mid_entry(make_kv(4, seed=1).serialize())
    with pytest.raises(KVCacheError, match="damaged"):  # was struct.error, past load's FlatTableError
        cache.load(data)
    assert cache.num_tokens == 6
    assert_same(contents(cache), before)
    assert flat_tables.parse(SCHEMA, data, IDENTIFIER)["version"] is None  # the half entry reads as absent


@pytest.mark.parametrize("version, match", [(None, "damaged"), (0, "damaged"), (7, "upgrade litekv")])
def test_only_a_newer_format_version_asks_to_upgrade(version, match):
    fields = flat_tables.parse(SCHEMA, make_kv(4).serialize(), IDENTIFIER)
    fields["version"] = version
    data = flat_tables.build(SCHEMA, {k: v for k, v in fields.items() if v is not None}, IDENTIFIER)
    cache = make_kv(6)
    with pytest.raises(KVCacheError, match=match):
        cache.load(data)
    assert cache.num_tokens == 6


# Every format whose bytes can be other than numbers: float keys and values, int8 codes' row scales
# (whose sign matters too). Static int8 codes are numbers whatever their bytes.
NOT_NUMBERS = [(f, bad) for f in FORMATS if f[1] != "int8" or f[2]
               for bad in ([np.nan, np.inf, -np.inf] + ([-0.5] if f[2] else []))]


@pytest.mark.parametrize("fmt, bad", NOT_NUMBERS, ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_load_refuses_values_that_are_not_numbers_and_keeps_the_cache(fmt, bad):
    layout, dtype, row_scales = fmt
    source = filled(layout, dtype, row_scales, tokens=9, seed=1)
    if row_scales:
        buffer, name = source.raw_value_scales(1), "value row scales"
        buffer[0, 2, 5] = bad  # [batch, KV head, slot]
    else:
        buffer, name = source.raw_keys(1), "keys"
        buffer[(0, 5, 2, 1) if layout == "BSHD" else (0, 2, 5, 1)] = bad
    target = filled(layout, dtype, row_scales, tokens=7, seed=2)
    before = contents(target)
    with pytest.raises(KVCacheError, match=f"holds (negative, )?NaN or infinite {name} \\(layer 1\\).*damaged"):
        target.load(source.serialize())
    assert target.num_tokens == 7
    assert_same(contents(target), before)


def mutated(data: bytes, rng: np.random.Generator) -> bytearray:
    """`data` after 1-3 random bit flips, truncations, overwritten 32-bit words and vtables cut mid-entry."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.integers(4)
        if kind == 0:
            buf[rng.integers(len(buf))] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            del buf[rng.integers(len(buf)):]
        elif kind == 2 and len(buf) >= 12:
            value = rng.choice([0, 1, 2, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, int(rng.integers(2**32))])
            struct.pack_into("<I", buf, int(rng.integers(len(buf) - 3)), int(value))
        elif kind == 3 and len(buf) >= 8:
            buf = bytearray(vtable_ending_mid_entry(bytes(buf)))
        if len(buf) < 8:
            break
    return buf


def test_fuzzed_serialized_caches_load_or_raise_a_kv_cache_error_and_change_nothing():
    """Bit flips, truncations, overwritten words and a vtable ending mid-entry, the checksum mostly
    made to match again so that the structure checks are reached."""
    rng = np.random.default_rng(20240611)
    sources = [filled(*f, tokens=int(rng.integers(0, 25)), seed=i).serialize() for i, f in enumerate(FORMATS)]
    targets = [filled(*f, tokens=7, seed=10 + i) for i, f in enumerate(FORMATS)]
    snapshots = [(t.num_tokens, contents(t)) for t in targets]
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(2000):
        buf = mutated(sources[rng.integers(len(sources))], rng)
        if rng.random() < 0.7:
            try:
                buf = bytearray(with_checksum(buf))
            except (flat_tables.FlatTableError, TypeError, ValueError, struct.error):
                pass  # not parseable enough to re-checksum: load must refuse it all the same
        index = int(rng.integers(len(targets)))
        target = targets[index]
        try:
            target.load(bytes(buf))
        except KVCacheError:
            outcomes["refused"] += 1
            assert (target.num_tokens, len(contents(target))) == (snapshots[index][0], len(snapshots[index][1]))
            assert_same(contents(target), snapshots[index][1])
            continue
        outcomes["loaded"] += 1
        snapshots[index] = (target.num_tokens, contents(target))
    assert outcomes["loaded"] and outcomes["refused"]  # both paths ran


# ---- session files --------------------------------------------------------------------------------

@pytest.mark.parametrize("data", ["a session", None, 42, np.frombuffer(b"LKVS" * 64, np.uint8)[::2]],
                         ids=["str", "None", "int", "strided"])
def test_decode_session_refuses_what_is_not_contiguous_bytes(data):
    with pytest.raises(SessionFormatError, match="session data: expected the bytes"):
        sf.decode_session(data)


def test_decode_session_refuses_a_vtable_ending_mid_entry():
    with pytest.raises(SessionFormatError):
        sf.decode_session(vtable_ending_mid_entry(sf.encode_session(make_state())))


@pytest.mark.parametrize("overrides, match", [
    (dict(fingerprint=None), "missing fingerprint"),
    (dict(fingerprint=7), "fingerprint must be a str, got int"),
    (dict(lora_name=3), "lora_name must be a str, got int"),
    (dict(sampler=None), "sampler must be a litekv.session_file.SamplerState"),
    (dict(tokens=[2**70, 1, 2, 3, 4, 5]), r"token ids must be in 0\.\.2\*\*31-1"),
])
def test_encode_session_refuses_fields_of_the_wrong_type(overrides, match):
    with pytest.raises(SessionFormatError, match=match):
        sf.encode_session(make_state(**overrides))


def test_saving_to_a_directory_names_the_path_and_leaves_it_alone(tmp_path):
    target = tmp_path / "chat.lkvs"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(SessionFormatError, match=f"cannot save the session to '{target}'.*another path") as info:
        sf.write_session(target, make_state())
    assert isinstance(info.value, OSError)  # callers that caught write_session's OSError still do
    assert ".tmp" not in str(info.value)  # the message names the user's path, not the temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.lkvs"]
    assert (target / "keep").read_text() == "x"


def test_a_failed_write_is_a_session_error_naming_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "s.lkvs"
    sf.write_session(path, make_state(lora_name="old"))
    before = path.read_bytes()

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(SessionFormatError, match=f"'{path}': No space left on device.*unchanged"):
        sf.write_session(path, make_state(lora_name="new"))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.lkvs"]


def test_read_session_refuses_a_fifo_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "chat.lkvs"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            sf.read_session(fifo)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in open() or read(): give it a writer and an end of file to return
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("read_session blocked on a FIFO")
    assert isinstance(outcome[0], SessionFormatError) and "not a regular file" in str(outcome[0])


def test_read_session_refuses_a_file_larger_than_any_session_before_decoding_it(tmp_path, monkeypatch):
    path = tmp_path / "s.lkvs"
    sf.write_session(path, make_state())
    assert sf.read_session(path).tokens == make_state().tokens
    monkeypatch.setattr(flatbuffers.Builder, "MAX_BUFFER_SIZE", path.stat().st_size - 1)
    with pytest.raises(SessionFormatError, match=f"'{path}' is larger than .* a litekv session can be"):
        sf.read_session(path)


@pytest.mark.parametrize("path", [None, 3])
def test_read_session_refuses_what_is_not_a_path(path):
    with pytest.raises(SessionFormatError, match="cannot read session file"):
        sf.read_session(path)


def _rechecksummed_session(buf: bytearray) -> bytearray:
    try:
        flat_tables.parse(sf.SCHEMA, bytes(buf), sf.IDENTIFIER)
        position = sf._checksum_position(buf)
        struct.pack_into("<Q", buf, position, sf._checksum(buf, position))
    except (flat_tables.FlatTableError, struct.error):
        pass
    return buf


def test_fuzzed_session_files_decode_or_raise_a_session_error():
    """Mutated session files (checksum mostly made to match again) give a SessionFormatError or a state
    whose cache loads (or is refused with a KVCacheError) and which encodes again."""
    rng = np.random.default_rng(7)
    base = sf.encode_session(make_state(lora_fingerprint="ab" * 32))
    cache = KVCache.allocate(2, 1, 2, 4, 16)
    decoded = 0
    for _ in range(3000):
        buf = mutated(base, rng)
        if rng.random() < 0.9:
            buf = _rechecksummed_session(buf)
        try:
            state = sf.decode_session(bytes(buf), vocab_size=1000)
        except SessionFormatError:
            continue
        decoded += 1
        try:
            cache.load(state.kv_cache)
        except KVCacheError:
            pass
        try:
            encoded = sf.encode_session(state)
        except SessionFormatError:
            continue
        assert sf.encode_session(sf.decode_session(encoded)) == encoded  # bytes: a NaN setting is not == itself
    assert decoded  # some mutations (e.g. of the timestamp) keep a valid file



def test_chat_save_to_a_directory_and_load_of_a_fifo_report_an_error_and_keep_chatting(tmp_path, monkeypatch, capsys):
    # The chat catches litekv errors only: an IsADirectoryError from /save ended it with a traceback.
    import builtins

    from litekv import cli
    from test_session_robustness import scripted_engine

    engine = scripted_engine("Hi there!<|im_end|>")
    fifo = tmp_path / "pipe.lkvs"
    os.mkfifo(fifo)
    lines = iter(["Hello", f"/save {tmp_path}", f"/load {fifo}", f"/save {tmp_path / 'ok.lkvs'}", "/quit"])
    monkeypatch.setattr(cli, "_engine", lambda args: engine)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert cli._chat(cli.build_parser().parse_args(["chat"])) == 0
    out = capsys.readouterr().out
    assert f"error: cannot save the session to '{tmp_path}'" in out
    assert "not a regular file" in out
    assert engine.load_session(tmp_path / "ok.lkvs").tokens  # the chat went on and saved
