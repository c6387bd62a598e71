"""Give back the resident pages of read-only file mappings this process no longer reads.

After LiteRT compiles a model, XNNPACK runs on its own packed copy of the weights, but the pages of
the model file that were read while packing stay counted in the process's memory (76 MB for the
SmolLM2 int8 bundle). Dropping them from this process is safe for read-only mappings: the data is
unchanged on disk and in the page cache, and a page that is read again faults back in.

The model's embedding rows are read from that mapping too, and the kernel maps 64 KB around each
row it faults in, so each prefill would leave the mapping a little more resident (51 MB of the
fp32 SmolLM2 file after a 1,024-token prompt), and so would a long run of decode steps; the
executor releases it after each prefill chunk and every few hundred steps.

ONNX Runtime maps its external weights file privately and writable, one mapping per initializer,
though it never writes them. Dropping a private page that was written would lose the write, so
such mappings are first made read-only, and only if none of their pages was written (smaps
`Anonymous: 0`): a later write would then fault instead of being lost.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

_MADV_DONTNEED = 4
RELEASE_EVERY_STEPS = 256  # decode steps between releases of a model file's pages
_PROT_READ = 1
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")


class Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    name: str  # file path or region such as [heap]
    rss_kb: int
    written_kb: int | None  # private pages copied on write (smaps "Anonymous")


def mappings() -> list[Mapping]:
    """Every mapping of this process, from /proc/self/smaps; empty where there is no /proc (not Linux).
    `written_kb` is None where the kernel does not report it."""
    found, fields = [], None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                match = _MAPPING.match(line)
                if match:
                    if fields:
                        found.append(Mapping(*fields))
                    start, end, perms, name = match.groups()
                    fields = [int(start, 16), int(end, 16), perms, name, 0, None]
                elif fields and line.startswith("Rss:"):
                    fields[4] = int(line.split()[1])
                elif fields and line.startswith("Anonymous:"):
                    fields[5] = int(line.split()[1])
    except OSError:
        return []
    if fields:
        found.append(Mapping(*fields))
    return found


def read_only_mappings(path: str | os.PathLike) -> list[tuple[int, int, int]]:
    """(start, end, resident kB) of every read-only mapping of `path` in this process."""
    target = str(Path(path).resolve())
    return [(m.start, m.end, m.rss_kb) for m in mappings() if m.name == target and "w" not in m.perms]


def seal_unwritten_mappings(path: str | os.PathLike, exclude: Iterable[tuple[int, int]] = ()) -> int:
    """Make this process's private writable mappings of `path` read-only where none of their pages
    was written (see the module notes); `exclude` as for FileMappings. Returns how many were sealed."""
    return len(_seal_unwritten(mappings(), str(Path(path).resolve()), set(exclude)))


def _seal_unwritten(found: list[Mapping], target: str, skipped: set) -> list[tuple[int, int]]:
    if not sys.platform.startswith("linux"):
        return []
    return [(m.start, m.end) for m in found
            if m.name == target and m.perms.startswith("rw") and m.perms.endswith("p") and m.written_kb == 0
            and (m.start, m.end) not in skipped and _libc().mprotect(m.start, m.end - m.start, _PROT_READ) == 0]


def mapped_ranges(path: str | os.PathLike) -> list[tuple[int, int]]:
    """(start, end) of every mapping of `path` in this process, whatever its permissions."""
    target = str(Path(path).resolve())
    return [(m.start, m.end) for m in mappings() if m.name == target]


def release_file_pages(path: str | os.PathLike) -> int:
    """Drop this process's resident pages of read-only mappings of `path`; returns the kB released."""
    mappings = read_only_mappings(path)
    resident = {(start, end): kb for start, end, kb in mappings if kb}
    released = _release(str(Path(path).resolve()), list(resident))
    return sum(resident[r] for r in released)


class FileMappings:
    """The read-only mappings of one file, found once, whose pages can be given back again and
    again at the cost of reading /proc/self/maps and an madvise per run of adjacent mappings
    (parsing smaps takes about 10 ms).

    `exclude`: ranges that are not ours, such as another model's mapping of the same file, taken
    before our model mapped it. A range is released only while /proc/self/maps says it still maps
    the file read-only, so a range unmapped since is skipped; keep the mapping's owner alive while
    calling `release`, so nothing else can be mapped there between that check and the madvise.
    `seal_unwritten`: first make the file's unwritten private writable mappings read-only and
    include them (see `seal_unwritten_mappings`), from the same reading of smaps.
    """

    def __init__(self, path: str | os.PathLike, exclude: Iterable[tuple[int, int]] = (),
                 seal_unwritten: bool = False):
        self.target = str(Path(path).resolve())
        skipped, found = set(exclude), mappings()
        self.ranges = [(m.start, m.end) for m in found
                       if m.name == self.target and "w" not in m.perms and (m.start, m.end) not in skipped]
        if seal_unwritten:
            self.ranges += _seal_unwritten(found, self.target, skipped)

    def release(self) -> None:
        _release(self.target, self.ranges)


