"""XNNPACK's weight cache file: XNNPACK writes it at its final path, so a load killed midway can
leave a partial file there. XNNPACK validates the header (version, build id, buffer list within
the file size) and rebuilds an invalid file: such a file must never change the logits."""
from __future__ import annotations

import numpy as np
import pytest

from conformance import bundle
from litekv.bundle import read_manifest
from litekv.executor import open_executor
from litekv.executor.litert_executor import xnnpack_cache_file

ARCH = "llama"


def logits(cache_root, monkeypatch):
    monkeypatch.setenv("LITEKV_CACHE", str(cache_root))
    ex = open_executor(bundle(ARCH, "litert"))
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(3, 9), cache)
    out = ex.step(np.array([5]), cache).copy()
    del cache, ex
    return out


def cache_path(cache_root, monkeypatch):
    monkeypatch.setenv("LITEKV_CACHE", str(cache_root))
    b = bundle(ARCH, "litert")
    manifest = read_manifest(b)
    return xnnpack_cache_file(b / manifest.model_file, manifest.fingerprint)


@pytest.fixture(scope="module")
def valid_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("xnn-fresh")
        expected = logits(root, mp)
        return expected, cache_path(root, mp).read_bytes()


@pytest.mark.parametrize("damage", ["garbage", "empty", "header-only", "half", "last-byte-missing"])
def test_a_partial_or_garbage_cache_file_is_rebuilt(damage, valid_cache, tmp_path, monkeypatch):
    expected, good = valid_cache
    assert len(good) > 4096
    path = cache_path(tmp_path, monkeypatch)
    path.write_bytes({"garbage": np.random.default_rng(0).bytes(len(good)), "empty": b"",
                      "header-only": good[:64], "half": good[:len(good) // 2],
                      "last-byte-missing": good[:-1]}[damage])
    np.testing.assert_array_equal(logits(tmp_path, monkeypatch), expected)
    assert path.read_bytes() == good  # rebuilt in place, complete
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files


def test_a_valid_cache_file_is_reused(valid_cache, tmp_path, monkeypatch):
    expected, good = valid_cache
    path = cache_path(tmp_path, monkeypatch)
    path.write_bytes(good)
    mtime = path.stat().st_mtime_ns
    np.testing.assert_array_equal(logits(tmp_path, monkeypatch), expected)
    assert path.stat().st_mtime_ns == mtime  # mapped, not rewritten
