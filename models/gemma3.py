"""Gemma 3 (text): scaled embeddings, q/k norms, norms before and after attention and MLP,
GELU-tanh gating, sliding-window layers with their own RoPE base between global layers."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import llama
from .base import ArchitectureSpec, register
from .blocks import attention_block, gated_mlp
from .config import ModelConfig, RopeConfig, float_field, hf_layer_kinds, int_field
from .ops import Ops, Tensor

HF_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.o.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down.weight",
}

GGUF_NAMES = {
    **{k: v for k, v in llama.GGUF_NAMES.items() if "bias" not in k},
    "blk.{i}.attn_q_norm.weight": "layers.{i}.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attn_norm.weight",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_mlp_norm.weight",
}

# transformers stores Gemma norms as w and computes x * (1 + w); GGUF already holds 1 + w.
HF_TRANSFORMS = {r".*norm\.weight": lambda w, cfg: w + np.float32(1.0)}

GLOBAL_EVERY = 6  # Gemma 3's pattern: five sliding-window layers, then one global layer.
LOCAL_ROPE_THETA = 10000.0


def forward(ops: Ops, cfg: ModelConfig) -> Tensor:
    x = ops.scale(ops.embed("embed"), cfg.embed_scale)
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        attn = attention_block(ops, cfg, i, ops.rms_norm(x, f"{p}.attn_norm", cfg.norm_eps))
        x = ops.add(x, ops.rms_norm(attn, f"{p}.post_attn_norm", cfg.norm_eps))
        mlp = gated_mlp(ops, cfg, i, ops.rms_norm(x, f"{p}.mlp_norm", cfg.norm_eps))
        x = ops.add(x, ops.rms_norm(mlp, f"{p}.post_mlp_norm", cfg.norm_eps))
    return ops.logits(ops.rms_norm(x, "final_norm", cfg.norm_eps), "lm_head")


def default_layer_types(num_layers: int, pattern: int = GLOBAL_EVERY) -> tuple[str, ...]:
    """Every `pattern`-th layer global, the rest sliding (transformers' sliding_window_pattern)."""
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def gemma_fields(hidden: int, head_dim: int, query_pre_attn_scalar: float) -> dict[str, Any]:
    return dict(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=float(np.float32(hidden ** 0.5)),
        attn_scale=float(query_pre_attn_scalar) ** -0.5,
        tie_embeddings=True,
    )


def config_from_hf(c: Mapping[str, Any], where: str) -> ModelConfig:
    if c.get("model_type") == "gemma3" and "text_config" in c:
        c = {**c["text_config"], "model_type": "gemma3_text"}
    for softcap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(softcap):
            llama.raise_unsupported(where, f"{softcap}={c[softcap]}")
    if c.get("use_bidirectional_attention"):
        llama.raise_unsupported(where, "use_bidirectional_attention=true")
    if c.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):  # both tanh GELU
        llama.raise_unsupported(where, f"hidden_activation={c.get('hidden_activation')!r}")
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one RoPE dict per layer kind
        rope = RopeConfig.from_hf(params["full_attention"], 1_000_000.0, where)
        local = RopeConfig.from_hf(params.get("sliding_attention"), LOCAL_ROPE_THETA, where)
    else:  # transformers 4 files
        rope = RopeConfig.from_hf(c.get("rope_scaling"), float_field(c, "rope_theta", where, 1_000_000.0), where)
        local = RopeConfig(theta=float_field(c, "rope_local_base_freq", where, LOCAL_ROPE_THETA))
    num_layers = int_field(c, "num_hidden_layers", where)
    kinds = c.get("layer_types")
    layer_types = (hf_layer_kinds(kinds, where) if kinds is not None else
                   default_layer_types(num_layers, int_field(c, "sliding_window_pattern", where, GLOBAL_EVERY)))
    hidden = int_field(c, "hidden_size", where)
    head_dim = int_field(c, "head_dim", where, 256)
    fields = llama.hf_common(
        {**c, "head_dim": head_dim}, where, "gemma3",
        rope=rope, local_rope=local, layer_types=layer_types,
        sliding_window=int_field(c, "sliding_window", where, 4096),
        # transformers' Gemma3TextConfig defaults query_pre_attn_scalar to 256 whatever head_dim is
        **gemma_fields(hidden, head_dim, float_field(c, "query_pre_attn_scalar", where, 256.0)),
    )
    if fields["bos_token_id"] is None:
        fields["bos_token_id"] = 2
    return ModelConfig(**fields)


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    fields = llama.gguf_common(meta, tensor_names, where, "gemma3")
    num_layers, hidden, head_dim = fields["num_layers"], fields["hidden_size"], fields["head_dim"]
    fields.update(
        local_rope=RopeConfig(theta=LOCAL_ROPE_THETA),
        layer_types=default_layer_types(num_layers),
        sliding_window=int(meta.get("gemma3.attention.sliding_window", 512)),
        **gemma_fields(hidden, head_dim, head_dim),
    )
    return ModelConfig(**fields)


SPEC = register(ArchitectureSpec(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    gguf_architectures=("gemma3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    forward=forward,
    hf_names=HF_NAMES,
    gguf_names=GGUF_NAMES,
    hf_transforms=HF_TRANSFORMS,
))
