"""The decode-attention kernel outside any model, over an int8 cache (or `--cache float32 / float16`):
its time per call with the cache in L2, in the L3 or coming from memory, on one and two threads,
beside one core reading the same bytes and, for int8, the time one core needs for the kernel's
dot-product instructions alone.

This separates the kernel's arithmetic (the cache in L2) from its misses (from memory), and both
from what a call inside the model adds (`bench/attention_threads.py`). Compiles
bench/kernel_cache_levels.c against litekv/kernels with the flags pyproject.toml builds them with
(needs a C compiler). SmolLM2 shapes: 9 query and 3 KV heads, head_dim 64.

`--layout head-major` runs an int8 cache as ONNX bundles keep it ([KV head][slot][D]) rather than as
LiteRT's ([slot][KV head][D]). Caches are on transparent huge pages where the system allows them,
as a runtime's KVCache is.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/kernel_cache_levels.py [--cache float16] [--slots 384]
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
SOURCE = Path(__file__).with_name("kernel_cache_levels.c")
DRIVER_CACHE_ARGUMENT = {"int8": [], "float32": ["float"], "float16": ["f16"]}
DOT_PATHS = {0: "no", 1: "AVX2 vpmaddwd", 2: "AVX-512 VNNI"}  # attention_common.h's Int8Dot
LEVELS = (("L2 (one layer repeated)", 1, 1, 3000), ("L3 (30 layers)", 1, 30, 200), ("memory (8 × 30 layers)", 8, 30, 200))


def build(directory: Path) -> Path:
    extension = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["ext-modules"][0]
    kernels = ROOT / "litekv" / "kernels"
    sources = [str(ROOT / s) for s in extension["sources"] if not s.endswith("decode_attention.c")]  # included
    return compile_c(directory / "kernel_cache_levels", *extension["extra-compile-args"], "-w", "-Wno-psabi",
                     f"-I{kernels}", str(SOURCE), *sources, "-lm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", choices=tuple(DRIVER_CACHE_ARGUMENT), default="int8", help="the cache's element type")
    parser.add_argument("--layout", choices=("rows", "head-major"), default="rows",
                        help="rows: [slot][KV head][D] (LiteRT); head-major: [KV head][slot][D] (ONNX; int8 only)")
    args = parser.parse_args()
    if args.layout == "head-major" and args.cache != "int8":
        parser.error("--layout head-major runs an int8 cache only (float caches take rows in the driver)")
    cache_argument = ["head-major"] if args.layout == "head-major" else DRIVER_CACHE_ARGUMENT[args.cache]
    runs: dict[tuple, list[dict]] = {(name, threads): [] for name, *_ in LEVELS for threads in (1, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for _ in range(args.rounds):
            for name, sets, layers, repeats in LEVELS:
                for threads in (1, 2):
                    command = [str(binary), str(args.slots), str(threads), str(sets), str(layers), str(repeats)]
                    out = subprocess.run(command + cache_argument, capture_output=True, text=True,
                                         check=True)
                    runs[(name, threads)].append(json.loads(out.stdout))
    rows, results = [], []
    for (name, threads), got in runs.items():
        layers = got[0]["layers"]
        per_call = statistics.median(r["kernel_ms"] for r in got) * 1e3 / layers
        read = statistics.median(r["read_ms"] for r in got) * 1e3 / layers
        rows.append([name, threads, f"{per_call:.1f}", f"{read:.1f}" if threads == 1 else "",
                     DOT_PATHS[got[0]["int8_dot"]]])
        results.append({"level": name, "threads": threads, "kernel_us_per_call": per_call,
                        "one_core_read_us_per_call": read, "runs": got})
    # The integer path issues slots x heads x head_dim / 16 512-bit dot-product instructions per call:
    # two digits of the query against 4 key bytes each, and int16 numerators against value pairs.
    every = [r for got in runs.values() for r in got]
    rate = max(r["vnni_per_second"] for r in every)  # the best: a floor must not be noisy; 0 for a float cache
    instructions = args.slots * every[0]["heads"] * every[0]["head_dim"] // 16
    floor = 1e6 * instructions / rate if rate else None
    if floor:
        print(f"one core retires {rate / 1e9:.2f} G vpdpbusd/vpdpwssd per second: the kernel's {instructions:,} per "
              f"call take at least {floor:.1f} µs on one core")
    print(f"{args.slots} slots, {args.cache} cache ({args.layout}), µs per call (median of {args.rounds} "
          "rounds of best-of):")
    print(markdown_table(["cache in", "kernel threads", "kernel µs per call", "one core reading the same bytes, µs",
                          "integer dot products"], rows))
    save("kernel_cache_levels" + {"int8": "", "float32": "_float", "float16": "_float16"}[args.cache]
         + ("_head_major" if args.layout == "head-major" else ""),
         {"slots": args.slots, "rounds": args.rounds, "cache": args.cache, "layout": args.layout,
          "dot_products_per_second": rate, "dot_products_per_call": instructions, "arithmetic_floor_us": floor,
          "results": results})


if __name__ == "__main__":
    main()
