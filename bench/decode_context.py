"""Does decode cost follow the live context? And what does a LoRA-ready model cost with no adapter?

Decode step time of SmolLM2 fp32 at 200 live tokens, with max context 4096 vs 256, for both
backends, and a LoRA-ready (rank 8) bundle with no adapter active vs the plain bundle.
Runs alternate between the compared bundles so machine noise hits both alike.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/decode_context.py
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from common import markdown_table, rewound_step_seconds, save, smollm2_bundle
from litekv.executor import open_executor

LIVE_TOKENS = 200


def step_time(executor, steps: int) -> float:
    """Median seconds of one decode step at LIVE_TOKENS tokens."""
    cache = executor.create_kv_cache()
    executor.prefill(np.arange(100, 100 + LIVE_TOKENS), cache)
    return rewound_step_seconds(executor, cache, LIVE_TOKENS, steps - 2)


def compare(a, b, rounds: int, steps: int) -> tuple[float, float]:
    """Interleaved medians of two executors."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(step_time(a, steps))
        tb.append(step_time(b, steps))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows, result = [], {}
    for backend in ("litert", "onnx"):
        big = open_executor(smollm2_bundle(backend, "fp32", 4096), threads=args.threads)
        small = open_executor(smollm2_bundle(backend, "fp32", 256, prefill_lengths=(32, 128)), threads=args.threads)
        t_big, t_small = compare(big, small, args.rounds, args.steps)
        del big
        lora = open_executor(smollm2_bundle(backend, "fp32", 256, lora_rank=8, prefill_lengths=(32, 128)),
                             threads=args.threads)
        t_lora, t_plain = compare(lora, small, args.rounds, args.steps)
        result[backend] = dict(step_ms_ctx4096=t_big * 1e3, step_ms_ctx256=t_small * 1e3, ratio_4096_vs_256=t_big / t_small,
                               step_ms_lora_ready=t_lora * 1e3, step_ms_plain=t_plain * 1e3,
                               lora_overhead=t_lora / t_plain - 1)
        rows.append([backend, f"{t_big * 1e3:.2f}", f"{t_small * 1e3:.2f}", f"{t_big / t_small:.3f}",
                     f"{t_lora * 1e3:.2f}", f"{t_plain * 1e3:.2f}", f"{100 * (t_lora / t_plain - 1):+.1f}%"])
    print(markdown_table(["backend", "ms/step ctx 4096", "ms/step ctx 256", "ratio (target <= 1.25)",
                          "ms/step LoRA-ready", "ms/step plain", "LoRA overhead (target < 5%)"], rows))
    print(f"(SmolLM2-135M fp32, {LIVE_TOKENS} live tokens, {args.threads} threads, median of {args.rounds} "
          "interleaved rounds)")
    save("decode_context", result)


if __name__ == "__main__":
    main()
