"""Host-side token sampling, identical in algorithm to the in-graph sampler of converted models.

Temperature, then the 64 most likely candidates, then top-k and top-p, then one draw from a
seeded Park-Miller generator: the same seed and logits give the same token on the host, in a
TFLite signature or in the ONNX sampler model.
"""
from __future__ import annotations

import numpy as np

CANDIDATES = 64
_MODULUS, _MULTIPLIER, _Q, _R = 2147483647, 16807, 127773, 2836
_MIX_ROUNDS = 3


def seeded_uniform(seed: int) -> np.float32:
    """A float32 in (0, 1) from a non-negative int32 seed (Schrage's method, exact in int32)."""
    x = seed % (_MODULUS - 1) + 1
    for _ in range(_MIX_ROUNDS):
        hi, lo = divmod(x, _Q)
        x = _MULTIPLIER * lo - _R * hi
        if x <= 0:
            x += _MODULUS
    return np.float32(x) / np.float32(_MODULUS)


def step_seed(seed: int, step: int) -> int:
    """The int32 seed for the step-th draw of a sequence seeded with `seed`."""
    return (seed * 1_000_003 + step * 7_919) % (_MODULUS - 1)


def sample_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> int:
    """logits [V] float32 -> token id. temperature must be > 0 (use argmax for greedy)."""
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
