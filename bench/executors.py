"""Executor throughput on SmolLM2: decode tokens/s, Python overhead per step, KV copy costs.

For each backend x precision: decode tok/s (external sampler, `step`) and internal-sampler tok/s
(`sample_tokens`); the Python overhead of a step = wall time minus the time inside the model
call, measured by wrapping the backend's run call; the cost of one `select_and_copy_from` and
one `broadcast_and_copy_from` on a 1,000-token cache (batch 3).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/executors.py
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import markdown_table, median_time, save, smollm2_bundle
from litekv.executor import open_executor

PROMPT = 128


class CallTimer:
    """Accumulates wall time spent inside the backend's model-run function."""

    def __init__(self):
        self.inside = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - start
        return timed


def instrument(executor) -> CallTimer:
    timer = CallTimer()
    if executor.backend == "litert":
        executor.model._invoke = timer.wrap(executor.model._invoke)
    else:
        executor.session.run_with_iobinding = timer.wrap(executor.session.run_with_iobinding)
    return timer


def decode_figures(executor, steps: int) -> dict:
    timer = instrument(executor)
    cache = executor.create_kv_cache()
    executor.prefill(np.arange(100, 100 + PROMPT), cache)
    token = 42
    for _ in range(3):  # warm-up
        token = int(np.argmax(executor.step([token], cache)[0]))
    timer.inside = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(executor.step([token], cache)[0]))
    wall = time.perf_counter() - start
    overhead = (wall - timer.inside) / steps
    cache.set_num_tokens(PROMPT)
    start = time.perf_counter()
    executor.sample_tokens(steps, [42], cache)
    internal = steps / (time.perf_counter() - start)
    return dict(decode_tok_s=steps / wall, internal_sampler_tok_s=internal, step_ms=1e3 * wall / steps,
                python_overhead_us=1e6 * overhead, overhead_share=overhead / (wall / steps))


def copy_costs(executor) -> dict:
    single, batch = executor.create_kv_cache(), executor.create_kv_cache(batch_size=3)
    executor.prefill(np.arange(100, 1100) % 40000, single)
    batch.broadcast_and_copy_from(single)
    return dict(select_ms=1e3 * median_time(lambda: single.select_and_copy_from(batch, 1), 10),
                broadcast_ms=1e3 * median_time(lambda: batch.broadcast_and_copy_from(single), 10),
                kv_mb_per_sequence=single.stats().memory_bytes / 1e6 * 1000 / single.num_entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows, result = [], {}
    for backend in ("litert", "onnx"):
        for quantize in ("fp32", "int8", "int4"):
            ex = open_executor(smollm2_bundle(backend, quantize), threads=args.threads)
            figures = decode_figures(ex, args.steps)
            if quantize == "fp32":
                figures.update(copy_costs(ex))
            figures["kv_dtype"] = ex.manifest.kv_dtype  # the converter's default for these weights
            result[f"{backend}-{quantize}"] = figures
            rows.append([backend, quantize, figures["kv_dtype"], f"{figures['decode_tok_s']:.1f}", f"{figures['internal_sampler_tok_s']:.1f}",
                         f"{figures['step_ms']:.2f}", f"{figures['python_overhead_us']:.0f}",
                         f"{100 * figures['overhead_share']:.1f}%",
                         f"{figures.get('select_ms', float('nan')):.2f}", f"{figures.get('broadcast_ms', float('nan')):.2f}"])
            del ex
    print(markdown_table(["backend", "weights", "KV cache", "decode tok/s (step)", "tok/s (sample_tokens)", "ms/step",
                          "Python µs/step", "overhead share (target < 5%)", "select ms (1k tok)",
                          "broadcast ms (1k tok, batch 3)"], rows))
    print(f"(SmolLM2-135M-Instruct, {PROMPT}-token prompt, {args.steps} steps, {args.threads} threads)")
    save("executors", result)


if __name__ == "__main__":
    main()
