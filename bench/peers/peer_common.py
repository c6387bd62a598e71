"""Helpers shared by the peer runners (standard library only: they run under two interpreters)."""
from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

PREFILL_LENGTHS = (256, 1024)
TTFT_PROMPT = 256      # time to first token is measured on the 256-token prompt
DECODE_PROMPT = 256    # decode starts after this many prompt tokens
DECODE_TOKENS = 128
RESULTS = Path(__file__).parent / "results"


def fixed_tokens(n: int, vocab: int = 49152, seed: int = 0) -> list[int]:
    """The same n token ids on every run and in every peer (no chat template, no BOS)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_of(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of fn() over `repeats` runs after `warmup` unmeasured ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(repeats))


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def report(result: dict, name: str | None = None) -> None:
    """Prints the result as one JSON line on stdout and, with a name, keeps it in results/NAME.json."""
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), **result}
    line = json.dumps(result)
    print(line)
    sys.stdout.flush()
    if name:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(line + "\n")
