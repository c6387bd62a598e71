"""Where a litekv process's resident memory goes: RSS after each stage of the benchmark's work,
and the largest mappings at the end.

Stages follow bench/peers/run_litekv.py: load the engine, prefill 256 and 1,024 tokens into fresh
caches, then 128 decode steps. Resident memory is split into anonymous (heap, KV buffers) and
file-backed pages (XNNPACK's packed-weight cache, the model file); the mappings table shows which
file or region holds them.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/memory_timeline.py --backend litert --quantize fp32
"""
from __future__ import annotations

import argparse
import collections

import numpy as np

from common import markdown_table, save, smollm2_bundle
from litekv.bundle import KV_CACHE_FORMATS, read_manifest
from litekv.resident_pages import mappings


def status_mb() -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile of this process, in MB."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in f if line.startswith(keys)}


def largest_mappings(count: int) -> list[tuple[str, int]]:
    """(mapping, resident MB) of the regions holding the most memory, summed per file/region."""
    resident: collections.Counter = collections.Counter()
    for m in mappings():
        resident[f"{m.name or '[anonymous]'} ({m.perms})"] += m.rss_kb
    return [(name, kb // 1024) for name, kb in resident.most_common(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("litert", "onnx"), default="litert")
    parser.add_argument("--quantize", choices=("fp32", "int8", "int4"), default="fp32")
    parser.add_argument("--kv-cache", choices=KV_CACHE_FORMATS, default=None,
                        help="KV cache precision (default: the converter's: fp32 on ONNX; on LiteRT int8 with "
                        "int4 weights, else fp16)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import litekv

    bundle = smollm2_bundle(args.backend, args.quantize, kv_cache=args.kv_cache)
    stages = [("start", status_mb())]
    engine = litekv.Engine(bundle, threads=args.threads)
    ex = engine.executor
    stages.append(("engine loaded", status_mb()))
    rng = np.random.default_rng(0)
    for n in (256, 1024):
        cache = ex.create_kv_cache()
        ex.prefill(rng.integers(100, 40000, n), cache)
        stages.append((f"prefill {n}", status_mb()))
    token = 42
    for _ in range(128):
        token = int(np.argmax(ex.step([token], cache)[0]))
    stages.append(("128 decode steps", status_mb()))

    model_mb = sum(f.stat().st_size for f in bundle.iterdir() if f.suffix in (".tflite", ".onnx", ".data")) / 2**20
    kv_mb = cache.stats().memory_bytes / 2**20
    print(f"{bundle.name}: model files {model_mb:.0f} MB, KV buffers {kv_mb:.0f} MB, "
          f"budget (model + KV + 150) {model_mb + kv_mb + 150:.0f} MB\n")
    print(markdown_table(["stage", "RSS MB", "peak MB", "anonymous MB", "file-backed MB"],
                         [[name, s["VmRSS"], s["VmHWM"], s["RssAnon"], s["RssFile"]] for name, s in stages]))
    mappings = largest_mappings(8)
    print()
    print(markdown_table(["mapping", "resident MB"], [list(m) for m in mappings]))
    variant = f"_kv{read_manifest(bundle).kv_dtype}"  # the default cache depends on the weights
    save(f"memory_timeline_{args.backend}_{args.quantize}{variant}",
         {"bundle": bundle.name, "model_mb": model_mb, "kv_mb": kv_mb,
          "stages": [{"stage": name, **s} for name, s in stages],
          "mappings": [{"mapping": name, "resident_mb": mb} for name, mb in mappings]})


if __name__ == "__main__":
    main()
