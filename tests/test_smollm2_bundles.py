"""SmolLM2-135M converted to both formats, fp32 and quantized, against the numpy reference."""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from litekv.converters.checkpoint import load_checkpoint
from litekv.converters.convert import ConvertOptions, convert
from litekv.executor import open_executor
from litekv.reference import ReferenceModel
from conformance import scratch_dir
from real_models import smollm2_gguf

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MAX_CONTEXT = 512
PASSAGE = (
    "The history of the bicycle is a story of many small improvements. Early machines in the nineteenth "
    "century had no pedals at all: riders pushed themselves along with their feet. Later designs put pedals "
    "on the front wheel, which made the wheel grow larger and larger, because a bigger wheel travelled "
    "further with each turn of the pedals. These high wheelers were fast but dangerous, and a fall from one "
    "could be serious. The safety bicycle solved the problem by driving the rear wheel with a chain, so both "
    "wheels could be the same modest size. Air-filled tyres arrived soon after and made riding far more "
    "comfortable on rough roads. Within a few years, bicycles became cheap enough for ordinary workers, and "
    "they changed daily life in cities and villages alike. People could travel to jobs further from home, "
    "visit friends in nearby towns, and explore the countryside on weekends. Women in particular gained a new "
    "kind of freedom, and the bicycle played a part in changing the clothes they wore. Today, millions of "
    "people ride to work every morning, and many cities are building new lanes to keep them safe from traffic."
)
CHAT_PROMPTS = ("What is the capital of France?", "Write one sentence about the ocean.")
# Prompts whose fp32 answer reaches a word any coherent answer contains (a regex) with a clear
# margin at every step before it (test_coherence_prompts_have_clear_margins checks that). Near-ties
# flip under any quantization: the capital question ("The" vs "L") and the sky question ("often" vs
# "typically", 0.05 apart) were dropped for that reason. The pattern is the answer, not the fp32
# phrasing: an int4 bundle answered "... The answer is 7." where fp32 says "approximately 7 days"
# (0.65 apart at the fourth token).
COHERENCE = (("How many days are in a week?", r"\b(7|seven)\b"), ("What is the opposite of hot?", r"\bcold\b"))
MIN_MARGIN = 0.5  # logits between the fp32 top-1 and top-2 tokens
_ROOT = scratch_dir("litekv-smollm2-")


@lru_cache(maxsize=None)
def checkpoint():
    return load_checkpoint(smollm2_gguf())


@lru_cache(maxsize=None)
def reference() -> ReferenceModel:
    ckpt = checkpoint()
    return ReferenceModel(ckpt.config, ckpt.weights)


@lru_cache(maxsize=None)
def bundle(backend: str, quantize: str, kv_cache: str = "fp32") -> Path:
    options = ConvertOptions(backend=backend, quantize=quantize, max_context=MAX_CONTEXT, prefill_lengths=(32, 128),
                             kv_cache=kv_cache)
    return convert(smollm2_gguf(), _ROOT / f"{backend}-{quantize}-kv{kv_cache}", options)


def greedy(executor, prompt: list[int], steps: int) -> list[int]:
    cache = executor.create_kv_cache()
    executor.prefill(prompt[:-1], cache)
    return executor.sample_tokens(steps, [prompt[-1]], cache)[0].tolist()


def chat_ids(text: str) -> list[int]:
    return checkpoint().tokenizer.apply_chat_template([{"role": "user", "content": text}])


@lru_cache(maxsize=None)
def passage_and_expected(text: str = PASSAGE) -> tuple[list[int], np.ndarray]:
    """A passage's first 201 token ids (or all, the other passages) and the fp32 reference's argmax
    after each but the last."""
    tokens = checkpoint().tokenizer.encode(text)[:201]
    assert len(tokens) == 201 or text != PASSAGE
    ref = reference()
    return tokens, ref.forward(np.array(tokens[:-1]), ref.new_cache(256))[0].argmax(axis=-1)


# Two more passages of other kinds (bench/quality_kl.py's): on one passage, int8 activations turn
# last-bit differences upstream into flips of near-tied tokens. ONNX int8 weights stepped at 93 %
# with GroupQueryAttention and 89 % with litekv's attention, whose fp32 logits are as close to the
# reference (1.7e-6 relative, median); over all three passages the two are closer.
OTHER_PASSAGES = tuple(json.loads((Path(__file__).parents[1] / "bench" / "quality_passages.json").read_text())["texts"])


def top1_agreement(executor) -> float:
    """Teacher-forced, one decode step per token: does the bundle's most likely next token match
    the fp32 reference's? Over three passages, 463 positions."""
    hits = []
    for text in (PASSAGE, *OTHER_PASSAGES):
        tokens, expected = passage_and_expected(text)
        cache = executor.create_kv_cache()
        hits += [int(np.argmax(executor.step([t], cache)[0])) == e for t, e in zip(tokens[:-1], expected)]
    return float(np.mean(hits))


