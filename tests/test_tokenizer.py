"""litekv.tokenizer: ids equal transformers' on real GGUF checkpoints, plus small synthetic vocabularies."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from litekv.errors import ChatTemplateError, LitekvError, UnsupportedTokenizerError
from litekv.tokenizer import StreamDecoder, Tokenizer
from real_models import gemma3_gguf, smollm2_gguf

# English, digits, code, emoji, CJK, runs of spaces/newlines/tabs, CRLF, special-token text.
VARIED = (
    "Hello world! The year 2024 had 12345 visitors, costing $3.14.\n\n\n"
    "def f(x):\n    return x**2  # square\n\tTabbed  text   with   spaces.\n"
    "Emoji: 🤗🚀👍🏽 CJK: 你好，世界。日本語のテキスト。 한국어\n"
    "  leading and trailing  \n<|im_start|>user hi<|im_end|> café naïve — “quotes” 100%\r\nwindows line"
)
# Characters Gemma's vocabulary lacks, so they come out as <0xXX> byte-fallback tokens.
RARE = "Rare: 𓀀 龘 🫨 𠜎 end"


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF key/values our builder reads, as plain python values."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}


def hf_tokenizer(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, Any]:
    path = smollm2_gguf()
    return Tokenizer.from_gguf_metadata(gguf_metadata(path)), hf_tokenizer(path)


GEMMA_BUILD_SECONDS: list[float] = []


@pytest.fixture(scope="module")
def gemma() -> tuple[Tokenizer, Any]:
    path = gemma3_gguf()
    meta = gguf_metadata(path)
    start = time.perf_counter()
    tok = Tokenizer.from_gguf_metadata(meta)
    GEMMA_BUILD_SECONDS.append(time.perf_counter() - start)
    return tok, hf_tokenizer(path)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = StreamDecoder(tok)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# --------------------------------------------------------------------------------- SmolLM2 (gpt2 BPE)


@pytest.mark.real_model
def test_smollm2_encode_matches_transformers(smollm2):
    tok, ref = smollm2
    ids = tok.encode(VARIED)
    assert ids == ref.encode(VARIED)
    assert tok.decode(ids) == VARIED
    # `<|im_start|>` in text is one special token, and skip_special_tokens drops it.
    assert tok.token_to_id("<|im_start|>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in tok.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(ref) == 49152


@pytest.mark.real_model
def test_smollm2_special_tokens(smollm2):
    tok, _ = smollm2
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.eos_token == "<|im_end|>"
    # EOS first, then `<|endoftext|>`, which llama.cpp also treats as end of generation.
    assert tok.eos_token_ids == (2, 0)
    assert tok.add_bos is False
    assert tok.encode("hi")[0] != tok.bos_token_id


@pytest.mark.real_model
def test_smollm2_splits_every_digit(smollm2):
    # llama.cpp's `smollm` pre-tokenizer (and SmolLM2's tokenizer.json) split off each digit before the
    # GPT-2 regex, so spaces before a number stay one run. transformers' GGUF loader skips that split
    # and yields ['Ġa', 'ĠĠ', 'Ġ', '1', ...]; that is why VARIED avoids spaces right before digits.
    tok, _ = smollm2
    assert [tok.id_to_token(i) for i in tok.encode(" a   1 x  22")] == ["Ġa", "ĠĠĠ", "1", "Ġx", "ĠĠ", "2", "2"]


@pytest.mark.real_model
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What is 2+2? 🤗"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And 3+3?"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2, messages, add_generation_prompt):
    tok, ref = smollm2
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.real_model
def test_smollm2_stream_decoder_holds_split_characters(smollm2):
    tok, _ = smollm2
    text = "Emoji 🤗🚀👍🏽 and CJK 你好，世界。日本語 한국어 𝔹 done"
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # byte-level tokens did split a character, and it was held back


# --------------------------------------------------------------------------------- Gemma 3 (sentencepiece)


@pytest.mark.real_model
def test_gemma_encode_matches_transformers(gemma):
    tok, ref = gemma
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    assert ids == ref.encode(prompt)
    assert ids[0] == tok.bos_token_id == 2
    assert tok.add_bos is True
    assert tok.encode(prompt, add_special_tokens=False) == ids[1:]
    for text in (VARIED, RARE):
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.vocab_size == len(ref) == 262144


@pytest.mark.real_model
def test_gemma_special_tokens_and_no_chat_template(gemma):
    tok, _ = gemma
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
    assert tok.eos_token_ids == (1, tok.token_to_id("<end_of_turn>"))
    assert tok.chat_template is None  # this base GGUF ships none
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.real_model
def test_gemma_stream_decoder_with_byte_fallback(gemma):
    tok, _ = gemma
    ids = tok.encode(RARE + " 你好 🤗", add_special_tokens=False)
    assert tok.token_to_id("<0xF0>") in ids
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == RARE + " 你好 🤗"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:-1].count("") >= 3


@pytest.mark.real_model
def test_gemma_merges_equal_transformers(gemma):
    # Gemma's merges are not in the file; ours are derived in the same order (token position, longer
    # left piece first), which is what makes rare merges such as those of user-defined tokens agree.
    tok, ref = gemma
    ours = json.loads(tok.to_json())["model"]
    theirs = json.loads(ref.backend_tokenizer.to_str())["model"]
    assert len(ours["merges"]) > 500_000
    assert ours["merges"] == theirs["merges"]
    assert ours["vocab"] == theirs["vocab"]


@pytest.mark.real_model
def test_gemma_build_is_fast(gemma):
    # 262k tokens and ~515k merges derived from the vocabulary: a few seconds (transformers takes ~15 s).
    assert GEMMA_BUILD_SECONDS and GEMMA_BUILD_SECONDS[0] < 15.0


@pytest.mark.real_model
def test_gguf_built_tokenizer_survives_save_load(gemma, tmp_path):
    tok, _ = gemma
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    for text in (VARIED, RARE):
        assert again.encode(text) == tok.encode(text)
    assert again.eos_token_ids == tok.eos_token_ids and again.add_bos


# --------------------------------------------------------------------------------- HF dir and bundles


@pytest.mark.real_model
def test_hf_dir_and_bundle_round_trip(smollm2, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, ref = smollm2
    hf_dir = tmp_path / "hf"
    ref.save_pretrained(hf_dir)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    # A post-processor that adds BOS decides; a config flag saying otherwise is ignored (transformers 5).
    backend = json.loads((hf_dir / "tokenizer.json").read_text())
    backend["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (hf_dir / "tokenizer.json").write_text(json.dumps(backend))
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    expected = transformers.AutoTokenizer.from_pretrained(hf_dir)

    tok = Tokenizer.from_hf_dir(hf_dir)
    ids = tok.encode(VARIED)
    assert ids == expected.encode(VARIED)
    assert ids[0] == tok.bos_token_id == 1 and tok.add_bos
    assert tok.eos_token_ids == (2, 0)
    assert tok.chat_template == (hf_dir / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == expected.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )

    bundle = tmp_path / "bundle"
    tok.save(bundle)
    assert sorted(p.name for p in bundle.iterdir()) == ["tokenizer.json", "tokenizer_meta.json"]
    again = Tokenizer.load(bundle)
    assert again.encode(VARIED) == ids
    assert again.to_dict() == tok.to_dict()
    assert again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(messages, tokenize=False)


# --------------------------------------------------------------------------------- synthetic, no model files

_BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_meta(pieces: list[tuple[str, float]], **extra: Any) -> dict[str, Any]:
    """A tiny llama-style (sentencepiece) GGUF vocabulary: specials, 256 byte tokens, then `pieces`."""
    tokens = ["<unk>", "<s>", "</s>", *_BYTES, *(p for p, _ in pieces)]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [s for _, s in pieces],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        **extra,
    }


WORDS = [("▁", -1), ("h", -2), ("e", -3), ("l", -4), ("o", -5), ("w", -6), ("r", -7), ("d", -8),
         ("he", -10), ("ll", -11), ("▁he", -12), ("llo", -13), ("▁hello", -14), ("or", -15), ("ld", -16),
         ("▁w", -17), ("▁wor", -18), ("▁world", -19)]


def pieces(tok: Tokenizer, text: str, **kw: Any) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, **kw)]


def test_sentencepiece_prefix_space_bos_and_byte_fallback():
    tok = Tokenizer.from_gguf_metadata(spm_meta(WORDS))  # add_space_prefix / add_bos default to llama.cpp's True
    assert pieces(tok, "hello world") == ["<s>", "▁hello", "▁world"]
    assert pieces(tok, "heé", add_special_tokens=False) == ["▁he", "<0xC3>", "<0xA9>"]
    # As in transformers, only a space at the very start of the text is stripped, not one after `<s>`.
    assert tok.decode(tok.encode("hello world")) == "<s> hello world"
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=True) == "hello world"
    ids = tok.encode("heé hello", add_special_tokens=False)
    # The leading space is stripped only at the very start of the stream, and é waits for its 2nd byte.
    assert stream(tok, ids) == ["he", "", "é", " hello", ""]
    no_prefix = Tokenizer.from_gguf_metadata(
        spm_meta(WORDS, **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    )
    assert pieces(no_prefix, "hello world") == ["he", "llo", "▁world"]
    assert not no_prefix.add_bos


@pytest.mark.parametrize(("ab", "bc", "expected"), [(-1.0, -2.0, ["ab", "c"]), (-2.0, -1.0, ["a", "bc"])])
def test_merge_priority_follows_scores(ab, bc, expected):
    meta = spm_meta([("a", -5), ("b", -6), ("c", -7), ("ab", ab), ("bc", bc)],
                    **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    assert pieces(Tokenizer.from_gguf_metadata(meta), "abc") == expected


def test_unknown_tokenizer_model_and_pre_are_rejected():
    with pytest.raises(UnsupportedTokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata(spm_meta(WORDS, **{"tokenizer.ggml.model": "bert"}))
    gpt2 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(UnsupportedTokenizerError, match="made-up"):
        Tokenizer.from_gguf_metadata(gpt2)
    with pytest.raises(UnsupportedTokenizerError):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})
    assert issubclass(UnsupportedTokenizerError, LitekvError) and issubclass(ChatTemplateError, LitekvError)


def test_byte_level_without_pre_uses_gpt2_split():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "Ġ", "ab", "Ġab", "<|end|>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3], "tokenizer.ggml.merges": ["a b", "Ġ ab"],
            "tokenizer.ggml.eos_token_id": 5}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert pieces(tok, "ab ab<|end|>") == ["ab", "Ġab", "<|end|>"]
    assert tok.decode(tok.encode("ab ab<|end|>"), skip_special_tokens=True) == "ab ab"
    assert tok.eos_token_ids == (5,) and tok.bos_token_id is None and not tok.add_bos


def test_chat_template_semantics_and_errors():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "[{{ m.role }}]{{ m.content | tojson }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer.from_gguf_metadata(spm_meta(WORDS, **{"tokenizer.chat_template": template}))
    text = tok.apply_chat_template([{"role": "user", "content": "héllo <b>"}], tokenize=False)
    # tojson keeps non-ASCII and HTML characters as they are (jinja's own filter would escape them).
    assert text == '<s>[user]"héllo <b>"\n[assistant]'
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # BOS comes from the template only
    with pytest.raises(ChatTemplateError, match="no bad roles") as info:
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    assert info.value.__cause__ is not None
    broken = Tokenizer.from_gguf_metadata(spm_meta(WORDS, **{"tokenizer.chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_trims_blocks_like_transformers():
    template = "{% for m in messages %}\n  {% if true %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(spm_meta(WORDS, **{"tokenizer.chat_template": template}))
    # trim_blocks eats the newline after each tag and lstrip_blocks the indentation before it.
    assert tok.apply_chat_template([{"content": "a"}, {"content": "b"}], tokenize=False) == "a\nb\n"


def test_save_is_atomic_and_load_checks_files(tmp_path):
    tok = Tokenizer.from_gguf_metadata(spm_meta(WORDS, **{"tokenizer.chat_template": "{{ messages[0].content }}"}))
    tok.save(tmp_path)
    tok.save(tmp_path)  # overwriting leaves no temp files behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_meta.json"]
    again = Tokenizer.load(tmp_path)
    assert again.encode("hello world") == tok.encode("hello world")
    assert again.chat_template == tok.chat_template and again.bos_token == "<s>"
    (tmp_path / "tokenizer_meta.json").unlink()
    with pytest.raises(LitekvError, match="tokenizer_meta.json"):
        Tokenizer.load(tmp_path)
    with pytest.raises(LitekvError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path / "missing")
