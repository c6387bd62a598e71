"""The operator vocabulary that architecture definitions are written in.

An architecture calls these methods and never learns which backend runs them: the numpy
reference executes them eagerly, the TFLite and ONNX emitters record graph nodes. Tensors are
opaque to the architecture. Shapes below: B batch, T new tokens, H hidden, N heads, D head dim.
"""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

from .config import RopeConfig

Tensor = TypeVar("Tensor")


class Ops(Protocol[Tensor]):
    def embed(self, name: str) -> Tensor:
        """Look up the call's input tokens in weight `name` [V, H] -> [B, T, H] float32."""

    def linear(self, x: Tensor, name: str) -> Tensor:
        """x [B, T, in] @ `name.weight`[out, in]^T (+ `name.bias` when the checkpoint has one) -> [B, T, out]."""

    def linears(self, x: Tensor, names: Sequence[str]) -> tuple[Tensor, ...]:
        """Several projections of the same input; backends may fuse them into one matmul."""

    def rms_norm(self, x: Tensor, name: str, eps: float) -> Tensor:
        """x * rsqrt(mean(x^2, last axis) + eps) * `name.weight` (effective weight, any rank)."""

    def add(self, a: Tensor, b: Tensor) -> Tensor: ...

    def mul(self, a: Tensor, b: Tensor) -> Tensor: ...

    def scale(self, x: Tensor, factor: float) -> Tensor: ...

    def activation(self, x: Tensor, kind: str) -> Tensor:
        """`silu` or `gelu_tanh`."""

    def split_heads(self, x: Tensor, num_heads: int, head_dim: int) -> Tensor:
        """[B, T, N*D] -> [B, T, N, D]."""

    def rope(self, x: Tensor, rope: RopeConfig) -> Tensor:
        """Rotate-half RoPE of [B, T, N, D] at the call's positions."""

    def attention(self, q: Tensor, k: Tensor, v: Tensor, layer: int, window: int | None, scale: float) -> Tensor:
        """Write k, v [B, T, KVH, D] into layer `layer`'s KV cache, attend causally (only the last
        `window` positions when given) with grouped-query heads; q [B, T, N, D] -> [B, T, N*D]."""

    def logits(self, x: Tensor, name: str) -> Tensor:
        """Final projection with `name.weight` [V, H]; backends may restrict it to the rows they need."""
