"""The directories `litekv convert` makes beside an output bundle while it replaces it, and what an
interrupted conversion left of them.

A conversion assembles the new bundle in `.<name>.partial-XXXXXXXX`, renames an existing bundle aside
to `.<name>.old-XXXXXXXX`, renames the new one into place, then deletes the aside copy. Killed between
the two renames, it leaves no bundle at the output path and the previous one complete under its
aside name; killed later, stale copies. Only names of exactly this form belong to the conversion
(the suffix is what tempfile.mkdtemp appends): nothing else beside the output is ever touched.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from litekv.bundle import BundleError, read_manifest

STAGING = "partial"
ASIDE = "old"


def parent_of(output: Path) -> Path:
    """The directory the output's staging and aside copies are made in."""
    return Path(output).resolve().parent


def prefix(output: Path, kind: str) -> str:
    """The name prefix of the output's `kind` (STAGING or ASIDE) directories, for tempfile.mkdtemp."""
    return f".{Path(output).name}.{kind}-"


def lock_file(output: Path) -> Path:
    """The lock that one conversion at a time holds while it replaces `output` or tidies beside it."""
    return parent_of(output) / f".{Path(output).name}.lock"


def copies(output: Path, kind: str) -> list[Path]:
    """The output's `kind` directories (STAGING or ASIDE) beside it, sorted by name."""
    pattern = re.compile(re.escape(prefix(output, kind)) + r"[a-z0-9_]{8}")
    return sorted(p for p in parent_of(output).iterdir()
                  if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def is_complete(bundle: Path) -> bool:
    """Whether `bundle` has a valid manifest and every file it lists, at the size it lists."""
    try:
        manifest = read_manifest(bundle)
    except BundleError:
        return False
    return all((bundle / name).is_file() and (bundle / name).stat().st_size == size
               for name, size in manifest.file_sizes.items())


def previous_bundle(output: Path) -> Path | None:
    """The bundle an interrupted conversion left aside, if `output` is missing and exactly one
    complete aside copy is there (with several, which was the last cannot be told)."""
    if Path(output).exists() or Path(output).is_symlink():
        return None
    complete = [p for p in copies(output, ASIDE) if is_complete(p)]
    return complete[0] if len(complete) == 1 else None


def interrupted_conversion_hint(output: Path) -> str:
    """A sentence for the error of opening a missing bundle: where an interrupted conversion left the
    previous one and how to get it back; empty if there is none."""
    try:
        previous = previous_bundle(output)
    except OSError:  # the parent directory cannot be listed
        return ""
    if previous is None:
        return ""
    return (f" An interrupted `litekv convert` left the previous bundle at {previous}: rename it back with "
            f"`mv {shlex.quote(str(previous))} {shlex.quote(str(output))}`, or convert to {output} again, which "
            "puts it back first.")
