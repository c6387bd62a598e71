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


class BackendError(LitekvError):
    """The inference backend (LiteRT) returned an error; ``status`` is its status code."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AcceleratorUnavailable(LitekvError):
    """The requested accelerator ("gpu", "npu", ...) cannot be used; ``reason`` says why.

    litekv never falls back to another accelerator silently: choose one explicitly.
    """

    def __init__(self, accelerator: str, reason: str):
        super().__init__(f"accelerator {accelerator!r} is unavailable: {reason}")
        self.accelerator = accelerator
        self.reason = reason


class BindingError(LitekvError, ValueError):
    """Buffers do not fit a model signature: an input or output is missing or unknown, or
    an array has the wrong shape or dtype, is not C-contiguous or not 64-byte aligned."""


class Cancelled(LitekvError):
    """The call was cancelled (e.g. ``cancel()`` from another thread) before it finished."""


class SessionFormatError(LitekvError):
    """A saved session is unreadable, damaged, from a newer litekv, or belongs to another model."""
