"""Every error a litekv user can meet.

Messages name the file or backend involved and say what to do next; causes are chained.
"""
from __future__ import annotations


class LitekvError(Exception):
    """Base class of all litekv errors."""


class CheckpointError(LitekvError):
    """A checkpoint (GGUF file or Hugging Face directory) is missing, unreadable or inconsistent."""


class CheckpointNotFound(CheckpointError):
    """The checkpoint path, or a file it needs, does not exist."""


class UnsupportedArchitecture(CheckpointError):
    """The checkpoint's architecture has no litekv definition."""


class UnsupportedTensorType(CheckpointError):
    """A GGUF tensor uses a quantization type litekv cannot dequantize."""


class WeightShapeMismatch(CheckpointError):
    """A weight's shape disagrees with the model config."""


class ConfigError(LitekvError):
    """A model config is missing required fields or has impossible values."""


class MissingDependency(LitekvError):
    """An optional dependency needed for this feature is not installed."""


class UnsupportedTokenizerError(LitekvError):
    """The checkpoint's tokenizer kind (GGUF `tokenizer.ggml.model` / `.pre`) has no litekv builder."""


class ChatTemplateError(LitekvError):
    """A chat template is missing, or rendering it failed."""


class ContextFull(LitekvError):
    """The KV cache has no room for the tokens of this call."""
