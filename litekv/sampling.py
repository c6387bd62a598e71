"""Host-side token sampling, identical in algorithm to the in-graph sampler of converted models.

Temperature, then the 64 most likely candidates, then top-k and top-p, then one draw from a
seeded Park-Miller generator: the same seed and logits give the same token on the host, in a
TFLite signature or in the ONNX sampler model.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from litekv.errors import BackendError, ConfigError
from litekv.validation import is_int

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
    """logits [V] (or [1, V]) float32 -> token id. temperature 0 is greedy, as in SamplerParams; top_k 0 is
    no limit; top_p in (0, 1]; seed a non-negative int."""
    logits = np.asarray(logits, np.float32)
    if logits.ndim == 0 or logits.size == 0 or logits.size != logits.shape[-1]:
        raise ConfigError(f"sample_token takes one row of logits [vocab], got shape {logits.shape}; sample each "
                          "row of a batch on its own.")
    logits = logits.reshape(-1)
    # Written so that NaN fails too. Out of range, these picked the least likely candidate or any token.
    if not (0 <= temperature < math.inf and top_p > 0) or not (is_int(top_k) and is_int(seed) and seed >= 0):
        raise ConfigError(f"sampler arguments out of range: temperature={temperature!r} (0 = greedy, or above 0), "
                          f"top_k={top_k!r} (an int, 0 = no limit), top_p={top_p!r} (above 0, at most 1), "
                          f"seed={seed!r} (an int, 0 or more).")
    if temperature == 0:  # greedy runs as temperature 1 with top-k 1, as SamplerParams.graph_inputs sends it
        temperature, top_k = 1.0, 1
    k = min(CANDIDATES, logits.size)
    order = top_order(logits, np.float32(temperature), k)
    values = logits[order] / np.float32(temperature)
    top = values[0]
    if not np.isfinite(top):  # NaN sorts last: a NaN or -inf first means no candidate is a number
        if top != np.inf:
            raise BackendError("the model's logits hold no finite value (all NaN or -inf), so no token can be "
                               "sampled; check the model file and any LoRA adapter, or reconvert the model.")
        if not np.isposinf(logits).any():  # finite logits over a tiny temperature: the limit is greedy
            return int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))
        probs = np.isposinf(logits[order]).astype(np.float32)  # the +inf logits share all the mass
    else:
        probs = np.exp(values - top)
        probs[np.isnan(probs)] = 0.0  # a NaN logit is never drawn
    probs = probs / probs.sum(dtype=np.float32)
    top_k = k if top_k <= 0 else min(top_k, k)
    keep = (np.arange(k) < top_k) & ((np.cumsum(probs, dtype=np.float32) - probs) < np.float32(top_p))
    weights = probs * keep
    cumulative = np.cumsum(weights, dtype=np.float32)
    target = seeded_uniform(seed) * cumulative[-1]
    choice = min(int(np.sum(cumulative <= target)), int(keep.sum()) - 1)
    return int(order[choice])


def all_finite(logits: np.ndarray) -> bool:
    """Whether logits [vocab] hold no NaN or infinity: max and min carry a NaN and find every infinity,
    without the temporary array of np.isfinite. A model whose logits fail this is broken: the
    executors' samplers and Session refuse to draw from them (sample_token alone still draws from the
    finite ones)."""
    return math.isfinite(logits.max()) and math.isfinite(logits.min())


def top_order(logits: np.ndarray, temperature: np.float32, k: int) -> np.ndarray:
    """Indices [k] of the k largest logits / temperature, largest first, ties in index order, NaN last.

    Exactly `np.argsort(-(logits / temperature), kind="stable")[:k]` for float32 logits [V], which
    sorted all 49,152 of SmolLM2's logits every token (6.5 ms): a partition finds the k-th value,
    and only the values above it are sorted.
    """
    keys, partitioned, mask = _scratch(logits.size)
    np.divide(logits, -temperature, out=keys)  # x / -t == -(x / t) exactly: ascending keys, no negated copy
    if k >= keys.size:
        return np.argsort(keys, kind="stable")[:k]
    np.copyto(partitioned, keys)
    partitioned.partition(k - 1)
    threshold = partitioned[k - 1]
    if np.isnan(threshold):  # fewer than k numbers (NaN sorts last, in partition as in argsort)
        return np.argsort(keys, kind="stable")[:k]
    better = np.flatnonzero(np.less(keys, threshold, out=mask))  # fewer than k, in index order
    # Ties of the k-th value keep index order, so they need no sort (a vocabulary masked to -inf
    # but for a few tokens ties at nearly every index).
    ties = np.flatnonzero(np.equal(keys, threshold, out=mask))[:k - better.size]
    return np.concatenate((better[np.argsort(keys[better], kind="stable")], ties))


_local = threading.local()


def _scratch(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's float32, float32 and bool arrays of `size`, kept between tokens. Fresh ones cost
    more than the selection itself: with glibc's mmap threshold pinned (keep_large_allocations_mapped),
    each 196 KB array is a new mapping, and the selection took 494 us instead of 143."""
    arrays = getattr(_local, "arrays", None)
    if arrays is None or arrays[0].size != size:
        arrays = _local.arrays = (np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.bool_))
    return arrays
