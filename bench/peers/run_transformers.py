"""Hugging Face transformers (PyTorch CPU, fp32) on SmolLM2: prefill, TTFT, decode, load time, RSS.

Run with the MAIN interpreter (it has torch and transformers; the peer venv does not):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/peers/run_transformers.py [--model X.gguf]

The GGUF is loaded with AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32),
which dequantizes every tensor to fp32 (the shipped Q4_1 file and the F32 file give the same weights).
Prints one JSON line; every figure is the median of --repeats runs after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from peer_common import (DECODE_PROMPT, DECODE_TOKENS, PREFILL_LENGTHS, TTFT_PROMPT, add_serve_flag,
                         current_rss_mb, fixed_tokens, median_of, peak_rss_mb, report, serve_timings, timed)


def default_model() -> Path:
    from litekv.catalog import checkpoint_path
    return Path(checkpoint_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: litekv's shipped Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passage", type=Path, default=None, help="passage.json: also report passage_argmax")
    parser.add_argument("--save", default=None, help="also write results/NAME.json")
    add_serve_flag(parser)
    args = parser.parse_args()
    model_path = (args.model or default_model()).resolve()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)

    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    def load():
        m = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
        return m.eval()

    load_times = []
    model = None
    for _ in range(args.repeats):
        model = None
        start = time.perf_counter()
        model = load()
        load_times.append(time.perf_counter() - start)
    load_times.sort()
    rss_after_load = current_rss_mb()
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill(ids):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], out.past_key_values

    decode_ids = torch.tensor([fixed_tokens(DECODE_PROMPT, vocab)])

    @torch.inference_mode()
    def decode_once() -> float:
        logits, cache = prefill(decode_ids)
        token = torch.argmax(logits).view(1, 1)
        start = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = torch.argmax(out.logits[0, -1]).view(1, 1)
        return time.perf_counter() - start

    if args.serve:
        prompts = {n: torch.tensor([fixed_tokens(n, vocab)]) for n in PREFILL_LENGTHS}
        serve_timings(decode_once, lambda n: timed(lambda: prefill(prompts[n])))
        return

    result = {"peer": "transformers", "version": transformers.__version__, "torch": torch.__version__,
              "model": model_path.name, "dtype": "float32", "threads": args.threads,
              "attn_implementation": model.config._attn_implementation, "repeats": args.repeats,
              "load_s": load_times[len(load_times) // 2]}
    for n in PREFILL_LENGTHS:
        ids = torch.tensor([fixed_tokens(n, vocab)])
        result[f"prefill_{n}_tok_s"] = n / median_of(lambda: prefill(ids), args.repeats)

    ids = torch.tensor([fixed_tokens(TTFT_PROMPT, vocab)])

    def first_token():
        logits, _ = prefill(ids)
        return int(torch.argmax(logits))
    result["ttft_ms"] = 1e3 * median_of(first_token, args.repeats)

    decode_once()  # warm-up
    times = sorted(decode_once() for _ in range(args.repeats))
    result["decode_tok_s"] = DECODE_TOKENS / times[len(times) // 2]
    if args.passage:
        passage = torch.tensor([json.loads(args.passage.read_text())["token_ids"]])
        with torch.inference_mode():  # teacher forcing: one forward, the argmax at every position
            result["passage_argmax"] = model(input_ids=passage[:, :-1]).logits[0].argmax(-1).tolist()
    result.update(prompt_for_decode=DECODE_PROMPT, decode_tokens=DECODE_TOKENS, rss_after_load_mb=rss_after_load,
                  peak_rss_mb=peak_rss_mb())
    report(result, args.save)


if __name__ == "__main__":
    main()
