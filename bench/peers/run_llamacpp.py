"""llama.cpp (llama-cpp-python) on SmolLM2: prefill, TTFT, decode, load time, RSS.

Run with the PEER venv's interpreter (bash bench/peers/setup.sh creates it):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE bench/peers/.venv/bin/python bench/peers/run_llamacpp.py --model X.gguf

The model is opened as Llama(model_path, n_ctx=2048, n_threads=2, n_batch=1024, logits_all=False,
verbose=False). Each timing calls llm.reset() and then times llm.eval(tokens) on fixed token ids (no
chat template, no BOS), so only llama.cpp's decode calls plus llama-cpp-python's thin batching loop
are inside the clock. Prints one JSON line; every figure is the median of --repeats runs after one
warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from peer_common import (DECODE_PROMPT, DECODE_TOKENS, PREFILL_LENGTHS, TTFT_PROMPT, add_serve_flag,
                         current_rss_mb, fixed_tokens, median_of, peak_rss_mb, report, serve_timings, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passage", type=Path, default=None, help="passage.json: also report passage_argmax")
    parser.add_argument("--save", default=None, help="also write results/NAME.json")
    add_serve_flag(parser)
    args = parser.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    def load() -> Llama:
        return Llama(model_path=str(args.model), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                     n_batch=1024, logits_all=False, verbose=False)

    load_times, llm = [], None
    for _ in range(args.repeats):
        if llm is not None:
            llm.close()
            llm = None
        start = time.perf_counter()
        llm = load()
        load_times.append(time.perf_counter() - start)
    load_times.sort()
    rss_after_load = current_rss_mb()
    vocab = llm.n_vocab()

    def prefill(tokens: list[int]) -> None:
        llm.reset()
        llm.eval(tokens)

    def last_logits() -> np.ndarray:
        # With logits_all=False, Llama.eval keeps no logits in llm.scores; read the context's last row.
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))

    decode_tokens = fixed_tokens(DECODE_PROMPT, vocab)

    def decode_once() -> float:
        prefill(decode_tokens)
        token = int(np.argmax(last_logits()))
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
        return time.perf_counter() - start

    if args.serve:
        prompts = {n: fixed_tokens(n, vocab) for n in PREFILL_LENGTHS}
        serve_timings(decode_once, lambda n: timed(lambda: prefill(prompts[n])))
        llm.close()
        return

    result = {"peer": "llama.cpp", "version": llama_cpp.__version__, "model": args.model.name,
              "threads": args.threads, "n_batch": 1024, "repeats": args.repeats,
              "load_s": load_times[len(load_times) // 2]}
    for n in PREFILL_LENGTHS:
        tokens = fixed_tokens(n, vocab)
        result[f"prefill_{n}_tok_s"] = n / median_of(lambda: prefill(tokens), args.repeats)

    ttft_tokens = fixed_tokens(TTFT_PROMPT, vocab)

    def first_token() -> int:
        prefill(ttft_tokens)
        return int(np.argmax(last_logits()))
    result["ttft_ms"] = 1e3 * median_of(first_token, args.repeats)

    decode_once()  # warm-up
    times = sorted(decode_once() for _ in range(args.repeats))
    result["decode_tok_s"] = DECODE_TOKENS / times[len(times) // 2]
    if args.passage:  # teacher forcing, one token per eval so every position's logits are read
        llm.reset()
        argmax = []
        for token in json.loads(args.passage.read_text())["token_ids"][:-1]:
            llm.eval([token])
            argmax.append(int(np.argmax(last_logits())))
        result["passage_argmax"] = argmax
    result.update(prompt_for_decode=DECODE_PROMPT, decode_tokens=DECODE_TOKENS, rss_after_load_mb=rss_after_load,
                  peak_rss_mb=peak_rss_mb(),
                  system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip())
    llm.close()
    report(result, args.save)


if __name__ == "__main__":
    main()
