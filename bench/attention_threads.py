"""Two thread pools on two cores: how much of a long-context decode step is attention, and how
well its two threads share it, with XNNPACK's pool and litekv's attention kernel sized apart.

For each LiteRT bundle with an int8 KV cache, one process opens an executor per configuration
(XNNPACK threads, attention-kernel threads) and times rewound decode steps at 64 and 2,048 live
tokens, the configurations taking turns over several rounds. The kernel's own counters
(`LiteRTExecutor.attention_stats`) give the time inside its calls, the helper thread's share of the
chunks and how long after the caller's offer it joins a call, so the step time splits into
attention and the rest. With two attention threads they also give each thread's time in its
chunks of a call and how long the caller then waits for the helper's.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/attention_threads.py [--quantize int4 int8]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from common import markdown_table, rewound_step_seconds, save, smollm2_bundle
from litekv.bundle import read_manifest
from litekv.executor.litert_executor import LiteRTExecutor
from litekv.native_attention import AttentionStats

CONFIGS = ((2, 2), (2, 1), (1, 2))  # (XNNPACK threads, attention-kernel threads)
SHORT, LONG = 64, 2048


def measure(quantize: str, rounds: int, steps: int) -> list[dict]:
    bundle = smollm2_bundle("litert", quantize, kv_cache="int8")
    manifest = read_manifest(bundle)
    runs = []
    for xnnpack, attention in CONFIGS:
        ex = LiteRTExecutor(bundle, manifest, threads=xnnpack, attention_threads=attention)
        cache = ex.create_kv_cache()
        ex.prefill(np.arange(LONG - 1) % 40000 + 100, cache)
        runs.append({"xnnpack": xnnpack, "attention": attention, "ex": ex, "cache": cache,
                     SHORT: [], LONG: [], "stats": AttentionStats(0, 0.0, 0, 0)})
    for _ in range(rounds):
        for run in runs:
            ex, cache = run["ex"], run["cache"]
            run[SHORT].append(1e3 * rewound_step_seconds(ex, cache, SHORT - 1, steps))
            before = ex.attention_stats()  # the long steps' calls only
            run[LONG].append(1e3 * rewound_step_seconds(ex, cache, LONG - 1, steps, warmup=0))
            run["stats"] += ex.attention_stats() - before
    rows = []
    for run in runs:
        layers, stats = run["ex"].config.num_layers, run["stats"]
        short, long = statistics.median(run[SHORT]), statistics.median(run[LONG])
        rows.append({"quantize": quantize, "xnnpack_threads": run["xnnpack"], "attention_threads": run["attention"],
                     "step_ms_64": short, "step_ms_2048": long, "ratio": long / short,
                     "attention_us_per_call_2048": stats.microseconds_per_call,
                     "attention_ms_per_step_2048": stats.microseconds_per_call * layers / 1e3,
                     "helper_share": stats.helper_share, "helper_start_us": stats.helper_start_microseconds,
                     "caller_chunks_us": stats.caller_microseconds_per_shared_call,
                     "helper_chunks_us": stats.helper_microseconds_per_join,
                     "caller_wait_us": stats.wait_microseconds_per_shared_call})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", nargs="+", default=["int4", "int8"], choices=("fp32", "int8", "int4"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30, help="steps per measurement")
    args = parser.parse_args()
    rows = [row for q in args.quantize for row in measure(q, args.rounds, args.steps)]
    print(markdown_table(
        ["weights", "XNNPACK threads", "attention threads", "step at 64, ms", "step at 2,048, ms", "2,048 / 64",
         "attention per layer at 2,048, µs", "attention per step, ms", "helper's chunks", "helper joins after, µs",
         "caller's chunks, µs", "helper's chunks, µs", "caller waits, µs"],
        [[r["quantize"], r["xnnpack_threads"], r["attention_threads"], f"{r['step_ms_64']:.2f}",
          f"{r['step_ms_2048']:.2f}", f"{r['ratio']:.2f}", f"{r['attention_us_per_call_2048']:.1f}",
          f"{r['attention_ms_per_step_2048']:.2f}", f"{100 * r['helper_share']:.0f} %",
          *([f"{r['helper_start_us']:.1f}", f"{r['caller_chunks_us']:.1f}", f"{r['helper_chunks_us']:.1f}",
             f"{r['caller_wait_us']:.1f}"] if r["attention_threads"] > 1 else ["–"] * 4)] for r in rows]))
    save("attention_threads", {"rounds": args.rounds, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
