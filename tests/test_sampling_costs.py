"""Per-token costs of sampling and streaming, cut without changing a token or a character.

The host sampler's top-64 selection, StreamDecoder's bounded window and the ONNX sampler's reused
binding each keep a copy of the code they replaced here, as the reference they must equal.
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from litekv.bundle import SAMPLER_INPUTS
from litekv.errors import BackendError
from litekv.executor import SamplerParams
from litekv.sampling import CANDIDATES, sample_token, seeded_uniform, top_order
from litekv.tokenizer import StreamDecoder, Tokenizer

# ---------------------------------------------------------------------------------- host sampler


def old_sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    """sample_token as it was, sorting the whole vocabulary."""
    logits = np.asarray(logits, np.float32).reshape(-1)
    k = min(CANDIDATES, logits.size)
    scaled = logits / np.float32(temperature)
    order = np.argsort(-scaled, kind="stable")[:k]
    values = scaled[order]
    probs = np.exp(values - values[0])
    probs = probs / probs.sum(dtype=np.float32)
    top_k = k if top_k <= 0 else min(top_k, k)
    keep = (np.arange(k) < top_k) & ((np.cumsum(probs, dtype=np.float32) - probs) < np.float32(top_p))
    weights = probs * keep
    cumulative = np.cumsum(weights, dtype=np.float32)
    target = seeded_uniform(seed) * cumulative[-1]
    choice = min(int(np.sum(cumulative <= target)), int(keep.sum()) - 1)
    return int(order[choice])


def old_order(logits: np.ndarray, temperature: float, k: int) -> np.ndarray:
    return np.argsort(-(logits / np.float32(temperature)), kind="stable")[:k]


def logit_cases(rng: np.random.Generator) -> Iterable[tuple[str, np.ndarray]]:
    """Random and tie-heavy float32 logits of several vocabulary sizes around CANDIDATES."""
    for size in (1, 2, 63, 64, 65, 300, 4096, 49152):
        yield "normal", (rng.standard_normal(size) * 4).astype(np.float32)
        yield "few values", rng.integers(-3, 3, size).astype(np.float32)
        yield "all equal", np.full(size, 1.5, np.float32)
        masked = np.full(size, -np.inf, np.float32)
        masked[rng.integers(0, size, 10)] = rng.integers(-2, 2, 10)
        yield "masked to -inf", masked
        nans = (rng.standard_normal(size) * 4).astype(np.float32)
        nans[rng.integers(0, size, max(1, size // 3))] = np.nan
        yield "some NaN", nans
        mostly_nan = np.full(size, np.nan, np.float32)
        mostly_nan[rng.integers(0, size, 20)] = rng.standard_normal(20)
        yield "fewer numbers than candidates", mostly_nan
        signed = rng.choice(np.array([0.0, -0.0, np.inf, 1.0, -1.0], np.float32), size)
        yield "signed zeros and inf", signed
        # adjacent floats below 2: distinct logits that the temperature division rounds to equal values
        adjacent = (np.float32(1.9).view(np.int32) + np.arange(size, dtype=np.int32)).view(np.float32)
        yield "ties made by the division", rng.permutation(adjacent)


def test_top_order_equals_the_stable_argsort_prefix():
    rng = np.random.default_rng(0)
    checked = 0
    for _, logits in logit_cases(rng):
        for temperature in (0.7, 1.0, 3e3):
            for k in (1, 5, CANDIDATES, logits.size, logits.size + 7):
                got = top_order(logits, np.float32(temperature), k)
                np.testing.assert_array_equal(got, old_order(logits, temperature, k))
                checked += 1
    assert checked == 8 * 8 * 3 * 5


def test_top_order_on_many_random_tie_heavy_vocabularies():
    rng = np.random.default_rng(1)
    for trial in range(300):
        size = int(rng.integers(CANDIDATES - 3, 3000))
        logits = rng.integers(-int(rng.integers(1, 40)), 3, size).astype(np.float32)  # ties at the boundary
        if trial % 3 == 0:
            logits[rng.integers(0, size, size // 4)] = -np.inf
        temperature = float(rng.uniform(0.1, 2.0))
        np.testing.assert_array_equal(top_order(logits, np.float32(temperature), CANDIDATES),
                                      old_order(logits, temperature, CANDIDATES))


def test_sample_token_is_bit_identical_to_the_full_sort():
    """For numbers; the old code drew arbitrary tokens where NaN or +inf reached the candidates
    (test_non_finite_logits_are_drawn_by_their_limit)."""
    rng = np.random.default_rng(2)
    draws = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for name, logits in logit_cases(rng):
            if name in ("some NaN", "fewer numbers than candidates", "signed zeros and inf"):
                continue
            for top_k in (0, 1, 7, CANDIDATES, 1000):
                for top_p in (0.3, 0.95, 1.0):
                    seed = int(rng.integers(0, 2**31 - 2))
                    assert sample_token(logits, 0.8, top_k, top_p, seed) == old_sample_token(logits, 0.8, top_k,
                                                                                             top_p, seed)
                    draws += 1
    assert draws == 8 * 5 * 5 * 3


def test_non_finite_logits_are_drawn_by_their_limit():
    rng = np.random.default_rng(4)
    for size in (5, 64, 300, 49152):
        base = (rng.standard_normal(size) * 4).astype(np.float32)
        # +inf: those tokens share all the mass, and each is drawn
        infinite = base.copy()
        ids = rng.choice(size, min(3, size), replace=False)
        infinite[ids] = np.inf
        drawn = {sample_token(infinite, 0.8, 0, 1.0, seed) for seed in range(200)}
        assert drawn == set(ids.tolist())
        # NaN: never drawn; the rest drawn as if the NaN were -inf, seed for seed
        nans, masked = base.copy(), base.copy()
        holes = rng.choice(size, size - min(size, 4), replace=False)
        nans[holes], masked[holes] = np.nan, -np.inf
        for seed in range(50):
            token = sample_token(nans, 1.0, 0, 0.9, seed)
            assert np.isfinite(nans[token]) and token == sample_token(masked, 1.0, 0, 0.9, seed)
        # finite logits over a temperature that overflows them: the greedy token
        big = base.copy()
        big[int(np.argmax(base))] += 1.0
        assert sample_token(big * np.float32(1e30), 1e-38, 0, 1.0, 7) == int(np.argmax(big))
        for hopeless in (np.full(size, np.nan, np.float32), np.full(size, -np.inf, np.float32)):
            with pytest.raises(BackendError, match="no finite value"):
                sample_token(hopeless, 1.0, 0, 1.0, 1)


def test_top_k_zero_means_all_candidates():
    """top_k 0 is no top-k limit, which is CANDIDATES candidates; a larger top_k is the same."""
    logits = np.zeros(1000, np.float32)  # every token ties: candidates are the first 64 ids
    tokens = {k: [sample_token(logits, 1.0, k, 1.0, seed) for seed in range(400)] for k in (0, CANDIDATES, 500)}
    assert tokens[0] == tokens[CANDIDATES] == tokens[500]
    assert max(tokens[0]) == CANDIDATES - 1 and min(tokens[0]) == 0
    assert [sample_token(logits, 1.0, 3, 1.0, seed) for seed in range(100)] != tokens[0][:100]


def test_top_order_results_are_not_overwritten_by_the_next_call():
    """The selection reuses its scratch arrays between tokens; what it returns is never one of them."""
    rng = np.random.default_rng(3)
    for size in (40, 49152):  # the argsort path (k >= size) and the partition path
        first_logits = rng.standard_normal(size).astype(np.float32)
        first = top_order(first_logits, np.float32(1.0), CANDIDATES)
        kept = first.copy()
        top_order(rng.standard_normal(size).astype(np.float32), np.float32(1.0), CANDIDATES)
        np.testing.assert_array_equal(first, kept)


# ---------------------------------------------------------------------------------- stream decoder


class OldStreamDecoder:
    """StreamDecoder as it was: the window grows while its text ends in U+FFFD."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        emitted, full = self._window_texts()
        if len(full) > len(emitted) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(emitted):]
        return ""

    def flush(self) -> str:
        emitted, full = self._window_texts()
        self._read = len(self._ids)
        return full[len(emitted):] if len(full) > len(emitted) else ""

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix:]
        decode = self._tokenizer.decode
        return decode(window[: self._read - self._prefix], self._skip), decode(window, self._skip)


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


