"""Static per-channel scales for an int8 KV cache, measured on built-in texts.

onnxruntime's GroupQueryAttention stores int8 K/V as `code * scale` with one fixed scale per
(KV head, channel). The scales are set here, once per conversion, from the K and V the fp32
reference model writes for a few calibration prompts of different kinds, with headroom for text
that reaches further.
Keys are stored after RoPE, which rotates channel i together with channel i + D/2 by a position
dependent angle; a key channel's bound is therefore the largest length of its (i, i + D/2) pair,
which holds at every position, not only the calibrated ones.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from litekv.errors import CheckpointError
from litekv.models.config import ModelConfig
from litekv.reference import ReferenceModel
from litekv.tokenizer import Tokenizer

# Several kinds of text, each its own prompt: one prompt's ranges miss what other text reaches
# (with a single prompt, 10-14 % of value channels went past 1.25x their calibrated bound on
# the benchmark's passages, up to 3.2x).
CALIBRATION_TEXTS = (
    "Write a short guide for a weekend trip to the mountains. Include what to pack, how to plan the "
    "route, and what to do if the weather turns bad. Our group has 4 adults and 2 children, a budget of "
    "350 euros, and the train leaves at 07:45 on Saturday. The forecast says 12 to 18 degrees, with rain "
    "likely after 3 pm. Also list three easy recipes that need only a small stove, for example: "
    "def boil(water_ml: int) -> int: return water_ml // 250 cups. Finally, answer briefly: why do "
    "mountain huts ask guests to book ahead, and why is it colder at the top than in the valley?",
    "The lighthouse keeper had not spoken to anyone for eleven days when the boat appeared. \"You're "
    "late,\" she called down, though nobody had told her to expect it. The young man at the oars "
    "laughed, shipped them, and threw up a rope. \"Storm in the strait,\" he said. \"Three crates: "
    "paraffin, flour, and letters. Mostly letters.\" She read them that night by the lamp, one after "
    "another, until the sky over the water turned grey and then a thin, astonished pink.",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total_cents) / 100.0 AS revenue\n"
    "FROM orders WHERE created_at >= '2024-01-01' GROUP BY customer_id HAVING COUNT(*) > 3\n"
    "ORDER BY revenue DESC LIMIT 20;\n\n"
    "const retry = async (fn, attempts = 5) => {\n  for (let i = 0; i < attempts; i++) {\n"
    "    try { return await fn(); } catch (err) { await sleep(2 ** i * 100); }\n  }\n"
    "  throw new Error(`gave up after ${attempts} attempts`);\n};",
    "Dear Ms. Okafor, thank you for your quick reply. To confirm: the invoice #4471-B for 1,280.00 USD "
    "covers 16 hours of consulting (8 on 3 March, 8 on 10 March) at 80 USD per hour. Payment is due "
    "within 30 days; our IBAN is listed below. If anything is unclear, please call me on +44 20 7946 "
    "0958 between 9:00 and 17:30 (UK time). Kind regards, Tomás",
    "Q: What is the difference between weather and climate?\nA: Weather is what happens in the "
    "atmosphere over hours or days: rain tomorrow, a heat wave next week. Climate is the long-term "
    "pattern, usually averaged over 30 years or more. One cold winter says little about climate; "
    "a warming trend over decades says a lot.\nQ: Can you give an example?\nA: Sure. Lisbon's "
    "average July high is about 28 °C, but a single July day can reach 40 °C or stay at 22 °C.",
)
KEY_HEADROOM = 1.1  # keys: the pair bound holds at every position, and finer steps beat rare clipping
VALUE_HEADROOM = 2.0  # values are not bounded by a rotation's pair, and vary more from text to text
INT8_MAX = 127.0


def int8_kv_scales(cfg: ModelConfig, weights: Mapping[str, np.ndarray], tokenizer: Tokenizer,
                   texts: Sequence[str] = CALIBRATION_TEXTS,
                   progress: Callable[[int, int, str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(key scales, value scales), each float32 [num_layers, num_kv_heads, head_dim]."""
    model = ReferenceModel(cfg, dict(weights))
    key_bounds, value_bounds = [], []
    for done, text in enumerate(texts, 1):
        keys, values = _bounds(cfg, model, _prompt(tokenizer, text))
        key_bounds.append(keys)
        value_bounds.append(values)
        if progress:
            progress(done, len(texts), text)
    key_bound, value_bound = np.max(key_bounds, axis=0), np.max(value_bounds, axis=0)
    if not (np.isfinite(key_bound).all() and np.isfinite(value_bound).all()):
        # an infinite scale would quantize every key or value to 0 in a bundle that otherwise looks fine
        raise CheckpointError("int8 KV calibration overflowed float32 (a key or value bound came out inf or NaN on "
                              "the calibration texts), so the checkpoint's weights are most likely damaged; check "
                              "them, or convert with --kv-cache fp16 or fp32.")
    return _scale(key_bound, KEY_HEADROOM), _scale(value_bound, VALUE_HEADROOM)


def _prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages) if tokenizer.chat_template else tokenizer.encode(text)


def _bounds(cfg: ModelConfig, model: ReferenceModel, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The largest |K| and |V| one prompt writes, each [num_layers, num_kv_heads, head_dim]."""
    cache = model.new_cache(len(ids))
    model.forward(np.asarray(ids), cache, last_logits_only=True)
    half = cfg.head_dim // 2
    key_bounds, value_bounds = [], []
    for keys, values in zip(cache.keys, cache.values):
        k = keys[0, :len(ids)]  # [T, KVH, D]
        pair = np.sqrt(k[..., :half] ** 2 + k[..., half:2 * half] ** 2).max(axis=0)  # [KVH, D/2]
        key_bound = np.concatenate([pair, pair], axis=-1)
        if cfg.head_dim % 2:  # an odd last channel is not rotated
            key_bound = np.concatenate([key_bound, np.abs(k[..., -1:]).max(axis=0)], axis=-1)
        key_bounds.append(key_bound)
        value_bounds.append(np.abs(values[0, :len(ids)]).max(axis=0))
    return np.stack(key_bounds), np.stack(value_bounds)


def _scale(bound: np.ndarray, headroom: float) -> np.ndarray:
    # A channel that never moved still gets a usable step, so a value there later is not lost.
    floor = np.maximum(bound.max(axis=(-2, -1), keepdims=True), 1e-6) * 1e-3  # per layer
    return (np.maximum(bound, floor) * headroom / INT8_MAX).astype(np.float32)
