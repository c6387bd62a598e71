"""What this machine's memory sustains for reads, as the yardstick for the decode kernels.

Compiles bench/memory_bandwidth.c (a 2-thread AVX2 read loop built for this CPU; needs a C compiler, which the
llama.cpp peer build needs too) and reads arrays the size of SmolLM2's int8 weights (134 MB), its
fp32 weights (540 MB) and a larger one, without and with software prefetch. An array that fits the
L3 (`lscpu` gives its size) partly comes from cache; the 540 MB figure is the DRAM rate an fp32
decode step meets.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/memory_bandwidth.py
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from common import compile_c, markdown_table, save

SOURCE = Path(__file__).with_name("memory_bandwidth.c")
SIZES_MIB = (128, 515, 1024)  # 134 MB (int8 weights), 540 MB (fp32 weights), 1.07 GB
PREFETCH_FLOATS = (0, 4096)


def build(directory: Path) -> Path:
    return compile_c(directory / "memory_bandwidth", "-O3", "-march=native", "-fopenmp", str(SOURCE))


def read_rate(binary: Path, mib: int, repeats: int, ahead: int = 0, threads: int = 2) -> dict:
    """The built loop's best read rate over `repeats` passes of a `mib` MiB array."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "close"}
    out = subprocess.run([str(binary), str(mib), str(repeats), str(ahead)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def read_rates(sizes_mib: tuple[int, ...] = SIZES_MIB, prefetch: tuple[int, ...] = PREFETCH_FLOATS,
               threads: int = 2, repeats: int = 20) -> list[dict]:
    """One result per (array size, prefetch distance): the best read rate of `repeats` passes."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        return [read_rate(binary, mib, repeats, ahead, threads) for mib in sizes_mib for ahead in prefetch]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    results = read_rates(threads=args.threads, repeats=args.repeats)
    rows = [[f"{r['mib'] * 1.048576:.0f} MB", "yes" if r["prefetch_floats"] else "no", f"{r['gb_s']:.1f}"]
            for r in results]
    print(markdown_table(["array", "software prefetch", "read GB/s (best of repeats)"], rows))
    save("memory_bandwidth", {"threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
