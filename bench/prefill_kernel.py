"""The prefill-attention kernel outside any model: µs per call of a SmolLM2 chunk (9 query and 3 KV
heads, head_dim 64) against a 4,096-slot cache, at the start of the cache and after a prefix, on one
and two threads, with the AVX2 path and the portable one alternating in one process (where the CPU
has AVX2 and not AVX-512; elsewhere only the path it runs).

Compiles bench/prefill_kernel.c against litekv/kernels with the flags pyproject.toml builds them
with (needs a C compiler). Run it under the CPU lock on a shared machine:

    flock /tmp/litekv-cpu.lock python bench/prefill_kernel.py [--cache f32 f16 i8 i8rows] [--layout litert onnx]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import tomllib
from pathlib import Path

from common import compile_c, markdown_table, save

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).with_name("prefill_kernel.c")


def build(directory: Path) -> Path:
    extension = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"][0]
    kernels = ROOT / "litekv" / "kernels"
    sources = [str(ROOT / s) for s in extension["sources"] if "prefill_attention" in s]
    return compile_c(directory / "prefill_kernel", *extension["extra-compile-args"], "-w", "-Wno-psabi",
                     f"-I{kernels}", str(SOURCE), *sources, "-lm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--first", type=int, nargs="+", default=[0, 768], help="the chunk's first slot")
    parser.add_argument("--cache", nargs="+", choices=("f32", "f16", "i8", "i8rows"), default=["f32"])
    parser.add_argument("--layout", nargs="+", choices=("litert", "onnx"), default=["litert"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for cache in args.cache:
            for layout in args.layout:
                for first in args.first:
                    for threads in (1, 2):
                        command = [str(binary), str(args.slots), str(first), str(args.tokens), str(threads),
                                   str(args.repeats), str(args.rounds), cache, layout]
                        got = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
                        portable = statistics.median(got["portable_us"])
                        avx2 = statistics.median(got["avx2_us"]) if "avx2_us" in got else None
                        rows.append([cache, layout, first, threads, f"{portable:.0f}",
                                     "" if avx2 is None else f"{avx2:.0f}",
                                     "" if avx2 is None else f"{portable / avx2:.1f}",
                                     f"{got.get('max_difference', 0):.2g}"])
                        results.append({"cache": cache, "layout": layout, "first": first, "threads": threads,
                                        "tokens": args.tokens, "slots": args.slots, **got})
    print(markdown_table(["cache", "layout", "first slot", "threads", "portable µs", "AVX2 µs", "speed-up",
                          "max |difference|"], rows))
    print(f"saved {save('prefill_kernel', {'runs': results})}")


if __name__ == "__main__":
    main()
