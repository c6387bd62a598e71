"""Processes opening one LiteRT bundle for the first time at once: one builds XNNPACK's weight cache
under the lock beside it (<cache>.lock), the others wait and map the finished file. The cache file
appears only complete, by a rename."""
from __future__ import annotations

import fcntl
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conformance import bundle
from litekv.bundle import read_manifest
from litekv.executor import open_executor
from litekv.executor.litert_executor import xnnpack_cache_file

ARCH = "llama"
SLOW_BUILD = 1.5  # seconds added to a first open, as a large model's takes


def lock_of(cache: Path) -> Path:
    return cache.with_name(cache.name + ".lock")


def cache_path(cache_root: Path, monkeypatch) -> Path:
    monkeypatch.setenv("LITEKV_CACHE", str(cache_root))
    b = bundle(ARCH, "litert")
    manifest = read_manifest(b)
    return xnnpack_cache_file(b / manifest.model_file, manifest.fingerprint)


def first_logits(bundle_dir: Path) -> np.ndarray:
    ex = open_executor(bundle_dir)
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(3, 9), cache)
    return ex.step(np.array([5]), cache).copy()


def slow_open(bundle_dir: str, cache_root: str, start, building: str, finish, results) -> None:
    """In a child: open the bundle once `start` fires, a weight cache build taking SLOW_BUILD seconds
    more; after XNNPACK has written the file, the build is held open, marked by the file `building`,
    until `finish` fires. Reports whether this process built the cache, and the logits."""
    from litekv.executor import litert_executor

    os.environ["LITEKV_CACHE"] = cache_root
    manifest = read_manifest(bundle_dir)
    final = xnnpack_cache_file(Path(bundle_dir) / manifest.model_file, manifest.fingerprint)
    built = []

    class SlowlyBuilt(litert_executor.CompiledTFLiteModel):
        def __init__(self, *args, **kwargs):
            built.append(not final.exists())
            if built[-1]:
                time.sleep(SLOW_BUILD)
            super().__init__(*args, **kwargs)
            if built[-1]:
                Path(building).touch()
                finish.wait(timeout=120)

    litert_executor.CompiledTFLiteModel = SlowlyBuilt
    start.wait()
    results.put((os.getpid(), built, first_logits(Path(bundle_dir))))


@pytest.fixture
def start_openers():
    """Starts `count` children running slow_open; ends them all after the test, whatever happened."""
    context = multiprocessing.get_context("spawn")  # no fork of a process with LiteRT's threads
    started = []

    def start(count: int, cache_root: Path, building: Path):
        go, finish, results = context.Event(), context.Event(), context.Queue()
        children = [context.Process(target=slow_open, args=(str(bundle(ARCH, "litert")), str(cache_root), go,
                                                            str(building), finish, results)) for _ in range(count)]
        for child in children:
            child.start()
        started.append((children, finish))
        return children, go, finish, results

    yield start
    for children, finish in started:
        finish.set()
        for child in children:
            child.join(timeout=120)
            if child.is_alive():
                child.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[np.ndarray, bytes]:
    """Logits and weight cache file of one process opening the bundle alone."""
    with pytest.MonkeyPatch.context() as mp:
        path = cache_path(tmp_path_factory.mktemp("xnn-alone"), mp)
        return first_logits(bundle(ARCH, "litert")), path.read_bytes()


def test_two_processes_opening_at_once_build_the_cache_once(reference, tmp_path, monkeypatch, start_openers):
    expected, good = reference
    path = cache_path(tmp_path, monkeypatch)
    children, start, finish, results = start_openers(2, tmp_path, tmp_path / "building")
    finish.set()
    start.set()
    reports = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sorted(built for _pid, [built], _logits in reports) == [False, True]  # one built, one reused
    for _pid, _built, logits in reports:
        np.testing.assert_array_equal(logits, expected)
    assert path.read_bytes() == good  # complete, and as one process alone builds it
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no lock or temporary file left


def test_the_cache_file_appears_only_once_complete(reference, tmp_path, monkeypatch, start_openers):
    expected, good = reference
    path = cache_path(tmp_path, monkeypatch)
    building = tmp_path / "building"
    children, start, finish, results = start_openers(1, tmp_path, building)
    start.set()
    deadline = time.monotonic() + 120
    while not building.exists():  # XNNPACK has written the cache; the build is not over
        assert time.monotonic() < deadline and children[0].is_alive()
        time.sleep(0.01)
    assert not path.exists()  # written under another name
    finish.set()
    _pid, _built, logits = results.get(timeout=120)
    children[0].join(timeout=60)
    np.testing.assert_array_equal(logits, expected)
    assert path.read_bytes() == good


def test_an_open_waits_while_another_process_holds_the_lock(reference, tmp_path, monkeypatch):
    expected, good = reference
    path = cache_path(tmp_path, monkeypatch)
    done: list = []
    fd = os.open(lock_of(path), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as another process building the cache does
        opener = threading.Thread(target=lambda: done.append(first_logits(bundle(ARCH, "litert"))))
        opener.start()
        opener.join(timeout=2.0)
        assert opener.is_alive() and not done
        assert not path.exists()
    finally:
        os.close(fd)
    opener.join(timeout=120)
    assert not opener.is_alive()
    np.testing.assert_array_equal(done[0], expected)
    assert path.read_bytes() == good


def test_a_killed_builders_temporary_file_and_lock_file_are_not_in_the_way(reference, tmp_path, monkeypatch):
    expected, good = reference
    path = cache_path(tmp_path, monkeypatch)
    lock_of(path).write_bytes(b"")  # its holder died: the lock is free, the file stays
    leftover = path.with_name(path.name + ".partial")
    leftover.write_bytes(good[:len(good) // 2])
    np.testing.assert_array_equal(first_logits(bundle(ARCH, "litert")), expected)
    assert path.read_bytes() == good
    assert [p.name for p in path.parent.iterdir()] == [path.name]
