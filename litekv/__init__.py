"""litekv: on-device LLM runtime with the KV cache as a first-class object.

    engine = litekv.Engine(bundle)
    session = engine.create_session(litekv.SamplerConfig(temperature=0.7, seed=1))
    print(session.generate_text("Hello!"))
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from litekv.engine import Conversation, Engine, GenerationChunk, SamplerConfig, Session
from litekv.errors import (AcceleratorUnavailable, Cancelled, CheckpointError, ConfigError, ContextFull,
                           LitekvError)
from litekv.kv_cache import KVCache

if TYPE_CHECKING:  # the converter needs litekv[convert]; imported when convert() runs
    from litekv.converters.convert import ConvertOptions

__version__ = "0.1.0"


def convert(source: str | Path, output: str | Path, *, options: ConvertOptions | None = None,
            **changes: Any) -> Path:
    """Convert a GGUF file or Hugging Face directory into a bundle (needs `litekv[convert]`).

    Keywords are the fields of `litekv.converters.convert.ConvertOptions`, the command line's flags by
    their Python names (backend, quantize, max_context, prefill_lengths, kv_cache, key_blocks,
    decode_attention, ...); an unknown one raises ConfigError listing them. `options`, if given, is the
    starting point the keywords change. Unset ones keep the converter's defaults: e.g. prefill_lengths
    are those of 32, 128, 512 that fit max_context."""
    from litekv.converters.convert import convert as run
    from litekv.converters.convert import convert_options

    return run(source, output, convert_options(options, **changes))


__all__ = ["Engine", "Session", "Conversation", "SamplerConfig", "GenerationChunk", "KVCache", "convert",
           "LitekvError", "ConfigError", "ContextFull", "Cancelled", "CheckpointError", "AcceleratorUnavailable"]
