"""Prefill and decode tokens/s of the numpy reference on SmolLM2-135M-Instruct.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/reference_speed.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from litekv.catalog import checkpoint_path
from litekv.converters.checkpoint import load_checkpoint
from litekv.reference import ReferenceModel


def measure(model: ReferenceModel, prompt_len: int, decode_steps: int, chunk: int) -> tuple[float, float]:
    cache = model.new_cache(prompt_len + decode_steps + 8)
    prompt = np.random.default_rng(0).integers(100, 40000, prompt_len)
    start = time.perf_counter()
    model.prefill(prompt, cache, chunk_size=chunk)
    prefill = prompt_len / (time.perf_counter() - start)
    token = np.array([[42]])
    start = time.perf_counter()
    for _ in range(decode_steps):
        model.forward(token, cache, last_logits_only=True)
    decode = decode_steps / (time.perf_counter() - start)
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "reference_speed.json")
    args = parser.parse_args()

    ckpt = load_checkpoint(checkpoint_path(), with_tokenizer=False)
    model = ReferenceModel(ckpt.config, ckpt.weights)
    measure(model, 32, 4, args.chunk)  # warm-up: page in weights, build fused matrices
    runs = [measure(model, args.prompt, args.decode, args.chunk) for _ in range(args.runs)]
    result = {
        "model": "SmolLM2-135M-Instruct (fp32 numpy reference)",
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "prefill_tok_s": statistics.median(r[0] for r in runs),
        "decode_tok_s": statistics.median(r[1] for r in runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"| reference fp32 | prefill {result['prefill_tok_s']:.0f} tok/s ({args.prompt} tokens) "
          f"| decode {result['decode_tok_s']:.1f} tok/s | median of {args.runs} |")


if __name__ == "__main__":
    main()