class ModelFilePages:
    """A model file's pages given back after loading, before and after each prefill chunk and every
    `every_steps` decode steps (each step reads one embedding row, and the kernel maps 64 KB around
    it: 200 SmolLM2 fp32 steps left 14 MB resident). `guard` runs a release while the mappings'
    owner is kept open (see FileMappings).

    `prefill_only`: mappings only prefill reads, given back when a prefill ends. With a LiteRT
    bundle's decode linears in litekv's kernels, decode reads the weights in the model file and
    prefill XNNPACK's packed copy of them, so each phase gives the other's pages back and the two
    copies are never resident together.

    `once`: give the pages back after loading only. Where every step reads the whole embedding table
    from the file (an fp32 LM head in litekv's op), the rows a prefill gathers are among pages the next
    step needs anyway, and giving them back made each prefill refault 113 MB (SmolLM2 fp32: 256-token
    prefill 2-4 % slower)."""

    def __init__(self, pages: FileMappings, every_steps: int = RELEASE_EVERY_STEPS,
                 guard: Callable[[Callable[[], None]], None] = lambda release: release(),
                 prefill_only: FileMappings | None = None, once: bool = False):
        self.pages, self.every_steps, self.guard, self.prefill_only = pages, every_steps, guard, prefill_only
        self.steps_since_release = 0
        self.guard(self.pages.release)
        self.once = once

    def release(self) -> None:
        self.steps_since_release = 0
        if not self.once:
            self.guard(self.pages.release)

    def release_after_steps(self) -> None:
        """A release if decode steps ran since the last one; prefill chunks release after themselves."""
        if self.steps_since_release:
            self.release()

    def prefill_done(self) -> None:
        if self.prefill_only is not None:
            self.guard(self.prefill_only.release)

    def count_steps(self, steps: int) -> None:
        self.steps_since_release += steps
        if self.steps_since_release >= self.every_steps:
            self.release()


def _release(target: str, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """madvise(DONTNEED) on each range that still maps `target` read-only; returns the ranges released.

    One reading of /proc/self/maps checks them all, and ranges next to each other go in one call:
    ONNX Runtime maps each initializer on its own, 852 mappings for the int4 SmolLM2 file, and a
    readlink of /proc/self/map_files and an madvise for each took 5.5-7.5 ms, twice per prefill."""
    if not ranges or not sys.platform.startswith("linux"):
        return []
    mapped = _read_only_ranges(target)
    released, span = [], []
    for start, end in sorted(r for r in ranges if r in mapped) + [(-1, -1)]:
        if span and start != span[-1][1]:  # the span ends: give it back in one call
            if _libc().madvise(span[0][0], span[-1][1] - span[0][0], _MADV_DONTNEED) == 0:
                released += span
            span = []
        span.append((start, end))
    return released


def _read_only_ranges(target: str) -> set[tuple[int, int]]:
    """(start, end) of the mappings of `target` that are not writable, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return set()
    found = set()
    for line in text.splitlines():
        if line.endswith(target) or line.endswith(target + " (deleted)"):
            addresses, perms = line.split(" ", 2)[:2]
            if "w" not in perms and line.split(maxsplit=5)[5] in (target, target + " (deleted)"):
                start, end = addresses.split("-")
                found.add((int(start, 16), int(end, 16)))
    return found


_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value


@functools.lru_cache(maxsize=1)
def keep_large_allocations_mapped() -> bool:
    """Pin glibc's mmap threshold at its starting 128 KB, for this whole process; returns whether it
    was set. glibc raises the threshold each time a mapped block is freed, up to 32 MB, after which
    such blocks come from the heap and stay resident once freed. ONNX Runtime's per-chunk
    activations and numpy's temporaries then grew an ONNX int4 SmolLM2 process's heap by 58 MB over
    a few prefills and decodes (peak RSS 368 MB against 309 with the threshold pinned; LiteRT int4
    327 against 311), with prefill and decode as fast. Left alone where the user set
    MALLOC_MMAP_THRESHOLD_ (glibc's own variable) and where the C library is not glibc."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = _libc().mallopt
    except AttributeError:
        return False
    return bool(os.confstr("CS_GNU_LIBC_VERSION")) and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
