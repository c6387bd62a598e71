"""The tokenizer and the host sampler as an app uses them: hard text against transformers on both real
models, streaming, chat templates, and the argument and file mistakes that must raise litekv errors."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from litekv.errors import CheckpointError, ConfigError
from litekv.sampling import CANDIDATES, sample_token
from litekv.tokenizer import Tokenizer
from real_models import gemma3_gguf, smollm2_gguf

# Pieces of hard text: many scripts, combining marks, emoji with ZWJ and modifiers, invisible characters,
# whitespace runs, CRLF, digits of several scripts, special-token text and near misses of it.
POOL = [
    "hello", "World", " the", "don't", "I'M", "we'll", "naïve", "café", "e\u0301", "a\u0308\u0323", "\u0301",
    "你好", "世界", "日本語", "한국어", "Привет", "Ελληνικά", "עברית", "العربية", "हिन्दी", "ไทย", "ქართ",
    "𓀀", "𝔹", "龘", "𠜎", "🤗", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "\u200d", "\u200b", "\ufeff", "\u00a0",
    "\u3000", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\v", "\f",
    "0", "7", "42", "123456789012345", "3.14", "1,000", "-5", "٣٤", "१२",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
    "<pad>", "<|im_start", "im_end|>", "<", ">", "|", "'s", "'", '"', "...", "—", "“", "”", "$", "%",
    "=>", "::", "{}", "def", "return", "x**2", "\\n", "http://a.b/c?d=e", "ÿ", "\x00", "\x7f", "\x1b[0m",
]


def generated_texts(count: int, seed: int) -> list[str]:
    """Deterministic strings of 1-12 pieces, a few of them random code points of several planes."""
    rng = random.Random(seed)
    texts = [""]
    for _ in range(count - 1):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.85:
                parts.append(rng.choice(POOL))
            else:
                low, high = rng.choice([(0x20, 0x2FF), (0x370, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF),
                                        (0x10000, 0x2FFFF)])
                parts.append(chr(rng.randint(low, high)))
        texts.append("".join(parts))
    return texts


def tokenizer_pair(path: Path) -> tuple[Tokenizer, Any]:
    """(litekv's tokenizer, transformers' reference) from one GGUF file.

    Both read the metadata with transformers' GGUF reader (gguf.GGUFReader takes 15-25 s on Gemma's 262k
    tokens); what is compared is what each builds from it."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.integrations.gguf.reader import read_gguf_metadata

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    meta, _ = read_gguf_metadata(path, arrays)
    ours = Tokenizer.from_gguf_metadata(meta)
    architecture, tokenizer_dict, config = get_gguf_tokenizer(path)
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return ours, transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, Any]:
    from tokenizers import pre_tokenizers

    ours, ref = tokenizer_pair(smollm2_gguf())
    # transformers' GGUF loader leaves out the digit split of llama.cpp's `smollm` pre-tokenizer, which
    # SmolLM2's own tokenizer.json has (test_tokenizer.test_smollm2_splits_every_digit): put it back.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), ref.backend_tokenizer.pre_tokenizer])
    return ours, ref


@pytest.fixture(scope="module")
def gemma() -> tuple[Tokenizer, Any]:
    return tokenizer_pair(gemma3_gguf())


def stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# ------------------------------------------------------------------------------ against the reference


def check_encode_decode(tok: Tokenizer, ref: Any, texts: list[str]) -> None:
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
        assert tok.decode(ids) == text  # no special token added, no normalizer: text comes back whole


@pytest.mark.real_model
def test_smollm2_encode_decode_match_transformers_on_generated_text(smollm2):
    check_encode_decode(*smollm2, generated_texts(400, seed=11))


@pytest.mark.real_model
def test_gemma_encode_decode_match_transformers_on_generated_text(gemma):
    check_encode_decode(*gemma, generated_texts(400, seed=12))


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma"])
def test_streamed_text_equals_decode_and_never_splits_a_character(model, request):
    tok, _ = request.getfixturevalue(model)
    split = 0
    for text in generated_texts(300, seed=13):
        ids = tok.encode(text)
        for skip in (False, True):
            pieces = stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), text
            assert not any("\ufffd" in p for p in pieces), text
            split += "" in pieces[:-1]
    assert split > 50  # characters did fall across token boundaries


