"""Qwen2 / Qwen2.5: the Llama block with biases on the q, k and v projections."""
from __future__ import annotations

from typing import Any, Mapping

from . import llama
from .base import ArchitectureSpec, register
from .config import ModelConfig


def hf_layer_types(c: Mapping[str, Any]) -> dict[str, Any]:
    """Sliding-window layers as transformers lists them (only when the config enables them)."""
    kinds = c.get("layer_types")
    if not kinds or not c.get("use_sliding_window", True) or "sliding_attention" not in kinds:
        return {}
    return {
        "layer_types": tuple("sliding" if k == "sliding_attention" else "full" for k in kinds),
        "sliding_window": int(c["sliding_window"]),
    }


def config_from_hf(c: Mapping[str, Any], where: str) -> ModelConfig:
    return ModelConfig(**llama.hf_common(c, where, "qwen2", attention_bias=True, **hf_layer_types(c)))


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    return ModelConfig(**llama.gguf_common(meta, tensor_names, where, "qwen2"))


# llama.cpp stores Qwen q/k rows in rotate-half order already, so no GGUF transforms.
SPEC = register(ArchitectureSpec(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    forward=llama.forward,
    hf_names=llama.HF_NAMES,
    gguf_names=llama.GGUF_NAMES,
))
