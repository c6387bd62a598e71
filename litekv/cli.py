"""The `litekv` command line."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from litekv.errors import LitekvError


def _generate(args: argparse.Namespace) -> int:
    from litekv.bundle import read_manifest
    from litekv.catalog import prepared_bundle
    from litekv.executor import SamplerParams, open_executor
    from litekv.tokenizer import Tokenizer

    started = time.perf_counter()
    bundle = args.model or prepared_bundle()
    executor = open_executor(bundle, threads=args.threads)
    tokenizer = Tokenizer.load(bundle)
    manifest = read_manifest(bundle)
    if tokenizer.chat_template and not args.raw:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt)
    cache = executor.create_kv_cache()
    loaded = time.perf_counter()
    executor.prefill(prompt[:-1], cache)
    sampler = SamplerParams(temperature=args.temperature, top_p=0.95, seed=args.seed)
    stream = tokenizer.stream_decoder(skip_special_tokens=True)
    token, generated, first_token_at = prompt[-1], 0, None
    while generated < args.max_new_tokens and cache.num_tokens < executor.max_context:
        token = int(executor.sample_tokens(1, [token], cache, sampler=sampler)[0, 0])
        first_token_at = first_token_at or time.perf_counter()
        if token in tokenizer.eos_token_ids:
            break
        generated += 1
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    done = time.perf_counter()
    rate = (generated - 1) / (done - first_token_at) if generated > 1 else 0.0
    print(f"[{manifest.config.architecture} {manifest.backend} {manifest.quantization['weights']}, "
          f"ready in {loaded - started:.1f}s, prompt {len(prompt)} tokens, first token after "
          f"{(first_token_at or done) - loaded:.2f}s, {generated} new tokens at {rate:.1f} tok/s]", file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from litekv.converters.convert import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="litekv", description="On-device LLM runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to a prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", help="a converted bundle (default: SmolLM2-135M-Instruct, LiteRT int8)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(run=_generate)
    from litekv.converters.convert import add_arguments

    conv = sub.add_parser("convert", help="convert a GGUF file or Hugging Face directory into a bundle")
    add_arguments(conv)
    conv.set_defaults(run=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except LitekvError as e:
        print(f"litekv: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
