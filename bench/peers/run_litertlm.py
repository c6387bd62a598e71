"""LiteRT-LM (litert-lm-api) on SmolLM2: prefill, TTFT, decode, load time, RSS, passage argmax.

Run with the LiteRT-LM venv's interpreter (bash bench/peers/setup_litertlm.sh creates it; the bundles come
from make_litertlm_models.py):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE bench/peers/.venv-litertlm/bin/python bench/peers/run_litertlm.py \\
        --model ~/.cache/litekv/peers/litertlm-fp32.litertlm --passage bench/peers/passage.json

Engine: litert_lm.Engine(model, backend=Backend.CPU(thread_count=--threads), enable_benchmark=True); the KV
cache size is the bundle's (2048). Every measurement uses a fresh Session (created outside the clock) made
with apply_prompt_template=False (raw tokens, no chat template) and SamplerConfig(top_k=1) (greedy). The
bundles have no start token (make_litertlm_models.py removes it), so no BOS is fed, as in the other peers.

Prompts are text. LiteRT-LM's Python API takes prefill input as text only (Session.run_prefill(list[str]))
and the runtime tokenizes it; there is no way to feed token ids. Decoding the fixed ids of
peer_common.fixed_tokens(n) and re-encoding them does not give n tokens back (random ids merge and split:
256 ids re-encode to ~266), so the prompt is built as: ids = runtime_tokenize(runtime_detokenize(fixed_tokens
(n + 64)))[:n], text = runtime_detokenize(ids), and it is kept only if runtime_tokenize(text) == ids (else the
cut moves by one id and is tried again). The prompt is thus the same pseudo-random text as the other peers'
prompts, in the runtime's own canonical tokenization, exactly n tokens long; `prompt_ids_shared_with_fixed`
tells how many of its n ids equal fixed_tokens(n) position by position. After every prefill the runner checks
the runtime's own count (BenchmarkInfo.last_prefill_token_count) is n.

Figures (median of --repeats runs after one warm-up, like run_llamacpp.py):
  load_s               Engine construction (median of --repeats loads in one process; file in page cache).
                       The CPU backend (XNNPACK) keeps packed weights in MODEL_<mtime>_<size>.xnnpack_cache
                       next to the bundle and builds it on the first load ever; `weight_cache_existed` says
                       whether it was there before this run's first load (later loads always find it).
  prefill_N_tok_s      N / wall time of session.run_prefill([text]) for N = 256, 1024 (prefill_256 and
                       prefill_1024 signatures of the bundle), tokenization of the text included (C++, ~1 ms)
  ttft_ms              256-token prompt: run_prefill + run_decode on a session with max_output_tokens=1,
                       i.e. prefill plus the first greedy token
  decode_tok_s         128 greedy tokens after a 256-token prompt, prefill not timed. The API decodes a whole
                       response per call (run_decode, up to max_output_tokens), so it is derived as
                       128 / (T_decode(129 tokens) - T_decode(1 token)): both times are run_decode alone on a
                       freshly prefilled session, so the difference is 128 decode steps with sampling and
                       detokenization, without prefill and without the first step. If a stop token ends the
                       response early, the runtime's token count is used instead of 129 (decode_tokens says).
  rss_after_load_mb, peak_rss_mb: as in the other peers (psutil RSS after the last load; ru_maxrss at the end).
  litertlm_*           the runtime's own BenchmarkInfo for the same runs (medians): prefill tok/s over the
                       prefill turn, time to first token, decode tok/s over the decode turn, init time.

passage_argmax (--passage FILE with token_ids): LiteRT-LM's Python API exposes no logits or scores for the
next token (Responses.scores is a sequence score; run_text_scoring scores a given target), so this uses the
fallback: for each position i, a fresh session is prefilled with the text of ids[0..i] and decodes one greedy
token; its text is re-encoded with the runtime tokenizer and must be exactly one id, which is reported.
Positions whose prefix text does not re-encode to ids[0..i], or whose produced text is not one token (a stop
token, which the runtime reports as empty text, or a partial UTF-8 byte), give -1 and are counted in
passage_prefix_mismatches / passage_unresolved.

Checked on 2026-11-22 (litert-lm-api 0.18.1): thread_count is honoured (int8 prefill@1024 314 tok/s with 1
thread, 606 with 2, two busy worker threads); the fp32 bundle's passage_argmax equals transformers' fp32
teacher-forced argmax at 200/200 positions (int8: 184/200, all differences at near-ties).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path

from peer_common import (DECODE_PROMPT, DECODE_TOKENS, PREFILL_LENGTHS, TTFT_PROMPT, add_serve_flag,
                         current_rss_mb, fixed_tokens, median_of, peak_rss_mb, report, serve_timings)

import litert_lm

GREEDY = litert_lm.SamplerConfig(top_k=1, seed=0)


def new_session(engine: litert_lm.Engine, max_output_tokens: int) -> litert_lm.Session:
    """A raw session: no chat template, greedy sampling, at most max_output_tokens decoded per call."""
    return engine.create_session(apply_prompt_template=False, sampler_config=GREEDY,
                                 max_output_tokens=max_output_tokens)


def exact_prompt(engine: litert_lm.Engine, n: int) -> tuple[str, list[int]]:
    """Text whose runtime tokenization is exactly n tokens, made from fixed_tokens (see module docstring)."""
    canonical = engine.tokenize(engine.detokenize(fixed_tokens(n + 64)))
    for start in range(16):
        ids = canonical[start:start + n]
        text = engine.detokenize(ids)
        if len(ids) == n and engine.tokenize(text) == ids:
            return text, ids
    raise RuntimeError(f"no {n}-token prompt text found")


class Runner:
    """Holds the engine and collects wall times plus the runtime's BenchmarkInfo per measurement."""

    def __init__(self, engine: litert_lm.Engine, repeats: int):
        self.engine = engine
        self.repeats = repeats
        self.info: dict[str, list[litert_lm.BenchmarkInfo]] = {}

    def _keep(self, key: str, session: litert_lm.Session) -> litert_lm.BenchmarkInfo:
        info = session.get_benchmark_info()
        self.info.setdefault(key, []).append(info)
        return info

    def prefill(self, text: str, n: int) -> float:
        """Wall seconds of one prefill of `text` (n tokens) into a fresh session."""
        session = new_session(self.engine, 1)
        start = time.perf_counter()
        session.run_prefill([text])
        elapsed = time.perf_counter() - start
        info = self._keep(f"prefill_{n}", session)
        session.close()
        if info.last_prefill_token_count != n:
            raise RuntimeError(f"runtime prefilled {info.last_prefill_token_count} tokens, expected {n}")
        return elapsed

    def prefill_then_decode(self, text: str, n_out: int, key: str) -> tuple[float, float, int]:
        """(prefill s, run_decode s, tokens decoded) on a fresh session allowed n_out output tokens."""
        session = new_session(self.engine, n_out)
        start = time.perf_counter()
        session.run_prefill([text])
        middle = time.perf_counter()
        session.run_decode()
        end = time.perf_counter()
        info = self._keep(key, session)
        session.close()
        return middle - start, end - middle, info.last_decode_token_count

    def median_info(self, key: str, field: str) -> float:
        """Median of a BenchmarkInfo field over the measured runs (the last `repeats`, warm-ups excluded)."""
        return statistics.median(getattr(i, field) for i in self.info[key][-self.repeats:])


