"""Helpers shared by the peer runners (standard library only: they run under two interpreters)."""
from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

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


def serve(measures: dict[str, Callable[[], float]]) -> None:
    """Pair mode, for bench/pairs.py: with the model loaded, answers each line on stdin that names a
    measure (a key of `measures`, each returning tokens/s of one run) with one JSON line, until an
    empty line or the end of input. Waiting on stdin, the process takes no CPU from the system
    measured beside it, so two runners can take turns within seconds of each other."""
    print(json.dumps({"ready": sorted(measures)}))
    sys.stdout.flush()
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        if name in measures:
            reply = {"measure": name, "tok_s": measures[name]()}
        else:
            reply = {"measure": name, "error": f"unknown measure; choose one of {sorted(measures)}"}
        print(json.dumps(reply))
        sys.stdout.flush()


def add_serve_flag(parser) -> None:
    parser.add_argument("--serve", action="store_true",
                        help="pair mode (bench/pairs.py): load once, then answer measures named on stdin")


def serve_timings(decode_seconds: Callable[[], float], prefill_seconds: Callable[[int], float],
                  more: dict[str, Callable[[], float]] | None = None) -> None:
    """serve() with the measures every runner offers: "decode", DECODE_TOKENS new tokens after a
    DECODE_PROMPT-token prompt (decode_seconds() times them), and "prefill_N" for each of
    PREFILL_LENGTHS (prefill_seconds(N) times one prefill of the runner's fixed N-token prompt);
    `more`: a runner's own measures, each returning tokens/s."""
    decode_seconds()  # warm-up
    serve({"decode": lambda: DECODE_TOKENS / decode_seconds(),
           **{f"prefill_{n}": (lambda n=n: n / prefill_seconds(n)) for n in PREFILL_LENGTHS}, **(more or {})})
