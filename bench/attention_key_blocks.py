"""What int8 keys stored in blocks of slots (native_attention.block_keys) save a decode-attention
call against the same keys stored as rows, on the kernel's own counters.

SmolLM2's shape (9 query heads over 3 KV heads of 64 dimensions, a 4,096-slot cache) with the
first `--live` slots attended: 30 layers of distinct int8 caches (read from memory, as a step
does) or 1 (in cache), statically scaled codes (ONNX bundles) and codes with a scale per row
(LiteRT bundles), 1 and 2 threads. The two layouts alternate in the same process; reported is each
one's best and median microseconds per call over `--rounds` rounds, and blocks / rows.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/attention_key_blocks.py [--live 2048]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from common import markdown_table, save
from litekv import native_attention

HEADS, KV_HEADS, HEAD_DIM, SLOTS = 9, 3, 64, 4096


def caches(layers: int, rng: np.random.Generator) -> list[dict]:
    """Per layer: int8 keys as rows and as blocks, values, and row scales."""
    out = []
    for _ in range(layers):
        keys = rng.integers(-127, 128, (SLOTS, KV_HEADS, HEAD_DIM), dtype=np.int8)
        out.append(dict(rows=keys.reshape(SLOTS, -1), blocks=native_attention.block_keys(keys).reshape(SLOTS, -1),
                        values=rng.integers(-127, 128, (SLOTS, KV_HEADS * HEAD_DIM), dtype=np.int8),
                        key_scales=rng.uniform(0.001, 0.02, (KV_HEADS, SLOTS)).astype(np.float32),
                        value_scales=rng.uniform(0.001, 0.02, (KV_HEADS, SLOTS)).astype(np.float32)))
    return out


def measure(layers: list[dict], live: int, threads: int, scaled: bool, rounds: int, calls: int) -> dict:
    kernel = native_attention.AttentionKernel(HEAD_DIM, HEADS, SLOTS, threads)
    query = np.random.default_rng(1).standard_normal(HEADS * HEAD_DIM).astype(np.float32)
    mask = np.full(SLOTS, -1e30, np.float32)
    mask[:live] = 0.0
    times: dict[str, list[float]] = {"rows": [], "blocks": []}
    try:
        for _ in range(rounds):
            for layout in times:
                before = kernel.stats()
                for _ in range(calls):
                    for layer in layers:
                        kernel.run(query, layer[layout], layer["values"], mask, KV_HEADS,
                                   layer["key_scales"] if scaled else None, layer["value_scales"] if scaled else None,
                                   key_blocks=layout == "blocks")
                times[layout].append((kernel.stats() - before).microseconds_per_call)
    finally:
        kernel.release()
    return {layout: {"best": min(t), "median": statistics.median(t)} for layout, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows, results = [], []
    for layers in (30, 1):
        data = caches(layers, rng)
        for scaled in (False, True):
            for threads in (1, 2):
                r = measure(data, args.live, threads, scaled, args.rounds, calls=10 if layers > 1 else 300)
                ratio = r["blocks"]["median"] / r["rows"]["median"]
                cache = "int8_rows" if scaled else "int8"
                results.append(dict(layers=layers, cache=cache, threads=threads, **r, ratio=ratio))
                rows.append([layers, cache, threads, f"{r['rows']['best']:.1f} / {r['rows']['median']:.1f}",
                             f"{r['blocks']['best']:.1f} / {r['blocks']['median']:.1f}", f"{ratio:.3f}"])
    print(f"decode attention, {args.live} live slots of {SLOTS}, microseconds per call (best / median)\n")
    print(markdown_table(["layers", "cache", "threads", "keys as rows", "keys in blocks", "blocks / rows"], rows))
    print(f"\nsaved {save('attention_key_blocks', dict(live=args.live, cpu=native_attention.cpu_paths(), results=results))}")


if __name__ == "__main__":
    main()
