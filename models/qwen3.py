"""Qwen3 (dense): the Llama block with RMSNorm on each query and key head before RoPE."""
from __future__ import annotations

from typing import Any, Mapping

from . import llama
from .base import ArchitectureSpec, register
from .config import ModelConfig
from .qwen2 import hf_layer_types

HF_NAMES = {
    **llama.HF_NAMES,
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm.weight",
}
GGUF_NAMES = {
    **llama.GGUF_NAMES,
    "blk.{i}.attn_q_norm.weight": "layers.{i}.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.k_norm.weight",
}


def config_from_hf(c: Mapping[str, Any], where: str) -> ModelConfig:
    llama.check_silu_mlp(c, where)
    return ModelConfig(**llama.hf_common(c, where, "qwen3", qk_norm=True, **hf_layer_types(c, where)))


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    return ModelConfig(**llama.gguf_common(meta, tensor_names, where, "qwen3", qk_norm=True))


SPEC = register(ArchitectureSpec(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    forward=llama.forward,
    hf_names=HF_NAMES,
    gguf_names=GGUF_NAMES,
))
