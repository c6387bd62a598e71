"""Saving and loading a 1,000-token SmolLM2 session, against prefilling those tokens again.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/session_io.py
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from common import markdown_table, save, smollm2_bundle
from litekv import Engine

TOKENS = 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, result = [], {}
    for backend, quantize in (("litert", "int8"), ("onnx", "int8")):
        engine = Engine(smollm2_bundle(backend, quantize))
        tokens = list(np.random.default_rng(0).integers(100, 40000, TOKENS))
        best = {"prefill": 1e9, "save": 1e9, "load": 1e9}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "session.lkvs"
            for _ in range(args.repeats):
                session = engine.create_session()
                start = time.perf_counter()
                session.prefill(tokens)
                best["prefill"] = min(best["prefill"], time.perf_counter() - start)
                start = time.perf_counter()
                session.save(path)
                best["save"] = min(best["save"], time.perf_counter() - start)
                start = time.perf_counter()
                restored = engine.load_session(path)
                best["load"] = min(best["load"], time.perf_counter() - start)
                assert restored.tokens == session.tokens
            size = path.stat().st_size
        speedup = best["prefill"] / best["load"]
        result[f"{backend}-{quantize}"] = {**best, "file_mb": size / 1e6, "load_vs_prefill": speedup}
        rows.append([f"{backend} {quantize}", f"{best['prefill'] * 1e3:.0f}", f"{best['save'] * 1e3:.0f}",
                     f"{best['load'] * 1e3:.0f}", f"{size / 1e6:.1f}", f"{speedup:.0f}x"])
    print(markdown_table(["bundle", f"prefill {TOKENS} tokens (ms)", "save (ms)", "load (ms)", "file (MB)",
                          "load vs prefill (target >= 10x)"], rows))
    save("session_io", result)


if __name__ == "__main__":
    main()
