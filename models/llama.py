"""Llama family (Llama 2/3.x, SmolLM2): pre-norm blocks, RMSNorm, RoPE, GQA, SwiGLU."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from litekv.errors import ConfigError

from .base import ArchitectureSpec, register
from .blocks import attention_block, gated_mlp
from .config import ModelConfig, RopeConfig, as_id_tuple, bool_field, float_field, int_field, require
from .ops import Ops, Tensor

HF_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.v.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.v.bias",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.o.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down.weight",
}

GGUF_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.q.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.k.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.v.weight",
    "blk.{i}.attn_q.bias": "layers.{i}.q.bias",
    "blk.{i}.attn_k.bias": "layers.{i}.k.bias",
    "blk.{i}.attn_v.bias": "layers.{i}.v.bias",
    "blk.{i}.attn_output.weight": "layers.{i}.o.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.gate.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.up.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.down.weight",
}


def unpermute_rows(heads: int, w: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave (made for interleaved RoPE) -> rotate-half order."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


GGUF_TRANSFORMS = {
    r"layers\.\d+\.q\.(weight|bias)": lambda w, cfg: unpermute_rows(cfg.num_heads, w),
    r"layers\.\d+\.k\.(weight|bias)": lambda w, cfg: unpermute_rows(cfg.num_kv_heads, w),
}


def forward(ops: Ops, cfg: ModelConfig) -> Tensor:
    x = ops.embed("embed")
    for i in range(cfg.num_layers):
        x = ops.add(x, attention_block(ops, cfg, i, ops.rms_norm(x, f"layers.{i}.attn_norm", cfg.norm_eps)))
        x = ops.add(x, gated_mlp(ops, cfg, i, ops.rms_norm(x, f"layers.{i}.mlp_norm", cfg.norm_eps)))
    return ops.logits(ops.rms_norm(x, "final_norm", cfg.norm_eps), "lm_head")


def hf_common(c: Mapping[str, Any], where: str, architecture: str, **overrides: Any) -> dict[str, Any]:
    """Fields every Llama-like Hugging Face config shares, each checked for its type."""
    hidden = int_field(c, "hidden_size", where)
    heads = int_field(c, "num_attention_heads", where)
    max_position = int_field(c, "max_position_embeddings", where, 4096)
    rope_params = c.get("rope_parameters") or c.get("rope_scaling")
    fields: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=int_field(c, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=int_field(c, "intermediate_size", where),
        num_layers=int_field(c, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=int_field(c, "num_key_value_heads", where, heads),
        head_dim=int_field(c, "head_dim", where, hidden // heads),
        norm_eps=float_field(c, "rms_norm_eps", where, 1e-6),
        rope=RopeConfig.from_hf(rope_params, float_field(c, "rope_theta", where, 10000.0), where, max_position),
        max_position=max_position,
        tie_embeddings=bool_field(c, "tie_word_embeddings", where, False),
        attention_bias=bool_field(c, "attention_bias", where, False),
        bos_token_id=int_field(c, "bos_token_id", where, None, minimum=0),
        eos_token_ids=as_id_tuple(c.get("eos_token_id"), where),
    )
    fields.update(overrides)
    return fields


def check_silu_mlp(c: Mapping[str, Any], where: str) -> None:
    """Refuse what litekv's SwiGLU block would otherwise ignore."""
    if c.get("mlp_bias"):
        raise_unsupported(where, "mlp_bias=true")
    if c.get("hidden_act", "silu") != "silu":
        raise_unsupported(where, f"hidden_act={c.get('hidden_act')!r}")


def config_from_hf(c: Mapping[str, Any], where: str) -> ModelConfig:
    check_silu_mlp(c, where)
    return ModelConfig(**hf_common(c, where, "llama"))


def raise_unsupported(where: str, what: str) -> None:
    raise ConfigError(f"{where}: {what} is not supported by litekv's definition of this architecture.")


def gguf_common(meta: Mapping[str, Any], tensor_names: set[str], where: str, architecture: str,
                **overrides: Any) -> dict[str, Any]:
    """Fields every Llama-like GGUF shares; keys are prefixed with `general.architecture`."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        return require(meta, f"{arch}.{key}", where)

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        vocab = need("vocab_size")
    if get("rope.scaling.type") not in (None, "none"):
        kind = get("rope.scaling.type")
        rope = RopeConfig(theta=float(get("rope.freq_base", 10000.0)), kind=kind,
                          factor=float(get("rope.scaling.factor", 1.0)))
    else:
        rope = RopeConfig(theta=float(get("rope.freq_base", 10000.0)))
    if "rope_freqs.weight" in tensor_names:
        raise_unsupported(where, "a rope_freqs tensor (Llama 3.1 rope scaling in GGUF form); convert from the "
                                 "Hugging Face directory instead, which litekv reads with its rope_scaling")
    eos = [meta.get("tokenizer.ggml.eos_token_id")]
    if meta.get("tokenizer.ggml.eot_token_id") is not None:
        eos.append(meta["tokenizer.ggml.eot_token_id"])
    fields: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=int(get("attention.key_length") or hidden // heads),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        max_position=int(get("context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )
    fields.update(overrides)
    return fields


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    return ModelConfig(**gguf_common(meta, tensor_names, where, "llama"))


SPEC = register(ArchitectureSpec(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    forward=forward,
    hf_names=HF_NAMES,
    gguf_names=GGUF_NAMES,
    gguf_transforms=GGUF_TRANSFORMS,
))
