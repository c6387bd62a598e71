"""The graph-building layer: `models.ops.Ops` on symbolic tensors, shared by the TFLite and ONNX emitters.

Composite operators (RMSNorm, RoPE, activations, fused projections, LoRA) are written here once in
terms of a handful of primitives; each emitter implements only the primitives, its weight storage
and its attention (the one place where the formats' KV-cache conventions differ).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from litekv.models.config import ModelConfig, RopeConfig

from .quantize import QuantPlan, int4_blockwise_asymmetric

LORA_TARGETS = ("q", "k", "v", "o")
MEMBERSHIP_MAX_BLOCKS = 64  # int4 block sums by matmul up to a [64, 2048] fp32 constant (512 KB)


@dataclass(frozen=True)
class Sym:
    """A symbolic tensor: a backend handle plus its static shape and dtype."""

    ref: Any
    shape: tuple[int, ...]
    dtype: str = "float32"
    rotary: RopeConfig | None = None  # RoPE an emitter deferred into its attention kernel

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Signature:
    """One entry point of a converted model.

    tokens: new tokens per call (T); capacity: KV slots it sees (S); lora: takes LoRA inputs;
    sampler: the standalone sampler (a decode's logits in, a token id out); logits: returns logits at all.
    """

    name: str
    tokens: int
    capacity: int
    lora: bool = False
    sampler: bool = False
    logits: bool = True


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    targets: tuple[str, ...] = LORA_TARGETS


def lora_input_names(layer: int, group: str) -> tuple[str, str]:
    return f"lora_a_{layer}_{group}", f"lora_b_{layer}_{group}"


class GraphOps(ABC):
    """Traces one signature of an architecture definition into a backend graph."""

    block_sums_by_matmul = True  # int4 block sums by a 0/1 membership matmul where it is small enough

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], plan: QuantPlan,
                 sig: Signature, lora: LoraSpec | None, rope_tables: Mapping[RopeConfig, tuple[np.ndarray, np.ndarray]],
                 quant_cache: dict | None = None):
        self.cfg = cfg
        self.quant_cache = {} if quant_cache is None else quant_cache  # shared by all signatures of a file
        self.weights = weights
        self.plan = plan
        self.sig = sig
        self.lora = lora if sig.lora else None
        self.rope_tables = rope_tables
        self.positions: Sym | None = None  # int32 [T], set by the emitter
        self.tokens: Sym | None = None  # int32 [1, T]
        self._rope_cache: dict[RopeConfig, tuple[Sym, Sym]] = {}
        # group name -> (parts of the fused projection, LoRA targets among them), for the manifest
        self.lora_groups: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    # ---- primitives every emitter implements -------------------------------------------------
    @abstractmethod
    def const(self, value: np.ndarray) -> Sym: ...

    @abstractmethod
    def binary(self, op: str, a: Sym, b: Sym) -> Sym:
        """op in add, sub, mul, div; numpy broadcasting."""

    @abstractmethod
    def unary(self, op: str, x: Sym) -> Sym:
        """op in rsqrt, tanh, sigmoid."""

    @abstractmethod
    def mean_last(self, x: Sym) -> Sym:
        """Mean over the last axis, kept as size 1."""

    @abstractmethod
    def reshape(self, x: Sym, shape: Sequence[int]) -> Sym: ...

    @abstractmethod
    def slice_last(self, x: Sym, start: int, size: int) -> Sym: ...

    @abstractmethod
    def concat_last(self, parts: Sequence[Sym]) -> Sym: ...

    @abstractmethod
    def gather_rows(self, table: str | np.ndarray, indices: Sym) -> Sym:
        """table[indices] for a weight name (stored once) or a constant array."""

    @abstractmethod
    def matmul_weight(self, x: Sym, weight: str, parts: Sequence[str]) -> Sym:
        """x [.., in] @ W^T where W stacks the canonical weights `parts` (stored once, quantized per plan)."""

    @abstractmethod
    def matmul_const(self, x: Sym, name: str, w: np.ndarray) -> Sym:
        """x [.., in] @ w^T for a small float32 constant w [out, in] stored once under `name`."""

    @abstractmethod
    def matmul_input(self, x: Sym, w: Sym) -> Sym:
        """x [.., in] @ w^T with w a graph input [out, in] (LoRA factors)."""

    @abstractmethod
    def lora_input(self, name: str, out_dim: int, in_dim: int) -> Sym:
        """A LoRA factor input for `matmul_input`, in the emitter's own layout (see LORA_LAYOUT)."""

    # ---- primitives for in-graph sampling (see sampling_graph) -----------------------------------
    @abstractmethod
    def int_op(self, op: str, a: Sym, b: Sym) -> Sym:
        """int32 add, sub, mul, div (floor; operands are non-negative), mod, min."""

    @abstractmethod
    def int_compare(self, op: str, a: Sym, b: Sym) -> Sym:
        """int32 le / lt -> int32 0 or 1."""

    @abstractmethod
    def float_compare(self, op: str, a: Sym, b: Sym) -> Sym:
        """float32 le / lt -> float32 0.0 or 1.0."""

    @abstractmethod
    def to_float(self, x: Sym) -> Sym: ...

    @abstractmethod
    def to_int(self, x: Sym) -> Sym: ...

    @abstractmethod
    def topk(self, x: Sym, k: int) -> tuple[Sym, Sym]:
        """Largest k along the last axis, sorted: (values float32, indices int32)."""

    @abstractmethod
    def softmax_last(self, x: Sym) -> Sym: ...

    @abstractmethod
    def cumsum_last(self, x: Sym) -> Sym: ...

    @abstractmethod
    def reduce_sum_last(self, x: Sym) -> Sym:
        """Sum over the last axis, kept as size 1."""

    @abstractmethod
    def gather_index(self, values: Sym, index: Sym) -> Sym:
        """values [1, k] int32 at index [1, 1] -> [1]."""

    # ---- models.ops.Ops --------------------------------------------------------------------------
    def add(self, a: Sym, b: Sym) -> Sym:
        return self.binary("add", a, b)

    def mul(self, a: Sym, b: Sym) -> Sym:
        return self.binary("mul", a, b)

    def scale(self, x: Sym, factor: float) -> Sym:
        return self.binary("mul", x, self.const(np.float32(factor)))

    def embed(self, name: str) -> Sym:
        return self.gather_rows(f"{name}.weight", self.tokens)

    def rms_norm(self, x: Sym, name: str, eps: float) -> Sym:
        ms = self.mean_last(self.binary("mul", x, x))
        inv = self.unary("rsqrt", self.binary("add", ms, self.const(np.float32(eps))))
        return self.binary("mul", self.binary("mul", x, inv), self.const_weight(f"{name}.weight"))

    def const_weight(self, name: str) -> Sym:
        """A small float32 weight (norms, biases) kept unquantized."""
        return self.const(np.asarray(self.weights[name], np.float32))

    def activation(self, x: Sym, kind: str) -> Sym:
        if kind == "silu":
            return self.binary("mul", x, self.unary("sigmoid", x))
        cube = self.binary("mul", self.binary("mul", x, x), x)
        inner = self.binary("add", x, self.binary("mul", cube, self.const(np.float32(0.044715))))
        t = self.unary("tanh", self.binary("mul", inner, self.const(np.float32(np.sqrt(2.0 / np.pi)))))
        half_x = self.binary("mul", x, self.const(np.float32(0.5)))
        return self.binary("add", half_x, self.binary("mul", half_x, t))

    def split_heads(self, x: Sym, num_heads: int, head_dim: int) -> Sym:
        return self.reshape(x, (*x.shape[:-1], num_heads, head_dim))

    def rope(self, x: Sym, rope: RopeConfig) -> Sym:
        if rope not in self._rope_cache:
            cos_table, sin_table = self.rope_tables[rope]
            steps, half = self.sig.tokens, cos_table.shape[1]
            self._rope_cache[rope] = tuple(  # type: ignore[assignment]
                self.reshape(self.gather_rows(table, self.positions), (1, steps, 1, half))
                for table in (cos_table, sin_table)
            )
        cos, sin = self._rope_cache[rope]
        half = x.shape[-1] // 2
        x1, x2 = self.slice_last(x, 0, half), self.slice_last(x, half, half)
        return self.concat_last([
            self.binary("sub", self.binary("mul", x1, cos), self.binary("mul", x2, sin)),
            self.binary("add", self.binary("mul", x2, cos), self.binary("mul", x1, sin)),
        ])

    def linear(self, x: Sym, name: str) -> Sym:
        return self.linears(x, (name,))[0]

    def stacked(self, parts: Sequence[str]) -> np.ndarray:
        return np.concatenate([np.asarray(self.weights[p], np.float32) for p in parts])

    def int4_weights(self, name: str, parts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q, fp16 scales, offsets) of an int4 weight, computed once per model file."""
        if name not in self.quant_cache:
            self.quant_cache[name] = int4_blockwise_asymmetric(self.stacked(parts), self.plan.block_size)
        return self.quant_cache[name]

    def project(self, x: Sym, name: str, parts: Sequence[str]) -> Sym:
        """x @ W^T in the plan's format; int4 adds its per-block offsets as sum_b offset[o, b] * sum(x in b)."""
        y = self.matmul_weight(x, name, parts)
        if self.plan.format_for(name) != "int4":
            return y
        offsets = self.int4_weights(name, parts)[2]
        return self.binary("add", y, self.block_offsets(self.block_sums(x), name, offsets))

    def block_sums(self, x: Sym) -> Sym:
        """The sums of x over each int4 block of its last axis: [.., width] -> [.., width / block]."""
        width, block = x.shape[-1], self.plan.block_size
        blocks = width // block
        if self.block_sums_by_matmul and blocks <= MEMBERSHIP_MAX_BLOCKS:
            # One matmul by a 0/1 block-membership matrix shared by every projection of this
            # width: one op instead of three, and a one-token step pays per op. The matrix is
            # blocks x width floats, so wide inputs use reshape + sum instead.
            membership = np.kron(np.eye(blocks, dtype=np.float32), np.ones((1, block), np.float32))
            return self.matmul_const(x, f"int4.block_sums.{width}.{block}", membership)
        grouped = self.reshape(x, (*x.shape[:-1], blocks, block))
        return self.reshape(self.reduce_sum_last(grouped), (*x.shape[:-1], blocks))

    def block_offsets(self, sums: Sym, name: str, offsets: np.ndarray) -> Sym:
        """The int4 offsets' share of a projection: sums [.., blocks] @ offsets[out, blocks]^T."""
        return self.matmul_const(sums, f"{name}.offsets", offsets)

    def linears(self, x: Sym, names: Sequence[str]) -> tuple[Sym, ...]:
        fused_name = "+".join(names)
        y = self.project(x, fused_name, [f"{n}.weight" for n in names])
        if any(f"{n}.bias" in self.weights for n in names):
            bias = np.concatenate([np.asarray(self.weights.get(f"{n}.bias", np.zeros(self.weights[f"{n}.weight"].shape[0])),
                                              np.float32) for n in names])
            y = self.binary("add", y, self.const(bias))
        y = self._with_lora(x, y, names)
        outs, start = [], 0
        for n in names:
            width = self.weights[f"{n}.weight"].shape[0]
            outs.append(y if len(names) == 1 else self.slice_last(y, start, width))
            start += width
        return tuple(outs)

    def _with_lora(self, x: Sym, y: Sym, names: Sequence[str]) -> Sym:
        """y + B (A x) for the LoRA targets of one fused projection, as two small matmuls.

        A stacks the targets' A factors [n*r, in]; B [out, n*r] is block-structured (the runtime
        fills each target's rows and columns, alpha / r folded in), so a group costs three ops.
        """
        if self.lora is None:
            return y
        parts = tuple(n.rsplit(".", 1)[1] for n in names)
        targets = tuple(t for t in parts if t in self.lora.targets)
        if not targets:
            return y
        group = "".join(targets)
        self.lora_groups[group] = (parts, targets)
        layer = int(names[0].split(".")[1])
        a_name, b_name = lora_input_names(layer, group)
        width = self.lora.rank * len(targets)
        a = self.lora_input(a_name, width, x.shape[-1])
        b = self.lora_input(b_name, y.shape[-1], width)
        return self.binary("add", y, self.matmul_input(self.matmul_input(x, a), b))

    def logits(self, x: Sym, name: str) -> Sym:
        if x.shape[1] != 1:  # only the last position's logits leave the graph
            x = self.last_row(x)
        return self.project(x, name, [f"{name}.weight"])

    @abstractmethod
    def last_row(self, x: Sym) -> Sym:
        """[B, T, H] -> [B, 1, H] (the last position)."""


def rope_tables(cfg: ModelConfig, max_context: int) -> dict[RopeConfig, tuple[np.ndarray, np.ndarray]]:
    """cos/sin [max_context, D/2] for every RoPE variant the model uses, computed like the reference."""
    tables = {}
    for layer in range(cfg.num_layers):
        rope = cfg.rope_for_layer(layer)
        if rope not in tables:
            angles = np.arange(max_context, dtype=np.float32)[:, None] * rope.inverse_frequencies(cfg.head_dim)[None]
            tables[rope] = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
    return tables
