"""The numpy reference: runs any architecture definition eagerly in float32.

It is the golden model every backend is tested against, and small enough to read in one go.
Weights are canonical float32 arrays; the KV cache is caller-owned and updated in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from litekv.errors import ConfigError, ContextFull
from litekv.models.base import ArchitectureSpec, architecture
from litekv.models.config import ModelConfig, RopeConfig

F32 = np.float32


@dataclass
class ArrayKVCache:
    """Plain per-layer K/V arrays [batch, capacity, kv_heads, head_dim], float32.

    `num_tokens` positions are valid in every batch row.
    """

    keys: list[np.ndarray]
    values: list[np.ndarray]
    num_tokens: int = 0

    @classmethod
    def allocate(cls, cfg: ModelConfig, capacity: int, batch_size: int = 1) -> "ArrayKVCache":
        shape = (batch_size, capacity, cfg.num_kv_heads, cfg.head_dim)
        return cls([np.zeros(shape, F32) for _ in range(cfg.num_layers)],
                   [np.zeros(shape, F32) for _ in range(cfg.num_layers)])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]


@dataclass
class NumpyOps:
    """`models.ops.Ops` on numpy arrays for one forward call (see `ReferenceModel.forward`)."""

    cfg: ModelConfig
    weights: Mapping[str, np.ndarray]
    tokens: np.ndarray  # [B, T] int
    positions: np.ndarray  # [T] int
    cache: ArrayKVCache
    last_logits_only: bool
    lora: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]] | None = None
    fused: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict)
    rope_tables: dict[RopeConfig, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def embed(self, name: str) -> np.ndarray:
        return self.weights[f"{name}.weight"][self.tokens]

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.linears(x, (name,))[0]

    def linears(self, x: np.ndarray, names: Sequence[str]) -> tuple[np.ndarray, ...]:
        key = tuple(names)
        if key not in self.fused:  # one matmul reads the input once; [in, out] streams fastest through BLAS
            self.fused[key] = np.ascontiguousarray(np.concatenate([self.weights[f"{n}.weight"] for n in names]).T)
        y = x @ self.fused[key]
        outs, start = [], 0
        for n in names:
            width = self.weights[f"{n}.weight"].shape[0]
            part = y[..., start:start + width]
            bias = self.weights.get(f"{n}.bias")
            outs.append(self._with_lora(x, part if bias is None else part + bias, n))
            start += width
        return tuple(outs)

    def _with_lora(self, x: np.ndarray, y: np.ndarray, name: str) -> np.ndarray:
        """Adds B (A x) for a LoRA adapter on this projection (alpha / r already in B)."""
        if not self.lora:
            return y
        _, layer, target = name.split(".")
        factors = self.lora.get((int(layer), target))
        return y if factors is None else y + (x @ factors[0].T) @ factors[1].T

    def rms_norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray:
        ms = np.mean(np.square(x), axis=-1, keepdims=True)
        return x * (1.0 / np.sqrt(ms + F32(eps))) * self.weights[f"{name}.weight"]

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a * b

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        return x * F32(factor)

    def activation(self, x: np.ndarray, kind: str) -> np.ndarray:
        if kind == "silu":
            return x / (F32(1.0) + np.exp(-x))
        inner = F32(np.sqrt(2.0 / np.pi)) * (x + F32(0.044715) * x * x * x)
        return F32(0.5) * x * (F32(1.0) + np.tanh(inner))

    def split_heads(self, x: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
        return x.reshape(*x.shape[:-1], num_heads, head_dim)

    def rope(self, x: np.ndarray, rope: RopeConfig) -> np.ndarray:
        if rope not in self.rope_tables:
            angles = self.positions[:, None].astype(F32) * rope.inverse_frequencies(x.shape[-1])[None, :]
            self.rope_tables[rope] = (np.cos(angles)[:, None, :], np.sin(angles)[:, None, :])
        cos, sin = self.rope_tables[rope]  # [T, 1, D/2] broadcast over heads
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, layer: int, window: int | None,
                  scale: float) -> np.ndarray:
        batch, steps, num_heads, head_dim = q.shape
        start = int(self.positions[0])
        end = start + steps
        self.cache.keys[layer][:, start:end] = k
        self.cache.values[layer][:, start:end] = v
        first = 0 if window is None else max(0, end - steps - window + 1)
        keys = self.cache.keys[layer][:, first:end]  # [B, S, KVH, D]
        vals = self.cache.values[layer][:, first:end]
        kv_heads = keys.shape[2]
        group = num_heads // kv_heads
        # [B, KVH, G, T, D] @ [B, KVH, 1, D, S] -> [B, KVH, G, T, S]
        qg = q.reshape(batch, steps, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
        scores = (qg * F32(scale)) @ keys.transpose(0, 2, 3, 1)[:, :, None]
        if steps > 1:  # a single new token may see every key in [first, end): no mask needed
            key_pos = np.arange(first, end)
            allowed = key_pos[None, :] <= self.positions[:, None]
            if window is not None:
                allowed &= key_pos[None, :] > self.positions[:, None] - window
            scores = np.where(allowed, scores, F32(-np.inf))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = probs @ vals.transpose(0, 2, 1, 3)[:, :, None]  # [B, KVH, G, T, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(batch, steps, num_heads * head_dim)

    def logits(self, x: np.ndarray, name: str) -> np.ndarray:
        if self.last_logits_only:
            x = x[:, -1:]
        return x @ self.weights[f"{name}.weight"].T


class ReferenceModel:
    """Golden float32 forward pass of one checkpoint, with chunked prefill and decode."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray]):
        self.config = config
        self.spec: ArchitectureSpec = architecture(config.architecture)
        self.weights = {name: np.ascontiguousarray(w, dtype=F32) for name, w in weights.items()}
        if "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = self.weights["embed.weight"]
        self._fused: dict[tuple[str, ...], np.ndarray] = {}

    def new_cache(self, capacity: int | None = None, batch_size: int = 1) -> ArrayKVCache:
        capacity = capacity or min(self.config.max_position, 4096)
        if capacity <= 0 or batch_size <= 0:
            raise ConfigError(f"cache capacity and batch size must be positive, got {capacity}, {batch_size}.")
        return ArrayKVCache.allocate(self.config, capacity, batch_size)

    def forward(self, tokens: np.ndarray, cache: ArrayKVCache, last_logits_only: bool = False,
                lora: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
        """Run tokens [B, T] (or [T]) after the cache's tokens; returns logits [B, T|1, V] float32."""
        tokens = np.asarray(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None, :]
        if tokens.shape[0] != cache.batch_size:
            raise ConfigError(f"tokens have batch {tokens.shape[0]} but the cache has batch {cache.batch_size}.")
        start, steps = cache.num_tokens, tokens.shape[1]
        if start + steps > cache.capacity:
            raise ContextFull(
                f"{steps} new tokens do not fit: the cache holds {start} of {cache.capacity}; "
                "use a larger cache or start a new sequence."
            )
        ops = NumpyOps(self.config, self.weights, tokens, np.arange(start, start + steps), cache,
                       last_logits_only, lora, self._fused)
        logits = self.spec.forward(ops, self.config)
        cache.num_tokens = start + steps
        return logits

    def prefill(self, tokens: Sequence[int], cache: ArrayKVCache, chunk_size: int = 128) -> np.ndarray:
        """Process a prompt in chunks; returns the logits of its last token [B, V]."""
        tokens = np.asarray(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None, :]
        if tokens.shape[1] == 0:
            raise ConfigError("prefill needs at least one token.")
        logits = None
        for begin in range(0, tokens.shape[1], chunk_size):
            logits = self.forward(tokens[:, begin:begin + chunk_size], cache, last_logits_only=True)
        return logits[:, -1]

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, cache: ArrayKVCache | None = None,
               stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of `prompt` (EOS ignored unless given in `stop_ids`)."""
        cache = cache or self.new_cache(len(prompt) + max_new_tokens)
        logits = self.prefill(prompt, cache)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(logits[0]))
            out.append(token)
            if token in stop_ids or len(out) == max_new_tokens:
                break
            logits = self.forward(np.array([[token]]), cache, last_logits_only=True)[:, -1]
        return out
