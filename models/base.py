"""Architecture specs and their registry.

An architecture is one module that declares: how to read its config (Hugging Face or GGUF),
how checkpoint tensor names map to canonical names (with any per-tensor fix-ups), and its
forward pass written against `models.ops.Ops`. Loaders and emitters only talk to `ArchitectureSpec`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from litekv.errors import UnsupportedArchitecture
from .config import ModelConfig
from .ops import Ops, Tensor

# A transform receives (array, config) and returns the canonical array.
WeightTransform = Callable[[np.ndarray, ModelConfig], np.ndarray]


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig]
    config_from_gguf: Callable[[Mapping[str, Any], set[str], str], ModelConfig]
    forward: Callable[[Ops, ModelConfig], Tensor]
    # Name tables: checkpoint pattern (with `{i}` for the layer) -> canonical name.
    hf_names: Mapping[str, str]
    gguf_names: Mapping[str, str]
    # Canonical-name regex -> transform, applied after renaming.
    hf_transforms: Mapping[str, WeightTransform] = field(default_factory=dict)
    gguf_transforms: Mapping[str, WeightTransform] = field(default_factory=dict)

    def canonical_name(self, name: str, table: Mapping[str, str]) -> str | None:
        """Map one checkpoint tensor name to its canonical name, or None if the table has no entry."""
        for pattern, regex in _compiled(table):
            m = regex.fullmatch(name)
            if m:
                return table[pattern].format(**m.groupdict())
        return None

    def transform(self, canonical: str, array: np.ndarray, cfg: ModelConfig, gguf: bool) -> np.ndarray:
        for pattern, fn in (self.gguf_transforms if gguf else self.hf_transforms).items():
            if re.fullmatch(pattern, canonical):
                array = fn(array, cfg)
        return array


_PATTERN_CACHE: dict[int, list[tuple[str, re.Pattern[str]]]] = {}


def _compiled(table: Mapping[str, str]) -> list[tuple[str, re.Pattern[str]]]:
    key = id(table)
    if key not in _PATTERN_CACHE:
        _PATTERN_CACHE[key] = [
            (p, re.compile(re.escape(p).replace(re.escape("{i}"), r"(?P<i>\d+)"))) for p in table
        ]
    return _PATTERN_CACHE[key]


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight the config requires, with its shape ([out, in] for projections)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, h),
        "final_norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.attn_norm.weight": (h,),
            f"{p}.q.weight": (q_out, h),
            f"{p}.k.weight": (kv_out, h),
            f"{p}.v.weight": (kv_out, h),
            f"{p}.o.weight": (h, q_out),
            f"{p}.mlp_norm.weight": (h,),
            f"{p}.gate.weight": (cfg.intermediate_size, h),
            f"{p}.up.weight": (cfg.intermediate_size, h),
            f"{p}.down.weight": (h, cfg.intermediate_size),
        })
        if cfg.attention_bias:
            shapes.update({f"{p}.q.bias": (q_out,), f"{p}.k.bias": (kv_out,), f"{p}.v.bias": (kv_out,)})
        if cfg.qk_norm:
            shapes.update({f"{p}.q_norm.weight": (d,), f"{p}.k_norm.weight": (d,)})
        if cfg.sandwich_norms:
            shapes.update({f"{p}.post_attn_norm.weight": (h,), f"{p}.post_mlp_norm.weight": (h,)})
    return shapes


# ---- registry -------------------------------------------------------------------------------

_REGISTRY: dict[str, ArchitectureSpec] = {}


def register(spec: ArchitectureSpec) -> ArchitectureSpec:
    _REGISTRY[spec.name] = spec
    return spec


def _all() -> list[ArchitectureSpec]:
    # Importing the package registers every bundled architecture (no import-time side effects elsewhere).
    from . import registry  # noqa: F401

    return list(_REGISTRY.values())


def supported_names() -> list[str]:
    return sorted(s.name for s in _all())


def architecture(name: str) -> ArchitectureSpec:
    """The spec registered under its canonical name (as stored in bundle manifests)."""
    for spec in _all():
        if spec.name == name:
            return spec
    raise UnsupportedArchitecture(
        f"architecture {name!r} is not supported; litekv supports: {', '.join(supported_names())}."
    )


def for_hf_model_type(model_type: str, source: str) -> ArchitectureSpec:
    for spec in _all():
        if model_type in spec.hf_model_types:
            return spec
    raise UnsupportedArchitecture(
        f"{source}: model_type {model_type!r} is not supported; litekv supports: "
        f"{', '.join(t for s in _all() for t in s.hf_model_types)}."
    )


def for_gguf_architecture(arch: str, source: str) -> ArchitectureSpec:
    for spec in _all():
        if arch in spec.gguf_architectures:
            return spec
    raise UnsupportedArchitecture(
        f"{source}: GGUF architecture {arch!r} is not supported; litekv supports: "
        f"{', '.join(a for s in _all() for a in s.gguf_architectures)}."
    )
