"""int8 KV caches on AVX2: the decode kernel's integer path (vpmaddwd on the codes) against the
same AVX2 path with the codes widened to floats, in one process, in the model.

An int4 SmolLM2 bundle with its default int8 cache decodes rewound steps at 64 and 2,048 live
tokens; the two paths take turns every measurement (litekv_decode_avx2_allow 1 and 2), so a slow
phase of the machine hits both. Reports each path's step times and 2,048 / 64 ratio. Needs a CPU
that takes the AVX2 path (AVX2, FMA and F16C, no AVX-512).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/attention_integer.py [--backend litert onnx]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

import numpy as np

from common import markdown_table, rewound_step_seconds, save, smollm2_bundle
from litekv import native_attention
from litekv.executor import open_executor

PATHS = {1: "integer (vpmaddwd)", 2: "codes widened to floats"}
SHORT, LONG = 64, 2048


def measure(backend: str, rounds: int, steps: int) -> list[list]:
    allow = native_attention._load().litekv_decode_avx2_allow
    allow.argtypes, allow.restype = [ctypes.c_int], ctypes.c_int
    if not allow(1):
        raise SystemExit("this CPU takes no AVX2 decode path")
    ex = open_executor(smollm2_bundle(backend, "int4", kv_cache="int8"), threads=2)
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(LONG - 1) % 40000 + 100, cache)
    samples = {mode: {SHORT: [], LONG: []} for mode in PATHS}
    try:
        for _ in range(rounds):
            for mode in PATHS:
                allow(mode)
                for live in (SHORT, LONG):
                    samples[mode][live].append(1e3 * rewound_step_seconds(ex, cache, live - 1, steps))
    finally:
        allow(1)
    rows = []
    for mode, times in samples.items():
        ratio = statistics.median(long / short for short, long in zip(times[SHORT], times[LONG]))
        rows.append([backend, PATHS[mode], f"{statistics.median(times[SHORT]):.2f}",
                     f"{statistics.median(times[LONG]):.2f}", f"{ratio:.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", default=["litert", "onnx"], choices=("litert", "onnx"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="steps per measurement")
    args = parser.parse_args()
    rows = [row for backend in args.backend for row in measure(backend, args.rounds, args.steps)]
    print(markdown_table(["backend", "int8 codes", "step at 64, ms", "step at 2,048, ms", "2,048 / 64"], rows))
    save("attention_integer", {"rounds": args.rounds, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
