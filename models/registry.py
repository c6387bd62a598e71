"""Imports every bundled architecture so each registers its spec."""
from . import gemma3, llama, qwen2, qwen3  # noqa: F401
