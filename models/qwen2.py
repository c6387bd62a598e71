"""Qwen2 / Qwen2.5: the Llama block with biases on the q, k and v projections."""
from __future__ import annotations

from typing import Any, Mapping

from litekv.errors import ConfigError

from . import llama
from .base import ArchitectureSpec, register
from .config import ModelConfig, bool_field, hf_layer_kinds, int_field


def hf_layer_types(c: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Sliding-window layers as transformers' Qwen2Config sets them: none unless use_sliding_window is
    true; then those layer_types lists, or without that list every layer from max_window_layers on."""
    kinds = c.get("layer_types")
    if not bool_field(c, "use_sliding_window", where, False):
        if kinds is not None and "sliding" in hf_layer_kinds(kinds, where):
            raise ConfigError(f"{where}: layer_types lists sliding_attention layers but use_sliding_window is not "
                              "true, so transformers gives them no window; fix config.json.")
        return {}
    window = int_field(c, "sliding_window", where, 4096)
    if kinds is None:
        first = int_field(c, "max_window_layers", where, 28, minimum=0)
        kinds = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(int_field(c, "num_hidden_layers", where))]
    return {"layer_types": hf_layer_kinds(kinds, where), "sliding_window": window}


def config_from_hf(c: Mapping[str, Any], where: str) -> ModelConfig:
    llama.check_silu_mlp(c, where)
    return ModelConfig(**llama.hf_common(c, where, "qwen2", attention_bias=True, **hf_layer_types(c, where)))


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
