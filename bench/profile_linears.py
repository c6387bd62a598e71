"""Where does a decode step's time go? The weight-streaming floor against the whole step.

For each precision, a TFLite graph holding only SmolLM2's decode-time linears (30 layers of fused
q/k/v, o, fused gate/up and down, then the tied LM head; random weights in the same formats the
converter writes) is timed for one token, next to a full decode step of the converted model and
to this machine's memory read bandwidth with 2 threads. The gap between the linears and the step
is what attention, norms, RoPE, the KV update and per-op dispatch cost.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/profile_linears.py
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from common import markdown_table, median_time, rewound_step_seconds, save, smollm2_bundle
from litekv.converters.quantize import int4_blockwise_asymmetric, int8_per_channel
from litekv.converters.tflite_writer import PerChannelQuant, TFLiteModelWriter
from litekv.executor import open_executor
from litekv.litert_capi import CompiledTFLiteModel, HostTensorBuffer, aligned_zeros

HIDDEN, QKV, FFN, VOCAB, LAYERS = 576, 960, 1536, 49152, 30
BLOCK = 32


def read_bandwidth_gb_s(threads: int, mb: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth numpy reaches: `threads` threads taking the max of disjoint parts of a 1 GiB
    buffer (larger than L3). A SIMD max is the cheapest full read numpy has; the C read loop of
    bench/memory_bandwidth.py reaches more, so this is a lower bound."""
    data = np.ones(mb * 2**20 // 4, np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def linears_model(path: Path, precision: str, with_int4_offsets: bool) -> tuple[Path, int]:
    """The decode-time linears in a chain; returns the path and the weight bytes one token reads."""
    rng = np.random.default_rng(0)
    writer = TFLiteModelWriter()
    sg = writer.add_signature("main")
    weight_bytes = 0

    def weight(out_dim: int, in_dim: int, name: str):
        nonlocal weight_bytes
        w = (rng.standard_normal((out_dim, in_dim)) * 0.02).astype(np.float32)
        if precision == "int8":
            q, scales = int8_per_channel(w)
            weight_bytes += q.nbytes
            return writer.add_constant(q, name, "int8", PerChannelQuant(tuple(scales), axis=0)), None
        if precision == "int4":
            q, scales, offsets = int4_blockwise_asymmetric(w, BLOCK)
            weight_bytes += q.size // 2 + scales.size * 2
            return writer.add_blockwise_int4(q, scales, name, BLOCK), offsets
        weight_bytes += w.nbytes
        return writer.add_constant(w, name, "float32"), None

    def linear(x: int, in_dim: int, out_dim: int, name: str) -> int:
        nonlocal weight_bytes
        const, offsets = weight(out_dim, in_dim, name)
        y = sg.tensor(f"{name}.y", (1, out_dim))
        sg.op("FULLY_CONNECTED", [x, sg.use(const), -1], [y])
        if offsets is None or not with_int4_offsets:
            return y
        blocks = in_dim // BLOCK
        grouped = sg.tensor(f"{name}.g", (1, blocks, BLOCK))
        sg.op("RESHAPE", [x, sg.const(np.array([1, blocks, BLOCK], np.int32))], [grouped])
        sums = sg.tensor(f"{name}.s", (1, blocks))
        sg.op("SUM", [grouped, sg.const(np.array([2], np.int32))], [sums], keep_dims=False)
        correction = sg.tensor(f"{name}.c", (1, out_dim))
        q, scales = int8_per_channel(offsets)  # as the converter stores them (int8 per output row)
        weight_bytes += q.nbytes
        off = writer.add_constant(q, f"{name}.offsets", "int8", PerChannelQuant(tuple(scales), axis=0))
        sg.op("FULLY_CONNECTED", [sums, sg.use(off), -1], [correction])
        out = sg.tensor(f"{name}.out", (1, out_dim))
        sg.op("ADD", [y, correction], [out])
        return out

    def first(x: int, width: int, name: str) -> int:
        y = sg.tensor(name, (1, width))
        sg.op("SLICE", [x, sg.const(np.array([0, 0], np.int32)), sg.const(np.array([1, width], np.int32))], [y])
        return y

    h = sg.add_input("x", (1, HIDDEN))
    for i in range(LAYERS):
        qkv = linear(h, HIDDEN, QKV, f"l{i}.qkv")
        h = linear(first(qkv, HIDDEN, f"l{i}.q"), HIDDEN, HIDDEN, f"l{i}.o")
        gate_up = linear(h, HIDDEN, 2 * FFN, f"l{i}.gate_up")
        h = linear(first(gate_up, FFN, f"l{i}.gate"), FFN, HIDDEN, f"l{i}.down")
    sg.add_output("logits", linear(h, HIDDEN, VOCAB, "head"))
    writer.write(path)
    return path, weight_bytes


def bound_linears(path: Path, threads: int) -> tuple[CompiledTFLiteModel, Callable[[], object]]:
    """The linears model compiled, and a call that runs it once on a fixed input."""
    model = CompiledTFLiteModel(path, num_threads=threads)
    x, y = aligned_zeros((1, HIDDEN)), aligned_zeros((1, VOCAB))
    x[:] = 0.1
    return model, model.bind("main", {"x": HostTensorBuffer(x)}, {"logits": HostTensorBuffer(y)})


def time_linears(path: Path, threads: int, runs: int) -> float:
    model, run = bound_linears(path, threads)
    seconds = median_time(run, runs, warmup=5)
    model.close()
    return seconds


def decode_step(precision: str, threads: int, runs: int, live: int = 256) -> float:
    ex = open_executor(smollm2_bundle("litert", precision), threads=threads)
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(100, 100 + live), cache)
    return rewound_step_seconds(ex, cache, live, runs, warmup=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    bandwidth = read_bandwidth_gb_s(args.threads)
    print(f"memory read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s")
    rows, result = [], {"read_bandwidth_gb_s": bandwidth}
    with tempfile.TemporaryDirectory() as tmp:
        for precision, offsets in (("fp32", False), ("int8", False), ("int4", False), ("int4", True)):
            label = precision + (" + offset correction" if offsets else "")
            path, nbytes = linears_model(Path(tmp) / f"{precision}-{offsets}.tflite", precision, offsets)
            t_linears = time_linears(path, args.threads, args.runs)
            t_step = decode_step(precision, args.threads, args.runs) if offsets or precision != "int4" else float("nan")
            result[label] = dict(weight_mb=nbytes / 1e6, linears_ms=t_linears * 1e3, step_ms=t_step * 1e3,
                                 linears_gb_s=nbytes / t_linears / 1e9)
            rows.append([label, f"{nbytes / 1e6:.0f}", f"{t_linears * 1e3:.2f}", f"{nbytes / t_linears / 1e9:.1f}",
                         f"{1 / t_linears:.0f}", f"{t_step * 1e3:.2f}", f"{t_linears / t_step:.0%}"])
    print(markdown_table(["weights", "MB read per token", "linears only ms", "GB/s", "linears-only tok/s",
                          "full step ms (ctx 256)", "linears share"], rows))
    save("profile_linears", result)


if __name__ == "__main__":
    main()
