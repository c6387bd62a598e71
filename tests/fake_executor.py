"""A scripted executor: plays back a fixed token sequence, so Session and CLI tests need no model."""
from __future__ import annotations

import time

import numpy as np

from litekv.executor.base import ExternalSamplerExecutor, InternalSamplerExecutor
from litekv.kv_cache import KVCache
from litekv.models.config import ModelConfig, RopeConfig


def tiny_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, norm_eps=1e-6, rope=RopeConfig(10000.0),
                       max_position=256)


class ScriptedExecutor(ExternalSamplerExecutor, InternalSamplerExecutor):
    """Each decode step emits the next token of `script` (logits are one-hot); `delay` slows steps."""

    backend = "scripted"

    def __init__(self, script: list[int], vocab_size: int, max_context: int = 256, delay: float = 0.0):
        super().__init__(tiny_config(vocab_size), max_context, (8,), None, ())
        self.script, self.delay = list(script), delay
        self.fed: list[int] = []  # every token the model was given, prefill and decode
        self.steps = 0

    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        return KVCache.allocate(1, batch_size, 1, 8, self.max_context, "BSHD", huge_pages=huge_pages)

    def _run_prefill_chunk(self, tokens, chunk, kv_cache, row, adapter) -> None:
        self.fed.extend(int(t) for t in tokens)
        time.sleep(self.delay)

    def _decode(self, tokens, kv_cache, adapter) -> np.ndarray:
        self.fed.extend(int(t) for t in tokens)
        time.sleep(self.delay)
        logits = np.full((kv_cache.batch_size, self.config.vocab_size), -10.0, np.float32)
        logits[:, self.script[self.steps % len(self.script)]] = 10.0
        self.steps += 1
        return logits

    def _sample(self, tokens, kv_cache, adapter, sampler) -> np.ndarray:
        return np.argmax(self._decode(tokens, kv_cache, adapter), axis=-1).astype(np.int32)
