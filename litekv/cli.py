"""The `litekv` command line."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from litekv.errors import LitekvError


def _generate(args: argparse.Namespace) -> int:
    from litekv.catalog import checkpoint_path
    from litekv.converters.checkpoint import load_checkpoint
    from litekv.reference import ReferenceModel

    source = args.model or checkpoint_path()
    started = time.perf_counter()
    ckpt = load_checkpoint(source)
    model = ReferenceModel(ckpt.config, ckpt.weights)
    tokenizer = ckpt.tokenizer
    if tokenizer.chat_template and not args.raw:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt)
    cache = model.new_cache(len(prompt) + args.max_new_tokens)
    loaded = time.perf_counter()
    logits = model.prefill(prompt, cache)
    stream = tokenizer.stream_decoder(skip_special_tokens=True)
    generated = 0
    first_token_at = None
    for _ in range(args.max_new_tokens):
        token = int(np.argmax(logits[0]))
        first_token_at = first_token_at or time.perf_counter()
        if token in tokenizer.eos_token_ids:
            break
        generated += 1
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
        logits = model.forward(np.array([[token]]), cache, last_logits_only=True)[:, -1]
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    done = time.perf_counter()
    decode_rate = (generated - 1) / (done - first_token_at) if generated > 1 else 0.0
    print(f"[{ckpt.config.architecture} reference, load {loaded - started:.1f}s, prompt {len(prompt)} tokens, "
          f"{generated} new tokens, {decode_rate:.1f} tok/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="litekv", description="On-device LLM runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to a prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(run=_generate)
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
