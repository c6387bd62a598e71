"""The numpy reference as an executor: slow but dependency-free, and the golden model in tests."""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from litekv.bundle import SAMPLER_NON_FINITE
from litekv.kv_cache import KVCache
from litekv.models.config import ModelConfig
from litekv.reference import ArrayKVCache, ReferenceModel
from litekv.sampling import all_finite, sample_token

from .base import ExternalSamplerExecutor, InternalSamplerExecutor, SamplerParams
from .lora import LORA_TARGETS_ALL, LoraAdapter
from .prefill_plan import Chunk

PREFILL_CHUNK = 256


class NumpyExecutor(ExternalSamplerExecutor, InternalSamplerExecutor):
    backend = "numpy"

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], max_context: int = 4096,
                 lora_rank: int | None = None):
        super().__init__(config, max_context, (PREFILL_CHUNK,), lora_rank, LORA_TARGETS_ALL)
        self.model = ReferenceModel(config, weights)

    def create_kv_cache(self, batch_size: int = 1, huge_pages: bool = True) -> KVCache:
        cfg = self.config
        return KVCache.allocate(cfg.num_layers, batch_size, cfg.num_kv_heads, cfg.head_dim, self.max_context, "BSHD",
                                huge_pages=huge_pages)

    def _forward(self, tokens: np.ndarray, kv_cache: KVCache, rows: slice, adapter: LoraAdapter | None) -> np.ndarray:
        layers = range(kv_cache.num_layers)
        view = ArrayKVCache([kv_cache.raw_keys(layer)[rows] for layer in layers],
                            [kv_cache.raw_values(layer)[rows] for layer in layers],
                            kv_cache.num_tokens)
        return self.model.forward(tokens, view, last_logits_only=True,
                                  lora=adapter.factors if adapter else None)[:, -1]

    def _run_prefill_chunk(self, tokens: np.ndarray, chunk: Chunk, kv_cache: KVCache, row: int,
                           adapter: LoraAdapter | None) -> None:
        self._forward(tokens[None, :], kv_cache, slice(row, row + 1), adapter)

    def _decode(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None) -> np.ndarray:
        return self._forward(tokens[:, None], kv_cache, slice(None), adapter)

    def _sample(self, tokens: np.ndarray, kv_cache: KVCache, adapter: LoraAdapter | None,
                sampler: SamplerParams) -> np.ndarray:
        logits = self._decode(tokens, kv_cache, adapter)
        return host_sample(logits, sampler, kv_cache.num_tokens)


def host_sample(logits: np.ndarray, sampler: SamplerParams, position: int) -> np.ndarray:
    """Sample each row of logits [batch, vocab] exactly as the in-graph sampler would, SAMPLER_NON_FINITE
    for a row holding a NaN or an infinity."""
    tokens = [host_token(row, sampler, graph_refuses_non_finite=False) for row in logits]
    return np.array([sample_token(row, sampler.temperature, sampler.top_k, sampler.top_p, sampler.seed_for(position, b))
                     if token is None else token for b, (row, token) in enumerate(zip(logits, tokens))], np.int32)


def greedy_token(logits: np.ndarray) -> int:
    """The id of the top logit of logits [vocab] float32 (the lowest of ties, as the sampler graph's
    top-1), or SAMPLER_NON_FINITE where a logit is NaN or infinite, as the sampler graph refuses them.
    argmax stops at the first NaN and finds a +inf; min finds a -inf (3 us over SmolLM2's 49,152)."""
    token = int(logits.argmax())
    return token if math.isfinite(logits[token]) and math.isfinite(logits.min()) else SAMPLER_NON_FINITE


def host_token(logits: np.ndarray, sampler: SamplerParams, graph_refuses_non_finite: bool) -> int | None:
    """What is decided on the host before a sampler draws from logits [vocab]: a greedy step's top-1
    (greedy_token); SAMPLER_NON_FINITE for non-finite logits, unless the sampler graph refuses them
    itself (Manifest.sampler_refuses_non_finite; older graphs and sample_token draw from them); else
    None: the sampler draws."""
    if sampler.greedy:
        return greedy_token(logits)
    if not graph_refuses_non_finite and not all_finite(logits):
        return SAMPLER_NON_FINITE
    return None
