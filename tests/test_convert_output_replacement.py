"""Converting over an existing bundle: the old one stays until the new one, flushed to disk, replaces it."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from conformance import checkpoint_dir
from litekv.bundle import MANIFEST
from litekv.converters.convert import ConvertOptions, convert
from litekv.errors import ConfigError

OLD = ConvertOptions(backend="onnx", max_context=64, prefill_lengths=(8,))
NEW = ConvertOptions(backend="onnx", max_context=32, prefill_lengths=(8,))


def snapshot(bundle: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(bundle.iterdir())}


def max_context(bundle: Path) -> int:
    return json.loads((bundle / MANIFEST).read_text())["max_context"]


@pytest.fixture
def old_bundle(tmp_path) -> tuple[Path, dict[str, str]]:
    out = convert(checkpoint_dir("llama"), tmp_path / "out", OLD)
    (out / "stale.txt").write_text("from the previous conversion")
    return out, snapshot(out)


def fail_rename(monkeypatch, failing) -> list[tuple[str, str]]:
    """Make os.replace raise OSError for the renames `failing(src, dst)` picks; returns every call."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((os.fspath(src), os.fspath(dst)))
        if failing(Path(src), Path(dst)):
            raise OSError(5, "Input/output error (simulated)")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_reconversion_replaces_the_old_bundle(old_bundle, tmp_path):
    out, _ = old_bundle
    assert max_context(out) == 64
    convert(checkpoint_dir("llama"), out, NEW)
    assert max_context(out) == 32
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or aside directory left


def test_failed_final_rename_keeps_the_old_bundle(old_bundle, tmp_path, monkeypatch):
    out, before = old_bundle
    calls = fail_rename(monkeypatch, lambda src, dst: ".partial-" in src.name and dst == out)
    with pytest.raises(ConfigError, match="previous bundle there is unchanged"):
        convert(checkpoint_dir("llama"), out, NEW)
    assert any(".partial-" in Path(src).name and Path(dst) == out for src, dst in calls)  # the failure did happen
    assert snapshot(out) == before
    assert max_context(out) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_rename_aside_keeps_the_old_bundle(old_bundle, tmp_path, monkeypatch):
    out, before = old_bundle
    fail_rename(monkeypatch, lambda src, dst: src == out)
    with pytest.raises(ConfigError, match="renaming it aside failed"):
        convert(checkpoint_dir("llama"), out, NEW)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="maps file descriptors to paths through /proc")
def test_every_file_and_the_directories_are_flushed_before_and_after_the_rename(old_bundle, tmp_path, monkeypatch):
    out, _ = old_bundle
    real_fsync, real_replace, events = os.fsync, os.replace, []

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    convert(checkpoint_dir("llama"), out, NEW)
    publish = next(i for i, e in enumerate(events)
                   if e[0] == "replace" and ".partial-" in Path(e[1]).name and Path(e[2]) == out)
    staging = Path(events[publish][1]).resolve()
    flushed_before = {Path(e[1]) for e in events[:publish] if e[0] == "fsync"}
    # onnx.save_model writes model.onnx, model.onnx.data and sampler.onnx without fsync of its own
    assert {staging / p.name for p in out.iterdir()} | {staging} <= flushed_before
    assert ("fsync", str(tmp_path.resolve())) in events[publish + 1:]


def test_output_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "notes"
    target.write_text("keep me")
    with pytest.raises(ConfigError, match="not a directory"):
        convert(checkpoint_dir("llama"), target, OLD)
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
