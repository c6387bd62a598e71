"""Why a LiteRT step grows by more than its attention: long attention calls put XNNPACK's worker to sleep.

XNNPACK's worker thread spins for about 15 µs after each task, then sleeps until the next parallel
op wakes it, and a wake-up across cores costs this VM about 17 µs (bench/wake_latency.py). An
attention call is a custom op outside XNNPACK, so the worker waits through it; once calls last
longer than its spin, it sleeps in every layer, and the op after each call likely starts on one core.

For LiteRT bundles with their default KV cache, one process opens two executors: XNNPACK on 2
threads (the default) and, as the control, on 1 thread (no worker to put to sleep). Both have the
attention kernel on 2 threads. Rewound steps at each live length, the lengths and executors taking
turns over the rounds. Per length it reports the step (median), the attention kernel's own time
(its counters), the rest of the step (the mean step minus the calls' time over the same steps), the
helper's share of the chunks and how late it joins, and the voluntary context switches per step of
the threads that are neither the calling thread nor the kernel's helper: XNNPACK's worker going to
sleep. Writes a table, bench/results/worker_sleep.json and worker_sleep.png.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/worker_sleep.py [--quantize int4 int8]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from common import RESULTS, markdown_table, save, smollm2_bundle
from litekv.bundle import read_manifest
from litekv.executor.litert_executor import LiteRTExecutor

LIVE = (64, 256, 512, 768, 1024, 1536, 2048, 3072)
HELPER_NAME = "litekv-attn"  # pthread_setname_np in litekv/kernels/decode_attention.c


def other_threads_sleeps() -> int:
    """Voluntary context switches so far of this process's threads other than the caller and the
    attention kernel's helper (XNNPACK's worker; idle pools such as OpenBLAS's add nothing)."""
    total, caller = 0, threading.get_native_id()
    for task in Path("/proc/self/task").iterdir():
        try:
            if int(task.name) == caller or (task / "comm").read_text().strip() == HELPER_NAME:
                continue
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
        except FileNotFoundError:  # a thread that ended while listed
            continue
    return total


def timed_steps(ex: LiteRTExecutor, cache, live: int, steps: int) -> dict:
    for _ in range(2):  # warm-up at this length
        cache.set_num_tokens(live - 1)
        ex.step([42], cache)
    stats, sleeps, samples = ex.attention_stats(), other_threads_sleeps(), []
    for _ in range(steps):
        cache.set_num_tokens(live - 1)
        start = time.perf_counter()
        ex.step([42], cache)
        samples.append(time.perf_counter() - start)
    calls = ex.attention_stats() - stats
    # The counters sum over these steps, so the rest of a step is taken from their mean too.
    return {"step_ms": 1e3 * statistics.median(samples),
            "rest_ms": 1e3 * statistics.mean(samples) - calls.seconds * 1e3 / steps,
            "attention_us_per_call": calls.microseconds_per_call,
            "helper_share": calls.helper_share,
            "helper_start_us": calls.helper_start_microseconds if calls.helper_joins else None,
            "worker_sleeps_per_step": (other_threads_sleeps() - sleeps) / steps}


def measure(quantize: str, rounds: int, steps: int) -> list[dict]:
    bundle = smollm2_bundle("litert", quantize)
    manifest = read_manifest(bundle)
    runs = []
    for xnnpack in (2, 1):
        ex = LiteRTExecutor(bundle, manifest, threads=xnnpack, attention_threads=2)
        cache = ex.create_kv_cache()
        ex.prefill(np.arange(max(LIVE) - 1) % 40000 + 100, cache)
        runs.append({"xnnpack": xnnpack, "ex": ex, "cache": cache, "got": {live: [] for live in LIVE}})
    for _ in range(rounds):
        for live in LIVE:
            for run in runs:
                run["got"][live].append(timed_steps(run["ex"], run["cache"], live, steps))
    rows = []
    for run in runs:
        for live in LIVE:
            got = run["got"][live]
            step = statistics.median(g["step_ms"] for g in got)
            per_call = statistics.median(g["attention_us_per_call"] for g in got)
            starts = [g["helper_start_us"] for g in got if g["helper_start_us"] is not None]
            rows.append({"quantize": quantize, "kv_cache": manifest.kv_dtype, "xnnpack_threads": run["xnnpack"],
                         "live": live, "step_ms": step, "attention_us_per_call": per_call,
                         "rest_ms": statistics.median(g["rest_ms"] for g in got),
                         "helper_share": statistics.median(g["helper_share"] for g in got),
                         "worker_sleeps_per_step": statistics.median(g["worker_sleeps_per_step"] for g in got),
                         "helper_start_us": statistics.median(starts) if starts else None})
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = plt.get_cmap("tab10").colors
    for i, quantize in enumerate(dict.fromkeys(r["quantize"] for r in rows)):  # colour: weights; line: threads
        for xnnpack, style in ((2, "-"), (1, "--")):
            mine = [r for r in rows if r["quantize"] == quantize and r["xnnpack_threads"] == xnnpack]
            label = f"{quantize} weights, XNNPACK on {xnnpack} thread{'s' if xnnpack > 1 else ''}"
            x = [r["attention_us_per_call"] for r in mine]
            left.plot(x, [r["rest_ms"] - mine[0]["rest_ms"] for r in mine], style, marker="o", label=label,
                      color=colors[i])
            if xnnpack == 2:
                right.plot(x, [r["worker_sleeps_per_step"] for r in mine], style, marker="o", label=label,
                           color=colors[i])
    left.set_xlabel("attention call, µs (the kernel's counters)")
    left.set_ylabel("rest of the step, ms, over its value at 64 tokens")
    left.set_title("The step's time outside attention")
    right.set_xlabel("attention call, µs (the kernel's counters)")
    right.set_ylabel("XNNPACK worker's sleeps per step")
    right.set_title("XNNPACK's worker sleeping through the calls")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M on LiteRT, live context 64 to 3,072 tokens, 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", nargs="+", default=["int4", "int8"], choices=("fp32", "int8", "int4"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per length and round")
    args = parser.parse_args()
    rows = [row for q in args.quantize for row in measure(q, args.rounds, args.steps)]
    print(markdown_table(
        ["weights", "KV cache", "XNNPACK threads", "live tokens", "step, ms", "attention per call, µs",
         "rest of the step, ms", "worker sleeps per step", "helper's chunks", "helper joins after, µs"],
        [[r["quantize"], r["kv_cache"], r["xnnpack_threads"], r["live"], f"{r['step_ms']:.2f}",
          f"{r['attention_us_per_call']:.1f}", f"{r['rest_ms']:.2f}", f"{r['worker_sleeps_per_step']:.1f}",
          f"{100 * r['helper_share']:.0f} %",
          "–" if r["helper_start_us"] is None else f"{r['helper_start_us']:.1f}"] for r in rows]))
    save("worker_sleep", {"rounds": args.rounds, "steps": args.steps, "rows": rows})
    plot(rows, RESULTS / "worker_sleep.png")
    print(f"plot: {RESULTS / 'worker_sleep.png'}")


if __name__ == "__main__":
    main()
