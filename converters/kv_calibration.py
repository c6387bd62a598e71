"""Static per-channel scales for an int8 KV cache, measured on a built-in text.

onnxruntime's GroupQueryAttention stores int8 K/V as `code * scale` with one fixed scale per
(KV head, channel). The scales are set here, once per conversion, from the K and V the fp32
reference model writes for a calibration prompt, with headroom for text that reaches further.
Keys are stored after RoPE, which rotates channel i together with channel i + D/2 by a position
dependent angle; a key channel's bound is therefore the largest length of its (i, i + D/2) pair,
which holds at every position, not only the calibrated ones.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from litekv.models.config import ModelConfig
from litekv.reference import ReferenceModel
from litekv.tokenizer import Tokenizer

CALIBRATION_TEXT = (
    "Write a short guide for a weekend trip to the mountains. Include what to pack, how to plan the "
    "route, and what to do if the weather turns bad. Our group has 4 adults and 2 children, a budget of "
    "350 euros, and the train leaves at 07:45 on Saturday. The forecast says 12 to 18 degrees, with rain "
    "likely after 3 pm. Also list three easy recipes that need only a small stove, for example: "
    "def boil(water_ml: int) -> int: return water_ml // 250 cups. Finally, answer briefly: why do "
    "mountain huts ask guests to book ahead, and why is it colder at the top than in the valley?"
)
HEADROOM = 1.25  # above the largest calibrated value: other text may reach a little further
INT8_MAX = 127.0


def int8_kv_scales(cfg: ModelConfig, weights: Mapping[str, np.ndarray],
                   tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(key scales, value scales), each float32 [num_layers, num_kv_heads, head_dim]."""
    messages = [{"role": "user", "content": CALIBRATION_TEXT}]
    ids = tokenizer.apply_chat_template(messages) if tokenizer.chat_template else tokenizer.encode(CALIBRATION_TEXT)
    model = ReferenceModel(cfg, dict(weights))
    cache = model.new_cache(len(ids))
    model.forward(np.asarray(ids), cache, last_logits_only=True)
    half = cfg.head_dim // 2
    key_scales, value_scales = [], []
    for keys, values in zip(cache.keys, cache.values):
        k = keys[0, :len(ids)]  # [T, KVH, D]
        pair = np.sqrt(k[..., :half] ** 2 + k[..., half:2 * half] ** 2).max(axis=0)  # [KVH, D/2]
        key_bound = np.concatenate([pair, pair], axis=-1)
        if cfg.head_dim % 2:  # an odd last channel is not rotated
            key_bound = np.concatenate([key_bound, np.abs(k[..., -1:]).max(axis=0)], axis=-1)
        value_bound = np.abs(values[0, :len(ids)]).max(axis=0)
        key_scales.append(_scale(key_bound))
        value_scales.append(_scale(value_bound))
    return np.stack(key_scales), np.stack(value_scales)


def _scale(bound: np.ndarray) -> np.ndarray:
    # A channel that never moved still gets a usable step, so a value there later is not lost.
    floor = max(float(bound.max()), 1e-6) * 1e-3
    return (np.maximum(bound, floor) * HEADROOM / INT8_MAX).astype(np.float32)
