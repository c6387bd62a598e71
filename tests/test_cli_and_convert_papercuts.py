"""Command line and convert() paper cuts: Ctrl-C in chat, slash commands, end tokens in printed text,
default prefill lengths on small contexts, and one option path for litekv.convert and the CLI."""
from __future__ import annotations

import argparse
import builtins
import json
import signal
import threading
import time
from types import SimpleNamespace

import pytest

import litekv
from conformance import checkpoint_dir
from fake_executor import ScriptedExecutor
from litekv import cli
from litekv.bundle import MANIFEST
from litekv.converters import convert as convert_module
from litekv.converters.convert import OPTION_NAMES, ConvertOptions, options_from_args
from litekv.engine import Engine, GenerationChunk
from litekv.errors import ConfigError
from litekv.tokenizer import Tokenizer


def tokenizer() -> Tokenizer:
    """The tiny checkpoint's tokenizer with SmolLM2's two end ids: <|im_end|> (its eos_token) and <|endoftext|>."""
    base = Tokenizer.from_hf_dir(checkpoint_dir("llama"))
    return Tokenizer(base.backend, bos_token=base.bos_token, eos_token="<|im_end|>",
                     eos_token_ids=[base.token_to_id("<|endoftext|>")], chat_template=base.chat_template)


def scripted_engine(text: str, max_context: int = 256) -> Engine:
    tok = tokenizer()
    executor = ScriptedExecutor(tok.encode(text, add_special_tokens=False), tok.vocab_size, max_context)
    return Engine.from_executor(executor, tok, "scripted")


def run_cli(monkeypatch, capsys, engine: Engine, *argv: str, lines: tuple[str, ...] = ()) -> str:
    """stdout of `litekv ARGV` on `engine`, typing `lines` into the chat."""
    typed = iter(lines)

    def type_line(prompt: str = "") -> str:
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(cli, "_engine", lambda args: engine)
    monkeypatch.setattr(builtins, "input", type_line)
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


# ---- Ctrl-C -----------------------------------------------------------------------------------

class BlockedChat:
    """A chat whose reply is a model call holding a lock that the session's cancel() also takes (as
    the executor's did); Ctrl-C lands inside that call, `presses` times."""

    def __init__(self, presses: int = 1):
        self.lock, self.cancelled, self.presses = threading.Lock(), threading.Event(), presses
        self.handler_seconds = None
        self.session = SimpleNamespace(cancel=self._cancel, engine=SimpleNamespace(tokenizer=tokenizer()))

    def _cancel(self) -> None:
        if not self.lock.acquire(timeout=3):
            raise AssertionError("cancel() ran on the thread that holds the model call's lock")
        self.lock.release()
        self.cancelled.set()

    def send(self, line: str):
        with self.lock:
            started = time.monotonic()
            for _ in range(self.presses):
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            self.handler_seconds = time.monotonic() - started
        assert self.cancelled.wait(5), "the first Ctrl-C never cancelled the session"
        yield GenerationChunk(-1, "", "cancelled")


def test_ctrl_c_inside_a_model_call_returns_at_once_and_cancels_after_it(capsys):
    chat, before = BlockedChat(), signal.getsignal(signal.SIGINT)
    cli._answer(chat, "hello")
    assert chat.handler_seconds < 1.0
    assert "[stopped]" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before


def test_second_ctrl_c_exits():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        cli._answer(BlockedChat(presses=2), "hello")
    assert signal.getsignal(signal.SIGINT) is before


# ---- slash commands ---------------------------------------------------------------------------

def test_slash_commands_without_their_argument_or_unknown_do_not_reach_the_model(monkeypatch, capsys):
    engine = scripted_engine("Hi there.<|im_end|>")
    out = run_cli(monkeypatch, capsys, engine, "chat",
                  lines=("/save", "/load  ", "/bogus", "/quit now", "/reset please", "/help", "/quit"))
    assert engine.executor.fed == []
    for expected in ("[usage: /save PATH]", "[usage: /load PATH]", "[unknown command /bogus; the commands are",
                     "[/quit takes no argument]", "[/reset takes no argument]", "/reset (a new conversation)"):
        assert expected in out


def test_reset_starts_over_once_the_context_is_full(monkeypatch, capsys):
    engine = scripted_engine("one two three four five six ", max_context=64)  # never ends: fills the context
    out = run_cli(monkeypatch, capsys, engine, "chat", "--system", "Be brief.",
                  lines=("Tell me everything.", "And more?", "/reset", "Again?"))
    full, _, after = out.partition("[new conversation]")
    assert "Type /reset to start one" in full
    assert "one two three" in after and "error" not in after
    assert engine.tokenizer.decode(engine.executor.fed).count("Be brief.") == 2  # the reset kept the system


