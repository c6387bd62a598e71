"""How close LiteRT's fp32 decode step comes to the time its weights take to read, and where the rest goes.

An fp32 SmolLM2 step reads 538 MB of weights in 121 one-token linears, each waiting for the one
before. Each round times, in turn and in one process:
- litekv's step (the default LiteRT fp32 bundle, rewound to `--live` tokens), with the attention
  kernel's own time taken out of it;
- XNNPACK's linears alone (bench/profile_linears.py's model: the same 121 matrices and nothing else);
- bench/fp32_read_floor.c over matrices of the same shapes, on two spinning threads: the bytes read
  as one stream ("stream"), read matrix by matrix with the threads meeting after each ("ops", the
  floor of any chain of one-token linears), and a plain AVX2 matrix-vector chain ("gemv").
Medians over the rounds, so each comparison is made in the same minutes: the machine's read rate
moves by 30 % within an hour.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/fp32_read_floor.py [--rounds 7] [--live 320]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import compile_c, markdown_table, median_time, rewound_step_seconds, save, smollm2_bundle
from litekv.executor import open_executor
from profile_linears import FFN, HIDDEN, LAYERS, QKV, VOCAB, bound_linears, linears_model

SOURCE = Path(__file__).with_name("fp32_read_floor.c")
C_MODES = ("stream", "ops", "gemv")


def step_shapes() -> list[str]:
    """The decode step's matrices in order, as OUTxIN: fused q/k/v, o, fused gate/up, down; the head."""
    layer = [f"{QKV}x{HIDDEN}", f"{HIDDEN}x{HIDDEN}", f"{2 * FFN}x{HIDDEN}", f"{HIDDEN}x{FFN}"]
    return layer * LAYERS + [f"{VOCAB}x{HIDDEN}"]


def c_milliseconds(program: Path, mode: str, passes: int) -> float:
    out = subprocess.run([str(program), mode, str(passes), *step_shapes()], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--live", type=int, default=320, help="tokens the timed steps attend over")
    parser.add_argument("--runs", type=int, default=20, help="steps, model runs and C passes per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    ex = open_executor(smollm2_bundle("litert", "fp32"), threads=args.threads)
    cache = ex.create_kv_cache()
    ex.prefill(list(range(100, 100 + args.live)), cache)
    layers = ex.config.num_layers
    times: dict[str, list[float]] = {k: [] for k in ("step", "attention", "linears", *C_MODES)}
    with tempfile.TemporaryDirectory() as tmp:
        program = compile_c(Path(tmp) / "fp32_read_floor", "-O3", "-march=native", "-pthread", str(SOURCE))
        path, weight_bytes = linears_model(Path(tmp) / "fp32.tflite", "fp32", False)
        model, run_linears = bound_linears(path, args.threads)
        for r in range(args.rounds):
            before = ex.attention_stats()
            times["step"].append(1e3 * rewound_step_seconds(ex, cache, args.live - 1, args.runs))
            times["attention"].append((ex.attention_stats() - before).microseconds_per_call * layers / 1e3)
            times["linears"].append(1e3 * median_time(run_linears, args.runs, warmup=3))
            for mode in C_MODES:
                times[mode].append(c_milliseconds(program, mode, args.runs))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in times.items()),
                  flush=True)
        model.close()

    ms = {k: statistics.median(v) for k, v in times.items()}
    rest = statistics.median(s - a - lin for s, a, lin in zip(times["step"], times["attention"], times["linears"]))

    def share(part: str, whole: str) -> float:  # per round, then the median: both timed in the same minutes
        return statistics.median(a / b for a, b in zip(times[part], times[whole]))

    gb_s = {k: weight_bytes / 1e6 / ms[k] for k in ("step", "linears", *C_MODES)}
    readers = [("stream", "the bytes as one stream (C, 2 threads)"), ("ops", "matrix by matrix, meeting after each (C)"),
               ("gemv", "plain AVX2 matrix-vector chain (C)"), ("linears", "XNNPACK's linears alone"),
               ("step", f"litekv's step at {args.live} tokens")]
    rows = [[label, f"{ms[k]:.2f}", f"{gb_s[k]:.1f}", f"{share('stream', k):.2f}"] for k, label in readers]
    print(f"\n{weight_bytes / 1e6:.0f} MB of fp32 weights, {args.threads} threads, medians of {args.rounds} rounds:")
    print(markdown_table(["reading the step's weights", "ms", "GB/s", "share of the stream's rate"], rows))
    print(f"\nThe step: XNNPACK's linears {ms['linears']:.2f} ms (in their model alone), attention kernel "
          f"{ms['attention']:.2f} ms, the rest {rest:.2f} ms. XNNPACK's linears take "
          f"{share('linears', 'ops'):.2f}x the matrix-by-matrix floor.")
    save("fp32_read_floor", {"live": args.live, "rounds": args.rounds, "weight_mb": weight_bytes / 1e6,
                             "median_ms": ms, "rest_ms": rest, "gb_s": gb_s,
                             "linears_over_ops_floor": share("linears", "ops"),
                             "stream_share": {k: share("stream", k) for k in ("ops", "gemv", "linears", "step")},
                             "rounds_ms": times})


if __name__ == "__main__":
    main()
