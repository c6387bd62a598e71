"""Impossible conversion requests fail clearly and leave nothing half-written behind."""
from __future__ import annotations

import json
import os

import pytest

from conformance import checkpoint_dir
from litekv.converters.convert import ConvertOptions, convert, main
from litekv.errors import ConfigError, UnsupportedArchitecture


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("options, message", [
    (dict(max_context=64, prefill_lengths=(32, 128)), "prefill length 128 is above the max context 64"),
    (dict(lora_rank=0), "--lora-rank must be at least 1"),
    (dict(quantize="int3"), "unknown quantization 'int3'"),
    (dict(backend="coreml"), "unknown backend 'coreml'"),
    (dict(max_context=64, prefill_lengths=(8,), kv_buckets=(16, 32)), "must increase and end at the max context 64"),
])
def test_impossible_options(options, message):
    with pytest.raises(ConfigError, match=message):
        ConvertOptions(**options)


def test_unsupported_architecture_leaves_no_bundle(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    out = tmp_path / "out"
    with pytest.raises(UnsupportedArchitecture, match="mamba"):
        convert(source, out, ConvertOptions(max_context=64, prefill_lengths=(8,)))
    assert leftovers(tmp_path) == ["src"]


def test_unwritable_output_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits: use a path under a file instead
            target = tmp_path / "a_file" / "bundle"
            (tmp_path / "a_file").write_text("not a directory")
            with pytest.raises(ConfigError, match="does not exist"):
                convert(checkpoint_dir("llama"), target, ConvertOptions(max_context=64, prefill_lengths=(8,)))
        else:
            with pytest.raises(ConfigError, match="not writable"):
                convert(checkpoint_dir("llama"), locked / "bundle", ConvertOptions(max_context=64, prefill_lengths=(8,)))
    finally:
        locked.chmod(0o700)
    assert leftovers(locked) == []


def test_failure_midway_removes_the_partial_bundle(tmp_path, monkeypatch):
    import litekv.converters.convert as convert_module

    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert_module, "_finish_manifest", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(checkpoint_dir("llama"), tmp_path / "out", ConvertOptions(max_context=64, prefill_lengths=(8,)))
    assert leftovers(tmp_path) == []


def test_refuses_to_overwrite_a_directory_that_is_not_a_bundle(tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a litekv bundle"):
        convert(checkpoint_dir("llama"), out, ConvertOptions(max_context=64, prefill_lengths=(8,)))
    assert (out / "notes.txt").read_text() == "keep me"


def test_cli_reports_errors_with_exit_code(tmp_path, capsys):
    code = main([str(checkpoint_dir("llama")), "-o", str(tmp_path / "b"), "--max-context", "64",
                 "--prefill-lengths", "32,128"])
    assert code == 1
    assert "above the max context" in capsys.readouterr().err
    assert leftovers(tmp_path) == []
