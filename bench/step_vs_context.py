"""Decode step time against the live context, for both backends and every precision, with two KV
caches each: LiteRT float16 and int8, ONNX float32 and int8 (a label's "*" marks the converter's
default for those weights).

Each executor is opened on a bundle with max context 4096 and prefilled once; the cache is then
rewound (the rows below stay valid) so that the measured step's token is the L-th: it writes row
L - 1 and attends over L live tokens, in the smallest capacity bucket that holds them. Writes
the table, a JSON file and a PNG plot (bench/results/step_vs_context.png).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/step_vs_context.py
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import numpy as np

from common import (RESULTS, SWEEP_CACHES, default_mark, markdown_table, rewound_step_seconds, save, smollm2_bundle,
                    sweep_label)
from litekv.executor import open_executor

LIVE = (64, 128, 256, 512, 1024, 2048, 3072, 4096)


@dataclass
class Sweep:
    step_ms: dict[int, float]       # median step time at each live length
    ratio: float                    # median over rounds of each round's 2,048 / 64 step ratio
    attention_ms: dict[int, float]  # median time a step spends in the attention kernel's calls (LiteRT only)


def sweep(backend: str, quantize: str, threads: int, steps: int, kv_cache: str | None = None,
          rounds: int = 5) -> Sweep:
    """The lengths take turns, `rounds` times, so a slow phase of the machine (it drifts by tens of
    percent within minutes) hits them all alike, and a ratio compares steps taken seconds apart,
    not medians gathered minutes apart. Where the executor counts its attention kernel's calls
    (LiteRT), each measurement also gives the step's time inside them."""
    ex = open_executor(smollm2_bundle(backend, quantize, kv_cache=kv_cache), threads=threads)
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(max(LIVE) - 1) % 40000 + 100, cache)
    counted = getattr(ex, "attention_stats", lambda: None)() is not None
    samples: dict[int, list[float]] = {live: [] for live in LIVE}
    attention: dict[int, list[float]] = {live: [] for live in LIVE}
    for _ in range(rounds):
        for live in LIVE:
            before = ex.attention_stats() if counted else None
            samples[live].append(1e3 * rewound_step_seconds(ex, cache, live - 1, max(1, steps // rounds)))
            if counted:  # every step calls the kernel once per layer, the warm-up steps too
                calls = ex.attention_stats() - before
                attention[live].append(1e3 * calls.seconds * ex.config.num_layers / calls.calls)
    ratio = statistics.median(long / short for long, short in zip(samples[2048], samples[64]))
    return Sweep({live: statistics.median(v) for live, v in samples.items()}, ratio,
                 {live: statistics.median(v) for live, v in attention.items() if v})


def growth_rows(results: dict[str, Sweep]) -> list[list]:
    """Where each counted sweep's growth from 64 to 2,048 tokens goes: attention against the rest."""
    rows = []
    for label, r in results.items():
        if not r.attention_ms:
            continue
        short, long = r.step_ms[64], r.step_ms[2048]
        rest_short, rest_long = short - r.attention_ms[64], long - r.attention_ms[2048]
        rows.append([default_mark(label), f"{r.attention_ms[64]:.2f} / {r.attention_ms[2048]:.2f}",
                     f"{rest_short:.2f} / {rest_long:.2f}", f"{(r.attention_ms[2048] - r.attention_ms[64]) / short:+.2f}",
                     f"{(rest_long - rest_short) / short:+.2f}", f"{long / short:.2f}"])
    return rows


def plot(results: dict[str, dict[int, float]], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors  # twelve lines: more than the default cycle's ten colours
    for i, (label, times) in enumerate(results.items()):
        style = ("-" if label.startswith("litert") else "--") if "kvint8" not in label else \
            ("-." if label.startswith("litert") else ":")
        ax.plot(list(times), list(times.values()), style, marker="o", label=default_mark(label),
                color=colors[i % len(colors)])
    ax.set_xscale("log", base=2)
    ax.set_xticks(LIVE, [str(n) for n in LIVE])
    ax.set_xlabel("tokens attended by the step (max context 4096)")
    ax.set_ylabel("decode step time, ms")
    ax.set_title("litekv decode step time vs live context (SmolLM2-135M, 2 threads)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncol=3, title="* the converter's default cache for those weights",
              title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25, help="steps per live length, over 5 rounds")
    parser.add_argument("--quantize", default="fp32,int8,int4")
    args = parser.parse_args()
    results: dict[str, Sweep] = {}
    for backend, kv_cache in SWEEP_CACHES:
        for quantize in args.quantize.split(","):
            label = sweep_label(backend, quantize, kv_cache)
            print(f"{label} ...", file=sys.stderr, flush=True)
            results[label] = sweep(backend, quantize, args.threads, args.steps, kv_cache)
    rows = [[default_mark(label), *(f"{t:.2f}" for t in r.step_ms.values()), f"{r.ratio:.2f}"]
            for label, r in results.items()]
    print(markdown_table(["system", *(f"{n} tok ms" for n in LIVE),
                          "2048 / 64, median of per-round ratios (target <= 1.25)"], rows))
    print("\nWhere the growth goes (LiteRT, the attention kernel's own counters; growth as a share of the "
          "64-token step):")
    print(markdown_table(["system", "attention ms per step, 64 / 2048", "rest of the step ms, 64 / 2048",
                          "growth from attention", "growth from the rest", "2048 / 64 of the medians"],
                         growth_rows(results)))
    save("step_vs_context", {**{label: {str(k): v for k, v in r.step_ms.items()} for label, r in results.items()},
                             "ratio_2048_64": {label: r.ratio for label, r in results.items()},
                             "attention_ms": {label: {str(k): v for k, v in r.attention_ms.items()}
                                              for label, r in results.items() if r.attention_ms}})
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot({label: r.step_ms for label, r in results.items()}, RESULTS / "step_vs_context.png")
    print(f"plot: {RESULTS / 'step_vs_context.png'}")


if __name__ == "__main__":
    main()
