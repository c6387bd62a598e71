"""Releasing the resident pages of model-file mappings (what LiteRT and ONNX Runtime leave after loading)."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest

from litekv.resident_pages import FileMappings, read_only_mappings, release_file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

SIZE = 8 << 20


def resident_kb(path) -> int:
    return sum(kb for _, _, kb in read_only_mappings(path))


def test_read_only_mapping_is_released_and_still_reads_the_same(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # touch every page
        assert resident_kb(path) >= SIZE // 1024 * 0.9
        assert release_file_pages(path) >= SIZE // 1024 * 0.9
        assert resident_kb(path) < SIZE // 1024 * 0.1
        np.testing.assert_array_equal(view, data)  # faults back in, unchanged
        del view


def test_writable_mapping_is_left_alone(tmp_path):
    path = tmp_path / "scratch.bin"
    path.write_bytes(bytes(SIZE))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        view[::4096] = 7  # private dirty pages: dropping them would lose these writes
        assert read_only_mappings(path) == []
        assert release_file_pages(path) == 0
        assert np.all(view[::4096] == 7)
        del view


def test_litert_prefill_leaves_no_model_file_pages_resident(tmp_path):
    """Embedding rows a prefill read (and the 64 KB the kernel maps around each) are given back;
    the model keeps giving the reference's logits. Its own bundle: no other test maps that file."""
    from conformance import KV_BUCKETS, MAX_CONTEXT, PREFILL_LENGTHS, checkpoint_dir, reference, relative_error
    from litekv.converters.convert import ConvertOptions, convert
    from litekv.executor import open_executor

    options = ConvertOptions(backend="litert", max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS,
                             kv_buckets=KV_BUCKETS, kv_cache="fp32",
                             # builtin attention, so the fp32 head stays XNNPACK's: litekv's reads the whole
                             # table every step, and its bundles keep those pages (test_rope_attention_op.py)
                             decode_attention="graph", prefill_attention="graph")
    ex, ref = open_executor(convert(checkpoint_dir("llama"), tmp_path / "bundle", options)), reference("llama")
    model_file = ex.model.path
    prompt = np.random.default_rng(2).integers(3, ex.config.vocab_size, 13)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.step([int(prompt[0])], ours)
    ref.step([int(prompt[0])], theirs)
    assert resident_kb(model_file) > 0  # a decode step reads its row from the mapping
    ex.prefill(prompt[1:-1], ours)
    ref.prefill(prompt[1:-1], theirs)
    assert resident_kb(model_file) == 0
    assert relative_error(ex.step([int(prompt[-1])], ours), ref.step([int(prompt[-1])], theirs)) < 1e-4


def test_litert_decode_steps_give_model_file_pages_back_periodically(tmp_path):
    """Each step reads one embedding row (and the 64 KB around it) from the model file."""
    from conformance import KV_BUCKETS, MAX_CONTEXT, PREFILL_LENGTHS, checkpoint_dir
    from litekv.converters.convert import ConvertOptions, convert
    from litekv.executor import open_executor

    options = ConvertOptions(backend="litert", max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS,
                             kv_buckets=KV_BUCKETS, kv_cache="fp32",
                             # builtin attention, so the fp32 head stays XNNPACK's: litekv's reads the whole
                             # table every step, and its bundles keep those pages (test_rope_attention_op.py)
                             decode_attention="graph", prefill_attention="graph")
    ex = open_executor(convert(checkpoint_dir("llama"), tmp_path / "bundle", options))
    ex.model_pages.every_steps = 3
    cache = ex.create_kv_cache()
    assert resident_kb(ex.model.path) == 0
    ex.step([5], cache)
    ex.sample_tokens(1, [6], cache)
    assert resident_kb(ex.model.path) > 0
    ex.step([7], cache)  # the third step since the last release
    assert resident_kb(ex.model.path) == 0


