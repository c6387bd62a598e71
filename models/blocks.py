"""Attention and MLP blocks shared by the architectures that use them."""
from __future__ import annotations

from .config import ModelConfig
from .ops import Ops, Tensor


def attention_block(ops: Ops, cfg: ModelConfig, layer: int, h: Tensor) -> Tensor:
    """Self-attention of normalized hidden states h [B, T, H]: projections, optional q/k norms, RoPE."""
    p = f"layers.{layer}"
    q, k, v = ops.linears(h, (f"{p}.q", f"{p}.k", f"{p}.v"))
    q = ops.split_heads(q, cfg.num_heads, cfg.head_dim)
    k = ops.split_heads(k, cfg.num_kv_heads, cfg.head_dim)
    v = ops.split_heads(v, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = ops.rms_norm(q, f"{p}.q_norm", cfg.norm_eps)
        k = ops.rms_norm(k, f"{p}.k_norm", cfg.norm_eps)
    rope = cfg.rope_for_layer(layer)
    q, k = ops.rope(q, rope), ops.rope(k, rope)
    out = ops.attention(q, k, v, layer, cfg.window_for_layer(layer), cfg.attn_scale)
    return ops.linear(out, f"{p}.o")


def gated_mlp(ops: Ops, cfg: ModelConfig, layer: int, h: Tensor) -> Tensor:
    """down(act(gate(h)) * up(h)): SwiGLU for silu, GeGLU for gelu_tanh."""
    p = f"layers.{layer}"
    gate, up = ops.linears(h, (f"{p}.gate", f"{p}.up"))
    return ops.linear(ops.mul(ops.activation(gate, cfg.activation), up), f"{p}.down")
