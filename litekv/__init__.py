"""litekv: on-device LLM runtime with the KV cache as a first-class object.

    engine = litekv.Engine(bundle)
    session = engine.create_session(litekv.SamplerConfig(temperature=0.7, seed=1))
    print(session.generate_text("Hello!"))
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from litekv.engine import Conversation, Engine, GenerationChunk, SamplerConfig, Session
from litekv.errors import (AcceleratorUnavailable, Cancelled, CheckpointError, ConfigError, ContextFull,
                           LitekvError)
from litekv.kv_cache import KVCache

__version__ = "0.1.0"


def convert(source: str | Path, output: str | Path, backend: str = "litert", quantize: str = "fp32",
            max_context: int = 4096, prefill_lengths: Sequence[int] = (32, 128, 512),
            lora_rank: int | None = None, kv_cache: str | None = None) -> Path:
    """Convert a GGUF file or Hugging Face directory into a bundle (needs `litekv[convert]`).

    kv_cache: "fp32", "fp16", "int8" or "int8-row" (LiteRT); None takes the converter's default for these
    weights."""
    from litekv.converters.convert import ConvertOptions
    from litekv.converters.convert import convert as run

    options = ConvertOptions(backend=backend, quantize=quantize, max_context=max_context,
                             prefill_lengths=tuple(prefill_lengths), lora_rank=lora_rank, kv_cache=kv_cache)
    return run(source, output, options)


__all__ = ["Engine", "Session", "Conversation", "SamplerConfig", "GenerationChunk", "KVCache", "convert",
           "LitekvError", "ConfigError", "ContextFull", "Cancelled", "CheckpointError", "AcceleratorUnavailable"]
