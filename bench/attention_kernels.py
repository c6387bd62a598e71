"""How fast XNNPACK runs one-token attention over a KV cache, in the decode graph's form and in
the alternatives, against the bytes it has to read.

Each model is 30 layers (SmolLM2's count) of attention for one query token: 9 query heads spread
over the 3 KV heads' blocks of a [1, S, 192] cache row, as litekv's decode graph does, so every
layer reads S x 192 floats of keys and as many of values. Reported: milliseconds per 30 layers
and the rate over the cache bytes; the machine's read rate (bench/memory_bandwidth.py) is the
ceiling, what a kernel that streams the cache once would reach. The alternatives: the cache as the
left operand (not repacked by XNNPACK), for the scores and, with a transposed value cache, for
probs x V; the scores as a fully-connected op whose filter is the query; a head-major cache
without the zero blocks (a third of the arithmetic); an int8 cache through TFLite's float x int8
batch matmul; numpy/OpenBLAS on the same arithmetic as a second stock kernel; and litekv's own
decode-attention kernel (litekv.native_attention), which the LiteRT decode entry points use.

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
from litekv.converters.tflite_writer import PerChannelQuant, TFLiteModelWriter
from litekv import litert_capi, native_attention
from litekv.litert_capi import CompiledTFLiteModel, HostTensorBuffer, aligned_zeros

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64
HEADS, ROW = KV_HEADS * GROUP, KV_HEADS * HEAD_DIM
TRANSPOSE_LAST_TWO = np.array([0, 2, 1], np.int32)


def _attend(sg, layer: int, query: int, keys: int, values: int, query_shape: tuple[int, int, int], slots: int,
            values_transposed: bool = False) -> int:
    """scores = query . keys^T, softmax, probs x values, for a query [batch, rows, width]."""
    batch, rows, _ = query_shape
    scores = sg.tensor(f"scores{layer}", (batch, rows, slots))
    sg.op("BATCH_MATMUL", [query, keys], [scores], adj_y=True)
    probs = sg.tensor(f"probs{layer}", (batch, rows, slots))
    sg.op("SOFTMAX", [scores], [probs], beta=1.0)
    out = sg.tensor(f"out{layer}", query_shape)
    sg.op("BATCH_MATMUL", [probs, values], [out], adj_y=values_transposed)
    return out


def spread(sg, slots: int) -> list[int]:
    """The decode graph's form: 9 query heads spread over the KV blocks of a [1, S, 192] cache row."""
    query = sg.add_input("query", (1, HEADS, ROW))
    return [_attend(sg, layer, query, sg.add_input(f"k{layer}", (1, slots, ROW)),
                    sg.add_input(f"v{layer}", (1, slots, ROW)), (1, HEADS, ROW), slots) for layer in range(LAYERS)]


def scores_only(sg, slots: int) -> list[int]:
    query, outputs = sg.add_input("query", (1, HEADS, ROW)), []
    for layer in range(LAYERS):
        scores = sg.tensor(f"scores{layer}", (1, HEADS, slots))
        sg.op("BATCH_MATMUL", [query, sg.add_input(f"k{layer}", (1, slots, ROW))], [scores], adj_y=True)
        outputs.append(scores)
    return outputs


def values_only(sg, slots: int) -> list[int]:
    probs, outputs = sg.add_input("probs", (1, HEADS, slots)), []
    for layer in range(LAYERS):
        out = sg.tensor(f"out{layer}", (1, HEADS, ROW))
        sg.op("BATCH_MATMUL", [probs, sg.add_input(f"v{layer}", (1, slots, ROW))], [out])
        outputs.append(out)
    return outputs


def cache_left(sg, slots: int) -> list[int]:
    """Scores as keys . query^T (the cache as the left operand, which XNNPACK does not repack)."""
    query, outputs = sg.add_input("query", (1, HEADS, ROW)), []
    for layer in range(LAYERS):
        keys, values = sg.add_input(f"k{layer}", (1, slots, ROW)), sg.add_input(f"v{layer}", (1, slots, ROW))
        scores_t, scores = sg.tensor(f"scores_t{layer}", (1, slots, HEADS)), sg.tensor(f"scores{layer}", (1, HEADS, slots))
        sg.op("BATCH_MATMUL", [keys, query], [scores_t], adj_y=True)
        sg.op("TRANSPOSE", [scores_t, sg.const(TRANSPOSE_LAST_TWO)], [scores])
        probs = sg.tensor(f"probs{layer}", (1, HEADS, slots))
        sg.op("SOFTMAX", [scores], [probs], beta=1.0)
        out = sg.tensor(f"out{layer}", (1, HEADS, ROW))
        sg.op("BATCH_MATMUL", [probs, values], [out])
        outputs.append(out)
    return outputs