def test_a_double_slash_sends_a_message_that_begins_with_a_slash(monkeypatch, capsys):
    engine = scripted_engine("ok<|im_end|>")
    run_cli(monkeypatch, capsys, engine, "chat", lines=("//usr/bin is a folder?",))
    fed = engine.tokenizer.decode(engine.executor.fed)
    assert "user\n/usr/bin is a folder?" in fed


# ---- end tokens in printed text ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "chat"])
def test_an_end_token_other_than_eos_token_is_not_printed(monkeypatch, capsys, command):
    engine = scripted_engine("Paris is lovely.<|endoftext|>")
    argv = ["generate", "--prompt", "Where?"] if command == "generate" else ["chat"]
    out = run_cli(monkeypatch, capsys, engine, *argv, lines=("Where?",))
    assert "Paris is lovely." in out
    assert "<|" not in out


# ---- convert: default prefill lengths ---------------------------------------------------------

def test_default_prefill_lengths_are_those_that_fit_the_context(tmp_path, capsys):
    assert ConvertOptions(max_context=256).prefill_chunk_lengths == (32, 128)
    assert ConvertOptions(max_context=4096).prefill_chunk_lengths == (32, 128, 512)
    assert ConvertOptions(max_context=16).prefill_chunk_lengths == (16,)
    with pytest.raises(ConfigError, match="prefill length 512 is above the max context 256"):
        ConvertOptions(max_context=256, prefill_lengths=(128, 512))
    api = litekv.convert(checkpoint_dir("llama"), tmp_path / "api", backend="onnx", max_context=64)
    assert json.loads((api / MANIFEST).read_text())["prefill_lengths"] == [32]
    assert convert_module.main([str(checkpoint_dir("llama")), "-o", str(tmp_path / "cli"), "--backend", "onnx",
                                "--max-context", "16"]) == 0
    assert json.loads((tmp_path / "cli" / MANIFEST).read_text())["prefill_lengths"] == [16]


# ---- convert: one option path for Python and the command line ---------------------------------

def captured_options(monkeypatch) -> list[ConvertOptions]:
    seen = []
    monkeypatch.setattr(convert_module, "convert", lambda source, output, options, **_: seen.append(options))
    return seen


def test_convert_takes_every_option_as_a_keyword(monkeypatch):
    seen = captured_options(monkeypatch)
    chosen = dict(quantize="int4", max_context=64, prefill_lengths=[8, 16], kv_cache="int8", key_blocks=True,
                  decode_attention="kernel", prefill_attention="kernel", decode_linears="kernel",
                  prefill_linears="graph", lm_head="int8", embedding="fp16", sampler=False, head_screen=False)
    litekv.convert("model.gguf", "out", **chosen)
    assert seen[0] == ConvertOptions(**{**chosen, "prefill_lengths": (8, 16)})
    litekv.convert("model.gguf", "out", options=seen[0], max_context=128)
    assert seen[1].max_context == 128 and seen[1].key_blocks and seen[1].prefill_lengths == (8, 16)


def test_convert_refuses_an_unknown_keyword_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown conversion option kv_key_blocks; the options are .*key_blocks"):
        litekv.convert("model.gguf", "out", kv_key_blocks=True)


def test_every_cli_flag_is_an_option_and_every_option_a_flag():
    parser = cli.build_parser()
    argv = ["convert", "m.gguf", "-o", "out", "--backend", "onnx", "--quantize", "int4", "--max-context", "64",
            "--prefill-lengths", "8,16", "--lora-rank", "4", "--lora-targets", "q,v", "--no-sampler",
            "--no-head-screen", "--lm-head", "int8", "--embedding", "fp16", "--kv-cache", "fp32"]
    options = options_from_args(parser.parse_args(argv))
    assert options == ConvertOptions(backend="onnx", quantize="int4", max_context=64, prefill_lengths=(8, 16),
                                     lora_rank=4, lora_targets=("q", "v"), sampler=False, head_screen=False,
                                     lm_head="int8", embedding="fp16", kv_cache="fp32")
    assert options_from_args(parser.parse_args(["convert", "m.gguf", "-o", "out"])) == ConvertOptions()
    flags = argparse.ArgumentParser()
    convert_module.add_arguments(flags)
    assert {a.dest for a in flags._actions} - {"help", "source", "output"} == set(OPTION_NAMES)
