"""Shared helpers for the benchmarks: bundles converted once, timing, result files."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from litekv.catalog import cache_dir, checkpoint_path
from litekv.converters.convert import ConvertOptions, convert

RESULTS = Path(__file__).parent / "results"
# The two KV caches each backend's step sweeps cover: LiteRT float16 and int8, ONNX float32 and int8.
SWEEP_CACHES = (("litert", "fp16"), ("onnx", "fp32"), ("litert", "int8"), ("onnx", "int8"))


def sweep_label(backend: str, quantize: str, kv_cache: str) -> str:
    """A bundle's key in the step sweeps' results."""
    return f"{backend}-{quantize}-kv{kv_cache}"


def default_mark(label: str) -> str:
    """A sweep label as tables and plots show it: "*" marks the converter's default cache for it."""
    backend, quantize, kv = label.split("-")
    return label + ("*" if kv.removeprefix("kv") == default_cache(backend, quantize) else "")


def default_cache(backend: str, quantize: str) -> str:
    """The converter's KV cache format for these weights, with its other defaults."""
    return ConvertOptions(backend=backend, quantize=quantize).kv_format


def compile_c(output: Path, *arguments: str) -> Path:
    """Builds a benchmark's C program with $CC, cc or gcc (the llama.cpp peer build needs one too)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        sys.exit(f"{output.name}: no C compiler found (install gcc, or set CC)")
    subprocess.run([compiler, *arguments, "-o", str(output)], check=True)
    return output


def converter_fingerprint() -> str:
    """Hash of the converter and architecture sources: a bundle made by older code is never reused."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.glob("converters/*.py"), *root.glob("models/*.py")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def smollm2_bundle(backend: str, quantize: str, max_context: int = 4096, lora_rank: int | None = None,
                   prefill_lengths: tuple[int, ...] = (32, 128, 256, 512), kv_cache: str | None = None,
                   lm_head: str | None = None, decode_attention: str | None = None,
                   decode_linears: str | None = None, prefill_linears: str | None = None) -> Path:
    """A SmolLM2 bundle in the user cache, converted on first use. kv_cache, lm_head, decode_attention,
    decode_linears, prefill_linears None: the converter's defaults."""
    variant = (("" if kv_cache is None else f"-kv{kv_cache}") + ("" if lm_head is None else f"-head{lm_head}")
               + ("" if decode_attention is None else f"-{decode_attention}-attention")
               + ("" if decode_linears is None else f"-{decode_linears}-linears")
               + ("" if prefill_linears is None else f"-{prefill_linears}-prefill-linears"))
    name = (f"smollm2-{backend}-{quantize}{variant}-ctx{max_context}-lora{lora_rank}-p{'_'.join(map(str, prefill_lengths))}"
            f"-{converter_fingerprint()}")
    path = cache_dir() / "bench-bundles" / name
    if not (path / "litekv.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        options = ConvertOptions(backend=backend, quantize=quantize, max_context=max_context, lora_rank=lora_rank,
                                 prefill_lengths=prefill_lengths, kv_cache=kv_cache, lm_head=lm_head,
                                 decode_attention=decode_attention, decode_linears=decode_linears,
                                 prefill_linears=prefill_linears)
        print(f"converting {name} ...", file=sys.stderr)
        convert(checkpoint_path(), path, options, show_progress=True)
    return path


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of fn()."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def rewound_step_seconds(executor, cache, num_tokens: int, steps: int, warmup: int = 2) -> float:
    """Median seconds of one decode step with `num_tokens` in the cache, rewound before every
    step so each sees the same context (the rows below stay valid)."""
    samples = []
    for _ in range(warmup + steps):
        cache.set_num_tokens(num_tokens)
        start = time.perf_counter()
        executor.step([42], cache)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[warmup:])


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    result = {"threads": int(os.environ.get("LITEKV_THREADS", 2)), "when": time.strftime("%Y-%m-%d %H:%M"),
              **result}
    path.write_text(json.dumps(result, indent=1))
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