@pytest.mark.real_model
def test_smollm2_chat_template_matches_transformers_on_generated_conversations(smollm2):
    tok, ref = smollm2
    rng = random.Random(14)
    texts = generated_texts(200, seed=15)
    for _ in range(100):
        messages = [{"role": "system", "content": rng.choice(texts)}] if rng.random() < 0.5 else []
        messages += [{"role": ("user", "assistant")[i % 2], "content": rng.choice(texts)}
                     for i in range(rng.randint(1, 5))]
        prompt = rng.random() < 0.5
        text = tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert text == ref.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == ref.apply_chat_template(
            messages, add_generation_prompt=prompt, return_dict=False)


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=template)


@pytest.mark.real_model
def test_chat_template_sees_tools_and_documents_as_none_like_transformers(smollm2):
    # Templates such as Mistral's test `tools is not none`: an undefined `tools` passed that test and
    # rendered an empty tool list into every prompt.
    tok, ref = smollm2
    template = ("{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    text = with_template(tok, template).apply_chat_template(messages, tokenize=False)
    assert text == ref.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                           tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.real_model
def test_chat_template_leaves_out_none_valued_keys_like_transformers(smollm2):
    # OpenAI-style messages carry `"content": None` / `"tool_calls": None`; rendered as is, the prompt got
    # the text "None" and a tool-call section.
    tok, ref = smollm2
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if m.tool_calls is defined %}[calls]{% endif %}<|im_end|>\n{% endfor %}")
    messages = [{"role": "user", "content": "hi", "name": None},
                {"role": "assistant", "content": None, "tool_calls": None}]
    text = with_template(tok, template).apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert text == ref.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": None}  # the caller's are unchanged


# ------------------------------------------------------------------------------ argument mistakes

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


def tiny_tokenizer(**extra: Any) -> Tokenizer:
    """A byte-level vocabulary of single bytes plus two specials, with a chat template."""
    from litekv.tokenizer import _byte_alphabet

    tokens = [*_byte_alphabet(), "<|end|>", "<|start|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3, 3], "tokenizer.ggml.eos_token_id": 256,
            "tokenizer.ggml.bos_token_id": 257, "tokenizer.chat_template": TEMPLATE, **extra}
    return Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("messages", ["hi", None, ["hi"], {"role": "user", "content": "hi"}, [None]])
def test_chat_messages_of_the_wrong_type_raise_config_error(messages):
    with pytest.raises(ConfigError, match="dicts? such as {.role.: .user."):
        tiny_tokenizer().apply_chat_template(messages)


def test_chat_messages_may_be_any_iterable_of_mappings():
    tok = tiny_tokenizer()
    messages = ({"role": "user", "content": "é"},)
    assert tok.apply_chat_template(iter(messages), tokenize=False) == "[user]é"


@pytest.mark.parametrize("text", ["a\ud800b", "\udcff", "ok \ud83d"])
def test_encode_refuses_a_lone_surrogate_with_a_litekv_error(text):
    with pytest.raises(ConfigError, match="lone surrogate U\\+D[89A-F][0-9A-F]{2} at index") as info:
        tiny_tokenizer().encode(text)
    assert isinstance(info.value.__cause__, TypeError)
    fixed = text.encode("utf-8", "replace").decode("utf-8")  # what the message suggests works
    assert tiny_tokenizer().encode(fixed)


@pytest.mark.parametrize("value", [None, b"hi", 5, ["hi"]])
def test_encode_refuses_what_is_not_text(value):
    with pytest.raises(ConfigError, match="encode takes text as a str"):
        tiny_tokenizer().encode(value)


