"""Typed model configuration shared by every architecture and every backend.

Architectures build a `ModelConfig` from a Hugging Face `config.json` or from GGUF metadata;
emitters and executors only ever read this dataclass, never the raw checkpoint dicts.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from litekv.errors import ConfigError
from litekv.validation import is_int

log = logging.getLogger("litekv.config")

ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_KINDS = ("full", "sliding")
_REQUIRED: Any = object()  # a config field's default that means "the field must be present"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding (rotate-half convention) with optional frequency scaling."""

    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"RoPE scaling type {self.kind!r} is not supported; litekv supports default, linear and llama3."
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ConfigError(f"RoPE theta and factor must be positive, got theta={self.theta}, factor={self.factor}.")

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """float32 [head_dim // 2] inverse frequencies, scaling applied (as transformers computes them)."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
        inv = inv.astype(np.float32)
        if self.kind == "linear":
            inv = inv / np.float32(self.factor)
        elif self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, default_theta: float, where: str = "config.json",
                max_position: int | None = None) -> "RopeConfig":
        """Parse a transformers `rope_parameters` / legacy `rope_scaling` dict. The fields a scaling type
        needs must be present (transformers refuses such a config too), except llama3's
        original_max_position_embeddings, which defaults to `max_position` as in transformers 5."""
        if params is None:
            params = {}
        where = f"{where} rope_scaling"
        if not isinstance(params, Mapping):
            raise ConfigError(f"{where} must be an object such as {{\"rope_type\": \"linear\", \"factor\": 2.0}}, "
                              f"got {params!r}; fix config.json.")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ("default", "linear", "llama3"):
            raise ConfigError(f"{where}: RoPE scaling type {kind!r} is not supported; litekv supports default, linear "
                              "and llama3, so this model cannot be converted as it is.")
        llama3 = kind == "llama3"
        return cls(
            theta=float_field(params, "rope_theta", where, default_theta),
            kind=kind,
            factor=float_field(params, "factor", where, 1.0 if kind == "default" else _REQUIRED),
            low_freq_factor=float_field(params, "low_freq_factor", where, _REQUIRED if llama3 else 1.0),
            high_freq_factor=float_field(params, "high_freq_factor", where, _REQUIRED if llama3 else 4.0),
            original_max_position=int_field(params, "original_max_position_embeddings", where,
                                            (max_position or _REQUIRED) if llama3 else 8192),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and conventions of a decoder-only transformer.

    Weights use canonical names (see `models.base`); norm weights are stored *effective*
    (Gemma's 1 + w already folded in), so every backend computes `x * rsqrt(mean(x^2) + eps) * w`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0 means head_dim ** -0.5
    local_rope: RopeConfig | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{self.architecture} config: {name} must be a positive integer, got {value!r}.")
        if self.head_dim % 2:
            raise ConfigError(f"{self.architecture} config.head_dim must be even (rotary embeddings turn pairs of "
                              f"dimensions), got {self.head_dim}.")
        if is_int(self.bos_token_id) and self.bos_token_id >= self.vocab_size:
            raise ConfigError(f"{self.architecture} config.bos_token_id must be below vocab_size {self.vocab_size}, "
                              f"got {self.bos_token_id}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{self.architecture} config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})."
            )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"{self.architecture} config: activation {self.activation!r} is not one of {ACTIVATIONS}.")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_KINDS for t in self.layer_types):
            raise ConfigError(
                f"{self.architecture} config: layer_types must list {self.num_layers} entries from {LAYER_KINDS}."
            )
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ConfigError(f"{self.architecture} config: sliding layers need a positive sliding_window.")
        if self.attn_scale == 0.0:
            object.__setattr__(self, "attn_scale", self.head_dim ** -0.5)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding"

    def window_for_layer(self, layer: int) -> int | None:
        """Number of most recent positions a query may attend to, or None for global layers."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope_for_layer(self, layer: int) -> RopeConfig:
        if self.is_sliding(layer) and self.local_rope is not None:
            return self.local_rope
        return self.rope

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, stored in bundle manifests."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            if name == "extra":
                continue
            value = getattr(self, name)
            if isinstance(value, RopeConfig):
                value = dict(value.__dict__)
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict`; unknown keys are logged, not silently dropped."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "extra"}
        unknown = sorted(set(data) - set(known))
        if unknown:
            log.warning("ignoring unknown model config keys: %s", ", ".join(unknown))
        try:
            for key in ("rope", "local_rope"):
                if known.get(key) is not None:
                    known[key] = RopeConfig(**known[key])
            for key in ("layer_types", "eos_token_ids"):
                if key in known:
                    known[key] = tuple(known[key])
            return cls(**known)
        except TypeError as e:
            raise ConfigError(f"model config is incomplete or malformed: {e}") from e


def require(source: Mapping[str, Any], key: str, where: str) -> Any:
    """Fetch a required config field or raise a `ConfigError` naming it and the file."""
    if key not in source or source[key] is None:
        raise ConfigError(f"{where} is missing the required field {key!r}; re-export the checkpoint with it.")
    return source[key]


def int_field(source: Mapping[str, Any], key: str, where: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
    """A whole-number config field of at least `minimum` (`default` when absent or null). A fraction
    (8.0 is 8), a string or a bool is a `ConfigError`, never truncated or converted."""
    value = source.get(key)
    if value is None:
        return _absent(source, key, where, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{where}: {key} must be an integer of at least {minimum}, got {value!r}; fix config.json "
                          "or re-export the checkpoint.")
    return int(value)


def float_field(source: Mapping[str, Any], key: str, where: str, default: Any = _REQUIRED) -> Any:
    """A finite number config field (`default` when absent or null)."""
    value = source.get(key)
    if value is None:
        return _absent(source, key, where, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a finite number, got {value!r}; fix config.json or re-export "
                          "the checkpoint.")
    return float(value)


def bool_field(source: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """A true/false config field (`default` when absent or null); "false" as a string is refused, not true."""
    value = source.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}; fix config.json.")
    return value


def _absent(source: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    if default is _REQUIRED:
        require(source, key, where)  # raises: the field is missing or null
    return default


HF_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def hf_layer_kinds(kinds: Any, where: str) -> tuple[str, ...]:
    """transformers' layer_types ("full_attention" / "sliding_attention") as litekv's layer kinds."""
    known = isinstance(kinds, (list, tuple)) and all(isinstance(k, str) and k in HF_LAYER_KINDS for k in kinds)
    if not known or not kinds:
        raise ConfigError(f"{where}: layer_types must be a list of {' / '.join(HF_LAYER_KINDS)}, got {kinds!r}; "
                          "litekv supports no other kind of attention layer.")
    return tuple(HF_LAYER_KINDS[k] for k in kinds)


def as_id_tuple(value: Any, where: str = "config.json") -> tuple[int, ...]:
    """Token ids given as null, one id or a list of ids."""
    if value is None:
        return ()
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not all(is_int(v) and v >= 0 for v in ids):
        raise ConfigError(f"{where}: eos_token_id must be a token id or a list of token ids, got {value!r}; "
                          "fix config.json.")
    return tuple(int(v) for v in ids)