def values_transposed_left(sg, slots: int) -> list[int]:
    """probs x V as V^T [192, S] x probs^T [S, 9]: a transposed value cache as the left operand, so
    only the small probabilities are packed (a layout whose bucket prefixes would not be views)."""
    probs_t, outputs = sg.add_input("probs_t", (1, slots, HEADS)), []
    for layer in range(LAYERS):
        out = sg.tensor(f"out{layer}", (1, ROW, HEADS))
        sg.op("BATCH_MATMUL", [sg.add_input(f"vt{layer}", (1, ROW, slots)), probs_t], [out])
        outputs.append(out)
    return outputs


def keys_as_fc_input(sg, slots: int) -> list[int]:
    """Scores^T [S, 9] as FULLY_CONNECTED(keys [S, 192], query [9, 192] as a dynamic filter)."""
    query, outputs = sg.add_input("query", (HEADS, ROW)), []
    for layer in range(LAYERS):
        scores_t = sg.tensor(f"scores_t{layer}", (slots, HEADS))
        sg.op("FULLY_CONNECTED", [sg.add_input(f"k{layer}", (slots, ROW)), query, -1], [scores_t])
        outputs.append(scores_t)
    return outputs


def litekv_kernel(sg, slots: int, dtype: str = "float32") -> list[int]:
    """litekv's decode-attention kernel (a custom op): the cache rows as bound, each read once."""
    query, mask, outputs = sg.add_input("query", (1, 1, HEADS * HEAD_DIM)), sg.add_input("mask", (1, 1, 1, slots)), []
    op = native_attention.OP_NAME if dtype == "float32" else native_attention.OP_NAME_INT8
    for layer in range(LAYERS):
        out = sg.tensor(f"out{layer}", (1, 1, HEADS * HEAD_DIM))
        sg.custom_op(op, [query, sg.add_input(f"k{layer}", (1, slots, ROW), dtype),
                          sg.add_input(f"v{layer}", (1, slots, ROW), dtype), mask], [out])
        outputs.append(out)
    return outputs


def litekv_kernel_int8(sg, slots: int) -> list[int]:
    """The kernel's int8 form on an int8 cache (--kv-cache int8): a quarter of the bytes, multiplied
    as integers (AVX-512 VNNI) where the CPU can."""
    return litekv_kernel(sg, slots, "int8")


def litekv_kernel_int8_widened(sg, slots: int) -> list[int]:
    """The same, with the codes widened to floats: what CPUs without AVX-512 VNNI run."""
    return litekv_kernel(sg, slots, "int8")


def head_major(sg, slots: int) -> list[int]:
    """A [KVH, S, D] cache: each KV head's 3 query heads against its own rows, no zero blocks."""
    query = sg.add_input("query", (KV_HEADS, GROUP, HEAD_DIM))
    return [_attend(sg, layer, query, sg.add_input(f"k{layer}", (KV_HEADS, slots, HEAD_DIM)),
                    sg.add_input(f"v{layer}", (KV_HEADS, slots, HEAD_DIM)), (KV_HEADS, GROUP, HEAD_DIM), slots)
            for layer in range(LAYERS)]


def per_head_buffers(sg, slots: int) -> list[int]:
    """One [1, S, D] buffer per KV head: head-major arithmetic whose bucket prefixes stay views."""
    queries = [sg.add_input(f"query{h}", (1, GROUP, HEAD_DIM)) for h in range(KV_HEADS)]
    return [_attend(sg, layer * KV_HEADS + h, queries[h], sg.add_input(f"k{layer}_{h}", (1, slots, HEAD_DIM)),
                    sg.add_input(f"v{layer}_{h}", (1, slots, HEAD_DIM)), (1, GROUP, HEAD_DIM), slots)
            for layer in range(LAYERS) for h in range(KV_HEADS)]


