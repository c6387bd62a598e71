"""LoRA adapters in Hugging Face PEFT format, prepared as the converted model's LoRA inputs.

An adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules) and
`adapter_model.safetensors`. Each (layer, target) becomes A [rank, in] and B [out, rank] at the
model's converted rank: lower ranks are zero-padded and alpha / r is folded into B.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from litekv.errors import LitekvError
from litekv.models.config import ModelConfig
from litekv.safetensors_reader import SafetensorsFile

# PEFT module names -> our canonical projection names.
_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
_KEY = re.compile(r".*layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.lora_([AB])\.weight")


class LoraError(LitekvError):
    """A LoRA adapter is unreadable or does not fit the converted model."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the adapter's own rank (<= the model's)
    # (layer, target) -> (A [model_rank, in], B [out, model_rank] with alpha / r applied), float32
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of a projection."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (q_out, cfg.hidden_size), "k": (kv_out, cfg.hidden_size), "v": (kv_out, cfg.hidden_size),
            "o": (cfg.hidden_size, q_out)}[target]


def load_peft_adapter(path: str | Path, cfg: ModelConfig, model_rank: int, model_targets: tuple[str, ...],
                      name: str | None = None) -> LoraAdapter:
    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as e:
        raise LoraError(f"{config_path} is missing; a PEFT adapter directory needs adapter_config.json.") from e
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{config_path} cannot be read as JSON ({e}).") from e
    if not weights_path.exists():
        raise LoraError(f"{weights_path} is missing; save the adapter with safe_serialization=True.")
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if rank < 1:
        raise LoraError(f"{config_path}: r must be a positive integer.")
    if rank > model_rank:
        raise LoraError(f"{path}: adapter rank {rank} is higher than the model's LoRA rank {model_rank}; "
                        f"reconvert the model with --lora-rank {rank} or more.")
    if config.get("use_dora") or config.get("use_rslora"):
        raise LoraError(f"{path}: DoRA and rsLoRA adapters are not supported.")
    scale = np.float32(alpha / rank)
    tensors = SafetensorsFile(weights_path)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key in tensors.names():
        m = _KEY.fullmatch(key)
        if not m:
            raise LoraError(f"{weights_path}: tensor {key} is not a LoRA factor of q/k/v/o projections; "
                            f"this model's LoRA inputs cover {', '.join(model_targets)}.")
        layer, target, which = int(m.group(1)), _MODULES[m.group(2)], m.group(3)
        if target not in model_targets:
            raise LoraError(f"{path}: the adapter targets {m.group(2)}, but the model was converted with LoRA "
                            f"inputs only on {', '.join(model_targets)}.")
        if layer >= cfg.num_layers:
            raise LoraError(f"{path}: layer {layer} does not exist (the model has {cfg.num_layers}).")
        found.setdefault((layer, target), {})[which] = tensors.read(key)
    factors = {}
    for (layer, target), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{path}: layer {layer} {target} has only lora_{''.join(pair)}.")
        out_dim, in_dim = projection_shape(cfg, target)
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
            raise LoraError(f"{path}: layer {layer} {target} has A {a.shape} and B {b.shape}; expected "
                            f"A {(rank, in_dim)} and B {(out_dim, rank)}.")
        padded_a = np.zeros((model_rank, in_dim), np.float32)
        padded_b = np.zeros((out_dim, model_rank), np.float32)
        padded_a[:rank], padded_b[:, :rank] = a, b * scale
        factors[(layer, target)] = (padded_a, padded_b)
    if not factors:
        raise LoraError(f"{weights_path}: no LoRA factors found.")
    return LoraAdapter(name or path.name, rank, factors)

LORA_TARGETS_ALL = tuple(_MODULES.values())


def group_factors(adapter: LoraAdapter | None, cfg: ModelConfig, layer: int, parts: list[str], targets: list[str],
                  rank: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The stacked LoRA inputs of one fused projection (see converters.graph_ops._with_lora).

    A [len(targets) * rank, in] stacks each target's A; B [sum(out of parts), len(targets) * rank]
    holds each target's (scaled) B in its own rows and columns and zeros elsewhere. With
    layout "in_out" both come transposed. No adapter (or a target it lacks) gives zeros.
    """
    outs = [projection_shape(cfg, p)[0] for p in parts]
    in_dim = projection_shape(cfg, parts[0])[1]
    a = np.zeros((len(targets) * rank, in_dim), np.float32)
    b = np.zeros((sum(outs), len(targets) * rank), np.float32)
    for j, target in enumerate(targets):
        factors = adapter.factors.get((layer, target)) if adapter else None
        if factors is None:
            continue
        row = sum(outs[:parts.index(target)])
        a[j * rank:(j + 1) * rank] = factors[0]
        b[row:row + outs[parts.index(target)], j * rank:(j + 1) * rank] = factors[1]
    if layout == "in_out":
        return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    return a, b


def lora_inputs(adapter: LoraAdapter | None, cfg: ModelConfig, groups: dict[str, list[list[str]]], rank: int,
                layout: str) -> dict[str, np.ndarray]:
    """Every LoRA input of a converted model, by input name."""
    arrays = {}
    for layer in range(cfg.num_layers):
        for group, (parts, targets) in groups.items():
            a, b = group_factors(adapter, cfg, layer, parts, targets, rank, layout)
            arrays[f"lora_a_{layer}_{group}"], arrays[f"lora_b_{layer}_{group}"] = a, b
    return arrays