def test_file_mappings_release_only_their_file_and_skip_excluded_ranges(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(SIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as first:
        theirs = FileMappings(path).ranges
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as second:
            ours = FileMappings(path, exclude=theirs)
            assert len(ours.ranges) == 1 and ours.ranges[0] not in theirs
            np.frombuffer(first, np.uint8).sum(), np.frombuffer(second, np.uint8).sum()
            ours.release()
            kb = {(start, end): resident for start, end, resident in read_only_mappings(path)}
            assert kb[ours.ranges[0]] == 0 and kb[theirs[0]] >= SIZE // 1024 * 0.9


def test_a_range_that_no_longer_maps_the_file_is_left_alone(tmp_path):
    """A private anonymous mapping placed where the file was mapped would lose its data to
    MADV_DONTNEED; the check of /proc/self/maps must skip it."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(SIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        stale = FileMappings(path)
    assert len(stale.ranges) == 1
    start, end = stale.ranges[0]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000  # MAP_FIXED_NOREPLACE: exactly there, or fail
    address = libc.mmap(start, end - start, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value) or address != start:
        pytest.skip("could not map anonymous memory at the released range")
    try:
        memory = (ctypes.c_uint8 * (end - start)).from_address(address)
        ctypes.memset(address, 7, end - start)
        stale.release()
        assert memory[0] == 7 and memory[(end - start) // 2] == 7 and memory[end - start - 1] == 7
    finally:
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(address, end - start)


def test_release_reports_only_what_it_released(tmp_path, monkeypatch):
    import litekv.resident_pages as resident_pages

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(SIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        np.frombuffer(mapped, np.uint8).sum()
        monkeypatch.setattr(resident_pages, "_read_only_ranges", lambda target: set())
        assert release_file_pages(path) == 0  # the check finds the file mapped nowhere: nothing released
        assert resident_kb(path) >= SIZE // 1024 * 0.9


def test_adjacent_ranges_are_released_in_one_call_and_unmapped_ones_skipped(monkeypatch):
    import litekv.resident_pages as resident_pages

    calls = []

    class Libc:
        @staticmethod
        def madvise(start, length, advice):
            calls.append((start, start + length, advice))
            return 0

    mapped = {(0x1000, 0x3000), (0x3000, 0x4000), (0x8000, 0x9000), (0x9000, 0xA000)}
    monkeypatch.setattr(resident_pages, "_read_only_ranges", lambda target: mapped - {(0x9000, 0xA000)})
    monkeypatch.setattr(resident_pages, "_libc", lambda: Libc)
    released = resident_pages._release("/model.onnx.data", sorted(mapped, reverse=True))
    assert calls == [(0x1000, 0x4000, 4), (0x8000, 0x9000, 4)]  # 0x9000 no longer maps the file
    assert sorted(released) == [(0x1000, 0x3000), (0x3000, 0x4000), (0x8000, 0x9000)]


def test_unwritten_private_mapping_is_sealed_then_released_and_a_written_one_is_left_alone(tmp_path):
    """What ONNX Runtime's external-data mappings look like: private and writable, never written."""
    from litekv.resident_pages import mapped_ranges, seal_unwritten_mappings

    path = tmp_path / "weights.bin"
    data = np.random.default_rng(1).integers(0, 255, SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as clean, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as written:
        np.frombuffer(clean, np.uint8).sum()  # read: resident, not written
        written_view = np.frombuffer(written, np.uint8)
        written_view[::4096] = 7
        assert read_only_mappings(path) == [] and len(mapped_ranges(path)) == 2
        assert seal_unwritten_mappings(path) == 1
        assert len(read_only_mappings(path)) == 1 and resident_kb(path) >= SIZE // 1024 * 0.9
        assert release_file_pages(path) >= SIZE // 1024 * 0.9
        np.testing.assert_array_equal(np.frombuffer(clean, np.uint8), data)  # faults back in, unchanged
        assert np.all(written_view[::4096] == 7)  # the written mapping kept its writes
        del written_view


def test_onnx_prefill_leaves_no_external_data_pages_resident(tmp_path):
    """ONNX Runtime's mappings of model.onnx.data are sealed and given back after each prefill chunk
    and periodically during decode; the model keeps giving the reference's logits."""
    from conformance import MAX_CONTEXT, PREFILL_LENGTHS, checkpoint_dir, reference, relative_error
    from litekv.converters.convert import ConvertOptions, convert
    from litekv.executor import open_executor

    options = ConvertOptions(backend="onnx", max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS)
    bundle = convert(checkpoint_dir("llama"), tmp_path / "bundle", options)
    ex, ref = open_executor(bundle), reference("llama")
    data_file = bundle / "model.onnx.data"
    assert ex.model_pages is not None and ex.model_pages.pages.ranges
    prompt = np.random.default_rng(2).integers(3, ex.config.vocab_size, 13)
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.step([int(prompt[0])], ours)
    ref.step([int(prompt[0])], theirs)
    assert resident_kb(data_file) > 0  # a decode step reads its embedding row from the mapping
    ex.prefill(prompt[1:-1], ours)
    ref.prefill(prompt[1:-1], theirs)
    assert resident_kb(data_file) == 0
    assert relative_error(ex.step([int(prompt[-1])], ours), ref.step([int(prompt[-1])], theirs)) < 1e-4
    ex.model_pages.every_steps = 2
    ex.sample_tokens(1, [6], ours)  # the second step since the prefill's release
    assert resident_kb(data_file) == 0


FREED_BLOCK = """
import ctypes, sys
from litekv import resident_pages
if sys.argv[1] == "pinned":
    assert resident_pages.keep_large_allocations_mapped()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def anon_kb():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon"))
size = 8 << 20
for _ in range(2):  # the first free raises glibc's threshold; the second block then comes from the heap
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
guard = libc.malloc(64)  # keeps the freed block off the heap's top, where glibc would trim it
print(anon_kb())
"""


@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc")
def test_freed_large_blocks_go_back_to_the_system_with_the_threshold_pinned():
    import subprocess

    def anon_kb(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        out = subprocess.run([sys.executable, "-c", FREED_BLOCK, mode], capture_output=True, text=True, env=env,
                             check=True)
        return int(out.stdout.split()[-1])

    assert anon_kb("dynamic") - anon_kb("pinned") > 6 * 1024  # the 8 MB block stayed resident without the pin