def stream(decoder: Any, ids: Iterable[int]) -> list[str]:
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def gpt2_alphabet() -> list[str]:
    """The printable character GPT-2's byte-level BPE spells each byte with."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


# ids 256.. of the byte-level test vocabulary, as bytes; byte b alone is id b
MERGED = [b"\x82\xac\xe2", "é".encode(), " hello".encode(), "€".encode()]
END = 256 + len(MERGED)  # a special token, <|end|>


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    alphabet = gpt2_alphabet()
    tokens = [*alphabet, *("".join(alphabet[b] for b in m) for m in MERGED), "<|end|>"]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3], "tokenizer.ggml.eos_token_id": END,
    })


def byte_ids(text: str) -> list[int]:
    """One id per UTF-8 byte: every character of more than one byte is split across tokens."""
    return list(text.encode())


VALID_STREAMS = {
    "split characters": byte_ids("héllo wörld, €100 🤗 你好 𝔹 done"),
    "merged pieces": [104, 256 + 1, 256 + 2, 32, 256 + 3, END, 33],
    # one character per token boundary: a token that ends one € and starts the next, 12 in a row
    "characters cut at every boundary": [0xE2, *([256] * 12), 0x82, 0xAC, 33],
    "special token inside a character": [0xE2, 0x82, END, 0xAC, 33],
}


@pytest.mark.parametrize("name", VALID_STREAMS)
@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_text_is_unchanged_for_valid_text(byte_level, name, skip):
    ids = VALID_STREAMS[name]
    pieces = stream(StreamDecoder(byte_level, skip_special_tokens=skip), ids)
    assert pieces == stream(OldStreamDecoder(byte_level, skip), ids)
    if name != "special token inside a character" or skip:
        assert "".join(pieces) == byte_level.decode(ids, skip)
        assert all("\ufffd" not in p for p in pieces)
    if name != "merged pieces":
        assert "" in pieces[:-1]  # a character was held back


def test_stream_decoder_window_stays_bounded_on_invalid_bytes(byte_level):
    """A run of bytes that never form characters: the old window (and each decode) grew to the whole
    run; now both stay a few HELD long, and the text is still decode(all ids), U+FFFD for each
    maximal invalid subsequence."""
    length = 3000
    lone = [*byte_ids("ok "), *([0x80] * length), *byte_ids(" é ")]
    # truncated characters of 2 and 3 bytes: the window's start falls inside them
    ids = [*lone, *([0xE2, 0x82] * length), *([0xF0, 0x9A, 0xA8] * length), *byte_ids("€ end")]
    counting = CountingTokenizer(byte_level)
    pieces = stream(StreamDecoder(counting), ids)
    assert "".join(pieces) == byte_level.decode(ids)
    assert "".join(pieces).count("\ufffd") == 3 * length
    assert max(counting.lengths) <= 2 * StreamDecoder.HELD + 1
    assert sum(counting.lengths) <= 3 * (2 * StreamDecoder.HELD + 1) * len(ids)
    assert sum(p.count("\ufffd") for p in pieces[:length + 3]) >= length - 2 * StreamDecoder.HELD  # emitted as it came

    old = CountingTokenizer(byte_level)
    assert "".join(stream(OldStreamDecoder(old), lone)) == "".join(stream(StreamDecoder(byte_level), lone))
    assert max(old.lengths) > length  # what the bound is about


def test_stream_decoder_random_byte_level_streams_equal_decode(byte_level):
    rng = random.Random(4)
    for _ in range(150):
        ids = [rng.choice([rng.randrange(256), rng.randrange(0x80, 0x100), rng.randrange(256, END + 1)])
               for _ in range(rng.randrange(1, 120))]
        for skip in (False, True):
            counting = CountingTokenizer(byte_level)
            pieces = stream(StreamDecoder(counting, skip_special_tokens=skip), ids)
            assert "".join(pieces) == byte_level.decode(ids, skip)
            assert max(counting.lengths) <= 2 * (StreamDecoder.MAX_HELD + 1)


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """A sentencepiece vocabulary: specials, 256 byte tokens <0xNN> (ids 3..258), then a few words."""
    words = [("▁", -1.0), ("▁hello", -2.0), ("h", -3.0), ("e", -4.0)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *(w for w, _ in words)]
    return Tokenizer.from_gguf_metadata({
        "general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [s for _, s in words],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(words),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    })


def test_stream_decoder_byte_fallback_text_unchanged_and_window_bounded(byte_fallback):
    hello = 259 + 1
    valid = [hello, *(3 + b for b in " é 你好 🤗".encode()), hello]
    pieces = stream(StreamDecoder(byte_fallback), valid)
    assert pieces == stream(OldStreamDecoder(byte_fallback), valid)
    assert "".join(pieces) == byte_fallback.decode(valid) == "hello é 你好 🤗 hello"

    invalid = [hello, *([3 + 0x80] * 2000), hello]  # lone continuation bytes: one U+FFFD each
    counting = CountingTokenizer(byte_fallback)
    pieces = stream(StreamDecoder(counting), invalid)
    assert "".join(pieces) == byte_fallback.decode(invalid) == "hello" + "\ufffd" * 2000 + " hello"
    assert max(counting.lengths) <= 2 * StreamDecoder.HELD + 1


@pytest.mark.real_model
def test_smollm2_stream_decoder_on_invalid_token_runs():
    """SmolLM2 has 265 ids that decode to U+FFFD alone; random runs of them, mixed with other ids,
    still give decode(all ids), and each decode stays a few HELD ids long."""
    gguf = pytest.importorskip("gguf")
    from real_models import smollm2_gguf

    reader = gguf.GGUFReader(smollm2_gguf())
    tok = Tokenizer.from_gguf_metadata(
        {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))})
    bad = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert len(bad) == 265
    rng = random.Random(5)
    longest = 0
    for _ in range(40):
        p = rng.choice([0.5, 0.9, 1.0])
        ids = [rng.choice(bad) if rng.random() < p else rng.randrange(tok.vocab_size) for _ in range(300)]
        counting = CountingTokenizer(tok)
        pieces = stream(StreamDecoder(counting), ids)
        assert "".join(pieces) == tok.decode(ids)
        assert "".join(pieces) == "".join(stream(OldStreamDecoder(tok), ids))
        longest = max(longest, *counting.lengths)
    assert longest <= 2 * (StreamDecoder.MAX_HELD + 1)  # over 2 * HELD + 1 while ids cut characters

    # the reviewer's case: one lone continuation byte again and again
    lone = next(i for i in bad if tok.decode([i, i]) == "\ufffd\ufffd")
    ids = [*tok.encode("Hi "), *([lone] * 1500), *tok.encode(" bye")]
    counting, old = CountingTokenizer(tok), CountingTokenizer(tok)
    pieces = stream(StreamDecoder(counting), ids)
    assert "".join(pieces) == tok.decode(ids) == "Hi " + "\ufffd" * 1500 + " bye"
    assert "".join(stream(OldStreamDecoder(old), ids)) == "".join(pieces)
    assert max(counting.lengths) <= 2 * StreamDecoder.HELD + 1 and max(old.lengths) > 1500
    text = "Emoji 🤗🚀👍🏽 and CJK 人工智能是计算机科学的一个分支，你好，世界。日本語 한국어 𝔹 done"
    ids = tok.encode(text)
    assert stream(StreamDecoder(tok), ids) == stream(OldStreamDecoder(tok), ids)


# ---------------------------------------------------------------------------------- ONNX sampler graph


def fresh_binding_sample(ex: Any, logits_value: Any, sampler: SamplerParams, seed: int) -> int:
    """OnnxExecutor._sample_on_graph as it was: a new binding, parameters and output per token."""
    io = ex.sampler.io_binding()
    io.bind_ortvalue_input("logits", logits_value)
    for (name, dtype), value in zip(SAMPLER_INPUTS, sampler.graph_inputs(seed)):
        io.bind_cpu_input(name, np.array([value], dtype))
    token = np.zeros(1, np.int32)
    io.bind_ortvalue_output("next_token", ex._ort.OrtValue.ortvalue_from_numpy(token))
    ex.sampler.run_with_iobinding(io)
    return int(token[0])


@pytest.fixture(scope="module")
def onnx_executor() -> Any:
    pytest.importorskip("onnxruntime")
    from conformance import executor

    return executor("llama", "onnx")


def test_onnx_sampler_draws_equal_a_fresh_binding_and_the_host(onnx_executor):
    """Parameters rewritten in place and logits rebound as the buffers alternate: every draw equals
    the old per-token binding and the host sampler."""
    ex = onnx_executor
    rng = np.random.default_rng(6)
    vocab = ex.config.vocab_size
    buffers = [(rng.standard_normal((1, 1, vocab)) * 3).astype(np.float32) for _ in range(3)]
    values = [ex._ort.OrtValue.ortvalue_from_numpy(b) for b in buffers]
    drawn = []
    for i in range(300):
        which = int(rng.integers(0, 3))  # a row's buffer again, or another's
        sampler = SamplerParams(temperature=float(rng.choice([0.4, 0.8, 1.5])), top_k=int(rng.choice([0, 2, 40, 99])),
                                top_p=float(rng.choice([0.5, 0.95, 1.0])), seed=i)
        seed = sampler.seed_for(i, 0)
        token = ex._sample_on_graph(values[which], sampler, seed)
        assert token == fresh_binding_sample(ex, values[which], sampler, seed)
        assert token == sample_token(buffers[which][0, 0], sampler.temperature, sampler.top_k, sampler.top_p, seed)
        drawn.append(token)
    assert len(set(drawn)) > 20  # really sampling from different logits and parameters


def test_onnx_sampler_binding_is_made_once(onnx_executor, monkeypatch):
    ex = onnx_executor
    binding = ex._sampler_io
    made = []
    original = ex.sampler.io_binding
    monkeypatch.setattr(ex.sampler, "io_binding", lambda: made.append(1) or original())
    sampler = SamplerParams(temperature=0.9, top_k=20, seed=7)
    rng = np.random.default_rng(8)
    for _ in range(2):  # two caches: two logits buffers
        cache = ex.create_kv_cache()
        ex.prefill(rng.integers(3, 300, 5), cache)
        ex.sample_tokens(6, [3], cache, sampler=sampler)
    assert made == []
    assert ex._sampler_io is binding
