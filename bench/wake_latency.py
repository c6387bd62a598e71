"""What a handoff to the other core costs on this machine: the floor under the attention kernel's
helper thread, which joins every decode-step call late.

Compiles bench/wake_latency.c (needs a C compiler, as the llama.cpp peer build does) and times a
thread on CPU 0 handing work to one on CPU 1, with CPU 1 idle or running a spinner (a thread that
spins on PAUSE, as XNNPACK's worker does between its tasks), the receiver either sleeping on a
futex or polling with sched_yield (the kernel's helper), as an ordinary thread or SCHED_FIFO (run
where permitted). Every case runs in its own process, the cases taking turns over the rounds.

    python bench/wake_latency.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import compile_c, markdown_table, save

SOURCE = Path(__file__).with_name("wake_latency.c")
# (wait, spinner on CPU 1, waiter policy, what it stands for)
CASES = (
    ("yield", "none", "other", "helper polling, other core free (XNNPACK on one thread)"),
    ("yield", "other", "other", "helper polling beside a spinning worker (the default)"),
    ("futex", "none", "other", "helper asleep, other core idle"),
    ("futex", "other", "other", "helper asleep, woken beside a spinning worker"),
    ("futex", "idle", "other", "the same, the worker SCHED_IDLE"),
    ("futex", "other", "fifo", "the same, the helper SCHED_FIFO"),
)


def build(directory: Path) -> Path:
    return compile_c(directory / "wake_latency", "-O2", "-pthread", str(SOURCE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1000, help="handoffs per case and round")
    args = parser.parse_args()
    runs: dict[tuple, list[dict]] = {case[:3]: [] for case in CASES}
    refused = set()
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for _ in range(args.rounds):
            for case in runs:
                if case in refused:
                    continue
                out = subprocess.run([str(binary), *case, str(args.samples)], capture_output=True, text=True)
                if out.returncode == 4:  # SCHED_FIFO not permitted here
                    refused.add(case)
                    continue
                out.check_returncode()
                runs[case].append(json.loads(out.stdout))
    rows, results = [], []
    for wait, spinner, policy, meaning in CASES:
        got = runs[(wait, spinner, policy)]
        if not got:
            rows.append([meaning, wait, spinner, policy, "not permitted", "", ""])
            continue
        median = statistics.median(r["median_us"] for r in got)
        p90 = statistics.median(r["p90_us"] for r in got)
        seen = sum(r["seen"] for r in got) / sum(r["offered"] for r in got)
        rows.append([meaning, wait, spinner, policy, f"{median:.1f}", f"{p90:.1f}", f"{100 * seen:.0f} %"])
        results.append({"wait": wait, "spinner": spinner, "waiter": policy, "median_us": median, "p90_us": p90,
                        "seen": seen, "runs": got})
    print(markdown_table(["case", "receiver waits by", "other thread on CPU 1", "receiver policy",
                          "median µs", "90th percentile µs", "handoffs seen"], rows))
    save("wake_latency", {"rounds": args.rounds, "samples": args.samples, "results": results})


if __name__ == "__main__":
    main()
