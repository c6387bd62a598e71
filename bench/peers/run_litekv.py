"""litekv on SmolLM2 with the same measurements as the peer runners (main python).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/peers/run_litekv.py --backend litert --quantize int8

The bundle (max context 4096, prefill signatures 32/128/256/512) is converted once into the user
cache by bench/common.py, named with a hash of the converter sources so code changes reconvert. `load_s` is `Engine(bundle)`: manifest, tokenizer and the compiled
model, what an application pays at start-up. Timings use the engine's executor on the same fixed
token ids as the peers: a prefill is `executor.prefill(ids, fresh cache)`; time to first token
prefills all but the last prompt token and runs one decode step on it, then takes the argmax.
Decode (`decode_tok_s`) is what a session's generation runs: `sample_tokens`, 128 greedy steps
sampled inside the model (the Engine samples there unless a repetition penalty asks for logits).
`decode_step_tok_s` is 128 `step` calls, each returning every logit, with a host argmax, like the
llama.cpp runner's loop; the two differ where the bundle's fp32 head is screened (converters'
`head_screen`): only the sampler's path reads the screen instead of the whole head.
`passage_argmax` steps through the passage one token at a time (teacher forcing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/common.py

from common import smollm2_bundle  # noqa: E402
from peer_common import (DECODE_PROMPT, DECODE_TOKENS, PREFILL_LENGTHS, TTFT_PROMPT, add_serve_flag,  # noqa: E402
                         current_rss_mb, fixed_tokens, median_of, peak_rss_mb, report, serve_timings, timed)

import litekv  # noqa: E402


def passage_argmax(executor, ids: list[int]) -> list[int]:
    cache = executor.create_kv_cache()
    return [int(np.argmax(executor.step([token], cache)[0])) for token in ids[:-1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("litert", "onnx"), required=True)
    parser.add_argument("--quantize", choices=("fp32", "int8", "int4"), required=True)
    parser.add_argument("--kv-cache", choices=("fp32", "fp16", "int8"), default=None,
                        help="KV cache precision (default: the converter's: fp32 on ONNX; on LiteRT int8 with "
                        "int4 weights, else fp16)")
    parser.add_argument("--lm-head", choices=("fp32", "int8", "int4"), default=None,
                        help="LM head precision (default: the converter's, int8 for quantized weights)")
    parser.add_argument("--decode-linears", choices=("graph", "kernel"), default=None,
                        help="the decode step's quantized linears in the runtime's own ops or litekv's kernels (default: the converter's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passage", type=Path, default=None, help="passage.json: also report passage_argmax")
    parser.add_argument("--save", default=None, help="also write results/NAME.json")
    parser.add_argument("--convert-only", action="store_true",
                        help="convert the bundle if the cache lacks it, then exit (measured runs then open it only)")
    add_serve_flag(parser)
    args = parser.parse_args()

    bundle = smollm2_bundle(args.backend, args.quantize, kv_cache=args.kv_cache, lm_head=args.lm_head,
                            decode_linears=args.decode_linears)
    if args.convert_only:
        return
    load_times, engine = [], None
    for _ in range(args.repeats):
        engine = None
        start = time.perf_counter()
        engine = litekv.Engine(bundle, threads=args.threads)
        load_times.append(time.perf_counter() - start)
    load_times.sort()
    rss_after_load = current_rss_mb()
    ex = engine.executor
    model_bytes = sum(f.stat().st_size for f in bundle.iterdir() if f.suffix in (".tflite", ".onnx", ".data"))

    def prefill(tokens: list[int]):
        cache = ex.create_kv_cache()
        ex.prefill(tokens, cache)
        return cache

    decode_tokens = fixed_tokens(DECODE_PROMPT)

    def steps_once() -> float:
        cache = prefill(decode_tokens[:-1])
        token = decode_tokens[-1]
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            token = int(np.argmax(ex.step([token], cache)[0]))
        return time.perf_counter() - start

    def decode_once() -> float:
        cache = prefill(decode_tokens[:-1])
        start = time.perf_counter()
        ex.sample_tokens(DECODE_TOKENS, decode_tokens[-1:], cache)
        return time.perf_counter() - start

    if args.serve:
        prompts = {n: fixed_tokens(n) for n in PREFILL_LENGTHS}
        steps_once()  # warm-up
        serve_timings(decode_once, lambda n: timed(lambda: prefill(prompts[n])),
                      {"decode_step": lambda: DECODE_TOKENS / steps_once()})
        return

    result = {"peer": "litekv", "version": litekv.__version__, "backend": args.backend, "quantize": args.quantize,
              "kv_cache": args.kv_cache, "lm_head": args.lm_head, "decode_linears": args.decode_linears,
              "model": bundle.name, "threads": args.threads, "repeats": args.repeats,
              "load_s": load_times[len(load_times) // 2]}
    for n in PREFILL_LENGTHS:
        tokens = fixed_tokens(n)
        result[f"prefill_{n}_tok_s"] = n / median_of(lambda: prefill(tokens), args.repeats)

    ttft_tokens = fixed_tokens(TTFT_PROMPT)

    def first_token() -> int:
        cache = prefill(ttft_tokens[:-1])
        return int(np.argmax(ex.step(ttft_tokens[-1:], cache)[0]))
    result["ttft_ms"] = 1e3 * median_of(first_token, args.repeats)

    decode_once(), steps_once()  # warm-up
    times = sorted(decode_once() for _ in range(args.repeats))
    result["decode_tok_s"] = DECODE_TOKENS / times[len(times) // 2]
    times = sorted(steps_once() for _ in range(args.repeats))
    result["decode_step_tok_s"] = DECODE_TOKENS / times[len(times) // 2]
    kv_bytes = ex.create_kv_cache().stats().memory_bytes
    if args.passage:
        result["passage_argmax"] = passage_argmax(ex, json.loads(args.passage.read_text())["token_ids"])
    result.update(prompt_for_decode=DECODE_PROMPT, decode_tokens=DECODE_TOKENS, rss_after_load_mb=rss_after_load,
                  peak_rss_mb=peak_rss_mb(), model_file_mb=model_bytes / 2**20, kv_mb=kv_bytes / 2**20,
                  max_context=engine.max_context)
    report(result, args.save)


if __name__ == "__main__":
    main()
