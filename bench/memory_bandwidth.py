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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_PROC_BIND": "close"}
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for mib in SIZES_MIB:
            for ahead in PREFETCH_FLOATS:
                out = subprocess.run([str(binary), str(mib), str(args.repeats), str(ahead)], env=env,
                                     capture_output=True, text=True, check=True)
                result = json.loads(out.stdout)
                results.append(result)
                rows.append([f"{mib * 1.048576:.0f} MB", "yes" if ahead else "no", f"{result['gb_s']:.1f}"])
    print(markdown_table(["array", "software prefetch", "read GB/s (best of repeats)"], rows))
    save("memory_bandwidth", {"threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
