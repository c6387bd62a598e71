"""A conversion over an existing bundle killed midway: the next conversion to the same output puts the
previous bundle back if it is only left aside, and removes the stale copies once the new one is in place.
The kills are real (SIGKILL in a child process), at the points that leave each state on disk."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance import checkpoint_dir
from litekv.bundle import MANIFEST, BundleError, read_manifest
from litekv.converters.convert import convert
from litekv.errors import CheckpointNotFound
from test_convert_output_replacement import NEW, OLD, max_context, snapshot

# Converts NEW over argv[2], killed by SIGKILL at the point argv[3] names.
KILLED_CONVERSION = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    import litekv.converters.convert as c

    source, out, point = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    real_replace, real_rmtree, real_write_atomic = os.replace, shutil.rmtree, c.write_atomic

    def kill_at(here):
        if here == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def replace(src, dst):
        if ".partial-" in Path(src).name and Path(dst) == out:
            kill_at("between-renames")  # the old bundle is aside, the new one not yet in place
        return real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if ".old-" in Path(path).name:
            kill_at("before-removing-aside")  # the new bundle is in place
        return real_rmtree(path, *args, **kwargs)

    def write_atomic(path, data):
        kill_at("while-emitting")  # the manifest is the staged bundle's last file
        return real_write_atomic(path, data)

    os.replace, shutil.rmtree, c.write_atomic = replace, rmtree, write_atomic
    c.convert(source, out, c.ConvertOptions(backend="onnx", max_context=32, prefill_lengths=(8,)))
""")


def killed_conversion(out: Path, point: str) -> None:
    child = subprocess.run([sys.executable, "-c", KILLED_CONVERSION, str(checkpoint_dir("llama")), str(out), point],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr  # killed, not finished or failed


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def asides(tmp_path: Path) -> list[Path]:
    return sorted(p for p in tmp_path.iterdir() if p.name.startswith(".out.old-"))


@pytest.fixture
def old_bundle(tmp_path) -> tuple[Path, dict[str, str]]:
    out = convert(checkpoint_dir("llama"), tmp_path / "out", OLD)
    return out, snapshot(out)


@pytest.fixture
def killed_between_renames(old_bundle, tmp_path) -> tuple[Path, dict[str, str]]:
    out, before = old_bundle
    killed_conversion(out, "between-renames")
    assert not out.exists()
    [aside] = asides(tmp_path)
    assert snapshot(aside) == before  # the state this recovery is for
    return out, before


def test_killed_between_renames_the_next_conversion_replaces_and_tidies(killed_between_renames, tmp_path):
    out, _ = killed_between_renames
    convert(checkpoint_dir("llama"), out, NEW)
    assert max_context(out) == 32
    assert names(tmp_path) == ["out"]  # the aside copy, the killed run's staging and its lock file are gone


def test_killed_between_renames_a_failed_next_conversion_puts_the_previous_bundle_back(killed_between_renames,
                                                                                      tmp_path):
    out, before = killed_between_renames
    with pytest.raises(CheckpointNotFound):
        convert(tmp_path / "no-such-checkpoint", out, NEW)
    assert snapshot(out) == before
    assert max_context(out) == 64
    assert not asides(tmp_path)


def test_killed_before_the_aside_copy_was_removed_it_goes_with_the_next_conversion(old_bundle, tmp_path):
    out, _ = old_bundle
    killed_conversion(out, "before-removing-aside")
    assert max_context(out) == 32 and len(asides(tmp_path)) == 1
    convert(checkpoint_dir("llama"), out, OLD)
    assert max_context(out) == 64
    assert names(tmp_path) == ["out"]


def test_killed_while_emitting_the_staged_directory_goes_with_the_next_conversion(old_bundle, tmp_path):
    out, before = old_bundle
    killed_conversion(out, "while-emitting")
    assert snapshot(out) == before
    assert any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())
    convert(checkpoint_dir("llama"), out, NEW)
    assert max_context(out) == 32
    assert names(tmp_path) == ["out"]


def move_aside(bundle: Path, suffix: str) -> Path:
    aside = bundle.parent / f".{bundle.name}.old-{suffix}"
    os.replace(bundle, aside)
    return aside


def test_with_two_complete_aside_copies_neither_is_guessed(old_bundle, tmp_path):
    out, before = old_bundle
    shutil.copytree(out, tmp_path / ".out.old-aaaaaaaa")
    move_aside(out, "bbbbbbbb")
    with pytest.raises(CheckpointNotFound):
        convert(tmp_path / "no-such-checkpoint", out, NEW)
    assert not out.exists()
    assert [snapshot(p) for p in asides(tmp_path)] == [before, before]  # both kept
    convert(checkpoint_dir("llama"), out, NEW)
    assert names(tmp_path) == ["out"]  # once the new bundle is in place, both were stale


@pytest.mark.parametrize("damage", ["empty", "file-missing", "file-truncated", "no-manifest"])
def test_an_incomplete_aside_copy_is_not_put_back(damage, old_bundle, tmp_path):
    out, _ = old_bundle
    aside = move_aside(out, "cccccccc")
    victim = next(p for p in sorted(aside.iterdir()) if p.name != MANIFEST)
    if damage == "empty":
        shutil.rmtree(aside)
        aside.mkdir()
    elif damage == "file-missing":
        victim.unlink()
    elif damage == "file-truncated":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        (aside / MANIFEST).unlink()
    with pytest.raises(CheckpointNotFound):
        convert(tmp_path / "no-such-checkpoint", out, NEW)
    assert not out.exists()
    assert aside.exists()


def test_only_this_outputs_own_directories_are_removed(old_bundle, tmp_path):
    out, _ = old_bundle
    keep = [".out.old-by-hand", ".out.old-", ".outer.old-dddddddd", ".other.partial-eeeeeeee",
            "out.old-ffffffff", ".out.partial-ABCDEFGH"]
    for name in keep:
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("not the converter's")
    (tmp_path / ".out.old-gggggggg").write_text("a file, not a directory")
    convert(checkpoint_dir("llama"), out, NEW)
    assert names(tmp_path) == sorted(keep + [".out.old-gggggggg", "out"])


def test_a_staging_directory_in_use_by_another_conversion_is_kept(old_bundle, tmp_path):
    out, _ = old_bundle
    live = tmp_path / ".out.partial-hhhhhhhh"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a conversion that is still emitting holds its staging directory
        convert(checkpoint_dir("llama"), out, NEW)
        assert live.is_dir()
    finally:
        os.close(fd)
    convert(checkpoint_dir("llama"), out, OLD)
    assert names(tmp_path) == ["out"]


def test_opening_the_missing_bundle_can_say_where_the_previous_one_is(killed_between_renames, tmp_path):
    from litekv.bundle_swap import interrupted_conversion_hint

    out, _ = killed_between_renames
    [aside] = asides(tmp_path)
    hint = interrupted_conversion_hint(out)
    assert "interrupted `litekv convert`" in hint and f"mv {aside} {out}" in hint
    with pytest.raises(BundleError) as opened:  # what a user opening the bundle sees
        read_manifest(out)
    assert str(opened.value).endswith(hint)
    shutil.copytree(aside, tmp_path / ".out.old-zzzzzzzz")
    assert interrupted_conversion_hint(out) == ""  # two copies: no guess
    assert interrupted_conversion_hint(tmp_path / "never-converted") == ""
