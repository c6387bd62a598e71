"""int4 prefill chunks with their projections in the runtime's own ops (`--prefill-linears graph`:
XNNPACK's block-wise int4 FULLY_CONNECTED, or ONNX Runtime's MatMulNBits) against litekv's
LinearInt4 tiles (`--prefill-linears kernel`, the default), SmolLM2 int4 on both backends, in one
process, taking turns; then the op alone on SmolLM2's projection shapes, one token at a time
against the tiles (tokens 1-3 take the one-token rows, 4 and more the tiles).

    env -u OPENBLAS_CORETYPE python bench/prefill_linears.py --rounds 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from common import markdown_table, save, smollm2_bundle
from litekv.executor import open_executor
from litekv.native_attention import AttentionKernel

LENGTHS = (256, 1024)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's fused qkv, o, gate/up, down


def prefill_rates(rounds: int) -> dict[str, dict[int, list[float]]]:
    executors = {f"{backend} {kind}": open_executor(smollm2_bundle(backend, "int4", prefill_linears=kind))
                 for backend in ("litert", "onnx") for kind in ("graph", "kernel")}
    prompt = np.random.default_rng(3).integers(100, 40000, max(LENGTHS))
    rates = {name: {n: [] for n in LENGTHS} for name in executors}
    for round_ in range(rounds + 1):  # the first round warms every executor up and is dropped
        for name, ex in executors.items():
            for n in LENGTHS:
                cache = ex.create_kv_cache()
                start = time.perf_counter()
                ex.prefill(prompt[:n], cache)
                if round_:
                    rates[name][n].append(n / (time.perf_counter() - start))
    return rates


def kernel_rates(tokens: int, threads: int) -> list[float]:
    """GMAC/s of the int4 op over each shape (best of 7), with `tokens` tokens at once."""
    kernel = AttentionKernel(64, 9, 4096, threads)
    rng = np.random.default_rng(0)
    rates = []
    for out, width in SHAPES:
        x = rng.standard_normal((tokens, width), dtype=np.float32)
        codes = rng.integers(0, 256, (out, width // 2), dtype=np.uint8)
        scales = (rng.random((out, width // 32)) * 0.01).astype(np.float16)
        offsets = rng.integers(-5, 5, (out, width // 32), dtype=np.int8)
        offset_scales = (rng.random(out) * 0.01).astype(np.float32)
        kernel.run_linear(x, codes, offset_scales, scales, offsets)
        best = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            kernel.run_linear(x, codes, offset_scales, scales, offsets)
            best = min(best, time.perf_counter() - start)
        rates.append(tokens * width * out / best / 1e9)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    rates = prefill_rates(args.rounds)
    rows = [[name, *(f"{statistics.median(rates[name][n]):.0f}" for n in LENGTHS)] for name in rates]
    print(markdown_table(["bundle (int4, prefill linears)", *(f"prefill@{n} tok/s" for n in LENGTHS)], rows))
    ops = {f"{tokens} tokens, {threads} thread(s)": kernel_rates(tokens, threads)
           for threads in (1, 2) for tokens in (1, 3, 4, 256)}
    print(markdown_table(["LinearInt4", *(f"{w}x{o} GMAC/s" for o, w in SHAPES)],
                         [[name, *(f"{r:.0f}" for r in values)] for name, values in ops.items()]))
    save("prefill_linears", {"rounds": args.rounds, "prefill_tok_s": rates, "op_gmac_s": ops,
                             "shapes": [list(s) for s in SHAPES]})


if __name__ == "__main__":
    main()
