"""Operator breakdown of one SmolLM2 decode step, for both backends, from the runtimes' own profilers.

LiteRT: the compiled model is created with profiling enabled (runtime option `enable_profiling`)
and LiteRtGetProfileSummary's per-op-type table is parsed. ONNX Runtime: the session writes its
JSON trace (`enable_profiling`) and the node events of the measured runs are summed per op type.
Both profile `--steps` decode steps at the same live context after a warm-up (ONNX with
`--prefill N`: prefills of N tokens instead); profiling adds a little time per op, so use the
shares, not the absolute figures, and bench/compare.py for speed.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/profile_ops.py [--quantize int8] [--live 256]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/profile_ops.py --backend onnx --quantize int4 --prefill 256
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import re
import tempfile
from pathlib import Path

import numpy as np

from common import markdown_table, smollm2_bundle
from litekv import litert_capi
from litekv.bundle import KV_CACHE_FORMATS, read_manifest
from litekv.executor import open_executor


def _prefilled(executor, live: int):
    cache = executor.create_kv_cache()
    executor.prefill(np.arange(live - 1) % 40000 + 100, cache)
    return cache


def _decode_steps(executor, cache, live: int, steps: int) -> None:
    for _ in range(steps):
        cache.set_num_tokens(live - 1)
        executor.step([42], cache)


def litert_breakdown(bundle: Path, live: int, steps: int, threads: int) -> dict[str, tuple[float, int]]:
    """op type -> (ms per step, calls per step)."""
    original = litert_capi.CompiledTFLiteModel._add_opaque_options

    def with_profiling(self, lib, identifier, toml):
        if identifier == "runtime_options_string":
            toml += "enable_profiling = true\n"
        return original(self, lib, identifier, toml)

    litert_capi.CompiledTFLiteModel._add_opaque_options = with_profiling
    try:
        ex = open_executor(bundle, threads=threads)
    finally:
        litert_capi.CompiledTFLiteModel._add_opaque_options = original
    cache = _prefilled(ex, live)
    _decode_steps(ex, cache, live, 3)  # warm-up, not profiled
    lib, handle = litert_capi._load(), ctypes.c_void_p(ex.model._handle)
    profiler = ctypes.c_void_p()
    if lib.LiteRtCompiledModelGetProfiler(handle, ctypes.byref(profiler)) != 0 or not profiler.value:
        raise RuntimeError("this LiteRT build gives no profiler")
    lib.LiteRtResetProfiler(profiler)
    lib.LiteRtStartProfiler(profiler)
    _decode_steps(ex, cache, live, steps)
    lib.LiteRtStopProfiler(profiler)
    summary = ctypes.c_char_p()
    if lib.LiteRtGetProfileSummary(profiler, handle, ctypes.byref(summary)) != 0:
        raise RuntimeError("LiteRtGetProfileSummary failed")
    text = summary.value.decode()
    libc = ctypes.CDLL(None)
    libc.free(ctypes.cast(summary, ctypes.c_void_p))
    # The "Delegate Statistics" table: op name, count, avg, min, max, total (microseconds).
    table = text.split("Delegate Statistics", 1)[1]
    result = {}
    for line in table.splitlines():
        m = re.match(r"(\S.*?)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", line)
        if m:
            result[m.group(1)] = (int(m.group(6)) / 1e3 / steps, int(m.group(2)) // steps)
    # Ops LiteRT runs itself (not delegated) appear in the per-node-type table only.
    section = text.split("Summary by node type", 1)[1].split("Delegate Statistics", 1)[0]
    for line in section.splitlines():
        m = re.match(r"\s*([A-Za-z_0-9.]+)\s+(\d+)\s+([\d.]+)\s+[\d.]+%\s+[\d.]+%\s+[\d.]+\s+(\d+)", line)
        if m:
            result[m.group(1)] = (float(m.group(3)) * int(m.group(2)), int(m.group(4)) // steps)
    return result


def onnx_breakdown(bundle: Path, live: int, steps: int, threads: int, prefill: int = 0) -> dict[str, tuple[float, int]]:
    """op type -> (ms, calls) per decode step at `live` tokens or, with `prefill`, per prefill of
    that many tokens into an empty cache (the model graph's session, in chunks of PREFILL_CHUNK)."""
    import onnxruntime as ort

    from litekv.executor.onnx_executor import PREFILL_CHUNK

    prefix = Path(tempfile.mkdtemp()) / "ort"
    original = ort.SessionOptions

    class Profiled(original):  # the executor builds its own options; switch profiling on in them
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.enable_profiling = True
            self.profile_file_prefix = str(prefix)

    ort.SessionOptions = Profiled
    try:
        ex = open_executor(bundle, threads=threads)
    finally:
        ort.SessionOptions = original
    if prefill:
        for _ in range(3 + steps):
            _prefilled(ex, prefill + 1)
        session, runs_each = ex.session, -(-prefill // PREFILL_CHUNK)
    else:
        _decode_steps(ex, _prefilled(ex, live), live, 3 + steps)
        session, runs_each = ex.decode_session, 1
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"]
    first = runs[-steps * runs_each]["ts"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            total[e["args"]["op_name"]] += e["dur"]
            calls[e["args"]["op_name"]] += 1
    return {op: (us / 1e3 / steps, calls[op] // steps) for op, us in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", default="int8", choices=("fp32", "int8", "int4"))
    parser.add_argument("--live", type=int, default=256, help="tokens the profiled step attends over")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache", choices=KV_CACHE_FORMATS, default=None,
                        help="KV cache precision (default: the converter's: fp32 on ONNX; on LiteRT int8 with "
                        "int4 weights, else fp16)")
    parser.add_argument("--backend", choices=("litert", "onnx", "both"), default="both")
    parser.add_argument("--prefill", type=int, default=0,
                        help="ONNX: profile prefills of this many tokens instead of decode steps")
    parser.add_argument("--decode-linears", choices=("graph", "kernel"), default=None,
                        help="the decode step's quantized linears in the runtime's own ops (XNNPACK, MatMulNBits) or "
                             "litekv's kernels (default: the converter's)")
    args = parser.parse_args()
    for backend, breakdown in (("litert", litert_breakdown), ("onnx", onnx_breakdown)):
        if args.backend not in (backend, "both"):
            continue
        linears = args.decode_linears
        bundle = smollm2_bundle(backend, args.quantize, kv_cache=args.kv_cache, decode_linears=linears)
        if args.prefill and backend == "onnx":
            ops, what = onnx_breakdown(bundle, args.live, args.steps, args.threads, args.prefill), \
                f"one prefill of {args.prefill} tokens"
        elif args.prefill:
            continue  # LiteRT's profiler here covers decode steps only
        else:
            ops, what = breakdown(bundle, args.live, args.steps, args.threads), \
                f"one decode step at {args.live} live tokens"
        total = sum(ms for ms, _ in ops.values())
        rows = [[op, calls, f"{ms:.3f}", f"{100 * ms / total:.1f}%"]
                for op, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0]) if ms >= 0.005]
        print(f"\n{backend} {args.quantize}, {read_manifest(bundle).kv_dtype} KV cache, {what} "
              f"({total:.2f} ms inside ops, profiled):")
        print(markdown_table(["op", "calls per run", "ms per run", "share"], rows))


if __name__ == "__main__":
    main()