@pytest.mark.parametrize(("ids", "match"), [
    ([104, -1], "token id -1 is not a vocabulary id \\(a cancelled"),
    ([2**40], "token id 1099511627776 is not a vocabulary id"),
    ("123", "expected a sequence of token ids, got str"),
    (b"\x01", "expected a sequence of token ids, got bytes"),
    (7, "expected a sequence of token ids, got int"),
    ([1.7], "token ids must be ints, got 1.7"),
    ([True], "token ids must be ints, got True"),
    (np.array([[104, 105]]), "1-D integer array"),
    (np.array([104.0]), "1-D integer array"),
])
def test_decode_refuses_what_are_not_token_ids(ids, match):
    with pytest.raises(ConfigError, match=match):
        tiny_tokenizer().decode(ids)


def test_decode_takes_numpy_ids_and_stream_push_refuses_a_bad_id_without_keeping_it():
    tok = tiny_tokenizer()
    ids = list("é!".encode())
    assert tok.decode(np.array(ids, np.int32)) == tok.decode([np.int64(i) for i in ids]) == "é!"
    assert tok.decode([]) == ""
    decoder = tok.stream_decoder()
    assert decoder.push(ids[0]) == ""
    with pytest.raises(ConfigError, match="token id -1"):
        decoder.push(-1)
    assert decoder.push(ids[1]) + decoder.push(ids[2]) + decoder.flush() == "é!"
    assert decoder.ids == tuple(ids)
    assert tok.id_to_token(-1) is None and tok.id_to_token(2**40) is None and tok.id_to_token(104) == "h"
    with pytest.raises(ConfigError):
        tok.id_to_token("104")
    with pytest.raises(ConfigError, match="token_to_id takes"):
        tok.token_to_id(None)


# ------------------------------------------------------------------------------ untrusted files


def saved(tmp_path: Path, **meta_changes: Any) -> Path:
    tiny_tokenizer().save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer_meta.json").read_text())
    meta.update(meta_changes)
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps(meta))
    return tmp_path


@pytest.mark.parametrize(("change", "match"), [
    ({"version": "1"}, "version must be an int"),
    ({"version": None}, "version must be an int"),
    ({"eos_token_ids": 256}, "eos_token_ids must be a list of ints"),
    ({"eos_token_ids": ["256"]}, "eos_token_ids must be a list of ints"),
    ({"eos_token_ids": [True]}, "eos_token_ids must be a list of ints"),  # was taken as id 1
    ({"eos_token_ids": [2.5]}, "eos_token_ids must be a list of ints"),
    ({"eos_token_ids": [-1]}, "eos_token_ids holds -1, outside the vocabulary of 258 ids"),
    ({"eos_token_ids": [258]}, "eos_token_ids holds 258"),
    ({"bos_token": 257}, "bos_token must be a string or null"),
    ({"eos_token": ["<|end|>"]}, "eos_token must be a string or null"),
    ({"chat_template": 5}, "chat_template must be a string or null"),
])
def test_a_bundles_tokenizer_sidecar_is_checked_field_by_field(tmp_path, change, match):
    path = saved(tmp_path, **change)
    with pytest.raises(CheckpointError, match=match) as info:
        Tokenizer.load(path)
    assert "tokenizer_meta.json" in str(info.value)


def test_a_bundles_tokenizer_json_that_is_not_utf8_raises_checkpoint_error(tmp_path):
    path = saved(tmp_path)
    assert Tokenizer.load(path).eos_token_ids == (256,)
    (path / "tokenizer.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="tokenizer.json is not readable UTF-8 text"):
        Tokenizer.load(path)


@pytest.mark.parametrize(("change", "match"), [
    ({"tokenizer.ggml.token_type": [1] * 10}, "token_type has 10 entries for 258 tokens"),
    ({"tokenizer.ggml.token_type": ["normal"] * 258}, "token_type must hold numbers"),
    ({"tokenizer.ggml.merges": ["a zz"]}, "merges do not fit its vocabulary"),
])
def test_damaged_gguf_tokenizer_metadata_raises_checkpoint_error(change, match):
    with pytest.raises(CheckpointError, match=match):
        tiny_tokenizer(**change)


def test_gguf_scores_shorter_than_the_vocabulary_raise_checkpoint_error():
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a"]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 10, "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1, 1]}
    with pytest.raises(CheckpointError, match="scores has 10 entries for 261 tokens"):
        Tokenizer.from_gguf_metadata(meta)