def passage_argmax(engine: litert_lm.Engine, ids: list[int], positions: int) -> dict:
    """Greedy next token after each prefix ids[0..i] (fallback method of the module docstring)."""
    argmax, mismatches, unresolved = [], 0, 0
    for i in range(positions):
        prefix = ids[:i + 1]
        text = engine.detokenize(prefix)
        if engine.tokenize(text) != prefix:
            mismatches += 1
            argmax.append(-1)
            continue
        session = new_session(engine, 1)
        session.run_prefill([text])
        produced = "".join(session.run_decode().texts)
        session.close()
        token = engine.tokenize(produced) if produced else []
        if len(token) == 1:
            argmax.append(token[0])
        else:
            unresolved += 1
            argmax.append(-1)
    return {"passage_argmax": argmax, "passage_method": "fresh session per prefix + 1 greedy decode step "
            "(no logits in the Python API)", "passage_prefix_mismatches": mismatches,
            "passage_unresolved": unresolved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help=".litertlm bundle")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", default=None, help="also write results/NAME.json")
    parser.add_argument("--passage", type=Path, default=None, help="passage.json: adds passage_argmax")
    parser.add_argument("--passage-positions", type=int, default=200)
    add_serve_flag(parser)
    args = parser.parse_args()

    litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)

    def load() -> litert_lm.Engine:
        return litert_lm.Engine(str(args.model), backend=litert_lm.Backend.CPU(thread_count=args.threads),
                                enable_benchmark=True)

    cache_existed = any(args.model.parent.glob(args.model.name + "_*.xnnpack_cache"))
    load_times, engine = [], None
    for _ in range(args.repeats):
        if engine is not None:
            engine.close()
            engine = None
        start = time.perf_counter()
        engine = load()
        load_times.append(time.perf_counter() - start)
    rss_after_load = current_rss_mb()
    runner = Runner(engine, args.repeats)

    result: dict = {"peer": "litert-lm", "version": version("litert-lm-api"), "model": args.model.name,
                    "threads": args.threads, "backend": "cpu", "repeats": args.repeats,
                    "load_s": statistics.median(load_times), "weight_cache_existed": cache_existed}

    prompts: dict[int, tuple[str, list[int]]] = {}
    for n in sorted({*PREFILL_LENGTHS, TTFT_PROMPT, DECODE_PROMPT}):
        prompts[n] = exact_prompt(engine, n)
    result["prompt_ids_shared_with_fixed"] = {
        str(n): sum(a == b for a, b in zip(ids, fixed_tokens(n))) for n, (_, ids) in prompts.items()}

    if args.serve:
        def decode_seconds() -> float:
            """DECODE_TOKENS steps: T(DECODE_TOKENS + 1 tokens) - T(1 token), as below."""
            _, one, _ = runner.prefill_then_decode(prompts[DECODE_PROMPT][0], 1, "ttft")
            _, many, count = runner.prefill_then_decode(prompts[DECODE_PROMPT][0], DECODE_TOKENS + 1, "decode")
            return (many - one) * DECODE_TOKENS / (count - 1)

        serve_timings(decode_seconds, lambda n: runner.prefill(prompts[n][0], n))
        engine.close()
        return

    for n in PREFILL_LENGTHS:
        text = prompts[n][0]
        result[f"prefill_{n}_tok_s"] = n / median_of(lambda: runner.prefill(text, n), args.repeats)

    ttft_text = prompts[TTFT_PROMPT][0]
    first: list[tuple[float, float, int]] = []

    def first_token() -> None:
        first.append(runner.prefill_then_decode(ttft_text, 1, "ttft"))
    first_token()  # warm-up
    first.clear()
    for _ in range(args.repeats):
        first_token()
    result["ttft_ms"] = 1e3 * statistics.median(p + d for p, d, _ in first)
    one_step = statistics.median(d for _, d, _ in first)

    decode_text = prompts[DECODE_PROMPT][0]
    runner.prefill_then_decode(decode_text, DECODE_TOKENS + 1, "decode")  # warm-up
    runs = [runner.prefill_then_decode(decode_text, DECODE_TOKENS + 1, "decode") for _ in range(args.repeats)]
    decoded = min(count for _, _, count in runs)
    result["decode_tok_s"] = (decoded - 1) / (statistics.median(d for _, d, _ in runs) - one_step)
    result.update(prompt_for_decode=DECODE_PROMPT, decode_tokens=decoded - 1,
                  decode_method="128/(T_run_decode(129 tokens) - T_run_decode(1 token)), prefill excluded")

    result.update(
        litertlm_init_s=runner.median_info("ttft", "init_time_in_second"),
        litertlm_prefill_256_tok_s=runner.median_info("prefill_256", "last_prefill_tokens_per_second"),
        litertlm_prefill_1024_tok_s=runner.median_info("prefill_1024", "last_prefill_tokens_per_second"),
        litertlm_ttft_ms=1e3 * runner.median_info("ttft", "time_to_first_token_in_second"),
        litertlm_decode_tok_s=runner.median_info("decode", "last_decode_tokens_per_second"),
        litertlm_decode_token_count=int(runner.median_info("decode", "last_decode_token_count")))

    if args.passage:
        ids = json.loads(args.passage.read_text())["token_ids"]
        start = time.perf_counter()
        result.update(passage_argmax(engine, ids, min(args.passage_positions, len(ids) - 1)))
        result["passage_s"] = time.perf_counter() - start

    result.update(rss_after_load_mb=rss_after_load, peak_rss_mb=peak_rss_mb())
    engine.close()
    report(result, args.save)


if __name__ == "__main__":
    main()