def int8_hybrid(sg, slots: int) -> list[int]:
    """An int8 [KVH, S, D] cache (values stored [KVH, D, S]) read by TFLite's float x int8 batch
    matmul, which XNNPACK does not take: the builtin kernel runs it."""
    query, scale = sg.add_input("query", (KV_HEADS, GROUP, HEAD_DIM)), PerChannelQuant((0.05,))
    return [_attend(sg, layer, query, sg.add_input(f"k{layer}", (KV_HEADS, slots, HEAD_DIM), "int8", quant=scale),
                    sg.add_input(f"v{layer}", (KV_HEADS, HEAD_DIM, slots), "int8", quant=scale),
                    (KV_HEADS, GROUP, HEAD_DIM), slots, values_transposed=True)
            for layer in range(LAYERS)]


# label: (graph builder, fraction of the K and V cache it reads, cache bytes per element)
VARIANTS = {
    "decode graph (scores, softmax, probs x V)": (spread, 1.0, 4),
    "scores only": (scores_only, 0.5, 4),
    "probs x V only": (values_only, 0.5, 4),
    "scores with the cache as left operand, transposed back": (cache_left, 1.0, 4),
    "scores as FULLY_CONNECTED, query as a dynamic filter": (keys_as_fc_input, 0.5, 4),
    "probs x V with V^T as the left operand": (values_transposed_left, 0.5, 4),
    "head-major cache [KVH, S, D], no zero blocks": (head_major, 1.0, 4),
    "one [S, D] buffer per KV head": (per_head_buffers, 1.0, 4),
    "int8 cache, float x int8 batch matmul": (int8_hybrid, 1.0, 1),
    "litekv decode-attention kernel (custom op)": (litekv_kernel, 1.0, 4),
    "litekv kernel, int8 cache": (litekv_kernel_int8, 1.0, 1),
    "litekv kernel, int8 cache, codes widened to floats": (litekv_kernel_int8_widened, 1.0, 1),
}


# the graphs that call litekv's kernel: whether it may multiply int8 codes as integers
KERNEL_GRAPHS = {litekv_kernel: True, litekv_kernel_int8: True, litekv_kernel_int8_widened: False}


def build(path: Path, slots: int, graph) -> None:
    writer = TFLiteModelWriter()
    sg = writer.add_signature("run")
    for i, tensor in enumerate(graph(sg, slots)):
        sg.add_output(f"out{i}", tensor)
    writer.write(path)


def host_buffer(values: np.ndarray, dtype) -> HostTensorBuffer:
    array = aligned_zeros(values.shape, dtype)
    array[...] = values
    return HostTensorBuffer(array)


def time_litert(slots: int, graph, threads: int, repeats: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "attention.tflite"
        build(path, slots, graph)
        kernels = ([native_attention.AttentionKernel(HEAD_DIM, HEADS, slots, threads, litert=litert_capi.library(),
                                                     int8_dot=KERNEL_GRAPHS[graph])]
                   if graph in KERNEL_GRAPHS else [])
        model = CompiledTFLiteModel(path, num_threads=threads, custom_ops=kernels)
        rng = np.random.default_rng(0)
        sig = model.signature("run")
        inputs = {t.name: host_buffer(rng.integers(-100, 100, t.shape) if t.dtype == np.int8
                                      else np.zeros(t.shape) if t.name == "mask"  # every slot live
                                      else rng.standard_normal(t.shape), t.dtype) for t in sig.inputs}
        outputs = {t.name: host_buffer(np.zeros(t.shape), t.dtype) for t in sig.outputs}
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
    parser.add_argument("--only", default="", help="time only the kernels whose label contains this text")
    args = parser.parse_args()
    rows, result = [], {}
    for slots in (int(s) for s in args.slots.split(",")):
        cache_mb = LAYERS * 2 * slots * ROW * 4 / 1e6  # float32 keys and values
        timings, read_mb = {}, {}
        for label, (graph, fraction, itemsize) in VARIANTS.items():
            if args.only not in label:
                continue
            timings[label] = time_litert(slots, graph, args.threads, args.repeats)
            read_mb[label] = cache_mb * fraction * itemsize / 4
        if not args.only:
            timings["numpy/OpenBLAS, same arithmetic"] = time_numpy(slots, args.repeats)
            read_mb["numpy/OpenBLAS, same arithmetic"] = cache_mb
        for label, ms in timings.items():
            rows.append([slots, label, f"{ms:.2f}", f"{read_mb[label] / ms:.1f}"])
        result[str(slots)] = {"cache_mb": cache_mb, "ms": timings}
    print(markdown_table(["cache slots", "kernel", "ms per 30 layers", "GB/s over the cache it reads"], rows))
    print(f"wrote {save('attention_kernels', result)}")


if __name__ == "__main__":
    main()
