"""How fast XNNPACK runs one-token attention over a KV cache, in the decode graph's form and in
the alternatives, against the bytes it has to read.

Each model is 30 layers (SmolLM2's count) of attention for one query token: 9 query heads spread
over the 3 KV heads' blocks of a [1, S, 192] cache row, as litekv's decode graph does, so every
layer reads S x 192 floats of keys and as many of values. Reported: milliseconds per 30 layers
and the rate over the cache bytes; the machine's read rate (bench/memory_bandwidth.py) is the
ceiling, what a kernel that streams the cache once would reach. numpy/OpenBLAS is timed on the same
arithmetic as a second stock kernel.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/attention_kernels.py [--slots 384,2048]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import markdown_table, save
from litekv.converters.tflite_writer import TFLiteModelWriter
from litekv.litert_capi import CompiledTFLiteModel, HostTensorBuffer, aligned_zeros

LAYERS, HEADS, ROW = 30, 9, 3 * 64
VARIANTS = {
    "decode graph (scores, softmax, probs x V)": "full",
    "scores only": "scores",
    "probs x V only": "values",
    "scores with the cache as left operand, transposed back": "cache_left",
}


def build(path: Path, slots: int, variant: str) -> None:
    writer = TFLiteModelWriter()
    sg = writer.add_signature("run")
    query = sg.add_input("query", (1, HEADS, ROW))
    given_probs = sg.add_input("probs", (1, HEADS, slots))
    outputs = []
    for layer in range(LAYERS):
        keys, values = sg.add_input(f"k{layer}", (1, slots, ROW)), sg.add_input(f"v{layer}", (1, slots, ROW))
        scores = sg.tensor(f"scores{layer}", (1, HEADS, slots))
        if variant == "cache_left":
            scores_t = sg.tensor(f"scores_t{layer}", (1, slots, HEADS))
            sg.op("BATCH_MATMUL", [keys, query], [scores_t], adj_y=True)
            sg.op("TRANSPOSE", [scores_t, sg.const(np.array([0, 2, 1], np.int32))], [scores])
        elif variant != "values":
            sg.op("BATCH_MATMUL", [query, keys], [scores], adj_y=True)
        if variant == "scores":
            outputs.append(scores)
            continue
        probs = given_probs
        if variant != "values":
            probs = sg.tensor(f"probs{layer}", (1, HEADS, slots))
            sg.op("SOFTMAX", [scores], [probs], beta=1.0)
        out = sg.tensor(f"out{layer}", (1, HEADS, ROW))
        sg.op("BATCH_MATMUL", [probs, values], [out])
        outputs.append(out)
    for i, tensor in enumerate(outputs):
        sg.add_output(f"out{i}", tensor)
    writer.write(path)


def host_buffer(values: np.ndarray) -> HostTensorBuffer:
    array = aligned_zeros(values.shape, np.float32)
    array[...] = values
    return HostTensorBuffer(array)


def time_litert(slots: int, variant: str, threads: int, repeats: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attention.tflite"
        build(path, slots, variant)
        model = CompiledTFLiteModel(path, num_threads=threads)
        rng = np.random.default_rng(0)
        pool = {"query": host_buffer(rng.standard_normal((1, HEADS, ROW))),
                "probs": host_buffer(np.full((1, HEADS, slots), 1.0 / slots))}
        for layer in range(LAYERS):
            for kind in "kv":
                pool[f"{kind}{layer}"] = host_buffer(rng.standard_normal((1, slots, ROW)))
        sig = model.signature("run")
        inputs = {name: pool[name] for name in sig.input_names}
        outputs = {t.name: host_buffer(np.zeros(t.shape)) for t in sig.outputs}
        samples = []
        try:
            for i in range(repeats + 5):
                start = time.perf_counter()
                model.run("run", inputs, outputs)
                if i >= 5:
                    samples.append(time.perf_counter() - start)
        finally:
            model.close()
    return 1e3 * statistics.median(samples)


def time_numpy(slots: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((slots, ROW)).astype(np.float32) for _ in range(LAYERS)]
    values = [rng.standard_normal((slots, ROW)).astype(np.float32) for _ in range(LAYERS)]
    query = rng.standard_normal((ROW, HEADS)).astype(np.float32)

    def step() -> None:
        for k, v in zip(keys, values):
            scores = k @ query  # [S, 9]: the cache read once, in place
            scores -= scores.max(axis=0)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=0)
            scores.T @ v

    samples = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        step()
        if i >= 3:
            samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", default="384,2048", help="cache capacities to time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    rows, result = [], {}
    for slots in (int(s) for s in args.slots.split(",")):
        cache_mb = LAYERS * 2 * slots * ROW * 4 / 1e6
        timings = {label: time_litert(slots, variant, args.threads, args.repeats) for label, variant in VARIANTS.items()}
        timings["numpy/OpenBLAS, same arithmetic"] = time_numpy(slots, args.repeats)
        for label, ms in timings.items():
            read_mb = cache_mb / 2 if label in ("scores only", "probs x V only") else cache_mb
            rows.append([slots, label, f"{ms:.2f}", f"{read_mb / ms:.1f}"])
        result[str(slots)] = {"cache_mb": cache_mb, "ms": timings}
    print(markdown_table(["cache slots", "kernel", "ms per 30 layers", "GB/s over the cache it reads"], rows))
    print(f"wrote {save('attention_kernels', result)}")


if __name__ == "__main__":
    main()
