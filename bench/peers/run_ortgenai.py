"""onnxruntime-genai on SmolLM2: prefill, TTFT, decode, load time, RSS (and the passage argmax).

Run with the ortgenai venv's interpreter (bash bench/peers/setup_ortgenai.sh creates it; the models come
from make_ortgenai_models.py):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE bench/peers/.venv-ortgenai/bin/python bench/peers/run_ortgenai.py \
        --model ~/.cache/litekv/peers/ortgenai-int4

The model directory's genai_config.json is loaded with og.Config and overlaid in memory (the file is
not changed) with decoder session_options intra_op_num_threads=--threads, inter_op_num_threads=1. One
Generator (greedy: do_sample=False, max_length=2048) is reused: each timing calls generator.rewind_to(0)
(an empty KV cache, like llama.cpp's reset) and then generator.append_tokens(all prompt ids at once),
which runs the whole prompt as one forward pass (search chunk_size is 0, so nothing is split).
generate_next_token() right after append_tokens only picks the argmax of the prefill's logits; each
later call runs one single-token forward on the KV cache and then picks the argmax, so the decode clock
covers 128 such calls. Inputs are fixed token ids (no chat template, no BOS). Prints one JSON line; every
figure is the median of --repeats runs after one warm-up.

The builder's default graphs compute logits for every prompt position (no prune_lm_head), so the
prefill figures include the lm_head on all positions, which llama.cpp (logits_all=False) and the
transformers runner (logits_to_keep=1) skip. The same full logits give the passage argmax in one forward.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from peer_common import (DECODE_PROMPT, DECODE_TOKENS, PREFILL_LENGTHS, TTFT_PROMPT, add_serve_flag,
                         current_rss_mb, fixed_tokens, median_of, peak_rss_mb, report, serve_timings, timed)

MAX_LENGTH = 2048  # KV cache capacity (past_present_share_buffer: allocated once per Generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model directory with genai_config.json")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passage", type=Path, default=None, help="passage.json: also report passage_argmax")
    parser.add_argument("--save", default=None, help="also write results/NAME.json")
    add_serve_flag(parser)
    args = parser.parse_args()

    import onnxruntime
    import onnxruntime_genai as og

    genai_config = json.loads((args.model / "genai_config.json").read_text())
    session_options = {"intra_op_num_threads": args.threads, "inter_op_num_threads": 1}

    def load() -> og.Model:
        config = og.Config(str(args.model))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": session_options}}}))
        return og.Model(config)

    load_times, model = [], None
    for _ in range(args.repeats):
        model = None  # drop the previous model before loading the next one
        start = time.perf_counter()
        model = load()
        load_times.append(time.perf_counter() - start)
    load_times.sort()
    rss_after_load = current_rss_mb()
    vocab = genai_config["model"]["vocab_size"]

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=MAX_LENGTH)
    generator = og.Generator(model, params)

    def prefill(tokens: np.ndarray) -> None:
        generator.rewind_to(0)
        generator.append_tokens(tokens)

    def ids(n: int) -> np.ndarray:
        return np.array(fixed_tokens(n, vocab), dtype=np.int32)

    def start(tokens: np.ndarray) -> int:
        """Prefill, then the first greedy token: argmax of the prefill's last logits (no forward)."""
        prefill(tokens)
        generator.generate_next_token()
        return int(generator.get_next_tokens()[0])

    decode_tokens = ids(DECODE_PROMPT)

    def decode_once() -> float:
        start(decode_tokens)
        begin = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            generator.generate_next_token()  # one forward of the previous token, then its argmax
        elapsed = time.perf_counter() - begin
        assert generator.token_count() == DECODE_PROMPT + 1 + DECODE_TOKENS
        return elapsed

    if args.serve:
        prompts = {n: ids(n) for n in PREFILL_LENGTHS}
        serve_timings(decode_once, lambda n: timed(lambda: prefill(prompts[n])))
        return

    result = {"peer": "onnxruntime-genai", "version": og.__version__, "onnxruntime": onnxruntime.__version__,
              "model": args.model.name, "threads": args.threads, "session_options": session_options,
              "max_length": MAX_LENGTH, "repeats": args.repeats, "load_s": load_times[len(load_times) // 2]}
    for n in PREFILL_LENGTHS:
        tokens = ids(n)
        result[f"prefill_{n}_tok_s"] = n / median_of(lambda tokens=tokens: prefill(tokens), args.repeats)

    ttft_tokens = ids(TTFT_PROMPT)
    result["ttft_ms"] = 1e3 * median_of(lambda: start(ttft_tokens), args.repeats)

    decode_once()  # warm-up
    times = sorted(decode_once() for _ in range(args.repeats))
    result["decode_tok_s"] = DECODE_TOKENS / times[len(times) // 2]

    if args.passage:
        passage = json.loads(args.passage.read_text())["token_ids"]
        # Teacher forcing in one forward: logits [1, len, vocab] for every position; row i follows ids[0..i].
        prefill(np.array(passage[:-1], dtype=np.int32))
        logits = generator.get_output("logits")
        assert logits.shape[:2] == (1, len(passage) - 1), logits.shape
        result["passage_argmax"] = logits[0].argmax(axis=-1).tolist()

    result.update(prompt_for_decode=DECODE_PROMPT, decode_tokens=DECODE_TOKENS, rss_after_load_mb=rss_after_load,
                  peak_rss_mb=peak_rss_mb())
    report(result, args.save)


if __name__ == "__main__":
    main()
