"""The x86-64 CPU flags from /proc/cpuinfo, for tests that check which kernel path runs."""
from __future__ import annotations

from pathlib import Path

from litekv.native_attention import max_isa


def cpu_flags(capped: bool = True) -> set[str]:
    """The CPU's flags, empty where /proc/cpuinfo gives none. capped: as the kernels see them, with
    what LITEKV_MAX_ISA takes away (AVX-512's under "avx2", AVX2's too under "baseline")."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    flags = set(next((line.split(":", 1)[1] for line in lines if line.startswith("flags")), "").split())
    cap = max_isa() if capped else "avx512"
    if cap != "avx512":
        flags = {flag for flag in flags if not flag.startswith("avx512")}
    if cap == "baseline":
        flags -= {"avx2", "fma", "f16c"}
    return flags