@pytest.mark.real_model
def test_catalog_replaces_a_torn_assembled_checkpoint(tmp_path, monkeypatch):
    # An interrupted first `litekv pull gemma3-270m` left a partial GGUF, and the package's assemble()
    # then refused every later call with FileExistsError ("pass overwrite=True"), which no user can.
    gemma3_gguf()  # skips without the package
    from litekv import catalog

    monkeypatch.setenv("LITEKV_CACHE", str(tmp_path))
    model = catalog.lookup("gemma3-270m")
    torn = tmp_path / "models" / model.relative_file
    torn.parent.mkdir(parents=True)
    torn.write_bytes(b"GGUF" + bytes(1000))
    path = catalog.checkpoint_path("gemma3-270m", install=False)
    assert path == torn and path.stat().st_size > 100_000_000
    assert catalog._sha256(path) == __import__(model.module).EXPECTED_SHA256
    assert sorted(p.name for p in torn.parent.iterdir()) == [torn.name]  # no side file left behind
    assert catalog.checkpoint_path("gemma3-270m", install=False) == path


# ------------------------------------------------------------------------------ host sampler


def test_sample_token_temperature_zero_is_greedy():
    rng = np.random.default_rng(21)
    for _ in range(20):
        logits = (rng.standard_normal(5000) * 3).astype(np.float32)
        seed = int(rng.integers(0, 2**31 - 2))
        assert sample_token(logits, 0.0, 0, 0.9, seed) == int(np.argmax(logits)) == sample_token(logits, 1.0, 1, 1.0,
                                                                                                 seed)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "seed"), [
    (-0.5, 0, 1.0, 0), (float("nan"), 0, 1.0, 0), (float("inf"), 0, 1.0, 0),
    (1.0, 0, 0.0, 0), (1.0, 0, -0.1, 0), (1.0, 0, float("nan"), 0),
    (1.0, 2.5, 1.0, 0), (1.0, 0, 1.0, 1.5), (1.0, 0, 1.0, -3),
])
def test_sample_token_refuses_arguments_that_picked_an_arbitrary_token(temperature, top_k, top_p, seed):
    # top_p 0 kept no candidate, and the draw fell on the 64th most likely token.
    logits = np.arange(1000, dtype=np.float32)
    with pytest.raises(ConfigError, match="sampler arguments out of range"):
        sample_token(logits, temperature, top_k, top_p, seed)


@pytest.mark.parametrize("shape", [(0,), (2, 500), (500, 2), ()])
def test_sample_token_takes_one_row_of_logits(shape):
    # A [2, 500] batch was flattened, and its ids could lie past the vocabulary.
    with pytest.raises(ConfigError, match="one row of logits"):
        sample_token(np.zeros(shape, np.float32), 1.0, 0, 1.0, 0)


def test_sample_token_edges_that_were_right_stay_right():
    rng = np.random.default_rng(22)
    logits = (rng.standard_normal(3000) * 2).astype(np.float32)
    draws = [sample_token(logits, 0.8, 0, 0.95, seed) for seed in range(200)]
    assert draws == [sample_token(logits.astype(np.float64), 0.8, 0, 0.95, seed) for seed in range(200)]
    assert draws == [sample_token(logits[None, :], 0.8, 0, 0.95, seed) for seed in range(200)]
    assert draws == [sample_token(logits, 0.8, 10**6, 0.95, seed) for seed in range(200)]  # top_k past vocab
    assert len(set(draws)) > 5
    top = set(np.argsort(-logits, kind="stable")[:CANDIDATES].tolist())
    assert set(draws) <= top
    assert {sample_token(logits, 0.8, 3, 1.0, seed) for seed in range(200)} == set(
        np.argsort(-logits, kind="stable")[:3].tolist())
    assert sample_token(np.float32([1.0]), 1.0, 0, 1.0, 7) == 0
