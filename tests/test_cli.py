"""The command line, driven through a real terminal (pexpect gives it a pty)."""
from __future__ import annotations

import sys

import pexpect
import pytest

from conformance import bundle

pytestmark = pytest.mark.slow


def spawn(*args: str, timeout: int = 120) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "litekv.cli", *args], encoding="utf-8", timeout=timeout)


def test_inspect_lists_signatures_and_sizes():
    child = spawn("inspect", str(bundle("llama", "litert")))
    child.expect("backend +litert")
    child.expect("decode_s16 +decode")
    child.expect(pexpect.EOF)


def test_generate_on_a_bundle():
    child = spawn("generate", "--model", str(bundle("llama", "onnx")), "--prompt", "hi", "--max-new-tokens", "5")
    child.expect(r"5 new tokens at [\d.]+ tok/s")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_errors_are_reported_with_exit_code_1(tmp_path):
    child = spawn("inspect", str(tmp_path))
    child.expect("litekv: error: .*no litekv.json")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1


@pytest.mark.real_model
def test_chat_streams_survives_ctrl_c_and_saves_and_loads(tmp_path):
    child = spawn("chat", timeout=300)
    child.expect("litekv chat:")
    child.expect("> ")
    child.sendline("What is the capital of France?")
    child.expect("France\\?\r\n")
    child.expect("Paris")
    child.expect("\n> ")
    child.sendline("Write a very long story about a dragon who learns to bake bread, with many chapters.")
    child.expect("many chapters.\r\n")  # the terminal's echo of the question
    child.expect(r"\w+ \w+ \w+ \w+")  # the answer is streaming
    child.sendintr()  # Ctrl-C in the middle of the answer
    child.expect(r"\[stopped\]")
    child.expect("\n> ")
    saved = tmp_path / "chat.lkvs"
    child.sendline(f"/save {saved}")
    child.expect(r"\[saved (\d+) tokens")
    tokens = int(child.match.group(1))
    child.expect("> ")
    child.sendline(f"/load {saved}")
    child.expect(rf"\[loaded {tokens} tokens")
    child.expect("> ")
    child.sendline("Thank you!")
    child.expect(r"\w+")
    child.expect("\n> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and saved.exists()