def prefill_top1_agreement(executor) -> float:
    """The same question with the context written by prefill chunks, whose matmuls run on many
    rows at once (quantized kernels may scale activations per tensor there, not per token)."""
    tokens, expected = passage_and_expected()
    hits = []
    for p in range(20, 200, 3):
        cache = executor.create_kv_cache()
        executor.prefill(tokens[:p], cache)
        hits.append(int(np.argmax(executor.step([tokens[p]], cache)[0])) == expected[p])
    return float(np.mean(hits))


@pytest.mark.parametrize("backend", ["litert", "onnx"])
def test_fp32_greedy_equals_reference_on_chat_prompts(backend):
    ex = open_executor(bundle(backend, "fp32"))
    for text in CHAT_PROMPTS:
        prompt = chat_ids(text)
        assert greedy(ex, prompt, 40) == reference().greedy(prompt, 40)


def test_coherence_prompts_have_clear_margins():
    ref, tokenizer = reference(), checkpoint().tokenizer
    for question, expected in COHERENCE:
        prompt = chat_ids(question)
        answer = ref.greedy(prompt, 48)
        reached = next((i + 1 for i in range(len(answer)) if re.search(expected, tokenizer.decode(answer[:i + 1]))),
                       None)
        assert reached is not None, f"the fp32 answer to {question!r} lacks {expected!r}"
        logits = ref.forward(np.array(prompt + answer[:reached - 1]), ref.new_cache(MAX_CONTEXT))[0][len(prompt) - 1:]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert float(np.min(top2[:, 1] - top2[:, 0])) >= MIN_MARGIN, question


# Prefill chunks quantize int8 activations per token (XNNPACK, MLAS), where steps on litekv's
# kernels use a scale per 32: after prefill, int8 bundles agreed on 86.7-90.0 % of 30 positions and
# 88.3 % of 60 on an AVX2 machine, 90-97 % on an AVX-512 one, flipping only near-ties. A scale per
# tensor, the failure this guards against, gave 57 %.
@pytest.mark.parametrize("quantize, target, after_prefill_target", [("int8", 0.90, 0.85), ("int4", 0.80, 0.80)])
@pytest.mark.parametrize("backend", ["litert", "onnx"])
def test_quantized_agreement_and_coherent_answer(backend, quantize, target, after_prefill_target, record_property):
    ex = open_executor(bundle(backend, quantize))
    agreement = top1_agreement(ex)
    record_property("top1_agreement", agreement)
    print(f"{backend} {quantize}: top-1 agreement with fp32 reference over 463 positions = {agreement:.1%}")
    assert agreement >= target
    after_prefill = prefill_top1_agreement(ex)
    print(f"  after prefill chunks, over 60 positions = {after_prefill:.1%}")
    assert after_prefill >= after_prefill_target
    for question, expected in COHERENCE:
        answer = checkpoint().tokenizer.decode(greedy(ex, chat_ids(question), 48))
        print(f"  {question} -> {answer!r}")
        assert re.search(expected, answer), (question, answer)


# After prefill, fp32 weights with an int8 cache missed 4 of 60 positions (ONNX) and 3 (LiteRT) on
# an AVX2 machine, every one a near-tie: the reference's top two were 0.02-0.07 logits apart.
@pytest.mark.parametrize("backend, quantize, target, after_prefill_target",
                         [("onnx", "fp32", 0.95, 0.90), ("onnx", "int4", 0.90, 0.90),
                          ("litert", "fp32", 0.95, 0.90), ("litert", "int4", 0.80, 0.80)])
def test_int8_kv_cache_agreement(backend, quantize, target, after_prefill_target):
    """LiteRT int4 with an int8 cache is what int4 users get by default: the int4 target holds."""
    ex = open_executor(bundle(backend, quantize, "int8"))
    assert ex.create_kv_cache().dtype == np.int8
    steps, after_prefill = top1_agreement(ex), prefill_top1_agreement(ex)
    print(f"{backend} {quantize} with int8 KV: top-1 agreement {steps:.1%} stepping, {after_prefill:.1%} after prefill")
    assert steps >= target and after_prefill >= after_prefill_target


def test_bundle_sizes_shrink_with_quantization():
    sizes = {}
    for quantize in ("fp32", "int8", "int4"):
        manifest = json.loads((bundle("litert", quantize) / "litekv.json").read_text())
        sizes[quantize] = manifest["file_sizes"]["model.tflite"]
    print("model.tflite sizes (MB):", {k: round(v / 1e6, 1) for k, v in sizes.items()})
    assert sizes["int4"] < sizes["int8"] < 0.5 * sizes["fp32"]
