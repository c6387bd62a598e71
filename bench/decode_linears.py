"""A decode step with its quantized linears in the runtime's own ops (`--decode-linears graph`:
XNNPACK's, or ONNX Runtime's MatMulNBits) against litekv's linear kernels (`--decode-linears
kernel`, the default), SmolLM2 int4 and int8, in one process, taking turns.

For each bundle and live length it reports the median rewound step and how often the runtime's
worker threads sleep per step: with the kernels a LiteRT step's parallel work is litekv's, so
XNNPACK's worker should stay asleep, and the attention kernel's helper never waits for its spin.
Run bench/quality_kl.py on the same bundles for their quality.

    env -u OPENBLAS_CORETYPE python bench/decode_linears.py --rounds 6
    env -u OPENBLAS_CORETYPE python bench/decode_linears.py --backend onnx --weights int4
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from common import markdown_table, rewound_step_seconds, save, smollm2_bundle
from litekv.executor import open_executor
from worker_sleep import other_threads_sleeps

LIVE = (64, 2048)
STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--weights", nargs="+", default=["int4", "int8"])
    parser.add_argument("--backend", choices=("litert", "onnx"), default="litert",
                        help="onnx: int4 weights only (ONNX int8 bundles keep DynamicQuantizeMatMul)")
    parser.add_argument("--kv-cache", choices=("fp32", "fp16", "int8"), default=None,
                        help="the bundles' KV cache (default: the converter's for the weights)")
    args = parser.parse_args()
    runs = {}
    prompt = np.random.default_rng(1).integers(100, 40000, max(LIVE)).tolist()
    for weights in args.weights:
        for linears in ("graph", "kernel"):
            ex = open_executor(smollm2_bundle(args.backend, weights, kv_cache=args.kv_cache, decode_linears=linears))
            cache = ex.create_kv_cache()
            ex.prefill(prompt, cache)
            runs[weights, linears] = (ex, cache)
    steps: dict = {}
    sleeps: dict = {}
    for _ in range(args.rounds):
        for (weights, linears), (ex, cache) in runs.items():
            for live in LIVE:
                before = other_threads_sleeps()
                steps.setdefault((weights, linears, live), []).append(rewound_step_seconds(ex, cache, live, STEPS))
                sleeps.setdefault((weights, linears, live), []).append((other_threads_sleeps() - before) / (STEPS + 2))
    rows, result = [], {}
    for weights in args.weights:
        for linears in ("graph", "kernel"):
            ms = {live: 1e3 * statistics.median(steps[weights, linears, live]) for live in LIVE}
            naps = {live: statistics.median(sleeps[weights, linears, live]) for live in LIVE}
            growth = ms[LIVE[-1]] / ms[LIVE[0]]
            result[f"{weights}/{linears}"] = dict(step_ms=ms, worker_sleeps_per_step=naps, growth=growth)
            rows.append([weights, linears, *(f"{ms[live]:.2f}" for live in LIVE), f"{growth:.2f}",
                         " / ".join(f"{naps[live]:.1f}" for live in LIVE)])
    print(markdown_table(["weights", "decode linears", *(f"step at {live}, ms" for live in LIVE),
                          f"{LIVE[-1]} / {LIVE[0]}", "runtime worker sleeps per step"], rows))
    for weights in args.weights:
        ratios = [statistics.median(steps[weights, "graph", live]) / statistics.median(steps[weights, "kernel", live])
                  for live in LIVE]
        print(f"{weights}: graph / kernel step time " + ", ".join(f"{r:.2f} at {live}" for r, live in zip(ratios, LIVE)))
    save("decode_linears" + ("_onnx" if args.backend == "onnx" else ""),
         dict(backend=args.backend, rounds=args.rounds, steps=STEPS, kv_cache=args.kv_cache, bundles=result))


if __name__ == "__main__":
    main()
